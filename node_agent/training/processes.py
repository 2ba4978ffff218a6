"""Training processes on this node: which they are, who they are, which GPUs they use.

Three sources, merged by pid (``TrainingProcess.sources``):

- ``heartbeat``: the live writers of ``<spool_dir>/heartbeat/<uid>/<pid>.json`` (each uid's
  own directory; files of the older layout, ``heartbeat/<pid>.json``, too:
  ``node_agent.heartbeat``);
- ``nvml``: the compute processes NVML lists on each GPU
  (``nvidia-smi --query-compute-apps=pid``), which also gives each process's GPUs;
- ``pid``: pids the caller names (then only those are returned).

A process's rank and job come from its environment (``/proc/<pid>/environ``), parsed exactly as
the heartbeat writer parses its own (``heartbeat.identity_from_env``). Reading another user's
environ needs root or ``CAP_SYS_PTRACE``; without it a trusted heartbeat's claims stand in.

The environment is the user's to set, so a job may be *acted on* (``job_verified``) only when
the kernel agrees: a Slurm job id must be the one slurmd's cgroup holds the process in
(``read_slurm_cgroup_job``: a ``job_<id>`` directory directly under one of slurmd's cgroup
roots, every directory from the job's up to that root owned by root, so a user's delegated
cgroup subtree cannot pose as one), and a Kubernetes pod must be the pod whose UID the kubepods
cgroup names (``read_pod_uid``; the adapter compares that UID with the pod it is about to
delete). A verified Slurm job travels as ``slurm:<id>@uid:<uid>``, the process's uid, which the
Slurm adapter compares with the job's owner before it requeues anything. A torchelastic run id,
a launcher's pid or a heartbeat's label has no such witness and is never acted on
(docs/security.md).

Heartbeat spools are writable by every training user, so a heartbeat file speaks only for a
process whose uid owns the file: root's file for root's processes, nobody for anyone else.
Nothing here raises for a process that exits mid-way (it is dropped) or for a failing NVML
query (a problem per GPU).

Example::

    found = discover(Path("/var/spool/node-agent/heartbeat"), gpus=backend.devices())
    for p in found.processes:
        print(p.pid, p.rank, p.job, p.gpus)
    for subject, message in found.problems:
        log.warning("%s: %s", subject, message)
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
import stat
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from node_agent.atomic_file import ensure_user_spool
from node_agent.gpu.base import GpuDevice, GpuError
from node_agent.heartbeat import (
    SpoolFile,
    check_log_file,
    identity_from_env,
    process_start_ticks,
    read_heartbeat_files,
)

HEARTBEAT, NVML, PID = "heartbeat", "nvml", "pid"
_SOURCES = (HEARTBEAT, NVML, PID)
_CMDLINE_ARGS = 20
_CMDLINE_ARG_CHARS = 200
_MAX_ANCESTORS = 64  # a guard against a ppid loop read mid-change; real trees are a few deep
_IDENTITY_KEYS = ("rank", "local_rank", "world_size", "job", "job_source", "slurm_job_id", "pod")
_PRIVILEGE_ADVICE = "run the agent as root or with CAP_SYS_PTRACE"


@dataclass
class TrainingProcess:
    """One training process, as found; ``None`` means "not known", never "zero"."""

    pid: int
    start_ticks: int | None  # /proc/<pid>/stat field 22: clock ticks since boot
    uid: int | None  # effective uid (the owner of files it creates)
    cmdline: list[str]  # the first 20 arguments, each cut to 200 characters
    rank: int | None  # RANK
    local_rank: int | None  # LOCAL_RANK
    world_size: int | None  # WORLD_SIZE
    job: str | None  # slurm:<id> | torchelastic:<id> | pod:<name> | ppid:<pid>
    job_source: str | None  # slurm | torchelastic | pod | ppid | argument (heartbeat)
    slurm_job_id: str | None
    pod: str | None  # Kubernetes pod name
    pod_namespace: str | None  # POD_NAMESPACE or KUBERNETES_NAMESPACE, when a pod
    identity_source: str  # "environ" | "heartbeat" | "none"
    gpus: tuple[int, ...]  # GPU indices NVML lists the pid on
    heartbeat: dict[str, Any] | None  # its heartbeat record (heartbeat.read_heartbeats)
    heartbeat_path: str | None
    log_file: str | None  # NODE_AGENT_TRAIN_LOG, else the heartbeat's "log_file"
    parents: list[int]  # ancestor pids, nearest first, pid 1 left out
    children: list[int]  # direct children (dataloader workers, ...)
    sources: tuple[str, ...]  # subset of ("heartbeat", "nvml", "pid"): how it was found
    slurm_cgroup_job: str | None = None  # the Slurm job id in /proc/<pid>/cgroup (slurmd's)
    pod_uid: str | None = None  # the pod UID in /proc/<pid>/cgroup (the kubelet's kubepods)

    @property
    def job_verified(self) -> bool:
        """The job may be acted on: it comes from the process's own environment (not from a
        heartbeat's claim or a label) and the kernel vouches for it: a Slurm job id is the one
        slurmd's cgroup holds the process in; a pod is one the kubepods cgroup names by UID
        (an environment variable is the user's to set; the cgroup is not)."""
        if self.identity_source != "environ":
            return False
        if self.job_source == "slurm":
            # the uid travels with the job to the adapter, which compares it with the job's owner
            return (
                self.slurm_cgroup_job is not None
                and self.uid is not None
                and self.slurm_cgroup_job == self.slurm_job_id
            )
        if self.job_source == "pod":
            return self.pod_uid is not None
        return False  # torchelastic, ppid, argument: nothing but the user's word

    @property
    def restart_job_id(self) -> str | None:
        """The job id an adapter may restart: a pod's carries the UID from the kernel
        (``pod:<ns>/<name>@<uid>``), which the Kubernetes adapter checks against the pod it
        deletes; a Slurm job's carries the process's uid (``slurm:<id>@uid:<uid>``), which the
        Slurm adapter checks against the job's owner; None when the job is not verified."""
        if not self.job_verified or self.job is None:
            return None
        if self.job_source == "pod":
            return f"{self.job}@{self.pod_uid}"
        if self.job_source == "slurm":
            return f"{self.job}@uid:{self.uid}"
        return self.job

    def to_evidence(self) -> dict[str, Any]:
        """JSON-friendly fields for a result's evidence: the heartbeat record is left out (its
        step data is reported on its own) and the command line is one string."""
        return {
            "pid": self.pid,
            "start_ticks": self.start_ticks,
            "uid": self.uid,
            "cmdline": " ".join(self.cmdline),
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "job": self.job,
            "job_source": self.job_source,
            "slurm_job_id": self.slurm_job_id,
            "pod": self.pod,
            "pod_namespace": self.pod_namespace,
            "identity_source": self.identity_source,
            "gpus": list(self.gpus),
            "heartbeat_path": self.heartbeat_path,
            "log_file": self.log_file,
            "parents": list(self.parents),
            "children": list(self.children),
            "sources": list(self.sources),
            "slurm_cgroup_job": self.slurm_cgroup_job,
            "pod_uid": self.pod_uid,
            "job_verified": self.job_verified,
        }


@dataclass
class Discovery:
    """What :func:`discover` found.

    ``problems`` are ``(subject, message)``: subject ``pid:<n>`` (an untrusted heartbeat, an
    unknown identity, a pid NVML lists but /proc does not show) or ``gpu:<k>`` (NVML could not
    list its processes); each message names the pid or GPU and what to do. ``bad_files`` are
    ``(path, reason)`` for spool files that are not heartbeats (a link, a FIFO, too big, a
    wrong type): skipped, for the caller to report once. ``dead_heartbeats`` are files whose
    writer exited or whose pid now belongs to another process (safe to remove once old).
    """

    processes: list[TrainingProcess] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)
    dead_heartbeats: list[Path] = field(default_factory=list)
    bad_files: list[tuple[Path, str]] = field(default_factory=list)


