"""Pure parsers for the output of external benchmark tools (fio, perftest, nccl-tests).

Each parser takes the text a tool printed and returns typed values, or raises
:class:`ParseError` naming what was expected and what was found. Parsers never run anything;
the checks run the tools through :mod:`node_agent.proc` and hand the text here.

A parser given saved or pasted output (a launcher's prefixes, warnings inside a table, a second
output format after the JSON) either reads the right figures or refuses with the reason; where
a tool prints the same quantity twice (fio's bytes and bytes/s, perftest's bandwidth and
message rate, nccl-tests' size, time and algbw) the parsers compare the two, so a figure that
is wrong by a unit or was edited is caught rather than trusted.
"""

from __future__ import annotations

import json
import re
from typing import Any


class ParseError(ValueError):
    """Tool output that cannot be read: truncated, an unknown unit, a missing table."""


_LINE_START_BRACE = re.compile(r"^\{", re.MULTILINE)


def json_document(text: str, tool: str, expected: str, preview: int = 160) -> Any:
    """The JSON document a tool printed, with anything before it (banners, warnings on the
    same stream) and after it (a second output format, e.g. fio's ``--output-format=json,normal``)
    left out. ``tool`` and ``expected`` name the tool and the output wanted in the error:
    ``json_document(out, "fio", "--output-format=json output")``.

    The document is the first ``{`` in the first column of a line that decodes (a warning
    with a brace inside it, or an object nested in a broken document, is not mistaken for it);
    a document that stops early is reported as truncated with the character where it broke.
    """
    starts = [m.end() - 1 for m in _LINE_START_BRACE.finditer(text)]
    if not starts and "{" in text:
        starts = [text.find("{")]
    if not starts:
        raise ParseError(
            f"{tool} printed no JSON document (expected {expected}; got {text.strip()[:preview]!r})"
        )
    decoder = json.JSONDecoder()
    first_error: tuple[int, json.JSONDecodeError] | None = None
    for start in starts:
        try:
            doc, _end = decoder.raw_decode(text, start)
            return doc
        except json.JSONDecodeError as err:
            first_error = first_error or (start, err)
    assert first_error is not None
    _start, decode_error = first_error
    raise ParseError(
        f"{tool} JSON is truncated or malformed at character {decode_error.pos} of {len(text)}: "
        f"{decode_error.msg}"
    ) from decode_error
