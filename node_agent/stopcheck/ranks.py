"""Who is in the stopped job: rank, world size and rendezvous, as any PyTorch launcher gives them.

torchrun sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (and hosts the store
itself: ``TORCHELASTIC_USE_AGENT_STORE=True``); ``srun`` sets ``SLURM_PROCID`` and
``SLURM_NTASKS``; an indexed Kubernetes Job sets ``JOB_COMPLETION_INDEX``. ``MASTER_ADDR`` and
``MASTER_PORT`` must then be exported by the job script (the first node and a free port).

Joining is checked before any collective: every rank writes its node's name into the job's
store, and rank 0 waits for all of them until the join deadline. A rank that never arrives is
then named by rank 0 (``did not join``) instead of every rank hanging in the process group's
set-up until its own timeout with nobody named.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from node_agent.yamlfile import ConfigError

_PREFIX = "node-agent/stop-check"


@dataclass(frozen=True)
class Place:
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    agent_store: bool  # torchrun hosts the store; we are its clients


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            try:
                return int(value)
            except ValueError as err:
                raise ConfigError(f"{name}={value!r} is not a whole number") from err
    return None


def place_from_env(env: Mapping[str, str] | None = None) -> Place:
    """This rank's place in the job; ConfigError (exit 2, one line) when the launcher gave too
    little or the job is one node (nothing to compare with)."""
    env = os.environ if env is None else env
    rank = _int(env, "RANK", "SLURM_PROCID", "JOB_COMPLETION_INDEX")
    world = _int(env, "WORLD_SIZE", "SLURM_NTASKS")
    if rank is None or world is None:
        raise ConfigError(
            "stop-check runs as one rank per node of a torch.distributed job: "
            "start it with torchrun, srun or a Kubernetes indexed Job (RANK and "
            "WORLD_SIZE, or SLURM_PROCID and SLURM_NTASKS, are not set)"
        )
    if world < 2:
        raise ConfigError(
            f"stop-check compares nodes with each other, but WORLD_SIZE={world}: "
            "run it over at least two nodes (one rank per node); for one node "
            "run `node-agent check`"
        )
    if not 0 <= rank < world:
        raise ConfigError(f"rank {rank} is outside the job's world of {world}")
    addr = env.get("MASTER_ADDR", "").strip()
    port = _int(env, "MASTER_PORT")
    if not addr or port is None:
        raise ConfigError(
            "MASTER_ADDR and MASTER_PORT are not set: export the first node's "
            "address and a free port in the job script (torchrun sets them)"
        )
    return Place(
        rank, world, addr, port, env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    )


def open_store(place: Place, timeout_s: float) -> Any:
    """The job's key-value store: torchrun's, or one rank 0 hosts at MASTER_ADDR:MASTER_PORT."""
    import torch.distributed as dist

    store = dist.TCPStore(
        place.master_addr,
        place.master_port,
        place.world_size,
        is_master=place.rank == 0 and not place.agent_store,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return dist.PrefixStore(_PREFIX, store)


@dataclass(frozen=True)
class Joined:
    nodes: dict[int, str]  # rank -> node name, for every rank that joined
    missing: list[int]


def join(store: Any, place: Place, node: str, deadline_s: float) -> Joined:
    """Announce this rank's node and learn who joined (rank 0 decides after ``deadline_s``)."""
    store.set(f"join/{place.rank}", node)
    if place.rank == 0:
        keys = [f"join/{r}" for r in range(place.world_size)]
        end = time.monotonic() + deadline_s
        while time.monotonic() < end and not store.check(keys):
            time.sleep(0.1)
        nodes = {
            r: store.get(f"join/{r}").decode(errors="replace")
            for r in range(place.world_size)
            if store.check([f"join/{r}"])
        }
        missing = [r for r in range(place.world_size) if r not in nodes]
        store.set(
            "joined",
            json.dumps({"nodes": {str(k): v for k, v in nodes.items()}, "missing": missing}),
        )
        return Joined(nodes, missing)
    store.wait(["joined"], timedelta(seconds=deadline_s + 30))
    data = json.loads(store.get("joined"))
    return Joined({int(k): v for k, v in data["nodes"].items()}, list(data["missing"]))


def init_group(store: Any, place: Place, backend: str, timeout_s: float) -> None:
    """The job's process group over the same store (every rank joined)."""
    import torch.distributed as dist

    dist.init_process_group(
        backend,
        store=dist.PrefixStore("pg", store),
        rank=place.rank,
        world_size=place.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
