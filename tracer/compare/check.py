"""Compare a candidate trace with its reference: per-tensor error, threshold, first divergence.

:func:`compare` reads a reference trace (single device, with noise samples under
``ref/noise/sample_*``, see :mod:`tracer.compare.thresholds`) and a candidate trace (any layout),
and for every tensor both traced, in the reference's execution order:

1. assembles the candidate's shards into the full tensor (:func:`tracer.trace.canonical.assemble`,
   from the placements each rank wrote) and checks that replicated copies agree bitwise
   (they are computed from identical inputs by identical code on every rank);
2. computes the error ``||cand - ref||_2`` (and the largest elementwise difference, with
   the candidate rank that holds it) and the threshold from the noise samples, and (unless
   ``block_scale=False``), on most floating-point tensors, the block-scale statistic: the
   part of the difference that rescales the reference block by block, which a wrong scale on
   one shard changes (:mod:`tracer.compare.blockscale`); each statistic then gets half the tensor's
   false-alarm probability;
3. marks the tensor ``over`` when a statistic exceeds its threshold (``ratio`` is the
   larger of the ratios), ``nonfinite`` when the candidate has NaN/Inf where the
   reference does not, ``replicas`` when copies disagree.

The *first divergence* is the first non-``ok`` tensor in the reference's execution order
(step by step: forward and backward of each microbatch, then the grads each rank
contributes, the reduced grads, the grad norm and the updated parameters). It is then
*localised*: a forward output whose module's inputs all agree is a wrong module; a reduced
grad whose per-rank contributions agree is a wrong reduction; an updated parameter whose
reduced grad agrees is a wrong optimizer step (:func:`localise`).

What a candidate records for a reference that re-synchronises to it (:mod:`tracer.capture.resync`) is
not compared: a run's own carried state (phase ``state``, e.g. FP8 amax histories, whose
effect the scales and every quantised tensor show), and the optimizer's (phases
``main_param``, ``exp_avg``, ``exp_avg_sq``): Adam
moves an element whose gradient is within round-off of zero by ``+-lr`` at random, and where
the candidate's split reduction biases a gradient (the sum over every token of a 1-D parameter's
gradient, :mod:`tracer.compare.blockscale`) the noise samples do not sample those flips. The updated
parameters themselves are compared (phase ``param``).
"""
from __future__ import annotations

import math
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tracer.trace.canonical import Placement, assemble, shard
from tracer.compare.decisions import TOPK_CONSUMER_META, TOPK_META, ChoiceChange, choice_changes, without_choices
from tracer.compare.blockscale import block_scales, block_scales_and_norms, verdict_ratio
from tracer.compare.deviation import (DEVIATION_FIELD, DeviationOf, Key, SampleMoments, block_scale_applies,
                              combined_moments, entry_key, storage_rounding_allowance, storage_rounding_excess,
                              stored_rounded, work_dtype)
from tracer.compare.difference import difference_norms
from tracer.errors import IncomparableRunsError, TraceError
from tracer.capture.optim_state import STEP_COUNT_OPTION
from tracer.trace.store import CARRIED_PHASES, INVARIANT_PHASES, PRE_UPDATE_PHASES, TraceReader
from tracer.compare.thresholds import (DEFAULT_FALSE_ALARM, deviation_threshold, moments_threshold, noise_threshold,
                               unmodelled_threshold)

__all__ = ["Comparison", "TensorCheck", "assembled_phases", "assembled_records", "compare", "few_sources", "localise",
           "makes_topk_choice", "noise_dirs", "samples_restart"]



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

    @property
    def by_scale(self) -> bool:
        """Is the block-scale statistic the one that sets :attr:`ratio`?"""
        return self.scale_threshold > 0 and self.scale_error / self.scale_threshold >= self.ratio

    @property
    def label(self) -> str:
        return f"step {self.step} {self.phase} {self.name} (mb {self.microbatch})"


