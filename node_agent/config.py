"""The agent's YAML configuration: defaults, validation, clear errors (see DESIGN.md).

``load_config(path)`` (or ``config_from_dict`` for tests and embedding) returns a
:class:`Config` whose typed, frozen sections are read by the code::

    config = load_config("/etc/node-agent/config.yaml")
    config.node.expected_gpus        # int | None
    config.adapter.slurm.timeout_s   # float
    config.safety.max_restarts       # int

Each key is written once, as a field of its section below: its type, its default and its
bounds (``key(15.0, gt=0)``). The defaults (:data:`DEFAULTS`), the file's schema
(:data:`SCHEMA`, whose errors name the key) and the parsing into sections are derived from
those fields; docs/configuration.md lists every key for operators, and a test holds it to them.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from node_agent.yamlfile import ConfigError, load_yaml, validate

DEFAULT_CONFIG_PATH = Path("/etc/node-agent/config.yaml")

_T = TypeVar("_T")
_RULE = "config_rule"  # a key's field metadata: its JSON Schema bounds


def key(
    default: _T,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    pattern: str | None = None,
    min_length: int | None = None,
    choices: Sequence[str] | None = None,
) -> _T:
    """One configuration key, as a section's field: its default and the bounds its value keeps.

    The type is the field's annotation (``str``, ``int``, ``float``, ``bool``, ``Path``, a
    ``tuple[X, ...]`` read from a YAML list, any of them ``| None``). ``ge``/``gt``/``le`` bound
    a number, ``pattern`` and ``min_length`` a string, ``choices`` lists the values allowed; on a
    tuple they bound each item."""
    bounds = {
        "minimum": ge,
        "exclusiveMinimum": gt,
        "maximum": le,
        "pattern": pattern,
        "minLength": min_length,
        "enum": None if choices is None else list(choices),
    }
    rule = {name: bound for name, bound in bounds.items() if bound is not None}
    return field(default=default, metadata={_RULE: rule})


def section(cls: type[_T]) -> _T:
    """A nested section of the configuration (``adapter.slurm``): its keys are ``cls``'s."""
    return field(default_factory=cls, metadata={_RULE: {}})


_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"


@dataclass(frozen=True)
class Software:
    """``node.software``: the golden software set (None = not checked)."""

    driver: str | None = key(None)
    cuda: str | None = key(None)
    nccl: str | None = key(None)
    vbios: str | None = key(None)
    kernel: str | None = key(None)

    def as_dict(self) -> dict[str, str | None]:
        """Component -> expected version, in the config's order (``driver``, ``cuda``, ...)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class NodeConfig:
    """``node``: what this node should be."""

    name: str | None = key(None, pattern=_NAME)
    sku: str = key("auto", pattern=r"^[a-z0-9][a-z0-9._-]*$")  # "auto" or a SKU id
    expected_gpus: int | None = key(None, ge=0)
    expected_nvlinks: int | None = key(None, ge=0)
    expected_memory_gib: float | None = key(None, gt=0)
    expected_cpus: int | None = key(None, ge=1)
    expected_hca_ports: int | None = key(None, ge=0)
    expected_hca_rate_gbps: float | None = key(None, ge=0)
    software: Software = section(Software)


@dataclass(frozen=True)
class HostConfig:
    """``host``: the host checks' tools (docs/host_checks.md)."""

    ipmitool: str = key("ipmitool", min_length=1)
    nvme: str = key("nvme", min_length=1)
    ras_mc_ctl: str = key("ras-mc-ctl", min_length=1)
    smartctl: str = key("smartctl", min_length=1)
    ipmi_sensors: str = key("ipmi-sensors", min_length=1)
    ipmi_sel: str = key("ipmi-sel", min_length=1)
    timeout_s: float = key(15.0, gt=0)


@dataclass(frozen=True)
class KernelLogConfig:
    """``kernel_log``: None = this host's kernel log; a path = that file instead."""

    path: str | None = key(None)


