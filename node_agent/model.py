"""The data model: Result, Grade, Report and their JSON form (schema ``node-agent.report/1``).

Everything the agent measures becomes a :class:`Result`; grading turns results into a
:class:`Grade`; a :class:`Report` carries both with the inventory, and round-trips through JSON
so that ``node-agent grade report.json`` can re-grade a saved run.
"""

from __future__ import annotations

import datetime as _dt
import enum
import re
from dataclasses import asdict, dataclass, field
from typing import Any

REPORT_SCHEMA = "node-agent.report/1"


class Status(str, enum.Enum):
    """Outcome of one measurement. ``skip`` always says why; ``error`` means the check broke."""

    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"
    ERROR = "error"

    @property
    def severity(self) -> int:
        """The one order of "the worst status", everywhere: skip < pass < warn < error < fail.

        A ``fail`` is a finding; an ``error`` is a check that could not say, so it ranks below a
        finding and above anything that passed.
        """
        return _STATUS_SEVERITY[self]


_STATUS_SEVERITY = {
    Status.SKIP: 0,
    Status.PASS: 1,
    Status.WARN: 2,
    Status.ERROR: 3,
    Status.FAIL: 4,
}


class Level(enum.IntEnum):
    """Node grade, ordered: the worst reason decides."""

    HEALTHY = 0
    WARN = 1
    ERROR = 2  # recoverable: drain, restart (GPU reset or reboot), re-test
    FAULT = 3  # hardware: drain, replace

    @classmethod
    def parse(cls, text: str) -> Level:
        try:
            return cls[text.upper()]
        except KeyError:
            raise ValueError(
                f"unknown grade level {text!r}; expected one of {', '.join(m.name for m in cls)}"
            ) from None


class Action(str, enum.Enum):
    NONE = "none"
    RESTART = "restart"
    DRAIN = "drain"
    REPLACE = "replace"


ACTION_FOR_LEVEL = {
    Level.HEALTHY: Action.NONE,
    Level.WARN: Action.NONE,  # never drain for WARN
    Level.ERROR: Action.RESTART,
    Level.FAULT: Action.REPLACE,
}


class Recovery(str, enum.Enum):
    """The driver's own recovery action for a GPU (``nvmlGpuRecoveryAction_t``), as a finding
    carries it: the remediation plan chooses a GPU reset or a reboot from this, never from text."""

    NONE = "none"
    GPU_RESET = "gpu_reset"
    NODE_REBOOT = "node_reboot"
    DRAIN_P2P = "drain_p2p"
    DRAIN_AND_RESET = "drain_and_reset"
    RECOVER_IMEX_DOMAIN = "recover_imex_domain"
    BUS_RESET = "bus_reset"
    SYSTEM_REBOOT = "system_reboot"
    UNKNOWN = "unknown"  # a value newer than this list (NVML's ``unknown_<n>``)

    @classmethod
    def parse(cls, name: str) -> Recovery:
        """The action NVML named; a name this list lacks is UNKNOWN (never an error)."""
        try:
            return cls(name)
        except ValueError:
            return cls.UNKNOWN


class ReportFormatError(ValueError):
    """A saved report that cannot be read: wrong schema version, missing or mistyped field."""


@dataclass(frozen=True)
class PlannedEvent:
    """A maintenance the node's cloud announced ahead (``cloud_maintenance``): a typed fact the
    remediation plan reads for a ``planned`` remedy and names in the drain reason.

    ``provider`` is ``gcp``, ``aws``, ``azure`` or ``command``; ``kind`` the provider's own word
    (``TERMINATE_ON_HOST_MAINTENANCE``, ``system-reboot``, ``Redeploy``); ``starts_at`` and
    ``ends_at`` ISO-8601 UTC (None: not announced, or already begun); ``acknowledge`` (Azure
    Scheduled Events only) asks the agent to acknowledge the event once it drained the node.
    """

    provider: str
    kind: str
    event_id: str | None = None
    starts_at: str | None = None
    ends_at: str | None = None
    acknowledge: bool = False

    def describe(self) -> str:
        """``gcp TERMINATE_ON_HOST_MAINTENANCE from 2026-11-21T12:00:00Z``: what a drain reason
        and ``sinfo -R`` show."""
        when = f" from {self.starts_at}" if self.starts_at else " now"
        return f"{self.provider} {self.kind}{when}" + (
            f" until {self.ends_at}" if self.ends_at else ""
        )

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None and v is not False}

    @classmethod
    def from_dict(cls, data: Any) -> PlannedEvent:
        if not isinstance(data, dict) or not isinstance(data.get("kind"), str):
            raise ValueError(f"planned event {data!r:.120}: expected an object with a kind")
        optional = {}
        for key in ("event_id", "starts_at", "ends_at"):
            value = data.get(key)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"planned event: {key} must be a string, found {value!r}")
            optional[key] = value
        return cls(
            provider=str(data.get("provider", "")),
            kind=data["kind"],
            acknowledge=bool(data.get("acknowledge", False)),
            **optional,
        )


