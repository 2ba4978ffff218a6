"""SDC probes on the CPU with real torch: exact goldens, injected corruption, confirmation,
Freivalds, digests, the spool's atomicity and the in-training budget."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from node_agent.sdc import probes as sdc  # noqa: E402
from node_agent.sdc.probes import ProbeSpec, SdcProbe, Verdict  # noqa: E402

SMALL = ProbeSpec(32, 32, 32, "fp32")


class FakeClock:
    """A monotonic clock the test advances by hand (seconds)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


# -- exact probe ----------------------------------------------------------------------------


@pytest.mark.parametrize("spec", sdc.default_specs("cpu"), ids=lambda s: s.label())
def test_golden_is_exact_int64_matmul(spec: ProbeSpec) -> None:
    a, b, c = sdc.golden(spec)
    assert a.dtype == b.dtype == c.dtype == torch.int64
    assert torch.equal(c, a @ b)
    dtype = sdc.DTYPES[spec.dtype][0]
    # The inputs round-trip exactly through the probe dtype, and so does the worst-case sum.
    assert torch.equal(a.to(dtype).to(torch.int64), a)
    assert torch.equal(b.to(dtype).to(torch.int64), b)
    assert torch.equal(c.to(dtype).to(torch.int64), c)
    assert int(c.abs().max()) <= spec.k * int(a.abs().max()) * int(b.abs().max())
    assert sdc.golden(spec)[2] is c  # cached


def test_exact_probe_rejects_shape_that_could_round() -> None:
    with pytest.raises(ValueError, match="exceeds 256"):
        sdc.golden(ProbeSpec(8, 512, 8, "bf16", seed=99))


def test_healthy_cpu_shows_no_mismatch_over_2000_exact_probes() -> None:
    dtypes = ["fp32", "bf16", "fp16"]
    statuses = set()
    for i in range(2000):
        v = sdc.exact_gemm_probe(ProbeSpec(16, 32, 24, dtypes[i % 3], seed=i % 7))
        statuses.add(v.status)
        assert v.mismatched_elements == 0, v.detail
    assert statuses == {"pass"}


def test_default_specs_all_pass_on_healthy_cpu() -> None:
    for spec in sdc.default_specs("cpu"):
        v = sdc.exact_gemm_probe(spec)
        assert v.status == "pass", v.detail


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_corrupting_matmul_yields_confirmed_mismatch_naming_shape_dtype_count(dtype: str) -> None:
    spec = ProbeSpec(48, 64, 40, dtype)
    v = sdc.exact_gemm_probe(spec, matmul=sdc.corrupting_matmul(seed=3))
    assert v.status == "confirmed"
    assert v.mismatched_elements == 1
    assert v.shape == (48, 64, 40) and v.dtype == dtype
    assert f"{dtype} 48x64x40" in v.detail and "1 of 1920 elements differ" in v.detail
    (idx, got, expected), = v.evidence["first"]
    _, _, c = sdc.golden(spec)
    assert expected == float(c[idx[0], idx[1]]) and got != expected


@pytest.mark.parametrize("bit", [0, 10, 22, 23, 30, 31])
def test_any_flipped_fp32_bit_is_caught(bit: int) -> None:
    v = sdc.exact_gemm_probe(ProbeSpec(32, 32, 32, "fp32", seed=1), matmul=sdc.corrupting_matmul(bit=bit, seed=5))
    # bit 31 (sign) of an exact zero gives -0.0, which equals 0.0: the seed picks a nonzero.
    assert v.status == "confirmed", v.detail


def test_corruption_on_first_call_only_is_transient_not_confirmed() -> None:
    v = sdc.exact_gemm_probe(SMALL, matmul=sdc.corrupting_matmul(times=1))
    assert v.status == "transient"
    assert v.mismatched_elements == 1
    assert v.evidence["rerun_mismatched_elements"] == 0
    assert "transient" in v.detail


def test_probe_restores_tf32_and_reduced_precision_flags() -> None:
    m = torch.backends.cuda.matmul
    before = (m.allow_tf32, m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction)
    seen = []

    def spy(a, b):
        seen.append((m.allow_tf32, m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction))
        return torch.matmul(a, b)

    m.allow_tf32 = True
    try:
        sdc.exact_gemm_probe(SMALL, matmul=spy)
        assert seen == [(False, False, False)]
        assert m.allow_tf32 is True
    finally:
        m.allow_tf32 = before[0]
    assert (m.allow_tf32, m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction) == before


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
    assert sdc.digest_probe(spec, previous=prev, matmul=sdc.corrupting_matmul()).status == "confirmed"
    assert sdc.digest_probe(spec, previous=prev, matmul=sdc.corrupting_matmul(times=1)).status == "transient"


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
    return sdc.exact_gemm_probe(SMALL, matmul=sdc.corrupting_matmul() if status == "confirmed" else None)


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
        "sdc-empty.json", "sdc-nostatus.json", "sdc-other.json", "sdc-truncated.json"]


