r"""Sum and mean reductions along one dimension.

Computation model (``sum``): the ``n`` terms along ``dim`` are converted to the
accumulation format (exact for bf16/fp16 into fp32; one more rounding level when the
inputs are wider than the accumulator, e.g. fp32 data summed in bf16), summed as a
:class:`~ttrace_num.bounds.summation.Summation` states (default: ``recursive`` in the
compute format, valid for any order, e.g. torch's vectorised cascade sum, which on CPU
accumulates bf16/fp16 in fp32), then rounded to the output format::

    |err| <= acc + half_ulp_out(|y| + acc),   acc = theta S + eta   (or its Azuma form)

``S = sum |x_i|``; with a split (``Summation(split=k, ...)``) the reduction levels act on
``T = sum_parts |sum_{part} x_i|`` (two stages, :mod:`.summation`), computed here from the
data in float64.

``mean``: ``fl_out(fl_c(fl(sum) / n))`` (torch on CPU: the sum and the division in fp32
for bf16/fp16 inputs, then the cast). The mean is the sum of the terms ``x_i / n``, so
``S`` and ``|y|`` scale by ``1/n``; the division is one more rounding in the sum's final
format applied to the whole computed sum (an ``extra_depths`` level of the outer stage,
acting on ``|y|/n + acc``, not on ``S/n``). The underflow term is left unscaled (safe).

Magnitudes: ``S`` and ``|y|`` are float64 sums, turned into rigorous upper bounds with
``gamma_{n+1}(2**-53)`` (any order of the float64 sum).

Source: Higham, *Accuracy and Stability of Numerical Algorithms* (2002) §4.2 and Lemma
3.1 (summation); probabilistic form: Higham & Mary (2019), Connolly, Higham & Mary (2021),
as derived in :mod:`.summation`.
"""
from __future__ import annotations

import torch

from .base import Bound, Explanation
from .common import f64, register, resolve_mode, resolve_precision
from .summation import Summation, conversion_exact, sum_error_bound, float64_sum_statistics

__all__ = ["sum_", "mean"]

SOURCE = ("Higham, Accuracy and Stability of Numerical Algorithms (2002) §4.2; Higham & Mary (2019); "
          "Connolly, Higham & Mary (2021)")


def _stats(x: torch.Tensor, dim: int, keepdim: bool, summ: Summation
           ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]:
    """``(S_upper, |y|_upper, n, T_upper or None)`` along ``dim`` in float64."""
    n = x.shape[dim]
    s, y, g = float64_sum_statistics(x, dim, keepdim)
    t = None
    if summ.parts(n) > 1:
        parts = torch.split(f64(x), summ.part_size(n), dim=dim)
        t = sum(p.sum(dim, keepdim=keepdim).abs() for p in parts) * (1 + g) + g * s
    return s, y, n, t


def _bound(op: str, x: torch.Tensor, dim: int, keepdim: bool, fmt, compute_fmt, out_fmt,
           summation: Summation | None, mode: str, failure_probability: float | None) -> Bound:
    prec = resolve_precision((x,), fmt, compute_fmt, out_fmt)
    summ = summation if summation is not None else Summation(accum=prec.compute)
    ms = resolve_mode(mode, failure_probability)
    s, ymag, n, t = _stats(x, dim, keepdim, summ)
    scale = 1.0 / n if op == "mean" else 1.0
    bound, values = sum_error_bound(s * scale, ymag * scale, n, summ, prec.out, ms.mode, ms.lam,
                                    exact_products=conversion_exact(prec.storage, summ.accum),
                                    extra_depths={summ.final_fmt: 1} if op == "mean" else None,
                                    partial_abs_sum=None if t is None else t * scale)
    values["precision"] = prec.describe()
    formula = "|err| <= acc + half_ulp_out(|y| + acc), acc = theta S + eta (or its Azuma form), S = sum|x_i|"
    if op == "mean":
        formula += "/n, one more level (the division) on |y|/n + acc"
    assumptions = (f"summation: {summ.describe()}",) + (
        ("rounding errors mean-independent (Higham-Mary model)",) if ms.mode == "probabilistic" else ())
    return Bound(abs=bound, mode=ms.mode, failure_probability=ms.failure_probability, magnitude=ymag * scale,
                 explanation=Explanation(op=op, formula=formula, source=SOURCE, assumptions=assumptions, values=values))


@register("sum")
def sum_(x: torch.Tensor, dim: int = -1, keepdim: bool = False, *, fmt=None, compute_fmt=None,
         out_fmt=None, summation: Summation | None = None, mode: str = "deterministic",
         failure_probability: float | None = None) -> Bound:
    """Bound on ``|fl(x.sum(dim)) - exact|``; see the module docstring."""
    return _bound("sum", x, dim, keepdim, fmt, compute_fmt, out_fmt, summation, mode, failure_probability)


@register("mean")
def mean(x: torch.Tensor, dim: int = -1, keepdim: bool = False, *, fmt=None, compute_fmt=None,
         out_fmt=None, summation: Summation | None = None, mode: str = "deterministic",
         failure_probability: float | None = None) -> Bound:
    """Bound on ``|fl(x.mean(dim)) - exact|``; see the module docstring."""
    return _bound("mean", x, dim, keepdim, fmt, compute_fmt, out_fmt, summation, mode, failure_probability)
