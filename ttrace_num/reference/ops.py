"""High-precision references for the non-linear operators (mpmath, >= 40 digits).

Every function takes torch tensors of any real float dtype (values are taken exactly,
through float64) and returns a float64 tensor of the shape of the corresponding torch
op's output. Parameters such as ``eps`` or ``label_smoothing`` are taken as the exact
value of the Python float (float64) given.

Accuracy. Each reference evaluates the mathematical definition in binary floating point
of ``wp = prec + 8`` bits, where ``prec`` corresponds to ``dps`` decimal digits (default
:data:`~ttrace_num.reference.mp.DEFAULT_DPS` = 50, i.e. 169 bits; set per call with
``dps=`` or for a block with ``with workdps(80):``). Sums of input values (means,
variances, sums of squares, sums of logits) are computed **exactly** (integer
arithmetic), and the formulas are arranged so that no rounded quantity is subtracted from
a nearly equal one:

* softmax = exp(x_i - m) / sum_j exp(x_j - m); log_softmax = (x_i - m) - log S (both <= 0);
  cross_entropy: nll = (m - x_t) + log S, smoothing term sum_c (m - x_c) (exact) + C log S;
* layer_norm / rms_norm: only ``1 / (n sqrt(var + eps))`` is rounded; ``d_i c w_i + b_i``
  is then formed exactly and rounded once (``+ b`` cancelling is harmless);
* gelu / silu: ``x/2 + (x/2) f`` with f = erf or tanh (exact sum) where ``f >= -0.77``,
  and ``x/2 erfc(-x/sqrt 2)`` / ``x / (1 + exp(-2u))`` in the negative tail.
* mse_loss and its gradient are rational in the inputs: computed exactly
  (``fractions.Fraction``) and rounded once, so always correctly rounded.

``x - m`` is exact. So before the final rounding every result has relative error below
~2^-(prec - 12) (~5e-48 at dps=50; the worst cases are erfc / exp of large arguments,
whose condition numbers ~2 z^2 and |2u| eat up to ~12 of the 8 guard bits plus the
requested ones) and is then rounded to nearest float64 with
:func:`~ttrace_num.reference.mp.raw_to_float` (correct rounding, subnormals included).
So results are **correctly rounded unless the exact value lies within that tiny relative
distance of a float64 rounding midpoint** (then the neighbour may be returned: always
faithful). The tests check that dps=40 and dps=80 give identical float64 results, and
agreement with straightforward mpmath formulas evaluated at 80-400 digits.

Special values (documented choices):

* softmax / log_softmax / cross_entropy: ``-inf`` logits are masked (probability 0,
  log-probability -inf) and handled exactly; a row whose logits are all ``-inf``, or that
  contains ``+inf`` or NaN, gives NaN for the whole row (as torch does).
  cross_entropy: ``ignore_index`` rows contribute 0 and are excluded from the mean;
  a mean over no rows is NaN (as torch).
* layer_norm / rms_norm / the elementwise activations: rows (elements) containing a
  non-finite value, and layer_norm/rms_norm rows whose denominator ``var + eps`` is 0,
  return what torch's float64 op returns for them (IEEE propagation: NaN, inf, 0*inf).
* Outputs that underflow (e.g. softmax of logits 800 below the max, gelu(x) for
  x < -38.5) are rounded correctly, i.e. to 0 or a subnormal.

Speed (CPU time on the project's 2-core EPYC, python mpmath backend; gmpy2 makes the
exp/erf-bound ones 1.1-2x faster): softmax / log_softmax / cross_entropy (64, 1024)
~1.2 s (dominated by ~65k ``mpf_exp`` calls), layer_norm (32, 4096) with weight and bias
~0.3 s, rms_norm ~0.2 s, mean_ref ~0.1 s; gelu (erf) ~30 us, gelu (tanh) / silu ~25 us,
swiglu ~30 us per element. Elementwise ops evaluate each *distinct* input value once,
so bf16/fp8 inputs are cheap (gelu on a (32, 4096) bf16 tensor: ~0.1 s).
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from mpmath import libmp
from mpmath.libmp import libhyper

from .dot import exact_sum
from .mp import raw_to_float, resolve_prec

__all__ = [
    "softmax",
    "log_softmax",
    "cross_entropy",
    "layer_norm",
    "rms_norm",
    "gelu",
    "silu",
    "swiglu",
    "sum_ref",
    "mean_ref",
]

_GUARD = 8  # extra working bits on top of the requested precision

_from_float = libmp.from_float
_from_int = libmp.from_int
_mpf_add = libmp.mpf_add
_mpf_sub = libmp.mpf_sub
_mpf_mul = libmp.mpf_mul
_mpf_mul_int = libmp.mpf_mul_int
_mpf_div = libmp.mpf_div
_mpf_exp = libmp.mpf_exp
_mpf_log = libmp.mpf_log
_mpf_sqrt = libmp.mpf_sqrt
_mpf_sum = libmp.mpf_sum
_mpf_neg = libmp.mpf_neg
_mpf_shift = libmp.mpf_shift
_mpf_erf = libhyper.mpf_erf
_mpf_erfc = libhyper.mpf_erfc
_fzero = libmp.fzero
_fone = libmp.fone
_finf = libmp.finf
_fninf = libmp.fninf
_INF = math.inf
_NAN = math.nan


def _wp(dps: int | None) -> int:
    return resolve_prec(dps) + _GUARD


def _f64(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x)
    if x.is_complex() or not x.is_floating_point():
        raise TypeError(f"expected a real floating tensor, got {x.dtype}")
    return x.detach().to("cpu", torch.float64)


def _rows_last(x64: torch.Tensor, dim: int):
    """Move ``dim`` last and flatten: returns (list of row lists, moved shape)."""
    xm = x64.movedim(dim, -1)
    shape = xm.shape
    n = shape[-1] if len(shape) else 1
    rows = xm.reshape(-1, n).tolist()
    return rows, shape


def _back(values: list, moved_shape, dim: int) -> torch.Tensor:
    out = torch.tensor(values, dtype=torch.float64).reshape(moved_shape)
    return out.movedim(-1, dim) if len(moved_shape) else out


# ----------------------------------------------------------------------------- softmax family


def _row_lse_parts(row: list, wp: int, need_exps: bool, log_only_thr: float | None):
    """For a finite-max row: returns (m_raw, t list (x - m, None for -inf), e list, S)."""
    m = max(row)
    mr = _from_float(m)
    ts = []
    es = []
    ff = _from_float
    sub = _mpf_sub
    exp = _mpf_exp
    thr = 760.0 if log_only_thr is None else log_only_thr
    for v in row:
        if v == -_INF:
            ts.append(None)
            es.append(_fzero)
            continue
        t = sub(ff(v), mr, 0)  # exact
        ts.append(t)
        if m - v > thr:  # exp(t) is negligible (for S) / underflows (for softmax)
            es.append(_fzero)
        else:
            es.append(exp(t, wp))
    S = _mpf_sum(es, wp)
    return mr, ts, es, S


def _bad_row(row: list) -> bool:
    """NaN, +inf present, or everything -inf: torch gives NaN for the whole row."""
    m = -_INF
    for v in row:
        if v != v or v == _INF:
            return True
        if v > m:
            m = v
    return m == -_INF


def softmax(x: torch.Tensor, dim: int = -1, dps: int | None = None) -> torch.Tensor:
    """Reference ``torch.softmax(x, dim)``: exp(x_i - max) / sum_j exp(x_j - max), exactly rounded.

    ``-inf`` entries give 0; fully masked rows (all ``-inf``) and rows with NaN/+inf give NaN."""
    x64 = _f64(x)
    if x64.dim() == 0:
        x64 = x64.reshape(1)
        return softmax(x64, 0, dps).reshape(())
    wp = _wp(dps)
    rows, shape = _rows_last(x64, dim)
    out = []
    rf = raw_to_float
    mul = _mpf_mul
    for row in rows:
        if _bad_row(row):
            out.extend([_NAN] * len(row))
            continue
        _, _, es, S = _row_lse_parts(row, wp, True, None)
        inv = _mpf_div(_fone, S, wp)
        out.extend([rf(mul(e, inv, wp)) if e[1] else 0.0 for e in es])
    return _back(out, shape, dim)


def log_softmax(x: torch.Tensor, dim: int = -1, dps: int | None = None) -> torch.Tensor:
    """Reference ``torch.log_softmax(x, dim)``: (x_i - max) - log(sum_j exp(x_j - max)).

    Both terms are <= 0, so there is no cancellation. ``-inf`` entries give ``-inf``;
    fully masked rows and rows with NaN/+inf give NaN."""
    x64 = _f64(x)
    if x64.dim() == 0:
        return log_softmax(x64.reshape(1), 0, dps).reshape(())
    wp = _wp(dps)
    rows, shape = _rows_last(x64, dim)
    out = []
    rf = raw_to_float
    sub = _mpf_sub
    for row in rows:
        if _bad_row(row):
            out.extend([_NAN] * len(row))
            continue
        thr = wp * 0.6932 + math.log(len(row)) + 20.0
        _, ts, _, S = _row_lse_parts(row, wp, False, thr)
        logS = _mpf_log(S, wp)
        out.extend([-_INF if t is None else rf(sub(t, logS, wp)) for t in ts])
    return _back(out, shape, dim)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    dps: int | None = None,
) -> torch.Tensor:
    """Reference ``torch.nn.functional.cross_entropy`` with class-index targets (no weights).

    Per sample: ``(1 - ls) * (LSE - x_t) + ls / C * sum_c (LSE - x_c)`` with
    ``LSE = log sum_c exp(x_c)``; logits ``(N, C)``, ``(N, C, d1, ...)`` or ``(C,)``;
    ``reduction`` "none" (shape of target), "sum" or "mean" (over non-ignored samples)."""
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"reduction must be 'none', 'mean' or 'sum', not {reduction!r}")
    x64 = _f64(logits)
    tgt = torch.as_tensor(target)
    if tgt.is_floating_point():
        raise NotImplementedError("probability targets are not supported; pass class indices")
    if x64.dim() == 1:
        x2 = x64.reshape(1, -1)
        t1 = tgt.reshape(1)
        tshape = ()
    else:
        C = x64.shape[1]
        x2 = x64.movedim(1, -1).reshape(-1, C)
        t1 = tgt.reshape(-1)
        tshape = tuple(tgt.shape)
        if tuple(x64.shape[:1] + x64.shape[2:]) != tshape:
            raise ValueError(f"target shape {tshape} does not match logits {tuple(x64.shape)}")
    C = x2.shape[1]
    ls = float(label_smoothing)
    if not 0.0 <= ls <= 1.0:
        raise ValueError("label_smoothing must be in [0, 1]")
    wp = _wp(dps)
    rows = x2.tolist()
    targets = t1.tolist()
    w_nll = _mpf_sub(_fone, _from_float(ls), wp) if ls else _fone  # 1 - ls
    w_smooth = _mpf_div(_from_float(ls), _from_int(C), wp) if ls else _fzero  # ls / C
    losses = []  # raw mpf (or special floats)
    specials = []
    count = 0
    for row, t in zip(rows, targets):
        if t == ignore_index:
            losses.append(_fzero)
            continue
        if not 0 <= t < C:
            raise IndexError(f"target {t} out of range for {C} classes")
        count += 1
        if _bad_row(row):
            losses.append(None)
            specials.append(_NAN)
            continue
        thr = wp * 0.6932 + math.log(C) + 20.0
        mr, ts, _, S = _row_lse_parts(row, wp, False, thr)
        logS = _mpf_log(S, wp)
        xt = row[t]
        if xt == -_INF or (ls and any(v == -_INF for v in row)):
            losses.append(_finf)
            continue
        # nll = (m - x_t) + log S: both >= 0
        nll = _mpf_add(_mpf_sub(mr, _from_float(xt), 0), logS, wp)
        loss = _mpf_mul(w_nll, nll, wp)
        if ls:
            # sum_c (LSE - x_c) = sum_c (m - x_c) + C log S, with sum_c (m - x_c) exact (>= 0)
            X, E = _scaled_ints(row)
            ex = libmp.from_man_exp(C * max(X) - sum(X), E)  # exact
            smooth = _mpf_add(ex, _mpf_mul_int(logS, C, wp), wp)
            loss = _mpf_add(loss, _mpf_mul(w_smooth, smooth, wp), wp)
        losses.append(loss)
    has_nan = any(l is None for l in losses)
    if reduction == "none":
        vals = [_NAN if l is None else raw_to_float(l) for l in losses]
        return torch.tensor(vals, dtype=torch.float64).reshape(tshape)
    if has_nan:
        return torch.tensor(_NAN, dtype=torch.float64)
    total = _mpf_sum(losses, wp)  # all terms >= 0
    if reduction == "sum":
        return torch.tensor(raw_to_float(total), dtype=torch.float64)
    if count == 0:
        return torch.tensor(_NAN, dtype=torch.float64)
    return torch.tensor(raw_to_float(_mpf_div(total, _from_int(count), wp)), dtype=torch.float64)


# ----------------------------------------------------------------------------- normalisation


def _norm_rows(x: torch.Tensor, normalized_shape):
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    normalized_shape = tuple(int(s) for s in normalized_shape)
    k = len(normalized_shape)
    x64 = _f64(x)
    if tuple(x64.shape[x64.dim() - k:]) != normalized_shape:
        raise ValueError(f"normalized_shape {normalized_shape} does not match input {tuple(x64.shape)}")
    n = math.prod(normalized_shape)
    rows = x64.reshape(-1, n).tolist()
    return x64, rows, n, normalized_shape


def _finite_row(row: list) -> bool:
    return all(v - v == 0.0 for v in row)  # False for inf and nan


def _scaled_ints(vals: list) -> tuple[list, int]:
    """Finite floats -> (ints X_i, E) with vals[i] == X_i * 2**E exactly (common E)."""
    ratios = [v.as_integer_ratio() for v in vals]
    dbits = max(den.bit_length() for _, den in ratios)
    ints = [num << (dbits - den.bit_length()) for num, den in ratios]
    return ints, 1 - dbits


def _round_scaled(ms: list, e: int) -> list:
    """Correctly rounded floats of ``m * 2**e`` for ints m (one rounding each).

    Uses CPython's int/int true division, which is correctly rounded (ties to even,
    subnormals included) and raises OverflowError only when the rounded value overflows."""
    out = []
    if e < 0:
        den = 1 << -e
        for m in ms:
            try:
                out.append(m / den)
            except OverflowError:
                out.append(_INF if m > 0 else -_INF)
    else:
        for m in ms:
            try:
                out.append(float(m << e))
            except OverflowError:
                out.append(_INF if m > 0 else -_INF)
    return out


def _raw_man_exp(r) -> tuple[int, int]:
    sign, man, exp, _ = r
    m = int(man)
    return (-m if sign else m), exp


def _affine_ints(weight, bias, n):
    """Weights/bias as exact scaled ints (None if absent)."""
    w = b = None
    if weight is not None:
        wv = _f64(weight).reshape(-1).tolist()
        if len(wv) != n:
            raise ValueError("weight does not match normalized_shape")
        if not _finite_row(wv):
            raise ValueError("weight must be finite")
        w = _scaled_ints(wv)
    if bias is not None:
        bv = _f64(bias).reshape(-1).tolist()
        if len(bv) != n:
            raise ValueError("bias does not match normalized_shape")
        if not _finite_row(bv):
            raise ValueError("bias must be finite")
        b = _scaled_ints(bv)
    return w, b


def _finish_affine(ps: list, e: int, w, b) -> list:
    """Round ``p_i 2**e * w_i + b_i`` exactly once (p_i ints; w, b scaled ints or None)."""
    if w is not None:
        W, EW = w
        ps = [p * wi for p, wi in zip(ps, W)]
        e += EW
    if b is not None:
        B, EB = b
        if EB >= e:
            sh = EB - e
            ps = [p + (bi << sh) for p, bi in zip(ps, B)]
        else:
            sh = e - EB
            ps = [(p << sh) + bi for p, bi in zip(ps, B)]
            e = EB
    return _round_scaled(ps, e)


def layer_norm(
    x: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    dps: int | None = None,
) -> torch.Tensor:
    """Reference ``torch.nn.functional.layer_norm``: (x - mean) / sqrt(var + eps) * w + b.

    Mean and biased variance over the last ``len(normalized_shape)`` dims are exact:
    with ``x_i = X_i 2^E`` (integers), ``d_i = n X_i - sum X`` and ``sum d_i^2`` are exact
    integers, so a constant row gives exactly ``x - mean = 0`` (output ``b``, or 0). Only
    ``c = 1 / (n sqrt(var + eps))`` is rounded (to ``prec + 8`` bits); then
    ``d_i c w_i + b_i`` is formed exactly and rounded once to float64, so the result is
    the correct rounding of a value with relative error < 2^-(prec+5) in its
    ``d_i c w_i`` part (``b_i`` exact): no cancellation issue even when ``b`` cancels."""
    x64, rows, n, nshape = _norm_rows(x, normalized_shape)
    w, b = _affine_ints(weight, bias, n)
    wp = _wp(dps)
    epsr = _from_float(float(eps))
    n3 = _from_int(n**3)
    out = []
    fallback = []
    for r, row in enumerate(rows):
        if not _finite_row(row):
            fallback.append(r)
            out.extend([0.0] * n)
            continue
        X, E = _scaled_ints(row)
        S = sum(X)
        d = [n * xi - S for xi in X]  # n (x_i - mean) 2^-E, exact
        SS = sum([di * di for di in d])
        var = _mpf_div(libmp.from_man_exp(SS, 2 * E), n3, wp)
        den = _mpf_add(var, epsr, wp)
        if not den[1]:
            fallback.append(r)
            out.extend([0.0] * n)
            continue
        c = _mpf_div(_fone, _mpf_mul(_mpf_sqrt(den, wp), _from_int(n), wp), wp)  # 1/(n sqrt(den))
        cm, ce = _raw_man_exp(c)
        out.extend(_finish_affine([di * cm for di in d], ce + E, w, b))
    res = torch.tensor(out, dtype=torch.float64).reshape(x64.shape)
    if fallback:
        idx = torch.tensor(fallback)
        flat = x64.reshape(-1, n)[idx].reshape((len(fallback),) + nshape)
        tw = None if weight is None else _f64(weight)
        tb = None if bias is None else _f64(bias)
        res.reshape(-1, n)[idx] = F.layer_norm(flat, nshape, tw, tb, float(eps)).reshape(len(fallback), n)
    return res


def rms_norm(
    x: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float | None = 1e-6,
    dps: int | None = None,
) -> torch.Tensor:
    """Reference ``torch.nn.functional.rms_norm``: x / sqrt(mean(x^2) + eps) * w.

    ``eps=None`` means torch's CPU default: ``finfo(compute dtype).eps``, where the compute
    dtype is float32 for bf16/fp16 inputs (torch computes them in fp32) and the input dtype
    otherwise.
    ``sum x^2`` is exact; only ``1/sqrt(mean + eps)`` is rounded (prec + 8 bits), then
    ``x_i r w_i`` is formed exactly and rounded once."""
    if eps is None:
        eps = torch.finfo(torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype).eps
    x64, rows, n, nshape = _norm_rows(x, normalized_shape)
    w, _ = _affine_ints(weight, None, n)
    wp = _wp(dps)
    epsr = _from_float(float(eps))
    nr = _from_int(n)
    out = []
    fallback = []
    for r, row in enumerate(rows):
        if not _finite_row(row):
            fallback.append(r)
            out.extend([0.0] * n)
            continue
        X, E = _scaled_ints(row)
        SS = sum([xi * xi for xi in X])
        den = _mpf_add(_mpf_div(libmp.from_man_exp(SS, 2 * E), nr, wp), epsr, wp)
        if not den[1]:
            fallback.append(r)
            out.extend([0.0] * n)
            continue
        c = _mpf_div(_fone, _mpf_sqrt(den, wp), wp)
        cm, ce = _raw_man_exp(c)
        out.extend(_finish_affine([xi * cm for xi in X], ce + E, w, None))
    res = torch.tensor(out, dtype=torch.float64).reshape(x64.shape)
    if fallback:
        idx = torch.tensor(fallback)
        flat = x64.reshape(-1, n)[idx].reshape((len(fallback),) + nshape)
        tw = None if weight is None else _f64(weight)
        res.reshape(-1, n)[idx] = F.rms_norm(flat, list(nshape), tw, float(eps)).reshape(len(fallback), n)
    return res


# ----------------------------------------------------------------------------- elementwise


def _elementwise(x: torch.Tensor, scalar_fn, torch_fn) -> torch.Tensor:
    """Apply ``scalar_fn(float) -> float`` once per distinct finite value; non-finite
    elements take ``torch_fn``'s float64 result."""
    x64 = _f64(x)
    flat = x64.reshape(-1).numpy()
    fin = np.isfinite(flat)
    out = np.empty_like(flat)
    if fin.any():
        vals, inv = np.unique(flat[fin], return_inverse=True)
        res = np.array([scalar_fn(v) for v in vals.tolist()], dtype=np.float64)
        out[fin] = res[inv.reshape(-1)]
    if not fin.all():
        out[~fin] = torch_fn(torch.from_numpy(flat[~fin].copy())).numpy()
    return torch.from_numpy(out).reshape(x64.shape)


