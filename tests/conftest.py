"""Shared fixtures: run the real ``node-agent`` entry point, write scenarios and configs.

No test reads this host's kernel log (``owned_kernel_log``): a host that ever logged an Xid, or
a user's fake one, would otherwise grade every test's agent FAULT.

Under CI (``CI`` set), a test that skips because ``../shared/realworld`` is absent fails
instead (the hooks of ``tests/realworld_ci.py``, loaded here for every test).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

import slurm_cluster as _slurm  # noqa: E402  (tests/slurm_cluster.py)
import tmpfs_tmpdir  # noqa: E402  (tests/tmpfs_tmpdir.py)
from preloaded_agent import Invocation, Zygote  # noqa: E402  (tests/preloaded_agent.py)

# hooks: pytest finds them by name in this module
from realworld_ci import pytest_make_collect_report, pytest_runtest_makereport  # noqa: E402, F401

REPO = Path(__file__).resolve().parents[1]
#: the directory on a tmpfs that the run's TMPDIR names, where the controller made one
TMPFS_RUN = pytest.StashKey[Path | None]()


@pytest.hookimpl(tryfirst=True)  # before pytest's tmp_path plugin reads --basetemp
def pytest_configure(config: pytest.Config) -> None:
    """Let every process of the run write the bytecode of what it imports, and put its
    temporary files on a tmpfs where the host has one (tests/tmpfs_tmpdir.py says why).

    Where ``PYTHONDONTWRITEBYTECODE`` is set (as on some CI hosts) no process writes a ``.pyc``,
    and every ``node-agent``, rank and stand-in a test starts (hundreds in ``make test``)
    compiled its modules from source again: the agent's, and the dependencies' that the
    installer left uncompiled (``make deps-test`` installs without compiling, so that only the
    modules a test imports are ever compiled, once). Set by the xdist controller (or the only
    process) before its workers start, so they and every child inherit it. Python checks each
    ``.pyc`` against its source, and writes it atomically beside it, so processes that import
    a module at once still read whole files."""
    if hasattr(config, "workerinput"):
        return  # a worker: the controller's environment, already without the variable
    sys.dont_write_bytecode = False
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    run = config.stash[TMPFS_RUN] = tmpfs_tmpdir.use_tmpfs()
    if run is not None and config.option.basetemp is None:
        # tmp_path there too, shorter than /tmp/pytest-of-root/pytest-N: the sockets tests
        # make under it stay within AF_UNIX's 107 bytes
        config.option.basetemp = str(run / "p")


def pytest_unconfigure(config: pytest.Config) -> None:
    run = config.stash.get(TMPFS_RUN, None)
    if run is not None:
        tmpfs_tmpdir.remove(run)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under ``--dist loadgroup`` (``make test``), a test of an ``xdist_group`` that pytest-xdist
    did not group fails before it starts: it would run beside the rest of its group on another
    worker, racing for what the group keeps to one (the Slurm test cluster, users made with
    fixed names, one expensive shared run). pytest 9.2 drops xdist's group suffix from the
    nodeid (pytest-dev/pytest-xdist#1386)."""
    if not getattr(item.config.option, "loadgroup", False):
        return  # not an xdist worker under --dist loadgroup (xdist sets the option there)
    nodeid = item.nodeid
    if item.get_closest_marker("xdist_group") and "@" not in nodeid[nodeid.rfind("]") + 1 :]:
        pytest.fail(
            "pytest-xdist did not group this xdist_group test: this pytest and pytest-xdist do "
            "not work together under --dist loadgroup (pytest-dev/pytest-xdist#1386); install "
            "the pytest that pyproject.toml's dev extra names (make test does)",
            pytrace=False,
        )


#: the environment variable the agent reads its kernel log from where a config leaves
#: ``kernel_log.path`` null (node_agent.environment.KERNEL_LOG_ENV)
KERNEL_LOG_ENV = "NODE_AGENT_KERNEL_LOG"
HOST_KERNEL_LOGS = ("/dev/kmsg",)