@dataclass(frozen=True)
class TrainingConfig:
    """``training``: None = the built-in cgroup roots (docs/training_hangs.md)."""

    slurm_cgroup_roots: tuple[str, ...] | None = key(None, min_length=1)


@dataclass(frozen=True)
class FleetConfig:
    """``fleet``: run as root, believe only report files owned by these uids."""

    report_owner_uids: tuple[int, ...] = key((0,), ge=0)


@dataclass(frozen=True)
class StorageConfig:
    """``storage``: the scratch paths the storage checks measure."""

    paths: tuple[str, ...] = key(())


@dataclass(frozen=True)
class WebhookConfig:
    """``adapter.webhook`` (docs/remediation.md)."""

    url: str | None = key(None)
    secret_file: str | None = key(None)
    timeout_s: float = key(5.0, gt=0)
    retries: int = key(3, ge=0)
    #: the whole action, retries and backoff included (4 x 5 s + 1 + 2 + 4 s fit)
    deadline_s: float = key(30.0, gt=0)
    ca_file: str | None = key(None)
    client_cert: str | None = key(None)
    client_key: str | None = key(None)
    #: besides root, the accounts whose receiver on this host (an http:// loopback url) is
    #: believed
    receiver_users: tuple[str, ...] = key((), min_length=1)


