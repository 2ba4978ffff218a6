"""Check ``sdc``: silent-data-corruption probes on every GPU of the node.

The probes are the library's (``node_agent.sdc``, see ``docs/sdc.md``); this module runs them on
the node's compute devices (``ports.compute``: CUDA GPUs, or a scenario's CPU stand-ins whose
matmul its ``sdc`` fault corrupts, tile by tile on one SM or all)
and turns the verdicts into results:

0. per GPU and dtype, the accumulator check: a GEMM kernel that accumulates in lower precision
   than the exact probe needs has its dtype skipped, with the reason in the result;
1. round 0, per GPU: the whole-GPU exact GEMM of every dtype (shapes from the GPU's SM count,
   so every SM runs several output tiles; ``node_agent.sdc.tiles``), the digest GEMM of every
   (digest shape, dtype) compared with *this GPU's* earlier digest (stored under the state
   directory per GPU UUID, spec and software stack), and a Freivalds-verified GEMM per dtype;
2. the round-0 digests compared *across the node's GPUs* (``odd_one_out``): the odd one out
   is re-run, and only a GPU that differs again is confirmed;
3. rounds 1.. (``repeats``, or until ``duration_s`` passed): the exact GEMMs again, cycling over
   ``seeds`` input seeds (the goldens are cached per seed, so the seeds are bounded).

Every exact mismatch is re-run before it is believed; it is ``confirmed`` when the re-run or any
other exact probe run on the same GPU in this run mismatched too (an intermittent SM rarely
fails the very same element twice: ``node_agent.sdc.verdicts``), ``transient`` otherwise.

Results, one set per GPU (target ``gpu:N``), each with ``sm_coverage`` in its evidence (the
share of the GPU's SMs a round's exact probes reached: measured with ``%smid`` on a CUDA GPU
where a kernel can be built, the tile model's figure otherwise; 0.0 where nothing ran):

- ``sdc_confirmed`` ``fail`` (grade FAULT): names the probe, shape, dtype and how many elements
  differed, with every non-pass verdict in the evidence and where the wrong tiles ran;
- ``sdc_transient`` ``warn`` (grade WARN): a mismatch nothing repeated, kept as evidence;
- ``sdc_digest_drift`` ``warn`` (grade WARN): only digests unlike the GPU's own history, which
  no other GPU ran, while every exact probe came out right (a stale history cannot be told from
  a defect there);
- ``sdc_probe_error`` ``error``: a probe that could not run (never a pass);
- ``sdc_probes`` ``pass``: how many probes ran, all clean; or ``skip`` with the reason.

A stored digest taken with other software (torch, its CUDA, the driver, the GPU name) is not
compared: digests are bit-exact only within one stack, so the result says the baseline was
retaken; the fingerprint names the cuBLAS wheel too (pip upgrades it apart from torch). A GPU
that differs from its own history but agrees with a strict majority of the node's other GPUs
(3 or more compared), or with every other GPU (two GPUs drifting to one new digest), had a stale
baseline (a software change the fingerprint does not see), not SDC: its baseline is replaced
and the result says so.

Params (:class:`Params`, parsed when the suite loads: a bad value is a configuration error
naming the key): ``dtypes`` (of fp32, tf32, bf16, fp16, fp8; those the device lacks are dropped, with a
note when asked for by name), ``tiles_per_sm`` (output tiles per SM of a whole-GPU exact probe;
default 4 on a GPU, 2 on a CPU stand-in), ``shapes`` ([[M, K, N], ...]: explicit exact shapes instead of
whole-GPU ones, and the digest shapes unless ``digest_shapes`` is given), ``digest_shapes``
(default the library's small ``DEFAULT_SHAPES``), ``repeats`` (exact-probe rounds, default 2),
``duration_s`` (keep running rounds until then; default none), ``seeds`` (distinct input seeds
the rounds cycle over, default 4), ``freivalds_n`` (size of the Freivalds GEMM; default 1024 on
CUDA, 256 on the CPU; 0 turns it off), ``gpus`` (indices; default all), ``digest_history``
(default true), ``min_free_mib`` (service mode only: a GPU with less free memory is skipped, so a
probe never pushes a training job out of memory; default 2048).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node_agent.atomic_file import write_json
from node_agent.checking.behaviour import ServiceBehaviour
from node_agent.checking.context import CheckContext
from node_agent.checking.params import Reader
from node_agent.checking.sdc_metrics import SdcVerdicts
from node_agent.compute import devices as compute
from node_agent.model import Result, Status

if TYPE_CHECKING:
    from node_agent.compute.devices import ComputeDevice
    from node_agent.sdc import probes as sdc_lib
    from node_agent.sdc.coverage import Coverage
    from node_agent.sdc.verdicts import Window

#: in the daemon: each GPU's verdict counts in node_agent_sdc_probes_total (checking/sdc_metrics.py)
SERVICE = ServiceBehaviour(metrics=SdcVerdicts)
HISTORY_SCHEMA = "node-agent.sdc-digests/1"
DEFAULT_REPEATS = 2
DEFAULT_SEEDS = 4
DEFAULT_MIN_FREE_MIB = 2048
ALL_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
Shape = tuple[int, int, int]  # M, K, N
#: dtypes the digest and Freivalds probes run in (random fp8 inputs have no digest baseline yet)
DIGEST_DTYPES = ("fp32", "tf32", "bf16", "fp16")
#: digest comparison across GPUs needs a strict majority that means something
MIN_GPUS_FOR_MAJORITY = 3


def _shapes(r: Reader, key: str) -> tuple[Shape, ...] | None:
    """``[[M, K, N], ...]`` of positive whole numbers, or None where the suite sets none."""
    raw = r.value(key)
    if raw is None:
        return None
    want = "a list of [M, K, N], each a positive whole number"
    if not isinstance(raw, list | tuple) or not raw:
        r.fail(key, raw, want)
    for s in raw:
        if not (
            isinstance(s, list | tuple)
            and len(s) == 3
            and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in s)
        ):
            r.fail(key, s, want)
    return tuple((s[0], s[1], s[2]) for s in raw)


@dataclasses.dataclass(frozen=True)
class Params:
    """The check's parameters (a suite's ``params``), validated by :meth:`parse`; what each
    means is in the module's docstring."""

    dtypes: tuple[str, ...] | None = None  # None: every dtype the device has, no note
    tiles_per_sm: int | None = None  # None: 4 on a GPU, 2 on a CPU stand-in
    shapes: tuple[Shape, ...] | None = None  # None: whole-GPU shapes
    digest_shapes: tuple[Shape, ...] | None = None  # None: ``shapes``, else DEFAULT_SHAPES
    repeats: int = DEFAULT_REPEATS
    duration_s: float | None = None
    seeds: int = DEFAULT_SEEDS
    freivalds_n: int | None = None  # None: 1024 on CUDA, 256 on the CPU; 0: off
    gpus: tuple[int, ...] | None = None  # None: every GPU
    digest_history: bool = True
    min_free_mib: float = DEFAULT_MIN_FREE_MIB

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Params:
        """ValueError naming the key and what was expected."""
        r = Reader("sdc", raw, cls)
        dtypes = r.strings("dtypes", empty=False) if r.given("dtypes") else None
        if dtypes is not None and not set(dtypes) <= set(ALL_DTYPES):
            r.fail("dtypes", list(dtypes), "a list of dtypes among " + ", ".join(ALL_DTYPES))
        gpus = r.integers("gpus", 0, "a list of GPU indices") if r.given("gpus") else None
        return cls(
            dtypes=dtypes,
            tiles_per_sm=r.optional_integer("tiles_per_sm", 1),
            shapes=_shapes(r, "shapes"),
            digest_shapes=_shapes(r, "digest_shapes"),
            repeats=r.integer("repeats", 1),
            duration_s=r.optional_number("duration_s", above=0),
            seeds=r.integer("seeds", 1),
            freivalds_n=r.optional_integer("freivalds_n", 0),
            gpus=gpus,
            digest_history=r.flag("digest_history"),
            min_free_mib=r.number("min_free_mib", at_least=0),
        )


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to run on each GPU: exact probes (whole-GPU unless ``shapes``), digest specs, rounds
    and the Freivalds size (0 = off)."""

    dtypes: tuple[str, ...]
    digest_specs: tuple[sdc_lib.ProbeSpec, ...]
    shapes: tuple[Shape, ...] | None = None
    tiles_per_sm: int | None = None
    repeats: int = DEFAULT_REPEATS
    duration_s: float | None = None
    seeds: int = DEFAULT_SEEDS
    freivalds_n: int = 0
    freivalds_dtypes: tuple[str, ...] = ("fp32", "bf16")

    def exact_specs(self, dev: ComputeDevice) -> tuple[list[sdc_lib.ProbeSpec], dict[str, str]]:
        """This GPU's exact specs and ``{dtype: why not probed}`` for dtypes it lacks."""
        from node_agent.sdc import probes as sdc_lib

        if self.shapes is None:
            return sdc_lib.whole_gpu_specs(
                dev.device, dev.tile_model, self.dtypes, self.tiles_per_sm
            )
        specs, skipped = [], {}
        for name in self.dtypes:
            why = sdc_lib.dtype_unsupported(name, dev.device)
            if why:
                skipped[name] = why
                continue
            specs += [sdc_lib.ProbeSpec(*shape, dtype=name) for shape in self.shapes]
        return specs, skipped


