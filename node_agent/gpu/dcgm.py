"""DCGM (NVIDIA Data Center GPU Manager) as an extra source: diagnostics and health watches.

DCGM's Python bindings ship with the DCGM package, not on PyPI. :func:`find_bindings` looks for
``pydcgm`` in ``dcgm.bindings_path`` (config) and then where the packages install it
(:data:`BINDINGS_PATHS`); :func:`open_dcgm` imports them, connects to the host engine named by
``dcgm.hostengine`` (default ``localhost``, the ``nv-hostengine`` daemon) or, when none
answers, starts an embedded host engine in this process, and says which in
:attr:`BindingsDcgm.connection`. A host engine on this host whose port another user holds is
never asked (``dcgm.hostengine_users``; :func:`node_agent.peers.why_not_trusted`).

Checks see only the :class:`DcgmSource` protocol; tests pass a fake. Nothing here is imported
or touched until a DCGM check runs. Every failure of the bindings is translated here into
:class:`DcgmError` subclasses whose message says what to do:

* :class:`DcgmUnavailable` — no bindings: the checks ``skip`` (or fall back to ``dcgmi``).
* :class:`DcgmConnectError` — bindings present, but neither a host engine nor an embedded
  one could be had: an ``error`` (DCGM is installed, so a broken DCGM is not "absent").
* :class:`DcgmTimeout` — a call did not return in time (the call is abandoned on its thread).
* :class:`DcgmCallError` — a DCGM API call failed (``DCGMError`` with its return code).

API facts used (NVIDIA/DCGM ``testing/python3``): ``pydcgm.DcgmHandle(ipAddress=None|addr,
opMode=DCGM_OPERATION_MODE_AUTO)`` starts an embedded engine for ``None`` and connects
otherwise (``dcgmConnect_v2``); ``DcgmDiag.DcgmDiag(gpuIds=, testNamesStr="3"|"memory,pcie",
paramsStr=).Execute(handle)`` runs ``dcgmActionValidate_v2``; ``dcgm_agent.dcgmHealthSet(handle,
group, systems)`` / ``dcgmHealthCheck(handle, group)`` return ``overallHealth`` and
``incidents[incidentCount]`` with ``system``, ``health``, ``error.code``/``error.msg`` and
``entityInfo``.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from node_agent.gpu.base import GpuError
from node_agent.parsers.dcgm_diag import DiagEntityResult, DiagReport, DiagWarning, error_name
from node_agent.peers import held_by_another, on_this_host, split_host_port, why_not_trusted

#: where DCGM's packages put the Python bindings, newest first
BINDINGS_PATHS = (
    Path("/usr/share/datacenter-gpu-manager-4/bindings/python3"),  # DCGM 4
    Path("/usr/local/dcgm/bindings/python3"),  # DCGM 3.x
    Path("/usr/local/dcgm/bindings"),  # DCGM 3.x (older layout), 2.x
    Path("/usr/src/dcgm/bindings"),  # DCGM 2.0
)
INSTALL_HINT = (
    "install DCGM from NVIDIA's CUDA repository (DCGM 4: `apt-get install "
    "datacenter-gpu-manager-4-core datacenter-gpu-manager-4-cuda12`; DCGM 3: "
    "`datacenter-gpu-manager`), or set dcgm.bindings_path in the config to the "
    "directory holding pydcgm.py"
)

#: dcgmHealthSystems_t (dcgm_structs.h): watch name -> bit
#: the port nv-hostengine listens on unless told otherwise (DCGM_HE_PORT_NUMBER)
HOSTENGINE_PORT = 5555
HEALTH_SYSTEMS = {
    "pcie": 0x1,
    "nvlink": 0x2,
    "pmu": 0x4,
    "mcu": 0x8,
    "mem": 0x10,
    "sm": 0x20,
    "inforom": 0x40,
    "thermal": 0x80,
    "power": 0x100,
    "driver": 0x200,
    "nvswitch_nonfatal": 0x400,
    "nvswitch_fatal": 0x800,
}
#: dcgmHealthWatchResults_t
HEALTH_RESULTS = {0: "pass", 10: "warn", 20: "fail"}
#: dcgm_field_entity_group_t (dcgm_fields.h)
ENTITY_GROUPS = {
    0: "node",
    1: "GPU",
    2: "VGPU",
    3: "NvSwitch",
    4: "GPU_I",
    5: "GPU_CI",
    6: "Link",
    7: "CPU",
    8: "CPU_Core",
}
#: dcgmDiagResult_t
_DIAG_RESULTS = {0: "Pass", 1: "Skip", 2: "Warn", 3: "Fail", 4: None}  # 4: NOT_RUN
#: display names of dcgmDiagResponse v7-v10 fixed result slots (dcgmi/Diag.cpp)
_LEVEL_ONE_TESTS = (
    "Denylist",
    "NVML Library",
    "CUDA Main Library",
    "CUDA Toolkit Library",
    "Permissions and OS Blocks",
    "Persistence Mode",
    "Environment Variables",
    "Page Retirement/Row Remap",
    "Graphics Processes",
    "Inforom",
)
_PER_GPU_TESTS = (
    "GPU Memory",
    "Diagnostic",
    "PCIe",
    "SM Stress",
    "Targeted Stress",
    "Targeted Power",
    "Memory Bandwidth",
    "Memtest",
    "Pulse Test",
    "EUD Test",
)
_MAX_DEVICES = 32  # DCGM_MAX_NUM_DEVICES: an unused perGpuResponses slot carries this gpuId


# -- errors --------------------------------------------------------------------------------------


class DcgmError(GpuError):
    """A DCGM operation failed; the message says which and what to do."""


class DcgmUnavailable(DcgmError):
    """No DCGM Python bindings on this host (DCGM checks skip, naming what was searched)."""


class DcgmConnectError(DcgmError):
    """The bindings load, but no host engine answered and none could be started here."""


class DcgmTimeout(DcgmError):
    """A DCGM call did not return in time; it was abandoned on its thread."""


class DcgmCallError(DcgmError):
    """A DCGM API call returned an error."""


# -- what the checks ask and get -----------------------------------------------------------------


@dataclass(frozen=True)
class DiagRequest:
    """A diagnostic to run: a level 1-4 (``dcgmi diag -r 3``) or named tests (``-r memory,pcie``).

    ``gpus`` empty means every GPU; ``iterations`` > 1 repeats the run (stopping at the first
    failing one, as ``dcgmi diag --iterations`` does).
    """

    level: int | None = 3
    tests: tuple[str, ...] = ()
    gpus: tuple[int, ...] = ()
    iterations: int = 1

    def __post_init__(self) -> None:
        if self.tests and any(
            not t or "," in t or not t.replace("_", "").replace(" ", "").isalnum()
            for t in self.tests
        ):
            raise ValueError(
                f"DCGM test names must be words such as memory or pcie; got {list(self.tests)}"
            )
        if not self.tests and self.level not in (1, 2, 3, 4):
            raise ValueError(f"DCGM diagnostic level must be 1, 2, 3 or 4; got {self.level!r}")
        if self.iterations < 1:
            raise ValueError(f"iterations must be at least 1; got {self.iterations}")

    @property
    def run_arg(self) -> str:
        """The ``-r`` argument: ``"3"`` or ``"memory,pcie"``."""
        return ",".join(self.tests) if self.tests else str(self.level)


@dataclass(frozen=True)
class HealthIncident:
    """One incident of a DCGM health watch (``dcgmIncidentInfo_t``)."""

    system: str  # "mem", "pcie", ... (HEALTH_SYSTEMS)
    health: str  # "pass", "warn", "fail"
    error_code: int | None
    message: str
    entity_group: str = "GPU"
    entity_id: int | None = None

    @property
    def target(self) -> str:
        if self.entity_id is None or self.entity_group == "node":
            return "node"
        return f"{self.entity_group.lower()}:{self.entity_id}"

    @property
    def error_name(self) -> str | None:
        return error_name(self.error_code)


@dataclass(frozen=True)
class HealthReport:
    """What ``dcgmHealthCheck`` said: the overall health and each incident."""

    overall: str  # "pass", "warn", "fail"
    incidents: tuple[HealthIncident, ...] = ()
    systems: tuple[str, ...] = field(default_factory=tuple)


@runtime_checkable
class DcgmSource(Protocol):
    """DCGM as the checks see it: real bindings (:class:`BindingsDcgm`) or a test fake."""

    #: how DCGM was reached, e.g. "host engine at localhost", "embedded host engine"
    connection: str

    def run_diag(self, request: DiagRequest, timeout_s: float) -> DiagReport: ...
    def set_health_watches(self, systems: int) -> None: ...
    def check_health(self) -> HealthReport: ...
    def close(self) -> None: ...


def health_mask(systems: Sequence[str]) -> int:
    """``["pcie", "mem"]`` -> ``0x11``; ValueError names an unknown system."""
    unknown = [s for s in systems if s not in HEALTH_SYSTEMS]
    if unknown:
        raise ValueError(
            f"unknown DCGM health system(s) {unknown}; known: {', '.join(HEALTH_SYSTEMS)}"
        )
    mask = 0
    for s in systems:
        mask |= HEALTH_SYSTEMS[s]
    return mask


def system_name(bit: int) -> str:
    """A ``dcgmHealthSystems_t`` value -> its watch name (``0x10`` -> ``"mem"``)."""
    return next((name for name, b in HEALTH_SYSTEMS.items() if b == bit), f"system_{bit:#x}")


# -- finding and loading the bindings ----------------------------------------------------------


def bindings_candidates(configured: str | None) -> list[Path]:
    """Where to look, in order: the configured path first, then the packages' paths."""
    return ([Path(configured)] if configured else []) + list(BINDINGS_PATHS)


