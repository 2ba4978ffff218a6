"""Under CI, every real component ``make test`` installs is present, so no test skipped for lack
of one while the run still passed.

On a user's machine a test whose component is missing skips and says which (Slurm, fio,
promtool, chromium, torch ...): right there. Under CI (``CI`` set, tests/realworld_ci.py) the
same skip would mean the run proved less than it claims, so this test fails, naming what is
missing; the Slurm cluster's own start conditions (its programs, root) included.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest
import slurm_cluster  # tests/slurm_cluster.py
from realworld_ci import under_ci

REPO = Path(__file__).resolve().parents[2]
SYSTEM_DEPS = REPO / "scripts" / "install-test-system-deps"

#: each Debian package scripts/install-test-system-deps installs -> the programs tests run from it
PROGRAMS_OF_PACKAGE = {
    "fio": ("fio",),
    "prometheus": ("promtool",),
    "slurmctld": ("slurmctld",),
    "slurmd": ("slurmd",),
    "slurm-client": ("srun", "sbatch", "scontrol", "sinfo", "squeue", "scancel"),
    "munge": ("munged",),
    "chromium": ("chromium",),
    # the container image's test (tests/integration/test_image.py): builder and Debian base
    "buildah": ("buildah",),
    "debootstrap": ("debootstrap",),
}

#: Python modules ``make deps-test`` installs (the pinned CPU torch, the dev and k8s extras)
MODULES = ("torch", "grpc_tools", "celpy", "kubernetes", "hypothesis", "matplotlib")


def installed_packages() -> list[str]:
    """The ``packages=(...)`` list of scripts/install-test-system-deps."""
    found = re.search(r"^packages=\(([^)]*)\)", SYSTEM_DEPS.read_text(), re.MULTILINE)
    assert found, f"{SYSTEM_DEPS} has no packages=(...) line"
    return found.group(1).split()


def found(program: str) -> bool:
    return shutil.which(program) is not None or Path("/usr/sbin", program).exists()


def missing_components() -> list[str]:
    missing = [
        f"{program} (Debian package {package})"
        for package in installed_packages()
        for program in PROGRAMS_OF_PACKAGE[package]
        if not found(program)
    ]
    missing += [f"Python module {m}" for m in MODULES if importlib.util.find_spec(m) is None]
    slurm = slurm_cluster.missing_reason()
    if slurm:
        missing.append(slurm)
    return missing


def test_every_package_the_install_script_names_has_its_programs_listed_here():
    assert set(installed_packages()) == set(PROGRAMS_OF_PACKAGE)


def test_under_ci_every_component_make_test_installs_is_present():
    missing = missing_components()
    if missing and not under_ci():
        pytest.skip(
            "not a CI run, and these are missing (their tests skip, saying so): "
            + "; ".join(missing)
        )
    assert not missing, (
        "CI is set, but components make test installs are missing, so the tests that need "
        "them skipped: " + "; ".join(missing)
    )
