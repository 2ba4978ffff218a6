"""The contract every scheduler adapter keeps, run against each one (beside the GPU backends'
tests/unit/test_backend_contract.py):

- ``log``: its own record file;
- ``webhook``: a real HTTP receiver on 127.0.0.1 that checks each request's signature, timestamp
  and nonce as docs/schedulers.md tells a receiver to (tests/integration/test_webhook_adapter.py);
- ``slurm``: a REAL munge + slurmctld + slurmd on loopback (tests/slurm_cluster.py); what the
  node holds is read back from Slurm (``scontrol show node``);
- ``kubernetes``: the official client against a STAND-IN Node API on 127.0.0.1
  (tests/integration/test_kubernetes_adapter.py), because no Kubernetes API server can run here
  (no container runtime, no etcd); it applies patches as the API server does for these fields.

The contract (docs/schedulers.md, "The adapter contract"):

1. A drain, then the same drain again, is one effect. An adapter that reads the node's state from
   its scheduler (Slurm, Kubernetes) answers ``already`` and sends nothing; one that cannot (log,
   webhook) sends the same idempotency key both times, on which its receiver deduplicates.
2. A drain someone else made is never resumed, rebooted, drained over or replaced: ``refused``,
   their reason kept (the adapters that can see it: Slurm, Kubernetes).
3. The evidence reaches the scheduler: the reason sanitised (``node-agent:`` prefix, no quotes,
   shell or control characters, bounded), the grade's words in it, the idempotency key where the
   scheduler can hold one (log record, webhook body, Kubernetes annotation; Slurm keeps one
   Reason per node, which ``sinfo -R`` shows), the driver bug report's path on a replace where
   it can hold one (log, webhook).
4. A resume after its own drain returns the node to service (``done``); a resume of a node in
   service sends nothing where the adapter can see that (``already``).
5. restart and replace as documented: the node is out of service afterwards (or the request is
   recorded, where the adapter cannot see the node), and a replace's reason says ``replace:``.
6. A scheduler that does not answer is an :class:`AdapterError` that says what to check; through
   the executor the step is ``failed``, kept in the journal and retried: nothing is lost.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from node_agent.config import config_from_dict
from node_agent.model import ActionOutcome
from node_agent.remediation.executor import Remediator
from node_agent.remediation.plan import Safety
from node_agent.remediation.store import open_store
from node_agent.schedulers import (
    REASON_PREFIX,
    AdapterError,
    AdapterStatus,
    SchedulerAdapter,
    open_adapter,
    sanitise_reason,
)
from node_agent.schedulers.log import LogAdapter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import slurm_cluster as _slurm  # noqa: E402  (tests/slurm_cluster.py)

GRADE = "FAULT xid79 gpu:5"
KEY = "9f" * 32  # an idempotency key as the executor makes them (64 hex)
HOSTILE = f'{GRADE} "x"; $(reboot) `id` | rm -rf / \n State=RESUME\r\nReason=x\x00\x1b[31m'
EVIDENCE = "/var/lib/node-agent/evidence/bug-report-7.log.gz"


@dataclass(frozen=True)
class Effect:
    """One change that reached the scheduler, as the scheduler received it."""

    reason: str | None
    key: str | None = None
    evidence: str | None = None
    action: str | None = None  # where the scheduler is told the action by name (log, webhook)


@dataclass
class Harness:
    """One adapter wired to its scheduler, and how the test reads that scheduler back."""

    adapter: SchedulerAdapter
    node: str
    effects: Callable[[], list[Effect]]  # every change that reached the scheduler, in order
    reads_state: bool  # node_state is the scheduler's own word (else: always in service)
    holds_key: bool  # the scheduler keeps the idempotency key
    holds_evidence: bool  # the scheduler keeps the bug report's path
    #: someone else drains the node with this reason (None: the adapter cannot see it)
    drain_by_hand: Callable[[str], None] | None
    held_reason: Callable[[], str | None]  # the drain reason the scheduler holds now
    silent: Callable[[], SchedulerAdapter]  # the same adapter, its scheduler not answering


# -- the four adapters ----------------------------------------------------------------------
def _recorder(
    adapter: SchedulerAdapter,
    requests: Callable[[], list[dict[str, Any]]],
    silent: Callable[[], SchedulerAdapter],
) -> Harness:
    """An adapter that tells its scheduler each action and cannot read the node's state (log,
    webhook): ``requests`` are what the scheduler received, each with its reason, key
    (``key`` or ``idempotency_key``), evidence and action."""

    def effects() -> list[Effect]:
        return [
            Effect(
                r["reason"], r.get("key", r.get("idempotency_key")), r.get("evidence"), r["action"]
            )
            for r in requests()
        ]

    return Harness(
        adapter=adapter,
        node="gpu-01",
        effects=effects,
        reads_state=False,
        holds_key=True,
        holds_evidence=True,
        drain_by_hand=None,
        held_reason=lambda: (effects() or [Effect(None)])[-1].reason,
        silent=silent,
    )


def _log(tmp_path: Path) -> Harness:
    adapter = LogAdapter(tmp_path / "actions.log", node="gpu-01")
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    return _recorder(
        adapter, adapter.records, lambda: LogAdapter(blocker / "actions.log", node="gpu-01")
    )


def _webhook(tmp_path: Path) -> Iterator[Harness]:
    from test_webhook_adapter import Receiver
    from test_webhook_adapter import adapter_for as webhook_for

    receiver = Receiver()
    adapter, _ = webhook_for(receiver.url, tmp_path)

    def silent() -> SchedulerAdapter:
        closed = f"http://127.0.0.1:{_closed_port()}/node-agent"
        return webhook_for(closed, tmp_path, retries=1)[0]

    def bodies() -> list[dict[str, Any]]:
        return [r["body"] for r in receiver.received if r["valid"]]

    try:
        yield _recorder(adapter, bodies, silent)
    finally:
        receiver.close()


def _slurm_harness(cluster: Any, tmp_path: Path) -> Harness:
    from node_agent.schedulers.slurm import SlurmAdapter

    config = config_from_dict({"adapter": {"name": "slurm"}})
    adapter = open_adapter(config)
    assert isinstance(adapter, SlurmAdapter)
    adapter.env = cluster.env()
    changes: list[Effect] = []
    real = adapter._run

    def counting(argv: list[str], *args: Any, **kwargs: Any) -> Any:
        if argv[1:2] in (["update"], ["reboot"]):
            reason = next(
                (a.split("=", 1)[1] for a in argv if a.lower().startswith("reason=")), None
            )
            changes.append(Effect(reason))
        return real(argv, *args, **kwargs)

    adapter._run = counting

    def silent() -> SchedulerAdapter:
        down = _slurm.SlurmCluster(root=tmp_path / "down")
        down.conf.parent.mkdir(parents=True, exist_ok=True)
        down.conf.write_text(down._slurm_conf(*_slurm._free_ports(3)))
        return SlurmAdapter(env={**os.environ, "SLURM_CONF": str(down.conf)}, timeout_s=60)

    return Harness(
        adapter=adapter,
        node=cluster.node,
        effects=lambda: list(changes),
        reads_state=True,
        holds_key=False,
        holds_evidence=False,
        drain_by_hand=cluster.drain,
        held_reason=lambda: cluster.show_node().get("Reason"),
        silent=silent,
    )


def _kubernetes() -> Iterator[Harness]:
    pytest.importorskip(
        "kubernetes", reason="kubernetes client not installed: pip install -e '.[k8s]'"
    )
    from test_kubernetes_adapter import FakeNodeApi, make_node
    from test_kubernetes_adapter import adapter_for as kubernetes_for

    from node_agent.schedulers.kubernetes import ANN_KEY, ANN_REASON

    api = FakeNodeApi({"gpu-01": make_node("gpu-01"), "gpu-02": make_node("gpu-02")})
    adapter = kubernetes_for(api)

    def effects() -> list[Effect]:
        patches = [p for p in api.patches() if not p["path"].endswith("/status")]
        notes = [(p["body"].get("metadata") or {}).get("annotations") or {} for p in patches]
        return [Effect(n.get(ANN_REASON), n.get(ANN_KEY)) for n in notes]

    def drain_by_hand(reason: str) -> None:
        api.nodes["gpu-01"]["spec"]["unschedulable"] = True  # kubectl cordon: no taint

    def held_reason() -> str | None:
        node = api.nodes["gpu-01"]
        if not node["spec"].get("unschedulable"):
            return None
        return node["metadata"].get("annotations", {}).get(ANN_REASON, "(cordoned by hand)")

    def silent() -> SchedulerAdapter:
        down = FakeNodeApi({})
        adapter = kubernetes_for(down)
        down.close()
        return adapter

    try:
        yield Harness(
            adapter=adapter,
            node="gpu-01",
            effects=effects,
            reads_state=True,
            holds_key=True,
            holds_evidence=False,
            drain_by_hand=drain_by_hand,
            held_reason=held_reason,
            silent=silent,
        )
    finally:
        api.close()


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(
    params=[
        "log",
        "webhook",
        pytest.param("slurm", marks=pytest.mark.xdist_group("slurm")),
        "kubernetes",
    ]
)
def harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    if request.param == "log":
        yield _log(tmp_path)
    elif request.param == "webhook":
        yield from _webhook(tmp_path)
    elif request.param == "slurm":
        yield _slurm_harness(request.getfixturevalue("slurm"), tmp_path)
    else:
        yield from _kubernetes()


@pytest.fixture
def stateful(harness: Harness) -> Harness:
    """The adapters that read the node's state from their scheduler (Slurm, Kubernetes)."""
    if not harness.reads_state or harness.drain_by_hand is None:
        pytest.skip(f"the {harness.adapter.name} adapter cannot read the node's state")
    return harness


