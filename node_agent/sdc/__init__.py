"""Silent-data-corruption probes and their verdict spool; what a training job imports::

    from node_agent.sdc import SdcProbe, Verdict, write_verdict, default_spool_dir

The spool half (``Verdict``, ``write_verdict``, ``default_spool_dir``, ``read_spool``) is
torch-free and loaded at once, so the daemon reads verdicts without torch. The probes
(``SdcProbe`` and the rest of :mod:`node_agent.sdc.probes`) need torch and are loaded on first
use (PEP 562 module ``__getattr__``).
"""

from __future__ import annotations

from typing import Any

from node_agent.sdc.spool import (
    SPOOL_SCHEMA,
    Verdict,
    default_spool_dir,
    read_spool,
    read_spool_files,
    write_verdict,
)

_PROBE_NAMES = ("DTYPES", "DEFAULT_SHAPES", "ProbeSpec", "SdcProbe", "corrupting_matmul",
                "default_specs", "digest_probe", "exact_gemm_probe", "freivalds_check",
                "freivalds_probe", "golden", "odd_one_out", "run_probes", "strict_matmul")

__all__ = ["SPOOL_SCHEMA", "Verdict", "default_spool_dir", "read_spool", "read_spool_files",
           "write_verdict", "DTYPES", "DEFAULT_SHAPES", "ProbeSpec", "SdcProbe",
           "corrupting_matmul", "default_specs", "digest_probe", "exact_gemm_probe",
           "freivalds_check", "freivalds_probe", "golden", "odd_one_out", "run_probes",
           "strict_matmul"]


def __getattr__(name: str) -> Any:
    if name in _PROBE_NAMES:
        from node_agent.sdc import probes

        return getattr(probes, name)
    raise AttributeError(f"module 'node_agent.sdc' has no attribute {name!r}")
