"""The summation core (ttrace_num.bounds.summation) and its emulator (ttrace_num.emulate.summation).

The emulator is checked first against independent implementations (numpy float32 /
float16 and ml_dtypes bfloat16 loops, whose arithmetic is IEEE), then the bounds are
checked against the emulator and the exact reference.
"""
import math

import ml_dtypes
import numpy as np
import pytest
import torch
from scipy.stats import binomtest

from ttrace_num.bounds.base import lambda_for
from ttrace_num.bounds.summation import (Summation, conversion_exact, difference_depths, sum_difference_bound,
                                         sum_error_bound, tree_height, unshared_depths)
from ttrace_num.emulate import emulate_matmul, emulate_mean, emulate_sum, emulate_terms
from ttrace_num.emulate.summation import _add, _convert
from ttrace_num.formats import get_format
from ttrace_num.reference.dot import exact_sum
from ttrace_num.rounding import round_to

FP64, FP32, BF16, FP16 = (get_format(n) for n in ("fp64", "fp32", "bf16", "fp16"))
NP = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ python references
def _np_chain(row, dt):
    acc = dt(row[0])
    for v in row[1:]:
        acc = dt(acc + dt(v))
    return float(acc)


def _np_pairwise(row, dt):
    t = [dt(v) for v in row]
    while len(t) > 1:
        nxt = [dt(t[i] + t[i + 1]) for i in range(0, len(t) - 1, 2)]
        if len(t) % 2:
            nxt.append(t[-1])
        t = nxt
    return float(t[0])


def _np_blocked(row, dt, b):
    sums = [_np_chain(row[i:i + b], dt) for i in range(0, len(row), b)]
    return _np_chain(sums, dt)


def _np_split(row, dt_acc, dt_red, k):
    ps = math.ceil(len(row) / k)
    partials = [dt_red(_np_chain(row[i:i + ps], dt_acc)) for i in range(0, len(row), ps)]
    return _np_chain(partials, dt_red)


def _rows(fmt, m=6, n=37, seed=0):
    """Rows on fmt's grid with mixed magnitudes (so that roundings happen)."""
    g = _gen(seed)
    x = torch.randn(m, n, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-6, 7, (m, n), generator=g)).double()
    return round_to(x, fmt)


# ------------------------------------------------------------------ emulator arithmetic
@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16"])
def test_native_rounded_add_equals_round_to(name):
    fmt = get_format(name)
    g = _gen(1)
    n = 20000
    e = torch.randint(fmt.emin - fmt.mantissa_bits - 2, fmt.emax + 1, (2, n), generator=g).double()
    x = round_to(torch.randn(2, n, generator=g, dtype=torch.float64) * torch.exp2(e), fmt)
    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    a, b = x[0], x[1]
    # exact ties: b = half an ulp of a
    b[:2000] = torch.ldexp(torch.ones(2000, dtype=torch.float64), torch.frexp(a[:2000])[1] - 1 - fmt.precision) * 3
    b[:2000] = round_to(b[:2000], fmt)
    # near the largest value: max + k half-ulps (ties to even overflow)
    half_ulp_max = 2.0 ** (fmt.emax - fmt.precision)
    a[-300:] = fmt.max
    b[-300:] = round_to(torch.arange(300, dtype=torch.float64) % 4 * half_ulp_max, fmt)
    got = _add(_convert(a, fmt), _convert(b, fmt), fmt).double()
    want = round_to(a + b, fmt)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    ok = torch.isnan(want) | (got == want)
    assert ok.all(), (a[~ok][:3], b[~ok][:3], got[~ok][:3], want[~ok][:3])
    # the sample covers subnormal results and overflow
    assert (want.abs() < fmt.min_normal).any() and torch.isinf(want).any()


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16"])
def test_emulated_orders_equal_numpy_loops_bit_for_bit(name):
    fmt = get_format(name)
    dt = NP[name]
    x = _rows(fmt)
    cases = {
        Summation(accum=fmt): lambda r: _np_chain(r, dt),
        Summation(accum=fmt, algorithm="pairwise"): lambda r: _np_pairwise(r, dt),
        Summation(accum=fmt, algorithm="blocked", block=5): lambda r: _np_blocked(r, dt, 5),
        Summation(accum=fmt, split=4, reduce_fmt="fp16"): lambda r: _np_split(r, dt, np.float16, 4),
    }
    for summ, ref in cases.items():
        got = emulate_sum(x, -1, summ, "fp64")
        want = torch.tensor([ref(r) for r in x.numpy()], dtype=torch.float64)
        assert torch.equal(got, want), summ.describe()


