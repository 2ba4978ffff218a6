"""Parse perftest bandwidth output (``ib_write_bw`` and friends), table and ``--out_json``.

The table ends every run::

     #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]
     65536      2372560          0.00               388.72             0.741432

The unit in brackets depends on the flags and the perftest version: ``Gb/sec`` with
``--report_gbits`` (10^9 bits/s), ``MB/sec`` in older releases and ``MiB/sec`` in newer ones
without it. Both byte units are 2^20 bytes/s: perftest divides by 0x100000 and later renamed the
label to say so (perftest ``print_report_bw``). In duration mode (``-D``) perftest does not
measure a peak and prints 0.00, so a zero peak is reported as ``None``. Columns are found by
name, so the ``#sl`` (QoS), ``CPU_Util[%]`` (``--cpu_util``) and per-port variants read too.

**The label is checked, not trusted.** perftest computes bandwidth and message rate from the
same count and time (``print_report_bw``: ``bw_avg = tsize*iters*cycles/(time*format_factor)``,
``msgRate = iters*cycles/(time*10^6)``, ``tsize`` = message size), so

    BW average [bytes/s] = MsgRate [Mpps] * 10^6 * #bytes

in every unit and mode of current perftest (the bidirectional factor scales both). One old
form breaks it: releases whose ``-b`` iteration-mode report doubled ``tsize`` but not the
message rate print BW = 2 x MsgRate x size; no capture of it was found, and such a row is
refused with both figures rather than read. Each row's bandwidth is compared with that product:

* it agrees with the label's unit: read as labelled;
* it agrees with another unit perftest prints (a server whose header says ``MB/sec`` printing
  the client's ``--report_gbits`` figures, as in a real capture): read in that unit, and
  ``unit_note`` says what was corrected and why;
* it agrees with none: :class:`ParseError` naming both figures.

``--out_json`` files carry no unit at all (``"BW_average": 2229.27``); the unit is the one
whose figure agrees with ``MsgRate * MsgSize``, or the caller's ``unit`` when the message rate
is missing. Assuming Gb/s there read a MiB/s file 119x too high (1 MiB/s = 8 * 2^20 / 10^9 =
0.00839 Gb/s: 2229.27 MiB/s is 18.70 Gb/s, not 2229.27).

Lines perftest prints inside the table (``Conflicting CPU frequency values detected ...``) are
kept in ``warnings``: perftest converts cycles to time with the CPU frequency it read, so such a
warning means both figures may be off together, which the cross-check cannot see.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from node_agent.parsers import ParseError

#: bandwidth unit label -> factor to Gb/s (10^9 bits per second)
UNIT_TO_GBPS: dict[str, float] = {
    "Gb/sec": 1.0,
    "MB/sec": 1048576 * 8 / 1e9,
    "MiB/sec": 1048576 * 8 / 1e9,
}
#: the two scales a figure can be in, for the cross-check (MB/sec and MiB/sec are one scale)
_SCALES = {"Gb/sec": 1.0, "MiB/sec": 1048576 * 8 / 1e9}

_HEADER = re.compile(r"#bytes\s.*BW average\[([^\]]+)\]")
_LAT_HEADER = re.compile(r"#bytes\s+#iterations\s+t_min\[")
_COLUMN = re.compile(r"#\w+|[A-Za-z_]+(?: [A-Za-z0-9_]+)?\[[^\]]*\]")
_NUMBER = re.compile(r"^\d+(\.\d+)?$")
#: relative slack of the cross-check beyond print rounding (perftest's own timing jitter
#: between the two figures is nil: both come from one count and one time)
_SLACK = 0.01


@dataclass(frozen=True)
class BwRow:
    """One message size of a perftest bandwidth run, bandwidth converted to Gb/s."""

    msg_size_bytes: int
    iterations: int
    bw_peak_gbps: float | None
    bw_avg_gbps: float
    msg_rate_mpps: float | None
    unit_reported: str  # the label perftest printed ("" for --out_json, which has none)
    unit_used: str = ""  # the unit the figures were read in, after the cross-check
    unit_note: str | None = None  # why unit_used differs from the label, or how it was chosen
    cross_checked: bool = False  # bandwidth agreed with MsgRate x size
    warnings: tuple[str, ...] = ()  # lines perftest printed inside the table


def to_gbps(value: float, unit: str) -> float:
    """``value`` in perftest's ``unit`` as Gb/s; ParseError for a unit perftest never prints."""
    try:
        return value * UNIT_TO_GBPS[unit.strip()]
    except KeyError:
        raise ParseError(
            f"unknown perftest bandwidth unit {unit!r}; expected one of {', '.join(UNIT_TO_GBPS)}"
        ) from None


