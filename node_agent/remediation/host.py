"""What the remediator needs from this host and its configuration: the scheduler's name for
the node, the configured adapter, the GPU resetter, the boot time."""

from __future__ import annotations

import socket

from node_agent.config import Config, configured_node_name
from node_agent.environment import Environment
from node_agent.remediation.executor import NvidiaSmiReset, SimulatedReset
from node_agent.remediation.store import Store
from node_agent.schedulers import AdapterError, SchedulerAdapter, open_adapter
from node_agent.yamlfile import ConfigError


def node_name(config: Config, simulate: str | None = None) -> str:
    """``node.name`` from the config, else ``$NODE_AGENT_NODE_NAME`` (Kubernetes: the node a
    pod runs on), else the scenario's host name, else the short hostname."""
    configured = configured_node_name(config)
    if configured:
        return configured
    if simulate:
        from node_agent.environment import load_data
        from node_agent.sim.scenario import load_scenario

        _, skus = load_data(config)
        return load_scenario(simulate, skus).hostname
    return socket.gethostname().split(".")[0]


def open_configured_adapter(config: Config, name: str | None) -> SchedulerAdapter:
    try:
        return open_adapter(config, name)
    except AdapterError as err:
        raise ConfigError(f"{config.source}: adapter: {err}") from err


def state_dir_of(store: Store):
    return store.path.parent if store.path is not None else None


def boot_time() -> float:
    import psutil

    return float(psutil.boot_time())


def gpu_resetter(env: Environment):
    if env.simulated:
        return SimulatedReset()
    from node_agent import proc

    return NvidiaSmiReset() if proc.which("nvidia-smi") and env.inventory.gpus else None