@dataclass
class Comparison:
    """Everything :func:`compare` found."""

    reference: str
    candidate: str
    candidate_layout: dict[str, Any]
    rows: list[TensorCheck]
    first: TensorCheck | None
    localisation: str
    unmatched: list[str]
    noise_samples: int
    false_alarm: float

    @property
    def verdict(self) -> str:
        return "consistent" if self.first is None else "DIVERGENT"

    @property
    def max_ratio_ok(self) -> float:
        """Largest error/threshold among the tensors within threshold (the safety margin)."""
        return max((r.ratio for r in self.rows if r.status == "ok" and math.isfinite(r.ratio)), default=0.0)

    def counts(self) -> dict[str, int]:
        c: dict[str, int] = defaultdict(int)
        for r in self.rows:
            c[r.status] += 1
        return dict(c)

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "reference": self.reference, "candidate": self.candidate,
                "candidate_layout": self.candidate_layout, "counts": self.counts(),
                "max_ratio_within_threshold": self.max_ratio_ok, "noise_samples": self.noise_samples,
                "false_alarm_per_comparison": self.false_alarm,
                "first_divergence": None if self.first is None else asdict(self.first),
                "localisation": self.localisation, "unmatched": self.unmatched,
                "tensors": [asdict(r) for r in self.rows]}


def noise_dirs(ref_root: str | Path) -> list[Path]:
    """The noise-sample traces of a reference (``ref/noise/sample_*``), sorted."""
    base = Path(ref_root) / "noise"
    return sorted(p for p in base.glob("sample_*") if (p / "run.json").is_file()) if base.is_dir() else []


def samples_restart(noise: Iterable[TraceReader]) -> bool:
    """Whether every noise sample restarted each step from the reference's state, as those of
    a reference re-synchronised to its candidate do (``run.json`` meta ``restarts_each_step``,
    written by :class:`tracer.capture.noise_sampler.NoiseSampler`); False without samples."""
    readers = list(noise)
    return bool(readers) and all((r.run.get("meta") or {}).get("restarts_each_step") is True for r in readers)


def few_sources(phase: str, restarted: bool, discrete: bool) -> bool:
    """Whether a tensor's threshold keeps the few-source cap on its degrees of freedom
    (:mod:`tracer.compare.thresholds`, ``few_sources``): everywhere but on the tensors a step records
    before its optimizer update (:data:`~tracer.trace.store.PRE_UPDATE_PHASES`) when the samples
    restart every step (:func:`samples_restart`) and the step makes no ``discrete`` choice.
    There every run starts the step from the same parameters, so no Adam flip can drive the
    deviation. A top-k routing choice (:mod:`tracer.compare.decisions`) is such a flip inside the step:
    a sample that routes a near-tied token elsewhere deviates by that token alone. Measured:
    without this exception the re-synchronised matrix had 5 tensors over threshold (up to
    1.04x) in one MoE row, downstream of its routers."""
    return not (restarted and not discrete and phase in PRE_UPDATE_PHASES)


def makes_topk_choice(reader: TraceReader, step: int) -> bool:
    """Whether ``step`` of the trace scores a top-k choice (a record marked ``topk``)."""
    return any(TOPK_META in e["meta"] for rank in reader.ranks(step) for e in reader.entries(step, rank))


def _index_by_key(reader: TraceReader, step: int) -> dict[Key, dict[int, dict[str, Any]]]:
    """key -> {rank: entry} over every present rank of ``step``."""
    out: dict[Key, dict[int, dict[str, Any]]] = defaultdict(dict)
    for rank in reader.ranks(step):
        for e in reader.entries(step, rank):
            out[entry_key(e)][rank] = e
    return out


def _compared(reader: TraceReader, step: int) -> dict[Key, dict[int, dict[str, Any]]]:
    """:func:`_index_by_key` without the state recorded for re-synchronisation (not compared:
    module docstring)."""
    return {k: v for k, v in _index_by_key(reader, step).items() if k[0] not in CARRIED_PHASES}


