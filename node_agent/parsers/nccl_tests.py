"""Parse the table ``all_reduce_perf`` (nccl-tests) prints.

Current nccl-tests print a ``root`` column and count wrong elements in ``#wrong``; releases
before 2.11 had no ``root`` and printed the maximum error as ``error`` (``0e+00`` when
correct). Columns are found by name from the header, out-of-place first, then in-place::

    #       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
    #        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
         8388608       2097152     float     sum      -1    97.07   86.42  151.23      0    96.65   86.80  151.89      0

GB/s here is 10^9 bytes/s; busbw = algbw * 2(n-1)/n for all-reduce (nccl-tests PERFORMANCE.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from node_agent.parsers import ParseError


@dataclass(frozen=True)
class NcclRow:
    """One message size (out-of-place figures; in-place kept alongside)."""

    size_bytes: int
    count: int
    dtype: str
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    wrong: int | None  # wrong elements (``#wrong``); None with the older ``error`` column
    max_error: float | None  # older releases only
    inplace_busbw_gbps: float | None
    inplace_wrong: int | None


@dataclass(frozen=True)
class NcclTable:
    rows: list[NcclRow]
    avg_busbw_gbps: float | None
    out_of_bounds: int | None


_FLOAT = re.compile(r"^-?\d+(\.\d*)?([eE][-+]?\d+)?$")


def _num(token: str) -> float | None:
    return float(token) if _FLOAT.match(token) else None  # "N/A" when validation is off


def parse_all_reduce_perf(text: str) -> NcclTable:
    """Rows, ``# Avg bus bandwidth`` and ``# Out of bounds values`` of an all_reduce_perf run.

    Raises :class:`ParseError` without a header or rows, or without the closing
    ``Avg bus bandwidth`` line (the run was cut off).
    """
    columns: list[str] | None = None
    rows: list[NcclRow] = []
    avg: float | None = None
    oob: int | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            body = stripped.lstrip("#").split()
            if body[:2] == ["size", "count"] and "busbw" in body:
                columns = body
            elif stripped.startswith("# Avg bus bandwidth"):
                avg = float(stripped.split(":")[1].split()[0])
            elif stripped.startswith("# Out of bounds values"):
                oob = int(stripped.split(":")[1].split()[0])
            continue
        if columns is None or not stripped or not stripped[0].isdigit():
            continue
        tokens = stripped.split()
        if len(tokens) != len(columns):
            continue  # a half-written last line, or an interleaved warning
        rows.append(_row(columns, tokens))
    if columns is None:
        raise ParseError("no all_reduce_perf table header (# size count type redop ...) in "
                         "the output")
    if not rows:
        raise ParseError("all_reduce_perf printed its header but no result rows: truncated")
    if avg is None:
        raise ParseError(f"all_reduce_perf output ends after {len(rows)} rows without "
                         "'# Avg bus bandwidth': the run was cut off")
    return NcclTable(rows=rows, avg_busbw_gbps=avg, out_of_bounds=oob)


def _row(columns: list[str], tokens: list[str]) -> NcclRow:
    first = {}
    second = {}
    for name, token in zip(columns, tokens, strict=True):
        (second if name in first else first)[name] = token
    check = "#wrong" if "#wrong" in first else "error" if "error" in first else None
    wrong, max_error, inplace_wrong = None, None, None
    if check == "#wrong":
        w = _num(first["#wrong"])
        wrong = int(w) if w is not None else None
        w2 = _num(second.get("#wrong", "N/A"))
        inplace_wrong = int(w2) if w2 is not None else None
    elif check == "error":
        # The old column is a maximum deviation, not a count: the verdict is the run's
        # "# Out of bounds values" line, so the per-row count stays unknown.
        max_error = _num(first["error"])
    try:
        return NcclRow(size_bytes=int(first["size"]), count=int(first["count"]),
                       dtype=first["type"], time_us=float(first["time"]),
                       algbw_gbps=float(first["algbw"]), busbw_gbps=float(first["busbw"]),
                       wrong=wrong, max_error=max_error,
                       inplace_busbw_gbps=_num(second.get("busbw", "N/A")),
                       inplace_wrong=inplace_wrong)
    except (KeyError, ValueError) as err:
        raise ParseError(f"all_reduce_perf row {' '.join(tokens)!r}: {err}") from err
