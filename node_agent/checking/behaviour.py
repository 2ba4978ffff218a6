"""What a check does in service, declared beside its ``run()``: the daemon reads it, never a name.

A check module may declare, next to ``run(ctx)``:

``SERVICE = ServiceBehaviour(sticky=..., fold=..., metrics=..., watcher=...)``
    - ``sticky(result)``: the key under which a result stays part of the grade for the
      daemon's life, whatever window a later run reads (``None``: not sticky). The xid check's
      Xid/SXid findings are sticky, one per ``(target, code)``.
    - ``fold(kept, new)``: which of two sticky results under one key is kept (default: the
      new one). The xid check keeps the one that counted more lines.
    - ``metrics``: a :class:`MetricsFactory`; the daemon builds one collector per factory
      (two checks that report one thing, ``sdc`` and ``sdc_spool``, share one) and registers it
      in its Prometheus registry. ``observe(results)`` is called with every run's results
      (a watcher's findings feed its own collector, below); ``collect()`` renders the
      families fresh at each scrape, client_python style. A collector that renders the
      latest run (a reading, a throughput figure) subclasses :class:`LatestResults`.
    - ``watcher``: a :data:`WatcherFactory`, for a check that is event-driven as well as
      periodic. The daemon builds one watcher per factory at its start, for every registered
      check (whether its suite schedules the check or not), with a :class:`WatchContext`: the
      node as the daemon has it now (:class:`WatchedNode`, read through a getter because the
      daemon swaps its environment on a driver reload, a scenario change or a config reload),
      the node's labels, and ``report``, through which the watcher hands back each
      :class:`Sighting` to be graded at once. A sighting's result is its check's and stays part
      of the grade under the check's ``sticky`` key, replacing what is kept there (a watcher
      folds its own findings, so its latest is its fullest). The watcher is also a Prometheus
      collector (its ``collect()``, which may yield nothing). The xid check's watcher follows
      NVML's Xid events and the kernel log (``checks/xid/watch.py``).

``OUTPUTS = ("trace",)`` and ``INPUTS = {"trace": "gpu_burn"}``
    A value one check hands to a later one in the same suite run: the producer declares the
    name and sets it with :func:`put_output`; the consumer declares where it comes from and
    reads it with :func:`get_input`. The runner hands over only what is declared.

A check without ``SERVICE`` gets :data:`PLAIN`: nothing sticky, no metrics of its own.
"""

from __future__ import annotations

import importlib
import math
import threading
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from node_agent.model import Result, Status, Target

if TYPE_CHECKING:
    from prometheus_client.core import GaugeMetricFamily

    from node_agent.checking.context import CheckContext
    from node_agent.checking.ports import Ports
    from node_agent.config import Config
    from node_agent.gpu.base import GpuBackend
    from node_agent.inventory import Inventory
    from node_agent.kernel_log import KernelLog

#: prefix under which the runner hands declared values over (``CheckContext.handover``)
_IO_PREFIX = "io:"


@dataclass(frozen=True)
class NodeLabels:
    """The labels every series of the node carries, read fresh at each scrape."""

    hostname: str
    gpu_uuids: Mapping[int, str]


class CheckMetrics(Protocol):
    """One check's own Prometheus collector (``prometheus_client`` calls ``collect()``)."""

    def observe(self, results: Sequence[Result]) -> None:
        """Take one run's results into the collector's state."""

    def forget(self, check: str) -> None:
        """``check`` left the daemon's schedule (a reload dropped it): its gauges go, so a scrape
        never shows a stale reading as current; a counter keeps its total (it never goes back)."""

    def collect(self) -> Iterable[Any]:
        """The metric families, rendered now."""


#: builds a check's collector; its argument gives the node's labels at scrape time
MetricsFactory = Callable[[Callable[[], NodeLabels]], CheckMetrics]