@dataclass(frozen=True)
class KubernetesConfig:
    """``adapter.kubernetes``."""

    kubeconfig: str | None = key(None)
    taint_key: str = key("node-agent/health")
    #: a DNS-1123 label: the namespace of a job named pod:<name>
    pod_namespace: str = key("default", pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


@dataclass(frozen=True)
class SlurmConfig:
    """``adapter.slurm``: the programs (a bare name is looked up on PATH)."""

    scontrol: str = key("scontrol", min_length=1)
    squeue: str = key("squeue", min_length=1)
    timeout_s: float = key(15.0, gt=0)


@dataclass(frozen=True)
class AdapterConfig:
    """``adapter``: which scheduler adapter acts, and each adapter's settings."""

    name: str = key("log", choices=("log", "slurm", "kubernetes", "webhook"))
    dry_run: bool = key(False)
    webhook: WebhookConfig = section(WebhookConfig)
    kubernetes: KubernetesConfig = section(KubernetesConfig)
    slurm: SlurmConfig = section(SlurmConfig)


@dataclass(frozen=True)
class Safety:
    """``safety``: the remediation guards (docs/remediation.md for each)."""

    max_drained_fraction: float = key(0.1, ge=0, le=1)
    max_restarts: int = key(2, ge=0)
    restart_window_h: float = key(24.0, gt=0)
    breaker_max_drains: int = key(5, ge=1)
    breaker_window_h: float = key(1.0, gt=0)
    dedup_window_s: float = key(600.0, ge=0)
    min_action_interval_s: float = key(60.0, ge=0)
    opt_out: bool = key(False)
    #: remediations of this node in 7 days after which it is held for an operator
    max_remediations_7d: int = key(5, ge=1)


@dataclass(frozen=True)
class NvhcdConfig:
    """``daemon.nvhcd``: NVRx's node health-check service; off while ``socket`` is None."""

    socket: str | None = key(None, pattern="^/")
    group: str | None = key(None, min_length=1)
    #: concurrent calls one uid may hold open; past it that uid's oldest call is closed
    max_per_uid: int = key(4, ge=1, le=64)
    #: the longest one call may take, its request's arrival included (seconds)
    call_s: float = key(5.0, gt=0, le=60)


@dataclass(frozen=True)
class DaemonConfig:
    """``daemon``: the long-running service (docs/daemon.md)."""

    listen: str = key("127.0.0.1:9847", pattern=r"^[^:\s]+:\d{1,5}$")  # host:port
    suite: str = key("periodic")
    default_every_s: float = key(300.0, gt=0)
    xid_poll_s: float = key(0.5, gt=0, le=5)
    nvml_retry_s: float = key(30.0, gt=0)
    act: bool = key(True)
    #: a failed action is retried while its grade stands: 30 s, doubling, up to 10 min
    retry_initial_s: float = key(30.0, gt=0)
    retry_max_s: float = key(600.0, gt=0)
    #: compute checks import torch: they run in a child so that the daemon stays small
    subprocess_checks: tuple[str, ...] = key(
        ("sdc", "gpu_burn", "thermal_power", "hbm_bandwidth", "pcie_bandwidth", "nccl_allreduce")
    )
    nvhcd: NvhcdConfig = section(NvhcdConfig)
    #: runs in a row that timed out or failed after which a check's failure is a finding
    failures_warn_after: int = key(3, ge=1)


@dataclass(frozen=True)
class NvmlConfig:
    """``nvml``."""

    call_timeout_s: float = key(10.0, gt=0)


@dataclass(frozen=True)
class DcgmConfig:
    """``dcgm``: None = the DCGM bindings' usual places."""

    bindings_path: str | None = key(None)
    hostengine: str = key("localhost")
    #: besides root, the accounts whose host engine on this host is believed
    hostengine_users: tuple[str, ...] = key(("nvidia-dcgm",), min_length=1)


def _parsed_from_data(cls: type[_T]) -> type[_T]:
    """Leaves ``cls``'s keys out of its ``__init__``, repr and ``==``: they are parsed from its
    ``data`` (and so equal where the data is), never given."""
    for value in vars(cls).values():
        if isinstance(value, dataclasses.Field):
            value.init = value.repr = value.compare = False
    return cls


@dataclass(frozen=True)
@_parsed_from_data
class Config:
    """Validated configuration, read through its typed sections (``config.node.expected_gpus``,
    ``config.adapter.slurm.scontrol``), parsed once when the config is built from ``data``.

    ``data`` holds every key with defaults filled in, as plain data: a child process gets the
    configuration as that (``proc.absolute_config(config.data)``). The fields after it are the
    file's top level, in the file's order."""

    data: dict[str, Any]
    source: str
    node: NodeConfig = section(NodeConfig)
    host: HostConfig = section(HostConfig)
    kernel_log: KernelLogConfig = section(KernelLogConfig)
    training: TrainingConfig = section(TrainingConfig)
    fleet: FleetConfig = section(FleetConfig)
    #: the private state directory
    state_dir: Path = key(Path("/var/lib/node-agent"), min_length=1)
    #: the root of the spools training jobs write to (``<spool_dir>/heartbeat``, ``/sdc``)
    spool_dir: Path = key(Path("/var/spool/node-agent"), min_length=1)
    #: None = the suites / graders that ship with the agent
    suites_dir: Path | None = key(None)
    graders_dir: Path | None = key(None)
    storage: StorageConfig = section(StorageConfig)
    adapter: AdapterConfig = section(AdapterConfig)
    safety: Safety = section(Safety)
    daemon: DaemonConfig = section(DaemonConfig)
    nvml: NvmlConfig = section(NvmlConfig)
    dcgm: DcgmConfig = section(DcgmConfig)

    def __post_init__(self) -> None:
        for f, kind in _keys(Config):
            object.__setattr__(self, f.name, _parse(kind, self.data[f.name]))


# -- what the declarations above give: the keys, their schema, defaults and parsing ---------


@functools.cache
def _keys(cls: type) -> tuple[tuple[dataclasses.Field[Any], Any], ...]:
    """``cls``'s configuration keys and sections, each with its resolved type."""
    kinds = typing.get_type_hints(cls)
    return tuple((f, kinds[f.name]) for f in fields(cls) if _RULE in f.metadata)


def _is_section(kind: Any) -> bool:
    return isinstance(kind, type) and dataclasses.is_dataclass(kind)


def _optional(kind: Any) -> Any:
    """X for ``X | None``, else None."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in args:
        (inner,) = (a for a in args if a is not type(None))
        return inner
    return None


_JSON_TYPE = {str: "string", Path: "string", int: "integer", float: "number", bool: "boolean"}


def _schema(kind: Any, rule: dict[str, Any]) -> dict[str, Any]:
    """The JSON Schema of one key of type ``kind`` within ``rule``'s bounds, or of a section."""
    if _is_section(kind):
        props = {f.name: _schema(k, f.metadata[_RULE]) for f, k in _keys(kind)}
        return {"type": "object", "additionalProperties": False, "properties": props}
    inner = _optional(kind)
    if inner is not None:
        schema = _schema(inner, rule)
        return schema | {"type": [schema["type"], "null"]} if "type" in schema else schema
    if typing.get_origin(kind) is tuple:
        return {"type": "array", "items": _schema(typing.get_args(kind)[0], rule)}
    if "enum" in rule:
        return dict(rule)
    if kind not in _JSON_TYPE:
        raise TypeError(f"a configuration key cannot be a {kind}: use str, int, float, bool, Path")
    return {"type": _JSON_TYPE[kind], **rule}


def _parse(kind: Any, value: Any) -> Any:
    """Validated plain ``value`` as ``kind``: a section, a tuple, a float, a Path."""
    if _is_section(kind):
        return kind(**{f.name: _parse(k, value[f.name]) for f, k in _keys(kind)})
    if value is None:
        return None
    kind = _optional(kind) or kind
    if typing.get_origin(kind) is tuple:
        return tuple(_parse(typing.get_args(kind)[0], item) for item in value)
    return kind(value) if kind in (int, float, Path) else value


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    return str(value) if isinstance(value, Path) else value


def _defaults(cls: type) -> dict[str, Any]:
    """Every key of ``cls`` with its default, as plain data (lists, strings)."""
    return {f.name: _defaults(k) if _is_section(k) else _plain(f.default) for f, k in _keys(cls)}


#: every key with its default, as the file would write it
DEFAULTS: dict[str, Any] = _defaults(Config)
#: the file's JSON Schema: an unknown key, a wrong type or a value out of bounds names the key
SCHEMA: dict[str, Any] = _schema(Config, {})


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for name, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(name), dict):
            merged[name] = _merge(merged[name], value)
        else:
            merged[name] = value
    return merged


