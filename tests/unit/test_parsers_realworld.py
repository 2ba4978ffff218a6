"""The tool-output parsers on real output other people published (../shared/realworld/).

Every sample in the nccl, perftest, fio and dcgm folders is either read to the figures written
below, which were checked by hand against the file (and, where the tool prints a quantity
twice, against its other figure: perftest's MsgRate x size, fio's io_bytes / runtime,
nccl-tests' size / time), or refused with a reason that says what is wrong with it. The
samples are read where they lie, never copied; where the folder is absent the tests skip
saying so. Each folder's PROVENANCE.md says where every file comes from.

Variants nobody has published a capture of (nccl-tests ``-C 1``, ``-S 1``, several tagged
ranks) are made here from a real sample by the change nccl-tests' src/util.cu makes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from node_agent.parsers import ParseError
from node_agent.parsers.dcgm_diag import error_name, parse_diag_json
from node_agent.parsers.fio import parse_fio_json
from node_agent.parsers.nccl_tests import parse_all_reduce_perf
from node_agent.parsers.perftest import parse_bw_json, parse_bw_table

REALWORLD = Path(__file__).resolve().parents[2] / ".." / "shared" / "realworld"
MIB = 1048576 * 8 / 1e9  # Gb/s per MiB/s


def sample(folder: str, name: str) -> str:
    path = REALWORLD / folder / name
    if not path.exists():
        pytest.skip(
            f"real-world sample {path} is not there (the shared samples folder is "
            "absent from this checkout)"
        )
    return path.read_text(encoding="utf-8")


def sample_names(folder: str) -> set[str]:
    directory = REALWORLD / folder
    if not directory.is_dir():
        pytest.skip(f"{directory} is absent: no real-world samples to check")
    return {p.name for p in directory.iterdir() if p.name != "PROVENANCE.md"}


# ---------------------------------------------------------------- nccl-tests all_reduce_perf

#: name -> (rows, last row (size, time_us, algbw, busbw, in-place busbw), avg busbw,
#:          ranks listed, validated, launcher prefix)
NCCL_READ = {
    "n01_gcm_single_node_8xA100_nccl2.16.txt": (
        6,
        (1073741824, 8109.1, 132.41, 231.72, 231.70),
        210.99,
        8,
        True,
        None,
    ),
    "n02_gcm_two_node_16xA100_nccl2.12.txt": (
        6,
        (1073741824, 11013.0, 97.50, 182.80, 181.39),
        150.209,
        16,
        True,
        None,
    ),
    "n04_nccl-ebpf_tag-output_nccl-tests2.18_rtx5090.txt": (
        8,
        (134217728, 58479.5, 2.30, 2.30, 2.31),
        1.57614,
        2,
        True,
        "mpirun --tag-output",
    ),
    "n05_azureml-gpu-diag_K80_error-col_info-line.txt": (
        7,
        (2147483648, 1258554.0, 1.71, 2.56, 2.56),
        2.54225,
        4,
        True,
        None,
    ),
    "n06_aws-efa-eks_2node_error-col_nccl-info.txt": (
        29,
        (2147483648, 826687.0, 2.60, 2.60, 2.59),
        1.16154,
        None,
        True,
        None,
    ),
    "n07_nccl-tests-290_single-node_8xH100.txt": (
        6,
        (4294967296, 15870.0, 270.63, 473.60, 476.53),
        439.369,
        8,
        True,
        None,
    ),
    "n08_nccl-tests-290_two-node_16xH100_srun-label_c0-NA.txt": (
        11,
        (8589934592, 103530.0, 82.97, 155.57, 155.56),
        142.735,
        16,
        False,
        "srun --label",
    ),
    "n09_awsome-distributed-training_p4de_srun-label_25MB.txt": (
        1,
        (26214400, 2009.1, 13.05, 24.46, 26.23),
        25.3468,
        None,
        True,
        "srun --label",
    ),
}
NCCL_REFUSED = {
    "n03_gcm_mpirun_not_enough_slots.txt": "no all_reduce_perf table header",
    "n10_nccl-tests-287_alltoall_rtx5090_inplace-NA.txt": "redop is 'none'.*another collective",
}


def test_every_nccl_sample_has_an_expectation():
    assert sample_names("nccl") == set(NCCL_READ) | set(NCCL_REFUSED)


@pytest.mark.parametrize("name", sorted(NCCL_READ))
def test_nccl_sample_read_to_hand_checked_figures(name):
    rows, last, avg, ranks, validated, launcher = NCCL_READ[name]
    table = parse_all_reduce_perf(sample("nccl", name))
    assert len(table.rows) == rows
    r = table.rows[-1]
    assert (
        r.size_bytes,
        r.time_us,
        r.algbw_gbps,
        r.busbw_gbps,
        r.inplace_busbw_gbps,
    ) == pytest.approx(last)
    assert table.avg_busbw_gbps == pytest.approx(avg)
    assert (table.ranks, table.validated, table.launcher_prefix) == (ranks, validated, launcher)
    sizes = [row.size_bytes for row in table.rows]
    assert sizes == sorted(sizes)  # nothing from another rank's lines or an INFO line


@pytest.mark.parametrize("name", sorted(NCCL_REFUSED))
def test_nccl_sample_refused_with_reason(name):
    with pytest.raises(ParseError, match=NCCL_REFUSED[name]):
        parse_all_reduce_perf(sample("nccl", name))


def test_validation_off_claims_no_correctness():
    # n08 ran with validation 0: '#wrong' is N/A, yet nccl-tests prints "Out of bounds : 0 OK"
    table = parse_all_reduce_perf(sample("nccl", NCCL_N08))
    assert table.out_of_bounds is None
    assert all(r.wrong is None and r.inplace_wrong is None for r in table.rows)


def test_old_error_column_keeps_max_error_and_out_of_bounds():
    table = parse_all_reduce_perf(
        sample("nccl", "n05_azureml-gpu-diag_K80_error-col_info-line.txt")
    )
    assert {r.max_error for r in table.rows} == {2e-07}
    assert table.out_of_bounds == 0 and all(r.wrong is None for r in table.rows)


NCCL_N07 = "n07_nccl-tests-290_single-node_8xH100.txt"
NCCL_N08 = "n08_nccl-tests-290_two-node_16xH100_srun-label_c0-NA.txt"


def _with_cputime(text: str) -> str:
    """-C 1 (util.cu writeResultHeader): the time columns are named cputime; figures alike."""
    return "\n".join(
        re.sub(r"\btime\b", "cputime", line) if "algbw" in line else line
        for line in text.splitlines()
    )


def _with_timestamps(text: str) -> str:
    """-S 1: a 'timestamp' header column, the format in the units line, and a two-token
    '%Y-%m-%d %H:%M:%S' after every row's in-place #wrong (util.cu writeTimestamp)."""
    out = []
    for line in text.splitlines():
        if line.startswith("#") and "algbw" in line:
            line += "  timestamp"
        elif line.startswith("#") and "(GB/s)" in line:
            line += "  %Y-%m-%d %H:%M:%S"
        elif line.strip()[:1].isdigit():
            line += "  2025-01-31 12:00:00"
        out.append(line)
    return "\n".join(out)


