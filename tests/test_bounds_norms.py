"""Bounds of layer_norm and rms_norm against the mpmath references.

The computation model (ATen's Welford cascade, centering, FMAs) is checked bit for bit
against torch's CPU kernels; the bounds against the real kernels (fp32/bf16/fp16) and the
emulations (torch_cpu and two_pass models, compute fp32 and compute = bf16/fp16) on random
and adversarial rows (large mean / small variance, near-constant rows where eps dominates,
heavy tails, rows of 16384, near overflow, subnormals): 0 deterministic violations, a
binomial test of the probabilistic claim, and deliberately wrong models that are caught.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from scipy.stats import binomtest

import ttrace_num as tn
from ttrace_num import reference as ref
from ttrace_num.bounds import norms as N
from ttrace_num.bounds.common import resolve_mode, resolve_precision
from ttrace_num.bounds.summation import Summation
from ttrace_num.emulate import norms as EN
from ttrace_num.formats import get_format
from ttrace_num.rounding import round_to

DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
EPS = 1e-5


def _case(fmt: str, label: str, g: torch.Generator) -> torch.Tensor:
    n = 1024
    if label == "normal":
        x = torch.randn(8, n, generator=g)
    elif label == "shift":  # large mean, small variance: cancellation in x - mu
        x = (1e4 if fmt == "fp32" else 100.0) + torch.randn(8, n, generator=g)
    elif label == "nearconst":  # sigma ~ 0: eps dominates, r ~ 1/sqrt(eps)
        x = 3.0 + 1e-4 * torch.randn(8, n, generator=g)
    elif label == "heavy":  # one outlier in 100 is 1e3..1e4 times the rest
        x = torch.randn(8, n, generator=g) * torch.where(torch.rand(8, n, generator=g) < 0.01, 1e3 if fmt == "fp16" else 1e4, 1.0)
    elif label == "long":
        x = torch.randn(2, 16384, generator=g)
    elif label == "big":  # near overflow of the format (fp16) / of the fp32 sum of squares
        x = (torch.randn(8, n, generator=g) * 2e4).clamp(-6e4, 6e4) if fmt == "fp16" else torch.randn(8, n, generator=g) * 1e17
    elif label == "subnormal":
        x = torch.randn(8, n, generator=g) * (1e-6 if fmt == "fp16" else 1e-39)
    else:
        raise ValueError(label)
    return x.to(DT[fmt])


LABELS = ["normal", "shift", "nearconst", "heavy", "long", "big", "subnormal"]


@pytest.fixture(scope="module")
def cases() -> dict:
    g = torch.Generator().manual_seed(0)
    out = {}
    for fmt, dt in DT.items():
        for label in LABELS:
            x = _case(fmt, label, g)
            n = x.shape[-1]
            w = torch.randn(n, generator=g).to(dt)
            b = torch.randn(n, generator=g).to(dt)
            out[fmt, label] = {"x": x, "w": w, "b": b, "n": n,
                               "ln": ref.layer_norm(x, [n], w, b, EPS), "rms": ref.rms_norm(x, [n], w, 1e-6)}
    return out


def _err(y: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    return (y.double() - exact).abs()


def _viol(y, exact, bound) -> int:
    return int((_err(y, exact) > bound).sum())


def _tight(y, exact, bound) -> float:
    e = _err(y, exact)
    nz = e > 0
    return float((bound[nz] / e[nz]).min()) if nz.any() else math.inf


# ----------------------------------------------------------------------------- the model is torch's


@pytest.mark.cpu_dispatch("avx2")
@pytest.mark.parametrize("fmt", list(DT))
def test_emulation_is_torch_bit_for_bit(fmt):
    """Mean, 1/sqrt(var+eps) and output of ATen's CPU layer_norm equal the emulation of the
    stated model (Welford cascade with FMAs, centering by format) exactly; rms_norm too."""
    g = torch.Generator().manual_seed(5)
    for n, shift in [(37, 0.0), (1000, 100.0), (4096, 0.0)]:
        x = (torch.randn(4, n, generator=g) * 2 + shift).to(DT[fmt])
        w, b = torch.randn(n, generator=g).to(DT[fmt]), torch.randn(n, generator=g).to(DT[fmt])
        y, mean, rstd = torch.native_layer_norm(x, [n], w, b, EPS)
        assert torch.equal(y.double(), EN.layer_norm(x, [n], w, b, EPS))
        mu, var = EN.moments(x.double().reshape(-1, n), get_format("fp32"), get_format(fmt))
        if fmt == "fp32":  # (bf16 kernels return mean/rstd in bf16)
            assert torch.equal(mean.double().reshape(-1), mu.reshape(-1))
            c = get_format("fp32")
            r = round_to(1.0 / round_to(torch.sqrt(round_to(var + float(round_to(torch.tensor(EPS), c)), c)), c), c)
            assert torch.equal(rstd.double().reshape(-1), r.reshape(-1))
        yr = F.rms_norm(x, [n], w, 1e-6)
        assert torch.equal(yr.double(), EN.rms_norm(x, [n], w, 1e-6))


# ----------------------------------------------------------------------------- layer_norm


@pytest.mark.parametrize("fmt", list(DT))
@pytest.mark.parametrize("label", LABELS)
def test_layer_norm_torch(cases, fmt, label):
    c = cases[fmt, label]
    x, w, b, n = c["x"], c["w"], c["b"], c["n"]
    y = F.layer_norm(x, [n], w, b, EPS)
    bound = tn.tolerance("layer_norm", x, [n], w, b, EPS)
    assert _viol(y, c["ln"], bound.abs) == 0
    # probabilistic, failure probability 0.1 per element: one-sided binomial test
    prob = tn.tolerance("layer_norm", x, [n], w, b, EPS, mode="probabilistic", failure_probability=0.1)
    assert (prob.abs <= bound.abs).all()
    v = _viol(y, c["ln"], prob.abs)
    assert binomtest(v, y.numel(), 0.1, alternative="greater").pvalue > 1e-3
    y0 = F.layer_norm(x, [n])  # no affine
    assert _viol(y0, ref.layer_norm(x, [n], eps=EPS), tn.tolerance("layer_norm", x, [n]).abs) == 0
    if label in ("normal", "long", "heavy"):
        assert _tight(y, c["ln"], bound.abs) < (20.0 if fmt == "fp32" else 2.0)


@pytest.mark.parametrize("fmt", list(DT))
@pytest.mark.parametrize("label", ["normal", "shift", "nearconst", "heavy"])
def test_layer_norm_emulated(cases, fmt, label):
    """Emulations: torch_cpu model without FMA (every op rounded), compute = storage format
    (bf16/fp16 Welford), and the two-pass model."""
    c = cases[fmt, label]
    x, w, b, n = c["x"][:4], c["w"], c["b"], c["n"]
    exact = c["ln"][:4]
    y = EN.layer_norm(x, [n], w, b, EPS, fma=False)
    assert _viol(y, exact, tn.tolerance("layer_norm", x, [n], w, b, EPS).abs) == 0
    if fmt != "fp32":
        y = EN.layer_norm(x, [n], w, b, EPS, compute_fmt=fmt)
        bound = tn.tolerance("layer_norm", x, [n], w, b, EPS, compute_fmt=fmt)
        assert _viol(y, exact, bound.abs) == 0
    y = EN.layer_norm(x, [n], w, b, EPS, moments_model="two_pass")
    for mode in ("deterministic", "probabilistic"):
        bound = tn.tolerance("layer_norm", x, [n], w, b, EPS, moments="two_pass", mode=mode, failure_probability=0.01)
        assert _viol(y, exact, bound.abs) == 0


def test_layer_norm_probabilistic_tighter_on_long_rows(cases):
    c = cases["fp32", "long"]
    x, n = c["x"], c["n"]
    det = tn.tolerance("layer_norm", x, [n]).abs
    prob = tn.tolerance("layer_norm", x, [n], mode="probabilistic").abs
    assert (prob <= det).all() and prob.median() < det.median()


def test_one_over_sigma_amplification_is_needed():
    """x = 100 + N(0, 0.01^2) in fp32: the absolute errors of x - mu^ (~u 100) are divided
    by sigma, r = 1/sqrt(v + eps) ~ 94. The bound holds (within ~6x of the error); the same
    budget without the factor 1/sigma (bound / r) is violated. A near-constant row is
    capped by eps: r <= eps^-1/2."""
    g = torch.Generator().manual_seed(7)
    n = 1024
    x = 100.0 + 0.01 * torch.randn(8, n, generator=g)
    exact = ref.layer_norm(x, [n], eps=EPS)
    y = F.layer_norm(x, [n], eps=EPS)
    good = tn.tolerance("layer_norm", x, [n], eps=EPS)
    assert _viol(y, exact, good.abs) == 0
    assert _tight(y, exact, good.abs) < 10
    prec = resolve_precision((x,))
    me = N.moment_errors(x.double(), prec, resolve_mode("deterministic", None))
    r = 1.0 / torch.sqrt(me.v + EPS)
    assert float(r.min()) > 50
    assert _viol(y, exact, good.abs / r) > 0
    flat = torch.full((2, n), 7.0)
    flat[:, 0] = 7.0 + 2 ** -20
    bflat = tn.tolerance("layer_norm", flat, [n], eps=EPS)
    assert float(bflat.explanation.values["max r = 1/sqrt(v+eps)"]) <= EPS ** -0.5
    assert _viol(F.layer_norm(flat, [n], eps=EPS), ref.layer_norm(flat, [n], eps=EPS), bflat.abs) == 0


@pytest.mark.cpu_dispatch("avx2")  # its last check needs the avx2 kernel's folded centering
def test_wrong_models_caught(cases):
    # moments and normalisation claimed in fp64 (u of the wrong compute format): torch's fp32
    # cancellation error on x = 1e4 + N(0, 1) is not covered
    c = cases["fp32", "shift"]
    x, n = c["x"], c["n"]
    exact = ref.layer_norm(x, [n], eps=EPS)
    wrong = tn.tolerance("layer_norm", x, [n], eps=EPS, compute_fmt="fp64")
    assert _viol(F.layer_norm(x, [n], eps=EPS), exact, wrong.abs) > 0
    # two-pass model whose sums are claimed exact (fp64) while the emulation sums in fp32
    y2 = EN.layer_norm(x[:2], [n], eps=EPS, moments_model="two_pass")
    wrong = tn.tolerance("layer_norm", x[:2], [n], eps=EPS, moments="two_pass", summation=Summation(accum="fp64"))
    assert _viol(y2, exact[:2], wrong.abs) > 0
    # u of the wrong format: bf16 outputs bounded as if stored in fp32
    c = cases["bf16", "normal"]
    wrong = tn.tolerance("layer_norm", c["x"], [c["n"]], c["w"], c["b"], EPS, out_fmt="fp32")
    assert _viol(F.layer_norm(c["x"], [c["n"]], c["w"], c["b"], EPS), c["ln"], wrong.abs) > 0
    # centering: torch's bf16 kernel folds the mean (x r^ + fl(-r^ mu^)); on constant rows
    # r^ = eps^-1/2 and fl(r^ mu^) ~ 3e6 errs by up to 0.125: z^ != 0 although z = 0
    x = torch.tensor([9984.0, 1000.0, 333.0, 77.5]).repeat_interleave(256).reshape(4, 256).to(torch.bfloat16)
    exact = ref.layer_norm(x, [256], eps=EPS)
    y = F.layer_norm(x, [256], eps=EPS)
    assert _viol(y, exact, tn.tolerance("layer_norm", x, [256], eps=EPS).abs) == 0
    assert _viol(y, exact, tn.tolerance("layer_norm", x, [256], eps=EPS, centering="subtract").abs) > 0


def test_statistics_kept_in_bf16_are_caught_at_the_op(cases):
    """A kernel that rounds its fp32 mean and variance to bf16 before normalising: a traced
    comparison of whole runs cannot see it (docs/detection.md, "Bugs beyond the catalogue":
    0.46x its threshold), the op's bound against the exact result can."""
    c = cases["bf16", "normal"]
    x, n, w, b = c["x"], c["n"], c["w"], c["b"]
    xf = x.float()
    mean = xf.mean(-1, keepdim=True).bfloat16().float()
    var = (xf - mean).square().mean(-1, keepdim=True).bfloat16().float()
    y = ((xf - mean) * torch.rsqrt(var + EPS) * w.float() + b.float()).bfloat16()
    bound = tn.tolerance("layer_norm", x, [n], w, b, EPS).abs
    assert _viol(F.layer_norm(x, [n], w, b, EPS), c["ln"], bound) == 0
    assert _viol(y, c["ln"], bound) > 0.01 * y.numel()