# -- 1. idempotency -------------------------------------------------------------------------
def test_a_drain_twice_is_one_effect(harness: Harness) -> None:
    assert isinstance(harness.adapter, SchedulerAdapter)  # the Protocol, every method
    first = harness.adapter.drain(harness.node, GRADE, key=KEY)
    second = harness.adapter.drain(harness.node, GRADE, key=KEY)
    assert first.status is AdapterStatus.DONE, first
    effects = harness.effects()
    if harness.reads_state:
        assert second.status is AdapterStatus.ALREADY, second
        assert len(effects) == 1, effects
    else:  # sent twice, under one key: the receiver makes it one effect
        assert second.status is AdapterStatus.DONE, second
        assert {e.key for e in effects} == {KEY} and len(effects) == 2
    assert harness.adapter.node_state(harness.node).drained is harness.reads_state


# -- 2. someone else's drain ----------------------------------------------------------------
def test_someone_elses_drain_is_never_resumed_rebooted_drained_over_or_replaced(
    stateful: Harness,
) -> None:
    adapter, node = stateful.adapter, stateful.node
    assert stateful.drain_by_hand is not None
    stateful.drain_by_hand("bad DIMM, ticket 4711")
    before = stateful.held_reason()
    outcomes = {
        "resume": adapter.resume(node, "re-test passed", key=KEY),
        "restart": adapter.restart(node, GRADE, key=KEY),
        "drain": adapter.drain(node, GRADE, key=KEY),
        "replace": adapter.replace(node, GRADE, key=KEY, evidence=EVIDENCE),
    }
    assert {a: o.status for a, o in outcomes.items()} == dict.fromkeys(
        outcomes, AdapterStatus.REFUSED
    ), outcomes
    assert stateful.effects() == []  # nothing sent
    assert stateful.held_reason() == before
    state = adapter.node_state(node)
    assert state.drained and not state.drained_by_agent


