"""Test helpers for the stand-in NVML library (docs/nvml_fake.md): build it, load it, point it
at a state file. Imported by tests through ``sys.path`` (tests/ is not a package)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from node_agent.sim.nvml_state import Switch, write_state

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "scripts" / "build-nvml-fake"
LIB_DIR = REPO / "build" / "nvml-fake"
LIB = LIB_DIR / "libnvidia-ml.so.1"
HEADER_DIR = LIB_DIR / "nvml-dev"

# A GPU and driver that report the least an agent can live with: what the NVML backend reads
# through ``_optional`` or answers NotSupported for, unsupported; the newer function names
# absent (an older driver), so the backend falls back to the older ones.
SPARSE_SWITCHES = (
    # first: the first switch naming a function decides, and "unsupported X" covers X_v3 too
    Switch("absent", "nvmlSystemGetCudaDriverVersion_v2"),
    Switch("absent", "nvmlDeviceGetCurrentClocksEventReasons"),
    Switch("absent", "nvmlDeviceGetComputeRunningProcesses_v3"),
    *(
        Switch("unsupported", fn)
        for fn in (
            "nvmlSystemGetNVMLVersion",
            "nvmlDeviceGetSerial",
            "nvmlDeviceGetVbiosVersion",
            "nvmlDeviceGetMemoryInfo",
            "nvmlDeviceGetTemperatureThreshold",
            "nvmlDeviceGetEnforcedPowerLimit",
            "nvmlDeviceGetPowerManagementDefaultLimit",
            "nvmlDeviceGetMaxClockInfo",
            "nvmlDeviceGetPcieReplayCounter",
            "nvmlDeviceGetMemoryErrorCounter",
            "nvmlDeviceGetSramEccErrorStatus",
            "nvmlDeviceGetRetiredPages",
            "nvmlDeviceGetRemappedRows",
            "nvmlDeviceGetNvLinkErrorCounter",
            "nvmlDeviceGetNvLinkCapability",
            "nvmlDeviceGetNvLinkRemoteDeviceType",
            "nvmlDeviceGetNvLinkRemotePciInfo",
            "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceGetUtilizationRates",
            "nvmlDeviceRegisterEvents",
            "nvmlDeviceGetPersistenceMode",
        )
    ),
)
# ... and the driver predates the memory-temperature and recovery-action fields
SPARSE_FIELDS = ("field.82 error 3", "field.230 error 3")


def build() -> Path:
    """Build the library (a no-op when it is current) and return its path.

    Skips, with the build's own message, only when gcc or NVIDIA's header cannot be had here;
    a compile error fails the test.
    """
    proc = subprocess.run([str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=600)
    if proc.returncode == 0 and LIB.is_file():
        return LIB
    headers = list(HEADER_DIR.rglob("nvml.h")) if HEADER_DIR.is_dir() else []
    if shutil.which(os.environ.get("CC", "gcc")) is None or not headers:
        pytest.skip(f"stand-in NVML library cannot be built here: {proc.stderr.strip()[-800:]}")
    pytest.fail(f"scripts/build-nvml-fake failed:\n{proc.stderr[-4000:]}")


def real_driver_present() -> bool:
    return Path("/dev/nvidiactl").exists() or ctypes.util.find_library("nvidia-ml") is not None


def preload(config: pytest.Config) -> ctypes.CDLL:
    """Load the built library into this process under its soname, so ``pynvml``'s
    ``CDLL("libnvidia-ml.so.1")`` finds it (the dynamic loader matches loaded sonames).

    Once loaded it stays for the process: on a host with a real driver that would put the
    stand-in under the `gpu`-marked tests, so there it loads only in a run without them
    (``make test`` runs ``-m "not gpu"``); subprocess tests (LD_LIBRARY_PATH) run anywhere.
    """
    import pynvml

    if real_driver_present() and "not gpu" not in (config.option.markexpr or ""):
        pytest.skip(
            "a real NVIDIA driver is here and this run includes the gpu tests: the "
            "in-process stand-in would shadow it (run with -m 'not gpu')"
        )
    lib = ctypes.CDLL(str(LIB), mode=ctypes.RTLD_GLOBAL)
    if pynvml.nvmlLib is not None and pynvml.nvmlLib._handle != lib._handle:
        pytest.skip("pynvml already loaded another libnvidia-ml.so.1 in this process")
    return lib


def agent_env(
    *,
    state: str | Path | None = None,
    scenario: str | Path | None = None,
    python: str | None = None,
) -> dict[str, str]:
    """The environment of a subprocess that loads the stand-in as its libnvidia-ml.so.1."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("NVML_FAKE_STATE", "NVML_FAKE_SCENARIO", "NVML_FAKE_PYTHON")
    }
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        [str(LIB_DIR), *filter(None, [os.environ.get("LD_LIBRARY_PATH")])]
    )
    if state is not None:
        env["NVML_FAKE_STATE"] = str(state)
    if scenario is not None:
        env["NVML_FAKE_SCENARIO"] = str(scenario)
    if python is not None:
        env["NVML_FAKE_PYTHON"] = python
    return env


def run_agent(
    args: Sequence[str], scenario: str | Path, *, simulate: bool, cwd: Path
) -> subprocess.CompletedProcess:
    """``node-agent args...`` on the scenario's node, either simulated (``--simulate``, the
    stand-in off the library path) or through the stand-in library (``NVML_FAKE_SCENARIO``)."""
    argv = [sys.executable, "-m", "node_agent.commands.main", *args]
    if simulate:
        env = agent_env()
        env.pop("LD_LIBRARY_PATH")
        argv += ["--simulate", str(scenario)]
    else:
        env = agent_env(scenario=scenario)
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=cwd, env=env)


def close_backends(state: Path, backends: list) -> None:
    """Close the backends a test opened on the stand-in, first letting the calls it left hanging
    (``hang`` lines in the state file) return: NVML must not be shut down under them."""
    if state.exists():
        kept = [line for line in state.read_text().splitlines(True) if not line.startswith("hang ")]
        write_state(state, "".join(kept))
        time.sleep(0.05)
    for backend in backends:
        backend.close()
