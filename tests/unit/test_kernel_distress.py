"""The ``kernel_distress`` check: the kernel's own distress lines, read only where the kernel wrote
them, folded per kind and device, graded by the shipped rules; rasdaemon's summary; pstore.

Every line form is the one Linux prints, with the function that prints it (the forms are in
``node_agent.kernel_log_distress.DistressLine``); the example values (task names, devices, times) are
made up, the text around them is the kernel's format string:

- hung task: kernel/hung_task.c ``check_hung_task``, ``"INFO: task %s:%d blocked for more than
  %ld seconds.\\n"``; soft lockup: kernel/watchdog.c ``watchdog_timer_fn``, ``"BUG: soft lockup -
  CPU#%d stuck for %us! [%s:%d]\\n"`` under ``pr_fmt "watchdog: "`` (``NMI watchdog:`` before
  4.15); hard lockup: ``"Watchdog detected hard LOCKUP on cpu %d\\n"`` (kernel/watchdog_hld.c),
  ``"CPU%u: Watchdog detected hard LOCKUP on cpu %u\\n"`` (kernel/watchdog.c, 6.5+);
- OOM: mm/oom_kill.c ``__oom_kill_process`` ``"%s: Killed process %d (%s) total-vm:%lukB,
  anon-rss:%lukB, file-rss:%lukB, shmem-rss:%lukB, UID:%u pgtables:%lukB oom_score_adj:%hd\\n"``
  and ``dump_oom_summary`` ``"oom-kill:constraint=%s,nodemask=%*pbl" ...``;
- NVMe: drivers/nvme/host/pci.c ``nvme_timeout`` (``"I/O %d QID %d timeout, reset
  controller\\n"``; 6.x ``"I/O tag %d (%04x) opcode %#x (%s) QID %d timeout, aborting req_op:%s(%u)
  size:%u\\n"``) and ``nvme_warn_reset`` (``"controller is down; will reset: CSTS=%#x,
  PCI_STATUS=%#x\\n"``), printed with ``dev_warn`` on the controller (``nvme nvme0: ``);
- read-only: fs/ext4/super.c ``ext4_handle_error`` (``"Remounting filesystem read-only"`` through
  ``ext4_msg``: ``EXT4-fs (%s): ``), fs/xfs/xfs_fsops.c ``xfs_do_force_shutdown`` (``"%s (0x%x)
  detected at %pS (%s:%d).  Shutting down filesystem."``), btrfs ``"forced readonly"``;
- NFS: net/sunrpc/clnt.c ``call_timeout`` ``"%s: server %s not responding, still trying\\n"``;
  Lustre: lustre/ptlrpc/import.c ``"%s: Connection to %s (at %s) was lost; in progress operations
  using this service will wait for recovery to complete\\n"``;
- MCE: arch/x86/kernel/cpu/mce/core.c ``mce_notify_irq`` (``HW_ERR "Machine check events
  logged\\n"``), ``__print_mce`` (``HW_ERR "CPU %d: Machine Check%s: %Lx Bank %d: %016Lx\\n"``),
  ``mce_panic`` (``"Fatal machine check"``); mm/memory-failure.c ``action_result``
  (``"%#lx: recovery action for %s: %s\\n"`` under ``pr_fmt "Memory failure: "``);
- rasdaemon: util/ras-mc-ctl.in, ``summary``: ``"MCE records summary:\\n"`` then ``"\\t$count
  $msg errors\\n"`` per distinct ``error_msg``, or ``"No MCE errors.\\n"``;
- pstore: fs/pstore/platform.c ``pstore_dump``: each part starts ``"%s#%d Part%u\\n"`` (reason,
  dump count, part).

The node is simulated only for its inventory and grader; the check reads a list of lines
(``LinesKernelLog``, as the simulator gives it) or kmsg records with their facility.
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path

import pytest
import yaml

from node_agent.checking.context import HOST_PORTS
from node_agent.checks import kernel_distress as kd
from node_agent.config import Config, config_from_dict, load_config
from node_agent.environment import open_environment
from node_agent.kernel_log import FileKernelLog, LinesKernelLog, LogRecord
from node_agent.kernel_log_distress import parse_distress, scan_distress
from node_agent.model import Level, Status

#: (line as the kernel prints it, kind, subject, process)
FORMS = [
    ("INFO: task python3:4242 blocked for more than 122 seconds.", "hung_task", None, "python3"),
    (
        "INFO: task kworker/u16:2:811 blocked for more than 120 seconds.",
        "hung_task",
        None,
        "kworker/u16:2",
    ),
    (
        "watchdog: BUG: soft lockup - CPU#12 stuck for 23s! [python3:1234]",
        "soft_lockup",
        None,
        "python3",
    ),
    (
        "NMI watchdog: BUG: soft lockup - CPU#3 stuck for 22s! [kworker/3:1:311]",
        "soft_lockup",
        None,
        "kworker/3:1",
    ),
    ("BUG: soft lockup - CPU#0 stuck for 67s! [swapper/0:0]", "soft_lockup", None, "swapper/0"),
    ("watchdog: Watchdog detected hard LOCKUP on cpu 7", "hard_lockup", None, None),
    ("watchdog: CPU7: Watchdog detected hard LOCKUP on cpu 7", "hard_lockup", None, None),
    (
        "Out of memory: Killed process 5123 (python3) total-vm:98765432kB, anon-rss:8765432kB, "
        "file-rss:0kB, shmem-rss:0kB, UID:1001 pgtables:17000kB oom_score_adj:0",
        "oom_kill",
        None,
        "python3",
    ),
    (
        "Memory cgroup out of memory: Killed process 5124 (pt_main_thread) total-vm:1000kB, "
        "anon-rss:900kB, file-rss:0kB, shmem-rss:0kB, UID:1001 pgtables:100kB oom_score_adj:0",
        "oom_kill",
        None,
        "pt_main_thread",
    ),
    (
        "oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0-1,"
        "oom_memcg=/slurm/uid_1001/job_77,task_memcg=/slurm/uid_1001/job_77/step_0,task=python3,"
        "pid=5124,uid=1001",
        "oom_summary",
        None,
        "python3",
    ),
    ("nvme nvme0: I/O 123 QID 4 timeout, reset controller", "nvme_timeout", "nvme0", None),
    (
        "nvme nvme1: I/O tag 28 (401c) opcode 0x2 (I/O Cmd) QID 1 timeout, aborting "
        "req_op:READ(0) size:4096",
        "nvme_timeout",
        "nvme1",
        None,
    ),
    (
        "nvme nvme0: controller is down; will reset: CSTS=0xffffffff, PCI_STATUS=0xffff",
        "nvme_reset",
        "nvme0",
        None,
    ),
    ("nvme nvme2: Removing after probe failure status: -19", "nvme_failed", "nvme2", None),
    ("EXT4-fs (nvme0n1p1): Remounting filesystem read-only", "fs_readonly", "nvme0n1p1", None),
    (
        "XFS (md0): Corruption of in-memory data (0x8) detected at xfs_trans_cancel+0x13c/0x150 "
        "(fs/xfs/xfs_trans.c:1097).  Shutting down filesystem.",
        "fs_readonly",
        "md0",
        None,
    ),
    (
        "XFS (dm-3): Filesystem has been shut down due to log error (0x2).",
        "fs_readonly",
        "dm-3",
        None,
    ),
    ("BTRFS error (device sdb1): forced readonly", "fs_readonly", "sdb1", None),
    ("nfs: server storage01 not responding, still trying", "nfs_not_responding", "storage01", None),
    ("nfs: server storage01 OK", "nfs_ok", "storage01", None),
    (
        "Lustre: scratch-MDT0000-mdc-ffff9c1e8b3f4000: Connection to scratch-MDT0000 (at "
        "10.0.0.2@o2ib) was lost; in progress operations using this service will wait for recovery "
        "to complete",
        "lustre_lost",
        "scratch-MDT0000",
        None,
    ),
    ("mce: [Hardware Error]: Machine check events logged", "mce_logged", None, None),
    (
        "mce: [Hardware Error]: CPU 0: Machine Check: 0 Bank 7: 8c00004000010090",
        "mce_record",
        None,
        None,
    ),
    (
        "mce: [Hardware Error]: CPU 3: Machine Check Exception: 5 Bank 4: be00000000800400",
        "mce_record",
        None,
        None,
    ),
    ("mce: [Hardware Error]: Machine check: Processor context corrupt", "mce_fatal", None, None),
    ("Kernel panic - not syncing: Fatal machine check", "mce_fatal", None, None),
    (
        "Memory failure: 0x3f2a1: recovery action for dirty LRU page: Recovered",
        "memory_failure",
        None,
        None,
    ),
    # before 5.0 (mm/oom_kill.c, oom_kill_process): the victim named first, then killed
    (
        "Out of memory: Kill process 21518 (python2) score 752 or sacrifice child",
        "oom_kill",
        None,
        "python2",
    ),
    (
        "Memory cgroup out of memory: Kill process 42453 (memcg_test_1) score 0 or sacrifice child",
        "oom_kill",
        None,
        "memcg_test_1",
    ),
    (
        "Killed process 42453 (memcg_test_1), UID 0, total-vm:7296kB, anon-rss:96kB, "
        "file-rss:164kB, shmem-rss:0kB",
        "oom_kill",
        None,
        "memcg_test_1",
    ),
    # fs/file_table.c, alloc_empty_file
    ("VFS: file-max limit 1000000 reached", "file_max", None, None),
    # an EDAC driver that decodes the memory error prints the bank record itself
    # (drivers/edac/skx_common.c; github.com/ovro-lwa/lwa-issues/issues/117: UC set)
    (
        "EDAC skx MC3: CPU 10: Machine Check Event: 0 Bank 8: fc00010001010092",
        "mce_record",
        None,
        None,
    ),
    # drivers/edac/sb_edac.c (github.com/radiasoft/devops/issues/134: UC clear)
    (
        "EDAC sbridge MC1: CPU 1: Machine Check Event: 0 Bank 11: 8c00004f000800c2",
        "mce_record",
        None,
        None,
    ),
    # drivers/edac/edac_mc.c, edac_ce_error / edac_ue_error
    (
        "EDAC MC1: 1 CE memory scrubbing error on CPU_SrcID#1_Ha#0_Chan#0_DIMM#0 (channel:0 "
        "slot:0 page:0xee30a0 offset:0x0 grain:32 syndrome:0x0 -  area:DRAM err_code:0008:00c2 "
        "socket:1 ha:0 channel_mask:1 rank:0)",
        "edac_error",
        None,
        None,
    ),
    (
        "EDAC MC3: 1 UE memory read error on CPU_SrcID#1_MC#1_Chan#2_DIMM#0 (channel:2 slot:0 "
        "page:0xb757589 offset:0xdc0 grain:32 -  err_code:0x0000:0x0090 SystemAddress:0xb757589dc0)",
        "edac_error",
        None,
        None,
    ),
]

#: what a log puts in front of the kernel's message (docs/xid.md, "Rules of belief")
PREFIXES = [
    "",
    "[ 1843.308145] ",
    "[Sun Feb 23 16:24:18 2025] ",
    "2025-02-23T16:24:18,123456+00:00 ",
    "kern  :err   : [ 1843.308145] ",
    "Dec  2 11:38:27 worker4 kernel: [  218.25] ",
    "6,3964,206764307,-;",
]


@pytest.fixture
def env(tmp_path):
    """A simulated 8-GPU H100 node (no faults): its inventory, config and shipped grader."""
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "state_dir": str(tmp_path / "state"),
                "host": {"ras_mc_ctl": "ras-mc-ctl-not-installed-here"},
            }
        )
    )
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(yaml.safe_dump({"sku": "h100-sxm5-80gb", "gpus": 8}))
    environment = open_environment(load_config(config), str(scenario))
    yield environment
    environment.close()


def run_check(env, lines=None, log=None, state_dir=None, graders=None, **params):
    """The check on this host's path (no scenario): pstore at a directory of the test's own;
    ``graders``: an operator's graders directory (its kernel.yaml holds the thresholds)."""
    params.setdefault("pstore_root", "/nonexistent/pstore")
    params.setdefault("pstore_archive", "/nonexistent/pstore-archive")
    config = env.config
    if graders is not None:  # the env's config with the operator's graders directory
        config = config_from_dict(
            {
                "state_dir": str(config.state_dir),
                "host": {"ras_mc_ctl": config.host.ras_mc_ctl},
                "graders_dir": str(graders),
            }
        )
    ctx = env.check_context(
        "kernel_distress",
        "service",
        params,
        kernel_log=log if log is not None else LinesKernelLog(lines or []),
        config=config,
        state_dir=state_dir,
        ports=HOST_PORTS,
    )
    return kd.run(ctx)


