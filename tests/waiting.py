"""Waiting for what another process or thread does: poll until it shows, never sleep a fixed
time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout_s: float, interval_s: float = 0.05) -> T:
    """``predicate()``'s first truthy value within ``timeout_s``, polled every ``interval_s``;
    after that, its value once more (falsy unless it turned true at the last moment)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    return predicate()
