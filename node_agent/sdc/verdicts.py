"""Verdicts of probe runs, and when a mismatch is believed.

**Confirmation.** A mismatch is re-run at once. It is ``confirmed`` (grade FAULT) when the
re-run mismatches too (not necessarily in the same element: an intermittent SM corrupts a
different tile each time), or when *another* probe run on the same device mismatched within the
confirmation window: the rest of the same round, for the check the whole run on that GPU. Exact
probes have no false positives on healthy hardware, so two independent mismatches in minutes are
not a coincidence; requiring the identical element, or a clean-free re-run, would let an SM that
fails 30 % of the time through more often than not. A mismatch alone in its window (re-run
clean, nothing else) is ``transient`` (WARN, kept as evidence: a particle upset, or the start of
an intermittent fault the next window will confirm).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from node_agent.sdc.exact import Outcome, ProbeSpec
from node_agent.sdc.spool import Verdict


def describe(
    probe: str, spec: ProbeSpec, o: Outcome, rerun: Outcome | None, window_hits: int = 0
) -> str:
    if not o.mismatched:
        return f"{probe} {spec.label()}: all {o.total} elements match"
    firsts = "; ".join(
        f"{tuple(i)} got {g!r} expected {e!r}" for i, g, e in o.evidence.get("first", [])
    )
    if rerun is not None and rerun.mismatched:
        again = f"re-run mismatched too ({rerun.mismatched} differ)"
    elif window_hits:
        again = (
            f"re-run matched, but {window_hits} other probe run(s) on this device mismatched "
            "in the same window (intermittent)"
        )
    else:
        again = "re-run matched (transient)"
    where = ""
    if "tiles_mismatched" in o.evidence:
        residues = o.evidence.get("tile_residues", {})
        where = (
            f"; {o.evidence['tiles_mismatched']} of {o.evidence['tiles_total']} tiles, "
            f"{len(residues)} SM residue class(es) mod {o.evidence['sm_count']}"
            + (" (one SM under the tile model)" if len(residues) == 1 else "")
        )
    return (
        f"{probe} {spec.label()}: {o.mismatched} of {o.total} elements differ{where}; {again}"
        + (f"; first: {firsts}" if firsts else "")
    )


def make_verdict(
    probe: str,
    spec: ProbeSpec,
    device: Any,
    first: Outcome,
    rerun: Outcome | None,
    duration_s: float,
    evidence: dict[str, Any] | None = None,
    window_hits: int = 0,
) -> Verdict:
    """The verdict of a probe run and its re-run (``window_hits``: other mismatching runs on
    the device inside the confirmation window)."""
    if not first.mismatched:
        status = "pass"
    elif (rerun is not None and rerun.mismatched) or window_hits:
        status = "confirmed"
    else:
        status = "transient"
    ev = dict(first.evidence)
    if rerun is not None:
        ev["rerun_mismatched_elements"] = rerun.mismatched
        ev["rerun"] = rerun.evidence
    if window_hits:
        ev["window_mismatches"] = window_hits
    ev.update(evidence or {})
    return Verdict(
        probe=probe,
        device=str(device),
        shape=spec.shape,
        dtype=spec.dtype,
        status=status,
        mismatched_elements=first.mismatched,
        detail=describe(probe, spec, first, rerun, window_hits),
        duration_s=duration_s,
        timestamp=time.time(),
        evidence=ev,
    )


def error_verdict(
    probe: str, spec: ProbeSpec | None, device: Any, err: BaseException, duration_s: float = 0.0
) -> Verdict:
    """The ``error`` verdict of a probe that raised (it could not run: never a pass)."""
    label = spec.label() if spec else ""
    return Verdict(
        probe=probe,
        device=str(device),
        shape=spec.shape if spec else (),
        dtype=spec.dtype if spec else "",
        status="error",
        mismatched_elements=0,
        detail=f"{probe} {label} could not run: {type(err).__name__}: {err}",
        duration_s=duration_s,
        timestamp=time.time(),
    )


class Window:
    """Mismatching probe runs on one device among its last ``size`` runs (``None``: unbounded,
    the whole run). ``record(mismatched_runs)`` after each probe; ``hits()`` before it."""

    def __init__(self, size: int | None = None) -> None:
        self.size = size
        self._runs: deque[int] = deque(maxlen=size)
        self.total = 0

    def hits(self) -> int:
        return sum(self._runs)

    def record(self, mismatched_runs: int) -> None:
        self._runs.append(mismatched_runs)
        self.total += mismatched_runs


def upgrade_in_window(verdict: Verdict, window: Window) -> Verdict:
    """Apply the window to a verdict from a probe that re-runs on its own (``exact_gemm_probe``):
    a ``transient`` with earlier mismatches in the window becomes ``confirmed``. Records the
    verdict's mismatching runs in the window."""
    runs = 0
    if verdict.status in ("transient", "confirmed"):
        runs = 1 + int(bool(verdict.evidence.get("rerun_mismatched_elements")))
    hits = window.hits()
    window.record(runs)
    if verdict.status == "transient" and hits:
        verdict.status = "confirmed"
        verdict.evidence["window_mismatches"] = hits
        verdict.detail = verdict.detail.replace(
            "re-run matched (transient)",
            f"re-run matched, but {hits} other probe run(s) on this device mismatched in the same "
            "window (intermittent)",
        )
    return verdict


def sm_pattern(verdicts: list[Verdict]) -> dict[str, int]:
    """Where the wrong tiles of mismatching runs fell, for the field engineer: in how many runs
    they share one residue mod the SM count (one SM computed them all, under the tile model:
    a single defective SM) and in how many they spread over several (a GPU-wide problem).
    Residues are per launch: each launch may start on another SM."""
    one = many = widest = 0
    for v in verdicts:
        for ev in (v.evidence, v.evidence.get("rerun") or {}):
            residues = ev.get("tile_residues")
            if not residues:
                continue
            widest = max(widest, len(residues))
            if len(residues) == 1:
                one += 1
            else:
                many += 1
    return {"runs_one_sm": one, "runs_several_sms": many, "most_sms_in_one_run": widest}
