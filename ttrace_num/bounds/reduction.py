r"""Sum and mean reductions along one dimension.

``sum``: an ``n``-term sum under a :class:`~ttrace_num.bounds.summation.Summation`, then
rounded to the output format (torch on CPU accumulates bf16/fp16 sums in fp32).

``mean``: ``fl(fl(sum) / n)``: the division is one more rounding in the compute format
applied to the whole sum, i.e. one more level whose subtree is every term, so the bound
is that of the sum with one more level, divided by ``n``::

    |err| <= (coef' * S + eta) / n + half_ulp_out(|mean| + ...),  S = sum |x_i|

Source: Higham (2002) §4.2 (summation), Lemma 3.1; probabilistic form as in
:mod:`.summation`.
"""
from __future__ import annotations

import torch

from .base import Bound, Explanation
from .common import f64, register, resolve_mode, resolve_precision
from .summation import Summation, conversion_exact, sum_error_bound

__all__ = ["sum_", "mean"]

SOURCE = "Higham, Accuracy and Stability of Numerical Algorithms (2002) §4.2; Connolly, Higham & Mary (2021)"


def _stats(x: torch.Tensor, dim: int, keepdim: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    x64 = f64(x)
    n = x.shape[dim]
    s = x64.abs().sum(dim, keepdim=keepdim)
    y = x64.sum(dim, keepdim=keepdim).abs()
    g = (n + 1) * 2.0 ** -53
    return s / (1 - g), y + g / (1 - g) * s, n


@register("sum")
def sum_(x: torch.Tensor, dim: int = -1, keepdim: bool = False, *, fmt=None, compute_fmt=None,
         out_fmt=None, summation: Summation | None = None, mode: str = "deterministic",
         failure_probability: float | None = None) -> Bound:
    """Bound on ``|fl(x.sum(dim)) - exact|``; see the module docstring."""
    prec = resolve_precision((x,), fmt, compute_fmt, out_fmt)
    summ = summation if summation is not None else Summation(accum=prec.compute)
    ms = resolve_mode(mode, failure_probability)
    s, ymag, n = _stats(x, dim, keepdim)
    bound, values = sum_error_bound(s, ymag, n, summ, prec.out, ms.mode, ms.lam,
                                    exact_products=conversion_exact(prec.storage, summ.accum))
    values["precision"] = prec.describe()
    return Bound(abs=bound, mode=ms.mode, failure_probability=ms.failure_probability, magnitude=ymag,
                 explanation=Explanation(op="sum", formula="|err| <= coef*S + eta + half_ulp_out(|y| + coef*S + eta), S = sum|x_i|",
                                         source=SOURCE, assumptions=(f"summation: {summ.describe()}",), values=values))


@register("mean")
def mean(x: torch.Tensor, dim: int = -1, keepdim: bool = False, *, fmt=None, compute_fmt=None,
         out_fmt=None, summation: Summation | None = None, mode: str = "deterministic",
         failure_probability: float | None = None) -> Bound:
    """Bound on ``|fl(x.mean(dim)) - exact|``; see the module docstring."""
    prec = resolve_precision((x,), fmt, compute_fmt, out_fmt)
    summ = summation if summation is not None else Summation(accum=prec.compute)
    ms = resolve_mode(mode, failure_probability)
    s, ymag, n = _stats(x, dim, keepdim)
    # the division is one more rounding level over the whole sum; the mean is the sum of
    # the terms x_i/n, so S and |y| scale by 1/n (the underflow term stays unscaled: safe).
    bound, values = sum_error_bound(s / n, ymag / n, n, summ, prec.out, ms.mode, ms.lam,
                                    exact_products=conversion_exact(prec.storage, summ.accum),
                                    extra_depths={summ.final_fmt: 1})
    values["precision"] = prec.describe()
    return Bound(abs=bound, mode=ms.mode, failure_probability=ms.failure_probability, magnitude=ymag / n,
                 explanation=Explanation(op="mean", formula="|err| <= (coef'*S + eta)/n + half_ulp_out(|mean| + ...), one extra level for the division",
                                         source=SOURCE, assumptions=(f"summation: {summ.describe()}",), values=values))
