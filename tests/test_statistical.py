"""``mode="statistical"`` (ttrace_num/bounds/statistical.py): tight on torch's fp32 kernels, no
violation on the fixed-seed instances here, sigma the error's actual scale (a random-order
chain's rms error is 0.6-1.0 sigma: neither a dropped term nor a doubled one passes), not
looser than the probabilistic mode in bf16, clear errors for bad use. The exact references are
float64 evaluations, checked against the correctly rounded ones in
:func:`test_float64_reference_is_exact_enough`."""
from __future__ import annotations

import math
import statistics

import pytest
import torch
import torch.nn.functional as F

import ttrace_num as tn
from ttrace_num.bounds.statistical import STATISTICAL_OPS, false_alarm_factor
from ttrace_num.bounds.summation import Summation
from ttrace_num.bounds.summation_variance import aten_cascade_sum
from ttrace_num.emulate.summation import emulate_sum
from ttrace_num.reference import ops as ref
from ttrace_num.reference.dot import exact_matmul, exact_sum


def _tightness(op, make, run, exact, trials, mode="statistical", **kw):
    g = torch.Generator().manual_seed(0)
    tight, viol = [], 0
    for _ in range(trials):
        ins = make(g)
        err = (run(*ins).double() - exact(*ins).double()).abs()
        b = torch.broadcast_to(tn.tolerance(op, *ins, mode=mode, **kw).abs, err.shape)
        viol += int((err > b).sum())
        nz = err > 0
        tight.append(float((b[nz] / err[nz]).min()))
    return statistics.median(tight), viol


def _f64(f):
    return lambda *xs: f(*(x.double() for x in xs))


@pytest.mark.parametrize("k", [64, 1024])
def test_matmul_fp32_tight(k):
    make = lambda g: (torch.randn(8, k, generator=g), torch.randn(k, 8, generator=g))
    med, viol = _tightness("matmul", make, torch.matmul, _f64(torch.matmul), 20)
    med_p, _ = _tightness("matmul", make, torch.matmul, _f64(torch.matmul), 5, mode="probabilistic")
    assert viol == 0 and med <= 4, (med, viol)
    assert med_p > 5 * med  # the probabilistic bound is 28-900x here, the statistical 2.5-3.1


@pytest.mark.parametrize("op, run", [("softmax", lambda x: torch.softmax(x, -1)),
                                     ("log_softmax", lambda x: torch.log_softmax(x, -1))])
def test_softmax_fp32_tight(op, run):
    make = lambda g: (torch.randn(8, 128, generator=g) * 2,)
    med, viol = _tightness(op, make, run, _f64(run), 20)
    assert viol == 0 and med <= 4, (med, viol)


def test_attention_fp32_tight():
    make = lambda g: tuple(torch.randn(1, 2, n, 16, generator=g) for n in (16, 32, 32))
    sdpa = F.scaled_dot_product_attention
    med, viol = _tightness("attention", make, sdpa, _f64(sdpa), 20)
    assert viol == 0 and med <= 4, (med, viol)


def test_sum_holds_and_mean_dims():
    x = torch.randn(4, 6, 300, generator=torch.Generator().manual_seed(1))
    for dim in (-1, (0, 2), None):
        b = tn.tolerance("sum", x, dim=dim, mode="statistical")
        y = x.sum(dim) if dim is not None else x.sum()
        err = (y.double() - x.double().sum(dim if dim is not None else (0, 1, 2))).abs()
        assert b.abs.shape == err.shape and bool((err <= b.abs).all())
    m = tn.tolerance("mean", x, dim=-1, mode="statistical")
    assert bool(((x.mean(-1).double() - x.double().mean(-1)).abs() <= m.abs).all())


