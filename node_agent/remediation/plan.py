"""Grade + history -> remediation plan (pure functions; the clock is a parameter).

Per node (DESIGN.md, "Remediation and safety")::

    in-service -> drained -> restarting -> retest -> in-service
                      \\-> fault -> awaiting-replacement
                      \\-> needs-operator   (software cause; set-healthy + act resume)

* ERROR: drain, restart (a GPU reset where the fault allows it, else a reboot request through
  the scheduler adapter), re-test (the quick suite right after a GPU reset; the next graded run
  after a reboot), then resume on a pass or escalate.
* FAULT: drain, then replace.
* Restarts are counted per fault code within ``safety.restart_window_h``; a fault code that is
  still there after its restarts (the catalog's ``restarts_before_fault`` carried on the Reason,
  else ``safety.max_restarts``) is escalated to FAULT, unless every ERROR
  reason is a software cause (``remedy: software`` in graders/rules.yaml: no driver, NVML
  broken, a check that could not run): then the node stays drained as ``needs-operator`` (a
  ``hold`` step, no adapter call) and no further restart or replacement is planned until an
  operator's ``set-healthy`` / ``act resume``.
* A node the agent already restarted ``safety.max_remediations_7d`` times in 7 days (GPU resets
  and reboot requests, any fault code) is not restarted again: a ``hold`` step with the fault
  code ``remediations-7d`` keeps it drained as ``needs-operator`` (NVSentinel flags a node
  remediated that often; a restart loop hides a sick node and costs the jobs that land on it).
* HEALTHY/WARN never cause a drain; they resume a node only when the agent itself drained it
  for a restart and this is the passing re-test. A re-test whose only ERRORs are hung training
  jobs (``JOB_RULES``) passes for the node: it resumes, then the jobs are restarted.
* A hung training job (ERROR whose every ERROR-or-worse reason is a job rule, ``JOB_RULES``) is
  not the node's fault: one ``restart-job`` step per hung job, through the scheduler, and the
  node's state does not change. A hardware ERROR/FAULT beside it takes the node path instead
  (a reboot or replacement ends the jobs anyway).

The plan says *what* to do; :mod:`node_agent.remediation.executor` executes it through the guards in
:mod:`node_agent.remediation.guards` and journals each step before acting.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from node_agent.config import Config
from node_agent.model import Grade, Level, Reason
from node_agent.remediation.store import NodeRecord
from node_agent.schedulers.base import MAX_JOB_LEN, sanitise_reason

#: remediation states of a node
STATES = (
    "in-service",
    "drained",
    "restarting",
    "retest",
    "fault",
    "awaiting-replacement",
    "needs-operator",
)
#: states in which the agent has drained the node for a restart and a passing re-test resumes it
RESUMABLE_STATES = ("drained", "restarting", "retest")
#: actions a plan step can take (the journal's ``action`` column)
ACTIONS = ("drain", "gpu-reset", "restart", "retest", "resume", "replace", "restart-job", "hold")
#: actions that take the node (or its GPUs) out of work: the rate limit of a drain counts them
DISRUPTIVE = ("drain", "gpu-reset", "restart", "replace")
#: actions before which evidence is collected: a job restart kills the hung processes, so their
#: stacks are taken first
EVIDENCE_ACTIONS = (*DISRUPTIVE, "restart-job")
#: rules whose ERROR is about a training job, not the node: restart the job, leave the node be
JOB_RULES = frozenset({"training-hang"})
#: the ``remedy`` of a software cause: an ERROR that new hardware would not fix
SOFTWARE = "software"

# Faults that a GPU reset clears, so a reboot is not needed. Sources: NVIDIA "GPU Memory Error
# Management" (a pending row remap or page retirement takes effect after a GPU reset) and the
# NVML recovery action NVML_GPU_RECOVERY_ACTION_GPU_RESET (the driver asks for a reset).
GPU_RESET_RULES = frozenset({"row-remap-pending", "retired-pages-pending", "recovery-action"})

#: the fault code of a hold for too many remediations in 7 days (``safety.max_remediations_7d``)
REMEDIATIONS_CODE = "remediations-7d"
REMEDIATION_WINDOW_S = 7 * 24 * 3600.0
#: what counts as one remediation of the node: an automatic restart of it or of its GPUs
REMEDIATION_ACTIONS = ("restart", "gpu-reset")

# the grader appends "[Xid N: name]" (rule xid) or "[SXid N: name]" (rule sxid, an NVSwitch)
# after the finding's detail (grading/rules.py): for people (``sinfo -R``), never for decisions
_XID_NAME_IN_MESSAGE = re.compile(r"\[(S?Xid \d+: [^\]]*)\]")
_GPU_TARGET = re.compile(r"^gpu:(\d+)$")
# job:<job>/rank:<n> or job:<job>/pid:<n>; <job> may itself hold ':' and '/', so the match is
# anchored at the end (docs/training_hangs.md)
_JOB_TARGET = re.compile(r"^job:(?P<job>.+)/(?:rank|pid):\d+$")


@dataclass(frozen=True)
class Safety:
    """The ``safety.*`` configuration keys (see docs/remediation.md for each guard)."""

    max_drained_fraction: float = 0.1
    max_restarts: int = 2
    restart_window_h: float = 24.0
    breaker_max_drains: int = 5
    breaker_window_h: float = 1.0
    dedup_window_s: float = 600.0
    min_action_interval_s: float = 60.0
    opt_out: bool = False
    max_remediations_7d: int = 5

    @classmethod
    def from_config(cls, config: Config) -> Safety:
        s: dict[str, Any] = config.get("safety")
        return cls(**{k: s[k] for k in cls.__dataclass_fields__ if k in s})


@dataclass(frozen=True)
class Step:
    """One action of a plan. ``reason`` is what the scheduler stores (prefixed, sanitised)."""

    action: str  # one of ACTIONS
    reason: str
    to_state: str | None  # the node's remediation state once the step is done
    fault_code: str | None = None
    target: str | None = None
    attempt: int = 0  # restarts already counted for this fault code: part of the idempotency key
    restart_kind: str | None = None  # gpu-reset | reboot
    gpu_index: int | None = None
    # restart-job: the job, as parsed from the finding's target (untrusted text, checked by
    # the remediator before any adapter sees it); None when the target named no job
    job: str | None = None

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


def restart_limit(reason: Reason, safety: Safety) -> int:
    """Restarts this finding's code gets before it is hardware: the catalog's
    ``restarts_before_fault`` carried on the reason, else ``safety.max_restarts``."""
    if reason.restarts_before_fault is not None:
        return reason.restarts_before_fault
    return safety.max_restarts


def _last(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
    """The last match: the grader's bracket follows the detail, which quotes the kernel line."""
    matches = list(pattern.finditer(text))
    return matches[-1] if matches else None


