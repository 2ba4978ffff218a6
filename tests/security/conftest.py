"""The attacker of ``tests/security``: a real unprivileged user made with ``useradd``.

The agent runs as root and training jobs run as ordinary users, so every attack in
``test_attacks.py`` is replayed by such a user (``runuser``/``setpriv`` to drop to it), and the
agent runs as root in the test process or as a child of it. Skips, with the reason, only where
that cannot be done here: not root, no ``useradd``/``userdel``, neither ``runuser`` nor
``setpriv``, no Python interpreter the new user may run.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Attacker:
    """A real unprivileged user; ``run``/``popen`` start programs as it (no supplementary
    groups, its own uid and gid), ``python`` is an interpreter it may execute with the
    checkout on its ``PYTHONPATH`` (so it can ``import node_agent.heartbeat`` as a job does)."""

    name: str
    uid: int
    gid: int
    drop: list[str]  # argv prefix that runs the rest as the user
    python: str
    children: list[subprocess.Popen] = field(default_factory=list)

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": "/",
            "LANG": "C.UTF-8",
            "PYTHONPATH": str(REPO),
            **(extra or {}),
        }

    def run(
        self,
        argv: list[str],
        env: dict[str, str] | None = None,
        timeout: float = 60,
        check: bool = True,
    ) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [*self.drop, *argv],
            env=self.env(env),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd="/",
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"as {self.name}: {argv} exited {done.returncode}: {done.stderr[-2000:]}"
            )
        return done

    def py(
        self,
        code: str,
        *args: str,
        env: dict[str, str] | None = None,
        timeout: float = 60,
        check: bool = True,
    ) -> subprocess.CompletedProcess:
        """Run Python ``code`` as the user (``sys.argv[1:]`` = ``args``)."""
        return self.run([self.python, "-c", code, *args], env=env, timeout=timeout, check=check)

    def popen(self, code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """A long-lived Python process of the user; it must print one line when ready."""
        child = subprocess.Popen(
            [*self.drop, self.python, "-c", code, *args],
            env=self.env(env),
            stdout=subprocess.PIPE,
            text=True,
            cwd="/",
        )
        self.children.append(child)
        child.first_line = child.stdout.readline().strip()
        if not child.first_line:
            raise AssertionError(f"{self.name}'s process did not start")
        return child

    def stop_children(self) -> None:
        """Kill (by pid) what ``popen`` started and reap it."""
        for child in self.children:
            with contextlib.suppress(OSError):
                child.kill()
            child.wait()
            child.stdout.close()
        self.children.clear()


def new_system_user(label: str) -> str:
    """A new system user ``na-<label>-<8 hex>``: its own group, no home, no login shell. The
    test is skipped, saying why, when useradd refuses."""
    name = f"na-{label}-{uuid.uuid4().hex[:8]}"
    made = subprocess.run(
        [
            "useradd",
            "--system",
            "--no-create-home",
            "--user-group",
            "--shell",
            "/usr/sbin/nologin",
            name,
        ],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"useradd {name} failed: {made.stderr.strip()}")
    return name


def _drop_prefix(user: str, uid: int, gid: int) -> list[str] | None:
    if shutil.which("setpriv"):
        return [
            "setpriv",
            f"--reuid={uid}",
            f"--regid={gid}",
            "--clear-groups",
            "--inh-caps=-all",
            "--",
        ]
    if shutil.which("runuser"):
        return ["runuser", "-u", user, "--"]
    return None


def _usable_python(prefix: list[str]) -> str | None:
    """This interpreter if the user may run it (a venv under /root is not), else a system
    python3 of the same version (the checkout's heartbeat/spool modules are stdlib-only)."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (sys.executable, shutil.which(version), shutil.which("python3")):
        if not candidate:
            continue
        probe = subprocess.run(
            [*prefix, candidate, "-c", "import sys; print(sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=60,
            env={"PATH": "/usr/bin:/bin"},
            cwd="/",
        )
        if probe.returncode == 0 and probe.stdout.strip() == str(tuple(sys.version_info[:2])):
            return candidate
    return None


@pytest.fixture(scope="session")
def attacker():
    if os.geteuid() != 0:
        pytest.skip(
            "the security tests need root: they create a user with useradd and run "
            "the agent as root against it"
        )
    if not (shutil.which("useradd") and shutil.which("userdel")):
        pytest.skip("useradd/userdel are not installed (Debian package passwd)")
    name = new_system_user("attk")
    try:
        entry = pwd.getpwnam(name)
        prefix = _drop_prefix(name, entry.pw_uid, entry.pw_gid)
        if prefix is None:
            pytest.skip(
                "neither setpriv nor runuser is installed (util-linux): cannot run "
                "anything as the unprivileged user"
            )
        python = _usable_python(prefix)
        if python is None:
            pytest.skip(
                f"no Python {sys.version_info.major}.{sys.version_info.minor} that "
                f"user {name} may execute ({sys.executable} is not reachable for it)"
            )
        yield Attacker(name, entry.pw_uid, entry.pw_gid, prefix, python)
    finally:
        subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture
def victim(attacker):
    """A second unprivileged user, made like the attacker: the one whose files or processes
    the attacker tries to block or hide."""
    name = new_system_user("vict")
    entry = pwd.getpwnam(name)
    drop = _drop_prefix(name, entry.pw_uid, entry.pw_gid)
    assert drop is not None  # the attacker was made with the same tools
    who = Attacker(name, entry.pw_uid, entry.pw_gid, drop, attacker.python)
    try:
        yield who
    finally:
        who.stop_children()
        subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture
def user(attacker):
    """The session's attacker, with the processes a test started for it killed afterwards."""
    try:
        yield attacker
    finally:
        attacker.stop_children()


@pytest.fixture
def shared_dir():
    """A directory under /tmp that the attacker can reach (pytest's tmp_path is root's, 0700):
    0755 and root's, like /var; the tests make their spools (1777) and state dirs in it."""
    path = Path(tempfile.mkdtemp(prefix="na-security-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        for mounted in sorted((p for p in path.rglob("*") if p.is_mount()), reverse=True):
            subprocess.run(["umount", "-l", str(mounted)], capture_output=True)
        with contextlib.suppress(OSError):
            shutil.rmtree(path)


@pytest.fixture
def attack_dir(shared_dir, user):
    """A directory in ``shared_dir`` that the attacker owns."""
    """A directory the user owns, where its files are named."""
    path = shared_dir / "user-files"
    path.mkdir()
    os.chown(path, user.uid, user.gid)
    return path


@pytest.fixture
def node(shared_dir):
    """Root's agent on this host (real mode, no --simulate): its config, and the kernel log
    it reads (root's file, 0644: records appended to it are what the kernel logged)."""
    kernel_log = shared_dir / "kmsg-records.txt"
    kernel_log.write_text("")
    kernel_log.chmod(0o644)
    config = shared_dir / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "state_dir": str(shared_dir / "state"),
                "spool_dir": str(shared_dir / "spool"),
                "kernel_log": {"path": str(kernel_log)},
            }
        )
    )
    return config, kernel_log