_mpf_tanh = libmp.mpf_tanh


def _half_plus(xr, f, wp):
    """``x/2 + (x/2) f`` with the product rounded to ``wp`` bits and the sum exact.

    Used where ``f`` = erf / tanh is in [-0.77, 1]: no harmful cancellation, and for tiny
    (subnormal) x the exact ``x/2`` keeps the final rounding correct next to a midpoint."""
    h = _mpf_shift(xr, -1)
    return _mpf_add(h, _mpf_mul(h, f, wp), 0)


def _silu_raw(xr, wp):
    """silu(x) as a raw mpf (relative error < 2^-(wp-3)); not rounded to float."""
    if libmp.mpf_ge(xr, _M2):
        # x sigmoid(x) = x/2 + (x/2) tanh(x/2)
        return _half_plus(xr, _mpf_tanh(_mpf_shift(xr, -1), wp), wp)
    # x < -2: x / (1 + exp(-x)), no cancellation
    return _mpf_div(xr, _mpf_add(_fone, _mpf_exp(_mpf_neg(xr), wp), wp), wp)


_M2 = libmp.from_int(-2)


def silu(x: torch.Tensor, dps: int | None = None) -> torch.Tensor:
    """Reference ``torch.nn.functional.silu``: x * sigmoid(x).

    Evaluated as x/2 + (x/2) tanh(x/2) for x >= -2 and x / (1 + exp(-x)) below."""
    wp = _wp(dps)
    return _elementwise(x, lambda v: raw_to_float(_silu_raw(_from_float(v), wp)), F.silu)


