"""Pure parsers for the output of external benchmark tools (fio, perftest, nccl-tests).

Each parser takes the text a tool printed and returns typed values, or raises
:class:`ParseError` naming what was expected and what was found. Parsers never run anything;
the checks run the tools through :mod:`node_agent.proc` and hand the text here.
"""

from __future__ import annotations

import json
from typing import Any


class ParseError(ValueError):
    """Tool output that cannot be read: truncated, an unknown unit, a missing table."""


def json_document(text: str, tool: str, expected: str, preview: int = 160) -> Any:
    """The JSON document a tool printed, skipping anything before its first ``{`` (banners,
    warnings on the same stream). ``tool`` and ``expected`` name the tool and the output
    wanted in the error: ``json_document(out, "fio", "--output-format=json output")``."""
    start = text.find("{")
    if start < 0:
        raise ParseError(f"{tool} printed no JSON document (expected {expected}; got "
                         f"{text.strip()[:preview]!r})")
    try:
        return json.loads(text[start:])
    except json.JSONDecodeError as err:
        raise ParseError(f"{tool} JSON is truncated or malformed at character "
                         f"{err.pos + start} of {len(text)}: {err.msg}") from err
