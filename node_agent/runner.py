"""Run a suite: each check isolated and time-bounded; a check that hangs or crashes becomes an
``error`` result and the run goes on.

Checks run on a daemon thread the runner waits on until the check's deadline: its start plus the
spec's ``timeout_s``, set here and only here and handed to the check (``CheckContext.deadline``).
A driver call can hang for good; the thread is then abandoned (it cannot be killed) and the
result says so. Subprocesses started by checks carry their own timeouts (``node_agent.proc``),
within that deadline (``ctx.remaining_s()``); a check that must report a stage that did not
return, rather than be abandoned, bounds it with :mod:`node_agent.checking.deadline`.

A check hands a value to a later check only as a declared output (``OUTPUTS`` in the producer,
``INPUTS`` in the consumer: :mod:`node_agent.checking.behaviour`); the runner keeps one
:class:`~node_agent.checking.behaviour.Handover` per suite run and gives each check only the
inputs it declares.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from node_agent import proc
from node_agent.checking.behaviour import Handover
from node_agent.checking.registry import resolve
from node_agent.environment import Environment
from node_agent.model import Result, Status
from node_agent.suite import STAND_IN_OVERLAY, CheckSpec, Suite

#: checks whose workers come from multiprocessing's forkserver (compute/burn.py, pcie_bandwidth)
FORKSERVER_CHECKS = frozenset({"gpu_burn", "thermal_power", "pcie_bandwidth"})


#: progress(event, spec, index, total, results) — event is "start" or "done"
Progress = Callable[[str, CheckSpec, int, int, list[Result]], None]


@dataclass
class _Outcome:
    results: list[Result] | None = None
    error: BaseException | None = None
    trace: str = ""


def run_check(
    spec: CheckSpec, env: Environment, mode: str, handover: Handover | None = None
) -> list[Result]:
    """Run one check until its deadline (now plus its timeout); always returns at least one
    result.

    ``handover`` carries the suite run's declared outputs from earlier checks to this one's
    declared inputs, and takes this one's outputs when it finished in time."""
    given = handover.inputs_for(spec.check) if handover is not None else {}
    stand_in = env.node.param_overlay == STAND_IN_OVERLAY
    start = time.monotonic()
    ctx = env.check_context(
        spec.check,
        mode,
        spec.params_for(stand_in),
        typed=spec.typed_for(stand_in),
        state_dir=env.writable_state_dir(),
        timeout_s=spec.timeout_s,
        deadline=start + spec.timeout_s,
        handover=given,
    )
    outcome = _Outcome()

    def target() -> None:
        try:
            outcome.results = list(resolve(spec.check)(ctx))
        except BaseException as err:  # noqa: BLE001 - a check must never take the run down
            outcome.error = err
            outcome.trace = traceback.format_exc(limit=6)

    thread = threading.Thread(target=target, name=f"check-{spec.check}", daemon=True)
    thread.start()
    thread.join(max(0.0, ctx.deadline - time.monotonic()))
    duration = time.monotonic() - start
    if thread.is_alive():
        return [
            ctx.result(
                "node",
                "timeout",
                Status.ERROR,
                f"check {spec.check} did not finish within {spec.timeout_s:g} s "
                "and was abandoned (a hung driver call or tool)",
                timeout_s=spec.timeout_s,
            )
        ]
    if outcome.error is not None:
        err = outcome.error
        return [
            ctx.result(
                "node",
                "crashed",
                Status.ERROR,
                f"check {spec.check} crashed: {type(err).__name__}: {err}",
                traceback=outcome.trace,
            )
        ]
    results = outcome.results or []
    if not results:
        return [
            ctx.result(
                "node",
                "ran",
                Status.ERROR,
                f"check {spec.check} returned no results (a check must report "
                "something: pass, skip with its reason, or a finding)",
            )
        ]
    for result in results:  # a result without its own timing carries its check's
        result.duration_s = result.duration_s or duration
    if handover is not None:
        handover.collect(spec.check, given)
    return results


def run_suite(suite: Suite, env: Environment, progress: Progress | None = None) -> list[Result]:
    """Run the suite's checks in order; returns every result."""
    all_results: list[Result] = []
    handover = Handover()
    total = len(suite.checks)
    if any(spec.check in FORKSERVER_CHECKS for spec in suite.checks):
        # before any check thread runs: the forkserver must not start in the caller's working
        # directory, which others may write to (proc.start_forkserver_in_child_cwd)
        proc.start_forkserver_in_child_cwd()
    for i, spec in enumerate(suite.checks, start=1):
        if progress:
            progress("start", spec, i, total, [])
        results = run_check(spec, env, suite.mode, handover)
        all_results.extend(results)
        if progress:
            progress("done", spec, i, total, results)
    return all_results