def test_cputime_variant_reads_bandwidth_and_keeps_cputime_apart():
    table = parse_all_reduce_perf(_with_cputime(sample("nccl", NCCL_N07)))
    last = table.rows[-1]
    assert (last.busbw_gbps, last.algbw_gbps) == (473.60, 270.63)
    assert last.time_us is None and last.cputime_us == 15870.0
    assert table.avg_busbw_gbps == pytest.approx(439.369)


def test_timestamp_variant_reads_rows_and_timestamps():
    table = parse_all_reduce_perf(_with_timestamps(sample("nccl", NCCL_N07)))
    assert len(table.rows) == 6
    assert table.rows[0].busbw_gbps == 382.99
    assert {r.timestamp for r in table.rows} == {"2025-01-31 12:00:00"}


def test_srun_label_with_cputime_and_timestamps_together():
    text = "\n".join(
        " 0: " + line
        for line in _with_timestamps(_with_cputime(sample("nccl", NCCL_N07))).splitlines()
    )
    table = parse_all_reduce_perf(text)
    assert table.launcher_prefix == "srun --label"
    assert table.rows[-1].busbw_gbps == 473.60 and table.rows[-1].cputime_us == 15870.0


def test_tagged_lines_of_other_ranks_and_stderr_are_not_read():
    text = sample("nccl", "n04_nccl-ebpf_tag-output_nccl-tests2.18_rtx5090.txt")
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if "  4194304 " in line)
    # rank 1 printing a row-shaped line, and an error on rank 0's stderr, inside the table
    lines[at:at] = [
        "[1,1]<stdout>:     4194304       1048576     float     sum      -1  1.00"
        "    9.99    9.99       0  1.00    9.99    9.99       0",
        "[1,0]<stderr>: NCCL WARN something",
    ]
    table = parse_all_reduce_perf("\n".join(lines))
    assert [r.busbw_gbps for r in table.rows if r.size_bytes == 4194304] == [0.96]


