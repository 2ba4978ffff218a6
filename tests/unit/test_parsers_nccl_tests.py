"""nccl-tests all_reduce_perf tables: current (#wrong, root) and older (error) columns."""

from __future__ import annotations

from pathlib import Path

import pytest

from node_agent.compute.allreduce import bandwidths, bus_factor
from node_agent.parsers import ParseError
from node_agent.parsers.nccl_tests import parse_all_reduce_perf

DATA = Path(__file__).resolve().parents[1] / "data" / "nccl_tests"


def test_current_table_rows_and_average():
    table = parse_all_reduce_perf((DATA / "all_reduce_perf_ok.txt").read_text())
    assert [r.size_bytes for r in table.rows] == [
        8,
        1024,
        1048576,
        67108864,
        1073741824,
        8589934592,
    ]
    last = table.rows[-1]
    assert (last.time_us, last.algbw_gbps, last.busbw_gbps) == (36598, 234.71, 410.75)
    assert last.inplace_busbw_gbps == 410.94
    assert all(r.wrong == 0 for r in table.rows)
    assert table.avg_busbw_gbps == pytest.approx(191.6045)
    assert table.out_of_bounds == 0


def test_wrong_column_counts_wrong_elements():
    table = parse_all_reduce_perf((DATA / "all_reduce_perf_wrong.txt").read_text())
    by_size = {r.size_bytes: r for r in table.rows}
    assert by_size[1073741824].wrong == 1024
    assert by_size[1073741824].inplace_wrong == 1024
    assert sum(r.wrong for r in table.rows) == 1024
    assert table.out_of_bounds == 2048


def test_older_error_column_keeps_max_error_and_out_of_bounds():
    table = parse_all_reduce_perf((DATA / "all_reduce_perf_error_col.txt").read_text())
    assert len(table.rows) == 5
    assert table.rows[-1].busbw_gbps == 181.74
    assert all(r.wrong is None and r.max_error == 0.0 for r in table.rows)
    assert table.out_of_bounds == 0


def test_indented_mpirun_tag_reads_the_same_table():
    """all_reduce_perf_ok.txt as ``mpirun --tag-output`` saved it with the tag indented
    (``   [1,0]<stdout>:``), which was refused as "no table header" (issue 24)."""
    tagged = parse_all_reduce_perf((DATA / "all_reduce_perf_indented_tag.txt").read_text())
    plain = parse_all_reduce_perf((DATA / "all_reduce_perf_ok.txt").read_text())
    assert tagged.rows == plain.rows and tagged.avg_busbw_gbps == plain.avg_busbw_gbps
    assert tagged.launcher_prefix == "mpirun --tag-output"


def test_truncated_table_raises_parse_error():
    with pytest.raises(ParseError, match="cut off"):
        parse_all_reduce_perf((DATA / "all_reduce_perf_truncated.txt").read_text())


#: nccl-tests issue 78 (github.com/NVIDIA/nccl-tests/issues/78): alltoall_perf of a release
#: that left the redop cell empty under the all-reduce header
ALLTOALL_NO_REDOP = """\
#                                                       out-of-place                       in-place
#       size         count      type   redop     time   algbw   busbw  error     time   algbw   busbw  error
#        (B)    (elements)                       (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
   268435456       1048576     float           520935    0.52    0.51  0e+00   519562    0.52    0.51  1e+00
   536870912       2097152     float          1041974    0.52    0.51  0e+00  1041299    0.52    0.51  1e+00
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 0.507636
"""


def test_alltoall_table_without_redop_is_refused_as_another_collective():
    with pytest.raises(ParseError, match="leave the redop column empty.*another collective"):
        parse_all_reduce_perf(ALLTOALL_NO_REDOP)


def test_one_edited_cell_is_refused_as_edited_not_truncated():
    text = (DATA / "all_reduce_perf_ok.txt").read_text().replace("172.74", "172.7a")
    with pytest.raises(ParseError, match="the algbw cell is '172.7a'.*edited"):
        parse_all_reduce_perf(text)