# -- /proc readings -------------------------------------------------------------------------------


def alive(
    pid: int, expected_start_ticks: int | None = None, proc_root: Path = Path("/proc")
) -> bool:
    """The process runs: ``pid`` exists, is not a zombie, and (where both are known) started at
    ``expected_start_ticks`` — so a reused pid is not taken for the process that wrote a
    heartbeat. ``alive(rec["pid"], rec.get("start_ticks"))`` checks a heartbeat's writer."""
    if pid <= 0:
        return False
    try:
        if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return False
    except (psutil.NoSuchProcess, ValueError):
        return False
    except psutil.AccessDenied:
        pass  # it exists; we may not read its state
    now = process_start_ticks(pid, proc_root)
    return expected_start_ticks is None or now is None or int(expected_start_ticks) == now


def read_environ(pid: int, proc_root: Path = Path("/proc")) -> dict[str, str]:
    """``<proc_root>/<pid>/environ`` as a dict (the environment the process started with).

    Raises PermissionError for another user's process without root/CAP_SYS_PTRACE, and
    FileNotFoundError/ProcessLookupError when the process is gone."""
    data = (proc_root / str(pid) / "environ").read_bytes()
    env = {}
    for item in data.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


#: The cgroup directories slurmd puts jobs in, as path patterns (``*`` stands for the rest of
#: one path component, never for a ``/``). A job is the ``job_<id>`` directory directly below
#: one (``uid_<uid>/job_<id>`` under cgroup v1), and only when that directory, every one between
#: it and the root, and the root itself are owned by root. Slurm's docs (cgroup_v2.html,
#: "slurmd startup" and "Hierarchy overview"; cgroups.html):
#:
#: - cgroup/v2: slurmd starts a systemd scope ``slurmstepd.scope`` (``<node>_slurmstepd.scope``
#:   when built with --enable-multiple-slurmd) under ``system.slice``, or under the slice
#:   slurmd's own unit runs in; jobs are ``<scope>/job_<id>/step_<n>/user/task_<n>``.
#: - cgroup/v1: ``/sys/fs/cgroup/<controller>/slurm/uid_<uid>/job_<id>/step_<n>/task_<n>``
#:   (``slurm_<node>`` with several slurmds on one host); the uid level must name the process's
#:   own uid.
#:
#: ``training.slurm_cgroup_roots`` in the config replaces this list (docs/training_hangs.md).
DEFAULT_SLURM_CGROUP_ROOTS = (
    "/sys/fs/cgroup/system.slice/slurmstepd.scope",
    "/sys/fs/cgroup/*.slice/slurmstepd.scope",
    "/sys/fs/cgroup/*.slice/*_slurmstepd.scope",
    "/sys/fs/cgroup/*/slurm",
    "/sys/fs/cgroup/*/slurm_*",
)
#: where the kernel's cgroup hierarchies are mounted: cgroup v2 at the top (or at ``unified``
#: on a hybrid host), each v1 hierarchy at its controller list (``cpu,cpuacct``, ``systemd``)
CGROUP_FS = Path("/sys/fs/cgroup")
_JOB_DIR = re.compile(r"job_(\d+)")
_UID_DIR = re.compile(r"uid_(\d+)")


