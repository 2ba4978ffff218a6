"""The SQLite state store: WAL, schema version, journal, breaker, opt-out, corrupt files."""

from __future__ import annotations

import json
import os
import sqlite3

import pytest

from node_agent.remediation import store as store_mod
from node_agent.remediation.store import (
    DB_NAME,
    SCHEMA_VERSION,
    NodeRecord,
    StateUnavailable,
    open_store,
)

T0 = 1_700_000_000.0


@pytest.fixture
def store(tmp_path):
    s = open_store(tmp_path / "state")
    yield s
    s.close()


def _plan(store, key="gpu-01|drain|xid-79@gpu:5|0", action="drain", now=T0, **kw):
    args = dict(
        key=key,
        node="gpu-01",
        action=action,
        reason="node-agent: FAULT xid-79 gpu:5",
        fault_code="xid-79",
        target="gpu:5",
        attempt=0,
        to_state="fault",
        trigger="auto",
        adapter="log",
        now=now,
    )
    args.update(kw)
    return store.journal_plan(**args)


def test_new_store_is_wal_with_schema_version(tmp_path):
    store = open_store(tmp_path / "state")
    try:
        assert store.path == tmp_path / "state" / DB_NAME
        assert store.schema_version() == SCHEMA_VERSION
        assert store.notes == []
    finally:
        store.close()
    conn = sqlite3.connect(tmp_path / "state" / DB_NAME)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()


def test_reopening_keeps_state(tmp_path):
    first = open_store(tmp_path)
    first.set_node_record(NodeRecord("gpu-01", "drained", T0, "xid-31", "gpu:1", "auto"))
    first.close()
    again = open_store(tmp_path)
    assert again.node_record("gpu-01").state == "drained"
    assert again.node_record("other").state == "in-service"
    again.close()


def test_journal_rows_left_planned_or_started_are_open(store):
    a = _plan(store)
    b = _plan(store, key="k2", action="replace")
    store.journal_update(b.id, "started", "", T0 + 1, count_try=True)
    c = _plan(store, key="k3", action="resume")
    store.journal_finish(c.id, "done", "ok", T0 + 2)
    assert [r.id for r in store.open_journal("gpu-01")] == [a.id, b.id]
    assert store.journal_row(b.id).tries == 1
    assert store.journal_by_key("k3").state == "done"
    assert store.open_journal("someone-else") == []


def test_journal_finish_moves_node_state_in_the_same_transaction(store):
    row = _plan(store)
    store.journal_finish(
        row.id,
        "done",
        "drained",
        T0 + 5,
        NodeRecord("gpu-01", "fault", T0 + 5, "xid-79", "gpu:5", "auto"),
    )
    assert store.node_record("gpu-01").state == "fault"
    assert store.journal_row(row.id).state == "done"


def test_unknown_journal_state_is_rejected(store):
    with pytest.raises(ValueError, match="journal state"):
        _plan(store, state="maybe")


def test_count_done_filters_by_action_fault_time_and_trigger(store):
    for i, (action, code, trigger) in enumerate(
        [
            ("restart", "xid-31", "auto"),
            ("gpu-reset", "xid-31", "auto"),
            ("restart", "row-remap-pending", "auto"),
            ("drain", "xid-31", "operator"),
        ]
    ):
        row = _plan(store, key=f"k{i}", action=action, fault_code=code, trigger=trigger, now=T0 + i)
        store.journal_finish(row.id, "done", "", T0 + i)
    assert store.count_done("gpu-01", ("restart", "gpu-reset"), T0, fault_code="xid-31") == 2
    assert store.count_done("gpu-01", ("restart", "gpu-reset"), T0 + 1, fault_code="xid-31") == 1
    assert store.count_done(None, ("drain",), T0, trigger="auto") == 0
    assert store.count_done(None, ("drain",), T0, trigger="operator") == 1
    assert store.last_done_at("gpu-01", ("restart",)) == T0 + 2


