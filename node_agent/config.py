"""The agent's YAML configuration: defaults, validation, clear errors (see DESIGN.md).

``load_config(path)`` (or ``config_from_dict`` for tests and embedding) returns a
:class:`Config` whose typed, frozen sections are read by the code::

    config = load_config("/etc/node-agent/config.yaml")
    config.node.expected_gpus        # int | None
    config.adapter.slurm.timeout_s   # float
    config.safety.max_restarts       # int

Each key has its default in :data:`DEFAULTS`, its rule in :data:`SCHEMA` and its typed field in
a section below (docs/configuration.md lists them for operators).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from node_agent.yamlfile import ConfigError, load_yaml

DEFAULT_CONFIG_PATH = Path("/etc/node-agent/config.yaml")


@dataclass(frozen=True)
class Software:
    """``node.software``: the golden software set (None = not checked)."""

    driver: str | None
    cuda: str | None
    nccl: str | None
    vbios: str | None
    kernel: str | None

    def as_dict(self) -> dict[str, str | None]:
        """Component -> expected version, in the config's order (``driver``, ``cuda``, ...)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class NodeConfig:
    """``node``: what this node should be."""

    name: str | None
    sku: str  # "auto" or a SKU id
    expected_gpus: int | None
    expected_nvlinks: int | None
    expected_memory_gib: float | None
    expected_cpus: int | None
    software: Software


@dataclass(frozen=True)
class HostConfig:
    """``host``: the host checks' tools (docs/host_checks.md)."""

    ipmitool: str
    nvme: str
    ras_mc_ctl: str
    smartctl: str
    ipmi_sensors: str
    ipmi_sel: str
    timeout_s: float


@dataclass(frozen=True)
class KernelLogConfig:
    """``kernel_log``: None = this host's kernel log; a path = that file instead."""

    path: str | None


@dataclass(frozen=True)
class TrainingConfig:
    """``training``: None = the built-in cgroup roots (docs/training_hangs.md)."""

    slurm_cgroup_roots: tuple[str, ...] | None


@dataclass(frozen=True)
class FleetConfig:
    """``fleet``: run as root, believe only report files owned by these uids."""

    report_owner_uids: tuple[int, ...]


@dataclass(frozen=True)
class StorageConfig:
    """``storage``: the scratch paths the storage checks measure."""

    paths: tuple[str, ...]


@dataclass(frozen=True)
class WebhookConfig:
    """``adapter.webhook`` (docs/remediation.md)."""

    url: str | None
    secret_file: str | None
    timeout_s: float
    retries: int
    deadline_s: float  # the whole action, retries and backoff included
    ca_file: str | None
    client_cert: str | None
    client_key: str | None


@dataclass(frozen=True)
class KubernetesConfig:
    """``adapter.kubernetes``."""

    kubeconfig: str | None
    taint_key: str
    pod_namespace: str


@dataclass(frozen=True)
class SlurmConfig:
    """``adapter.slurm``: the programs (a bare name is looked up on PATH)."""

    scontrol: str
    squeue: str
    timeout_s: float


@dataclass(frozen=True)
class AdapterConfig:
    """``adapter``: which scheduler adapter acts, and each adapter's settings."""

    name: str  # log | slurm | kubernetes | webhook
    dry_run: bool
    webhook: WebhookConfig
    kubernetes: KubernetesConfig
    slurm: SlurmConfig


@dataclass(frozen=True)
class Safety:
    """``safety``: the remediation guards (docs/remediation.md for each). The field defaults
    are the configuration's defaults (:data:`DEFAULTS` takes them from here)."""

    max_drained_fraction: float = 0.1
    max_restarts: int = 2
    restart_window_h: float = 24.0
    breaker_max_drains: int = 5
    breaker_window_h: float = 1.0
    dedup_window_s: float = 600.0
    min_action_interval_s: float = 60.0
    opt_out: bool = False
    #: remediations of this node in 7 days after which it is held for an operator
    max_remediations_7d: int = 5


