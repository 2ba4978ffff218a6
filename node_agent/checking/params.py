"""A check's typed parameters: the contract, and the readers its ``Params.parse`` is made of.

A check module may define ``Params``: a frozen dataclass whose field defaults are the check's
defaults, with a classmethod ``parse(raw) -> Params`` that raises ValueError naming the key, the
value found and what was expected (unknown keys, NaN and infinities, a bool where a number
belongs are all refused). The suite's load parses every entry's params through it once
(:class:`node_agent.suite.CheckSpec`), so a bad value is a configuration error (exit 2) before
anything runs; the check reads attributes of ``ctx.typed_params(Params)``.

:class:`Reader` holds the rules every check shares, so a ``parse`` is one line per key::

    r = Reader("storage", raw, cls)
    return cls(size=r.string("size"), runtime_s=r.positive("runtime_s"))

A key given as ``null`` reads as not given (the default).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING, fields
from typing import Any, NoReturn, Protocol, TypeVar

_T = TypeVar("_T")


class CheckParams(Protocol):
    """What a check's ``Params`` offers: parsing a suite entry's raw params."""

    @classmethod
    def parse(cls: type[_T], raw: Mapping[str, Any]) -> _T: ...


P = TypeVar("P", bound=CheckParams)


class Reader:
    """One check's raw params, read key by key, each absent key taking its default from the
    ``Params`` dataclass; every error names the check, the key, the value and what is expected.
    Unknown keys are refused when the reader is made."""

    def __init__(self, check: str, raw: Mapping[str, Any], params: type[Any]) -> None:
        self.check = check
        self.raw = raw
        self.defaults = {f.name: f.default for f in fields(params) if f.default is not MISSING}
        known = [f.name for f in fields(params)]
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(
                f"params of {check}: unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}"
            )

    def fail(self, key: str, value: Any, expected: str) -> NoReturn:
        raise ValueError(f"params of {self.check}: {key} {value!r}: expected {expected}")

    def given(self, key: str) -> bool:
        """Whether the suite set ``key`` (to something other than null)."""
        return self.raw.get(key) is not None

    def value(self, key: str) -> Any:
        return self.raw[key] if self.given(key) else self.defaults.get(key)

    def integers(self, key: str, low: int, what: str) -> tuple[int, ...]:
        """A list of whole numbers (not bools), each at least ``low``; ``what`` says what the
        list is in the error."""
        v = self.value(key)
        if not isinstance(v, list | tuple) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= low for n in v
        ):
            self.fail(key, v, what)
        return tuple(v)

    def number(
        self, key: str, *, above: float | None = None, at_least: float | None = None
    ) -> float:
        """A finite number (an int or a float, not a bool), above ``above`` / at least
        ``at_least`` when given."""
        v = self.value(key)
        want = "a finite number" + (
            f" above {above:g}"
            if above is not None
            else f" of at least {at_least:g}"
            if at_least is not None
            else ""
        )
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            self.fail(key, v, want)
        if (above is not None and not v > above) or (at_least is not None and not v >= at_least):
            self.fail(key, v, want)
        return float(v)

    def positive(self, key: str) -> float:
        """A finite number above 0 (a duration, a size)."""
        return self.number(key, above=0)

    def optional_number(
        self, key: str, *, above: float | None = None, at_least: float | None = None
    ) -> float | None:
        if self.value(key) is None:
            return None
        return self.number(key, above=above, at_least=at_least)

    def nullable_number(self, key: str, *, above: float | None = None) -> float | None:
        """A number, or None where the suite sets ``null`` (meaning "no bound"; an absent key
        takes the default)."""
        if key in self.raw and self.raw[key] is None:
            return None
        return self.number(key, above=above) if self.value(key) is not None else None

    def integer(self, key: str, low: int | None = None, high: int | None = None) -> int:
        """A whole number (not a bool) in ``[low, high]``, each bound when given."""
        v = self.value(key)
        want = "a whole number" + (f" >= {low}" if low is not None else "")
        want += f" <= {high}" if high is not None else ""
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(key, v, want)
        if (low is not None and v < low) or (high is not None and v > high):
            self.fail(key, v, want)
        return v

    def optional_integer(
        self, key: str, low: int | None = None, high: int | None = None
    ) -> int | None:
        return self.integer(key, low, high) if self.value(key) is not None else None

    def string(self, key: str, *, empty: bool = False) -> str:
        """A string; an empty one only when ``empty``."""
        v = self.value(key)
        if not isinstance(v, str) or (not v and not empty):
            self.fail(key, v, "a string" if empty else "a non-empty string")
        return v

    def optional_string(self, key: str) -> str | None:
        return self.string(key) if self.value(key) is not None else None

    def choice(self, key: str, options: tuple[str, ...]) -> str:
        v = self.value(key)
        if v not in options:
            self.fail(key, v, "one of " + ", ".join(options))
        return str(v)

    def flag(self, key: str) -> bool:
        """true or false (not 0, 1 or a string)."""
        v = self.value(key)
        if not isinstance(v, bool):
            self.fail(key, v, "true or false")
        return v

    def strings(self, key: str, *, empty: bool = True, lone: bool = False) -> tuple[str, ...]:
        """A list of non-empty strings (``empty``: the list may be empty; ``lone``: one string
        may stand alone)."""
        v = self.value(key)
        if isinstance(v, tuple) or (lone and isinstance(v, str)):  # the default; one string
            v = list(v) if isinstance(v, tuple) else [v]
        if (
            not isinstance(v, list)
            or not all(isinstance(s, str) and s for s in v)
            or (not v and not empty)
        ):
            self.fail(key, v, "a list of non-empty strings" + ("" if empty else ", at least one"))
        return tuple(v)
