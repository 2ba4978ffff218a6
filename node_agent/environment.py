"""Everything one invocation works against, opened once: config, graders, SKU, and the node
(:mod:`node_agent.node`: its GPUs, kernel log and the ports the checks read it through).

This is the single place where a stand-in node or the real hardware is chosen:
``open_environment(config, simulate=path)`` opens the stand-in a scenario file describes
(:mod:`node_agent.sim.node`); without ``simulate``, this host. Nothing below asks which; the
checks read ``Environment.ports``. The node keeps how it was chosen as a typed spec
(``Node.spec``, :class:`~node_agent.checking.child.NodeSpec`), and a check child opens the same
node from it with :func:`open_environment_for`.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node_agent import resources
from node_agent.atomic_file import private_dir
from node_agent.checking.child import NodeSpec
from node_agent.checking.context import CheckContext
from node_agent.checking.ports import Ports
from node_agent.config import Config
from node_agent.gpu import open_backend
from node_agent.gpu.base import GpuBackend
from node_agent.grading.rules import Grader, load_grader
from node_agent.hardware.sku import Sku, load_skus
from node_agent.inventory import Inventory, collect
from node_agent.kernel_log import KernelLog, open_kernel_log
from node_agent.node import Node
from node_agent.yamlfile import ConfigError


@dataclass
class Environment:
    config: Config
    grader: Grader
    skus: dict[str, Sku]
    node: Node
    inventory: Inventory
    #: what the checks read the node through, built with it once its SKU is matched
    ports: Ports = Ports()

    @property
    def gpu(self) -> GpuBackend:
        return self.node.gpu

    @property
    def kernel_log(self) -> KernelLog:
        return self.node.kernel_log

    @property
    def simulated(self) -> bool:
        """The node is a stand-in (``--simulate``): reports say SIMULATED."""
        return self.node.stand_in

    @property
    def sku(self) -> Sku | None:
        return self.inventory.sku

    @property
    def hostname(self) -> str:
        """The node's name: ``node.name``, else the stand-in's own, else this host's."""
        return self.inventory.host.hostname

    @property
    def expected_gpus(self) -> int | None:
        configured = self.config.node.expected_gpus
        if configured is not None:
            return configured
        if self.node.declared_gpus is not None:
            return self.node.declared_gpus
        if self.sku is None or not self.sku.fixed_gpu_count:
            return None  # an add-in card's count is the server's build (node.expected_gpus)
        return self.sku.gpus_per_node

    def writable_state_dir(self) -> Path | None:
        """The configured state directory if it can be made private (0700, the agent's own,
        see ``atomic_file.private_dir``) and written, else None."""
        path = self.config.state_dir
        try:
            private_dir(path)
        except OSError:
            return None
        return path if os.access(path, os.W_OK) else None

    def check_context(
        self, check: str, mode: str, params: dict[str, Any], **fields: Any
    ) -> CheckContext:
        """A context for ``check`` on this node: its GPUs, kernel log, config, inventory, SKU,
        expected GPU count and ports. ``fields`` set the rest of :class:`CheckContext` (the
        deadline, the state dir, ...) or replace any of these."""
        return CheckContext(
            **{
                "check": check,
                "gpu": self.gpu,
                "kernel_log": self.kernel_log,
                "config": self.config,
                "inventory": self.inventory,
                "sku": self.sku,
                "expected_gpus": self.expected_gpus,
                "mode": mode,
                "params": params,
                "ports": self.ports,
                **fields,
            }
        )

    def close(self) -> None:
        self.gpu.close()


def load_data(config: Config) -> tuple[Grader, dict[str, Sku]]:
    """Grader and SKU files, validated (ConfigError on any problem)."""
    graders = resources.graders_dir(config)
    skus = load_skus(graders)
    sku_setting = config.node.sku
    if sku_setting != "auto" and sku_setting not in skus:
        raise ConfigError(
            f"{config.source}: key 'node.sku': {sku_setting!r} is not a SKU file "
            f"in {graders / 'skus'}; expected auto or one of: "
            f"{', '.join(sorted(skus))}"
        )
    return load_grader(graders), skus


