"""Durable state in SQLite (WAL) under ``<state_dir>/node-agent.db``.

What it keeps: a summary of every graded run, the remediation state of the node, the action
journal (every transition is journaled *before* it is acted on, so a crash mid-action is
completed on the next start instead of being repeated or forgotten), the circuit breaker and
the node's opt-out flag.

The agent never refuses to *check* because of its own state, and never *acts* without it
(DESIGN.md, "Trust boundary"; docs/remediation.md):

- a file that is not an SQLite database at all (``SQLITE_NOTADB``, "file is not a database")
  is moved aside to ``node-agent.db.corrupt-<timestamp>`` with a loud message on stderr and a
  fresh one is started: nothing in it could be read anyway;
- any other trouble (an I/O error, a full or read-only disk, a lock held too long, a damaged
  page, a schema written by a newer agent, a state directory that is not the agent's own)
  keeps the file as it is and gives a store that is :attr:`Store.unavailable`: opened
  read-only where that still works (``status`` shows the state), else empty. Checks and
  reports go on; every automatic action is refused ("state unavailable"), because opt-out, the
  breaker and the journal cannot be trusted or written.

A write or read that fails later (the disk fills up mid-run) raises :class:`StateUnavailable`
and makes the store unavailable for the rest of the run.

Times are UNIX epoch seconds (float) passed in by the caller, so that tests need no sleeps.
"""

from __future__ import annotations

import enum
import json
import os
import sqlite3
import stat
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from node_agent.atomic_file import private_dir
from node_agent.model import utc_stamp
from node_agent.remediation.states import (
    JournalState,
    NodeState,
    RestartKind,
    StepAction,
    Trigger,
)

DB_NAME = "node-agent.db"
SCHEMA_VERSION = 1
#: how long a write waits for another agent's transaction (a Slurm health check and the daemon
#: may write at once; each transaction is milliseconds) before the state counts as unavailable
BUSY_TIMEOUT_S = 10.0

#: the ``runs`` table's bounds (issue 34: a run is recorded at every grade change, every 15 s
#: under a load of stale heartbeats, and 200 of them grew the table about 1 GB a day): rows
#: older than RUNS_MAX_AGE_S or beyond the newest RUNS_MAX_ROWS are deleted at open and every
#: RUNS_PRUNE_EVERY rows added; a run's reasons are kept up to RUN_REASONS_MAX_BYTES of JSON,
#: the highest levels first (the run's report has them all). Worst case: 20,000 x 8 KiB.
RUNS_MAX_AGE_S = 400 * 86400.0
RUNS_MAX_ROWS = 20_000
RUNS_PRUNE_EVERY = 100
RUN_REASONS_MAX_BYTES = 8192
#: free pages that make an open compact the file (VACUUM): an agent that ran before the
#: bounds may have left gigabytes that SQLite would otherwise keep for reuse, never return
COMPACT_FREE_BYTES = 64 << 20

#: journal states; ``planned`` and ``started`` are the ones a crash can leave behind
JOURNAL_STATES = tuple(JournalState)
OPEN_STATES = (JournalState.PLANNED, JournalState.STARTED)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY, at REAL NOT NULL, node TEXT NOT NULL, suite TEXT NOT NULL,
    mode TEXT NOT NULL, level TEXT NOT NULL, reasons TEXT NOT NULL, report_path TEXT);
CREATE TABLE IF NOT EXISTS node_state (
    node TEXT PRIMARY KEY, state TEXT NOT NULL, since REAL NOT NULL,
    fault_code TEXT, target TEXT, trigger TEXT, restart_kind TEXT, requested_at REAL,
    cleared_at REAL, detail TEXT);