def _cgroup_dirs(line: str, cgroup_fs: Path) -> list[Path]:
    """The directories one ``/proc/<pid>/cgroup`` line may name (``id:controllers:path``)."""
    hier, sep, rest = line.partition(":")
    controllers, sep2, path = rest.partition(":")
    if not (sep and sep2 and path.startswith("/")):
        return []
    parts = [p for p in path.split("/") if p]
    if any(p in (".", "..") for p in parts):  # another cgroup namespace's view: not ours to read
        return []
    if hier == "0" and not controllers:  # the unified (v2) hierarchy
        mounts = [cgroup_fs, cgroup_fs / "unified"]
    else:
        mounts = [cgroup_fs / controllers.removeprefix("name=")]
    return [m.joinpath(*parts) for m in mounts]


def _root_owned_dirs(dirs: Iterable[Path]) -> str | None:
    """None when each of ``dirs`` is a real directory (not a link) owned by root, else why."""
    for d in dirs:
        try:
            st = os.lstat(d)
        except OSError as err:
            return f"{d}: {err.strerror or err}"
        if not stat.S_ISDIR(st.st_mode):
            return f"{d} is not a directory"
        if st.st_uid != 0:
            return f"{d} is owned by uid {st.st_uid}, not root"
    return None


def slurm_job_of_cgroup(path: Path, roots: Sequence[str], uid: int | None) -> str | None:
    """The Slurm job id of the cgroup directory ``path`` when it lies in a job of slurmd's (see
    :data:`DEFAULT_SLURM_CGROUP_ROOTS`), else None. ``uid``: the process's uid, which a v1
    ``uid_<uid>`` level must name."""
    parts = path.parts
    for pattern in roots:
        root = Path(pattern).parts
        if len(parts) <= len(root) or not all(
            fnmatch.fnmatchcase(have, want)
            for have, want in zip(parts[: len(root)], root, strict=True)
        ):
            continue
        depth = len(root)
        level = _UID_DIR.fullmatch(parts[depth])
        if level is not None:
            if uid is None or int(level.group(1)) != uid:
                continue  # another user's uid level: not this process's job
            depth += 1
        job = _JOB_DIR.fullmatch(parts[depth]) if depth < len(parts) else None
        if job is None:
            continue
        chain = [Path(*parts[:n]) for n in range(depth + 1, len(root) - 1, -1)]
        if _root_owned_dirs(chain) is None:
            return job.group(1)
    return None


