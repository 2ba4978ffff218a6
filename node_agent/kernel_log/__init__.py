"""The kernel log as a source of GPU and NVSwitch errors: ``/dev/kmsg``, else ``journalctl -k``.

Three parts, in the order a line travels:

- :mod:`.sources` say who wrote a record: ``/dev/kmsg`` (facility 0 is the kernel's), the journal
  (``_TRANSPORT=kernel``), a file the operator named (``kernel_log.path``), a list of lines;
- :mod:`.framing` strips what a log puts around the kernel's message (a kmsg header, a time, a
  syslog ``<host> kernel:``) and refuses the records a user's text may start (a user's fault
  report, a netfilter LOG prefix, the driver's API-mismatch record);
- :mod:`.driver` reads the NVIDIA drivers' own messages: :class:`XidLine` (a GPU Xid),
  :class:`SxidLine` (an NVSwitch SXid), :class:`DriverLine` (a driver line without an Xid, a PCIe
  AER line about a GPU) or :class:`Unreadable` (names an Xid/SXid but cannot be read, and says
  why). Parsing never raises.

**What is believed** (docs/xid.md, "Rules of belief"): a record the kernel wrote, whose message,
after its framing, *starts* with the driver's or the PCI core's own text; the middle of a line is
never searched, only a record's first line is a message, and the never-source records are
refused whole. The time in the framing, where there is one, becomes the event's :class:`Stamp`.
"""

from node_agent.kernel_log.driver import (
    DriverLine,
    Event,
    KernelLogScanner,
    SxidLine,
    Unreadable,
    XidLine,
    normalise_bus,
    parse_driver_line,
    parse_line,
    parse_xid_line,
    scan,
    scan_lines,
)
from node_agent.kernel_log.framing import (
    KERNEL_FACILITY,
    MessageReader,
    Stamp,
    frame,
    kernel_message,
    line_stamp,
    refusal,
)
from node_agent.kernel_log.journal import journal_records
from node_agent.kernel_log.reading import believed_messages
from node_agent.kernel_log.record import LogRecord
from node_agent.kernel_log.sources import (
    FILE_READ_BYTES,
    FileKernelLog,
    JournalKernelLog,
    KernelLog,
    KmsgFollower,
    KmsgKernelLog,
    LinesKernelLog,
    UnavailableKernelLog,
    _parse_kmsg_record,
    file_records,
    open_kernel_log,
)

__all__ = [
    "FILE_READ_BYTES",
    "KERNEL_FACILITY",
    "DriverLine",
    "Event",
    "FileKernelLog",
    "JournalKernelLog",
    "KernelLog",
    "KernelLogScanner",
    "KmsgFollower",
    "KmsgKernelLog",
    "LinesKernelLog",
    "LogRecord",
    "MessageReader",
    "Stamp",
    "SxidLine",
    "UnavailableKernelLog",
    "Unreadable",
    "XidLine",
    "_parse_kmsg_record",
    "believed_messages",
    "file_records",
    "frame",
    "journal_records",
    "kernel_message",
    "line_stamp",
    "normalise_bus",
    "open_kernel_log",
    "parse_driver_line",
    "parse_line",
    "parse_xid_line",
    "refusal",
    "scan",
    "scan_lines",
]