def test_emulated_recursive_fp32_sum_of_torch_float32_rows():
    x = torch.randn(64, 300, generator=_gen(2)).float()
    got = emulate_sum(x, 1, Summation(), "fp32")
    want = [_np_chain(r, np.float32) for r in x.numpy()]
    assert torch.equal(got, torch.tensor(want, dtype=torch.float64))


def test_products_are_rounded_to_accum_and_fp64_accumulation_is_near_exact():
    g = _gen(3)
    a = torch.randn(5, 200, generator=g).float()
    b = torch.randn(200, 3, generator=g).float()
    prods = a.double()[:, None, :] * b.double().T[None, :, :]
    # fp32 accumulation: every product rounded to fp32, then a float32 chain
    got = emulate_matmul(a, b, Summation(), "fp32")
    want = torch.tensor([[_np_chain(np.float32(p), np.float32) for p in row] for row in prods.numpy()],
                        dtype=torch.float64)
    assert torch.equal(got, want)
    # fp64 accumulation of exact products: within n * 2**-53 * S of the exact value
    y = emulate_matmul(a, b, Summation(accum=FP64), "fp64")
    exact = exact_sum(prods, -1)
    s = prods.abs().sum(-1)
    assert ((y - exact).abs() <= 200 * 2.0 ** -53 * s).all()


def test_emulate_matmul_broadcasts_and_adds_the_bias_as_last_term():
    g = _gen(4)
    a = torch.randn(2, 1, 3, 40, generator=g).to(torch.bfloat16)
    b = torch.randn(4, 40, 5, generator=g).to(torch.bfloat16)
    bias = torch.randn(5, generator=g).to(torch.bfloat16)
    summ = Summation(accum=BF16, algorithm="blocked", block=8, split=2, reduce_fmt=FP32)
    y = emulate_matmul(a, b, summ, "bf16", bias=bias)
    assert y.shape == (2, 4, 3, 5)
    terms = torch.cat([(a.double()[..., :, None, :] * b.double().transpose(-1, -2)[..., None, :, :]).expand(2, 4, 3, 5, 40),
                       bias.double().expand(2, 4, 3, 5)[..., None]], dim=-1)
    assert torch.equal(y, emulate_terms(terms, summ, "bf16"))


def test_emulate_mean_divides_once_in_the_final_format():
    x = torch.randn(7, 33, generator=_gen(5)).to(torch.bfloat16)
    got = emulate_mean(x, -1, Summation(), "bf16")
    s = emulate_sum(x, -1, Summation(), "fp32").float()
    assert torch.equal(got, (s / 33).to(torch.bfloat16).double())


# ------------------------------------------------------------------ the model's combinatorics
def test_tree_heights_and_depth_counts():
    """Heights of the trees the emulator builds (test_emulated_orders_equal_numpy_loops_bit_for_bit
    checks the trees themselves) and the per-format depth / rounding counts of the model."""
    for n in (1, 2, 3, 7, 8, 9, 33, 100):
        assert tree_height(n, "recursive") == max(0, n - 1)
        assert tree_height(n, "pairwise") == (math.ceil(math.log2(n)) if n > 1 else 0)
        b = 5
        assert tree_height(n, "blocked", b) == (min(b, n) - 1 + math.ceil(n / min(b, n)) - 1 if n > 1 else 0)
    s = Summation(split=4, reduce_fmt="bf16", algorithm="pairwise")
    assert s.depths(100) == {FP32: 5, BF16: 3 + 1}  # parts of 25: 5 levels; 4 partials: convert + 2 levels
    assert s.depths(100, exact_products=False) == {FP32: 6, BF16: 4}
    assert Summation(split=4).depths(100) == {FP32: 24 + 3}
    assert s.roundings(100) == {FP32: 100, BF16: 4}  # terms (underflow of products) + conversions


