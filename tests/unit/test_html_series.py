"""Trace series in the HTML report: a missing reading is a gap, not a lost plot."""

import math

from node_agent.report.html import _series


def test_trace_with_missing_readings_keeps_its_numbers_as_a_gapped_series():
    # the burn's trace has no TFLOP/s before its first window: [None, 690.0, ...]
    ys = _series({"tflops": [None, 690.0, 345.0]}, "tflops")
    assert ys is not None and math.isnan(ys[0]) and ys[1:] == [690.0, 345.0]


def test_series_with_no_number_or_a_non_number_is_not_plotted():
    assert _series({"tflops": [None, None]}, "tflops") is None
    assert _series({"tflops": [1.0, "hot"]}, "tflops") is None
    assert _series({}, "tflops") is None
