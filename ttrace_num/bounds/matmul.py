r"""Matrix multiplication (``matmul``, ``bmm``, ``linear``) and its split-K difference bound.

Computation model
-----------------
Inputs: ``A``, ``B`` (and a bias) stored in ``fmt``, their values taken as exact. Every
output ``y_ij = sum_k a_ik b_kj (+ bias_j)`` is an ``n``-term sum (``n = K``, or ``K + 1``
with a bias, the bias being the last term) evaluated as a
:class:`~ttrace_num.bounds.summation.Summation` states: accumulation format (default: the
compute format, fp32 for bf16/fp16/FP8 inputs), order (default ``recursive``: its height
``n - 1`` is the largest of any order, so it covers MKL, oneDNN, cuBLAS... whatever order
and blocking they use), split-K / tensor parallelism (``split``, ``reduce_fmt``,
``reduce_algorithm``), then rounded to the output format. Products are exact when
``2 p_in <= p_accum`` (bf16/fp16 inputs, fp32 accumulation); otherwise one more rounding
level is counted (it also covers FMA, which does not round them).

Flush to zero. The default model is ``Summation(accum=compute, ftz=True)``: the kernel a
user gets may flush products, partial sums and results below the normal range to zero and
read subnormal inputs as zero (torch 2.13's bf16 GEMM on an AVX512-BF16 CPU does: 99% of the
elements of a product in fp32's subnormal range violated the gradual-underflow bound; GPU
tensor cores may). The bound then has ``eta = (2n - k) min_normal(accum)`` (every rounding
may flush), ``max(t, half_ulp_out(t))`` for outputs with ``t = |y| + acc < min_normal_out``,
and, where an input is subnormal, the dropped products ``|A_sub||B| + |A||B_sub|``
(:func:`daz_term`, added to ``acc`` and to the output magnitude). On normal data this adds
``~n 2^-126`` for fp32 accumulation: tightness is unchanged (see
:mod:`.summation`, "Flush to zero"). Pass a ``Summation`` without ``ftz`` for a kernel with
gradual underflow.

Bound (:mod:`.summation`, identity (1) and its two stages; Higham 2002, §3.1, eq. (3.5);
probabilistic: Higham & Mary 2019, Connolly, Higham & Mary 2021)::

    |y_hat - y| <= acc + half_ulp_out(|y| + acc)
    acc = theta_in S + theta_out T_hat + eta        (deterministic)
    acc = lambda sqrt(((1+g_in) s_in S)^2 + ((1+g_out) s_out T_hat)^2) + eta   (probabilistic, if smaller)

with ``S = |A| |B| (+ |bias|)``, ``T_hat = T + g_in S``, ``T = sum_parts |A_i B_i|`` (the
exact partial products of the ``split`` K-slices; ``T = |y|`` without a split) and
``s^2 = sum_f d_f u_f^2`` over each stage's levels. ``half_ulp_out`` is half the spacing
of the output format at that magnitude (not ``u |y|``), which is what makes bf16/fp16
outputs tight.

Statistics and cost
-------------------
``S`` and ``y``: two matmuls in fp32 (fp64 for fp64 inputs, or when fp32 matmuls may use
TF32/bf16 internally), made rigorous: for non-negative terms any floating-point sum in
any order satisfies ``fl(sum p) >= (1 - (K+1) u_w) sum p``, so ``S <= fl(S) / (1 - (K+1)
u_w)``, and ``|fl(A B) - A B| <= gamma_{K+1} S`` bounds ``|y|``. With a split, ``T`` costs
``k`` more matmuls of ``K/k`` (one matmul in total). Measured (1024^3, 1 thread, loaded
2-core AVX2 EPYC): fp32 matmul 64-120 ms, the deterministic bound 240 ms (two fp32
matmuls plus ~8 float64 passes), split-K bound ~400 ms. For bf16 inputs the statistics
are fp32 matmuls: on a CPU with native bf16 GEMMs (AVX512-bf16, ~2.3x faster than fp32)
the bound costs ~4-5 bf16 matmuls; on AVX2 (no bf16 GEMM, 6 s) it is 20x cheaper than the
matmul itself.

Tightness, and why fp32 with fp32 accumulation is loose on random data
--------------------------------------------------------------------
bf16/fp16 outputs: the output rounding dominates; median instance tightness (min over an
instance's elements of bound/|error|) ~1.0-1.3 (probabilistic) on random normal data.

fp32 inputs and outputs, fp32 accumulation, K = 4096, random normal data (MKL): the
probabilistic bound is ~900 (worst element of an instance) to ~4600 (median element)
times the actual error; deterministic ~1e4-5e4. The factors, measured
(``tests/test_bounds_matmul.py``, bench ``matmul`` cases):

1. **Sign cancellation** (~13x at K = 4096): the bound charges every rounding with
   ``S_v = sum |a_k b_k|`` below the node, the actual error with the computed partial
   sum ``s_v``, a random walk ``~ sqrt(len)`` on random-sign data (``S / |y| ~ 58``). On
   all-positive data the MKL tightness drops from ~4600 to ~360.
2. **The kernel's order** (~12x): the bound must hold for any order, so the path length
   is ``K - 1`` (probabilistic ``sqrt(K - 1)``); MKL's blocked kernel behaves like a
   ~30-deep chain (``(30/360)^2 K``). An emulated recursive chain on positive data has
   tightness ~30 (median element) / ~6 (worst element).
3. **The rounding model** (~5-30x, the rest): ``lambda(1e-6) = 5.4`` standard deviations,
   ``|delta| <= u`` (a round-to-nearest error is ~uniform within half an ulp: variance
   ``~u^2/6``), ``S_v`` vs the average partial sum ``S_v / 2`` along a chain.

None of 1-2 can be removed rigorously for an unknown order: an order that sums the
positive products first makes the partial sums reach ``max(P, N) >= S/2`` for a length
``~K/2`` path, so a bound valid for every order and every data set of given ``S`` is
within a small constant of being attained. The bound is not loose by construction:
recursive bf16 accumulation of positive products that stagnate (``1 + t``, ``t`` just
below half an ulp) attains the deterministic bound to ``1 + O(K u)`` (tightness 1.24 at
K = 32), and on uniform positive data the probabilistic bound is within ~3-6 of the worst
element. Tighter fp32 bounds need a known order (``Summation(algorithm=..., block=...,
known_order=True)`` for a documented kernel) or data-dependent statistics (e.g. partial
sums along a known order), which cost more than the matmul.

Difference of two models (:func:`matmul_difference`): see :mod:`.summation`; nothing is
shared between two unknown orders (a kernel's order may change with the shapes and the
layout: MKL's fp32 ``(A @ B)[:, :1]`` and ``A @ B[:, :1]`` differ in the last bits), and
the probabilistic form adds the two computations' unshared roundings in quadrature.
"""
from __future__ import annotations

