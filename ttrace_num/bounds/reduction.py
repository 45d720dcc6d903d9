r"""Sum and mean reductions over any set of dimensions, with torch's signature.

``sum_(x, dim=None, keepdim=False)`` / ``mean(x, dim=None, keepdim=False)`` reduce like
``torch.sum`` / ``torch.mean``: ``dim=None`` (the default, as in torch) or ``()`` reduces
every dimension, an int one, a tuple or list of ints those (each once); ``keepdim`` keeps
them as size 1. The bound treats the ``n = prod(sizes of the reduced dims)`` terms of each
output element as one sum, the reduced dims moved last and flattened (a view of the data,
no change to the model): the summation bounds below hold for every order of the ``n``
terms, so they hold however the kernel walks a multi-dimensional reduction.

Computation model (``sum``): the ``n`` terms of each output are converted to the
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

import math

import torch

from .base import Bound, Explanation
from .common import f64, register, resolve_mode, resolve_precision
from .summation import Summation, conversion_exact, sum_error_bound, float64_sum_statistics

__all__ = ["sum_", "mean", "reduced_dims"]

SOURCE = ("Higham, Accuracy and Stability of Numerical Algorithms (2002) §4.2; Higham & Mary (2019); "
          "Connolly, Higham & Mary (2021)")


Dims = int | tuple[int, ...] | list[int] | None


def reduced_dims(op: str, x: torch.Tensor, dim: Dims) -> tuple[int, ...]:
    """The dims ``torch.<op>(x, dim)`` reduces, normalised to ``0..ndim-1`` (a 0-d tensor
    has none); ``TypeError``/``ValueError`` naming ``dim`` for what torch refuses."""
    if dim is None:
        return tuple(range(x.dim()))
    dims = (dim,) if isinstance(dim, int) and not isinstance(dim, bool) else dim
    if not isinstance(dims, (tuple, list)) or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise TypeError(f"{op}: dim must be None, an int or a tuple of ints (as for torch.{op}), got {dim!r}")
    if not dims:
        return tuple(range(x.dim()))
    nd = max(x.dim(), 1)
    bad = [d for d in dims if not -nd <= d < nd]
    if bad:
        raise ValueError(f"{op}: dim {bad[0]} is out of range for a tensor of shape {tuple(x.shape)} "
                         f"(dims {-nd}..{nd - 1})")
    norm = tuple(d % nd for d in dims)
    if len(set(norm)) != len(norm):
        raise ValueError(f"{op}: dim {dim!r} names a dimension twice; name each reduced dimension once")
    return tuple(d for d in norm if d < x.dim())


def _rows(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """``x`` with the reduced ``dims`` moved last and flattened into one (the kept dims first)."""
    kept = [d for d in range(x.dim()) if d not in dims]
    n = math.prod(x.shape[d] for d in dims)
    return x.reshape(1) if x.dim() == 0 else x.permute(*kept, *dims).reshape(*(x.shape[d] for d in kept), n)


def _stats(x: torch.Tensor, summ: Summation) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]:
    """``(S_upper, |y|_upper, n, T_upper or None)`` along the last dim, in float64."""
    n = x.shape[-1]
    s, y, g = float64_sum_statistics(x, -1)
    t = None
    if summ.parts(n) > 1:
        parts = torch.split(f64(x), summ.part_size(n), dim=-1)
        t = sum(p.sum(-1).abs() for p in parts) * (1 + g) + g * s
    return s, y, n, t


def _bound(op: str, x: torch.Tensor, dim: Dims, keepdim: bool, fmt, compute_fmt, out_fmt,
           summation: Summation | None, mode: str, failure_probability: float | None) -> Bound:
    prec = resolve_precision((x,), fmt, compute_fmt, out_fmt)
    summ = summation if summation is not None else Summation(accum=prec.compute)
    ms = resolve_mode(mode, failure_probability)
    dims = reduced_dims(op, x, dim)
    s, ymag, n, t = _stats(_rows(x, dims), summ)
    if op == "mean" and n == 0:
        raise ValueError(f"mean over an empty dimension of x (shape {tuple(x.shape)}, dim {dim!r}) is NaN in torch; "
                         "there is no error to bound: reduce over a non-empty dimension")
    if keepdim:  # the reduced dims back as size 1
        shape = tuple(1 if d in dims else x.shape[d] for d in range(x.dim()))
        s, ymag, t = s.reshape(shape), ymag.reshape(shape), None if t is None else t.reshape(shape)
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
def sum_(x: torch.Tensor, dim: Dims = None, keepdim: bool = False, *, fmt=None, compute_fmt=None,
         out_fmt=None, summation: Summation | None = None, mode: str = "deterministic",
         failure_probability: float | None = None) -> Bound:
    """Bound on ``|fl(torch.sum(x, dim, keepdim)) - exact|`` (``dim=None``: every dim, as in
    torch); see the module docstring."""
    return _bound("sum", x, dim, keepdim, fmt, compute_fmt, out_fmt, summation, mode, failure_probability)


@register("mean")
def mean(x: torch.Tensor, dim: Dims = None, keepdim: bool = False, *, fmt=None, compute_fmt=None,
         out_fmt=None, summation: Summation | None = None, mode: str = "deterministic",
         failure_probability: float | None = None) -> Bound:
    """Bound on ``|fl(torch.mean(x, dim, keepdim)) - exact|`` (``dim=None``: every dim, as in
    torch); see the module docstring."""
    return _bound("mean", x, dim, keepdim, fmt, compute_fmt, out_fmt, summation, mode, failure_probability)