CREATE TABLE IF NOT EXISTS journal (
    id INTEGER PRIMARY KEY, key TEXT NOT NULL, node TEXT NOT NULL, action TEXT NOT NULL,
    reason TEXT NOT NULL, fault_code TEXT, target TEXT, attempt INTEGER NOT NULL DEFAULT 0,
    state TEXT NOT NULL, detail TEXT NOT NULL DEFAULT '', to_state TEXT,
    trigger TEXT NOT NULL DEFAULT 'auto', adapter TEXT NOT NULL DEFAULT '',
    tries INTEGER NOT NULL DEFAULT 0, created_at REAL NOT NULL, updated_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS journal_key ON journal(key);
CREATE INDEX IF NOT EXISTS journal_node_state ON journal(node, state);
CREATE TABLE IF NOT EXISTS breaker (
    id INTEGER PRIMARY KEY CHECK (id = 1), open INTEGER NOT NULL DEFAULT 0, opened_at REAL,
    reason TEXT, reset_at REAL);
CREATE TABLE IF NOT EXISTS opt_out (node TEXT PRIMARY KEY, at REAL NOT NULL, reason TEXT);
"""


def _warn(message: str) -> None:
    print(f"node-agent: WARNING: {message}", file=sys.stderr)


@dataclass(frozen=True)
class JournalRow:
    id: int
    key: str
    node: str
    action: StepAction
    reason: str
    fault_code: str | None
    target: str | None
    attempt: int
    state: JournalState
    detail: str
    to_state: str | None  # the node's remediation state once this action is done
    trigger: Trigger
    adapter: str
    tries: int
    created_at: float
    updated_at: float

    def __post_init__(self) -> None:
        # the database keeps their words; the agent wrote every one of them from these enums
        object.__setattr__(self, "action", StepAction(self.action))
        object.__setattr__(self, "state", JournalState(self.state))
        object.__setattr__(self, "trigger", Trigger(self.trigger))

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class NodeRecord:
    """The remediation state of one node (``in-service`` when never seen)."""

    node: str
    state: NodeState = NodeState.IN_SERVICE
    since: float = 0.0
    fault_code: str | None = None
    target: str | None = None
    trigger: str | None = None  # who started this episode: auto | operator
    restart_kind: RestartKind | None = None  # while restarting
    requested_at: float | None = None  # when the restart was requested
    cleared_at: float | None = None  # last set-healthy; history before it does not count
    detail: str | None = None

    def __post_init__(self) -> None:
        # the store and callers may give the on-disk strings ("drained", "reboot"); ValueError
        # for a string that names no state
        if not isinstance(self.state, NodeState):
            object.__setattr__(self, "state", NodeState(self.state))
        if self.restart_kind is not None and not isinstance(self.restart_kind, RestartKind):
            object.__setattr__(self, "restart_kind", RestartKind(self.restart_kind))

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON-ready values (the enums as their on-disk strings)."""
        return {k: v.value if isinstance(v, enum.Enum) else v for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class BreakerState:
    open: bool = False
    opened_at: float | None = None
    reason: str | None = None
    reset_at: float | None = None


@dataclass(frozen=True)
class RunRow:
    at: float
    suite: str
    mode: str
    level: str
    reasons: list[dict[str, Any]]
    report_path: str | None


class StateUnavailable(Exception):
    """The agent's own state cannot be read or written; nothing may be acted on."""


class Store:
    """The agent's SQLite state. Open with :func:`open_store`; close when done.

    ``unavailable`` is None while the store can be trusted; otherwise it says why not, the
    store is read-only (or empty), and every write raises :class:`StateUnavailable`."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        path: Path | None,
        notes: list[str] | None = None,
        unavailable: str | None = None,
    ) -> None:
        self._conn = conn
        self.path = path  # None: nothing on disk could be opened
        self.notes = notes or []  # what went wrong opening it (moved aside, read-only)
        self.unavailable = unavailable
        self._added = 0  # runs recorded since the last prune

    def close(self) -> None:
        self._conn.close()

    def _fail(self, what: str, err: sqlite3.Error) -> StateUnavailable:
        reason = f"{what} {self.path or 'the state database'} failed: {err}"
        if self.unavailable is None:
            self.unavailable = reason
            self.notes.append(reason)
            _warn(
                f"{reason}; automatic actions are refused until it works again (the file "
                "is kept as it is)"
            )
        return StateUnavailable(reason)

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, taken immediately so concurrent agents serialise."""
        if self.unavailable is not None:
            raise StateUnavailable(self.unavailable)
        try:
            self._conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as err:
            raise self._fail("writing", err) from err
        try:
            yield self._conn
        except sqlite3.Error as err:
            with suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")
            raise self._fail("writing", err) from err
        except BaseException:
            with suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")
            raise
        try:
            self._conn.execute("COMMIT")
        except sqlite3.Error as err:
            with suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")
            raise self._fail("writing", err) from err

    def _rows(self, sql: str, params: tuple[Any, ...] | list[Any] = (), one: bool = False) -> Any:
        """A query; a failing read makes the store unavailable (StateUnavailable)."""
        try:
            cur = self._conn.execute(sql, params)
            return cur.fetchone() if one else cur.fetchall()
        except sqlite3.Error as err:
            raise self._fail("reading", err) from err

    # -- runs ----------------------------------------------------------------------------------
    def record_run(
        self,
        node: str,
        at: float,
        suite: str,
        mode: str,
        level: str,
        reasons: list[dict[str, Any]],
        report_path: str | None = None,
    ) -> None:
        """Add a graded run (its reasons bounded: :func:`bounded_reasons`); every
        :data:`RUNS_PRUNE_EVERY` runs, prune the table (:meth:`prune_runs`, ``at`` as now)."""
        with self._tx() as c:
            c.execute(
                "INSERT INTO runs (at, node, suite, mode, level, reasons, report_path) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (at, node, suite, mode, level, bounded_reasons(reasons), report_path),
            )
        self._added += 1
        if self._added >= RUNS_PRUNE_EVERY:
            self.prune_runs(at)

    def prune_runs(
        self,
        now: float,
        max_age_s: float = RUNS_MAX_AGE_S,
        max_rows: int = RUNS_MAX_ROWS - RUNS_PRUNE_EVERY,
    ) -> int:
        """Delete the runs older than ``max_age_s`` and all but the newest ``max_rows``;
        returns how many went. The default leaves room for the rows added before the next
        prune, so the table never holds more than RUNS_MAX_ROWS. Two deletes: milliseconds
        for a full table."""
        with self._tx() as c:
            gone = c.execute("DELETE FROM runs WHERE at < ?", (now - max_age_s,)).rowcount
            gone += c.execute(
                "DELETE FROM runs WHERE id <= (SELECT id FROM runs ORDER BY id DESC "
                "LIMIT 1 OFFSET ?)",
                (max_rows,),
            ).rowcount
        self._added = 0
        return gone

    def last_run(self, node: str) -> RunRow | None:
        row = self._rows(
            "SELECT at, suite, mode, level, reasons, report_path FROM runs WHERE node = ? "
            "ORDER BY id DESC LIMIT 1",
            (node,),
            one=True,
        )
        if row is None:
            return None
        return RunRow(row[0], row[1], row[2], row[3], json.loads(row[4]), row[5])

    def runs_since(self, node: str, since: float, limit: int = 200) -> list[RunRow]:
        """The newest ``limit`` runs at or after ``since``, oldest first."""
        rows = self._rows(
            "SELECT at, suite, mode, level, reasons, report_path FROM runs WHERE node = ? "
            "AND at >= ? ORDER BY id DESC LIMIT ?",
            (node, since, limit),
        )
        return [RunRow(r[0], r[1], r[2], r[3], json.loads(r[4]), r[5]) for r in reversed(rows)]

    # -- node state ----------------------------------------------------------------------------
    def node_record(self, node: str) -> NodeRecord:
        row = self._rows(
            "SELECT node, state, since, fault_code, target, trigger, restart_kind, requested_at,"
            " cleared_at, detail FROM node_state WHERE node = ?",
            (node,),
            one=True,
        )
        if not row:
            return NodeRecord(node=node)
        try:
            return NodeRecord(*row)
        except ValueError as err:  # a state or restart kind this agent does not know
            reason = f"reading {self.path or 'the state database'}: node {node!r}: {err}"
            self.unavailable = self.unavailable or reason
            raise StateUnavailable(reason) from err

    def set_node_record(self, record: NodeRecord) -> None:
        with self._tx() as c:
            self._put_record(c, record)

    @staticmethod
    def _put_record(c: sqlite3.Connection, r: NodeRecord) -> None:
        c.execute(
            "INSERT OR REPLACE INTO node_state (node, state, since, fault_code, target, "
            "trigger, restart_kind, requested_at, cleared_at, detail) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                r.node,
                r.state.value,
                r.since,
                r.fault_code,
                r.target,
                r.trigger,
                r.restart_kind.value if r.restart_kind is not None else None,
                r.requested_at,
                r.cleared_at,
                r.detail,
            ),
        )

    def clear_node(self, node: str, now: float, detail: str) -> NodeRecord:
        """``set-healthy``: back in service; restarts and drains before ``now`` stop counting.

        The journal rows are kept (they are the audit trail); open rows are closed as
        ``refused`` so that crash recovery does not replay them after a repair.
        """
        record = NodeRecord(
            node=node, state=NodeState.IN_SERVICE, since=now, cleared_at=now, detail=detail
        )
        with self._tx() as c:
            self._put_record(c, record)
            c.execute(
                "UPDATE journal SET state = 'refused', detail = ?, updated_at = ? "
                "WHERE node = ? AND state IN ('planned', 'started')",
                (f"cancelled by set-healthy: {detail}", now, node),
            )
        return record

    # -- journal -------------------------------------------------------------------------------
    def journal_plan(
        self,
        *,
        key: str,
        node: str,
        action: str,
        reason: str,
        fault_code: str | None,
        target: str | None,
        attempt: int,
        to_state: str | None,
        trigger: str,
        adapter: str,
        now: float,
        state: str = "planned",
        detail: str = "",
        tries: int = 0,
    ) -> JournalRow:
        """Write a journal row *before* acting; returns it (with its id). A retry of a failed
        step is a new row with the same key and the tries so far (the journal shows each
        attempt)."""
        if state not in JOURNAL_STATES:
            raise ValueError(f"journal state {state!r} is not one of {JOURNAL_STATES}")
        with self._tx() as c:
            cur = c.execute(
                "INSERT INTO journal (key, node, action, reason, fault_code, target, attempt, "
                "state, detail, to_state, trigger, adapter, tries, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    key,
                    node,
                    action,
                    reason,
                    fault_code,
                    target,
                    attempt,
                    state,
                    detail,
                    to_state,
                    trigger,
                    adapter,
                    tries,
                    now,
                    now,
                ),
            )
            row_id = cur.lastrowid
        if row_id is None:  # sqlite3 sets it after every INSERT
            raise StateUnavailable("writing the journal: the new row has no id")
        return self.journal_row(row_id)

    def journal_update(
        self, row_id: int, state: str, detail: str, now: float, count_try: bool = False
    ) -> JournalRow:
        if state not in JOURNAL_STATES:
            raise ValueError(f"journal state {state!r} is not one of {JOURNAL_STATES}")
        with self._tx() as c:
            c.execute(
                "UPDATE journal SET state = ?, detail = ?, updated_at = ?, "
                "tries = tries + ? WHERE id = ?",
                (state, detail, now, 1 if count_try else 0, row_id),
            )
        return self.journal_row(row_id)

    def journal_finish(
        self, row_id: int, state: str, detail: str, now: float, record: NodeRecord | None = None
    ) -> JournalRow:
        """Close a row and, when it is ``done``, move the node to its new state, atomically."""
        if state not in JOURNAL_STATES:
            raise ValueError(f"journal state {state!r} is not one of {JOURNAL_STATES}")
        with self._tx() as c:
            c.execute(
                "UPDATE journal SET state = ?, detail = ?, updated_at = ? WHERE id = ?",
                (state, detail, now, row_id),
            )
            if record is not None:
                self._put_record(c, record)
        return self.journal_row(row_id)

    def journal_row(self, row_id: int) -> JournalRow:
        row = self._rows(f"SELECT {_JCOLS} FROM journal WHERE id = ?", (row_id,), one=True)
        if row is None:
            raise KeyError(f"journal row {row_id} does not exist")
        return JournalRow(*row)

    def journal_by_key(self, key: str) -> JournalRow | None:
        """The newest row with this idempotency key."""
        row = self._rows(
            f"SELECT {_JCOLS} FROM journal WHERE key = ? ORDER BY id DESC LIMIT 1", (key,), one=True
        )
        return JournalRow(*row) if row else None

    def first_seen(self, key: str, since: float) -> float | None:
        """When a row with this key was first written at or after ``since`` (the start of the
        node's current episode): the fault's first sighting, for the adapters' idempotency."""
        row = self._rows(
            "SELECT MIN(created_at) FROM journal WHERE key = ? AND created_at >= ?",
            (key, since),
            one=True,
        )
        return row[0] if row else None

    def open_journal(self, node: str) -> list[JournalRow]:
        """Rows a crash left ``planned`` or ``started``, oldest first."""
        rows = self._rows(
            f"SELECT {_JCOLS} FROM journal WHERE node = ? AND state IN "
            "('planned', 'started') ORDER BY id",
            (node,),
        )
        return [JournalRow(*r) for r in rows]

    def journal_tail(self, node: str | None = None, limit: int = 20) -> list[JournalRow]:
        """The newest ``limit`` rows (oldest first)."""
        if node is None:
            rows = self._rows(f"SELECT {_JCOLS} FROM journal ORDER BY id DESC LIMIT ?", (limit,))
        else:
            rows = self._rows(
                f"SELECT {_JCOLS} FROM journal WHERE node = ? ORDER BY id DESC LIMIT ?",
                (node, limit),
            )
        return [JournalRow(*r) for r in reversed(rows)]

    def count_done(
        self,
        node: str | None,
        actions: tuple[str, ...],
        since: float,
        fault_code: str | None = None,
        trigger: str | None = None,
    ) -> int:
        """How many ``done`` rows of these actions (for this node and fault code) since then."""
        sql = (
            f"SELECT COUNT(*) FROM journal WHERE state = 'done' AND updated_at >= ? "
            f"AND action IN ({','.join('?' * len(actions))})"
        )
        params: list[Any] = [since, *actions]
        if node is not None:
            sql += " AND node = ?"
            params.append(node)
        if fault_code is not None:
            sql += " AND fault_code = ?"
            params.append(fault_code)
        if trigger is not None:
            sql += " AND trigger = ?"
            params.append(trigger)
        return int(self._rows(sql, params, one=True)[0])

    def done_by_code(
        self, node: str, actions: tuple[str, ...], since: float, trigger: str | None = None
    ) -> dict[str, int]:
        """``done`` rows of these actions since then, per fault code (``status``: the restarts
        each fault code has had in its window)."""
        sql = (
            f"SELECT fault_code, COUNT(*) FROM journal WHERE node = ? AND state = 'done' "
            f"AND updated_at >= ? AND action IN ({','.join('?' * len(actions))})"
        )
        params: list[Any] = [node, since, *actions]
        if trigger is not None:
            sql += " AND trigger = ?"
            params.append(trigger)
        rows = self._rows(sql + " GROUP BY fault_code ORDER BY fault_code", params)
        return {str(code or "-"): int(n) for code, n in rows}

    def last_done_at(self, node: str, actions: tuple[str, ...]) -> float | None:
        row = self._rows(
            f"SELECT MAX(updated_at) FROM journal WHERE node = ? AND state = 'done' "
            f"AND action IN ({','.join('?' * len(actions))})",
            (node, *actions),
            one=True,
        )
        return row[0] if row else None

    # -- breaker -------------------------------------------------------------------------------
    def breaker(self) -> BreakerState:
        row = self._rows(
            "SELECT open, opened_at, reason, reset_at FROM breaker WHERE id = 1", one=True
        )
        return BreakerState(bool(row[0]), row[1], row[2], row[3]) if row else BreakerState()

    def open_breaker(self, now: float, reason: str) -> None:
        with self._tx() as c:
            c.execute(
                "INSERT INTO breaker (id, open, opened_at, reason, reset_at) "
                "VALUES (1, 1, ?, ?, (SELECT reset_at FROM breaker WHERE id = 1)) "
                "ON CONFLICT(id) DO UPDATE SET open = 1, opened_at = excluded.opened_at, "
                "reason = excluded.reason",
                (now, reason),
            )

    def reset_breaker(self, now: float) -> BreakerState:
        """Close the breaker; drains before ``now`` no longer count towards tripping it."""
        before = self.breaker()
        with self._tx() as c:
            c.execute(
                "INSERT INTO breaker (id, open, opened_at, reason, reset_at) "
                "VALUES (1, 0, NULL, NULL, ?) ON CONFLICT(id) DO UPDATE SET open = 0, "
                "opened_at = NULL, reason = NULL, reset_at = excluded.reset_at",
                (now,),
            )
        return before

    # -- opt-out -------------------------------------------------------------------------------
    def opted_out(self, node: str) -> str | None:
        """The opt-out reason when the node is opted out, else None."""
        row = self._rows("SELECT reason FROM opt_out WHERE node = ?", (node,), one=True)
        return (row[0] or "opted out") if row else None

    def set_opt_out(self, node: str, on: bool, now: float, reason: str = "") -> None:
        with self._tx() as c:
            if on:
                c.execute(
                    "INSERT OR REPLACE INTO opt_out (node, at, reason) VALUES (?, ?, ?)",
                    (node, now, reason or "opted out by an operator"),
                )
            else:
                c.execute("DELETE FROM opt_out WHERE node = ?", (node,))

    def schema_version(self) -> int:
        return int(self._rows("SELECT version FROM schema_version", one=True)[0])


