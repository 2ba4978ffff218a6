"""The agent's YAML configuration: defaults, validation, clear errors (see DESIGN.md)."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node_agent.yamlfile import ConfigError, load_yaml

DEFAULT_CONFIG_PATH = Path("/etc/node-agent/config.yaml")

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
    "host": {"ipmitool": "ipmitool", "nvme": "nvme", "ras_mc_ctl": "ras-mc-ctl", "timeout_s": 15},
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
    "safety": {
        "max_drained_fraction": 0.1,
        "max_restarts": 2,
        "restart_window_h": 24,
        "breaker_max_drains": 5,
        "breaker_window_h": 1,
        "dedup_window_s": 600,
        "min_action_interval_s": 60,
        "opt_out": False,
        # remediations of this node in 7 days after which it is held for an operator
        "max_remediations_7d": 5,
    },
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
        # NVRx's node health-check service (docs/stop_check.md): off unless a socket
        # path is set (NVRx's default is /var/run/nvhcd.sock)
        "nvhcd": {"socket": None, "group": None, "max_age_s": 60, "min_refresh_s": 30},
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
                "nvhcd": _obj(
                    {
                        "socket": {"type": ["string", "null"], "pattern": "^/"},
                        "group": {"type": ["string", "null"], "minLength": 1},
                        "max_age_s": {"type": "number", "exclusiveMinimum": 0},
                        "min_refresh_s": {"type": "number", "minimum": 0},
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
    """Validated configuration; ``data`` holds every key with defaults filled in."""

    data: dict[str, Any]
    source: str

    def get(self, dotted: str) -> Any:
        node: Any = self.data
        for part in dotted.split("."):
            node = node[part]
        return node

    @property
    def state_dir(self) -> Path:
        return Path(self.data["state_dir"])

    @property
    def spool_dir(self) -> Path:
        """The root of the spools training jobs write to (``<spool_dir>/heartbeat``, ``/sdc``)."""
        return Path(self.data["spool_dir"])


#: the node's scheduler name where the host's own name is not it (a Kubernetes pod's hostname is
#: the pod's): the DaemonSet and the stop-check Job set it from the downward API's spec.nodeName
NODE_NAME_ENV = "NODE_AGENT_NODE_NAME"


def configured_node_name(config: Config, environ: Mapping[str, str] | None = None) -> str | None:
    """``node.name`` from the config, else ``$NODE_AGENT_NODE_NAME``, else None (the caller
    falls back to a scenario's host name or the short hostname)."""
    env = os.environ if environ is None else environ
    return config.get("node.name") or env.get(NODE_NAME_ENV, "").strip() or None


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
