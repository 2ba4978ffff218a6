"""The reference step every GPU of every node runs in the bitwise-alignment and replay phases.

A fixed two-layer perceptron, forward and backward, from a fixed seed: ``h = relu(x W1)``,
``y = h W2``, ``L = mean((y - t)^2)``, and the gradients ``dW2 = h^T dy``, ``dW1 = x^T dh``. Every
product goes through the device's own matmul (:meth:`ComputeDevice.matmul`), so a simulated
``sdc`` fault corrupts it as it corrupts the probes, and on a GPU the tensor cores that training
uses compute it. With TF32 and reduced-precision reductions off and deterministic algorithms on
(``torch.use_deterministic_algorithms``; cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG``), the same GPU
model with the same driver, CUDA and torch produces the same bits every time: a GPU that does not
is computing wrong. The output side is sized from the device's SM count (``sdc.tiles``), so
every SM computes several output tiles of every product.

Each GPU's result is the SHA-256 of ``y``, ``dW1`` and ``dW2`` (their bytes as stored);
``y`` itself is what the replay phase reduces across nodes.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from node_agent.sdc.tiles import GPU_BLOCK, SIM_BLOCK, whole_gpu_mn

if TYPE_CHECKING:
    import torch

    from node_agent.compute.devices import ComputeDevice

#: tiles per SM of each product's output: every SM computes at least this many of each
TILES_PER_SM = 2


@dataclass(frozen=True)
class StepResult:
    """One GPU's reference step: its hash and its output ``y`` (kept on the device)."""

    gpu: int
    digest: str
    output: torch.Tensor


def step_dtype(device: ComputeDevice) -> torch.dtype:
    """bf16 on a GPU (the training datapath); fp32 on a simulated GPU (the CPU's bf16 GEMM is too
    slow for a test and the stand-in's arithmetic is not what is under test)."""
    import torch

    return torch.float32 if device.simulated else torch.bfloat16


def step_shape(device: ComputeDevice) -> int:
    """The side ``d`` of the square products: at least TILES_PER_SM tiles on every SM."""
    block = SIM_BLOCK if device.simulated else GPU_BLOCK
    m, n = whole_gpu_mn(device.tile_model, TILES_PER_SM, block)
    return max(m, n)


def deterministic() -> None:
    """Process-wide settings that make a product's bits a function of its inputs alone."""
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # torch.use_deterministic_algorithms also sets Inductor's deterministic mode, importing
    # Inductor, Dynamo and sympy (seconds of CPU in every rank) for a compiler the agent never
    # runs; the eager kernels' switch is the flag it sets underneath, read back publicly below
    eager_switch = getattr(torch._C, "_set_deterministic_algorithms", None)
    if eager_switch is None:
        torch.use_deterministic_algorithms(True, warn_only=False)
    else:
        eager_switch(True, warn_only=False)
    if not torch.are_deterministic_algorithms_enabled():
        raise RuntimeError("torch did not take deterministic algorithms; stop-check cannot run")
    m = torch.backends.cuda.matmul
    m.allow_tf32 = False
    m.allow_bf16_reduced_precision_reduction = False
    m.allow_fp16_reduced_precision_reduction = False
    torch.backends.cudnn.allow_tf32 = False


def run_step(device: ComputeDevice, seed: int) -> StepResult:
    """The reference step of round ``seed`` on ``device``."""
    import torch

    dtype = step_dtype(device)
    d = step_shape(device)
    g = torch.Generator(device="cpu").manual_seed(20251125 + seed)

    def draw(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device=device.device, dtype=dtype)

    x, t = draw(d, d, scale=1.0), draw(d, d, scale=1.0)
    w1, w2 = draw(d, d, scale=d**-0.5), draw(d, d, scale=d**-0.5)
    mm = device.matmul
    pre = mm(x, w1)
    h = torch.relu(pre)
    y = mm(h, w2)
    dy = (y - t) * (2.0 / y.numel())
    dw2 = mm(h.transpose(0, 1).contiguous(), dy)
    dh = mm(dy, w2.transpose(0, 1).contiguous()) * (pre > 0).to(dtype)
    dw1 = mm(x.transpose(0, 1).contiguous(), dh)
    device.synchronize()
    sha = hashlib.sha256()
    for tensor in (y, dw1, dw2):
        sha.update(_bytes(tensor))
    return StepResult(device.spec.index, sha.hexdigest(), y)


def _bytes(tensor: torch.Tensor) -> bytes:
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    if flat.dtype in (torch.bfloat16, torch.float16):
        flat = flat.view(torch.int16)
    return flat.cpu().numpy().tobytes()


def digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's stored bytes."""
    return hashlib.sha256(_bytes(tensor)).hexdigest()
