"""Under CI, a test that skips because the real-world samples are absent fails instead.

The tests that read published tool output and kernel logs (``../shared/realworld/``, beside the
repository) skip where that folder is absent, saying where they looked: right for a user's clone,
which does not have it. Under CI the folder is part of the checkout, so its absence means the
run proved less than it claims; this plugin turns such a skip into a failure there.

- "Under CI": the ``CI`` environment variable is set to anything but empty, ``0`` or ``false``
  (any case), as GitHub Actions, GitLab and most runners set it.
- "Because the samples are absent": the skip's reason names the folder (``shared/realworld``).
  A test that skips for another reason must not name it in its reason.

``tests/conftest.py`` loads it for the whole suite; a test file needs nothing of its own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import pytest

#: the folder a skip reason names when the samples were not found
REALWORLD = "shared/realworld"
CI_OFF = ("", "0", "false")


def under_ci(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this run is a CI run: ``CI`` set, and not to empty, ``0`` or ``false``."""
    return environ.get("CI", "").strip().lower() not in CI_OFF


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str | None:
    """The reason of a plain skip (not an expected failure), or None."""
    if not report.skipped or hasattr(report, "wasxfail"):
        return None
    longrepr: Any = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _fail_a_skip_for_missing_samples(report: pytest.TestReport | pytest.CollectReport) -> None:
    reason = _skip_reason(report)
    if reason is None or REALWORLD not in reason or not under_ci():
        return
    report.outcome = "failed"
    report.longrepr = (
        f"{reason}\n"
        f"CI is set (CI={os.environ['CI']!r}): the real-world samples ({REALWORLD}, beside the "
        "repository) must be present, so a test that would skip without them fails instead "
        "(tests/realworld_ci.py)"
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    report = yield
    _fail_a_skip_for_missing_samples(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    """A module that skips as a whole (``pytest.skip(..., allow_module_level=True)``)."""
    report = yield
    _fail_a_skip_for_missing_samples(report)
    return report
