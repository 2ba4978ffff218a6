"""A real, throwaway Slurm cluster on loopback for integration tests.

Starts Debian's ``munged``, ``slurmctld`` and ``slurmd`` (packages munge, slurmctld, slurmd,
slurm-client; ``scripts/install-test-system-deps`` installs them) in the foreground (``-D``)
as children of the test process, with everything they write under one temporary directory:

* a fresh munge key and a private munge socket (``AuthInfo=socket=...``), so the host's own
  munge, if any, is neither used nor disturbed;
* a generated ``slurm.conf`` with free TCP ports on 127.0.0.1, ``ProctrackType=proctrack/linuxproc``,
  ``TaskPlugin=task/none`` and no cgroups (the sandbox has none to give);
* one real node (``NODE``, served by the slurmd started here with ``-N``) and
  ``FAKE_NODES`` that no slurmd serves: Slurm lists them (``down*`` once the controller gives up
  on them), so blast-radius tests have a partition with more than one node.

No ``RebootProgram`` is configured: a real reboot cannot happen in a test, and the adapter's
documented behaviour for that case (see docs/schedulers.md) is what the tests exercise.

Client commands find the cluster through ``SLURM_CONF``: use :meth:`SlurmCluster.env` or
:meth:`SlurmCluster.run`. Teardown kills exactly the PIDs started here.

Batch jobs run for real on the one node (``sbatch`` as root, ``CPUs=1``: one job at a time;
:meth:`SlurmCluster.submit`, :meth:`SlurmCluster.show_job`); :func:`reset_cluster` cancels
every job a test left behind, so a requeued job cannot start again during a later test.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("munge", "slurmctld", "slurmd", "slurm-client")
PROGRAMS = ("munged", "slurmctld", "slurmd", "scontrol", "sinfo", "squeue", "sbatch", "scancel")
NODE = "na-node1"
FAKE_NODES = ("na-fake1", "na-fake2", "na-fake3")
PARTITION = "gpu"
START_TIMEOUT_S = 60.0


def missing_reason() -> str | None:
    """Why a real Slurm cannot be started here, or None when it can."""
    missing = [
        p for p in PROGRAMS if shutil.which(p) is None and not Path(f"/usr/sbin/{p}").exists()
    ]
    if missing:
        return (
            "real Slurm not available: missing "
            + ", ".join(missing)
            + f"; install Debian packages {' '.join(PACKAGES)} "
            "(scripts/install-test-system-deps, as root)"
        )
    if os.geteuid() != 0:
        # slurmd must run as root to serve a node (it setuid()s to job users); munged as
        # root needs --force. A non-root run cannot start the daemons.
        return "real Slurm needs root to run slurmd; run the integration tests as root"
    return None


def _program(name: str) -> str:
    found = shutil.which(name)
    return found or f"/usr/sbin/{name}"


def _free_ports(count: int) -> list[int]:
    socks, ports = [], []
    for _ in range(count):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


@dataclass
class SlurmCluster:
    root: Path
    node: str = NODE
    fake_nodes: tuple[str, ...] = FAKE_NODES
    partition: str = PARTITION
    reboot_program: str | None = None  # None: Slurm cannot reboot (the CI default)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket.2"

    @property
    def all_nodes(self) -> tuple[str, ...]:
        return (self.node, *self.fake_nodes)

    def env(self) -> dict[str, str]:
        """Environment for Slurm client commands (scontrol, sinfo) that talk to this cluster."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def run(
        self, *argv: str, check: bool = True, timeout: float = 30
    ) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster (test-side checks)."""
        proc = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, env=self.env()
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr}")
        return proc

    def drain(self, reason: str, node: str | None = None) -> None:
        """Drain ``node`` (default: the real one) with ``reason``, as an admin by hand, or an
        earlier agent run, would."""
        self.run(
            "scontrol", "update", f"NodeName={node or self.node}", "State=DRAIN", f"Reason={reason}"
        )

    def show_node(self, node: str | None = None) -> dict[str, str]:
        """``scontrol show node -o NODE`` as a dict of its Key=Value fields."""
        out = self.run("scontrol", "show", "node", "-o", node or self.node).stdout
        return parse_fields(out.strip())

    def submit(self, *sbatch_args: str, wrap: str = "sleep 300") -> str:
        """``sbatch --parsable ... --wrap WRAP``; returns the job id. Output goes nowhere.

        Waits first for the node to be plain ``IDLE``: a RESUME (an earlier test's drain undone
        by reset_cluster) makes slurmctld mark the node ``IDLE+NOT_RESPONDING`` (``idle*``) until
        it has pinged it again, which takes up to ~11 s here; a job submitted meanwhile stays
        PENDING ("Nodes required for job are DOWN, DRAINED ...") until the main scheduler's
        next periodic pass (measured: more than 30 s) instead of starting within ~3 s.
        """
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.show_node().get("State") != "IDLE":
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"node {self.node} not IDLE and responding: {self.show_node()}\n{self.logs()}"
                )
            time.sleep(0.2)
        out = self.run(
            "sbatch",
            "--parsable",
            "--output=/dev/null",
            f"--chdir={self.root}",
            *sbatch_args,
            "--wrap",
            wrap,
        ).stdout.strip()
        return out.split(";")[0]

    def show_job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o JOB`` as a dict (Reason= is mid-line for jobs, not last)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout.strip()
        return {m.group(1): m.group(2).strip() for m in _FIELD_RE.finditer(out)}

    def wait_job(self, job_id: str, state: str, timeout_s: float = 30.0) -> dict[str, str]:
        """Wait until the job is in ``state`` (e.g. RUNNING); returns its fields."""
        deadline = time.monotonic() + timeout_s
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            fields = self.show_job(job_id)
            if fields.get("JobState") == state:
                return fields
            time.sleep(0.2)
        raise AssertionError(
            f"job {job_id} not {state} after {timeout_s:.0f} s: {fields}\n{self.logs()}"
        )

    def sinfo_reasons(self) -> str:
        """``sinfo -R`` as printed: the drained/down nodes with their reasons."""
        return self.run("sinfo", "-R", "--noheader", "-o", "%N|%T|%E").stdout

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        (self.root / "munge").mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        (self.root / "state").mkdir(exist_ok=True)
        (self.root / "spool").mkdir(exist_ok=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        os.chmod(key, 0o600)
        ctld_port, slurmd_port, fake_port = _free_ports(3)
        self.conf.write_text(self._slurm_conf(ctld_port, slurmd_port, fake_port))
        try:
            self._spawn(
                "munged",
                [
                    _program("munged"),
                    "--foreground",
                    "--force",
                    f"--socket={self.munge_socket}",
                    f"--key-file={key}",
                    f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                    f"--log-file={self.root / 'munge' / 'munged.log'}",
                    f"--seed-file={self.root / 'munge' / 'munged.seed'}",
                ],
            )
            self._wait(lambda: self.munge_socket.exists(), "munged socket", "munged")
            self._spawn("slurmctld", [_program("slurmctld"), "-D", "-i", "-f", str(self.conf)])
            self._wait(self._ctld_answers, "slurmctld to answer `scontrol ping`", "slurmctld")
            self._spawn("slurmd", [_program("slurmd"), "-D", "-N", self.node, "-f", str(self.conf)])
            self._wait(self._node_idle, f"node {self.node} to be IDLE", "slurmd")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Kill the daemons started here, by PID, last started first."""
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def logs(self) -> str:
        """The tail of each daemon's log, for a failure message."""
        parts = []
        for name in ("munge/munged.log", "slurmctld.log", f"slurmd-{self.node}.log"):
            path = self.root / name
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-15:]
                parts.append(f"--- {path}\n" + "\n".join(tail))
        return "\n".join(parts)

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / f"{name}.stdout", "wb")  # noqa: SIM115 - lives as long as the daemon
        self.procs[name] = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env(),
            start_new_session=True,
        )
        log.close()

    def _wait(self, ready, what: str, daemon: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            proc = self.procs[daemon]
            if proc.poll() is not None:
                out = (self.root / f"{daemon}.stdout").read_text(errors="replace")[-2000:]
                raise RuntimeError(
                    f"{daemon} exited {proc.returncode} while waiting for {what}:\n"
                    f"{out}\n{self.logs()}"
                )
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(
            f"timed out after {START_TIMEOUT_S:.0f} s waiting for {what}\n{self.logs()}"
        )

    def _ctld_answers(self) -> bool:
        proc = self.run("scontrol", "ping", check=False, timeout=10)
        return proc.returncode == 0 and "UP" in proc.stdout

    def _node_idle(self) -> bool:
        proc = self.run("scontrol", "show", "node", "-o", self.node, check=False, timeout=10)
        state = parse_fields(proc.stdout.strip()).get("State", "")
        return proc.returncode == 0 and state.split("+")[0] == "IDLE"

    def _slurm_conf(self, ctld_port: int, slurmd_port: int, fake_port: int) -> str:
        r = self.root
        fakes = ",".join(self.fake_nodes)
        # A reboot that never comes back would turn the node DOWN after ResumeTimeout.
        reboot = (
            f"RebootProgram={self.reboot_program}\nResumeTimeout=3600\n"
            if self.reboot_program
            else ""
        )
        return f"""\
# Generated by tests/slurm_cluster.py: a one-host test cluster on loopback.
ClusterName=nodeagent-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
StateSaveLocation={r / "state"}
SlurmdSpoolDir={r / "spool"}/%n
SlurmctldPidFile={r / "slurmctld.pid"}
SlurmdPidFile={r / "slurmd"}-%n.pid
SlurmctldLogFile={r / "slurmctld.log"}
SlurmdLogFile={r / "slurmd"}-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmdTimeout=300
PlugStackConfig=/dev/null
{reboot}NodeName={self.node} NodeHostname=localhost NodeAddr=127.0.0.1 CPUs=1 RealMemory=100 State=UNKNOWN
# Nodes no slurmd serves (an unused port): listed by Slurm, for share-of-drained tests.
NodeName={fakes} NodeHostname=localhost NodeAddr=127.0.0.1 Port={fake_port} CPUs=1 RealMemory=100 State=UNKNOWN
PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


_FIELD_RE = re.compile(r"(\S+?)=(.*?)(?=\s+\S+?=|$)")


def parse_fields(line: str) -> dict[str, str]:
    """``Key=Value Key2=Value with spaces`` (one ``scontrol show -o`` record) -> dict.

    ``Reason=`` is the last field and runs to the end of the line (it may hold ``=``).
    """
    head, sep, reason = line.partition(" Reason=")
    fields = {m.group(1): m.group(2).strip() for m in _FIELD_RE.finditer(head)}
    if sep:
        fields["Reason"] = reason.strip()
    return fields


def start_cluster(root: Path, reboot_program: str | None = None) -> SlurmCluster:
    cluster = SlurmCluster(root=root, reboot_program=reboot_program)
    cluster.start()
    return cluster


def reset_cluster(cluster: SlurmCluster) -> None:
    """Undo what a test did: cancel every job, resume every drained/failed node, cancel reboot
    requests."""
    jobs = cluster.run("squeue", "--noheader", "--format=%A", check=False).stdout.split()
    if jobs:
        cluster.run("scancel", *jobs, check=False)
        deadline = time.monotonic() + 30
        while (
            time.monotonic() < deadline
            and cluster.run("squeue", "--noheader", "--format=%A", check=False).stdout.strip()
        ):
            time.sleep(0.2)
    for line in cluster.run("scontrol", "show", "node", "-o").stdout.splitlines():
        fields = parse_fields(line.partition(" Reason=")[0])
        name, state = fields.get("NodeName"), fields.get("State", "")
        if not name:
            continue
        if "REBOOT_REQUESTED" in state:
            cluster.run("scontrol", "cancel_reboot", name, check=False)
        if any(flag in state for flag in ("DRAIN", "FAIL")):
            # Slurm resumes a never-registered (UNKNOWN) node but still answers "Invalid node
            # state specified"; the state read back is what counts.
            cluster.run("scontrol", "update", f"NodeName={name}", "State=RESUME", check=False)
