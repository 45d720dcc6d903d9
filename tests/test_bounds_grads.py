"""Backward (gradient) bounds (ttrace_num.bounds.grads) against exact references, for torch's
CPU autograd kernels and for the emulated computation models (ttrace_num.emulate.grads).

References: exact_matmul / exact_sum (linear, matmul) and mpmath at 50 digits (softmax,
log_softmax, cross entropy, layer norm, rms norm, gelu, silu), from the stored inputs
(ttrace_num.emulate.grads.exact_*). Deterministic bounds: 0 violations. Probabilistic bounds
(failure probability P_TEST = 0.1 per element, to give the test power): one-sided binomial
test against the claim, and never above the deterministic bound. Shapes are small (the
mpmath references dominate the runtime; the file runs in well under 90 s on one core)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from scipy.stats import binomtest

import ttrace_num as tn
from ttrace_num.bounds import grads as G
from ttrace_num.bounds.summation import Summation
from ttrace_num.emulate import grads as E
from ttrace_num.formats import get_format, half_ulp

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
P_TEST = 0.1


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _err(computed: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    return (computed.to(torch.float64) - exact.to(torch.float64)).abs()


def _check(computed: torch.Tensor, exact: torch.Tensor, det: tn.Bound, prob: tn.Bound) -> None:
    """0 deterministic violations; probabilistic violations consistent with P_TEST; prob <= det."""
    err = _err(computed, exact)
    bd = torch.broadcast_to(det.abs, err.shape)
    bp = torch.broadcast_to(prob.abs, err.shape)
    assert det.mode == "deterministic" and prob.mode == "probabilistic"
    assert torch.isfinite(bd).all()
    v_det = int((err > bd).sum())
    assert v_det == 0, (v_det, float((err / bd).max()))
    v = int((err > bp).sum())
    assert binomtest(v, err.numel(), prob.failure_probability, alternative="greater").pvalue > 1e-3, (v, err.numel())
    assert (bp <= bd * (1 + 1e-12)).all()


def _bounds(op: str, *inputs, **kw) -> tuple[tn.Bound, tn.Bound]:
    return (tn.tolerance(op, *inputs, mode="deterministic", **kw),
            tn.tolerance(op, *inputs, mode="probabilistic", failure_probability=P_TEST, **kw))


def _heavy(shape, g: torch.Generator) -> torch.Tensor:
    return torch.tan(math.pi * (torch.rand(*shape, generator=g) - 0.5)).clamp(-1e3, 1e3)


# ============================================================================ model checks
@pytest.mark.cpu_dispatch("avx2")  # bit-exact emulations of ATen's vectorised backward kernels
@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_torch_computes_in_fp32_and_rounds_once(fmt):
    """The stated models for bf16/fp16 (fp32 opmath, one final rounding; layer norm's saved
    statistics and storage-dtype dgamma/dbeta buffers; the composite rms_norm's autograd) are
    what torch CPU does: the emulations agree bit for bit."""
    dt = DTYPES[fmt]
    g = _gen(1)
    x = (torch.randn(8, 64, generator=g) * 2).to(dt)
    gr = torch.randn(8, 64, generator=g).to(dt)
    for log, aten, emu in ((False, torch.ops.aten._softmax_backward_data, E.emulate_softmax_backward),
                           (True, torch.ops.aten._log_softmax_backward_data, E.emulate_log_softmax_backward)):
        y = (torch.log_softmax if log else torch.softmax)(x, -1)
        assert torch.equal(aten(gr, y, -1, dt).double(), emu(y, gr))
    t = torch.randint(0, 64, (8,), generator=g)
    t[3] = -100
    for red, ls in (("mean", 0.0), ("mean", 0.1), ("sum", 0.1)):
        xr = x.clone().requires_grad_()
        F.cross_entropy(xr, t, reduction=red, label_smoothing=ls).backward()
        assert torch.equal(xr.grad.double(), E.emulate_cross_entropy_backward(x, t, red, ls))
    xs = (torch.randn(4096, generator=g) * 3).to(dt)
    gs = torch.randn(4096, generator=g).to(dt)
    assert torch.equal(torch.ops.aten.silu_backward(gs, xs).double(), E.emulate_silu_backward(gs, xs))
    for ap in ("none", "tanh"):  # torch's erf/tanh are not correctly rounded: rare 1-ulp differences
        same = torch.ops.aten.gelu_backward(gs, xs, approximate=ap).double() == E.emulate_gelu_backward(gs, xs, ap)
        assert same.float().mean() > 0.99
    for wdt, threads in ((dt, 1), (dt, 2), (torch.float32, 2)):
        w = (1 + 0.5 * torch.randn(64, generator=g)).to(wdt)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        br = torch.zeros_like(w, requires_grad=True)
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out = torch.native_layer_norm(xr, (64,), wr, br, 1e-5)
            out[0].backward(gr)
        finally:
            torch.set_num_threads(prev)
        prec = tn.bounds.common.resolve_precision((x,))
        m, r = E.layer_norm_stats(x, 64, 1e-5, prec, get_format(out[1].dtype))
        assert torch.equal(out[1].double().reshape(-1), m.reshape(-1))
        assert torch.equal(out[2].double().reshape(-1), r.reshape(-1))
        dx, dw, db = E.emulate_layer_norm_backward(gr, x, w, 1e-5, threads=threads)
        assert torch.equal(xr.grad.double(), dx) and torch.equal(wr.grad.double(), dw)
        assert torch.equal(br.grad.double(), db)
    w = (1 + 0.5 * torch.randn(64, generator=g)).to(dt)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.rms_norm(xr, (64,), wr).backward(gr)
    dx, dw = E.emulate_rms_norm_backward(gr, x, w)
    assert torch.equal(xr.grad.double(), dx) and torch.equal(wr.grad.double(), dw)


def test_layer_norm_saves_statistics_in_the_input_dtype():
    """torch CPU saves mean/rstd in bf16 for a bf16 layer norm (fp32 only with an fp32 weight)."""
    x = torch.randn(4, 32).to(torch.bfloat16)
    for wdt, expect in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)):
        _, mean, rstd = torch.native_layer_norm(x, (32,), torch.ones(32, dtype=wdt), None, 1e-5)
        assert mean.dtype == rstd.dtype == expect


def test_library_constants_cover_the_backward_kernels():
    """The fp32 library constants (activations.TORCH_CPU) bound torch's gelu/silu backward
    kernels, oneDNN and ATen: 2e5 inputs against float64 derivatives (their error, < 1e-14 of
    the magnitudes of their terms, is added to the measured error). A sweep of 2.5e7 inputs
    (every 97th fp32 below 32 in magnitude, both signs, and 2e6 uniform in [-20, 20]) gave
    max error/bound 0.86 (erf form), 0.64 (tanh form), 0.80 (silu)."""
    g = _gen(2)
    x = torch.cat([torch.rand(100_000, generator=g) * 40 - 20, torch.randn(100_000, generator=g) * 2])
    one = torch.ones_like(x)
    xd = x.double()
    phi = torch.exp(-0.5 * xd * xd) / math.sqrt(2 * math.pi)
    k, b = 0.044715, math.sqrt(2 / math.pi)
    u = b * (xd + k * xd ** 3)
    s = torch.sigmoid(xd)
    sech2 = 1 / torch.cosh(u) ** 2
    refs = {"none": 0.5 * torch.special.erfc(-xd / math.sqrt(2)) + xd * phi,
            "tanh": 0.5 * (1 + torch.tanh(u)) + 0.5 * xd * sech2 * b * (1 + 3 * k * xd * xd),
            "silu": s * (1 + xd * (1 - s))}
    # magnitudes of the float64 terms: 1e-14 of them bounds the float64 reference's error
    scale = {"none": 1 + xd.abs() * phi, "tanh": 1 + xd.abs() * sech2 * (1 + xd * xd), "silu": s * (1 + xd.abs())}
    for mk in (True, False):
        with torch.backends.mkldnn.flags(enabled=mk):
            for kind, ref in refs.items():
                y = (torch.ops.aten.silu_backward(one, x) if kind == "silu"
                     else torch.ops.aten.gelu_backward(one, x, approximate=kind))
                bound = (G.silu_backward(one, x) if kind == "silu" else G.gelu_backward(one, x, kind)).abs
                err = _err(y, ref) + 1e-14 * scale[kind]
                assert (err <= bound).all(), (kind, mk, float((err / bound).max()))


# ============================================================================ data
def _softmax_data(fmt: str, kind: str, log: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    rows, n = (1, 8192) if kind == "long" else (8, 64)
    x = torch.randn(rows, n, generator=g) * 2
    if kind == "peaked":
        x[:, 0] += 12.0
    gr = _heavy((rows, n), g) if kind == "heavy" else torch.randn(rows, n, generator=g)
    if kind == "cancel":
        gr = 3.0 + 2.0 ** -12 * torch.randn(rows, n, generator=g)
    xd = x.to(DTYPES[fmt])
    return (torch.log_softmax if log else torch.softmax)(xd, -1), gr.to(DTYPES[fmt])


@pytest.mark.parametrize("fmt", list(DTYPES))
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("kind", ["normal", "cancel", "heavy", "peaked", "long"])
def test_softmax_family_backward(fmt, log, kind):
    y, gr = _softmax_data(fmt, kind, log)
    op = "log_softmax_backward" if log else "softmax_backward"
    exact = (E.exact_log_softmax_backward if log else E.exact_softmax_backward)(y, gr)
    aten = torch.ops.aten._log_softmax_backward_data if log else torch.ops.aten._softmax_backward_data
    det, prob = _bounds(op, y, gr)
    _check(aten(gr, y, -1, y.dtype), exact, det, prob)
    emu = (E.emulate_log_softmax_backward if log else E.emulate_softmax_backward)(y, gr)
    _check(emu, exact, det, prob)
    if kind == "long" and fmt == "fp32" and not log:  # Azuma: sqrt(n) instead of n for the row sum
        assert float(prob.abs.median()) < float(det.abs.median()) / 4


def test_softmax_backward_other_dim_and_bf16_accumulation():
    """``dim=0`` (ATen's non-last-dim kernel) and an emulated bf16-accumulated row sum."""
    y, gr = _softmax_data("fp32", "normal", False, seed=3)
    yt, gt = y.T.contiguous(), gr.T.contiguous()
    exact = E.exact_softmax_backward(yt, gt, dim=0)
    det, prob = _bounds("softmax_backward", yt, gt, dim=0)
    _check(torch.ops.aten._softmax_backward_data(gt, yt, 0, yt.dtype), exact, det, prob)
    low = {"compute_fmt": "bf16", "summation": Summation(accum=get_format("bf16"), algorithm="pairwise")}
    det, prob = _bounds("softmax_backward", y, gr, **low)
    _check(E.emulate_softmax_backward(y, gr, **low), E.exact_softmax_backward(y, gr), det, prob)


def _ce_run(x: torch.Tensor, t: torch.Tensor, **kw) -> torch.Tensor:
    xr = x.clone().requires_grad_()
    F.cross_entropy(xr, t, **kw).backward()
    return xr.grad


@pytest.mark.parametrize("fmt", list(DTYPES))
@pytest.mark.parametrize("reduction,ls,kind", [("mean", 0.0, "normal"), ("mean", 0.1, "normal"),
                                               ("sum", 0.1, "normal"), ("mean", 0.1, "peaked")])
def test_cross_entropy_backward(fmt, reduction, ls, kind):
    g = _gen(4)
    x = torch.randn(8, 64, generator=g) * 2
    t = torch.randint(0, 64, (8,), generator=g)
    if kind == "peaked":  # p_target ~ 1: p - 1 cancels
        x[:, 0] += 15.0
        t[:4] = 0
    t[-1] = -100
    x = x.to(DTYPES[fmt])
    kw = {"reduction": reduction, "label_smoothing": ls}
    exact = E.exact_cross_entropy_backward(x, t, **kw)
    det, prob = _bounds("cross_entropy_backward", x, t, **kw)
    assert (det.abs[-1] == 0).all()  # the ignored row's gradient is exactly 0
    _check(_ce_run(x, t, **kw), exact, det, prob)
    _check(E.emulate_cross_entropy_backward(x, t, **kw), exact, det, prob)


def test_cross_entropy_loss_scale():
    """An upstream gradient other than 1 (loss scaling), fp16."""
    g = _gen(5)
    x = (torch.randn(8, 64, generator=g) * 2).to(torch.float16)
    t = torch.randint(0, 64, (8,), generator=g)
    xr = x.clone().requires_grad_()
    L = F.cross_entropy(xr, t, label_smoothing=0.05)
    L.backward(torch.tensor(1024.0, dtype=torch.float16))
    exact = E.exact_cross_entropy_backward(x, t, label_smoothing=0.05, grad_output=1024.0)
    det, prob = _bounds("cross_entropy_backward", x, t, label_smoothing=0.05, grad_output=1024.0)
    _check(xr.grad, exact, det, prob)


# ----------------------------------------------------------------------------- norms
def _norm_data(fmt: str, kind: str, seed: int = 0, wdt=None):
    g = _gen(seed)
    dt = DTYPES[fmt]
    rows, n = (2, 4096) if kind == "long" else (8, 64)
    x = torch.randn(rows, n, generator=g)
    if kind == "offset":
        x = 100.0 + x
    elif kind == "constant":  # rows a few ulps of 3 apart: r = 1/sqrt(var + eps) ~ eps^-1/2
        spacing = {"fp32": 2.0 ** -22, "bf16": 2.0 ** -6, "fp16": 2.0 ** -9}[fmt]
        x = 3.0 + spacing * torch.randint(-2, 3, (rows, n), generator=g).to(torch.float32)
    gr = _heavy((rows, n), g) if kind == "heavy" else torch.randn(rows, n, generator=g)
    w = (1.0 + 0.5 * torch.randn(n, generator=g)).to(wdt or dt)
    return gr.to(dt), x.to(dt), w


def _ln_torch(gr, x, w, eps=1e-5):
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    br = torch.zeros_like(w, requires_grad=True)
    F.layer_norm(xr, (x.shape[-1],), wr, br, eps).backward(gr)
    return xr.grad, wr.grad, br.grad


LN_OPS = ("layer_norm_backward_input", "layer_norm_backward_weight", "layer_norm_backward_bias")


@pytest.mark.parametrize("fmt,kind", [(f, k) for f in DTYPES for k in ("normal", "offset", "constant", "heavy", "long")]
                         + [("bf16", "mixed"), ("fp16", "mixed")])  # mixed: fp32 weight
def test_layer_norm_backward(fmt, kind):
    wdt = torch.float32 if kind == "mixed" else None
    gr, x, w = _norm_data(fmt, "normal" if kind == "mixed" else kind, wdt=wdt)
    exact = E.exact_layer_norm_backward(gr, x, w, 1e-5)
    computed = {"torch": _ln_torch(gr, x, w), "emulated": E.emulate_layer_norm_backward(gr, x, w, 1e-5)}
    for i, op in enumerate(LN_OPS):
        det, prob = _bounds(op, gr, x, w, eps=1e-5)
        for out in computed.values():
            _check(out[i], exact[i], det, prob)


def test_layer_norm_backward_tuple_and_threads():
    """``layer_norm_backward`` returns the three registered bounds; the bf16 dgamma chain model
    holds for 1 and 2 threads (the single-thread chain is the longest)."""
    gr, x, w = _norm_data("bf16", "normal", seed=6)
    gr, x = gr.repeat(8, 1), x.repeat(8, 1)  # 64 rows
    exact = E.exact_layer_norm_backward(gr, x, w, 1e-5)
    both = G.layer_norm_backward(gr, x, w, 1e-5)
    assert torch.equal(both.dx.abs, tn.tolerance("layer_norm_backward_input", gr, x, w, eps=1e-5).abs)
    for threads in (1, 2):
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            _, dw, db = _ln_torch(gr, x, w)
        finally:
            torch.set_num_threads(prev)
        b = G.layer_norm_backward(gr, x, w, 1e-5, threads=threads)
        assert (_err(dw, exact[1]) <= b.dweight.abs).all() and (_err(db, exact[2]) <= b.dbias.abs).all()
    assert (G.layer_norm_backward(gr, x, w, 1e-5, threads=1).dweight.abs >= both.dweight.abs).all()


def _rms_torch(gr, x, w, eps=1e-5):
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.rms_norm(xr, (x.shape[-1],), wr, eps).backward(gr)
    return xr.grad, wr.grad


@pytest.mark.parametrize("fmt", list(DTYPES))
@pytest.mark.parametrize("kind", ["normal", "offset", "constant", "heavy", "long"])
def test_rms_norm_backward(fmt, kind):
    gr, x, w = _norm_data(fmt, kind, seed=7)
    exact = E.exact_rms_norm_backward(gr, x, w, 1e-5)
    computed = {"torch": _rms_torch(gr, x, w), "emulated": E.emulate_rms_norm_backward(gr, x, w, 1e-5)}
    for i, op in enumerate(("rms_norm_backward_input", "rms_norm_backward_weight")):
        det, prob = _bounds(op, gr, x, w, eps=1e-5)
        for out in computed.values():
            _check(out[i], exact[i], det, prob)


def test_rms_norm_backward_default_eps_no_weight():
    gr, x, _ = _norm_data("bf16", "normal", seed=8)
    xr = x.clone().requires_grad_()
    torch.rms_norm(xr, (64,)).backward(gr)
    exact, _ = E.exact_rms_norm_backward(gr, x)
    b = G.rms_norm_backward(gr, x)
    assert b.dweight is None
    assert (_err(xr.grad, exact) <= b.dx.abs).all()


# ----------------------------------------------------------------------------- gelu / silu
def _act_data(fmt: str, kind: str, op: str, seed: int = 0):
    g = _gen(seed)
    n = 512
    if kind == "normal":
        x = torch.randn(n, generator=g) * 3
    elif kind == "tails":
        x = (torch.rand(n, generator=g) * 2 - 1) * 12
    else:  # around the derivative's zero
        x = {"gelu": -0.7518, "silu": -1.2785}[op] + 0.01 * torch.randn(n, generator=g)
    return torch.randn(n, generator=g).to(DTYPES[fmt]), x.to(DTYPES[fmt])


@pytest.mark.parametrize("fmt", list(DTYPES))
@pytest.mark.parametrize("kind", ["normal", "tails", "zero"])
@pytest.mark.parametrize("op", ["gelu", "gelu_tanh", "silu"])
def test_activation_backward(fmt, kind, op):
    base = "silu" if op == "silu" else "gelu"
    gr, x = _act_data(fmt, kind, base)
    if op == "silu":
        exact, kw = E.exact_silu_backward(gr, x), {}
        outs = [torch.ops.aten.silu_backward(gr, x), E.emulate_silu_backward(gr, x)]
    else:
        ap = "tanh" if op == "gelu_tanh" else "none"
        exact, kw = E.exact_gelu_backward(gr, x, ap), {"approximate": ap}
        outs = [torch.ops.aten.gelu_backward(gr, x, approximate=ap), E.emulate_gelu_backward(gr, x, ap)]
        with torch.backends.mkldnn.flags(enabled=False):  # ATen's kernel (fp32 uses oneDNN by default)
            outs.append(torch.ops.aten.gelu_backward(gr, x, approximate=ap))
    det, prob = _bounds(f"{base}_backward", gr, x, **kw)
    for out in outs:
        _check(out, exact, det, prob)


def test_activation_backward_special_values():
    """Zeros, tiny and large inputs (exp over/underflow, tanh = +-1): finite, valid bounds;
    non-finite inputs: no finite claim."""
    x = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 60.0, -60.0, -100.0])
    gr = torch.ones_like(x)
    cases = [(torch.ops.aten.gelu_backward(gr, x), E.exact_gelu_backward(gr, x), G.gelu_backward(gr, x)),
             (torch.ops.aten.gelu_backward(gr, x, approximate="tanh"), E.exact_gelu_backward(gr, x, "tanh"),
              G.gelu_backward(gr, x, "tanh")),
             (torch.ops.aten.silu_backward(gr, x), E.exact_silu_backward(gr, x), G.silu_backward(gr, x))]
    for out, exact, b in cases:
        assert torch.isfinite(b.abs).all() and (_err(out, exact) <= b.abs).all()
    bad = torch.tensor([math.inf, -math.inf])
    for b in (G.gelu_backward(torch.ones(2), bad), G.silu_backward(torch.ones(2), bad)):
        assert torch.isinf(b.abs).all()
    for fn in (G.gelu_backward, G.silu_backward):  # NaN inputs: refused, as for every op (bounds.common.register)
        with pytest.raises(ValueError, match="input 1 .* contains NaN"):
            fn(torch.ones(1), torch.tensor([math.nan]))


