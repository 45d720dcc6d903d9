r"""Emulation of the attention computation models of :mod:`ttrace_num.bounds.attention`, and
exact (high-precision) references for attention forward and backward.

Emulation (every intermediate rounded with :func:`~ttrace_num.rounding.round_to`, vectorised
over batch, heads and rows; formats default as in the bound: compute fp32 for narrower
storage, scores and ``P`` in the compute format, output = storage):

* scores: ``fl_c(scale_c * dot)``, the dot product accumulated left to right in ``c``
  (:func:`~ttrace_num.emulate.summation.emulate_matmul`), ``scale_c = fl_c(scale)``; a float
  mask added with one more rounding; with ``score_fmt != c`` the product, the scaled and
  the masked scores are each rounded to ``score_fmt`` (a chain of narrow-dtype torch ops);
* ``"standard"``: ``m = max``, ``t = fl_c(s - m)``, ``e = fl_c(exp t)`` (float64 exp, then
  rounded: within 0.5 ulp + 2^-53), ``l`` = left-to-right sum in ``c``, ``r = fl_c(1/l)``,
  ``p = fl_c(e r)``, ``P~ = fl_pf(p)``, ``O = fl_out(sum_j P~_j v_j)`` (left to right in ``c``);
* ``"online"``: per key block: running max, ``alpha = fl_c(exp(fl_c(m_old - m_new)))`` (0 for
  the first non-empty block), ``e = fl_c(exp(fl_c(s - m_new)))``, ``l = fl_c(fl_c(alpha l) +
  blocksum(e))``, ``acc = fl_c(alpha acc)`` then ``acc + sum_j fl_pf(e_j) v_j`` as one
  left-to-right chain starting with the carried value; ``O = fl_out(fl_c(acc fl_c(1/l)))``.

``round_p=False`` skips the rounding of ``P`` to ``p_fmt`` (a deliberately different
computation, for tests that a bound stating the rounding is needed).

Fully masked rows give 0 (torch's convention, also the bound's).

Backward (:func:`emulate_attention_backward`): ``P`` as the forward computes it (standard:
the stored ``p`` of the forward, in ``c``; online: recomputed as ``fl_c(exp(fl_c(s - L)))``
from the forward's ``L = fl_c(m + fl_c(log l))``), ``dV = fl_out(P~^T dO)``, ``dP = dO V^T``
(``c``), ``D`` = ``rowsum(dO * O_stored)`` (``delta="output"``) or ``rowsum(P * dP)``
(``"probs"``) in ``c``, ``dS = fl_dsf(fl_c(P fl_c(dP - D)))``, ``dQ = fl_out(fl_c(scale_c
(dS K)))``, ``dK = fl_out(fl_c(scale_c (dS^T Q)))`` (GEMMs left to right in ``c``; with
``grad_accum_fmt``, blocked as torch's CPU flash backward accumulates: ``C = fl_acc(fl_c(C +
fl_c(scale_c block)))``); GQA sums the grouped heads' ``dK``/``dV`` in ``c`` before the output
rounding.

Exact references (:func:`exact_attention`, :func:`exact_attention_backward`): the scores
``q.k`` as a double-double (correctly rounded sum plus its correctly rounded residual,
:func:`~ttrace_num.reference.dot.exact_matmul`/:func:`~ttrace_num.reference.dot.exact_sum`:
exact to ``2^-106`` relative), times the exact scale, plus the mask, then the softmax (and
``dP - D``, ``dS``) in mpmath at ``dps`` digits (default 50); ``P`` and ``dS`` are split into
double-doubles ``hi + lo`` and every product with ``V``, ``K``, ``Q``, ``dO`` is
:func:`~ttrace_num.reference.dot.exact_matmul` of the concatenation ``[hi, lo] @ [B; B]``: the
result is the float64 rounding of a value within ``~2^-100`` relative of the exact one
(not a composition of correctly rounded steps). :func:`reference_attention_f64` is the
float64 evaluation for long sequences (relative error ``~(Lk + |s|) 2^-52``, see the tests).
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch
from mpmath import libmp

from ..bounds.attention import _problem
from ..bounds.common import resolve_precision
from ..bounds.summation import Summation
from ..formats import FloatFormat, get_format
from ..reference.dot import exact_matmul, exact_sum
from ..reference.mp import raw_to_float, resolve_prec
from ..rounding import round_to
from .summation import emulate_matmul, emulate_terms

__all__ = [
    "emulate_attention",
    "emulate_attention_backward",
    "exact_attention",
    "exact_attention_backward",
    "exp_u20",
    "reference_attention_f64",
]


def _formats(q, fmt, compute_fmt, out_fmt, score_fmt, p_fmt):
    prec = resolve_precision((q,), fmt, compute_fmt, out_fmt)
    c = prec.compute
    sf = get_format(score_fmt) if score_fmt is not None else c
    pf = get_format(p_fmt) if p_fmt is not None else c
    return prec, c, sf, pf


def _scores(pb, c: FloatFormat, sf: FloatFormat) -> torch.Tensor:
    """Computed scores (float64 on the grid of ``sf``), ``-inf`` where masked."""
    summ = Summation(accum=c)
    narrow = sf != c
    raw = emulate_matmul(pb.q, pb.k.transpose(-1, -2), summ, sf if narrow else c)
    sc = round_to(torch.tensor(pb.scale, dtype=torch.float64), c)
    s = round_to(raw * sc, c)
    if narrow:
        s = round_to(s, sf)
    if pb.add is not None:
        s = round_to(s + pb.add, c)
        if narrow:
            s = round_to(s, sf)
    return torch.where(pb.blocked.expand_as(s), torch.full_like(s, -math.inf), s)


def _softmax_stats(s: torch.Tensor, c: FloatFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Standard softmax pieces: ``(e, l, m)`` (``e`` = 0 where masked; rows all masked: ``e = 0``, ``l = 1``)."""
    m = s.max(-1, keepdim=True).values
    valid = torch.isfinite(m)
    msafe = torch.where(valid, m, torch.zeros_like(m))
    t = round_to(s - msafe, c)
    e = torch.where(torch.isfinite(s), round_to(torch.exp(t), c), torch.zeros_like(s))
    l = emulate_terms(e, Summation(accum=c), c).unsqueeze(-1)
    l = torch.where(valid, l, torch.ones_like(l))
    return e, l, msafe