def test_header_with_no_rows_says_the_run_ended_before_its_first_size():
    text = (DATA / "all_reduce_perf_truncated.txt").read_text()
    header_only = text[: text.index("           8 ")]
    with pytest.raises(ParseError, match="header and no result row.*before its first"):
        parse_all_reduce_perf(header_only)


def test_row_cut_mid_line_is_refused_as_cut_off():
    text = (DATA / "all_reduce_perf_truncated.txt").read_text()
    with pytest.raises(ParseError, match="cut off inside a row \\(11 of 13 fields"):
        parse_all_reduce_perf(text[: text.index("17.13") + 5] + "\n")


def test_the_four_refusals_are_four_different_messages():
    ok = (DATA / "all_reduce_perf_ok.txt").read_text()
    cut = (DATA / "all_reduce_perf_truncated.txt").read_text()
    said = set()
    for text in (
        ALLTOALL_NO_REDOP,
        ok.replace("172.74", "172.7a"),
        cut[: cut.index("    8 ")],
        cut,
    ):
        with pytest.raises(ParseError) as err:
            parse_all_reduce_perf(text)
        said.add(str(err.value)[:40])
    assert len(said) == 4


def test_output_without_header_raises_parse_error():
    with pytest.raises(ParseError, match="no all_reduce_perf table header"):
        parse_all_reduce_perf("NCCL WARN Cuda failure 'out of memory'\n")


@pytest.mark.parametrize("n, factor", [(2, 1.0), (4, 1.5), (8, 1.75)])
def test_busbw_factor_matches_nccl_tests(n, factor):
    assert bus_factor(n) == factor
    algbw, busbw = bandwidths(2_000_000_000, 0.5, n)
    assert algbw == 4.0
    assert busbw == 4.0 * factor


def test_bus_factor_reproduces_the_captured_table():
    # nccl-tests' own figures for 8 GPUs: busbw = algbw * 2*7/8 (to its print precision)
    table = parse_all_reduce_perf((DATA / "all_reduce_perf_ok.txt").read_text())
    for row in table.rows[2:]:
        assert row.busbw_gbps == pytest.approx(row.algbw_gbps * bus_factor(8), abs=0.01)
        assert row.algbw_gbps == pytest.approx(
            row.size_bytes / (row.time_us * 1e-6) / 1e9, rel=2e-3
        )


# -- real tables other people published (tests/data/realworld/collective_tables/PROVENANCE.md) --

REAL = Path(__file__).resolve().parents[1] / "data" / "realworld" / "collective_tables"


def test_real_alltoall_without_redop_is_refused_as_another_collective():
    text = (REAL / "c01_nccl-tests-78_alltoall_no-redop-cell.txt").read_text()
    with pytest.raises(ParseError, match="leave the redop column empty.*another collective"):
        parse_all_reduce_perf(text)


def test_real_all_reduce_of_the_same_report_is_read():
    table = parse_all_reduce_perf(
        (REAL / "c02_nccl-tests-78_all_reduce_64xV100_error-col.txt").read_text()
    )
    assert [(r.size_bytes, r.busbw_gbps) for r in table.rows] == [
        (268435456, 4.33),
        (536870912, 4.32),
    ]
    assert table.avg_busbw_gbps == pytest.approx(4.32178)


def test_real_mscclpp_alltoall_is_refused_as_another_tools_table():
    text = (REAL / "c03_mscclpp-87_mscclpp-test_alltoall_1n8p.txt").read_text()
    with pytest.raises(ParseError, match="no type and redop columns.*another tool's or collective"):
        parse_all_reduce_perf(text)


def test_one_edited_cell_of_a_real_table_is_refused_as_edited():
    text = (REAL / "c02_nccl-tests-78_all_reduce_64xV100_error-col.txt").read_text()
    with pytest.raises(ParseError, match="the busbw cell is '4.3E'.*edited"):
        parse_all_reduce_perf(text.replace("4.33  2e-06   122165", "4.3E  2e-06   122165"))
