"""The verdict on one traced tensor: error, threshold, status.

:func:`check_tensor` judges one record of one step, the candidate's assembled tensor against the
reference's and the noise samples (whole or as moments, :mod:`tracer.compare.deviation`):

1. the error ``||cand - ref||_2`` (and the largest elementwise difference, with the candidate
   ranks that hold it) against the threshold from the noise samples (:mod:`tracer.compare.thresholds`);
   on most floating-point tensors also the block-scale statistic (:mod:`tracer.compare.blockscale`),
   each statistic at half the tensor's false-alarm probability;
2. status (:class:`~tracer.trace.schema.Status`): ``over`` when a statistic exceeds its threshold
   (``ratio`` is the larger of the ratios), ``nonfinite`` when the candidate has NaN/Inf where the
   reference does not, ``replicas`` when copies the candidate marks as replicated disagree,
   ``unchecked`` when no threshold applies.

Records of an invariant (:data:`~tracer.trace.schema.INVARIANT_PHASES`) are compared bitwise;
a candidate traced in statistics-only mode by the reverse triangle inequality
(:func:`check_stats_only`); top-k routing decisions by :func:`check_routed`
(:mod:`tracer.compare.decisions`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from tracer.compare.blockscale import block_scales, block_scales_and_norms, verdict_ratio
from tracer.compare.decisions import TOPK_CONSUMER_META, TOPK_META, ChoiceChange, choice_changes, without_choices
from tracer.compare.deviation import (DeviationOf, SampleMoments, block_scale_applies, storage_rounding_allowance,
                                      storage_rounding_excess, stored_rounded, work_dtype)
from tracer.compare.difference import difference_norms
from tracer.compare.elementwise import element_test, summarize
from tracer.compare.thresholds import deviation_threshold, moments_threshold, noise_threshold, unmodelled_threshold
from tracer.trace.canonical import shard
from tracer.trace.schema import INVARIANT_PHASES, Entry, Phase, RecordKey, Status

__all__ = ["TensorCheck", "check_routed", "check_stats_only", "check_tensor", "downstream_of_choices"]


@dataclass
class TensorCheck:
    """The verdict on one traced tensor of one step."""

    step: int
    phase: str
    name: str
    microbatch: int
    call: int
    index: int                 # execution index in the reference
    module: str
    shape: list[int]
    dtype: str
    status: str                # ok | over | nonfinite | replicas | unchecked
    error: float               # ||cand - ref||_2
    threshold: float
    ratio: float               # the larger of error / threshold (inf when threshold is 0 and error > 0)
                               # and scale_error / scale_threshold
    max_abs: float             # largest |cand - ref| element
    ref_norm: float
    n_eff: float = 0.0
    factor: float = 0.0
    worst_ranks: list[int] = field(default_factory=list)  # candidate ranks holding the worst element
    note: str = ""
    scale_error: float = math.nan      # ||y|| of the block-scale statistic (tracer.compare.blockscale); NaN: not tested
    scale_threshold: float = math.nan  # its threshold
    cand_norm: float = math.nan        # ||cand||_2, measured for a tensor not ok (NaN: not measured);
                                       # cand_norm / ref_norm is a uniform rescaling's factor (localisation)
    element_ratio: float = math.nan    # the element statistic's max_i |e_i| / T_i (tracer.compare.elementwise);
                                       # NaN: not tested
    element_index: int = -1            # flat index of the element that sets it

    @property
    def by_element(self) -> bool:
        """Is the element statistic the one that sets :attr:`ratio`?"""
        return self.element_ratio >= self.ratio

    @property
    def by_scale(self) -> bool:
        """Is the block-scale statistic the one that sets :attr:`ratio`?"""
        return self.scale_threshold > 0 and self.scale_error / self.scale_threshold >= self.ratio

    @property
    def label(self) -> str:
        return f"step {self.step} {self.phase} {self.name} (mb {self.microbatch})"


def _identity(step: int, key: RecordKey, ref_e: Entry, ref_t: torch.Tensor) -> dict[str, Any]:
    """The fields of a :class:`TensorCheck` that say which tensor it is."""
    return dict(step=step, phase=str(key.phase), name=key.name, microbatch=key.microbatch, call=key.call,
                index=ref_e.index, module=ref_e.module, shape=list(ref_t.shape), dtype=ref_e.dtype)


def _worst_ranks(full_shape: tuple[int, ...], flat_index: int, entries: dict[int, Entry]) -> list[int]:
    """Candidate ranks whose shard holds element ``flat_index`` of the full tensor."""
    numel = math.prod(full_shape)
    if numel == 0 or numel > 1 << 26:
        return []
    ids = torch.arange(numel, dtype=torch.int64).reshape(full_shape)
    out = []
    for r, e in entries.items():
        pl = e.placement
        if any(d.kind == "partial" for d in pl.dims):
            out.append(r)
            continue
        try:
            if bool((shard(ids, pl) == flat_index).any()):
                out.append(r)
        except (ValueError, RuntimeError):
            continue
    return sorted(out)


def _max_abs(x: torch.Tensor) -> float:
    """``max |x|`` (0 when empty, NaN when ``x`` has one) from one ``aminmax`` pass: torch's CPU
    kernel for the inf-norm takes ~9x as long on 4M float32 values (11.4 vs 1.3 ms)."""
    if not x.numel():
        return 0.0
    lo, hi = torch.aminmax(x)
    return max(-float(lo), float(hi))


def check_tensor(step: int, key: RecordKey, ref_e: Entry, ref_t: torch.Tensor, cand_t: torch.Tensor,
               notes: list[str], noisy: "list[torch.Tensor] | SampleMoments", false_alarm: float,
               cand_entries: dict[int, Entry], work: torch.dtype | None = None, *,
               block_scale: bool = True, few_sources: bool = True, elementwise: bool = False) -> TensorCheck:
    """The verdict on one tensor (module doc); ``noisy``: the noise samples, whole or as their
    moments (:mod:`tracer.compare.deviation`); ``few_sources``: the thresholds' degrees of freedom are
    also capped by the samples' spread (:func:`few_sources`); ``elementwise``: also test the
    element statistic (:mod:`tracer.compare.elementwise`) where the samples carry what it needs
    (stored whole, or as moments with their element summaries) and moved the tensor. The tensor's
    false-alarm probability is split evenly over the statistics tested (Bonferroni).

    Arithmetic runs in ``work``: by default float32 for tensors stored in fp32/bf16/fp16 (half
    the memory traffic of float64, :func:`~tracer.compare.deviation.work_dtype`), float64 otherwise,
    and float64 again when a float32 result overflows to infinity (squares beyond 3e38)."""
    phase = key.phase
    base = _identity(step, key, ref_e, ref_t)
    if tuple(cand_t.shape) != tuple(ref_t.shape):
        return TensorCheck(**base, status=Status.OVER, error=math.inf, threshold=0.0, ratio=math.inf,
                           max_abs=math.inf, ref_norm=float(ref_t.double().norm()),
                           note=f"shape {list(cand_t.shape)} in the candidate vs {list(ref_t.shape)} in the "
                                "reference (a wrong placement or a wrong computation)")
    if phase in INVARIANT_PHASES:
        return _check_invariant(base, float(torch.linalg.vector_norm((cand_t.double() - ref_t.double()).reshape(-1))),
                                float(torch.linalg.vector_norm(ref_t.double().reshape(-1))), notes)
    if work is None and work_dtype(ref_t.dtype, cand_t.dtype) == torch.float32:
        row = check_tensor(step, key, ref_e, ref_t, cand_t, notes, noisy, false_alarm, cand_entries, torch.float32,
                         block_scale=block_scale, few_sources=few_sources, elementwise=elementwise)
        if row.status == Status.NONFINITE or not any(map(math.isinf, (row.error, row.threshold, row.ref_norm))):
            return row  # else a float32 overflow: again in float64
    work = torch.float64 if work is None else work
    # with block_scale, two statistics where the block-scale one applies (and a sample can set
    # its threshold), each at half the false-alarm probability
    blocks = block_scale and bool(noisy) and block_scale_applies(phase, ref_t) and (
        not isinstance(noisy, SampleMoments) or noisy.blocks is not None)
    # the common case, all finite: the norms chunk by chunk (a NaN or Inf of either, or an
    # overflow, makes them non-finite), no elementwise masks, no whole-tensor copies; with the
    # block statistic, its coordinates from the same pass
    cand_blocks, norms = (block_scales_and_norms(ref_t, cand_t, work) if blocks
                          else (None, difference_norms(ref_t, cand_t, work)))
    dev: DeviationOf | None = None

    def deviation() -> DeviationOf:  # the reference in the working dtype, when elementwise work needs it
        nonlocal dev
        if dev is None:
            dev = DeviationOf(ref_t.detach().to(work), ref_t.dtype, phase, finite=True)
        return dev
    if norms is not None:
        error, ref_norm, max_abs = norms
    else:
        r, c = ref_t.detach().to(work), cand_t.detach().to(work)
        rf, cf = torch.isfinite(r), torch.isfinite(c)  # masks of the finite elements
        if bool(rf.all()) and bool(cf.all()):  # an overflow of the difference
            rf = None
        ref_norm = float(torch.linalg.vector_norm(r if rf is None else r[rf]))
        if rf is not None and not bool(torch.equal(rf, cf) and torch.equal(r[~rf].nan_to_num(1.0, 2.0, -2.0),
                                                                           c[~cf].nan_to_num(1.0, 2.0, -2.0))):
            bad = (~cf & rf).nonzero()
            where = f" first at index {bad[0].tolist()}" if len(bad) else ""
            return TensorCheck(**base, status=Status.NONFINITE, error=math.inf, threshold=0.0, ratio=math.inf,
                               max_abs=math.inf, ref_norm=ref_norm,
                               note=f"NaN/Inf pattern differs from the reference: {int((~cf).sum())} non-finite "
                                    f"in the candidate, {int((~rf).sum())} in the reference;{where}")
        # the same non-finite pattern: their positions count as equal
        dev = DeviationOf(r, ref_t.dtype, phase, finite=True if rf is None else rf)
        diff = dev.part(c) - dev.ref
        error, max_abs = float(torch.linalg.vector_norm(diff)), _max_abs(diff)
    if stored_rounded(phase, ref_t.dtype) and ref_t.numel():  # on the stored values where all are finite
        error = (deviation().excess.norm(deviation().part(cand_t)) if norms is None
                 else storage_rounding_excess(phase, ref_t.dtype, ref_t).norm(cand_t))
    if not noisy:
        return TensorCheck(**base, status=Status.UNCHECKED, error=error, threshold=math.nan, ratio=math.nan,
                           max_abs=max_abs, ref_norm=ref_norm, note="no noise sample traced this tensor")
    elements = elementwise and ref_t.is_floating_point() and ref_t.numel() > 0 and bool(
        noisy.elements if isinstance(noisy, SampleMoments) else noisy)
    q = false_alarm / (1 + blocks + elements)
    if isinstance(noisy, SampleMoments):
        th = moments_threshold(noisy.z, noisy.m_sq, q, few_sources=few_sources)
        sample_blocks = noisy.blocks if blocks else None
    else:
        devs = [deviation()(n) for n in noisy]
        th = deviation_threshold(devs, q, few_sources=few_sources)
        sample_blocks = [block_scales(deviation().ref, d, work, deviation=True) for d in devs] if blocks else None
    if th.threshold == 0.0 and ref_t.is_floating_point():
        th = unmodelled_threshold(deviation().ref, ref_t.dtype)
        # no sample moved it: the norm statistic's ulp threshold, and the element statistic with a
        # zero scale (an element beyond its storage allowance is infinitely over; a layout that
        # leaves the tensor's arithmetic unchanged predicts exactly this, ttrace_num.propagate.layout)
        sample_blocks = None
    ratio, scale_error, scale_threshold = verdict_ratio(
        error, th.threshold, sample_blocks,
        lambda: cand_blocks if norms is not None else block_scales(deviation().ref, deviation().part(cand_t), work), q,
        few_sources=few_sources)
    element = None
    if elements:
        d = deviation()
        summaries = (noisy.elements if isinstance(noisy, SampleMoments)
                     else [summarize(x, d.ref, ref_t.dtype) for x in devs])
        element = element_test(d.part(cand_t) - d.ref, summaries, d.ref, ref_t.dtype, q)
        ratio = max(ratio, element.ratio)
    status = Status.OVER if ratio > 1 else Status.OK
    note = "; ".join(notes)
    if notes:
        status = Status.REPLICAS if status == Status.OK else status
    worst, cand_norm = [], math.nan
    if status != Status.OK and ref_t.numel():
        d = deviation()
        at = element.index if element is not None and element.ratio >= ratio else \
            int((d.part(cand_t) - d.ref).abs().reshape(-1).argmax())
        worst = _worst_ranks(tuple(ref_t.shape), at, cand_entries)
        cand_norm = float(torch.linalg.vector_norm(d.part(cand_t)))
    return TensorCheck(**base, status=status, error=error, threshold=th.threshold, ratio=ratio, max_abs=max_abs,
                       ref_norm=ref_norm, n_eff=th.n_eff, factor=th.factor, worst_ranks=worst, note=note,
                       scale_error=scale_error, scale_threshold=scale_threshold, cand_norm=cand_norm,
                       element_ratio=element.ratio if element else math.nan,
                       element_index=element.index if element else -1)


def _check_invariant(base: dict[str, Any], error: float, ref_norm: float, notes: list[str]) -> TensorCheck:
    """The verdict on a record of an invariant (:data:`~tracer.trace.store.INVARIANT_PHASES`): over
    when the candidate differs from the reference at all (threshold 0, no noise samples)."""
    status = Status.OVER if error != 0 else (Status.REPLICAS if any("replicas over" in n for n in notes) else Status.OK)
    return TensorCheck(**base, status=status, error=error, threshold=0.0, ratio=0.0 if error == 0 else math.inf,
                       max_abs=error, ref_norm=ref_norm, note="; ".join(notes))


def check_routed(step: int, key: RecordKey, ref_e: Entry, ref_t: torch.Tensor, cand_t: torch.Tensor,
                  notes: list[str], noisy: "list[torch.Tensor] | SampleMoments", false_alarm: float,
                  cand_entries: dict[int, Entry],
                  changed: dict[tuple[int, str, int, int], ChoiceChange], block_scale: bool = True,
                  few_sources: bool = True, elementwise: bool = False) -> TensorCheck:
    """:func:`check_tensor` with top-k choices (:mod:`tracer.compare.decisions`): a module's scores,
    when within threshold, record in ``changed`` which tokens' choices differ; the scores'
    gradient and the tensors that consume the choice leave those tokens out (a consumer
    without token rows is ``unchecked`` when the candidate's choice changed)."""
    meta = ref_e.meta
    module = str(meta.get("module", ""))
    scores_of = (module if key[0] == Phase.BWD and TOPK_META in meta
                 else f"{module}.{meta[TOPK_CONSUMER_META]}" if TOPK_CONSUMER_META in meta else None)
    change = changed.get((step, scores_of, key[2], key[3])) if scores_of else None
    if change is not None and cand_t.shape == ref_t.shape:
        if _fits(change.left_out, ref_t):
            mask = change.left_out
            row = check_tensor(step, key, ref_e, without_choices(ref_t, mask), without_choices(cand_t, mask), notes,
                             [without_choices(n, mask) for n in noisy], false_alarm, cand_entries,
                             block_scale=block_scale, few_sources=few_sources,
                             elementwise=elementwise)
            row.note = "; ".join(x for x in (row.note, f"{int(mask.sum())} token(s) left out: their top-k choice "
                                                       "legitimately differs (tracer.compare.decisions)") if x)
            return row
        if change.in_candidate:
            row = check_tensor(step, key, ref_e, ref_t, cand_t, notes, noisy, false_alarm, cand_entries,
                             block_scale=block_scale, few_sources=few_sources,
                             elementwise=elementwise)
            if row.status in (Status.OK, Status.OVER):
                _not_compared(row, f"it depends on the top-k choice of {scores_of}, which legitimately differs on "
                                   f"{change.in_candidate} token(s) of this microbatch, and has no token rows to "
                                   "leave them out")
            return row
    row = check_tensor(step, key, ref_e, ref_t, cand_t, notes, noisy, false_alarm, cand_entries, block_scale=block_scale,
                     few_sources=few_sources, elementwise=elementwise)
    topk = meta.get(TOPK_META)
    if topk and key[0] == Phase.FWD and row.status == Status.OK and noisy:
        change = choice_changes(ref_t, cand_t, noisy, topk["k"], topk["dim"])
        if change.note:
            changed[(step, module, key[2], key[3])] = change
            row.note = "; ".join(x for x in (row.note, change.note) if x)
    return row


def downstream_of_choices(row: TensorCheck, meta: dict[str, Any],
                           changed: dict[tuple[int, str, int, int], ChoiceChange]) -> TensorCheck:
    """``row`` reported ``unchecked`` instead of ``over`` when it is a forward, backward or loss
    tensor of a step and microbatch in which the candidate changed a top-k choice that no noise
    sample changed, recorded earlier in execution order (step 4 of :mod:`tracer.compare.decisions`);
    the scores and their consumers (meta) are compared as they are."""
    if row.status != Status.OVER or row.phase not in (Phase.FWD, Phase.BWD, Phase.LOSS) or TOPK_META in meta \
            or TOPK_CONSUMER_META in meta:
        return row
    causes = [(module, c.unsampled) for (step, module, mb, _), c in changed.items()
              if step == row.step and mb == row.microbatch and c.unsampled]
    if causes:
        _not_compared(row, "downstream of a top-k choice the candidate legitimately changed and no noise sample "
                           f"did ({', '.join(f'{m}: {n} token(s)' for m, n in causes)}), which the thresholds do "
                           "not describe")
    return row


def _not_compared(row: TensorCheck, why: str) -> None:
    """Mark ``row`` ``unchecked`` because of a top-k choice, keeping its ratio in the note."""
    row.status = Status.UNCHECKED
    row.note = "; ".join(x for x in (row.note, f"not compared (ratio {row.ratio:.3g} for the record): {why} "
                                               "(tracer.compare.decisions)") if x)


def _fits(mask: torch.Tensor, t: torch.Tensor) -> bool:
    """Does a token mask of a module's scores broadcast to ``t`` (one of its gradients)?"""
    return mask.dim() == t.dim() and all(m in (1, n) for m, n in zip(mask.shape, t.shape))


def _stats_norm(entries: dict[int, Entry]) -> float | None:
    """Norm of the full tensor from the shards' stored norms: shards of a split add in
    squares, replicas count once; None when a level is a pending sum (partial) or a norm
    is missing (non-finite values)."""
    pl = {r: e.placement for r, e in entries.items()}
    if any(d.kind == "partial" for p in pl.values() for d in p.dims):
        return None
    seen: set[tuple] = set()
    total = 0.0
    for r, e in entries.items():
        coords = tuple((d.rank, d.start) for d in pl[r].dims if d.kind != "replicated")
        if coords in seen:
            continue
        seen.add(coords)
        n = (e.stats or {}).get("norm")
        if n is None:
            return None
        total += float(n) ** 2
    return math.sqrt(total)


def check_stats_only(step: int, key: RecordKey, ref_e: Entry, ref_t: torch.Tensor,
                 cand_entries: dict[int, Entry], noisy: "list[torch.Tensor] | SampleMoments",
                 false_alarm: float, few_sources: bool = True) -> TensorCheck:
    """A candidate traced in statistics-only mode: ``| ||c|| - ||r|| | <= ||c - r||`` (reverse
    triangle inequality) is a lower bound of the error, so exceeding the threshold with it is
    a sound detection (a difference that keeps the norm goes unseen)."""
    phase = key.phase
    r = ref_t.detach().double()
    base = _identity(step, key, ref_e, ref_t)
    ref_norm = float(torch.linalg.vector_norm(r))
    bad = sum((e.stats or {}).get("nan_count", 0) + (e.stats or {}).get("inf_count", 0) for e in cand_entries.values())
    if bad and bool(torch.isfinite(r).all()):
        return TensorCheck(**base, status=Status.NONFINITE, error=math.inf, threshold=0.0, ratio=math.inf,
                           max_abs=math.inf, ref_norm=ref_norm,
                           note=f"NaN/Inf in the candidate ({bad} values over its shards), none in the reference")
    cn = _stats_norm(cand_entries)
    if phase in INVARIANT_PHASES and cn is not None:
        return _check_invariant(base, abs(cn - ref_norm), ref_norm,
                                ["stats-only candidate: error is the lower bound | ||cand|| - ||ref|| |"])
    if cn is None or not noisy or not math.isfinite(ref_norm):
        return TensorCheck(**base, status=Status.UNCHECKED, error=math.nan, threshold=math.nan, ratio=math.nan,
                           max_abs=math.nan, ref_norm=ref_norm,
                           note="stats-only candidate: no norm to compare (pending sum, NaN/Inf or no noise)")
    th = (moments_threshold(noisy.z, noisy.m_sq, false_alarm, few_sources=few_sources)
          if isinstance(noisy, SampleMoments)
          else noise_threshold(r, [n.double() for n in noisy], false_alarm, few_sources=few_sources))
    if th.threshold == 0.0 and ref_t.is_floating_point():
        th = unmodelled_threshold(r, ref_t.dtype)
    err = abs(cn - ref_norm)
    if isinstance(noisy, SampleMoments):  # a threshold of storage-rounding excesses: bound the candidate's alike
        err = max(0.0, err - storage_rounding_allowance(phase, ref_t.dtype, cn, ref_norm, r.numel()))
    ratio = err / th.threshold if th.threshold > 0 else (0.0 if err == 0 else math.inf)
    return TensorCheck(**base, status=Status.OVER if ratio > 1 else Status.OK, error=err, threshold=th.threshold,
                       ratio=ratio, max_abs=math.nan, ref_norm=ref_norm, n_eff=th.n_eff, factor=th.factor,
                       note="stats-only candidate: error is the lower bound | ||cand|| - ||ref|| |")