_GELU_TANH_K = "0.044715"


def gelu(x: torch.Tensor, approximate: str = "none", dps: int | None = None) -> torch.Tensor:
    """Reference ``torch.nn.functional.gelu``.

    ``"none"``: x Phi(x) = x/2 + (x/2) erf(x/sqrt 2) for x >= -1.5, and x/2 erfc(-x/sqrt 2)
    below (so the tail keeps its relative accuracy; torch's float64 gelu returns 0 there
    already at x = -8.5). ``"tanh"``: x/2 (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3)
    with the exact decimal 0.044715, evaluated as x/2 + (x/2) tanh(u) for u >= -1 and as
    x / (1 + exp(-2u)) below (no cancellation)."""
    wp = _wp(dps)
    if approximate == "none":
        inv_sqrt2 = _mpf_div(_fone, _mpf_sqrt(_from_int(2), wp + 10), wp + 10)

        def fn(v: float) -> float:
            if v > 13.5:  # erfc(v/sqrt2)/2 < 1e-41: x Phi(x) rounds to x
                return v
            if v < -40.0:  # |x Phi(x)| < 2**-1100: rounds to -0.0
                return -0.0
            xr = _from_float(v)
            z = _mpf_mul(xr, inv_sqrt2, wp)
            if v >= -1.5:
                return raw_to_float(_half_plus(xr, _mpf_erf(z, wp), wp))
            return raw_to_float(_mpf_shift(_mpf_mul(xr, _mpf_erfc(_mpf_neg(z), wp), wp), -1))

        return _elementwise(x, fn, lambda t: F.gelu(t))
    if approximate == "tanh":
        k = _mpf_sqrt(_mpf_div(_from_int(2), libmp.mpf_pi(wp + 10), wp + 10), wp + 10)
        c = libmp.from_str(_GELU_TANH_K, wp + 10, "n")
        m1 = libmp.from_int(-1)

        def fn(v: float) -> float:
            xr = _from_float(v)
            x3 = _mpf_mul(_mpf_mul(xr, xr, 0), xr, 0)  # exact
            u = _mpf_mul(k, _mpf_add(xr, _mpf_mul(c, x3, wp), wp), wp)
            if libmp.mpf_ge(u, m1):
                return raw_to_float(_half_plus(xr, _mpf_tanh(u, wp), wp))
            den = _mpf_add(_fone, _mpf_exp(_mpf_shift(_mpf_neg(u), 1), wp), wp)
            return raw_to_float(_mpf_div(xr, den, wp))

        return _elementwise(x, fn, lambda t: F.gelu(t, approximate="tanh"))
    raise ValueError(f"approximate must be 'none' or 'tanh', not {approximate!r}")


