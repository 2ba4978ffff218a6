"""A run's :class:`~node_agent.model.Report` from what the environment knows of the node."""

from __future__ import annotations

from node_agent import __version__
from node_agent.environment import Environment
from node_agent.model import Grade, Report, Result, utc_iso


def build_report(
    env: Environment,
    suite: str,
    mode: str,
    started_at: str,
    results: list[Result],
    grade: Grade,
) -> Report:
    """The report of a run of ``suite`` (in ``mode``) on ``env``'s node that started at
    ``started_at`` and finishes now: its host, GPUs, SKU and whether it was a stand-in."""
    return Report(
        host=env.inventory.host,
        gpus=env.inventory.gpus,
        suite=suite,
        mode=mode,
        started_at=started_at,
        finished_at=utc_iso(),
        results=results,
        grade=grade,
        simulated=env.simulated,
        agent_version=__version__,
        sku=env.sku.id if env.sku else None,
        inventory=env.inventory.to_dict(),
    )
