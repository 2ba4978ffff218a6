"""One hang signal: what one way of looking at a training process says about its progress.

The ``training_progress`` check looks at each training process in several independent ways
(progress heartbeats, stack samples, GPU activity, RDMA port traffic, log silence; see
``docs/training_hangs.md``) and suspects a hang only when enough of them agree. Each way of
looking yields one :class:`Signal`. A signal that cannot be read (no py-spy, no permission, no
RDMA device, no log file configured) is ``available=False`` with the reason: it neither
accuses nor clears the process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: the signals, in the order the evidence lists them
NAMES = ("heartbeat", "stack", "gpu_activity", "rdma_traffic", "log_silence")


@dataclass(frozen=True)
class Signal:
    """``hang`` is True when this signal sees no progress; ``detail`` is one line for the
    operator (what was seen, or why the signal is unavailable); ``figures`` are the readings
    behind it (seconds, counters, percentages), kept as evidence."""

    name: str
    available: bool
    hang: bool = False
    detail: str = ""
    figures: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def unavailable(cls, name: str, reason: str, **figures: Any) -> Signal:
        return cls(name, False, False, reason, dict(figures))

    def to_dict(self) -> dict[str, Any]:
        return {
            "available": self.available,
            "hang": self.hang,
            "detail": self.detail,
            **self.figures,
        }