# ----------------------------------------------------------------------------- linear / matmul
@pytest.mark.parametrize("fmt", list(DTYPES))
@pytest.mark.parametrize("kind", ["normal", "heavy"])
def test_linear_backward(fmt, kind):
    g = _gen(9)
    dt = DTYPES[fmt]
    scale = 1 / 32 if fmt == "fp16" else 1.0  # keep the Cauchy products' sums below fp16's max
    rnd = (lambda s, gen: scale * _heavy(s, gen)) if kind == "heavy" else (lambda s, gen: torch.randn(*s, generator=gen))
    x, W = rnd((4, 32, 24), g).to(dt), rnd((16, 24), g).to(dt)
    gr = rnd((4, 32, 16), g).to(dt)
    xr, Wr = x.clone().requires_grad_(), W.clone().requires_grad_()
    br = torch.zeros(16, dtype=dt, requires_grad=True)
    F.linear(xr, Wr, br).backward(gr)
    cases = [("linear_backward_input", (gr, W), xr.grad, E.exact_linear_backward_input(gr, W),
              E.emulate_linear_backward_input(gr, W)),
             ("linear_backward_weight", (gr, x), Wr.grad, E.exact_linear_backward_weight(gr, x),
              E.emulate_linear_backward_weight(gr, x)),
             ("linear_backward_bias", (gr,), br.grad, E.exact_linear_backward_bias(gr), E.emulate_linear_backward_bias(gr))]
    for op, inputs, torch_out, exact, emu in cases:
        det, prob = _bounds(op, *inputs)
        _check(torch_out, exact, det, prob)
        _check(emu, exact, det, prob)