_JCOLS = (
    "id, key, node, action, reason, fault_code, target, attempt, state, detail, to_state, "
    "trigger, adapter, tries, created_at, updated_at"
)


_LEVEL_ORDER = {"FAULT": 0, "ERROR": 1, "WARN": 2}


def bounded_reasons(reasons: list[dict[str, Any]], max_bytes: int = RUN_REASONS_MAX_BYTES) -> str:
    """``reasons`` as the ``runs`` table keeps them: JSON of at most about ``max_bytes``. When
    they are longer, the highest levels are kept first (FAULT, ERROR, WARN: what the restart
    limits and ``status`` read), each reason whole and in its place, and one last entry (rule
    ``runs-reasons-cut``) says how many were left out."""
    text = json.dumps(reasons)
    if len(text) <= max_bytes:
        return text
    room = max_bytes - 200  # for the closing note
    keep: set[int] = set()
    for i in sorted(
        range(len(reasons)), key=lambda i: _LEVEL_ORDER.get(str(reasons[i].get("level")), 3)
    ):
        size = len(json.dumps(reasons[i])) + 2
        if size <= room:
            keep.add(i)
            room -= size
    cut = len(reasons) - len(keep)
    note = {
        "rule": "runs-reasons-cut",
        "level": "HEALTHY",
        "target": "node",
        "message": f"{cut} more reason(s) of this run are not kept here (its report has them)",
    }
    return json.dumps([r for i, r in enumerate(reasons) if i in keep] + [note])