@dataclass
class Result:
    """One measurement or verdict of one check on one target.

    ``target`` is ``node``, ``gpu:3``, ``hca:mlx5_0``, ``disk:/scratch``, ``nvswitch:0`` or
    ``job:<job>/rank:<n>`` (read by :meth:`Target.parse`, never by hand); ``value`` carries
    its ``unit``; ``evidence`` holds what a person needs to believe the status.
    """

    check: str
    target: str
    metric: str
    status: Status
    detail: str
    value: float | int | str | bool | None = None
    unit: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
    duration_s: float = 0.0
    #: the driver's recovery action this finding reports (a typed fact for the plan), or None
    recovery: Recovery | None = None
    #: the announced maintenance this finding reports (``cloud_maintenance``), or None
    planned: PlannedEvent | None = None

    @property
    def entity(self) -> Target:
        """What the result is about: its target, parsed (:meth:`Target.parse`)."""
        return Target.parse(self.target)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "check": self.check,
            "target": self.target,
            "metric": self.metric,
            "value": self.value,
            "unit": self.unit,
            "status": self.status.value,
            "detail": self.detail,
            "evidence": self.evidence,
            "duration_s": round(self.duration_s, 3),
        }
        if self.recovery is not None:
            data["recovery"] = self.recovery.value
        if self.planned is not None:
            data["planned"] = self.planned.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Result:
        try:
            return cls(
                check=str(data["check"]),
                target=str(data["target"]),
                metric=str(data["metric"]),
                status=Status(data["status"]),
                detail=str(data.get("detail", "")),
                value=data.get("value"),
                unit=str(data.get("unit", "")),
                evidence=dict(data.get("evidence") or {}),
                duration_s=float(data.get("duration_s", 0.0)),
                recovery=Recovery.parse(str(data["recovery"])) if data.get("recovery") else None,
                planned=PlannedEvent.from_dict(data["planned"]) if data.get("planned") else None,
            )
        except (KeyError, ValueError, TypeError) as err:
            raise ReportFormatError(f"result {data!r:.120}: {err}") from err


class Remedy(str, enum.Enum):
    """The remedy class of a finding, a rule's ``remedy`` in graders/rules.yaml (JSON form
    ``remedy: software``).

    ``software`` marks a finding whose cause a restart may clear but a hardware swap never does
    (no driver, NVML broken, a check that could not run): an ERROR of such findings only, that
    survives its restarts, waits for an operator instead of being escalated to a replacement
    (docs/remediation.md). ``hardware`` says so explicitly; a finding with no marker is treated
    as hardware. ``planned`` marks an event announced ahead (a cloud's host maintenance,
    :class:`PlannedEvent`): an ERROR of such findings only drains the node, with no restart and
    no replacement, and a passing re-test after the event resumes it (docs/cloud.md).
    ``application`` marks an error a user's own code can make the driver report (an Xid of
    ``class: application`` in graders/xid.yaml, repeated on one GPU): it is restarted like any
    ERROR but never proves the hardware bad, so once its restarts are spent it too waits for an
    operator, who runs the GPU's field diagnostics, instead of being escalated to a replacement.
    ``record`` marks a finding read from a record that a restart does not clear (the BMC's
    event log, panics kept in pstore): that it is still there after a restart proves nothing,
    so once its restarts are spent it too waits for an operator, who reads and clears the record.
    ``elsewhere`` marks a finding whose cause is outside the parts a replacement swaps: a link
    error several GPUs report at once (an Xid of ``class: link``) or the same links down on
    every GPU (the far end, an NVSwitch; on an NVL72 rack, in another tray), an HCA port the
    switch or the subnet manager holds down, the fabric manager's partition, a PSU's feed. It
    too waits for an operator instead of a replacement. ``unclassified`` marks a FAIL no rule
    classifies (the ``unclassified-fail`` fallback, a check's metric graders/rules.yaml does not
    know): restarted like any ERROR, and then held for an operator, because nothing says a
    replacement fixes it.
    """

    SOFTWARE = "software"
    HARDWARE = "hardware"
    PLANNED = "planned"
    APPLICATION = "application"
    RECORD = "record"
    ELSEWHERE = "elsewhere"
    UNCLASSIFIED = "unclassified"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


