"""Discovery of training processes (``node_agent.training.processes``) on real processes.

Children are real ``python`` processes with a launcher's environment (RANK, SLURM_JOB_ID, ...);
heartbeats are written by ``node_agent.heartbeat.Heartbeat`` inside them or by hand; NVML's
process list comes from a fake GPU. Only the unreadable-environ case (the agent not root) is
patched, as a root test runner can read every environ.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from node_agent.gpu.base import DeviceLost, GpuProcess, NotSupported
from node_agent.heartbeat import SCHEMA, identity_from_env, process_start_ticks
from node_agent.training import processes as tp
from node_agent.training.processes import alive, discover

LAUNCHER_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "SLURM_JOB_ID",
    "TORCHELASTIC_RUN_ID",
    "KUBERNETES_POD_NAME",
    "KUBERNETES_SERVICE_HOST",
    "POD_NAMESPACE",
    "KUBERNETES_NAMESPACE",
    "NODE_AGENT_TRAIN_LOG",
    "NODE_AGENT_STATE_DIR",
)

SLEEPER = "import time; print('ready', flush=True); time.sleep(60)"
BEATER = """
import sys, time
from node_agent.heartbeat import Heartbeat
rank = int(sys.argv[2]) if len(sys.argv) > 2 else None
job = sys.argv[3] if len(sys.argv) > 3 else None
hb = Heartbeat(spool_dir=sys.argv[1], rank=rank, job=job, min_interval_s=0)
hb.beat(0)
print('ready', flush=True)
time.sleep(60)
"""
# a launcher-like parent with one worker (a dataloader worker, say) that exits when orphaned
WORKER = "import os, sys, time\nwhile os.getppid() == int(sys.argv[1]): time.sleep(0.05)"
PARENT = f"""
import os, subprocess, sys, time
worker = subprocess.Popen([sys.executable, '-c', {WORKER!r}, str(os.getpid())])
print(worker.pid, flush=True)
time.sleep(60)
"""


class FakeGpu:
    """Only what discovery reads: NVML's compute-process list of one GPU."""

    def __init__(self, index: int, pids=(), error: Exception | None = None) -> None:
        self.index = index
        self.pids = list(pids)
        self.error = error
        self.asked = 0

    def compute_processes(self) -> list[GpuProcess]:
        self.asked += 1
        if self.error is not None:
            raise self.error
        return [GpuProcess(pid=p, used_memory_bytes=1 << 30) for p in self.pids]


@pytest.fixture
def spool(tmp_path) -> Path:
    d = tmp_path / "spool" / "heartbeat"
    d.mkdir(parents=True)
    return d


@pytest.fixture
def spawn():
    """``spawn(code, *args, env={...})`` -> a running child whose exec has finished (it has
    printed its first line, so /proc/<pid>/environ is its own, not the test's)."""
    children: list[subprocess.Popen] = []

    def start(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        base = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
        child = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            env={**base, **(env or {})},
            stdout=subprocess.PIPE,
            text=True,
        )
        children.append(child)
        child.first_line = child.stdout.readline().strip()
        assert child.first_line, f"child {child.pid} did not start"
        return child

    yield start
    for child in children:
        child.kill()
        child.wait()
        child.stdout.close()


def write_beat(spool: Path, pid: int, name: str | None = None, **extra) -> Path:
    record = {
        "schema": SCHEMA,
        "pid": pid,
        "start_ticks": process_start_ticks(pid),
        "step": 10,
        "step_at": time.time(),
        "step_time_s": 0.5,
        **extra,
    }
    path = spool / (name or f"{pid}.json")
    path.write_text(json.dumps(record))
    return path


def by_pid(found) -> dict[int, tp.TrainingProcess]:
    return {p.pid: p for p in found.processes}


# -- identity ------------------------------------------------------------------------------------