def find_bindings(candidates: Sequence[Path]) -> Path | None:
    """The first directory holding ``pydcgm`` (``pydcgm.py`` or a ``pydcgm`` package)."""
    for path in candidates:
        if (path / "pydcgm.py").is_file() or (path / "pydcgm" / "__init__.py").is_file():
            return path
    return None


@dataclass(frozen=True)
class Bindings:
    """The imported DCGM modules (``pydcgm``, ``dcgm_structs``, ``dcgm_agent``, ``DcgmDiag``)."""

    path: Path
    pydcgm: Any
    structs: Any
    agent: Any
    diag: Any


def load_bindings(path: Path, importer: Callable[[str], Any] = importlib.import_module) -> Bindings:
    """Import the bindings from ``path``; DcgmError says which module failed and why.

    The directory stays on ``sys.path``: the DCGM modules import one another by top-level
    name, some of them lazily.
    """
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    mods = {}
    for name in ("pydcgm", "dcgm_structs", "dcgm_agent", "DcgmDiag"):
        try:
            mods[name] = importer(name)
        except Exception as err:  # noqa: BLE001 - any import failure is a broken install
            raise DcgmConnectError(
                f"DCGM bindings in {path} do not import ({name}: "
                f"{type(err).__name__}: {err}); reinstall DCGM or point "
                "dcgm.bindings_path at a working copy"
            ) from err
    return Bindings(
        path=path,
        pydcgm=mods["pydcgm"],
        structs=mods["dcgm_structs"],
        agent=mods["dcgm_agent"],
        diag=mods["DcgmDiag"],
    )