#: the values of a rule's ``remedy`` (:class:`Remedy`)
REMEDIES = tuple(r.value for r in Remedy)
#: the catalogs a Reason's ``catalog`` names: ``graders/xid.yaml`` and ``graders/sxid.yaml``
CATALOGS = ("xid", "sxid")

# job:<job>/rank:<n> or job:<job>/pid:<n>; <job> may itself hold ':' and '/', so the member is
# anchored at the end (docs/training_hangs.md); '.' never matches a newline
_JOB_TARGET = re.compile(r"job:(?P<job>.+)/(?P<member>rank|pid):(?P<n>[0-9]+)")
_GPU_TARGET = re.compile(r"gpu:(?P<n>[0-9]+)")


@dataclass(frozen=True)
class Target:
    """A finding's target, parsed in this one place: what it names, as fields.

    ``kind`` is the part before the first ``:`` (``node``, ``gpu``, ``hca``, ``disk``,
    ``nvswitch``, ``job``; ``node`` for the bare word), ``name`` the rest (the job, for a job).
    ``gpu_index`` is set for ``gpu:<n>``; ``job`` (untrusted text: a training process wrote it)
    and ``rank`` or ``pid`` for ``job:<job>/rank:<n>`` and ``job:<job>/pid:<n>``.

    >>> Target.parse("gpu:3").gpu_index
    3
    >>> Target.parse("job:pod:ml/trainer-0/rank:3").job
    'pod:ml/trainer-0'
    >>> Target.parse("disk:/scratch")
    Target(kind='disk', name='/scratch', gpu_index=None, job=None, rank=None, pid=None)
    """

    kind: str
    name: str
    gpu_index: int | None = None
    job: str | None = None
    rank: int | None = None
    pid: int | None = None

    @classmethod
    def parse(cls, text: str) -> Target:
        """Never fails: a target of no known form is its kind and name as written (a job target
        that names no job has ``job`` None)."""
        gpu = _GPU_TARGET.fullmatch(text)
        if gpu:
            return cls("gpu", gpu.group("n"), gpu_index=int(gpu.group("n")))
        job = _JOB_TARGET.fullmatch(text)
        if job:
            n = int(job.group("n"))
            rank, pid = (n, None) if job.group("member") == "rank" else (None, n)
            return cls("job", job.group("job"), job=job.group("job"), rank=rank, pid=pid)
        kind, sep, name = text.partition(":")
        return cls(kind, name) if sep else cls(text or "node", "")