def _connect(path: Path | str) -> sqlite3.Connection:
    # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE in Store._tx).
    conn = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_S, isolation_level=None)
    conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
    if str(path) != ":memory:":
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise sqlite3.DatabaseError(f"cannot switch {path} to WAL mode (got {mode})")
    conn.execute("PRAGMA synchronous = NORMAL")
    return conn


class NewerSchema(sqlite3.DatabaseError):
    """The database was written by a newer node-agent (an agent rollback): kept, not used."""


def _init_schema(conn: sqlite3.Connection, path: Path | str) -> None:
    """Create the tables (idempotent) and check the schema version; raise DatabaseError if
    the file is not a database this agent can use (NewerSchema for a newer agent's)."""
    check = conn.execute("PRAGMA quick_check").fetchone()
    if check is None or check[0] != "ok":
        raise sqlite3.DatabaseError(f"integrity check of {path} failed: {check}")
    _check_version(conn, path)
    conn.executescript(_SCHEMA)
    row = conn.execute("SELECT version FROM schema_version").fetchone()
    if row is None:
        conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))


def _check_version(conn: sqlite3.Connection, path: Path | str) -> None:
    try:
        row = conn.execute("SELECT version FROM schema_version").fetchone()
    except sqlite3.OperationalError as err:
        if "no such table" in str(err):
            return  # a new database
        raise
    if row is not None and int(row[0]) > SCHEMA_VERSION:
        raise NewerSchema(
            f"{path} has schema version {row[0]}; this agent knows up to {SCHEMA_VERSION} "
            "(written by a newer node-agent)"
        )