def finding(results, metric):
    (found,) = [r for r in results if r.metric == metric]
    return found


def grade(env, results):
    return env.grader.grade(results, "service")


# --- the forms --------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", PREFIXES, ids=lambda p: p.strip()[:12] or "bare")
@pytest.mark.parametrize(
    "line,kind,subject,process", FORMS, ids=[f[1] + str(i) for i, f in enumerate(FORMS)]
)
def test_every_distress_form_is_read_behind_every_prefix(line, kind, subject, process, prefix):
    event = parse_distress(prefix + line)
    assert event is not None, prefix + line
    assert (event.kind, event.subject, event.process) == (kind, subject, process)


def test_mce_status_bits_say_corrected_uncorrected_and_context_corrupt():
    corrected = parse_distress(FORMS[22][0])
    fatal = parse_distress(FORMS[23][0])
    assert (corrected.field("uncorrected"), corrected.field("context_corrupt")) == (False, False)
    assert (fatal.field("uncorrected"), fatal.field("context_corrupt")) == (True, True)
    assert fatal.field("bank") == 4 and fatal.field("cpu") == 3


def test_an_edac_drivers_bank_record_and_the_memory_controllers_ce_and_ue_are_read():
    skx_uc, sbridge_ce, edac_ce, edac_ue = (parse_distress(f[0]) for f in FORMS[-4:])
    assert (skx_uc.field("uncorrected"), skx_uc.field("cpu"), skx_uc.field("bank")) == (True, 10, 8)
    assert skx_uc.field("exception") is False and sbridge_ce.field("uncorrected") is False
    assert (edac_ce.field("uncorrected"), edac_ce.field("count"), edac_ce.field("mc")) == (
        False,
        1,
        1,
    )
    assert edac_ce.field("dimm") == "CPU_SrcID#1_Ha#0_Chan#0_DIMM#0"
    assert edac_ce.field("what") == "memory scrubbing error"
    assert (edac_ue.field("uncorrected"), edac_ue.field("dimm")) == (
        True,
        "CPU_SrcID#1_MC#1_Chan#2_DIMM#0",
    )


