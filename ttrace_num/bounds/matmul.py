r"""Matrix multiplication (``matmul``, ``bmm``, ``linear``) and its split-K difference bound.

Computation model: every output ``y_ij = sum_k a_ik b_kj (+ bias_j)`` is an ``n``-term sum
(``n = K``, or ``K + 1`` with a bias) evaluated as stated by a
:class:`~ttrace_num.bounds.summation.Summation` (accumulation format, order, split-K and
the format/order of the reduction of the partials), then rounded to the output format.
Products are exact when ``2 p_in <= p_accum`` (bf16/fp16 inputs, fp32 accumulation);
otherwise one more rounding level is counted.

Bound (Higham 2002, §3.1 and eq. (3.5); probabilistic: Higham & Mary 2019, Connolly,
Higham & Mary 2021, via the martingale of :mod:`.summation`)::

    |y_hat - y| <= coef * (|A| |B|)_ij + eta + half_ulp_out(|y_ij| + coef (|A||B|)_ij + eta)

Cost: two matmuls in the working precision (``A @ B`` and ``|A| @ |B|``); both are made
rigorous upper bounds: for non-negative terms a floating-point sum satisfies
``fl(sum p) >= (1 - (K+1) u) sum p`` (every term is multiplied by at most ``K+1`` factors
``(1+delta) >= 1-u``), so ``S <= fl(S) / (1 - (K+1) u_w)``; and
``|fl(A@B) - A@B| <= gamma_{K+1} S`` bounds the magnitude used for the output rounding.
"""
from __future__ import annotations

import torch

from ..formats import get_format
from .base import Bound, Explanation
from .common import Precision, f64, register, resolve_mode, resolve_precision
from .summation import Summation, products_exact, sum_difference_bound, sum_error_bound

__all__ = ["matmul", "linear", "matmul_difference", "matmul_statistics"]

SOURCE = ("Higham, Accuracy and Stability of Numerical Algorithms (2002) §3.1, §4; probabilistic: "
          "Higham & Mary, SISC 41(5) 2019; Connolly, Higham & Mary, SISC 43(1) 2021 (martingale form)")


def _working(a: torch.Tensor, b: torch.Tensor) -> torch.dtype:
    """fp32 is exact for every input format up to fp32 and twice as fast as fp64 on CPU."""
    if a.dtype == torch.float64 or b.dtype == torch.float64:
        return torch.float64
    return torch.float32


def matmul_statistics(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(S_upper, |y|_upper, n)``: rigorous float64 upper bounds on ``(|A||B| + |bias|)`` and
    on ``|A B + bias|`` per output, computed with two working-precision matmuls."""
    wd = _working(a, b)
    uw = 2.0 ** -53 if wd == torch.float64 else 2.0 ** -24
    eta_w = 2.0 ** -1075 if wd == torch.float64 else 2.0 ** -150
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
    s64 = s.to(torch.float64) / (1.0 - gam) + (n + 1) * eta_w
    y64 = y.to(torch.float64).abs() + gam / (1.0 - gam) * s64
    return s64, y64, n


def _default_summation(prec: Precision, summation: Summation | None) -> Summation:
    return summation if summation is not None else Summation(accum=prec.compute)


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
        summation: the accumulation model; default ``Summation(accum=compute_fmt)``
            (recursive: valid for any order, e.g. an MKL or cuBLAS kernel). Use
            ``Summation(split=k, reduce_fmt=...)`` for split-K / tensor parallelism.
        mode: ``"deterministic"`` or ``"probabilistic"``.
        failure_probability: per-element, probabilistic mode (default 1e-6).
    """
    prec = resolve_precision((a, b), fmt, compute_fmt, out_fmt)
    summ = _default_summation(prec, summation)
    ms = resolve_mode(mode, failure_probability)
    s, ymag, n = matmul_statistics(a, b, bias)
    exact_p = products_exact(prec.storage, summ.accum)
    bound, values = sum_error_bound(s, ymag, n, summ, prec.out, ms.mode, ms.lam, exact_p)
    values.update(precision=prec.describe(), products_exact=exact_p, S="(|A||B|)_ij")
    formula = ("|err_ij| <= coef * S_ij + eta + half_ulp_out(|y_ij| + coef*S_ij + eta), S = |A||B|, "
               "coef = " + ("theta" if ms.mode == "deterministic" else "min(theta, lambda(1+theta)sqrt(sum d_f u_f^2))"))
    assumptions = ["inputs are exact as stored", f"summation tree: {summ.describe()}"]
    if ms.mode == "probabilistic":
        assumptions.append("rounding errors mean-independent (Higham-Mary model)")
    return Bound(abs=bound, mode=ms.mode, failure_probability=ms.failure_probability, magnitude=ymag,
                 explanation=Explanation(op="matmul", formula=formula, source=SOURCE,
                                         assumptions=tuple(assumptions), values=values))


@register("linear")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, **kw) -> Bound:
    """``F.linear(x, weight, bias) = x @ weight.T + bias``: see :func:`matmul`."""
    return matmul(x, weight.transpose(-1, -2), bias=bias, **kw)


def matmul_difference(a: torch.Tensor, b: torch.Tensor, *, model_a: Summation, model_b: Summation,
                      bias: torch.Tensor | None = None, fmt=None, out_fmt_a=None, out_fmt_b=None,
                      mode: str = "deterministic", failure_probability: float | None = None) -> Bound:
    """Elementwise bound on ``|result_a - result_b|`` for two correct computations of one matmul
    that differ only in their summation model (e.g. one device vs ``K`` split over
    ``split`` tensor-parallel ranks and summed by an all-reduce in ``reduce_fmt``).

    Tighter than ``matmul(model_a) + matmul(model_b)``: shared roundings cancel exactly and,
    in probabilistic mode, the unshared ones add in quadrature (see
    :func:`~ttrace_num.bounds.summation.sum_difference_bound`).
    """
    prec = resolve_precision((a, b), fmt, model_a.accum, out_fmt_a)
    out_b = get_format(out_fmt_b) if out_fmt_b is not None else prec.out
    ms = resolve_mode(mode, failure_probability)
    s, ymag, n = matmul_statistics(a, b, bias)
    exact_p = products_exact(prec.storage, model_a.accum) and products_exact(prec.storage, model_b.accum)
    bound, values = sum_difference_bound(s, ymag, n, model_a, model_b, prec.out, out_b, ms.mode, ms.lam, exact_p)
    return Bound(abs=bound, mode=ms.mode, failure_probability=ms.failure_probability, magnitude=ymag,
                 explanation=Explanation(
                     op="matmul difference",
                     formula="|y_a - y_b| <= (1+theta) c(d') S + eta_a + eta_b + out_a + out_b, "
                             "d' = roundings not shared by the two trees",
                     source=SOURCE + "; shared-node cancellation: identity (1) of ttrace_num.bounds.summation",
                     assumptions=("both computations are correct implementations of the stated models",),
                     values=values))