#: names the kernel log where the config's ``kernel_log.path`` is null: a file (or a character
#: device) read instead of this host's /dev/kmsg. The test suite sets it so that no test reads
#: the host's log; it is the environment of the agent's own process (root's), like its config.
KERNEL_LOG_ENV = "NODE_AGENT_KERNEL_LOG"


def kernel_log_path(config: Config) -> str | None:
    """The kernel log this invocation reads: ``kernel_log.path``, else ``$NODE_AGENT_KERNEL_LOG``,
    else None (this host's: /dev/kmsg, else ``journalctl -k``)."""
    return config.kernel_log.path or os.environ.get(KERNEL_LOG_ENV) or None


def open_node(config: Config, skus: dict[str, Sku], simulate: str | None = None) -> Node:
    """The node this invocation works against: the stand-in the scenario file ``simulate``
    describes (ConfigError when it is invalid), else this host."""
    if simulate:
        from node_agent.sim.node import open_stand_in

        node = open_stand_in(simulate, skus, config.node.sku, config.nvml.call_timeout_s)
        return dataclasses.replace(node, spec=NodeSpec.scenario(simulate))
    return Node(
        gpu=open_backend(call_timeout_s=config.nvml.call_timeout_s),
        kernel_log=open_kernel_log(kernel_log_path(config)),
    )


def stand_in_hostname(config: Config, simulate: str) -> str:
    """The host name of the stand-in node a scenario file describes, without opening it
    (ConfigError when the file does not load): how a node names a peer it never heard from."""
    from node_agent.sim.node import stand_in_hostname as hostname_of

    _, skus = load_data(config)
    return hostname_of(simulate, skus)


def open_environment(config: Config, simulate: str | None = None) -> Environment:
    """Validate everything first (ConfigError: nothing has run), then open the node."""
    grader, skus = load_data(config)
    node = open_node(config, skus, simulate)
    inventory = collect(
        node.gpu,
        skus,
        node.sku_setting or config.node.sku,
        hostname=config.node.name or node.hostname,
    )
    return Environment(
        config=config,
        grader=grader,
        skus=skus,
        node=node,
        inventory=inventory,
        ports=dataclasses.replace(node.ports_for(inventory.sku), node=node.spec),
    )


def open_environment_for(config: Config, node: NodeSpec) -> Environment:
    """The environment of the node a typed spec names (a check child's request,
    checking/child.py): this host, or the stand-in its scenario file describes."""
    return open_environment(config, node.scenario_path)


def report_dir(env: Environment, out: str | None) -> tuple[Path, str | None]:
    """Where reports go: ``--out``, else ``<state_dir>/reports`` (0700), else a new private
    temp dir (``mkdtemp``: 0700, a name nobody can guess or make first), with a note.

    Never a fixed path in a shared directory: a ``/tmp/node-agent-reports`` another user made
    first would let them point the report's file names at files root owns."""
    if out:
        path = Path(out)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"--out {out}: cannot create directory: {err.strerror}") from err
        return path, None
    state = env.writable_state_dir()
    if state is not None and _free_bytes(state) >= REPORT_ROOM_BYTES:
        return private_dir(state / "reports"), None
    try:
        path = Path(tempfile.mkdtemp(prefix="node-agent-reports-"))
    except OSError as err:
        raise ConfigError(
            f"state dir {env.config.state_dir} is not usable and no private temp "
            f"dir can be made ({err.strerror or err}); set state_dir in the "
            "config or give --out DIR"
        ) from err
    why = (
        "has less than 1 MiB free"
        if state is not None
        else "is not usable (not writable, or not the agent's own)"
    )
    return path, (
        f"state dir {env.config.state_dir} {why}; report written under the new "
        f"private directory {path} instead"
    )


#: a report is 10-200 KB (delivery suite with plots' data: the largest seen); below this much
#: free space the state dir's disk is full for practical purposes and the report goes elsewhere
REPORT_ROOM_BYTES = 1 << 20


def _free_bytes(path: Path) -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize
