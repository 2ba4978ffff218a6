"""GPU resets for the remediation: ``nvidia-smi --gpu-reset`` on a real node (a stand-in node
brings its own, ``Node.gpu_reset``). A reset that does not happen raises
:class:`GpuResetError`, which the executor records as a failed step (the next run re-plans,
towards a reboot)."""

from __future__ import annotations

from typing import Protocol

from node_agent import proc

GPU_RESET_TIMEOUT_S = 120.0


class GpuResetError(Exception):
    """A GPU reset that did not happen (busy GPU, no permission, tool missing)."""


class GpuResetter(Protocol):
    def reset(self, index: int) -> str: ...  # detail line; raises GpuResetError


class NvidiaSmiReset:
    """``nvidia-smi --gpu-reset -i N``: needs root and no process on the GPU."""

    def reset(self, index: int) -> str:
        result = proc.run(
            ["nvidia-smi", "--gpu-reset", "-i", str(index)], timeout_s=GPU_RESET_TIMEOUT_S
        )
        if not result.ok:
            raise GpuResetError(f"GPU reset of gpu:{index} failed: {result.describe_failure()}")
        return f"GPU reset of gpu:{index} (nvidia-smi --gpu-reset -i {index})"
