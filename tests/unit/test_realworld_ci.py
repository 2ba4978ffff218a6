"""Under CI a test that skips for want of ``../shared/realworld`` fails; elsewhere it skips with
its reason (tests/realworld_ci.py, loaded by tests/conftest.py for every test)."""

from __future__ import annotations

from pathlib import Path

import pytest
from realworld_ci import under_ci

pytest_plugins = ("pytester",)

TESTS = Path(__file__).resolve().parents[1]

#: the two ways the suite's tests skip without the samples: a skipif mark (here on the module),
#: a pytest.skip in the test's body
SKIPPING = {
    "test_marked": """
        import pytest
        pytestmark = pytest.mark.skipif(
            True, reason="the real H100 capture is not here (/nowhere/shared/realworld/gpu-h100-vm)"
        )
        def test_reads_the_capture():
            pass
        """,
    "test_in_body": """
        import pytest
        def test_reads_a_sample():
            pytest.skip("real-world sample /nowhere/../shared/realworld/nccl/a.txt is not there")
        """,
}

#: a whole module skipped at import (none does today)
MODULE_SKIP = {
    "test_module_level": """
        import pytest
        pytest.skip("/nowhere/shared/realworld/xid is absent", allow_module_level=True)
        def test_never_collected():
            pass
        """
}

#: skips and expected failures that have nothing to do with the samples stay what they are
UNRELATED = {
    "test_unrelated": """
        import pytest
        @pytest.mark.skipif(True, reason="needs an NVIDIA GPU")
        def test_on_a_gpu():
            pass
        def test_without_root():
            pytest.skip("writing /dev/kmsg needs root")
        @pytest.mark.xfail(reason="shared/realworld names a known bug here", strict=True)
        def test_known_bug():
            assert False
        """
}


def run_inner(pytester: pytest.Pytester, files: dict[str, str]) -> pytest.RunResult:
    pytester.syspathinsert(TESTS)
    pytester.makepyfile(**files)
    return pytester.runpytest(
        "-p",
        "realworld_ci",
        "-ra",
        "-p",
        "no:cacheprovider",
        "-W",
        "ignore::pytest.PytestAssertRewriteWarning",  # realworld_ci is imported already
    )


@pytest.mark.parametrize("value", ["true", "1"])
def test_under_ci_a_skip_for_missing_samples_fails_the_run(pytester, monkeypatch, value):
    monkeypatch.setenv("CI", value)
    result = run_inner(pytester, SKIPPING)
    # the mark fails the test's setup (an error), the body's skip the test
    result.assert_outcomes(failed=1, errors=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    out = result.stdout.str()
    for reason in (
        "the real H100 capture is not here (/nowhere/shared/realworld/gpu-h100-vm)",
        "real-world sample /nowhere/../shared/realworld/nccl/a.txt is not there",
    ):
        assert reason in out
    assert out.count(f"CI is set (CI={value!r})") >= 2 and "must be present" in out


def test_under_ci_a_module_skipped_for_missing_samples_is_a_collection_error(pytester, monkeypatch):
    monkeypatch.setenv("CI", "true")
    result = run_inner(pytester, {**MODULE_SKIP, **SKIPPING})
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(
        ["ERROR test_module_level.py - Skipped: /nowhere/shared/realworld/xid is absent"]
    )
    assert "CI is set (CI='true')" in result.stdout.str()


@pytest.mark.parametrize("value", [None, "false"])
def test_outside_ci_a_skip_for_missing_samples_stays_a_skip_with_its_reason(
    pytester, monkeypatch, value
):
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    result = run_inner(pytester, {**MODULE_SKIP, **SKIPPING})
    result.assert_outcomes(skipped=3)
    assert result.ret == pytest.ExitCode.OK
    for line in (
        "SKIPPED * the real H100 capture is not here (/nowhere/shared/realworld/gpu-h100-vm)",
        "SKIPPED * real-world sample /nowhere/../shared/realworld/nccl/a.txt is not there",
        "SKIPPED * /nowhere/shared/realworld/xid is absent",
    ):
        result.stdout.fnmatch_lines([line])


def test_under_ci_other_skips_and_expected_failures_are_left_alone(pytester, monkeypatch):
    monkeypatch.setenv("CI", "true")
    result = run_inner(pytester, UNRELATED)
    result.assert_outcomes(skipped=2, xfailed=1)
    assert result.ret == 0


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, False),
        ({"CI": ""}, False),
        ({"CI": "0"}, False),
        ({"CI": "false"}, False),
        ({"CI": " FALSE "}, False),
        ({"CI": "true"}, True),
        ({"CI": "1"}, True),
        ({"CI": "woodpecker"}, True),
    ],
)
def test_ci_is_any_value_but_empty_0_or_false(environ, expected):
    assert under_ci(environ) is expected
