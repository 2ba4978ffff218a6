"""fio --output-format=json parsing, on output captured from fio 3.33 (tests/data/fio)."""

from __future__ import annotations

from pathlib import Path

import pytest

from node_agent.checks.storage import figures
from node_agent.parsers import ParseError
from node_agent.parsers.fio import parse_fio_json

DATA = Path(__file__).resolve().parents[1] / "data" / "fio"


def test_fio_json_jobs_and_bandwidth_in_mb_per_s():
    jobs = parse_fio_json((DATA / "seq_rand_direct.json").read_text())
    assert set(jobs) == {"seqwrite", "seqread", "randread"}
    # the captured figures, from bw_bytes (B/s) divided by 1e6
    assert jobs["seqread"].read_bw_bytes == 1217134074
    assert jobs["seqread"].read_bw_mbps == pytest.approx(1217.134074)
    assert jobs["seqwrite"].write_bw_mbps == pytest.approx(3004.112969)
    assert jobs["randread"].read_iops == pytest.approx(70607.392607)
    values = figures(jobs)
    assert values == {
        "write_bw_mbps": pytest.approx(3004.112969),
        "read_bw_mbps": pytest.approx(1217.134074),
        "randread_iops": pytest.approx(70607.392607),
    }


def test_fio_warning_lines_before_json_are_skipped():
    text = (
        "fio: this platform does not support O_DIRECT\n"
        + (DATA / "seq_rand_direct.json").read_text()
    )
    assert "randread" in parse_fio_json(text)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "fio: engine nosuchengine not loadable\n",
        (DATA / "truncated.json").read_text(),
        '{"jobs": []}',
    ],
)
def test_fio_truncated_or_empty_output_raises_parse_error(text):
    with pytest.raises(ParseError):
        parse_fio_json(text)