def test_clear_node_sets_watermark_and_cancels_open_rows(store):
    store.set_node_record(NodeRecord("gpu-01", "awaiting-replacement", T0, "xid-79", "gpu:5"))
    row = _plan(store)
    record = store.clear_node("gpu-01", T0 + 100, "GPU 5 replaced")
    assert record.state == "in-service" and record.cleared_at == T0 + 100
    assert store.open_journal("gpu-01") == []
    assert "set-healthy" in store.journal_row(row.id).detail


def test_breaker_stays_open_across_reopen_until_reset(tmp_path):
    store = open_store(tmp_path)
    store.open_breaker(T0, "5 drains in 1 h")
    store.close()
    store = open_store(tmp_path)
    assert store.breaker().open and store.breaker().reason == "5 drains in 1 h"
    before = store.reset_breaker(T0 + 10)
    assert before.open
    after = store.breaker()
    assert not after.open and after.reset_at == T0 + 10
    store.close()


def test_opt_out_flag_round_trips(store):
    assert store.opted_out("gpu-01") is None
    store.set_opt_out("gpu-01", True, T0, "firmware update")
    assert store.opted_out("gpu-01") == "firmware update"
    store.set_opt_out("gpu-01", False, T0)
    assert store.opted_out("gpu-01") is None


def test_run_history_keeps_last_grade(store):
    store.record_run(
        "gpu-01", T0, "quick", "service", "ERROR", [{"rule": "xid", "target": "gpu:1"}]
    )
    store.record_run("gpu-01", T0 + 1, "delivery", "delivery", "HEALTHY", [])
    last = store.last_run("gpu-01")
    assert (last.suite, last.level, last.reasons) == ("delivery", "HEALTHY", [])


def test_a_file_that_is_not_a_database_is_moved_aside_and_a_fresh_one_started(tmp_path, capsys):
    state = tmp_path / "state"
    state.mkdir()
    (state / DB_NAME).write_bytes(b"this is not sqlite \x00\xff" * 200)
    store = open_store(state, clock=lambda: T0)
    try:
        assert store.path == state / DB_NAME and store.unavailable is None
        assert store.schema_version() == SCHEMA_VERSION
        assert store.node_record("gpu-01").state == "in-service"
    finally:
        store.close()
    moved = list(state.glob(f"{DB_NAME}.corrupt-*"))
    assert len(moved) == 1 and moved[0].read_bytes().startswith(b"this is not sqlite")
    err = capsys.readouterr().err
    assert "WARNING" in err and "moved it aside" in err and str(moved[0]) in err


def _opted_out_db(state, version=SCHEMA_VERSION):
    first = open_store(state)
    first.set_opt_out("gpu-01", True, T0, "maintenance")
    first.close()
    if version != SCHEMA_VERSION:
        conn = sqlite3.connect(state / DB_NAME)
        conn.execute("UPDATE schema_version SET version = ?", (version,))
        conn.commit()
        conn.close()
    return (state / DB_NAME).read_bytes()


def test_a_newer_agents_database_is_kept_and_read_only(tmp_path, capsys):
    before = _opted_out_db(tmp_path, version=99)
    store = open_store(tmp_path)
    try:
        assert "schema version 99" in store.unavailable and "newer node-agent" in store.unavailable
        assert store.opted_out("gpu-01") == "maintenance"  # status can still show it
        with pytest.raises(StateUnavailable):
            store.set_opt_out("gpu-01", False, T0)
    finally:
        store.close()
    assert (tmp_path / DB_NAME).read_bytes() == before
    assert not list(tmp_path.glob(f"{DB_NAME}.corrupt-*"))
    assert "automatic actions are refused" in capsys.readouterr().err