@dataclass(frozen=True)
class NvhcdConfig:
    """``daemon.nvhcd``: NVRx's node health-check service; off while ``socket`` is None."""

    socket: str | None
    group: str | None
    #: concurrent calls one uid may hold open; past it that uid's oldest call is closed
    max_per_uid: int
    #: the longest one call may take, its request's arrival included (seconds)
    call_s: float


@dataclass(frozen=True)
class DaemonConfig:
    """``daemon``: the long-running service."""

    listen: str  # host:port
    suite: str
    default_every_s: float
    xid_poll_s: float
    nvml_retry_s: float
    act: bool
    retry_initial_s: float
    retry_max_s: float
    subprocess_checks: tuple[str, ...]
    nvhcd: NvhcdConfig
    #: runs in a row that timed out or failed after which a check's failure is a finding
    failures_warn_after: int


@dataclass(frozen=True)
class NvmlConfig:
    """``nvml``."""

    call_timeout_s: float


@dataclass(frozen=True)
class DcgmConfig:
    """``dcgm``: None = the DCGM bindings' usual places."""

    bindings_path: str | None
    hostengine: str


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _opt_path(value: Any) -> Path | None:
    return None if value is None else Path(value)


DEFAULTS: dict[str, Any] = {
    "node": {
        "name": None,
        "sku": "auto",
        "expected_gpus": None,
        "expected_nvlinks": None,
        # the host: installed memory (GiB) and online CPUs this node should have
        "expected_memory_gib": None,
        "expected_cpus": None,
        # the golden software set; a value that differs on the node is a WARN (drift)
        "software": {"driver": None, "cuda": None, "nccl": None, "vbios": None, "kernel": None},
    },
    # the host checks' tools (docs/host_checks.md)
    "host": {
        "ipmitool": "ipmitool",
        "nvme": "nvme",
        "ras_mc_ctl": "ras-mc-ctl",
        "smartctl": "smartctl",
        "ipmi_sensors": "ipmi-sensors",
        "ipmi_sel": "ipmi-sel",
        "timeout_s": 15,
    },
    # the kernel log the agent reads for driver messages: null = this host's (/dev/kmsg, else
    # journalctl -k); a path = that file instead (a saved log, a test's own log)
    "kernel_log": {"path": None},
    # training processes: null = the built-in default (docs/training_hangs.md)
    "training": {"slurm_cgroup_roots": None},
    # node-agent fleet, run as root: believe only report files owned by these uids
    "fleet": {"report_owner_uids": [0]},
    "state_dir": "/var/lib/node-agent",
    # where training jobs write heartbeats and SDC verdicts: apart from the private state_dir
    "spool_dir": "/var/spool/node-agent",
    "suites_dir": None,
    "graders_dir": None,
    "storage": {"paths": []},
    "adapter": {
        "name": "log",
        "dry_run": False,
        "webhook": {
            "url": None,
            "secret_file": None,
            "timeout_s": 5,
            "retries": 3,
            # the whole action, retries and backoff included (4 x 5 s + 1 + 2 + 4 s fit)
            "deadline_s": 30,
            "ca_file": None,
            "client_cert": None,
            "client_key": None,
        },
        "kubernetes": {
            "kubeconfig": None,
            "taint_key": "node-agent/health",
            "pod_namespace": "default",
        },
        "slurm": {"scontrol": "scontrol", "squeue": "squeue", "timeout_s": 15},
    },
    # the remediation guards: their defaults are the fields of Safety
    "safety": asdict(Safety()),
    "daemon": {
        "listen": "127.0.0.1:9847",
        "suite": "periodic",
        "default_every_s": 300,
        "xid_poll_s": 0.5,
        "nvml_retry_s": 30,
        "act": True,
        # a failed action is retried while its grade stands: 30 s, doubling, <= 10 min
        "retry_initial_s": 30,
        "retry_max_s": 600,
        # compute checks import torch: run them in a child so the daemon stays small
        "subprocess_checks": [
            "sdc",
            "gpu_burn",
            "thermal_power",
            "hbm_bandwidth",
            "pcie_bandwidth",
            "nccl_allreduce",
        ],
        # a check that times out or fails this many runs in a row is a WARN of its own
        # (a child wedged in NVML or DCGM: docs/daemon.md)
        "failures_warn_after": 3,
        # NVRx's node health-check service (docs/daemon.md): off unless a socket path is set
        # (the shipped unit's runtime directory: /run/node-agent/nvhcd.sock)
        "nvhcd": {"socket": None, "group": None, "max_per_uid": 4, "call_s": 5},
    },
    "nvml": {"call_timeout_s": 10},
    "dcgm": {"bindings_path": None, "hostengine": "localhost"},
}

