"""SDC probes on the CPU with real torch: whole-GPU shapes from the SM count, full-significand
exact inputs and their goldens, the accumulator check, the simulated faulty SM, confirmation of
intermittent mismatches, Freivalds, digests, the spool's atomicity and the in-training probe's
budget, memory bound and coverage evidence.

The simulated faulty SM is the library's own ``corrupting_matmul`` (the compute boundary the
simulator uses); a "narrow accumulator" matmul below emulates a kernel that keeps fewer bits
than fp32 (nothing on a CPU does), so that the check that detects one can be tested.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from node_agent.sdc import coverage as sdc_coverage  # noqa: E402
from node_agent.sdc import exact  # noqa: E402
from node_agent.sdc import probes as sdc  # noqa: E402
from node_agent.sdc.probes import ProbeSpec, SdcProbe, Verdict  # noqa: E402
from node_agent.sdc.tiles import TileModel, gpu_model, sim_model, whole_gpu_mn  # noqa: E402
from node_agent.sdc.verdicts import Window, upgrade_in_window  # noqa: E402

SMALL = ProbeSpec(32, 32, 32, "fp32")
SIM = sim_model()  # a simulated H100: 132 SMs, 16 x 16 tiles


class FakeClock:
    """A monotonic clock the test advances by hand (seconds)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


def narrow_accumulator(bits: int, only: torch.dtype | None = None):
    """A matmul whose running sum keeps ``bits`` significant bits (truncated after every add),
    as a kernel accumulating below fp32 would; ``only`` limits it to inputs of one dtype."""

    def matmul(a, b):
        if only is not None and a.dtype != only:
            return exact.gemm(a, b)
        x, y = a.double(), b.double()
        acc = torch.zeros(x.shape[0], y.shape[1], dtype=torch.float64)
        for k in range(x.shape[1]):
            acc = acc + torch.outer(x[:, k], y[k, :])
            mant, exp = torch.frexp(acc)
            acc = torch.ldexp(torch.trunc(mant * 2.0**bits) / 2.0**bits, exp)
        return acc.to(
            torch.bfloat16 if a.dtype == getattr(torch, "float8_e4m3fn", None) else a.dtype
        )

    return matmul


def rne(value: int, bits: int) -> int:
    """Round an integer to ``bits`` significant bits, ties to even (IEEE 754's default)."""
    if value == 0:
        return 0
    shift = max(0, abs(value).bit_length() - bits)
    q, r = divmod(abs(value), 1 << shift)
    half = 1 << shift >> 1
    if shift and (r > half or (r == half and q & 1)):
        q += 1
    return (q << shift) * (1 if value > 0 else -1)


# -- whole-GPU shapes and the tile model ----------------------------------------------------


@pytest.mark.parametrize("sm_count", [78, 108, 114, 132, 142, 148, 152])
def test_whole_gpu_shape_gives_every_sm_at_least_the_asked_tiles(sm_count):
    model = gpu_model(sm_count)
    m, n = whole_gpu_mn(model, 4, 256)
    assert m % 256 == 0 and n % 256 == 0
    assert model.tiles(m, n) >= 4 * sm_count
    # whatever SM the launch starts on, every SM gets at least 4 tiles
    for rotation in (0, 1, sm_count - 1):
        assert min(len(model.tiles_on(sm, m, n, rotation)) for sm in range(sm_count)) >= 4
    assert model.coverage([(m, n)]) == 1.0


def test_old_fixed_probe_shapes_reach_one_to_three_of_an_h100s_132_sms():
    model = gpu_model(132)
    assert [model.sms_reached(m, n) for m, _, n in sdc.DEFAULT_SHAPES] == [1, 2, 3]
    assert model.coverage([(m, n) for m, _, n in sdc.DEFAULT_SHAPES]) == pytest.approx(3 / 132)


def test_sm_count_comes_from_the_sku_file_on_a_simulated_node():
    from node_agent.compute.devices import open_device
    from node_agent.hardware.sku import load_sku
    from node_agent.resources import _shipped
    from node_agent.sim.node import ScenarioCompute

    sku = load_sku(_shipped("node_agent.graders") / "skus" / "b200-sxm-180gb.yaml")
    (spec,) = ScenarioCompute(_scenario(), sku).specs([0])
    dev = open_device(spec)
    assert dev.sm_count == 148 and dev.tile_model == TileModel(148, 16, 16)
    (default,) = ScenarioCompute(_scenario(), None).specs([0])
    assert open_device(default).sm_count == 132


def _scenario(faults=()):
    from node_agent.sim.scenario import Fault, Scenario

    return Scenario(
        sku="h100-sxm5-80gb",
        gpus=8,
        source="test",
        faults=tuple(
            Fault("sdc", f["gpu"], {k: v for k, v in f.items() if k != "gpu"}) for f in faults
        ),
    )


