"""``nvlink_fabric``: being built; until then it skips and says so."""

from __future__ import annotations

from node_agent.checks import CheckContext
from node_agent.model import Result, Status


def run(ctx: CheckContext) -> list[Result]:
    return [ctx.result("node", "nvlink_fabric", Status.SKIP, "this check is not built yet")]
