"""sum / mean bounds against the exact reference (ttrace_num.reference.dot.exact_sum) for
the real torch CPU reductions and for emulations of the stated computation models."""
import math

import pytest
import torch
from scipy.stats import binomtest

import ttrace_num as tn
from ttrace_num.bounds.reduction import mean, sum_
from ttrace_num.bounds.summation import Summation
from ttrace_num.emulate import emulate_mean, emulate_sum
from ttrace_num.reference.dot import exact_sum
from ttrace_num.rounding import round_to

DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
P_TEST = 1e-2


def _gen(*key):
    return torch.Generator().manual_seed(hash(key) % 2**31)


def _data(kind: str, m: int, n: int, fmt: str, g: torch.Generator) -> torch.Tensor:
    if kind in ("normal", "long"):
        x = torch.randn(m, n, generator=g)
    elif kind == "positive":
        x = torch.rand(m, n, generator=g)
    elif kind == "cancel":  # pairs x, -x(1 + O(2^-6)): |sum| << sum |x|
        h = torch.randn(m, n // 2, generator=g)
        x = torch.cat([h, -h * (1 + 2.0 ** -6 * torch.randn(m, n // 2, generator=g))], dim=1)
    elif kind == "heavy":  # Student t(1.5) times lognormal
        x = torch.distributions.StudentT(1.5).sample((m, n)).clamp(-1e4, 1e4) * torch.exp(torch.randn(m, n, generator=g))
        if fmt == "fp16":
            x = x * (30000 / float(x.abs().sum(-1).max()))
    elif kind == "overflow":  # fp16 sums up to 0.9 * 65504
        x = 0.9 * 65504 / n * torch.rand(m, n, generator=g)
    elif kind == "peaked":  # one huge term per row, the rest tiny
        x = torch.randn(m, n, generator=g) * 2.0 ** -10
        x[:, 0] = 1000.0
    elif kind == "subnormal":
        x = torch.randn(m, n, generator=g) * (2.0 ** -130 if fmt != "fp16" else 2.0 ** -20)
    else:
        raise ValueError(kind)
    return round_to(x, fmt).to(DT[fmt])


def _violations(bound: torch.Tensor, computed: torch.Tensor, exact: torch.Tensor) -> tuple[int, float]:
    err = (computed.double() - exact).abs()
    b = torch.broadcast_to(bound, err.shape)
    nz = err > 0
    return int((err > b).sum()), (float((b[nz] / err[nz]).min()) if nz.any() else math.inf)


KINDS = {"normal": (64, 1024), "positive": (64, 1024), "cancel": (64, 1024), "heavy": (64, 1024),
         "overflow": (32, 1024), "peaked": (32, 1024), "subnormal": (32, 512), "long": (8, 16384)}


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_torch_sum_and_mean_within_bounds(fmt, kind):
    m, n = KINDS[kind]
    x = _data(kind, m, n, fmt, _gen("torch", fmt, kind))
    exact = exact_sum(x, -1)
    for op, computed, ex in (("sum", x.sum(-1), exact), ("mean", x.mean(-1), exact / n)):
        assert torch.isfinite(computed).all()
        for mode in ("deterministic", "probabilistic"):
            p = P_TEST if mode == "probabilistic" else None
            bound = tn.tolerance(op, x, dim=-1, mode=mode, failure_probability=p)
            viol, _ = _violations(bound.abs, computed, ex)
            if mode == "deterministic":
                assert viol == 0, (op, fmt, kind)
            else:
                assert binomtest(viol, m, P_TEST, alternative="greater").pvalue > 1e-3


def test_dim_and_keepdim():
    x = torch.randn(5, 300, 7, generator=_gen("dims")).to(torch.bfloat16)
    for dim in (0, 1, -1):
        for keepdim in (False, True):
            s = x.sum(dim, keepdim=keepdim)
            b = sum_(x, dim, keepdim)
            assert b.abs.shape == s.shape
            assert _violations(b.abs, s, exact_sum(x, dim, keepdim=keepdim))[0] == 0
            mb = mean(x, dim, keepdim)
            assert _violations(mb.abs, x.mean(dim, keepdim=keepdim), exact_sum(x, dim, keepdim=keepdim) / x.shape[dim])[0] == 0


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_low_precision_probabilistic_tightness_meets_the_target(fmt):
    """bf16/fp16 outputs of an fp32 accumulation: the output rounding half_ulp(|y|)
    dominates, the median instance tightness is <= 4."""
    tights = []
    for seed in range(7):
        x = _data("normal", 16, 2048, fmt, _gen("target", fmt, seed))
        for op, computed, ex in (("sum", x.sum(-1), exact_sum(x, -1)), ("mean", x.mean(-1), exact_sum(x, -1) / 2048)):
            tights.append(_violations(tn.tolerance(op, x, dim=-1, mode="probabilistic").abs, computed, ex)[1])
    assert sorted(tights)[len(tights) // 2] <= 4.0


MODELS = [  # (storage, summation, out)
    ("bf16", Summation(accum="bf16"), "bf16"),
    ("fp16", Summation(accum="fp16", algorithm="pairwise"), "fp16"),
    ("fp32", Summation(accum="fp32", algorithm="blocked", block=64), "fp32"),
    ("bf16", Summation(split=8, reduce_fmt="bf16"), "bf16"),
    ("fp16", Summation(accum="fp16", split=4, reduce_fmt="fp32", reduce_algorithm="pairwise"), "fp16"),
    ("fp32", Summation(accum="bf16"), "fp32"),  # accumulator narrower than the inputs
]


@pytest.mark.parametrize("storage,summ,out", MODELS, ids=lambda v: v.describe() if isinstance(v, Summation) else v)
@pytest.mark.parametrize("kind", ["normal", "positive", "cancel", "heavy", "peaked", "subnormal"])
def test_emulated_sum_and_mean_within_bounds(storage, summ, out, kind):
    n = 512
    x = _data(kind, 48, n, storage, _gen("emu", storage, summ.describe(), kind))
    exact = exact_sum(x, -1)
    for op, emu, ex, fn in (("sum", emulate_sum, exact, sum_), ("mean", emulate_mean, exact / n, mean)):
        computed = emu(x, -1, summ, out)
        assert torch.isfinite(computed).all()
        for mode in ("deterministic", "probabilistic"):
            p = P_TEST if mode == "probabilistic" else None
            bound = fn(x, -1, summation=summ, out_fmt=out, mode=mode, failure_probability=p)
            viol, _ = _violations(bound.abs, computed, ex)
            if mode == "deterministic":
                assert viol == 0, (op, mode)
            else:
                assert binomtest(viol, x.shape[0], P_TEST, alternative="greater").pvalue > 1e-3


def test_emulated_long_rows():
    x = _data("normal", 16, 16384, "fp16", _gen("long-emu"))
    exact = exact_sum(x, -1)
    for summ in (Summation(accum="fp16", algorithm="blocked", block=128), Summation(split=16, reduce_fmt="bf16")):
        y = emulate_sum(x, -1, summ, "fp16")
        for mode in ("deterministic", "probabilistic"):
            assert _violations(sum_(x, -1, summation=summ, mode=mode).abs, y, exact)[0] == 0


@pytest.mark.parametrize("claimed,computed", [
    (Summation(accum="fp32"), Summation(accum="bf16")),   # a wider compute format claimed
    (Summation(), Summation(split=4, reduce_fmt="bf16")),  # bf16 partials not declared
])
def test_wrong_models_are_caught(claimed, computed):
    x = _data("positive", 256, 1024, "bf16", _gen("wrong", computed.describe()))
    exact = exact_sum(x, -1)
    y = emulate_sum(x, -1, computed, "fp32")
    assert _violations(sum_(x, -1, summation=claimed, out_fmt="fp32").abs, y, exact)[0] > 0
    viol = _violations(sum_(x, -1, summation=claimed, out_fmt="fp32", mode="probabilistic",
                            failure_probability=P_TEST).abs, y, exact)[0]
    assert binomtest(viol, 256, P_TEST, alternative="greater").pvalue < 1e-3


def test_wrong_length_is_caught():
    """Stagnation (x_1 = 1, then terms just below half an ulp of 1) attains the bound of a
    recursive fp32 chain; the bound of a row half as long (n/2 terms) is violated."""
    n = 256
    x = torch.full((4, n), 2.0 ** -24 * (1 - 2.0 ** -8), dtype=torch.bfloat16)
    x[:, 0] = 1.0
    summ = Summation(accum="fp32")
    y = emulate_sum(x, -1, summ, "fp32")
    exact = exact_sum(x, -1)
    assert (y == 1.0).all()
    viol, tight = _violations(sum_(x, -1, summation=summ, out_fmt="fp32").abs, y, exact)
    assert viol == 0 and tight < 1.01
    half = sum_(x[:, : n // 2], -1, summation=summ, out_fmt="fp32")
    assert _violations(half.abs, y, exact)[0] == 4