def test_scenario_sm_outside_the_sku_is_refused_with_the_fix():
    from node_agent.compute.devices import ComputeUnavailable
    from node_agent.hardware.sku import load_sku
    from node_agent.resources import _shipped
    from node_agent.sim.node import ScenarioCompute

    sku = load_sku(_shipped("node_agent.graders") / "skus" / "h100-sxm5-80gb.yaml")
    with pytest.raises(ComputeUnavailable, match=r"names sm 140.*has 132 SMs.*fix the scenario"):
        ScenarioCompute(_scenario([{"gpu": 6, "sm": 140}]), sku).specs([6])


# -- exact inputs and goldens --------------------------------------------------------------


def test_whole_gpu_specs_use_each_dtypes_full_significand_with_an_exact_k():
    full = {
        s.dtype: s
        for s in exact.plan_whole_gpu(gpu_model(132), list(exact.NUMERICS), 4, 256)
        if exact.input_bits(s) == exact.NUMERICS[s.dtype].full_bits
    }
    assert {d: (exact.input_bits(s), s.k) for d, s in full.items()} == {
        "bf16": (8, 256),
        "fp16": (11, 4),
        "tf32": (11, 4),
        "fp8": (4, 32),
    }
    for spec in exact.plan_whole_gpu(gpu_model(132), list(exact.NUMERICS), 4, 256):
        vmax = 2 ** exact.input_bits(spec) - 1
        # every partial sum, in any order, stays below the accumulator's exact range
        assert spec.k * vmax * vmax < 2 ** exact.NUMERICS[spec.dtype].acc_bits


@pytest.mark.parametrize(
    "spec",
    exact.plan_whole_gpu(SIM, list(exact.NUMERICS), 2, 64),
    ids=lambda s: f"{s.label()}-{exact.input_bits(s)}b",
)
def test_inputs_are_full_significand_integers_exact_in_their_dtype(spec):
    a, b, c = sdc.golden(spec)
    bits = exact.input_bits(spec)
    x = exact.NUMERICS[spec.dtype]
    assert a.dtype == b.dtype == c.dtype == torch.int64 and torch.equal(c, a @ b)
    for t in (a, b):
        assert int(t.abs().max()) <= 2**bits - 1
        # three in four use every significant bit: the multipliers see full significands
        assert (t.abs() >= 2 ** (bits - 1)).double().mean() > 0.7
        scaled = t.double() * 2.0**-x.scale_exp
        assert torch.equal(scaled.to(x.dtype).double(), scaled)  # representable exactly


@pytest.mark.parametrize(
    "spec",
    exact.plan_whole_gpu(SIM, ["bf16", "fp16", "fp8"], 2, 64)[:4],
    ids=lambda s: f"{s.label()}-{exact.input_bits(s)}b",
)
def test_golden_is_the_exact_sum_rounded_once_to_nearest_even(spec):
    _, _, c = sdc.golden(spec)
    x = exact.NUMERICS[spec.dtype]
    out_bits = {torch.bfloat16: 8, torch.float16: 11}[x.out_dtype]
    got = sdc.golden_out(spec).double() * 2.0 ** (2 * x.scale_exp)
    want = torch.tensor([rne(int(v), out_bits) for v in c.view(-1).tolist()], dtype=torch.float64)
    assert torch.equal(got.view(-1), want)
    assert sdc.golden_out(spec) is sdc.golden_out(spec)  # computed once per spec


def test_golden_rounding_breaks_ties_to_even():
    assert [rne(v, 8) for v in (257, 259, 261, 263)] == [256, 260, 260, 264]
    ints = torch.tensor([257, 259, 261, 263])
    assert torch.equal(
        ints.to(torch.float32).to(torch.bfloat16).to(torch.int64),
        torch.tensor([256, 260, 260, 264]),
    )


def test_spec_whose_sums_could_round_is_refused_with_the_largest_safe_k():
    with pytest.raises(ValueError, match=r"exceeds 16777216.*use K <= 4 for 11-bit"):
        sdc.golden(ProbeSpec(64, 8, 64, "fp16", bits=11, seed=99))
    with pytest.raises(ValueError, match="even inputs of"):
        exact.input_bits(ProbeSpec(1, 2**24, 1, "fp32"))
    # explicit shapes get the widest inputs their K allows
    assert exact.input_bits(ProbeSpec(16, 16, 16, "fp16")) == 10
    assert exact.input_bits(ProbeSpec(16, 512, 16, "bf16")) == 7


def test_every_whole_gpu_spec_passes_on_a_healthy_cpu_fp8_included():
    specs = exact.plan_whole_gpu(SIM, list(exact.NUMERICS), 2, 64)
    assert {s.dtype for s in specs} == {"bf16", "fp16", "tf32", "fp8", "fp32"}
    for spec in specs:  # tf32 runs as fp32 on the CPU; fp8 through torch._scaled_mm
        v = sdc.exact_gemm_probe(spec, tiles=SIM)
        assert v.status == "pass", v.detail


