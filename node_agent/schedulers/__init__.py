"""Scheduler adapters: how a grade becomes a drain/resume/restart/replace on the cluster, and
a hung training job a restart of that job (``restart_job``).

``open_adapter(config)`` returns the adapter named by ``adapter.name`` (or ``name``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from node_agent.schedulers.base import (
    JOB_KINDS,
    REASON_PREFIX,
    AdapterError,
    AdapterOutcome,
    AdapterStatus,
    JobKind,
    NodeState,
    SchedulerAdapter,
    check_job_id,
    check_node_name,
    is_agent_reason,
    sanitise_reason,
)

if TYPE_CHECKING:
    from node_agent.config import Config

ADAPTER_NAMES = ("log", "slurm", "kubernetes", "webhook")


def open_adapter(config: Config, name: str | None = None) -> SchedulerAdapter:
    """The adapter ``name`` (default: ``adapter.name`` from the config), configured.

    Raises AdapterError for an unknown name or a configuration the adapter cannot use
    (e.g. webhook without a URL), with what to set.
    """
    chosen = name or config.adapter.name or "log"
    if chosen == "log":
        from node_agent.schedulers.log import LogAdapter

        return LogAdapter.from_config(config)
    if chosen == "slurm":
        from node_agent.schedulers.slurm import SlurmAdapter

        return SlurmAdapter.from_config(config)
    if chosen == "kubernetes":
        from node_agent.schedulers.kubernetes import KubernetesAdapter

        return KubernetesAdapter.from_config(config)
    if chosen == "webhook":
        from node_agent.schedulers.webhook import WebhookAdapter

        return WebhookAdapter.from_config(config)
    raise AdapterError(f"unknown adapter {chosen!r}; choose one of {', '.join(ADAPTER_NAMES)}")


__all__ = [
    "ADAPTER_NAMES",
    "JOB_KINDS",
    "REASON_PREFIX",
    "AdapterError",
    "AdapterOutcome",
    "AdapterStatus",
    "JobKind",
    "NodeState",
    "SchedulerAdapter",
    "check_job_id",
    "check_node_name",
    "is_agent_reason",
    "open_adapter",
    "sanitise_reason",
]
