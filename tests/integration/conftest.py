"""Fixtures for integration tests that need real external components."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import slurm_cluster as _slurm  # noqa: E402  (tests/slurm_cluster.py, not an installed module)


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """A real munge + slurmctld + slurmd on loopback for this test module (tests/slurm_cluster.py).

    Client commands reach it through ``SLURM_CONF``: use ``slurm_cluster.env()``. Skips, with
    the reason, only where Slurm cannot run here (packages missing, not root).
    """
    reason = _slurm.missing_reason()
    if reason:
        pytest.skip(reason)
    cluster = _slurm.start_cluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def slurm(slurm_cluster):
    """The module's Slurm cluster with every node back in service before the test."""
    _slurm.reset_cluster(slurm_cluster)
    return slurm_cluster