@dataclass(frozen=True)
class Reason:
    """Why a grade is what it is: the rule that fired, on which target, with what evidence.

    The remediation plan reads the typed fields, never the message (which is for people):

    * ``remedy``: the rule's remedy class (:class:`Remedy`), None when the rule has none;
    * ``catalog``, ``code`` and ``name``: the catalog entry that graded it (``xid`` 79 "GPU has
      fallen off the bus", ``sxid`` 20034; None for a rule that reads no catalog);
    * ``restarts_before_fault``: that entry's count of restarts after which the same code is
      hardware (None: ``safety.max_restarts`` applies);
    * ``recovery``: the driver's recovery action the finding reports (:class:`Recovery`);
    * ``planned``: the announced maintenance a ``planned`` finding reports (:class:`PlannedEvent`);
    * the entity (:attr:`entity`: its GPU index, job, or other kind and id), parsed from
      ``target`` by :meth:`Target.parse`.
    """

    rule: str
    level: Level
    target: str
    message: str
    remedy: Remedy | None = None
    catalog: str | None = None
    code: int | None = None
    restarts_before_fault: int | None = None
    name: str | None = None
    recovery: Recovery | None = None
    planned: PlannedEvent | None = None

    def __post_init__(self) -> None:
        # callers may name the enums by their JSON strings ("software", "gpu_reset")
        if self.remedy is not None and not isinstance(self.remedy, Remedy):
            object.__setattr__(self, "remedy", _remedy(self.remedy, self.rule))
        if self.recovery is not None and not isinstance(self.recovery, Recovery):
            object.__setattr__(self, "recovery", Recovery.parse(str(self.recovery)))

    @property
    def entity(self) -> Target:
        """What the finding is about: its target, parsed."""
        return Target.parse(self.target)

    @property
    def gpu_index(self) -> int | None:
        return self.entity.gpu_index

    @property
    def job(self) -> str | None:
        """The training job a job finding names (untrusted text), else None."""
        return self.entity.job

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "rule": self.rule,
            "level": self.level.name,
            "target": self.target,
            "message": self.message,
        }
        for key in ("remedy", "catalog", "code", "restarts_before_fault", "name", "recovery"):
            value = getattr(self, key)
            if value is not None:
                data[key] = value.value if isinstance(value, enum.Enum) else value
        if self.planned is not None:
            data["planned"] = self.planned.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Reason:
        """A reason as :meth:`to_dict` wrote it; a report written before a field existed reads
        with that field None."""
        remedy = data.get("remedy")
        catalog = data.get("catalog")
        if catalog is not None and catalog not in CATALOGS:
            raise ValueError(
                f"unknown catalog {catalog!r} in reason {data.get('rule')!r}; "
                f"expected one of {', '.join(CATALOGS)}"
            )
        name = data.get("name")
        if name is not None and not isinstance(name, str):
            raise ValueError(f"reason {data.get('rule')!r}: name must be a string, found {name!r}")
        recovery = data.get("recovery")
        planned = data.get("planned")
        return cls(
            rule=data["rule"],
            level=Level.parse(data["level"]),
            target=data["target"],
            message=data["message"],
            remedy=None if remedy is None else _remedy(remedy, data.get("rule")),
            catalog=catalog,
            code=_optional_int(data, "code"),
            restarts_before_fault=_optional_int(data, "restarts_before_fault"),
            name=name,
            recovery=None if recovery is None else Recovery.parse(str(recovery)),
            planned=None if planned is None else PlannedEvent.from_dict(planned),
        )


def _remedy(value: object, rule: object) -> Remedy:
    try:
        return Remedy(value)
    except ValueError:
        raise ValueError(
            f"unknown remedy {value!r} in reason {rule!r}; expected one of {', '.join(REMEDIES)}"
        ) from None


def _optional_int(data: dict[str, Any], key: str) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"reason {data.get('rule')!r}: {key} must be an integer, found {value!r}")
    return value