_NULLABLE_STR = {"type": ["string", "null"]}


def _obj(props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "properties": props}


SCHEMA: dict[str, Any] = _obj(
    {
        "node": _obj(
            {
                "name": {
                    "type": ["string", "null"],
                    "pattern": r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$",
                },
                "sku": {"type": "string", "pattern": r"^[a-z0-9][a-z0-9._-]*$"},
                "expected_gpus": {"type": ["integer", "null"], "minimum": 0},
                "expected_nvlinks": {"type": ["integer", "null"], "minimum": 0},
                "expected_memory_gib": {"type": ["number", "null"], "exclusiveMinimum": 0},
                "expected_cpus": {"type": ["integer", "null"], "minimum": 1},
                "software": _obj(
                    {k: _NULLABLE_STR for k in ("driver", "cuda", "nccl", "vbios", "kernel")}
                ),
            }
        ),
        "host": _obj(
            {
                "ipmitool": {"type": "string", "minLength": 1},
                "nvme": {"type": "string", "minLength": 1},
                "ras_mc_ctl": {"type": "string", "minLength": 1},
                "smartctl": {"type": "string", "minLength": 1},
                "ipmi_sensors": {"type": "string", "minLength": 1},
                "ipmi_sel": {"type": "string", "minLength": 1},
                "timeout_s": {"type": "number", "exclusiveMinimum": 0},
            }
        ),
        "kernel_log": _obj({"path": _NULLABLE_STR}),
        "training": _obj(
            {
                "slurm_cgroup_roots": {
                    "type": ["array", "null"],
                    "items": {"type": "string", "minLength": 1},
                }
            }
        ),
        "fleet": _obj(
            {"report_owner_uids": {"type": "array", "items": {"type": "integer", "minimum": 0}}}
        ),
        "state_dir": {"type": "string", "minLength": 1},
        "spool_dir": {"type": "string", "minLength": 1},
        "suites_dir": _NULLABLE_STR,
        "graders_dir": _NULLABLE_STR,
        "storage": _obj({"paths": {"type": "array", "items": {"type": "string"}}}),
        "adapter": _obj(
            {
                "name": {"enum": ["log", "slurm", "kubernetes", "webhook"]},
                "dry_run": {"type": "boolean"},
                "webhook": _obj(
                    {
                        "url": _NULLABLE_STR,
                        "secret_file": _NULLABLE_STR,
                        "timeout_s": {"type": "number", "exclusiveMinimum": 0},
                        "retries": {"type": "integer", "minimum": 0},
                        "deadline_s": {"type": "number", "exclusiveMinimum": 0},
                        "ca_file": _NULLABLE_STR,
                        "client_cert": _NULLABLE_STR,
                        "client_key": _NULLABLE_STR,
                    }
                ),
                "kubernetes": _obj(
                    {
                        "kubeconfig": _NULLABLE_STR,
                        "taint_key": {"type": "string"},
                        # DNS-1123 label: the namespace of a job named pod:<name>
                        "pod_namespace": {
                            "type": "string",
                            "pattern": r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$",
                        },
                    }
                ),
                "slurm": _obj(
                    {
                        "scontrol": {"type": "string", "minLength": 1},
                        "squeue": {"type": "string", "minLength": 1},
                        "timeout_s": {"type": "number", "exclusiveMinimum": 0},
                    }
                ),
            }
        ),
        "safety": _obj(
            {
                "max_drained_fraction": {"type": "number", "minimum": 0, "maximum": 1},
                "max_restarts": {"type": "integer", "minimum": 0},
                "restart_window_h": {"type": "number", "exclusiveMinimum": 0},
                "breaker_max_drains": {"type": "integer", "minimum": 1},
                "breaker_window_h": {"type": "number", "exclusiveMinimum": 0},
                "dedup_window_s": {"type": "number", "minimum": 0},
                "min_action_interval_s": {"type": "number", "minimum": 0},
                "opt_out": {"type": "boolean"},
                "max_remediations_7d": {"type": "integer", "minimum": 1},
            }
        ),
        "daemon": _obj(
            {
                "listen": {"type": "string", "pattern": r"^[^:\s]+:\d{1,5}$"},
                "suite": {"type": "string"},
                "default_every_s": {"type": "number", "exclusiveMinimum": 0},
                "xid_poll_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 5},
                "nvml_retry_s": {"type": "number", "exclusiveMinimum": 0},
                "retry_initial_s": {"type": "number", "exclusiveMinimum": 0},
                "retry_max_s": {"type": "number", "exclusiveMinimum": 0},
                "subprocess_checks": {"type": "array", "items": {"type": "string"}},
                "act": {"type": "boolean"},
                "failures_warn_after": {"type": "integer", "minimum": 1},
                "nvhcd": _obj(
                    {
                        "socket": {"type": ["string", "null"], "pattern": "^/"},
                        "group": {"type": ["string", "null"], "minLength": 1},
                        "max_per_uid": {"type": "integer", "minimum": 1, "maximum": 64},
                        "call_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 60},
                    }
                ),
            }
        ),
        "nvml": _obj({"call_timeout_s": {"type": "number", "exclusiveMinimum": 0}}),
        "dcgm": _obj({"bindings_path": _NULLABLE_STR, "hostengine": {"type": "string"}}),
    }
)


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


