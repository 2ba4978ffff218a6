"""Grade + history -> remediation plan (pure functions; the clock is a parameter).

The plan reads only the typed fields of a grade's reasons (level, rule, catalog code and name,
remedy class, the driver's recovery action, the entity and job of the target: ``model.Reason``),
never a message, and decides through one transition table::

    TRANSITIONS[(phase, verdict)] -> Move

* the **phase** is the node's :class:`NodeState` (the store's record), refined where the state
  alone does not decide: a ``drained`` node drained by an operator, a ``restarting`` node whose
  requested reboot has not happened yet, a ``needs-operator`` node held for too many
  remediations (:class:`Phase`);
* the **verdict** is what the grade asks for, from ``model.Action`` (:data:`ACTION_FOR_LEVEL`)
  and the node's history (:class:`Verdict`);
* the **move** builds the steps (:class:`Move`, one small builder each).

How the node grade's ``model.Action`` maps onto step actions (:data:`STEPS_FOR_ACTION`): NONE
plans nothing (a passing re-test resumes a node the agent drained); RESTART drains, then
restarts: a GPU reset and a re-test where the finding allows it (:func:`gpu_reset_allowed`),
else a reboot request through the scheduler adapter, re-tested by the next graded run; a
RESTART whose every ERROR is a hung training job restarts the jobs instead; REPLACE drains, then
asks for a replacement; DRAIN is an operator's (``node-agent act drain``: :func:`operator_step`)
or an announced maintenance's (every ERROR ``remedy: planned``: drain alone, no restart).

The rules (DESIGN.md, "Remediation and safety"):

* Restarts are counted per fault code (codes that are one fault seen by different witnesses
  together: :data:`ONE_FAULT`) within ``safety.restart_window_h``, for the grade's first
  hardware finding where it has one (never for a software, application or planned one beside
  it); a fault code that is still there after its own restarts (the catalog's
  ``restarts_before_fault`` carried on the Reason, else ``safety.max_restarts``) is escalated
  to FAULT, unless every ERROR reason is one that new hardware is not known to fix
  (:data:`NO_SWAP`): a software cause (``remedy: software`` in
  graders/rules.yaml: no driver, NVML broken, a check that could not run) or an error a user's
  code can make the driver report (``remedy: application``: an application-class Xid repeated
  on one GPU). Then the node stays drained as ``needs-operator`` (a ``hold`` step, no adapter
  call) and no further restart or replacement is planned until an operator's ``set-healthy`` /
  ``act resume``.
* A node the agent already restarted ``safety.max_remediations_7d`` times in 7 days (GPU resets
  and reboot requests, any fault code) is not restarted again: a ``hold`` step with the fault
  code ``remediations-7d`` keeps it drained as ``needs-operator`` (NVSentinel flags a node
  remediated that often; a restart loop hides a sick node and costs the jobs that land on it).
* HEALTHY/WARN never cause a drain; they resume a node only when the agent itself drained it
  for a restart and this is the passing re-test. A re-test whose only ERRORs are hung training
  jobs (``JOB_RULES``) passes for the node: it resumes, then the jobs are restarted.
* An announced maintenance (ERROR whose every node ERROR has ``remedy: planned``: the
  ``cloud_maintenance`` check inside its lead time) drains the node to ``planned`` with the
  event in the drain reason, and nothing else: no restart (the cloud takes the host), no
  replacement, no restart counted. While the event stands the node waits; the first passing
  re-test after it resumes the node (a maintenance that ends in a broken node grades ERROR or
  FAULT and takes that path from ``planned``).
* A hung training job (ERROR whose every ERROR-or-worse reason is a job rule, ``JOB_RULES``) is
  not the node's fault: one ``restart-job`` step per hung job, through the scheduler, and the
  node's state does not change. A hardware ERROR/FAULT beside it takes the node path instead
  (a reboot or replacement ends the jobs anyway).

The plan says *what* to do; :mod:`node_agent.remediation.executor` executes it through the guards
in :mod:`node_agent.remediation.guards` and journals each step before acting.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from node_agent.config import Safety
from node_agent.model import (
    ACTION_FOR_LEVEL,
    Action,
    Grade,
    Level,
    PlannedEvent,
    Reason,
    Remedy,
    Target,
    utc_iso,
)
from node_agent.remediation.states import (
    RESTART_FOR_RECOVERY,
    NodeState,
    RestartKind,
    StepAction,
)
from node_agent.remediation.store import NodeRecord
from node_agent.schedulers.base import MAX_JOB_LEN, sanitise_reason

__all__ = [
    "ACTIONS",
    "DISRUPTIVE",
    "EVIDENCE_ACTIONS",
    "JOB_RULES",
    "REMEDIATIONS_CODE",
    "REMEDIATION_ACTIONS",
    "STATES",
    "STEPS_FOR_ACTION",
    "TRANSITIONS",
    "Move",
    "NodeState",
    "Phase",
    "Plan",
    "RestartKind",
    "Safety",
    "Step",
    "StepAction",
    "Verdict",
    "fault_code",
    "job_of",
    "operator_step",
    "plan",
    "short_message",
]

#: remediation states of a node (the store's strings)
STATES = tuple(s.value for s in NodeState)
#: actions a plan step can take (the journal's ``action`` column)
ACTIONS = tuple(a.value for a in StepAction)
#: actions that take the node (or its GPUs) out of work: the rate limit of a drain counts them
DISRUPTIVE = (StepAction.DRAIN, StepAction.GPU_RESET, StepAction.RESTART, StepAction.REPLACE)
#: actions before which evidence is collected: a job restart kills the hung processes, so their
#: stacks are taken first
EVIDENCE_ACTIONS = (*DISRUPTIVE, StepAction.RESTART_JOB)
#: rules whose ERROR is about a training job, not the node: restart the job, leave the node be
JOB_RULES = frozenset({"training-hang"})

#: the steps each node grade's action expands to on a node in service (the alternatives of a
#: RESTART: a GPU reset and its re-test where the finding allows it, else a reboot request)
STEPS_FOR_ACTION: Mapping[Action, tuple[tuple[StepAction, ...], ...]] = {
    Action.NONE: ((),),
    # an operator's, and an announced maintenance's (every ERROR remedy planned)
    Action.DRAIN: ((StepAction.DRAIN,),),
    Action.RESTART: (
        (StepAction.DRAIN, StepAction.GPU_RESET, StepAction.RETEST),
        (StepAction.DRAIN, StepAction.RESTART),
    ),
    Action.REPLACE: ((StepAction.DRAIN, StepAction.REPLACE),),
}

# Faults that a GPU reset clears, so a reboot is not needed. Sources: NVIDIA "GPU Memory Error
# Management" (a pending row remap or page retirement takes effect after a GPU reset) and the
# NVML recovery action (the driver asks for a reset, or a reboot: RESTART_FOR_RECOVERY).
GPU_RESET_RULES = frozenset({"row-remap-pending", "retired-pages-pending", "recovery-action"})

#: the fault code of a hold for too many remediations in 7 days (``safety.max_remediations_7d``)
REMEDIATIONS_CODE = "remediations-7d"
REMEDIATION_WINDOW_S = 7 * 24 * 3600.0
#: what counts as one remediation of the node: an automatic restart of it or of its GPUs
REMEDIATION_ACTIONS = (StepAction.RESTART, StepAction.GPU_RESET)

#: the state each operator action (``node-agent act ACTION``) leaves the node in
OPERATOR_ACTIONS: Mapping[StepAction, NodeState] = {
    StepAction.DRAIN: NodeState.DRAINED,
    StepAction.RESUME: NodeState.IN_SERVICE,
    StepAction.RESTART: NodeState.RESTARTING,
    StepAction.REPLACE: NodeState.AWAITING_REPLACEMENT,
}


@dataclass(frozen=True)
class Step:
    """One action of a plan. ``reason`` is what the scheduler stores (prefixed, sanitised)."""

    action: StepAction
    reason: str
    to_state: NodeState | None  # the node's remediation state once the step is done
    fault_code: str | None = None
    target: str | None = None
    attempt: int = 0  # restarts already counted for this fault code: part of the idempotency key
    restart_kind: RestartKind | None = None
    gpu_index: int | None = None
    # restart-job: the job, as the finding's target names it (untrusted text, checked by the
    # remediator before any adapter sees it); None when the target named no job
    job: str | None = None
    # a planned drain: the announced maintenance it is for (the executor acknowledges it after
    # the drain where the event asks for that: Azure Scheduled Events)
    planned: PlannedEvent | None = None

    def __post_init__(self) -> None:
        # a caller may name the enums by their stored words ("restart", "restarting")
        for name, kind in (("action", StepAction), ("to_state", NodeState)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                object.__setattr__(self, name, kind(value))
        if self.restart_kind is not None and not isinstance(self.restart_kind, RestartKind):
            object.__setattr__(self, "restart_kind", RestartKind(self.restart_kind))

    def key(self, node: str) -> str:
        """Idempotency key (node, action, fault, attempt): the same step never runs twice."""
        return f"{node}|{self.action}|{self.fault_code or '-'}@{self.target or '-'}|{self.attempt}"


@dataclass(frozen=True)
class Plan:
    steps: tuple[Step, ...] = ()
    note: str = ""  # why this plan (or why nothing), for the report and status
    escalated: bool = False
    fault_code: str | None = None
    target: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# -- the typed facts a plan reads -------------------------------------------------------------
def fault_code(reason: Reason) -> str:
    """The code restarts are counted by: the rule id, with the catalog code where the reason
    carries one (its typed ``code`` field; the message is never read).

    The rule id keeps the two apart: an Xid is graded by rule ``xid`` and an NVSwitch SXid by
    rule ``sxid`` (a rule routes to one catalog only), so Xid 20034 is ``xid-20034`` and
    SXid 20034 ``sxid-20034``, each with its own restarts.

    >>> fault_code(Reason("xid", Level.ERROR, "gpu:1", "Xid 31 on gpu:1", catalog="xid", code=31))
    'xid-31'
    >>> fault_code(Reason("sxid", Level.ERROR, "nvswitch:0", "x", catalog="sxid", code=20034))
    'sxid-20034'
    >>> fault_code(Reason("driver-hang", Level.ERROR, "gpu:1", "hung"))
    'driver-hang'
    """
    return f"{reason.rule}-{reason.code}" if reason.code is not None else reason.rule


#: fault codes that are one fault seen by different witnesses: a GPU gone from the bus is Xid 79
#: in the driver's log, NVML's GPU_IS_LOST, and a GPU short in the count once the node rebooted.
#: Their restarts count together, so a GPU that stays gone after the reboot its Xid asked for is
#: not rebooted again from nought under its next witness's name.
ONE_FAULT: tuple[frozenset[str], ...] = (frozenset({"xid-79", "gpu-lost", "gpu-missing"}),)


def counted_with(code: str) -> frozenset[str]:
    """The fault codes whose restarts count towards ``code``'s (itself, and its :data:`ONE_FAULT`
    set).

    >>> sorted(counted_with("gpu-missing"))
    ['gpu-lost', 'gpu-missing', 'xid-79']
    >>> counted_with("xid-31")
    frozenset({'xid-31'})
    """
    return next((same for same in ONE_FAULT if code in same), frozenset({code}))


def restart_limit(reason: Reason, safety: Safety) -> int:
    """Restarts this finding's code gets before it is hardware: the catalog's
    ``restarts_before_fault`` carried on the reason, else ``safety.max_restarts``."""
    if reason.restarts_before_fault is not None:
        return reason.restarts_before_fault
    return safety.max_restarts


def short_message(reason: Reason, max_len: int = 60) -> str:
    """What a person reading ``sinfo -R`` needs: the catalog entry when the reason carries one
    (``Xid 79: GPU has fallen off the bus``, ``SXid 20034: LTSSM Fault Up, printed Fatal``),
    else the start of the message (text for people: it decides nothing)."""
    if reason.catalog is not None and reason.code is not None and reason.name:
        noun = "SXid" if reason.catalog == "sxid" else "Xid"
        text = f"{noun} {reason.code}: {reason.name}"
    else:
        text = reason.message
    return text if len(text) <= max_len else text[: max_len - 3] + "..."


def gpu_index(target: str | None) -> int | None:
    """The GPU a ``gpu:<n>`` target names, else None (:meth:`model.Target.parse`)."""
    return Target.parse(target or "").gpu_index


def gpu_reset_allowed(reason: Reason) -> bool:
    """True when a GPU reset (not a reboot) is the documented fix for this finding: a finding of
    one GPU whose rule a reset clears, unless the driver's recovery action asks for a reboot
    (:data:`~node_agent.remediation.states.RESTART_FOR_RECOVERY`)."""
    if reason.rule not in GPU_RESET_RULES or reason.gpu_index is None:
        return False
    return reason.recovery is None or RESTART_FOR_RECOVERY[reason.recovery] is RestartKind.GPU_RESET


def job_of(target: str | None) -> str | None:
    """The job of a job finding's target, or None when the target is not one.

    >>> job_of("job:pod:ml/trainer-0/rank:3")
    'pod:ml/trainer-0'
    """
    return Target.parse(target or "").job


def drain_reason(level: Level | str, code: str, target: str | None, note: str = "") -> str:
    """``node-agent: <LEVEL> <fault code> <target>[ <note>]``, sanitised and bounded."""
    name = level.name if isinstance(level, Level) else level
    text = f"{name} {code} {target or 'node'}" + (f" {note}" if note else "")
    return sanitise_reason(text)


def restart_window_start(record: NodeRecord, safety: Safety, now: float) -> float:
    """Restarts since this time count: the window, but never before the last set-healthy."""
    return max(now - safety.restart_window_h * 3600.0, record.cleared_at or 0.0)


def remediation_window_start(record: NodeRecord, now: float) -> float:
    """Remediations since this time count towards ``safety.max_remediations_7d``: 7 days, but
    never before the last set-healthy (a repaired node starts afresh)."""
    return max(now - REMEDIATION_WINDOW_S, record.cleared_at or 0.0)


# -- the transition table ---------------------------------------------------------------------
class Phase(enum.Enum):
    """The node's :class:`NodeState`, refined by its record where the state alone does not
    decide (:func:`phase_of`)."""

    IN_SERVICE = "in-service"
    DRAINED = "drained"  # drained by the agent (a passing re-test resumes it)
    OPERATOR_DRAINED = "drained by an operator"  # only `act resume` returns it
    RESTARTING = "restarting"
    REBOOT_PENDING = "restarting, the requested reboot not yet done"
    RETEST = "retest"
    FAULT = "fault"  # drained for a FAULT, the replace request not yet done
    AWAITING_REPLACEMENT = "awaiting-replacement"
    NEEDS_OPERATOR = "needs-operator"  # restarts spent on software causes
    PLANNED = "planned"  # drained ahead of an announced maintenance
    HELD = "needs-operator for remediations-7d"  # held for too many remediations


class Verdict(enum.Enum):
    """What the grade asks for (its ``model.Action``), given the node's restart history."""

    PASS = "none"  # Action.NONE: HEALTHY or WARN
    JOBS = "restart the hung jobs"  # Action.RESTART, every ERROR a hung training job
    FAULT = "replace"  # Action.REPLACE
    ERROR = "restart"  # Action.RESTART, restarts left
    OVERUSED = "restart, remediations-7d reached"
    SPENT = "restart, restarts spent"  # -> escalated to FAULT
    SOFTWARE = "restart a software cause"  # every node ERROR has remedy software
    SOFTWARE_OVERUSED = "restart a software cause, remediations-7d reached"
    SOFTWARE_SPENT = "restart a software cause, restarts spent"  # -> hold for an operator
    PLANNED = "drain for an announced maintenance"  # every node ERROR has remedy planned