@pytest.fixture(autouse=True)
def umask_of_the_worker():
    """Each test ends with the umask it started with. ``node-agent``'s ``main`` sets the agent's
    umask (077); a test that calls it in-process left it on the xdist worker, and a later test
    that made directories as root for another user (the delegated cgroup attack) made them 0700,
    which that user could not enter."""
    before = os.umask(0o022)
    os.umask(before)
    yield
    os.umask(before)


@pytest.fixture(autouse=True)
def owned_kernel_log(tmp_path_factory, monkeypatch):
    """Every test's agent reads a kernel log the test owns: an empty file, root's, 0644.

    - Subprocess agents (``node-agent ...`` with any ``--config``, the daemon) inherit
      ``NODE_AGENT_KERNEL_LOG`` pointing at it; a config that names ``kernel_log.path`` itself
      still wins, so a test that writes lines into a log of its own keeps it.
    - In this process, opening the host's ``/dev/kmsg`` or running ``journalctl`` through the
      agent's readers fails the test (a test that means to read kmsg records builds them).

    A test appends lines to the returned path to give its agent a kernel log.
    """
    from node_agent import kernel_log

    # apart from the test's tmp_path, which some tests expect to hold only what they made
    path = tmp_path_factory.mktemp("kernel-log") / "owned-kernel-log.txt"
    path.write_text("")
    path.chmod(0o644)
    monkeypatch.setenv(KERNEL_LOG_ENV, str(path))

    def refuse(what):
        pytest.fail(
            f"a test's agent read the host's kernel log ({what}); give it a log of its "
            f"own (config kernel_log.path, or the owned_kernel_log fixture)"
        )

    def kmsg_read(self):
        if self.path in HOST_KERNEL_LOGS:
            refuse(self.path)
        return real_kmsg_read(self)

    def follower_init(self, path="/dev/kmsg"):
        if path in HOST_KERNEL_LOGS:
            refuse(path)
        real_follower_init(self, path)

    real_kmsg_read = kernel_log.KmsgKernelLog.read
    real_follower_init = kernel_log.KmsgFollower.__init__
    monkeypatch.setattr(kernel_log.KmsgKernelLog, "read", kmsg_read)
    monkeypatch.setattr(kernel_log.KmsgFollower, "__init__", follower_init)
    monkeypatch.setattr(kernel_log.JournalKernelLog, "read", lambda self: refuse("journalctl -k"))
    return path


#: how long a test's ``node-agent`` may run before it counts as hung: a bound on a hang, not on
#: speed (``make test`` runs several xdist workers per core, and a full simulated delivery run
#: takes over 40 s on one idle core of a small machine)
AGENT_TIMEOUT_S = 240.0  # under the 300 s a whole test may take (pyproject.toml)


@dataclass
class Run:
    code: int
    stdout: str
    stderr: str

    def json(self):
        return json.loads(self.stdout)


def agent_args(args: tuple[str, ...], home: Path) -> list[str]:
    """``args``, where ``accept``, ``check``, ``inventory`` and ``grade`` have no ``--config``
    with one added that keeps its state in ``home``."""
    if "--config" not in args and args and args[0] in ("accept", "check", "inventory", "grade"):
        config = home / "agent-config.yaml"
        if not config.exists():
            config.write_text(yaml.safe_dump({"state_dir": str(home / "state")}))
        return [*args, "--config", str(config)]
    return list(args)


def run_agent(zygote: Zygote, args: tuple[str, ...], home: Path, timeout: float, env=None) -> Run:
    """``node-agent ARGS`` (``agent_args``) run in ``home`` with ``env`` (by default this
    process's environment), a fork of ``zygote``."""
    inv = Invocation(agent_args(args, home), dict(os.environ if env is None else env), home, "-c")
    [(code, out, err)] = zygote.run([inv], timeout)
    return Run(code, out, err)


@pytest.fixture(scope="session")
def agent_zygote(tmp_path_factory):
    """This worker's zygote (tests/preloaded_agent.py, which says what its forks do not show):
    an interpreter that imported torch, every command and every check once. Each test's
    ``node-agent`` is a fork of it, not a fresh interpreter importing them again (hundreds of
    runs in ``make test``). Started at first use, and again if a run's timeout killed it."""
    holder: dict[str, Zygote] = {}
    base = tmp_path_factory.mktemp("zygote")

    def get() -> Zygote:
        if "z" not in holder or not holder["z"].alive:
            holder["z"] = Zygote(base / f"z{len(list(base.iterdir()))}")
        return holder["z"]

    yield get
    if "z" in holder:
        holder["z"].close()