# ----------------------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("fmt", list(DT))
@pytest.mark.parametrize("label", LABELS)
def test_rms_norm(cases, fmt, label):
    c = cases[fmt, label]
    x, w, n = c["x"], c["w"], c["n"]
    y = F.rms_norm(x, [n], w, 1e-6)
    bound = tn.tolerance("rms_norm", x, [n], w, 1e-6)
    assert _viol(y, c["rms"], bound.abs) == 0
    prob = tn.tolerance("rms_norm", x, [n], w, 1e-6, mode="probabilistic", failure_probability=0.1)
    v = _viol(y, c["rms"], prob.abs)
    assert binomtest(v, y.numel(), 0.1, alternative="greater").pvalue > 1e-3
    if label in ("normal", "heavy", "shift"):
        xe = x[:2]
        for comp in ["fp32"] + ([fmt] if fmt != "fp32" else []):
            # ATen's cascade sum in the compute format (fp32: torch's rsqrt; else correctly rounded)
            ye = EN.rms_norm(xe, [n], w, 1e-6, compute_fmt=comp)
            be = tn.tolerance("rms_norm", xe, [n], w, 1e-6, compute_fmt=comp)
            assert _viol(ye, c["rms"][:2], be.abs) == 0, comp
            # a recursive (left-to-right) sum of the squares, correctly rounded rsqrt
            summ = Summation(accum=comp)
            ye = EN.rms_norm(xe, [n], w, 1e-6, compute_fmt=comp, summation=summ, rsqrt="correctly_rounded")
            be = tn.tolerance("rms_norm", xe, [n], w, 1e-6, compute_fmt=comp, summation=summ,
                              library="correctly_rounded")
            assert _viol(ye, c["rms"][:2], be.abs) == 0, comp
    if label == "normal" and fmt != "fp32":
        assert _tight(y, c["rms"], bound.abs) < 2.0