class Move(enum.Enum):
    """A transition: each builds a :class:`Plan` (:data:`_BUILDERS`)."""

    NO_ACTION = "no action"
    WAIT_REBOOT = "wait for the requested reboot"
    RESUME = "resume"
    RESUME_THEN_JOBS = "resume, then restart the hung jobs"
    RESTART_JOBS = "restart the hung jobs"
    NOTE_REPAIR = "say it waits for a repair"
    NOTE_NEEDS_OPERATOR = "say it needs an operator"
    NOTE_OPERATOR_DRAIN = "say an operator drained it"
    NOTE_AWAITING = "say it awaits its replacement"
    FINISH_REPLACE = "finish the replace request"
    REPLACE = "drain, replace"
    RESTART = "drain, GPU reset or reboot request"
    ESCALATE = "escalate to FAULT: drain, replace"
    HOLD_SOFTWARE = "hold for an operator (software cause)"
    NOTE_SOFTWARE_HELD = "say it is held for an operator (software cause)"
    HOLD_REMEDIATIONS = "hold for an operator (remediations-7d)"
    NOTE_HELD = "say it is held for an operator (remediations-7d)"
    PLANNED_DRAIN = "drain for the announced maintenance, no restart"
    NOTE_PLANNED = "say it waits for the announced maintenance to end"


