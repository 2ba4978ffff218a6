"""The daemon's view of the node: the latest result of every scheduled check, kept on disk.

The daemon's grade is the node's state, never the last run's: it keeps each scheduled check's
latest results with the time they were made (:class:`CheckResults`), the sticky findings
(an Xid seen stays for the daemon's life and across its restarts) and the grade over all of
them. :class:`StateFile` keeps that in ``<state_dir>/daemon-state.json`` (0600, written
atomically) and reads it back at start: within the same boot the stored results count, each
marked with its age; after a reboot only the stored grade is kept, as the answer while the
checks run again. A file that cannot be read is set aside (``.unreadable-<time>``) with one
clear log line; the daemon starts without it, never crashes on it.

:class:`NodeView` is what the daemon tells others (NVRx's service, ``/healthz``, the metrics):
the grade, or ``UNKNOWN`` while some scheduled check has no result yet and no stored ERROR or
FAULT stands, and each reason with the uid it is about, so that a caller is told other users'
jobs, pids and stack frames only when the caller's uid owns them (:meth:`NodeView.reasons_for`).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node_agent.atomic_file import write_text
from node_agent.model import Grade, Level, ReportFormatError, Result, Target
from node_agent.report.terminal import printable

log = logging.getLogger("node_agent.service.node_state")

SCHEMA = "node-agent.daemon-state/1"
FILE_NAME = "daemon-state.json"
#: the largest state file read back (bytes); a bigger one is set aside as unreadable
MAX_BYTES = 32 << 20
#: the level the daemon answers while it does not know the node's state (not a model.Level:
#: nothing grades UNKNOWN, it is the absence of a grade)
UNKNOWN = "UNKNOWN"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@dataclass
class CheckResults:
    """One check's latest results, when its run finished, and whether they were read back from
    the state file (made by an earlier daemon) rather than run by this one."""

    results: list[Result]
    finished_unix: float
    restored: bool = False


@dataclass
class Stored:
    """What the state file held: per-check results and sticky findings (same boot only) and
    the grade the earlier daemon had."""

    checks: dict[str, CheckResults] = field(default_factory=dict)
    sticky: list[Result] = field(default_factory=list)
    grade: Grade | None = None
    saved_unix: float = 0.0


def boot_id(path: Path = BOOT_ID) -> str:
    """This boot's id (empty where the kernel does not say)."""
    try:
        return path.read_text().strip()
    except OSError:
        return ""


class StateFile:
    """``<state_dir>/daemon-state.json``: :meth:`load` at start, :meth:`save` after a change."""

    def __init__(self, state_dir: Path | str, boot: str | None = None) -> None:
        self.path = Path(state_dir) / FILE_NAME
        self.boot = boot_id() if boot is None else boot

    def load(self) -> Stored:
        """The stored state, or an empty one (no file, or one set aside as unreadable)."""
        try:
            data = self._read()
        except FileNotFoundError:
            return Stored()
        except (OSError, ValueError, ReportFormatError) as err:
            aside = self.path.with_name(f"{self.path.name}.unreadable-{int(time.time())}")
            try:
                os.replace(self.path, aside)
                kept = f"kept as {aside}"
            except OSError as move:
                kept = f"left in place ({move.strerror})"
            log.error(
                "daemon state %s cannot be read (%s); %s; starting without it: the grade is "
                "UNKNOWN until every scheduled check has run",
                self.path,
                printable(str(err))[:300],
                kept,
            )
            return Stored()
        return data

    def _read(self) -> Stored:
        fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise ValueError(f"not a regular file of uid {os.geteuid()}")
            if st.st_size > MAX_BYTES:
                raise ValueError(f"{st.st_size} bytes, over the {MAX_BYTES} read back")
            with os.fdopen(fd, "rb", closefd=False) as f:
                raw = f.read(MAX_BYTES + 1)
        finally:
            os.close(fd)
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} document")
        grade = data.get("grade")
        stored = Stored(
            grade=Grade.from_dict(grade) if isinstance(grade, dict) else None,
            saved_unix=float(data.get("saved_unix", 0.0)),
        )
        if data.get("boot") != self.boot or not self.boot:
            # results of an earlier boot describe a node that has since restarted: only the
            # grade is kept, as the answer until the checks have run again
            return stored
        for name, entry in dict(data.get("checks") or {}).items():
            stored.checks[str(name)] = CheckResults(
                [Result.from_dict(r) for r in entry["results"]],
                float(entry["finished_unix"]),
                restored=True,
            )
        stored.sticky = [Result.from_dict(r) for r in data.get("sticky") or []]
        return stored

    def save(
        self, checks: Mapping[str, CheckResults], sticky: Iterable[Result], grade: Grade | None
    ) -> None:
        """Write the state (0600, atomically); a failure is logged, the daemon goes on."""
        doc = {
            "schema": SCHEMA,
            "boot": self.boot,
            "saved_unix": time.time(),
            "checks": {
                name: {
                    "finished_unix": entry.finished_unix,
                    "results": [r.to_dict() for r in entry.results],
                }
                for name, entry in checks.items()
            },
            "sticky": [r.to_dict() for r in sticky],
            "grade": grade.to_dict() if grade is not None else None,
        }
        try:
            write_text(self.path, json.dumps(doc, default=str, separators=(",", ":")))
        except OSError as err:
            log.error("daemon state %s not saved: %s", self.path, err.strerror or err)


