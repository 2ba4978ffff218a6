"""A check's typed parameters (checking/params.py): parsed once, when the suite loads, through the
check's ``Params``; a bad value is a configuration error naming the suite, the check and the key
(exit 2) and nothing runs. Every shipped suite loads, on a real host and on a stand-in node (its
``simulated`` overlay applied)."""

from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from node_agent.checking.context import CheckContext
from node_agent.checking.params import Reader
from node_agent.checking.registry import REGISTRY
from node_agent.commands.main import main
from node_agent.suite import CheckSpec, load_suite
from node_agent.yamlfile import ConfigError

REPO = Path(__file__).resolve().parents[2]
SUITES = REPO / "suites"
HEALTHY = str(REPO / "scenarios" / "healthy-h100.yaml")

#: one bad value per check with a ``Params``: (check, params, the key the error names)
BAD = [
    ("nvlink_fabric", {"clique_id": -1}, "clique_id"),
    ("nvlink_fabric", {"cluster_uuid": "rack-7"}, "cluster_uuid"),
    ("imex", {"timeout_s": 0}, "timeout_s"),
    ("imex", {"service_units": "x"}, "service_units"),
    ("storage", {"runtime_s": -1}, "runtime_s"),
    ("storage", {"read_bw_mbps_min": "fast"}, "read_bw_mbps_min"),
    ("software_drift", {"needs": {"peermem": "no"}}, "needs"),
    ("gpu_burn", {"duration_s": True}, "duration_s"),
    ("gpu_burn", {"precisions": "bf16"}, "precisions"),
    ("thermal_power", {"size": 8192.5}, "size"),
    ("hbm_bandwidth", {"reps": 0}, "reps"),
    ("pcie_bandwidth", {"concurrent_s": 0}, "concurrent_s"),
    ("nccl_allreduce", {"sizes": [1024, "1M"]}, "sizes"),
    ("sdc_spool", {"confirm": "yes"}, "confirm"),
    ("rdma", {"tcp_port": 70000}, "tcp_port"),
    ("rdma", {"perftest": "no"}, "perftest"),
    ("hca_ports", {"since": "yesterday"}, "since"),
    ("hca_ports", {"ignore": [1]}, "ignore"),
    ("xid", {"watch_s": -1}, "watch_s"),
    ("kernel_distress", {"nvme_repeat": 0}, "nvme_repeat"),
    ("kernel_distress", {"rasdaemon": 1}, "rasdaemon"),
    ("host_cpu", {"sys_root": 7}, "sys_root"),
    ("host_memory", {"sys_root": ""}, "sys_root"),
    ("host_power", {"ipmitool": ["ipmitool"]}, "ipmitool"),
    ("nvme_health", {"nvme": False}, "nvme"),
    ("pcie_aer", {"sys_root": 1.5}, "sys_root"),
    ("dcgm_diag", {"level": 7}, "level"),
    ("dcgm_diag", {"gpus": [0, -1]}, "gpus"),
    ("dcgm_health", {"systems": ["gpu_vibes"]}, "systems"),
    ("nvml_health", {"under_load": "true"}, "under_load"),
    ("sdc", {"repeats": 0}, "repeats"),
    ("sdc", {"duration_s": -5}, "duration_s"),
    ("sdc", {"dtypes": ["fp32", "fp64"]}, "dtypes"),
    ("sdc", {"shapes": [[16, 0, 16]]}, "shapes"),
    ("sdc", {"digest_shapes": [[16, 16]]}, "digest_shapes"),
    ("sdc", {"gpus": [0, "1"]}, "gpus"),
    ("sdc", {"digest_history": "yes"}, "digest_history"),
    ("sdc", {"freivalds_n": -1}, "freivalds_n"),
    ("training_progress", {"stale_file_s": -1}, "stale_file_s"),
    ("training_progress", {"stall_after_s": 0}, "stall_after_s"),
    ("training_progress", {"agree": 2.5}, "agree"),
    ("training_progress", {"straggler_ratio": 1}, "straggler_ratio"),
    ("training_progress", {"sample_all": 1}, "sample_all"),
    ("training_progress", {"stack_max_calls": 0}, "stack_max_calls"),
    ("training_progress", {"pids": [0]}, "pids"),
    ("training_progress", {"spool_dir": ""}, "spool_dir"),
]