def test_rank_and_job_come_from_the_process_environment(spool, spawn, tmp_path):
    log = str(tmp_path / "train.log")
    env = {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "SLURM_JOB_ID": "777",
        "NODE_AGENT_TRAIN_LOG": log,
    }
    child = spawn(BEATER, str(spool), env=env)
    found = discover(spool)
    assert found.problems == [] and found.dead_heartbeats == []
    (p,) = found.processes
    assert (p.pid, p.rank, p.local_rank, p.world_size) == (child.pid, 3, 1, 8)
    assert (p.job, p.job_source, p.slurm_job_id, p.pod) == ("slurm:777", "slurm", "777", None)
    assert (p.identity_source, p.log_file, p.sources, p.gpus) == (
        "environ",
        log,
        ("heartbeat",),
        (),
    )
    assert p.heartbeat_path == str(spool / f"{child.pid}.json")
    assert p.heartbeat["pid"] == child.pid and p.heartbeat["step"] == 0
    assert p.start_ticks == process_start_ticks(child.pid) == p.heartbeat["start_ticks"]
    assert p.uid == os.geteuid()
    assert p.cmdline[:2] == [sys.executable, "-c"] and p.cmdline[-1] == str(spool)
    assert p.parents[0] == os.getpid() and 1 not in p.parents
    assert p.children == []
    # the same format the process's own heartbeat wrote
    for key in ("rank", "local_rank", "world_size", "job", "job_source", "slurm_job_id"):
        assert getattr(p, key) == p.heartbeat[key], key


def test_pod_name_and_namespace_come_from_a_kubernetes_environment(spool, spawn):
    child = spawn(
        SLEEPER,
        env={
            "KUBERNETES_SERVICE_HOST": "10.0.0.1",
            "HOSTNAME": "trainer-0",
            "POD_NAMESPACE": "ml",
            "RANK": "0",
        },
    )
    (p,) = discover(spool, pids=[child.pid]).processes
    assert (p.job, p.job_source, p.pod, p.pod_namespace) == (
        "pod:ml/trainer-0",
        "pod",
        "trainer-0",
        "ml",
    )
    assert p.sources == ("pid",) and p.heartbeat is None


def test_without_a_job_variable_the_job_is_the_launcher_ppid(spool, spawn):
    child = spawn(SLEEPER)
    (p,) = discover(spool, pids=[child.pid]).processes
    assert p.job == f"ppid:{os.getpid()}" == identity_from_env({}, ppid=os.getpid())["job"]
    assert p.rank is None and p.pod_namespace is None and p.identity_source == "environ"


def test_rank_and_job_given_to_the_heartbeat_fill_in_where_the_environment_is_silent(spool, spawn):
    child = spawn(BEATER, str(spool), "5", "exp-42")  # mp.spawn passes the rank as an argument
    (p,) = discover(spool).processes
    assert (p.pid, p.rank, p.job, p.job_source) == (child.pid, 5, "exp-42", "argument")
    assert p.identity_source == "environ"


def test_unreadable_environ_falls_back_to_the_heartbeat_claims(spool, spawn, monkeypatch):
    child = spawn(SLEEPER, env={"RANK": "9"})
    write_beat(
        spool,
        child.pid,
        rank=2,
        local_rank=2,
        world_size=4,
        job="slurm:55",
        job_source="slurm",
        slurm_job_id="55",
        log_file="/var/log/job.log",
    )

    def denied(pid, proc_root=Path("/proc")):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tp, "read_environ", denied)  # what a non-root agent gets
    found = discover(spool)
    (p,) = found.processes
    assert (p.identity_source, p.rank, p.world_size, p.job) == ("heartbeat", 2, 4, "slurm:55")
    assert p.log_file == "/var/log/job.log" and found.problems == []


def test_unreadable_environ_without_heartbeat_is_identity_none_with_advice(
    spool, spawn, monkeypatch
):
    child = spawn(SLEEPER, env={"RANK": "9"})

    def denied(pid, proc_root=Path("/proc")):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tp, "read_environ", denied)
    found = discover(spool, pids=[child.pid])
    (p,) = found.processes
    assert (p.identity_source, p.rank, p.job) == ("none", None, None)
    ((subject, message),) = found.problems
    assert subject == f"pid:{child.pid}"
    assert "environ" in message and "root" in message and "CAP_SYS_PTRACE" in message


def test_proc_root_is_read_for_environ_stat_and_cmdline(spool, spawn, tmp_path):
    child = spawn(SLEEPER)
    fake = tmp_path / "proc" / str(child.pid)
    fake.mkdir(parents=True)
    fake.joinpath("environ").write_bytes(b"RANK=6\0TORCHELASTIC_RUN_ID=abc\0")
    fake.joinpath("stat").write_bytes(
        f"{child.pid} (py thon) S 1 ".encode() + b" ".join([b"0"] * 17) + b" 4242 0 0"
    )
    fake.joinpath("cmdline").write_bytes(b"train.py\0" + b"x" * 500 + b"\0")
    (p,) = discover(spool, pids=[child.pid], proc_root=tmp_path / "proc").processes
    assert (p.rank, p.job, p.start_ticks) == (6, "torchelastic:abc", 4242)
    assert p.cmdline == ["train.py", "x" * 200]