#: the node's scheduler name where the host's own name is not it (a Kubernetes pod's hostname is
#: the pod's): the DaemonSet and the stop-check Job set it from the downward API's spec.nodeName
NODE_NAME_ENV = "NODE_AGENT_NODE_NAME"


def configured_node_name(config: Config, environ: Mapping[str, str] | None = None) -> str | None:
    """``node.name`` from the config, else ``$NODE_AGENT_NODE_NAME``, else None (the caller
    falls back to a scenario's host name or the short hostname)."""
    env = os.environ if environ is None else environ
    return config.node.name or env.get(NODE_NAME_ENV, "").strip() or None


def load_config(path: str | Path | None) -> Config:
    """Load ``path`` (or the default file when it exists, or only defaults) and validate it.

    An explicitly given file that is missing is an error; the default path may be absent.
    """
    if path is None:
        if not DEFAULT_CONFIG_PATH.exists():
            return Config(copy.deepcopy(DEFAULTS), "(defaults)")
        path = DEFAULT_CONFIG_PATH
    data = load_yaml(path, SCHEMA, what="config file", empty_ok=True)
    return Config(_merge(DEFAULTS, data), str(path))


def config_from_dict(data: dict[str, Any], source: str = "(inline)") -> Config:
    """Build a Config from a dict (tests, embedding); validated like a file."""
    validate(data, SCHEMA, source)
    return Config(_merge(DEFAULTS, data), source)


__all__ = ["Config", "ConfigError", "load_config", "config_from_dict", "DEFAULTS", "key", "section"]
