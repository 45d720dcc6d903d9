r"""Emulation of all-reduce and reduce-scatter orders, every hop rounded to the reduced format.

An all-reduce of ``k`` partials in format ``f`` computes every element as a ``k``-term sum
whose additions are rounded to ``f``; the algorithms differ only in the order of the
additions, which may depend on the element's position. Each element's order is built
here as a permutation of the ranks (or a tree over them) and the sum is evaluated by
:func:`ttrace_num.emulate.summation.emulate_terms` (conversion of the partials to ``f``,
then native additions in ``f``), vectorised over the elements.

Orders (``algorithm``):

* ``"ring"``: the tensor (flattened, C order) is cut into ``k`` contiguous chunks; chunk
  ``c``'s chain starts at rank ``(c + start) mod k`` and visits ``(c + start + j*step) mod k``
  for ``j = 1..k-1``, each rank adding its own partial to the running sum it received
  (Thakur, Rabenseifner & Gropp 2005, ring reduce-scatter followed by a ring all-gather).
  The defaults ``start=-1, step=-1`` and the chunk layout of
  :func:`~ttrace_num.bounds.collectives.gloo_ring_chunks` are those of gloo's ring
  (``gloo/allreduce.cc``: rank ``r`` first sends its segment of chunk ``r+1`` to rank
  ``r-1``, which adds its own and forwards it), verified bit for bit
  against ``torch.distributed`` on gloo (tests/test_bounds_collectives.py). The textbook
  convention "chunk ``c`` starts at rank ``c+1`` and travels upwards" is ``start=1, step=1``.
* ``"tree"``: ranks in order, summed pairwise level by level ``(x_0 + x_1) + (x_2 + x_3)``
  (recursive doubling / binomial tree, height ``ceil(log2 k)``).
* ``"chain"``: ``((x_0 + x_1) + x_2) + ...`` for every element (a sequential reduce to
  rank 0; gloo's shared-memory all-reduce, where built, also sums ranks in order).

``reduce_op="avg"`` divides the sum by ``k`` with one rounding to ``f``: the float64 quotient of
two ``f`` numbers rounded again to ``f`` is the correctly rounded quotient (double rounding
is innocuous for division when ``53 >= 2p + 2``, Figueroa 1995), which is what torch
computes for ``y / k`` in bf16/fp16 (fp32 arithmetic, one rounding: ``24 >= 2p + 2``).

Reduce-scatter on gloo is the all-reduce of the full tensor followed by taking the shard
(measured bitwise), so :func:`emulate_reduce_scatter` slices :func:`emulate_all_reduce`.
"""
from __future__ import annotations

import torch

from ..bounds.collectives import element_size, gloo_ring_chunks, ring_orders
from ..bounds.summation import Summation, conversion_exact
from ..formats import FloatFormat, get_format
from ..rounding import round_to
from .summation import emulate_terms

__all__ = ["emulate_all_reduce", "emulate_reduce_scatter"]


def emulate_all_reduce(partials: torch.Tensor, fmt: "FloatFormat | str | None" = None, algorithm: str = "ring", *,
                       reduce_op: str = "sum", start: int = -1, step: int = -1, chunks: torch.Tensor | None = None,
                       out_fmt: "FloatFormat | str | None" = None) -> torch.Tensor:
    """All-reduce of ``partials`` (shape ``(k, ...)``) with every hop rounded to ``fmt``.

    Args:
        partials: the ranks' contributions stacked along dim 0 (any real dtype; their values
            are converted to ``fmt`` first, with one rounding when they are not on its grid).
        fmt: the reduced tensor's format (default: the partials' dtype).
        algorithm: ``"ring"``, ``"tree"`` or ``"chain"`` (module docstring).
        reduce_op: ``"sum"`` or ``"avg"`` (sum then one rounded division by ``k``).
        start, step, chunks: the ring's order: chunk ``c`` starts at rank ``c + start`` and
            proceeds by ``step``; ``chunks`` (flat chunk index per element) defaults to gloo's
            layout (:func:`~ttrace_num.bounds.collectives.gloo_ring_chunks`) for ``fmt``'s element size.
        out_fmt: format of the returned values (default ``fmt``).
    Returns float64 values on ``out_fmt``'s grid, shaped ``partials.shape[1:]``.
    """
    f = get_format(fmt if fmt is not None else partials.dtype)
    out = get_format(out_fmt) if out_fmt is not None else f
    if reduce_op not in ("sum", "avg"):
        raise ValueError(f"reduce_op must be 'sum' or 'avg', got {reduce_op!r}")
    k = partials.shape[0]
    p = partials.detach().to(torch.float64).reshape(k, -1)
    n = p.shape[1]
    if algorithm == "ring":
        c = chunks if chunks is not None else gloo_ring_chunks(n, k, element_size(f))
        terms = p.gather(0, ring_orders(c.reshape(-1), k, start, step))
        summ = Summation(accum=f, algorithm="recursive")
    elif algorithm in ("chain", "tree"):
        terms = p
        summ = Summation(accum=f, algorithm="recursive" if algorithm == "chain" else "pairwise")
    else:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; use 'ring', 'tree' or 'chain'")
    y = emulate_terms(terms.T, summ, f)
    if reduce_op == "avg":
        y = round_to(y / k, f)
    if not conversion_exact(f, out):
        y = round_to(y, out)
    return y.reshape(partials.shape[1:])


def emulate_reduce_scatter(partials: torch.Tensor, rank: int | None = None, fmt: "FloatFormat | str | None" = None,
                           algorithm: str = "ring", **kwargs) -> torch.Tensor:
    """``reduce_scatter_tensor`` of ``partials`` (``(k, n, ...)``, ``n`` divisible by ``k``): the
    all-reduce of the full tensors (:func:`emulate_all_reduce`, same keywords) and rank
    ``rank``'s rows ``[rank n/k, (rank+1) n/k)`` (``None``: every shard, concatenated)."""
    k, n = partials.shape[0], partials.shape[1]
    if n % k:
        raise ValueError(f"dim 1 of partials ({n}) must be divisible by k={k}")
    y = emulate_all_reduce(partials, fmt, algorithm, **kwargs)
    if rank is None:
        return y
    m = n // k
    return y[rank * m:(rank + 1) * m]