def test_cmdline_keeps_the_first_twenty_arguments(spool, spawn):
    child = spawn(SLEEPER, *[str(i) for i in range(30)])
    (p,) = discover(spool, pids=[child.pid]).processes
    assert len(p.cmdline) == 20 and p.cmdline[:3] == [sys.executable, "-c", SLEEPER]


# -- sources -------------------------------------------------------------------------------------


def test_explicit_pids_return_only_those_enriched_by_heartbeat_and_nvml(spool, spawn):
    wanted = spawn(BEATER, str(spool), env={"RANK": "0"})
    other = spawn(BEATER, str(spool), env={"RANK": "1"})
    gpus = [FakeGpu(0, [wanted.pid, other.pid]), FakeGpu(1, [other.pid])]
    found = discover(spool, gpus=gpus, pids=[wanted.pid])
    (p,) = found.processes
    assert (p.pid, p.sources, p.gpus) == (wanted.pid, ("heartbeat", "nvml", "pid"), (0,))
    assert p.heartbeat["pid"] == wanted.pid and found.problems == []
    assert {q.pid for q in discover(spool, gpus=gpus).processes} == {wanted.pid, other.pid}


def test_explicit_pid_that_is_not_running_is_a_problem(spool, spawn):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    found = discover(spool, pids=[gone.pid])
    assert found.processes == []
    assert found.problems == [
        (
            f"pid:{gone.pid}",
            f"pid {gone.pid} was asked for but is not running (or is a zombie): nothing to inspect",
        )
    ]


def test_nvml_process_without_heartbeat_is_found_with_its_gpus_and_tree(spool, spawn):
    parent = spawn(PARENT, env={"RANK": "4", "TORCHELASTIC_RUN_ID": "run-1"})
    worker = int(parent.first_line)
    found = discover(spool, gpus=[FakeGpu(0, [parent.pid]), FakeGpu(1, [parent.pid]), FakeGpu(2)])
    (p,) = found.processes
    assert (p.pid, p.sources, p.gpus, p.rank, p.job) == (
        parent.pid,
        ("nvml",),
        (0, 1),
        4,
        "torchelastic:run-1",
    )
    assert p.children == [worker] and p.parents[0] == os.getpid()
    (w,) = discover(spool, pids=[worker]).processes
    assert w.parents[:2] == [parent.pid, os.getpid()]


def test_nvml_pid_not_in_proc_is_a_pid_namespace_problem(spool, spawn):
    child = spawn(SLEEPER)
    ghost = int(Path("/proc/sys/kernel/pid_max").read_text()) + 7  # can never exist
    gpus = [FakeGpu(0, [child.pid]), FakeGpu(1, [ghost])]
    found = discover(spool, gpus=gpus)
    assert [p.pid for p in found.processes] == [child.pid]
    assert found.problems == [
        (
            f"pid:{ghost}",
            f"pid {ghost} uses gpu:1 but is not visible in "
            "/proc (the agent runs in another PID namespace: give it the "
            "host's, hostPID: true in Kubernetes, --pid=host in Docker)",
        )
    ]
    assert gpus[1].asked == 2 and gpus[0].asked == 1  # asked again before blaming the namespace


def test_nvml_pid_that_exited_before_the_second_look_is_not_blamed(spool):
    ghost = int(Path("/proc/sys/kernel/pid_max").read_text()) + 7

    class ExitsAfterFirstList(FakeGpu):
        def compute_processes(self):
            listed = super().compute_processes()
            self.pids = []
            return listed

    found = discover(spool, gpus=[ExitsAfterFirstList(0, [ghost])])
    assert (found.processes, found.problems) == ([], [])


def test_nvml_failure_is_a_problem_per_gpu_not_an_exception(spool, spawn):
    child = spawn(SLEEPER)
    gpus = [
        FakeGpu(
            0, error=DeviceLost("nvmlDeviceGetComputeRunningProcesses_v3 on GPU 0: GPU is lost")
        ),
        FakeGpu(1, error=NotSupported("no process list on GPU 1")),
        FakeGpu(2, [child.pid]),
    ]
    found = discover(spool, gpus=gpus)
    assert [(p.pid, p.gpus) for p in found.processes] == [(child.pid, (2,))]
    assert [s for s, _ in found.problems] == ["gpu:0", "gpu:1"]
    assert "DeviceLost" in found.problems[0][1] and "GPU is lost" in found.problems[0][1]