@dataclasses.dataclass
class GpuRun:
    """One GPU's verdicts and notes from one run of the check."""

    index: int
    device: ComputeDevice
    uuid: str | None = None
    verdicts: list[sdc_lib.Verdict] = dataclasses.field(default_factory=list)
    digests: dict[str, str] = dataclasses.field(default_factory=dict)  # spec key -> digest
    notes: list[str] = dataclasses.field(default_factory=list)
    rounds: int = 0
    specs: list[sdc_lib.ProbeSpec] = dataclasses.field(default_factory=list)  # exact, seed 0
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)  # dtype -> why
    coverage: Coverage | None = None
    window: Window | None = None

    @property
    def suspect(self) -> bool:
        return any(v.status in ("confirmed", "transient", "error") for v in self.verdicts)


def spec_key(spec: sdc_lib.ProbeSpec) -> str:
    """Stable name of a probe spec in the digest history, e.g. ``fp32 128x128x128 seed0``."""
    return f"{spec.label()} seed{spec.seed}"


# --------------------------------------------------------------------------------------------
# Digest history under the state directory


class DigestHistory:
    """Each GPU's earlier digests, per UUID, spec and software fingerprint (a JSON file).

    ``software`` is a dict (torch, its CUDA, driver, GPU name ...); a GPU whose stored
    fingerprint differs has no usable history, and :meth:`baseline` says what changed.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._gpus: dict[str, dict[str, Any]] = {}
        self.problem: str | None = None
        if path is not None and path.exists():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                if data.get("schema") != HISTORY_SCHEMA:
                    raise ValueError(f"schema {data.get('schema')!r}, expected {HISTORY_SCHEMA!r}")
                self._gpus = dict(data["gpus"])
            except (OSError, ValueError, KeyError, TypeError) as err:
                self.problem = (
                    f"earlier digests in {path} unreadable ({err}); a new baseline is taken"
                )

    def baseline(self, uuid: str, software: Mapping[str, Any]) -> tuple[dict[str, str], str | None]:
        """(digests by spec key, why none are usable or None)."""
        entry = self._gpus.get(uuid)
        if entry is None:
            return {}, None
        stored = entry.get("software", {})
        if stored != dict(software):
            changed = ", ".join(
                f"{k} {stored.get(k)} -> {software.get(k)}"
                for k in sorted(set(stored) | set(software))
                if stored.get(k) != software.get(k)
            )
            return {}, (
                f"earlier digests discarded: software changed ({changed}); digests are "
                "bit-exact only within one software stack, a new baseline is taken"
            )
        return dict(entry.get("digests", {})), None

    def store(self, uuid: str, software: Mapping[str, Any], digests: Mapping[str, str]) -> None:
        entry = self._gpus.get(uuid)
        if entry is None or entry.get("software") != dict(software):
            entry = self._gpus[uuid] = {"software": dict(software), "digests": {}}
        entry["digests"].update(digests)
        entry["updated_at"] = time.time()

    def save(self) -> None:
        """Write atomically (``atomic_file``: temp file + rename); a crash leaves the old file
        or the new one."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json(self.path, {"schema": HISTORY_SCHEMA, "gpus": self._gpus})