def test_sigma_is_the_error_scale():
    """A random-order fp32 chain (the model's own computation) has rms error 0.6-1.0 sigma
    (1 up to the uniform-within-u vs within-half-ulp slack, ~0.73): dropping a variance term or
    doubling one moves it out of the band."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(400, 512, generator=g)
    x = x[:, torch.randperm(512, generator=g)]
    err = emulate_sum(x, -1, Summation(), "fp32") - exact_sum(x, -1).double()
    sigma = tn.tolerance("sum", x, dim=-1, mode="statistical", false_alarm=1e-6,
                         summation=Summation()).abs / false_alarm_factor(1e-6)  # the chain model, not the tree
    ratio = float((err.square().mean() / sigma.square().mean()).sqrt())
    assert 0.6 < ratio < 1.0, ratio


def test_bf16_not_looser_than_probabilistic():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(16, 1024, generator=g).bfloat16(), torch.randn(1024, 16, generator=g).bfloat16()
    s = tn.tolerance("matmul", a, b, mode="statistical").abs
    p = tn.tolerance("matmul", a, b, mode="probabilistic").abs
    assert bool((s <= p * 1.0001).all())
    x = (torch.randn(8, 128, generator=g) * 2).bfloat16()
    assert bool((tn.tolerance("softmax", x, mode="statistical").abs
                 <= tn.tolerance("softmax", x, mode="probabilistic").abs * 1.0001).all())


def test_float64_reference_is_exact_enough():
    """The bench's float64 references differ from the correctly rounded ones by < 1e-6 of the
    statistical bound (bench/cases/statistical.py)."""
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(8, 16384, generator=g), torch.randn(16384, 8, generator=g)
    d = (a.double() @ b.double() - exact_matmul(a, b).double()).abs()
    assert bool((d <= 1e-6 * tn.tolerance("matmul", a, b, mode="statistical").abs).all())
    x = torch.randn(8, 128, generator=g) * 2
    for op, f in (("softmax", torch.softmax), ("log_softmax", torch.log_softmax)):
        d = (f(x.double(), -1) - getattr(ref, op)(x).double()).abs()
        assert bool((d <= 1e-6 * tn.tolerance(op, x, mode="statistical").abs).all())


def test_explain_and_bad_input():
    a = torch.randn(4, 8)
    b = tn.tolerance("matmul", a, a.T, mode="statistical", false_alarm=1e-3)
    assert b.mode == "statistical" and b.failure_probability == 1e-3
    assert "false-alarm rate <= 0.001" in b.explain() and "z=" in b.explain()
    assert false_alarm_factor(1e-6) == pytest.approx(math.sqrt(2 * math.log(2e6)))
    with pytest.raises(ValueError, match="not supported for op 'gelu'.*matmul"):
        tn.tolerance("gelu", a, mode="statistical")
    with pytest.raises(ValueError, match="false_alarm must be a number in"):
        tn.tolerance("matmul", a, a.T, mode="statistical", false_alarm=2.0)
    with pytest.raises(ValueError, match="false_alarm is the rate of mode='statistical'"):
        tn.tolerance("matmul", a, a.T, mode="probabilistic", false_alarm=1e-3)
    with pytest.raises(ValueError, match="mode must be one of"):
        tn.tolerance("matmul", a, a.T, mode="stats")
    with pytest.raises(ValueError, match="served by ttrace_num.tolerance"):
        from ttrace_num.bounds.matmul import matmul
        matmul(a, a.T, mode="statistical")
    with pytest.raises(ValueError, match="NaN or Inf"):
        tn.tolerance("sum", torch.tensor([1.0, math.nan]), mode="statistical")
    assert {"matmul", "linear", "bmm", "sum", "mean", "softmax", "log_softmax", "attention"} <= set(STATISTICAL_OPS)
    d = tn.difference("matmul", a, a.T, model_a={}, model_b={}, mode="statistical")
    assert d.mode == "statistical" and d.failure_probability == pytest.approx(2e-6)


@pytest.mark.parametrize("lq, lk, kw", [(8, 1100, {}), (64, 64, {"is_causal": True}), (16, 32, {"mask": True})])
def test_attention_online_blocks_and_masks(lq, lk, kw):
    """Three key blocks of torch's flash kernel (two rescalings), a causal mask, a boolean mask."""
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(1, 2, lq, 16, generator=g), torch.randn(1, 2, lk, 16, generator=g), \
        torch.randn(1, 2, lk, 16, generator=g)
    if kw.pop("mask", False):
        kw["attn_mask"] = torch.rand(lq, lk, generator=g) < 0.7
        kw["attn_mask"][:, 0] = True
    y = F.scaled_dot_product_attention(q, k, v, **kw)
    err = (y.double() - F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kw)).abs()
    b = tn.tolerance("attention", q, k, v, mode="statistical", **kw).abs
    assert bool((err <= b).all()) and float((b / err.clamp(min=1e-30)).min()) < 6