def test_an_uncorrected_memory_error_an_edac_driver_decoded_grades_error_naming_the_dimm(env):
    """On Intel and AMD servers an EDAC driver decodes a memory machine check, and the kernel's
    own "CPU n: Machine Check" record is not printed: before, such a log read as a corrected
    machine check (WARN) though its DIMM had an uncorrected error."""
    logged = FORMS[21][0]
    decoded = run_check(env, [logged, FORMS[-4][0]])
    assert finding(decoded, "mce_uncorrected").status is Status.FAIL
    assert grade(env, decoded).level is Level.ERROR
    summary = run_check(env, [logged, FORMS[-1][0]])
    uncorrected = finding(summary, "mce_uncorrected")
    assert "MC3 CPU_SrcID#1_MC#1_Chan#2_DIMM#0" in uncorrected.detail
    assert grade(env, summary).level is Level.ERROR
    corrected = run_check(env, [FORMS[-2][0]])
    assert finding(corrected, "mce_corrected").status is Status.WARN
    assert grade(env, corrected).level is Level.WARN


def test_oom_summary_reads_the_uid_the_kernel_printed_not_one_in_the_task_name():
    """The task name (15 characters, the user's) cannot stand in for the tail the kernel writes."""
    line = (
        "oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0,"
        "global_oom,task_memcg=/user.slice/a,task=x,pid=1,uid=0,pid=777,uid=1001"
    )
    event = parse_distress(line)
    assert (event.pid, event.field("uid"), event.field("scope")) == (777, 1001, "global")