def test_matmul_backward_and_long_token_dim():
    g = _gen(10)
    a, b = torch.randn(2, 8, 32, generator=g), torch.randn(2, 32, 16, generator=g)
    gr = torch.randn(2, 8, 16, generator=g)
    ar, brr = a.clone().requires_grad_(), b.clone().requires_grad_()
    (ar @ brr).backward(gr)
    for op, inputs, out, exact in (("matmul_backward_a", (gr, b), ar.grad, E.exact_matmul_backward_a(gr, b)),
                                   ("matmul_backward_b", (a, gr), brr.grad, E.exact_matmul_backward_b(a, gr))):
        _check(out, exact, *_bounds(op, *inputs))
    # grad_W over K = 8192 tokens in bf16 (fp32 accumulation, one rounding)
    gr, x = torch.randn(8192, 8, generator=g).to(torch.bfloat16), torch.randn(8192, 8, generator=g).to(torch.bfloat16)
    det, prob = _bounds("linear_backward_weight", gr, x)
    _check(gr.T @ x, E.exact_linear_backward_weight(gr, x), det, prob)


# ============================================================================ wrong models are caught
def test_wrong_models_are_caught():
    """Each bound, with one modelling mistake, is violated on data where that mistake matters:
    (1) layer norm with mean/rstd assumed saved in fp32 (torch saves bf16), (2) softmax
    backward with the output rounding dropped (out_fmt=fp32 for bf16 outputs), (3) cross
    entropy treating the stored log_softmax as exact (the plain log_softmax_backward bound of
    the stored lp), (4) layer norm dgamma assumed accumulated in fp32 (torch: bf16 buffers)."""
    # (1) bf16 layer norm, rows with |mean| >> sigma: the bf16-rounded mean enters grad_x
    gr, x, w = _norm_data("bf16", "offset", seed=11)
    exact = E.exact_layer_norm_backward(gr, x, w, 1e-5)
    dx, dw, _ = _ln_torch(gr, x, w)
    right = G.layer_norm_backward(gr, x, w, 1e-5).dx
    wrong = G.layer_norm_backward(gr, x, w, 1e-5, stats_fmt="fp32").dx
    assert int((_err(dx, exact[0]) > right.abs).sum()) == 0
    assert int((_err(dx, exact[0]) > wrong.abs).sum()) > 0
    # (2) softmax backward, bf16 output rounding ignored
    y, g2 = _softmax_data("bf16", "normal", False, seed=12)
    ex = E.exact_softmax_backward(y, g2)
    out = torch.ops.aten._softmax_backward_data(g2, y, -1, y.dtype)
    assert int((_err(out, ex) > G.softmax_backward(y, g2, out_fmt="fp32").abs).sum()) > 0
    # (3) cross entropy: the forward's bf16 log-probabilities are not exact
    g3 = _gen(13)
    logits = (torch.randn(8, 64, generator=g3) * 2).to(torch.bfloat16)
    t = torch.randint(0, 64, (8,), generator=g3)
    ex = E.exact_cross_entropy_backward(logits, t)
    out = _ce_run(logits, t)
    lp = torch.log_softmax(logits, -1)
    upstream = torch.zeros(8, 64, dtype=torch.bfloat16)
    upstream[torch.arange(8), t] = -1.0 / 8
    naive = G.log_softmax_backward(lp, upstream).abs
    assert int((_err(out, ex) > naive).sum()) > 0
    assert int((_err(out, ex) > G.cross_entropy_backward(logits, t).abs).sum()) == 0
    # (4) bf16 dgamma over 512 rows with one thread: fp32 accumulation is not what torch does
    gr, x, w = _norm_data("bf16", "normal", seed=14)
    gr = (1 + 0.05 * torch.randn(512, 64, generator=_gen(15))).to(torch.bfloat16)
    x = x.repeat(64, 1)
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _, dw, _ = _ln_torch(gr, x, w)
    finally:
        torch.set_num_threads(prev)
    exact_dw = E.exact_layer_norm_backward(gr, x, w, 1e-5)[1]
    wrong = G.layer_norm_backward(gr, x, w, 1e-5, threads=1, param_summation=Summation(accum=get_format("fp32"))).dweight
    right = G.layer_norm_backward(gr, x, w, 1e-5, threads=1).dweight
    assert int((_err(dw, exact_dw) > wrong.abs).sum()) > 0
    assert int((_err(dw, exact_dw) > right.abs).sum()) == 0


