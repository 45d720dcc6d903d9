r"""Emulation of the softmax-family computation models of :mod:`ttrace_num.bounds.softmax`,
every intermediate rounded to its stated format.

The inputs' values are taken as they are (exact, "as stored"); pass a bf16 tensor, or an
fp32 tensor together with ``fmt=`` naming the storage format. Formats default exactly as
in the bounds (:func:`ttrace_num.bounds.common.resolve_precision`): compute fp32 for
formats narrower than fp32, output = storage.

Shifted softmax / log-sum-exp (per row of ``n`` entries, compute format ``c``):

1. ``m = max_j x_j`` (exact);
2. ``t_j = fl_c(x_j - m)``; ``e_j = fl_c(exp(t_j))`` (a correctly rounded exp: ``exp`` in
   float64, then :func:`~ttrace_num.rounding.round_to`; the float64 error, <= 1 ulp of
   fp64, is far inside the ``exp_ulps`` budget of the bound);
3. ``s = sum_j e_j`` under a :class:`~ttrace_num.bounds.summation.Summation` (emulated by
   :func:`ttrace_num.emulate.summation.emulate_terms`: order, accumulation format,
   split into tensor-parallel shards whose partials are rounded to ``reduce_fmt`` and
   reduced by a chain);
4. softmax: ``division="reciprocal"``: ``r = fl_c(1/s)``, ``y_j = fl_c(e_j r)`` (torch CPU),
   or ``"divide"``: ``y_j = fl_c(e_j / s)``; then ``fl_out``;
   log_softmax: ``s' = fl_st(s)``, ``L = fl_st(fl_c(log s'))`` (``st`` = ``stats_fmt``,
   torch CPU stores the row sum and its log in the storage dtype), then
   ``fl_out(fl_c(t_j - L))``.

Roundings of a float64 result of one operation to ``c`` (sub, div, add) are correct
roundings: double rounding through float64 is innocuous for precisions ``p`` with
``53 >= 2p + 2`` (Figueroa, SIGNUM 1995), i.e. every format up to fp32; products
``e_j r`` of two ``p <= 24`` numbers are exact in float64.

Cross entropy (torch ``F.cross_entropy`` with class-index targets, CPU): ``lp =
log_softmax`` in the storage dtype, then ``nll_loss``: ``-lp[target]`` per sample
(exact); for ``"sum"``/``"mean"`` torch's cascade sum in the storage dtype (``scalar_t``
arithmetic: each ``+`` computed in fp32 opmath and rounded to the storage format, a
16-term chain per level, see :func:`nll_cascade_sum`), and for ``"mean"`` a division by
the count converted to the storage format. Label smoothing ``eps``:
``(1-eps)*nll + smooth*(eps/C)`` with ``smooth = -lp.sum(1)`` (a sum over the classes in
the compute format, rounded to the storage format), reduced by ``.sum()`` (and ``/ count``),
each tensor op rounding to the storage format (scalars rounded to the compute format).

Vocab-parallel cross entropy (Megatron ``VocabParallelCrossEntropy``): the same per-row
algorithm with the class sum split into ``tp`` contiguous shards (``Summation(split=tp,
reduce_fmt=...)``), loss ``fl_c(fl_c(log s) - t_target)``, returned in the compute format.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..bounds.common import Precision, resolve_precision
from ..bounds.summation import Summation
from ..formats import FloatFormat, get_format
from ..rounding import round_to
from .summation import emulate_terms

__all__ = [
    "emulate_softmax",
    "emulate_log_softmax",
    "emulate_cross_entropy",
    "emulate_vocab_parallel_cross_entropy",
    "nll_cascade_sum",
]


def _shifted(x64: torch.Tensor, c: FloatFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t, e)`` on the last dim: ``t = fl_c(x - max)``, ``e = fl_c(exp(t))`` (NaN rows stay NaN)."""
    m = x64.max(-1, keepdim=True).values
    t = round_to(x64 - m, c)
    e = round_to(torch.exp(t), c)
    return t, e


def _row_sum(e: torch.Tensor, summation: Summation) -> torch.Tensor:
    """Row sums (keepdim) of ``e`` as ``summation`` states, left in its final format."""
    return emulate_terms(e, summation, summation.final_fmt).unsqueeze(-1)


def _prec(x: torch.Tensor, fmt, compute_fmt, out_fmt) -> Precision:
    return resolve_precision((x,), fmt, compute_fmt, out_fmt)


def emulate_softmax(x: torch.Tensor, dim: int = -1, *, fmt=None, compute_fmt=None, out_fmt=None,
                    summation: Summation | None = None, division: str = "reciprocal") -> torch.Tensor:
    """Softmax along ``dim`` under the stated model (module docstring); float64 result on
    the output format's grid."""
    prec = _prec(x, fmt, compute_fmt, out_fmt)
    c = prec.compute
    summ = summation if summation is not None else Summation(accum=c)
    x64 = x.detach().to(torch.float64).movedim(dim, -1)
    _, e = _shifted(x64, c)
    s = round_to(_row_sum(e, summ), c)
    if division == "reciprocal":
        y = round_to(e * round_to(1.0 / s, c), c)
    elif division == "divide":
        y = round_to(e / s, c)
    else:
        raise ValueError(f"division must be 'reciprocal' or 'divide', not {division!r}")
    return round_to(y, prec.out).movedim(-1, dim)


def _log_softmax_last(x64: torch.Tensor, prec: Precision, summ: Summation, st: FloatFormat) -> torch.Tensor:
    """log_softmax on the last dim, result in the compute format (before ``fl_out``)."""
    c = prec.compute
    t, e = _shifted(x64, c)
    s = round_to(round_to(_row_sum(e, summ), c), st)
    L = round_to(round_to(torch.log(s), c), st)
    return round_to(t - L, c)


