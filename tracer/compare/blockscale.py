r"""The block-scale statistic: the part of a deviation that rescales the reference block by block.

A wrong scale on one rank's shard (a gradient not averaged over its group, a loss or softmax
scale applied twice, a wrong FP8 ``scale_inv``) changes the candidate along the reference
itself: ``c = r + delta r`` on the shard ``S``. The norm statistic of :mod:`tracer.compare.check`
sees it only once ``delta ||r_S||`` exceeds the whole legitimate difference ``||d||``, most of
which points elsewhere. This statistic looks along the reference only.

**Definition.** Cut the tensor into a grid of blocks ``b``: :data:`BLOCKS_PER_DIM` consecutive
slabs along its first dimension times as many along its last (fewer when a dimension is
shorter; a 1-D tensor only along its one dimension). With ``r_b`` the reference restricted to
block ``b``, the vectors ``p_b = r_b / ||r_b||`` are orthonormal (disjoint supports), and the
deviation's coordinates on them are

.. math::

    y_b = \frac{\langle d, r_b \rangle}{\|r_b\|_2} = \frac{\sum_{i \in b} d_i r_i}
          {\sqrt{\sum_{i \in b} r_i^2}} \qquad (y_b = 0 \text{ where } r_b = 0),

i.e. ``||y||_2`` is the norm of the orthogonal projection of ``d`` onto ``span{p_b}``, the
differences that multiply each block of the reference by its own factor ``1 + a_b``
(``y_b = a_b ||r_b||``).

**Why it separates.** A shard scaled by ``1 + delta`` whose boundaries fall on block
boundaries gives ``||y|| = delta ||r_S||``, the same as its contribution to ``||d||``; a
legitimate deviation spread over ``n`` elements in no preferred direction keeps about
``B / n`` of its squared norm in a ``B``-dimensional projection. TP, SP and CP shards are
slabs along the first or last dimension of the canonical tensor (weights ``[out, in]``,
activations ``[s, b, h]``), so their boundaries are block boundaries when the split is into
at most :data:`BLOCKS_PER_DIM` parts; a shard that cuts a block in halves keeps ``||y|| ~
delta ||r_S|| / sqrt 2``.

**Threshold.** The projection is linear, so the noise samples' projections ``y_s = P d_s``
have the candidate's covariance in the projected space under the same equal-variance model
as the norm statistic (:mod:`tracer.compare.thresholds`), and
:func:`~tracer.compare.thresholds.deviation_threshold` applies to them unchanged: ``T = F
sqrt(mean_s ||y_s||^2)``, ``F`` from ``F(n_eff, S n_eff)``, ``n_eff <= B``. With it, the
checker tests both statistics on a tensor and gives each half its false-alarm probability
(Bonferroni), so a correct candidate still passes a comparison with probability >= 0.99
under the model.

**Choice of the grid.** ``B`` trades two effects: the projected legitimate noise grows as
``sqrt B`` while ``F`` shrinks with ``n_eff <= B`` (at ``q = 4e-6``, ``S = 4``: ``F ~ 1.3`` at
``n_eff = 150``, 1.7 at 40, 2.5 at 11). Measured on the sensitivity benchmark's ten targets
(docs/sensitivity.md, bf16): 4 x 4 blocks flag a median 1.0x, 8 x 8 1.1x and 16 x 16 1.5x the
smallest corruption of 4 x 4; 4 per dimension also matches TP and SP degrees up to 4 exactly.

**Where it is not tested** (:func:`tracer.compare.deviation.block_scale_applies`): the noise samples'
perturbations are zero-mean by construction, so the statistic's model excludes a legitimate
difference with a systematic part. One such difference is known and measured: sums over
every token that a kernel accumulates in low precision. torch's CPU layer-norm backward adds
the tokens' ``dgamma``/``dbeta`` into a buffer of the input's dtype; a bf16 running sum absorbs
addends below half its ulp, one-sidedly where the gradients are coherent, and a TP + SP
candidate sums half the tokens per rank, so it loses less. On the cost bench's larger model
(hidden 256, 128 tokens, TP2 + SP, bf16) the clean candidate's ``input_layernorm.bias``
gradients are 1.1-2.3% larger than the reference's in every block while the samples stay
within +-0.3% of it (fp32: within the samples' spread); the statistic reached 0.95-1.0005 of its
threshold there (the norm statistic 0.89-0.96). The noise of those sums now carries the
chain's one-sided part (:func:`ttrace_num.bounds.summation_variance.chain_split_difference`),
but as zero-mean noise, whose projection on the reference a coherent difference still
outgrows. The gradients of 1-D parameters (norm weights and biases, linear biases: the token
sums) therefore get the norm statistic only; on that model the largest block-scale ratio left
is 0.35. Every other tensor of the detection matrix's 182,160 clean comparisons stayed under 1
with it (largest 0.975, downstream of a top-k choice; ``docs/detection.md``).

Not covered: a difference without this structure (a few wrong elements, a permutation, a
wrong sign on part of a block) is seen by the norm statistic only, as before; and parameters
stored narrower than fp32 are compared by their storage-rounding excess
(:mod:`tracer.compare.deviation`), which is not linear in the deviation: they get the norm statistic
only (:func:`tracer.compare.deviation.block_scale_applies`).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from tracer.compare.difference import chunk_norms, combine_chunk_norms
from tracer.compare.thresholds import deviation_threshold

__all__ = ["BLOCKS_PER_DIM", "block_grid", "block_scales", "block_scales_and_norms", "scale_test", "verdict_ratio"]

#: blocks along the first and along the last dimension of a tensor (module doc, "Choice of the grid")
BLOCKS_PER_DIM = 4

#: elements per chunk: a chunk of whole rows of the first dimension stays in cache
_CHUNK = 1 << 17


def block_grid(shape: tuple[int, ...] | list[int]) -> tuple[int, int]:
    """``(B0, B1)``: blocks along the first and the last dimension of a tensor of ``shape``."""
    if len(shape) == 0:
        return 1, 1
    first = min(BLOCKS_PER_DIM, shape[0])
    last = min(BLOCKS_PER_DIM, shape[-1]) if len(shape) >= 2 else 1
    return max(first, 1), max(last, 1)


def block_scales(ref: torch.Tensor, x: torch.Tensor, work: torch.dtype, *, deviation: bool = False
                 ) -> torch.Tensor:
    """The coordinates ``y_b`` (float64, ``B0 * B1`` of them) of the deviation of ``x`` from
    ``ref`` on the blocks of the reference (module doc); see :func:`block_scales_and_norms`."""
    return _block_pass(ref, x, work, deviation, norms=False)[0]


def block_scales_and_norms(ref: torch.Tensor, cand: torch.Tensor, work: torch.dtype
                           ) -> tuple[torch.Tensor, tuple[float, float, float] | None]:
    """:func:`block_scales` of ``cand`` and, from the same pass over both tensors,
    :func:`tracer.compare.difference.difference_norms` (``None`` when a value is not finite: the
    coordinates are then meaningless too). One read of the two tensors instead of two: the
    pass is bound by memory traffic on large tensors."""
    return _block_pass(ref, cand, work, False, norms=True)


def _block_pass(ref: torch.Tensor, x: torch.Tensor, work: torch.dtype, deviation: bool, norms: bool
                ) -> tuple[torch.Tensor, tuple[float, float, float] | None]:
    """The coordinates of :func:`block_scales` and, with ``norms``, the difference norms.

    ``x`` is the candidate or a noise sample (``deviation=False``: the deviation is ``x -
    ref``), or already the deviation (``deviation=True``). Chunk by chunk of whole rows of the
    first dimension (:func:`_row_chunks`): products and a chunk's sums in ``work`` (torch's sums
    over a chunk's rows, ~1e-7 relative in float32), the chunks' sums accumulated in float64."""
    shape = tuple(ref.shape)
    b0, b1 = block_grid(shape)
    rows = shape[0] if shape else 1
    last = shape[-1] if len(shape) >= 2 else 1
    r2 = ref.detach().reshape(rows, -1, last)
    x2 = x.detach().reshape(rows, -1, last)
    cross = torch.zeros(b0, last, dtype=torch.float64)   # sum of d_i r_i per (row block, column)
    power = torch.zeros(b0, last, dtype=torch.float64)   # sum of r_i^2
    chunks = []  # chunk_norms of each chunk, with norms
    for i, stop in _row_chunks(rows, r2.shape[1] * last, b0):
        r = r2[i:stop].to(work)
        d = x2[i:stop].to(work)
        d = d if deviation else d - r
        blk = i * b0 // rows  # row i lies in row block i * b0 // rows
        if blk == (stop - 1) * b0 // rows:  # one row block: the column sums over the whole chunk
            cross[blk] += (d * r).sum((0, 1))
            r_sq = (r * r).sum((0, 1))
            power[blk] += r_sq
        else:  # a small tensor in one chunk: each row's column sums, added to its block in float64
            r_sq = (r * r).sum(1)
            cross += _block_sums((d * r).sum(1).double(), b0, 0)
            power += _block_sums(r_sq.double(), b0, 0)
            r_sq = r_sq.sum(0)
        if norms:
            chunks.append(chunk_norms(r_sq.sum().sqrt(), d))
    cross, power = _block_sums(cross, b1, 1), _block_sums(power, b1, 1)
    y = torch.where(power > 0, cross / power.clamp_min(math.ulp(0.0)).sqrt(), torch.zeros_like(cross))
    return y.reshape(-1), (combine_chunk_norms(chunks) if norms else None)


def _block_starts(n: int, blocks: int) -> list[int]:
    """First index of each of ``blocks`` contiguous blocks of ``n`` (index ``i`` lies in block
    ``i * blocks // n``), and ``n`` at the end."""
    return [-(-blk * n // blocks) for blk in range(blocks + 1)]


def _block_sums(t: torch.Tensor, blocks: int, dim: int) -> torch.Tensor:
    """Sums of ``t`` over the ``blocks`` contiguous blocks of dimension ``dim`` (one slice sum per
    block: ``index_add_`` along a dimension with many indices loops over them on CPU, 30 us each)."""
    starts = _block_starts(t.shape[dim], blocks)
    return torch.stack([t.narrow(dim, lo, hi - lo).sum(dim) for lo, hi in zip(starts, starts[1:])], dim)


def _row_chunks(rows: int, row_size: int, b0: int) -> list[tuple[int, int]]:
    """``(start, stop)`` row ranges of :func:`_block_pass`'s chunks: the whole tensor when it has at
    most :data:`_CHUNK` elements (one pass of ~10 calls instead of one per row block: small tensors
    cost per call, not per element), else chunks of at most ``_CHUNK`` elements (at least one row)
    that never straddle two of the ``b0`` row blocks."""
    if rows * row_size <= _CHUNK:
        return [(0, rows)] if rows else []
    starts = _block_starts(rows, b0)
    step = max(1, _CHUNK // max(1, row_size))
    return [(i, min(i + step, starts[blk + 1])) for blk in range(b0) for i in range(starts[blk], starts[blk + 1], step)]


def scale_test(sample_coordinates: list[torch.Tensor], coordinates: Callable[[], torch.Tensor],
               false_alarm: float, *, few_sources: bool = True) -> tuple[float, float]:
    """``(||y||, T)`` of the block-scale statistic: ``T`` from the noise samples' coordinates
    (:func:`~tracer.compare.thresholds.deviation_threshold` at per-tensor probability ``false_alarm``),
    ``y = coordinates()`` of the tested tensor, computed only when ``T > 0`` (else ``||y||`` is
    NaN: no sample moved the tensor along the reference, the norm statistic decides alone)."""
    threshold = deviation_threshold(sample_coordinates, false_alarm, few_sources=few_sources).threshold
    if threshold <= 0:
        return math.nan, threshold
    return float(torch.linalg.vector_norm(coordinates())), threshold


def verdict_ratio(error: float, threshold: float, sample_coordinates: list[torch.Tensor] | None,
                  coordinates: Callable[[], torch.Tensor], false_alarm: float, *,
                  few_sources: bool = True) -> tuple[float, float, float]:
    """``(ratio, ||y||, T)``: a tensor's error/threshold ratio over both statistics, the norm
    statistic's ``error / threshold`` (0 for no error under a zero threshold, else infinite)
    and, when ``sample_coordinates`` is given, :func:`scale_test`'s ``||y|| / T`` where ``T > 0``
    (``||y||``, ``T``: NaN when the block statistic is not tested)."""
    ratio = error / threshold if threshold > 0 else (0.0 if error == 0 else math.inf)
    scale_error = scale_threshold = math.nan
    if sample_coordinates is not None:
        scale_error, scale_threshold = scale_test(sample_coordinates, coordinates, false_alarm,
                                                  few_sources=few_sources)
        if scale_threshold > 0:
            ratio = max(ratio, scale_error / scale_threshold)
    return ratio, scale_error, scale_threshold
