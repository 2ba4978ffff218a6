"""Load and validate the agent's YAML files (config, scenarios, suites, graders, SKUs).

Every problem becomes one :class:`ConfigError` line naming the file, the key and what was
expected, so the CLI can print it and exit 2 without a traceback. Run as root, the agent reads
these files only where no other user could have written them (:func:`_refuse_foreign`).
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import re
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    import jsonschema


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
    try:
        if conforms(data, schema):
            return
    except _Undecided:
        pass
    import jsonschema  # the error message, or a schema keyword conforms() leaves to it

    validator = jsonschema.Draft202012Validator(schema)
    errors = list(validator.iter_errors(data))
    if errors:
        best = jsonschema.exceptions.best_match(errors)
        raise ConfigError(f"{source}: {_explain(best)}")


# -- a valid file without jsonschema ------------------------------------------------------------
# jsonschema with what it imports (attrs, referencing, rpds, decimal) holds about 4 MiB for the
# life of a process; the daemon loads valid files at start and at each reload and would keep it
# only to hear "valid". conforms() answers that for the keywords the agent's schemas use, with
# Draft 2020-12's meaning (jsonschema's own type and equality rules); a file it finds wrong, or a
# schema with any other keyword, goes to jsonschema, whose best match is the error message.
# tests/unit/test_yamlfile_conforms.py holds it to jsonschema's verdict on every shipped file and
# on broken copies of them.


class _Undecided(Exception):
    """The schema has a keyword :func:`conforms` leaves to jsonschema."""


#: keywords that only annotate (no verdict of their own)
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "$schema"})


def _is_type(value: Any, name: str) -> bool:
    if name == "object":
        return isinstance(value, dict)
    if name == "array":
        return isinstance(value, list)
    if name == "string":
        return isinstance(value, str)
    if name == "boolean":
        return isinstance(value, bool)
    if name == "null":
        return value is None
    if isinstance(value, bool):
        return False
    if name == "number":
        return isinstance(value, numbers.Number)
    if name == "integer":
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    raise _Undecided(f"type {name!r}")


def _equal(one: Any, two: Any) -> bool:
    """JSON equality as jsonschema has it: true and 1 differ, 1 and 1.0 do not."""
    if one is two:
        return True
    if isinstance(one, str) or isinstance(two, str):
        return bool(one == two)
    if isinstance(one, (list, tuple)) and isinstance(two, (list, tuple)):
        return len(one) == len(two) and all(map(_equal, one, two))
    if isinstance(one, dict) and isinstance(two, dict):
        return one.keys() == two.keys() and all(_equal(one[k], two[k]) for k in one)
    if isinstance(one, bool) or isinstance(two, bool):
        return False  # `one is two` answered two equal booleans
    return bool(one == two)


def _number(value: Any) -> bool:
    return isinstance(value, numbers.Number) and not isinstance(value, bool)


def _additional(value: dict[Any, Any], schema: dict[str, Any]) -> list[Any]:
    """The values of ``value``'s keys that neither properties nor patternProperties name."""
    named = schema.get("properties") or {}
    patterns = schema.get("patternProperties") or {}
    return [
        v for k, v in value.items() if k not in named and not any(re.search(p, k) for p in patterns)
    ]