def implied_gbps(msg_size_bytes: int, msg_rate_mpps: float) -> float:
    """Bandwidth in Gb/s that ``msg_rate_mpps`` messages of ``msg_size_bytes`` carry."""
    return msg_rate_mpps * 1e6 * msg_size_bytes * 8 / 1e9


def _agrees(value: float, scale: float, size: int, rate: float, decimals: int) -> bool:
    """Whether ``value`` (in a unit of ``scale`` Gb/s) matches ``rate`` Mpps of ``size`` B,
    allowing each figure's print rounding (``decimals`` places; MsgRate has 6)."""
    implied = implied_gbps(size, rate)
    got = value * scale
    rounding = 0.5 * 10**-decimals * scale + implied_gbps(size, 0.5e-6)
    return bool(abs(got - implied) <= rounding + _SLACK * implied)


def resolve_unit(
    value: float, label: str | None, size: int, rate: float | None, decimals: int = 2
) -> tuple[str, str | None, bool]:
    """(unit to read ``value`` in, note, cross-checked) for one bandwidth figure.

    Raises :class:`ParseError` when the figure agrees with no unit, or when there is neither a
    label nor a message rate to tell the unit by.
    """
    if label is not None:
        to_gbps(0.0, label)  # a label perftest never prints is refused
    if rate is None or rate <= 0 or value <= 0:
        if label is None:
            raise ParseError(
                "perftest JSON names no bandwidth unit and has no MsgRate to tell "
                "it by: pass the unit the run used (Gb/sec with --report_gbits, "
                "MiB/sec without)"
            )
        return label, None, False
    matches = [u for u, scale in _SCALES.items() if _agrees(value, scale, size, rate, decimals)]
    label_scale = None if label is None else _SCALES["Gb/sec" if label == "Gb/sec" else "MiB/sec"]
    if (
        label is not None
        and label_scale is not None
        and _agrees(value, label_scale, size, rate, decimals)
    ):
        return label, None, True
    implied = implied_gbps(size, rate)
    if matches:
        unit = matches[0]
        if label is None:
            return (
                unit,
                (
                    f"no unit in the output: {value:g} agrees with MsgRate {rate:g} Mpps "
                    f"x {size} B = {implied:.2f} Gb/s only when read as {unit}"
                ),
                True,
            )
        return (
            unit,
            (
                f"labelled {label} but {value:g} is {unit}: MsgRate {rate:g} Mpps x "
                f"{size} B = {implied:.2f} Gb/s (seen when a server prints its client's "
                "--report_gbits figures under its own MB/sec header)"
            ),
            True,
        )
    raise ParseError(
        f"perftest bandwidth {value:g} {label or '(no unit)'} at {size} B disagrees with its "
        f"own message rate: {rate:g} Mpps x {size} B = {implied:.2f} Gb/s "
        f"= {implied * 1e9 / 8 / 1048576:.2f} MiB/s; neither unit fits, so the figure cannot "
        "be trusted"
    )


def _columns(header_line: str) -> list[str]:
    return _COLUMN.findall(header_line)


def parse_bw_table(text: str) -> list[BwRow]:
    """The result rows of a perftest bandwidth run (one per message size).

    Raises :class:`ParseError` when the table header is missing, no row follows it (a run
    that died or was cut off), or a row's bandwidth contradicts its message rate.
    """
    lines = text.splitlines()
    found = next(((i, m) for i, m in enumerate(map(_HEADER.search, lines)) if m), None)
    if found is None and (latency := next((x for x in lines if _LAT_HEADER.search(x)), None)):
        raise ParseError(
            f"this is a perftest latency table ({latency.strip()[:100]!r}: ib_*_lat), not a "
            "bandwidth run's: it has no BW average to read"
        )
    if found is None:
        said = [line.strip() for line in lines if line.strip()][:2]
        raise ParseError(
            "no perftest result table (#bytes ... BW average[...]) in the output; "
            "the run ended before reporting" + (f": {' / '.join(said)}" if said else " (no output)")
        )
    start, _match = found
    columns = _columns(lines[start])
    try:
        i_size, i_iters = columns.index("#bytes"), columns.index("#iterations")
        i_avg = next(i for i, c in enumerate(columns) if c.startswith("BW average["))
    except (ValueError, StopIteration):
        raise ParseError(
            f"perftest table header {lines[start].strip()!r} lacks #bytes, "
            "#iterations or BW average"
        ) from None
    i_peak = next((i for i, c in enumerate(columns) if c.startswith("BW peak[")), None)
    i_rate = next((i for i, c in enumerate(columns) if c.startswith("MsgRate[")), None)
    avg_unit = columns[i_avg][len("BW average[") : -1]
    peak_unit = columns[i_peak][len("BW peak[") : -1] if i_peak is not None else avg_unit
    to_gbps(0.0, avg_unit)  # an unknown label is refused here, before any row
    to_gbps(0.0, peak_unit)
    rows: list[BwRow] = []
    warnings: list[str] = []
    unread: list[list[str]] = []  # lines that start like a row (a size) and are not one
    for line in lines[start + 1 :]:
        tokens = line.split()
        if (
            len(tokens) != len(columns)
            or not all(_NUMBER.match(t) for t in tokens)
            or "." in tokens[i_size]
        ):
            if tokens and tokens[0].isdigit():
                unread.append(tokens)
            # warnings ("Conflicting CPU frequency ...") may sit inside the table
            elif tokens and not set(line.strip()) <= {"-"}:
                warnings.append(line.strip())
            continue
        size = int(tokens[i_size])
        avg_text = tokens[i_avg]
        rate = float(tokens[i_rate]) if i_rate is not None else None
        decimals = len(avg_text.split(".")[1]) if "." in avg_text else 0
        unit, note, checked = resolve_unit(float(avg_text), avg_unit, size, rate, decimals)
        peak_in = unit if unit != avg_unit else peak_unit
        peak = to_gbps(float(tokens[i_peak]), peak_in) if i_peak is not None else 0.0
        rows.append(
            BwRow(
                msg_size_bytes=size,
                iterations=int(tokens[i_iters]),
                bw_peak_gbps=peak or None,
                bw_avg_gbps=to_gbps(float(avg_text), unit),
                msg_rate_mpps=rate,
                unit_reported=avg_unit,
                unit_used=unit,
                unit_note=note,
                cross_checked=checked,
                warnings=tuple(warnings),
            )
        )
    _refuse_unread(columns, rows, unread)
    return rows