# -- heartbeats: trust, death, junk ----------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown")
def test_heartbeat_owned_by_another_user_does_not_speak_for_the_process(spool, spawn):
    child = spawn(SLEEPER, env={"RANK": "1"})
    forged = write_beat(spool, child.pid, rank=0, job="slurm:victim", log_file="/etc/shadow")
    os.chown(forged, 65534, 65534)
    found = discover(spool)
    assert found.processes == [] and found.dead_heartbeats == []
    ((subject, message),) = found.problems
    assert subject == f"pid:{child.pid}"
    assert str(forged) in message and "uid 65534" in message and "uid 0" in message
    assert "remove the file" in message
    # still found through NVML, but without the forged record or its claims
    (p,) = discover(spool, gpus=[FakeGpu(0, [child.pid])]).processes
    assert (p.sources, p.heartbeat, p.heartbeat_path, p.rank, p.log_file) == (
        ("nvml",),
        None,
        None,
        1,
        None,
    )


def test_heartbeat_of_a_reused_pid_is_dead(spool, spawn):
    child = spawn(SLEEPER)
    stale = write_beat(spool, child.pid, start_ticks=process_start_ticks(child.pid) - 1)
    found = discover(spool)
    assert (found.processes, found.dead_heartbeats, found.problems) == ([], [stale], [])
    assert not alive(child.pid, process_start_ticks(child.pid) - 1)
    assert alive(child.pid, process_start_ticks(child.pid)) and alive(child.pid)