def _typed_checks() -> list[str]:
    return [
        name
        for name, module in REGISTRY.items()
        if hasattr(importlib.import_module(module), "Params")
    ]


def _suite(tmp_path: Path, check: str, params: dict[str, object]) -> Path:
    path = tmp_path / "bad-suite.yaml"
    suite = {"name": "bad", "mode": "delivery", "checks": [{"check": check, "params": params}]}
    path.write_text(yaml.safe_dump(suite))
    return path


@pytest.fixture
def umask():
    """``main`` sets the agent's umask; the test process gets its own back."""
    old = os.umask(0o022)
    os.umask(old)
    yield
    os.umask(old)


# -- the shipped suites -------------------------------------------------------------------------


@pytest.mark.parametrize("suite", sorted(p.stem for p in SUITES.glob("*.yaml")))
def test_every_shipped_suite_parses_on_a_host_and_on_a_stand_in(suite):
    loaded = load_suite(suite, SUITES)
    typed = set(_typed_checks())
    for spec in loaded.checks:
        if spec.check in typed:
            params = importlib.import_module(REGISTRY[spec.check]).Params
            assert isinstance(spec.typed_for(False), params), spec.check
            assert isinstance(spec.typed_for(True), params), spec.check
        else:
            assert spec.typed_for(False) is None and spec.typed_for(True) is None


def test_the_stand_in_overlay_reaches_the_typed_params():
    """Scenarios carry no check params of their own: the suite's ``simulated`` overlay is what a
    stand-in node's checks get on top."""
    spec = CheckSpec("imex", params={"timeout_s": 5, "simulated": {"timeout_s": 1}})
    assert (spec.typed_for(False).timeout_s, spec.typed_for(True).timeout_s) == (5.0, 1.0)


def test_the_delivery_suites_null_in_the_overlay_takes_the_sdc_default():
    """``duration_s: null`` in the ``simulated`` overlay: no duration on a stand-in node (the
    default), the suite's 180 s on a host."""
    (spec,) = [c for c in load_suite("delivery", SUITES).checks if c.check == "sdc"]
    assert spec.typed_for(False).duration_s == 180.0
    assert spec.typed_for(True).duration_s is None
    assert spec.typed_for(True).freivalds_n == 64


def test_the_sdc_and_hang_check_commands_build_suites_whose_params_parse(tmp_path):
    """``node-agent sdc`` and ``hang-check`` amend a shipped suite's entry (the GPUs, a
    duration, pids, sampling); what they add is typed like the rest."""
    from node_agent.checks.sdc import Params as SdcParams
    from node_agent.checks.training_progress import Params as TrainingParams
    from node_agent.commands import hang_check, sdc
    from node_agent.config import load_config

    config = load_config(None)
    (probe,) = sdc.build_suite(config, SUITES, [0, 2], 30.0).checks
    for stand_in in (False, True):
        typed = probe.typed_for(stand_in)
        assert isinstance(typed, SdcParams)
        assert (typed.gpus, typed.duration_s) == ((0, 2), 30.0)
    (hang,) = hang_check.build_suite(config, SUITES, [4242], 2, 0.0).checks
    typed = hang.typed_for(False)
    assert isinstance(typed, TrainingParams)
    assert (typed.pids, typed.sample_all, typed.one_shot) == ((4242,), True, True)
    assert (typed.stack_samples, typed.stack_interval_s) == (2, 0.0)


def test_a_check_without_params_reads_its_old_defaults():
    """Typing the params kept every default: the training check's (its thresholds are
    graders/training.yaml's: tests/unit/test_hang_verdict.py), the SDC plan's sizes those the
    check always used."""
    from node_agent.checks import sdc
    from node_agent.checks.nvml_health import Params as NvmlParams
    from node_agent.checks.training_progress import Params as TrainingParams

    training = TrainingParams.parse({})
    assert (training.stack_samples, training.stale_file_s, training.one_shot) == (
        3,
        86400.0,
        False,
    )
    assert sdc.Params.parse({}) == sdc.Params()
    assert (sdc.Params().repeats, sdc.Params().seeds, sdc.Params().min_free_mib) == (2, 4, 2048)
    assert sdc.Params().digest_history and sdc.Params().gpus is None
    assert NvmlParams.parse({}).under_load is False


