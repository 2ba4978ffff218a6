"""Issue 27's trust boundary for the kernel's own distress: what a user can make the kernel print.

``kernel_distress`` reads the kernel log for hung tasks, lockups, OOM kills, NVMe timeouts,
read-only filesystems and machine checks, and some of those grade ERROR (a drain and a reboot).
The kernel quotes names users choose (a task's ``comm``, a mapped file's name), and users can
cause some distress for real. Each attack is played by a real ``useradd`` user (conftest.py)
against root's ``node-agent check --act``, in real mode, with the records in the kernel log the
agent reads (``kernel_log.path``, a file root owns: no test reads the host's log):

- the user segfaults in a file *named* after a distress line, with its process named after one
  too (``BUG: soft lockup``, cut to 15 characters by the kernel): the kernel's own segfault
  record, read back from ``/dev/kmsg`` (or built exactly as arch/x86/mm/fault.c prints it where
  this kernel logs no user segfaults, said in the output), must leave the node HEALTHY;
- the user really makes the kernel OOM-kill its process, named ``BUG: soft lockup``, in a
  memory cgroup root made for it (cgroup v1 ``memory.limit_in_bytes`` or v2 ``memory.max``): the
  kernel's own ``oom-kill:`` and ``Memory cgroup out of memory: Killed process`` records, read
  back from ``/dev/kmsg``, grade WARN at most and never act (emulated exactly, and said, where no
  memory cgroup can be made or kmsg read);
- a hung task of the user's real process named ``BUG: soft lockup``: a user can put a task in
  D state (a FUSE mount that never answers), but the kernel reports it only after
  ``hung_task_timeout_secs`` (120 s by default; lowering it is a host-wide setting a test must
  not touch), so the record is built exactly as kernel/hung_task.c prints it for that process
  (its real comm and pid), and said: WARN at most, no action.

A genuine soft lockup record in the same log grades ERROR (the control: the log was read).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from test_attacks_kernel_log import (  # tests/security, same dir
    _kmsg_records,
    run_agent,
    segfault_record,
)

REPO = Path(__file__).resolve().parents[2]
NAME = "BUG: soft lockup"  # what the user names its process; the kernel keeps 15 characters

#: distress lines a user names a file after (no "/" in a file name)
FILE_NAMES = {
    "soft_lockup": "watchdog: BUG: soft lockup - CPU#0 stuck for 23s! [python3:1]",
    "hard_lockup": "watchdog: CPU0: Watchdog detected hard LOCKUP on cpu 0",
    "fs_readonly": "EXT4-fs (nvme0n1p1): Remounting filesystem read-only",
    "nvme": "nvme nvme0: controller is down; will reset: CSTS=0xffffffff, PCI_STATUS=0xffff",
    "mce_fatal": "mce: [Hardware Error]: Machine check: Processor context corrupt",
}

GENUINE_SOFT_LOCKUP = (
    "0,{seq},{usec},-;watchdog: BUG: soft lockup - CPU#3 stuck for 23s! [kworker:311]"
)

#: the user's program for the OOM: take the name, say the pid, wait until root has put it in
#: the memory cgroup named by argv[2], then fill memory until the kernel kills it
FILL_MEMORY = r"""
import ctypes, os, sys, time
ctypes.CDLL(None).prctl(15, sys.argv[1].encode()[:15], 0, 0, 0)
print(os.getpid(), flush=True)
deadline = time.monotonic() + 30
while sys.argv[2] not in open("/proc/self/cgroup").read():
    if time.monotonic() > deadline:
        sys.exit(2)
    time.sleep(0.05)
held = []
while True:
    held.append(bytearray(1 << 20))