@dataclass(frozen=True)
class Config:
    """Validated configuration, read through its typed sections (``config.node.expected_gpus``,
    ``config.adapter.slurm.scontrol``), parsed once when the config is built.

    ``data`` holds every key with defaults filled in, as plain data: a child process gets the
    configuration as that (``proc.absolute_config(config.data)``)."""

    data: dict[str, Any]
    source: str
    node: NodeConfig = field(init=False, repr=False, compare=False)
    host: HostConfig = field(init=False, repr=False, compare=False)
    kernel_log: KernelLogConfig = field(init=False, repr=False, compare=False)
    training: TrainingConfig = field(init=False, repr=False, compare=False)
    fleet: FleetConfig = field(init=False, repr=False, compare=False)
    storage: StorageConfig = field(init=False, repr=False, compare=False)
    adapter: AdapterConfig = field(init=False, repr=False, compare=False)
    safety: Safety = field(init=False, repr=False, compare=False)
    daemon: DaemonConfig = field(init=False, repr=False, compare=False)
    nvml: NvmlConfig = field(init=False, repr=False, compare=False)
    dcgm: DcgmConfig = field(init=False, repr=False, compare=False)
    #: the private state directory
    state_dir: Path = field(init=False, repr=False, compare=False)
    #: the root of the spools training jobs write to (``<spool_dir>/heartbeat``, ``/sdc``)
    spool_dir: Path = field(init=False, repr=False, compare=False)
    #: None = the suites / graders that ship with the agent
    suites_dir: Path | None = field(init=False, repr=False, compare=False)
    graders_dir: Path | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, value in _sections(self.data).items():
            object.__setattr__(self, name, value)