#: the remedies of findings that new hardware is not known to fix: an ERROR made only of these
#: is held for an operator when its restarts are spent, never escalated to a replacement
NO_SWAP = frozenset(
    {Remedy.SOFTWARE, Remedy.APPLICATION, Remedy.RECORD, Remedy.ELSEWHERE, Remedy.UNCLASSIFIED}
)
#: the remedies of findings whose recurring never makes the node's hardware bad: those above and
#: an announced maintenance (the cloud's, not the node's)
NOT_HARDWARE = NO_SWAP | {Remedy.PLANNED}

_ERRORS = (Verdict.ERROR, Verdict.SOFTWARE)
_OVERUSED = (Verdict.OVERUSED, Verdict.SOFTWARE_OVERUSED)
_SOFTWARE = (Verdict.SOFTWARE, Verdict.SOFTWARE_OVERUSED, Verdict.SOFTWARE_SPENT)
_NOT_PASSING = tuple(v for v in Verdict if v not in (Verdict.PASS, Verdict.JOBS))

#: what a node in service does with each verdict, and where no phase says otherwise
_DEFAULT: Mapping[Verdict, Move] = {
    Verdict.PASS: Move.NO_ACTION,
    Verdict.JOBS: Move.RESTART_JOBS,
    Verdict.FAULT: Move.REPLACE,
    Verdict.ERROR: Move.RESTART,
    Verdict.SOFTWARE: Move.RESTART,
    Verdict.OVERUSED: Move.HOLD_REMEDIATIONS,
    Verdict.SOFTWARE_OVERUSED: Move.HOLD_REMEDIATIONS,
    Verdict.SPENT: Move.ESCALATE,
    Verdict.SOFTWARE_SPENT: Move.HOLD_SOFTWARE,
    Verdict.PLANNED: Move.PLANNED_DRAIN,  # on a drained node: a note, nothing to drain
}
_RESUMING = {Verdict.PASS: Move.RESUME, Verdict.JOBS: Move.RESUME_THEN_JOBS}
_OVERRIDES: Mapping[Phase, Mapping[Verdict, Move]] = {
    Phase.IN_SERVICE: {},
    Phase.DRAINED: _RESUMING,
    Phase.RESTARTING: _RESUMING,
    Phase.RETEST: _RESUMING,
    Phase.OPERATOR_DRAINED: {Verdict.PASS: Move.NOTE_OPERATOR_DRAIN},
    Phase.PLANNED: {**_RESUMING, Verdict.PLANNED: Move.NOTE_PLANNED},
    Phase.REBOOT_PENDING: {v: Move.WAIT_REBOOT for v in Verdict},
    Phase.FAULT: {
        Verdict.PASS: Move.NOTE_REPAIR,
        **{v: Move.FINISH_REPLACE for v in _NOT_PASSING},
    },
    Phase.AWAITING_REPLACEMENT: {
        Verdict.PASS: Move.NOTE_REPAIR,
        **{v: Move.NOTE_AWAITING for v in _NOT_PASSING},
    },
    Phase.NEEDS_OPERATOR: {
        Verdict.PASS: Move.NOTE_NEEDS_OPERATOR,
        **{v: Move.NOTE_SOFTWARE_HELD for v in _SOFTWARE},
    },
    Phase.HELD: {
        Verdict.PASS: Move.NOTE_NEEDS_OPERATOR,
        **{v: Move.NOTE_SOFTWARE_HELD for v in _SOFTWARE},
        Verdict.ERROR: Move.NOTE_HELD,
        Verdict.OVERUSED: Move.NOTE_HELD,
    },
}
#: the whole table: every (phase, verdict) has exactly one move
TRANSITIONS: Mapping[tuple[Phase, Verdict], Move] = {
    (p, v): _OVERRIDES[p].get(v, _DEFAULT[v]) for p in Phase for v in Verdict
}