def test_unshared_depths_only_with_known_orders():
    n = 1024
    whole, split = Summation(), Summation(split=4, reduce_fmt="bf16")
    # unknown orders: nothing is shared, not even between identical models
    assert unshared_depths(whole, whole, n) == ((whole.depths(n), {}), (whole.depths(n), {}))
    assert difference_depths(whole, split, n) == {FP32: 1023 + 255, BF16: 3 + 1}
    kw, ks = Summation(known_order=True), Summation(split=4, reduce_fmt="bf16", known_order=True)
    assert unshared_depths(kw, kw, n) == (({}, {}), ({}, {}))
    # the split's first part (255 levels) is the unsplit chain's start
    assert unshared_depths(kw, ks, n) == (({FP32: 1023 - 255}, {}), ({FP32: 255}, {BF16: 4}))
    # rounded products are shared by known orders in the same format
    (ia, _), (ib, _) = unshared_depths(kw, ks, n, exact_products=False)
    assert ia == {FP32: 1023 - 255} and ib == {FP32: 255}
    # same parts, different reduction: only the reductions differ
    ks32 = Summation(split=4, known_order=True)
    assert unshared_depths(ks, ks32, n) == (({}, {BF16: 4}), ({}, {FP32: 3}))


def test_identical_known_models_give_zero_and_unknown_do_not():
    s, y = torch.tensor([10.0], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64)
    k = Summation(known_order=True)
    b0, _ = sum_difference_bound(s, y, 100, k, k, FP32, FP32, "deterministic", math.inf)
    assert b0.item() == 0.0
    b1, _ = sum_difference_bound(s, y, 100, Summation(), Summation(), FP32, FP32, "deterministic", math.inf)
    single, _ = sum_error_bound(s, y, 100, Summation(), FP32, "deterministic", math.inf)
    assert b1.item() == pytest.approx(2 * single.item())


# ------------------------------------------------------------------ bounds vs emulation
def _check(x, summ, out, modes=("deterministic", "probabilistic"), p=1e-2, storage=BF16):
    """Emulated sums of the rows of x (values of ``storage``) under summ vs the bound:
    {mode: (violations, median tightness, bound)}."""
    x64 = x.double()
    exact = exact_sum(x64, -1)
    s = x64.abs().sum(-1)
    got = emulate_sum(x, -1, summ, out)
    err = (got - exact).abs()
    res = {}
    for mode in modes:
        b, _ = sum_error_bound(s, exact.abs(), x.shape[-1], summ, get_format(out), mode, lambda_for(p),
                               exact_products=conversion_exact(storage, summ.accum))
        nz = err > 0
        res[mode] = (int((err > b).sum()), float((b[nz] / err[nz]).median()) if nz.any() else math.inf, b)
    return res


MODELS = [
    Summation(accum=FP32),
    Summation(accum=BF16),
    Summation(accum=FP16),
    Summation(accum=BF16, algorithm="pairwise"),
    Summation(accum=FP16, algorithm="blocked", block=16),
    Summation(accum=FP32, split=8, reduce_fmt=BF16),
    Summation(accum=FP16, algorithm="pairwise", split=4, reduce_fmt=BF16, reduce_algorithm="pairwise"),
]


