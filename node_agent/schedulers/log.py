"""The ``log`` adapter (the default): records what it would do, changes nothing.

Each call appends one JSON line to ``<state_dir>/actions.log`` (or the path given)::

    {"at": "2025-01-01T00:00:00+00:00", "adapter": "log", "action": "drain",
     "node": "gpu-01", "reason": "node-agent: FAULT xid79 gpu:5"}

``restart_job`` adds ``"job": "slurm:1234"`` (action ``restart-job``); any job id that passes
:func:`~node_agent.schedulers.base.check_job_id` is recorded, since nothing is restarted.
The node's state is unknown (``NodeState.known`` False): nothing was really drained.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node_agent.atomic_file import create_private
from node_agent.model import utc_iso
from node_agent.schedulers.base import (
    ActionByName,
    AdapterAction,
    AdapterError,
    AdapterOutcome,
    NodeState,
    check_node_name,
)

if TYPE_CHECKING:
    from node_agent.config import Config


class LogAdapter(ActionByName):
    name = "log"

    def __init__(
        self, path: str | Path, node: str | None = None, clock: Callable[[], str] = utc_iso
    ) -> None:
        self.path = Path(path)
        self.node = node
        self._clock = clock

    @classmethod
    def from_config(cls, config: Config) -> LogAdapter:
        return cls(config.state_dir / "actions.log", node=config.node.name)

    def _act(self, act: AdapterAction) -> AdapterOutcome:
        entry: dict[str, str] = {
            "at": self._clock(),
            "adapter": self.name,
            "action": act.action,
            "node": act.node,
            "reason": act.reason,
            **({"key": act.key} if act.key else {}),
            **({"evidence": act.evidence} if act.evidence else {}),
            **({"job": act.job} if act.job is not None else {}),
        }
        line = json.dumps(entry, sort_keys=True)
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            # One write of one line with O_APPEND: concurrent writers never interleave lines.
            # 0600 and never through a symlink: it is the agent's own record (docs/security.md).
            fd = create_private(self.path, append=True)
            try:
                os.write(fd, (line + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as err:
            raise AdapterError(
                f"log adapter cannot write {self.path}: {err}; "
                "check state_dir in the config and its permissions"
            ) from err
        return AdapterOutcome.done(f"log: would {act.what} ({act.reason}); recorded in {self.path}")

    def node_state(self, node: str) -> NodeState:
        return NodeState(
            name=check_node_name(node), state="unknown", drained=False, reason=None, known=False
        )

    def list_nodes(self) -> list[NodeState]:
        """Only this node (when known): the log adapter manages nothing else."""
        return [self.node_state(self.node)] if self.node else []

    def records(self) -> list[dict[str, Any]]:
        """The recorded actions, oldest first (for tests and ``status``)."""
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