def test_healthy_cpu_shows_no_mismatch_over_600_exact_probes():
    statuses = set()
    for i in range(600):
        spec = ProbeSpec(
            32, (4, 64, 256)[i % 3], 48, ("fp16", "bf16", "fp32")[i % 3], seed=i % 7, block=(16, 16)
        )
        v = sdc.exact_gemm_probe(spec)
        statuses.add(v.status)
        assert v.mismatched_elements == 0, v.detail
    assert statuses == {"pass"}


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_corrupting_matmul_yields_confirmed_mismatch_naming_shape_dtype_count(dtype: str) -> None:
    spec = ProbeSpec(48, 64, 40, dtype)
    v = sdc.exact_gemm_probe(spec, matmul=sdc.corrupting_matmul(seed=3))
    assert v.status == "confirmed"
    assert v.mismatched_elements == 1
    assert v.shape == (48, 64, 40) and v.dtype == dtype
    assert f"{dtype} 48x64x40" in v.detail and "1 of 1920 elements differ" in v.detail
    ((idx, got, expected),) = v.evidence["first"]
    assert expected == float(sdc.golden_out(spec)[idx[0], idx[1]]) and got != expected


@pytest.mark.parametrize("bit", [0, 10, 22, 23, 30, 31])
def test_any_flipped_fp32_bit_is_caught(bit: int) -> None:
    v = sdc.exact_gemm_probe(
        ProbeSpec(32, 32, 32, "fp32", seed=1), matmul=sdc.corrupting_matmul(bit=bit, seed=5)
    )
    assert v.status == "confirmed", v.detail


def test_corruption_on_first_call_only_is_transient_not_confirmed() -> None:
    v = sdc.exact_gemm_probe(SMALL, matmul=sdc.corrupting_matmul(times=1))
    assert v.status == "transient"
    assert v.mismatched_elements == 1
    assert v.evidence["rerun_mismatched_elements"] == 0
    assert "transient" in v.detail


def test_probe_restores_tf32_and_reduced_precision_flags() -> None:
    m = torch.backends.cuda.matmul
    before = (
        m.allow_tf32,
        m.allow_bf16_reduced_precision_reduction,
        m.allow_fp16_reduced_precision_reduction,
    )
    seen = []

    def spy(a, b):
        seen.append(
            (
                m.allow_tf32,
                m.allow_bf16_reduced_precision_reduction,
                m.allow_fp16_reduced_precision_reduction,
            )
        )
        return torch.matmul(a, b)

    m.allow_tf32 = True
    try:
        sdc.exact_gemm_probe(ProbeSpec(32, 32, 32, "fp32", seed=3), matmul=spy)
        assert seen == [(False, False, False)]
        assert m.allow_tf32 is True
    finally:
        m.allow_tf32 = before[0]
    assert (
        m.allow_tf32,
        m.allow_bf16_reduced_precision_reduction,
        m.allow_fp16_reduced_precision_reduction,
    ) == before


# -- the accumulator check -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16", "fp8"])
def test_an_fp32_accumulator_passes_the_accumulator_check(dtype):
    assert sdc.accumulator_check(dtype, "cpu", tiles=SIM) is None


@pytest.mark.parametrize("dtype, bits", [("bf16", 14), ("fp16", 16), ("fp8", 10)])
def test_a_kernel_accumulating_in_lower_precision_is_detected_and_named(dtype, bits):
    why = sdc.accumulator_check(dtype, "cpu", narrow_accumulator(bits), SIM)
    assert why is not None and why.startswith(
        f"{dtype}: this GEMM kernel accumulates in lower precision"
    )
    assert "skipped" in why


def test_a_faulty_sm_is_not_mistaken_for_a_narrow_accumulator():
    everywhere = sdc.corrupting_matmul(tiles=SIM, sm=None, rate=1.0)  # every tile, every SM
    assert sdc.accumulator_check("bf16", "cpu", everywhere, SIM) is None
    # ... and the exact probe still sees it
    spec = exact.plan_whole_gpu(SIM, ["bf16"], 2, 64)[0]
    assert sdc.exact_gemm_probe(spec, matmul=everywhere, tiles=SIM).status == "confirmed"


def test_whole_gpu_specs_skip_what_the_cpu_lacks_with_the_reason():
    specs, skipped = sdc.whole_gpu_specs("cpu")
    assert {s.dtype for s in specs} == {"bf16", "fp16", "fp32"}
    assert skipped == {
        "tf32": "tf32: the CPU has no TF32 tensor cores",
        "fp8": "fp8: the CPU has no fp8 GEMM",
    }


