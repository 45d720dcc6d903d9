"""Softmax family bounds (ttrace_num.bounds.softmax) against the mpmath references of
ttrace_num.reference.ops, for the real torch CPU ops and for the emulated computation
models (ttrace_num.emulate.softmax), deterministic and probabilistic.

Every reference is mpmath (>= 40 digits, correctly rounded to float64); shapes are kept
moderate so that the whole file runs in well under 90 s on one core."""
from __future__ import annotations

import functools
import math

import mpmath
import pytest
import torch
import torch.nn.functional as F
from scipy.stats import binomtest

import ttrace_num as tn
from ttrace_num.bounds.softmax import nll_cascade_height, vocab_parallel_difference
from ttrace_num.bounds.summation import Summation
from ttrace_num.emulate.softmax import (emulate_cross_entropy, emulate_log_softmax, emulate_softmax,
                                        emulate_vocab_parallel_cross_entropy)
from ttrace_num.reference import ops as ref

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
P_TEST = 0.1  # failure probability used to give the binomial tests power


def _errors(computed: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|computed - exact|, 0 where both are NaN or the same infinity."""
    c, e = computed.to(torch.float64), exact.to(torch.float64)
    err = (c - e).abs()
    same = (torch.isnan(c) & torch.isnan(e)) | (torch.isinf(c) & (c == e))
    return torch.where(same, torch.zeros_like(err), err)


def _violations(computed, exact, bound) -> int:
    err = _errors(computed, exact)
    return int((err > torch.broadcast_to(bound.abs, err.shape)).sum())


def _check(computed, exact, det, prob) -> None:
    """0 deterministic violations; probabilistic violations consistent with the claim."""
    assert det.mode == "deterministic" and prob.mode == "probabilistic"
    assert _violations(computed, exact, det) == 0
    v = _violations(computed, exact, prob)
    n = computed.numel()
    assert binomtest(v, n, prob.failure_probability, alternative="greater").pvalue > 1e-3, (v, n)
    finite = torch.isfinite(det.abs)
    assert (prob.abs[finite] <= det.abs[finite] * (1 + 1e-12)).all()


# ----------------------------------------------------------------------------- data
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _data(kind: str, fmt: str, seed: int = 0) -> torch.Tensor:
    g = _gen(seed)
    rows, n = 16, 256
    x = torch.randn(rows, n, generator=g)
    if kind == "normal":
        x = 2 * x
    elif kind == "peaked":
        x[:, 5] += 1e3 if fmt != "fp16" else 6e4
        x[:8, 9] = x[:8, 5] - 95.0  # exp underflows into fp32's subnormal range
    elif kind == "flat":
        x = torch.full((rows, n), 3.0)
    elif kind == "masked":
        x[:, ::3] = -math.inf
        x[0] = -math.inf  # fully masked row: NaN in torch and in the reference
    elif kind == "spread":
        scale = 1e4 if fmt != "fp16" else 3e4
        x = (torch.rand(rows, n, generator=g) * 2 - 1) * scale
        top = x.max(1, keepdim=True).values
        x[:, :40] = top - torch.rand(rows, 40, generator=g) * 8
    elif kind == "heavy":
        x = torch.distributions.StudentT(1.5).sample((rows, n)) * 3
    else:
        raise ValueError(kind)
    return x.to(DTYPES[fmt])


@functools.lru_cache(maxsize=None)
def _ref(op: str, kind: str, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    x = _data(kind, fmt)
    return x, (ref.softmax(x) if op == "softmax" else ref.log_softmax(x))


def _run(op: str, impl: str, x: torch.Tensor, **kw) -> torch.Tensor:
    if impl == "torch":
        return (torch.softmax if op == "softmax" else torch.log_softmax)(x, -1)
    return (emulate_softmax if op == "softmax" else emulate_log_softmax)(x, **kw)


# ------------------------------------------------------------------ the exp/log error model
def _ulp_err(v: torch.Tensor, exact: list) -> float:
    """max |v - exact| in fp32 ulps of the exact value."""
    worst = 0.0
    for a, e in zip(v.tolist(), exact):
        ulp = 2.0 ** (math.frexp(e)[1] - 24) if e else 2.0 ** -149
        worst = max(worst, abs(a - e) / max(ulp, 2.0 ** -149))
    return worst


def test_exp_and_log_error_model():
    """exp_ulps = log_ulps = 1 (the defaults) on this machine, against mpmath: the exp used
    inside torch.softmax (read back exactly from rows [0, t], t < -17.4, where the fp32
    row sum is 1), torch.exp near 0, and the log of torch.log_softmax (rows of n zeros:
    output -log(n), the sum n being exact)."""
    g = _gen(1)
    t = -(torch.rand(3000, generator=g, dtype=torch.float64) * (87.3 - 17.5) + 17.5).float()
    inner = torch.softmax(torch.stack([torch.zeros_like(t), t], 1), 1)[:, 1]
    mpmath.mp.dps = 30
    exact = [float(mpmath.exp(mpmath.mpf(float(v)))) for v in t.tolist()]
    assert _ulp_err(inner.double(), exact) <= 1.0
    t2 = -(torch.rand(2000, generator=g) * 17.5)
    exact2 = [float(mpmath.exp(mpmath.mpf(float(v)))) for v in t2.tolist()]
    assert _ulp_err(torch.exp(t2).double(), exact2) <= 1.0
    ns = [2, 3, 5, 7, 10, 100, 255, 1000, 1023, 4097, 16384]
    outs = torch.stack([torch.log_softmax(torch.zeros(1, n), 1)[0, 0] for n in ns])
    exact3 = [float(-mpmath.log(n)) for n in ns]
    assert _ulp_err(outs.double(), exact3) <= 1.0


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_torch_cpu_matches_the_stated_model(fmt):
    """torch CPU bf16/fp16 softmax = fp32 computation rounded once; log_softmax keeps the
    row sum and its log in the storage dtype (stats_fmt default); cross entropy follows.
    Agreement is bitwise except for rare 1-ulp differences from torch's (non correctly
    rounded) exp; the alternative stats_fmt=fp32 model disagrees on ~5% of the entries."""
    x = _data("normal", fmt, seed=3)
    t = torch.randint(0, x.shape[1], (x.shape[0],), generator=_gen(3))
    pairs = [(torch.softmax(x, -1), emulate_softmax(x)), (torch.log_softmax(x, -1), emulate_log_softmax(x))]
    for red in ("none", "mean"):
        pairs.append((F.cross_entropy(x, t, reduction=red, label_smoothing=0.1),
                      emulate_cross_entropy(x, t, red, 0.1)))
    for a, b in pairs:
        assert (a.double() == b).double().mean() >= 0.99
        assert (a.double() - b).abs().max() <= tn.get_format(fmt).eps
    alt = emulate_log_softmax(x, stats_fmt="fp32")
    assert (torch.log_softmax(x, -1).double() == alt).double().mean() < 0.99


# --------------------------------------------------------------------- softmax / log_softmax
@pytest.mark.parametrize("fmt", list(DTYPES))
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("kind", ["normal", "peaked", "flat", "masked", "spread", "heavy"])
@pytest.mark.parametrize("impl", ["torch", "emulated"])
def test_bound_holds(fmt, op, kind, impl):
    x, exact = _ref(op, kind, fmt)
    computed = _run(op, impl, x)
    det = tn.tolerance(op, x)
    prob = tn.tolerance(op, x, mode="probabilistic", failure_probability=P_TEST)
    _check(computed, exact, det, prob)
    if kind == "masked":
        assert torch.isinf(det.abs[0]).all()  # fully masked row: no finite claim (NaN result)
        assert (det.abs[1:, ::3] == 0).all()  # masked entries are exact
    if kind == "peaked" and op == "softmax" and fmt == "fp32":
        tiny = exact[:8, 9]
        assert (tiny > 0).all() and (tiny < 2.0 ** -126).all()  # subnormal outputs exercised
        assert (det.abs[:8, 9] < 2.0 ** -120).all()


def test_tightness_on_random_data():
    """Median tightness on random normal rows: bf16/fp16 outputs are dominated by the output
    rounding (tightness ~1); fp32 is dominated by the denominator's summation bound."""
    for fmt, limit in (("bf16", 2.0), ("fp16", 2.0), ("fp32", 20.0)):
        x, exact = _ref("softmax", "normal", fmt)
        prob = tn.tolerance("softmax", x, mode="probabilistic")
        err = _errors(torch.softmax(x, -1), exact)
        ratios = [float((prob.abs[i][err[i] > 0] / err[i][err[i] > 0]).min()) for i in range(x.shape[0])]
        assert sorted(ratios)[len(ratios) // 2] <= limit, (fmt, ratios)


@pytest.mark.parametrize("compute", ["bf16", "fp16"])
@pytest.mark.parametrize("alg", ["recursive", "pairwise"])
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_low_precision_compute_emulation(compute, alg, op):
    x, exact = _ref(op, "normal", "fp32")
    x = x[:, :64]
    exact = ref.softmax(x) if op == "softmax" else ref.log_softmax(x)
    summ = Summation(accum=tn.get_format(compute), algorithm=alg)
    computed = _run(op, "emulated", x, compute_fmt=compute, summation=summ)
    kw = dict(compute_fmt=compute, summation=summ)
    det = tn.tolerance(op, x, **kw)
    prob = tn.tolerance(op, x, mode="probabilistic", failure_probability=P_TEST, **kw)
    _check(computed, exact, det, prob)
    assert torch.isfinite(prob.abs).all()


def test_divide_variant_and_gpu_stats():
    x, exact = _ref("softmax", "normal", "bf16")
    y = emulate_softmax(x, division="divide")
    assert _violations(y, exact, tn.tolerance("softmax", x, division="divide")) == 0
    x, exact = _ref("log_softmax", "normal", "bf16")
    y = emulate_log_softmax(x, stats_fmt="fp32")
    assert _violations(y, exact, tn.tolerance("log_softmax", x, stats_fmt="fp32")) == 0


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_long_rows(op):
    g = _gen(7)
    x = torch.randn(2, 16384, generator=g) * 3
    exact = ref.softmax(x) if op == "softmax" else ref.log_softmax(x)
    det = tn.tolerance(op, x)
    prob = tn.tolerance(op, x, mode="probabilistic", failure_probability=P_TEST)
    _check(_run(op, "torch", x), exact, det, prob)
    _check(_run(op, "emulated", x), exact, det, prob)


def test_wrong_model_is_caught():
    """Emulating bf16 accumulation (pairwise) but claiming the fp32 default is violated, and
    so is a bf16 softmax whose bound forgets the output rounding (out_fmt=fp32)."""
    x, exact = _ref("softmax", "normal", "fp32")
    summ = Summation(accum=tn.get_format("bf16"), algorithm="pairwise")
    y = emulate_softmax(x, compute_fmt="bf16", summation=summ)
    assert _violations(y, exact, tn.tolerance("softmax", x)) > 0
    assert _violations(y, exact, tn.tolerance("softmax", x, compute_fmt="bf16", summation=summ)) == 0
    xb, exact_b = _ref("softmax", "normal", "bf16")
    assert _violations(torch.softmax(xb, -1), exact_b, tn.tolerance("softmax", xb, out_fmt="fp32")) > 0


# ------------------------------------------------------------------------- cross entropy
@functools.lru_cache(maxsize=None)
def _ce_data(fmt: str):
    g = _gen(11)
    x = (torch.randn(16, 200, generator=g) * 2).to(DTYPES[fmt])
    t = torch.randint(0, 200, (16,), generator=g)
    t[3] = -100  # ignored row
    return x, t


@pytest.mark.parametrize("fmt", list(DTYPES))
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("ls", [0.0, 0.1])
def test_cross_entropy(fmt, reduction, ls):
    x, t = _ce_data(fmt)
    exact = ref.cross_entropy(x, t, reduction=reduction, label_smoothing=ls)
    det = tn.tolerance("cross_entropy", x, t, reduction=reduction, label_smoothing=ls)
    prob = tn.tolerance("cross_entropy", x, t, reduction=reduction, label_smoothing=ls,
                        mode="probabilistic", failure_probability=P_TEST)
    for computed in (F.cross_entropy(x, t, reduction=reduction, label_smoothing=ls),
                     emulate_cross_entropy(x, t, reduction, ls)):
        _check(computed, exact, det, prob)
    if reduction == "none":
        assert det.abs[3] == 0  # ignored sample: exactly 0


def test_cross_entropy_masked_logits():
    x, t = _ce_data("fp32")
    x = x.clone()
    x[:, 50:60] = -math.inf
    t = torch.where((t >= 50) & (t < 60), t + 20, t)
    t[0] = 55  # masked target: loss +inf
    exact = ref.cross_entropy(x, t, reduction="none")
    det = tn.tolerance("cross_entropy", x, t, reduction="none")
    assert _violations(F.cross_entropy(x, t, reduction="none"), exact, det) == 0
    assert math.isinf(float(det.abs[0])) and torch.isfinite(det.abs[1:]).all()
    smooth = tn.tolerance("cross_entropy", x, t, reduction="none", label_smoothing=0.1)
    assert torch.isinf(smooth.abs[t != -100]).all()  # label smoothing over masked classes: +inf


def test_nll_cascade_height():
    assert nll_cascade_height([]) == 0 and nll_cascade_height([0]) == 0
    for n in (2, 15, 16, 17, 100, 257, 4096, 5000):
        h = nll_cascade_height(list(range(n)))
        assert math.ceil(math.log2(n)) <= h <= 15 + math.ceil(n / 16) + 8


# --------------------------------------------------------------------- vocab parallel
@functools.lru_cache(maxsize=None)
def _vp_data():
    g = _gen(5)
    x = torch.randn(16, 1000, generator=g) * 2
    t = torch.randint(0, 1000, (16,), generator=g)
    return x, t, ref.cross_entropy(x, t, reduction="none")


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("rf", ["fp32", "bf16"])
def test_vocab_parallel_cross_entropy(tp, rf):
    x, t, exact = _vp_data()
    vp = emulate_vocab_parallel_cross_entropy(x, t, tp=tp, reduce_fmt=rf)
    kw = dict(tp=tp, reduce_fmt=rf)
    _check(vp, exact, tn.tolerance("vocab_parallel_cross_entropy", x, t, **kw),
           tn.tolerance("vocab_parallel_cross_entropy", x, t, mode="probabilistic", failure_probability=P_TEST, **kw))
    # difference to the single-device computation: same algorithm and exp ...
    single = emulate_vocab_parallel_cross_entropy(x, t, tp=1)
    _check(vp, single, vocab_parallel_difference(x, t, same_exp=True, **kw),
           vocab_parallel_difference(x, t, same_exp=True, mode="probabilistic", failure_probability=P_TEST, **kw))
    # ... and torch's own fp32 cross entropy (another exp and summation tree)
    _check(vp, F.cross_entropy(x, t, reduction="none"), vocab_parallel_difference(x, t, **kw),
           vocab_parallel_difference(x, t, mode="probabilistic", failure_probability=P_TEST, **kw))


def test_vocab_parallel_difference_bf16_logits_and_wrong_model():
    x, t, _ = _vp_data()
    xb = x.to(torch.bfloat16)
    vp = emulate_vocab_parallel_cross_entropy(xb, t, tp=4, reduce_fmt="bf16")
    torch_ce = F.cross_entropy(xb, t, reduction="none")
    d = vocab_parallel_difference(xb, t, tp=4, reduce_fmt="bf16", single_stats_fmt="bf16", single_out_fmt="bf16")
    assert _violations(vp, torch_ce, d) == 0
    # claiming an fp32 all-reduce while it ran in bf16 is caught
    exact = _vp_data()[2]
    vp32 = emulate_vocab_parallel_cross_entropy(x, t, tp=4, reduce_fmt="bf16")
    assert _violations(vp32, exact, tn.tolerance("vocab_parallel_cross_entropy", x, t, tp=4)) > 0
    assert _violations(vp32, exact, tn.tolerance("vocab_parallel_cross_entropy", x, t, tp=4, reduce_fmt="bf16")) == 0


def test_registered_and_explained():
    for op in ("softmax", "log_softmax", "cross_entropy", "vocab_parallel_cross_entropy"):
        assert op in tn.ops()
    x, _ = _ref("softmax", "normal", "bf16")
    text = tn.tolerance("log_softmax", x, mode="probabilistic").explain()
    for needle in ("Blanchard", "lambda=", "stored in bf16", "exp within 1 ulp"):
        assert needle in text