import os
from typing import Literal

import torch

from ..formats import FloatFormat, get_format, half_ulp
from .base import Bound, Explanation
from .common import Precision, register, resolve_mode, resolve_precision
from .summation import Summation, output_rounding, products_exact, sum_difference_bound, sum_error_bound

__all__ = ["matmul", "linear", "matmul_difference", "matmul_statistics", "daz_term", "magnitude_lower",
           "torch_bias_rounding"]

SOURCE = ("Higham, Accuracy and Stability of Numerical Algorithms (2002) §3.1, §4; probabilistic: "
          "Higham & Mary, SISC 41(5) 2019; Connolly, Higham & Mary, SISC 43(1) 2021 (martingale form)")


def _fp32_matmul_is_ieee(device: torch.device) -> bool:
    """Whether fp32 matmuls really compute in fp32 here: ``torch.set_float32_matmul_precision
    ("high"/"medium")`` or the backends' ``fp32_precision`` let them use TF32 or bf16
    internally (oneDNN on CPU, cuBLAS on CUDA), which would make the statistics below
    lower bounds no more."""
    if torch.get_float32_matmul_precision() != "highest":
        return False
    backend = torch.backends.cuda.matmul if device.type == "cuda" else torch.backends.mkldnn.matmul
    if getattr(backend, "fp32_precision", "none") not in ("none", "ieee"):
        return False
    return not (device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32)


def _working(a: torch.Tensor, b: torch.Tensor) -> torch.dtype:
    """fp32 holds every input format up to fp32 exactly and is twice as fast as fp64 on CPU;
    fp64 for fp64 inputs, or when fp32 matmuls are allowed to use TF32/bf16 internally."""
    if a.dtype == torch.float64 or b.dtype == torch.float64 or not _fp32_matmul_is_ieee(a.device):
        return torch.float64
    return torch.float32


def _working_constants(wd: torch.dtype) -> tuple[float, float]:
    """``(u, eta)`` of the working precision: unit roundoff and subnormal absolute error."""
    return (2.0 ** -53, 2.0 ** -1075) if wd == torch.float64 else (2.0 ** -24, 2.0 ** -150)