def history_path(state_dir: Path | None) -> Path | None:
    return state_dir / "sdc" / "digests.json" if state_dir is not None else None


def software_fingerprint(
    device: ComputeDevice, gpu_name: str | None, driver: str | None
) -> dict[str, Any]:
    """What a digest depends on besides the GPU itself: torch (and its cuBLAS), CUDA, driver,
    GPU name; on a CPU stand-in the thread count too (CPU GEMM blocking depends on it)."""
    import torch

    fp: dict[str, Any] = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "driver": driver,
        "gpu_name": gpu_name,
        "device": device.device.type,
    }
    if cublas := _cublas_wheel():
        fp["cublas"] = cublas
    if device.device.type == "cpu":
        fp["cpu_threads"] = torch.get_num_threads()
    return fp


def _cublas_wheel() -> str | None:
    """Every cuBLAS wheel installed (pip upgrades them apart from torch, and leaves a cu12 one
    behind when torch moves to a cu13 build), as ``name version, ...``: whichever torch loads,
    its upgrade changes this. None where torch carries its own or uses the system's."""
    from importlib import metadata

    found = []
    for name in ("nvidia-cublas-cu12", "nvidia-cublas-cu13", "nvidia-cublas"):
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return ", ".join(found) or None


# --------------------------------------------------------------------------------------------
# Probing (pure of the check context: unit tests call this with real CPU devices)