def short_message(reason: Reason, max_len: int = 60) -> str:
    """What a person reading ``sinfo -R`` needs: the XID catalog name when there is one
    (``Xid 79: GPU has fallen off the bus``, ``SXid 20034: LTSSM Fault Up, printed Fatal``),
    else the start of the message."""
    match = _last(_XID_NAME_IN_MESSAGE, reason.message)
    text = match.group(1) if match else reason.message
    return text if len(text) <= max_len else text[: max_len - 3] + "..."


def gpu_index(target: str | None) -> int | None:
    match = _GPU_TARGET.match(target or "")
    return int(match.group(1)) if match else None


def gpu_reset_allowed(reason: Reason) -> bool:
    """True when a GPU reset (not a reboot) is the documented fix for this finding."""
    if reason.rule not in GPU_RESET_RULES or gpu_index(reason.target) is None:
        return False
    # the driver may ask for a node reboot instead of a reset (NVML_GPU_RECOVERY_ACTION_NODE_REBOOT)
    return not (reason.rule == "recovery-action" and "reboot" in reason.message.lower())


def job_of(target: str | None) -> str | None:
    """The job of a job finding's target, or None when the target is not one.

    >>> job_of("job:pod:ml/trainer-0/rank:3")
    'pod:ml/trainer-0'
    """
    match = _JOB_TARGET.match(target or "")
    return match.group("job") if match else None


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
    """What to do about ``grade`` given the node's remediation ``record``.

    ``restart_counts`` maps a fault code to the restarts already done for it in the window
    (:func:`restart_window_start`); ``boot_time`` (epoch s) tells whether a requested reboot
    has happened; ``gpu_reset_tried`` is True after a GPU reset in this run, so that the next
    restart is a reboot; ``remediations_7d`` is the automatic restarts of the node, any code,
    since :func:`remediation_window_start`.
    """
    state = record.state
    if (
        state == "restarting"
        and record.restart_kind == "reboot"
        and record.requested_at is not None
        and boot_time < record.requested_at
    ):
        return Plan(
            note=f"waiting for the reboot requested at {_iso(record.requested_at)}; "
            "the next run after it re-tests the node"
        )

    resumable = state in ("restarting", "retest") or (
        state == "drained" and record.trigger != "operator"
    )
    if grade.level <= Level.WARN:
        if resumable:
            step = _resume_step(grade.level.name, record)
            return Plan(
                (step,),
                note=f"re-test graded {grade.level.name}: resume",
                fault_code=record.fault_code,
                target=record.target,
            )
        if state in ("fault", "awaiting-replacement"):
            return Plan(
                note=f"node is {state} ({record.fault_code} {record.target}); a passing "
                "run does not return it: after the repair run `node-agent "
                "set-healthy` and `node-agent act resume`"
            )
        if state == "needs-operator":
            return Plan(
                note=f"node needs an operator ({record.fault_code} {record.target}); a "
                "passing run does not return it: once the cause is fixed run "
                "`node-agent set-healthy` and `node-agent act resume`"
            )
        if state == "drained":
            return Plan(
                note="node was drained by an operator through node-agent; resume it "
                "with `node-agent act resume`"
            )
        return Plan(note=f"{grade.level.name}: no action (never drain for WARN)")

    serious = [r for r in grade.reasons if r.level >= Level.ERROR]
    if grade.level == Level.ERROR and serious and all(r.rule in JOB_RULES for r in serious):
        jobs = _job_plan(serious, state)
        if not resumable:
            return jobs
        # the node's own re-test is clean: a training job's hang is the job's, never a reason
        # to keep the node drained (issue 29: a user's idle process with a stale heartbeat
        # kept a drained node from its resume); the node resumes first, then the jobs restart
        step = _resume_step("clean apart from hung training jobs", record)
        return Plan(
            (step, *jobs.steps),
            note=f"re-test clean apart from hung training jobs: resume; {jobs.note}",
            fault_code=record.fault_code,
            target=record.target,
        )

    if state == "awaiting-replacement":
        return Plan(
            note=f"node is already {state} for {record.fault_code} "
            f"{record.target}; nothing more to do until it is repaired"
        )

    # the node's own findings decide; a hung job beside them ends with the reboot/replacement
    node_reasons = [r for r in grade.reasons if r.rule not in JOB_RULES] or list(grade.reasons)
    node_serious = [r for r in node_reasons if r.level >= Level.ERROR]
    software = (
        grade.level == Level.ERROR
        and bool(node_serious)
        and all(r.remedy == SOFTWARE for r in node_serious)
    )
    worst = node_reasons[0] if node_reasons else Reason("ungraded", grade.level, "node", "")
    code, target = fault_code(worst), worst.target
    drained = state != "in-service"
    if state == "fault":  # drained for a FAULT, the replace request not yet done: finish it
        p = _replace_plan(record.fault_code or code, record.target or target, True, Level.FAULT)
        return Plan(
            p.steps,
            note=f"{p.note} (replace request still pending)",
            fault_code=p.fault_code,
            target=p.target,
        )
    if grade.level >= Level.FAULT:
        return _replace_plan(code, target, drained, Level.FAULT, note=short_message(worst))
    if state == "needs-operator" and software:
        return Plan(
            note=f"node needs an operator since {_iso(record.since)} ({record.fault_code} "
            f"{record.target}); still {code} on {target}: no restart or "
            "replacement until an operator fixes the cause and runs `node-agent "
            "set-healthy` and `node-agent act resume`",
            fault_code=record.fault_code,
            target=record.target,
        )

    restarts = restart_counts.get(code, 0)
    limit = restart_limit(worst, safety)
    if restarts >= limit:
        where = (
            "its restarts_before_fault in graders/xid.yaml"
            if worst.restarts_before_fault is not None
            else "safety.max_restarts"
        )
        why = (
            f"{code} on {target} is still there after {restarts} restart(s) in "
            f"{safety.restart_window_h:g} h ({where}={limit})"
        )
        if software:
            return _hold_plan(node_serious, code, target, restarts, drained, why)
        # a software cause beside a hardware one: the hardware finding is what gets replaced
        hardware = next((r for r in node_serious if r.remedy != SOFTWARE), worst)
        if hardware is not worst:
            why += f"; with {fault_code(hardware)} on {hardware.target}, not a software cause"
            code, target = fault_code(hardware), hardware.target
        plan_ = _replace_plan(code, target, drained, Level.FAULT, note="escalated", why=why)
        return Plan(
            plan_.steps,
            note=f"escalated to FAULT: {why}",
            escalated=True,
            fault_code=code,
            target=target,
        )

    held = state == "needs-operator" and record.fault_code == REMEDIATIONS_CODE
    if held or remediations_7d >= safety.max_remediations_7d:
        return _remediations_hold_plan(record, code, target, remediations_7d, drained, safety)

    steps: list[Step] = []
    reason = drain_reason(Level.ERROR, code, target)
    if not drained:
        steps.append(Step("drain", reason, "drained", code, target, restarts))
    index = gpu_index(target)
    if gpu_reset_available and not gpu_reset_tried and gpu_reset_allowed(worst):
        steps.append(
            Step(
                "gpu-reset",
                reason,
                "retest",
                code,
                target,
                restarts,
                restart_kind="gpu-reset",
                gpu_index=index,
            )
        )
        steps.append(Step("retest", reason, None, code, target, restarts, restart_kind="gpu-reset"))
        note = (
            f"ERROR {code} on {target}: drain, GPU reset, re-test (restart {restarts + 1} "
            f"of {limit})"
        )
    else:
        steps.append(
            Step("restart", reason, "restarting", code, target, restarts, restart_kind="reboot")
        )
        note = (
            f"ERROR {code} on {target}: drain, reboot request, re-test after the reboot "
            f"(restart {restarts + 1} of {limit})"
        )
    return Plan(tuple(steps), note=note, fault_code=code, target=target)