def untrusted_hostengine(hostengine: str | None, users: Sequence[str]) -> str | None:
    """Why the host engine at ``hostengine`` may not be asked (None: it may). No address, or
    ``embedded``, is ``localhost``, where ``dcgmi`` asks first."""
    address = hostengine if hostengine and hostengine != "embedded" else "localhost"
    return why_not_trusted(address, HOSTENGINE_PORT, users)


def open_dcgm(
    config: Any,
    candidates: Sequence[Path] | None = None,
    loader: Callable[[Path], Bindings] = load_bindings,
    connect_timeout_s: float = 15.0,
) -> BindingsDcgm:
    """Find, load and connect; raises DcgmUnavailable (no bindings) or another DcgmError."""
    configured = config.dcgm.bindings_path
    searched = list(candidates) if candidates is not None else bindings_candidates(configured)
    path = find_bindings(searched)
    if path is None:
        raise DcgmUnavailable(
            "DCGM Python bindings not found (searched "
            + ", ".join(str(p) for p in searched)
            + f"): {INSTALL_HINT}"
        )
    source = BindingsDcgm(
        loader(path),
        hostengine=config.dcgm.hostengine,
        hostengine_users=config.dcgm.hostengine_users,
    )
    source.connect(connect_timeout_s)
    return source


# -- the real backend ----------------------------------------------------------------------------


