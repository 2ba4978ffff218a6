"""NaN and infinity are refused everywhere the agent reads numbers from YAML (config, suites,
scenarios, graders): exit 2 with one line naming the file and the key, nothing run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from node_agent.config import config_from_dict, load_config
from node_agent.yamlfile import ConfigError

MAIN = [sys.executable, "-m", "node_agent.commands.main"]


@pytest.mark.parametrize(
    "text, key",
    [
        ("safety:\n  max_drained_fraction: .nan\n", "safety.max_drained_fraction"),
        ("daemon:\n  default_every_s: .nan\n", "daemon.default_every_s"),
        ("adapter:\n  webhook:\n    timeout_s: .inf\n", "adapter.webhook.timeout_s"),
        ("safety:\n  dedup_window_s: -.inf\n", "safety.dedup_window_s"),
        ("nvml:\n  call_timeout_s: .NaN\n", "nvml.call_timeout_s"),
    ],
)
def test_nan_and_infinity_in_the_config_are_a_one_line_error_naming_the_key(tmp_path, text, key):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert message.startswith(f"{path}: key '{key}'") and "not a finite number" in message
    assert "\n" not in message


def test_nan_given_as_a_dict_is_refused_too():
    with pytest.raises(ConfigError, match="key 'safety.max_drained_fraction'"):
        config_from_dict({"safety": {"max_drained_fraction": float("nan")}})


def test_a_suite_cadence_of_nan_is_exit_2_with_one_line_before_anything_runs(tmp_path):
    suite = tmp_path / "suite.yaml"
    suite.write_text(
        yaml.safe_dump(
            {
                "name": "s",
                "mode": "service",
                "checks": [{"check": "inventory", "timeout_s": 10, "every_s": float("nan")}],
            }
        )
    )
    scenario = tmp_path / "node.yaml"
    scenario.write_text(yaml.safe_dump({"sku": "h100-sxm5-80gb", "gpus": 2}))
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state")}))
    done = subprocess.run(
        [
            *MAIN,
            "check",
            "--suite",
            str(suite),
            "--simulate",
            str(scenario),
            "--config",
            str(config),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert "checks.0.every_s" in line and "not a finite number" in line
    assert not (tmp_path / "state" / "reports").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="the rule applies to an agent run as root")
@pytest.mark.parametrize("mode, owner", [(0o666, 0), (0o620, 0), (0o644, 65534)])
def test_root_takes_no_settings_from_a_file_another_user_could_write(tmp_path, mode, owner):
    """A config another user owns or can write would let them choose root's scheduler
    programs (adapter.slurm.scontrol) or thresholds: refused, naming the file and the fix."""
    path = tmp_path / "config.yaml"
    path.write_text("adapter: {name: slurm, slurm: {scontrol: /tmp/theirs}}\n")
    os.chown(path, owner, 1234 if mode == 0o620 else 0)
    path.chmod(mode)
    with pytest.raises(ConfigError, match="another user could have written it.*chmod go-w"):
        load_config(str(path))
