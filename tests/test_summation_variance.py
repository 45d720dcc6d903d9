"""ttrace_num.bounds.summation_variance: identity (1) against exact enumeration, the model
against emulated random-order fp32 chains (it must be neither unsafe nor loose), against
this machine's fp32 and bf16 GEMMs split like tensor parallelism, and the rounding of a
result into bf16/fp16 against measured roundings."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from ttrace_num.bounds.summation import Summation
from ttrace_num.formats import get_format
from ttrace_num.bounds.summation_variance import (chain_split_difference, difference_std, gemm_difference_variance,
                                                  matmul_sum_statistics, matmul_variance, may_stagnate,
                                                  rounding_variance, sum_variance)

VECTORS = {
    "mixed": [0.3, -1.2, 2.0, 0.7, -0.4, 1.1],
    "positive": [0.5, 1.5, 2.5, 0.25, 3.0, 1.0],
    "cancelling": [1.0, -1.0, 2.0, -2.0, 0.5, -0.5],
}


def _exact_mean_sq_prefix(t: torch.Tensor) -> float:
    """E over all n! orders of sum_j s_j^2, by enumeration (float64, exact enough)."""
    perms = list(itertools.permutations(range(len(t))))
    return sum(float((torch.cumsum(t[list(p)], 0) ** 2).sum()) for p in perms) / len(perms)


@pytest.mark.parametrize("name", VECTORS)
def test_identity_1_by_enumerating_every_order(name):
    t = torch.tensor(VECTORS[name], dtype=torch.float64)
    n, q, c = len(t), float((t * t).sum()), float(t.sum())
    assert _exact_mean_sq_prefix(t) == pytest.approx((n + 1) * (q / 6 + c * c / 3), rel=1e-12)


@pytest.mark.parametrize("name", VECTORS)
def test_split_model_matches_enumeration(name):
    """Two parts of 3 terms, each a chain, and the chain over the 2 partials: the model's
    ``variance / (u^2/3)`` is the expected sum of squared partial sums over every order."""
    t = torch.tensor(VECTORS[name], dtype=torch.float64)
    perms = list(itertools.permutations(range(6)))
    total = 0.0
    for p in perms:
        x = t[list(p)]
        parts = [torch.cumsum(x[:3], 0), torch.cumsum(x[3:], 0)]
        reduction = torch.cumsum(torch.stack([parts[0][-1], parts[1][-1]]), 0)
        total += float(sum((s * s).sum() for s in parts) + (reduction * reduction).sum())
    s = Summation(split=2)
    model = sum_variance((t * t).sum(), t.sum(), 6, s)
    assert float(model) / (s.accum.u ** 2 / 3) == pytest.approx(total / len(perms), rel=1e-12)


def _fp32_chain_errors(rng: np.random.Generator, n: int, trials: int, positive: bool) -> tuple[float, float]:
    """(rms error of a float32 left-to-right sum over random data and orders, rms of the model)."""
    errs, model = [], []
    for _ in range(trials):
        x = rng.standard_normal(n)
        if positive:
            x = np.abs(x)
        x32 = x.astype(np.float32)
        exact = math.fsum(x32.astype(np.float64))
        computed = np.cumsum(x32, dtype=np.float32)[-1]  # sequential in float32
        errs.append(float(computed) - exact)
        t = torch.from_numpy(x32.astype(np.float64))
        model.append(float(sum_variance((t * t).sum(), t.sum(), n)))
    return math.sqrt(np.mean(np.square(errs))), math.sqrt(np.mean(model))


@pytest.mark.parametrize("n", [64, 1024])
@pytest.mark.parametrize("positive", [False, True])
def test_model_against_emulated_fp32_chains(n, positive):
    """Round-to-nearest's relative error has variance between u^2/12 and u^2/3 (uniform model:
    u^2/3), so the model's std should exceed the actual one by at most ~2x, and never fall
    below it."""
    actual, model = _fp32_chain_errors(np.random.default_rng(n + positive), n, 400, positive)
    ratio = actual / model
    print(f"n={n} positive={positive}: actual rms {actual:.3g}, model {model:.3g}, ratio {ratio:.2f}")
    assert 0.35 <= ratio <= 1.0


@pytest.mark.parametrize("m,k,n", [(64, 64, 64), (32, 1024, 32), (64, 4096, 16)])
@pytest.mark.parametrize("tp", [2, 4])
def test_model_covers_split_fp32_gemms(m, k, n, tp):
    """fp32 GEMM vs the same GEMM split over ``tp`` K-slices summed in fp32 (a row-parallel
    linear): the rms difference stays below the model's, and within 20x of it (tightness)."""
    g = torch.Generator().manual_seed(m + k + tp)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    split = sum(a[:, i * k // tp:(i + 1) * k // tp] @ b[i * k // tp:(i + 1) * k // tp] for i in range(tp))
    d = ((a @ b).double() - split.double()).pow(2).mean().sqrt()
    sd = difference_std(matmul_variance(a, b), matmul_variance(a, b, summation=Summation(split=tp))).pow(2).mean().sqrt()
    ratio = float(d / sd)
    print(f"{m}x{k}x{n} tp={tp}: rms difference / model std = {ratio:.3f}")
    assert ratio <= 1.0
    assert ratio >= 0.05 or float(d) == 0.0  # bitwise-equal splits happen (kernel blocking)


def test_fp32_products_add_one_rounding_bf16_ones_none():
    """bf16 x bf16 products are exact in fp32; fp32 x fp32 ones are counted as rounded once."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 16, generator=g).bfloat16(), torch.randn(16, 4, generator=g).bfloat16()
    q = (a.double() ** 2) @ (b.double() ** 2)
    extra = matmul_variance(a.float(), b.float()) - matmul_variance(a, b)  # same values, fp32 dtype
    # Q from float32 GEMMs: within gamma_(K+1) = (K + 2) 2^-24 relative (matmul_sum_statistics)
    assert torch.allclose(extra, (2.0 ** -24) ** 2 / 3 * q, rtol=18 * 2.0 ** -24, atol=0)


def _float64_statistics(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a64, b64 = a.double(), b.double()
    return (a64 * a64) @ (b64 * b64), a64 @ b64


@pytest.mark.parametrize("k", [64, 512, 4096])
@pytest.mark.parametrize("exponent", [-40, 0, 40])
def test_gemm_statistics_in_float32_match_float64(k, exponent):
    """The float32 statistics (operands scaled by powers of two) against float64 ones, on bf16
    GEMMs whose squared products reach 2^+-160 (outside float32's range unscaled), with half the
    columns cancelling exactly in pairs (C = 0, Q large): Q within its rigorous bound, and the
    variance of a bf16 TP-2 difference within 1e-5 relative."""
    g = torch.Generator().manual_seed(k + exponent)
    a = (torch.randn(16, k, generator=g) * 2.0 ** exponent).bfloat16()
    b = torch.randn(k, 32, generator=g) * 2.0 ** exponent
    b[:, 16:] = torch.where(torch.arange(k)[:, None] % 2 == 0, b[:, 16:], 0.0)
    a[:, 1::2] = a[:, 0::2]                      # a's odd columns repeat its even ones ...
    b[1::2, 16:] = -b[0::2, 16:]                  # ... and these columns of b cancel them
    b = b.bfloat16()
    q, c, n, exact = matmul_sum_statistics(a, b)
    q64, c64 = _float64_statistics(a, b)
    assert (c64[:, 16:] == 0).all() and (q64[:, 16:] > 0).all()
    assert torch.allclose(q, q64, rtol=(k + 2) * 2.0 ** -24, atol=0)
    models = (None, Summation(split=2, reduce_fmt=get_format("bf16")))
    out = get_format("bf16")
    v, v64 = (gemm_difference_variance(qq, cc, n, exact, models, out) for qq, cc in ((q, c), (q64, c64)))
    rel = float(((v - v64).abs() / v64).max())
    print(f"K={k} scale 2^{exponent}: variance from float32 statistics, largest relative difference {rel:.1e}")
    assert rel < 1e-5


def test_gemm_statistics_of_non_finite_operands_are_not_finite():
    a, b = torch.ones(2, 3), torch.ones(3, 2)
    a[0, 0] = float("inf")
    q, c, _, _ = matmul_sum_statistics(a, b)
    assert math.isinf(q[0, 0]) and math.isinf(c[0, 0]) and torch.equal(q[1], torch.full((2,), 3.0, dtype=torch.float64))


def _injected_variance(inputs, **kw) -> float:
    """Mean squared deviation of ``F.linear(*inputs)`` under a forward-only NoiseInjector."""
    import torch.nn.functional as F

    from ttrace_num.propagate.noise import NoiseInjector
    with NoiseInjector(torch.Generator().manual_seed(0), mode="probabilistic", backward=False, **kw):
        y = F.linear(*inputs)
    return float((y.double() - F.linear(*inputs).double()).pow(2).mean())


def test_injector_gives_fp32_gemms_the_model_variance():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(256, 128, generator=g), torch.randn(64, 128, generator=g)
    split = Summation(split=2)
    model = float((matmul_variance(x, w.t()) + matmul_variance(x, w.t(), summation=split)).mean())
    matched, bound = _injected_variance((x, w), variance_model=split), _injected_variance((x, w))
    print(f"fp32 linear K=128: noise variance / model {matched / model:.3f}; bound-sized noise / model "
          f"{bound / model:.0f}")
    assert 0.9 <= matched / model <= 1.1
    assert bound / model > 100  # what the variance model replaces


def test_rounding_variance_is_that_of_round_to_nearest():
    """Random values over many binades rounded to bf16/fp16: the squared error over
    half_ulp^2/3, averaged elementwise, is 1 (uniform error on [-h, h])."""
    g = torch.Generator().manual_seed(11)
    for fmt, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        x = torch.randn(200_000, generator=g, dtype=torch.float64) * torch.exp(
            3 * torch.randn(200_000, generator=g, dtype=torch.float64))
        x = x.clamp(-6e4, 6e4)
        err2 = (x.to(dtype).double() - x) ** 2
        ratio = float((err2 / rounding_variance(x, get_format(fmt))).mean())
        print(f"{fmt}: measured / model rounding variance {ratio:.4f}")
        assert 0.98 <= ratio <= 1.02


@pytest.mark.parametrize("m,k,n", [(64, 64, 64), (32, 1024, 32), (64, 4096, 16)])
@pytest.mark.parametrize("tp", [2, 4])
def test_model_covers_split_bf16_gemms(m, k, n, tp):
    """A bf16 GEMM (fp32 accumulation, result rounded to bf16) against the same GEMM split over
    ``tp`` K-slices whose bf16 results are added in bf16 (a row-parallel linear with a bf16
    all-reduce): the rms difference is below the model's standard deviation and within 2x of
    it (measured 0.73-0.81)."""
    g = torch.Generator().manual_seed(m + k + tp)
    a, b = torch.randn(m, k, generator=g).bfloat16(), torch.randn(k, n, generator=g).bfloat16()
    parts = [a[:, i * k // tp:(i + 1) * k // tp] @ b[i * k // tp:(i + 1) * k // tp] for i in range(tp)]
    split = parts[0]
    for p in parts[1:]:
        split = split + p  # one bf16 rounding per addition, as gloo's bf16 sum
    d = ((a @ b).double() - split.double()).pow(2).mean().sqrt()
    q, c, terms, exact = matmul_sum_statistics(a, b)
    var = gemm_difference_variance(q, c, terms, exact, (None, Summation(split=tp, reduce_fmt="bf16")),
                                   get_format("bf16"))
    ratio = float(d / var.mean().sqrt())
    print(f"{m}x{k}x{n} tp={tp}: rms difference / model std = {ratio:.3f}")
    assert 0.5 <= ratio <= 1.0


def test_injector_gives_bf16_gemms_the_model_variance_and_keeps_bounds_for_mixed_operands():
    """bf16 linear, TP=2 model: the noise has the model's variance, plus the re-rounding of the
    noisy result to bf16 (measured 1.26x the model's variance, within [1, 1.5]); the bound-sized
    noise it replaces has 3.6x it. Operands of two dtypes keep the bound."""
    from tracer.adapters.megatron import noise_policy
    from ttrace_num.propagate.noise import NoiseInjector
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(256, 128, generator=g).bfloat16(), torch.randn(64, 128, generator=g).bfloat16()
    split, policy = Summation(split=2, reduce_fmt="bf16"), noise_policy(2, "bf16")
    q, c, terms, exact = matmul_sum_statistics(x, w.t())
    model = float(gemm_difference_variance(q, c, terms, exact, (None, split), get_format("bf16")).mean())
    matched = _injected_variance((x, w), variance_model=split, policy=policy)
    bound = _injected_variance((x, w), policy=policy)
    print(f"bf16 linear K=128, tp=2: noise variance / model {matched / model:.3f}; bound-sized noise / model "
          f"{bound / model:.2f}")
    assert 1.0 <= matched / model <= 1.5
    assert bound / model > 2.5  # what the variance model replaces
    inj = NoiseInjector(torch.Generator(), variance_model=split)
    assert inj._gemm_variance_applies(x, w, torch.bfloat16)
    assert not inj._gemm_variance_applies(x, w.float(), torch.bfloat16)
    assert not inj._gemm_variance_applies(x.float(), w.float(), torch.bfloat16)


@pytest.mark.parametrize("tokens", [32, 128])
def test_cpu_bf16_layer_norm_parameter_grads_follow_the_bf16_chain_model(tokens):
    """torch's CPU layer-norm backward sums dbeta row by row in a bf16 buffer: a bias gradient
    over all tokens vs over two halves (bf16 results added in fp32, a TP+SP candidate) differs
    by far more than one rounding, and within the bf16-chain variance the noise injector uses
    (measured 0.39-0.57x of its standard deviation)."""
    import torch.nn as nn
    g0 = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 1, 256, generator=g0).bfloat16()
    g = (torch.randn(tokens, 1, 256, generator=g0) * 1e-2).bfloat16()

    def dbeta(xs, gs):
        ln = nn.LayerNorm(256).bfloat16()
        ln(xs.clone().requires_grad_()).backward(gs)
        return ln.bias.grad.double()

    half = tokens // 2
    diff = dbeta(x, g) - (dbeta(x[:half], g[:half]) + dbeta(x[half:], g[half:]))
    t = g.double().reshape(tokens, 256)
    q, c = (t * t).sum(0), t.sum(0)
    var = (sum_variance(q, c, tokens, Summation(accum="bf16"), False)
           + sum_variance(q, c, tokens, Summation(accum="bf16", split=2, reduce_fmt="fp32"), False))
    ratio = float(diff.pow(2).mean().sqrt() / var.mean().sqrt())
    one_rounding = float((c.abs() * 2.0 ** -9).pow(2).mean().sqrt())
    print(f"{tokens} tokens: rms difference / model std = {ratio:.2f}")
    assert 0.2 <= ratio <= 1.0
    # a float accumulation would differ by its three final roundings: at most 1.5 half-ulps
    assert float(diff.pow(2).mean().sqrt()) > 2 * one_rounding


def _layer_norm_dbeta_split(tokens: int, coherence: float, width: int = 512):
    """torch's CPU bf16 layer-norm bias gradient over all tokens minus over two halves (added in
    fp32), for gradients ``0.01 (z + coherence v)`` (``v`` shared by the tokens); the terms, and
    the variance of the bf16-chain model of both runs."""
    import torch.nn as nn
    g0 = torch.Generator().manual_seed(tokens + int(coherence * 10))
    x = torch.randn(tokens, 1, width, generator=g0).bfloat16()
    v = torch.randn(1, 1, width, generator=g0)
    g = ((torch.randn(tokens, 1, width, generator=g0) + coherence * v) * 1e-2).bfloat16()

    def dbeta(xs, gs):
        ln = nn.LayerNorm(width).bfloat16()
        ln(xs.clone().requires_grad_()).backward(gs)
        return ln.bias.grad.double()

    half = tokens // 2
    diff = dbeta(x, g) - (dbeta(x[:half], g[:half]) + dbeta(x[half:], g[half:]))
    t = g.reshape(tokens, width)
    t64 = t.double()
    q, c = (t64 * t64).sum(0), t64.sum(0)
    models = (Summation(accum="bf16"), Summation(accum="bf16", split=2, reduce_fmt="fp32"))
    var = sum(sum_variance(q, c, tokens, m, False) for m in models)
    return diff, t, var, models


@pytest.mark.parametrize("tokens,coherence", [(32, 0.0), (128, 3.0), (128, 10.0), (512, 3.0)])
def test_chain_split_difference_is_the_cpu_layer_norm_kernels(tokens, coherence):
    """The one-sided part of a bf16 chain: emulated on the terms, the difference between the
    bias gradient over all tokens and over two halves is the kernel's, bitwise (one thread:
    torch's CPU layer-norm backward chains each thread's rows in a bf16 buffer)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        diff, t, var, _ = _layer_norm_dbeta_split(tokens, coherence)
    finally:
        torch.set_num_threads(threads)
    emulated = chain_split_difference(t, torch.bfloat16, 2)
    beyond = float(diff.pow(2).mean() / var.mean())
    print(f"{tokens} tokens, coherence {coherence}: difference^2 / chain variance {beyond:.2f}")
    assert torch.equal(emulated, diff)
    assert torch.equal(chain_split_difference(t, torch.bfloat16, 1), torch.zeros_like(diff))


@pytest.mark.parametrize("tokens,coherence", [(256, 10.0), (512, 3.0), (1024, 3.0), (2048, 1.0)])
def test_stagnating_bf16_chains_are_marked_and_bounded(tokens, coherence):
    """Long bf16 chains of coherent terms absorb their addends: the variance model is exceeded
    (the failure this guards against), the elements ``may_stagnate`` leaves unmarked stay within
    it, and the marked ones within the deterministic difference bound the noise injector gives
    them."""
    import ttrace_num as tn
    diff, t, var, models = _layer_norm_dbeta_split(tokens, coherence)
    overall = float(diff.pow(2).mean().sqrt() / var.mean().sqrt())
    stuck = may_stagnate(t, get_format("bf16"))
    free = ~stuck
    worst = tn.difference("sum", t, dim=0, model_a={"summation": models[0]}, model_b={"summation": models[1]},
                          mode="deterministic").abs
    free_ratio = float(diff[free].pow(2).mean().sqrt() / var[free].mean().sqrt()) if free.any() else 0.0
    tight = float((worst[stuck] / diff[stuck].abs().clamp(min=1e-30)).median())
    print(f"{tokens} tokens, coherence {coherence}: model exceeded {overall:.2f}x; {int(stuck.sum())}/{stuck.numel()} "
          f"marked; unmarked at {free_ratio:.2f}x of the model; marked: bound / |difference| median {tight:.0f}")
    assert overall > 1.4
    assert free_ratio <= 1.0
    assert bool((diff[stuck].abs() <= worst[stuck]).all())


def test_short_bf16_chains_are_never_marked():
    """``max |S_j| <= K rms(t)``: a chain shorter than ``m / u`` (128 terms in bf16) is never
    marked, whatever its terms (all equal: the largest prefix sums there are)."""
    fmt = get_format("bf16")
    assert not bool(may_stagnate(torch.ones(127, 4), fmt).any())
    assert bool(may_stagnate(torch.ones(128, 4), fmt).all())  # the bound is reached