@dataclass(frozen=True)
class Grade:
    level: Level
    action: Action
    reasons: tuple[Reason, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "level": self.level.name,
            "action": self.action.value,
            "reasons": [r.to_dict() for r in self.reasons],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Grade:
        return cls(
            level=Level.parse(data["level"]),
            action=Action(data["action"]),
            reasons=tuple(Reason.from_dict(r) for r in data.get("reasons", [])),
        )


class Word(str, enum.Enum):
    """A str enum that prints as its value (``f"{StepAction.DRAIN}"`` is ``drain``): the words
    the journal keeps on disk and the report writes, so ``member == "drain"`` holds."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class StepAction(Word):
    """What one remediation step does (the journal's ``action`` column, a report's action)."""

    DRAIN = "drain"
    GPU_RESET = "gpu-reset"
    RESTART = "restart"  # a reboot request through the scheduler adapter
    RETEST = "retest"
    RESUME = "resume"
    REPLACE = "replace"
    RESTART_JOB = "restart-job"
    HOLD = "hold"  # journaled, no adapter call: the node waits for an operator


class ActionOutcome(Word):
    """How one remediation step ended (the journal row's final state)."""

    DONE = "done"  # the adapter acted, or the node already was in that state
    DRY_RUN = "dry-run"  # recorded only (``--dry-run``, ``adapter.dry_run``)
    REFUSED = "refused"  # not done, on purpose: ``ActionRecord.refusal`` says why
    FAILED = "failed"  # the adapter or GPU reset failed; kept in the journal and retried


class Refusal(Word):
    """Why a step was refused: what the daemon and the exit code decide on, never the detail."""

    STATE_UNAVAILABLE = "state-unavailable"  # the agent's own state unreadable: retried
    GUARD = "guard"  # a safety guard: opt-out, breaker, blast radius, a job id
    RATE_LIMIT = "rate-limit"  # too soon after the node's last action: retried after it
    FOREIGN_DRAIN = "foreign-drain"  # someone else's drain: left as it is
    NOT_AVAILABLE = "not-available"  # this command cannot do it (no re-test here)


@dataclass
class ActionRecord:
    """An action taken (or refused, or only logged) on the node through a scheduler adapter."""

    action: StepAction
    adapter: str
    outcome: ActionOutcome
    detail: str  # for people (the report, the journal, stderr); nothing decides on it
    at: str
    refusal: Refusal | None = None  # why, when ``outcome`` is refused

    def __post_init__(self) -> None:
        # a saved report names them by their words
        self.action = StepAction(self.action)
        self.outcome = ActionOutcome(self.outcome)
        if self.refusal is not None:
            self.refusal = Refusal(self.refusal)

    @property
    def retryable(self) -> bool:
        """A failure, or a refusal only because the agent's own state was unavailable or its
        last action was too recent: the daemon retries it while the grade stands."""
        return self.outcome is ActionOutcome.FAILED or self.refusal in (
            Refusal.STATE_UNAVAILABLE,
            Refusal.RATE_LIMIT,
        )

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "action": str(self.action),
            "adapter": self.adapter,
            "outcome": str(self.outcome),
            "detail": self.detail,
            "at": self.at,
        }
        if self.refusal is not None:
            data["refusal"] = str(self.refusal)
        return data


@dataclass
class GpuInfo:
    """Identity of one GPU, as ``nvidia-smi -q`` shows it."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str
    serial: str | None = None
    vbios: str | None = None
    memory_total_mib: int | None = None
    sku: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class HostInfo:
    hostname: str
    kernel: str
    driver: str | None = None
    cuda: str | None = None
    gpu_backend: str = "none"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Report:
    host: HostInfo
    gpus: list[GpuInfo]
    suite: str
    mode: str  # delivery | service: decides how a check that could not run is graded
    started_at: str
    finished_at: str
    results: list[Result]
    grade: Grade
    simulated: bool = False
    agent_version: str = ""
    sku: str | None = None
    actions: list[ActionRecord] = field(default_factory=list)
    #: ``Inventory.to_dict()``: the host, GPUs with their fabric, the NVLink domain (fleet)
    inventory: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": REPORT_SCHEMA,
            "agent_version": self.agent_version,
            "simulated": self.simulated,
            "host": self.host.to_dict(),
            "gpus": [g.to_dict() for g in self.gpus],
            "sku": self.sku,
            "suite": self.suite,
            "mode": self.mode,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "results": [r.to_dict() for r in self.results],
            "grade": self.grade.to_dict(),
            "actions": [a.to_dict() for a in self.actions],
            **({} if self.inventory is None else {"inventory": self.inventory}),
        }

    @classmethod
    def from_dict(cls, data: Any) -> Report:
        if not isinstance(data, dict):
            raise ReportFormatError(f"a report is a JSON object; found {type(data).__name__}")
        schema = data.get("schema")
        if schema != REPORT_SCHEMA:
            raise ReportFormatError(
                f"report schema is {schema!r}; this agent reads {REPORT_SCHEMA!r} "
                "(re-run the suite with this agent version, or use the agent that wrote it)"
            )
        try:
            return cls(
                host=HostInfo(**data["host"]),
                gpus=[GpuInfo(**g) for g in data.get("gpus", [])],
                suite=data["suite"],
                mode=data.get("mode", "delivery"),
                started_at=data["started_at"],
                finished_at=data["finished_at"],
                results=[Result.from_dict(r) for r in data["results"]],
                grade=Grade.from_dict(data["grade"]),
                simulated=bool(data.get("simulated", False)),
                agent_version=data.get("agent_version", ""),
                sku=data.get("sku"),
                actions=[ActionRecord(**a) for a in data.get("actions", [])],
                inventory=data.get("inventory"),
            )
        except ReportFormatError:
            raise
        except (KeyError, TypeError, ValueError) as err:
            raise ReportFormatError(f"report field missing or malformed: {err}") from err


def utc_iso(epoch: float | None = None) -> str:
    """The one time format of reports, journals, spools and adapters: ISO-8601 UTC with
    seconds, e.g. ``2026-11-21T12:00:00Z`` (``epoch`` None: now)."""
    moment = (
        _dt.datetime.now(_dt.timezone.utc)
        if epoch is None
        else _dt.datetime.fromtimestamp(epoch, _dt.timezone.utc)
    )
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def utc_stamp(epoch: float | None = None) -> str:
    """The same instant for a file name (no ``:``), e.g. ``20261121T120000Z``."""
    return utc_iso(epoch).replace("-", "").replace(":", "")
