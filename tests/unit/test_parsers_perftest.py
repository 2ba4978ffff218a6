"""perftest (ib_write_bw) table and --out_json parsing, in every bandwidth unit it prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from node_agent.parsers import ParseError
from node_agent.parsers.perftest import parse_bw_json, parse_bw_table, to_gbps

DATA = Path(__file__).resolve().parents[1] / "data" / "perftest"
MIB_TO_GBPS = 1048576 * 8 / 1e9


@pytest.mark.parametrize(
    "name, size, iters, avg_gbps, unit",
    [
        ("ib_write_bw_gbits.txt", 65536, 3707100, 388.72, "Gb/sec"),
        ("ib_write_bw_mb.txt", 65536, 5000, 11030.45 * MIB_TO_GBPS, "MB/sec"),
        ("ib_write_bw_mib_roce.txt", 65536, 279928, 5830.79 * MIB_TO_GBPS, "MiB/sec"),
    ],
)
def test_bw_table_converts_each_unit_to_gbps(name, size, iters, avg_gbps, unit):
    (row,) = parse_bw_table((DATA / name).read_text())
    assert row.msg_size_bytes == size
    assert row.iterations == iters
    assert row.bw_avg_gbps == pytest.approx(avg_gbps)
    assert row.unit_reported == unit


def test_duration_mode_zero_peak_is_none_not_zero():
    (row,) = parse_bw_table((DATA / "ib_write_bw_gbits.txt").read_text())
    assert row.bw_peak_gbps is None
    (row,) = parse_bw_table((DATA / "ib_write_bw_mb.txt").read_text())
    assert row.bw_peak_gbps == pytest.approx(11030.78 * MIB_TO_GBPS)


def test_header_with_no_rows_says_the_run_ended_before_its_first_measurement():
    with pytest.raises(ParseError, match="header and no result row.*before its first"):
        parse_bw_table((DATA / "ib_write_bw_truncated.txt").read_text())


def test_row_cut_mid_line_is_refused_as_truncated():
    text = (DATA / "ib_write_bw_mb.txt").read_text()
    cut = text[: text.index("11030.45") + len("11030.45")]
    with pytest.raises(ParseError, match="truncated inside a row \\(4 of 5 fields"):
        parse_bw_table(cut)


def test_one_edited_cell_is_refused_as_edited_not_truncated():
    text = (DATA / "ib_write_bw_mb.txt").read_text().replace("11030.45", "11030.4S")
    with pytest.raises(ParseError, match="BW average\\[MB/sec\\] cell is '11030.4S'.*edited"):
        parse_bw_table(text)


def test_latency_table_is_refused_as_another_test():
    text = (
        " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]\n"
        " 2       1000          1.03           3.56         1.06               1.07\n"
    )
    with pytest.raises(ParseError, match="latency table.*not a bandwidth run"):
        parse_bw_table(text)


def test_the_four_refusals_are_four_different_messages():
    header = (DATA / "ib_write_bw_truncated.txt").read_text()
    full = (DATA / "ib_write_bw_mb.txt").read_text()
    said = set()
    for text in (
        header,
        full[: full.index("11030.45") + 8],
        full.replace("11030.45", "11030.4S"),
        " #bytes #iterations t_min[usec] t_max[usec]\n 2 1000 1.03 3.56\n",
    ):
        with pytest.raises(ParseError) as err:
            parse_bw_table(text)
        said.add(str(err.value).split(":")[0])
    assert len(said) == 4


def test_output_without_table_raises_parse_error():
    with pytest.raises(ParseError, match="no perftest result table"):
        parse_bw_table(
            " Couldn't connect to 127.0.0.1:18515\nUnable to open file descriptor "
            "for socket connection"
        )


def test_out_json_results():
    row = parse_bw_json((DATA / "ib_write_bw_out.json").read_text())
    assert (row.msg_size_bytes, row.iterations) == (65536, 3707100)
    assert row.bw_avg_gbps == pytest.approx(388.72)
    assert row.bw_peak_gbps is None


def test_truncated_out_json_raises_parse_error():
    with pytest.raises(ParseError, match="truncated"):
        parse_bw_json((DATA / "ib_write_bw_out_truncated.json").read_text())


def test_unknown_unit_raises_parse_error():
    with pytest.raises(ParseError, match="unknown perftest bandwidth unit"):
        to_gbps(1.0, "KB/sec")


# -- real tables other people published (tests/data/realworld/collective_tables/PROVENANCE.md) --

REAL = Path(__file__).resolve().parents[1] / "data" / "realworld" / "collective_tables"
SWEEP = "c04_perftest-132_write_bw_-a_gbits_first-rows.txt"
RDMA_CM = "c05_perftest-pr342_write_bw_rdma-cm_first-row.txt"


@pytest.mark.parametrize("name, rows, last_gbps", [(SWEEP, 3, 0.17), (RDMA_CM, 1, 42.31)])
def test_real_tables_are_read_and_cross_checked(name, rows, last_gbps):
    read = parse_bw_table((REAL / name).read_text())
    assert len(read) == rows and read[-1].bw_avg_gbps == pytest.approx(last_gbps)
    assert all(r.cross_checked for r in read)


def test_the_real_tables_refused_for_each_cause_say_which():
    sweep = (REAL / SWEEP).read_text()
    header_only = (REAL / RDMA_CM).read_text().rsplit("\n 65536", 1)[0] + "\n"
    with pytest.raises(ParseError, match="header and no result row"):
        parse_bw_table(header_only)
    with pytest.raises(ParseError, match="truncated inside a row \\(3 of 5 fields"):
        parse_bw_table(sweep[: sweep.index("0.17   ") + 4])
    with pytest.raises(ParseError, match="the #iterations cell is '5O00'.*edited"):
        parse_bw_table(sweep.replace(" 4          5000 ", " 4          5O00 "))
