"""What a stuck training process is blocked in, from its stack: the basis of the hang origin.

When a job hangs, the rank that stopped first is rarely inside a collective: its peers are,
waiting for it. So a hung rank *not* waiting on its peers, while hung peers are, is the likely
origin (:func:`node_agent.training.verdict.likely_origin`). Which frames mean "waiting on the
peers" is decided here by what the frame *is* (its module and function), never by a word in its
name: a rank blocked in a data loader (``queue.get`` -> ``threading.Condition.wait``,
``multiprocessing.connection.wait``) was once taken for one in a collective because a frame was
called ``wait``, and the most common real non-collective hang then named no origin.

The stack is read innermost frame first. Frames that only say *how* a process waits, not *what
for*, are passed over: the standard library (``threading``, ``queue``, ``multiprocessing``,
``selectors``, ``socket``...), and C frames that are not recognised below (libc, libstdc++,
pybind11 dispatch, raw addresses). The first frame that says what for decides:

========================  =====================================================================
``collective``            torch.distributed (``torch/distributed/``: c10d's collectives and
                          barriers, functional collectives, FSDP, DTensor, pipelining, RPC;
                          not ``elastic/``, the launcher, nor ``checkpoint/``, whose own
                          collectives show as c10d frames inside it); DeepSpeed's comm package
                          (``deepspeed/comm/``); Megatron-Core's communication wrappers
                          (``tensor_parallel/mappings.py``, ``pipeline_parallel/
                          p2p_communication.py``, ``distributed/finalize_model_grads.py``, and
                          the ``start/finish_grad_sync``, ``start/finish_param_sync`` of its
                          DDP); with native frames, ``c10d::`` (``c10d::Work::wait``,
                          ``ProcessGroupNCCL``/``ProcessGroupGloo``), ``gloo::`` and NCCL
                          (``nccl*`` functions, ``libnccl``).
``device``                waiting for the GPU: ``torch.cuda.synchronize``, a stream's or
                          event's ``synchronize`` (``torch/cuda/``); with native
                          frames, ``cudaStreamSynchronize``/``cudaDeviceSynchronize``/
                          ``cudaEventSynchronize`` and their driver-API forms.
``data_loader``           ``torch/utils/data/`` (the DataLoader, its workers' queues).
``checkpoint``            ``torch/serialization.py`` (``torch.save``/``load``), the file I/O
                          of ``torch/distributed/checkpoint/``, ``safetensors``.
``launcher``              ``torch/distributed/elastic/``, ``torch/distributed/run.py``: the
                          torchrun agent, not a rank.
``other``                 anything else: the job's own code (a sleep, a lock, a loop).
========================  =====================================================================

**Decision on ``device``.** NCCL collectives return as soon as they are queued on the GPU; a
rank whose peer never joins blocks at its next synchronisation (``torch.cuda.synchronize``,
``.item()``, ``.cpu()``), not in the collective call. In a distributed job that is the usual
shape of a rank waiting on its peers, so ``device`` counts as waiting on the peers for the
origin rule. A rank whose *own* kernel hangs (a GPU fault) looks the same from its stack; the
GPU activity signal, the XID check and the ranks' other stacks tell the two apart, and the
origin is then left unnamed rather than guessed.

**``Work.wait`` and ``.item()`` need native frames.** They are C++ methods: py-spy's Python
stack shows only their caller (the job's own code), which reads ``other``. The stack sampler
therefore takes one ``py-spy dump --native`` of a stuck process whose Python stack reads
``other`` (:mod:`node_agent.training.stacks`) and uses what the C++ frames say when they name a
collective or a GPU wait.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: kinds that mean the rank waits on its peers (see the module docstring for ``device``)
WAITING_ON_PEERS = frozenset({"collective", "device"})
#: kinds of a rank stopped for a reason of its own: candidates for the origin
OWN_REASON = frozenset({"data_loader", "checkpoint", "other"})

_STDLIB = re.compile(r"(^|/)lib/python\d+(\.\d+)?/(?!site-packages/|dist-packages/)")
_NATIVE_FILE = re.compile(r"\.so(\.[\d.]+)?$|\.dylib$")
_ADDRESS = re.compile(r"^0x[0-9a-fA-F]+$")
_NATIVE_COLLECTIVE = re.compile(
    r"^(c10d::|gloo::|nccl[A-Z_]|ncclKernel|ncclDevKernel)"
    r"|ProcessGroup(NCCL|Gloo|MPI|UCC)"
)
_NATIVE_DEVICE = re.compile(
    r"^(cuda(Stream|Device|Event)Synchronize|cu(Stream|Ctx|Event)"
    r"Synchronize)"
)
_MEGATRON_DDP = frozenset(
    {"start_grad_sync", "finish_grad_sync", "start_param_sync", "finish_param_sync"}
)


@dataclass(frozen=True)
class Blocked:
    """What one stack is blocked in: ``kind`` (see the module docstring), the deciding frame
    (``frame``: "name (file:line)"), and the rule that recognised it (``via``)."""

    kind: str
    frame: str | None
    via: str

    @property
    def waits_on_peers(self) -> bool:
        return self.kind in WAITING_ON_PEERS

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "frame": self.frame, "via": self.via}


def _path(frame: dict[str, Any]) -> str:
    return str(frame.get("filename") or frame.get("short_filename") or "").replace("\\", "/")


def _text(frame: dict[str, Any]) -> str:
    where = frame.get("short_filename") or frame.get("filename") or "?"
    return f"{frame.get('name', '?')} ({where}:{frame.get('line', '?')})"


def is_native(frame: dict[str, Any]) -> bool:
    """A C/C++ frame of ``py-spy dump --native`` (a shared object, not a .py file)."""
    path = _path(frame)
    if path.endswith(".py"):
        return False
    # py-spy sets ``module`` (the shared object or executable) on native frames only
    return bool(
        frame.get("module")
        or _NATIVE_FILE.search(path)
        or _ADDRESS.match(str(frame.get("name", "")))
        or frame.get("line") == 0
    )


def _function(frame: dict[str, Any]) -> str:
    """The function's own name: py-spy qualifies methods (``Condition.wait``)."""
    return str(frame.get("name", "")).rsplit(".", 1)[-1]