def error_verdict(
    probe: str, spec: sdc_lib.ProbeSpec, dev: ComputeDevice, err: BaseException
) -> sdc_lib.Verdict:
    """The ``error`` verdict of a probe that raised (it could not run: not a pass)."""
    from node_agent.sdc.verdicts import error_verdict as make_error

    return make_error(probe, spec, dev.device, err)


def _guarded(
    probe: str,
    spec: sdc_lib.ProbeSpec,
    dev: ComputeDevice,
    fn: Callable[..., sdc_lib.Verdict],
    **kw: Any,
) -> sdc_lib.Verdict:
    """``fn(spec, device, matmul, **kw)`` on ``dev``; an exception becomes an error verdict."""
    try:
        return fn(spec, dev.device, dev.matmul, **kw)
    except Exception as err:  # noqa: BLE001 - a probe that cannot run is an error, never a pass
        return error_verdict(probe, spec, dev, err)


def _exact(run: GpuRun, spec: sdc_lib.ProbeSpec) -> None:
    """One exact probe on the run's GPU; a second mismatching run in this check run confirms."""
    from node_agent.sdc import probes as sdc_lib
    from node_agent.sdc.verdicts import Window, upgrade_in_window

    if run.window is None:
        run.window = Window()  # the whole run on this GPU is the confirmation window
    v = _guarded(
        "exact_gemm", spec, run.device, sdc_lib.exact_gemm_probe, tiles=run.device.tile_model
    )
    run.verdicts.append(upgrade_in_window(v, run.window))


def prepare_gpu(run: GpuRun, plan: Plan) -> None:
    """The GPU's exact specs, less the dtypes it lacks or whose kernel accumulates in lower
    precision (noted), and the round's SM coverage."""
    from node_agent.sdc import coverage as sdc_coverage
    from node_agent.sdc import probes as sdc_lib

    dev = run.device
    specs, unsupported = plan.exact_specs(dev)
    model = dev.tile_model
    for name in sorted({s.dtype for s in specs}):
        try:
            why = sdc_lib.accumulator_check(name, dev.device, dev.matmul, model)
        except Exception as err:  # noqa: BLE001 - the dtype's probes will report the error
            run.notes.append(
                f"{name}: accumulator check could not run ({type(err).__name__}: "
                f"{err}); probed anyway"
            )
            why = None
        if why:
            run.skipped[name] = why
            run.notes.append(why)
    run.skipped.update(unsupported)
    run.specs = [s for s in specs if s.dtype not in run.skipped]
    shapes = sorted({(s.m, s.n) for s in run.specs})
    run.coverage = (
        sdc_coverage.measure(dev.device, model, shapes) if shapes else sdc_coverage.NONE_RAN
    )


def _cross_gpu(runs: Mapping[int, GpuRun], specs: Iterable[sdc_lib.ProbeSpec]) -> None:
    """Compare round-0 digests across GPUs; re-run the odd one out; record its verdict."""
    from node_agent.sdc import probes as sdc_lib

    for spec in specs:
        key = spec_key(spec)
        digests = {i: r.digests[key] for i, r in runs.items() if key in r.digests}
        if len(digests) < 2:
            continue
        by_gpu: dict[Hashable, str] = {i: d for i, d in digests.items()}
        odd_keys = set(sdc_lib.odd_one_out(by_gpu))
        odd = [i for i in digests if i in odd_keys]
        if not odd:
            continue
        majority = Counter(digests.values()).most_common(1)[0]
        for i in odd:
            run = runs[i]
            t0 = time.perf_counter()
            try:
                again = sdc_lib.digest_probe(spec, run.device.device, run.device.matmul)
            except Exception as err:  # noqa: BLE001 - reported as the probe's error
                run.verdicts.append(error_verdict("digest_gemm", spec, run.device, err))
                continue
            d1, d2 = digests[i], again.evidence["digest"]
            confirmed = d2 != majority[0]
            run.verdicts.append(
                sdc_lib.Verdict(
                    probe="digest_gemm",
                    device=str(run.device.device),
                    shape=spec.shape,
                    dtype=spec.dtype,
                    status="confirmed" if confirmed else "transient",
                    mismatched_elements=0,
                    detail=(
                        f"digest_gemm {spec.label()}: output sha256 {d1[:16]} differs from the "
                        f"{majority[1]} of {len(digests)} GPUs that agree on {majority[0][:16]} "
                        f"(odd one out); "
                        + ("re-run differed again" if confirmed else "re-run agreed with them")
                    ),
                    duration_s=time.perf_counter() - t0,
                    timestamp=time.time(),
                    evidence={
                        "compared": "across GPUs",
                        "digest": d1,
                        "rerun_digest": d2,
                        "majority_digest": majority[0],
                        "agreeing_gpus": majority[1],
                        "compared_gpus": sorted(digests),
                    },
                )
            )


