"""One record of the kernel log, as a source gives it."""

from __future__ import annotations

from dataclasses import dataclass

from node_agent.kernel_log.framing import KERNEL_FACILITY


@dataclass(frozen=True)
class LogRecord:
    seq: int  # monotonically increasing position (kmsg sequence number or line number)
    text: str  # may hold several lines (a multi-line kmsg record, a journal entry)
    boot_s: float | None = None  # the record's own time since boot, where the source gives it
    #: syslog facility from the kmsg header (0 = kernel, 1 = user: a write to /dev/kmsg);
    #: None where the source does not say (a saved text line: its prefix is checked instead)
    facility: int | None = None

    @property
    def whole(self) -> bool:
        """True where the record holds all the lines the kernel printed in it (kmsg, the
        journal); False for a line of a text log, where a record's later lines come after it."""
        return self.facility is not None or "\n" in self.text

    @property
    def from_kernel(self) -> bool:
        """False for a record the kernel did not write itself (facility other than 0)."""
        return self.facility is None or self.facility == KERNEL_FACILITY
