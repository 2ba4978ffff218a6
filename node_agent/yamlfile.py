"""Load and validate the agent's YAML files (config, scenarios, suites, graders, SKUs).

Every problem becomes one :class:`ConfigError` line naming the file, the key and what was
expected, so the CLI can print it and exit 2 without a traceback.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jsonschema
import yaml


class ConfigError(Exception):
    """A configuration, scenario, suite or grader file is unreadable or invalid (exit 2)."""


def _key_path(error: jsonschema.ValidationError) -> str:
    parts = [str(p) for p in error.absolute_path]
    return ".".join(parts) if parts else "(top level)"


def _explain(error: jsonschema.ValidationError) -> str:
    if error.validator == "additionalProperties":
        allowed = sorted((error.schema.get("properties") or {}).keys())
        extra = (
            sorted(set(error.instance) - set(allowed)) if isinstance(error.instance, dict) else []
        )
        if extra:
            where = _key_path(error)
            prefix = "" if where == "(top level)" else where + "."
            return (
                f"unknown key '{prefix}{extra[0]}'; expected one of: "
                f"{', '.join(allowed) or '(none)'}"
            )
    if error.validator == "type":
        expected = error.validator_value
        expected = " or ".join(expected) if isinstance(expected, list) else expected
        return (
            f"key '{_key_path(error)}': expected {expected}, found "
            f"{type(error.instance).__name__} {error.instance!r:.60}"
        )
    if error.validator == "enum":
        return (
            f"key '{_key_path(error)}': {error.instance!r:.60} is not one of "
            f"{', '.join(map(str, error.validator_value))}"
        )
    if error.validator == "required":
        return f"key '{_key_path(error)}': {error.message}"
    return f"key '{_key_path(error)}': {error.message}"


def _non_finite(data: Any, path: tuple[str, ...] = ()) -> tuple[str, float] | None:
    """(key path, value) of the first NaN or infinity in ``data``, else None."""
    if isinstance(data, float) and not math.isfinite(data):
        return ".".join(path) or "(top level)", data
    items: Iterable[tuple[Any, Any]]
    if isinstance(data, dict):
        items = data.items()
    elif isinstance(data, (list, tuple)):
        items = enumerate(data)
    else:
        return None
    for key, value in items:
        found = _non_finite(value, (*path, str(key)))
        if found is not None:
            return found
    return None


def validate(data: Any, schema: dict[str, Any], source: str) -> None:
    """Raise ConfigError with one line for the first (deepest, most specific) schema violation.

    NaN and infinity (YAML ``.nan``, ``.inf``) are refused wherever they appear, whatever the
    schema says: JSON Schema's "number" lets them through, and every comparison with NaN is
    false (a limit of ``.nan`` is no limit, a cadence of ``.nan`` a busy loop)."""
    bad = _non_finite(data)
    if bad is not None:
        raise ConfigError(
            f"{source}: key '{bad[0]}': {bad[1]!r} is not a finite number; "
            "expected a number (.nan and .inf are not accepted)"
        )
    validator = jsonschema.Draft202012Validator(schema)
    errors = list(validator.iter_errors(data))
    if errors:
        best = jsonschema.exceptions.best_match(errors)
        raise ConfigError(f"{source}: {_explain(best)}")


def parse_yaml_text(text: str, source: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{source}:{where}: not valid YAML: {problem}") from err


def load_yaml(
    path: str | Path,
    schema: dict[str, Any] | None = None,
    what: str = "file",
    empty_ok: bool = False,
) -> Any:
    """Read ``path`` as YAML, validate it against ``schema``; ConfigError on any problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: {what} not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: {what} is a directory, expected a YAML file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read {what}: {err}") from err
    data = parse_yaml_text(text, str(path))
    if data is None and empty_ok:
        data = {}
    if schema is not None:
        validate(data, schema, str(path))
    return data