def probe_node(
    runs: Mapping[int, GpuRun],
    plan: Plan,
    baselines: Mapping[int, Mapping[str, str]] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Run the plan on every GPU of ``runs`` (their verdicts are appended in place).

    ``baselines``: per GPU index, earlier digests by :func:`spec_key` (empty: none usable).
    Rounds run GPU after GPU, so with ``duration_s`` every GPU gets the same number of rounds.
    """
    from node_agent.sdc import probes as sdc_lib

    baselines = baselines or {}
    start = clock()
    for i, run in runs.items():
        dev = run.device
        prepare_gpu(run, plan)
        for spec in run.specs:
            _exact(run, spec)
        for spec in plan.digest_specs:
            if sdc_lib.dtype_unsupported(spec.dtype, dev.device):
                continue
            key = spec_key(spec)
            prev = baselines.get(i, {}).get(key)
            v = _guarded("digest_gemm", spec, dev, sdc_lib.digest_probe, previous=prev)
            if "digest" in v.evidence:
                run.digests[key] = v.evidence["digest"]
            if v.status != "pass":
                v.detail += " (compared with this GPU's earlier digest)"
                v.evidence["compared"] = "with this GPU's earlier digest"
            run.verdicts.append(v)
        if plan.freivalds_n > 0:
            for name in plan.freivalds_dtypes:
                if sdc_lib.dtype_unsupported(name, dev.device) or name in run.skipped:
                    continue
                spec = sdc_lib.ProbeSpec(plan.freivalds_n, plan.freivalds_n, plan.freivalds_n, name)
                run.verdicts.append(_guarded("freivalds", spec, dev, sdc_lib.freivalds_probe))
        run.rounds = 1
    _forgive_stale_history(runs)
    _cross_gpu(runs, plan.digest_specs)
    rounds = 1
    while rounds < plan.repeats or (
        plan.duration_s is not None and clock() - start < plan.duration_s
    ):
        seed = rounds % max(1, plan.seeds)
        for run in runs.values():
            for spec in run.specs:
                _exact(run, dataclasses.replace(spec, seed=spec.seed + seed))
            run.rounds += 1
        rounds += 1


def _forgive_stale_history(runs: Mapping[int, GpuRun]) -> None:
    """A GPU that differs from its own earlier digest but agrees with a strict majority of the
    node's GPUs (>= MIN_GPUS_FOR_MAJORITY compared), or with every other GPU (two GPUs that
    drift to one new digest together), has a stale baseline, not SDC: no two GPUs corrupt a
    product into the same bits."""
    from node_agent.sdc import probes as sdc_lib

    for run in runs.values():
        for n, v in enumerate(run.verdicts):
            if v.probe != "digest_gemm" or v.status == "pass" or "digest" not in v.evidence:
                continue
            rows, inner, cols = v.shape
            spec = sdc_lib.ProbeSpec(rows, inner, cols, dtype=v.dtype)
            key = spec_key(spec)
            digests = {i: r.digests[key] for i, r in runs.items() if key in r.digests}
            if len(digests) == 1:  # no other GPU ran it: nothing corroborates the history
                v.evidence["uncorroborated"] = True
            every_gpu_alike = len(digests) >= 2 and len(set(digests.values())) == 1
            if len(digests) < MIN_GPUS_FOR_MAJORITY and not every_gpu_alike:
                continue
            value, count = Counter(digests.values()).most_common(1)[0]
            if count * 2 > len(digests) and digests.get(run.index) == value:
                run.notes.append(
                    f"{key}: differs from this GPU's earlier digest but agrees with "
                    f"{count} of {len(digests)} GPUs: the earlier digest was stale "
                    "and is replaced"
                )
                run.verdicts[n] = dataclasses.replace(
                    v, status="pass", evidence={**v.evidence, "stale_baseline": True}
                )


# --------------------------------------------------------------------------------------------
# Results


def _finding(v: sdc_lib.Verdict) -> dict[str, Any]:
    out = {
        "probe": v.probe,
        "shape": list(v.shape),
        "dtype": v.dtype,
        "status": v.status,
        "mismatched_elements": v.mismatched_elements,
        "detail": v.detail,
    }
    for key in ("tiles_mismatched", "tile_residues"):
        if key in v.evidence:
            out[key] = v.evidence[key]
    return out


def _summary(verdicts: list[sdc_lib.Verdict]) -> str:
    probes = Counter(v.probe for v in verdicts)
    dtypes = sorted({v.dtype for v in verdicts})
    return (
        ", ".join(f"{p} {n}" for p, n in sorted(probes.items())) + f"; dtypes {', '.join(dtypes)}"
    )


#: ``sdc.coverage.NONE_RAN.evidence()``, spelled out: a check that probed nothing (no GPU, no
#: driver) says so without importing torch, which ``sdc.coverage`` needs (a host without a GPU
#: need not have torch installed)
NO_COVERAGE_EVIDENCE: dict[str, Any] = {
    "sm_coverage": 0.0,
    "sm_coverage_method": "none: no probe ran",
    "sm_count": 0,
    "sms_reached": 0,
}


def coverage_evidence(run: GpuRun | None) -> dict[str, Any]:
    """``sm_coverage`` and how it was had, for a result's evidence (0.0 where nothing ran)."""
    if run is None or run.coverage is None:
        return dict(NO_COVERAGE_EVIDENCE)
    return run.coverage.evidence()