def _full(reader: TraceReader, step: int, entries: dict[int, dict[str, Any]], name: str
          ) -> tuple[torch.Tensor, list[str]]:
    """Assembled full tensor of one key, and notes on disagreeing replicas."""
    shards = {r: reader.load(step, r, e["key"]) for r, e in entries.items()}
    placements = {r: e["placement"] or {"dims": []} for r, e in entries.items()}
    try:
        full, report = assemble(shards, placements, name=name)
    except ValueError as exc:
        raise TraceError(f"cannot assemble the candidate's shards: {exc}", path=reader.root, step=step,
                         tensor=name) from exc
    notes = [f"replicas over {d.group} differ: ranks {list(d.reference)} vs {list(d.other)}, "
             f"max |diff| {d.max_abs_diff:.3g}" for d in report.replicas if not d.equal]
    notes += [f"rank {r}: " + _listed(e["meta"]["differing"])  # a `cast` record's findings
              for r, e in sorted(entries.items()) if e["meta"].get("differing")]
    return full, notes


def _listed(differing: list[list], shown: int = 3) -> str:
    """``[[param, differing, checked], ...]`` (a ``cast`` record's meta) as a short phrase."""
    out = ", ".join(f"{p} ({n} of {m} elements)" for p, n, m in differing[:shown])
    return out + (f" and {len(differing) - shown} more" if len(differing) > shown else "")


def _worst_ranks(full_shape: tuple[int, ...], flat_index: int, entries: dict[int, dict[str, Any]]) -> list[int]:
    """Candidate ranks whose shard holds element ``flat_index`` of the full tensor."""
    numel = math.prod(full_shape)
    if numel == 0 or numel > 1 << 26:
        return []
    ids = torch.arange(numel, dtype=torch.int64).reshape(full_shape)
    out = []
    for r, e in entries.items():
        pl = Placement.from_dict(e["placement"] or {"dims": []})
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


