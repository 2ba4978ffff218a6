"""Issue 29's attacks on job identity and the heartbeat spool, each replayed by real users.

The attackers are users made with ``useradd`` (``conftest.py``, as is the second one, the
victim); the agent runs as root, as the real ``node-agent`` command or through
its library functions where the command adds nothing. The GPUs are simulated (none here).

- **A job cgroup of the user's own.** systemd's user manager (``user@<uid>.service``, with
  ``Delegate=yes``) hands each user a cgroup subtree of its own: the directory and its
  ``cgroup.procs``, ``cgroup.threads`` and ``cgroup.subtree_control`` are chowned to the user
  (systemd.io/CGROUP_DELEGATION), so the user can make ``job_4242`` in it and move itself
  there. This machine runs no systemd user manager, so the test makes exactly that in the
  kernel's real cgroup v2 hierarchy: root makes ``user.slice/user-<uid>.slice/user@<uid>
  .service`` and chowns it and those three files to the user, puts the user's process in it,
  and the user does the rest itself. Where no cgroup v2 hierarchy is writable, the test skips
  with the reason (the same attack on a built /proc and cgroup tree is in
  ``tests/unit/test_training_processes.py``).
- **Another user's Slurm job.** A real Slurm job (``tests/slurm_cluster.py``: munge,
  slurmctld and slurmd on loopback), submitted by root; the attacker's process sits in a cgroup
  root made the way slurmstepd makes a job's (root's, ``slurmstepd.scope/job_<id>/...``) and
  names that job: the Slurm adapter compares the job's owner with the process's uid.
- **Unusable text in a heartbeat**, a **squatted spool** and a **flooded spool**: written by
  the attacker with plain file calls, read by root's agent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]

STALE_BEATER = r"""
import sys, time
from node_agent.heartbeat import Heartbeat
hb = Heartbeat(sys.argv[1], min_interval_s=0, wall=lambda: time.time() - 3600)
hb.beat(5)  # its last step an hour ago: a hung job, by its own heartbeat
print(hb.path, flush=True)
time.sleep(120)
"""

# Waits to be put in its user's delegated cgroup (as systemd starts a user's session there),
# then makes job_<id> in that subtree, moves itself into it and beats a stale heartbeat.
DELEGATED_JOB = r"""
import os, sys, time
spool, delegated, job = sys.argv[1], sys.argv[2], sys.argv[3]
print("started", flush=True)
while not open("/proc/self/cgroup").read().strip().endswith(sys.argv[4]):
    time.sleep(0.02)