def matmul_statistics(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(S_upper, |y|_upper, n)``: rigorous float64 upper bounds on ``(|A||B| + |bias|)`` and
    on ``|A B + bias|`` per output, computed with two working-precision matmuls."""
    wd = _working(a, b)
    uw, eta_w = _working_constants(wd)
    aw, bw = a.detach().to(wd), b.detach().to(wd)
    k = a.shape[-1]
    n = k + (bias is not None)
    s = torch.matmul(aw.abs(), bw.abs())
    y = torch.matmul(aw, bw)
    if bias is not None:
        bw_ = bias.detach().to(wd)
        s = s + bw_.abs()
        y = y + bw_
    gam = (n + 1) * uw
    if gam >= 0.5:
        raise ValueError(f"inner dimension {k} is too large for the working precision {wd}")
    s64 = s.to(torch.float64).mul_(1.0 / (1.0 - gam)).add_((n + 1) * eta_w)
    y64 = y.to(torch.float64).abs_().add_(s64, alpha=gam / (1.0 - gam))
    return s64, y64, n


def magnitude_lower(abs_sum: torch.Tensor, magnitude: torch.Tensor, n: int, a: torch.Tensor, b: torch.Tensor
                    ) -> torch.Tensor:
    """Lower bound on ``|A B + bias|`` from :func:`matmul_statistics`' ``(S_upper, |y|_upper, n)``:
    ``|y|_upper = |y_w| + g S_upper`` with ``|y - y_w| <= g S_upper``, ``g = gamma_{n+1}(u_w)``,
    so ``|y| >= |y|_upper - 2 g S_upper``."""
    uw, _ = _working_constants(_working(a, b))
    gam = (n + 1) * uw / (1.0 - (n + 1) * uw)
    return magnitude - 2.0 * gam * abs_sum


def partial_abs_sum(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, summation: Summation,
                    abs_sum: torch.Tensor) -> torch.Tensor | None:
    """Rigorous upper bound on ``T = sum_i |p_i|``, the exact partial sums of the ``split``
    contiguous parts of each output's ``n`` terms (the ``K`` products, then the bias), or
    ``None`` with a single part. ``abs_sum`` is an upper bound on ``S`` (from
    :func:`matmul_statistics`).

    Each ``P_i = fl(A_i @ B_i [+ bias])`` in the working precision is within
    ``gamma_{m+1} S_i`` of ``p_i`` (``m`` = part size, any order), so
    ``T <= (sum_i |P_i|)(1 + gamma_k(2**-53)) + gamma_{m+1} S + (n+1) eta_w`` (the sum of the
    ``|P_i|`` is taken in float64). Cost: ``k`` matmuls of ``K/k``, one matmul in total.
    """
    k = a.shape[-1]
    n = k + (bias is not None)
    parts = summation.parts(n)
    if parts <= 1:
        return None
    ps = summation.part_size(n)
    wd = _working(a, b)
    uw, eta_w = _working_constants(wd)
    aw, bw = a.detach().to(wd), b.detach().to(wd)
    total = None
    for i in range(parts):
        lo, hi = i * ps, min((i + 1) * ps, n)
        p = torch.matmul(aw[..., lo:min(hi, k)], bw[..., lo:min(hi, k), :])
        if bias is not None and hi == n:
            p = p + bias.detach().to(wd)
        total = p.to(torch.float64).abs() if total is None else total + p.to(torch.float64).abs()
    gam = (ps + 1) * uw / (1.0 - (ps + 1) * uw)
    gam64 = parts * 2.0 ** -53 / (1.0 - parts * 2.0 ** -53)
    return total * (1.0 + gam64) + gam * abs_sum + (n + 1) * eta_w


def daz_term(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, fmt: FloatFormat) -> torch.Tensor | None:
    """Rigorous upper bound on the products (and bias) a kernel that reads subnormal inputs as
    zero (DAZ) drops: ``|A_sub| |B| + |A| |B_sub| (+ |bias_sub|)`` with ``X_sub`` the entries of
    ``X`` below ``fmt``'s normal range (:func:`matmul_statistics` of the masked operands), or
    ``None`` when no input is subnormal (one pass over the inputs)."""
    def sub(t: torch.Tensor) -> torch.Tensor:
        return (t.abs() < fmt.min_normal) & (t != 0)
    ma, mb = sub(a), sub(b)
    mbias = sub(bias) if bias is not None else None
    if not (ma.any() or mb.any() or (mbias is not None and mbias.any())):
        return None
    zero_bias = None if bias is None else bias.masked_fill(~mbias, 0)
    return (matmul_statistics(a.masked_fill(~ma, 0), b, zero_bias)[0]
            + matmul_statistics(a, b.masked_fill(~mb, 0))[0])


def _default_summation(prec: Precision, summation: Summation | None) -> Summation:
    """``Summation(accum=compute_fmt, ftz=True)``: any order, and subnormals may be flushed (the
    kernel a user gets may be an FTZ one, e.g. AVX512-BF16 GEMMs; module docstring)."""
    return summation if summation is not None else Summation(accum=prec.compute, ftz=True)


@register("matmul", "mm", "bmm")
def matmul(a: torch.Tensor, b: torch.Tensor, *, bias: torch.Tensor | None = None, fmt=None,
           compute_fmt=None, out_fmt=None, summation: Summation | None = None,
           mode: str = "deterministic", failure_probability: float | None = None) -> Bound:
    """Elementwise bound on ``|fl(A @ B [+ bias]) - (A @ B [+ bias])|`` (torch.matmul broadcasting).

    Args:
        a, b: the stored inputs (their values are taken as exact; their dtype gives the
            default storage format).
        bias: optional bias added along the last dim (as ``F.linear``), one more term.
        fmt / compute_fmt / out_fmt: storage, accumulation and output formats (defaults:
            input dtype, fp32 for narrower inputs, input dtype).
        summation: the accumulation model; default ``Summation(accum=compute_fmt, ftz=True)``
            (recursive: valid for any order, e.g. an MKL or cuBLAS kernel; subnormals may be
            flushed, e.g. AVX512-BF16 GEMMs, tensor cores). Use
            ``Summation(split=k, reduce_fmt=...)`` for split-K / tensor parallelism.
        mode: ``"deterministic"`` or ``"probabilistic"``.
        failure_probability: per-element, probabilistic mode (default 1e-6).
    """
    prec = resolve_precision((a, b), fmt, compute_fmt, out_fmt)
    summ = _default_summation(prec, summation)
    ms = resolve_mode(mode, failure_probability)
    s, ymag, n = matmul_statistics(a, b, bias)
    exact_p = products_exact(prec.storage, summ.accum)
    t = partial_abs_sum(a, b, bias, summ, s)
    daz = daz_term(a, b, bias, prec.storage) if summ.ftz else None
    # with DAZ the kernel sums the terms without the dropped ones: |y'| <= |y| + daz, and y' - y <= daz
    low = magnitude_lower(s, ymag, n, a, b) if summ.ftz else None
    bound, values = sum_error_bound(s, ymag if daz is None else ymag + daz, n, summ, prec.out, ms.mode, ms.lam,
                                    exact_p, partial_abs_sum=t,
                                    magnitude_lower=low if daz is None or low is None else low - daz)
    if daz is not None:
        bound = bound + daz
        values["daz"] = "|A_sub||B| + |A||B_sub|"
    values.update(precision=prec.describe(), products_exact=exact_p, S="(|A||B|)_ij")
    formula = ("|err_ij| <= acc_ij + half_ulp_out(|y_ij| + acc_ij), acc = theta_in S + theta_out T_hat + eta, "
               "S = |A||B|, T_hat = sum_parts |A_i B_i| + theta_in S"
               + ("" if ms.mode == "deterministic" else
                  "; or lambda sqrt(((1+g_in) s_in S)^2 + ((1+g_out) s_out T_hat)^2) + eta, "
                  "s^2 = sum_f d_f u_f^2, g = theta or the probabilistic path growth, if smaller"))
    assumptions = ["inputs are exact as stored", f"summation tree: {summ.describe()}"]
    if ms.mode == "probabilistic":
        assumptions.append("rounding errors mean-independent (Higham-Mary model)")
    return Bound(abs=bound, mode=ms.mode, failure_probability=ms.failure_probability, magnitude=ymag,
                 explanation=Explanation(op="matmul", formula=formula, source=SOURCE,
                                         assumptions=tuple(assumptions), values=values))


BiasRounding = Literal["fused", "separate"]


def torch_bias_rounding(x: torch.Tensor) -> BiasRounding:
    """How ``F.linear(x, weight, bias)`` adds a bias, by ATen's ``linear`` (torch 2.13,
    ``aten/src/ATen/native/Linear.cpp``; verified bit for bit, ``tests/test_bounds_matmul.py``):
    a 2-D input, a contiguous input of any other rank (flattened to 2-D), or a 3-D input with
    ``TORCH_LINEAR_FLATTEN_3D=1`` takes ``addmm``: the bias is one more term of the sum, one
    rounding (``"fused"``); any other input (a non-contiguous 3-D or N-D view: a transpose, an
    expand) takes ``matmul``, rounded to the output format, then ``add_(bias)``: two
    roundings (``"separate"``)."""
    flatten_3d = os.environ.get("TORCH_LINEAR_FLATTEN_3D", "").lower() in ("1", "true")
    if x.dim() == 2 or x.is_contiguous() or (flatten_3d and x.dim() == 3):
        return "fused"
    return "separate"


@register("linear")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           bias_rounding: BiasRounding | None = None, **kw) -> Bound:
    """``F.linear(x, weight, bias) = x @ weight.T + bias``: see :func:`matmul`.

    ``bias_rounding``: ``"fused"`` (the bias is the last term of the sum, one rounding:
    ``addmm``), ``"separate"`` (``y1 = fl_o(x W^T)`` then ``fl_o(fl_c(y1 + bias))``: the matmul
    bound ``B1`` plus ``hu_c(t) + hu_o(t + hu_c(t))`` at ``t = |y| + B1``, the output flushed
    where it may be subnormal); default ``None``: what torch does for this ``x``
    (:func:`torch_bias_rounding`)."""
    wt = weight.transpose(-1, -2)
    if bias_rounding is None:
        bias_rounding = torch_bias_rounding(x)
    if bias_rounding not in ("fused", "separate"):
        raise ValueError(f"bias_rounding must be 'fused', 'separate' or None (torch's rule), not {bias_rounding!r}")
    if bias is None or bias_rounding == "fused":
        return matmul(x, wt, bias=bias, **kw)
    first = matmul(x, wt, **kw)
    prec = resolve_precision((x, wt), kw.get("fmt"), kw.get("compute_fmt"), kw.get("out_fmt"))
    s, ymag, n = matmul_statistics(x, wt, bias)
    t = ymag + first.abs
    r_c = half_ulp(t, prec.compute)
    low = magnitude_lower(s, ymag, n, x, wt) - first.abs - r_c
    bound = first.abs + r_c + output_rounding(t + r_c, prec.compute, prec.out, True, low)
    e = first.explanation
    return Bound(abs=bound, mode=first.mode, failure_probability=first.failure_probability, magnitude=ymag,
                 explanation=Explanation(op="linear", formula="B1 + hu_c(t) + hu_out(t + hu_c(t)), t = |y| + B1, "
                                         "B1 = bound of fl_out(x W^T) (" + e.formula + ")", source=e.source,
                                         assumptions=e.assumptions + ("bias added after the matmul's rounding "
                                                                      "(torch's matmul + add_ path)",),
                                         values={**e.values, "bias_rounding": bias_rounding}))


def matmul_difference(a: torch.Tensor, b: torch.Tensor, *, model_a: Summation, model_b: Summation,
                      bias: torch.Tensor | None = None, fmt=None, out_fmt_a=None, out_fmt_b=None,
                      mode: str = "deterministic", failure_probability: float | None = None) -> Bound:
    """Elementwise bound on ``|result_a - result_b|`` for two correct computations of one matmul
    that differ only in their summation model (e.g. one device vs ``K`` split over
    ``split`` tensor-parallel ranks and summed by an all-reduce in ``reduce_fmt``).

    Never looser than ``matmul(model_a) + matmul(model_b)`` (at half the failure probability
    each in probabilistic mode, i.e. the same total): in probabilistic mode the two
    computations' roundings add in quadrature, and roundings shared by two models of
    known order (``Summation(known_order=True)``) cancel exactly. Two models of unknown
    order share nothing, even when equal (see
    :func:`~ttrace_num.bounds.summation.sum_difference_bound`).
    """
    prec = resolve_precision((a, b), fmt, model_a.accum, out_fmt_a)
    out_b = get_format(out_fmt_b) if out_fmt_b is not None else prec.out
    ms = resolve_mode(mode, failure_probability)
    s, ymag, n = matmul_statistics(a, b, bias)
    exact_p = products_exact(prec.storage, model_a.accum) and products_exact(prec.storage, model_b.accum)
    bound, values = sum_difference_bound(s, ymag, n, model_a, model_b, prec.out, out_b, ms.mode, ms.lam, exact_p,
                                         partial_abs_sum(a, b, bias, model_a, s),
                                         partial_abs_sum(a, b, bias, model_b, s))
    return Bound(abs=bound, mode=ms.mode, failure_probability=ms.failure_probability, magnitude=ymag,
                 explanation=Explanation(
                     op="matmul difference",
                     formula="|y_a - y_b| <= min(bound_a + bound_b, sum_{side,stage} (1+theta) c(d') M) "
                             "+ eta_a + eta_b + out_a + out_b, d' = roundings not shared by the two trees, "
                             "M = S (parts) or T_hat (reduction)",
                     source=SOURCE + "; shared-node cancellation: identity (1) of ttrace_num.bounds.summation",
                     assumptions=("both computations are correct implementations of the stated models",),
                     values=values))
