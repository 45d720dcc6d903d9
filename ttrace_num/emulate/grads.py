r"""Emulation of the backward (gradient) computation models of :mod:`ttrace_num.bounds.grads`,
and exact (high-precision) references for the same gradients.

Emulations. Every intermediate is rounded to its stated format with
:func:`~ttrace_num.rounding.round_to`; the elementary functions (``exp``, ``erf``,
``tanh``, ``rsqrt``) are *correctly rounded* (float64 value, then one rounding), which the
bounds cover (their library errors are at least half an ulp). The inputs are the stored
values, taken as exact; formats default as in the bounds
(:func:`~ttrace_num.bounds.common.resolve_precision`: compute fp32 for bf16/fp16 storage,
output = storage). Roundings of a float64 result of one ``+ - * /`` to fp32 or narrower are
correct roundings (double rounding through float64 is innocuous for ``53 >= 2p + 2``,
Figueroa, SIGNUM 1995); every product of two operands of at most 26 significant bits is
exact in float64, and a product of three operands is rounded after each multiplication.
Sums follow a :class:`~ttrace_num.bounds.summation.Summation` (default: a left-to-right
chain in the compute format) via :func:`~ttrace_num.emulate.summation.emulate_terms`.
Results are float64 tensors holding output-format values.

The step-by-step models (which operation rounds where) are stated in the bounds module;
each function below names its model. With fp32 compute the emulations reproduce torch's
CPU kernels bit for bit for the elementwise parts; sums differ only by their order
(torch's vector lanes versus the emulated chain), see ``tests/test_bounds_grads.py``.

Exact references (``exact_*``): linear/matmul gradients by
:func:`~ttrace_num.reference.dot.exact_matmul` and :func:`~ttrace_num.reference.dot.exact_sum`
(float64 roundings of the exact values); softmax, log_softmax, cross entropy, layer norm,
rms norm, gelu and silu gradients by mpmath at :data:`~ttrace_num.reference.mp.DEFAULT_DPS`
(>= 40) digits from the exact stored inputs, rounded once to float64.
"""
from __future__ import annotations

import math

import mpmath
import torch

from ..bounds.common import Precision, resolve_precision
from ..bounds.summation import Summation
from ..formats import FloatFormat, get_format
from ..reference.dot import exact_matmul, exact_sum
from ..reference.mp import mpf_to_float, to_mpf, workdps
from ..rounding import round_to
from .norms import moments
from .softmax import emulate_log_softmax
from .summation import emulate_matmul, emulate_terms

__all__ = [
    "emulate_cross_entropy_backward",
    "emulate_gelu_backward",
    "emulate_layer_norm_backward",
    "emulate_linear_backward_bias",
    "emulate_linear_backward_input",
    "emulate_linear_backward_weight",
    "emulate_log_softmax_backward",
    "emulate_matmul_backward_a",
    "emulate_matmul_backward_b",
    "emulate_rms_norm_backward",
    "emulate_silu_backward",
    "emulate_softmax_backward",
    "exact_cross_entropy_backward",
    "exact_gelu_backward",
    "exact_layer_norm_backward",
    "exact_linear_backward_bias",
    "exact_linear_backward_input",
    "exact_linear_backward_weight",
    "exact_log_softmax_backward",
    "exact_matmul_backward_a",
    "exact_matmul_backward_b",
    "exact_rms_norm_backward",
    "exact_silu_backward",
    "exact_softmax_backward",
    "layer_norm_stats",
]


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float64)


def _summ(prec: Precision, summation: Summation | None) -> Summation:
    return summation if summation is not None else Summation(accum=prec.compute)


def _rnd(c: FloatFormat):
    return lambda t: round_to(t, c)


def _const(value: float, c: FloatFormat) -> float:
    """A float64 constant rounded to ``c`` (a kernel's ``scalar_t(value)`` / opmath scalar)."""
    return float(round_to(torch.tensor(value, dtype=torch.float64), c))


# ----------------------------------------------------------------------------- linear / matmul
def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def emulate_linear_backward_input(g: torch.Tensor, weight: torch.Tensor, *, fmt=None, compute_fmt=None,
                                  out_fmt=None, summation: Summation | None = None) -> torch.Tensor:
    """``grad_x = g @ W`` (``W`` of shape ``(out, in)``) under ``summation``."""
    prec = resolve_precision((g, weight), fmt, compute_fmt, out_fmt)
    return emulate_matmul(g, weight, _summ(prec, summation), prec.out)