# -- 3. the evidence ------------------------------------------------------------------------
def test_the_reason_reaches_the_scheduler_sanitised_with_the_grade_and_the_key(
    harness: Harness,
) -> None:
    outcome = harness.adapter.drain(harness.node, HOSTILE, key=KEY)
    assert outcome.status is AdapterStatus.DONE
    held = harness.held_reason()
    expected = sanitise_reason(HOSTILE)
    assert held is not None and held.startswith(expected), held
    assert held.startswith(f"{REASON_PREFIX} {GRADE}")
    for bad in ('"', "'", "`", "$", ";", "|", "\n", "\r", "\x00", "\x1b"):
        assert bad not in expected
    (effect,) = harness.effects()
    assert effect.key == (KEY if harness.holds_key else None)
    if harness.reads_state:  # the embedded "State=RESUME" did not become an argument
        assert harness.adapter.node_state(harness.node).drained_by_agent


def test_a_replace_carries_its_reason_and_where_it_can_the_bug_report(harness: Harness) -> None:
    outcome = harness.adapter.replace(harness.node, GRADE, key=KEY, evidence=EVIDENCE)
    assert outcome.status is AdapterStatus.DONE, outcome
    effect = harness.effects()[-1]
    assert effect.evidence == (EVIDENCE if harness.holds_evidence else None)
    if harness.reads_state:  # the scheduler's one reason says it
        assert (harness.held_reason() or "").startswith(f"{REASON_PREFIX} replace: {GRADE}")
        state = harness.adapter.node_state(harness.node)
        assert state.drained and state.drained_by_agent
    else:  # the request names the action
        assert (effect.action, effect.reason) == ("replace", f"{REASON_PREFIX} {GRADE}")


