"""Node-relative grading: a GPU's figure against the median of its siblings on the same node.

Thresholds come from ``graders/performance.yaml`` (``siblings``; their one home, read through
:func:`~node_agent.checking.thresholds.load_topic`); the check that measured the figures applies
them, so the result's status already says warn/fail and the detail names both
the GPU's figure and its siblings' median.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from node_agent.checking.thresholds import load_topic
from node_agent.config import Config
from node_agent.model import Status

_RATIO = {"type": "number", "exclusiveMinimum": 0, "maximum": 1}
PERFORMANCE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "siblings": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "warn_below": _RATIO,
                "error_below": _RATIO,
                "min_gpus": {"type": "integer", "minimum": 2},
            },
        }
    },
}


@dataclass(frozen=True)
class SiblingThresholds:
    """``graders/performance.yaml``'s ``siblings`` (no defaults here: the file is their home)."""

    warn_below: float
    error_below: float
    min_gpus: int


def load_thresholds(config: Config) -> SiblingThresholds:
    """The ``siblings`` thresholds: the operator's keys over the shipped file's (ConfigError if
    either is bad)."""
    data = load_topic(config, "performance", PERFORMANCE_SCHEMA, "performance grading file")
    siblings = data["siblings"]
    return SiblingThresholds(
        warn_below=siblings["warn_below"],
        error_below=siblings["error_below"],
        min_gpus=siblings["min_gpus"],
    )


@dataclass(frozen=True)
class SiblingVerdict:
    status: Status  # pass, warn (clearly below) or fail (far below)
    ratio: float | None  # figure / siblings' median; None when not compared
    siblings_median: float | None
    detail: str  # "" when the figure is in line with its siblings

    def evidence(self) -> dict[str, Any]:
        return {
            "siblings_median": self.siblings_median,
            "ratio_to_siblings": None if self.ratio is None else round(self.ratio, 4),
        }


def compare_with_siblings(
    values: Mapping[int, float], thresholds: SiblingThresholds, what: str, unit: str
) -> dict[int, SiblingVerdict]:
    """Each GPU's figure (higher is better) against the median of the other GPUs.

    >>> th = SiblingThresholds(warn_below=0.92, error_below=0.80, min_gpus=3)
    >>> v = compare_with_siblings({0: 100, 1: 101, 2: 99, 3: 50}, th, "bf16", "TFLOP/s")
    >>> v[3].status.value, v[3].siblings_median
    ('fail', 100)
    """
    out: dict[int, SiblingVerdict] = {}
    if len(values) < thresholds.min_gpus:
        return {i: SiblingVerdict(Status.PASS, None, None, "") for i in values}
    for index, value in values.items():
        median = statistics.median(v for i, v in values.items() if i != index)
        if median <= 0:
            out[index] = SiblingVerdict(Status.PASS, None, median, "")
            continue
        ratio = value / median
        if ratio < thresholds.error_below:
            status, words = Status.FAIL, "far below"
        elif ratio < thresholds.warn_below:
            status, words = Status.WARN, "below"
        else:
            out[index] = SiblingVerdict(Status.PASS, ratio, median, "")
            continue
        detail = (
            f"gpu:{index} {what} {value:.4g} {unit} is {words} its siblings' median "
            f"{median:.4g} {unit} ({ratio:.0%}; WARN under {thresholds.warn_below:.0%}, "
            f"ERROR under {thresholds.error_below:.0%})"
        )
        out[index] = SiblingVerdict(status, ratio, median, detail)
    return out