def read_slurm_cgroup_job(
    pid: int,
    proc_root: Path = Path("/proc"),
    *,
    uid: int | None = None,
    roots: Sequence[str] | None = None,
    cgroup_fs: Path = CGROUP_FS,
) -> str | None:
    """The job id of the Slurm cgroup holding ``pid``, from ``<proc_root>/<pid>/cgroup``; None
    outside one, or when the hierarchies disagree.

    Only a ``job_<id>`` directly below one of slurmd's cgroup roots (``roots``, default
    :data:`DEFAULT_SLURM_CGROUP_ROOTS`) counts, and only when the directories from the job's
    up to that root are root's: a user may make ``job_4242`` inside the cgroup subtree systemd
    delegates to it (``user@<uid>.service``), but that subtree is the user's own. ``uid`` is
    the process's uid (a cgroup v1 ``uid_<uid>`` level must name it); ``cgroup_fs`` is where
    the hierarchies are mounted."""
    try:
        text = (proc_root / str(pid) / "cgroup").read_text(errors="replace")
    except OSError:
        return None
    patterns = DEFAULT_SLURM_CGROUP_ROOTS if roots is None else tuple(roots)
    jobs = set()
    for line in text.splitlines():
        for d in _cgroup_dirs(line.strip(), cgroup_fs):
            job = slurm_job_of_cgroup(d, patterns, uid)
            if job is not None:
                jobs.add(job)
                break
    return jobs.pop() if len(jobs) == 1 else None


_UUID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
# the pod's own cgroup, as the kubelet names it: ``pod<uid>`` (cgroupfs driver) or
# ``kubepods[-<qos>]-pod<uid_with_underscores>.slice`` (systemd driver)
_POD_DIR = re.compile(rf"^(?:kubepods-(?:besteffort-|burstable-)?)?pod({_UUID})(?:\.slice)?$")
# what may stand above it: the kubepods root and a QoS class, in either driver's naming
_KUBEPODS_ROOT = ("kubepods", "kubepods.slice")
_QOS_DIRS = ("besteffort", "burstable", "kubepods-besteffort.slice", "kubepods-burstable.slice")


def _pod_uid_of_path(path: str) -> str | None:
    parts = [p for p in path.split("/") if p]
    relative = False
    while parts and parts[0] == "..":  # the agent in a cgroup namespace sees others relative
        parts.pop(0)
        relative = True
    if parts and parts[0] in _KUBEPODS_ROOT:
        parts.pop(0)
    elif not relative:
        return None  # an absolute path that is not under kubepods: not a pod's process
    if parts and parts[0] in _QOS_DIRS:
        parts.pop(0)
    match = _POD_DIR.match(parts[0]) if parts else None
    return match.group(1).replace("_", "-") if match else None


