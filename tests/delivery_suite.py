"""The shipped delivery suite as the integration tests run it (``tests/integration``).

A test's delivery run happens on a machine that runs other tests at once (``make test``'s
pytest-xdist workers), so the stand-in burns (``gpu_burn``, ``thermal_power``: 8 workers that
import torch) get longer bounds on a hang than the shipped suite's 60 s to get ready and 15 s
per turn; a worker that missed them would be killed as stalled and grade the node ERROR. The
work each burn does is as shipped.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
#: the stand-in burns' bounds on a hang in the tests' delivery runs
PATIENT_BURN = {"startup_timeout_s": 150, "stall_s": 60}
#: an agent running such a suite: the bounds above and the run, under a test's own 300 s
PATIENT_AGENT_TIMEOUT_S = 270
#: the readers of ``healthy_delivery`` (tests/conftest.py), whatever their module: on one
#: pytest-xdist worker, so ``make test`` makes that run once
HEALTHY_DELIVERY = pytest.mark.xdist_group("healthy_delivery")


def delivery_suite(directory: Path, burn_s: float | None = None) -> str:
    """The shipped delivery suite, every check in it, with the stand-in burns' hang bounds at
    ``PATIENT_BURN`` and, given ``burn_s``, a stand-in gpu_burn of that many seconds (for
    delivery runs that test something other than the burn); the path of the copy written."""
    suite = yaml.safe_load((REPO / "suites" / "delivery.yaml").read_text())
    for check in suite["checks"]:
        if check["check"] not in ("gpu_burn", "thermal_power"):
            continue
        stand_in = check["params"]["simulated"]
        stand_in.update(PATIENT_BURN)
        if burn_s is not None and check["check"] == "gpu_burn":
            assert stand_in["duration_s"] > burn_s
            stand_in["duration_s"] = burn_s
    name = "delivery-patient.yaml" if burn_s is None else "delivery-short-burn.yaml"
    path = directory / name
    path.write_text(yaml.safe_dump(suite, sort_keys=False))
    return str(path)
