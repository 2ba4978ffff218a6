"""Durable state in SQLite (WAL) under ``<state_dir>/node-agent.db``.

What it keeps: a summary of every graded run, the remediation state of the node, the action
journal (every transition is journaled *before* it is acted on, so a crash mid-action is
completed on the next start instead of being repeated or forgotten), the circuit breaker and
the node's opt-out flag.

The agent never refuses to run because of its own state: a database that is not SQLite, or
whose schema is unreadable, is moved aside to ``node-agent.db.corrupt-<timestamp>`` with a loud
message on stderr and a fresh one is started; a state directory that cannot be written gives an
in-memory store (with a warning) for this run.

Times are UNIX epoch seconds (float) passed in by the caller, so that tests need no sleeps.
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node_agent.atomic_file import private_dir

DB_NAME = "node-agent.db"
SCHEMA_VERSION = 1

#: journal states; ``planned`` and ``started`` are the ones a crash can leave behind
JOURNAL_STATES = ("planned", "started", "done", "failed", "refused", "dry-run")
OPEN_STATES = ("planned", "started")

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
    action: str  # drain | resume | restart | gpu-reset | replace | retest
    reason: str
    fault_code: str | None
    target: str | None
    attempt: int
    state: str  # one of JOURNAL_STATES
    detail: str
    to_state: str | None  # the node's remediation state once this action is done
    trigger: str  # auto | operator
    adapter: str
    tries: int
    created_at: float
    updated_at: float

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class NodeRecord:
    """The remediation state of one node (``in-service`` when never seen)."""

    node: str
    state: str = "in-service"
    since: float = 0.0
    fault_code: str | None = None
    target: str | None = None
    trigger: str | None = None  # who started this episode: auto | operator
    restart_kind: str | None = None  # gpu-reset | reboot, while restarting
    requested_at: float | None = None  # when the restart was requested
    cleared_at: float | None = None  # last set-healthy; history before it does not count
    detail: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


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


class Store:
    """The agent's SQLite state. Open with :func:`open_store`; close when done."""

    def __init__(self, conn: sqlite3.Connection, path: Path | None,
                 notes: list[str] | None = None) -> None:
        self._conn = conn
        self.path = path  # None: in memory (state dir unwritable)
        self.notes = notes or []  # what went wrong opening it (moved aside, in memory)

    def close(self) -> None:
        self._conn.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, taken immediately so concurrent agents serialise."""
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield self._conn
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    # -- runs ----------------------------------------------------------------------------------
    def record_run(self, node: str, at: float, suite: str, mode: str, level: str,
                   reasons: list[dict[str, Any]], report_path: str | None = None) -> None:
        with self._tx() as c:
            c.execute("INSERT INTO runs (at, node, suite, mode, level, reasons, report_path) "
                      "VALUES (?, ?, ?, ?, ?, ?, ?)",
                      (at, node, suite, mode, level, json.dumps(reasons), report_path))

    def last_run(self, node: str) -> RunRow | None:
        row = self._conn.execute(
            "SELECT at, suite, mode, level, reasons, report_path FROM runs WHERE node = ? "
            "ORDER BY id DESC LIMIT 1", (node,)).fetchone()
        if row is None:
            return None
        return RunRow(row[0], row[1], row[2], row[3], json.loads(row[4]), row[5])

    # -- node state ----------------------------------------------------------------------------
    def node_record(self, node: str) -> NodeRecord:
        row = self._conn.execute(
            "SELECT node, state, since, fault_code, target, trigger, restart_kind, requested_at,"
            " cleared_at, detail FROM node_state WHERE node = ?", (node,)).fetchone()
        return NodeRecord(*row) if row else NodeRecord(node=node)

    def set_node_record(self, record: NodeRecord) -> None:
        with self._tx() as c:
            self._put_record(c, record)

    @staticmethod
    def _put_record(c: sqlite3.Connection, r: NodeRecord) -> None:
        c.execute("INSERT OR REPLACE INTO node_state (node, state, since, fault_code, target, "
                  "trigger, restart_kind, requested_at, cleared_at, detail) "
                  "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                  (r.node, r.state, r.since, r.fault_code, r.target, r.trigger, r.restart_kind,
                   r.requested_at, r.cleared_at, r.detail))

    def clear_node(self, node: str, now: float, detail: str) -> NodeRecord:
        """``set-healthy``: back in service; restarts and drains before ``now`` stop counting.

        The journal rows are kept (they are the audit trail); open rows are closed as
        ``refused`` so that crash recovery does not replay them after a repair.
        """
        record = NodeRecord(node=node, state="in-service", since=now, cleared_at=now,
                            detail=detail)
        with self._tx() as c:
            self._put_record(c, record)
            c.execute("UPDATE journal SET state = 'refused', detail = ?, updated_at = ? "
                      "WHERE node = ? AND state IN ('planned', 'started')",
                      (f"cancelled by set-healthy: {detail}", now, node))
        return record

    # -- journal -------------------------------------------------------------------------------
    def journal_plan(self, *, key: str, node: str, action: str, reason: str,
                     fault_code: str | None, target: str | None, attempt: int,
                     to_state: str | None, trigger: str, adapter: str, now: float,
                     state: str = "planned", detail: str = "") -> JournalRow:
        """Write a journal row *before* acting; returns it (with its id)."""
        if state not in JOURNAL_STATES:
            raise ValueError(f"journal state {state!r} is not one of {JOURNAL_STATES}")
        with self._tx() as c:
            cur = c.execute(
                "INSERT INTO journal (key, node, action, reason, fault_code, target, attempt, "
                "state, detail, to_state, trigger, adapter, tries, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?, ?)",
                (key, node, action, reason, fault_code, target, attempt, state, detail,
                 to_state, trigger, adapter, now, now))
            row_id = cur.lastrowid
        return self.journal_row(int(row_id))

    def journal_update(self, row_id: int, state: str, detail: str, now: float,
                       count_try: bool = False) -> JournalRow:
        if state not in JOURNAL_STATES:
            raise ValueError(f"journal state {state!r} is not one of {JOURNAL_STATES}")
        with self._tx() as c:
            c.execute("UPDATE journal SET state = ?, detail = ?, updated_at = ?, "
                      "tries = tries + ? WHERE id = ?",
                      (state, detail, now, 1 if count_try else 0, row_id))
        return self.journal_row(row_id)

    def journal_finish(self, row_id: int, state: str, detail: str, now: float,
                       record: NodeRecord | None = None) -> JournalRow:
        """Close a row and, when it is ``done``, move the node to its new state, atomically."""
        if state not in JOURNAL_STATES:
            raise ValueError(f"journal state {state!r} is not one of {JOURNAL_STATES}")
        with self._tx() as c:
            c.execute("UPDATE journal SET state = ?, detail = ?, updated_at = ? WHERE id = ?",
                      (state, detail, now, row_id))
            if record is not None:
                self._put_record(c, record)
        return self.journal_row(row_id)

    def journal_row(self, row_id: int) -> JournalRow:
        row = self._conn.execute(f"SELECT {_JCOLS} FROM journal WHERE id = ?",
                                 (row_id,)).fetchone()
        if row is None:
            raise KeyError(f"journal row {row_id} does not exist")
        return JournalRow(*row)

    def journal_by_key(self, key: str) -> JournalRow | None:
        """The newest row with this idempotency key."""
        row = self._conn.execute(f"SELECT {_JCOLS} FROM journal WHERE key = ? "
                                 "ORDER BY id DESC LIMIT 1", (key,)).fetchone()
        return JournalRow(*row) if row else None

    def open_journal(self, node: str) -> list[JournalRow]:
        """Rows a crash left ``planned`` or ``started``, oldest first."""
        rows = self._conn.execute(f"SELECT {_JCOLS} FROM journal WHERE node = ? AND state IN "
                                  "('planned', 'started') ORDER BY id", (node,)).fetchall()
        return [JournalRow(*r) for r in rows]

    def journal_tail(self, node: str | None = None, limit: int = 20) -> list[JournalRow]:
        """The newest ``limit`` rows (oldest first)."""
        if node is None:
            rows = self._conn.execute(f"SELECT {_JCOLS} FROM journal ORDER BY id DESC LIMIT ?",
                                      (limit,)).fetchall()
        else:
            rows = self._conn.execute(f"SELECT {_JCOLS} FROM journal WHERE node = ? "
                                      "ORDER BY id DESC LIMIT ?", (node, limit)).fetchall()
        return [JournalRow(*r) for r in reversed(rows)]

    def count_done(self, node: str | None, actions: tuple[str, ...], since: float,
                   fault_code: str | None = None, trigger: str | None = None) -> int:
        """How many ``done`` rows of these actions (for this node and fault code) since then."""
        sql = (f"SELECT COUNT(*) FROM journal WHERE state = 'done' AND updated_at >= ? "
               f"AND action IN ({','.join('?' * len(actions))})")
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
        return int(self._conn.execute(sql, params).fetchone()[0])

    def last_done_at(self, node: str, actions: tuple[str, ...]) -> float | None:
        row = self._conn.execute(
            f"SELECT MAX(updated_at) FROM journal WHERE node = ? AND state = 'done' "
            f"AND action IN ({','.join('?' * len(actions))})", (node, *actions)).fetchone()
        return row[0] if row else None

    # -- breaker -------------------------------------------------------------------------------
    def breaker(self) -> BreakerState:
        row = self._conn.execute(
            "SELECT open, opened_at, reason, reset_at FROM breaker WHERE id = 1").fetchone()
        return BreakerState(bool(row[0]), row[1], row[2], row[3]) if row else BreakerState()

    def open_breaker(self, now: float, reason: str) -> None:
        with self._tx() as c:
            c.execute("INSERT INTO breaker (id, open, opened_at, reason, reset_at) "
                      "VALUES (1, 1, ?, ?, (SELECT reset_at FROM breaker WHERE id = 1)) "
                      "ON CONFLICT(id) DO UPDATE SET open = 1, opened_at = excluded.opened_at, "
                      "reason = excluded.reason", (now, reason))

    def reset_breaker(self, now: float) -> BreakerState:
        """Close the breaker; drains before ``now`` no longer count towards tripping it."""
        before = self.breaker()
        with self._tx() as c:
            c.execute("INSERT INTO breaker (id, open, opened_at, reason, reset_at) "
                      "VALUES (1, 0, NULL, NULL, ?) ON CONFLICT(id) DO UPDATE SET open = 0, "
                      "opened_at = NULL, reason = NULL, reset_at = excluded.reset_at", (now,))
        return before

    # -- opt-out -------------------------------------------------------------------------------
    def opted_out(self, node: str) -> str | None:
        """The opt-out reason when the node is opted out, else None."""
        row = self._conn.execute("SELECT reason FROM opt_out WHERE node = ?",
                                 (node,)).fetchone()
        return (row[0] or "opted out") if row else None

    def set_opt_out(self, node: str, on: bool, now: float, reason: str = "") -> None:
        with self._tx() as c:
            if on:
                c.execute("INSERT OR REPLACE INTO opt_out (node, at, reason) VALUES (?, ?, ?)",
                          (node, now, reason or "opted out by an operator"))
            else:
                c.execute("DELETE FROM opt_out WHERE node = ?", (node,))

    def schema_version(self) -> int:
        return int(self._conn.execute("SELECT version FROM schema_version").fetchone()[0])


_JCOLS = ("id, key, node, action, reason, fault_code, target, attempt, state, detail, to_state, "
          "trigger, adapter, tries, created_at, updated_at")


def _connect(path: Path | str) -> sqlite3.Connection:
    # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE in Store._tx).
    conn = sqlite3.connect(str(path), timeout=10.0, isolation_level=None)
    conn.execute("PRAGMA busy_timeout = 10000")
    if str(path) != ":memory:":
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise sqlite3.DatabaseError(f"cannot switch {path} to WAL mode (got {mode})")
    conn.execute("PRAGMA synchronous = NORMAL")
    return conn


def _init_schema(conn: sqlite3.Connection, path: Path | str) -> None:
    """Create the tables (idempotent) and check the schema version; raise DatabaseError if
    the file is not a database this agent can use."""
    check = conn.execute("PRAGMA quick_check").fetchone()
    if check is None or check[0] != "ok":
        raise sqlite3.DatabaseError(f"integrity check of {path} failed: {check}")
    conn.executescript(_SCHEMA)
    row = conn.execute("SELECT version FROM schema_version").fetchone()
    if row is None:
        conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
    elif int(row[0]) > SCHEMA_VERSION:
        raise sqlite3.DatabaseError(
            f"{path} has schema version {row[0]}; this agent knows up to {SCHEMA_VERSION} "
            "(written by a newer node-agent)")


def open_store(state_dir: Path | str, clock: Callable[[], float] = time.time) -> Store:
    """Open (or create) the store under ``state_dir``; never raises for its own state.

    A corrupt or foreign file is moved aside to ``node-agent.db.corrupt-<timestamp>`` (with its
    ``-wal``/``-shm`` files) and a fresh database started; an unwritable state directory gives
    an in-memory store. Both are reported loudly on stderr and in ``Store.notes``.
    """
    state_dir = Path(state_dir)
    path = state_dir / DB_NAME
    notes: list[str] = []
    try:
        private_dir(state_dir)  # 0700: nobody else may read the journal or lock the database
    except OSError as err:
        return _memory_store(f"cannot use state dir {state_dir}: {err.strerror or err}")
    for attempt in (1, 2):
        conn = None
        try:
            conn = _connect(path)
            _init_schema(conn, path)
            _private_files(path)
            return Store(conn, path, notes)
        except sqlite3.DatabaseError as err:
            if conn is not None:
                conn.close()
            if attempt == 2 or not path.exists():
                return _memory_store(f"cannot open {path}: {err}", notes)
            moved = _move_aside(path, clock())
            note = (f"state database {path} is unreadable ({err}); moved it aside to {moved} "
                    "and started a fresh one: remediation history, journal and breaker state "
                    "are reset; inspect the old file and keep it for the incident record")
            _warn(note)
            notes.append(note)
        except OSError as err:
            if conn is not None:
                conn.close()
            return _memory_store(f"cannot open {path}: {err}", notes)
    raise AssertionError("unreachable")  # pragma: no cover


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


def _move_aside(path: Path, now: float) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
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


def _memory_store(why: str, notes: list[str] | None = None) -> Store:
    note = (f"{why}; using an in-memory state for this run only (nothing is remembered: fix "
            "state_dir in the config or its permissions)")
    _warn(note)
    conn = _connect(":memory:")
    _init_schema(conn, ":memory:")
    return Store(conn, None, [*(notes or []), note])