def _sections(d: dict[str, Any]) -> dict[str, Any]:
    """The typed sections of validated, defaults-filled ``data`` (numbers as float or int)."""
    n, sw, h = d["node"], d["node"]["software"], d["host"]
    a, w, k, sl = (
        d["adapter"],
        d["adapter"]["webhook"],
        d["adapter"]["kubernetes"],
        d["adapter"]["slurm"],
    )
    dm, nv, s = d["daemon"], d["daemon"]["nvhcd"], d["safety"]
    roots = d["training"]["slurm_cgroup_roots"]
    return {
        "node": NodeConfig(
            name=n["name"],
            sku=n["sku"],
            expected_gpus=n["expected_gpus"],
            expected_nvlinks=n["expected_nvlinks"],
            expected_memory_gib=_opt_float(n["expected_memory_gib"]),
            expected_cpus=n["expected_cpus"],
            software=Software(**{f.name: sw[f.name] for f in fields(Software)}),
        ),
        "host": HostConfig(
            ipmitool=h["ipmitool"],
            nvme=h["nvme"],
            ras_mc_ctl=h["ras_mc_ctl"],
            smartctl=h["smartctl"],
            ipmi_sensors=h["ipmi_sensors"],
            ipmi_sel=h["ipmi_sel"],
            timeout_s=float(h["timeout_s"]),
        ),
        "kernel_log": KernelLogConfig(path=d["kernel_log"]["path"]),
        "training": TrainingConfig(slurm_cgroup_roots=None if roots is None else tuple(roots)),
        "fleet": FleetConfig(report_owner_uids=tuple(d["fleet"]["report_owner_uids"])),
        "storage": StorageConfig(paths=tuple(d["storage"]["paths"])),
        "adapter": AdapterConfig(
            name=a["name"],
            dry_run=a["dry_run"],
            webhook=WebhookConfig(
                url=w["url"],
                secret_file=w["secret_file"],
                timeout_s=float(w["timeout_s"]),
                retries=w["retries"],
                deadline_s=float(w["deadline_s"]),
                ca_file=w["ca_file"],
                client_cert=w["client_cert"],
                client_key=w["client_key"],
            ),
            kubernetes=KubernetesConfig(
                kubeconfig=k["kubeconfig"],
                taint_key=k["taint_key"],
                pod_namespace=k["pod_namespace"],
            ),
            slurm=SlurmConfig(
                scontrol=sl["scontrol"], squeue=sl["squeue"], timeout_s=float(sl["timeout_s"])
            ),
        ),
        "safety": Safety(
            max_drained_fraction=float(s["max_drained_fraction"]),
            max_restarts=s["max_restarts"],
            restart_window_h=float(s["restart_window_h"]),
            breaker_max_drains=s["breaker_max_drains"],
            breaker_window_h=float(s["breaker_window_h"]),
            dedup_window_s=float(s["dedup_window_s"]),
            min_action_interval_s=float(s["min_action_interval_s"]),
            opt_out=s["opt_out"],
            max_remediations_7d=s["max_remediations_7d"],
        ),
        "daemon": DaemonConfig(
            listen=dm["listen"],
            suite=dm["suite"],
            default_every_s=float(dm["default_every_s"]),
            xid_poll_s=float(dm["xid_poll_s"]),
            nvml_retry_s=float(dm["nvml_retry_s"]),
            act=dm["act"],
            retry_initial_s=float(dm["retry_initial_s"]),
            retry_max_s=float(dm["retry_max_s"]),
            subprocess_checks=tuple(dm["subprocess_checks"]),
            nvhcd=NvhcdConfig(
                socket=nv["socket"],
                group=nv["group"],
                max_per_uid=int(nv["max_per_uid"]),
                call_s=float(nv["call_s"]),
            ),
            failures_warn_after=int(dm["failures_warn_after"]),
        ),
        "nvml": NvmlConfig(call_timeout_s=float(d["nvml"]["call_timeout_s"])),
        "dcgm": DcgmConfig(
            bindings_path=d["dcgm"]["bindings_path"], hostengine=d["dcgm"]["hostengine"]
        ),
        "state_dir": Path(d["state_dir"]),
        "spool_dir": Path(d["spool_dir"]),
        "suites_dir": _opt_path(d["suites_dir"]),
        "graders_dir": _opt_path(d["graders_dir"]),
    }


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
    from node_agent.yamlfile import validate

    validate(data, SCHEMA, source)
    return Config(_merge(DEFAULTS, data), source)


__all__ = ["Config", "ConfigError", "load_config", "config_from_dict", "DEFAULTS"]