def _resume_step(graded: str, record: NodeRecord) -> Step:
    return Step(
        "resume",
        sanitise_reason(f"re-test passed ({graded}) after {record.fault_code or 'restart'}"),
        to_state="in-service",
        fault_code=record.fault_code,
        target=record.target,
    )


def _job_plan(reasons: list[Reason], state: str) -> Plan:
    """One restart-job step per distinct hung job; the node's state does not change.

    The job text is untrusted (a training process wrote it): the step keeps it as found for
    the remediator to check (:func:`~node_agent.schedulers.base.check_job_id`) before any
    adapter sees it; the reason is sanitised and the target escaped to printable ASCII.
    """
    by_job: dict[tuple[str | None, str], list[Reason]] = {}
    for reason in reasons:
        job = job_of(reason.target)
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
                "restart-job",
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
        f"drained and stays {state}",
        fault_code=reasons[0].rule,
        target=steps[0].target,
    )


def _printable(text: str, max_len: int = MAX_JOB_LEN + 32) -> str:
    """Untrusted text for the journal and ``status``: printable ASCII (escapes), bounded."""
    escaped = text.encode("unicode_escape").decode("ascii")
    return escaped if len(escaped) <= max_len else escaped[: max_len - 3] + "..."


def _hold_plan(
    reasons: list[Reason], code: str, target: str, restarts: int, drained: bool, why: str
) -> Plan:
    """Restarts spent on software causes only: keep the node drained for an operator.

    New hardware would not fix a driver that is not loaded or a check that cannot run, so the
    node is neither restarted again nor sent for replacement: a ``hold`` step (journaled, no
    adapter call) moves it to ``needs-operator``, after a drain if it is not drained.
    """
    causes = ", ".join(dict.fromkeys(f"{fault_code(r)} {r.target}" for r in reasons))
    reason = drain_reason(Level.ERROR, code, target, f"needs-operator {short_message(reasons[0])}")
    steps = [] if drained else [Step("drain", reason, "drained", code, target, restarts)]
    steps.append(Step("hold", reason, "needs-operator", code, target, restarts))
    note = (
        f"needs an operator: {why}; every ERROR is a software cause ({causes}: remedy "
        "software in graders/rules.yaml), which new hardware does not fix, so the node stays "
        "drained with no further restart or replacement; fix the cause (e.g. rebuild or "
        "reinstall the driver for the running kernel), then run `node-agent set-healthy` and "
        "`node-agent act resume`"
    )
    return Plan(tuple(steps), note=note, fault_code=code, target=target)