def emulate_linear_backward_weight(g: torch.Tensor, x: torch.Tensor, *, fmt=None, compute_fmt=None,
                                   out_fmt=None, summation: Summation | None = None) -> torch.Tensor:
    """``grad_W = g^T x`` over the flattened leading dims (``K`` = number of tokens)."""
    prec = resolve_precision((g, x), fmt, compute_fmt, out_fmt)
    return emulate_matmul(_flat(g).transpose(0, 1), _flat(x), _summ(prec, summation), prec.out)


def emulate_linear_backward_bias(g: torch.Tensor, *, fmt=None, compute_fmt=None, out_fmt=None,
                                 summation: Summation | None = None) -> torch.Tensor:
    """``grad_b = sum of g over the leading dims``."""
    prec = resolve_precision((g,), fmt, compute_fmt, out_fmt)
    return emulate_terms(_f64(_flat(g)).transpose(0, 1), _summ(prec, summation), prec.out)


def emulate_matmul_backward_a(g: torch.Tensor, b: torch.Tensor, **kw) -> torch.Tensor:
    """``grad_A = g @ B^T`` (batched)."""
    return emulate_linear_backward_input(g, b.transpose(-1, -2), **kw)


def emulate_matmul_backward_b(a: torch.Tensor, g: torch.Tensor, **kw) -> torch.Tensor:
    """``grad_B = A^T @ g`` (batched; a 2-D ``B`` shared by a batched ``A`` is
    :func:`emulate_linear_backward_weight`)."""
    return emulate_linear_backward_input(a.transpose(-1, -2), g, **kw)


# ----------------------------------------------------------------------------- softmax family
def emulate_softmax_backward(y: torch.Tensor, g: torch.Tensor, dim: int = -1, *, fmt=None, compute_fmt=None,
                             out_fmt=None, summation: Summation | None = None) -> torch.Tensor:
    """``fl_o(fl_c(fl_c(g - D) y))``, ``D = sum_j g_j y_j`` in ``c`` (products rounded to ``c``)."""
    prec = resolve_precision((y, g), fmt, compute_fmt, out_fmt)
    r = _rnd(prec.compute)
    y64, g64 = _f64(y).movedim(dim, -1), _f64(g).movedim(dim, -1)
    D = emulate_terms(r(g64 * y64), _summ(prec, summation), prec.compute).unsqueeze(-1)
    return round_to(r(r(g64 - D) * y64), prec.out).movedim(-1, dim)


def _log_softmax_backward_last(yl: torch.Tensor, g: torch.Tensor, prec: Precision, summ: Summation) -> torch.Tensor:
    r = _rnd(prec.compute)
    s = emulate_terms(r(g), summ, prec.compute).unsqueeze(-1)
    return round_to(r(g - r(r(torch.exp(yl)) * s)), prec.out)


def emulate_log_softmax_backward(y_log: torch.Tensor, g: torch.Tensor, dim: int = -1, *, fmt=None,
                                 compute_fmt=None, out_fmt=None, summation: Summation | None = None) -> torch.Tensor:
    """``fl_o(fl_c(g - fl_c(EXP(y_log) s)))``, ``s = sum_j g_j`` in ``c``."""
    prec = resolve_precision((y_log, g), fmt, compute_fmt, out_fmt)
    out = _log_softmax_backward_last(_f64(y_log).movedim(dim, -1), _f64(g).movedim(dim, -1), prec,
                                     _summ(prec, summation))
    return out.movedim(-1, dim)