def emulate_log_softmax(x: torch.Tensor, dim: int = -1, *, fmt=None, compute_fmt=None, out_fmt=None,
                        summation: Summation | None = None, stats_fmt=None) -> torch.Tensor:
    """log_softmax along ``dim`` (module docstring); ``stats_fmt`` defaults to the storage
    format (torch CPU); float64 result on the output format's grid."""
    prec = _prec(x, fmt, compute_fmt, out_fmt)
    summ = summation if summation is not None else Summation(accum=prec.compute)
    st = get_format(stats_fmt) if stats_fmt is not None else prec.storage
    x64 = x.detach().to(torch.float64).movedim(dim, -1)
    return round_to(_log_softmax_last(x64, prec, summ, st), prec.out).movedim(-1, dim)


def _op(v: torch.Tensor, prec: Precision) -> torch.Tensor:
    """One tensor op of the storage dtype: computed in the compute (opmath) format, stored in ``out``."""
    return round_to(round_to(v, prec.compute), prec.out)


def nll_cascade_sum(values: torch.Tensor, rows: list[int], prec: Precision) -> torch.Tensor:
    """torch CPU ``nll_loss`` reduction: ``loss_partial_sums`` cascade (8 levels, a level
    flushes into the next when ``b & (15 << 4j) == 0`` for row index ``b``), every ``+`` a
    ``scalar_t`` op (:func:`_op`), then ``0 + level_0 + ... + level_7``.

    ``values``: the per-row terms (float64, on the output grid); ``rows``: the indices of
    the rows that are not ignored (ignored rows are skipped but still advance ``b``)."""
    zero = torch.zeros((), dtype=torch.float64)
    levels = [zero.clone() for _ in range(8)]
    k = 0
    for b in rows:
        levels[0] = _op(levels[0] + values[k], prec)
        k += 1
        for j in range(7):
            if b & (15 << (4 * j)):
                break
            levels[j + 1] = _op(levels[j + 1] + levels[j], prec)
            levels[j] = zero.clone()
    acc = zero
    for lv in levels:
        acc = _op(acc + lv, prec)
    return acc


def emulate_cross_entropy(logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean",
                          label_smoothing: float = 0.0, ignore_index: int = -100, *, fmt=None,
                          compute_fmt=None, out_fmt=None, summation: Summation | None = None,
                          stats_fmt=None) -> torch.Tensor:
    """``F.cross_entropy(logits (N, C), target (N,))`` as torch CPU computes it (module
    docstring); float64 result on the output format's grid."""
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"reduction must be 'none', 'mean' or 'sum', not {reduction!r}")
    prec = _prec(logits, fmt, compute_fmt, out_fmt)
    summ = summation if summation is not None else Summation(accum=prec.compute)
    st = get_format(stats_fmt) if stats_fmt is not None else prec.storage
    lp = round_to(_log_softmax_last(logits.detach().to(torch.float64), prec, summ, st), prec.out)
    tgt = target.reshape(-1).to(torch.int64)
    keep = tgt != ignore_index
    rows = [int(i) for i in torch.nonzero(keep).flatten()]
    safe = torch.where(keep, tgt, torch.zeros_like(tgt))
    nll = torch.where(keep, -lp.gather(1, safe[:, None])[:, 0], torch.zeros(()))
    count = round_to(torch.tensor(float(len(rows)), dtype=torch.float64), prec.out)

    def reduce_nll(v: torch.Tensor) -> torch.Tensor:
        if reduction == "none":
            return v
        tot = nll_cascade_sum(v[keep], rows, prec)
        return tot if reduction == "sum" else _op(tot / count, prec)

    out = reduce_nll(nll)
    if label_smoothing == 0.0:
        return out
    C = logits.shape[1]
    smooth = -emulate_terms(lp, Summation(accum=prec.compute), prec.out)
    smooth = torch.where(keep, smooth, torch.zeros(()))
    if reduction != "none":
        smooth = emulate_terms(smooth, Summation(accum=prec.compute), prec.out)
        if reduction == "mean":
            smooth = _op(smooth / count, prec)
    c1 = round_to(torch.tensor(1.0 - label_smoothing, dtype=torch.float64), prec.compute)
    c2 = round_to(torch.tensor(label_smoothing / C, dtype=torch.float64), prec.compute)
    return _op(_op(out * c1, prec) + _op(smooth * c2, prec), prec)


def emulate_vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, tp: int,
                                         reduce_fmt=None, fmt=None, compute_fmt=None,
                                         local_summation: Summation | None = None) -> torch.Tensor:
    """Megatron's vocab-parallel cross entropy (per-token loss, no reduction): shards of
    ``ceil(C / tp)`` contiguous classes, exact global max, shard sums of ``exp`` in the
    compute format, an all-reduce chain of the ``tp`` partials in ``reduce_fmt`` (default:
    the compute format), loss ``fl_c(fl_c(log s) - t_target)`` in the compute format."""
    prec = _prec(logits, fmt, compute_fmt, None)
    c = prec.compute
    local = local_summation if local_summation is not None else Summation(accum=c)
    rf = get_format(reduce_fmt) if reduce_fmt is not None else c
    summ = replace(local, split=tp, reduce_fmt=rf, reduce_algorithm="recursive")
    x64 = logits.detach().to(torch.float64)
    t, e = _shifted(x64, c)
    L = round_to(torch.log(round_to(_row_sum(e, summ), c)), c)
    tt = t.gather(1, target.reshape(-1, 1).to(torch.int64))
    return round_to(L - tt, c)[:, 0]