"""


def check(config: Path, *extra: str) -> tuple[int, dict]:
    done = run_agent("check", *extra, "--json", "--config", str(config))
    assert done.returncode in (0, 3, 4), done.stderr[-3000:]
    return done.returncode, json.loads(done.stdout)


def distress(report: dict) -> list[dict]:
    return [
        r
        for r in report["results"]
        if r["check"] == "kernel_distress" and r["status"] in ("warn", "fail", "error")
    ]


@pytest.mark.parametrize("form", sorted(FILE_NAMES))
def test_segfault_in_a_file_named_like_a_distress_line_leaves_check_act_healthy(
    user, attack_dir, node, form
):
    config, kernel_log = node
    record, recorded_by = segfault_record(user, attack_dir, FILE_NAMES[form], NAME)
    print(f"record ({recorded_by}): {record}")
    kernel_log.write_text(record + "\n")
    code, report = check(config, "--act")
    assert code == 0 and report["actions"] == [], report["grade"]
    assert distress(report) == [], distress(report)
    # the control: the kernel's own soft lockup record in the same log is graded ERROR
    kernel_log.write_text(
        record + "\n" + GENUINE_SOFT_LOCKUP.format(seq=90002, usec=404608999) + "\n"
    )
    code, report = check(config)
    assert code == 3 and [r["metric"] for r in distress(report)] == ["soft_lockup"]


def _memory_cgroup() -> Path | None:
    """A fresh memory cgroup root may limit to 48 MiB (cgroup v1 or v2), or None."""
    name = f"na-attk-oom-{uuid.uuid4().hex[:8]}"
    v1, v2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
    candidates = []
    if (v1 / "cgroup.procs").exists():
        candidates.append((v1, "memory.limit_in_bytes"))
    try:
        if "memory" in (v2 / "cgroup.subtree_control").read_text().split():
            candidates.append((v2, "memory.max"))
    except OSError:
        pass
    for base, limit in candidates:
        try:
            (base / name).mkdir()
        except OSError:
            continue
        try:
            (base / name / limit).write_text(str(48 << 20))
            return base / name
        except OSError:
            (base / name).rmdir()
    return None


def _kill_records_of(pid: int) -> list[str]:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        mine = [r for r in _kmsg_records() if f",pid={pid}," in r or f"Killed process {pid} (" in r]
        if any("Killed process" in r for r in mine):
            return mine
        time.sleep(0.1)
    return []


def test_a_users_real_oom_kill_named_like_a_lockup_is_warn_at_most_and_never_acts(user, node):
    config, kernel_log = node
    cgroup = _memory_cgroup()
    records: list[str] = []
    recorded_by = "emulated: no memory cgroup could be made here or /dev/kmsg is unreadable"
    if cgroup is not None and os.access("/dev/kmsg", os.R_OK):
        try:
            child = user.popen(FILL_MEMORY, NAME, cgroup.name)
            pid = int(child.first_line)
            (cgroup / "cgroup.procs").write_text(str(pid))
            try:
                child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            records = _kill_records_of(pid)
            if records:
                recorded_by = "the kernel (read back from /dev/kmsg)"
        finally:
            for _ in range(50):
                try:
                    cgroup.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
    if not records:  # mm/oom_kill.c, dump_oom_summary and __oom_kill_process, as printed
        pid = 4406
        records = [
            f"6,1525,4236730401,-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),"
            f"cpuset=/,mems_allowed=0,oom_memcg=/x,task_memcg=/x,task={NAME[:15]},"
            f"pid={pid},uid={user.uid}",
            f"3,1526,4236730427,-;Memory cgroup out of memory: Killed process {pid} "
            f"({NAME[:15]}) total-vm:49460kB, anon-rss:39552kB, file-rss:6632kB, "
            f"shmem-rss:0kB, UID:{user.uid} pgtables:136kB oom_score_adj:0",
        ]
    print(f"records ({recorded_by}):", *records, sep="\n")
    kernel_log.write_text("\n".join(records) + "\n")
    code, report = check(config, "--act")
    assert code == 0 and report["actions"] == [], report["grade"]
    assert report["grade"]["level"] in ("HEALTHY", "WARN")
    found = distress(report)
    assert [r["metric"] for r in found] == ["oom_kill"]
    assert f"{NAME[:15]}:" in found[0]["detail"] and found[0]["status"] == "warn"


def test_a_users_hung_task_named_like_a_lockup_is_warn_at_most_and_never_acts(user, node):
    config, kernel_log = node
    child = user.popen(
        "import ctypes, os, sys, time\nctypes.CDLL(None).prctl(15, sys.argv[1]"
        ".encode()[:15], 0, 0, 0)\nprint(os.getpid(), flush=True)\ntime.sleep(60)",
        NAME,
    )
    pid = int(child.first_line)
    comm = Path(f"/proc/{pid}/comm").read_text().rstrip("\n")
    assert comm == NAME[:15]
    # kernel/hung_task.c check_hung_task, as printed for this process (emulated: see above)
    record = f"3,2001,500000000,-;INFO: task {comm}:{pid} blocked for more than 122 seconds."
    print(f"record (emulated: the kernel reports a hung task after 120 s): {record}")
    kernel_log.write_text(record + "\n")
    code, report = check(config, "--act")
    assert code == 0 and report["actions"] == [], report["grade"]
    found = distress(report)
    assert [(r["metric"], r["status"]) for r in found] == [("hung_task", "warn")]
    assert f"{comm}:{pid}" in found[0]["detail"]