def test_rms_norm_eps_none_is_compute_eps():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    b = tn.tolerance("rms_norm", x, [64], eps=None)
    assert b.explanation.values["eps"] == get_format("fp32").eps
    exact = ref.rms_norm(x, [64], eps=get_format("fp32").eps)
    assert _viol(F.rms_norm(x, [64]), exact, b.abs) == 0


def test_rms_norm_wrong_u_caught(cases):
    c = cases["fp16", "normal"]
    wrong = tn.tolerance("rms_norm", c["x"], [c["n"]], c["w"], 1e-6, out_fmt="fp32")
    assert _viol(F.rms_norm(c["x"], [c["n"]], c["w"], 1e-6), c["rms"], wrong.abs) > 0


def test_registered_and_explained(cases):
    for op in ("layer_norm", "rms_norm"):
        assert op in tn.ops()
    c = cases["bf16", "normal"]
    b = tn.tolerance("layer_norm", c["x"], [c["n"]], mode="probabilistic")
    text = b.explain()
    assert "RowwiseMoments" in text and "fold" in text
    assert b.abs.shape == c["x"].shape
    # dim= (normalise along another dim): the bound comes back in the input's layout
    x = torch.randn(64, 3, 5)
    bd = tn.tolerance("layer_norm", x, dim=0)
    assert bd.abs.shape == x.shape
    y = F.layer_norm(x.movedim(0, -1), [64]).movedim(-1, 0)
    assert _viol(y, ref.layer_norm(x.movedim(0, -1), [64]).movedim(-1, 0), bd.abs) == 0