def _remediations_hold_plan(
    record: NodeRecord, code: str, target: str, count: int, drained: bool, safety: Safety
) -> Plan:
    """The node was restarted ``safety.max_remediations_7d`` times in 7 days: no further
    restart. A ``hold`` step (journaled, no adapter call) moves it to ``needs-operator`` with
    the fault code ``remediations-7d``, after a drain if it is not drained; once held, later
    ERRORs plan nothing (a FAULT is still replaced)."""
    why = (
        f"node restarted {count} time(s) by node-agent in 7 days (safety.max_remediations_7d="
        f"{safety.max_remediations_7d}), now {code} on {target}"
    )
    if record.state == "needs-operator" and record.fault_code == REMEDIATIONS_CODE:
        return Plan(
            note=f"held for an operator since {_iso(record.since)}: {why}; no restart "
            "until an operator looks at the node and runs `node-agent set-healthy` "
            "and `node-agent act resume`",
            fault_code=record.fault_code,
            target=record.target,
        )
    reason = drain_reason(Level.ERROR, code, target, f"needs-operator {count} remediations in 7 d")
    steps = [] if drained else [Step("drain", reason, "drained", code, target, count)]
    steps.append(Step("hold", reason, "needs-operator", REMEDIATIONS_CODE, "node", count))
    note = (
        f"held for an operator: {why}; a node that keeps needing restarts is not restarted "
        "again: it stays drained until an operator finds the cause, then runs `node-agent "
        "set-healthy` and `node-agent act resume`"
    )
    return Plan(tuple(steps), note=note, fault_code=REMEDIATIONS_CODE, target="node")


def _replace_plan(
    code: str, target: str, drained: bool, level: Level, note: str = "", why: str = ""
) -> Plan:
    reason = drain_reason(level, code, target, note)
    steps = [] if drained else [Step("drain", reason, "fault", code, target)]
    steps.append(Step("replace", reason, "awaiting-replacement", code, target))
    return Plan(
        tuple(steps),
        note=why or f"FAULT {code} on {target}: drain, replace",
        fault_code=code,
        target=target,
    )


def operator_step(action: str, text: str) -> Step:
    """The step for ``node-agent act ACTION --reason TEXT`` (TEXT already sanitised)."""
    to_state = {
        "drain": "drained",
        "resume": "in-service",
        "restart": "restarting",
        "replace": "awaiting-replacement",
    }[action]
    reason = sanitise_reason(f"operator {action}" + (f": {text}" if text else ""))
    return Step(
        action,
        reason,
        to_state,
        fault_code="operator",
        target="node",
        restart_kind="reboot" if action == "restart" else None,
    )


def _iso(epoch: float) -> str:
    import datetime as _dt

    return _dt.datetime.fromtimestamp(epoch, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
