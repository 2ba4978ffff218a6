"""The journal's kernel records in its output forms: ``-o json`` (what the journal source reads),
and ``-o export`` and ``-o verbose`` as an operator may save them (``kernel_log.path``).

The source says who wrote a record: an entry is the kernel's only where ``_TRANSPORT`` is
``kernel`` (journald's kmsg reader; systemd.journal-fields(7)) and ``SYSLOG_FACILITY``, where
given, is 0. Its ``MESSAGE`` is the kernel's message with no framing; the monotonic time
(``_SOURCE_MONOTONIC_TIMESTAMP``, the kernel's own, else ``__MONOTONIC_TIMESTAMP``) becomes the
record's time since boot.
"""

from __future__ import annotations

import json
import re
from typing import Any

from node_agent.kernel_log.framing import KERNEL_FACILITY
from node_agent.kernel_log.record import LogRecord

#: ``-o export``: "FIELD=value" lines, an empty line between entries (a field holding a newline
#: or binary data is "FIELD\n<64-bit little-endian size><data>\n"; systemd's JOURNAL_EXPORT_FORMATS)
_EXPORT_FIELD = re.compile(rb"^_{0,2}[A-Z0-9][A-Z0-9_]{0,63}=")
_EXPORT_NAME = re.compile(rb"^_{0,2}[A-Z0-9][A-Z0-9_]{0,63}$")
#: ``-o verbose``: "<weekday> <date> <time> <zone> [s=<cursor>;i=...]" then "    FIELD=value"
_VERBOSE_HEAD = re.compile(rb"^\S+ \d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \S+ \[s=[0-9a-f]+;i=")
_VERBOSE_FIELD = re.compile(r"^ {4}(?P<k>_{0,2}[A-Z0-9][A-Z0-9_]{0,63})=(?P<v>.*)$")


def journal_form(data: bytes) -> str | None:
    """``"export"``, ``"verbose"`` or ``"json"`` where ``data`` is that journal output (by its
    first line), else None (a text log)."""
    first = data.lstrip(b"\n").split(b"\n", 1)[0]
    if _EXPORT_FIELD.match(first):
        return "export"
    if _VERBOSE_HEAD.match(first):
        return "verbose"
    if first.startswith(b"{") and b'"MESSAGE"' in data[: 1 << 16]:
        return "json"
    return None


def journal_file_records(data: bytes, form: str) -> list[LogRecord]:
    """The kernel's records of a saved journal output of ``form`` (:func:`journal_form`)."""
    if form == "json":
        return journal_records(data.decode("utf-8", "replace"))
    entries = _export_entries(data) if form == "export" else _verbose_entries(data)
    records = []
    for i, entry in enumerate(entries):
        record = journal_entry_record(entry, i + 1)
        if record is not None:
            records.append(record)
    return records


def journal_records(text: str) -> list[LogRecord]:
    """``journalctl -o json`` output -> the kernel's records (see ``JournalKernelLog``)."""
    records: list[LogRecord] = []
    for i, line in enumerate(text.splitlines()):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            record = journal_entry_record(entry, i + 1)
            if record is not None:
                records.append(record)
    return records


def journal_entry_record(entry: dict[str, Any], seq: int) -> LogRecord | None:
    """One journal entry as the kernel's record, or None where the kernel did not write it."""
    if entry.get("_TRANSPORT") != "kernel":
        return None
    facility = entry.get("SYSLOG_FACILITY")
    if facility is not None and str(facility) != str(KERNEL_FACILITY):
        return None
    message = entry.get("MESSAGE")
    if isinstance(message, list):  # journald stores non-UTF-8 text as a byte array
        message = bytes(b for b in message if isinstance(b, int) and 0 <= b < 256).decode(
            "utf-8", "replace"
        )
    if not isinstance(message, str):
        return None
    boot_s: float | None = None
    for key in ("_SOURCE_MONOTONIC_TIMESTAMP", "__MONOTONIC_TIMESTAMP"):
        try:
            boot_s = int(entry[key]) / 1e6
            break
        except (KeyError, TypeError, ValueError):
            continue
    return LogRecord(seq, message.rstrip("\n"), boot_s, facility=KERNEL_FACILITY)


def _export_entries(data: bytes) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = []
    entry: dict[str, Any] = {}
    i = 0
    while i < len(data):
        end = data.find(b"\n", i)
        end = len(data) if end < 0 else end
        line = data[i:end]
        i = end + 1
        if not line:
            if entry:
                entries.append(entry)
            entry = {}
        elif _EXPORT_FIELD.match(line):
            key, _, value = line.partition(b"=")
            entry[key.decode()] = value.decode("utf-8", "replace")
        elif _EXPORT_NAME.match(line) and i + 8 <= len(data):  # a binary field
            size = int.from_bytes(data[i : i + 8], "little")
            if size > len(data) - i - 8:
                break  # cut short: the rest cannot be read
            entry[line.decode()] = data[i + 8 : i + 8 + size].decode("utf-8", "replace")
            i += 8 + size + 1
    if entry:
        entries.append(entry)
    return entries


def _verbose_entries(data: bytes) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = []
    entry: dict[str, Any] | None = None
    for raw in data.split(b"\n"):
        if _VERBOSE_HEAD.match(raw):
            entry = {}
            entries.append(entry)
            continue
        m = _VERBOSE_FIELD.match(raw.decode("utf-8", "replace"))
        if m is not None and entry is not None:
            entry[m["k"]] = m["v"]
    return entries