NCCL_N04 = "n04_nccl-ebpf_tag-output_nccl-tests2.18_rtx5090.txt"


@pytest.mark.parametrize(
    "lead",
    [
        "   ",  # issue 24: "   [1,0]<stdout>:" saved indented was refused as "no table header"
        "\t",
        "Mon Jun 10 12:00:00 2024",  # a time in front, as --timestamp-output or a collector puts it
        "2024-06-10T12:00:00Z node7 job-17 ",
    ],
)
def test_mpirun_tag_is_read_wherever_it_sits_on_the_line(lead):
    """n04 with something in front of every line's [job,rank]<stream>: tag: the same table."""
    text = sample("nccl", NCCL_N04)
    moved = "\n".join(lead + line if line.startswith("[") else line for line in text.splitlines())
    table = parse_all_reduce_perf(moved)
    expected = parse_all_reduce_perf(text)
    assert table.rows == expected.rows and len(table.rows) == 8
    assert (table.avg_busbw_gbps, table.launcher_prefix) == (
        expected.avg_busbw_gbps,
        "mpirun --tag-output",
    )


def test_indented_srun_label_is_read():
    text = sample("nccl", NCCL_N08)
    table = parse_all_reduce_perf("\n".join("  " + line for line in text.splitlines()))
    assert len(table.rows) == 11 and table.launcher_prefix == "srun --label"


def test_row_whose_algbw_contradicts_size_over_time_is_refused():
    text = sample("nccl", NCCL_N07).replace("270.63  473.60", "170.63  473.60")
    with pytest.raises(ParseError, match="algbw 170.63 GB/s but size / time = 270.63"):
        parse_all_reduce_perf(text)


def test_busbw_ratio_of_another_collective_is_refused():
    # reduce_scatter's busbw is algbw * (n-1)/n: the same n07 rows with that factor
    text = sample("nccl", NCCL_N07).replace("473.60", f"{270.63 * 7 / 8:.2f}")
    with pytest.raises(ParseError, match="not all-reduce's 2\\(n-1\\)/n = 1.75 for the 8 ranks"):
        parse_all_reduce_perf(text)


# -------------------------------------------------------------------------------- perftest