_Keyword = Callable[[Any, Any, dict[str, Any]], bool]
#: keyword -> (value, the keyword's argument, the whole schema) -> whether value satisfies it;
#: each applies only to the JSON type it is about, as in the specification
_KEYWORDS: dict[str, _Keyword] = {
    "type": lambda v, r, s: any(_is_type(v, t) for t in (r if isinstance(r, list) else [r])),
    "enum": lambda v, r, s: any(_equal(v, each) for each in r),
    "const": lambda v, r, s: _equal(v, r),
    "minimum": lambda v, r, s: not _number(v) or v >= r,
    "maximum": lambda v, r, s: not _number(v) or v <= r,
    "exclusiveMinimum": lambda v, r, s: not _number(v) or v > r,
    "exclusiveMaximum": lambda v, r, s: not _number(v) or v < r,
    "pattern": lambda v, r, s: not isinstance(v, str) or re.search(r, v) is not None,
    "minLength": lambda v, r, s: not isinstance(v, str) or len(v) >= r,
    "maxLength": lambda v, r, s: not isinstance(v, str) or len(v) <= r,
    "items": lambda v, r, s: not isinstance(v, list) or all(conforms(x, r) for x in v),
    "minItems": lambda v, r, s: not isinstance(v, list) or len(v) >= r,
    "maxItems": lambda v, r, s: not isinstance(v, list) or len(v) <= r,
    "uniqueItems": lambda v, r, s: (
        not r
        or not isinstance(v, list)
        or not any(_equal(a, b) for i, a in enumerate(v) for b in v[i + 1 :])
    ),
    "required": lambda v, r, s: not isinstance(v, dict) or all(k in v for k in r),
    "minProperties": lambda v, r, s: not isinstance(v, dict) or len(v) >= r,
    "maxProperties": lambda v, r, s: not isinstance(v, dict) or len(v) <= r,
    "properties": lambda v, r, s: (
        not isinstance(v, dict) or all(conforms(v[k], sub) for k, sub in r.items() if k in v)
    ),
    "patternProperties": lambda v, r, s: (
        not isinstance(v, dict)
        or all(conforms(x, sub) for p, sub in r.items() for k, x in v.items() if re.search(p, k))
    ),
    "additionalProperties": lambda v, r, s: (
        not isinstance(v, dict) or all(conforms(x, r) for x in _additional(v, s))
    ),
    "propertyNames": lambda v, r, s: not isinstance(v, dict) or all(conforms(k, r) for k in v),
    "allOf": lambda v, r, s: all(conforms(v, sub) for sub in r),
    "anyOf": lambda v, r, s: any(conforms(v, sub) for sub in r),
    "oneOf": lambda v, r, s: sum(conforms(v, sub) for sub in r) == 1,
    "not": lambda v, r, s: not conforms(v, r),
}


def conforms(value: Any, schema: Any) -> bool:
    """Whether ``value`` is valid against ``schema`` (JSON Schema Draft 2020-12), without
    jsonschema; raises _Undecided for a keyword outside :data:`_KEYWORDS`."""
    if schema is True or schema is False:
        return schema
    if not isinstance(schema, dict):
        raise _Undecided(f"a schema that is a {type(schema).__name__}")
    for key, rule in schema.items():
        if key in _ANNOTATIONS:
            continue
        keyword = _KEYWORDS.get(key)
        if keyword is None:
            raise _Undecided(f"keyword {key!r}")
        if not keyword(value, rule, schema):
            return False
    return True


#: libyaml's safe loader where PyYAML was built with it (ten times faster on the graders and
#: suites every agent process reads at start), else PyYAML's own; both are safe loaders
_SAFE_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def parse_yaml_text(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_SAFE_LOADER)  # noqa: S506 - a safe loader
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{source}:{where}: not valid YAML: {problem}") from err


@functools.cache
def _trusted() -> tuple[frozenset[int], frozenset[int]]:
    """(uids, gids) whose files root takes its settings from: root, this process, and the
    owner of the agent's own code, who can change what root runs anyway (a checkout an
    operator runs with sudo)."""
    code = os.stat(Path(__file__).resolve().parent)
    return frozenset({0, os.geteuid(), code.st_uid}), frozenset({0, code.st_gid})


def _refuse_foreign(path: Path, st: os.stat_result, what: str) -> None:
    """ConfigError when the agent runs as root and ``path`` (its ``st``) could have been
    written by another user: owned by someone not trusted (:func:`_trusted`), or writable by
    others or by a group not trusted. Such a file would let that user choose root's adapter
    programs, thresholds or checks."""
    if os.geteuid() != 0:
        return
    uids, gids = _trusted()
    writable = st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP and st.st_gid not in gids)
    if st.st_uid not in uids or writable:
        raise ConfigError(
            f"{path}: {what} is owned by uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):04o}: another user could have written it, and root "
            "takes its settings only from files no other user can change; chown root and "
            "chmod go-w it"
        )


def load_yaml(
    path: str | Path,
    schema: dict[str, Any] | None = None,
    what: str = "file",
    empty_ok: bool = False,
) -> Any:
    """Read ``path`` as YAML, validate it against ``schema``; ConfigError on any problem."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            _refuse_foreign(path, os.fstat(f.fileno()), what)
            text = f.read().decode("utf-8")
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