def swiglu(x: torch.Tensor, dim: int = -1, dps: int | None = None) -> torch.Tensor:
    """Reference Megatron ``swiglu``: ``a, b = chunk(x, 2, dim)``; ``silu(a) * b`` (one rounding)."""
    x64 = _f64(x)
    if x64.shape[dim] % 2:
        raise ValueError("swiglu needs an even size along dim")
    a, b = torch.chunk(x64, 2, dim=dim)
    shape = a.shape
    av = a.reshape(-1).tolist()
    bv = b.reshape(-1).tolist()
    wp = _wp(dps)
    ff = _from_float
    out = []
    special = []
    for i, (p, q) in enumerate(zip(av, bv)):
        if p - p != 0.0 or q - q != 0.0:
            special.append(i)
            out.append(0.0)
            continue
        out.append(raw_to_float(_mpf_mul(_silu_raw(ff(p), wp), ff(q), wp + 64)))
    res = torch.tensor(out, dtype=torch.float64)
    if special:
        idx = torch.tensor(special)
        res[idx] = F.silu(a.reshape(-1)[idx]) * b.reshape(-1)[idx]
    return res.reshape(shape)


# ----------------------------------------------------------------------------- reductions


def sum_ref(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Correctly rounded ``torch.sum(x, dim)`` (exact summation, see ``dot.exact_sum``)."""
    return exact_sum(x, dim=dim, keepdim=keepdim)


def mean_ref(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Correctly rounded ``torch.mean(x, dim)``: the exact sum divided by n, rounded once.

    Non-finite slices follow IEEE (``exact_sum`` semantics divided by n); an empty slice is NaN."""
    x64 = _f64(x)
    if dim is None:
        rows = [x64.reshape(-1).tolist()]
        out_shape = (1,) * x64.dim() if keepdim else ()
    else:
        if x64.dim() == 0:
            x64 = x64.reshape(1)
        d = dim % x64.dim()
        shape = list(x64.shape)
        if keepdim:
            shape[d] = 1
        else:
            shape.pop(d)
        out_shape = tuple(shape)
        rows = x64.movedim(d, -1).reshape(math.prod(out_shape) if not keepdim else math.prod(shape), x64.shape[d]).tolist()
    out = []
    for row in rows:
        n = len(row)
        if n == 0:
            out.append(_NAN)
            continue
        if not _finite_row(row):
            s = float(exact_sum(torch.tensor(row, dtype=torch.float64)).item())
            out.append(s / n)
            continue
        X, E = _scaled_ints(row)
        S = sum(X)
        # S 2^E / n, rounded once (int/int true division is correctly rounded)
        try:
            out.append(S / (n << -E) if E < 0 else (S << E) / n)
        except OverflowError:
            out.append(_INF if S > 0 else -_INF)
    return torch.tensor(out, dtype=torch.float64).reshape(out_shape)


# ----------------------------------------------------------------------------- mse loss
_MSE_REDUCTIONS = ("none", "mean", "sum")


def _mse_inputs(x: torch.Tensor, y: torch.Tensor, reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
    if reduction not in _MSE_REDUCTIONS:
        raise ValueError(f"reduction must be one of {_MSE_REDUCTIONS}, got {reduction!r}")
    if x.shape != y.shape:
        raise ValueError(f"mse_loss reference: input {tuple(x.shape)} and target {tuple(y.shape)} must have the "
                         "same shape (broadcast them first)")
    return _f64(x), _f64(y)


def _to_float(q: Fraction) -> float:
    """``q`` rounded to nearest float64 (``Fraction.__float__`` divides two ints: correctly
    rounded), overflow to ``+-inf``."""
    try:
        return float(q)
    except OverflowError:
        return _INF if q > 0 else -_INF


def mse_loss(x: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Correctly rounded ``F.mse_loss(x, y, reduction)``: ``(x - y)^2`` per element
    (``"none"``), their sum (``"sum"``) or the sum divided by ``n`` (``"mean"``), each the exact
    rational value (every float is a dyadic rational: ``fractions.Fraction``, exact) rounded
    once. Non-finite inputs follow IEEE float64 arithmetic (NaN, inf)."""
    x64, y64 = _mse_inputs(x, y, reduction)
    if not (torch.isfinite(x64).all() and torch.isfinite(y64).all()):
        sq = (x64 - y64) ** 2
        return sq if reduction == "none" else (sq.sum() if reduction == "sum" else sq.mean())
    sq = [(Fraction(a) - Fraction(b)) ** 2 for a, b in zip(x64.reshape(-1).tolist(), y64.reshape(-1).tolist())]
    if reduction == "none":
        return torch.tensor([_to_float(q) for q in sq], dtype=torch.float64).reshape(x64.shape)
    if reduction == "mean" and not sq:
        return torch.tensor(_NAN, dtype=torch.float64)  # torch: the mean of no elements
    total = sum(sq, Fraction(0))
    return torch.tensor(_to_float(total / len(sq) if reduction == "mean" else total), dtype=torch.float64)


def mse_loss_backward(x: torch.Tensor, y: torch.Tensor, grad_output: torch.Tensor,
                      reduction: str = "mean") -> torch.Tensor:
    """Correctly rounded ``d F.mse_loss(x, y, reduction) / d x`` given the upstream gradient:
    ``norm (x - y) grad_output`` with ``norm = 2 / n`` for ``"mean"``, else 2 (``grad_output`` a
    scalar for ``"mean"``/``"sum"``, of ``x``'s shape for ``"none"``), exact (``Fraction``) and
    rounded once. Non-finite inputs follow IEEE float64 arithmetic."""
    x64, y64 = _mse_inputs(x, y, reduction)
    g64 = torch.broadcast_to(_f64(torch.as_tensor(grad_output)), x64.shape)
    n = x64.numel()
    if not all(bool(torch.isfinite(t).all()) for t in (x64, y64, g64)):
        return (2.0 / max(n, 1) if reduction == "mean" else 2.0) * (x64 - y64) * g64
    norm = Fraction(2, max(n, 1)) if reduction == "mean" else Fraction(2)
    out = [_to_float(norm * (Fraction(a) - Fraction(b)) * Fraction(g))
           for a, b, g in zip(x64.reshape(-1).tolist(), y64.reshape(-1).tolist(), g64.reshape(-1).tolist())]
    return torch.tensor(out, dtype=torch.float64).reshape(x64.shape)