def read_pod_uid(pid: int, proc_root: Path = Path("/proc")) -> str | None:
    """The UID of the Kubernetes pod holding ``pid``, from ``<proc_root>/<pid>/cgroup`` (the
    kubepods cgroup the kubelet made for the pod, cgroup v1 or v2, cgroupfs or systemd
    driver), or None outside a pod.

    Only a path that *starts* in kubepods counts (a user with a delegated cgroup subtree can
    name a sub-cgroup ``kubepods-pod<uid>.slice`` under it, but not above it), and every
    hierarchy that names a pod must name the same one."""
    try:
        text = (proc_root / str(pid) / "cgroup").read_text(errors="replace")
    except OSError:
        return None
    uids = {
        uid
        for line in text.splitlines()
        if (uid := _pod_uid_of_path(line.split(":", 2)[-1])) is not None
    }
    return uids.pop() if len(uids) == 1 else None


def read_cmdline(pid: int, proc_root: Path = Path("/proc")) -> list[str]:
    """The first 20 arguments of ``<proc_root>/<pid>/cmdline``, each cut to 200 characters;
    [] when unreadable."""
    try:
        data = (proc_root / str(pid) / "cmdline").read_bytes()
    except OSError:
        return []
    args = data.rstrip(b"\0").split(b"\0") if data else []
    return [a.decode(errors="replace")[:_CMDLINE_ARG_CHARS] for a in args[:_CMDLINE_ARGS]]


# -- discovery ------------------------------------------------------------------------------------


def discover(
    spool_dir: Path,
    gpus: Sequence[GpuDevice] | None = None,
    pids: Sequence[int] | None = None,
    proc_root: Path = Path("/proc"),
    *,
    slurm_cgroup_roots: Sequence[str] | None = None,
    cgroup_fs: Path = CGROUP_FS,
    make_user_dirs: bool | None = None,
) -> Discovery:
    """Find this node's training processes (see the module docstring).

    ``spool_dir``: the heartbeat spool; ``gpus``: devices whose NVML compute processes count as
    training processes; ``pids``: when given, exactly these pids are reported (heartbeats and
    NVML still add their record and GPUs). ``proc_root`` is read for environ, cmdline and stat.
    ``dead_heartbeats`` and unreadable spool files cover the whole spool, ``pids`` or not.
    ``slurm_cgroup_roots`` (config ``training.slurm_cgroup_roots``; None: the built-in
    :data:`DEFAULT_SLURM_CGROUP_ROOTS`) and ``cgroup_fs`` say where slurmd's job cgroups are.
    ``make_user_dirs`` (default: when the agent runs as root): make each uid that runs a GPU
    process, or writes heartbeats outside its own directory, its own heartbeat directory
    (``atomic_file.ensure_user_spool``), taking back a name another user squatted; what was
    wrong is a problem naming the squatter's uid.
    """
    out = Discovery()
    wanted = None if pids is None else list(dict.fromkeys(int(p) for p in pids))
    live = _live_heartbeats(spool_dir, out, proc_root)
    beats = _trusted_heartbeats(live, wanted, out.problems)
    on_gpus = _nvml_pids(gpus or [], out.problems)
    candidates = sorted(set(beats) | set(on_gpus)) if wanted is None else list(wanted)
    _drop_invisible(candidates, on_gpus, gpus or [], proc_root, out.problems)
    if make_user_dirs if make_user_dirs is not None else os.geteuid() == 0:
        _make_user_dirs(Path(spool_dir), on_gpus, live, out.problems)
    tree = _ProcessTree()
    cgroups = _CgroupReading(slurm_cgroup_roots, cgroup_fs)
    for pid in candidates:
        sources = tuple(
            s
            for s, hit in (
                (HEARTBEAT, pid in beats),
                (NVML, pid in on_gpus),
                (PID, wanted is not None),
            )
            if hit
        )
        found = _inspect(
            pid,
            sources,
            beats.get(pid),
            on_gpus.get(pid, ()),
            tree,
            proc_root,
            out.problems,
            cgroups,
        )
        if found is not None:
            out.processes.append(found)
        elif wanted is not None:
            out.problems.append(
                (
                    f"pid:{pid}",
                    f"pid {pid} was asked for but is not running "
                    "(or is a zombie): nothing to inspect",
                )
            )
    return out