def test_read_spool_of_missing_dir_is_empty(tmp_path) -> None:
    assert sdc.read_spool(tmp_path / "nope") == []


def test_default_spool_dir_follows_state_dir(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("NODE_AGENT_STATE_DIR", str(tmp_path))
    assert sdc.default_spool_dir() == tmp_path / "spool" / "sdc"
    monkeypatch.delenv("NODE_AGENT_STATE_DIR")
    assert str(sdc.default_spool_dir()) == "/var/lib/node-agent/spool/sdc"


# -- SdcProbe -------------------------------------------------------------------------------


def _timed_matmul(clock: FakeClock, cost_s: float, inner=None):
    """A matmul that 'takes' cost_s seconds of the fake clock."""
    mm = inner or torch.matmul

    def matmul(a, b):
        clock.advance(cost_s)
        return mm(a, b)

    return matmul


def test_sdc_probe_step_respects_the_budget_with_an_injected_clock(tmp_path) -> None:
    clock = FakeClock()
    probe = SdcProbe(
        "cpu", budget_fraction=0.001, spool_dir=tmp_path, shapes=[(16, 16, 16)],
        clock=clock, matmul=_timed_matmul(clock, 0.01),
    )
    ran = 0
    for _ in range(100_000):  # 100 ms steps: 10,000 s of training
        clock.advance(0.1)
        if probe.step() is not None:
            ran += 1
        if ran > 1:
            assert probe.overhead() <= 0.001 + 1e-12
    # 10 ms probes at 0.1 % of 10,000 s = 10 s of probe time: about 1,000 probes.
    assert 900 <= ran <= 1001, ran
    assert 0.0009 <= probe.overhead() <= 0.001
    assert {v.status for v in probe.verdicts} == {"pass"}
    assert list(tmp_path.iterdir()) == []  # passes are not spooled by default


def test_sdc_probe_first_step_runs_a_probe_then_waits(tmp_path) -> None:
    clock = FakeClock()
    probe = SdcProbe("cpu", spool_dir=tmp_path, shapes=[(16, 16, 16)], clock=clock, matmul=_timed_matmul(clock, 0.5))
    clock.advance(0.1)
    assert probe.step() is not None
    clock.advance(100)  # 0.5 s spent; the budget allows the next after 500 s (+ its own cost)
    assert probe.step() is None
    clock.advance(1000)
    assert probe.step() is not None


def test_sdc_probe_confirmed_fault_is_spooled(tmp_path) -> None:
    clock = FakeClock()
    probe = SdcProbe("cpu", spool_dir=tmp_path, shapes=[(16, 16, 16)], clock=clock,
                     matmul=sdc.corrupting_matmul(), digests=False)
    clock.advance(1)
    v = probe.step()
    assert v is not None and v.status == "confirmed" and v.probe == "exact_gemm"
    (spooled,) = sdc.read_spool(tmp_path)
    assert spooled.status == "confirmed" and spooled.shape == (16, 16, 16)


def test_sdc_probe_digest_drift_on_same_device_is_confirmed(tmp_path) -> None:
    clock = FakeClock()
    state = {"mm": torch.matmul}
    probe = SdcProbe("cpu", spool_dir=tmp_path, shapes=[(16, 16, 16)], clock=clock,
                     matmul=lambda a, b: state["mm"](a, b), budget_fraction=0.5)
    seen = []
    for _ in range(12):  # 3 exact + 3 digest probes (fp32, bf16, fp16), twice
        clock.advance(10)
        seen.append(probe.step())
    assert all(v is not None and v.status == "pass" for v in seen)
    state["mm"] = sdc.corrupting_matmul(bit=0)
    statuses = []
    for _ in range(6):
        clock.advance(10)
        v = probe.step()
        statuses.append((v.probe, v.status))
    assert statuses.count(("digest_gemm", "confirmed")) == 3
    assert statuses.count(("exact_gemm", "confirmed")) == 3


def test_sdc_probe_step_never_raises_when_the_probe_throws(tmp_path, caplog) -> None:
    clock = FakeClock()

    def broken(a, b):
        raise RuntimeError("boom")

    probe = SdcProbe("cpu", spool_dir=tmp_path, clock=clock, matmul=broken)
    with caplog.at_level(logging.ERROR, logger="node_agent.sdc.probes"):
        clock.advance(1)
        v = probe.step()
        assert v is not None and v.status == "error" and "boom" in v.detail
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
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    new = [m for m in out.stdout.split() if m]
    assert "node_agent.sdc.probes" in new
    foreign = [
        m for m in new
        if m not in ("node_agent", "node_agent.sdc", "node_agent.sdc.probes", "node_agent.sdc.spool")
        and m.split(".")[0] not in sys.stdlib_module_names
        and not m.startswith("torch")
    ]
    assert foreign == [], f"node_agent.sdc pulled in {foreign}"
    for banned in ("pynvml", "yaml", "jsonschema", "psutil"):
        assert banned not in new