def test_heartbeat_of_an_exited_or_zombie_process_is_dead(spool):
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # exits; not reaped until wait()
    try:
        deadline = time.monotonic() + 10
        while alive(zombie.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        beats = [
            write_beat(spool, exited.pid, start_ticks=None),
            write_beat(spool, zombie.pid, start_ticks=None),
        ]
        found = discover(spool)
        assert found.processes == [] and sorted(found.dead_heartbeats) == sorted(beats)
    finally:
        zombie.wait()


def test_file_that_is_not_a_heartbeat_is_a_bad_file_not_a_process(spool):
    junk = spool / "123.json"
    junk.write_text('{"schema": "something-else"}')
    found = discover(spool)
    assert found.problems == [] and found.processes == []
    ((path, reason),) = found.bad_files
    assert path == junk and "schema" in reason


@pytest.mark.parametrize(
    "field, value",
    [
        ("step_time_s", "fast"),
        ("start_ticks", "1"),
        ("step_at", None),
        ("pause", "checkpoint"),
        ("rank", 1.5),
        ("job", ["slurm:1"]),
    ],
)
def test_a_heartbeat_with_a_value_of_the_wrong_type_is_a_bad_file(spool, spawn, field, value):
    child = spawn(SLEEPER)
    path = write_beat(spool, child.pid, **{field: value})
    found = discover(spool)
    assert found.processes == []
    ((bad, reason),) = found.bad_files
    assert bad == path and repr(field) in reason


def test_two_heartbeat_files_for_one_pid_use_its_own(spool, spawn):
    child = spawn(BEATER, str(spool))
    own = spool / f"{child.pid}.json"
    copy = write_beat(spool, child.pid, name="copy.json", step=99)
    found = discover(spool)
    (p,) = found.processes
    assert p.heartbeat_path == str(own) and p.heartbeat["step"] == 0
    ((_, message),) = found.problems
    assert str(copy) in message and "remove the other" in message


def test_missing_spool_directory_finds_nothing(tmp_path):
    found = discover(tmp_path / "nowhere")
    assert (found.processes, found.problems, found.dead_heartbeats) == ([], [], [])


# -- processes that exit mid-way -------------------------------------------------------------


@pytest.mark.parametrize("when", ["read_environ", "read_cmdline"])
def test_process_exiting_mid_discovery_does_not_crash(spool, spawn, monkeypatch, when):
    child = spawn(BEATER, str(spool))
    original = getattr(tp, when)

    def exit_first(pid, proc_root=Path("/proc")):
        child.kill()
        child.wait()  # reaped: /proc/<pid> is gone
        return original(pid, proc_root)

    monkeypatch.setattr(tp, when, exit_first)
    found = discover(spool, gpus=[FakeGpu(0, [child.pid])])
    if when == "read_environ":
        assert found.processes == []  # gone before its identity was read: dropped
    else:
        (p,) = found.processes  # gone after: the snapshot taken stands, its cmdline is empty
        assert p.cmdline == [] and p.pid == child.pid
    assert found.problems == []


def test_process_gone_before_psutil_reads_it_is_dropped(spool, spawn, monkeypatch):
    child = spawn(SLEEPER)
    # the last step before the candidates are inspected: the process exits right there
    monkeypatch.setattr(tp, "_drop_invisible", lambda *a: (child.kill(), child.wait()))
    found = discover(spool, gpus=[FakeGpu(0, [child.pid])])
    assert found.processes == [] and found.problems == []
    assert not alive(child.pid)


# -- evidence ------------------------------------------------------------------------------------


def test_evidence_is_json_and_leaves_the_heartbeat_record_out(spool, spawn):
    spawn(BEATER, str(spool), env={"RANK": "0", "SLURM_JOB_ID": "1"})
    (p,) = discover(spool, gpus=[FakeGpu(3, [])]).processes
    evidence = json.loads(json.dumps(p.to_evidence()))
    assert "heartbeat" not in evidence and evidence["heartbeat_path"] == p.heartbeat_path
    assert evidence["cmdline"] == " ".join(p.cmdline)
    assert (evidence["rank"], evidence["job"], evidence["sources"], evidence["gpus"]) == (
        0,
        "slurm:1",
        ["heartbeat"],
        [],
    )


def _cgroup_tree(tmp_path: Path, procs: dict[int, str], owned: dict[str, int] | None = None):
    """A /proc tree whose ``<pid>/cgroup`` files read ``procs[pid]``, and the cgroup
    directories they name made under ``<tmp>/cgroup`` (root's, as the test runs as root; the
    paths in ``owned`` given to that uid, as systemd delegates a user's subtree)."""
    proc, fs = tmp_path / "proc", tmp_path / "cgroup"
    for pid, text in procs.items():
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text(text)
        for line in text.splitlines():
            hier, controllers, path = line.split(":", 2)
            mount = fs if hier == "0" else fs / controllers.removeprefix("name=")
            (mount / path.lstrip("/")).mkdir(parents=True, exist_ok=True)
    for path, uid in (owned or {}).items():
        os.chown(fs / path, uid, uid)
    return proc, fs


def _roots(fs: Path) -> list[str]:
    """The built-in roots, moved under the test's cgroup mount."""
    return [str(fs / Path(r).relative_to(tp.CGROUP_FS)) for r in tp.DEFAULT_SLURM_CGROUP_ROOTS]


def test_slurm_job_is_verified_only_by_slurmds_cgroup_not_by_the_environment(tmp_path):
    """A user can put any SLURM_JOB_ID in their own environment; slurmd's cgroup is not theirs.
    A fake /proc and cgroup tree: the paths are the ones Slurm's cgroup plugins create
    (cgroup_v2.html "Hierarchy overview"; v1: slurm/uid_<uid>/job_<id>/step_<n>)."""
    from node_agent.training.processes import read_slurm_cgroup_job

    proc, fs = _cgroup_tree(
        tmp_path,
        {
            1: "0::/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0",  # v2
            2: "4:memory:/slurm/uid_1000/job_77/step_batch\n2:cpu:/",  # v1
            3: "0::/user.slice/user-1000.slice/session-3.scope",  # no job
            5: "0::/system.slice/node7_slurmstepd.scope/job_9/step_extern/user/task_0",  # multi
            6: "0::/slurm.slice/slurmstepd.scope/job_10/step_0/user/task_0",  # slurmd's own slice
        },
    )
    roots = _roots(fs)

    def job(pid, uid=1000):
        return read_slurm_cgroup_job(pid, proc, uid=uid, roots=roots, cgroup_fs=fs)

    assert job(1) == "4242"
    assert job(2) == "77"
    assert job(2, uid=1001) is None  # v1's uid level names another user
    assert job(3) is None
    assert job(4) is None  # gone
    assert (job(5), job(6)) == ("9", "10")
    # the real mount, where none of these paths exist: nothing is taken on the path's word
    assert read_slurm_cgroup_job(1, proc, uid=1000) is None


@pytest.mark.parametrize(
    "path",
    [
        # systemd's user manager delegates user@<uid>.service to the user: a job_N made inside it
        "user.slice/user-1000.slice/user@1000.service/app.slice/job_4242",
        "user.slice/user-1000.slice/user@1000.service/app.slice/job_4242/step_0",
        # a name that looks like slurmd's scope, inside the user's subtree
        "user.slice/user-1000.slice/user@1000.service/slurmstepd.scope/job_4242",
    ],
)
def test_a_job_cgroup_a_user_made_in_its_own_delegated_subtree_is_no_slurm_job(tmp_path, path):
    from node_agent.training.processes import read_slurm_cgroup_job

    delegated = "user.slice/user-1000.slice/user@1000.service"
    proc, fs = _cgroup_tree(tmp_path, {1: f"0::/{path}"})
    for d in [fs / delegated, *(fs / delegated).rglob("*")]:
        os.chown(d, 1000, 1000)
    assert read_slurm_cgroup_job(1, proc, uid=1000, roots=_roots(fs), cgroup_fs=fs) is None
    # a root pattern wide enough to take it in still needs root's directories up to the job
    wide = [str(fs / "user.slice/*/*/*"), str(fs / "user.slice/*/*")]
    assert read_slurm_cgroup_job(1, proc, uid=1000, roots=wide, cgroup_fs=fs) is None


def test_a_user_owned_directory_between_the_job_and_slurmds_root_is_refused(tmp_path):
    from node_agent.training.processes import read_slurm_cgroup_job

    proc, fs = _cgroup_tree(
        tmp_path,
        {1: "0::/system.slice/slurmstepd.scope/job_5/step_0"},
        owned={"system.slice/slurmstepd.scope/job_5": 1000},
    )
    assert read_slurm_cgroup_job(1, proc, uid=1000, roots=_roots(fs), cgroup_fs=fs) is None
    # a symlink in the chain is not a directory of root's either
    target = tmp_path / "elsewhere"
    (target / "job_6" / "step_0").mkdir(parents=True)
    (fs / "system.slice" / "linked.scope").symlink_to(target)
    (proc / "2").mkdir()
    (proc / "2" / "cgroup").write_text("0::/system.slice/linked.scope/job_6/step_0\n")
    roots = [*_roots(fs), str(fs / "system.slice/linked.scope")]
    assert read_slurm_cgroup_job(2, proc, uid=1000, roots=roots, cgroup_fs=fs) is None


def slurm_rank(**overrides: object) -> tp.TrainingProcess:
    """Rank 0 of Slurm job 42, named by its environment and confirmed by its cgroup."""
    fields: dict = dict(
        pid=1,
        start_ticks=1,
        uid=0,
        cmdline=[],
        rank=0,
        local_rank=0,
        world_size=1,
        job="slurm:42",
        job_source="slurm",
        slurm_job_id="42",
        pod=None,
        pod_namespace=None,
        identity_source="environ",
        gpus=(),
        heartbeat=None,
        heartbeat_path=None,
        log_file=None,
        parents=[],
        children=[],
        sources=("pid",),
        slurm_cgroup_job="42",
    )
    return tp.TrainingProcess(**{**fields, **overrides})


def test_a_verified_slurm_job_carries_the_processes_uid_to_the_adapter():
    assert slurm_rank(uid=1000).restart_job_id == "slurm:42@uid:1000"
    unknown = slurm_rank(uid=None)  # whose it is cannot be said
    assert not unknown.job_verified and unknown.restart_job_id is None


def test_only_an_environment_job_with_a_matching_cgroup_may_be_acted_on():
    assert slurm_rank().job_verified
    assert not slurm_rank(slurm_cgroup_job="41").job_verified  # SLURM_JOB_ID set by hand
    assert not slurm_rank(slurm_cgroup_job=None).job_verified  # not in a Slurm job at all
    assert not slurm_rank(identity_source="heartbeat").job_verified  # only a file said so
    assert not slurm_rank(job="label", job_source="argument").job_verified
    assert not slurm_rank(job="ppid:7", job_source="ppid").job_verified
    # a torchelastic run id is whatever the user exported: no kernel witness, never acted on
    assert not slurm_rank(job="torchelastic:x", job_source="torchelastic").job_verified
    pod = dict(
        job="pod:ml/trainer-0",
        job_source="pod",
        pod="trainer-0",
        pod_namespace="ml",
        slurm_job_id=None,
        slurm_cgroup_job=None,
    )
    uid = "0f3c6b0e-2f6a-4b7c-9a7e-1234567890ab"
    assert not slurm_rank(**pod).job_verified  # KUBERNETES_POD_NAME alone
    assert slurm_rank(**pod, pod_uid=uid).job_verified  # the kubepods cgroup agrees
    assert slurm_rank(**pod, pod_uid=uid).restart_job_id == f"pod:ml/trainer-0@{uid}"
    assert slurm_rank(job="torchelastic:x", job_source="torchelastic").restart_job_id is None


UID = "0f3c6b0e-2f6a-4b7c-9a7e-1234567890ab"


@pytest.mark.parametrize(
    "cgroup, uid",
    [
        # cgroup v2, systemd driver (containerd), as the agent in the host's cgroup namespace sees it
        (
            f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}"
            ".slice/cri-containerd-1f2e.scope\n",
            UID,
        ),
        # guaranteed QoS, systemd driver
        (
            f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/cri-containerd-1f.scope\n",
            UID,
        ),
        # cgroup v1, cgroupfs driver: every hierarchy names the same pod
        (
            f"12:memory:/kubepods/besteffort/pod{UID}/abc\n11:pids:/kubepods/besteffort/pod{UID}/abc\n"
            "1:name=systemd:/kubepods/besteffort/pod" + UID + "/abc\n0::/\n",
            UID,
        ),
        # the agent itself in a pod with a cgroup namespace: other pods' paths are relative
        (
            f"0::/../../kubepods-besteffort-pod{UID.replace('-', '_')}.slice/cri-containerd-9.scope\n",
            UID,
        ),
        # a user's delegated subtree can hold a cgroup named like a pod's, but not above itself
        (
            f"0::/user.slice/user-1000.slice/user@1000.service/app.slice/kubepods-pod"
            f"{UID.replace('-', '_')}.slice\n",
            None,
        ),
        (
            f"0::/../../../user.slice/user-1000.slice/kubepods-pod{UID.replace('-', '_')}.slice\n",
            None,
        ),
        # Slurm, and two hierarchies that disagree
        ("0::/system.slice/slurmstepd.scope/job_42/step_0/user/task_0\n", None),
        (f"12:memory:/kubepods/pod{UID}/a\n11:pids:/kubepods/pod{UID[:-1]}0/a\n", None),
    ],
)
def test_pod_uid_comes_only_from_a_kubepods_cgroup(tmp_path, cgroup, uid):
    from node_agent.training.processes import read_pod_uid

    (tmp_path / "77").mkdir()
    (tmp_path / "77" / "cgroup").write_text(cgroup)
    assert read_pod_uid(77, tmp_path) == uid