def _not_a_database(err: sqlite3.Error) -> bool:
    """Only this moves a store aside: the file is not SQLite at all, so nothing in it is lost."""
    return getattr(
        err, "sqlite_errorname", None
    ) == "SQLITE_NOTADB" or "file is not a database" in str(err)


def open_store(state_dir: Path | str, clock: Callable[[], float] = time.time) -> Store:
    """Open (or create) the store under ``state_dir``; never raises for its own state.

    A file that is not a database is moved aside to ``node-agent.db.corrupt-<timestamp>``
    (with its ``-wal``/``-shm`` files) and a fresh database started. Anything else that goes
    wrong keeps the file and gives an unavailable store (read-only where it can still be read,
    else empty): see the module docstring. Both are reported loudly on stderr and in
    ``Store.notes``.
    """
    state_dir = Path(state_dir)
    path = state_dir / DB_NAME
    notes: list[str] = []
    try:
        private_dir(state_dir)  # 0700: nobody else may read the journal or lock the database
    except OSError as err:
        return _unavailable_store(
            path, f"cannot use state dir {state_dir}: {err.strerror or err}", notes, read_only=False
        )
    for attempt in (1, 2):
        conn = None
        try:
            # can it be written? SQLite opens a file it may not write read-only, silently, and
            # a read-only disk would show up only at the first action
            for target in (state_dir, path):
                if target.exists() and not os.access(target, os.W_OK):
                    raise sqlite3.OperationalError(
                        f"{target} is not writable (a read-only file system, or its permissions)"
                    )
            conn = _connect(path)
            _init_schema(conn, path)
            _private_files(path)
            store = Store(conn, path, notes)
            _prune_at_open(store, clock())
            return store
        except sqlite3.Error as err:
            if conn is not None:
                with suppress(sqlite3.Error):
                    conn.close()
            if attempt == 1 and _not_a_database(err) and path.exists():
                try:
                    moved = move_aside(path, clock())
                except OSError as move_err:
                    return _unavailable_store(
                        path,
                        f"{path} is not a database and cannot be moved aside ({move_err})",
                        notes,
                    )
                note = (
                    f"state database {path} is not a database ({err}); moved it aside to "
                    f"{moved} and started a fresh one: remediation history, journal and "
                    "breaker state are reset; inspect the old file and keep it for the "
                    "incident record"
                )
                _warn(note)
                notes.append(note)
                continue
            return _unavailable_store(path, f"cannot use {path}: {err}", notes)
        except OSError as err:
            if conn is not None:
                with suppress(sqlite3.Error):
                    conn.close()
            return _unavailable_store(path, f"cannot use {path}: {err}", notes)
    raise AssertionError("unreachable")  # pragma: no cover


