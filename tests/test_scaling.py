"""Block-scaled quantization (ttrace_num.scaling): recipes, error bounds, MX against an
independent per-block loop, power-of-two scales, delayed-amax saturation, _scaled_mm."""
from __future__ import annotations

import dataclasses
import functools
import math

import ml_dtypes
import numpy as np
import pytest
import torch

from ttrace_num.formats import get_format
from ttrace_num.rounding import round_to
from ttrace_num.scaling import (
    Quantized,
    ScalingRecipe,
    fake_quant,
    get_recipe,
    mx,
    per_row,
    per_tensor,
    quantize,
    scales_from_amax,
    tile_1x128,
    tile_128x128,
)

ELEM = ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1"]
RECIPES = ["tensor", "row", "1x128", "128x128", "mx32", ScalingRecipe.per_tensor(power_of_two=True),
           ScalingRecipe.tile_128x128(power_of_two=True), ScalingRecipe.per_row(margin=1)]


@functools.cache
def _data_cached(shape, seed):
    return _make_data(shape, seed)


def _data(shape=(256, 384), seed=0) -> torch.Tensor:
    return _data_cached(tuple(shape), seed).clone()


def _make_data(shape, seed) -> torch.Tensor:
    """float32 data whose magnitude varies by row and by 128-column tile (so recipes differ),
    with heavy tails, exact zeros and values deep in every format's subnormal range."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    row_mag = torch.exp2(torch.randint(-20, 20, (shape[0], 1), generator=g)).to(torch.float64)
    col_mag = torch.exp2(torch.randint(-6, 6, (1, shape[1] // 32), generator=g)).repeat_interleave(32, 1)
    x = x * row_mag * col_mag.to(torch.float64) * torch.exp(2 * torch.randn(shape, generator=g, dtype=torch.float64))
    x[torch.rand(shape, generator=g) < 0.01] = 0.0
    return x.to(torch.float32)


# ------------------------------------------------------------------------ recipes
def test_constructors_and_names():
    assert per_tensor() == ScalingRecipe("tensor") and per_tensor().name == "tensor"
    assert per_row().name == "row"
    assert tile_1x128() == ScalingRecipe("tile", tile=(1, 128)) and tile_1x128().name == "1x128"
    assert tile_128x128().name == "128x128"
    m = mx()
    assert m.name == "mx32" and m.block == 32 and m.scale_fmt == get_format("e8m0") and m.power_of_two
    assert mx(block=16).name == "mx16"
    assert str(per_tensor(power_of_two=True, margin=2)) == "tensor[pow2][margin=2]"
    assert per_tensor().scale_format == get_format("fp32")
    r = ScalingRecipe.per_tensor(scale_fmt="bf16")
    assert r.scale_fmt == get_format("bf16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        per_tensor().margin = 3  # type: ignore[misc]
    assert len({per_tensor(), per_tensor(), per_row()}) == 2


@pytest.mark.parametrize("spec,expect", [
    ("tensor", per_tensor()), ("per_tensor", per_tensor()), ("row", per_row()), ("rowwise", per_row()),
    ("1x128", tile_1x128()), ("128x128", tile_128x128()), ("64x32", ScalingRecipe("tile", tile=(64, 32))),
    ("mx32", mx()), ("MX", mx()), ("mx16", mx(16)), ("mxfp32", mx()), (" 128X128 ", tile_128x128()),
])
def test_parse(spec, expect):
    assert get_recipe(spec) == expect
    assert ScalingRecipe.parse(spec) == expect
    assert get_recipe(expect) is expect


@pytest.mark.parametrize("kw,match", [
    (dict(granularity="block"), "unknown scaling granularity"),
    (dict(granularity="tile"), "tile=\\(rows, cols\\)"),
    (dict(granularity="tile", tile=(0, 128)), "tile=\\(rows, cols\\)"),
    (dict(granularity="row", tile=(1, 128)), "only meaningful"),
    (dict(granularity="mx", block=0), "block"),
    (dict(granularity="mx", scale_fmt=get_format("bf16")), "E8M0"),
    (dict(granularity="tensor", scale_fmt=get_format("e8m0")), "power_of_two=True"),
    (dict(granularity="tensor", margin=1.5), "margin"),
])
def test_bad_recipes_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        ScalingRecipe(**kw)


@pytest.mark.parametrize("spec", ["tile", "mx-32x", "1x", "block32", ""])
def test_unknown_recipe_string(spec):
    with pytest.raises(ValueError, match="unknown scaling recipe"):
        get_recipe(spec)


@pytest.mark.parametrize("shape,recipe,scale_shape", [
    ((256, 384), "tensor", ()), ((256, 384), "row", (256, 1)), ((256, 384), "1x128", (256, 3)),
    ((256, 384), "128x128", (2, 3)), ((256, 384), "mx32", (256, 12)), ((2, 3, 64), "mx32", (2, 3, 2)),
    ((4, 256, 128), "128x128", (4, 2, 1)), ((384,), "1x128", (3,)), ((384,), "row", (1,)), ((), "tensor", ()),
])
def test_scale_shapes(shape, recipe, scale_shape):
    x = torch.randn(shape)
    q = quantize(x, "e4m3", recipe)
    assert tuple(q.scale.shape) == scale_shape
    assert q.values.shape == x.shape and q.values.dtype == torch.float64
    assert q.dequantize().shape == x.shape
    assert q.expand(q.scale).shape == x.shape


@pytest.mark.parametrize("shape,recipe,match", [
    ((4, 100), "mx32", r"\(4, 100\).*mx32"),
    ((100, 128), "128x128", r"\(100, 128\).*128x128.*second-to-last dim 100"),
    ((128, 130), "1x128", r"\(128, 130\).*1x128.*last dim 130 % 128"),
    ((128,), "128x128", r"at least two dims.*\(128,\)"),
    ((), "row", "at least one dim"),
])
def test_indivisible_shapes_raise(shape, recipe, match):
    with pytest.raises(ValueError, match=match):
        quantize(torch.randn(shape), "e4m3", recipe)


# ------------------------------------------------------------------------ error bound
@pytest.mark.parametrize("recipe", RECIPES, ids=str)
@pytest.mark.parametrize("fmt_name", ELEM)
def test_dequantize_error_bound(fmt_name, recipe):
    """|x' - x| <= u |x| + scale_inv * subnormal_abs_error for every non-saturated element,
    and the bound is nearly attained (it is not vacuous)."""
    fmt = get_format(fmt_name)
    x = _data().to(torch.float64)
    q = quantize(x, fmt, recipe)
    err = (q.dequantize() - x).abs()
    bound = fmt.u * x.abs() + q.expand(q.scale_inv) * fmt.subnormal_abs_error
    ok = ~q.saturated
    # MX saturates the top of a block by design (amax / X can exceed max); TE scaling does not
    assert ok.float().mean() > 0.95
    assert bool((err[ok] <= bound[ok]).all())
    assert float((err[ok] / bound[ok]).max()) > 0.5
    # the values are on the grid, saturated ones at +-max
    assert torch.equal(round_to(q.values, fmt), q.values)
    assert bool((q.values.abs() <= fmt.max).all())
    assert torch.equal(q.values[q.saturated].abs(), torch.full_like(q.values[q.saturated], fmt.max))
    if get_recipe(recipe).granularity != "mx":
        # current scaling: amax * s <= max up to the float32 rounding of s: nothing saturates
        y = (x * q.expand(q.scale)).abs()
        assert float(y.max()) <= fmt.max * (1 + 2.0**-23)
        assert not bool(q.saturated.any())
    else:
        # MX: exactly the elements whose scaled magnitude rounds beyond max are saturated
        y = (x / q.expand(q.scale_inv)).abs()
        assert torch.equal(q.saturated, torch.isnan(round_to(y, fmt, overflow="nan")))
        assert bool((y[q.saturated] > fmt.max).all())
    # negative control: a bound with half the unit roundoff is violated
    tight = fmt.u / 2 * x.abs() + q.expand(q.scale_inv) * fmt.subnormal_abs_error / 2
    assert bool((err[ok] > tight[ok]).any())


def test_finer_granularity_is_more_accurate_on_varied_data():
    """Magnitudes vary by 2**40 across rows: one tensor scale flushes most small rows to zero,
    finer blocks keep them (mean relative error over the nonzero elements)."""
    x = _data().to(torch.float64)
    nz = x != 0
    flushed, rel = {}, {}
    for r in ("tensor", "row", "1x128", "mx32"):
        d = fake_quant(x, "e4m3", r)
        flushed[r] = float(((d == 0) & nz).double().mean() / nz.double().mean())
        rel[r] = float(((d - x).abs() / x.abs())[nz].mean())
    assert flushed["tensor"] > 0.5 and flushed["row"] < 0.2 and flushed["mx32"] < 0.01
    assert rel["tensor"] > rel["row"] > rel["1x128"] > rel["mx32"]


# ------------------------------------------------------------------------ MX vs a loop reference
def _mx_reference(x: np.ndarray, fmt_name: str, k: int):
    """Straightforward per-block loop of OCP MX v1.0 section 6.3, using ml_dtypes for the
    element rounding (clip to +-max first = saturation). Returns (elements, X per block)."""
    fmt = get_format(fmt_name)
    dt = getattr(ml_dtypes, fmt.ml_dtypes_name)
    rows, n = x.shape
    elems = np.empty((rows, n), dtype=np.float64)
    xs = np.empty((rows, n // k), dtype=np.float64)
    for i in range(rows):
        for b in range(n // k):
            v = [float(t) for t in x[i, b * k:(b + 1) * k]]
            amax = max(abs(t) for t in v) if not any(math.isnan(t) for t in v) else math.nan
            if math.isnan(amax) or math.isinf(amax):
                e = math.nan
            elif amax == 0:
                e = -127
            else:
                e = max(math.frexp(amax)[1] - 1 - fmt.emax, -127)
                if e > 127:
                    e = math.nan
            xs[i, b] = e
            for j, t in enumerate(v):
                if math.isnan(e):
                    elems[i, b * k + j] = math.nan
                else:
                    p = min(max(t / 2.0**e, -fmt.max), fmt.max)
                    elems[i, b * k + j] = float(np.array([p], dtype=np.float64).astype(dt).astype(np.float64)[0])
    return elems, xs


def _mx_data() -> torch.Tensor:
    x = _data((12, 256), seed=3)
    x[0, :32] = 0.0  # all-zero block
    x[1, :32] = torch.exp2(torch.arange(-16, 16, dtype=torch.float32))  # exact powers of two
    x[2, :32] = torch.full((32,), 2.0**-140)  # float32 subnormals: shared exponent clamps at -127
    x[2, 32:64] = 1e38  # near float32 max
    x[3, 5] = math.inf  # Inf -> NaN scale
    x[3, 40] = math.nan  # NaN -> NaN scale
    x[4, :32] = torch.linspace(-448, 448, 32)  # amax exactly on a binade of e4m3
    x[4, 32:64] = torch.linspace(-500, 511, 32)  # saturating elements
    # exact element ties: amax 256 (X = 2**0 for e4m3) and odd multiples of half an ulp
    x[5, :32] = torch.tensor([256.0] + [1.0 + (2 * i + 1) / 16 for i in range(31)], dtype=torch.float32)
    return x


@pytest.mark.parametrize("fmt_name", ELEM)
def test_mx_matches_loop_reference_bit_exactly(fmt_name):
    x = _mx_data()
    q = quantize(x, fmt_name, "mx32")
    elems, xs = _mx_reference(x.numpy(), fmt_name, 32)
    got_e = q.values.numpy()
    same = (got_e == elems) & (np.signbit(got_e) == np.signbit(elems)) | (np.isnan(got_e) & np.isnan(elems))
    assert same.all(), np.argwhere(~same)[:5]
    se = q.shared_exponent.numpy()
    assert np.array_equal(se, xs, equal_nan=True)
    assert np.array_equal(q.scale_inv.numpy(), np.exp2(xs), equal_nan=True)
    deq = q.dequantize().numpy()
    assert np.array_equal(deq, elems * np.repeat(np.exp2(xs), 32, axis=1), equal_nan=True)
    # the special blocks did what the spec says
    assert xs[0, 0] == -127 and (got_e[0, :32] == 0).all()
    assert xs[2, 0] == -127
    assert np.isnan(xs[3, 0]) and np.isnan(xs[3, 1]) and np.isnan(deq[3, :64]).all()
    assert not np.isnan(deq[3, 64:]).any()


def test_mx_reference_negative_controls():
    """The loop comparison can fail: a wrong emax or ties-away element rounding is caught."""
    x = _mx_data()
    elems, xs = _mx_reference(x.numpy(), "e4m3", 32)
    wrong_emax, _ = _mx_reference(x.numpy(), "e5m2", 32)  # different emax and grid
    assert not np.array_equal(wrong_emax, elems, equal_nan=True)
    q = quantize(x, "e4m3", "mx32")
    assert not np.array_equal(quantize(x, "e4m3", mx(block=16)).values.numpy(), elems, equal_nan=True)
    # ties-away rounding of the element (microxcaling's default "nearest") differs on row 5
    v = x[5, :32].double() / 2.0**xs[5, 0]
    away = torch.sign(v) * torch.floor(v.abs() * 8 + 0.5) / 8  # e4m3 spacing in [1, 2) is 1/8
    assert not torch.equal(away[1:], q.values[5, 1:32])


def test_mx_fp4_hand_example():
    """A block of 32 with amax 7.5: shared_exp = floor(log2 7.5) - 2 = 0; e2m1 grid
    0, .5, 1, 1.5, 2, 3, 4, 6: 7.5 saturates to 6, 2.5 ties to 2 (even), 0.25 ties to 0."""
    x = torch.zeros(32, dtype=torch.float64)
    x[:7] = torch.tensor([7.5, 2.5, 0.25, -3.5, 0.75, 5.0, 6.5])
    q = quantize(x, "e2m1", "mx32")
    assert q.shared_exponent.tolist() == [0.0]
    assert q.values[:7].tolist() == [6.0, 2.0, 0.0, -4.0, 1.0, 4.0, 6.0]
    # 7.5 would round to 8 (beyond max): clamped; 6.5 rounds to 6 by itself
    assert q.saturated[:7].tolist() == [True, False, False, False, False, False, False]
    q2 = quantize(x * 2.0**-20, "e2m1", "mx32")
    assert q2.shared_exponent.tolist() == [-20.0] and torch.equal(q2.values, q.values)


# ------------------------------------------------------------------------ tile reference
@pytest.mark.parametrize("recipe,tile", [("1x128", (1, 128)), ("128x128", (128, 128)), ("row", (1, 384))])
def test_tile_scales_match_loop_reference(recipe, tile):
    """TE current scaling per tile: s = fp32(448 / amax_tile), dequant with fp32(1 / s)."""
    x = _data(seed=4)
    q = quantize(x, "e4m3", recipe)
    a, b = tile
    xn = x.numpy()
    s_full = q.expand(q.scale).numpy()
    sinv_full = q.expand(q.scale_inv).numpy()
    for i in range(0, xn.shape[0], a):
        for j in range(0, xn.shape[1], b):
            amax = np.abs(xn[i:i + a, j:j + b]).max()
            s = np.float32(448.0) / np.float32(amax) if amax > 0 else np.float32(1.0)
            assert (s_full[i:i + a, j:j + b] == np.float64(s)).all()
            sinv = np.float32(1.0) / s
            assert (sinv_full[i:i + a, j:j + b] == np.float64(sinv)).all()
    ref_vals = np.clip(xn.astype(np.float64) * s_full, -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    assert np.array_equal(q.values.numpy(), ref_vals.astype(np.float64))


# ------------------------------------------------------------------------ scales
@pytest.mark.parametrize("recipe", [per_tensor(power_of_two=True), per_row(power_of_two=True),
                                    tile_128x128(power_of_two=True), tile_1x128(power_of_two=True),
                                    per_tensor(power_of_two=True, scale_fmt="e8m0"), mx()], ids=str)
def test_power_of_two_scales_are_exact(recipe):
    x = _data(seed=5).to(torch.float64)
    q = quantize(x, "e4m3", recipe)
    s = q.scale
    mant, _ = torch.frexp(s)
    assert bool((mant == 0.5).all())  # exact powers of two
    assert torch.equal(s * q.scale_inv, torch.ones_like(s))
    assert torch.equal(q.dequantize(), q.values / q.expand(q.scale))  # q * s_inv == q / s exactly
    if recipe.granularity != "mx":
        assert not bool(q.saturated.any())  # rounded down: amax * s <= max
        assert bool((q.scale <= 448.0 / q.amax.clamp(min=1e-300)).all())


def test_non_power_of_two_scales_are_fp32_and_not_powers_of_two():
    """Negative control for the test above, and the TE convention: s and s_inv are fp32."""
    q = quantize(_data(seed=5), "e4m3", "row")
    mant, _ = torch.frexp(q.scale)
    assert bool((mant != 0.5).any())
    assert torch.equal(round_to(q.scale, "fp32"), q.scale)
    assert torch.equal(round_to(q.scale_inv, "fp32"), q.scale_inv)
    assert not torch.equal(q.dequantize(), q.values / q.expand(q.scale))  # s_inv = fp32(1/s) != 1/s
    rel = ((q.dequantize() - q.values / q.expand(q.scale)).abs() / (q.values / q.expand(q.scale)).abs())
    assert float(rel.nan_to_num(0.0).max()) <= 2.0**-24


def test_scale_formats_and_margin():
    x = _data(seed=6).to(torch.float64)
    q0 = quantize(x, "e4m3", per_tensor(power_of_two=True))
    q2 = quantize(x, "e4m3", per_tensor(power_of_two=True, margin=2))
    assert torch.equal(q2.scale, q0.scale / 4)
    assert float(q2.values.abs().max()) <= 448 / 4
    qb = quantize(x, "e4m3", per_tensor(scale_fmt="bf16"))
    assert torch.equal(round_to(qb.scale, "bf16"), qb.scale)
    assert torch.equal(round_to(qb.scale_inv, "bf16"), qb.scale_inv)
    qm = quantize(x, "e4m3", mx(margin=1))
    assert torch.equal(qm.shared_exponent, quantize(x, "e4m3", "mx32").shared_exponent + 1)


def test_zero_and_nonfinite_amax():
    z = torch.zeros(4, 64)
    q = quantize(z, "e4m3", "tensor")
    assert float(q.scale) == 1.0 and torch.equal(q.dequantize(), z.double())
    q = quantize(z, "e4m3", "row")
    assert torch.equal(q.scale, torch.ones(4, 1, dtype=torch.float64))
    # TE: a non-finite amax leaves the scale at 1; the Inf element saturates, NaN stays NaN
    x = torch.tensor([[1.0, math.inf, -2.0, 0.5]])
    q = quantize(x, "e4m3", "tensor")
    assert float(q.scale) == 1.0 and q.values.tolist() == [[1.0, 448.0, -2.0, 0.5]]
    q = quantize(torch.tensor([1.0, math.nan, 3.0]), "e4m3", "tensor")
    assert float(q.scale) == 1.0 and math.isnan(q.values[1]) and q.values[2] == 3.0
    s, sinv = scales_from_amax(torch.tensor([0.0, 448.0, 1.0, math.inf]), "e4m3", "tensor")
    assert s.tolist() == [1.0, 1.0, 448.0, 1.0] and sinv[2] == float(np.float32(1) / np.float32(448))


# ------------------------------------------------------------------------ delayed scaling
@pytest.mark.parametrize("recipe", ["tensor", "row", "128x128", "mx32"])
def test_delayed_amax_saturates_values_above_it(recipe):
    fmt = get_format("e4m3")
    x = _data(seed=7).to(torch.float64)
    measured = quantize(x, fmt, recipe).amax
    q = quantize(x, fmt, recipe, amax=measured / 2)  # history says half of what we see now
    a_full = q.expand(q.amax)
    above = x.abs() > a_full * (1 + 2.0**-20)
    assert bool(above.any())
    if get_recipe(recipe).granularity != "mx":
        # s = max / amax: everything above amax saturates to +-max, i.e. dequantizes to ~ +-amax
        assert torch.equal(q.values[above].abs(), torch.full_like(q.values[above], fmt.max))
        # beyond max * (1 + u) the rounding itself would overflow: flagged as saturated
        far = x.abs() > a_full * (1 + fmt.u)
        assert bool(far.any()) and bool(q.saturated[far].all()) and not bool(q.saturated[~above].any())
        deq = q.dequantize()
        rel = ((deq[above].abs() - a_full[above]) / a_full[above]).abs()
        assert float(rel.max()) <= 2.0**-22
    # elements below the delayed amax keep the round-off bound
    ok = ~q.saturated
    err = (q.dequantize() - x).abs()
    bound = fmt.u * x.abs() + q.expand(q.scale_inv) * fmt.subnormal_abs_error
    assert bool((err[ok] <= bound[ok]).all())


def test_delayed_amax_scalar_and_bad_shape():
    x = torch.linspace(-10, 10, 256).reshape(2, 128)
    q = quantize(x, "e4m3", "tensor", amax=5.0)
    assert float(q.scale) == float(np.float32(448) / np.float32(5))
    assert float(q.dequantize().abs().max()) == pytest.approx(5.0, rel=1e-6)
    q = quantize(x, "e4m3", "row", amax=torch.tensor([[4.0], [8.0]]))
    assert q.amax.tolist() == [[4.0], [8.0]]
    with pytest.raises(ValueError, match="does not broadcast"):
        quantize(x, "e4m3", "row", amax=torch.ones(3))


# ------------------------------------------------------------------------ torch._scaled_mm
def _identity_fp8(n: int) -> torch.Tensor:
    return torch.eye(n, dtype=torch.float32).to(torch.float8_e4m3fn).t()  # column-major as _scaled_mm wants


@pytest.mark.parametrize("pow2", [False, True])
def test_scaled_mm_per_tensor_dequant_equality(pow2):
    """torch._scaled_mm(q, I, scale_a=scale_inv) reproduces dequantize() (rounded to its fp32 output)."""
    x = _data((64, 128), seed=8)
    q = quantize(x, "e4m3", per_tensor(power_of_two=pow2))
    a = q.as_torch()
    assert torch.equal(a.double(), q.values)
    sa = q.scale_inv.to(torch.float32)
    assert float(sa) == float(q.scale_inv)  # exact fp32
    out = torch._scaled_mm(a, _identity_fp8(128), scale_a=sa, scale_b=torch.tensor(1.0), out_dtype=torch.float32)
    assert torch.equal(out.double(), round_to(q.dequantize(), "fp32"))


def test_scaled_mm_rowwise_dequant_equality_and_gemm():
    xa, xb = _data((64, 128), seed=9), _data((32, 128), seed=10)
    qa, qb = quantize(xa, "e4m3", "row"), quantize(xb, "e4m3", "row")
    sa, sb = qa.scale_inv.to(torch.float32), qb.scale_inv.to(torch.float32).t()
    assert sa.shape == (64, 1) and sb.shape == (1, 32)
    out = torch._scaled_mm(qa.as_torch(), _identity_fp8(128), scale_a=sa, scale_b=torch.ones(1, 128),
                           out_dtype=torch.float32)
    assert torch.equal(out.double(), round_to(qa.dequantize(), "fp32"))
    # the real GEMM equals the fp64 product of the dequantized operands up to fp32 accumulation
    gemm = torch._scaled_mm(qa.as_torch(), qb.as_torch().t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    exact = qa.dequantize() @ qb.dequantize().t()
    absprod = qa.dequantize().abs() @ qb.dequantize().abs().t()
    k = 128
    gamma = (k + 2) * 2.0**-24 / (1 - (k + 2) * 2.0**-24)
    assert bool(((gemm.double() - exact).abs() <= gamma * absprod).all())


# ------------------------------------------------------------------------ misc
def test_fake_quant_is_dequantized_quantize():
    x = _data(seed=11)
    for r in ("tensor", "row", "1x128", "mx32"):
        q = quantize(x, "e5m2", r)
        assert isinstance(q, Quantized)
        assert torch.equal(fake_quant(x, "e5m2", r), q.dequantize())
        assert fake_quant(x, "e5m2", r).dtype == torch.float64


def test_as_torch_and_shared_exponent_errors():
    q = quantize(torch.randn(4, 32), "e2m1", "mx32")
    with pytest.raises(ValueError, match="no torch dtype"):
        q.as_torch()
    assert q.as_torch(torch.float32).dtype == torch.float32
    with pytest.raises(ValueError, match="MX"):
        _ = quantize(torch.randn(4, 32), "e4m3", "row").shared_exponent


@pytest.mark.parametrize("recipe", [per_tensor(), per_tensor(power_of_two=True),
                                    per_tensor(power_of_two=True, scale_fmt="e8m0"), mx()], ids=str)
def test_amax_beyond_the_scale_range_gives_finite_scales(recipe):
    """float64 inputs far beyond float32's range: the scale clamps to the smallest positive
    value of its format (never 0, never NaN for finite data within E8M0's range)."""
    x = torch.tensor([1e40, -3e39, 1.0, 0.0] * 8, dtype=torch.float64)
    q = quantize(x, "e4m3", recipe)
    assert bool(torch.isfinite(q.scale).all()) and bool((q.scale > 0).all())
    assert bool(torch.isfinite(q.values).all())
    assert bool((q.values.abs() <= 448).all())