def _ce_upstream(target: torch.Tensor, C: int, reduction: str, label_smoothing: float, ignore_index: int,
                grad_output: float, prec: Precision) -> torch.Tensor:
    """The gradient reaching ``log_softmax`` in torch's autograd of ``F.cross_entropy`` (model of
    :func:`ttrace_num.bounds.grads.cross_entropy_backward`), float64 ``(N, C)`` on the storage grid."""
    s, c = prec.storage, prec.compute

    def op(v: float) -> float:  # one scalar_t op: computed in c, stored in s
        return float(round_to(round_to(torch.tensor(v, dtype=torch.float64), c), s))

    tgt = target.reshape(-1).to(torch.int64)
    keep = tgt != ignore_index
    n_keep = int(keep.sum())
    count = float(round_to(torch.tensor(float(n_keep), dtype=torch.float64), s))
    go = float(round_to(torch.tensor(float(grad_output), dtype=torch.float64), s))
    eps = float(label_smoothing)
    a = go if eps == 0.0 else op(go * _const(1.0 - eps, c))
    w = -(op(a / count) if reduction == "mean" else a)
    G = torch.zeros(tgt.shape[0], C, dtype=torch.float64)
    safe = torch.where(keep, tgt, torch.zeros_like(tgt))
    G[torch.arange(tgt.shape[0]), safe] = torch.where(keep, torch.tensor(w, dtype=torch.float64), 0.0)
    if eps:
        b = op(go * _const(eps / C, c))
        b = -(op(b / count) if reduction == "mean" else b)
        onehot = torch.zeros_like(G, dtype=torch.bool)
        onehot[torch.arange(tgt.shape[0]), safe] = True
        G = torch.where(onehot, round_to(round_to(G + b, c), s), torch.full_like(G, b))
        G = torch.where(keep[:, None], G, torch.zeros_like(G))
    return G


def emulate_cross_entropy_backward(logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean",
                                   label_smoothing: float = 0.0, ignore_index: int = -100,
                                   grad_output: float = 1.0, *, fmt=None, compute_fmt=None,
                                   summation: Summation | None = None) -> torch.Tensor:
    """``d F.cross_entropy(logits (N, C), target) / d logits`` as torch CPU autograd computes it:
    the emulated forward ``log_softmax`` (stored in the storage format), the upstream
    gradient (:func:`_ce_upstream`), then :func:`emulate_log_softmax_backward`."""
    prec = resolve_precision((logits,), fmt, compute_fmt, None)
    lp = emulate_log_softmax(logits, -1, fmt=prec.storage, compute_fmt=prec.compute)
    G = _ce_upstream(target, logits.shape[1], reduction, label_smoothing, ignore_index, grad_output, prec)
    return _log_softmax_backward_last(lp, G, prec, _summ(prec, summation))


# ----------------------------------------------------------------------------- layer norm
def _rows(x: torch.Tensor, n: int) -> torch.Tensor:
    return _f64(x).reshape(-1, n)