def phase_of(record: NodeRecord, boot_time: float) -> Phase:
    """The node's phase: its state, refined by who drained it, whether a requested reboot has
    happened (``boot_time``, epoch s) and why it is held."""
    state = NodeState(record.state)
    if state is NodeState.DRAINED and record.trigger == "operator":
        return Phase.OPERATOR_DRAINED
    if (
        state is NodeState.RESTARTING
        and record.restart_kind == RestartKind.REBOOT
        and record.requested_at is not None
        and boot_time < record.requested_at
    ):
        return Phase.REBOOT_PENDING
    if state is NodeState.NEEDS_OPERATOR and record.fault_code == REMEDIATIONS_CODE:
        return Phase.HELD
    return Phase(state.value)


@dataclass(frozen=True)
class _Case:
    """Everything a move builds its plan from."""

    grade: Grade
    record: NodeRecord
    safety: Safety
    serious: tuple[Reason, ...]  # every reason of ERROR or worse
    node_serious: tuple[Reason, ...]  # those of the node (not a hung job)
    worst: Reason  # the node's worst reason
    restarts: int  # restarts done for the worst reason's fault code in the window
    limit: int  # restarts it gets before it is hardware
    remediations_7d: int
    gpu_reset_available: bool
    gpu_reset_tried: bool

    @property
    def code(self) -> str:
        return fault_code(self.worst)

    @property
    def drained(self) -> bool:
        return NodeState(self.record.state) is not NodeState.IN_SERVICE


