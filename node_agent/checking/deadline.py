"""A check's deadline, the runner's: the monotonic time by which the check must have returned
(``CheckContext.deadline``, set by :func:`node_agent.runner.run_check` from the spec's
``timeout_s``). A check the runner abandons there is an ``error`` result (``check-hang``).

A check whose stages wait on what it does not control, and that must say so itself rather than
be abandoned, ends each such stage by :meth:`~node_agent.checking.context.CheckContext.stage_end`
(the deadline less :func:`return_margin_s`) and runs the ones that can block for good (a read of
``/proc`` of a process stuck in the kernel) through :func:`call_before`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def return_margin_s(timeout_s: float) -> float:
    """How long before its deadline a check's stages end, so that it can still report and
    return: a tenth of ``timeout_s``, at least 2 s and at most half of it."""
    return min(0.5 * timeout_s, max(2.0, 0.1 * timeout_s))


class Overdue(Exception):
    """A stage that had not returned by the time it was given; its thread is left behind (a
    thread cannot be killed), and what it returns later goes nowhere."""

    def __init__(self, stage: str, until: float) -> None:
        super().__init__(f"{stage} did not return by its deadline")
        self.stage = stage
        self.until = until


def call_before(until: float, stage: str, fn: Callable[[], T]) -> T:
    """``fn()``, run on a daemon thread and waited on until the monotonic time ``until``.

    Its exception is raised here; :class:`Overdue` naming ``stage`` when it has not returned by
    then."""
    box: dict[str, T] = {}
    failure: list[BaseException] = []

    def work() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - raised again on the caller's thread
            failure.append(err)

    thread = threading.Thread(target=work, name=f"stage: {stage}"[:64], daemon=True)
    thread.start()
    thread.join(max(0.0, until - time.monotonic()))
    if thread.is_alive():
        raise Overdue(stage, until)
    if failure:
        raise failure[0]
    return box["value"]