def _prune_at_open(store: Store, now: float) -> None:
    """Prune the runs table, and compact the file when an older agent left much free space in
    it (VACUUM copies only what is kept: a second or so for a full table). A failure to
    prune makes the store unavailable, as any failed write does; one to compact is a note."""
    try:
        store.prune_runs(now)
    except StateUnavailable:
        return
    try:
        free, size = (
            store._conn.execute(f"PRAGMA {what}").fetchone()[0]
            for what in ("freelist_count", "page_size")
        )
        if free * size >= COMPACT_FREE_BYTES:
            store._conn.execute("VACUUM")  # in WAL mode the file shrinks at the checkpoint
            store._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            store.notes.append(
                f"state database {store.path}: compacted {free * size >> 20} MiB that older "
                "runs had left free"
            )
    except sqlite3.Error as err:
        store.notes.append(f"state database {store.path} could not be compacted: {err}")


def _open_read_only(path: Path) -> tuple[sqlite3.Connection, str] | None:
    """The database opened read-only, for ``status``: normally, else as immutable (a read-only
    disk where the -shm file cannot be made; the last changes, still in the -wal, may be
    missing). None when neither works or the file is absent."""
    if not path.is_file():
        return None
    for query, how in (
        ("mode=ro", "read-only"),
        (
            "mode=ro&immutable=1",
            "read-only, from the main file only (changes still in the -wal file are not shown)",
        ),
    ):
        conn = None
        try:
            conn = sqlite3.connect(
                f"file:{quote(str(path))}?{query}", uri=True, timeout=2.0, isolation_level=None
            )
            conn.execute("PRAGMA query_only = 1")
            conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
            return conn, how
        except sqlite3.Error:
            if conn is not None:
                with suppress(sqlite3.Error):
                    conn.close()
    return None