def _verdict(c: _Case) -> Verdict:
    action = ACTION_FOR_LEVEL[c.grade.level]
    if action is Action.NONE:
        return Verdict.PASS
    if action is Action.REPLACE:
        return Verdict.FAULT
    if c.serious and all(r.rule in JOB_RULES for r in c.serious):
        return Verdict.JOBS
    if c.node_serious and all(r.remedy is Remedy.PLANNED for r in c.node_serious):
        return Verdict.PLANNED
    software = bool(c.node_serious) and all(r.remedy in NOT_HARDWARE for r in c.node_serious)
    if c.restarts >= c.limit:
        return Verdict.SOFTWARE_SPENT if software else Verdict.SPENT
    if c.remediations_7d >= c.safety.max_remediations_7d:
        return Verdict.SOFTWARE_OVERUSED if software else Verdict.OVERUSED
    return Verdict.SOFTWARE if software else Verdict.ERROR


def plan(
    grade: Grade,
    record: NodeRecord,
    safety: Safety,
    *,
    now: float,
    boot_time: float,
    restart_counts: dict[str, int],
    gpu_reset_available: bool,
    gpu_reset_tried: bool = False,
    remediations_7d: int = 0,
) -> Plan:
    """What to do about ``grade`` given the node's remediation ``record``:
    ``TRANSITIONS[(phase_of(record), verdict)]``.

    ``restart_counts`` maps a fault code to the restarts already done for it in the window
    (:func:`restart_window_start`), for every code :func:`counted_with` a reason's code;
    ``boot_time`` (epoch s) tells whether a requested reboot has happened; ``gpu_reset_tried``
    is True after a GPU reset in this run, so that the next restart is a reboot;
    ``remediations_7d`` is the automatic restarts of the node, any code, since
    :func:`remediation_window_start`. ``now`` is part of the pure interface (the plan's clock);
    the windows are applied by the caller.
    """
    serious = tuple(r for r in grade.reasons if r.level >= Level.ERROR)
    # the node's own findings decide; a hung job beside them ends with the reboot/replacement
    node_reasons = [r for r in grade.reasons if r.rule not in JOB_RULES] or list(grade.reasons)
    node_serious = tuple(r for r in node_reasons if r.level >= Level.ERROR)
    # Restarts are counted for, and escalate, the node's first hardware finding where it has
    # one: a code is escalated by its own restarts only, never by those a software cause, an
    # application Xid or an announced maintenance beside it collected.
    worst = (
        next((r for r in node_serious if r.remedy not in NOT_HARDWARE), None)
        or next((r for r in node_serious if r.remedy is not Remedy.PLANNED), None)
        or (node_reasons[0] if node_reasons else Reason("ungraded", grade.level, "node", ""))
    )
    case = _Case(
        grade=grade,
        record=record,
        safety=safety,
        serious=serious,
        node_serious=node_serious,
        worst=worst,
        restarts=sum(restart_counts.get(code, 0) for code in counted_with(fault_code(worst))),
        limit=restart_limit(worst, safety),
        remediations_7d=remediations_7d,
        gpu_reset_available=gpu_reset_available,
        gpu_reset_tried=gpu_reset_tried,
    )
    move = TRANSITIONS[(phase_of(record, boot_time), _verdict(case))]
    return _BUILDERS[move](case)


# -- the moves --------------------------------------------------------------------------------
def _no_action(c: _Case) -> Plan:
    return Plan(note=f"{c.grade.level.name}: no action (never drain for WARN)")


def _wait_reboot(c: _Case) -> Plan:
    return Plan(
        note=f"waiting for the reboot requested at {utc_iso(c.record.requested_at or 0.0)}; "
        "the next run after it re-tests the node"
    )


def _resume(c: _Case) -> Plan:
    return Plan(
        (_resume_step(c.grade.level.name, c.record),),
        note=f"re-test graded {c.grade.level.name}: resume",
        fault_code=c.record.fault_code,
        target=c.record.target,
    )