def _bounded(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """``fn()`` on a daemon thread; DcgmTimeout when it is not back within ``timeout_s``.

    A DCGM call cannot be interrupted; a hung one is abandoned (the thread is a daemon, so it
    does not hold up the agent's exit).
    """
    done = threading.Event()
    outcome: list[Any] = [None, None]

    def target() -> None:
        try:
            outcome[0] = fn()
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            outcome[1] = err
        finally:
            done.set()

    threading.Thread(target=target, name=f"dcgm-{what}", daemon=True).start()
    if not done.wait(timeout_s):
        raise DcgmTimeout(
            f"DCGM {what} did not return within {timeout_s:g} s and was "
            "abandoned; check nv-hostengine (journalctl -u nvidia-dcgm) and "
            "dmesg for Xids"
        )
    if outcome[1] is not None:
        raise outcome[1]
    return outcome[0]


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.split(b"\0", 1)[0].decode(errors="replace")
    return str(value)


class BindingsDcgm:
    """DCGM through its Python bindings. Make one with :func:`open_dcgm`."""

    def __init__(
        self,
        bindings: Bindings,
        hostengine: str | None = "localhost",
        hostengine_users: Sequence[str] = ("nvidia-dcgm",),
    ) -> None:
        self._b = bindings
        self._hostengine = hostengine
        self._hostengine_users = tuple(hostengine_users)
        self._handle: Any = None
        self.connection = "not connected"
        error_cls = getattr(bindings.structs, "DCGMError", None)
        self._dcgm_error: type[BaseException] = (
            error_cls
            if isinstance(error_cls, type) and issubclass(error_cls, BaseException)
            else Exception
        )

    def connect(self, timeout_s: float = 15.0) -> None:
        """The host engine at ``hostengine``, else an embedded one (``"embedded"``: only that).

        A host engine on this host is asked only while its port is held by root or one of
        ``hostengine_users`` (:func:`node_agent.peers.why_not_trusted`), read before connecting
        and again after (the port may change hands in between). Where another account holds
        it, neither it nor an embedded engine is asked (two engines on one node can deadlock
        in the driver, DCGM's maintainers say): DcgmConnectError names the holder."""
        b = self._b
        mode = getattr(b.structs, "DCGM_OPERATION_MODE_AUTO", 1)
        refused = ""
        engine = self._hostengine
        if engine and engine != "embedded":
            if held := self._held_by_another(engine):
                raise DcgmConnectError(self._not_asked(engine, held))
            if distrust := self._distrust(engine):
                refused = f"; the host engine at {engine} was not asked: {distrust}"
            else:
                try:
                    self._handle = _bounded(
                        lambda: b.pydcgm.DcgmHandle(ipAddress=engine, opMode=mode),
                        timeout_s,
                        "connect",
                    )
                except (DcgmTimeout, self._dcgm_error) as err:
                    refused = f"; no host engine answered at {engine}: {err}"
                else:
                    if not (distrust := self._distrust(engine)):
                        self.connection = f"host engine at {engine}"
                        return
                    self.close()
                    raise DcgmConnectError(self._not_asked(engine, f"after connecting, {distrust}"))
        try:
            self._handle = _bounded(
                lambda: b.pydcgm.DcgmHandle(ipAddress=None, opMode=mode),
                timeout_s,
                "embedded start",
            )
        except (DcgmTimeout, self._dcgm_error) as err:
            raise DcgmConnectError(
                f"DCGM bindings in {b.path} load, but no host engine answered"
                f"{refused or ''} and an embedded one did not start ({err}); start it with "
                "`systemctl start nvidia-dcgm` (or nv-hostengine) or run the agent as root"
            ) from err
        self.connection = "embedded host engine" + (refused and f" ({refused[2:]})")

    def _distrust(self, engine: str) -> str | None:
        return untrusted_hostengine(engine, self._hostengine_users)

    def _held_by_another(self, engine: str) -> str | None:
        host, port = split_host_port(engine, HOSTENGINE_PORT)
        return held_by_another(port, self._hostengine_users) if on_this_host(host) else None

    def _not_asked(self, engine: str, why: str) -> str:
        return (
            f"the DCGM host engine at {engine} was not asked, nor an embedded one started beside "
            f"it: {why}; if it is DCGM's own nv-hostengine, name its account in "
            "dcgm.hostengine_users"
        )

    def _call(self, what: str, fn: Callable[..., Any], timeout_s: float = 30.0) -> Any:
        if self._handle is None:
            raise DcgmCallError(f"DCGM {what}: not connected")
        try:
            return _bounded(fn, timeout_s, what)
        except self._dcgm_error as err:
            code = getattr(err, "value", None)
            raise DcgmCallError(
                f"DCGM {what} failed ({self.connection}): {err}"
                + (f" [dcgmReturn_t {code}]" if code is not None else "")
            ) from err

    def run_diag(self, request: DiagRequest, timeout_s: float) -> DiagReport:
        """``dcgmActionValidate_v2`` through ``DcgmDiag``; repeats for ``request.iterations``."""
        reports = []
        for i in range(request.iterations):
            diag = self._b.diag.DcgmDiag(
                gpuIds=list(request.gpus) or None,
                testNamesStr=request.run_arg,
                paramsStr="",
                verbose=True,
            )
            resp = self._call(
                f"diagnostic -r {request.run_arg}",
                lambda d=diag: d.Execute(self._handle.handle),
                timeout_s,
            )
            one = report_from_response(resp, iteration=i if request.iterations > 1 else None)
            reports.append(one)
            if one.findings and any(f.status == "fail" for f in one.findings):
                break  # as dcgmi --iterations does: stop at the first failing run
        if len(reports) == 1:
            return reports[0]
        failed = any(f.status == "fail" for r in reports for f in r.findings)
        return DiagReport(
            results=tuple(x for r in reports for x in r.results),
            format=reports[0].format,
            dcgm_version=reports[0].dcgm_version,
            driver_version=reports[0].driver_version,
            iterations=len(reports),
            overall="Fail" if failed else "Pass",
        )

    def set_health_watches(self, systems: int) -> None:
        """``dcgmHealthSet`` on the all-GPUs group, then one field update so the first check
        has data (rate-based watches — PCIe, thermal, power — need about a minute of it)."""
        group = getattr(self._b.structs, "DCGM_GROUP_ALL_GPUS", 0x7FFFFFFF)
        agent = self._b.agent
        self._call(
            "health watch set", lambda: agent.dcgmHealthSet(self._handle.handle, group, systems)
        )
        self._call("field update", lambda: agent.dcgmUpdateAllFields(self._handle.handle, 1))

    def check_health(self) -> HealthReport:
        """``dcgmHealthCheck`` on the all-GPUs group."""
        group = getattr(self._b.structs, "DCGM_GROUP_ALL_GPUS", 0x7FFFFFFF)
        resp = self._call(
            "health check", lambda: self._b.agent.dcgmHealthCheck(self._handle.handle, group)
        )
        return health_report_from_response(resp)

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            try:
                _bounded(handle.Shutdown, 10.0, "disconnect")
            except (DcgmTimeout, self._dcgm_error):
                pass  # leaving: a host engine that does not answer here is reported elsewhere


# -- response structs -> the parser's model -----------------------------------------------------


def health_report_from_response(resp: Any) -> HealthReport:
    """``dcgmHealthResponse_v4/v5`` -> :class:`HealthReport`."""
    incidents = []
    for inc in list(resp.incidents)[: int(resp.incidentCount)]:
        group = ENTITY_GROUPS.get(int(inc.entityInfo.entityGroupId), "node")
        code = int(inc.error.code)
        incidents.append(
            HealthIncident(
                system=system_name(int(inc.system)),
                health=HEALTH_RESULTS.get(int(inc.health), "fail"),
                error_code=code or None,
                message=_text(inc.error.msg).strip(),
                entity_group=group,
                entity_id=None if group == "node" else int(inc.entityInfo.entityId),
            )
        )
    return HealthReport(
        overall=HEALTH_RESULTS.get(int(resp.overallHealth), "fail"), incidents=tuple(incidents)
    )


def report_from_response(resp: Any, iteration: int | None = None) -> DiagReport:
    """A diagnostic response struct -> :class:`DiagReport`, the same model ``dcgmi -j`` gives.

    Handles ``dcgmDiagResponse_v11/v12`` (DCGM 4: ``tests``, ``results``, ``errors``, ``info``
    indexed per test) and ``v7``-``v10`` (DCGM 3: ``levelOneResults`` and fixed per-GPU
    slots in ``perGpuResponses``).
    """
    version = _text(getattr(resp, "dcgmVersion", b"")) or None
    driver = _text(getattr(resp, "driverVersion", b"")) or None
    system_error = getattr(resp, "systemError", None)
    runtime_error = _text(system_error.msg).strip() or None if system_error is not None else None
    if hasattr(resp, "numTests"):
        results, fmt = _results_v12(resp, iteration), "dcgm4"
    else:
        results, fmt = _results_legacy(resp, iteration), "dcgm3"
    return DiagReport(
        results=tuple(results),
        format=fmt,
        dcgm_version=version,
        driver_version=driver,
        runtime_error=runtime_error,
    )


def _warning(err: Any) -> DiagWarning:
    return DiagWarning(
        message=_text(err.msg).strip(),
        error_id=int(err.code) or None,
        category=_int_attr(err, "category"),
        severity=_int_attr(err, "severity"),
    )


def _int_attr(obj: Any, name: str) -> int | None:
    value = getattr(obj, name, None)
    return None if value is None else int(value)


def _entity_result(
    test: str,
    category: str,
    group: str,
    entity: int | None,
    code: int,
    warnings: list[DiagWarning],
    info: list[str],
    iteration: int | None,
) -> DiagEntityResult | None:
    printed = _DIAG_RESULTS.get(code, "Fail")
    if printed is None:
        return None  # NOT_RUN
    return DiagEntityResult(
        test=test,
        category=category,
        entity_group=group,
        entity_id=entity,
        status=printed.lower(),
        printed_status=printed,
        warnings=tuple(warnings),
        info=tuple(i for i in info if i),
        iteration=iteration,
    )


def _results_v12(resp: Any, iteration: int | None) -> list[DiagEntityResult]:
    out = []
    categories = getattr(resp, "categories", None)
    for test in list(resp.tests)[: int(resp.numTests)]:
        cat = ""
        if categories is not None and hasattr(test, "categoryIndex"):
            try:
                cat = _text(categories[int(test.categoryIndex)])
            except (IndexError, TypeError):
                cat = ""
        errors = [resp.errors[i] for i in list(test.errorIndices)[: int(test.numErrors)]]
        infos = [
            resp.info[i]
            for i in list(getattr(test, "infoIndices", []))[: int(getattr(test, "numInfo", 0))]
        ]
        for idx in list(test.resultIndices)[: int(test.numResults)]:
            res = resp.results[idx]
            key = (int(res.entity.entityGroupId), int(res.entity.entityId))

            def mine(item: Any, key: tuple[int, int] = key) -> bool:
                return (int(item.entity.entityGroupId), int(item.entity.entityId)) == key

            group = ENTITY_GROUPS.get(key[0], "node")
            made = _entity_result(
                _text(test.name),
                cat,
                group,
                None if group == "node" else key[1],
                int(res.result),
                [_warning(e) for e in errors if mine(e)],
                [_text(i.msg) for i in infos if mine(i)],
                iteration,
            )
            if made is not None:
                out.append(made)
    return out


def _legacy_errors(result: Any) -> list[DiagWarning]:
    err = result.error
    items = list(err) if hasattr(err, "__len__") else [err]  # v3: error[5]; v2: one error
    return [_warning(e) for e in items if _text(e.msg).strip()]


def _results_legacy(resp: Any, iteration: int | None) -> list[DiagEntityResult]:
    """The level-one tests (the node's) and each GPU's tests of a v2/v3 response."""
    rows: list[tuple[str, str, str, int | None, Any]] = [
        (
            _LEVEL_ONE_TESTS[i] if i < len(_LEVEL_ONE_TESTS) else f"test {i}",
            "Deployment",
            "node",
            None,
            r,
        )
        for i, r in enumerate(list(resp.levelOneResults)[: int(resp.levelOneTestCount)])
    ]
    for gpu in resp.perGpuResponses:
        gpu_id = int(gpu.gpuId)
        if gpu_id < _MAX_DEVICES:
            tests = zip(_PER_GPU_TESTS, list(gpu.results), strict=False)  # the tests named
            rows.extend((test, "", "GPU", gpu_id, r) for test, r in tests)
    made = (
        _entity_result(
            test,
            category,
            group,
            entity,
            int(r.status),
            _legacy_errors(r),
            [_text(r.info)],
            iteration,
        )
        for test, category, group, entity, r in rows
    )
    return [m for m in made if m is not None]