def _unavailable_store(
    path: Path, why: str, notes: list[str] | None = None, read_only: bool = True
) -> Store:
    """The file is kept; the store refuses every write. Read-only when it can be read."""
    opened = _open_read_only(path) if read_only else None
    if opened is not None:
        conn, how = opened
        shown = f"opened {how} for status"
    else:
        conn = sqlite3.connect(":memory:", isolation_level=None)
        conn.executescript(_SCHEMA)
        conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
        shown = "nothing of it can be read"
    note = (
        f"state unavailable: {why}; the file is kept as it is ({shown}); checks and reports "
        "go on, automatic actions are refused until the state works again: free the disk, "
        "fix its permissions or mount, or move the file aside by hand"
    )
    _warn(note)
    return Store(
        conn, path if opened is not None else None, [*(notes or []), note], unavailable=why
    )


def _private_files(path: Path) -> None:
    """The database and its -wal/-shm files 0600 (SQLite gives new -wal/-shm the database's
    mode, so this holds for the files made later too)."""
    for name in (path.name, path.name + "-wal", path.name + "-shm"):
        f = path.with_name(name)
        try:
            st = f.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077:
            os.chmod(f, 0o600)


def move_aside(path: Path, now: float) -> Path:
    """Rename a database that is not SQLite (and its -wal/-shm) to ``<name>.corrupt-<time>``,
    keeping it for a person; returns where it went."""
    stamp = utc_stamp(now)
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
    path.rename(target)
    for suffix in ("-wal", "-shm"):
        side = path.with_name(path.name + suffix)
        if side.exists():
            side.rename(target.with_name(target.name + suffix))
    return target
