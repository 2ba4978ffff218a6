"""Execute remediation plans: guards, journal, evidence, adapter calls, crash recovery.

Every step is journaled ``planned`` then ``started`` *before* the adapter is called and closed
``done``/``failed``/``refused`` after; the node's remediation state moves in the same
transaction as ``done``. On start, :meth:`Remediator.recover` finds rows a crash left open and
completes each once (re-reading the scheduler first: a drain already in place is marked done
without repeating it).

An adapter that raises (``AdapterError``, or anything else) or a GPU reset that fails is a
``failed`` action with its message, never a crash; the row stays in the journal and the same
step (same idempotency key) is retried by the next run (the daemon retries it with backoff
while the grade stands: ``service/actions.py``). Each attempt is its own journal row with the
same key and a rising ``tries``, and every adapter call carries the same ``key``: SHA-256 over
the journal key and the fault's first sighting in this episode, so a receiver deduplicates the
retries of one fault, and the same fault weeks later (after a repair) is a new action.

Without its own state the remediator does nothing: when the store is unavailable (an I/O
error, a full or read-only disk, a lock, a newer agent's schema: ``Store.unavailable``) or a
read or write fails mid-run (``StateUnavailable``), every step is ``refused`` with
"state unavailable", because opt-out, the breaker and the journal cannot be read or kept.

A ``hold`` step (restarts spent on software causes only, or ``safety.max_remediations_7d``
automatic restarts of the node in 7 days: ``needs-operator``) calls no adapter:
the node is already drained; it is journaled and recorded like any step, and said on stderr.

A ``restart-job`` step (a hung training job) goes through the same journal, dry run, failure
handling and recovery, to ``adapter.restart_job``. Its job id is untrusted text: a step whose
target named no job, or whose job id does not pass ``check_job_id``, is ``refused`` before any
adapter call. Guards: opt-out, dedup (the key holds the job) and a rate limit between job
restarts of different runs apply; the breaker and the blast radius do not (nothing is drained).

A ``replace`` step first takes the driver's bug report (``nvidia-bug-report.sh --safe-mode``,
:class:`~node_agent.remediation.evidence.BugReportCollector`) named with its journal row's id;
the adapter's replace request (the webhook's ``evidence`` key), the journal and the report name
the file, or say why there is none. A dry run says what it would collect.

A planned drain (an announced maintenance, ``remedy: planned``) takes no evidence (nothing is
broken); where its event asks for it (Azure Scheduled Events with the check's ``acknowledge``),
the event is acknowledged once the drain is done (``acknowledge_event``), so the platform may
start it at once.

A test that needs a crash between the journal and the adapter call passes ``after_journal``: a
callable run with each step once it is journaled ``started``, before the adapter is called.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from node_agent.kernel_log import KernelLog
from node_agent.model import (
    ActionOutcome,
    ActionRecord,
    Grade,
    PlannedEvent,
    Refusal,
    Report,
    Target,
    utc_iso,
)
from node_agent.remediation import evidence as _evidence
from node_agent.remediation import guards
from node_agent.remediation.gpu_reset import GpuResetError, GpuResetter
from node_agent.remediation.plan import (
    DISRUPTIVE,
    EVIDENCE_ACTIONS,
    JOB_RULES,
    REMEDIATION_ACTIONS,
    REMEDIATIONS_CODE,
    Plan,
    Safety,
    Step,
    counted_with,
    fault_code,
    operator_step,
    plan,
    remediation_window_start,
)
from node_agent.remediation.plan import restart_window_start as _window_start
from node_agent.remediation.states import JournalState, NodeState, RestartKind, StepAction, Trigger
from node_agent.remediation.store import (
    OPEN_STATES,
    JournalRow,
    NodeRecord,
    StateUnavailable,
    Store,
)
from node_agent.report.terminal import printable
from node_agent.schedulers.base import (
    AdapterError,
    AdapterOutcome,
    AdapterStatus,
    SchedulerAdapter,
    check_job_id,
)

#: the restart each restarting step action is (the node record keeps it while restarting)
_RESTART_KIND_OF: dict[StepAction, RestartKind] = {
    StepAction.RESTART: RestartKind.REBOOT,
    StepAction.GPU_RESET: RestartKind.GPU_RESET,
}
MAX_REPLANS = 4  # drain -> GPU reset -> re-test -> reboot: a run never loops further


@dataclass
class Outcome:
    records: list[ActionRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def worst(self) -> ActionOutcome | None:
        """``failed`` if any step failed, else ``refused`` if any was refused, else None."""
        outcomes = {r.outcome for r in self.records}
        for o in (ActionOutcome.FAILED, ActionOutcome.REFUSED):
            if o in outcomes:
                return o
        return None

    @property
    def wants_retry(self) -> bool:
        """A step failed, or was refused only because the agent's own state was unavailable."""
        return any(r.retryable for r in self.records)