def test_matmul_holds_in_the_kernels_order():
    """The variance averaged over orders is not a bound for one order: products whose index-order
    partial sums climb to ~K/2 terms and back (positive terms first, then negative) make MKL's
    chain (index order at 8x8 outputs) ~K/2 times the average's variance. Before the index-order
    chain's own variance was taken (``_index_chain_variance``), 8x64x8: 66 of these 640 elements
    over the 1e-6 bound; after: none, at tightness < 4."""
    g = torch.Generator().manual_seed(6)
    sign = torch.where(torch.arange(64) < 32, 1.0, -1.0)
    over, tight = 0, []
    for _ in range(10):
        a = torch.rand(8, 64, generator=g).add(0.5) * sign
        b = torch.rand(64, 8, generator=g).add(0.5)
        err = (a @ b).double() - a.double() @ b.double()
        bound = tn.tolerance("matmul", a, b, mode="statistical").abs
        over += int((err.abs() > bound).sum())
        tight.append(float((bound / err.abs().clamp(min=1e-30)).min()))
    assert over == 0 and statistics.median(tight) < 4, (over, tight)


def test_aten_cascade_sum_is_the_kernels_order():
    """:func:`aten_cascade_sum` in fp32 reproduces torch's CPU sum bit for bit (lengths below one
    vector, tails, several cascade levels), under whichever dispatch this process runs."""
    f32 = lambda a, b: (a + b).float().double()  # noqa: E731
    g = torch.Generator().manual_seed(7)
    for n in (1, 5, 8, 33, 1000, 1024, 70000):
        x = torch.randn(3, n, generator=g)
        assert torch.equal(x.sum(-1).double(), aten_cascade_sum(x.double(), f32)), n


def test_sum_fp32_tight_on_torch_cascade():
    """torch.sum of 1024 fp32 terms: the unknown-order chain's variance was 13x loose (instance
    median tightness 13.4); the cascade tree's own variance: <= 4, rms error 0.6-1.0 sigma, no
    violation; a strided (non-contiguous) row keeps the chain."""
    g = torch.Generator().manual_seed(8)
    tight, over, ratio = [], 0, []
    for _ in range(30):
        x = torch.randn(32, 1024, generator=g)
        err = (x.sum(-1).double() - x.double().sum(-1)).abs()
        b = tn.tolerance("sum", x, dim=-1, mode="statistical")
        over += int((err > b.abs).sum())
        tight.append(float((b.abs / err.clamp(min=1e-30)).min()))
        ratio.append(err.square() / (b.abs / false_alarm_factor(1e-6)).square())
    rms = float(torch.cat(ratio).mean().sqrt())
    assert over == 0 and statistics.median(tight) <= 4 and 0.6 < rms < 1.0, (over, statistics.median(tight), rms)
    assert "cascade" in str(b.explanation.values["summation"])
    xt = torch.randn(1024, 32, generator=g).T
    assert "cascade" not in str(tn.tolerance("sum", xt, dim=-1, mode="statistical").explanation.values["summation"])
