"""Pure parsers for the output of external benchmark tools (fio, perftest, nccl-tests).

Each parser takes the text a tool printed and returns typed values, or raises
:class:`ParseError` naming what was expected and what was found. Parsers never run anything;
the checks run the tools through :mod:`node_agent.proc` and hand the text here.
"""

from __future__ import annotations


class ParseError(ValueError):
    """Tool output that cannot be read: truncated, an unknown unit, a missing table."""