def test_a_pod_named_only_by_the_environment_is_an_unverified_job(spool, spawn):
    child = spawn(SLEEPER, env={"KUBERNETES_POD_NAME": "kube-system/cilium-x", "RANK": "0"})
    (p,) = discover(spool, pids=[child.pid]).processes
    assert (p.job, p.job_source, p.pod_uid) == ("pod:kube-system/cilium-x", "pod", None)
    assert not p.job_verified and p.restart_job_id is None


def test_in_a_kernel_attested_pod_the_pod_is_the_job_even_under_torchrun(spool, spawn, tmp_path):
    child = spawn(
        SLEEPER,
        env={
            "KUBERNETES_POD_NAME": "trainer-0",
            "POD_NAMESPACE": "ml",
            "TORCHELASTIC_RUN_ID": "run-1",
            "RANK": "2",
        },
    )
    fake = tmp_path / "proc" / str(child.pid)
    fake.mkdir(parents=True)
    for name in ("environ", "stat", "cmdline"):
        fake.joinpath(name).write_bytes(Path(f"/proc/{child.pid}/{name}").read_bytes())
    fake.joinpath("cgroup").write_text(
        f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/cri-containerd-1.scope\n"
    )
    (p,) = discover(spool, pids=[child.pid], proc_root=tmp_path / "proc").processes
    assert (p.job, p.job_source, p.pod_uid, p.rank) == ("pod:ml/trainer-0", "pod", UID, 2)
    assert p.job_verified and p.restart_job_id == f"pod:ml/trainer-0@{UID}"
