"""Job cgroups laid out the way slurmd lays them out, for tests of verified training jobs.

The agent believes a training process's Slurm job only when the kernel's cgroup of the
process is ``job_<id>`` directly under one of slurmd's cgroup roots, owned by root
(``training.slurm_cgroup_roots``, docs/training_hangs.md). No slurmd with cgroups runs here
(tests/slurm_cluster.py runs slurmd without them: the sandbox has no cgroup to give it), so this
makes exactly what slurmd's cgroup plugins would: as root, a fresh root-owned directory in a
mounted cgroup hierarchy, ``<root>/uid_<uid>/job_<id>`` under cgroup v1 (``proctrack/cgroup``,
``slurm/uid_<uid>/job_<id>``) or ``<root>/job_<id>`` under cgroup v2, and it moves the test's
processes there through ``cgroup.procs``, as slurmstepd does. The kernel then names that cgroup
in ``/proc/<pid>/cgroup``; nothing the agent reads is faked. The root is configured with
:meth:`JobCgroups.config` (the ``slurm_job`` fixture writes it into the ``agent`` fixture's
config). Everything made is removed afterwards.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

CGROUP_FS = Path("/sys/fs/cgroup")


class JobCgroups:
    def __init__(self, root: Path, v1: bool) -> None:
        self.root, self.v1 = root, v1
        self.made: list[Path] = []

    def config(self) -> dict:
        """The ``training`` config section that names this root as slurmd's."""
        return {"training": {"slurm_cgroup_roots": [str(self.root)]}}

    def adopt(self, pid: int, job_id: str | int, uid: int = 0) -> Path:
        """Move ``pid`` into job ``job_id``'s cgroup (made on first use), as slurmstepd does."""
        job = (self.root / f"uid_{uid}" if self.v1 else self.root) / f"job_{job_id}"
        path = self.root
        for part in job.relative_to(self.root).parts:
            path = path / part
            if not path.exists():
                path.mkdir()
                self.made.append(path)
        (job / "cgroup.procs").write_text(f"{pid}\n")
        return job

    def remove(self) -> None:
        """Remove what was made, innermost first, once the processes in it have exited."""
        deadline = time.monotonic() + 10
        for path in [*reversed(self.made), self.root, self.root.parent]:
            while True:
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # still busy: a process is being reaped
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.05)


def _writable_hierarchy() -> tuple[Path, bool] | None:
    """A mounted cgroup hierarchy root may make directories in: (mount point, is v1)."""
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    found: list[tuple[Path, bool]] = []
    for line in mounts:
        fields = line.split()
        if " - " not in line:
            continue
        fstype = line.split(" - ", 1)[1].split()[0]
        point = Path(fields[4])
        if fstype == "cgroup" and point.name == "pids":
            found.insert(0, (point, True))
        elif fstype == "cgroup2":
            found.append((point, False))
    for point, v1 in found:
        if os.access(point, os.W_OK) and point.is_relative_to(CGROUP_FS):
            return point, v1
    return None


@contextlib.contextmanager
def job_cgroups() -> Iterator[JobCgroups | str]:
    """A :class:`JobCgroups` under a fresh root, or a string saying why there can be none."""
    if os.geteuid() != 0:
        yield "making slurmd's job cgroups needs root"
        return
    found = _writable_hierarchy()
    if found is None:
        yield "no cgroup hierarchy is mounted writable under /sys/fs/cgroup"
        return
    point, v1 = found
    base = point / f"na-test-{uuid.uuid4().hex[:8]}"
    try:
        base.mkdir()
        (base / "slurm").mkdir()
    except OSError as err:
        with contextlib.suppress(OSError):
            base.rmdir()
        yield f"cannot make a cgroup under {point}: {err.strerror or err}"
        return
    cgroups = JobCgroups(base / "slurm", v1)
    try:
        yield cgroups
    finally:
        cgroups.remove()


@pytest.fixture(name="slurm_job")
def slurm_job_fixture(tmp_path):
    """slurmd's job cgroups, named in the config the ``agent`` fixture uses
    (``tmp_path/agent-config.yaml``); ``slurm_job.adopt(pid, job_id)`` puts a process in a
    verified Slurm job. Skips, with the reason, where no cgroup can be made."""
    with job_cgroups() as cgroups:
        if isinstance(cgroups, str):
            pytest.skip(cgroups)
        (tmp_path / "agent-config.yaml").write_text(
            yaml.safe_dump({"state_dir": str(tmp_path / "state"), **cgroups.config()})
        )
        yield cgroups