def test_a_damaged_database_is_kept_not_replaced(tmp_path):
    _opted_out_db(tmp_path)
    data = bytearray((tmp_path / DB_NAME).read_bytes())
    data[4096 : 4096 + 100] = b"\xee" * 100  # page 2 ruined, the file header intact
    (tmp_path / DB_NAME).write_bytes(bytes(data))
    store = open_store(tmp_path)
    try:
        assert store.unavailable is not None
        with pytest.raises(StateUnavailable):
            store.record_run("gpu-01", T0, "quick", "service", "HEALTHY", [])
    finally:
        store.close()
    assert (tmp_path / DB_NAME).read_bytes() == bytes(data)
    assert not list(tmp_path.glob(f"{DB_NAME}.corrupt-*"))


def test_a_lock_held_too_long_makes_the_state_unavailable_not_lost(tmp_path, monkeypatch):
    _opted_out_db(tmp_path)
    monkeypatch.setattr(store_mod, "BUSY_TIMEOUT_S", 0.2)
    other = sqlite3.connect(tmp_path / DB_NAME, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    store = open_store(tmp_path)
    try:
        with pytest.raises(StateUnavailable, match="database is locked"):
            store.set_opt_out("gpu-01", False, T0)
        assert "locked" in store.unavailable
        with pytest.raises(StateUnavailable):  # and stays so for this run
            store.record_run("gpu-01", T0, "quick", "service", "HEALTHY", [])
    finally:
        other.execute("ROLLBACK")
        other.close()
        store.close()
    again = open_store(tmp_path)
    assert again.unavailable is None and again.opted_out("gpu-01") == "maintenance"
    again.close()


def test_unusable_state_dir_gives_an_unavailable_store_and_says_so(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    store = open_store(blocker / "state")
    try:
        assert store.path is None and "Not a directory" in store.unavailable
        with pytest.raises(StateUnavailable):
            store.set_node_record(NodeRecord("gpu-01", "drained", T0))
        assert store.node_record("gpu-01").state == "in-service"
    finally:
        store.close()
    assert "automatic actions are refused" in capsys.readouterr().err


def test_state_dir_of_another_user_is_not_used(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    os.chown(state, 65534, 65534)
    store = open_store(state)
    try:
        assert "owned by uid 65534" in store.unavailable
    finally:
        store.close()
    assert not (state / DB_NAME).exists()


def test_done_restarts_are_counted_per_fault_code_since_a_time(store):
    for i, (action, code, state) in enumerate(
        [
            ("restart", "xid-109", "done"),
            ("gpu-reset", "xid-109", "done"),
            ("restart", "xid-95", "done"),
            ("restart", "xid-95", "failed"),
            ("drain", "xid-95", "done"),
        ]
    ):
        row = _plan(store, key=f"k{i}", action=action, fault_code=code, now=T0 + i)
        store.journal_finish(row.id, state, "", T0 + i)
    assert store.done_by_code("gpu-01", ("restart", "gpu-reset"), T0) == {"xid-109": 2, "xid-95": 1}
    assert store.done_by_code("gpu-01", ("restart", "gpu-reset"), T0 + 2) == {"xid-95": 1}
    assert store.done_by_code("other", ("restart",), T0) == {}


def test_runs_since_keep_the_graded_reasons_with_their_typed_fields(store):
    reason = {
        "rule": "xid",
        "level": "ERROR",
        "target": "gpu:3",
        "message": "m",
        "catalog": "xid",
        "code": 109,
        "restarts_before_fault": 4,
    }
    store.record_run("gpu-01", T0, "quick", "service", "ERROR", [reason])
    store.record_run("gpu-01", T0 + 10, "quick", "service", "HEALTHY", [])
    runs = store.runs_since("gpu-01", T0 - 1)
    assert [r.level for r in runs] == ["ERROR", "HEALTHY"] and runs[0].reasons == [reason]
    assert [r.level for r in store.runs_since("gpu-01", T0 + 5)] == ["HEALTHY"]


# -- the runs table is bounded (issue 34) ---------------------------------------------------------


def _reason(level: str, i: int, size: int = 300) -> dict:
    return {"rule": "check-hang", "level": level, "target": f"pid:{i}", "message": "x" * size}


def test_runs_older_than_the_age_limit_are_pruned_as_rows_are_added(store):
    day = 86400.0
    for i in range(store_mod.RUNS_PRUNE_EVERY):
        store.record_run("gpu-01", T0 + i * day, "quick", "service", "WARN", [])
    # the 100th row pruned what was more than 400 days older than itself
    runs = store.runs_since("gpu-01", 0, limit=1000)
    assert len(runs) == store_mod.RUNS_PRUNE_EVERY  # 99 days apart at most: nothing too old
    store.record_run("gpu-01", T0 + 500 * day, "quick", "service", "WARN", [])
    assert store.prune_runs(T0 + 500 * day) == store_mod.RUNS_PRUNE_EVERY
    assert [r.at for r in store.runs_since("gpu-01", 0)] == [T0 + 500 * day]


def test_only_the_newest_rows_are_kept_past_the_count_limit(store):
    for i in range(30):
        store.record_run("gpu-01", T0 + i, "quick", "service", "WARN", [])
    assert store.prune_runs(T0 + 30, max_rows=10) == 20
    assert [r.at for r in store.runs_since("gpu-01", 0)] == [T0 + i for i in range(20, 30)]


def test_the_runs_table_is_pruned_when_the_store_is_opened(tmp_path):
    s = open_store(tmp_path / "state", clock=lambda: T0)
    s.record_run("gpu-01", T0 - 401 * 86400, "quick", "service", "WARN", [])
    s.record_run("gpu-01", T0 - 399 * 86400, "quick", "service", "HEALTHY", [])
    s.close()
    again = open_store(tmp_path / "state", clock=lambda: T0)
    try:
        assert [r.level for r in again.runs_since("gpu-01", 0)] == ["HEALTHY"]
    finally:
        again.close()


def test_200_hang_reasons_are_cut_to_the_bound_keeping_the_highest_levels(store):
    reasons = [_reason("WARN", i) for i in range(200)]
    reasons.insert(50, _reason("ERROR", 999, size=50) | {"code": 109, "restarts_before_fault": 4})
    store.record_run("gpu-01", T0, "daemon", "service", "ERROR", reasons)
    (row,) = store._rows("SELECT length(reasons) FROM runs")
    assert row[0] <= store_mod.RUN_REASONS_MAX_BYTES
    kept = store.last_run("gpu-01").reasons
    assert reasons[50] in kept  # the ERROR, with its typed fields, whatever its place
    assert kept[-1]["rule"] == "runs-reasons-cut"
    assert kept[-1]["message"].startswith(f"{201 - (len(kept) - 1)} more reason(s)")
    # reasons that fit are kept as they are, with no note
    store.record_run("gpu-01", T0 + 1, "daemon", "service", "WARN", reasons[:3])
    assert store.last_run("gpu-01").reasons == reasons[:3]


def test_an_open_compacts_the_space_an_unbounded_table_left(tmp_path, monkeypatch):
    monkeypatch.setattr(store_mod, "COMPACT_FREE_BYTES", 1 << 20)
    s = open_store(tmp_path / "state", clock=lambda: T0)
    big = [_reason("WARN", i, size=4000) for i in range(2)]
    for _ in range(400):  # what an older agent left: ~3 MiB of rows, soon to be too old
        s._conn.execute(
            "INSERT INTO runs (at, node, suite, mode, level, reasons) VALUES (?,?,?,?,?,?)",
            (T0 - 500 * 86400, "gpu-01", "daemon", "service", "WARN", json.dumps(big)),
        )
    s.close()
    db = tmp_path / "state" / DB_NAME
    before = db.stat().st_size
    again = open_store(tmp_path / "state", clock=lambda: T0)
    try:
        assert any("compacted" in n for n in again.notes), again.notes
        assert db.stat().st_size < before / 4
    finally:
        again.close()