@pytest.fixture
def agent(tmp_path, agent_zygote):
    """Run ``node-agent ARGS`` in ``tmp_path``: ``main(argv)`` as the console script runs it, in
    a process of its own (its environment, working directory, stdout and stderr) forked from
    this worker's zygote (``agent_zygote``)."""

    def run(*args: str, timeout: float = AGENT_TIMEOUT_S) -> Run:
        return run_agent(agent_zygote(), args, tmp_path, timeout)

    return run


@dataclass
class ModuleAgent:
    """``agent`` for a module-scoped fixture (one run several tests read): runs in ``home``,
    its agent reading a kernel log of its own there, as ``owned_kernel_log`` gives each test's
    (function fixtures, that one included, start after a module's)."""

    home: Path
    zygote: Callable[[], Zygote]  # agent_zygote

    def __call__(self, *args: str, timeout: float = AGENT_TIMEOUT_S) -> Run:
        log = self.home / "owned-kernel-log.txt"
        if not log.exists():
            log.write_text("")
            log.chmod(0o644)
        env = {**os.environ, KERNEL_LOG_ENV: str(log)}
        return run_agent(self.zygote(), args, self.home, timeout, env)


@pytest.fixture(scope="module")
def module_agent(tmp_path_factory, agent_zygote) -> ModuleAgent:
    return ModuleAgent(tmp_path_factory.mktemp("module-agent"), agent_zygote)


@pytest.fixture(scope="session")
def healthy_delivery(tmp_path_factory, agent_zygote) -> Run:
    """One ``node-agent accept`` of a healthy simulated H100 node (8 GPUs) with every check of
    the shipped delivery suite, as the tests run it (``tests/delivery_suite.py``), ``--json``.

    A whole delivery run is one of the dearest things the tests do (the burn alone starts 8
    torch workers), so the tests that assert different things on a healthy node's delivery
    read this one run: ``test_cli_simulated`` its grade, ``test_burn_simulated`` the burn's
    figures and load traces. They carry ``delivery_suite.HEALTHY_DELIVERY``, one xdist group,
    so ``make test`` runs it once."""
    from delivery_suite import PATIENT_AGENT_TIMEOUT_S, delivery_suite

    agent = ModuleAgent(tmp_path_factory.mktemp("healthy-delivery"), agent_zygote)
    node = agent.home / "healthy-h100.yaml"
    node.write_text(yaml.safe_dump({"sku": "h100-sxm5-80gb", "gpus": 8, "faults": []}))
    suite = delivery_suite(agent.home)
    return agent(
        "accept", "--simulate", str(node), "--suite", suite, "--json",
        timeout=PATIENT_AGENT_TIMEOUT_S,
    )  # fmt: skip


@pytest.fixture
def scenario(tmp_path):
    """Write a scenario file: ``scenario(faults=[...], gpus=8, sku=...)`` -> its path."""
    counter = iter(range(1000))

    def make(faults=(), gpus=8, sku="h100-sxm5-80gb", **extra) -> str:
        path = tmp_path / f"scenario-{next(counter)}.yaml"
        path.write_text(yaml.safe_dump({"sku": sku, "gpus": gpus, "faults": list(faults), **extra}))
        return str(path)

    return make


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """A real munge + slurmctld + slurmd on loopback for this test module (tests/slurm_cluster.py).

    Client commands reach it through ``SLURM_CONF``: use ``slurm_cluster.env()``. Skips, with
    the reason, only where Slurm cannot run here (packages missing, not root).
    """
    reason = _slurm.missing_reason()
    if reason:
        pytest.skip(reason)
    cluster = _slurm.start_cluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def slurm(slurm_cluster):
    """The module's Slurm cluster with every node back in service before the test."""
    _slurm.reset_cluster(slurm_cluster)
    return slurm_cluster