# ============================================================================ API
def test_registered_explained_and_special_inputs():
    names = set(tn.ops())
    for op in ("linear_backward_input", "linear_backward_weight", "linear_backward_bias", "matmul_backward_a",
               "matmul_backward_b", "softmax_backward", "log_softmax_backward", "cross_entropy_backward",
               *LN_OPS, "rms_norm_backward_input", "rms_norm_backward_weight", "gelu_backward", "silu_backward"):
        assert op in names
    y, gr = _softmax_data("bf16", "normal", False)
    b = tn.tolerance("softmax_backward", y, gr, mode="probabilistic")
    text = b.explain()
    assert "softmax_backward" in text and "source" in text and b.failure_probability == 1e-6
    gr[0, 0] = math.nan
    with pytest.raises(ValueError, match="softmax_backward: input 1 .* contains NaN"):  # one policy for every op
        tn.tolerance("softmax_backward", y, gr)
    with pytest.raises(ValueError):
        tn.tolerance("cross_entropy_backward", torch.randn(2, 4), torch.tensor([0, 1]), reduction="none")
    # bf16 tightness: the output rounding dominates (bound within 2 half-ulps of the result)
    y, gr = _softmax_data("bf16", "normal", False)
    b = G.softmax_backward(y, gr)
    ex = E.exact_softmax_backward(y, gr)
    assert (b.abs <= 2.5 * half_ulp(ex, get_format("bf16")) + 1e-30).float().mean() > 0.9


@pytest.mark.parametrize("scale", [2.0 ** -18, 2.0 ** 10], ids=["subnormal", "large"])
def test_fp16_gradient_ranges(scale):
    """fp16 upstream gradients whose results fall below the normal range (absolute rounding
    errors) or are large (softmax, layer norm without weight, gelu)."""
    g = _gen(16)
    x = (torch.randn(8, 64, generator=g) * 2).to(torch.float16)
    gr = (torch.randn(8, 64, generator=g) * scale).to(torch.float16)
    y = torch.softmax(x, -1)
    _check(torch.ops.aten._softmax_backward_data(gr, y, -1, y.dtype), E.exact_softmax_backward(y, gr),
           *_bounds("softmax_backward", y, gr))
    xr = x.clone().requires_grad_()
    F.layer_norm(xr, (64,), None, None, 1e-5).backward(gr)
    exact = E.exact_layer_norm_backward(gr, x, None, 1e-5)
    _check(xr.grad, exact[0], *_bounds("layer_norm_backward_input", gr, x, None, eps=1e-5))
    _check(torch.ops.aten.gelu_backward(gr, x), E.exact_gelu_backward(gr, x), *_bounds("gelu_backward", gr, x))
