"""Modeled copy bandwidth of a simulated GPU: what its host<->device and device copies take.

A simulated GPU is a CPU stand-in, and its copies are CPU memcpys. Their time says what the
host's cores were doing (other processes, the other stand-ins, cache evictions), not what a
GPU's link or memory would do (measured: docs/load_tests.md, "Simulated copy bandwidth"). So, as
simulated GEMM time is modeled from the SKU's rate (:meth:`ComputeDevice.gemm_seconds`),
simulated copy time is modeled here, and the stand-in's copy still runs (the checks' code path,
buffers and error handling are the real ones) but its CPU time is not the measurement.

The model, per GPU (figures in GB/s = 10^9 B/s, per direction):

* **PCIe** (``h2d``, ``d2h``): the link's data rate times a copy efficiency. The link is the one
  the simulated NVML reports for the GPU: generation and width from the SKU's ``pcie`` section,
  the width the stand-in reports for the GPU's link when it is narrower, so a GPU trained x8 copies
  at half the rate of its x16 siblings, as a real one does. Data rate per lane after line
  coding (PCI-SIG base specifications: 8b/10b for Gen1-2, 128b/130b for Gen3-5, Gen6 FLIT
  mode with 242 of 256 bytes payload): Gen1 0.25, Gen2 0.5, Gen3 0.985, Gen4 1.969, Gen5 3.938,
  Gen6 7.563 GB/s. Copy efficiency 0.83: pinned ``bandwidthTest`` copies reach ~50-55 GB/s of
  Gen5 x16's 63 GB/s (the figure the SKU files cite next to ``pcie_h2d_gbps_min``).
* **HBM** (device copy): 1.15 x the SKU's ``hbm_bw_gbps_min``, the same margin over the floor
  that GEMM time uses (``SIM_RATE_OVER_MINIMUM``; the H100 file's 2,500 floor gives 2,875,
  within the 2.6-3.0 TB/s it cites as measured); 3,000 GB/s where the SKU gives no floor.
* **slow**: every figure times the ``slow`` factor (the fault slows the whole GPU, as a GPU
  stuck at a low clock or a degraded board does).

Only ratios between a node's GPUs are graded under simulation (DESIGN.md), so the absolute
figures matter only in that they are plausible. A healthy GPU's figure is the same on any
machine, however busy; a fault still shows, by the factor it carries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from node_agent.hardware.sku import Sku

#: PCIe data rate per lane and direction after line coding, GB/s, by generation (PCI-SIG)
PCIE_LANE_GBPS = {
    1: 0.25,
    2: 0.5,
    3: 8 * 128 / 130 / 8,
    4: 16 * 128 / 130 / 8,
    5: 32 * 128 / 130 / 8,
    6: 64 * 242 / 256 / 8,
}
#: share of the link's data rate a pinned host<->device copy reaches (~52 of Gen5 x16's 63)
PCIE_COPY_EFFICIENCY = 0.83
#: modeled HBM copy rate over the SKU floor; the margin simulated GEMM rates use too
HBM_RATE_OVER_MINIMUM = 1.15
#: HBM copy rate when the SKU gives no floor (GB/s; H100-class)
HBM_DEFAULT_GBPS = 3000.0
#: link when the SKU file has no pcie section (the simulated NVML's default)
DEFAULT_PCIE = {"gen": 4, "width": 16}

COPY_KINDS = ("h2d", "d2h", "hbm")


def pcie_link_gbps(gen: int, width: int) -> float:
    """Data rate of a PCIe link per direction in GB/s.

    >>> round(pcie_link_gbps(5, 16), 1)
    63.0
    """
    if gen not in PCIE_LANE_GBPS:
        raise ValueError(f"PCIe generation {gen!r} unknown (1-6)")
    return PCIE_LANE_GBPS[gen] * width


@dataclass(frozen=True)
class CopyModel:
    """A simulated GPU's modeled copy rates (GB/s) and how they were derived."""

    index: int
    h2d_gbps: float
    d2h_gbps: float
    hbm_copy_gbps: float
    basis: dict[str, Any] = field(default_factory=dict)

    def gbps(self, kind: str) -> float:
        """The modeled rate of one kind of copy: ``h2d``, ``d2h`` or ``hbm``."""
        try:
            return {"h2d": self.h2d_gbps, "d2h": self.d2h_gbps, "hbm": self.hbm_copy_gbps}[kind]
        except KeyError:
            raise ValueError(
                f"copy kind {kind!r}; expected one of {', '.join(COPY_KINDS)}"
            ) from None

    def seconds(self, kind: str, bytes_moved: int) -> float:
        """Modeled time of a copy that moves ``bytes_moved`` (count it as the check does)."""
        return bytes_moved / (self.gbps(kind) * 1e9)

    def evidence(self) -> dict[str, Any]:
        return {
            "modeled_gbps": {
                "h2d": round(self.h2d_gbps, 3),
                "d2h": round(self.d2h_gbps, 3),
                "hbm": round(self.hbm_copy_gbps, 3),
            },
            "model": dict(self.basis),
        }


def copy_model(
    index: int, slow_factor: float, sku: Sku | None, lanes: int | None = None
) -> CopyModel:
    """The modeled copy rates of simulated GPU ``index`` (see the module docstring): its link
    is the SKU's, trained at ``lanes`` where the stand-in narrowed it (None: the SKU's width)."""
    pcie = dict(DEFAULT_PCIE)
    if sku is not None:
        pcie.update({k: v for k, v in sku.section("pcie").items() if k in ("gen", "width")})
    gen, width = int(pcie["gen"]), int(pcie["width"])
    lanes = width if lanes is None else lanes
    link = pcie_link_gbps(gen, lanes) * PCIE_COPY_EFFICIENCY * slow_factor
    floor = sku.minimum("hbm_bw_gbps_min") if sku is not None else None
    hbm = (floor * HBM_RATE_OVER_MINIMUM if floor else HBM_DEFAULT_GBPS) * slow_factor
    basis = {
        "pcie_link": f"Gen{gen} x{lanes}",
        "pcie_expected": f"Gen{gen} x{width}",
        "pcie_copy_efficiency": PCIE_COPY_EFFICIENCY,
        "slow_factor": slow_factor,
        "hbm_from": (
            f"{HBM_RATE_OVER_MINIMUM} x SKU hbm_bw_gbps_min {floor:g}"
            if floor
            else f"default {HBM_DEFAULT_GBPS:g} GB/s (no SKU floor)"
        ),
    }
    return CopyModel(index=index, h2d_gbps=link, d2h_gbps=link, hbm_copy_gbps=hbm, basis=basis)