# -- the simulated faulty SM ----------------------------------------------------------------


def _wrong(spec, matmul):
    a, b = exact._inputs_cpu(spec)
    good, bad = exact.gemm(a, b), matmul(a, b)
    return (good != bad).nonzero().tolist()


def test_a_faulty_sm_corrupts_only_tiles_it_computed():
    spec = exact.plan_whole_gpu(SIM, ["fp32"], 2, 64)[0]
    mm = sdc.corrupting_matmul(seed=4, tiles=SIM, sm=17, rate=1.0)
    for _ in range(5):
        wrong = _wrong(spec, mm)
        tiles = {SIM.tile_of(i, j, spec.n) for i, j in wrong}
        assert len(tiles) == len(wrong) in (2, 3)  # one element in each of SM 17's tiles
        assert len({t % SIM.sm_count for t in tiles}) == 1  # all on one SM, wherever it began


def test_rate_is_honoured_over_many_launches_and_reproducible():
    spec = ProbeSpec(320, 4, 256, "fp32", bits=8, block=(64, 64))
    a, b = exact._inputs_cpu(spec)
    good = exact.gemm(a, b)

    def corrupted_tiles(seed):
        mm = sdc.corrupting_matmul(seed=seed, tiles=SIM, sm=97, rate=0.3)
        hit = total = 0
        for _ in range(400):
            hit += int((mm(a, b) != good).sum())
            total += len(SIM.tiles_on(97, spec.m, spec.n))  # 2 or 3; use the mean below
        return hit

    launches, mean_tiles = 400, 320 / 132
    hits = corrupted_tiles(1)
    assert hits == corrupted_tiles(1)  # seeded: the same run twice
    assert abs(hits / (launches * mean_tiles) - 0.3) < 0.06


def test_a_small_probe_rarely_reaches_the_faulty_sm_a_whole_gpu_probe_always_does():
    mm = sdc.corrupting_matmul(seed=2, tiles=SIM, sm=17, rate=1.0)
    small = ProbeSpec(32, 32, 32, "fp32")  # 4 tiles: the faulty SM only when the launch lands near
    whole = exact.plan_whole_gpu(SIM, ["fp32"], 2, 64)[0]
    small_hits = sum(bool(_wrong(small, mm)) for _ in range(264))
    whole_hits = sum(bool(_wrong(whole, mm)) for _ in range(50))
    assert whole_hits == 50
    assert small_hits < 264 * 0.1  # 4 tiles of 132 SMs: about 3 %


def test_legacy_corrupting_matmul_flips_one_element_per_call():
    a, b = torch.ones(8, 8), torch.ones(8, 8)
    assert int((sdc.corrupting_matmul()(a, b) != a @ b).sum()) == 1


# -- confirmation ---------------------------------------------------------------------------


def test_a_second_mismatch_in_the_window_confirms_an_intermittent_fault():
    window = Window()
    first = sdc.exact_gemm_probe(SMALL, matmul=sdc.corrupting_matmul(times=1))
    assert upgrade_in_window(first, window).status == "transient"
    second = sdc.exact_gemm_probe(
        ProbeSpec(32, 32, 32, "bf16"), matmul=sdc.corrupting_matmul(times=1)
    )
    second = upgrade_in_window(second, window)
    assert second.status == "confirmed" and second.evidence["window_mismatches"] == 1
    assert "other probe run(s) on this device mismatched" in second.detail


def test_a_clean_window_leaves_a_lone_mismatch_transient():
    window = Window(size=3)
    upgrade_in_window(sdc.exact_gemm_probe(SMALL, matmul=sdc.corrupting_matmul(times=1)), window)
    for _ in range(3):
        upgrade_in_window(sdc.exact_gemm_probe(SMALL), window)
    late = upgrade_in_window(
        sdc.exact_gemm_probe(SMALL, matmul=sdc.corrupting_matmul(times=1)), window
    )
    assert late.status == "transient"  # the first mismatch left the window


def test_mismatch_evidence_says_the_wrong_tiles_ran_on_one_sm():
    spec = exact.plan_whole_gpu(SIM, ["bf16"], 2, 64)[0]
    v = sdc.exact_gemm_probe(spec, matmul=sdc.corrupting_matmul(seed=1, tiles=SIM, sm=5), tiles=SIM)
    assert v.status == "confirmed"
    assert len(v.evidence["tile_residues"]) == 1 and v.evidence["tiles_mismatched"] in (2, 3)
    assert "one SM under the tile model" in v.detail


# -- coverage ------------------------------------------------------------------------------