def _refuse_unread(columns: list[str], rows: list[BwRow], unread: list[list[str]]) -> None:
    """Refuse a table with a line that starts like a row and is not one, naming why: a cell
    that is not a number (edited), a last row cut short (truncated), a row of another width;
    and a header with no row at all (the run ended before its first measurement)."""
    width = len(columns)
    for tokens in unread:
        if len(tokens) == width:
            name, cell = next(
                (c, t)
                for c, t in zip(columns, tokens, strict=True)
                if not _NUMBER.match(t) or (c == "#bytes" and "." in t)
            )
            raise ParseError(
                f"perftest row {' '.join(tokens)[:120]!r}: the {name} cell is {cell!r}, which "
                "perftest never prints there: the row was edited or corrupted after the run"
            )
    if unread and len(unread[-1]) < width and all(_NUMBER.match(t) for t in unread[-1]):
        raise ParseError(
            f"perftest output is truncated inside a row ({len(unread[-1])} of {width} fields: "
            f"{' '.join(unread[-1])[:120]!r}) after {len(rows)} whole row(s): the output was "
            "cut off mid-line"
        )
    if unread:
        raise ParseError(
            f"perftest line {' '.join(unread[0])[:120]!r} starts like a result row but has "
            f"{len(unread[0])} fields where the header has {width}: the table was edited or "
            "two outputs were mixed"
        )
    if not rows:
        raise ParseError(
            "perftest printed its table header and no result row under it: the run ended "
            "before its first measurement (killed, timed out, or its peer vanished); read the "
            "server's and the client's output for why"
        )


def parse_bw_json(text: str, unit: str | None = None) -> BwRow:
    """The ``results`` of perftest's ``--out_json`` file.

    perftest writes ``{"test_info": {...}, "results": {"MsgSize", "n_iterations", "BW_peak",
    "BW_average", "MsgRate"}}`` with bandwidth in the run's report unit and no unit in the
    file. The unit is the one in which ``BW_average`` agrees with ``MsgRate * MsgSize``; a
    ``unit`` passed here (``Gb/sec`` for a run with ``--report_gbits``) is checked the same
    way and used as is only when the file has no ``MsgRate``.
    """
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise ParseError(
            f"perftest JSON is truncated or malformed: {err.msg} at character {err.pos}"
        ) from err
    try:
        res: Any = doc["results"]
        if isinstance(res, list):  # some builds write one entry per message size
            res = res[-1]
        label = res.get("bw_unit") or res.get("BW_unit") or unit
        size = int(res["MsgSize"])
        avg = float(res["BW_average"])
        rate = float(res["MsgRate"]) if res.get("MsgRate") is not None else None
        chosen, note, checked = resolve_unit(avg, str(label) if label else None, size, rate)
        peak = to_gbps(float(res.get("BW_peak", 0.0)), chosen)
        return BwRow(
            msg_size_bytes=size,
            iterations=int(res["n_iterations"]),
            bw_peak_gbps=peak or None,
            bw_avg_gbps=to_gbps(avg, chosen),
            msg_rate_mpps=rate,
            unit_reported=str(label or ""),
            unit_used=chosen,
            unit_note=note,
            cross_checked=checked,
        )
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
        if isinstance(err, ParseError):
            raise
        raise ParseError(f"perftest JSON lacks or mistypes field {err}") from err