def _resume_then_jobs(c: _Case) -> Plan:
    # the node's own re-test is clean: a training job's hang is the job's, never a reason to
    # keep the node drained (a user's idle process with a stale heartbeat must not keep a
    # drained node from its resume); the node resumes first, then the jobs restart
    jobs = _restart_jobs(c)
    step = _resume_step("clean apart from hung training jobs", c.record)
    return Plan(
        (step, *jobs.steps),
        note=f"re-test clean apart from hung training jobs: resume; {jobs.note}",
        fault_code=c.record.fault_code,
        target=c.record.target,
    )


def _restart_jobs(c: _Case) -> Plan:
    """One restart-job step per distinct hung job; the node's state does not change.

    The job text is untrusted (a training process wrote it): the step keeps it as found for
    the remediator to check (:func:`~node_agent.schedulers.base.check_job_id`) before any
    adapter sees it; the reason is sanitised and the target escaped to printable ASCII.
    """
    reasons = c.serious
    by_job: dict[tuple[str | None, str], list[Reason]] = {}
    for reason in reasons:
        job = reason.job
        # a target that names no job stays apart, keyed by the target, and is refused later
        by_job.setdefault((job, "" if job is not None else reason.target), []).append(reason)
    steps = []
    for (job, raw_target), found in by_job.items():
        first = found[0]
        where = ",".join(r.target.rsplit("/", 1)[-1] for r in found[:3]) + (
            f",+{len(found) - 3}" if len(found) > 3 else ""
        )
        target = _printable(f"job:{job}" if job is not None else raw_target)
        text = (
            f"ERROR {first.rule} job {job if job is not None else '?'} {where} "
            f"{short_message(first)}"
        )
        steps.append(
            Step(
                StepAction.RESTART_JOB,
                sanitise_reason(text),
                None,
                fault_code=first.rule,
                target=target,
                job=job,
            )
        )
    jobs = ", ".join(s.target or "?" for s in steps)
    return Plan(
        tuple(steps),
        note=f"ERROR {reasons[0].rule}: restart {len(steps)} hung job(s) "
        f"through the scheduler ({jobs[:300]}); the node is not "
        f"drained and stays {c.record.state}",
        fault_code=reasons[0].rule,
        target=steps[0].target,
    )


def _held_note(c: _Case, held: str, when: str) -> Plan:
    """The note of a node held out of service: ``held`` (why, with its fault), and that only an
    operator returns it, ``when`` the cause is gone."""
    r = c.record
    return Plan(
        note=f"{held} ({r.fault_code} {r.target}); a passing run does not return it: "
        f"{when} run `node-agent set-healthy` and `node-agent act resume`"
    )


def _note_repair(c: _Case) -> Plan:
    return _held_note(c, f"node is {c.record.state}", "after the repair")


def _note_needs_operator(c: _Case) -> Plan:
    return _held_note(c, "node needs an operator", "once the cause is fixed")


def _note_operator_drain(c: _Case) -> Plan:
    return Plan(
        note="node was drained by an operator through node-agent; resume it "
        "with `node-agent act resume`"
    )


def _note_awaiting(c: _Case) -> Plan:
    r = c.record
    return Plan(
        note=f"node is already {r.state} for {r.fault_code} "
        f"{r.target}; nothing more to do until it is repaired"
    )


def _finish_replace(c: _Case) -> Plan:
    """Drained for a FAULT, the replace request not yet done: finish it."""
    code = c.record.fault_code or c.code
    p = _replace_plan(code, c.record.target or c.worst.target, True, Level.FAULT)
    return Plan(
        p.steps,
        note=f"{p.note} (replace request still pending)",
        fault_code=p.fault_code,
        target=p.target,
    )


def _replace(c: _Case) -> Plan:
    return _replace_plan(
        c.code, c.worst.target, c.drained, Level.FAULT, note=short_message(c.worst)
    )


def _note_software_held(c: _Case) -> Plan:
    r = c.record
    return Plan(
        note=f"node needs an operator since {utc_iso(r.since)} ({r.fault_code} "
        f"{r.target}); still {c.code} on {c.worst.target}: no restart or "
        "replacement until an operator fixes the cause and runs `node-agent "
        "set-healthy` and `node-agent act resume`",
        fault_code=r.fault_code,
        target=r.target,
    )


def _spent_why(c: _Case) -> str:
    where = (
        "its restarts_before_fault in graders/xid.yaml"
        if c.worst.restarts_before_fault is not None
        else "safety.max_restarts"
    )
    return (
        f"{c.code} on {c.worst.target} is still there after {c.restarts} restart(s) in "
        f"{c.safety.restart_window_h:g} h ({where}={c.limit})"
    )


def _escalate(c: _Case) -> Plan:
    """The hardware finding that outlived its own restarts (``worst``: :func:`plan` puts a
    hardware finding there whenever the grade has one) is replaced."""
    why = _spent_why(c)
    code, target = c.code, c.worst.target
    p = _replace_plan(code, target, c.drained, Level.FAULT, note="escalated", why=why)
    return Plan(
        p.steps, note=f"escalated to FAULT: {why}", escalated=True, fault_code=code, target=target
    )


