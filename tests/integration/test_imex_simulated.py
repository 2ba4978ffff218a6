"""The ``imex`` check through the CLI on stand-in nodes: where IMEX does not apply (an HGX B200
on its own NVSwitches, the real H100 pass-through VM's capture) it is a skip giving NVML's
reason, and a GB200 tray's stand-in, on multi-node NVLink, says it models no IMEX. Never a
finding: IMEX "unhealthy" where it does not apply is the field's commonest false positive.

The GPUs are simulated or a replayed capture (none can run here); the CLI, the applicability
rule, the check and the grading are the real code.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def imex_suite(directory: Path) -> str:
    suite = directory / "imex.yaml"
    suite.write_text(
        yaml.safe_dump(
            {"name": "imex", "mode": "delivery", "checks": [{"check": "imex", "timeout_s": 20}]}
        )
    )
    return str(suite)


@pytest.mark.parametrize(
    ("scenario", "expected"),
    [
        ("scenarios/hgx-b200-single-node.yaml", "not on multi-node NVLink (single-node NVSwitch"),
        ("scenarios/real/h100-sxm5-vm.yaml", "not on multi-node NVLink"),
        ("scenarios/healthy-gb200-186gb.yaml", "models no IMEX service"),
    ],
)
def test_imex_is_a_skip_with_its_reason_where_it_is_not_judged(
    agent, tmp_path: Path, scenario: str, expected: str
) -> None:
    run = agent(
        "check", "--simulate", str(ROOT / scenario), "--suite", imex_suite(tmp_path), "--json"
    )
    assert run.code in (0, 1), run.stderr  # HEALTHY, or WARN for what a capture cannot verify
    report = run.json()
    (result,) = [r for r in report["results"] if r["check"] == "imex"]
    assert result["status"] == "skip"
    assert expected in result["detail"]
    assert not [r for r in report["grade"]["reasons"] if "imex" in r.get("rule", "")]
