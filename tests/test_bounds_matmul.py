"""matmul / bmm / linear bounds and the split-K difference bound, against the exact
reference (ttrace_num.reference.dot.exact_matmul, correctly rounded) for the real torch
CPU kernels and for emulations of the stated computation models."""
import math

import pytest
import torch
import torch.nn.functional as F
from scipy.stats import binomtest

import ttrace_num as tn
from ttrace_num.bounds.matmul import linear, matmul, matmul_difference
from ttrace_num.bounds.summation import Summation
from ttrace_num.emulate import emulate_matmul
from ttrace_num.reference.dot import exact_matmul
from ttrace_num.rounding import round_to

DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
P_TEST = 1e-2  # failure probability used in tests (power for the binomial test)


def _gen(*key):
    return torch.Generator().manual_seed(hash(key) % 2**31)


def _data(kind: str, m: int, k: int, n: int, fmt: str, g: torch.Generator):
    """(a, b) float64 values on fmt's grid (kept in fmt's dtype when torch has one)."""
    if kind == "normal":
        a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    elif kind == "positive":
        a, b = torch.rand(m, k, generator=g), torch.rand(k, n, generator=g)
    elif kind == "cancel":  # second half of K cancels the first half up to 2**-8
        h = torch.randn(m, k // 2, generator=g)
        bh = torch.randn(k // 2, n, generator=g)
        a = torch.cat([h, h], dim=1)
        b = torch.cat([bh, -bh * (1 + 2.0 ** -8 * torch.randn(k // 2, n, generator=g))], dim=0)
    elif kind == "heavy":  # Student t (df 1.5) times lognormal magnitudes
        t = torch.distributions.StudentT(1.5)
        a = t.sample((m, k)).clamp(-1e3, 1e3) * torch.exp(torch.randn(m, k, generator=g))
        b = t.sample((k, n)).clamp(-1e3, 1e3)
    elif kind == "overflow":  # |products| up to 0.9 * 65504 / K: fp16 outputs near the top
        r = math.sqrt(0.9 * 65504 / k)
        a, b = r * torch.rand(m, k, generator=g), r * torch.rand(k, n, generator=g)
    elif kind == "subnormal":  # products in the subnormal range of fp32 (bf16/fp32) or fp16 inputs
        e = -70 if fmt in ("fp32", "bf16") else -8
        a = torch.randn(m, k, generator=g) * 2.0 ** e
        b = torch.randn(k, n, generator=g) * 2.0 ** e
    else:
        raise ValueError(kind)
    top = tn.get_format(fmt).max / 2  # no overflow to NaN in the FP8 formats
    a, b = round_to(a.clamp(-top, top), fmt), round_to(b.clamp(-top, top), fmt)
    s = float((a.abs() @ b.abs()).max())
    if fmt == "fp16" and s > 65504:  # heavy tails: scale by a power of two below fp16's top
        a = round_to(a * 2.0 ** -math.ceil(math.log2(s / 32768)), fmt)
    dt = DT.get(fmt)
    return (a.to(dt), b.to(dt)) if dt is not None else (a.float(), b.float())


def _stats(bound: torch.Tensor, computed: torch.Tensor, exact: torch.Tensor) -> tuple[int, float, float]:
    """(violations, instance tightness min_i b/err, median per-element tightness)."""
    err = (computed.double() - exact).abs()
    b = torch.broadcast_to(bound, err.shape)
    nz = err > 0
    r = b[nz] / err[nz]
    return int((err > b).sum()), (float(r.min()) if nz.any() else math.inf), (float(r.median()) if nz.any() else math.inf)


def _torch_op(fmt: str):
    """The real CPU kernel: torch.matmul, or F.linear for fp16 (fp16 mm is ~100x slow on CPU)."""
    if fmt == "fp16":
        return lambda a, b: F.linear(a, b.transpose(-1, -2).contiguous())
    return torch.matmul


# ------------------------------------------------------------------ real torch kernels
SHAPES = {"normal": (24, 2048, 24), "positive": (24, 2048, 24), "cancel": (24, 2048, 24),
          "heavy": (24, 1024, 24), "overflow": (16, 1024, 16), "subnormal": (16, 512, 16),
          "long": (8, 16384, 8)}


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("kind", list(SHAPES))
def test_torch_matmul_within_bounds(fmt, kind):
    m, k, n = SHAPES[kind]
    g = _gen("torch", fmt, kind)
    a, b = _data("normal" if kind == "long" else kind, m, k, n, fmt, g)
    y = _torch_op(fmt)(a, b)
    exact = exact_matmul(a, b)
    assert torch.isfinite(y).all()
    for mode in ("deterministic", "probabilistic"):
        bound = tn.tolerance("matmul", a, b, mode=mode, failure_probability=P_TEST if mode == "probabilistic" else None)
        viol, tight, _ = _stats(bound.abs, y, exact)
        if mode == "deterministic":
            assert viol == 0, (fmt, kind)
        else:
            assert binomtest(viol, exact.numel(), P_TEST, alternative="greater").pvalue > 1e-3
        assert tight >= 1.0 or viol > 0


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_batched_broadcast_and_transposed_inputs(fmt):
    g = _gen("bmm", fmt)
    dt = DT[fmt]
    a = torch.randn(2, 3, 8, 512, generator=g).to(dt)
    b = torch.randn(3, 512, 12, generator=g).to(dt)
    at = torch.randn(2, 3, 512, 8, generator=g).to(dt).transpose(-1, -2)  # non-contiguous
    bt = torch.randn(3, 12, 512, generator=g).to(dt).transpose(-1, -2)
    for x, w in ((a, b), (at, bt), (a[0], bt)):
        y = torch.matmul(x, w)
        exact = exact_matmul(x, w)
        bound = tn.tolerance("bmm" if x.dim() == 3 and w.dim() == 3 else "matmul", x, w)
        assert bound.abs.shape == y.shape
        assert _stats(bound.abs, y, exact)[0] == 0
    y = torch.bmm(a[0], b)
    assert _stats(matmul(a[0], b).abs, y, exact_matmul(a[0], b))[0] == 0


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16"])
def test_linear_with_bias(fmt):
    g = _gen("linear", fmt)
    dt = DT[fmt]
    x = torch.randn(4, 16, 768, generator=g).to(dt)
    w = torch.randn(96, 768, generator=g).to(dt)
    bias = (10 * torch.randn(96, generator=g)).to(dt)
    y = F.linear(x, w, bias)
    exact = exact_matmul(torch.cat([x.double(), torch.ones(4, 16, 1, dtype=torch.float64)], -1),
                         torch.cat([w.double(), bias.double()[:, None]], -1).T)
    for mode in ("deterministic", "probabilistic"):
        bound = tn.tolerance("linear", x, w, bias, mode=mode)
        assert _stats(bound.abs, y, exact)[0] == 0, mode
    assert "n=769" in linear(x, w, bias).explain()  # the bias is the K+1-th term


def test_bf16_probabilistic_tightness_meets_the_target():
    """bf16 outputs: the output rounding half_ulp(|y|) dominates, the median instance
    tightness (min over an instance's elements of bound/err) is <= 4."""
    tights = []
    for seed in range(6):
        a, b = _data("normal", 32, 1024, 32, "bf16", _gen("target", seed))
        bound = tn.tolerance("matmul", a, b, mode="probabilistic")
        tights.append(_stats(bound.abs, a @ b, exact_matmul(a, b))[1])
    assert sorted(tights)[len(tights) // 2] <= 4.0


# ------------------------------------------------------------------ emulated models
E_MODELS = [  # (storage, summation, out)
    ("fp32", Summation(), "fp32"),                                                 # products rounded
    ("bf16", Summation(accum="bf16", algorithm="pairwise"), "bf16"),
    ("fp16", Summation(accum="fp16", algorithm="blocked", block=32), "fp16"),      # fp16 accumulation
    ("bf16", Summation(accum="fp32", split=4, reduce_fmt="bf16"), "bf16"),        # TP + bf16 all-reduce
    ("bf16", Summation(accum="fp32", split=8, reduce_fmt="fp32", reduce_algorithm="pairwise"), "bf16"),
    ("fp16", Summation(accum="fp16", split=4, reduce_fmt="fp32"), "fp32"),
    ("e4m3", Summation(accum="fp32", algorithm="blocked", block=16), "bf16"),     # FP8 storage
    ("e5m2", Summation(accum="fp32", split=2, reduce_fmt="bf16"), "bf16"),
]


@pytest.mark.parametrize("storage,summ,out", E_MODELS, ids=lambda v: v.describe() if isinstance(v, Summation) else v)
@pytest.mark.parametrize("kind", ["normal", "positive", "cancel", "heavy", "subnormal"])
def test_emulated_models_within_bounds(storage, summ, out, kind):
    g = _gen("emu", storage, summ.describe(), kind)
    a, b = _data(kind, 12, 256, 12, storage, g)
    y = emulate_matmul(a, b, summ, out)
    exact = exact_matmul(a, b)
    for mode in ("deterministic", "probabilistic"):
        bound = matmul(a, b, fmt=storage, out_fmt=out, summation=summ, mode=mode,
                       failure_probability=P_TEST if mode == "probabilistic" else None)
        viol = _stats(bound.abs, y, exact)[0]
        if mode == "deterministic":
            assert viol == 0
        else:
            assert binomtest(viol, y.numel(), P_TEST, alternative="greater").pvalue > 1e-3


def test_emulated_long_sums():
    g = _gen("long")
    a, b = _data("normal", 4, 16384, 4, "bf16", g)
    exact = exact_matmul(a, b)
    for summ, out in ((Summation(), "bf16"), (Summation(algorithm="pairwise", accum="bf16"), "bf16"),
                      (Summation(split=16, reduce_fmt="bf16"), "bf16")):
        y = emulate_matmul(a, b, summ, out)
        for mode in ("deterministic", "probabilistic"):
            assert _stats(matmul(a, b, out_fmt=out, summation=summ, mode=mode).abs, y, exact)[0] == 0


def test_bound_is_nearly_attained_on_positive_data_in_low_precision():
    """Recursive bf16 accumulation of positive products: x_1 = 1, then K-1 products just
    below half an ulp of the running sum stagnate; the deterministic bound is attained up
    to 1 + O(K u). On uniform positive data the probabilistic bound is within a small
    factor (the rounding errors all multiply partial sums ~S_v)."""
    k, u = 32, 2.0 ** -8
    a = torch.full((1, k), u * (1 - 2.0 ** -7), dtype=torch.bfloat16)
    a[0, 0] = 1.0
    b = torch.ones(k, 1, dtype=torch.bfloat16)
    summ = Summation(accum="bf16")
    y = emulate_matmul(a, b, summ, "fp32")
    viol, tight, _ = _stats(matmul(a, b, out_fmt="fp32", summation=summ).abs, y, exact_matmul(a, b))
    t = u * (1 - 2.0 ** -7)  # bf16 products need rounding in bf16: depth K (products + chain)
    assert viol == 0 and tight == pytest.approx(((1 + u) ** k - 1) * (1 + (k - 1) * t) / ((k - 1) * t), rel=1e-5)
    assert tight < 1.25
    a, b = _data("positive", 64, 128, 64, "bf16", _gen("pos-prob"))
    y = emulate_matmul(a, b, summ, "fp32")
    # lambda(0.1) = 2.45; the remaining factor ~sqrt(3) sqrt(6) is S_v vs the partial sums
    # ~S_v/2 on average along the chain, and |delta| <= u vs its typical size u/sqrt(6)
    bound = matmul(a, b, out_fmt="fp32", summation=summ, mode="probabilistic", failure_probability=0.1)
    viol, tight, _ = _stats(bound.abs, y, exact_matmul(a, b))
    assert binomtest(viol, y.numel(), 0.1, alternative="greater").pvalue > 1e-3 and tight < 6


@pytest.mark.parametrize("claimed,computed,storage,out", [
    # the tolerance of a wider compute format than the one really used
    (Summation(accum="fp32"), Summation(accum="bf16"), "bf16", "fp32"),
    (Summation(accum="fp32"), Summation(accum="fp16"), "fp16", "fp32"),
    # split=1 claimed for a computation that reduces its partials in bf16
    (Summation(), Summation(split=4, reduce_fmt="bf16"), "fp32", "fp32"),
])
def test_wrong_models_are_caught(claimed, computed, storage, out):
    a, b = _data("normal", 32, 512, 32, storage, _gen("wrong", computed.describe()))
    y = emulate_matmul(a, b, computed, out)
    exact = exact_matmul(a, b)
    viol = _stats(matmul(a, b, fmt=storage, out_fmt=out, summation=claimed).abs, y, exact)[0]
    assert viol > 0
    pviol = _stats(matmul(a, b, fmt=storage, out_fmt=out, summation=claimed, mode="probabilistic",
                          failure_probability=P_TEST).abs, y, exact)[0]
    assert binomtest(pviol, y.numel(), P_TEST, alternative="greater").pvalue < 1e-3


def test_real_tensor_parallel_split_is_caught_by_a_split1_model():
    """4 bf16 partial matmuls all-reduced in bf16 vs the bound of one bf16 matmul."""
    a, b = _data("normal", 32, 2048, 32, "bf16", _gen("tp-wrong"))
    y = _tp(a, b, 4, torch.bfloat16)
    exact = exact_matmul(a, b)
    assert _stats(tn.tolerance("matmul", a, b).abs, y, exact)[0] > 0
    right = tn.tolerance("matmul", a, b, summation=Summation(split=4, reduce_fmt="bf16"))
    assert _stats(right.abs, y, exact)[0] == 0


# ------------------------------------------------------------------ difference bounds
def _tp(a, b, k, reduce_dtype):
    """Row-parallel linear: k matmuls over contiguous K-slices (outputs in a's dtype, or
    fp32 when the partials are reduced in fp32), summed in order in reduce_dtype."""
    ks = a.shape[-1] // k
    if reduce_dtype == torch.float32:
        parts = [a[..., i * ks:(i + 1) * ks].float() @ b[i * ks:(i + 1) * ks].float() for i in range(k)]
    else:
        parts = [a[..., i * ks:(i + 1) * ks] @ b[i * ks:(i + 1) * ks] for i in range(k)]
    acc = parts[0].to(reduce_dtype)
    for p in parts[1:]:
        acc = acc + p.to(reduce_dtype)
    return acc.to(a.dtype)


@pytest.mark.parametrize("fmt,reduce", [("bf16", "bf16"), ("bf16", "fp32"), ("fp32", "fp32"), ("fp32", "bf16")])
@pytest.mark.parametrize("k", [2, 4])
def test_difference_single_vs_tensor_parallel_real(fmt, reduce, k):
    """One torch matmul vs k torch matmuls over K-slices summed in reduce's dtype (a
    row-parallel linear and its all-reduce): 0 violations, and never looser than the sum
    of the two single bounds (at half the failure probability each in probabilistic mode,
    i.e. with the same total failure probability)."""
    a, b = _data("normal", 32, 2048, 32, fmt, _gen("tp", fmt, reduce, k))
    single = a @ b
    tp = _tp(a, b, k, DT[reduce])
    diff = (single.double() - tp.double()).abs()
    model_b = Summation(split=k, reduce_fmt=reduce)
    for mode, p in (("deterministic", None), ("probabilistic", P_TEST)):
        d = matmul_difference(a, b, model_a=Summation(), model_b=model_b, mode=mode, failure_probability=p)
        assert int((diff > d.abs).sum()) == 0, mode
        kw = dict(mode=mode, failure_probability=None if p is None else p / 2)
        both = matmul(a, b, **kw).abs + matmul(a, b, summation=model_b, **kw).abs
        assert (d.abs <= both * (1 + 1e-12)).all()


def test_difference_of_emulated_pairs_with_known_orders():
    """An unsplit recursive chain vs the same chain split into 4 parts reduced in bf16
    (both orders known: the first part's chain is shared and cancels)."""
    a, b = _data("normal", 24, 1024, 24, "fp32", _gen("emu-diff"))
    ma, mb = Summation(known_order=True), Summation(split=4, reduce_fmt="bf16", known_order=True)
    ya, yb = emulate_matmul(a, b, ma, "fp32"), emulate_matmul(a, b, mb, "fp32")
    diff = (ya - yb).abs()
    for mode in ("deterministic", "probabilistic"):
        kw = dict(mode=mode, failure_probability=P_TEST if mode == "probabilistic" else None)
        d = matmul_difference(a, b, model_a=ma, model_b=mb, **kw)
        assert int((diff > d.abs).sum()) == 0
        unknown = matmul_difference(a, b, model_a=Summation(), model_b=Summation(split=4, reduce_fmt="bf16"), **kw)
        assert (d.abs <= unknown.abs).all()
        if mode == "deterministic":  # (probabilistic: the bf16 reduction dominates in quadrature)
            assert d.abs.sum() < unknown.abs.sum()
    # same parts, reduction in bf16 vs fp32: only the reductions differ
    mc = Summation(split=4, known_order=True)
    yc = emulate_matmul(a, b, mc, "fp32")
    d = matmul_difference(a, b, model_a=mc, model_b=mb)
    assert int(((yc - yb).abs() > d.abs).sum()) == 0
    assert d.max() < matmul_difference(a, b, model_a=ma, model_b=mb).max()


def test_identical_computations():
    a, b = _data("normal", 16, 1024, 16, "fp32", _gen("same"))
    k = Summation(known_order=True)
    assert matmul_difference(a, b, model_a=k, model_b=k).max() == 0.0
    assert torch.equal(emulate_matmul(a, b, k, "fp32"), emulate_matmul(a, b, k, "fp32"))
    # the same torch call is deterministic: bitwise equal
    assert torch.equal(a @ b, a @ b)
    # but an unknown order may depend on the shapes / layout (MKL picks other kernels):
    # two computations of the same unknown-order model are bounded as independent ones
    col = a @ b[:, :1].contiguous()
    d = matmul_difference(a, b[:, :1], model_a=Summation(), model_b=Summation())
    assert d.max() > 0
    assert ((col - (a @ b)[:, :1]).abs().double() <= d.abs).all()


@pytest.mark.parametrize("mode", ["deterministic", "probabilistic"])
def test_difference_with_an_inner_dimension_of_one(mode):
    """K = 1 (an outer product, e.g. a weight gradient over one token): no summation level
    differs between the models, only the output roundings; the bound is a tensor that covers
    them (it crashed on the float 0 of the empty levels)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 1, generator=g).bfloat16(), torch.randn(1, 3, generator=g).bfloat16()
    d = matmul_difference(a, b, model_a=Summation(), model_b=Summation(split=2, reduce_fmt="bf16"), mode=mode)
    exact = a.double() @ b.double()
    assert d.abs.shape == (4, 3) and bool((d.abs >= (exact - (a @ b).double()).abs()).all())


def test_split_partials_that_overflow_fp16_give_an_infinite_bound():
    """Split-K with fp16 partials: the first part's partial sum (7e4) overflows fp16 to inf
    while the exact result (6e4) is finite; the bound must be inf there (it was finite)."""
    a = torch.ones(2, 4, dtype=torch.float16)
    a[1] /= 16
    b = torch.tensor([[35000.0], [35000.0], [-5000.0], [-5000.0]], dtype=torch.float16)
    summ = Summation(split=2, reduce_fmt="fp16")
    got = emulate_matmul(a, b, summ, "fp16")
    exact = exact_matmul(a, b)
    assert math.isinf(got[0, 0].item()) and math.isfinite(got[1, 0].item())
    for mode in ("deterministic", "probabilistic"):
        bd = matmul(a, b, summation=summ, mode=mode).abs
        assert math.isinf(bd[0, 0].item()) and math.isfinite(bd[1, 0].item())
        assert bool(((got - exact).abs() <= bd).all())


@pytest.mark.parametrize("case", ["subnormal_products", "subnormal_inputs"])
def test_default_bound_covers_a_flush_to_zero_gemm(case):
    """An FTZ/DAZ GEMM (AVX512-BF16 ``vdpbf16ps``, tensor cores), emulated: products, partial
    sums and results below fp32's normal range flushed, bf16 subnormal inputs read as 0. The
    gradual-underflow bound (the default before) is violated; the default (ftz) bound holds."""
    g = _gen("ftz", case)
    if case == "subnormal_products":  # bf16 normals whose products lie in fp32's subnormal range
        a = (torch.randn(16, 64, generator=g) * 2.0 ** -65).bfloat16()
        b = (torch.randn(64, 8, generator=g) * 2.0 ** -65).bfloat16()
    else:  # bf16 subnormals (read as 0) times large values: normal products dropped
        a = (torch.randn(16, 8, generator=g) * 2.0 ** -130).bfloat16()
        b = (torch.randn(8, 8, generator=g) * 2.0 ** 10).bfloat16()
    exact = exact_matmul(a, b)
    got = emulate_matmul(a, b, Summation(ftz=True), "bf16")
    err = (got - exact).abs()
    old = matmul(a, b, summation=Summation()).abs
    assert int((err > old).sum()) > err.numel() // 2
    for mode in ("deterministic", "probabilistic"):
        assert int((err > matmul(a, b, mode=mode).abs).sum()) == 0, mode


def test_flush_to_zero_leaves_normal_bf16_fp16_tightness_unchanged():
    """No subnormal input, no result near 0: the FTZ terms (``n 2^-126``) change nothing. (A
    subnormal fp16 input, 1 in 2e4 of randn values, adds its dropped products to the elements
    it touches: ``daz_term``; an output that may be an fp16 subnormal, |y| below ~6e-5 plus its
    error, rightly takes the output's flush term: such elements are left out.)"""
    g = _gen("ftz-tight")
    for dt in (torch.bfloat16, torch.float16):
        a, b = torch.randn(32, 256, generator=g), torch.randn(256, 32, generator=g)
        a, b = (torch.where(t.abs() < 1e-3, torch.full_like(t, 1e-3), t).to(dt) for t in (a, b))
        away_from_zero = (a.double() @ b.double()).abs() > 1e-2
        new, old = matmul(a, b).abs, matmul(a, b, summation=Summation()).abs
        assert away_from_zero.float().mean() > 0.9
        assert float((new / old)[away_from_zero].max()) < 1 + 1e-12


LINEAR_INPUTS = {  # name: (bf16 input, torch's path)
    "2d": (lambda g: torch.randn(16, 32, generator=g).bfloat16(), "fused"),
    "3d_contiguous": (lambda g: torch.randn(4, 8, 32, generator=g).bfloat16(), "fused"),
    "3d_transposed": (lambda g: torch.randn(8, 4, 32, generator=g).bfloat16().transpose(0, 1), "separate"),
    "4d_transposed": (lambda g: torch.randn(2, 8, 2, 32, generator=g).bfloat16().transpose(1, 2), "separate"),
    "3d_expanded": (lambda g: torch.randn(1, 8, 32, generator=g).bfloat16().expand(4, 8, 32), "separate"),
}


@pytest.mark.parametrize("name", list(LINEAR_INPUTS))
def test_linear_bias_rounding_follows_torch(name):
    """``F.linear`` with a bias on a non-contiguous N-D input is ``matmul`` (rounded to bf16) then
    ``add_``: two roundings. The default bound follows torch's rule (it was one rounding: up to
    22% of the elements violated), holds against the exact reference, and is unchanged for the
    inputs torch sends to ``addmm``."""
    g = _gen("linear", name)
    make, path = LINEAR_INPUTS[name]
    x = make(g)
    w, b = torch.randn(64, 32, generator=g).bfloat16(), (torch.randn(64, generator=g) * 4).bfloat16()
    y = F.linear(x, w, b)
    two = torch.matmul(x, w.t()).add_(b)
    assert torch.equal(y, two if path == "separate" else torch.addmm(b, x.reshape(-1, 32), w.t()).reshape(y.shape))
    assert tn.bounds.matmul.torch_bias_rounding(x) == path
    ones = torch.ones(*x.shape[:-1], 1, dtype=torch.float64)
    exact = exact_matmul(torch.cat([x.double(), ones], -1), torch.cat([w.double().t(), b.double()[None]], 0))
    err = (y.double() - exact).abs()
    fused = linear(x, w, b, bias_rounding="fused").abs
    for mode in ("deterministic", "probabilistic"):
        assert int((err > linear(x, w, b, mode=mode).abs).sum()) == 0, mode
    if path == "separate":
        assert int((err > fused).sum()) > 0  # the one-rounding model (the default before) is violated
    else:
        assert torch.equal(linear(x, w, b).abs, fused)
    with pytest.raises(ValueError, match="bias_rounding"):
        linear(x, w, b, bias_rounding="twice")