def _gemm(a: torch.Tensor, b: torch.Tensor, c: FloatFormat) -> torch.Tensor:
    return emulate_matmul(a, b, Summation(accum=c), c)


def _online(s: torch.Tensor, v: torch.Tensor, c: FloatFormat, pf: FloatFormat, block: int, round_p: bool,
            c2: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Online softmax-PV: ``(acc, l, m)`` (``m`` = final running max, ``-inf`` for empty rows).
    ``c2`` (the exp2 kernels: FlashAttention-2 with torch's ``UNFUSE_FMA``, the memory-efficient
    kernel): ``s`` are the unscaled ``q.k``, ``e = exp2(fl(fl(s c2) - fl(m c2)))``, ``alpha =
    exp2(fl(fl(m_prev - m) c2))``, ``c2 = fl(scale log2 e)``; float64 ``exp2`` rounded once to ``c``."""

    def ex(x: torch.Tensor, mx: torch.Tensor) -> torch.Tensor:  # the kernel's exp(x - mx)
        if c2 is None:
            return round_to(torch.exp(round_to(x - mx, c)), c)
        return round_to(torch.exp2(round_to(round_to(x * c2, c) - round_to(mx * c2, c), c)), c)

    def rescale(d: torch.Tensor) -> torch.Tensor:  # the kernel's exp(m_prev - m_new)
        if c2 is None:
            return round_to(torch.exp(round_to(d, c)), c)
        return round_to(torch.exp2(round_to(round_to(d, c) * c2, c)), c)

    Lk = s.shape[-1]
    shape = s.shape[:-1]
    m = torch.full(shape + (1,), -math.inf, dtype=torch.float64)
    l = torch.zeros(shape + (1,), dtype=torch.float64)
    acc = torch.zeros(torch.broadcast_shapes(shape[:-1], v.shape[:-2]) + (shape[-1], v.shape[-1]),
                      dtype=torch.float64)
    summ = Summation(accum=c)
    for j0 in range(0, Lk, block):
        sb = s[..., j0:j0 + block]
        vb = v[..., j0:j0 + block, :]
        m_new = torch.maximum(m, sb.max(-1, keepdim=True).values)
        live = torch.isfinite(m_new)
        mn = torch.where(live, m_new, torch.zeros_like(m_new))
        alpha = torch.where(torch.isfinite(m), rescale(m - mn), torch.zeros_like(m))
        e = torch.where(torch.isfinite(sb), ex(sb, mn), torch.zeros_like(sb))
        l = torch.where(live, round_to(round_to(alpha * l, c) + emulate_terms(e, summ, c).unsqueeze(-1), c), l)
        pt = round_to(e, pf) if round_p else e
        carried = round_to(alpha * acc, c)
        terms = pt.unsqueeze(-2) * vb.transpose(-1, -2).unsqueeze(-3)  # (..., Lq, dv, b)
        new = emulate_terms(torch.cat([carried.unsqueeze(-1), terms], dim=-1), summ, c)
        acc = torch.where(live, new, acc)
        m = m_new
    return acc, l, m


def emulate_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask=None, mask=None,
                      is_causal: bool = False, causal: bool = False, scale: float | None = None,
                      enable_gqa: bool = False, algorithm: str = "standard", block_size: int = 128, fmt=None,
                      compute_fmt=None, out_fmt=None, score_fmt=None, p_fmt=None, round_p: bool = True,
                      exp2: bool = False) -> torch.Tensor:
    """Attention forward under the stated model (module docstring); float64 result on the
    output format's grid. ``exp2=True`` (``algorithm="online"``, boolean/causal masks): the GPU
    kernels' exp2 of the unscaled scores times ``c2 = fl(scale log2 e)`` (:func:`_online`)."""
    prec, c, sf, pf = _formats(q, fmt, compute_fmt, out_fmt, score_fmt, p_fmt)
    pb = _problem(q, k, v, attn_mask, mask, is_causal or causal, scale, enable_gqa)
    c2 = None
    if exp2:
        if algorithm != "online" or pb.add is not None:
            raise ValueError("exp2=True emulates the GPU online kernels: algorithm='online' and a boolean mask")
        c2 = float(round_to(torch.tensor(pb.scale * math.log2(math.e), dtype=torch.float64), c))
        pb = replace(pb, scale=1.0)  # the scale is applied inside the exp2 argument
    s = _scores(pb, c, sf)
    valid = torch.isfinite(s).any(-1, keepdim=True)
    if algorithm == "standard":
        e, l, _ = _softmax_stats(s, c)
        p = round_to(e * round_to(1.0 / l, c), c)
        pt = round_to(p, pf) if round_p else p
        o = _gemm(pt, pb.v, c)
    elif algorithm == "online":
        acc, l, _ = _online(s, pb.v, c, pf, block_size, round_p, c2)
        o = round_to(acc * round_to(1.0 / torch.where(valid, l, torch.ones_like(l)), c), c)
    else:
        raise ValueError(f"unknown algorithm {algorithm!r}")
    o = torch.where(valid, o, torch.zeros_like(o))
    return round_to(o, prec.out)


def _group_sum(g: torch.Tensor, rep: int, c: FloatFormat) -> torch.Tensor:
    """Sum the ``rep`` consecutive heads (dim -3) of a key/value gradient in ``c`` (GQA)."""
    if rep == 1:
        return g
    gg = g.reshape(*g.shape[:-3], g.shape[-3] // rep, rep, *g.shape[-2:])
    return emulate_terms(gg.movedim(-3, -1), Summation(accum=c), c)


def _grad_gemm(a: torch.Tensor, b: torch.Tensor, c: FloatFormat, sc: torch.Tensor | None, accum_fmt, block: int | None
               ) -> torch.Tensor:
    """``[scale] a @ b`` in ``c``; with ``accum_fmt`` the contraction is split into blocks of ``block``
    and accumulated as torch's CPU flash backward does: ``C = fl_acc(fl_c(C + fl_c(scale * block GEMM)))``."""
    n = a.shape[-1]
    if accum_fmt is None or block is None or block >= n:
        r = _gemm(a, b, c)
        return r if sc is None else round_to(r * sc, c)
    acc = None
    for j0 in range(0, n, block):
        part = _gemm(a[..., j0:j0 + block], b[..., j0:j0 + block, :], c)
        part = part if sc is None else round_to(part * sc, c)
        acc = round_to(part if acc is None else round_to(acc + part, c), get_format(accum_fmt))
    return acc


def emulate_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, *,
                               attn_mask=None, mask=None, is_causal: bool = False, causal: bool = False,
                               scale: float | None = None, enable_gqa: bool = False, algorithm: str = "standard",
                               block_size: int = 128, delta: str | None = None, fmt=None, compute_fmt=None,
                               out_fmt=None, score_fmt=None, p_fmt=None, ds_fmt=None, grad_accum_fmt=None,
                               q_block_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dQ, dK, dV)`` under the stated backward model (module docstring), float64 on the
    output grid. The forward output used by ``delta="output"`` is :func:`emulate_attention`'s.
    ``grad_accum_fmt``: the gradient GEMMs accumulate blocks (``q_block_size`` rows for ``dK``,
    ``dV``; ``block_size`` keys for ``dQ``) into a ``grad_accum_fmt`` accumulator."""
    prec, c, sf, pf = _formats(q, fmt, compute_fmt, out_fmt, score_fmt, p_fmt)
    dsf = get_format(ds_fmt) if ds_fmt is not None else pf
    delta = delta or ("probs" if algorithm == "standard" else "output")
    causal = is_causal or causal
    pb = _problem(q, k, v, attn_mask, mask, causal, scale, enable_gqa)
    s = _scores(pb, c, sf)
    if algorithm == "standard":
        e, l, _ = _softmax_stats(s, c)
        P = round_to(e * round_to(1.0 / l, c), c)
    else:
        _, l, m = _online(s, pb.v, c, pf, block_size, True)
        msafe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        L = round_to(msafe + round_to(torch.log(l), c), c)
        P = torch.where(torch.isfinite(s), round_to(torch.exp(round_to(s - L, c)), c), torch.zeros_like(s))
    do = grad_out.detach().to(torch.float64)
    dv = _grad_gemm(round_to(P, pf).transpose(-1, -2), do, c, None, grad_accum_fmt, q_block_size)
    dP = _gemm(do, pb.v.transpose(-1, -2), c)
    if delta == "output":
        o = emulate_attention(q, k, v, attn_mask=attn_mask, mask=mask, is_causal=causal, scale=scale,
                              enable_gqa=enable_gqa, algorithm=algorithm, block_size=block_size, fmt=fmt,
                              compute_fmt=compute_fmt, out_fmt=out_fmt, score_fmt=score_fmt, p_fmt=p_fmt)
        D = emulate_terms(do * o, Summation(accum=c), c).unsqueeze(-1)
    else:
        D = emulate_terms(P * dP, Summation(accum=c), c).unsqueeze(-1)
    dS = round_to(round_to(P * round_to(dP - D, c), c), dsf)
    sc = round_to(torch.tensor(pb.scale, dtype=torch.float64), c)
    dq = _grad_gemm(dS, pb.k, c, sc, grad_accum_fmt, block_size)
    dk = _grad_gemm(dS.transpose(-1, -2), pb.q, c, sc, grad_accum_fmt, q_block_size)
    dk, dv = _group_sum(dk, pb.rep, c), _group_sum(dv, pb.rep, c)
    return round_to(dq, prec.out), round_to(dk, prec.out), round_to(dv, prec.out)


# ----------------------------------------------------------------------------- torch's exp_u20
def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 ``a * b + c`` for float32 operands (the product is exact in float64;
    the float64 sum and its TwoSum residual decide the one rounding to float32, ties included)."""
    p = a.double() * b.double()
    c = c.double()
    s = p + c
    bb = s - p
    e = (p - (s - bb)) + (c - bb)
    r32 = s.float()
    r = r32.double()
    d = s - r
    up = torch.nextafter(r32, torch.where(d >= 0, torch.tensor(math.inf), torch.tensor(-math.inf))).double()
    mid = (d != 0) & (d.abs() * 2 == (up - r).abs())
    go_up = mid & (e != 0) & (torch.sign(e) == torch.sign(d))
    return torch.where(go_up, up, r).float()


def exp_u20(x: torch.Tensor) -> torch.Tensor:
    """Bit-level emulation of torch's ``Vectorized<float>::exp_u20`` (``aten/src/ATen/cpu/vec/vec256/
    vec256_float.h``; the AVX-512 version uses the same constants and steps): ``fx = floor(fma(x,
    log2e, 0.5))``, ``r = fma(-fx, ln2f, x)``, a degree-5 polynomial in Horner form with FMAs, times
    ``2^(fx-1)`` (0 below ``ln(FLT_MIN)``) times 2. Used to measure :data:`~ttrace_num.bounds.attention
    .EXP_U20_ULPS` (tests/test_bounds_attention.py)."""
    f = torch.float32
    x = x.to(f)
    bits = lambda b: torch.tensor([b], dtype=torch.int32).view(f)[0]
    log2e, ln2, lnmin, lnmax = bits(0x3fb8aa3b), bits(0x3f317218), bits(-1028740016), bits(0x42b17218)
    coef = [torch.full_like(x, c) for c in (0.999999701, 0.499991506, 0.166676521, 0.0418978221, 0.00828929059)]
    small = x < lnmin
    src = x.clamp(max=float(lnmax)).clamp(min=float(lnmin))
    fx = torch.floor(_fma32(src, torch.full_like(x, float(log2e)), torch.full_like(x, 0.5)))
    r = _fma32(-fx, torch.full_like(x, float(ln2)), src)
    res = _fma32(r, coef[4], coef[3])
    for cf in (coef[2], coef[1], coef[0], torch.ones_like(x)):
        res = _fma32(r, res, cf)
    n = (fx - 1).to(torch.int32)
    two = ((n + 127) << 23).view(f)
    two = torch.where(small, torch.zeros_like(two), two)
    return (res * two) * 2


# ----------------------------------------------------------------------------- exact references
def _dd_scores(pb) -> tuple[torch.Tensor, torch.Tensor]:
    """``q.k`` as a double-double ``(hi, lo)``: correctly rounded sum and correctly rounded residual."""
    hi = exact_matmul(pb.q, pb.k.transpose(-1, -2))
    prods = pb.q.unsqueeze(-2) * pb.k.unsqueeze(-3)  # exact for inputs up to fp32
    lo = exact_sum(torch.cat([prods, -hi.unsqueeze(-1)], dim=-1), dim=-1)
    return hi, lo


def _dd_matmul(hi: torch.Tensor, lo: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Float64 rounding of ``(hi + lo) @ b``, computed exactly."""
    return exact_matmul(torch.cat([hi, lo], dim=-1), torch.cat([b, b], dim=-2))


_ff, _add, _sub, _mul, _div, _exp, _sum = (libmp.from_float, libmp.mpf_add, libmp.mpf_sub, libmp.mpf_mul,
                                            libmp.mpf_div, libmp.mpf_exp, libmp.mpf_sum)


def _split(vals: list, shape, wp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw mpf values -> double-double ``(hi, lo)`` tensors (``hi`` correctly rounded)."""
    hi = [raw_to_float(x) for x in vals]
    lo = [raw_to_float(_sub(x, _ff(h), wp)) for x, h in zip(vals, hi)]
    return (torch.tensor(hi, dtype=torch.float64).reshape(shape), torch.tensor(lo, dtype=torch.float64).reshape(shape))


def _mp_scale(pb, wp: int) -> tuple:
    if pb.default_scale:
        return _div(libmp.fone, libmp.mpf_sqrt(libmp.from_int(pb.q.shape[-1]), wp), wp)
    return _ff(pb.scale)


def _mp_probs(pb, wp: int) -> tuple[list, list]:
    """Per (batch, head, row) lists of raw mpf probabilities (fully masked rows: zeros)."""
    hi, lo = _dd_scores(pb)
    shape = list(hi.shape)
    n = shape[-1]
    blocked = pb.blocked.expand(hi.shape).reshape(-1, n).tolist()
    H, Lw = hi.reshape(-1, n).tolist(), lo.reshape(-1, n).tolist()
    add = pb.add.expand(hi.shape).reshape(-1, n).tolist() if pb.add is not None else None
    sc = _mp_scale(pb, wp)
    zero = libmp.fzero
    probs = []
    for r, (hr, lr, br) in enumerate(zip(H, Lw, blocked)):
        live = [j for j in range(n) if not br[j]]
        if not live:
            probs.append([zero] * n)
            continue
        s = {}
        for j in live:
            x = _mul(sc, _add(_ff(hr[j]), _ff(lr[j])), wp)  # hi + lo exactly, times the exact scale
            s[j] = _add(x, _ff(add[r][j]), wp) if add else x
        m = _ff(max(raw_to_float(x) for x in s.values()))  # any shift is exact in the ratio
        e = {j: _exp(_sub(x, m, wp), wp) for j, x in s.items()}
        W = _sum(list(e.values()), wp)
        probs.append([_div(e[j], W, wp) if j in e else zero for j in range(n)])
    return probs, shape


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask=None, mask=None,
                    is_causal: bool = False, causal: bool = False, scale: float | None = None,
                    enable_gqa: bool = False, dps: int = 50, **_ignored) -> torch.Tensor:
    """Exact attention output (float64 rounding of the exact value; fully masked rows 0).
    Model keywords (``algorithm=``, formats...) are accepted and ignored."""
    pb = _problem(q, k, v, attn_mask, mask, is_causal or causal, scale, enable_gqa)
    wp = resolve_prec(dps) + 8
    probs, shape = _mp_probs(pb, wp)
    phi, plo = _split([x for row in probs for x in row], shape, wp)
    return _dd_matmul(phi, plo, pb.v)


def exact_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, *,
                             attn_mask=None, mask=None, is_causal: bool = False, causal: bool = False,
                             scale: float | None = None, enable_gqa: bool = False, dps: int = 50, **_ignored
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact ``(dQ, dK, dV)`` (float64 roundings of the exact values; GQA: ``dK``, ``dV`` per
    key/value head, summed exactly over its query heads)."""
    pb = _problem(q, k, v, attn_mask, mask, is_causal or causal, scale, enable_gqa)
    wp = resolve_prec(dps) + 8
    probs, shape = _mp_probs(pb, wp)
    do = grad_out.detach().to(torch.float64)
    dhi = exact_matmul(do, pb.v.transpose(-1, -2))
    prods = do.unsqueeze(-2) * pb.v.unsqueeze(-3)
    dlo = exact_sum(torch.cat([prods, -dhi.unsqueeze(-1)], dim=-1), dim=-1)
    DH, DL = dhi.reshape(-1, shape[-1]).tolist(), dlo.reshape(-1, shape[-1]).tolist()
    sc = _mp_scale(pb, wp)
    ds = []
    for pr, hr, lr in zip(probs, DH, DL):
        dp = [_add(_ff(h), _ff(l)) for h, l in zip(hr, lr)]  # exact double-double dP
        D = _sum([_mul(p, x, wp) for p, x in zip(pr, dp)], wp)
        ds.extend(_mul(sc, _mul(p, _sub(x, D, wp), wp), wp) for p, x in zip(pr, dp))
    shi, slo = _split(ds, shape, wp)
    phi, plo = _split([x for row in probs for x in row], shape, wp)
    dq = _dd_matmul(shi, slo, pb.k)
    rep = pb.rep

    def grouped(a_hi, a_lo, b):  # sum over the rep query heads of a key/value head, exactly
        a = torch.cat([a_hi, a_lo], dim=-2).transpose(-1, -2)  # (..., H, Lk, 2Lq)
        bb = torch.cat([b, b], dim=-2)                          # (..., H, 2Lq, n)
        if rep > 1:
            a = a.reshape(*a.shape[:-3], a.shape[-3] // rep, rep, *a.shape[-2:]).movedim(-3, -2)
            a = a.reshape(*a.shape[:-3], a.shape[-3], -1)
            bb = bb.reshape(*bb.shape[:-3], bb.shape[-3] // rep, rep * bb.shape[-2], bb.shape[-1])
        return exact_matmul(a, bb)

    dk = grouped(shi, slo, pb.q)
    dv = grouped(phi, plo, do)
    return dq, dk, dv


def reference_attention_f64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask=None, mask=None,
                            is_causal: bool = False, causal: bool = False, scale: float | None = None,
                            enable_gqa: bool = False, **_ignored) -> torch.Tensor:
    """Float64 attention (for sequences too long for :func:`exact_attention`; fully masked rows 0)."""
    pb = _problem(q, k, v, attn_mask, mask, is_causal or causal, scale, enable_gqa)
    s = pb.scale * torch.matmul(pb.q, pb.k.transpose(-1, -2))
    if pb.add is not None:
        s = s + pb.add
    s = torch.where(pb.blocked.expand_as(s), torch.full_like(s, -math.inf), s)
    valid = torch.isfinite(s).any(-1, keepdim=True)
    p = torch.softmax(torch.where(valid, s, torch.zeros_like(s)), dim=-1)
    return torch.where(valid, torch.matmul(p, pb.v), torch.zeros((), dtype=torch.float64))