def frame_kind(frame: dict[str, Any]) -> tuple[str, str] | None:
    """(kind, rule) of one frame, or None when it only says how the process waits."""
    name = str(frame.get("name", ""))
    if is_native(frame):
        lib = _path(frame).rsplit("/", 1)[-1]
        if _NATIVE_COLLECTIVE.search(name) or lib.startswith("libnccl"):
            return "collective", "native c10d/gloo/NCCL frame"
        if _NATIVE_DEVICE.match(name):
            return "device", "native CUDA synchronise"
        return None  # libc, libstdc++, pybind11, the interpreter, other torch internals
    path = _path(frame)
    if not path or path.startswith("<") or _STDLIB.search(path):
        return None  # the standard library and frozen modules: how it waits, not what for
    if "torch/distributed/" in path:
        if "torch/distributed/elastic/" in path or path.endswith(
            ("torch/distributed/run.py", "torch/distributed/launch.py")
        ):
            return "launcher", "torch.distributed.elastic / torchrun"
        if "torch/distributed/checkpoint/" in path:
            return "checkpoint", "torch.distributed.checkpoint"
        return "collective", "torch.distributed"
    if "torch/cuda/" in path:
        # torch.cuda.synchronize, Stream.synchronize, Event.synchronize block the host;
        # wait_event / wait_stream only order streams and return at once
        if _function(frame) == "synchronize":
            return "device", "torch.cuda synchronise"
        return None
    if "torch/utils/data/" in path:
        return "data_loader", "torch.utils.data"
    if path.endswith("torch/serialization.py") or "/safetensors/" in path:
        return "checkpoint", "torch.save/load, safetensors"
    if "deepspeed/comm/" in path:
        return "collective", "DeepSpeed comm"
    if path.endswith(
        (
            "megatron/core/tensor_parallel/mappings.py",
            "megatron/core/pipeline_parallel/p2p_communication.py",
            "megatron/core/distributed/finalize_model_grads.py",
        )
    ):
        return "collective", "Megatron-Core communication"
    if "megatron/core/distributed/" in path and _function(frame) in _MEGATRON_DDP:
        return "collective", "Megatron-Core DDP grad/param sync"
    package = re.search(r"/(?:site|dist)-packages/([^/]+)", path)
    return "other", (f"library code ({package.group(1)})" if package else "the job's own code")


def classify(frames: Sequence[dict[str, Any]]) -> Blocked:
    """What a stack (innermost frame first, as py-spy prints it) is blocked in."""
    for frame in frames:
        found = frame_kind(frame)
        if found is not None:
            return Blocked(found[0], _text(frame), found[1])
    if not frames:
        return Blocked("unknown", None, "no frames")
    return Blocked("other", _text(frames[0]), "only standard-library or C frames")