#: name -> (rows, (size, iterations, avg Gb/s, peak Gb/s or None) of the last row,
#:          unit read in, label corrected)
PERFTEST_READ = {
    "p01_glimmer_dgx-spark_roce_D_gbits_4qp.txt": (
        1,
        (1048576, 71244, 99.61, None),
        "Gb/sec",
        False,
    ),
    "p02_perftest-273_postlist_gbits_8B.txt": (1, (8, 224958464, 0.48, None), "Gb/sec", False),
    "p03_nvidia-gpu-operator-docs_gpudirect_sweep_a_indented.txt": (
        23,
        (8388608, 5000, 92.39, 92.39),
        "Gb/sec",
        False,
    ),
    "p04_aks-rdma-doc_rdmacm_tos_4qp_gbits.txt": (1, (65536, 20000, 98.01, 98.01), "Gb/sec", False),
    "p05_send_bw_UD_D10_MBsec_cpufreq-warning.txt": (
        1,
        (4096, 17338400, 11288.12 * MIB, None),
        "MB/sec",
        False,
    ),
    "p06_read_bw_rdmacm_MBsec_cpufreq-warning.txt": (
        1,
        (65536, 1000, 10401.68 * MIB, 10402.09 * MIB),
        "MB/sec",
        False,
    ),
    "p07_perftest-132_sweep_gbits_inc-accuracy_excerpt.txt": (
        4,
        (16, 5000, 0.34, 0.34),
        "Gb/sec",
        False,
    ),
    # header MB/sec, but 0.183585 Mpps x 65536 B = 96.25 Gb/s: the number is Gb/s
    "p10_aws-hpc-doc_D_MBsec_RoCE.txt": (1, (65536, 1101500, 96.25, None), "Gb/sec", True),
}
PERFTEST_REFUSED = {
    "p08_perftest-228_couldnt_connect.txt": "no perftest result table.*Couldn't connect to 192.168.125.211:18515",
}
PERFTEST_JSON = "p09_k8s-e2e_out_json_no-report_gbits.json"


def test_every_perftest_sample_has_an_expectation():
    assert sample_names("perftest") == (
        set(PERFTEST_READ) | set(PERFTEST_REFUSED) | {PERFTEST_JSON}
    )


@pytest.mark.parametrize("name", sorted(PERFTEST_READ))
def test_perftest_table_read_to_hand_checked_figures(name):
    count, (size, iters, avg, peak), unit, corrected = PERFTEST_READ[name]
    rows = parse_bw_table(sample("perftest", name))
    assert len(rows) == count
    last = rows[-1]
    assert (last.msg_size_bytes, last.iterations) == (size, iters)
    assert last.bw_avg_gbps == pytest.approx(avg)
    assert last.bw_peak_gbps == (None if peak is None else pytest.approx(peak))
    assert last.unit_used == unit
    assert (last.unit_note is not None) == corrected
    assert all(r.cross_checked for r in rows)  # every row agreed with MsgRate x size


@pytest.mark.parametrize("name", sorted(PERFTEST_REFUSED))
def test_perftest_sample_refused_with_reason(name):
    with pytest.raises(ParseError, match=PERFTEST_REFUSED[name]):
        parse_bw_table(sample("perftest", name))


def test_label_that_disagrees_with_message_rate_is_corrected_with_the_reason():
    (row,) = parse_bw_table(sample("perftest", "p10_aws-hpc-doc_D_MBsec_RoCE.txt"))
    assert row.unit_reported == "MB/sec"
    assert "labelled MB/sec but 96.25 is Gb/sec" in row.unit_note
    assert row.bw_avg_gbps == pytest.approx(0.183585e6 * 65536 * 8 / 1e9, rel=1e-4)


def test_bandwidth_that_fits_no_unit_is_refused():
    text = sample("perftest", "p04_aks-rdma-doc_rdmacm_tos_4qp_gbits.txt")
    edited = text.replace("98.01              98.01", "98.01              50.00")
    with pytest.raises(ParseError, match="disagrees with its own message rate.*98.01 Gb/s"):
        parse_bw_table(edited)


def test_cpu_frequency_warning_inside_the_table_is_kept():
    (row,) = parse_bw_table(sample("perftest", "p05_send_bw_UD_D10_MBsec_cpufreq-warning.txt"))
    assert row.warnings == (
        "Conflicting CPU frequency values detected: 800.565000 != "
        "3311.538000. CPU Frequency is not max.",
    )