#: for each remedy in :data:`NO_SWAP`: what such a finding is, and what the operator does
_NO_SWAP_WORDS = {
    Remedy.SOFTWARE: (
        "a software cause (remedy software in graders/rules.yaml)",
        "fix the cause (e.g. rebuild or reinstall the driver for the running kernel)",
    ),
    Remedy.APPLICATION: (
        "an error a user's code can make the driver report (an Xid of class application in "
        "graders/xid.yaml)",
        "run the GPU's field diagnostics (DCGM's `dcgmi diag -r 3`, or NVIDIA's field "
        "diagnostic) and look at the jobs that ran on it",
    ),
    Remedy.RECORD: (
        "a record a restart does not clear (the BMC's event log, panics kept in pstore), "
        "whose lasting says nothing of the hardware now (remedy record in graders/rules.yaml)",
        "read the record, check the part it names (`ipmitool sel list`, the supplies; the "
        "panic's stack), clear it (`ipmitool sel clear`, remove the pstore dumps)",
    ),
    Remedy.ELSEWHERE: (
        "a cause outside the parts a replacement swaps: the far end of the node's links (an "
        "NVSwitch, on an NVL72 rack in another tray; a switch port, a cable, the subnet "
        "manager), the fabric manager's partition, or the node's power feed",
        "check the far end first (`nvidia-smi nvlink -e` on each GPU, the NVSwitches' SXids, "
        "the fabric manager's log; `ibstat` and the switch port; the PSUs' cords and PDUs)",
    ),
    Remedy.UNCLASSIFIED: (
        "a failure no rule in graders/rules.yaml classifies (unclassified-fail), which nothing "
        "says a replacement fixes",
        "read the check's detail, run the part's own diagnostics, and give the metric a rule "
        "(without a remedy if new hardware fixes it)",
    ),
}


def no_swap_why(reasons: Sequence[Reason], causes: str) -> str:
    """Why a node whose every ERROR is in :data:`NO_SWAP` is held, not replaced, and what the
    operator does: the wording follows the remedies present."""
    present = {r.remedy for r in reasons}
    words = [w for remedy, w in _NO_SWAP_WORDS.items() if remedy in present]
    kinds, fixes = " or ".join(k for k, _ in words), " and ".join(f for _, f in words)
    return (
        f"every ERROR ({causes}) is {kinds}, which new hardware is not known to fix, so the "
        f"node stays drained with no further restart or replacement; {fixes}, then run "
        "`node-agent set-healthy` and `node-agent act resume`"
    )


def _hold_software(c: _Case) -> Plan:
    """Restarts spent on software causes only: keep the node drained for an operator.

    New hardware would not fix a driver that is not loaded or a check that cannot run, so the
    node is neither restarted again nor sent for replacement: a ``hold`` step (journaled, no
    adapter call) moves it to ``needs-operator``, after a drain if it is not drained.
    """
    code, target, restarts = c.code, c.worst.target, c.restarts
    causes = ", ".join(dict.fromkeys(f"{fault_code(r)} {r.target}" for r in c.node_serious))
    reason = drain_reason(
        Level.ERROR, code, target, f"needs-operator {short_message(c.node_serious[0])}"
    )
    steps = [] if c.drained else [_drain(reason, code, target, restarts)]
    steps.append(Step(StepAction.HOLD, reason, NodeState.NEEDS_OPERATOR, code, target, restarts))
    note = f"needs an operator: {_spent_why(c)}; {no_swap_why(c.node_serious, causes)}"
    return Plan(tuple(steps), note=note, fault_code=code, target=target)


def _remediations_why(c: _Case) -> str:
    return (
        f"node restarted {c.remediations_7d} time(s) by node-agent in 7 days "
        f"(safety.max_remediations_7d={c.safety.max_remediations_7d}), now {c.code} on "
        f"{c.worst.target}"
    )


def _note_held(c: _Case) -> Plan:
    """Held for too many remediations: later ERRORs plan nothing (a FAULT is still replaced)."""
    return Plan(
        note=f"held for an operator since {utc_iso(c.record.since)}: {_remediations_why(c)}; "
        "no restart until an operator looks at the node and runs `node-agent set-healthy` "
        "and `node-agent act resume`",
        fault_code=c.record.fault_code,
        target=c.record.target,
    )


def _hold_remediations(c: _Case) -> Plan:
    """The node was restarted ``safety.max_remediations_7d`` times in 7 days: no further
    restart. A ``hold`` step (journaled, no adapter call) moves it to ``needs-operator`` with
    the fault code ``remediations-7d``, after a drain if it is not drained."""
    code, target, count = c.code, c.worst.target, c.remediations_7d
    reason = drain_reason(Level.ERROR, code, target, f"needs-operator {count} remediations in 7 d")
    steps = [] if c.drained else [_drain(reason, code, target, count)]
    steps.append(
        Step(StepAction.HOLD, reason, NodeState.NEEDS_OPERATOR, REMEDIATIONS_CODE, "node", count)
    )
    note = (
        f"held for an operator: {_remediations_why(c)}; a node that keeps needing restarts is "
        "not restarted again: it stays drained until an operator finds the cause, then runs "
        "`node-agent set-healthy` and `node-agent act resume`"
    )
    return Plan(tuple(steps), note=note, fault_code=REMEDIATIONS_CODE, target="node")


