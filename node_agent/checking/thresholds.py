"""A check's judging numbers that do not depend on the SKU: ``graders/<topic>.yaml``.

Each threshold has one home (docs/thresholds.md): the shipped topic file holds every key with
the source of its value, and nothing in code defaults one. An operator's ``graders_dir`` may
hold the same file with only the keys it changes: those replace the shipped values one by one
(inside a section too), so an operator's older file keeps working as new keys ship, and a
directory without the file uses the shipped one.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from node_agent.config import Config
from node_agent.resources import graders_dir, shipped_graders_dir
from node_agent.yamlfile import ConfigError, load_yaml

#: the last read of each file, by (path, mtime_ns, size): the daemon runs host checks every
#: minute and the files change only when an operator edits them
_READ: dict[str, tuple[tuple[int, int], Any]] = {}


def load_topic(config: Config, topic: str, schema: dict[str, Any], what: str) -> dict[str, Any]:
    """``graders/<topic>.yaml``: the operator's keys (``config.graders_dir``) over the shipped
    file's. ConfigError naming the file and key when either does not validate against
    ``schema`` (which requires no key: the shipped file is complete, tests/unit/
    test_threshold_homes.py holds that)."""
    shipped = shipped_graders_dir() / f"{topic}.yaml"
    data = _read(shipped, schema, what)
    own = graders_dir(config) / f"{topic}.yaml"
    if own.is_file() and own.resolve() != shipped.resolve():
        data = merged(data, _read(own, schema, what))
    return copy.deepcopy(data)  # the cached reads stay as read


def merged(shipped: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """``own`` over ``shipped``, mapping by mapping (a list or number replaces the whole value).

    >>> merged({"memory": {"a": 1, "b": 2}, "c": 3}, {"memory": {"b": 5}})
    {'memory': {'a': 1, 'b': 5}, 'c': 3}
    """
    out = dict(shipped)
    for key, value in own.items():
        before = out.get(key)
        if isinstance(before, dict) and isinstance(value, dict):
            value = merged(before, value)
        out[key] = value
    return out


def _read(path: Path, schema: dict[str, Any], what: str) -> dict[str, Any]:
    try:
        st = path.stat()
    except OSError:
        st = None
    if st is not None:
        cached = _READ.get(str(path))
        if cached is not None and cached[0] == (st.st_mtime_ns, st.st_size):
            data: dict[str, Any] = cached[1]
            return data
    loaded = load_yaml(path, schema, what=what, empty_ok=True)
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: {what} must be a mapping of keys to thresholds")
    if st is not None:
        _READ[str(path)] = ((st.st_mtime_ns, st.st_size), loaded)
    return loaded


def refuse_thresholds(check: str, raw: Mapping[str, Any], keys: Iterable[str], home: str) -> None:
    """ValueError when a suite's ``params`` for ``check`` carry one of ``keys``: judging numbers
    that moved to ``home`` (a suite says how to run, never how to judge). The suite's loader
    turns it into exit 2 naming the suite, the check and the key; nothing runs."""
    moved = sorted(set(raw) & set(keys))
    if moved:
        one = len(moved) == 1
        where = home + (
            " (an operator's graders_dir holds the keys it changes)"
            if home.startswith("graders/")
            else ""
        )
        raise ValueError(
            f"params of {check}: {', '.join(moved)} {'judges' if one else 'judge'} the check's "
            f"figures and {'is' if one else 'are'} read from {where}, never from a suite: move "
            f"{'it' if one else 'them'} there"
        )