# -- a bad value: exit 2, the key named, nothing run ----------------------------------------------


@pytest.mark.parametrize(("check", "params", "key"), BAD)
def test_a_bad_param_is_exit_2_naming_suite_check_and_key(
    tmp_path, capsys, umask, check, params, key
):
    suite = _suite(tmp_path, check, params)
    out = tmp_path / "reports"
    code = main(["check", "--simulate", HEALTHY, "--suite", str(suite), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert "suite 'bad'" in err and f"params of {check}: {key} " in err
    assert not out.exists()


def test_the_cli_refuses_a_bad_param_before_running_anything(tmp_path):
    suite = _suite(tmp_path, "nvlink_fabric", {"clique_id": "two"})
    out = tmp_path / "reports"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state")}))
    argv = ["check", "--simulate", HEALTHY, "--suite", str(suite), "--out", str(out)]
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from node_agent.commands.main import main; sys.exit(main())",
            *argv,
            "--config",
            str(config),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert "params of nvlink_fabric: clique_id 'two': expected a whole number" in run.stderr
    assert not out.exists()


def test_a_bad_value_in_the_stand_in_overlay_is_refused_too(tmp_path):
    suite = _suite(tmp_path, "imex", {"simulated": {"timeout_s": -1}})
    with pytest.raises(ConfigError, match="'simulated' overlay.*timeout_s -1"):
        load_suite(str(suite), SUITES)


@pytest.mark.parametrize("check", _typed_checks())
def test_unknown_keys_are_refused(check):
    with pytest.raises(ConfigError, match=rf"params of {check}: unknown key\(s\) colour"):
        CheckSpec(check, params={"colour": "red"})


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (math.nan, "a finite number above 0"),
        (math.inf, "a finite number above 0"),
        (True, "a finite number above 0"),
        ("5", "a finite number above 0"),
    ],
)
def test_nan_infinity_bool_and_text_are_not_numbers(value, expected):
    with pytest.raises(ConfigError, match=f"timeout_s {value!r}: expected {expected}"):
        CheckSpec("imex", params={"timeout_s": value})


@pytest.mark.parametrize(
    ("check", "key"),
    [
        ("sdc", "min_free_mib"),
        ("sdc", "duration_s"),
        ("training_progress", "stale_file_s"),
        ("training_progress", "stack_interval_s"),
    ],
)
def test_nan_is_refused_naming_the_key(check, key):
    """A suite file's YAML refuses .nan before the params see it; a suite built in code (the
    ``sdc`` and ``hang-check`` commands) reaches the check's own refusal."""
    with pytest.raises(ConfigError, match=rf"check '{check}': params of {check}: {key} nan"):
        CheckSpec(check, params={key: math.nan})


# -- the contract -------------------------------------------------------------------------------


def test_the_check_reads_the_params_parsed_at_load(tmp_path):
    spec = CheckSpec("imex", params={"tool": "imex-ctl"})
    ctx = CheckContext(
        check="imex",
        gpu=None,  # type: ignore[arg-type]  # not read: the check reads only its params here
        kernel_log=None,  # type: ignore[arg-type]
        config=None,  # type: ignore[arg-type]
        inventory=None,  # type: ignore[arg-type]
        sku=None,
        expected_gpus=None,
        params={"tool": "never-parsed"},
        typed=spec.typed_for(False),
    )
    params = importlib.import_module("node_agent.checks.imex").Params
    assert ctx.typed_params(params) is spec.typed_for(False)
    assert ctx.typed_params(params).tool == "imex-ctl"


def test_a_reader_takes_its_defaults_from_the_dataclass():
    params = importlib.import_module("node_agent.checks.imex").Params
    r = Reader("imex", {"timeout_s": None}, params)
    assert r.positive("timeout_s") == params.timeout_s  # null reads as not given


def test_importing_every_check_for_its_params_imports_no_compute_library():
    code = (
        "import importlib, sys\n"
        "from node_agent.checking.registry import REGISTRY\n"
        "for m in REGISTRY.values(): importlib.import_module(m)\n"
        "print(sorted(h for h in ('torch', 'numpy', 'cupy') if h in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    )
    assert out.stdout.strip() == "[]"
