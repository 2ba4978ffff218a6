"""Check ``dcgm_health``: DCGM's passive health watches, as incidents graded per subsystem.

Sets DCGM health watches (``params.systems``, default PCIe, memory, InfoROM, thermal, power,
NVLink, driver) on all GPUs and asks DCGM for incidents (``dcgmi health -s ... ; dcgmi health
-c`` does the same). Each incident is one result on its entity: metric ``health_<system>``
(``health_mem``, ``health_pcie``, ...), status ``warn`` or ``fail`` as DCGM says, evidence with
DCGM's error code and message. Where the code says more than the subsystem it names the metric
(:func:`incident_metric`): pending row remaps and page retirements (DCGM_FR codes 6, 83, 85) are
``health_reset_pending`` (a GPU reset applies them); a volatile double-bit or an uncontained
memory error (4, 81), ``health_mem_uncorrectable`` (drain and restart, as DCGM advises, not a
part to replace on one sighting); Fabric Manager's and IMEX's state, which
DCGM raises under the NVLink watch (122, 123), ``health_fabric_service``; counted NVLink errors,
a FAIL from one replay (13, 70, 71), ``health_nvlink_errors``. No incident: one ``pass``.

The watches need data: rate-based ones (PCIe replays, thermal, power) need about a minute of it
(dcgm_structs.h), so a one-shot check on a fresh embedded host engine sees only the immediate
ones (ECC, row remap, InfoROM, NVLink state, Xids). The daemon keeps a :class:`HealthWatch`
and polls it on its cadence; :func:`incident_results` turns any poll into results.

No DCGM bindings: ``skip`` naming the paths searched (the ``dcgmi`` CLI is not used here).
Simulated node: ``skip``. Params: ``systems`` (list of :data:`~node_agent.gpu.dcgm.HEALTH_SYSTEMS`
names).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from node_agent.checking.context import CheckContext
from node_agent.checking.params import Reader
from node_agent.checks.dcgm_diag import dcgm_unready
from node_agent.gpu.dcgm import (
    DcgmError,
    DcgmSource,
    DcgmUnavailable,
    HealthIncident,
    HealthReport,
    health_mask,
    open_dcgm,
)
from node_agent.model import Result, Status
from node_agent.parsers.dcgm_diag import RESET_FIRST_MEMORY_CODES

DEFAULT_SYSTEMS = ("pcie", "mem", "inforom", "thermal", "power", "nvlink", "driver")
#: said after the reason the node has no DCGM (``ports.dcgm_absent``)
ON_REAL_HARDWARE = "on real hardware this reads DCGM's health watches"
#: DCGM_FR_PENDING_PAGE_RETIREMENTS, DCGM_FR_DBE_PENDING_PAGE_RETIREMENTS,
#: DCGM_FR_PENDING_ROW_REMAP: the fix is a GPU reset (NVIDIA GPU memory error management)
RESET_PENDING_CODES = frozenset({6, 83, 85})
#: DCGM_FR_IMEX_UNHEALTHY, DCGM_FR_FABRIC_PROBE_STATE: raised under the NVLink watch for the
#: IMEX daemon's or Fabric Manager's state (DCGM's advice: "Ensure that the FabricManager is
#: running", "Check IMEX installation, configuration"): a service, not a part
FABRIC_SERVICE_CODES = frozenset({122, 123})
#: DCGM_FR_NVLINK_ERROR_THRESHOLD, DCGM_FR_NVLINK_CRC_ERROR_THRESHOLD,
#: DCGM_FR_NVLINK_ERROR_CRITICAL: counted link errors, FAIL from one replay or recovery error
#: (DCGM_LIMIT_MAX_NVLINK_ERROR 1); the counters' trend decides, as for NVML's (trends.yaml)
NVLINK_COUNTER_CODES = frozenset({13, 70, 71})

Opener = Callable[[Any], DcgmSource]


class HealthWatch:
    """DCGM health watches as a periodic source: set once, then :meth:`poll` on a cadence.

    >>> watch = HealthWatch(source, ["mem", "pcie"])   # doctest: +SKIP
    >>> watch.poll().incidents                          # doctest: +SKIP
    ()
    """

    def __init__(self, source: DcgmSource, systems: Sequence[str] = DEFAULT_SYSTEMS) -> None:
        self.source = source
        self.systems = tuple(systems)
        self._mask = health_mask(self.systems)  # ValueError for an unknown name, before DCGM
        self._armed = False

    def poll(self) -> HealthReport:
        """Incidents since DCGM last looked (sets the watches on the first call)."""
        if not self._armed:
            self.source.set_health_watches(self._mask)
            self._armed = True
        report = self.source.check_health()
        return HealthReport(
            overall=report.overall, incidents=report.incidents, systems=self.systems
        )


def incidents(source: DcgmSource, systems: Sequence[str] = DEFAULT_SYSTEMS) -> HealthReport:
    """One-shot: set the watches on ``source`` and return what DCGM reports."""
    return HealthWatch(source, systems).poll()


def incident_metric(incident: HealthIncident) -> str:
    """``health_<system>``, or by DCGM's error code where it says more than the subsystem:
    ``health_reset_pending`` (what a GPU reset applies), ``health_mem_uncorrectable`` (a
    double-bit or uncontained memory error: restart first), ``health_fabric_service`` (Fabric
    Manager or IMEX), ``health_nvlink_errors`` (counted link errors)."""
    code = incident.error_code
    if code in RESET_PENDING_CODES:
        return "health_reset_pending"
    if code in RESET_FIRST_MEMORY_CODES:
        return "health_mem_uncorrectable"
    if code in FABRIC_SERVICE_CODES:
        return "health_fabric_service"
    if code in NVLINK_COUNTER_CODES:
        return "health_nvlink_errors"
    return f"health_{incident.system}"


def incident_results(ctx: CheckContext, report: HealthReport, via: str) -> list[Result]:
    """One result per incident that is not PASS; one ``pass`` when there is none."""
    out = []
    for inc in report.incidents:
        if inc.health == "pass":
            continue
        status = Status.FAIL if inc.health == "fail" else Status.WARN
        code = (
            f"DCGM error {inc.error_code} {inc.error_name}" if inc.error_code else "no error code"
        )
        out.append(
            ctx.result(
                inc.target,
                incident_metric(inc),
                status,
                f"DCGM health {inc.system} {inc.health.upper()} on {inc.target}: "
                f"{inc.message or 'no message'} ({code})",
                value=inc.error_code,
                system=inc.system,
                health=inc.health.upper(),
                error_code=inc.error_code,
                error_name=inc.error_name,
                message=inc.message,
                overall=report.overall.upper(),
                via=via,
            )
        )
    if out:
        return out
    return [
        ctx.result(
            "node",
            "health",
            Status.PASS,
            f"DCGM health watches ({', '.join(report.systems)}) report no incident "
            f"(overall {report.overall.upper()})",
            systems=list(report.systems),
            overall=report.overall.upper(),
            via=via,
        )
    ]


@dataclass(frozen=True)
class Params:
    """The check's parameters (a suite's ``params``), validated by :meth:`parse`."""

    systems: tuple[str, ...] = DEFAULT_SYSTEMS  # the health watches set (HEALTH_SYSTEMS)

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Params:
        """ValueError naming the key and what was expected."""
        r = Reader("dcgm_health", raw, cls)
        systems = r.strings("systems")
        try:
            health_mask(systems)
        except ValueError as err:
            r.fail("systems", list(systems), str(err))
        return cls(systems=systems or DEFAULT_SYSTEMS)


def run(ctx: CheckContext, opener: Opener = open_dcgm) -> list[Result]:
    if unready := dcgm_unready(ctx, ON_REAL_HARDWARE):
        return unready
    systems = ctx.typed_params(Params).systems
    try:
        source = opener(ctx.config)
    except DcgmUnavailable as err:
        return [ctx.skip(str(err))]
    except DcgmError as err:
        return [ctx.result("node", "health", Status.ERROR, str(err))]
    try:
        report = incidents(source, systems)
    except DcgmError as err:
        return [
            ctx.result(
                "node",
                "health",
                Status.ERROR,
                f"DCGM health check did not complete: {err}",
                via=source.connection,
            )
        ]
    finally:
        source.close()
    return incident_results(ctx, report, via=source.connection)
