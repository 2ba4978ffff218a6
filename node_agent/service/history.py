"""Counter history: the numeric results ``graders/trends.yaml`` names, kept over time, bounded.

SQLite (WAL) in ``<state_dir>/history.db``, its own file beside the remediation store: private
like it (0600 in the 0700 state directory), and fail-safe: a history that cannot be opened or
written is a WARN (``trends``/``history``) and never stops the daemon or its checks; a file that
is not a database is moved aside to ``history.db.corrupt-<timestamp>`` and a fresh one started
(trends start over; nothing in it could be read anyway).

The bound (:class:`Bound`, docs/trends.md), per series (check, target, metric):

- raw: one point per 5-minute bucket (a counter keeps the bucket's last value, a gauge its
  mean), for 48 hours;
- hourly: one point per hour for 30 days;
- daily: one point per day beyond that, the newest 366 kept;
- a series not written for 400 days is dropped.

Compaction runs once an hour and moves whole buckets only, so a tier holds up to an hour (raw)
or a day (hourly) more than its span: a series holds at most 600 + 745 + 366 = 1,711 points
(:attr:`Bound.max_points`) whatever the checks' cadence. A counter's drop (a reset)
is marked on the point where it is seen and kept through downsampling, so a trend never spans a
reset even after its raw points are gone. Times are UNIX seconds from the injected ``clock``.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node_agent.atomic_file import private_dir
from node_agent.grading.trends import Point
from node_agent.remediation.store import move_aside

log = logging.getLogger("node_agent.service.history")

DB_NAME = "history.db"
SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS series (
    id INTEGER PRIMARY KEY, check_name TEXT NOT NULL, target TEXT NOT NULL, metric TEXT NOT NULL,
    kind TEXT NOT NULL, UNIQUE (check_name, target, metric));
CREATE TABLE IF NOT EXISTS points (
    series INTEGER NOT NULL, tier INTEGER NOT NULL, at REAL NOT NULL, value REAL NOT NULL,
    n INTEGER NOT NULL DEFAULT 1, reset INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS points_series_at ON points(series, at);
"""


@dataclass(frozen=True)
class Bound:
    """How much history a series keeps (module docstring); the defaults are the shipped bound."""

    raw_bucket_s: float = 300.0
    raw_keep_s: float = 48 * 3600.0
    hourly_keep_s: float = 30 * 86400.0
    daily_cap: int = 366
    drop_after_s: float = 400 * 86400.0
    compact_every_s: float = 3600.0

    @property
    def max_points(self) -> int:
        """The most points one series can hold: each tier's span, plus the slack of compacting
        whole buckets once per ``compact_every_s`` (one hour of raw points, one day of hourly
        ones, and one compaction interval of each, at most)."""
        raw = (self.raw_keep_s + 3600 + self.compact_every_s) // self.raw_bucket_s
        hourly = (self.hourly_keep_s + 86400 + self.compact_every_s) // 3600
        return int(raw) + int(hourly) + self.daily_cap


@dataclass(frozen=True)
class Sample:
    """One value to record: a series key, its kind (``counter`` or ``gauge``) and the value."""

    check: str
    target: str
    metric: str
    kind: str
    value: float