@pytest.mark.parametrize("summ", MODELS, ids=lambda s: s.describe())
@pytest.mark.parametrize("data", ["normal", "positive", "cancel", "heavy", "subnormal"])
def test_emulated_sums_never_violate_the_deterministic_bound(summ, data):
    g = _gen(hash((summ.describe(), data)) % 2**31)
    m, n = 64, 256
    if data == "normal":
        x = torch.randn(m, n, generator=g)
    elif data == "positive":
        x = torch.rand(m, n, generator=g)
    elif data == "cancel":
        h = torch.randn(m, n // 2, generator=g)
        x = torch.cat([h, -h * (1 + 2.0 ** -6 * torch.rand(m, n // 2, generator=g))], dim=-1)
    elif data == "heavy":
        x = torch.sign(torch.randn(m, n, generator=g)) * torch.exp(3 * torch.randn(m, n, generator=g))
        x = x.clamp(-6e4 / n, 6e4 / n)
    else:
        x = torch.randn(m, n, generator=g) * 2.0 ** -20  # fp16 subnormals, tiny in bf16
    x = round_to(x, BF16).float()
    res = _check(x, summ, "fp32")
    for mode, (viol, _, _) in res.items():
        assert viol == 0, (mode, summ.describe(), data)


def test_deterministic_bound_is_nearly_attained_by_stagnation():
    """x_1 = 1 followed by n-1 terms t just below half an ulp of 1: a recursive bf16 chain
    never moves (every addition rounds down by ~u), so err = (n-1) t while the bound is
    theta S with theta = (1+u)^(n-1) - 1 ~ (n-1) u and S = 1 + (n-1) t: tightness
    ~ (1 + (n-1)u/2)(1 + (n-1)u), i.e. 1 + O(n u): the bound is attained to first order."""
    n, u = 32, 2.0 ** -8
    t = u * (1 - 2.0 ** -7)
    x = torch.full((1, n), t)
    x[0, 0] = 1.0
    (viol, tight, _) = _check(x, Summation(accum=BF16), "fp32", modes=("deterministic",))["deterministic"]
    assert viol == 0
    expected = ((1 + u) ** (n - 1) - 1) * (1 + (n - 1) * t) / ((n - 1) * t)
    assert tight == pytest.approx(expected, rel=1e-9)
    assert tight < 1.2


def test_probabilistic_bound_holds_at_the_claimed_rate_and_is_tight_on_positive_data():
    """Positive terms and a recursive fp16 chain, the most favourable case for the
    martingale bound lambda sqrt(n-1) u S: the typical error is u sqrt(sum_k s_k^2 / 6)
    (partial sums s_k ~ k/2; a rounding error is uniform within half an ulp, variance
    ~u^2/6), so the median per-element tightness is ~ lambda sqrt(3) sqrt(6) / 0.67 ~ 15 at
    lambda(0.1) = 2.45 and the worst row of 2000 comes within a factor ~3 of the bound."""
    p = 0.1
    x = round_to(torch.rand(2000, 128, generator=_gen(6)), FP16).float()
    res = _check(x, Summation(accum=FP16), "fp32", modes=("probabilistic",), p=p, storage=FP16)["probabilistic"]
    viol, median_tight, b = res
    assert binomtest(viol, x.shape[0], p, alternative="greater").pvalue > 1e-3
    err = (emulate_sum(x, -1, Summation(accum=FP16), "fp32") - exact_sum(x.double(), -1)).abs()
    assert 8 < median_tight < 25
    assert 1 < float((b / err).min()) < 5


@pytest.mark.parametrize("wrong,computed", [
    (Summation(accum=FP32), Summation(accum=BF16)),                       # wrong accumulation format
    (Summation(accum=FP16, algorithm="pairwise"), Summation(accum=FP16)),  # depth log2 n claimed for n-1
    (Summation(accum=FP32), Summation(accum=FP32, split=4, reduce_fmt=BF16)),  # bf16 partials not declared
])
def test_wrong_models_are_caught(wrong, computed):
    x = round_to(torch.rand(256, 512, generator=_gen(7)), BF16).float()
    x64 = x.double()
    exact = exact_sum(x64, -1)
    got = emulate_sum(x, -1, computed, "fp32")
    err = (got - exact).abs()
    for mode, p in (("deterministic", 0.0), ("probabilistic", 1e-2)):
        b, _ = sum_error_bound(x64.abs().sum(-1), exact.abs(), 512, wrong, FP32, mode,
                               lambda_for(p) if p else math.inf)
        viol = int((err > b).sum())
        assert viol > 0, (mode, wrong.describe())
        if mode == "probabilistic":
            assert binomtest(viol, 256, p, alternative="greater").pvalue < 1e-3


def test_two_stage_bound_uses_partial_sums():
    """With a split the reduction levels scale with T = sum |p_i| (<= S); with T = S the
    bound is the single-stage theta S."""
    summ = Summation(split=8, reduce_fmt=BF16)
    s = torch.tensor([1000.0], dtype=torch.float64)
    y = torch.tensor([1.0], dtype=torch.float64)
    full, _ = sum_error_bound(s, y, 4096, summ, FP32, "deterministic", math.inf)
    d = summ.depths(4096)
    from ttrace_num.bounds.summation import theta
    assert full.item() == pytest.approx(theta(d) * 1000.0, rel=1e-12)
    tight, _ = sum_error_bound(s, y, 4096, summ, FP32, "deterministic", math.inf,
                               partial_abs_sum=torch.tensor([50.0], dtype=torch.float64))
    assert tight.item() < full.item() / 5


def test_leaf_levels_cover_terms_rounded_before_the_sum():
    """Each fp32 term rounded to bf16 (a leaf level), then an fp32 chain."""
    x = torch.rand(512, 256, generator=_gen(8)).float()
    exact = exact_sum(x.double(), -1)
    y = emulate_sum(round_to(x, BF16).float(), -1, Summation(), "fp32")
    err = (y - exact).abs()
    s, mag = x.double().abs().sum(-1), exact.abs()
    for mode, p in (("deterministic", 0.0), ("probabilistic", 1e-2)):
        lam = lambda_for(p) if p else math.inf
        b, _ = sum_error_bound(s, mag, 256, Summation(), FP32, mode, lam, leaf_depths={BF16: 1})
        viol = int((err > b).sum())
        assert viol == 0 if mode == "deterministic" else binomtest(viol, 512, p, alternative="greater").pvalue > 1e-3
        wrong, _ = sum_error_bound(s, mag, 256, Summation(), FP32, mode, lam)
        assert int((err > wrong).sum()) > 0


def test_overflow_possible_flags_values_above_the_format_maximum():
    from ttrace_num.bounds.summation import overflow_possible
    got = overflow_possible(torch.tensor([65504.0, -65505.0, math.nan, 1.0], dtype=torch.float64), "fp16")
    assert got.tolist() == [False, True, True, False]
    with pytest.raises(TypeError, match="partial_sum_upper"):
        overflow_possible(1.0, "fp16")


@pytest.mark.parametrize("mode", ["deterministic", "probabilistic"])
def test_partial_sums_that_overflow_give_an_infinite_bound(mode):
    """fp16 accumulation: 3e4 + 3e4 + 3e4 overflows to inf although the exact sum (3e4) and the
    output are finite; the bound must be inf there (it was finite: a false claim), and stay
    finite on the rows whose partial sums cannot overflow."""
    big = torch.tensor([[3e4, 3e4, 3e4, -3e4, -3e4, 0.0]], dtype=torch.float64)
    x = torch.cat([big, big / 64]).float()
    summ = Summation(accum=FP16)
    got = emulate_sum(x, -1, summ, "fp32")
    exact = exact_sum(x.double(), -1)
    assert math.isinf(got[0].item()) and math.isfinite(got[1].item())
    b, _ = sum_error_bound(x.double().abs().sum(-1), exact.abs(), 6, summ, FP32, mode, lambda_for(1e-2))
    assert math.isinf(b[0].item()) and math.isfinite(b[1].item())
    assert bool(((got - exact).abs() <= b).all())


def test_flush_to_zero_summation_is_covered():
    """FTZ accumulation, emulated: partial sums that cancel into fp32's subnormal range are
    flushed (error up to ``min_normal`` per addition); the gradual-underflow bound is violated,
    ``Summation(ftz=True)`` (``(2n - k) min_normal`` plus the flushed output) holds."""
    tiny = 2.0 ** -126
    g = _gen(11)
    x = torch.cat([torch.tensor([[3 * tiny / 2, -tiny]]).expand(64, 2),
                   torch.randint(-4, 5, (64, 30), generator=g) * tiny / 8], dim=1).float()
    exact = exact_sum(x.double(), -1)
    s, mag = x.double().abs().sum(-1), exact.abs()
    for out in ("fp32", "bf16", "fp16"):
        got = emulate_sum(x, -1, Summation(ftz=True), out)
        err = (got - exact).abs()
        for mode in ("deterministic", "probabilistic"):
            old, _ = sum_error_bound(s, mag, 32, Summation(), get_format(out), mode, lambda_for(1e-2))
            new, _ = sum_error_bound(s, mag, 32, Summation(ftz=True), get_format(out), mode, lambda_for(1e-2))
            assert int((err > new).sum()) == 0, (out, mode)
            if out != "fp16":  # fp16's output rounding (2^-25) already covers these errors
                assert int((err > old).sum()) > 0, (out, mode)