@dataclass(frozen=True)
class ViewReason:
    """One reason of the answered grade, with the uid whose processes it is about (None: no
    user's, or several users')."""

    rule: str
    level: str
    target: str
    message: str
    owner_uid: int | None = None
    about_users: bool = False  # a job target, or results that name a uid
    catalog: str | None = None
    code: int | None = None
    name: str | None = None

    def for_caller(self, uid: int | None) -> dict[str, Any]:
        """This reason as ``uid`` may read it: in full for root and for its owner; for anyone
        else only its typed fields (a message can quote a user's job, pid or stack frame), and
        a job target withheld."""
        full = uid == 0 or (self.owner_uid is not None and uid == self.owner_uid)
        if full:
            return {
                "rule": self.rule,
                "level": self.level,
                "target": self.target,
                "message": self.message,
            }
        target = (
            "job:(another user's)"
            if self.about_users and _is_job(self.target)
            else (self.target if not self.about_users else "node")
        )
        summary = f"{self.level} {self.rule} on {target}"
        if self.catalog and self.code is not None:
            summary += f": {self.catalog} {self.code}" + (f" ({self.name})" if self.name else "")
        if self.about_users:
            summary += " (details withheld: another user's process)"
        return {"rule": self.rule, "level": self.level, "target": target, "message": summary}


def _is_job(target: str) -> bool:
    return Target.parse(target).kind == "job"


@dataclass(frozen=True)
class NodeView:
    """The node as the daemon answers for it. ``level`` is a grade's level name or UNKNOWN."""

    level: str
    reasons: tuple[ViewReason, ...] = ()
    graded_at: float = 0.0  # time.time() of the grade
    complete: bool = False  # every scheduled check has a result (stored ones count)
    missing: tuple[str, ...] = ()  # scheduled checks without a result, or with a stale one
    finished: Mapping[str, float] = field(default_factory=dict)  # check -> time.time()
    restored: frozenset[str] = frozenset()  # checks whose result an earlier daemon made
    stored_grade: bool = False  # the level is the stored grade's, standing in
    suite: str = ""

    @property
    def unknown(self) -> bool:
        return self.level == UNKNOWN

    def why_unknown(self) -> str:
        return (
            f"node-agent does not know this node's state yet: {len(self.missing)} scheduled "
            f"check(s) have no result, or none recent ({', '.join(self.missing[:8])}"
            f"{', ...' if len(self.missing) > 8 else ''}); ask again after they have run"
        )

    def reasons_for(self, uid: int | None) -> list[dict[str, Any]]:
        return [r.for_caller(uid) for r in self.reasons]

    def ages(self, now: float) -> dict[str, float]:
        return {k: round(max(0.0, now - v), 1) for k, v in sorted(self.finished.items())}


def answered(
    grade: Grade, complete: bool, stored: Grade | None
) -> tuple[str, tuple[Any, ...], bool]:
    """(level name, reasons, whether the stored grade stands in) the daemon answers.

    Complete: the grade. Not yet: the grade where it already finds ERROR or FAULT; else a
    stored ERROR or FAULT (never answered healthy before the checks say otherwise); else
    UNKNOWN."""
    if complete or grade.level >= Level.ERROR:
        return grade.level.name, grade.reasons, False
    if stored is not None and stored.level >= Level.ERROR:
        return stored.level.name, stored.reasons, True
    return UNKNOWN, grade.reasons, False


def owners(results: Iterable[Result]) -> dict[str, set[int]]:
    """target -> the uids the results about it name (``evidence.uid``)."""
    out: dict[str, set[int]] = {}
    for r in results:
        uid = r.evidence.get("uid") if isinstance(r.evidence, dict) else None
        if isinstance(uid, int) and not isinstance(uid, bool):
            out.setdefault(r.target, set()).add(uid)
    return out