mine = os.path.join(delegated, "app.slice", "job_" + job)
os.makedirs(mine)
with open(os.path.join(mine, "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
from node_agent.heartbeat import Heartbeat
hb = Heartbeat(spool, min_interval_s=0, wall=lambda: time.time() - 3600)
hb.beat(5)
print(open("/proc/self/cgroup").read().strip().splitlines()[-1], flush=True)
time.sleep(120)
"""


def run_agent(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """The real ``node-agent`` command, as root."""
    return subprocess.run(
        [sys.executable, "-m", "node_agent.commands.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=dict(os.environ),
    )


def write_yaml(path: Path, data: dict) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


def heartbeat_spool(base: Path) -> Path:
    """The node's heartbeat spool the way the agent makes it (ensure_spool_dirs)."""
    from node_agent.atomic_file import ensure_spool_dirs

    assert not [n for n in ensure_spool_dirs(base / "spool") if "cannot" in n]
    return base / "spool" / "heartbeat"


def hang_check(base: Path, hb: Path) -> list[str]:
    """``node-agent check`` arguments for a training_progress run on ``hb``, as root."""
    cfg = write_yaml(
        base / "config.yaml", {"state_dir": str(base / "state"), "spool_dir": str(base / "spool")}
    )
    suite = write_yaml(
        base / "hang.yaml",
        {
            "name": "hang",
            "mode": "service",
            "checks": [
                {
                    "check": "training_progress",
                    "timeout_s": 60,
                    "params": {
                        "spool_dir": str(hb),
                        "stack_samples": 1,
                    },
                }
            ],
        },
    )
    node = write_yaml(base / "node.yaml", {"sku": "h100-sxm5-80gb", "gpus": 8})
    return ["check", "--suite", suite, "--simulate", node, "--config", cfg, "--json"]


def report(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode in (0, 3, 4), done.stderr[-3000:]
    return json.loads(done.stdout)


def results(rep: dict, metric: str) -> list[dict]:
    return [r for r in rep["results"] if r["metric"] == metric]


def of_pid(rep: dict, metric: str, pid: int) -> list[dict]:
    return [r for r in results(rep, metric) if (r.get("evidence") or {}).get("pid") == pid]


# -- High 2: a job_N cgroup in the user's own delegated subtree -----------------------------------


def _cgroup2_mount() -> Path | None:
    """Where the kernel's cgroup v2 hierarchy is mounted (``/sys/fs/cgroup``, or
    ``/sys/fs/cgroup/unified`` on a hybrid host), from /proc/self/mountinfo."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            fstype = fields[fields.index("-") + 1]
            if fstype == "cgroup2":
                return Path(fields[4])
    return None


class Cgroups:
    """A subtree of the real cgroup v2 hierarchy for one test, removed afterwards."""

    def __init__(self, mount: Path) -> None:
        self.mount = mount
        self.base = mount / f"na-sec-{uuid.uuid4().hex[:8]}"
        self.base.mkdir()

    def rel(self, path: Path) -> str:
        """The path as /proc/<pid>/cgroup names it."""
        return "/" + str(path.relative_to(self.mount))

    def make(self, rel: str) -> Path:
        path = self.base / rel
        path.mkdir(parents=True, exist_ok=True)
        return path

    def delegate(self, rel: str, uid: int, gid: int) -> Path:
        """What systemd's Delegate=yes does for a user's unit: the directory and its
        cgroup.procs, cgroup.threads and cgroup.subtree_control become the user's."""
        path = self.make(rel)
        for p in (
            path,
            path / "cgroup.procs",
            path / "cgroup.threads",
            path / "cgroup.subtree_control",
        ):
            os.chown(p, uid, gid)
        return path

    @staticmethod
    def put(pid: int, path: Path) -> None:
        (path / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        for d in sorted(
            (p for p in self.base.rglob("*") if p.is_dir()),
            key=lambda p: len(p.parts),
            reverse=True,
        ):
            for _ in range(50):  # a killed process leaves its cgroup a moment later
                try:
                    d.rmdir()
                    break
                except OSError:
                    time.sleep(0.05)
        self.base.rmdir()


@pytest.fixture
def cgroups(user):
    mount = _cgroup2_mount()
    if mount is None:
        pytest.skip(
            "no cgroup v2 hierarchy is mounted here: the delegated-cgroup attack "
            "needs one (the built-tree version is in tests/unit)"
        )
    try:
        tree = Cgroups(mount)
    except OSError as err:
        pytest.skip(
            f"cannot make a cgroup under {mount} ({err.strerror}): the "
            "delegated-cgroup attack needs a writable cgroup v2 hierarchy"
        )
    try:
        yield tree
    finally:
        user.stop_children()  # a cgroup with a process in it cannot be removed
        tree.remove()


def _delegated_job(user, cgroups, hb: Path, job: str):
    """The attack: the user's process in its own delegated subtree, in a job_<job> it made,
    with SLURM_JOB_ID=<job> and a stale heartbeat. Returns (process, its cgroup line)."""
    service = f"user.slice/user-{user.uid}.slice/user@{user.uid}.service"
    cgroups.make(f"user.slice/user-{user.uid}.slice")
    delegated = cgroups.delegate(service, user.uid, user.gid)
    proc = user.popen(
        DELEGATED_JOB,
        str(hb),
        str(delegated),
        job,
        cgroups.rel(delegated),
        env={"SLURM_JOB_ID": job, "RANK": "0"},
    )
    assert proc.first_line == "started"
    cgroups.put(proc.pid, delegated)
    line = proc.stdout.readline().strip()
    assert line.endswith(f"{cgroups.rel(delegated)}/app.slice/job_{job}"), line
    return proc, line


def test_a_job_cgroup_in_the_users_delegated_subtree_gets_no_restart_job(user, shared_dir, cgroups):
    hb = heartbeat_spool(shared_dir)
    proc, line = _delegated_job(user, cgroups, hb, "4242")
    rep = report(run_agent(*hang_check(shared_dir, hb), "--act"))
    (hang,) = of_pid(rep, "training_hang", proc.pid)
    assert hang["target"] == "job:unverified:slurm:4242/rank:0", hang["target"]
    process = hang["evidence"]["process"]
    assert (process["slurm_job_id"], process["slurm_cgroup_job"], process["job_verified"]) == (
        "4242",
        None,
        False,
    )
    assert not [a for a in rep.get("actions", []) if a["outcome"] == "done"], rep["actions"]
    assert not (shared_dir / "state" / "actions.log").exists()  # nothing reached the adapter


def test_slurmds_job_cgroup_is_believed_and_a_root_wide_enough_to_hold_the_users_is_not(
    user, shared_dir, cgroups
):
    """The control: the same kind of process put by root in a root-owned
    slurmstepd.scope/job_<id>/step_0/user/task_0 (as slurmstepd does) is that job's, and
    carries its uid; a configured root that takes the user's subtree in still refuses the
    user's job_4242, because the directories up to it are the user's."""
    from node_agent.training.processes import discover

    hb = heartbeat_spool(shared_dir)
    attack, _ = _delegated_job(user, cgroups, hb, "4242")
    task = cgroups.make("system.slice/slurmstepd.scope/job_4243/step_0/user/task_0")
    honest = user.popen(STALE_BEATER, str(hb), env={"SLURM_JOB_ID": "4243", "RANK": "0"})
    cgroups.put(honest.pid, task)
    scope = str(cgroups.base / "system.slice" / "slurmstepd.scope")
    wide = str(cgroups.base / "user.slice" / "*" / "*" / "*")
    found = discover(
        hb, pids=[attack.pid, honest.pid], slurm_cgroup_roots=[scope, wide], cgroup_fs=cgroups.mount
    )
    by_pid = {p.pid: p for p in found.processes}
    assert by_pid[honest.pid].job_verified
    assert by_pid[honest.pid].restart_job_id == f"slurm:4243@uid:{user.uid}"
    assert not by_pid[attack.pid].job_verified and by_pid[attack.pid].slurm_cgroup_job is None


# -- High 2, the adapter: another user's real Slurm job ------------------------------------------


@pytest.mark.xdist_group("slurm")
def test_a_verified_job_of_another_user_is_never_requeued(
    user, shared_dir, cgroups, slurm, tmp_path
):
    """A real Slurm job runs as root. The attacker's process sits in a job cgroup of that id
    under a root slurmd's (the kernel's word: a job of the user's own would look so; here
    root put it there) and names the job: the identity check passes, and the adapter still
    refuses, because Slurm says the job is uid 0's and the process is the attacker's."""
    from node_agent.model import Action, Grade, Level, Reason
    from node_agent.remediation.store import open_store
    from node_agent.training.processes import discover
    from tests.integration.test_slurm_remediation import slurm_remediator

    job = slurm.submit()
    slurm.wait_job(job, "RUNNING")
    hb = heartbeat_spool(shared_dir)
    task = cgroups.make(f"system.slice/slurmstepd.scope/job_{job}/step_0/user/task_0")
    proc = user.popen(STALE_BEATER, str(hb), env={"SLURM_JOB_ID": job, "RANK": "0"})
    cgroups.put(proc.pid, task)
    (found,) = discover(
        hb,
        pids=[proc.pid],
        cgroup_fs=cgroups.mount,
        slurm_cgroup_roots=[str(cgroups.base / "system.slice" / "slurmstepd.scope")],
    ).processes
    job_id = found.restart_job_id
    assert job_id == f"slurm:{job}@uid:{user.uid}"
    grade = Grade(
        Level.ERROR,
        Action.RESTART,
        (Reason("training-hang", Level.ERROR, f"job:{job_id}/rank:0", "rank 0 made no step"),),
    )

    class Hung:
        suite, mode = "periodic", "service"

        def __init__(self):
            self.grade = grade

        def to_dict(self):
            return {"grade": grade.to_dict()}

    store = open_store(tmp_path / "state")
    try:
        out = slurm_remediator(store, slurm, tmp_path / "state").remediate(Hung())
    finally:
        store.close()
    (rec,) = out.records
    assert (rec.action, rec.outcome) == ("restart-job", "failed"), rec
    assert (
        f"belongs to uid 0, but the hung process that named it runs as uid {user.uid}" in rec.detail
    ), rec.detail
    fields = slurm.show_job(job)
    assert (fields["JobState"], fields["Restarts"]) == ("RUNNING", "0"), fields


# -- Medium 6 and 7: a lone surrogate in job, a NUL in log_file -----------------------------------

FORGE = r"""
import json, os, sys, time
spool, pid, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
bad = {"job": "\\ud800", "log_file": "/tmp/x\\u0000y"}[kind]
text = ('{"schema": "node-agent.heartbeat/1", "pid": %d, "step": 1, "step_at": %f, '
        '"%s": "%s"}' % (pid, time.time() - 3600, kind, bad))
own = os.path.join(spool, str(os.geteuid()))
os.makedirs(own, mode=0o700, exist_ok=True)
with open(os.path.join(own, "%d.json" % pid), "w") as f:
    f.write(text)
print("forged", flush=True)
"""


@pytest.mark.parametrize("kind", ["job", "log_file"])
def test_a_surrogate_job_or_a_nul_log_file_leaves_metrics_and_hang_detection_working(
    user, victim, shared_dir, kind
):
    from prometheus_client import CollectorRegistry, generate_latest

    from node_agent.checking.behaviour import NodeLabels, behaviour
    from node_agent.model import Result

    hb = heartbeat_spool(shared_dir)
    sleeper = user.popen("import time; print('up', flush=True); time.sleep(120)")
    user.py(FORGE, str(hb), str(sleeper.pid), kind)
    hung = victim.popen(STALE_BEATER, str(hb), env={"RANK": "0"})
    done = run_agent(*hang_check(shared_dir, hb))
    rep = report(done)
    # the victim's real hang is still found
    assert of_pid(rep, "training_hang", hung.pid), [r["metric"] for r in rep["results"]]
    # the forged file is refused, once, naming its writer
    (refused,) = [
        r for r in results(rep, "training_discovery") if f"{sleeper.pid}.json" in r["detail"]
    ]
    assert refused["status"] == "warn" and f"written by uid {user.uid}" in refused["detail"]
    assert ("lone surrogate" if kind == "job" else "NUL byte") in refused["detail"]
    # the check's own /metrics collector (the daemon's, for this check) renders this run
    factory = behaviour("training_progress").metrics
    assert factory is not None
    collector = factory(lambda: NodeLabels("n1", {}))
    run = [Result.from_dict(r) for r in rep["results"] if r["check"] == "training_progress"]
    collector.observe(run)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert f'pid="{hung.pid}"' in text and "node_agent_training_hang_suspected" in text
    # and grade --html renders the saved report
    saved = shared_dir / "report.json"
    saved.write_text(done.stdout)
    page = shared_dir / "report.html"
    graded = run_agent("grade", str(saved), "--html", str(page))
    assert graded.returncode in (0, 3, 4), graded.stderr[-2000:]
    assert str(hung.pid) in page.read_text()


# -- Medium 8: squatted names and a flood in the spool --------------------------------------------

SQUAT = r"""
import os, sys
spool, victim_uid, first_pid, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
os.mkdir(os.path.join(spool, victim_uid), 0o777)   # the victim's directory name, taken first
os.chmod(os.path.join(spool, victim_uid), 0o777)
for pid in range(first_pid, first_pid + count):    # and every pid name about to be used
    with open(os.path.join(spool, "%d.json" % pid), "w") as f:
        f.write("{}")
print("squatted", flush=True)
"""


def test_a_squatted_spool_does_not_block_or_hide_another_users_heartbeats(user, victim, shared_dir):
    from node_agent.training.processes import discover

    hb = heartbeat_spool(shared_dir)
    next_pid = int(Path("/proc/sys/kernel/ns_last_pid").read_text()) + 1
    user.py(SQUAT, str(hb), str(victim.uid), str(next_pid), "3000")
    beater = victim.popen(STALE_BEATER, str(hb), env={"RANK": "0"})
    written = Path(beater.first_line)
    # its directory's name was taken: it wrote under a name nobody could guess
    assert written.parent == hb and written.name.startswith(f"{beater.pid}.")
    found = discover(hb, pids=[beater.pid])
    (p,) = found.processes
    assert p.heartbeat is not None and p.heartbeat["step"] == 5
    assert p.heartbeat_path == str(written)
    # root took the name back for the victim (it runs a process with a heartbeat outside its
    # own directory), naming the squatter
    assert any(f"taken by uid {user.uid}" in msg for _, msg in found.problems), found.problems
    st = os.lstat(hb / str(victim.uid))
    assert (st.st_uid, st.st_mode & 0o777) == (victim.uid, 0o700)
    # the victim's next writer uses its own directory, which nobody else can write in
    again = victim.popen(STALE_BEATER, str(hb), env={"RANK": "1"})
    assert Path(again.first_line) == hb / str(victim.uid) / f"{again.pid}.json"
    assert {q.pid for q in discover(hb, pids=[again.pid]).processes if q.heartbeat} == {again.pid}


NEST = r"""
import os, sys
spool, victim_uid, depth = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.mkdir(os.path.join(spool, victim_uid), 0o755)   # the victim's directory name, taken first
fd = os.open(os.path.join(spool, victim_uid), os.O_RDONLY | os.O_DIRECTORY)
for _ in range(depth):                             # deeper than Python's recursion limit
    os.symlink("/etc/shadow", "shadow", dir_fd=fd)  # a link root must unlink, never follow
    os.mkdir("d", 0o755, dir_fd=fd)
    fd, old = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd), fd
    os.close(old)
print("nested", flush=True)
"""


def test_a_squatted_name_nested_1500_deep_is_removed_and_hang_detection_keeps_working(
    user, victim, shared_dir
):
    """Issue 34: root's removal of a squatted name recursed once per level and raised
    RecursionError at 1,500 levels, so training_progress crashed on every run. Now the tree
    is removed without recursion, the victim gets its directory, and its hang is still found."""
    hb = heartbeat_spool(shared_dir)
    user.py(NEST, str(hb), str(victim.uid), "1500", timeout=300)
    hung = victim.popen(STALE_BEATER, str(hb), env={"RANK": "0"})
    assert Path(hung.first_line).parent == hb  # its directory's name was taken
    shadow = _shadow()
    rep = report(run_agent(*hang_check(shared_dir, hb), timeout=600))
    errors = [r for r in rep["results"] if r["status"] == "error"]
    assert not errors, errors
    assert of_pid(rep, "training_hang", hung.pid), [r["metric"] for r in rep["results"]]
    (taken,) = [r for r in results(rep, "training_discovery") if "was taken by" in r["detail"]]
    assert taken["status"] == "warn" and f"taken by uid {user.uid}" in taken["detail"]
    assert "removed it" in taken["detail"], taken["detail"]
    # nothing of the squat is left, the victim's own directory stands, /etc/shadow untouched
    assert sorted(p.name for p in hb.iterdir() if p.name.startswith(".")) == []
    st = os.lstat(hb / str(victim.uid))
    assert (st.st_uid, st.st_mode & 0o777) == (victim.uid, 0o700)
    assert _shadow() == shadow


def _shadow() -> tuple[int, int, int, str]:
    """What the squat aims at in /etc/shadow: its owner, group, mode and root's entry. (Not its
    inode or times: another test's useradd, on another worker, rewrites the file.)"""
    st = os.lstat("/etc/shadow")
    root = next(
        line for line in Path("/etc/shadow").read_text().splitlines() if line.startswith("root:")
    )
    return st.st_uid, st.st_gid, st.st_mode, root


FLOOD = r"""
import os, sys
where, count = sys.argv[1], int(sys.argv[2])
os.makedirs(where, mode=0o700, exist_ok=True)
for i in range(count):
    os.close(os.open(os.path.join(where, "%06d.json" % i), os.O_CREAT | os.O_WRONLY, 0o600))
print("flooded", flush=True)
"""


def test_a_70000_entry_flood_hides_no_other_users_heartbeat(user, victim, shared_dir):
    """70,000 junk names in the attacker's own directory, and 70,000 more in the shared one:
    each uid's directory is read with caps of its own, and is found from the uids running
    processes, not from the shared directory's listing."""
    from node_agent.heartbeat import SPOOL_MAX_LISTED, read_heartbeat_files

    hb = heartbeat_spool(shared_dir)
    user.py(FLOOD, str(hb / str(user.uid)), "70000", timeout=300)
    user.py(FLOOD, str(hb), "70000", timeout=300)
    assert 70000 > SPOOL_MAX_LISTED
    user.popen("import time; print('up', flush=True); time.sleep(120)")  # its uid is live
    beater = victim.popen(STALE_BEATER, str(hb), env={"RANK": "0"})
    errors: list = []
    beats = read_heartbeat_files(hb, errors)
    mine = [b for b in beats if b.data["pid"] == beater.pid]
    assert [b.uid for b in mine] == [victim.uid], [str(b.path) for b in beats[:5]]
    assert mine[0].path == hb / str(victim.uid) / f"{beater.pid}.json"
    flooded = {str(path) for path, why in errors if "holds more than" in why}
    assert flooded == {str(hb), str(hb / str(user.uid))}, flooded


def test_grade_html_renders_a_saved_report_that_carries_a_lone_surrogate(shared_dir):
    """The spool readers refuse such text; a report that got one some other way (an older
    agent's, a report edited by hand) is still rendered, the surrogate written as its escape."""
    rep = {
        "schema": "node-agent.report/1",
        "agent_version": "0",
        "simulated": True,
        "host": {"hostname": "n1", "kernel": "k", "driver": None, "cuda": None},
        "gpus": [],
        "suite": "quick",
        "started_at": "2026-01-01T00:00:00Z",
        "finished_at": "2026-01-01T00:00:01Z",
        "grade": {"level": "HEALTHY", "action": "none", "reasons": []},
        "actions": [],
        "results": [
            {
                "check": "training_progress",
                "target": "job:\ud800/rank:0",
                "metric": "training_progress",
                "value": 1.0,
                "unit": "s",
                "status": "pass",
                "detail": "job \ud800 steps",
                "evidence": {"job": "\ud800", "pid": 5},
                "duration_s": 0.1,
            }
        ],
    }
    saved = shared_dir / "old.json"
    saved.write_text(json.dumps(rep))  # ensure_ascii: \ud800 as JSON writes it
    page = shared_dir / "old.html"
    done = run_agent("grade", str(saved), "--html", str(page))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "job \\ud800 steps" in page.read_text()
