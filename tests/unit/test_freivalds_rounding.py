"""``freivalds_check`` never accuses a correct product, and still sees an exponent-bit flip.

The field case: on an H100, ``freivalds_check`` flagged 512 rows of a *correct* bf16 product of
integer inputs, because exact mode took integer inputs as proof that C was exact while C had
been rounded to bf16. Here every product is made as a GPU makes it (fp32 accumulation, the
result rounded once into C's dtype; TF32 rounds the fp32 inputs first), on the CPU: products
of integer bf16, fp16 and TF32-rounded inputs, random full-mantissa ones, and one summed by a
stand-in for a tensor core's truncating multi-operand adder. No GPU runs here; a GPU's
products are inside the same bound by construction (the bound's derivation is in
``freivalds_check``'s docstring and docs/sdc.md).

Sizes: small ones, and 4096, the largest of the burn's shapes (the burn runs 8192) that a CPU
multiplies and checks in a few seconds.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from node_agent.sdc import exact  # noqa: E402
from node_agent.sdc.exact import ProbeSpec  # noqa: E402
from node_agent.sdc.reference import freivalds_check  # noqa: E402

BURN_SIZE_ON_CPU = 4096
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
_EXPONENT_BITS = {
    torch.float32: range(23, 31),
    torch.bfloat16: range(7, 15),
    torch.float16: range(10, 15),
}


def gpu_product(a: torch.Tensor, b: torch.Tensor, out: torch.dtype) -> torch.Tensor:
    """A·B as a GPU GEMM writes it: fp32 accumulation, rounded once to ``out``."""
    return (a.float() @ b.float()).to(out)


def tf32_round(t: torch.Tensor, truncate: bool) -> torch.Tensor:
    """fp32 to TF32's 10 stored mantissa bits: truncated (what a kernel that feeds raw fp32
    to the tensor core gets) or rounded to nearest (``cvt.rna.tf32.f32``)."""
    bits = t.contiguous().view(torch.int32)
    if not truncate:
        bits = bits + (1 << 12)  # half of the 13 dropped bits: round half away from zero
    return (bits & ~((1 << 13) - 1)).view(torch.float32)


def flip_exponent_bit(c: torch.Tensor, i: int, j: int) -> torch.Tensor:
    """C with one exponent bit of element (i, j) flipped: the highest exponent bit that is 0,
    so the element grows (by 2^(2^b), or to inf) rather than shrinking towards 0."""
    view = _INT_VIEW[c.dtype]
    bad = c.clone()
    word = int(bad.view(view)[i, j])
    bit = next(b for b in reversed(_EXPONENT_BITS[c.dtype]) if not (word >> b) & 1)
    flipped = word ^ (1 << bit)
    width = torch.iinfo(view).bits
    if flipped >= 1 << (width - 1):
        flipped -= 1 << width
    bad.view(view)[i, j] = flipped
    assert bad[i, j] != c[i, j]
    return bad


def integer_inputs(m: int, k: int, n: int, dtype: str, seed: int = 0):
    """The exact probe's integer inputs (full-significand integers of the dtype's width)."""
    return exact._inputs_cpu(ProbeSpec(m, k, n, dtype, seed=seed))


def random_inputs(m: int, k: int, n: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g).to(dtype), torch.randn(k, n, generator=g).to(dtype))


# -- the field case ------------------------------------------------------------------------------


def test_the_h100s_correct_bf16_product_of_integers_flags_no_row():
    """The GPU test that flagged 512 rows: 512x256x512 bf16 integers, C = A @ B in bf16."""
    a, b = integer_inputs(512, 256, 512, "bf16")
    c = gpu_product(a, b, torch.bfloat16)
    assert c.float().abs().max() > 256  # so bf16 had to round it: exact mode cannot apply
    assert freivalds_check(a, b, c) == 0
    assert freivalds_check(a, b, flip_exponent_bit(c, 100, 200)) >= 1


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(64, 128, 48), (512, 256, 512)])
def test_a_correct_rounded_product_of_integers_flags_no_row_and_a_flip_is_caught(dtype, shape):
    a, b = integer_inputs(*shape, dtype)
    out = exact.NUMERICS[dtype].out_dtype
    c = gpu_product(a, b, out)
    assert freivalds_check(a, b, c) == 0
    assert freivalds_check(a, b, flip_exponent_bit(c, shape[0] // 2, shape[2] - 1)) >= 1


@pytest.mark.parametrize("truncate", [True, False])
@pytest.mark.parametrize("inputs", ["integers over 11 bits", "full mantissa"])
def test_a_tf32_product_flags_no_row_and_a_flip_is_caught(truncate, inputs):
    """TF32 inputs: fp32 storage, the kernel keeps 10 mantissa bits of each input."""
    g = torch.Generator().manual_seed(3)
    if inputs == "full mantissa":
        a, b = torch.randn(256, 384, generator=g), torch.randn(384, 320, generator=g)
    else:  # integers TF32 cannot hold exactly: exact mode must not be taken
        a = torch.randint(-4095, 4096, (256, 384), generator=g).float()
        b = torch.randint(-4095, 4096, (384, 320), generator=g).float()
    c = tf32_round(a, truncate) @ tf32_round(b, truncate)
    assert freivalds_check(a, b, c, tf32=True) == 0
    assert freivalds_check(a, b, flip_exponent_bit(c, 7, 300), tf32=True) >= 1


def test_without_tf32_the_rounded_inputs_product_is_caught_when_the_error_is_beyond_fp32():
    """The TF32 allowance is what lets that product pass: without ``tf32`` the input
    rounding (about 2^-11 relative) is far beyond fp32's bound and the rows disagree."""
    a, b = random_inputs(128, 256, 128, torch.float32, seed=4)
    c = tf32_round(a, True) @ tf32_round(b, True)
    assert freivalds_check(a, b, c, tf32=True) == 0
    assert freivalds_check(a, b, c) > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("seed", range(3))
