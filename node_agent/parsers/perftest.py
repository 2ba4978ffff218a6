"""Parse perftest bandwidth output (``ib_write_bw`` and friends), table and ``--out_json``.

The table ends every run::

     #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]
     65536      2372560          0.00               388.72             0.741432

The unit in brackets depends on the flags and the perftest version: ``Gb/sec`` with
``--report_gbits`` (10^9 bits/s), ``MB/sec`` in older releases and ``MiB/sec`` in newer ones
without it. Both byte units are 2^20 bytes/s: perftest divides by 0x100000 and later renamed the
label to say so (perftest ``print_report_bw``). In duration mode (``-D``) perftest does not
measure a peak and prints 0.00, so a zero peak is reported as ``None``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from node_agent.parsers import ParseError

#: bandwidth unit label -> factor to Gb/s (10^9 bits per second)
UNIT_TO_GBPS: dict[str, float] = {
    "Gb/sec": 1.0,
    "MB/sec": 1048576 * 8 / 1e9,
    "MiB/sec": 1048576 * 8 / 1e9,
}

_HEADER = re.compile(r"#bytes\s+#iterations\s+BW peak\[([^\]]+)\]\s+BW average\[([^\]]+)\]")
_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)(?:\s+([\d.]+))?\s*$")


@dataclass(frozen=True)
class BwRow:
    """One message size of a perftest bandwidth run, bandwidth converted to Gb/s."""

    msg_size_bytes: int
    iterations: int
    bw_peak_gbps: float | None
    bw_avg_gbps: float
    msg_rate_mpps: float | None
    unit_reported: str


def to_gbps(value: float, unit: str) -> float:
    """``value`` in perftest's ``unit`` as Gb/s; ParseError for a unit perftest never prints."""
    try:
        return value * UNIT_TO_GBPS[unit.strip()]
    except KeyError:
        raise ParseError(f"unknown perftest bandwidth unit {unit!r}; expected one of "
                         f"{', '.join(UNIT_TO_GBPS)}") from None


def parse_bw_table(text: str) -> list[BwRow]:
    """The result rows of a perftest bandwidth run (one per message size).

    Raises :class:`ParseError` when the table header is missing or no row follows it
    (a run that died or was cut off).
    """
    lines = text.splitlines()
    found = next(((i, m) for i, m in enumerate(map(_HEADER.search, lines)) if m), None)
    if found is None:
        raise ParseError("no perftest result table (#bytes ... BW average[...]) in the output; "
                         "the run ended before reporting")
    start, header = found
    peak_unit, avg_unit = header.group(1), header.group(2)
    rows: list[BwRow] = []
    for line in lines[start + 1:]:
        match = _ROW.match(line)
        if not match:
            continue  # warnings ("Conflicting CPU frequency ...") may sit inside the table
        peak = to_gbps(float(match.group(3)), peak_unit)
        rows.append(BwRow(
            msg_size_bytes=int(match.group(1)), iterations=int(match.group(2)),
            bw_peak_gbps=peak or None, bw_avg_gbps=to_gbps(float(match.group(4)), avg_unit),
            msg_rate_mpps=float(match.group(5)) if match.group(5) else None,
            unit_reported=avg_unit))
    if not rows:
        raise ParseError("perftest printed its table header but no result row: the output is "
                         "truncated (the run was killed or its peer vanished)")
    return rows


def parse_bw_json(text: str, unit: str = "Gb/sec") -> BwRow:
    """The ``results`` of perftest's ``--out_json`` file.

    perftest writes ``{"test_info": {...}, "results": {"MsgSize", "n_iterations", "BW_peak",
    "BW_average", "MsgRate"}}`` with bandwidth in the run's report unit; pass ``unit`` as the
    flags made it (``Gb/sec`` with ``--report_gbits``).
    """
    try:
        doc = json.loads(text)
        res = doc["results"]
        if isinstance(res, list):  # some builds write one entry per message size
            res = res[-1]
        unit = str(res.get("bw_unit") or res.get("BW_unit") or unit)
        peak = to_gbps(float(res.get("BW_peak", 0.0)), unit)
        return BwRow(msg_size_bytes=int(res["MsgSize"]), iterations=int(res["n_iterations"]),
                     bw_peak_gbps=peak or None,
                     bw_avg_gbps=to_gbps(float(res["BW_average"]), unit),
                     msg_rate_mpps=float(res["MsgRate"]) if "MsgRate" in res else None,
                     unit_reported=unit)
    except json.JSONDecodeError as err:
        raise ParseError(f"perftest JSON is truncated or malformed: {err.msg} at "
                         f"character {err.pos}") from err
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise ParseError(f"perftest JSON lacks or mistypes field {err}") from err
