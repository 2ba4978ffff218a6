"""Check ``kernel_distress``: the kernel's own distress, from the kernel log, rasdaemon and pstore.

What the kernel reports about the host rather than a GPU (``kernel_log_distress.DistressLine``
has every line form and where Linux prints it), each folded like Xids (one result per kind and device:
count, first and last time, rate, bursts, the first and last line) and graded by
``graders/rules.yaml``:

========================  ====================  ===================================================
finding                   metric                status (grade)
========================  ====================  ===================================================
hung task                 ``hung_task``         warn (WARN) naming the tasks: a user can cause
                                                one (a FUSE mount that never answers, a hung NFS
                                                server), so never above WARN (docs/security.md)
soft / hard lockup        ``soft_lockup``,      fail (ERROR): a CPU stuck in the kernel
                          ``hard_lockup``
OOM kill                  ``oom_kill``          warn (WARN) naming the process: see ``_OOM_WHY``;
                                                the pre-5.0 ``Kill process ... or sacrifice
                                                child`` with its ``Killed process`` is one kill
file table full           ``file_max_reached``  warn (WARN): see ``_FILE_MAX_WHY``
NVMe timeout / reset      ``nvme_timeout``      warn (WARN) on ``disk:nvmeN``; fail (ERROR) from
                                                ``nvme_repeat`` (default 3) timeouts and resets,
                                                or a controller the driver removed or gave up on
read-only filesystem      ``fs_readonly``       fail (ERROR) naming ``disk:<device>``
NFS / Lustre lost         ``nfs_not_responding``, warn (WARN): the server's trouble, not the node's
                          ``lustre_connection_lost``
corrected machine checks  ``mce_corrected``     warn (WARN) from ``mce_corrected_warn`` events
                                                (default 1) in the window, else pass with the count
uncorrected / fatal MCE   ``mce_uncorrected``,  fail (ERROR)
                          ``mce_fatal``
rasdaemon's MCE records   ``ras_mce``           warn (WARN): its database keeps every boot's
                                                records without saying which were before a repair
panic kept in pstore      ``pstore_panic``      warn (WARN) for one panic; fail (ERROR) when two or
                                                more panics are kept (it recurs on this node)
========================  ====================  ===================================================

Only what the kernel wrote is believed (``kernel_log``'s rules of belief): a record of the
kernel's facility whose message *starts* with the form; the task and process names the kernel
quotes are their users' to choose, kept as names and never believed as anything else.

``since: boot`` (default) reads all the kernel still holds; ``since: last_run`` keeps a cursor in
the state directory (``kernel_distress_cursor.json``). Parameters: ``pstore_root`` (default
``/sys/fs/pstore``), ``pstore_archive`` (systemd-pstore's ``/var/lib/systemd/pstore``),
``rasdaemon`` (default true). Config ``host.ras_mc_ctl``, ``host.timeout_s``. Thresholds:
``graders/kernel.yaml``'s ``nvme_repeat`` (3), ``mce_corrected_warn`` (1) and
``pstore_max_age_h`` (168: older dumps were seen before), their one home; a suite that still
carries one is refused when it loads, naming the file.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node_agent import proc
from node_agent.checking import log_cursor
from node_agent.checking.behaviour import ServiceBehaviour
from node_agent.checking.context import CheckContext
from node_agent.checking.params import Reader
from node_agent.checking.thresholds import load_topic, refuse_thresholds
from node_agent.checking.xid_fold import BURST_GAP_S, MAX_BURST_STARTS, Fold, keep_fuller
from node_agent.kernel_log import LogRecord
from node_agent.kernel_log_distress import DistressLine, scan_distress
from node_agent.model import Result, Status

_KEPT = 16  # tasks, processes, CPUs, servers named per finding (a flood names the first ones)

#: The decision on OOM kills (issue 27): WARN, naming the process, and never more. Every form the
#: kernel prints for an OOM kill can be caused by a user: a job past its cgroup's limit
#: ("Memory cgroup out of memory"), a job without a limit that fills the node ("Out of memory",
#: CONSTRAINT_NONE), even one that leaves only unkillable memory (files in a tmpfs such as
#: /dev/shm are no process's to kill). What a user can cause grades WARN at most
#: (docs/security.md). The host-level causes of running out of memory (a DIMM missing, a
#: memory controller failing) are graded by the checks that see them (host_memory: installed
#: memory and EDAC), where a user cannot forge them.
_OOM_WHY = (
    "an OOM kill is the job's memory, not the node's: graded WARN at most (a user can "
    "cause every form of it)"
)

#: The decision on ``VFS: file-max limit N reached`` (issue 37): WARN. Every process on the node
#: then fails to open files (the agent, the jobs' checkpoints), so an operator must see it; but
#: the table is filled by processes, and a user's can fill it (many processes, each up to its
#: RLIMIT_NOFILE), so, as for OOM kills, what a user can cause grades WARN at most. The remedy
#: is the operator's: raise fs.file-max (proc(5), /proc/sys/fs/file-max) or find the leak
#: (/proc/sys/fs/file-nr).
_FILE_MAX_WHY = (
    "the node's open-file table is full: raise fs.file-max or find the process holding the "
    "files; WARN at most (a user's processes can fill it)"
)


@dataclass
class DistressFold:
    """Every distress line of one kind on one subject: count, times, bursts, lines, names."""

    kind: str
    target: str
    subject: str | None = None
    count: int = 0
    clock: str | None = None
    first_s: float | None = None
    last_s: float | None = None
    bursts: int = 0
    burst_starts: list[float] = field(default_factory=list)
    first_line: str = ""
    last_line: str = ""
    names: list[str] = field(default_factory=list)  # tasks "comm:pid", CPUs, servers
    facts: dict[str, Any] = field(default_factory=dict)

    def add(self, line: DistressLine, name: str | None = None) -> None:
        self.count += 1
        self.first_line = self.first_line or line.raw
        self.last_line = line.raw
        if name is not None and name not in self.names and len(self.names) < _KEPT:
            self.names.append(name)
        stamp = line.stamp
        if stamp is None or (self.clock is not None and stamp.clock != self.clock):
            self.bursts = self.bursts or 1
            return
        t = stamp.seconds
        if self.clock is None:
            self.clock, self.first_s, self.last_s, self.bursts = stamp.clock, t, t, 1
            self.burst_starts = [t]
            return
        assert self.first_s is not None and self.last_s is not None
        if t - self.last_s > BURST_GAP_S:
            self.bursts += 1
            self.burst_starts = (self.burst_starts + [t])[-MAX_BURST_STARTS:]
        self.first_s, self.last_s = min(self.first_s, t), max(self.last_s, t)

    def evidence(self, boot_epoch: float | None) -> dict[str, Any]:
        times = Fold(kind="distress", target=self.target, code=0, clock=self.clock)
        span = (
            (self.last_s - self.first_s)
            if self.first_s is not None and self.last_s is not None
            else 0.0
        )
        return {
            "kind": self.kind,
            "count": self.count,
            "subject": self.subject,
            "first_seen": times.seen(self.first_s, boot_epoch),
            "last_seen": times.seen(self.last_s, boot_epoch),
            "clock": self.clock,
            "rate_per_hour": round(self.count / span * 3600, 3) if span >= 1 else None,
            "bursts": self.bursts,
            "burst_gap_s": BURST_GAP_S,
            "lines": [self.first_line]
            + ([self.last_line] if self.last_line != self.first_line else []),
            "names": list(self.names),
            **self.facts,
        }


#: where the kernel keeps crash dumps, and where systemd-pstore archives them at boot
PSTORE_ROOT = Path("/sys/fs/pstore")
PSTORE_ARCHIVE = Path("/var/lib/systemd/pstore")

#: the topic file of the check's thresholds (checking/thresholds.py)
TOPIC = "kernel"
KERNEL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "nvme_repeat": {"type": "integer", "minimum": 1},  # this many timeouts of a disk fail it
        "mce_corrected_warn": {"type": "integer", "minimum": 0},  # fewer corrected MCEs pass
        "pstore_max_age_h": {"type": ["number", "null"], "exclusiveMinimum": 0},  # null: any
    },
}


def thresholds(ctx: CheckContext) -> dict[str, Any]:
    """``graders/kernel.yaml``: the operator's keys over the shipped file's."""
    return load_topic(ctx.config, TOPIC, KERNEL_SCHEMA, "kernel grading file")


@dataclass(frozen=True)
class Params:
    """The check's parameters (a suite's ``params``), validated by :meth:`parse`."""

    since: str = "boot"  # the kernel lines read: since boot, or since the last run
    rasdaemon: bool = True  # read rasdaemon's MCE records
    pstore_root: str | None = None  # None: PSTORE_ROOT, its archive when nothing is mounted
    pstore_archive: str = str(PSTORE_ARCHIVE)

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Params:
        """ValueError naming the key and what was expected (for a threshold: its home)."""
        refuse_thresholds(
            "kernel_distress", raw, KERNEL_SCHEMA["properties"], f"graders/{TOPIC}.yaml"
        )
        r = Reader("kernel_distress", raw, cls)
        return cls(
            since=r.choice("since", ("boot", "last_run")),
            rasdaemon=r.flag("rasdaemon"),
            pstore_root=r.optional_string("pstore_root"),
            pstore_archive=r.string("pstore_archive"),
        )


def run(ctx: CheckContext) -> list[Result]:
    params = ctx.typed_params(Params)
    since = params.since
    window = "since boot" if since == "boot" else "since the last run"
    log = ctx.kernel_log
    results: list[Result] = []
    read, problem = log_cursor.read_log(ctx)
    records: list[LogRecord] = read or []
    read_ok = read is not None
    if problem is not None:
        results.append(problem)
    records = records + ctx.ports.extra_kernel_records(len(records) + 1)
    cursor = log_cursor.load(_cursor_path(ctx), log.source) if since == "last_run" else None
    fresh = [r for r in records if cursor is None or r.seq > cursor]
    if since == "last_run" and records and read_ok:
        log_cursor.save(_cursor_path(ctx), log.source, records[-1].seq)
    lines = scan_distress(fresh)
    boot_epoch = time.time() - time.monotonic() if log.live else None
    findings = grade_lines(ctx, lines, window, boot_epoch, log.source)
    results.extend(findings)
    if params.rasdaemon:
        results.extend(rasdaemon_results(ctx))
    results.extend(pstore_results(ctx))
    if read_ok and not findings:
        results.append(
            ctx.result(
                "node",
                "kernel_distress",
                Status.PASS,
                f"no hung tasks, lockups, OOM kills, NVMe timeouts, read-only "
                f"filesystems, lost file servers or machine checks {window} "
                f"({log.source}: {len(fresh)} lines read)",
                value=0,
            )
        )
    return results


# --- the kernel log ---------------------------------------------------------------------------


def grade_lines(
    ctx: CheckContext, lines: list[DistressLine], window: str, boot_epoch: float | None, source: str
) -> list[Result]:
    """Distress lines -> one result per (kind, subject), graded as the module says."""
    folds: dict[tuple[str, str | None], DistressFold] = {}
    oom_context: dict[int, DistressLine] = {}
    chosen: set[int] = set()  # pids an older kernel named before it killed them

    def fold(kind: str, target: str, subject: str | None = None) -> DistressFold:
        key = (kind, subject)
        if key not in folds:
            folds[key] = DistressFold(kind=kind, target=target, subject=subject)
        return folds[key]

    for line in lines:
        k = line.kind
        task = f"{line.process}:{line.pid}" if line.process is not None else None
        if k == "hung_task":
            fold("hung_task", "node").add(line, task)
        elif k in ("soft_lockup", "hard_lockup"):
            fold(k, "node").add(line, f"CPU{line.field('cpu')}" + (f" ({task})" if task else ""))
        elif k == "oom_summary":
            if line.pid is not None:
                oom_context[line.pid] = line
        elif k == "oom_kill":
            if line.field("score") is not None and line.pid is not None:
                chosen.add(line.pid)  # before 5.0: "Kill process <pid> ... score" first
            elif line.pid in chosen:
                chosen.discard(line.pid)
                continue  # its "Killed process <pid>" line: the same kill
            fold("oom_kill", "node").add(line, task)
        elif k == "file_max":
            fold("file_max", "node").add(line, f"limit {line.field('limit')}")
        elif k in ("nvme_timeout", "nvme_reset", "nvme_failed"):
            f = fold("nvme", f"disk:{line.subject}", line.subject)
            f.add(line)
            f.facts[k] = f.facts.get(k, 0) + 1
        elif k == "fs_readonly":
            fold("fs_readonly", f"disk:{line.subject}", line.subject).add(line)
        elif k in ("nfs_not_responding", "lustre_lost"):
            fold(k, "node", line.subject).add(line, line.subject)
        elif k == "nfs_ok":
            lost = folds.get(("nfs_not_responding", line.subject))
            if lost is not None:
                lost.facts["recovered_line"] = line.raw
        elif k == "mce_record":
            if line.field("context_corrupt") or line.field("exception"):
                kind = "mce_fatal" if line.field("context_corrupt") else "mce_uncorrected"
            else:
                kind = "mce_uncorrected" if line.field("uncorrected") else "mce_corrected"
            fold(kind, "node").add(line, f"CPU{line.field('cpu')} bank {line.field('bank')}")
        elif k == "edac_error":
            kind = "mce_uncorrected" if line.field("uncorrected") else "mce_corrected"
            fold(kind, "node").add(line, f"MC{line.field('mc')} {line.field('dimm')}")
        elif k == "mce_logged":
            fold("mce_corrected", "node").add(line)
        elif k == "mce_fatal":
            fold("mce_fatal", "node").add(line)
        elif k == "memory_failure":
            fold("mce_uncorrected", "node").add(line, line.field("page"))

    out: list[Result] = []
    for (kind, _subject), f in sorted(folds.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        if kind == "oom_kill":
            scopes = sorted(
                {
                    oom_context[int(n.rsplit(":", 1)[1])].field("scope")
                    for n in f.names
                    if int(n.rsplit(":", 1)[1]) in oom_context
                }
            )
            f.facts.update(scopes=scopes, why=_OOM_WHY)
        elif kind == "file_max":
            f.facts["why"] = _FILE_MAX_WHY
        out.append(_result(ctx, f, window, boot_epoch, source))
    return out


_TITLES = {
    "hung_task": "hung task(s) (blocked in the kernel past hung_task_timeout_secs)",
    "soft_lockup": "soft lockup(s) (a CPU stuck in the kernel without scheduling)",
    "hard_lockup": "hard lockup(s) (a CPU stuck with interrupts off)",
    "oom_kill": "OOM kill(s)",
    "nvme": "NVMe I/O timeouts or controller resets",
    "fs_readonly": "filesystem shut down or remounted read-only",
    "nfs_not_responding": "NFS server not responding",
    "lustre_lost": "Lustre server connection lost",
    "mce_corrected": "corrected (or not decoded) machine check(s) / memory error(s)",
    "mce_uncorrected": "uncorrected machine check(s) / memory error(s) / memory failure(s)",
    "mce_fatal": "fatal machine check(s)",
    "file_max": "the kernel's table of open files full (fs.file-max reached)",
}
_METRIC = {
    "lustre_lost": "lustre_connection_lost",
    "nvme": "nvme_timeout",
    "file_max": "file_max_reached",
}


def sticky_key(result: Result) -> tuple[str, str, str | None] | None:
    """A finding from the kernel log (warn or fail) stays part of the daemon's grade for its
    life in this boot, whichever window a later run reads: the periodic suite reads
    ``since: last_run``, so a line is read once, and a fatal machine check must not be
    forgotten at the next run. One per (metric, target, subject). A pass (corrected machine
    checks below ``mce_corrected_warn``) is not kept; nor are rasdaemon's and pstore's
    findings, which every run reads whole (a dump removed from pstore is gone)."""
    evidence = result.evidence or {}
    if result.status in (Status.WARN, Status.FAIL) and evidence.get("kind") in _TITLES:
        subject = evidence.get("subject")
        return (result.metric, result.target, subject if isinstance(subject, str) else None)
    return None


_RANK = {Status.PASS: 0, Status.WARN: 1, Status.FAIL: 2}


def keep_worse(kept: Result, new: Result) -> Result:
    """Of two findings under one key, the worse (fail over warn: one run's NVMe controller
    removal over another's lone timeout), else the one that counted more lines, the newer on
    a tie. Counts are never added: each is one run's window."""
    rank_kept, rank_new = _RANK.get(kept.status, 0), _RANK.get(new.status, 0)
    if rank_new != rank_kept:
        return new if rank_new > rank_kept else kept
    return keep_fuller(kept, new)


SERVICE = ServiceBehaviour(sticky=sticky_key, fold=keep_worse)


def _result(
    ctx: CheckContext, f: DistressFold, window: str, boot_epoch: float | None, source: str
) -> Result:
    status = Status.WARN
    if f.kind in ("soft_lockup", "hard_lockup", "fs_readonly", "mce_uncorrected", "mce_fatal"):
        status = Status.FAIL
    elif f.kind == "nvme":
        repeat = int(thresholds(ctx)["nvme_repeat"])
        if f.count >= repeat or f.facts.get("nvme_failed"):
            status = Status.FAIL
            f.facts["repeated"] = True
        f.facts["nvme_repeat"] = repeat
    elif f.kind == "mce_corrected":
        least = int(thresholds(ctx)["mce_corrected_warn"])
        f.facts["mce_corrected_warn"] = least
        if f.count < least:
            status = Status.PASS
    named = (
        ": " + ", ".join(f.names) + (" and others" if len(f.names) >= _KEPT else "")
        if f.names
        else ""
    )
    where = f" on {f.target}" if f.target != "node" else ""
    about = f" ({f.subject})" if f.subject and f.target == "node" else ""
    detail = (
        f"{_TITLES[f.kind]}{about}{where}, {f.count} line(s) {window}{named}"
        + (" - repeated" if f.facts.get("repeated") else "")
        + (" - server answered again later" if f.facts.get("recovered_line") else "")
        + f": {f.first_line}"
    )
    evidence = f.evidence(boot_epoch)
    evidence["sources"] = [source]
    return Result(
        check=ctx.check,
        target=f.target,
        metric=_METRIC.get(f.kind, f.kind),
        status=status,
        detail=detail[:1000],
        value=f.count,
        unit="lines",
        evidence=evidence,
    )


# --- rasdaemon --------------------------------------------------------------------------------

_RAS_ROW = re.compile(r"^\s+(?P<count>\d+)\s+(?P<msg>.+?)\s+errors\s*$")
_RAS_UNCORRECTED = re.compile(
    r"uncorrect|fatal|context corrupt|(?<!no )action required|poison", re.IGNORECASE
)


def parse_ras_summary(text: str) -> dict[str, Any] | None:
    """``ras-mc-ctl --summary`` -> MCE record counts, or None when the output has no MCE part.

    rasdaemon prints ``MCE records summary:`` then one ``\\t<count> <error_msg> errors`` row per
    distinct message (``select error_msg, count(*) from mce_record group by error_msg``,
    util/ras-mc-ctl.in), or ``No MCE errors.``. A message naming an uncorrected, fatal or
    context-corrupt error counts as uncorrected; the rest (``Corrected error, no action
    required.``, ``No Error``) as corrected.
    """
    rows: list[tuple[int, str]] = []
    in_mce = False
    seen = False
    for line in text.splitlines():
        if line.strip().startswith("No MCE errors"):
            seen = True
            in_mce = False
            continue
        if line.strip().startswith("MCE records summary"):
            seen = in_mce = True
            continue
        if in_mce:
            m = _RAS_ROW.match(line)
            if m is None:
                in_mce = False
                continue
            rows.append((int(m["count"]), m["msg"]))
    if not seen:
        return None
    uncorrected = sum(n for n, msg in rows if _RAS_UNCORRECTED.search(msg))
    total = sum(n for n, _ in rows)
    return {
        "corrected": total - uncorrected,
        "uncorrected": uncorrected,
        "rows": [{"count": n, "message": msg} for n, msg in rows[:_KEPT]],
    }


def rasdaemon_results(ctx: CheckContext) -> list[Result]:
    """rasdaemon's MCE records (``ras-mc-ctl --summary``), where it is installed."""
    if not ctx.ports.rasdaemon:
        return []  # the node's machine checks are its kernel log's (a stand-in's mce fault)
    tool = ctx.config.host.ras_mc_ctl
    if proc.which(tool) is None:
        return [
            ctx.skip(
                f"rasdaemon's {tool} is not installed (Debian/Ubuntu package rasdaemon): "
                "machine checks are read from the kernel log only",
                metric="ras_mce",
            )
        ]
    # under the runner's limit for the check, so a slow tool is a skip, never an abandoned check
    timeout_s = min(ctx.config.host.timeout_s, ctx.timeout_s / 2)
    done = proc.run([tool, "--summary"], timeout_s=timeout_s)
    if not done.ok:
        return [
            ctx.skip(
                f"{tool} --summary failed ({done.describe_failure()}): is rasdaemon "
                "running with its database (ras-mc-ctl needs it)?",
                metric="ras_mce",
            )
        ]
    summary = parse_ras_summary(done.stdout)
    if summary is None:
        return [
            ctx.skip(
                f"{tool} --summary printed no MCE part (rasdaemon built without MCE support)",
                metric="ras_mce",
            )
        ]
    total = summary["corrected"] + summary["uncorrected"]
    if total == 0:
        return [
            ctx.result(
                "node",
                "ras_mce",
                Status.PASS,
                f"rasdaemon: no MCE records ({tool})",
                value=0,
                **summary,
            )
        ]
    return [
        ctx.result(
            "node",
            "ras_mce",
            Status.WARN,
            f"rasdaemon keeps {total} MCE record(s) ({summary['uncorrected']} "
            f"uncorrected, {summary['corrected']} corrected) over every boot it saw: "
            f"{'; '.join(r['message'] for r in summary['rows'][:4])} "
            f"(`{tool} --errors` lists them with times)",
            value=total,
            unit="records",
            **summary,
        )
    ]


# --- pstore -----------------------------------------------------------------------------------

#: fs/pstore/platform.c, pstore_dump: each dump part begins "<reason>#<count> Part<n>"
_PSTORE_HEADER = re.compile(
    r"^(?P<why>Panic|Oops|Emergency|Shutdown|Unknown)#(?P<n>\d+) "
    r"Part(?P<part>\d+)"
)
#: the kernel's own panic line in the saved log: "<0>[ 1234.5] Kernel panic - not syncing: ..."
_PANIC_LINE = re.compile(
    r"^(?:<\d+>)?(?:\[\s*\d+\.\d+\]\s*)?Kernel panic - not syncing: (?P<why>.{1,200})"
)
_PSTORE_READ_BYTES = 256 << 10


def pstore_mounted(root: Path, mounts: Path = Path("/proc/self/mounts")) -> bool:
    """Whether a pstore filesystem is mounted at ``root`` (``/proc/self/mounts``)."""
    try:
        for line in mounts.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "pstore" and Path(parts[1]) == root:
                return True
    except OSError:
        return False
    return False


def read_pstore(
    roots: list[Path], max_age_s: float | None = None, now: float | None = None
) -> tuple[list[dict[str, Any]], list[str]]:
    """The kernel dumps kept in ``roots`` (``dmesg-*`` files, searched one directory deep: the
    systemd-pstore archive keeps one directory per boot): a list of dumps ``{why, n, files,
    reason, mtime}``, one per (directory, reason, count), and the problems met reading them.

    Files are opened without following links and read up to 256 KiB each; a dump older than
    ``max_age_s`` (by its newest file's mtime) is left out."""
    now = time.time() if now is None else now
    dumps: dict[tuple[str, str, str], dict[str, Any]] = {}
    problems: list[str] = []
    for root in roots:
        try:
            entries = sorted(os.scandir(root), key=lambda e: e.name)
        except FileNotFoundError:
            continue
        except OSError as err:
            problems.append(f"{root}: {err.strerror or err}")
            continue
        files: list[os.DirEntry[str]] = []
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                try:
                    files.extend(sorted(os.scandir(entry.path), key=lambda e: e.name))
                except OSError as err:
                    problems.append(f"{entry.path}: {err.strerror or err}")
            else:
                files.append(entry)
        for entry in files:
            if not entry.name.startswith("dmesg-") or not entry.is_file(follow_symlinks=False):
                continue
            try:
                fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                try:
                    mtime = os.fstat(fd).st_mtime
                    text = os.read(fd, _PSTORE_READ_BYTES).decode("utf-8", "replace")
                finally:
                    os.close(fd)
            except OSError as err:
                problems.append(f"{entry.path}: {err.strerror or err}")
                continue
            if max_age_s is not None and now - mtime > max_age_s:
                continue
            header = _PSTORE_HEADER.match(text)
            why, n = (header["why"], header["n"]) if header else ("Unknown", "?")
            key = (str(Path(entry.path).parent), why, n)
            dump = dumps.setdefault(
                key,
                {
                    "why": why,
                    "n": n,
                    "directory": key[0],
                    "files": [],
                    "reason": None,
                    "mtime": mtime,
                },
            )
            dump["files"].append(entry.name)
            dump["mtime"] = max(dump["mtime"], mtime)
            for line in text.splitlines():
                m = _PANIC_LINE.match(line.strip())
                if m is not None:
                    dump["reason"] = m["why"].strip()
    return [dumps[k] for k in sorted(dumps)], problems


def pstore_results(ctx: CheckContext) -> list[Result]:
    """A panic (or oops) the kernel saved in pstore before this boot: WARN naming it; two or
    more panics kept: fail (ERROR). One panic can be a kernel bug every node of the fleet
    shares; a second on the same node before its dumps were cleared is the node's (its memory,
    CPU or firmware), and the node is drained and re-tested, as a repeated Xid is."""
    params = ctx.typed_params(Params)
    max_age_h = thresholds(ctx)["pstore_max_age_h"]
    max_age_s = None if max_age_h is None else float(max_age_h) * 3600
    if ctx.ports.pstore_unrecorded is not None:
        return [ctx.skip(ctx.ports.pstore_unrecorded, metric="pstore")]
    if ctx.ports.pstore_tree is not None:
        # the node's ports build its pstore (a stand-in's pstore_panic faults as the files the
        # efi backend keeps), read by the same reader
        with ctx.ports.pstore_tree() as view:
            results = _grade_pstore(ctx, list(view.roots), max_age_s)
        for r in results:
            r.evidence["roots"] = [view.label or str(root) for root in view.roots]
        return results
    root = Path(params.pstore_root or PSTORE_ROOT)
    archive = Path(params.pstore_archive)
    if params.pstore_root is None and not pstore_mounted(root):
        # no pstore now; dumps systemd-pstore archived from an earlier boot still count
        kept = _grade_pstore(ctx, [archive], max_age_s)
        if any(r.status in (Status.WARN, Status.FAIL) for r in kept):
            return kept
        return [
            ctx.skip(
                f"no pstore: nothing is mounted at {root} (mount -t pstore pstore "
                f"{root}; needs CONFIG_PSTORE and a backend: efi, erst or ramoops), and "
                f"no dump archived in {archive}",
                metric="pstore",
            )
        ]
    return _grade_pstore(ctx, [root, archive], max_age_s)


def _grade_pstore(ctx: CheckContext, roots: list[Path], max_age_s: float | None) -> list[Result]:
    dumps, problems = read_pstore(roots, max_age_s)
    out: list[Result] = []
    if problems and not dumps:
        return [
            ctx.skip(
                f"pstore could not be read: {'; '.join(problems[:3])} (root only)", metric="pstore"
            )
        ]
    panics = [d for d in dumps if d["why"] == "Panic"]
    others = [d for d in dumps if d["why"] != "Panic"]
    where = ", ".join(str(r) for r in roots)
    if not dumps:
        return [
            ctx.result(
                "node",
                "pstore_panic",
                Status.PASS,
                f"no kernel panic kept in pstore ({where})",
                value=0,
            )
        ]
    shown = [
        f"{d['why']}#{d['n']} ({d['reason'] or 'no panic line'}; {d['files'][0]})"
        for d in (panics or others)[:4]
    ]
    evidence = {
        "dumps": dumps[:_KEPT],
        "roots": [str(r) for r in roots],
        "clear_with": "remove the dumps from pstore (rm /sys/fs/pstore/dmesg-*) or the "
        "systemd-pstore archive once they are read",
    }
    if panics:
        status = Status.FAIL if len(panics) >= 2 else Status.WARN
        out.append(
            ctx.result(
                "node",
                "pstore_panic",
                status,
                f"{len(panics)} kernel panic(s) kept in pstore from before this "
                f"boot{' - it recurs on this node' if len(panics) >= 2 else ''}: "
                f"{'; '.join(shown)}",
                value=len(panics),
                unit="panics",
                **evidence,
            )
        )
    else:
        out.append(
            ctx.result(
                "node",
                "pstore_panic",
                Status.WARN,
                f"{len(others)} kernel dump(s) (no panic) kept in pstore from "
                f"before this boot: {'; '.join(shown)}",
                value=0,
                unit="panics",
                **evidence,
            )
        )
    return out


# --- the cursor (since: last_run) -------------------------------------------------------------


def _cursor_path(ctx: CheckContext) -> Path | None:
    return ctx.state_dir / "kernel_distress_cursor.json" if ctx.state_dir else None