# --- the rules of belief ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "line",
    [
        # a user's program's syslog line, the same text
        "Dec  2 11:38:27 worker4 python3[77]: watchdog: BUG: soft lockup - CPU#1 stuck for 23s! [x:1]",
        # dmesg --decode: the user facility
        "user  :warn  : [ 12.5] watchdog: BUG: soft lockup - CPU#1 stuck for 23s! [x:1]",
        # a write to /dev/kmsg: facility 1 (prio 12 = 1 << 3 | 4), devkmsg_write
        "12,4001,5000000,-;watchdog: BUG: soft lockup - CPU#1 stuck for 23s! [x:1]",
        # the kernel's report of a user's segfault in a file named after a distress line
        "[ 12.5] python3[4242]: segfault at 0 ip 00007f29 sp 00007ffc error 6 in watchdog: BUG: soft "
        "lockup - CPU#0 stuck for 23s! [x:1][7f294070e000+1000]",
        # ... by a process named after one (15 characters of it)
        "[ 12.5] BUG: soft locku[4242]: segfault at 0 ip 00007f29 sp 00007ffc error 6 in x[0+1000]",
        "[ 12.5] nvme nvme0: I/O[4242]: segfault at 0 ip 00007f29 sp 00007ffc error 6 in QID 1 "
        "timeout, reset controller[0+1000]",
        # a form in the middle of a line is never searched
        "[ 12.5] sshd: note INFO: task python3:1 blocked for more than 120 seconds.",
        "[ 12.5] x EXT4-fs (sda1): Remounting filesystem read-only",
        # a memory controller's UE, written by a user's program to syslog or /dev/kmsg
        "Dec  2 11:38:27 worker4 python3[77]: EDAC MC0: 1 UE memory read error on DIMM_A1 (x)",
        "12,4001,5000000,-;EDAC MC0: 1 UE memory read error on DIMM_A1 (channel:0 slot:0)",
    ],
)
def test_lines_the_kernel_did_not_write_as_distress_are_refused(line):
    assert parse_distress(line) is None