def test_coverage_on_a_cpu_stand_in_comes_from_the_model():
    cov = sdc_coverage.measure("cpu", SIM, [(320, 256)])
    assert (cov.value, cov.method, cov.sm_count) == (1.0, "model", 132)
    assert (
        cov.evidence()["sm_coverage"] == 1.0 and "tile model" in cov.evidence()["sm_coverage_note"]
    )
    assert sdc_coverage.modeled(gpu_model(132), [(128, 128)]).value == pytest.approx(1 / 132)


def test_reading_smid_without_a_kernel_names_every_kernel_it_tried():
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: tests/gpu/test_sdc_gpu.py measures %smid for real")
    with pytest.raises(RuntimeError, match=r"cupy: .*triton: .*jiterator: "):
        sdc_coverage.smids(torch.device("cuda", 0), 4)


# -- digests --------------------------------------------------------------------------------


def test_digest_is_reproducible_and_changes_with_a_flipped_bit() -> None:
    spec = ProbeSpec(64, 64, 64, "bf16", seed=4)
    d1 = sdc.digest_probe(spec).evidence["digest"]
    d2 = sdc.digest_probe(spec).evidence["digest"]
    assert d1 == d2 and len(d1) == 64
    bad = sdc.digest_probe(spec, matmul=sdc.corrupting_matmul(bit=0)).evidence["digest"]
    assert bad != d1


def test_digest_differing_from_earlier_is_confirmed_when_repeated_transient_when_not() -> None:
    spec = ProbeSpec(32, 32, 32, "fp32", seed=2)
    prev = sdc.digest_probe(spec).evidence["digest"]
    assert sdc.digest_probe(spec, previous=prev).status == "pass"
    assert (
        sdc.digest_probe(spec, previous=prev, matmul=sdc.corrupting_matmul()).status == "confirmed"
    )
    assert (
        sdc.digest_probe(spec, previous=prev, matmul=sdc.corrupting_matmul(times=1)).status
        == "transient"
    )


@pytest.mark.parametrize(
    ("digests", "odd"),
    [
        ({"cuda:0": "a", "cuda:1": "a", "cuda:2": "b", "cuda:3": "a"}, ["cuda:2"]),
        ({0: "a", 1: "b", 2: "a"}, [1]),
        ({0: "a", 1: "a"}, []),
        ({0: "a", 1: "b"}, []),  # no majority: no suspect
        ({0: "a", 1: "a", 2: "b", 3: "b"}, []),
        ({0: "a", 1: "a", 2: "a", 3: "b", 4: "c"}, [3, 4]),
        ({}, []),
    ],
)
def test_odd_one_out_names_the_minority(digests, odd) -> None:
    assert sdc.odd_one_out(digests) == odd


# -- Freivalds ------------------------------------------------------------------------------


def test_freivalds_passes_a_correct_integer_product_and_catches_one_flipped_element() -> None:
    a, b, c = sdc.golden(ProbeSpec(64, 128, 48, "fp32", seed=8))
    assert sdc.freivalds_check(a, b, c) == 0
    af, bf = a.float(), b.float()
    good = af @ bf
    assert sdc.freivalds_check(af, bf, good) == 0
    for bit in (0, 5, 22, 30):
        bad = sdc.corrupting_matmul(bit=bit, seed=bit)(af, bf)
        assert sdc.freivalds_check(af, bf, bad) == 1, bit
    off = good.clone()
    off[3, 7] += 1
    off[9, 0] -= 1
    assert sdc.freivalds_check(af, bf, off) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_freivalds_float_mode_passes_correct_product_and_catches_large_corruption(dtype) -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(200, 300, generator=g).to(dtype)
    b = torch.randn(300, 150, generator=g).to(dtype)
    c = a @ b
    assert sdc.freivalds_check(a, b, c, rounds=4) == 0
    bad = c.clone()
    # The float bound sums |A||B||x| + |C||x| over a row: about 1 for fp32 here, about 240 for
    # bf16 (its output rounding, 2^-8, dominates); an exponent-bit flip is far larger.
    bad[17, 5] += 10_000
    assert sdc.freivalds_check(a, b, bad) == 1
    nan = c.clone()
    nan[3, 3] = float("nan")
    assert sdc.freivalds_check(a, b, nan) == 1


def test_freivalds_probe_confirms_injected_exponent_flip() -> None:
    spec = ProbeSpec(128, 128, 128, "fp32")
    assert sdc.freivalds_probe(spec).status == "pass"
    v = sdc.freivalds_probe(spec, matmul=sdc.corrupting_matmul(bit=30))
    assert v.status == "confirmed" and v.mismatched_elements == 1


def test_run_probes_healthy_and_faulty() -> None:
    good = sdc.run_probes("cpu")
    assert good and {v.status for v in good} == {"pass"}
    assert {v.probe for v in good} == {"exact_gemm", "digest_gemm", "freivalds"}
    assert {v.evidence["sm_coverage"] for v in good} == {1.0}
    bad = sdc.run_probes("cpu", matmul=sdc.corrupting_matmul())
    assert {v.status for v in bad if v.probe == "exact_gemm"} == {"confirmed"}
    assert {v.status for v in bad if v.probe == "digest_gemm"} == {"pass"}  # no earlier digest


