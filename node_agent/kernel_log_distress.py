"""The kernel's own distress in the kernel log: hung tasks, lockups, OOM kills, NVMe timeouts,
read-only filesystems, lost file servers, machine checks (``checks/kernel_distress.py``).

Read from the same records as the driver's lines (:mod:`node_agent.kernel_log`) and under the
same rules of belief (docs/xid.md): a record of the kernel's facility, the form at the *start* of
the message after one known prefix (``kernel_log.kernel_message``), never a message led by a
process name and pid, only a record's first line.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from node_agent.kernel_log import LogRecord, Stamp, kernel_message, line_stamp
from node_agent.kernel_log.reading import believed_messages


@dataclass(frozen=True)
class DistressLine:
    """One line in which the kernel reports trouble of its own (not a GPU's): a hung task, a
    lockup, an OOM kill, an NVMe timeout, a filesystem gone read-only, a network filesystem's
    server not responding, a machine check. ``kind`` names the form (``DISTRESS_KINDS``);
    ``subject`` is what it is about: the device (``nvme0``, ``sda1``), the server, or ``None``
    (the node). ``process``/``pid`` are the task the kernel quotes, where it quotes one: that
    name is its user's to choose, never a reason to believe anything. ``fields`` carry the
    rest as printed (``cpu``, ``seconds``, ``uid``, ``scope``, ``mce_status``, ...).

    Forms and where the kernel prints them (Linux 4.x-6.x):

    ========================  ========================================================================
    ``hung_task``             ``INFO: task <comm>:<pid> blocked for more than <N> seconds.``
                              (kernel/hung_task.c, ``check_hung_task``)
    ``soft_lockup``           ``watchdog: BUG: soft lockup - CPU#<n> stuck for <N>s! [<comm>:<pid>]``
                              (kernel/watchdog.c, ``watchdog_timer_fn``; ``NMI watchdog:`` before
                              4.15, no prefix before 4.0)
    ``hard_lockup``           ``watchdog: CPU<n>: Watchdog detected hard LOCKUP on cpu <m>`` (6.5+;
                              ``watchdog: Watchdog detected hard LOCKUP on cpu <n>`` before,
                              kernel/watchdog_hld.c)
    ``oom_kill``              ``Out of memory: Killed process <pid> (<comm>) total-vm:... UID:<uid> ...``
                              and ``Memory cgroup out of memory: Killed process ...`` (mm/oom_kill.c,
                              ``__oom_kill_process``; a bare ``Killed process`` before 4.19)
                              and before 5.0 ``Out of memory: Kill process <pid> (<comm>) score <s> or
                              sacrifice child`` (``oom_kill_process``; the ``Killed process`` line
                              that follows it is the same kill)
    ``oom_summary``           ``oom-kill:constraint=<C>,...,task_memcg=<cg>,task=<comm>,pid=<p>,uid=<u>``
                              (mm/oom_kill.c, ``dump_oom_summary``, 4.19+)
    ``nvme_timeout``          ``nvme nvme<N>: I/O <tag> QID <q> timeout, reset controller`` (and
                              ``I/O tag <t> (<cid>) opcode <op> (<name>) QID <q> timeout, ...``, 6.x;
                              ``aborting``, ``disable controller``, ``completion polled``;
                              drivers/nvme/host/pci.c, ``nvme_timeout``)
    ``nvme_reset``            ``nvme nvme<N>: controller is down; will reset: CSTS=0x..., PCI_STATUS=0x...``
                              (``nvme_warn_reset``)
    ``nvme_failed``           ``nvme nvme<N>: Removing after probe failure status: <e>``, ``Device
                              not ready; aborting reset``, ``Disabling device after reset failure``
    ``fs_readonly``           ``EXT4-fs (<dev>): Remounting filesystem read-only`` (fs/ext4/super.c,
                              ``ext4_handle_error``), ``XFS (<dev>): ... Shutting down filesystem``
                              / ``Filesystem has been shut down due to ...`` / ``xfs_do_force_shutdown(``
                              (fs/xfs/xfs_fsops.c), ``BTRFS ... (device <dev>...): forced readonly``
    ``nfs_not_responding``    ``nfs: server <host> not responding, still trying`` (or ``timed out``;
                              net/sunrpc/clnt.c, ``call_timeout``); ``nfs_ok``: ``nfs: server <host> OK``
    ``lustre_lost``           ``Lustre: <obd>: Connection to <target> (at <nid>) was lost; ...``
                              (lustre/ptlrpc/import.c)
    ``mce_logged``            ``mce: [Hardware Error]: Machine check events logged``
                              (arch/x86/kernel/cpu/mce/core.c, ``mce_notify_irq``)
    ``mce_record``            ``mce: [Hardware Error]: CPU <n>: Machine Check[ Exception]: <mcg> Bank
                              <b>: <status>`` (``__print_mce``): MCi_STATUS bit 61 (UC) and 57 (PCC)
                              say uncorrected and processor context corrupt; an EDAC driver that
                              decodes the memory error prints it instead of the kernel, as ``EDAC
                              <drv> MC<m>: CPU <n>: Machine Check Event|Exception: <mcg> Bank <b>:
                              <status>`` (drivers/edac/sb_edac.c, skx_common.c, pnd2_edac.c)
    ``edac_error``            ``EDAC MC<m>: <count> CE|UE <what> on <DIMM label> (<location> ...)``
                              (drivers/edac/edac_mc.c, ``edac_ce_error``/``edac_ue_error``): a
                              memory controller's corrected or uncorrected error and its DIMM
    ``mce_fatal``             ``mce: [Hardware Error]: Machine check: <why>`` (``mce_panic``),
                              ``Kernel panic - not syncing: Fatal machine check``
    ``memory_failure``        ``Memory failure: <pfn>: recovery action for <page>: <result>``
                              (mm/memory-failure.c, ``action_result``): an uncorrected memory error
    ``file_max``              ``VFS: file-max limit <n> reached`` (fs/file_table.c,
                              ``alloc_empty_file``): the node's table of open files is full
    ========================  ========================================================================

    Every form is read under the rules of belief of this module: a record of the kernel's
    facility, the message *starting* with the form after one known prefix, never a message led
    by a process name and pid (the kernel's reports of user faults), only a record's first line.
    A task name the kernel quotes is at most 15 characters (``TASK_COMM_LEN``), and the forms
    read it so: a name cannot stretch a form over the rest of a line.
    """

    kind: str
    message: str
    raw: str
    subject: str | None = None
    process: str | None = None
    pid: int | None = None
    fields: tuple[tuple[str, Any], ...] = ()
    stamp: Stamp | None = None

    def field(self, name: str, default: Any = None) -> Any:
        return dict(self.fields).get(name, default)


DISTRESS_KINDS = (
    "hung_task",
    "soft_lockup",
    "hard_lockup",
    "oom_kill",
    "oom_summary",
    "nvme_timeout",
    "nvme_reset",
    "nvme_failed",
    "fs_readonly",
    "nfs_not_responding",
    "nfs_ok",
    "lustre_lost",
    "mce_logged",
    "mce_record",
    "edac_error",
    "mce_fatal",
    "memory_failure",
    "file_max",
)

_COMM = r"(?P<comm>.{0,15}?)"  # a task's name as the kernel quotes it: at most 15 characters
_DEV = r"(?P<dev>[A-Za-z0-9_.:+-]{1,64})"
_DISTRESS_FORMS: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "hung_task",
        re.compile(
            rf"^INFO: task {_COMM}:(?P<pid>\d+) blocked for more than "
            r"(?P<seconds>\d+) seconds\."
        ),
    ),
    (
        "soft_lockup",
        re.compile(
            r"^(?:(?:NMI )?watchdog: )?BUG: soft lockup - CPU#(?P<cpu>\d+) "
            rf"stuck for (?P<seconds>\d+)s! \[{_COMM}:(?P<pid>\d+)\]"
        ),
    ),
    (
        "hard_lockup",
        re.compile(
            r"^(?:(?:NMI )?watchdog: )?(?:CPU\d+: )?Watchdog detected hard "
            r"LOCKUP on cpu (?P<cpu>\d+)"
        ),
    ),
    (
        "oom_kill",
        re.compile(
            r"^(?:(?P<why>Out of memory|Memory cgroup out of memory)"
            r"(?: \([a-z_]+\))?: )?Killed process (?P<pid>\d+) "
            rf"\({_COMM}\),? (?:UID \d+, )?total-vm:\d+kB(?:.*? UID:(?P<uid>\d+))?"
        ),
    ),
    (
        "oom_kill",
        re.compile(
            r"^(?P<why>Out of memory|Memory cgroup out of memory)(?: \([a-z_]+\))?: Kill "
            rf"process (?P<pid>\d+) \({_COMM}\) score (?P<score>\d+) or sacrifice child"
        ),
    ),
    (
        "oom_summary",
        re.compile(
            r"^oom-kill:constraint=(?P<constraint>[A-Z_]+),.*,task="
            r"(?P<comm>.{0,15}),pid=(?P<pid>\d+),uid=(?P<uid>\d+)$"
        ),
    ),
    (
        "nvme_timeout",
        re.compile(
            r"^nvme (?P<dev>nvme\d+): I/O (?:tag )?(?P<tag>\d+) "
            r"(?:\([0-9a-fA-F]+\) )?(?:opcode \S+ \([^()]*\) )?QID "
            r"(?P<qid>\d+) timeout, (?P<action>reset controller|aborting|"
            r"disable controller|completion polled)"
        ),
    ),
    (
        "nvme_reset",
        re.compile(
            r"^nvme (?P<dev>nvme\d+): controller is down; will reset: "
            r"CSTS=(?P<csts>0x[0-9a-fA-F]+)"
        ),
    ),
    (
        "nvme_failed",
        re.compile(
            r"^nvme (?P<dev>nvme\d+): (?P<what>Removing after probe failure|"
            r"Device not ready; aborting reset|Disabling device after reset "
            r"failure)"
        ),
    ),
    (
        "fs_readonly",
        re.compile(
            rf"^(?:EXT[234]-fs \({_DEV}\): (?P<ext>Remounting filesystem "
            rf"read-only)|XFS \({_DEV.replace('dev', 'xdev')}\): (?P<xfs>.*"
            r"Shutting down filesystem|Filesystem has been shut down due to|"
            r"xfs_do_force_shutdown\()|BTRFS(?: [a-z]+)? \(device "
            rf"{_DEV.replace('dev', 'bdev')}(?:: state [A-Za-z]+)?\): "
            r"(?P<btrfs>forced readonly))"
        ),
    ),
    (
        "nfs_not_responding",
        re.compile(
            r"^(?P<prog>nfs|lockd): server (?P<server>[^\s]{1,255}) "
            r"not responding, (?P<how>still trying|timed out)"
        ),
    ),
    ("nfs_ok", re.compile(r"^(?P<prog>nfs|lockd): server (?P<server>[^\s]{1,255}) OK$")),
    (
        "lustre_lost",
        re.compile(
            r"^Lustre: (?P<obd>[^\s:]{1,128}): Connection to "
            r"(?P<server>[^\s]{1,128}) \(at (?P<nid>[^\s()]{1,128})\) was lost"
        ),
    ),
    ("mce_logged", re.compile(r"^mce: \[Hardware Error\]: Machine check events logged")),
    (
        "mce_record",
        re.compile(
            r"^(?:mce: (?:\[Hardware Error\]: )?|EDAC [a-z0-9_]{1,16} MC\d{1,4}: )CPU (?P<cpu>\d+): "
            r"Machine Check(?: Event|(?P<exception> Exception))?: (?:0x)?(?P<mcg>[0-9a-fA-F]{1,16}) "
            r"Bank (?P<bank>\d+): (?:0x)?(?P<status>[0-9a-fA-F]{1,16})\b"
        ),
    ),
    (
        "edac_error",
        re.compile(
            r"^EDAC MC(?P<mc>\d{1,4}): (?P<count>\d{1,10}) (?P<sev>CE|UE) "
            r"(?P<what>[^\n]{0,160}?)on (?P<dimm>[^()\n]{1,160}?) \("
        ),
    ),
    (
        "mce_fatal",
        re.compile(
            r"^(?:mce: \[Hardware Error\]: Machine check: (?P<why>.{1,120})|"
            r"Kernel panic - not syncing: (?P<panic>Fatal machine check.*|"
            r"Machine check.*))$"
        ),
    ),
    ("file_max", re.compile(r"^VFS: file-max limit (?P<limit>\d+) reached")),
    (
        "memory_failure",
        re.compile(
            r"^Memory failure: (?P<pfn>0x[0-9a-fA-F]+): recovery action "
            r"for (?P<page>[^:]{1,64}): (?P<result>Recovered|Ignored|"
            r"Failed|Delayed)"
        ),
    ),
)
#: words one of which every distress line holds: a cheap test before the prefixes are parsed
_DISTRESS_WORDS = (
    "INFO: task",
    "lockup",
    "LOCKUP",
    "Killed process",
    "Kill process",
    "file-max",
    "oom-kill:",
    "nvme",
    "-fs (",
    "XFS (",
    "BTRFS",
    "server ",
    "Lustre:",
    "mce:",
    "EDAC ",
    "Machine check",
    "machine check",
    "Memory failure:",
)

#: MCi_STATUS bits (Intel SDM vol. 3B, "IA32_MCi_STATUS MSRs"; AMD's MCA_STATUS alike)
MCI_STATUS_UC = 1 << 61  # uncorrected
MCI_STATUS_PCC = 1 << 57  # processor context corrupt: the state cannot be trusted


def parse_distress(line: str) -> DistressLine | None:
    """The kernel's own distress in one log line (see :class:`DistressLine`), or None: for any
    other line, and for every line the rules of belief refuse (a user's program's syslog line,
    a message led by a process name and pid, a form that is not at the message's start).

    >>> parse_distress("[ 363.2] INFO: task python3:4242 blocked for more than 122 seconds.").process
    'python3'
    >>> parse_distress("[ 9.1] python3[77]: segfault at 0 ip 0 in INFO: task x:1 blocked for more "
    ...                "than 9 seconds.[0+1000]") is None
    True
    """
    if not any(word in line for word in _DISTRESS_WORDS):
        return None
    found = kernel_message(line)
    return None if found is None else _distress(*found)


def _distress(prefix: str, message: str) -> DistressLine | None:
    for kind, form in _DISTRESS_FORMS:
        m = form.match(message)
        if m is None:
            continue
        groups = {k: v for k, v in m.groupdict().items() if v is not None}
        process = groups.pop("comm", None)
        pid = int(groups.pop("pid")) if "pid" in groups else None
        subject = (
            groups.pop("dev", None)
            or groups.pop("xdev", None)
            or groups.pop("bdev", None)
            or groups.get("server")
        )
        fields: dict[str, Any] = {}
        for key in ("cpu", "seconds", "uid", "bank", "qid", "tag", "score", "limit", "mc", "count"):
            if key in groups:
                fields[key] = int(groups.pop(key))
        if kind == "oom_kill":
            fields["scope"] = (
                "memcg"
                if groups.get("why", "").startswith("Memory cgroup")
                else "global"
                if groups.get("why")
                else "unknown"
            )
        elif kind == "oom_summary":
            fields["scope"] = "memcg" if groups["constraint"] == "CONSTRAINT_MEMCG" else "global"
            fields["constraint"] = groups["constraint"]
        elif kind == "mce_record":
            status = int(groups["status"], 16)
            fields.update(
                mce_status=f"0x{status:016x}",
                uncorrected=bool(status & MCI_STATUS_UC),
                context_corrupt=bool(status & MCI_STATUS_PCC),
                exception=bool(groups.get("exception")),
            )
        elif kind == "edac_error":
            fields.update(
                uncorrected=groups["sev"] == "UE",
                what=groups["what"].strip(),
                dimm=groups["dimm"].strip(),
            )
        else:
            for key in (
                "action",
                "what",
                "how",
                "nid",
                "obd",
                "csts",
                "result",
                "page",
                "why",
                "panic",
                "ext",
                "xfs",
                "btrfs",
                "prog",
            ):
                if key in groups:
                    fields[key] = groups[key].strip()
        raw = (prefix + message).strip()
        return DistressLine(
            kind=kind,
            message=message,
            raw=raw,
            subject=subject,
            process=process,
            pid=pid,
            fields=tuple(sorted(fields.items())),
            stamp=line_stamp(prefix),
        )
    return None


def scan_distress(records: Iterable[LogRecord]) -> list[DistressLine]:
    """Every distress line in ``records``, in order: records the kernel did not write (facility
    other than 0) and never-source records (``framing.refusal``, with the later lines of a text
    log's API-mismatch record) give nothing, and only a record's first line is a message."""
    out: list[DistressLine] = []
    for record, prefix, message in believed_messages(records, _DISTRESS_WORDS):
        event = _distress(prefix, message)
        if event is None:
            continue
        if record.boot_s is not None:
            event = replace(event, stamp=Stamp("boot", record.boot_s))
        out.append(event)
    return out