def _where(verdicts: list[sdc_lib.Verdict]) -> str:
    """Where the wrong tiles ran, in words, for a field engineer."""
    from node_agent.sdc.verdicts import sm_pattern

    p = sm_pattern(verdicts)
    runs = p["runs_one_sm"] + p["runs_several_sms"]
    if not runs:
        return ""
    if not p["runs_several_sms"]:
        return (
            f"; in all {runs} mismatching run(s) the wrong tiles ran on a single SM (tile "
            "model): a defective SM"
        )
    return (
        f"; wrong tiles on one SM in {p['runs_one_sm']} of {runs} mismatching runs, on up to "
        f"{p['most_sms_in_one_run']} SMs in one run"
    )


def results_for(
    ctx: CheckContext, run: GpuRun, extra: Mapping[str, Any] | None = None
) -> list[Result]:
    """The results of one GPU's run: confirmed > transient, plus errors; pass when clean."""
    from node_agent.sdc.verdicts import sm_pattern

    target = f"gpu:{run.index}"
    counts = Counter(v.status for v in run.verdicts)
    findings = [_finding(v) for v in run.verdicts if v.status != "pass"][:20]
    bad = [v for v in run.verdicts if v.status in ("confirmed", "transient")]
    evidence: dict[str, Any] = {
        "counts": {s: counts.get(s, 0) for s in ("pass", "transient", "confirmed", "error")},
        "probes": len(run.verdicts),
        "rounds": run.rounds,
        "gpu_uuid": run.uuid,
        "device": run.device.label,
        "exact_shapes": sorted({"x".join(map(str, s.shape)) for s in run.specs}),
        "skipped_dtypes": dict(run.skipped),
        "findings": findings,
        "notes": list(run.notes),
        **coverage_evidence(run),
        **(extra or {}),
    }
    if bad:
        evidence["sm_pattern"] = sm_pattern(bad)
    out = _mismatch_results(ctx, target, run.verdicts, bad, evidence)
    if not out:
        out.append(_clean_result(ctx, target, run, evidence))
    for r in out:
        r.duration_s = sum(v.duration_s for v in run.verdicts)
    return out


