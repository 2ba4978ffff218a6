"""What the remediator needs from this host and its configuration: the scheduler's name for
the node, the configured adapter, the GPU resetter, the boot time, and :func:`open_remediator`,
the one place a remediator is wired (``check``/``accept --act``, ``act``, the daemon)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

from node_agent.config import Config, configured_node_name
from node_agent.environment import Environment, kernel_log_path
from node_agent.kernel_log import KernelLog, open_kernel_log
from node_agent.model import Grade
from node_agent.remediation import evidence
from node_agent.remediation.executor import Remediator
from node_agent.remediation.gpu_reset import GpuResetter, NvidiaSmiReset
from node_agent.remediation.plan import Step
from node_agent.remediation.store import Store
from node_agent.schedulers import AdapterError, SchedulerAdapter, open_adapter
from node_agent.yamlfile import ConfigError


def node_name(config: Config, *, host: str | None = None) -> str:
    """The scheduler's name for this node: ``node.name`` from the config, else
    ``$NODE_AGENT_NODE_NAME`` (Kubernetes: the node a pod runs on), else ``host``, the host name
    the caller's environment has (``env.inventory.host.hostname``: a simulated node's is its
    scenario's), else this host's short name (:func:`short_hostname`)."""
    return configured_node_name(config) or host or short_hostname()


def short_hostname() -> str:
    """This host's name up to the first dot (what Slurm and Kubernetes name a node by)."""
    return socket.gethostname().split(".")[0]


def open_configured_adapter(config: Config, name: str | None) -> SchedulerAdapter:
    try:
        return open_adapter(config, name)
    except AdapterError as err:
        raise ConfigError(f"{config.source}: adapter: {err}") from err


def state_dir_of(store: Store) -> Path | None:
    return store.path.parent if store.path is not None else None


def boot_time() -> float:
    import psutil

    return float(psutil.boot_time())


def gpu_resetter(env: Environment) -> GpuResetter | None:
    """The node's own reset where it has one (a stand-in answers for itself), else
    ``nvidia-smi --gpu-reset`` where the tool and GPUs are there."""
    if env.node.gpu_reset is not None:
        return env.node.gpu_reset
    from node_agent import proc

    return NvidiaSmiReset() if proc.which("nvidia-smi") and env.inventory.gpus else None


def open_remediator(
    env: Environment | None,
    config: Config,
    store: Store,
    adapter: SchedulerAdapter,
    node: str,
    *,
    simulated: bool = False,
    dry_run: bool = False,
    retest: Callable[[], Grade] | None = None,
    after_journal: Callable[[Step], None] | None = None,
) -> Remediator:
    """A remediator for ``node`` through ``adapter``, wired to this host or to the simulator.

    ``env`` is the run's environment (a graded run, the daemon): whether it is simulated decides
    the boot time (a simulated node has just booted), the GPU resetter (the stand-in), the
    kernel log and the GPU processes for evidence. An operator's ``act`` opens no environment:
    it passes None and says ``simulated`` itself (``--simulate``); it gets no GPU reset.
    ``dry_run`` adds to ``adapter.dry_run`` from the config; ``after_journal`` is the executor's
    hook run after each step is journaled, before the adapter acts. A replace request is
    preceded by the driver's bug report (``nvidia-bug-report.sh``; not on a simulated node).
    """
    sim = env.simulated if env is not None else simulated
    kernel_log: KernelLog | None
    if env is not None:
        kernel_log = env.kernel_log
    else:
        kernel_log = None if sim else open_kernel_log(kernel_log_path(config))
    return Remediator(
        store,
        adapter,
        node,
        config.safety,
        state_dir=state_dir_of(store),
        dry_run=dry_run or config.adapter.dry_run,
        boot_time=(
            env.node.boot_time or boot_time()
            if env is not None
            else time.time()
            if sim
            else boot_time()
        ),
        gpu_resetter=gpu_resetter(env) if env is not None else None,
        retest=retest,
        kernel_log=kernel_log,
        gpu_pids=None if sim else evidence.gpu_pids,
        after_journal=after_journal,
        bug_report=evidence.BugReportCollector(
            unavailable=(
                "simulated node: nvidia-bug-report.sh would describe this host, not the "
                "simulated node"
                if sim
                else None
            )
        ),
    )