def test_a_hung_task_named_like_a_soft_lockup_is_a_hung_task_at_most():
    """A process named ``BUG: soft lockup`` (cut to 15 characters by the kernel) that hangs is
    quoted inside the hung-task form: it stays a hung task (WARN), never a lockup."""
    event = parse_distress(
        "[ 200.1] INFO: task BUG: soft locku:4242 blocked for more than 120 seconds."
    )
    assert (event.kind, event.process, event.pid) == ("hung_task", "BUG: soft locku", 4242)


def test_user_facility_records_and_later_lines_of_a_record_give_nothing():
    records = [
        LogRecord(1, "INFO: task a:1 blocked for more than 120 seconds.", 1.0, facility=1),
        LogRecord(2, "x\nwatchdog: BUG: soft lockup - CPU#1 stuck for 23s! [x:1]", 2.0, facility=0),
        LogRecord(3, "INFO: task b:2 blocked for more than 120 seconds.", 3.0, facility=0),
    ]
    assert [(e.kind, e.process) for e in scan_distress(records)] == [("hung_task", "b")]


def test_a_user_facility_record_in_a_saved_log_is_refused_by_the_check(env, tmp_path):
    saved = tmp_path / "kmsg.txt"
    saved.write_text(
        "12,1,5000000,-;watchdog: BUG: soft lockup - CPU#1 stuck for 23s! [x:1]\n"
        "4,2,6000000,-;INFO: task python3:4242 blocked for more than 120 seconds.\n"
    )
    saved.chmod(0o644)
    results = run_check(env, log=FileKernelLog(str(saved)))
    assert [r.metric for r in results if r.status is not Status.PASS] == ["hung_task", "ras_mce"]


# --- grades -----------------------------------------------------------------------------------


def test_hung_task_grades_warn_naming_the_task(env):
    results = run_check(
        env, ["[ 363.2] INFO: task python3:4242 blocked for more than 122 seconds."]
    )
    hung = finding(results, "hung_task")
    assert hung.status is Status.WARN and "python3:4242" in hung.detail
    g = grade(env, results)
    assert g.level is Level.WARN and g.reasons[0].rule == "kernel-hung-task"


def test_hung_task_never_grades_above_warn_even_as_a_fail(env):
    results = run_check(env, ["INFO: task a:1 blocked for more than 122 seconds."])
    finding(results, "hung_task").status = Status.FAIL
    assert grade(env, results).level is Level.WARN