def test_out_json_without_unit_is_read_as_mib_not_gbits():
    # 2229.27 with no unit; MsgRate 0.035668 Mpps x 65536 B = 2229.27 MiB/s = 18.70 Gb/s
    row = parse_bw_json(sample("perftest", PERFTEST_JSON))
    assert (row.msg_size_bytes, row.iterations) == (65536, 5000)
    assert row.bw_avg_gbps == pytest.approx(2229.27 * MIB)
    assert row.bw_avg_gbps == pytest.approx(18.70, abs=0.01)
    assert row.bw_peak_gbps == pytest.approx(5293.52 * MIB)
    assert row.unit_used == "MiB/sec" and "no unit in the output" in row.unit_note


def test_out_json_with_a_wrong_caller_unit_is_corrected():
    row = parse_bw_json(sample("perftest", PERFTEST_JSON), unit="Gb/sec")
    assert row.bw_avg_gbps == pytest.approx(18.70, abs=0.01)
    assert "labelled Gb/sec but 2229.27 is MiB/sec" in row.unit_note


# ------------------------------------------------------------------------------------- fio

#: name -> {job: (read bw_bytes, write bw_bytes, read iops, write iops, runtime ms, error)}
FIO_READ = {
    "f02_virtualclient_fio3.26_readwrite.json": {
        "disk_fill": (149343283, 67267937, 569.699415, 256.606819, 4957, 0)
    },
    "f03_virtualclient_fio3.26_windows_randwrite.json": {
        "fio_randwrite_1GB_4k_d1_th1_direct": (0, 8876980, 0.0, 2167.231601, 120958, 0)
    },
    "f05_virtualclient_fio3.13_errors_prefix.txt": {
        "fiotest": (202249835, 0, 49501.318267, 0.0, 2655, 42)
    },
    # the JSON's 13116864 B/s is the "(13.1MB/s)" of the normal report printed after it
    "f08_cbt_fio3.42_json-plus-normal_trailing_text.txt": {
        "/dev/nvme8n6": (0, 13116864, 0.0, 3201.659668, 10002, 0)
    },
}
FIO_REFUSED = {
    # read: 1071141824 B over 110948 ms is 9654449 B/s, not the 7876980 printed (edited copy)
    "f01_virtualclient_fio3.26_randrw.json": "read: bw_bytes 7876980 B/s, but io_bytes 1071141824 over runtime 110948 ms is "
    "9654449 B/s",
    "f04_virtualclient_fio3.13_randread.json": "is rw=randread but reports 1073741824 bytes written",
    "f06_virtualclient_fio_error_only.txt": "printed errors and no JSON report: fio: pid=4879, err=84/.*and 1 more",
    "f07_virtualclient_fio_verify_error.txt": "printed errors and no JSON report: sha256: verify failed at file "
    "fio_randwrite_1GB_32k_d1_th1_direct.0.0 offset 668565504",
}


def test_every_fio_sample_has_an_expectation():
    assert sample_names("fio") == set(FIO_READ) | set(FIO_REFUSED)


@pytest.mark.parametrize("name", sorted(FIO_READ))
def test_fio_sample_read_to_hand_checked_figures(name):
    jobs = parse_fio_json(sample("fio", name))
    assert set(jobs) == set(FIO_READ[name])
    for job, (rbw, wbw, riops, wiops, runtime, error) in FIO_READ[name].items():
        j = jobs[job]
        assert (j.read_bw_bytes, j.write_bw_bytes, j.runtime_ms, j.error) == (
            rbw,
            wbw,
            runtime,
            error,
        )
        assert (j.read_iops, j.write_iops) == pytest.approx((riops, wiops))


@pytest.mark.parametrize("name", sorted(FIO_REFUSED))
def test_fio_sample_refused_with_reason(name):
    with pytest.raises(ParseError, match=FIO_REFUSED[name]):
        parse_fio_json(sample("fio", name))