def _live_heartbeats(
    spool_dir: Path, out: Discovery, proc_root: Path
) -> dict[int, list[SpoolFile]]:
    """pid -> the spool's heartbeat files of that live process; those of exited processes go
    to ``out.dead_heartbeats``, unreadable ones to ``out.bad_files``."""
    live: dict[int, list[SpoolFile]] = {}
    for beat in read_heartbeat_files(spool_dir, out.bad_files, proc_root=proc_root):
        pid = beat.data["pid"]
        if alive(pid, beat.data.get("start_ticks"), proc_root):
            live.setdefault(pid, []).append(beat)
        else:
            out.dead_heartbeats.append(beat.path)
    return live


def _trusted_heartbeats(
    live: dict[int, list[SpoolFile]],
    wanted: list[int] | None,
    problems: list[tuple[str, str]],
) -> dict[int, tuple[Path, dict[str, Any]]]:
    """pid -> the heartbeat believed for it (its writer's own), of the pids ``wanted``."""
    beats: dict[int, tuple[Path, dict[str, Any]]] = {}
    for pid, entries in live.items():
        if wanted is not None and pid not in wanted:
            continue
        try:
            uid = _effective_uid(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue  # exited since it was seen alive
        picked = _trusted_heartbeat(pid, uid, entries, problems)
        if picked is not None:
            beats[pid] = picked
    return beats


@dataclass(frozen=True)
class _CgroupReading:
    """Where :func:`read_slurm_cgroup_job` looks (see :func:`discover`)."""

    roots: Sequence[str] | None
    cgroup_fs: Path


def _make_user_dirs(
    spool_dir: Path,
    on_gpus: dict[int, set[int]],
    live: dict[int, list[SpoolFile]],
    problems: list[tuple[str, str]],
) -> None:
    """Each uid that runs a GPU process, or wrote a live heartbeat outside its own directory
    (its directory's name was squatted), gets its own heartbeat directory."""
    uids = set()
    for pid in on_gpus:
        with contextlib.suppress(psutil.Error):
            uid = _effective_uid(psutil.Process(pid))
            if uid is not None:
                uids.add(uid)
    uids |= {b.uid for beats in live.values() for b in beats if b.path.parent == spool_dir}
    for uid in sorted(uids):
        note = ensure_user_spool(spool_dir, uid)
        if note:
            problems.append((f"uid:{uid}", note))


def _nvml_pids(gpus: Sequence[GpuDevice], problems: list[tuple[str, str]]) -> dict[int, set[int]]:
    """pid -> indices of the GPUs NVML lists it on; a GPU that cannot answer is a problem."""
    on_gpus: dict[int, set[int]] = {}
    for dev in gpus:
        try:
            listed = dev.compute_processes()
        except GpuError as err:
            problems.append(
                (
                    f"gpu:{dev.index}",
                    f"cannot list the compute processes on GPU "
                    f"{dev.index} ({type(err).__name__}: {err}); training processes "
                    "on it are found only from heartbeats or given pids",
                )
            )
            continue
        for proc in listed:
            on_gpus.setdefault(proc.pid, set()).add(dev.index)
    return on_gpus


def _drop_invisible(
    candidates: list[int],
    on_gpus: dict[int, set[int]],
    gpus: Sequence[GpuDevice],
    proc_root: Path,
    problems: list[tuple[str, str]],
) -> None:
    """Remove NVML pids /proc does not show. A pid NVML still lists when asked again (so a
    process that just exited is not blamed) means the agent sees another PID namespace."""
    missing = [p for p in candidates if p in on_gpus and not (proc_root / str(p)).exists()]
    if not missing:
        return
    again = _nvml_pids([g for g in gpus if any(g.index in on_gpus[p] for p in missing)], [])
    for pid in missing:
        candidates.remove(pid)
        if pid in again and not (proc_root / str(pid)).exists():
            where = ", ".join(f"gpu:{k}" for k in sorted(on_gpus[pid]))
            problems.append(
                (
                    f"pid:{pid}",
                    f"pid {pid} uses {where} but is not visible in "
                    f"{proc_root} (the agent runs in another PID namespace: give it "
                    "the host's, hostPID: true in Kubernetes, --pid=host in Docker)",
                )
            )


class _ProcessTree:
    """Parent and child pids from one scan of the process table, made on first use."""

    def __init__(self) -> None:
        self._ppid: dict[int, int] | None = None
        self._children: dict[int, list[int]] = {}

    def _scan(self) -> dict[int, int]:
        if self._ppid is None:
            self._ppid = {}
            for p in psutil.process_iter(["ppid"]):
                ppid = p.info.get("ppid")
                if ppid is not None:
                    self._ppid[p.pid] = ppid
                    self._children.setdefault(ppid, []).append(p.pid)
        return self._ppid

    def parents(self, ppid: int) -> list[int]:
        """``ppid`` and its ancestors, nearest first, up to (and without) pid 1."""
        table, out = self._scan(), list[int]()
        while ppid > 1 and ppid not in out and len(out) < _MAX_ANCESTORS:
            out.append(ppid)
            ppid = table.get(ppid, 0)
        return out

    def children(self, pid: int) -> list[int]:
        self._scan()
        return sorted(self._children.get(pid, []))


def _effective_uid(proc: psutil.Process) -> int | None:
    """The process's effective uid, None when it cannot be read; raises psutil.NoSuchProcess."""
    try:
        return proc.uids().effective
    except psutil.AccessDenied:
        return None


def _inspect(
    pid: int,
    sources: tuple[str, ...],
    beat: tuple[Path, dict[str, Any]] | None,
    gpus: Collection[int],
    tree: _ProcessTree,
    proc_root: Path,
    problems: list[tuple[str, str]],
    cgroups: _CgroupReading | None = None,
) -> TrainingProcess | None:
    """One candidate as a TrainingProcess; None when it is not running (any more)."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
            ppid = proc.ppid()
            uid = _effective_uid(proc)
    except (psutil.NoSuchProcess, ValueError):
        return None  # exited (or never ran): nothing to say about it
    ticks = process_start_ticks(pid, proc_root)
    env_error = ""
    try:
        env: dict[str, str] | None = read_environ(pid, proc_root)
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError as err:
        env, env_error = None, f"{type(err).__name__}: {err.strerror or err}"
    path, record = beat if beat is not None else (None, None)
    pod_uid = read_pod_uid(pid, proc_root)
    identity, source = _identity(pid, env, env_error, ppid, record, pod_uid, proc_root, problems)
    log_file = _log_file(pid, env, record, problems)
    cgroups = cgroups or _CgroupReading(None, CGROUP_FS)
    return TrainingProcess(
        pid=pid,
        start_ticks=ticks,
        uid=uid,
        cmdline=read_cmdline(pid, proc_root),
        rank=identity["rank"],
        local_rank=identity["local_rank"],
        world_size=identity["world_size"],
        job=identity["job"],
        job_source=identity["job_source"],
        slurm_job_id=identity["slurm_job_id"],
        pod=identity["pod"],
        pod_namespace=identity["pod_namespace"],
        identity_source=source,
        gpus=tuple(sorted(gpus)),
        heartbeat=record,
        heartbeat_path=None if path is None else str(path),
        log_file=log_file,
        parents=tree.parents(ppid),
        children=tree.children(pid),
        sources=sources,
        slurm_cgroup_job=read_slurm_cgroup_job(
            pid, proc_root, uid=uid, roots=cgroups.roots, cgroup_fs=cgroups.cgroup_fs
        ),
        pod_uid=pod_uid,
    )


def _identity(
    pid: int,
    env: dict[str, str] | None,
    env_error: str,
    ppid: int,
    record: dict[str, Any] | None,
    pod_uid: str | None,
    proc_root: Path,
    problems: list[tuple[str, str]],
) -> tuple[dict[str, Any], str]:
    """Its rank, job and pod, and where they came from: its environment, else its trusted
    heartbeat, else nowhere (``none``, with a problem saying so)."""
    if env is not None:
        identity, source = _identity_from_environ(env, ppid, record, pod_uid), "environ"
    elif record is not None:
        identity, source = {k: record.get(k) for k in _IDENTITY_KEYS}, "heartbeat"
        identity["pod_namespace"] = record.get("pod_namespace")
    else:
        identity, source = {k: None for k in (*_IDENTITY_KEYS, "pod_namespace")}, "none"
        problems.append(
            (
                f"pid:{pid}",
                f"pid {pid}: cannot read {proc_root}/{pid}/environ "
                f"({env_error}) and no trusted heartbeat names it, so its rank and job "
                f"are unknown: {_PRIVILEGE_ADVICE}",
            )
        )
    return identity, source


def _log_file(
    pid: int,
    env: dict[str, str] | None,
    record: dict[str, Any] | None,
    problems: list[tuple[str, str]],
) -> str | None:
    """Its log file (``NODE_AGENT_TRAIN_LOG`` or its heartbeat's ``log_file``); None, with a
    problem saying why, for one that is not an absolute path."""
    log_file = (env or {}).get("NODE_AGENT_TRAIN_LOG") or (record or {}).get("log_file")
    if log_file:
        try:
            check_log_file(
                log_file, f"pid {pid}'s log file (NODE_AGENT_TRAIN_LOG or its heartbeat's log_file)"
            )
        except ValueError as err:
            problems.append(
                (
                    f"pid:{pid}",
                    f"{err}: not read, so the log-silence signal is "
                    "unavailable for it; give an absolute path",
                )
            )
            log_file = None
    return str(log_file) if log_file else None


def _identity_from_environ(
    env: dict[str, str], ppid: int, record: dict[str, Any] | None, pod_uid: str | None = None
) -> dict[str, Any]:
    """identity_from_env's fields plus ``pod_namespace``. Where the environment is silent and
    the process's own (trusted) heartbeat says more — ranks passed as arguments, as with
    ``mp.spawn``, or ``Heartbeat(job=...)`` — the heartbeat's value is kept. In a pod the
    kernel vouches for (``pod_uid``), the pod is the job even under torchrun: the pod is what
    Kubernetes restarts, and a torchelastic run id has no witness."""
    identity = identity_from_env(env, ppid=ppid)
    identity["pod_namespace"] = (
        (env.get("POD_NAMESPACE") or env.get("KUBERNETES_NAMESPACE") or None)
        if identity["pod"]
        else None
    )
    if (
        pod_uid is not None
        and identity["pod"]
        and identity["job_source"] in ("torchelastic", "ppid")
    ):
        identity["job"], identity["job_source"] = f"pod:{identity['pod']}", "pod"
    if identity["job_source"] == "pod" and identity["pod_namespace"] and "/" not in identity["pod"]:
        identity["job"] = f"pod:{identity['pod_namespace']}/{identity['pod']}"
    if record is not None:
        for key in ("rank", "local_rank", "world_size"):
            if identity[key] is None and isinstance(record.get(key), int):
                identity[key] = record[key]
        if identity["job_source"] == "ppid" and record.get("job_source") == "argument":
            identity["job"], identity["job_source"] = record.get("job"), "argument"
    return identity


def _trusted_heartbeat(
    pid: int, uid: int | None, beats: list[SpoolFile], problems: list[tuple[str, str]]
) -> tuple[Path, dict[str, Any]] | None:
    """The heartbeat that may speak for ``pid``: one owned by the process's own uid (root's
    file for root's processes only: a root-owned file must not vouch for another user's pid).

    The owner is the one ``fstat`` gave for the file as it was read (not a second look at the
    path, which its writer could have swapped meanwhile). Others are ignored with a problem;
    of several trusted ones, ``<pid>.json`` (else the one with the latest step) is used."""
    trusted = []
    for beat in beats:
        path, record, owner = beat.path, beat.data, beat.uid
        if uid is not None and owner == uid:
            trusted.append((path, record))
            continue
        runs_as = "an unknown uid" if uid is None else f"uid {uid}"
        problems.append(
            (
                f"pid:{pid}",
                f"heartbeat file {path} claims pid {pid} but is owned by "
                f"uid {owner} while pid {pid} runs as {runs_as}: ignored, since any "
                "training user can write the spool; remove the file, and beat from "
                "the training process itself (node_agent.heartbeat.Heartbeat)",
            )
        )
    if not trusted:
        return None
    trusted.sort(
        key=lambda b: (b[0].stem == str(pid), float(b[1].get("step_at") or 0)), reverse=True
    )
    for path, _ in trusted[1:]:
        problems.append(
            (
                f"pid:{pid}",
                f"heartbeat files {trusted[0][0]} and {path} both claim "
                f"pid {pid}; using {trusted[0][0]}: remove the other",
            )
        )
    return trusted[0]
