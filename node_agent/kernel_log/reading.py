"""The kernel's believed messages of a run of records: one reader for every check that reads
the kernel log for a form of its own (the distress lines, PCIe AER, GHES, CPU throttling)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from node_agent.kernel_log.framing import MessageReader, kernel_message, refusal
from node_agent.kernel_log.record import LogRecord


def believed_messages(
    records: Iterable[LogRecord], words: tuple[str, ...] = ()
) -> Iterator[tuple[LogRecord, str, str]]:
    """``(record, framing, message)`` for each record the kernel wrote whose first line is a
    message that may be a source, in order (docs/xid.md, "Rules of belief"): records of another
    facility, never-source records (a user's fault report, a netfilter LOG record, the driver's
    API-mismatch record with all its lines, in a text log too) and a record's later lines give
    nothing. ``words``: only messages holding one of them (a cheap test before the framing is
    parsed). The message is to be matched from its first character, never searched.
    """
    reader = MessageReader()
    for record in records:
        if not record.from_kernel:
            continue
        first = record.text.split("\n", 1)[0]
        if not record.whole:  # a text log's line: the reader keeps what its records need
            found = reader.message(first, words)
        elif words and not any(word in first for word in words):
            continue
        else:  # kmsg, the journal: the record holds all its lines, refused whole
            found = None if refusal(record.text.lstrip()) else kernel_message(first)
        if found is not None:
            yield record, found[0], found[1]