@pytest.mark.parametrize(
    "line,metric",
    [
        (
            "[ 400.1] watchdog: BUG: soft lockup - CPU#12 stuck for 23s! [python3:1234]",
            "soft_lockup",
        ),
        ("[ 400.1] watchdog: CPU7: Watchdog detected hard LOCKUP on cpu 7", "hard_lockup"),
    ],
)
def test_lockups_grade_error(env, line, metric):
    results = run_check(env, [line])
    assert finding(results, metric).status is Status.FAIL
    g = grade(env, results)
    assert (g.level, g.reasons[0].rule) == (Level.ERROR, "kernel-soft-lockup")


def test_oom_kill_grades_warn_naming_the_process_global_or_not(env):
    lines = [FORMS[9][0], FORMS[7][0], FORMS[8][0]]
    results = run_check(env, lines)
    oom = finding(results, "oom_kill")
    assert oom.status is Status.WARN and oom.value == 2
    assert "python3:5123" in oom.detail and "pt_main_thread:5124" in oom.detail
    assert oom.evidence["scopes"] == ["memcg"]
    assert grade(env, results).level is Level.WARN


def test_nvme_timeout_warns_and_repeated_timeouts_grade_error_naming_the_disk(env):
    once = run_check(env, ["[ 500.1] nvme nvme0: I/O 123 QID 4 timeout, reset controller"])
    assert (finding(once, "nvme_timeout").target, grade(env, once).level) == (
        "disk:nvme0",
        Level.WARN,
    )
    lines = [
        f"[ {500 + i}.1] nvme nvme0: I/O {100 + i} QID 4 timeout, reset controller"
        for i in range(2)
    ] + ["[ 503.0] nvme nvme0: controller is down; will reset: CSTS=0xffffffff, PCI_STATUS=0xffff"]
    repeated = run_check(env, lines)
    result = finding(repeated, "nvme_timeout")
    assert (result.target, result.status, result.value) == ("disk:nvme0", Status.FAIL, 3)
    g = grade(env, repeated)
    assert (g.level, g.reasons[0].target) == (Level.ERROR, "disk:nvme0")


def test_an_nvme_controller_removed_grades_error_at_once(env):
    results = run_check(env, ["nvme nvme2: Removing after probe failure status: -19"])
    assert grade(env, results).level is Level.ERROR


def test_read_only_filesystem_grades_error_naming_the_device(env):
    results = run_check(env, ["[ 9.1] EXT4-fs (nvme0n1p1): Remounting filesystem read-only"])
    g = grade(env, results)
    assert (g.level, g.reasons[0].target) == (Level.ERROR, "disk:nvme0n1p1")


def test_nfs_and_lustre_lost_grade_warn_naming_the_server(env):
    results = run_check(env, [FORMS[18][0], FORMS[20][0], FORMS[19][0]])
    nfs = finding(results, "nfs_not_responding")
    assert nfs.status is Status.WARN and "storage01" in nfs.detail
    assert "answered again" in nfs.detail
    assert finding(results, "lustre_connection_lost").evidence["subject"] == "scratch-MDT0000"
    assert grade(env, results).level is Level.WARN


def test_corrected_machine_checks_warn_and_fatal_ones_grade_error(env, tmp_path):
    corrected = run_check(env, [FORMS[22][0], FORMS[21][0]])
    assert finding(corrected, "mce_corrected").status is Status.WARN
    assert grade(env, corrected).level is Level.WARN
    graders = tmp_path / "graders"
    graders.mkdir()
    (graders / "kernel.yaml").write_text("mce_corrected_warn: 5\n")
    below = finding(run_check(env, [FORMS[21][0]], graders=graders), "mce_corrected")
    assert below.status is Status.PASS and below.evidence["mce_corrected_warn"] == 5
    fatal = run_check(env, [FORMS[23][0], FORMS[24][0], FORMS[25][0]])
    assert finding(fatal, "mce_fatal").status is Status.FAIL
    assert grade(env, fatal).level is Level.ERROR
    failure = run_check(env, [FORMS[26][0]])
    assert grade(env, failure).level is Level.ERROR