def _mismatch_results(
    ctx: CheckContext,
    target: str,
    verdicts: list[sdc_lib.Verdict],
    bad: list[sdc_lib.Verdict],
    evidence: dict[str, Any],
) -> list[Result]:
    """A GPU's findings: confirmed corruption (FAIL) or else a transient mismatch (WARN), and
    probes that could not run (ERROR)."""
    n = len(verdicts)
    out: list[Result] = []
    confirmed = [v for v in verdicts if v.status == "confirmed"]
    transient = [v for v in verdicts if v.status == "transient"]
    errors = [v for v in verdicts if v.status == "error"]
    if _history_drift_alone(verdicts, confirmed):
        first = confirmed[0]
        out.append(
            ctx.result(
                target,
                "sdc_digest_drift",
                Status.WARN,
                f"{target}: {len(confirmed)} digest(s) differ from this GPU's own earlier ones, "
                f"repeatably, while every exact probe on it came out right and no other GPU ran "
                f"them to compare: {first.detail}. A software change the fingerprint does not "
                "see, or a defect only this GEMM reaches: run the sdc check on every GPU of the "
                "node (siblings that agree with it make it software), or the GPU's field "
                "diagnostics; after a software change, remove this GPU's entry from the digest "
                "history (sdc/digests.json under the state directory) to take a new baseline",
                value=len(confirmed),
                unit="probes",
                **first.headline(),
                **evidence,
            )
        )
        confirmed = []
    if confirmed:
        # An exact-probe verdict says how many elements were wrong; prefer it as the headline.
        first = next((v for v in confirmed if v.probe == "exact_gemm"), confirmed[0])
        out.append(
            ctx.result(
                target,
                "sdc_confirmed",
                Status.FAIL,
                f"{target}: silent data corruption confirmed (a mismatch repeated on this GPU): "
                f"{first.detail}; {len(confirmed)} of {n} probes confirmed ({_summary(confirmed)})"
                f"{_where(bad)}; replace the GPU",
                value=len(confirmed),
                unit="probes",
                **first.headline(),
                **evidence,
            )
        )
    elif transient:
        first = transient[0]
        out.append(
            ctx.result(
                target,
                "sdc_transient",
                Status.WARN,
                f"{target}: {len(transient)} of {n} probes mismatched once and nothing repeated it "
                f"(transient; kept as evidence): {first.detail}",
                value=len(transient),
                unit="probes",
                **first.headline(),
                **evidence,
            )
        )
    if errors:
        out.append(
            ctx.result(
                target,
                "sdc_probe_error",
                Status.ERROR,
                f"{target}: {len(errors)} of {n} SDC probes could not run: {errors[0].detail}",
                value=len(errors),
                unit="probes",
                **evidence,
            )
        )
    return out


def _history_drift_alone(verdicts: list[sdc_lib.Verdict], confirmed: list[sdc_lib.Verdict]) -> bool:
    """Whether a GPU's only confirmed findings are digests unlike its own history that no other
    GPU ran, while its exact probes (known answers) all came out right: the history is then the
    only witness, and a stale history cannot be told from a defect."""
    exact = [v for v in verdicts if v.probe == "exact_gemm"]
    return (
        bool(confirmed)
        and all(v.probe == "digest_gemm" and v.evidence.get("uncorroborated") for v in confirmed)
        and bool(exact)
        and all(v.status == "pass" for v in exact)
    )


def _clean_result(ctx: CheckContext, target: str, run: GpuRun, evidence: dict[str, Any]) -> Result:
    """The pass of a GPU whose probes all matched, with how much of it they reached."""
    n = len(run.verdicts)
    notes = "".join(f"; note: {x}" for x in run.notes)
    cov = run.coverage
    reach = (
        f"; exact probes reached {cov.value:.0%} of {cov.sm_count} SMs ({cov.method})"
        if cov is not None and cov.sm_count
        else ""
    )
    return ctx.result(
        target,
        "sdc_probes",
        Status.PASS,
        f"{target}: {n} SDC probes in {run.rounds} round(s), no mismatch{reach}{notes}",
        value=n,
        unit="probes",
        **evidence,
    )


# --------------------------------------------------------------------------------------------
# The check


def make_plan(p: Params | Mapping[str, Any], on_cuda: bool) -> tuple[Plan, list[str]]:
    """The plan from the check's params (a suite's raw params are parsed first); ValueError
    names a bad param (a shape too large for an exact golden among them); notes for the
    result."""
    from node_agent.sdc import probes as sdc_lib

    params = p if isinstance(p, Params) else Params.parse(p)
    notes = []
    dtypes = list(params.dtypes or ALL_DTYPES)
    if not on_cuda:
        for name, why in (
            ("tf32", "the CPU has no TF32 tensor cores"),
            ("fp8", "the CPU has no fp8 GEMM"),
        ):
            if name in dtypes:
                dtypes.remove(name)
                if params.dtypes is not None:
                    notes.append(f"{name} not probed: {why}")
    shapes = params.shapes
    for shape in shapes or ():
        for d in dtypes:
            sdc_lib.golden(sdc_lib.ProbeSpec(*shape, dtype=d))  # said up front, as a suite error
    digest_shapes = params.digest_shapes or shapes or sdc_lib.DEFAULT_SHAPES
    digest_specs = tuple(
        sdc_lib.ProbeSpec(*shape, dtype=d)
        for shape in digest_shapes
        for d in dtypes
        if d in DIGEST_DTYPES
    )
    plan = Plan(
        dtypes=tuple(dtypes),
        digest_specs=digest_specs,
        shapes=shapes,
        tiles_per_sm=params.tiles_per_sm,
        repeats=params.repeats,
        duration_s=params.duration_s,
        seeds=params.seeds,
        freivalds_n=params.freivalds_n
        if params.freivalds_n is not None
        else 1024
        if on_cuda
        else 256,
        freivalds_dtypes=tuple(d for d in ("fp32", "bf16", "tf32") if d in dtypes),
    )
    return plan, notes