def test_run_probes_turns_a_crashing_matmul_into_error_verdicts() -> None:
    def broken(a, b):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    vs = sdc.run_probes("cpu", matmul=broken)
    assert vs and {v.status for v in vs} == {"error"}
    assert "illegal memory access" in vs[0].detail


# -- spool ----------------------------------------------------------------------------------


def _verdict(status: str = "confirmed") -> Verdict:
    return sdc.exact_gemm_probe(
        SMALL, matmul=sdc.corrupting_matmul() if status == "confirmed" else None
    )


def test_spool_round_trip(tmp_path) -> None:
    v = _verdict()
    path = sdc.write_verdict(tmp_path, v)
    assert path.suffix == ".json" and path.parent == tmp_path
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left behind
    (back,) = sdc.read_spool(tmp_path)
    assert back == v
    assert json.loads(path.read_text())["schema"] == sdc.SPOOL_SCHEMA


def test_half_written_spool_files_are_never_read_as_verdicts(tmp_path) -> None:
    good = sdc.write_verdict(tmp_path, _verdict())
    text = good.read_text()
    # A writer killed mid-write leaves its temp name: not *.json, never read.
    (tmp_path / f".{good.name}.x1y2.tmp").write_text(text[: len(text) // 2])
    # Truncated JSON renamed to .json by hand: read, rejected, reported.
    (tmp_path / "sdc-truncated.json").write_text(text[: len(text) // 2])
    (tmp_path / "sdc-empty.json").write_text("")
    (tmp_path / "sdc-other.json").write_text(json.dumps({"schema": "something-else/1"}))
    (tmp_path / "sdc-nostatus.json").write_text(json.dumps({**json.loads(text), "status": "fine"}))
    errors: list = []
    verdicts = sdc.read_spool(tmp_path, errors=errors)
    assert len(verdicts) == 1 and verdicts[0].status == "confirmed"
    assert sorted(p.name for p, _ in errors) == [
        "sdc-empty.json",
        "sdc-nostatus.json",
        "sdc-other.json",
        "sdc-truncated.json",
    ]


def test_read_spool_of_missing_dir_is_empty(tmp_path) -> None:
    assert sdc.read_spool(tmp_path / "nope") == []


# -- SdcProbe -------------------------------------------------------------------------------


def _timed_matmul(clock: FakeClock, cost_s: float, inner=None):
    """A matmul that 'takes' cost_s seconds of the fake clock."""
    mm = inner or exact.gemm

    def matmul(a, b):
        clock.advance(cost_s)
        return mm(a, b)

    return matmul


def test_sdc_probe_step_respects_the_budget_with_an_injected_clock(tmp_path) -> None:
    clock = FakeClock()
    probe = SdcProbe(
        "cpu",
        budget_fraction=0.001,
        spool_dir=tmp_path,
        clock=clock,
        matmul=_timed_matmul(clock, 0.01),
    )
    ran = 0
    # each probe is a real product on the CPU: the budget's arithmetic does not depend on how
    # long training runs, so 2,000 s of it (about 200 probes) show it as well as 10,000 s
    for _ in range(20_000):  # 100 ms steps: 2,000 s of training
        clock.advance(0.1)
        if probe.step() is not None:
            ran += 1
        if ran > 1:
            assert probe.overhead() <= 0.001 + 1e-12
    # 10 ms probes at 0.1 % of 2,000 s = 2 s of probe time: about 200 probes.
    assert 180 <= ran <= 201, ran
    assert 0.0009 <= probe.overhead() <= 0.001
    assert {v.status for v in probe.verdicts} == {"pass"}
    assert list(tmp_path.iterdir()) == []  # passes are not spooled by default


def test_sdc_probe_spends_its_budget_round_robin_on_whole_gpu_probes(tmp_path) -> None:
    clock = FakeClock()
    probe = SdcProbe("cpu", budget_fraction=0.5, spool_dir=tmp_path, clock=clock)
    seen = []
    for _ in range(8):
        clock.advance(10)
        v = probe.step()
        seen.append((v.probe, v.dtype, v.shape))
    specs = [("exact_gemm", s.dtype, s.shape) for s in probe.specs]
    assert len(specs) == 4 and seen == specs + specs  # bf16, fp16 (11-bit), fp16 (8-bit), fp32
    assert {shape[0] * shape[2] for _, _, shape in seen} == {320 * 256}  # whole simulated H100


def test_every_sdc_probe_verdict_reports_sm_coverage_1_on_the_simulated_h100(tmp_path) -> None:
    clock = FakeClock()
    probe = SdcProbe(
        "cpu",
        budget_fraction=0.5,
        spool_dir=tmp_path,
        clock=clock,
        matmul=sdc.corrupting_matmul(tiles=SIM, sm=40),
    )
    verdicts = []
    for _ in range(6):
        clock.advance(10)
        verdicts.append(probe.step())
    assert {v.status for v in verdicts} == {"confirmed"}
    assert {v.evidence["sm_coverage"] for v in verdicts} == {1.0}
    assert {v.evidence["sm_coverage_method"] for v in verdicts} == {"model"}
    assert {s.evidence["sm_coverage"] for s in sdc.read_spool(tmp_path)} == {1.0}


def test_sdc_probe_confirms_an_intermittent_fault_by_a_second_mismatch_in_the_round(tmp_path):
    clock = FakeClock()
    calls = {"n": 0}
    wrong = {1, 3}  # the first probe's run (its re-run, call 2, is clean) and the next probe's

    def flaky(a, b):
        out = exact.gemm(a, b)
        calls["n"] += 1
        if calls["n"] in wrong:
            out = out.clone()
            out[0, 0] = -out[0, 0] - 1  # differs in any dtype (a +1 can round away in bf16)
        return out

    probe = SdcProbe("cpu", budget_fraction=0.5, spool_dir=tmp_path, clock=clock)
    probe.matmul = flaky  # after construction: the accumulator checks used the healthy gemm
    statuses = []
    for _ in range(3):
        clock.advance(10)
        statuses.append(probe.step().status)
    assert statuses == ["transient", "confirmed", "pass"]
    assert [v.status for v in sdc.read_spool(tmp_path)] == ["transient", "confirmed"]


def test_sdc_probe_skips_a_dtype_whose_kernel_accumulates_in_lower_precision(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="node_agent.sdc.probes"):
        probe = SdcProbe(
            "cpu",
            spool_dir=tmp_path,
            budget_fraction=0.5,
            matmul=narrow_accumulator(14, only=torch.bfloat16),
        )
    assert set(probe.skipped) == {"bf16"} and "lower precision" in probe.skipped["bf16"]
    assert {s.dtype for s in probe.specs} == {"fp16", "fp32"}
    v = probe.step()
    assert v.status == "pass" and "bf16" in v.evidence["skipped_dtypes"]
    assert any("lower precision" in r.getMessage() for r in caplog.records)


def test_in_training_probe_fits_64_mib_on_an_h100_cublas_workspace_included():
    names = [d for d, _, _ in exact.WHOLE_GPU_SPECS]
    specs, per_sm, need = sdc.fit_whole_gpu(
        gpu_model(132), names, sdc.TRAINING_TILES_PER_SM, 256, 64 * 2**20, 32 * 2**20
    )
    assert need <= 64 * 2**20 and per_sm >= 1
    assert {s.dtype for s in specs} == set(names)
    assert gpu_model(132).coverage([(s.m, s.n) for s in specs]) == 1.0
    with pytest.raises(ValueError, match="even at 1 tile per SM"):
        sdc.fit_whole_gpu(gpu_model(132), names, 2, 256, 40 * 2**20, 32 * 2**20)


def test_probe_memory_counts_inputs_goldens_buffers_and_workspace():
    spec = ProbeSpec(512, 256, 256, "bf16", bits=8, block=(256, 256))
    need = sdc.probe_memory_bytes([spec], gpu_model(2), workspace_bytes=1000)
    inputs = (512 * 256 + 256 * 256) * 2
    golden = 256 * 256 * 2
    out_and_mask = 512 * 256 * 2 + 512 * 256
    tile_map = 512 * 2 + 8
    assert need == 1000 + inputs + golden + out_and_mask + tile_map


def test_cublas_workspace_follows_torch_defaults_and_the_env(monkeypatch):
    assert sdc.cublas_workspace_bytes("cpu") == 0
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
        assert sdc.cublas_workspace_bytes("cuda:0") == 32 * 2**20
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
        assert sdc.cublas_workspace_bytes("cuda:0") == 8 * 2**20 + 128 * 1024
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")
        assert sdc.cublas_workspace_bytes("cuda:0") == 8 * 2**20 + 128 * 1024


def test_sdc_probe_first_step_runs_a_probe_then_waits(tmp_path) -> None:
    clock = FakeClock()
    probe = SdcProbe("cpu", spool_dir=tmp_path, clock=clock, matmul=_timed_matmul(clock, 0.5))
    clock.advance(0.1)
    assert probe.step() is not None
    clock.advance(100)  # 0.5 s spent; the budget allows the next after 500 s (+ its own cost)
    assert probe.step() is None
    clock.advance(1000)
    assert probe.step() is not None


def test_sdc_probe_confirmed_fault_is_spooled(tmp_path) -> None:
    clock = FakeClock()
    probe = SdcProbe("cpu", spool_dir=tmp_path, clock=clock, matmul=sdc.corrupting_matmul())
    clock.advance(1)
    v = probe.step()
    assert v is not None and v.status == "confirmed" and v.probe == "exact_gemm"
    (spooled,) = sdc.read_spool(tmp_path)
    assert spooled.status == "confirmed" and spooled.shape == v.shape


def test_sdc_probe_digest_drift_on_same_device_is_confirmed(tmp_path) -> None:
    clock = FakeClock()
    state = {"mm": exact.gemm}
    probe = SdcProbe(
        "cpu",
        spool_dir=tmp_path,
        clock=clock,
        digests=True,
        matmul=lambda a, b: state["mm"](a, b),
        budget_fraction=0.5,
    )
    rounds = len(probe.specs) + 1  # every exact spec, then one digest probe
    seen = []
    for _ in range(2 * rounds):
        clock.advance(10)
        seen.append(probe.step())
    assert all(v is not None and v.status == "pass" for v in seen)
    assert [v.probe for v in seen].count("digest_gemm") == 2
    # the digest rotation comes back to its first spec after 6 (3 shapes x bf16, fp32)
    for _ in range(4 * rounds):
        clock.advance(10)
        probe.step()
    state["mm"] = sdc.corrupting_matmul(bit=0)
    statuses = []
    for _ in range(rounds):
        clock.advance(10)
        v = probe.step()
        statuses.append((v.probe, v.status))
    assert ("digest_gemm", "confirmed") in statuses
    assert statuses.count(("exact_gemm", "confirmed")) == len(probe.specs)


def test_sdc_probe_step_never_raises_when_the_probe_throws(tmp_path, caplog) -> None:
    clock = FakeClock()

    def broken(a, b):
        raise RuntimeError("boom")

    probe = SdcProbe("cpu", spool_dir=tmp_path, clock=clock, matmul=broken)
    with caplog.at_level(logging.ERROR, logger="node_agent.sdc.probes"):
        clock.advance(1)
        v = probe.step()
        assert v is not None and v.status == "error" and "boom" in v.detail
        assert v.evidence["sm_coverage"] == 1.0
        # Backs off instead of retrying (and logging) at every step.
        for _ in range(50):
            clock.advance(0.1)
            assert probe.step() is None
        clock.advance(60)
        assert probe.step().status == "error"
    assert any("boom" in r.getMessage() or "boom" in str(r.exc_info) for r in caplog.records)
    assert [v.status for v in sdc.read_spool(tmp_path)] == ["error", "error"]


def test_sdc_probe_raise_errors_true_propagates(tmp_path) -> None:
    def broken(a, b):
        raise RuntimeError("boom")

    probe = SdcProbe("cpu", spool_dir=tmp_path, matmul=broken, raise_errors=True)
    with pytest.raises(RuntimeError, match="boom"):
        probe.step()


def test_sdc_probe_unwritable_spool_does_not_raise(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    probe = SdcProbe("cpu", spool_dir=blocker / "spool", matmul=sdc.corrupting_matmul())
    v = probe.step()
    assert v is not None and v.status == "confirmed"


def test_sdc_probe_rejects_bad_budget() -> None:
    with pytest.raises(ValueError, match="budget_fraction"):
        SdcProbe("cpu", budget_fraction=0)


def test_sm_coverage_validation_needs_a_cuda_device():
    from node_agent.sdc import sdc_sm_coverage

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: tests/gpu/test_sdc_gpu.py measures it")
    with pytest.raises(RuntimeError, match="no CUDA device"):
        sdc_sm_coverage()


# -- import isolation -----------------------------------------------------------------------


def test_sdc_imports_only_stdlib_and_torch() -> None:
    code = textwrap.dedent(
        """
        import sys
        import torch
        before = set(sys.modules)
        from node_agent.sdc import SdcProbe, Verdict, write_verdict, default_spool_dir
        new = sorted(set(sys.modules) - before)
        print("\\n".join(new))
        """
    )
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    new = [m for m in out.stdout.split() if m]
    assert "node_agent.sdc.probes" in new
    foreign = [
        m
        for m in new
        if m not in ("node_agent", "node_agent.heartbeat", "node_agent.atomic_file")
        and not m.startswith("node_agent.sdc")
        and m.split(".")[0] not in sys.stdlib_module_names
        and not m.startswith("torch")
    ]
    # node_agent.heartbeat is the other training-side module (standard library only); the spool
    # reads its files through it. node_agent.atomic_file (standard library only: whatever it
    # imported would be listed here too) writes the verdicts
    assert foreign == [], f"node_agent.sdc pulled in {foreign}"
    for banned in ("pynvml", "yaml", "jsonschema", "psutil"):
        assert banned not in new
