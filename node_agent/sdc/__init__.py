"""Silent-data-corruption probes and their verdict spool; what a training job imports::

    from node_agent.sdc import SdcProbe, Verdict, write_verdict, default_spool_dir

The spool half (``Verdict``, ``write_verdict``, ``default_spool_dir``, ``read_spool``) is
torch-free and loaded at once, so the daemon reads verdicts without torch. The probes
(``SdcProbe`` and the rest of :mod:`node_agent.sdc.probes`, and the GPU validation's figures in
:mod:`node_agent.sdc.validation`) need torch and are loaded on first use (PEP 562 module
``__getattr__``).

Modules: ``spool`` (verdict files), ``tiles`` (the SM/tile model, stdlib), ``exact`` (exact
inputs, goldens, the on-device comparison), ``reference`` (digests, Freivalds), ``inject`` (the
simulator's faulty matmul), ``coverage`` (``sm_coverage`` via ``%smid``), ``verdicts``
(confirmation), ``probes`` (the public API, ``SdcProbe``), ``validation``.
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

_PROBE_NAMES = (
    "DTYPES",
    "DEFAULT_SHAPES",
    "ProbeSpec",
    "SdcProbe",
    "accumulator_check",
    "corrupting_matmul",
    "cublas_workspace_bytes",
    "default_specs",
    "digest_probe",
    "dtype_unsupported",
    "exact_gemm_probe",
    "fit_whole_gpu",
    "freivalds_check",
    "freivalds_probe",
    "golden",
    "golden_out",
    "odd_one_out",
    "probe_memory_bytes",
    "run_probes",
    "strict_matmul",
    "whole_gpu_specs",
)
#: the GPU validation's figures (node_agent.sdc.validation), loaded on first use too
_VALIDATION_NAMES = (
    "measure_sm_coverage",
    "measure_training_overhead",
    "sdc_sm_coverage",
    "sdc_training_overhead_percent",
)

__all__ = [
    "SPOOL_SCHEMA",
    "Verdict",
    "default_spool_dir",
    "read_spool",
    "read_spool_files",
    "write_verdict",
    *_PROBE_NAMES,
    *_VALIDATION_NAMES,
]


def __getattr__(name: str) -> Any:
    if name in _PROBE_NAMES:
        from node_agent.sdc import probes

        return getattr(probes, name)
    if name in _VALIDATION_NAMES:
        from node_agent.sdc import validation

        return getattr(validation, name)
    raise AttributeError(f"module 'node_agent.sdc' has no attribute {name!r}")
