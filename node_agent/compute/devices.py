"""Compute devices: where the load checks' GEMMs and copies run.

A real node computes on its CUDA GPUs through torch. A simulated node computes on the CPU, one
stand-in per simulated GPU, with its compute faults carried by its :class:`ComputeSpec` and
applied here, at the device boundary (DESIGN.md, "The simulator"; the specs come from the
node's :class:`StandInCompute`, built with the node): ``slow`` stretches the device's clock so every throughput
measured above this layer comes out scaled (GEMM time is modeled from the SKU's rate, see
:meth:`ComputeDevice.gemm_seconds`), and ``sdc`` makes the device's matmul return corrupted
elements. The checks' own code (timing, verification, grading) is the same either way.

**SDC fault model** (``{kind: sdc, gpu: N, sm: S, rate: R}``, ``docs/sdc.md``). A simulated
GPU has the SKU file's ``sm_count`` SMs (``DEFAULT_SM_COUNT``, an H100's 132, when the SKU
gives none) and computes GEMM outputs in tiles assigned to SMs round-robin, as a persistent tile
scheduler does (``node_agent.sdc.tiles``; each launch starts on a drawn SM). Every tile SM ``S``
computes (every SM without ``sm``) is wrong with probability ``R`` per launch (1.0 without
``rate``): one element of it has its top mantissa bit flipped. Draws come from a generator
seeded by the GPU index, so a stand-in node gives the same verdicts every run while ``R`` holds over
many launches. Every matmul of the device sees it: the SDC probes, the burn, Freivalds.

A :class:`ComputeSpec` is a plain picklable value, so a worker process (one per GPU for the
burn) rebuilds its device with :func:`open_device` on its side.

Timing: :meth:`ComputeDevice.clock` is the device's clock in seconds. On CUDA it is the host's
monotonic clock read after a synchronise. On a simulated device it is this process's CPU time
divided by the ``slow`` factor: CPU time, not wall time, so that eight simulated GPUs sharing
two cores each still measure their own work and a healthy stand-in does not grade WARN from
scheduler noise.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from node_agent.extras import missing_message
from node_agent.sdc.tiles import DEFAULT_SM_COUNT, TileModel, gpu_model, sim_model

if TYPE_CHECKING:
    import torch

    from node_agent.compute.copy_model import CopyModel
    from node_agent.hardware.sku import Sku

#: precision name -> torch dtype name; "tf32" is fp32 storage with TF32 tensor-core matmuls
PRECISION_DTYPES = {
    "fp8": "float8_e4m3fn",
    "bf16": "bfloat16",
    "fp16": "float16",
    "tf32": "float32",
    "fp32": "float32",
}


class ComputeUnavailable(Exception):
    """No device to compute on; the message says why (becomes a check's ``skip`` reason)."""


@dataclass(frozen=True)
class ComputeSpec:
    """Which device to open and, when simulated, which compute faults it carries."""

    index: int  # the GPU index the results are reported on (target gpu:N)
    simulated: bool = False
    slow_factor: float = 1.0  # simulated only: measured throughput is multiplied by this
    corrupt: bool = False  # simulated only: the sdc fault (see the module docstring)
    sdc_sm: int | None = None  # simulated only: the faulty SM (None: every SM)
    sdc_rate: float = 1.0  # simulated only: chance a tile on the faulty SM is wrong, per launch
    sm_count: int | None = None  # simulated only: SMs of the simulated GPU (default: the SKU's)
    cpu_threads: int = 1  # simulated only: torch intra-op threads of the stand-in
    #: simulated only: the modeled GEMM rate of a healthy GPU of the SKU, TFLOP/s per precision
    sim_tflops: tuple[tuple[str, float], ...] = ()

    @property
    def target(self) -> str:
        return f"gpu:{self.index}"


def torch_missing_reason() -> str | None:
    """None when torch is installed; otherwise the operator's next step.

    Asks the import system rather than importing: on a stand-in node only the workers compute,
    and an import here would cost this process seconds of CPU for nothing. A torch that is
    installed but does not import fails in the worker, which reports it as the check's error."""
    if importlib.util.find_spec("torch") is None:
        return (
            missing_message("torch", "torch", "the load tests (burn, thermal, HBM, PCIe, SDC)")
            + " (a CUDA build on GPU hosts)"
        )
    return None


#: Modeled GEMM rate of a simulated healthy GPU relative to its SKU's minimum: a healthy part
#: clears its floor (the H100 SKU file cites ~600-750 bf16 TFLOP/s measured for a 600 floor).
SIM_RATE_OVER_MINIMUM = 1.15
#: Used when the SKU file gives no minimum for a precision (H100-class figures, TFLOP/s).
SIM_DEFAULT_TFLOPS = {"fp8": 1300.0, "bf16": 690.0, "fp16": 690.0, "tf32": 345.0, "fp32": 52.0}


def sim_tflops_for(sku: Sku | None) -> tuple[tuple[str, float], ...]:
    """Modeled healthy GEMM rates (TFLOP/s) of a simulated GPU of ``sku``."""
    rates = dict(SIM_DEFAULT_TFLOPS)
    for precision in rates:
        minimum = sku.minimum(f"tflops_{precision}_min") if sku else None
        if minimum:
            rates[precision] = round(minimum * SIM_RATE_OVER_MINIMUM, 1)
    return tuple(sorted(rates.items()))


def sim_sm_count(sku: Sku | None) -> int:
    """SMs of a simulated GPU of ``sku``: the SKU file's ``sm_count``, else
    ``DEFAULT_SM_COUNT`` (an H100 SXM5's 132, the stand-in's reference SKU)."""
    count = sku.data.get("sm_count") if sku is not None else None
    return int(count) if count else DEFAULT_SM_COUNT


class StandInCompute(Protocol):
    """The compute of a stand-in node's GPUs, as the node provides it: one CPU stand-in spec
    per GPU (with the faults the node injects) and the modelled copy rates of those specs."""

    def specs(self, gpu_indices: list[int]) -> list[ComputeSpec]:
        """One spec per GPU; ComputeUnavailable says why there is none."""
        ...

    def copy_models(self, specs: Sequence[ComputeSpec]) -> dict[int, CopyModel]:
        """The modelled copy rates of the simulated specs among ``specs``, by GPU index."""
        ...


def compute_specs(
    gpu_indices: list[int], stand_in: StandInCompute | None = None
) -> list[ComputeSpec]:
    """One spec per GPU: CUDA devices on a real node, the stand-in's CPU devices on a stand-in.

    Raises ComputeUnavailable when torch is missing, when a real node's torch cannot see
    CUDA (a CPU build, or a driver torch cannot use) — never falls back to the CPU silently —
    or when the stand-in cannot compute (it says why).
    """
    reason = torch_missing_reason()
    if reason:
        raise ComputeUnavailable(reason)
    if stand_in is not None:
        return stand_in.specs(gpu_indices)
    import torch

    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise ComputeUnavailable(
            f"torch {torch.__version__} ({build}) cannot use CUDA on this "
            "host; install a CUDA build of torch matching the driver"
        )
    visible = torch.cuda.device_count()
    missing = [i for i in gpu_indices if i >= visible]
    if missing:
        raise ComputeUnavailable(
            f"torch sees {visible} CUDA device(s) but NVML lists GPU(s) "
            f"{', '.join(map(str, missing))}; check CUDA_VISIBLE_DEVICES"
        )
    return [ComputeSpec(i) for i in gpu_indices]


@dataclass(frozen=True)
class ComputeSource:
    """Where the compute checks run, chosen once with the node: the node's CUDA GPUs (no
    stand-in: figures are measured and held to the SKU's minima), or a stand-in node's CPU
    devices (figures are modelled from the SKU and the node's faults; only their ratios to the
    siblings are graded)."""

    stand_in: StandInCompute | None = None

    @property
    def measured(self) -> bool:
        """True when figures are measured on the node's GPUs, so the SKU minima apply."""
        return self.stand_in is None

    def specs(self, gpu_indices: list[int]) -> list[ComputeSpec]:
        """One spec per GPU (:func:`compute_specs`); ComputeUnavailable says why there is none."""
        return compute_specs(gpu_indices, self.stand_in)

    def copy_models(self, specs: Sequence[ComputeSpec]) -> dict[int, CopyModel]:
        """The copy models of the stand-in GPUs among ``specs`` (none for real GPUs: they are
        timed)."""
        return {} if self.stand_in is None else self.stand_in.copy_models(specs)


class ComputeDevice:
    """One device's compute: tensors, matmul, copies and its clock. Build with open_device()."""

    def __init__(
        self,
        spec: ComputeSpec,
        torch_device: torch.device,
        matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        self.spec = spec
        self.device = torch_device
        self._matmul = matmul

    @property
    def simulated(self) -> bool:
        return self.spec.simulated

    @property
    def label(self) -> str:
        if self.spec.simulated:
            return f"simulated {self.spec.target} (CPU)"
        return f"{self.spec.target} ({self.device})"

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a @ b`` as this device computes it (fp8 inputs through ``torch._scaled_mm``; a
        simulated SDC corrupts tiles of the output)."""
        return self._matmul(a, b)

    @property
    def sm_count(self) -> int:
        """Streaming multiprocessors: ``multi_processor_count`` of a CUDA device (what
        ``torch.cuda.get_device_properties`` reports), the SKU's for a simulated one."""
        if self.device.type == "cuda":
            import torch

            return int(torch.cuda.get_device_properties(self.device).multi_processor_count)
        return self.spec.sm_count or DEFAULT_SM_COUNT

    @property
    def tile_model(self) -> TileModel:
        """How this device's GEMM output tiles map to SMs (``node_agent.sdc.tiles``)."""
        if self.device.type == "cuda":
            return gpu_model(self.sm_count)
        return sim_model(self.sm_count)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    def clock(self) -> float:
        """Seconds on this device's clock; call after synchronize() to time finished work."""
        if self.spec.simulated:
            return time.process_time() / self.spec.slow_factor
        return time.perf_counter()

    def gemm_seconds(self, flops: float, precision: str, measured_s: float) -> float:
        """Device time of ``flops`` of GEMM work that took ``measured_s`` on :meth:`clock`.

        A real GPU: ``measured_s``. A simulated one: the time its modeled rate (the SKU's,
        times the ``slow`` factor) needs for that work. The stand-in still computes and the
        burn still verifies every product on the CPU, but CPU stand-ins sharing a few cores
        would otherwise time each other's scheduling and cache noise, not a GPU
        (docs/load_tests.md).
        """
        if not self.spec.simulated:
            return measured_s
        rate = dict(self.spec.sim_tflops).get(precision) or SIM_DEFAULT_TFLOPS[precision]
        return flops / (rate * 1e12 * self.spec.slow_factor)

    def supports(self, precision: str) -> bool:
        """Whether the device runs matmuls in ``precision`` (a PRECISION_DTYPES key)."""
        import torch

        dtype = getattr(torch, PRECISION_DTYPES[precision], None)
        if dtype is None:
            return False
        if self.device.type == "cuda":
            major, _ = torch.cuda.get_device_capability(self.device)
            if precision == "fp8":
                return major >= 9 and hasattr(torch, "_scaled_mm")
            if precision in ("bf16", "tf32"):
                return major >= 8
            return True
        return precision != "fp8"  # the CPU has no fp8 GEMM

    def info(self) -> dict[str, Any]:
        """What the device is, for a result's evidence."""
        import torch

        out: dict[str, Any] = {
            "device": str(self.device),
            "simulated": self.spec.simulated,
            # a str: torch's version is a TorchVersion, and unpickling one imports torch
            "torch": str(torch.__version__),
        }
        if self.device.type == "cuda":
            out["cuda_name"] = torch.cuda.get_device_name(self.device)
        else:
            out["slow_factor"] = self.spec.slow_factor
            out["cpu_threads"] = self.spec.cpu_threads
            out["modeled_gemm_tflops"] = dict(self.spec.sim_tflops)
        return out


def open_device(spec: ComputeSpec) -> ComputeDevice:
    """Open the device a spec names (in whichever process calls it)."""
    import torch

    from node_agent.sdc.exact import gemm

    if not spec.simulated:
        device = torch.device("cuda", spec.index)
        torch.cuda.set_device(device)
        return ComputeDevice(spec, device, gemm)
    torch.set_num_threads(spec.cpu_threads)
    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = gemm
    if spec.corrupt:
        from node_agent.sdc.inject import corrupting_matmul

        matmul = corrupting_matmul(
            seed=spec.index,
            sm=spec.sdc_sm,
            rate=spec.sdc_rate,
            tiles=sim_model(spec.sm_count or DEFAULT_SM_COUNT),
        )
    return ComputeDevice(spec, torch.device("cpu"), matmul)