def test_fio_error_lines_are_kept_with_the_failed_job():
    job = parse_fio_json(sample("fio", "f05_virtualclient_fio3.13_errors_prefix.txt"))["fiotest"]
    assert job.error == 42
    assert any("err=42" in line and "Illegal byte sequence" in line for line in job.error_lines)


# ------------------------------------------------------------------------------- dcgmi diag

#: name -> (format, DCGM version, results, findings as (test, target, status))
DCGM_READ = {
    "d01_virtualclient_dcgm_r1.json": ("none", None, 9, []),
    "d02_virtualclient_dcgm_r2.json": ("dcgm2", None, 11, []),
    "d03_virtualclient_dcgm_r3.json": ("dcgm2", None, 16, []),
    "d05_glimmer_gb10-level1.json": ("dcgm4", "4.2.3", 1, [("software", "gpu:0", "fail")]),
    "d05_glimmer_gb10-level2-partial-skip.json": (
        "dcgm4",
        "4.2.3",
        3,
        [("software", "gpu:0", "fail")],
    ),
    "d05_glimmer_gb10-level2-plugins-allowed.json": (
        "dcgm4",
        "4.5.2",
        3,
        [("software", "gpu:0", "fail")],
    ),
    "d05_glimmer_gb10-level2-plugins-gated.json": (
        "dcgm4",
        "4.5.2",
        3,
        [("software", "gpu:0", "fail")],
    ),
    "d06_gcm_dcgm2x_fail_warn.json": (
        "none",
        None,
        9,
        [("Persistence Mode", "node", "fail"), ("Environment Variables", "node", "warn")],
    ),
    "d07_gcm_dcgm2x_warn.json": ("none", None, 9, [("Persistence Mode", "node", "warn")]),
}
DCGM_REFUSED = {
    "d04_virtualclient_dcgm_incorrect.json": "'DCGM GPU Diagnostic' is a list",
    "d08_dcgm-issue139_user-elided_r3.json": "malformed at character 67",
    "d09_dcgm-issue253_4.2.3_text_table_excerpt.txt": "text table, not its JSON",
}


def test_every_dcgm_sample_has_an_expectation():
    assert sample_names("dcgm") == set(DCGM_READ) | set(DCGM_REFUSED)


@pytest.mark.parametrize("name", sorted(DCGM_READ))
def test_dcgm_sample_read_to_hand_checked_results(name):
    fmt, version, count, findings = DCGM_READ[name]
    report = parse_diag_json(sample("dcgm", name))
    assert (report.format, report.dcgm_version, len(report.results)) == (fmt, version, count)
    assert [(f.test, f.target, f.status) for f in report.findings] == findings


@pytest.mark.parametrize("name", sorted(DCGM_REFUSED))
def test_dcgm_sample_refused_with_reason(name):
    with pytest.raises(ParseError, match=DCGM_REFUSED[name]):
        parse_diag_json(sample("dcgm", name))


def test_dcgm4_persistence_mode_error_is_decoded():
    report = parse_diag_json(sample("dcgm", "d05_glimmer_gb10-level1.json"))
    (finding,) = report.findings
    (warning,) = finding.warnings
    assert (warning.error_id, warning.severity_name, warning.category_name) == (
        29,
        "CONFIG",
        "SOFTWARE_OTHER",
    )
    assert error_name(warning.error_id) == "DCGM_FR_PERSISTENCE_MODE"
    assert report.driver_version == "580.82.09"
    # the test-wide note DCGM 4 keeps only in test_summary travels with the result
    assert any("SRAM Threshold checking was skipped" in i for i in finding.info)


def test_dcgm2_pcie_info_string_is_kept():
    report = parse_diag_json(sample("dcgm", "d02_virtualclient_dcgm_r2.json"))
    pcie = next(r for r in report.results if r.test == "PCIe")
    assert pcie.target == "gpu:0" and "13.15 GB/s" in pcie.info[0]