def layer_norm_stats(x: torch.Tensor, n: int, eps: float, prec: Precision, stats_fmt: FloatFormat
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's saved ``(mean, rstd)`` (rows, 1): torch CPU's ``RowwiseMoments`` in ``c``
    (:func:`ttrace_num.emulate.norms.moments`), ``rstd = fl(1 / fl(sqrt(fl(var + eps))))``,
    both stored in ``stats_fmt``."""
    c = prec.compute
    r = _rnd(c)
    mu, var = moments(_rows(x, n), c, prec.storage)
    rstd = r(1.0 / r(torch.sqrt(r(var + _const(float(eps), c)))))
    return round_to(mu, stats_fmt), round_to(rstd, stats_fmt)


def _chunks(m: int, threads: int) -> list[tuple[int, int]]:
    """``at::parallel_for(0, m, 1)``'s contiguous chunks of ``ceil(m / threads)`` rows."""
    t = max(1, min(threads, m))
    size = math.ceil(m / t)
    return [(i, min(m, i + size)) for i in range(0, m, size)]


def _buffered_rows(terms: torch.Tensor, threads: int, buf: FloatFormat, c: FloatFormat, fma_with=None) -> torch.Tensor:
    """torch CPU's two-pass column reduction of layer norm's ``dgamma``/``dbeta``: per thread a
    chain over its rows ``buf = fl_buf(fl_c(buf + t_i))`` (``fma_with = (dy, z)``: the term is
    ``dy * z`` fused into the addition), then ``fl_c`` chain over the thread buffers."""
    out = torch.zeros(terms.shape[1], dtype=torch.float64)
    for lo, hi in _chunks(terms.shape[0], threads):
        b = torch.zeros_like(out)
        for i in range(lo, hi):
            v = b + (fma_with[0][i] * fma_with[1][i] if fma_with is not None else terms[i])
            b = round_to(round_to(v, c), buf)
        out = round_to(out + b, c)
    return out


def emulate_layer_norm_backward(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None = None,
                                eps: float = 1e-5, *, threads: int | None = None, stats_fmt=None, fma: bool = True,
                                fmt=None, compute_fmt=None, out_fmt=None, summation: Summation | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_weight, grad_bias)`` of ``F.layer_norm`` over the last dim, torch CPU's
    ``LayerNormBackwardKernelImplInternal`` (model in :mod:`ttrace_num.bounds.grads`): saved
    ``mean``/``rstd`` (:func:`layer_norm_stats`), row sums ``ds = sum fl(fl(dy x) w)``,
    ``db = sum fl(dy w)`` under ``summation``; ``b = fl(fl(fl(fl(fl(db m) - ds) a) a) a) fl(1/N))``,
    ``c0 = fl(fl(-b m) - fl(fl(db a) fl(1/N)))``, ``dx = fl_o(fl(fl(fl(fl(a dy) w) + fl(b x)) + c0))``;
    ``dgamma``/``dbeta`` accumulated per thread in storage-format buffers (``fma``: the kernel's
    ``dgamma + dy (a x + b')`` fused into one rounding per step before the buffer's)."""
    prec = resolve_precision((x,), fmt, compute_fmt, out_fmt)
    c, s = prec.compute, prec.storage
    r = _rnd(c)
    n = x.shape[-1]
    st = get_format(stats_fmt) if stats_fmt is not None else _default_stats_fmt(prec, weight)
    rows, dy = _rows(x, n), _rows(g, n)
    w = _f64(weight).reshape(n) if weight is not None else torch.ones(n, dtype=torch.float64)
    m, a = layer_norm_stats(x, n, eps, prec, st)
    summ = _summ(prec, summation)
    ds = emulate_terms(r(r(dy * rows) * w), summ, c).unsqueeze(-1)
    db = emulate_terms(r(dy * w), summ, c).unsqueeze(-1)
    scale = _const(1.0 / n, c)
    b = r(r(r(r(r(r(db * m) - ds) * a) * a) * a) * scale)
    c0 = r(r(-b * m) - r(r(db * a) * scale))
    dx = round_to(r(r(r(r(a * dy) * w) + r(b * rows)) + c0), prec.out).reshape(x.shape)
    T = threads if threads is not None else torch.get_num_threads()
    bprime = r(-a * m)
    z = r(a * rows + bprime) if fma else r(r(a * rows) + bprime)
    dgamma = _buffered_rows(r(dy * z), T, s, c, fma_with=(dy, z) if fma else None)
    dbeta = _buffered_rows(dy, T, s, c)
    return dx, round_to(dgamma, st), round_to(dbeta, st)


def _default_stats_fmt(prec: Precision, weight: torch.Tensor | None) -> FloatFormat:
    """torch CPU: ``mean``/``rstd`` (and ``dgamma``/``dbeta``) are fp32 when the weight is fp32
    with bf16/fp16 input ("mixed type"), else of the input dtype."""
    if weight is not None and weight.dtype == torch.float32:
        return get_format("fp32")
    return prec.storage


# ----------------------------------------------------------------------------- rms norm
def emulate_rms_norm_backward(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None = None,
                              eps: float | None = None, *, fmt=None, compute_fmt=None, out_fmt=None,
                              summation: Summation | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(grad_x, grad_weight)`` of torch's composite ``rms_norm`` (autograd of ``x.float()``,
    ``pow(2)``, ``mean``, ``+ eps``, ``rsqrt``, ``* rsqrt``, ``* w``, cast), model in
    :mod:`ttrace_num.bounds.grads`."""
    prec = resolve_precision((x,), fmt, compute_fmt, out_fmt)
    c = prec.compute
    r = _rnd(c)
    n = x.shape[-1]
    if eps is None:
        eps = c.eps
    summ = _summ(prec, summation)
    rows, dy = _rows(x, n), _rows(g, n)
    ms = r(emulate_terms(r(rows * rows), summ, c) / n).unsqueeze(-1)
    rs = r(1.0 / torch.sqrt(r(ms + _const(float(eps), c))))
    gz = dy if weight is None else r(dy * _f64(weight).reshape(n))
    a_ = r(gz * rs)
    R = emulate_terms(r(gz * rows), summ, c).unsqueeze(-1)
    r3 = r(r(rs * rs) * rs)
    m2 = r(r(-0.5 * R * r3) / n)
    dx = round_to(r(a_ + r(m2 * (2.0 * rows))), prec.out).reshape(x.shape)
    if weight is None:
        return dx, None
    z = r(rows * rs)
    dw = emulate_terms(r(dy * z).transpose(0, 1), summ, c)
    return dx, round_to(dw, get_format(weight.dtype))


# ----------------------------------------------------------------------------- gelu / silu
def _gelu_constants(c: FloatFormat, storage: FloatFormat) -> tuple[float, float]:
    """``(kAlpha, kBeta)`` of torch's CPU ``GeluBackwardKernelImpl`` (erf form): fp32 kernel
    ``scalar_t(M_2_SQRTPI * M_SQRT1_2 * 0.5)``; bf16/fp16 kernel the float product
    ``float(M_2_SQRTPI) * float(M_SQRT1_2) * 0.5``."""
    alpha = _const(1.0 / math.sqrt(2.0), c)
    if storage.precision < c.precision:
        beta = _const(_const(2.0 / math.sqrt(math.pi), c) * alpha, c) * 0.5
    else:
        beta = _const(2.0 / math.sqrt(math.pi) / math.sqrt(2.0) * 0.5, c)
    return alpha, beta


def emulate_gelu_backward(g: torch.Tensor, x: torch.Tensor, approximate: str = "none", *, fmt=None,
                          compute_fmt=None, out_fmt=None) -> torch.Tensor:
    """torch CPU ``gelu_backward`` (ATen kernel; model in :mod:`ttrace_num.bounds.grads`) with
    correctly rounded ``erf``/``exp``/``tanh``."""
    prec = resolve_precision((x,), fmt, compute_fmt, out_fmt)
    c = prec.compute
    r = _rnd(c)
    xc, dy = r(_f64(x)), r(_f64(g))
    if approximate == "none":
        alpha, beta = _gelu_constants(c, prec.storage)
        cdf = 0.5 * r(1.0 + r(torch.special.erf(r(xc * alpha))))
        pdf = r(beta * r(torch.exp(r(r(xc * xc) * -0.5))))
        d = r(cdf + r(xc * pdf))
    elif approximate == "tanh":
        kb = _const(math.sqrt(2.0) * 2.0 / math.sqrt(math.pi) * 0.5, c)
        kk = _const(0.044715, c)
        x_sq = r(xc * xc)
        x_cube = r(x_sq * xc)
        th = r(torch.tanh(r(kb * r(xc + r(kk * x_cube)))))
        left = r(0.5 * xc)
        left_d = r(0.5 * r(1.0 + th))
        tanh_d = r(1.0 - r(th * th))
        inner_d = r(kb * r(1.0 + r(_const(3.0 * kk, c) * x_sq)))
        d = r(left_d + r(r(left * tanh_d) * inner_d))
    else:
        raise ValueError(f"approximate must be 'none' or 'tanh', not {approximate!r}")
    return round_to(r(dy * d), prec.out)


def emulate_silu_backward(g: torch.Tensor, x: torch.Tensor, *, fmt=None, compute_fmt=None,
                          out_fmt=None) -> torch.Tensor:
    """torch CPU ``silu_backward``: ``s = fl(1 / fl(1 + EXP(-x)))``, ``fl_o(fl(fl(dy s) fl(1 + fl(x fl(1 - s)))))``."""
    prec = resolve_precision((x,), fmt, compute_fmt, out_fmt)
    r = _rnd(prec.compute)
    xc, dy = r(_f64(x)), r(_f64(g))
    s = r(1.0 / r(1.0 + r(torch.exp(-xc))))
    return round_to(r(r(dy * s) * r(1.0 + r(xc * r(1.0 - s)))), prec.out)


# ============================================================================= exact references
def exact_linear_backward_input(g: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Exact ``g @ W`` (float64 rounding)."""
    return exact_matmul(g, weight)


def exact_linear_backward_weight(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Exact ``g^T x`` over the flattened tokens (float64 rounding)."""
    return exact_matmul(_flat(g).transpose(0, 1), _flat(x))


def exact_linear_backward_bias(g: torch.Tensor) -> torch.Tensor:
    """Exact sum of ``g`` over the leading dims (float64 rounding)."""
    return exact_sum(_flat(g), dim=0)


def exact_matmul_backward_a(g: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return exact_matmul(g, b.transpose(-1, -2))


def exact_matmul_backward_b(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return exact_matmul(a.transpose(-1, -2), g)


def _mp_rows(fn, *tensors: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Apply ``fn(*rows_as_mpf_lists) -> list`` to every row (last dim after ``movedim``) at
    the default mpmath precision; float64 result of the same shape."""
    moved = [_f64(t).movedim(dim, -1) for t in tensors]
    shape = moved[0].shape
    flat = [t.reshape(-1, shape[-1]) for t in moved]
    out = torch.empty(flat[0].shape, dtype=torch.float64)
    with workdps():
        for i in range(flat[0].shape[0]):
            vals = fn(*[to_mpf(f[i]) for f in flat])
            out[i] = torch.tensor([mpf_to_float(v) for v in vals], dtype=torch.float64)
    return out.reshape(shape).movedim(-1, dim)


def exact_softmax_backward(y: torch.Tensor, g: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``y (g - sum_j g_j y_j)`` from the stored ``y``, ``g`` (mpmath)."""
    def row(yr, gr):
        D = mpmath.fsum(a * b for a, b in zip(gr, yr))
        return [a * (b - D) for a, b in zip(yr, gr)]
    return _mp_rows(row, y, g, dim=dim)


def exact_log_softmax_backward(y_log: torch.Tensor, g: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``g - exp(y_log) sum_j g_j`` from the stored ``y_log``, ``g`` (mpmath)."""
    def row(lr, gr):
        s = mpmath.fsum(gr)
        return [b - mpmath.exp(a) * s for a, b in zip(lr, gr)]
    return _mp_rows(row, y_log, g, dim=dim)


def exact_cross_entropy_backward(logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean",
                                 label_smoothing: float = 0.0, ignore_index: int = -100,
                                 grad_output: float = 1.0) -> torch.Tensor:
    """``go (softmax(x) - (1-eps) onehot - eps/C) / N`` (``/N`` for ``"mean"``, ``N`` = non-ignored
    rows; ignored rows 0), mpmath; ``go`` is ``grad_output`` as stored in the logits' dtype."""
    x = _f64(logits)
    tgt = target.reshape(-1).to(torch.int64)
    keep = tgt != ignore_index
    C = x.shape[1]
    go = float(round_to(torch.tensor(float(grad_output), dtype=torch.float64), get_format(logits.dtype)))
    out = torch.zeros_like(x)
    with workdps():
        eps = mpmath.mpf(float(label_smoothing))
        scale = mpmath.mpf(go) / (int(keep.sum()) if reduction == "mean" else 1)
        for i in range(x.shape[0]):
            if not keep[i]:
                continue
            xs = to_mpf(x[i])
            mx = max(xs)
            es = [mpmath.exp(v - mx) for v in xs]
            S = mpmath.fsum(es)
            t = int(tgt[i])
            out[i] = torch.tensor([mpf_to_float(scale * (e / S - (1 - eps) * (j == t) - eps / C))
                                   for j, e in enumerate(es)], dtype=torch.float64)
    return out


def exact_layer_norm_backward(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None = None,
                              eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact ``(grad_x, grad_weight, grad_bias)`` of layer norm over the last dim:
    ``z = (x - mu) r``, ``r = (var + eps)^{-1/2}``, ``grad_x = r (gw - mean(gw) - z mean(gw z))``,
    ``grad_weight = sum_rows g z``, ``grad_bias = sum_rows g`` (mpmath; ``eps`` its float64 value)."""
    n = x.shape[-1]
    rows, dy = _rows(x, n), _rows(g, n)
    w = _f64(weight).reshape(n) if weight is not None else torch.ones(n, dtype=torch.float64)
    dx = torch.empty_like(rows)
    gz = [mpmath.mpf(0)] * n
    with workdps():
        wm = to_mpf(w)
        e = mpmath.mpf(float(eps))
        for i in range(rows.shape[0]):
            xs, gs = to_mpf(rows[i]), to_mpf(dy[i])
            mu = mpmath.fsum(xs) / n
            v = mpmath.fsum((a - mu) ** 2 for a in xs) / n
            r = 1 / mpmath.sqrt(v + e)
            z = [(a - mu) * r for a in xs]
            gw = [a * b for a, b in zip(gs, wm)]
            m1 = mpmath.fsum(gw) / n
            m2 = mpmath.fsum(a * b for a, b in zip(gw, z)) / n
            dx[i] = torch.tensor([mpf_to_float(r * (a - m1 - b * m2)) for a, b in zip(gw, z)], dtype=torch.float64)
            gz = [acc + a * b for acc, a, b in zip(gz, gs, z)]
        dw = torch.tensor([mpf_to_float(v) for v in gz], dtype=torch.float64)
    return dx.reshape(x.shape), dw, exact_sum(dy, dim=0)


def exact_rms_norm_backward(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None = None,
                            eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Exact ``(grad_x, grad_weight)`` of rms norm over the last dim: ``r = (mean(x^2) + eps)^{-1/2}``,
    ``z = x r``, ``grad_x = r (gw - z mean(gw z))``, ``grad_weight = sum_rows g z`` (mpmath;
    ``eps=None``: torch's default ``finfo(compute format).eps``, fp32's for bf16/fp16/fp32)."""
    n = x.shape[-1]
    rows, dy = _rows(x, n), _rows(g, n)
    if eps is None:
        eps = resolve_precision((x,)).compute.eps
    w = _f64(weight).reshape(n) if weight is not None else torch.ones(n, dtype=torch.float64)
    dx = torch.empty_like(rows)
    gz = [mpmath.mpf(0)] * n
    with workdps():
        wm = to_mpf(w)
        e = mpmath.mpf(float(eps))
        for i in range(rows.shape[0]):
            xs, gs = to_mpf(rows[i]), to_mpf(dy[i])
            r = 1 / mpmath.sqrt(mpmath.fsum(a * a for a in xs) / n + e)
            z = [a * r for a in xs]
            gw = [a * b for a, b in zip(gs, wm)]
            m2 = mpmath.fsum(a * b for a, b in zip(gw, z)) / n
            dx[i] = torch.tensor([mpf_to_float(r * (a - b * m2)) for a, b in zip(gw, z)], dtype=torch.float64)
            gz = [acc + a * b for acc, a, b in zip(gz, gs, z)]
        dw = torch.tensor([mpf_to_float(v) for v in gz], dtype=torch.float64)
    return dx.reshape(x.shape), (dw if weight is not None else None)


def _elementwise_mp(fn, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    gs, xs = _f64(g).flatten(), _f64(x).flatten()
    with workdps():
        vals = [mpf_to_float(mpmath.mpf(float(a)) * fn(mpmath.mpf(float(b)))) for a, b in zip(gs, xs)]
    return torch.tensor(vals, dtype=torch.float64).reshape(x.shape)


def _gelu_prime(x):
    return mpmath.ncdf(x) + x * mpmath.npdf(x)


def _gelu_tanh_prime(x):
    beta, kappa = mpmath.sqrt(2 / mpmath.pi), mpmath.mpf("0.044715")
    u = beta * (x + kappa * x ** 3)
    t = mpmath.tanh(u)
    return (1 + t) / 2 + x / 2 * (1 - t * t) * beta * (1 + 3 * kappa * x * x)


def _silu_prime(x):
    s = 1 / (1 + mpmath.exp(-x))
    return s * (1 + x * (1 - s))


def exact_gelu_backward(g: torch.Tensor, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``g gelu'(x)``: ``Phi(x) + x phi(x)`` or the tanh form's derivative (``kappa = 0.044715``
    exactly), mpmath."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', not {approximate!r}")
    return _elementwise_mp(_gelu_prime if approximate == "none" else _gelu_tanh_prime, g, x)


def exact_silu_backward(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``g silu'(x) = g s (1 + x (1 - s))``, ``s = sigmoid(x)``, mpmath."""
    return _elementwise_mp(_silu_prime, g, x)