def _restart(c: _Case) -> Plan:
    """Drain (unless drained), then a GPU reset and a quick re-test where the finding allows it
    and none was tried in this run, else a reboot request re-tested by the next graded run."""
    code, target, restarts, worst = c.code, c.worst.target, c.restarts, c.worst
    reason = drain_reason(Level.ERROR, code, target)
    steps = [] if c.drained else [_drain(reason, code, target, restarts)]
    if c.gpu_reset_available and not c.gpu_reset_tried and gpu_reset_allowed(worst):
        kind = RestartKind.GPU_RESET
        steps.append(
            Step(
                StepAction.GPU_RESET,
                reason,
                NodeState.RETEST,
                code,
                target,
                restarts,
                restart_kind=kind,
                gpu_index=worst.gpu_index,
            )
        )
        steps.append(Step(StepAction.RETEST, reason, None, code, target, restarts, kind))
        how = "GPU reset, re-test"
    else:
        steps.append(
            Step(
                StepAction.RESTART,
                reason,
                NodeState.RESTARTING,
                code,
                target,
                restarts,
                restart_kind=RestartKind.REBOOT,
            )
        )
        how = "reboot request, re-test after the reboot"
    note = f"ERROR {code} on {target}: drain, {how} (restart {restarts + 1} of {c.limit})"
    return Plan(tuple(steps), note=note, fault_code=code, target=target)


def _planned_what(c: _Case) -> str:
    event = c.worst.planned
    return event.describe() if event is not None else short_message(c.worst)


def _planned_drain(c: _Case) -> Plan:
    """Drain ahead of the announced maintenance, and nothing else: the drain reason names the
    event (its kind and start, from the typed ``Reason.planned``); the node moves to
    ``planned``, from which a passing re-test after the event resumes it."""
    code, target, what = c.code, c.worst.target, _planned_what(c)
    if c.drained:
        return Plan(
            note=f"planned maintenance {what}: the node is already {c.record.state} "
            f"({c.record.fault_code} {c.record.target}); nothing more to do for the event",
            fault_code=c.record.fault_code,
            target=c.record.target,
        )
    reason = drain_reason(Level.ERROR, code, target, f"planned {what}")
    step = Step(StepAction.DRAIN, reason, NodeState.PLANNED, code, target, planned=c.worst.planned)
    return Plan(
        (step,),
        note=f"planned maintenance {what}: drain ahead of it (no restart, no replacement); "
        "a passing re-test after the event resumes the node",
        fault_code=code,
        target=target,
    )


def _note_planned(c: _Case) -> Plan:
    return Plan(
        note=f"drained since {utc_iso(c.record.since)} for the planned maintenance "
        f"{_planned_what(c)}; it resumes when a re-test after the event passes",
        fault_code=c.record.fault_code,
        target=c.record.target,
    )


_BUILDERS: Mapping[Move, Callable[[_Case], Plan]] = {
    Move.NO_ACTION: _no_action,
    Move.WAIT_REBOOT: _wait_reboot,
    Move.RESUME: _resume,
    Move.RESUME_THEN_JOBS: _resume_then_jobs,
    Move.RESTART_JOBS: _restart_jobs,
    Move.NOTE_REPAIR: _note_repair,
    Move.NOTE_NEEDS_OPERATOR: _note_needs_operator,
    Move.NOTE_OPERATOR_DRAIN: _note_operator_drain,
    Move.NOTE_AWAITING: _note_awaiting,
    Move.FINISH_REPLACE: _finish_replace,
    Move.REPLACE: _replace,
    Move.RESTART: _restart,
    Move.ESCALATE: _escalate,
    Move.HOLD_SOFTWARE: _hold_software,
    Move.NOTE_SOFTWARE_HELD: _note_software_held,
    Move.HOLD_REMEDIATIONS: _hold_remediations,
    Move.NOTE_HELD: _note_held,
    Move.PLANNED_DRAIN: _planned_drain,
    Move.NOTE_PLANNED: _note_planned,
}


def _drain(reason: str, code: str, target: str, attempt: int = 0) -> Step:
    return Step(StepAction.DRAIN, reason, NodeState.DRAINED, code, target, attempt)


def _resume_step(graded: str, record: NodeRecord) -> Step:
    return Step(
        StepAction.RESUME,
        sanitise_reason(f"re-test passed ({graded}) after {record.fault_code or 'restart'}"),
        to_state=NodeState.IN_SERVICE,
        fault_code=record.fault_code,
        target=record.target,
    )


def _printable(text: str, max_len: int = MAX_JOB_LEN + 32) -> str:
    """Untrusted text for the journal and ``status``: printable ASCII (escapes), bounded."""
    escaped = text.encode("unicode_escape").decode("ascii")
    return escaped if len(escaped) <= max_len else escaped[: max_len - 3] + "..."


def _replace_plan(
    code: str, target: str, drained: bool, level: Level, note: str = "", why: str = ""
) -> Plan:
    reason = drain_reason(level, code, target, note)
    steps = [] if drained else [Step(StepAction.DRAIN, reason, NodeState.FAULT, code, target)]
    steps.append(Step(StepAction.REPLACE, reason, NodeState.AWAITING_REPLACEMENT, code, target))
    return Plan(
        tuple(steps),
        note=why or f"FAULT {code} on {target}: drain, replace",
        fault_code=code,
        target=target,
    )


def operator_step(action: str, text: str) -> Step:
    """The step for ``node-agent act ACTION --reason TEXT`` (TEXT already sanitised)."""
    step_action = StepAction(action)
    to_state = OPERATOR_ACTIONS[step_action]
    reason = sanitise_reason(f"operator {action}" + (f": {text}" if text else ""))
    return Step(
        step_action,
        reason,
        to_state,
        fault_code="operator",
        target="node",
        restart_kind=RestartKind.REBOOT if step_action is StepAction.RESTART else None,
    )