def _check_one(step: int, key: Key, ref_e: dict[str, Any], ref_t: torch.Tensor, cand_t: torch.Tensor,
               notes: list[str], noisy: "list[torch.Tensor] | SampleMoments", false_alarm: float,
               cand_entries: dict[int, dict[str, Any]], work: torch.dtype | None = None, *,
               block_scale: bool = True, few_sources: bool = True) -> TensorCheck:
    """The verdict on one tensor (module doc); ``noisy``: the noise samples, whole or as their
    moments (:mod:`tracer.compare.deviation`); ``few_sources``: the thresholds' degrees of freedom are
    also capped by the samples' spread (:func:`few_sources`).

    Arithmetic runs in ``work``: by default float32 for tensors stored in fp32/bf16/fp16 (half
    the memory traffic of float64, :func:`~tracer.compare.deviation.work_dtype`), float64 otherwise,
    and float64 again when a float32 result overflows to infinity (squares beyond 3e38)."""
    phase, name, mb, call = key
    base = dict(step=step, phase=phase, name=name, microbatch=mb, call=call, index=int(ref_e["index"]),
                module=str(ref_e["meta"].get("module", ref_e["meta"].get("param", ""))),
                shape=list(ref_t.shape), dtype=str(ref_e["dtype"]))
    if tuple(cand_t.shape) != tuple(ref_t.shape):
        return TensorCheck(**base, status="over", error=math.inf, threshold=0.0, ratio=math.inf,
                           max_abs=math.inf, ref_norm=float(ref_t.double().norm()),
                           note=f"shape {list(cand_t.shape)} in the candidate vs {list(ref_t.shape)} in the "
                                "reference (a wrong placement or a wrong computation)")
    if phase in INVARIANT_PHASES:
        return _check_invariant(base, float(torch.linalg.vector_norm((cand_t.double() - ref_t.double()).reshape(-1))),
                                float(torch.linalg.vector_norm(ref_t.double().reshape(-1))), notes)
    if work is None and work_dtype(ref_t.dtype, cand_t.dtype) == torch.float32:
        row = _check_one(step, key, ref_e, ref_t, cand_t, notes, noisy, false_alarm, cand_entries, torch.float32,
                         block_scale=block_scale, few_sources=few_sources)
        if row.status == "nonfinite" or not any(map(math.isinf, (row.error, row.threshold, row.ref_norm))):
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
            return TensorCheck(**base, status="nonfinite", error=math.inf, threshold=0.0, ratio=math.inf,
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
        return TensorCheck(**base, status="unchecked", error=error, threshold=math.nan, ratio=math.nan,
                           max_abs=max_abs, ref_norm=ref_norm, note="no noise sample traced this tensor")
    q = false_alarm / 2 if blocks else false_alarm
    if isinstance(noisy, SampleMoments):
        th = moments_threshold(noisy.z, noisy.m_sq, q, few_sources=few_sources)
        sample_blocks = noisy.blocks if blocks else None
    else:
        devs = [deviation()(n) for n in noisy]
        th = deviation_threshold(devs, q, few_sources=few_sources)
        sample_blocks = [block_scales(deviation().ref, d, work, deviation=True) for d in devs] if blocks else None
    if th.threshold == 0.0 and ref_t.is_floating_point():
        th = unmodelled_threshold(deviation().ref, ref_t.dtype)
        sample_blocks = None  # no sample moved it: the norm statistic's ulp threshold decides alone
    ratio, scale_error, scale_threshold = verdict_ratio(
        error, th.threshold, sample_blocks,
        lambda: cand_blocks if norms is not None else block_scales(deviation().ref, deviation().part(cand_t), work), q,
        few_sources=few_sources)
    status = "over" if ratio > 1 else "ok"
    note = "; ".join(notes)
    if notes:
        status = "replicas" if status == "ok" else status
    worst = []
    if status != "ok" and ref_t.numel():
        d = deviation()
        worst = _worst_ranks(tuple(ref_t.shape), int((d.part(cand_t) - d.ref).abs().reshape(-1).argmax()),
                             cand_entries)
    return TensorCheck(**base, status=status, error=error, threshold=th.threshold, ratio=ratio, max_abs=max_abs,
                       ref_norm=ref_norm, n_eff=th.n_eff, factor=th.factor, worst_ranks=worst, note=note,
                       scale_error=scale_error, scale_threshold=scale_threshold)


def _check_invariant(base: dict[str, Any], error: float, ref_norm: float, notes: list[str]) -> TensorCheck:
    """The verdict on a record of an invariant (:data:`~tracer.trace.store.INVARIANT_PHASES`): over
    when the candidate differs from the reference at all (threshold 0, no noise samples)."""
    status = "over" if error != 0 else ("replicas" if any("replicas over" in n for n in notes) else "ok")
    return TensorCheck(**base, status=status, error=error, threshold=0.0, ratio=0.0 if error == 0 else math.inf,
                       max_abs=error, ref_norm=ref_norm, note="; ".join(notes))


def _check_routed(step: int, key: Key, ref_e: dict[str, Any], ref_t: torch.Tensor, cand_t: torch.Tensor,
                  notes: list[str], noisy: "list[torch.Tensor] | SampleMoments", false_alarm: float,
                  cand_entries: dict[int, dict[str, Any]],
                  changed: dict[tuple[int, str, int, int], ChoiceChange], block_scale: bool = True,
                  few_sources: bool = True) -> TensorCheck:
    """:func:`_check_one` with top-k choices (:mod:`tracer.compare.decisions`): a module's scores,
    when within threshold, record in ``changed`` which tokens' choices differ; the scores'
    gradient and the tensors that consume the choice leave those tokens out (a consumer
    without token rows is ``unchecked`` when the candidate's choice changed)."""
    meta = ref_e["meta"]
    module = str(meta.get("module", ""))
    scores_of = (module if key[0] == "bwd" and TOPK_META in meta
                 else f"{module}.{meta[TOPK_CONSUMER_META]}" if TOPK_CONSUMER_META in meta else None)
    change = changed.get((step, scores_of, key[2], key[3])) if scores_of else None
    if change is not None and cand_t.shape == ref_t.shape:
        if _fits(change.left_out, ref_t):
            mask = change.left_out
            row = _check_one(step, key, ref_e, without_choices(ref_t, mask), without_choices(cand_t, mask), notes,
                             [without_choices(n, mask) for n in noisy], false_alarm, cand_entries,
                             block_scale=block_scale, few_sources=few_sources)
            row.note = "; ".join(x for x in (row.note, f"{int(mask.sum())} token(s) left out: their top-k choice "
                                                       "legitimately differs (tracer.compare.decisions)") if x)
            return row
        if change.in_candidate:
            row = _check_one(step, key, ref_e, ref_t, cand_t, notes, noisy, false_alarm, cand_entries,
                             block_scale=block_scale, few_sources=few_sources)
            if row.status in ("ok", "over"):
                _not_compared(row, f"it depends on the top-k choice of {scores_of}, which legitimately differs on "
                                   f"{change.in_candidate} token(s) of this microbatch, and has no token rows to "
                                   "leave them out")
            return row
    row = _check_one(step, key, ref_e, ref_t, cand_t, notes, noisy, false_alarm, cand_entries, block_scale=block_scale,
                     few_sources=few_sources)
    topk = meta.get(TOPK_META)
    if topk and key[0] == "fwd" and row.status == "ok" and noisy:
        change = choice_changes(ref_t, cand_t, noisy, topk["k"], topk["dim"])
        if change.note:
            changed[(step, module, key[2], key[3])] = change
            row.note = "; ".join(x for x in (row.note, change.note) if x)
    return row


def _downstream_of_choices(row: TensorCheck, meta: dict[str, Any],
                           changed: dict[tuple[int, str, int, int], ChoiceChange]) -> TensorCheck:
    """``row`` reported ``unchecked`` instead of ``over`` when it is a forward, backward or loss
    tensor of a step and microbatch in which the candidate changed a top-k choice that no noise
    sample changed, recorded earlier in execution order (step 4 of :mod:`tracer.compare.decisions`);
    the scores and their consumers (meta) are compared as they are."""
    if row.status != "over" or row.phase not in ("fwd", "bwd", "loss") or TOPK_META in meta \
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
    row.status = "unchecked"
    row.note = "; ".join(x for x in (row.note, f"not compared (ratio {row.ratio:.3g} for the record): {why} "
                                               "(tracer.compare.decisions)") if x)


def _fits(mask: torch.Tensor, t: torch.Tensor) -> bool:
    """Does a token mask of a module's scores broadcast to ``t`` (one of its gradients)?"""
    return mask.dim() == t.dim() and all(m in (1, n) for m, n in zip(mask.shape, t.shape))


def _stats_norm(entries: dict[int, dict[str, Any]]) -> float | None:
    """Norm of the full tensor from the shards' stored norms: shards of a split add in
    squares, replicas count once; None when a level is a pending sum (partial) or a norm
    is missing (non-finite values)."""
    pl = {r: Placement.from_dict(e["placement"] or {"dims": []}) for r, e in entries.items()}
    if any(d.kind == "partial" for p in pl.values() for d in p.dims):
        return None
    seen: set[tuple] = set()
    total = 0.0
    for r, e in entries.items():
        coords = tuple((d.rank, d.start) for d in pl[r].dims if d.kind != "replicated")
        if coords in seen:
            continue
        seen.add(coords)
        n = e["stats"].get("norm")
        if n is None:
            return None
        total += float(n) ** 2
    return math.sqrt(total)


def _check_stats(step: int, key: Key, ref_e: dict[str, Any], ref_t: torch.Tensor,
                 cand_entries: dict[int, dict[str, Any]], noisy: "list[torch.Tensor] | SampleMoments",
                 false_alarm: float, few_sources: bool = True) -> TensorCheck:
    """A candidate traced in statistics-only mode: ``| ||c|| - ||r|| | <= ||c - r||`` (reverse
    triangle inequality) is a lower bound of the error, so exceeding the threshold with it is
    a sound detection (a difference that keeps the norm goes unseen)."""
    phase, name, mb, call = key
    r = ref_t.detach().double()
    base = dict(step=step, phase=phase, name=name, microbatch=mb, call=call, index=int(ref_e["index"]),
                module=str(ref_e["meta"].get("module", ref_e["meta"].get("param", ""))),
                shape=list(ref_t.shape), dtype=str(ref_e["dtype"]))
    ref_norm = float(torch.linalg.vector_norm(r))
    bad = sum(e["stats"]["nan_count"] + e["stats"]["inf_count"] for e in cand_entries.values())
    if bad and bool(torch.isfinite(r).all()):
        return TensorCheck(**base, status="nonfinite", error=math.inf, threshold=0.0, ratio=math.inf,
                           max_abs=math.inf, ref_norm=ref_norm,
                           note=f"NaN/Inf in the candidate ({bad} values over its shards), none in the reference")
    cn = _stats_norm(cand_entries)
    if phase in INVARIANT_PHASES and cn is not None:
        return _check_invariant(base, abs(cn - ref_norm), ref_norm,
                                ["stats-only candidate: error is the lower bound | ||cand|| - ||ref|| |"])
    if cn is None or not noisy or not math.isfinite(ref_norm):
        return TensorCheck(**base, status="unchecked", error=math.nan, threshold=math.nan, ratio=math.nan,
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
    return TensorCheck(**base, status="over" if ratio > 1 else "ok", error=err, threshold=th.threshold,
                       ratio=ratio, max_abs=math.nan, ref_norm=ref_norm, n_eff=th.n_eff, factor=th.factor,
                       note="stats-only candidate: error is the lower bound | ||cand|| - ||ref|| |")


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="compare", unit="tensor", file=sys.stderr, leave=False)


def _noise_samples(readers: list[TraceReader], entries: list[dict[str, Any] | None], step: int,
                   ref_e: dict[str, Any]) -> "list[torch.Tensor] | SampleMoments":
    """One tensor's noise samples: whole tensors, or their moments when the samples were stored
    as moments (:mod:`tracer.compare.deviation`); ``[]`` when a sample lacks the tensor."""
    if not entries or any(e is None for e in entries):
        return []
    as_moments = [DEVIATION_FIELD in e for e in entries]
    if any(as_moments) and not all(as_moments):
        raise TraceError("some noise samples store this tensor whole and others as moments: use noise samples "
                         "of one reference run", path=readers[as_moments.index(True)].root, step=step,
                         tensor=ref_e["name"])
    stored = [n.load(step, 0, e["key"]) for n, e in zip(readers, entries)]
    if not all(as_moments):
        return stored
    return combined_moments(entries, stored, ref_e, readers[0].root.parent, step)


def compare(reference: str | Path, candidate: str | Path, *, noise: Iterable[str | Path] | None = None,
            steps: Iterable[int] | None = None, false_alarm: float = DEFAULT_FALSE_ALARM,
            progress: bool = False, block_scale: bool = True) -> Comparison:
    """Check ``candidate`` against ``reference`` (trace directories); see the module docstring.

    ``noise``: noise-sample trace directories (default: ``reference/noise/sample_*``).
    ``false_alarm``: the probability, under the thresholds' conservative equal-variance
    model, that a correct candidate has any tensor over its threshold in this comparison
    (each of the ``N`` tensors gets ``false_alarm / N``, Bonferroni). When the noise samples
    restarted every step from the re-synchronised state (:func:`samples_restart`), the tensors
    recorded before each step's optimizer update get thresholds without the few-source cap on
    their degrees of freedom, unless the step makes a top-k choice (:func:`few_sources`,
    :mod:`tracer.compare.thresholds`).
    ``block_scale``: also test the block-scale statistic (:mod:`tracer.compare.blockscale`; where it
    applies, each statistic at half a tensor's false-alarm probability); ``False``: the norm
    statistic alone (less sensitive to a wrongly scaled shard).
    Raises :class:`~tracer.errors.IncomparableRunsError` when the traces are of different
    models or share no step, and :class:`~tracer.errors.TraceError` (naming file, rank,
    step and tensor) for missing ranks and corrupt files. NaN/Inf are findings (status
    ``nonfinite``), never exceptions.
    """
    ref, cand = TraceReader(reference), TraceReader(candidate)
    dirs = list(noise) if noise is not None else noise_dirs(reference)
    noisy_readers = [TraceReader(d) for d in dirs]
    if ref.model_signature != cand.model_signature:
        raise IncomparableRunsError([f"model signature: reference {ref.model_signature!r} ({ref.root}), "
                                     f"candidate {cand.model_signature!r} ({cand.root})"])
    common = sorted(set(ref.steps()) & set(cand.steps()))
    wanted = common if steps is None else [s for s in steps if s in common]
    unmatched = [f"step {s}: only in the {'reference' if s in ref.steps() else 'candidate'}"
                 for s in sorted(set(ref.steps()) ^ set(cand.steps()))]
    if not wanted:
        raise IncomparableRunsError([f"no common step: reference has {ref.steps()}, candidate {cand.steps()}"])
    for n in noisy_readers:
        if n.model_signature != ref.model_signature:
            raise IncomparableRunsError([f"noise sample {n.root} is of model {n.model_signature!r}, "
                                         f"the reference of {ref.model_signature!r}"])
    for s in wanted:
        cand.validate([s])
        ref.validate([s])
    plan = []
    for s in wanted:
        ref_idx, cand_idx = _compared(ref, s), _compared(cand, s)
        noise_idx = [_index_by_key(n, s) if s in n.steps() else {} for n in noisy_readers]
        for k in sorted(set(ref_idx) ^ set(cand_idx)):
            unmatched.append(f"step {s} {k[0]} {k[1]} mb {k[2]}: only in the "
                             f"{'reference' if k in ref_idx else 'candidate'}")
        for k, ents in ref_idx.items():
            if k in cand_idx:
                plan.append((s, k, ents[0], cand_idx[k], [ni.get(k, {}).get(0) for ni in noise_idx]))
    plan.sort(key=lambda p: (p[0], p[2]["index"]))
    per_tensor = false_alarm / max(len(plan), 1)  # Bonferroni: family-wise over the comparison
    restarted = samples_restart(noisy_readers)
    routes = {s: makes_topk_choice(ref, s) for s in wanted} if restarted else {}
    bar = _progress(len(plan), progress)
    rows = []
    changed: dict[tuple[int, str, int, int], ChoiceChange] = {}  # top-k choices that differ, per module call
    for s, k, ref_e, cand_entries, noise_es in plan:
        ref_t = ref.load(s, 0, ref_e["key"])
        noisy = _noise_samples(noisy_readers, noise_es, s, ref_e)
        cap = few_sources(k[0], restarted, routes.get(s, False))
        if cand.manifest(s, next(iter(cand_entries)))["mode"] == "stats":
            rows.append(_check_stats(s, k, ref_e, ref_t, cand_entries, noisy, per_tensor, few_sources=cap))
        else:
            cand_t, notes = _full(cand, s, cand_entries, k[1])
            rows.append(_downstream_of_choices(
                _check_routed(s, k, ref_e, ref_t, cand_t, notes, noisy, per_tensor, cand_entries, changed,
                              block_scale, few_sources=cap),
                ref_e["meta"], changed))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    first = next((r for r in rows if r.status not in ("ok", "unchecked")), None)
    return Comparison(str(reference), str(candidate), cand.run.get("layout", {}), rows, first,
                      localise(rows, first), unmatched, len(noisy_readers), false_alarm)


def assembled_records(trace: str | Path, step: int, phase: str, microbatch: int, prefix: str
                      ) -> dict[str, torch.Tensor]:
    """Full (assembled) tensors of one trace whose name starts with ``prefix``, for one step,
    phase and microbatch (first call of each), e.g. a module's inputs for a re-run."""
    return assembled_phases(trace, step, (phase,), microbatch, prefix)[phase]


def assembled_phases(trace: str | Path, step: int, phases: Iterable[str], microbatch: int = 0, prefix: str = ""
                     ) -> dict[str, dict[str, torch.Tensor]]:
    """:func:`assembled_records` of several phases, the trace's step read and indexed once:
    phase -> name -> full tensor (an empty dict for a phase with no such record)."""
    reader = TraceReader(trace)
    out: dict[str, dict[str, torch.Tensor]] = {ph: {} for ph in phases}
    for (ph, name, mb, call), ents in _index_by_key(reader, step).items():
        if ph in out and mb == microbatch and call == 0 and name.startswith(prefix):
            out[ph][name] = _full(reader, step, ents, name)[0]
    return out


#: phase of the first divergence -> (which rows feed it, verdict when they all agree, verdict
#: otherwise or None)
_UPSTREAM = {
    "fwd": (lambda r, f: r.phase == "fwd" and r.microbatch == f.microbatch
            and r.name.startswith(f.name.split(".output")[0] + ".input"),
            "module {mod} is wrong: its inputs agree with the reference (worst {worst}) but its output does not",
            "the output of {mod} diverges; its inputs diverge too or were not traced"),
    "grad": (lambda r, f: r.phase == "grad_local" and r.name == f.name,
             "the cross-rank reduction of {name}'s gradient is wrong: every rank's contribution agrees with "
             "the reference (worst {worst}) but the reduced gradient does not",
             "the gradient of {name} is already wrong before the reduction"),
    "param": (lambda r, f: r.phase == "grad" and r.name == f.name,
              "the optimizer update of {name} is wrong: its reduced gradient agrees with the reference "
              "(worst {worst})", None),
    "grad_norm": (lambda r, f: r.phase == "grad",
                  "the grad norm is wrong although every reduced gradient agrees with the reference (worst "
                  "{worst}): the norm computation (which shards are counted, over which group) is wrong", None),
}


def localise(rows: list[TensorCheck], first: TensorCheck | None) -> str:
    """Local or propagated? Look at what fed the first divergent tensor (see module doc)."""
    if first is None:
        return ""
    same = [r for r in rows if r.step == first.step]

    def worst(cands: list[TensorCheck]) -> str:
        top = max(cands, key=lambda r: r.ratio if math.isfinite(r.ratio) else 1e300)
        return f"{top.name} at {top.ratio:.2g}x its threshold"

    if first.phase == "cast":
        return ("the model parameters are not the round-to-nearest cast of the optimizer's fp32 main copies "
                f"({first.note or 'the candidate trace names the parameters'}): the copy from main to model "
                "parameters rounds otherwise or copies the wrong range, or something writes to the model "
                "parameters after it; not round-off")
    if first.phase == "options" and first.name == f"optimizer.{STEP_COUNT_OPTION}":
        where = "across ranks" if first.status == "replicas" else "from the reference's"
        return (f"the optimizer's per-parameter step counts (min and max over a rank's parameters) differ {where}"
                f"{f' ({first.note})' if first.note else ''}: a rank restarted its count (a resume that restored "
                "the moments but not the step) or skipped or repeated an update, so its Adam bias correction "
                "differs; not round-off")
    if first.status == "replicas" or "replicas over" in first.note:
        return (f"the copies of {first.name} that the candidate's metadata marks as replicated differ across "
                f"ranks ({first.note}): a reduction over that group is missing, or a rank skipped or "
                "repeated a collective on this tensor")
    upstream = _UPSTREAM.get(first.phase if first.phase != "fwd" or ".output" in first.name else "")
    if upstream is not None:
        feeds, if_ok, otherwise = upstream
        ins = [r for r in same if feeds(r, first)]
        name, mod = first.name, first.name.split(".output")[0]
        if ins and all(r.status == "ok" for r in ins):
            return if_ok.format(name=name, mod=mod or "(root)", worst=worst(ins))
        if otherwise:
            return otherwise.format(name=name, mod=mod or "(root)")
    if first.phase == "options":
        return (f"the optimizer option {first.name.removeprefix('optimizer.')} (min and max over the param "
                "groups) differs from the reference's: a configuration error, not round-off")
    if first.phase == "bwd":
        return (f"the gradient flowing into {first.name.split('.output_grad')[0]} diverges first: the "
                "module that consumes this tensor computes a wrong backward (the forward agreed)")
    return f"{first.name} is the first tensor over its threshold"