class History:
    """The history database; open with :func:`open_history`. Thread-safe.

    ``problem`` is None while the history works; otherwise it says why not (then
    :meth:`record` does nothing and :meth:`points` answers empty)."""

    def __init__(
        self,
        conn: sqlite3.Connection | None,
        path: Path,
        clock: Callable[[], float],
        bound: Bound,
        problem: str | None = None,
    ) -> None:
        self._conn = conn
        self.path = path
        self._clock = clock
        self.bound = bound
        self.problem = problem
        self._lock = threading.Lock()
        self._ids: dict[tuple[str, str, str], int] = {}
        self._compacted_at: float | None = None
        #: what went wrong at opening that was mended (a corrupt file moved aside), else None
        self.notice: str | None = None

    # -- writing --------------------------------------------------------------------------------
    def record(self, samples: Iterable[Sample]) -> None:
        """Add each sample at the clock's now (into its 5-minute bucket) and compact when due.
        A failure makes the history unavailable for the rest of the run, logged once."""
        samples = list(samples)
        if not samples:
            return
        with self._lock:
            if self._conn is None or self.problem is not None:
                return
            now = self._clock()
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                for s in samples:
                    self._add(s, now)
                if (
                    self._compacted_at is None
                    or now - self._compacted_at >= self.bound.compact_every_s
                ):
                    self._compact(now)
                    self._compacted_at = now
                self._conn.execute("COMMIT")
            except sqlite3.Error as err:
                with suppress(sqlite3.Error):
                    self._conn.execute("ROLLBACK")
                self._fail(f"writing {self.path} failed: {err}")

    @property
    def _db(self) -> sqlite3.Connection:
        """The open connection (the helpers below run only while it is: their callers check)."""
        if self._conn is None:
            raise sqlite3.ProgrammingError(f"the counter history {self.path} is closed")
        return self._conn

    def _series_id(self, s: Sample) -> int:
        key = (s.check, s.target, s.metric)
        if key not in self._ids:
            self._db.execute(
                "INSERT OR IGNORE INTO series (check_name, target, metric, kind) "
                "VALUES (?, ?, ?, ?)",
                (*key, s.kind),
            )
            row = self._db.execute(
                "SELECT id FROM series WHERE check_name = ? AND target = ? AND metric = ?", key
            ).fetchone()
            self._ids[key] = int(row[0])
        return self._ids[key]

    def _add(self, s: Sample, now: float) -> None:
        sid = self._series_id(s)
        last = self._db.execute(
            "SELECT rowid, tier, at, value, n, reset FROM points WHERE series = ? "
            "ORDER BY at DESC LIMIT 1",
            (sid,),
        ).fetchone()
        dropped = s.kind == "counter" and last is not None and s.value < last[3]
        bucket = self.bound.raw_bucket_s
        if last is not None and last[1] == 0 and now // bucket == last[2] // bucket:
            rowid, _, _, value, n, reset = last
            new = s.value if s.kind == "counter" else (value * n + s.value) / (n + 1)
            self._db.execute(
                "UPDATE points SET at = ?, value = ?, n = ?, reset = ? WHERE rowid = ?",
                (now, new, n + 1, int(reset or dropped), rowid),
            )
            return
        self._db.execute(
            "INSERT INTO points (series, tier, at, value, n, reset) VALUES (?, 0, ?, ?, 1, ?)",
            (sid, now, s.value, int(dropped)),
        )

    def _compact(self, now: float) -> None:
        """Raw points past 48 h into hourly ones, hourly past 30 days into daily ones, daily
        beyond the cap and series silent for 400 days deleted."""
        b = self.bound
        kinds = dict(self._db.execute("SELECT id, kind FROM series").fetchall())
        for tier, keep_s, size_s in ((0, b.raw_keep_s, 3600.0), (1, b.hourly_keep_s, 86400.0)):
            cutoff = (now - keep_s) // size_s * size_s  # whole buckets only
            rows = self._db.execute(
                "SELECT series, at, value, n, reset FROM points WHERE tier = ? AND at < ? "
                "ORDER BY series, at",
                (tier, cutoff),
            ).fetchall()
            if not rows:
                continue
            groups: dict[tuple[int, float], list[tuple[Any, ...]]] = {}
            for row in rows:
                groups.setdefault((row[0], row[1] // size_s), []).append(row)
            self._db.execute("DELETE FROM points WHERE tier = ? AND at < ?", (tier, cutoff))
            self._db.executemany(
                "INSERT INTO points (series, tier, at, value, n, reset) VALUES (?, ?, ?, ?, ?, ?)",
                [
                    _merge(sid, tier + 1, group, kinds.get(sid, "counter"))
                    for (sid, _), group in groups.items()
                ],
            )
        for (sid,) in self._db.execute(
            "SELECT series FROM points WHERE tier = 2 GROUP BY series HAVING COUNT(*) > ?",
            (b.daily_cap,),
        ).fetchall():
            (edge,) = self._db.execute(
                "SELECT at FROM points WHERE series = ? AND tier = 2 "
                "ORDER BY at DESC LIMIT 1 OFFSET ?",
                (sid, b.daily_cap - 1),
            ).fetchone()
            self._db.execute(
                "DELETE FROM points WHERE series = ? AND tier = 2 AND at < ?", (sid, edge)
            )
        stale = [
            r[0]
            for r in self._db.execute(
                "SELECT series FROM points GROUP BY series HAVING MAX(at) < ?",
                (now - b.drop_after_s,),
            ).fetchall()
        ]
        for sid in stale:
            self._db.execute("DELETE FROM points WHERE series = ?", (sid,))
            self._db.execute("DELETE FROM series WHERE id = ?", (sid,))
        if stale:
            self._ids = {k: v for k, v in self._ids.items() if v not in stale}

    def _fail(self, why: str) -> None:
        if self.problem is None:
            self.problem = why
            log.warning(
                "counter history unavailable: %s; trends are not graded until the "
                "daemon restarts with a working history (checks go on)",
                why,
            )

    # -- reading --------------------------------------------------------------------------------
    def series(self) -> list[tuple[str, str, str]]:
        """Every (check, target, metric) with points."""
        with self._lock:
            if self._conn is None or self.problem is not None:
                return []
            try:
                return [
                    tuple(r)
                    for r in self._conn.execute(
                        "SELECT check_name, target, metric FROM series ORDER BY id"
                    ).fetchall()
                ]
            except sqlite3.Error as err:
                self._fail(f"reading {self.path} failed: {err}")
                return []

    def points(self, check: str, target: str, metric: str) -> list[Point]:
        """The series' points, oldest first (empty when unknown or unavailable)."""
        with self._lock:
            if self._conn is None or self.problem is not None:
                return []
            try:
                rows = self._conn.execute(
                    "SELECT p.at, p.value, p.reset FROM points p JOIN series s ON s.id = p.series "
                    "WHERE s.check_name = ? AND s.target = ? AND s.metric = ? ORDER BY p.at",
                    (check, target, metric),
                ).fetchall()
            except sqlite3.Error as err:
                self._fail(f"reading {self.path} failed: {err}")
                return []
        return [Point(at, value, bool(reset)) for at, value, reset in rows]

    def point_count(self) -> int:
        with self._lock:
            if self._conn is None or self.problem is not None:
                return 0
            return int(self._conn.execute("SELECT COUNT(*) FROM points").fetchone()[0])

    def size_bytes(self) -> int:
        """The database's size on disk after a checkpoint (main file; the -wal emptied)."""
        with self._lock:
            if self._conn is not None and self.problem is None:
                with suppress(sqlite3.Error):
                    self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return sum(
            f.stat().st_size
            for f in (self.path, self.path.with_name(DB_NAME + "-wal"))
            if f.exists()
        )

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                with suppress(sqlite3.Error):
                    self._conn.close()
                self._conn = None


def _merge(sid: int, tier: int, group: list[tuple[Any, ...]], kind: str) -> tuple[Any, ...]:
    """One downsampled point for a bucket's rows (series, at, value, n, reset): the last time,
    the last value (counter) or the weighted mean (gauge), the count, any reset."""
    n = sum(r[3] for r in group)
    value = group[-1][2] if kind == "counter" else sum(r[2] * r[3] for r in group) / n
    return (sid, tier, group[-1][1], value, n, int(any(r[4] for r in group)))


def open_history(
    state_dir: Path | str, clock: Callable[[], float] = time.time, bound: Bound | None = None
) -> History:
    """Open (or create) ``<state_dir>/history.db``; never raises for its own state (a history
    that cannot be used has its ``problem`` set and records nothing)."""
    bound = bound or Bound()
    path = Path(state_dir) / DB_NAME
    notes: list[str] = []
    for attempt in (1, 2):
        conn = None
        try:
            private_dir(state_dir)
            if not path.exists():  # made 0600 before SQLite writes a byte of it
                os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600))
            st = path.lstat()
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise OSError(f"{path} is not a regular file of the agent's own")
            if not os.access(path, os.W_OK) or not os.access(state_dir, os.W_OK):
                raise OSError(
                    f"{path} is not writable (a read-only file system, or its permissions)"
                )
            conn = sqlite3.connect(
                str(path), timeout=5.0, isolation_level=None, check_same_thread=False
            )
            if str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]).lower() != "wal":
                raise sqlite3.DatabaseError(f"cannot switch {path} to WAL mode")
            conn.execute("PRAGMA synchronous = NORMAL")
            check = conn.execute("PRAGMA quick_check").fetchone()
            if check is None or check[0] != "ok":
                raise sqlite3.DatabaseError(f"file is not a database: quick_check says {check}")
            conn.executescript(_SCHEMA)
            row = conn.execute("SELECT version FROM schema_version").fetchone()
            if row is None:
                conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
            elif int(row[0]) > SCHEMA_VERSION:
                raise OSError(
                    f"{path} has schema version {row[0]}; this agent knows up to "
                    f"{SCHEMA_VERSION} (written by a newer agent): kept as it is"
                )
            for name in (DB_NAME + "-wal", DB_NAME + "-shm"):
                side = path.with_name(name)
                if side.exists() and side.stat().st_mode & 0o077:
                    os.chmod(side, 0o600)
            history = History(conn, path, clock, bound)
            if notes:
                history.notice = notes[0]
                log.warning("%s", notes[0])
            return history
        except sqlite3.Error as err:
            if conn is not None:
                with suppress(sqlite3.Error):
                    conn.close()
            if attempt == 1 and "not a database" in str(err) and path.exists():
                try:
                    moved = move_aside(path, clock())
                except OSError as move_err:
                    return History(
                        None,
                        path,
                        clock,
                        bound,
                        f"{path} is not a database and cannot be moved aside: {move_err}",
                    )
                notes.append(
                    f"counter history {path} was not a database ({err}); moved it "
                    f"aside to {moved} and started a fresh one (trends start over)"
                )
                continue
            return History(None, path, clock, bound, f"cannot use {path}: {err}")
        except OSError as err:
            if conn is not None:
                with suppress(sqlite3.Error):
                    conn.close()
            return History(None, path, clock, bound, f"cannot use {path}: {err.strerror or err}")
    raise AssertionError("unreachable")  # pragma: no cover