#: label values from training processes' heartbeats are untrusted text: Prometheus escapes
#: them, but a job id of megabytes would bloat every scrape, so they are cut to this length
MAX_LABEL_CHARS = 128


def label(value: object) -> str:
    """An untrusted label value: cut to ``MAX_LABEL_CHARS``; a lone surrogate (JSON's
    ``"\\ud800"``), which UTF-8 cannot encode and which would fail the whole scrape, is shown
    escaped (``\\ud800``)."""
    if value is None:
        return ""
    text = str(value)[:MAX_LABEL_CHARS]
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def number(value: object) -> float | None:
    """A finite number as a sample value; None for anything else (a bool included)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def figure(result: Result) -> float | None:
    """A result's value as a sample: None for a skip, an error or a value that is no finite
    number (a failing figure, a slow GPU's, is the point and counts)."""
    if result.status in (Status.SKIP, Status.ERROR):
        return None
    return number(result.value)


def add_once(
    family: GaugeMetricFamily, labels: list[str], value: float, seen: set[tuple[str, ...]]
) -> None:
    """Add one sample per series: the first result wins, so a figure reported twice never
    makes a duplicate sample (which fails the whole scrape)."""
    key = (family.name, *labels)
    if key not in seen:
        seen.add(key)
        family.add_metric(labels, value)


def gpu_labels(node: NodeLabels, target: str) -> list[str] | None:
    """``[hostname, gpu, uuid]`` for a ``gpu:N`` target (dcgm-exporter's labels), None for any
    other target."""
    index = Target.parse(target).gpu_index
    if index is None:
        return None
    return [node.hostname, str(index), node.gpu_uuids.get(index, "")]


class LatestResults:
    """Base of a collector that renders the latest run of the checks that feed it.

    ``observe`` keeps each check's newest results (a run replaces that check's previous one,
    so a run that skipped or broke takes its figures away); a subclass's ``collect()`` reads
    them with :meth:`latest`. A collector two checks share keeps one run per check, in the
    order the checks first reported.
    """

    def __init__(self, labels: Callable[[], NodeLabels]) -> None:
        self._labels = labels
        self._lock = threading.Lock()
        self._runs: dict[str, list[Result]] = {}

    def observe(self, results: Sequence[Result]) -> None:
        runs: dict[str, list[Result]] = {}
        for r in results:
            runs.setdefault(r.check, []).append(r)
        with self._lock:
            self._runs.update(runs)

    def forget(self, check: str) -> None:
        with self._lock:
            self._runs.pop(check, None)

    def latest(self) -> tuple[NodeLabels, list[Result]]:
        """(the node's labels now, the latest results of every check that fed this)."""
        node = self._labels()
        with self._lock:
            return node, [r for run in self._runs.values() for r in run]


class WatchedNode(Protocol):
    """The node a watcher watches, as the daemon has it (its environment)."""

    @property
    def config(self) -> Config: ...
    @property
    def gpu(self) -> GpuBackend: ...
    @property
    def kernel_log(self) -> KernelLog: ...
    @property
    def ports(self) -> Ports: ...
    @property
    def inventory(self) -> Inventory: ...


@dataclass(frozen=True)
class Sighting:
    """What a watcher hands back: one finding of its check, to be graded at once."""

    result: Result  # the check's result, kept under the check's SERVICE.sticky key
    why: str  # what made the watcher report it now: "first", "new variant or burst", "update"
    headline: str  # for the daemon's log: "Xid 79 on gpu:5 from nvml-event"


@dataclass(frozen=True)
class WatchContext:
    """What a watcher is started with (see the module docstring)."""

    node: Callable[[], WatchedNode]  # read at each use: the daemon swaps its environment
    labels: Callable[[], NodeLabels]  # the node's labels, for the watcher's own metrics
    report: Callable[[Sighting], None]  # graded at once; never raises into the watcher


class Watcher(Protocol):
    """A check's event-driven part in the daemon: threads of its own between ``start()`` and
    ``stop()``, and a Prometheus collector (``collect()``, which may yield nothing)."""

    def start(self) -> None: ...
    def stop(self, timeout_s: float = 2.0) -> None: ...
    def collect(self) -> Iterable[Any]: ...


#: builds a check's watcher (not yet started) from what the daemon gives it
WatcherFactory = Callable[[WatchContext], Watcher]


def keep_new(kept: Result, new: Result) -> Result:
    """The default fold: the newer result replaces the kept one."""
    return new


@dataclass(frozen=True)
class ServiceBehaviour:
    """A check's behaviour in the daemon (see the module docstring)."""

    sticky: Callable[[Result], Hashable | None] | None = None
    fold: Callable[[Result, Result], Result] = keep_new
    metrics: MetricsFactory | None = None
    watcher: WatcherFactory | None = None

    def __post_init__(self) -> None:
        if self.watcher is not None and self.sticky is None:
            raise TypeError(
                "a check with a watcher declares sticky: its watcher's findings are kept under "
                "the check's sticky key"
            )

    def sticky_key(self, result: Result) -> Hashable | None:
        return None if self.sticky is None else self.sticky(result)


PLAIN = ServiceBehaviour()


def _module(check: str) -> Any:
    from node_agent.checking.registry import REGISTRY

    try:
        return importlib.import_module(REGISTRY[check])
    except KeyError:
        raise KeyError(
            f"unknown check {check!r}; known checks: {', '.join(sorted(REGISTRY))}"
        ) from None


def behaviour(check: str) -> ServiceBehaviour:
    """The registered check's ``SERVICE`` (``PLAIN`` when it declares none). Imports the
    check's module, which imports nothing heavy at module level (compute checks import torch
    inside their functions)."""
    found = getattr(_module(check), "SERVICE", PLAIN)
    if not isinstance(found, ServiceBehaviour):
        raise TypeError(f"check {check}: SERVICE must be a ServiceBehaviour, not {found!r}")
    return found


def outputs(check: str) -> tuple[str, ...]:
    """The names the check declares it hands to later checks (``OUTPUTS``)."""
    return tuple(getattr(_module(check), "OUTPUTS", ()))


def inputs(check: str) -> dict[str, str]:
    """The check's declared inputs: name -> the check that produces it (``INPUTS``)."""
    return dict(getattr(_module(check), "INPUTS", {}))


def put_output(ctx: CheckContext, name: str, value: Any) -> None:
    """Hand ``value`` to later checks under a name this check declares in ``OUTPUTS``."""
    if name not in outputs(ctx.check):
        raise KeyError(f"check {ctx.check} does not declare {name!r} in OUTPUTS")
    ctx.handover[_IO_PREFIX + name] = value


def get_input(ctx: CheckContext, name: str) -> Any:
    """The value of a declared input (``INPUTS``), or None when its producer did not run
    earlier in this suite run."""
    if name not in inputs(ctx.check):
        raise KeyError(f"check {ctx.check} does not declare {name!r} in INPUTS")
    return ctx.handover.get(_IO_PREFIX + name)


class Handover:
    """One suite run's declared values: ``(producer, name) -> value``. The runner collects each
    check's declared outputs after it ran and gives each check only its declared inputs."""

    def __init__(self) -> None:
        self._values: dict[tuple[str, str], Any] = {}

    def inputs_for(self, check: str) -> dict[str, Any]:
        wanted = inputs(check) if check_known(check) else {}
        return {
            _IO_PREFIX + name: self._values[(producer, name)]
            for name, producer in wanted.items()
            if (producer, name) in self._values
        }

    def collect(self, check: str, given: Mapping[str, Any]) -> None:
        if not check_known(check):
            return
        for name in outputs(check):
            if _IO_PREFIX + name in given:
                self._values[(check, name)] = given[_IO_PREFIX + name]


def check_known(check: str) -> bool:
    from node_agent.checking.registry import REGISTRY

    return check in REGISTRY