def test_a_correct_full_mantissa_product_flags_no_row_and_a_flip_is_caught(dtype, seed):
    a, b = random_inputs(200, 300, 150, dtype, seed)
    c = gpu_product(a, b, dtype)
    assert freivalds_check(a, b, c, rounds=4, seed=seed) == 0
    assert freivalds_check(a, b, flip_exponent_bit(c, 17, 5)) == 1


def truncating_tensor_core(
    a: torch.Tensor, b: torch.Tensor, out: torch.dtype, step: int = 8
) -> torch.Tensor:
    """A stand-in for a tensor core's accumulation: ``step`` products at a time added to the
    fp32 accumulator, each sum truncated toward zero (Fasi, Higham, Mikaitis, Pranesh 2021:
    biased, unlike round-to-nearest), then rounded once into ``out``."""
    a64, b64 = a.double(), b.double()
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32)
    for k0 in range(0, a.shape[1], step):
        exact_sum = acc.double() + a64[:, k0 : k0 + step] @ b64[k0 : k0 + step]
        rounded = exact_sum.float()
        away = rounded.double().abs() > exact_sum.abs()
        acc = torch.where(away, torch.nextafter(rounded, torch.zeros_like(rounded)), rounded)
    return acc.to(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_truncating_accumulator_is_inside_the_bound(dtype):
    a, b = random_inputs(128, 2048, 96, torch.bfloat16, seed=5)
    c = truncating_tensor_core(a, b, dtype)
    assert (c.double() - a.double() @ b.double()).abs().max() > 0  # it does round
    assert freivalds_check(a, b, c) == 0
    assert freivalds_check(a, b, flip_exponent_bit(c, 64, 3)) >= 1


# -- exact mode where C is exact ---------------------------------------------------------------


def test_exact_mode_still_catches_a_low_mantissa_bit_when_c_holds_every_value():
    """fp32 C of 8-bit integers with K = 128: every partial sum < 2^24, so C is exact and any
    change, even the lowest mantissa bit, is caught."""
    a, b, _ = exact.golden(ProbeSpec(64, 128, 48, "fp32", seed=8))
    af, bf = a.float(), b.float()
    c = af @ bf
    assert freivalds_check(af, bf, c) == 0
    bad = c.clone()
    bad.view(torch.int32)[10, 10] ^= 1
    assert freivalds_check(af, bf, bad) == 1


def test_integers_whose_sums_outgrow_fp32_take_the_float_mode():
    g = torch.Generator().manual_seed(6)
    a = torch.randint(-2047, 2048, (96, 512), generator=g).float()
    b = torch.randint(-2047, 2048, (512, 64), generator=g).float()
    c = a @ b  # |partial sums| up to 2^31: fp32 rounds them
    assert c.abs().max() > 2**24
    assert freivalds_check(a, b, c) == 0


def test_blocks_must_be_positive():
    a, b = random_inputs(8, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="blocks must be >= 1"):
        freivalds_check(a, b, a @ b, blocks=0)


# -- the burn's size ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bf16 integers", "fp16 random", "tf32 random"])
def test_burn_sized_correct_product_flags_no_row_and_a_flip_is_caught(kind):
    n = BURN_SIZE_ON_CPU
    tf32 = kind.startswith("tf32")
    if kind == "bf16 integers":  # 8-bit integers, exact in bf16; C's sums are not
        g = torch.Generator().manual_seed(1)
        a = torch.randint(-255, 256, (n, n), generator=g).to(torch.bfloat16)
        b = torch.randint(-255, 256, (n, n), generator=g).to(torch.bfloat16)
        c = gpu_product(a, b, torch.bfloat16)
    elif kind == "fp16 random":
        a, b = random_inputs(n, n, n, torch.float16, seed=2)
        c = gpu_product(a, b, torch.float16)
    else:
        a, b = random_inputs(n, n, n, torch.float32, seed=3)
        c = tf32_round(a, True) @ tf32_round(b, True)
    assert freivalds_check(a, b, c, tf32=tf32, rounds=1) == 0
    assert freivalds_check(a, b, flip_exponent_bit(c, n - 1, n // 3), tf32=tf32, rounds=1) >= 1