def test_flood_of_hung_tasks_is_one_finding_with_count_bursts_and_capped_names(env):
    lines = [
        f"[{1000.0 + i:10.3f}] INFO: task w{i}:{i} blocked for more than 120 seconds."
        for i in range(5000)
    ]
    lines += [
        f"[{9000.0 + i:10.3f}] INFO: task v:{i} blocked for more than 120 seconds."
        for i in range(3)
    ]
    hung = finding(run_check(env, lines), "hung_task")
    assert hung.value == 5003 and hung.evidence["bursts"] == 2
    assert len(hung.evidence["names"]) == 16 and hung.detail.count(":") < 40
    assert hung.evidence["first_seen"] == "1000.000 s after boot"


def test_a_quiet_log_passes_and_says_how_much_it_read(env):
    results = run_check(env, ["[ 1.0] Linux version 6.8.0", "[ 2.0] nvme nvme0: 8/0/0 default"])
    assert finding(results, "kernel_distress").status is Status.PASS
    assert "2 lines read" in finding(results, "kernel_distress").detail


def test_since_last_run_reports_each_line_once(env, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    log = LinesKernelLog(["INFO: task a:1 blocked for more than 120 seconds."])
    first = run_check(env, log=log, state_dir=state, since="last_run")
    again = run_check(env, log=log, state_dir=state, since="last_run")
    assert finding(first, "hung_task").value == 1
    assert sorted(r.metric for r in again if r.status is not Status.SKIP) == [
        "kernel_distress",
        "pstore_panic",
    ]


def test_an_unreadable_kernel_log_is_an_error_not_a_pass(env, tmp_path):
    results = run_check(env, log=FileKernelLog(str(tmp_path / "missing")))
    assert finding(results, "kernel_log").status is Status.ERROR
    assert not [r for r in results if r.status is Status.PASS and r.metric == "kernel_distress"]


# --- rasdaemon --------------------------------------------------------------------------------

RAS_SUMMARY = (
    "No Memory errors.\n\nNo PCIe AER errors.\n\nNo Extlog errors.\n"
    "MCE records summary:\n\t2 Corrected error, no action required. errors\n"
    "\t1 Uncorrected error, Processor context corrupt errors\n"
)


def test_ras_summary_counts_corrected_and_uncorrected_mce_records():
    summary = kd.parse_ras_summary(RAS_SUMMARY)
    assert (summary["corrected"], summary["uncorrected"]) == (2, 1)
    assert kd.parse_ras_summary("No Memory errors.\n\nNo MCE errors.\n")["corrected"] == 0
    assert kd.parse_ras_summary("No Memory errors.\n") is None


def test_without_rasdaemon_the_check_skips_it_with_the_reason(env):
    """This host has no rasdaemon (the config names a tool that is not installed)."""
    (ras,) = [r for r in run_check(env, []) if r.metric == "ras_mce"]
    assert ras.status is Status.SKIP and "rasdaemon" in ras.detail


# --- pstore -----------------------------------------------------------------------------------


def write_dump(root: Path, name: str, n: int, why: str = "Panic") -> None:
    (root / name).write_text(
        f"{why}#{n} Part1\n<6>[ 8800.1] nvme nvme0: I/O 1 QID 1 timeout, "
        "reset controller\n<0>[ 8849.2] Kernel panic - not syncing: "
        "softlockup: hung tasks\n"
    )


def test_one_panic_in_pstore_warns_naming_it_and_a_second_grades_error(env, tmp_path):
    root = tmp_path / "pstore"
    root.mkdir()
    write_dump(root, "dmesg-efi-173250001001", 1)
    write_dump(root, "dmesg-efi-173250001002", 1)  # a second part of the same dump
    one = finding(run_check(env, [], pstore_root=str(root)), "pstore_panic")
    assert (one.status, one.value) == (Status.WARN, 1)
    assert "softlockup: hung tasks" in one.detail
    write_dump(root, "dmesg-efi-173260001001", 2)
    results = run_check(env, [], pstore_root=str(root))
    assert finding(results, "pstore_panic").status is Status.FAIL
    g = grade(env, results)
    assert (g.level, g.reasons[0].rule) == (Level.ERROR, "pstore-panic-recurring")


def test_old_dumps_and_systemd_pstore_archives_are_read_by_age(env, tmp_path):
    root, archive = tmp_path / "pstore", tmp_path / "archive"
    root.mkdir()
    (archive / "1732500000").mkdir(parents=True)
    write_dump(archive / "1732500000", "dmesg-efi-173250001001", 1)
    old = root / "dmesg-ramoops-0"
    write_dump(root, old.name, 3)
    week_ago = time.time() - 8 * 24 * 3600
    os.utime(old, (week_ago, week_ago))
    result = finding(
        run_check(env, [], pstore_root=str(root), pstore_archive=str(archive)), "pstore_panic"
    )
    assert (result.status, result.value) == (Status.WARN, 1)
    assert result.evidence["dumps"][0]["directory"].endswith("1732500000")


def test_a_dump_older_than_kernel_yamls_max_age_is_left_out(env, tmp_path):
    root = tmp_path / "pstore"
    root.mkdir()
    write_dump(root, "dmesg-ramoops-0", 1)
    two_days_ago = time.time() - 48 * 3600
    os.utime(root / "dmesg-ramoops-0", (two_days_ago, two_days_ago))
    shipped = finding(run_check(env, [], pstore_root=str(root)), "pstore_panic")
    assert shipped.status is Status.WARN  # a week (168 h) shipped
    graders = tmp_path / "graders"
    graders.mkdir()
    (graders / "kernel.yaml").write_text("pstore_max_age_h: 24\n")
    short = finding(run_check(env, [], graders=graders, pstore_root=str(root)), "pstore_panic")
    assert short.status is Status.PASS


@pytest.mark.parametrize("key", ["nvme_repeat", "mce_corrected_warn", "pstore_max_age_h"])
def test_a_suite_carrying_a_kernel_threshold_is_refused_naming_graders_kernel_yaml(key):
    with pytest.raises(ValueError, match=f"{key} judges") as err:
        kd.Params.parse({key: 3})
    assert "graders/kernel.yaml" in str(err.value)


def test_an_empty_pstore_passes(env, tmp_path):
    assert (
        finding(run_check(env, [], pstore_root=str(tmp_path)), "pstore_panic").status is Status.PASS
    )


@pytest.mark.skipif(
    kd.pstore_mounted(kd.PSTORE_ROOT), reason="this host has pstore mounted at /sys/fs/pstore"
)
def test_without_pstore_mounted_the_check_skips_it_with_the_reason(env):
    ctx = env.check_context(
        "kernel_distress",
        "service",
        {"pstore_archive": "/nonexistent/pstore-archive"},
        kernel_log=LinesKernelLog([]),
        ports=HOST_PORTS,
    )
    (pstore,) = [r for r in kd.run(ctx) if r.metric == "pstore"]
    assert pstore.status is Status.SKIP and "mount -t pstore" in pstore.detail


def test_rasdaemon_records_are_read_through_the_configured_tool(env, tmp_path, monkeypatch):
    """rasdaemon is not installed here (it needs its daemon and database), so a stand-in script
    prints ``ras-mc-ctl --summary`` in the format above; the check runs it as it runs the tool."""
    tool = tmp_path / "ras-mc-ctl"
    tool.write_text('#!/bin/sh\n[ "$1" = --summary ] || exit 2\nprintf \'%s\' "$SUMMARY"\n')
    tool.chmod(0o755)
    data = copy.deepcopy(env.config.data)
    data["host"]["ras_mc_ctl"] = str(tool)
    env.config = Config(data, env.config.source)  # sections are parsed when a config is built
    monkeypatch.setenv("SUMMARY", RAS_SUMMARY)
    (ras,) = [r for r in run_check(env, []) if r.metric == "ras_mce"]
    assert (ras.status, ras.value, ras.evidence["uncorrected"]) == (Status.WARN, 3, 1)
    assert grade(env, [ras]).level is Level.WARN


def test_a_captured_node_skips_pstore_it_did_not_record(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state")}))
    real = Path(__file__).resolve().parents[2] / "scenarios" / "real" / "h100-sxm5-vm.yaml"
    env = open_environment(load_config(config), str(real))
    try:
        ctx = env.check_context(
            "kernel_distress",
            "delivery",
            {},
            expected_gpus=None,
        )
        results = kd.run(ctx)
    finally:
        env.close()
    (pstore,) = [r for r in results if r.metric == "pstore"]
    assert pstore.status is Status.SKIP and "not recorded" in pstore.detail
    assert finding(results, "kernel_distress").status is Status.PASS