def gpu_indices(ctx: CheckContext) -> list[int]:
    """The GPUs to probe: ``params.gpus`` or every GPU the inventory read."""
    have = [g.index for g in ctx.inventory.gpus]
    wanted = ctx.typed_params(Params).gpus
    return have if wanted is None else [i for i in have if i in set(wanted)]


def _free_mib(dev: ComputeDevice) -> tuple[float, float] | None:
    if dev.device.type != "cuda":
        return None
    import torch

    free, total = torch.cuda.mem_get_info(dev.device)
    return free / 2**20, total / 2**20


def _no_coverage(results: list[Result]) -> list[Result]:
    """Results of a check that probed nothing still say so: ``sm_coverage`` 0.0."""
    for r in results:
        for k, v in coverage_evidence(None).items():
            r.evidence.setdefault(k, v)
    return results


def _open_for_probe(
    ctx: CheckContext, spec: compute.ComputeSpec, min_free: float
) -> ComputeDevice | Result:
    """The GPU's compute device; else the result that says why it is not probed: it cannot
    open (error), or in the service mode it has less than ``min_free`` MiB free (skip, so a
    probe cannot push a running job out of memory)."""
    target = spec.target
    try:
        dev = compute.open_device(spec)
    except Exception as err:  # noqa: BLE001 - a device that cannot open is an error result
        return ctx.result(
            target,
            "sdc_probe_error",
            Status.ERROR,
            f"{target}: cannot open the compute device: {type(err).__name__}: {err}",
        )
    if ctx.mode == "service":
        mem = _free_mib(dev)
        if mem is not None and mem[0] < min_free:
            return ctx.result(
                target,
                "sdc_probes",
                Status.SKIP,
                f"{target}: {mem[0]:.0f} MiB free of {mem[1]:.0f} MiB, below "
                f"min_free_mib {min_free:g}: probe skipped so it cannot push a "
                "running job out of memory",
                free_mib=round(mem[0]),
            )
    return dev


def run(ctx: CheckContext) -> list[Result]:
    unavailable = ctx.gpus_unavailable()
    if unavailable:
        return _no_coverage(unavailable)
    params = ctx.typed_params(Params)
    indices = gpu_indices(ctx)
    if not indices:
        return _no_coverage(
            [ctx.skip("no GPUs visible: nothing to probe for silent data corruption")]
        )
    try:
        specs = ctx.ports.compute.specs(indices)
    except compute.ComputeUnavailable as err:
        return _no_coverage(ctx.compute_unavailable(str(err)))
    on_cuda = ctx.ports.compute.measured
    try:
        plan, plan_notes = make_plan(params, on_cuda)
    except ValueError as err:
        return _no_coverage(
            [
                ctx.result(
                    "node",
                    "sdc_probe_error",
                    Status.ERROR,
                    f"sdc check parameters are invalid: {err} (fix the suite file)",
                )
            ]
        )
    gpus = {g.index: g for g in ctx.inventory.gpus}
    history = DigestHistory(history_path(ctx.state_dir) if params.digest_history else None)
    runs: dict[int, GpuRun] = {}
    baselines: dict[int, dict[str, str]] = {}
    software: dict[int, dict[str, Any]] = {}
    out: list[Result] = []
    for spec in specs:
        dev = _open_for_probe(ctx, spec, params.min_free_mib)
        if isinstance(dev, Result):
            out.append(dev)
            continue
        info = gpus.get(spec.index)
        run = runs[spec.index] = GpuRun(spec.index, dev, uuid=info.uuid if info else None)
        run.notes.extend(plan_notes)
        software[spec.index] = software_fingerprint(
            dev, info.name if info else None, ctx.inventory.host.driver
        )
        if history.problem:
            run.notes.append(history.problem)
        if run.uuid and history.path is not None:
            base, why = history.baseline(run.uuid, software[spec.index])
            baselines[spec.index] = base
            if why:
                run.notes.append(why)
    _no_coverage(out)
    probe_node(runs, plan, baselines)
    for run in runs.values():
        if run.uuid and not run.suspect and run.digests:
            history.store(run.uuid, software[run.index], run.digests)
        out.extend(
            results_for(
                ctx,
                run,
                {"stand_in": not ctx.ports.compute.measured, "software": software[run.index]},
            )
        )
    try:
        history.save()
    except OSError as err:
        for r in out:
            r.evidence.setdefault("notes", []).append(
                f"digests not saved to {history.path}: {err.strerror}; the next run has no "
                "earlier digest to compare with"
            )
    return out