def _stderr(message: str) -> None:
    # the message can quote a scheduler's or a webhook's answer: escaped like stdout's
    print(f"node-agent: {printable(message)}", file=sys.stderr)


class Remediator:
    """Acts for one node through one adapter. Everything it depends on is a parameter."""

    def __init__(
        self,
        store: Store,
        adapter: SchedulerAdapter,
        node: str,
        safety: Safety,
        *,
        state_dir: Path | None,
        dry_run: bool = False,
        clock: Callable[[], float] = time.time,
        boot_time: float = 0.0,
        gpu_resetter: GpuResetter | None = None,
        retest: Callable[[], Grade] | None = None,
        kernel_log: KernelLog | None = None,
        gpu_pids: Callable[[], tuple[list[int], str | None]] | None = None,
        warn: Callable[[str], None] = _stderr,
        after_journal: Callable[[Step], None] | None = None,
        bug_report: _evidence.BugReportCollector | None = None,
        acknowledge_event: Callable[[PlannedEvent], str] | None = None,
    ) -> None:
        self.store, self.adapter, self.node, self.safety = store, adapter, node, safety
        self.state_dir, self.dry_run, self.clock = state_dir, dry_run, clock
        self.boot_time, self.gpu_resetter, self.retest = boot_time, gpu_resetter, retest
        self.kernel_log, self.gpu_pids, self.warn = kernel_log, gpu_pids, warn
        #: called with each step once it is journaled "started", before the adapter acts
        self.after_journal = after_journal
        #: the driver's bug report before a replace request (None: not taken in this command)
        self.bug_report = bug_report
        #: acknowledges an announced maintenance after its drain (default: the cloud's own API)
        self.acknowledge_event = acknowledge_event or _acknowledge_event
        self._evidence_taken = False
        self._report: Report | None = None
        self._run_started = float("-inf")  # job restarts since then are this run's own

    # -- entry points --------------------------------------------------------------------------
    def remediate(self, report: Report, record_run: bool = True) -> Outcome:
        """Automatic remediation of a graded report (``accept``/``check --act``, the daemon).
        ``record_run``: False when the daemon retries the same grade (recorded once)."""
        if self.store.unavailable is not None:
            return self._refuse_all(report.grade, self.store.unavailable)
        out = self.recover()
        self._report = report
        self._run_started = self.clock()
        try:
            if record_run:
                self.store.record_run(
                    self.node,
                    self.clock(),
                    report.suite,
                    report.mode,
                    report.grade.level.name,
                    [r.to_dict() for r in report.grade.reasons],
                )
            grade, gpu_reset_tried = report.grade, False
            for _ in range(MAX_REPLANS):
                p = self._plan(grade, gpu_reset_tried)
                out.notes.append(p.note)
                if not p.steps:
                    break
                retest_grade, reset_failed = self._run_plan(p, out)
                if retest_grade is not None:
                    grade, gpu_reset_tried = retest_grade, True
                    self.store.record_run(
                        self.node,
                        self.clock(),
                        "quick",
                        "service",
                        grade.level.name,
                        [r.to_dict() for r in grade.reasons],
                    )
                elif reset_failed:
                    gpu_reset_tried = True
                else:
                    break
        except StateUnavailable as err:
            refused = self._refuse_all(report.grade, str(err))
            out.records.extend(refused.records)
            out.notes.extend(refused.notes)
        return out

    def _refuse_all(self, grade: Grade, why: str) -> Outcome:
        """Nothing is done without the agent's own state: what the grade would have asked for
        is recorded as refused (in the report and on stderr; the journal cannot take it)."""
        out = Outcome()
        try:
            record = self.store.node_record(self.node)
        except StateUnavailable:
            record = NodeRecord(node=self.node)
        p = plan(
            grade,
            record,
            self.safety,
            now=self.clock(),
            boot_time=self.boot_time,
            restart_counts={},
            gpu_reset_available=self.gpu_resetter is not None,
        )
        out.notes.append(f"state unavailable: {p.note}")
        for step in p.steps:
            if step.action is StepAction.RETEST:
                continue
            detail = (
                f"state unavailable ({why}): opt-out, breaker and journal cannot be read "
                f"or kept, so node-agent does not {step.action} {self.node} "
                f"({step.reason}); fix the state directory, or act by hand with the "
                "scheduler's own tools"
            )
            self.warn(f"{step.action} REFUSED: {detail}")
            out.records.append(self._refused(step.action, Refusal.STATE_UNAVAILABLE, detail))
        return out

    def act(self, action: str, text: str) -> Outcome:
        """An operator's ``node-agent act ACTION --reason TEXT`` (``text`` already sanitised).

        Operator actions skip the automatic guards (breaker, blast radius, rate limit, opt-out,
        dedup: the operator decided) but never override or resume someone else's drain. They
        too need the journal: without it (state unavailable) they are refused, and the
        operator uses the scheduler's own tools.
        """
        step = operator_step(action, text)
        if self.store.unavailable is not None:
            out = Outcome()
            self._unavailable(step, self.store.unavailable, out)
            return out
        out = self.recover()
        self._step(step, Trigger.OPERATOR, out)
        return out

    def recover(self) -> Outcome:
        """Complete, once, the journal rows a crash left ``planned`` or ``started``."""
        out = Outcome()
        if self.store.unavailable is not None:
            return out
        try:
            for row in self.store.open_journal(self.node):
                self._recover_row(row, out)
        except StateUnavailable as err:
            out.notes.append(f"crash recovery not done: {err}")
        return out

    def _unavailable(self, step: Step, why: str, out: Outcome) -> None:
        detail = (
            f"state unavailable ({why}): node-agent does not {step.action} {self.node} "
            "without its journal, opt-out and breaker; fix the state directory, or act "
            "by hand with the scheduler's own tools"
        )
        self.warn(f"{step.action} REFUSED: {detail}")
        out.records.append(self._refused(step.action, Refusal.STATE_UNAVAILABLE, detail))

    # -- planning ------------------------------------------------------------------------------
    def _plan(self, grade: Grade, gpu_reset_tried: bool) -> Plan:
        now = self.clock()
        record = self.store.node_record(self.node)
        since = _window_start(record, self.safety, now)
        # job restarts are not node restarts: they never count towards the node's escalation
        counts = {
            code: self.store.count_done(self.node, REMEDIATION_ACTIONS, since, fault_code=code)
            for r in grade.reasons
            if r.rule not in JOB_RULES
            for code in counted_with(fault_code(r))
        }
        # the node's own automatic restarts, any code: a node that keeps needing them is held
        remediations = self.store.count_done(
            self.node,
            REMEDIATION_ACTIONS,
            remediation_window_start(record, now),
            trigger=Trigger.AUTO,
        )
        return plan(
            grade,
            record,
            self.safety,
            now=now,
            boot_time=self.boot_time,
            restart_counts=counts,
            gpu_reset_available=self.gpu_resetter is not None,
            gpu_reset_tried=gpu_reset_tried,
            remediations_7d=remediations,
        )

    def _run_plan(self, p: Plan, out: Outcome) -> tuple[Grade | None, bool]:
        """Run the steps in order; stop at the first one not done. Returns (re-test grade,
        whether a GPU reset failed)."""
        for step in p.steps:
            if step.action is StepAction.RETEST:
                return self._retest(step, out), False
            if not self._step(step, Trigger.AUTO, out):
                return None, (
                    step.action is StepAction.GPU_RESET
                    and out.records[-1].outcome is ActionOutcome.FAILED
                )
        return None, False

    def _retest(self, step: Step, out: Outcome) -> Grade | None:
        if self.dry_run or self.retest is None:
            detail = "would re-test with the quick suite ({})"
            if self.dry_run:
                record = self._record(
                    StepAction.RETEST, ActionOutcome.DRY_RUN, detail.format("dry run")
                )
            else:
                record = self._refused(
                    StepAction.RETEST,
                    Refusal.NOT_AVAILABLE,
                    detail.format("no re-test available in this command"),
                )
            out.records.append(record)
            return None
        grade = self.retest()
        detail = f"quick suite after {step.restart_kind or 'restart'} graded {grade.level.name}" + (
            f": {grade.reasons[0].rule} {grade.reasons[0].target}" if grade.reasons else ""
        )
        now = self.clock()
        self._journal(
            step,
            step.key(self.node),
            Trigger.AUTO,
            now,
            side_action=StepAction.RETEST,
            state=ActionOutcome.DONE,
            detail=detail,
        )
        out.records.append(self._record(StepAction.RETEST, ActionOutcome.DONE, detail))
        return grade

    # -- one step ------------------------------------------------------------------------------
    def _step(self, step: Step, trigger: Trigger, out: Outcome) -> bool:
        """Guard, journal, act, close. True when the plan may go on to its next step."""
        try:
            return self._guarded_step(step, trigger, out)
        except StateUnavailable as err:
            self._unavailable(step, str(err), out)
            return False

    def _guarded_step(self, step: Step, trigger: Trigger, out: Outcome) -> bool:
        now = self.clock()
        auto = trigger is Trigger.AUTO
        key = step.key(self.node) if auto else f"{step.key(self.node)}|{now:.6f}"
        retry: JournalRow | None = None
        if auto:
            guarded = self._guard(step, now)
            if guarded is not None:
                why, kind = guarded
                self._close_new(step, key, trigger, ActionOutcome.REFUSED, why, now, out, kind)
                return False
            decided, retry = self._seen_before(step, key, now, out)
            if decided is not None:
                return decided
        if self.dry_run:
            detail = f"dry run: would {step.action} {self.node} ({step.reason})"
            if step.action is StepAction.REPLACE:
                detail += f"; would first collect {self._bug_report_plan()}"
            self._close_new(step, key, trigger, ActionOutcome.DRY_RUN, detail, now, out)
            return True
        # evidence once per fault: the first attempt took it, a retry does not copy it again;
        # a planned drain has nothing broken to show
        evidence_note = (
            self._take_evidence(step.action, now)
            if retry is None and step.planned is None
            else None
        )
        row = self._journal(
            step,
            key,
            trigger,
            now,
            tries=retry.tries if retry is not None else 0,
            detail=(
                f"retry {retry.tries + 1} of a failed {step.action} (journal #{retry.id}: "
                f"{retry.detail[:200]})"
                if retry is not None
                else ""
            ),
        )
        if self.after_journal is not None:
            self.after_journal(step)
        row = self.store.journal_update(
            row.id, JournalState.STARTED, row.detail, now, count_try=True
        )
        result = self._act(step, row)
        detail = result.detail
        if evidence_note and result.status is not AdapterStatus.FAILED:
            detail = f"{detail}; {evidence_note}"
        if retry is not None:
            detail = f"retry {row.tries} of {step.action} (after journal #{retry.id}): {detail}"
        try:
            record = self._finish(row, AdapterOutcome(result.status, detail), out)
        except StateUnavailable as err:
            # the adapter acted; only its record failed: say so (the row stays "started",
            # and the next run with a working state re-reads the scheduler and closes it)
            outcome, refusal = _OUTCOME_OF[result.status]
            out.records.append(
                self._record(
                    StepAction(row.action),
                    outcome,
                    f"{detail}; not recorded in the journal: {err}",
                    refusal,
                )
            )
            return False
        return record.outcome is ActionOutcome.DONE

    def _seen_before(
        self, step: Step, key: str, now: float, out: Outcome
    ) -> tuple[bool | None, JournalRow | None]:
        """The journal's earlier row of this step's key: (True: done in this episode, dedup;
        False: in progress elsewhere; None: go on) and the failed row this attempt retries."""
        existing = self.store.journal_by_key(key)
        if existing is None:
            return None, None
        # a return to service since that row (resume, set-healthy) starts a new episode, in
        # which the same fault acts again
        episode_start = max(
            self.store.node_record(self.node).cleared_at or 0.0,
            self.store.last_done_at(self.node, ("resume",)) or 0.0,
        )
        if (
            existing.state is JournalState.DONE
            and existing.updated_at > episode_start
            and now - existing.updated_at < self.safety.dedup_window_s
        ):
            out.notes.append(
                f"dedup: {step.action} for {step.fault_code} "
                f"{step.target} already done (journal #{existing.id} at "
                f"{utc_iso(existing.updated_at)}, safety.dedup_window_s="
                f"{self.safety.dedup_window_s:g}); not repeated"
            )
            return True, None
        if existing.state in OPEN_STATES:
            out.notes.append(
                f"{step.action} is in progress elsewhere (journal #{existing.id}); not started twice"
            )
            return False, None
        return None, existing if existing.state is JournalState.FAILED else None

    def _act(self, step: Step, row: JournalRow) -> AdapterOutcome:
        """Perform a started row with what goes with its step: the driver's bug report before
        a replace request (named in it), the acknowledgement of a planned drain's event."""
        bug = self._take_bug_report(row) if step.action is StepAction.REPLACE else None
        result = self._perform(row, evidence=str(bug.path) if bug and bug.path else None)
        detail = result.detail
        if bug is not None:
            detail = f"{detail}; {bug.note}"
        done = result.status in (AdapterStatus.DONE, AdapterStatus.ALREADY)
        if done and step.planned is not None and step.planned.acknowledge:
            detail = f"{detail}; {self._acknowledge(step.planned)}"
        return AdapterOutcome(result.status, detail)

    def _guard(self, step: Step, now: float) -> tuple[str, Refusal] | None:
        """The refusal of the first guard that refuses ``step``, and its kind: only a rate
        limit is retried (by the daemon, while the grade stands) once the interval has passed."""
        refused = self._refused_by(step, now)
        if not refused:
            return None
        return refused if isinstance(refused, tuple) else (refused, Refusal.GUARD)

    def _refused_by(self, step: Step, now: float) -> str | tuple[str, Refusal] | None:
        refusal = guards.opt_out(self.safety.opt_out, self.store.opted_out(self.node), self.node)
        if refusal:
            return refusal
        if step.action is StepAction.RESTART_JOB:
            return self._job_guard(step, now)
        br = self.store.breaker()
        drains = 0
        if step.action is StepAction.DRAIN and not br.open:
            since = max(now - self.safety.breaker_window_h * 3600.0, br.reset_at or 0.0)
            drains = self.store.count_done(None, (StepAction.DRAIN,), since, trigger=Trigger.AUTO)
        refusal, trip = guards.breaker(
            br, drains, self.safety.breaker_max_drains, self.safety.breaker_window_h
        )
        if trip and refusal:
            self.store.open_breaker(now, refusal)
        if refusal:
            return refusal
        if step.action is not StepAction.DRAIN:
            return None
        if self.store.node_record(self.node).state is NodeState.IN_SERVICE:
            refusal = guards.rate_limit(
                self.store.last_done_at(self.node, (*DISRUPTIVE, "resume")),
                now,
                self.safety.min_action_interval_s,
            )
            if refusal:
                return refusal, Refusal.RATE_LIMIT
        try:
            known = self.adapter.node_state(self.node).known
            nodes = self.adapter.list_nodes() if known else None
        except Exception as err:  # noqa: BLE001 - any adapter failure refuses, never crashes
            return (
                f"blast radius: cannot read the drained share from the {self.adapter.name} "
                f"adapter ({type(err).__name__}: {err}); not draining blind"
            )
        return guards.blast_radius(nodes, self.node, self.safety.max_drained_fraction)

    def _job_guard(self, step: Step, now: float) -> str | None:
        """A job restart: the job id must be one the agent accepts, and a rate limit between
        job restarts of different runs (a detector that flaps, or heartbeat files naming many
        jobs, cannot requeue jobs faster than one batch per ``safety.min_action_interval_s``).
        The breaker and the blast radius guard drains; a job restart drains nothing."""
        if step.job is None:
            return (
                f"{step.fault_code} finding on target {step.target!r} names no job "
                "(expected job:<job>/rank:<n> or job:<job>/pid:<n>); no job restarted, "
                "the node is not drained"
            )
        try:
            check_job_id(step.job)
        except AdapterError as err:
            return f"{err}; no job restarted, the node is not drained"
        same = self.store.journal_by_key(step.key(self.node))
        if (
            same is not None
            and same.state is JournalState.DONE
            and now - same.updated_at < self.safety.dedup_window_s
        ):
            return None  # this very job again: dedup says so, quietly (not a refusal)
        last = self.store.last_done_at(self.node, ("restart-job",))
        if (
            last is not None
            and last < self._run_started
            and now - last < self.safety.min_action_interval_s
        ):
            return (
                f"rate limit: a job on this node was restarted {now - last:.0f} s ago, less "
                f"than safety.min_action_interval_s={self.safety.min_action_interval_s:g}; "
                "the next run restarts this job if it still hangs"
            )
        return None

    def action_key(self, row: JournalRow) -> str:
        """The idempotency key every adapter call of this step carries: SHA-256 over the
        journal key and when this fault was first journaled in the node's current episode
        (since the last set-healthy or resume), so retries share it and a recurrence after a
        repair does not."""
        record = self.store.node_record(self.node)
        episode = max(
            record.cleared_at or 0.0, self.store.last_done_at(self.node, ("resume",)) or 0.0
        )
        first = self.store.first_seen(row.key, episode)
        first = row.created_at if first is None else min(first, row.created_at)
        return hashlib.sha256(f"{row.key}|{first:.6f}".encode()).hexdigest()

    def _perform(self, row: JournalRow, evidence: str | None = None) -> AdapterOutcome:
        """Call the adapter (or the GPU resetter) for one started row. ``evidence``: the driver
        bug report a replace request names. An AdapterError, a failed reset or an adapter bug
        is ``failed`` (the executor's own state failing is raised: StateUnavailable)."""
        action = StepAction(row.action)
        try:
            if action in (StepAction.DRAIN, StepAction.RESUME, StepAction.REPLACE):
                settled = self._settled(action)
                if settled is not None:
                    return settled
            if action is StepAction.GPU_RESET:
                return self._gpu_reset(row)
            if action is StepAction.HOLD:  # bookkeeping: the node is already drained
                return AdapterOutcome.done(self._hold_detail(row))
            return _checked_outcome(self.adapter.name, self._call_adapter(action, row, evidence))
        except StateUnavailable:
            raise
        except (AdapterError, GpuResetError) as err:
            return AdapterOutcome.failed(str(err))
        except Exception as err:  # noqa: BLE001 - an adapter bug is a failed action, not a crash
            return AdapterOutcome.failed(
                f"{self.adapter.name} adapter raised {type(err).__name__}: {err}"
            )

    def _settled(self, action: StepAction) -> AdapterOutcome | None:
        """What the scheduler already says before a drain, resume or replace: someone else's
        drain (refused), a drain already in place or a node already in service (already)."""
        state = self.adapter.node_state(self.node)
        if not state.known:  # nothing to decide from: the action is sent (the journal dedups)
            return None
        refusal = guards.foreign_drain(state)
        if refusal:
            return AdapterOutcome.refused(refusal)
        if action is StepAction.DRAIN and state.drained:
            return AdapterOutcome.already(
                f"already drained by node-agent ({state.reason}); not repeated"
            )
        if action is StepAction.RESUME and not state.drained:
            return AdapterOutcome.already(
                f"{self.adapter.name}: {self.node} is not drained ({state.state}); "
                "nothing to resume"
            )
        return None

    def _gpu_reset(self, row: JournalRow) -> AdapterOutcome:
        if self.gpu_resetter is None:
            return AdapterOutcome.failed(
                "no GPU reset available in this command; the next run re-plans"
            )
        index = Target.parse(row.target or "").gpu_index
        if index is None:
            return AdapterOutcome.failed(f"a GPU reset needs a GPU target, found {row.target!r}")
        return AdapterOutcome.done(self.gpu_resetter.reset(index))

    def _hold_detail(self, row: JournalRow) -> str:
        if row.fault_code == REMEDIATIONS_CODE:
            return (
                f"held for an operator: node-agent restarted {self.node} {row.attempt} "
                "time(s) in 7 days (safety.max_remediations_7d="
                f"{self.safety.max_remediations_7d}) and it needs another: a node that keeps "
                "needing restarts is not restarted again; it stays drained, with no further "
                "restart (a FAULT is still replaced). Find the cause (`node-agent status` "
                "lists the restarts per fault code), then run `node-agent set-healthy` and "
                "`node-agent act resume`"
            )
        return (
            f"needs an operator: {row.fault_code} on {row.target} is still there after "
            f"{row.attempt} restart(s) and every ERROR is one that new hardware is not known "
            "to fix (a software cause, remedy software in graders/rules.yaml, or an error a "
            "user's code can make the driver report, an Xid of class application in "
            "graders/xid.yaml, or a record a restart does not clear, remedy record: the BMC's "
            "event log, pstore); the node stays drained, with no further restart or "
            "replacement. Fix the cause (e.g. rebuild or reinstall the driver for the running "
            "kernel; for an application Xid, run the GPU's field diagnostics; for a record, "
            "check the part it names and clear it: `ipmitool sel clear`, the pstore dumps), "
            "then run "
            "`node-agent set-healthy` and `node-agent act resume`"
        )

    def _call_adapter(
        self, action: StepAction, row: JournalRow, evidence: str | None
    ) -> AdapterOutcome:
        """The adapter call of a drain, resume, restart, replace or job restart, with the
        step's idempotency key."""
        key = self.action_key(row)
        if action is StepAction.RESTART_JOB:
            job = (row.target or "").removeprefix("job:")
            return self.adapter.restart_job(self.node, job, row.reason, key=key)
        if action is StepAction.REPLACE:
            return self.adapter.replace(self.node, row.reason, key=key, evidence=evidence)
        call = {
            StepAction.DRAIN: self.adapter.drain,
            StepAction.RESUME: self.adapter.resume,
            StepAction.RESTART: self.adapter.restart,
        }[action]
        return call(self.node, row.reason, key=key)

    def _finish(self, row: JournalRow, result: AdapterOutcome, out: Outcome) -> ActionRecord:
        """Close a started row with the adapter's outcome; the node's state moves with it."""
        outcome, refusal = _OUTCOME_OF[result.status]
        detail = result.detail
        now = self.clock()
        record = self._next_record(row, now) if outcome is ActionOutcome.DONE else None
        self.store.journal_finish(row.id, outcome, detail, now, record)
        if outcome is ActionOutcome.DONE and row.action == StepAction.HOLD:
            self.warn(f"{self.node} NEEDS AN OPERATOR: {detail}")
        if outcome in (ActionOutcome.FAILED, ActionOutcome.REFUSED):
            self.warn(
                f"{row.action} {str(outcome).upper()}: {detail}"
                + (
                    " (kept in the journal; the next run retries it)"
                    if outcome is ActionOutcome.FAILED
                    else ""
                )
            )
        action_record = self._record(StepAction(row.action), outcome, detail, refusal)
        out.records.append(action_record)
        return action_record

    def _journal(
        self,
        step: Step,
        key: str,
        trigger: Trigger,
        now: float,
        *,
        side_action: str | None = None,
        state: JournalState | ActionOutcome = JournalState.PLANNED,
        detail: str = "",
        tries: int = 0,
    ) -> JournalRow:
        """A journal row for ``step`` on this node through this adapter. ``side_action``: an
        action taken for the step that is not the step itself (the retest after a restart); it
        moves the node to no state."""
        return self.store.journal_plan(
            key=key,
            node=self.node,
            action=side_action or step.action,
            reason=step.reason,
            fault_code=step.fault_code,
            target=step.target,
            attempt=step.attempt,
            to_state=None if side_action else step.to_state,
            trigger=trigger,
            adapter=self.adapter.name,
            now=now,
            state=state,
            detail=detail,
            tries=tries,
        )

    def _close_new(
        self,
        step: Step,
        key: str,
        trigger: Trigger,
        outcome: ActionOutcome,
        detail: str,
        now: float,
        out: Outcome,
        refusal: Refusal | None = None,
    ) -> None:
        self._journal(step, key, trigger, now, state=outcome, detail=detail)
        if outcome is ActionOutcome.REFUSED:
            self.warn(f"{step.action} REFUSED: {detail}")
        out.records.append(self._record(step.action, outcome, detail, refusal))

    def _next_record(self, row: JournalRow, now: float) -> NodeRecord | None:
        if row.to_state is None:
            return None
        old = self.store.node_record(self.node)
        state = NodeState(row.to_state)
        record = NodeRecord(
            node=self.node, state=state, since=now, cleared_at=old.cleared_at, detail=row.reason
        )
        if state is NodeState.IN_SERVICE:
            return record  # back in service: the episode's fault, target and restart are gone
        restart_kind = _RESTART_KIND_OF.get(StepAction(row.action))
        return dataclasses.replace(
            record,
            fault_code=row.fault_code,
            target=row.target,
            trigger=row.trigger,
            restart_kind=restart_kind or old.restart_kind,
            requested_at=now if restart_kind else old.requested_at,
        )

    def _record(
        self,
        action: StepAction,
        outcome: ActionOutcome,
        detail: str,
        refusal: Refusal | None = None,
    ) -> ActionRecord:
        return ActionRecord(
            action=action,
            adapter=self.adapter.name,
            outcome=outcome,
            detail=detail,
            at=utc_iso(self.clock()),
            refusal=refusal,
        )

    def _refused(self, action: StepAction, refusal: Refusal, detail: str) -> ActionRecord:
        return self._record(action, ActionOutcome.REFUSED, detail, refusal)

    # -- recovery, evidence --------------------------------------------------------
    def _recover_row(self, row: JournalRow, out: Outcome) -> None:
        now = self.clock()
        self.warn(
            f"completing journal #{row.id} ({row.action} {row.fault_code} {row.target}) "
            f"left {row.state} at {utc_iso(row.updated_at)} by an interrupted run"
        )
        action = StepAction(row.action)
        if action in (StepAction.RETEST, StepAction.GPU_RESET):
            detail = (
                f"interrupted {row.action} is not replayed (the GPU state is unknown); "
                "the next graded run re-plans"
            )
            self.store.journal_finish(row.id, ActionOutcome.FAILED, detail, now)
            out.records.append(
                self._record(action, ActionOutcome.FAILED, f"recovered #{row.id}: {detail}")
            )
            return
        row = self.store.journal_update(
            row.id, JournalState.STARTED, row.detail, now, count_try=True
        )
        result = self._perform(row)
        self._finish(
            row, AdapterOutcome(result.status, f"recovered journal #{row.id}: {result.detail}"), out
        )

    def _take_evidence(self, action: str, now: float) -> str | None:
        if action not in EVIDENCE_ACTIONS or self._evidence_taken or self.state_dir is None:
            return None
        self._evidence_taken = True
        # one deadline for all of it, GPU pids included: the action does not wait past it
        deadline = time.monotonic() + _evidence.EVIDENCE_DEADLINE_S
        if self.gpu_pids is not None:
            pids, pids_note = self.gpu_pids()
        else:
            pids, pids_note = [], "GPU process ids are not known in this run"
        directory, notes = _evidence.collect(
            self.state_dir,
            action,
            now,
            self._report,
            self.kernel_log,
            pids,
            pids_note,
            deadline=deadline,
        )
        if directory is None:
            self.warn(f"evidence not collected: {'; '.join(notes)}")
            return f"evidence not collected ({notes[0]})"
        return f"evidence in {directory}"

    def _bug_report_plan(self) -> str:
        if self.bug_report is None:
            return "no driver bug report (not taken in this command)"
        return self.bug_report.describe(self.state_dir)

    def _take_bug_report(self, row: JournalRow) -> _evidence.BugReport:
        """The driver's bug report for this replace request, named with its journal row id."""
        if self.bug_report is None:
            return _evidence.BugReport(None, "no driver bug report (not taken in this command)")
        if self.state_dir is None:
            return _evidence.BugReport(None, "no driver bug report (no state directory)")
        report = self.bug_report.collect(self.state_dir, row.id)
        if report.path is None:
            self.warn(report.note)
        return report

    def _acknowledge(self, event: PlannedEvent) -> str:
        """Acknowledge the announced maintenance after its drain, which may start it at once:
        only where the scheduler says the node is drained (a log or webhook drain says nothing
        of it). Otherwise, or when it fails, a note: the event then starts at its announced
        time, as it would have anyway."""
        try:
            state = self.adapter.node_state(self.node)
            if not (state.known and state.drained):
                why = (
                    f"the {self.adapter.name} adapter cannot tell that {self.node} is drained"
                    if not state.known
                    else f"the scheduler says {self.node} is {state.state}, not drained"
                )
                return (
                    f"{event.provider} event {event.event_id} not acknowledged: {why}; it "
                    "starts at its own time, or acknowledge it once the node is drained"
                )
            return self.acknowledge_event(event)
        except Exception as err:  # noqa: BLE001 - the drain is done; the ack is a courtesy
            note = f"{event.provider} event {event.event_id} not acknowledged: {err}"
            self.warn(note)
            return note


