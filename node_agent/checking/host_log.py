"""The kernel's own messages, for the host checks that read the kernel log (``pcie_aer``,
``host_memory``, ``host_cpu``).

The framing in front of each message (the kmsg header, ``dmesg`` and syslog times, hosts,
``kernel:``) and what is believed (a record of the kernel's facility, only a record's first line)
are :mod:`node_agent.kernel_log`'s, through its public reader (``believed_messages``); the checks'
own modules (:mod:`node_agent.host.aer_lines`, :mod:`node_agent.host.ghes`,
:mod:`node_agent.host.cpu`) match the message from its first character, never the middle of a
line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from node_agent.checking.context import CheckContext
from node_agent.kernel_log import Stamp, believed_messages, line_stamp


@dataclass(frozen=True)
class KernelMessage:
    seq: int
    stamp: Stamp | None
    text: str  # the message, from the kernel's own first character


@dataclass
class KernelMessages:
    """The messages read, where from, and why none could be (``unreadable``: None when read)."""

    messages: list[KernelMessage] = field(default_factory=list)
    source: str = "none"
    unreadable: str | None = None


def kernel_messages(ctx: CheckContext, words: tuple[str, ...]) -> KernelMessages:
    """The kernel's messages holding one of ``words`` (a cheap test before the framing is
    parsed), from the node's kernel log and its ports' extra records."""
    log = ctx.kernel_log
    if log is None:
        return KernelMessages(unreadable="no kernel log to read")
    if log.unavailable_reason:
        return KernelMessages(source=log.source, unreadable=log.unavailable_reason)
    try:
        records = log.read()
    except OSError as err:
        return KernelMessages(source=log.source, unreadable=f"cannot read {log.source}: {err}")
    records = records + ctx.ports.extra_kernel_records(len(records) + 1)
    holds = re.compile("|".join(map(re.escape, words))).search  # one C-speed test per record
    # the one reader of belief: it refuses whole records no user text may lead (a netfilter LOG
    # record, the driver's API-mismatch record with all its lines, in a text log too)
    wanted = (r for r in records if holds(r.text) is not None)
    out: list[KernelMessage] = []
    for record, prefix, message in believed_messages(wanted, words):
        stamp = Stamp("boot", record.boot_s) if record.boot_s is not None else line_stamp(prefix)
        out.append(KernelMessage(record.seq, stamp, message))
    return KernelMessages(out, log.source)
