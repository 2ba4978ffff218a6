"""Parse the table ``all_reduce_perf`` (nccl-tests) prints, as run or as saved by a launcher.

Current nccl-tests print a ``root`` column and count wrong elements in ``#wrong``; releases
before 2.11 had no ``root`` and printed the maximum error as ``error`` (``0e+00`` when
correct). Columns are found by name from the header, out-of-place first, then in-place::

    #       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
    #        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
         8388608       2097152     float     sum      -1    97.07   86.42  151.23      0    96.65   86.80  151.89      0

GB/s here is 10^9 bytes/s; busbw = algbw * 2(n-1)/n for all-reduce (nccl-tests PERFORMANCE.md).

What else real output carries, and how it is read (nccl-tests ``src/util.cu``, v2.19):

* **Launcher prefixes.** ``srun --label`` puts the task number before every line (`` 0: ``),
  ``mpirun --tag-output`` puts ``[job,rank]<stdout>:``. The prefix is removed, and only the
  stream that printed the table header is read (other ranks' and stderr lines are dropped).
  The mpirun tag is found wherever it sits on the line: indented (``   [1,0]<stdout>:``, as
  a log viewer or a wrapper that indents its child's output saves it) or after a time or host
  that ``--timestamp-output`` or a log collector put in front; what precedes it is dropped.
  The srun label is read at the start of the line, after any blanks (a number followed by a
  colon further in is too easily a time).
* **``-C 1``** names the time column ``cputime``: the host's launch time per iteration. The
  bandwidth columns are still computed from the GPU time (``common.cu``: ``getBw(..., deltaSec)``),
  so they are read as usual and ``time_us`` is None (``cputime_us`` holds the figure).
* **``-S 1``** adds a ``timestamp`` header column and a two-token ``%Y-%m-%d %H:%M:%S`` at the
  end of every row; it is kept as ``timestamp``.
* **``-I 1``** adds ``i_min i_max i_p99 i_cv%`` after each half; read by name like the others.
* **validation off** (``-c 0``) prints ``N/A`` for ``#wrong`` and still ``Out of bounds values
  : 0 OK``; that zero checked nothing, so ``out_of_bounds`` is None and ``validated`` False.
* **Other collectives** print the same table. A ``redop`` of ``none`` (alltoall, all_gather,
  broadcast, sendrecv), a ``Collective test starting:`` line naming another test, or a busbw /
  algbw ratio that is not all-reduce's 2(n-1)/n for the listed ranks is refused: busbw means
  something else there. reduce_scatter without the test-name line (releases before 2.14) has
  the ``sum`` redop and root -1 of all-reduce and is caught only by the ratio, when the rank
  lines are present.
* **Consistency.** Where the ``time`` column is wall time, algbw must equal size / time to the
  printed precision; a row that does not was shifted or edited, and is refused.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from node_agent.parsers import ParseError


@dataclass(frozen=True)
class NcclRow:
    """One message size (out-of-place figures; in-place kept alongside)."""

    size_bytes: int
    count: int
    dtype: str
    time_us: float | None  # wall time per iteration; None when the run printed cputime (-C 1)
    algbw_gbps: float
    busbw_gbps: float
    wrong: int | None  # wrong elements (``#wrong``); None with the older ``error`` column or N/A
    max_error: float | None  # older releases only
    inplace_busbw_gbps: float | None
    inplace_wrong: int | None
    cputime_us: float | None = None  # -C 1: host time per iteration
    redop: str = "sum"
    timestamp: str | None = None  # -S 1


@dataclass(frozen=True)
class NcclTable:
    rows: list[NcclRow]
    avg_busbw_gbps: float | None
    out_of_bounds: int | None  # None when the run did not validate (``-c 0``)
    validated: bool | None = None  # False: -c 0 (every #wrong N/A); None: cannot tell
    ranks: int | None = None  # from the "#  Rank N ..." lines, when they are all there
    program: str | None = None  # "all_reduce_perf" from "# Collective test starting:"
    launcher_prefix: str | None = None  # "srun --label", "mpirun --tag-output" or None


_FLOAT = re.compile(r"^-?\d+(\.\d*)?([eE][-+]?\d+)?$")
_SRUN = re.compile(r"^\s*(\d+):(?: |$)")
_MPIRUN = re.compile(r"\[(\d+),(\d+)\]<(stdout|stderr|stddiag)>:")
_RANK = re.compile(r"^#\s+Rank\s+(\d+)\s")
_VALIDATION = re.compile(r"\bvalidation:\s*(\d+)")
_PROGRAM = re.compile(r"^#\s*Collective test starting:\s*(\S+)")
#: redops of the reduction tests; "none" is printed by the tests that do not reduce
_NO_REDUCTION = "none"


def _num(token: str) -> float | None:
    return float(token) if _FLOAT.match(token) else None  # "N/A" when validation is off


def split_prefix(line: str) -> tuple[str | None, str | None, str]:
    """(launcher, stream label, the line without its prefix) of one output line.

    >>> split_prefix(" 3: #  size count")
    ('srun --label', '3', '#  size count')
    >>> split_prefix("[1,0]<stdout>:   8  2 float")
    ('mpirun --tag-output', '1,0 stdout', '   8  2 float')
    >>> split_prefix("   [1,0]<stdout>:#  size count")
    ('mpirun --tag-output', '1,0 stdout', '#  size count')
    """
    match = _MPIRUN.search(line)
    if match:
        return (
            "mpirun --tag-output",
            f"{match.group(1)},{match.group(2)} {match.group(3)}",
            line[match.end() :],
        )
    match = _SRUN.match(line)
    if match:
        return "srun --label", match.group(1), line[match.end() :]
    return None, None, line


def _is_header(body: list[str]) -> bool:
    return body[:2] == ["size", "count"] and "busbw" in body and "algbw" in body


def _stream(lines: list[str]) -> tuple[str | None, str | None]:
    """The launcher and stream label of the line holding the first table header."""
    for line in lines:
        launcher, label, rest = split_prefix(line)
        stripped = rest.strip()
        if stripped.startswith("#") and _is_header(stripped.lstrip("#").split()):
            return launcher, label
    return None, None


def parse_all_reduce_perf(text: str) -> NcclTable:
    """Rows, ``# Avg bus bandwidth`` and ``# Out of bounds values`` of an all_reduce_perf run.

    Raises :class:`ParseError` without a header or rows, without the closing
    ``Avg bus bandwidth`` line (the run was cut off), or for a table that is not all-reduce's.
    """
    lines = text.splitlines()
    launcher, label = _stream(lines)
    columns: list[str] | None = None
    rows: list[NcclRow] = []
    avg: float | None = None
    oob: int | None = None
    validation: int | None = None
    program: str | None = None
    rank_ids: list[int] = []
    rank_list_cut = False
    unread: list[list[str]] = []  # row-shaped lines that are not rows
    for line in lines:
        line_launcher, line_label, rest = split_prefix(line)
        if launcher is not None and (line_launcher, line_label) != (launcher, label):
            continue  # another rank, stderr, or the launcher's own text
        stripped = rest.strip()
        if stripped.startswith("#"):
            body = stripped.lstrip("#").split()
            if _is_header(body):
                columns = body
            elif stripped.startswith("# Avg bus bandwidth"):
                avg = _after_colon(stripped, float, "Avg bus bandwidth")
            elif stripped.startswith("# Out of bounds values"):
                oob = _after_colon(stripped, int, "Out of bounds values")
            elif (m := _RANK.match(stripped)) is not None:
                rank_ids.append(int(m.group(1)))
                # util.cu cuts a process's device list at 2048 characters with "..."
                rank_list_cut = rank_list_cut or stripped.endswith("...")
            elif (m := _PROGRAM.match(stripped)) is not None:
                program = m.group(1)
            if (m := _VALIDATION.search(stripped)) is not None and "nThread" in stripped:
                validation = int(m.group(1))
            continue
        if columns is None or not stripped:
            continue
        tokens = stripped.split()
        row = _row(columns, tokens)
        if row is not None:
            rows.append(row)
        elif tokens[0].isdigit():  # a line that starts like a row and is not one
            unread.append(tokens)
    if columns is None:
        raise ParseError(
            "no all_reduce_perf table header (# size count type redop ...) in the output"
        )
    _refuse_unread(columns, rows, unread, ended=avg is not None)
    if avg is None:
        raise ParseError(
            f"all_reduce_perf output ends after {len(rows)} rows without "
            "'# Avg bus bandwidth': the run was cut off (killed, timed out, or a rank died "
            "mid-run); the rows before the cut are not a whole run"
        )
    ranks = _ranks(rank_ids, rank_list_cut)
    _check_all_reduce(rows, program, ranks)
    wrongs_printed = [r for r in rows if r.max_error is not None or r.wrong is not None]
    validated = (
        False
        if validation == 0 or (not wrongs_printed and "#wrong" in columns)
        else True
        if validation or wrongs_printed
        else None
    )
    return NcclTable(
        rows=rows,
        avg_busbw_gbps=avg,
        out_of_bounds=oob if validated is not False else None,
        validated=validated,
        ranks=ranks,
        program=program,
        launcher_prefix=launcher,
    )


_Number = TypeVar("_Number", int, float)


def _after_colon(line: str, kind: Callable[[str], _Number], what: str) -> _Number:
    try:
        return kind(line.split(":", 1)[1].split()[0])
    except (IndexError, ValueError) as err:
        raise ParseError(
            f"all_reduce_perf line {line!r}: expected a number after '{what} :'"
        ) from err


def _ranks(ids: list[int], cut: bool) -> int | None:
    """The rank count when the "#  Rank" lines list every rank exactly once (0..n-1)."""
    if not ids or cut or sorted(ids) != list(range(len(ids))):
        return None
    return len(ids)


def _row(columns: list[str], tokens: list[str]) -> NcclRow | None:
    """One result row, or None for a line that is not one (an interleaved NCCL INFO line,
    a half-written last line)."""
    timestamp = None
    if columns[-1] == "timestamp":
        if len(tokens) != len(columns) + 1:
            return None
        timestamp = " ".join(tokens[-2:])
        tokens, columns = tokens[:-2], columns[:-1]
    if len(tokens) != len(columns) or not (tokens[0].isdigit() and tokens[1].isdigit()):
        return None
    first: dict[str, str] = {}
    second: dict[str, str] = {}
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
    time_key = "time" if "time" in first else "cputime" if "cputime" in first else None
    if time_key is None:
        raise ParseError(f"all_reduce_perf header {' '.join(columns)!r} has no time column")
    try:
        time_value = float(first[time_key])
        return NcclRow(
            size_bytes=int(first["size"]),
            count=int(first["count"]),
            dtype=first["type"],
            time_us=time_value if time_key == "time" else None,
            cputime_us=time_value if time_key == "cputime" else None,
            algbw_gbps=float(first["algbw"]),
            busbw_gbps=float(first["busbw"]),
            wrong=wrong,
            max_error=max_error,
            inplace_busbw_gbps=_num(second.get("busbw", "N/A")),
            inplace_wrong=inplace_wrong,
            redop=first.get("redop", "sum"),
            timestamp=timestamp,
        )
    except (KeyError, ValueError):
        raise ParseError(_edited(columns, tokens)) from None


#: what each column holds: a count, a figure, a word; ``#wrong`` and ``error`` may be N/A
_INT_COLUMNS = frozenset({"size", "count", "root"})
_WORD_COLUMNS = frozenset({"type", "redop"})


def _cell_fits(name: str, token: str) -> bool:
    if name in _INT_COLUMNS:
        return re.fullmatch(r"-?\d+", token) is not None
    if name in _WORD_COLUMNS:
        return re.fullmatch(r"[a-z][a-z0-9_]*", token) is not None
    if name in ("#wrong", "error") and token == "N/A":
        return True
    return _num(token) is not None


def _edited(columns: list[str], tokens: list[str]) -> str:
    """The refusal of a row with a cell that cannot be what its column prints."""
    names = columns[:-1] if columns[-1] == "timestamp" else columns
    bad = [(n, t) for n, t in zip(names, tokens, strict=False) if not _cell_fits(n, t)]
    cell = f"the {bad[0][0]} cell is {bad[0][1]!r}" if bad else "a cell does not fit its column"
    return (
        f"all_reduce_perf row {' '.join(tokens)[:160]!r}: {cell}, which nccl-tests never "
        "prints there: the row was edited or corrupted after the run"
    )


def _refuse_unread(
    columns: list[str], rows: list[NcclRow], unread: list[list[str]], ended: bool
) -> None:
    """Refuse a table with lines that start like a row and are not one, naming why: another
    collective's table (its rows leave the ``redop`` column empty, as alltoall_perf before
    nccl-tests 2.11 did), an edited cell, or a last row cut off mid-line; and a header with no
    row under it, which is a run that ended before its first size, not a cut-off table."""
    if "redop" not in columns or "type" not in columns:
        raise ParseError(
            f"the table header ({' '.join(columns)[:100]!r}) has no type and redop columns, which "
            "all_reduce_perf always prints: this is another tool's or collective's table "
            "(mscclpp-test's alltoall prints none), and its busbw is not all-reduce bus bandwidth"
        )
    width = len(columns) + (1 if columns[-1] == "timestamp" else 0)
    short = [t for t in unread if len(t) < width]
    if "redop" in columns and short and all(_no_redop(columns, t) for t in short):
        if len(short) > 1 or rows or ended:
            raise ParseError(
                f"{len(short)} row(s) leave the redop column empty ({' '.join(short[0])[:120]!r}):"
                " this is another collective's table (alltoall, all_gather and broadcast "
                "print no reduction), not all_reduce_perf's; its busbw is not all-reduce "
                "bus bandwidth"
            )
    full = [t for t in unread if len(t) == width]
    if full:
        raise ParseError(_edited(columns, full[0]))
    if unread and not ended and len(unread[-1]) < width:
        raise ParseError(
            f"all_reduce_perf output is cut off inside a row ({len(unread[-1])} of {width} "
            f"fields: {' '.join(unread[-1])[:120]!r}) after {len(rows)} whole row(s): the run "
            "was killed or its output truncated mid-line"
        )
    if unread:
        raise ParseError(
            f"all_reduce_perf line {' '.join(unread[0])[:120]!r} starts like a result row but "
            f"has {len(unread[0])} fields where the header has {width}: the table was edited "
            "or two outputs were mixed"
        )
    if not rows:
        raise ParseError(
            "all_reduce_perf printed its table header and no result row under it: the run "
            "ended before its first message size completed (killed, timed out, or hung in "
            "the first collective); read the launcher's log for why"
        )


def _no_redop(columns: list[str], tokens: list[str]) -> bool:
    """Whether ``tokens`` is a row of ``columns`` with the redop cell left empty."""
    at = columns.index("redop")
    names = columns[:at] + columns[at + 1 :]
    if columns[-1] == "timestamp":
        names, tokens = names[:-1], tokens[: len(names) - 1]
    return len(tokens) == len(names) and all(
        _cell_fits(n, t) for n, t in zip(names, tokens, strict=True)
    )


def _check_all_reduce(rows: list[NcclRow], program: str | None, ranks: int | None) -> None:
    """Refuse a table that is not all-reduce's, or whose figures contradict each other."""
    if program is not None and "all_reduce" not in program:
        raise ParseError(
            f"this is {program} output, not all_reduce_perf: its busbw is "
            "computed with another factor"
        )
    if any(r.redop == _NO_REDUCTION for r in rows):
        raise ParseError(
            "the table's redop is 'none', which all_reduce_perf never prints "
            "(alltoall, all_gather, broadcast and sendrecv do): this is another "
            "collective's output and its busbw is not all-reduce bus bandwidth"
        )
    for row in rows:
        if row.time_us is None or row.time_us <= 0:
            continue
        expected = row.size_bytes / row.time_us / 1e3  # bytes/us -> GB/s (10^9 B/s)
        # time is printed to 4+ significant digits and algbw to 2 decimals
        if abs(row.algbw_gbps - expected) > 0.011 + 0.002 * expected:
            raise ParseError(
                f"all_reduce_perf row of {row.size_bytes} B: algbw {row.algbw_gbps:g} GB/s "
                f"but size / time = {expected:.2f} GB/s: the row is misaligned or edited"
            )
    if ranks is not None:
        factor = 2 * (ranks - 1) / ranks
        for row in rows:
            if row.algbw_gbps < 1.0:
                continue  # too few printed digits to compare
            if abs(row.busbw_gbps - row.algbw_gbps * factor) > 0.011 + 0.002 * row.busbw_gbps:
                raise ParseError(
                    f"all_reduce_perf row of {row.size_bytes} B: busbw {row.busbw_gbps:g} / "
                    f"algbw {row.algbw_gbps:g} is not all-reduce's 2(n-1)/n = {factor:g} for "
                    f"the {ranks} ranks listed: another collective's table, or an edited one"
                )