#: the step's outcome (and why it was refused) for each adapter status: a node already in the
#: state asked for is a step done; an adapter refuses only someone else's drain
_OUTCOME_OF: dict[AdapterStatus, tuple[ActionOutcome, Refusal | None]] = {
    AdapterStatus.DONE: (ActionOutcome.DONE, None),
    AdapterStatus.ALREADY: (ActionOutcome.DONE, None),
    AdapterStatus.REFUSED: (ActionOutcome.REFUSED, Refusal.FOREIGN_DRAIN),
    AdapterStatus.FAILED: (ActionOutcome.FAILED, None),
}


def _checked_outcome(adapter: str, result: object) -> AdapterOutcome:
    """An adapter's answer, which must be an AdapterOutcome (an adapter written for an older
    agent returned a bare detail line: it is a failed action, with what to change)."""
    if isinstance(result, AdapterOutcome):
        return result
    return AdapterOutcome.failed(
        f"the {adapter} adapter returned {type(result).__name__}, not an AdapterOutcome "
        "(node_agent.schedulers.base); update the adapter: nothing is assumed done"
    )


def _acknowledge_event(event: PlannedEvent) -> str:
    """The cloud's own acknowledgement of an announced maintenance (Azure Scheduled Events'
    ``StartRequests`` on the link-local address)."""
    from node_agent.host import cloud_metadata

    if event.provider != "azure" or event.event_id is None:
        return f"{event.provider} events take no acknowledgement"
    return cloud_metadata.acknowledge(event.event_id)