# -- 4. resume ------------------------------------------------------------------------------
def test_resume_after_its_own_drain_returns_the_node_to_service(harness: Harness) -> None:
    harness.adapter.drain(harness.node, GRADE, key=KEY)
    outcome = harness.adapter.resume(harness.node, "node-agent: re-test passed", key=KEY)
    assert outcome.status is AdapterStatus.DONE, outcome
    assert not harness.adapter.node_state(harness.node).drained
    if harness.reads_state:
        assert harness.held_reason() is None
        again = harness.adapter.resume(harness.node, "node-agent: re-test passed", key=KEY)
        assert again.status is AdapterStatus.ALREADY, again
        assert len(harness.effects()) == 2  # the drain and one resume


# -- 5. restart -----------------------------------------------------------------------------
def test_restart_takes_the_node_out_of_service_or_records_the_request(harness: Harness) -> None:
    outcome = harness.adapter.restart(harness.node, "ERROR row_remap_pending gpu:2", key=KEY)
    assert outcome.status is AdapterStatus.DONE, outcome
    assert (harness.held_reason() or "").startswith(f"{REASON_PREFIX} ERROR row_remap_pending")
    if harness.reads_state:  # rebooting, or drained for the re-test where it cannot reboot
        state = harness.adapter.node_state(harness.node)
        assert state.drained_by_agent or "REBOOT" in state.state.upper(), state
    else:
        assert harness.effects()[-1].key == KEY


# -- 6. a scheduler that does not answer ----------------------------------------------------
def test_a_scheduler_that_does_not_answer_is_an_adapter_error_and_nothing_is_lost(
    harness: Harness, tmp_path: Path
) -> None:
    silent = harness.silent()
    with pytest.raises(AdapterError) as err:
        silent.drain(harness.node, GRADE, key=KEY)
    assert str(err.value).strip()
    store = open_store(tmp_path / "state")
    warnings: list[str] = []
    try:
        out = Remediator(
            store, silent, harness.node, Safety(), state_dir=None, warn=warnings.append
        ).act("drain", f"{REASON_PREFIX} {GRADE}")
        (record,) = out.records
        assert record.outcome is ActionOutcome.FAILED and out.wants_retry
        (row,) = store.journal_tail(harness.node)
        assert (row.action, row.state) == ("drain", "failed")
        assert any("kept in the journal" in w for w in warnings)
    finally:
        store.close()
