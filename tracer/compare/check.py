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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tracer.compare.coverage import Coverage, mark_unmodelled, verdict as coverage_verdict
from tracer.compare.decisions import TOPK_META, ChoiceChange
from tracer.compare.deviation import DEVIATION_FIELD, SampleMoments, combined_moments
from tracer.compare.judge import TensorCheck, check_routed, check_stats_only, downstream_of_choices
from tracer.compare.localise import localise
from tracer.compare.thresholds import DEFAULT_FALSE_ALARM
from tracer.errors import IncomparableRunsError, TraceError
from tracer.trace.canonical import assemble
from tracer.trace.schema import CARRIED_PHASES, PRE_UPDATE_PHASES, Entry, RecordKey, Status
from tracer.trace.store import TraceReader

__all__ = ["Comparison", "assembled_phases", "assembled_record", "assembled_records", "compare", "few_sources",
           "makes_topk_choice", "noise_dirs", "records_by_key", "samples_restart"]



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
    coverage: Coverage | None = None  # ops without a model (tracer.compare.coverage)

    @property
    def verdict(self) -> str:
        """``DIVERGENT``, ``unverified`` (tensors depend on unmodelled ops) or ``consistent``."""
        return coverage_verdict(self.first, self.coverage)

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
                "coverage": None if self.coverage is None else self.coverage.to_dict(),
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
    return any(TOPK_META in e.meta for rank in reader.ranks(step) for e in reader.entries(step, rank))


def records_by_key(reader: TraceReader, step: int) -> dict[RecordKey, dict[int, Entry]]:
    """key -> {rank: entry} over every present rank of ``step``."""
    out: dict[RecordKey, dict[int, Entry]] = defaultdict(dict)
    for rank in reader.ranks(step):
        for e in reader.entries(step, rank):
            out[e.record_key][rank] = e
    return out


def _compared(reader: TraceReader, step: int) -> dict[RecordKey, dict[int, Entry]]:
    """:func:`records_by_key` without the state recorded for re-synchronisation (not compared:
    module docstring)."""
    return {k: v for k, v in records_by_key(reader, step).items() if k.phase not in CARRIED_PHASES}


def assembled_record(reader: TraceReader, step: int, entries: dict[int, Entry], name: str
                     ) -> tuple[torch.Tensor, list[str]]:
    """The full tensor of one record assembled from every rank's shard, and notes on copies
    marked as replicated that disagree (and on a ``cast`` record's findings)."""
    shards = {r: reader.load(step, r, e.key) for r, e in entries.items()}
    placements = {r: e.placement for r, e in entries.items()}
    try:
        full, report = assemble(shards, placements, name=name)
    except ValueError as exc:
        raise TraceError(f"cannot assemble the candidate's shards: {exc}", path=reader.root, step=step,
                         tensor=name) from exc
    notes = [f"replicas over {d.group} differ: ranks {list(d.reference)} vs {list(d.other)}, "
             f"max |diff| {d.max_abs_diff:.3g}" for d in report.replicas if not d.equal]
    notes += [f"rank {r}: " + _listed(e.meta["differing"])  # a `cast` record's findings
              for r, e in sorted(entries.items()) if e.meta.get("differing")]
    return full, notes


def _listed(differing: list[list], shown: int = 3) -> str:
    """``[[param, differing, checked], ...]`` (a ``cast`` record's meta) as a short phrase."""
    out = ", ".join(f"{p} ({n} of {m} elements)" for p, n, m in differing[:shown])
    return out + (f" and {len(differing) - shown} more" if len(differing) > shown else "")


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="compare", unit="tensor", file=sys.stderr, leave=False)


def _noise_samples(readers: list[TraceReader], entries: list[Entry | None], step: int,
                   ref_e: Entry) -> "list[torch.Tensor] | SampleMoments":
    """One tensor's noise samples: whole tensors, or their moments when the samples were stored
    as moments (:mod:`tracer.compare.deviation`); ``[]`` when a sample lacks the tensor."""
    if not entries or any(e is None for e in entries):
        return []
    as_moments = [DEVIATION_FIELD in e.extra for e in entries]
    if any(as_moments) and not all(as_moments):
        raise TraceError("some noise samples store this tensor whole and others as moments: use noise samples "
                         "of one reference run", path=readers[as_moments.index(True)].root, step=step,
                         tensor=ref_e.name)
    stored = [n.load(step, 0, e.key) for n, e in zip(readers, entries)]
    if not all(as_moments):
        return stored
    return combined_moments(entries, stored, ref_e, readers[0].root.parent, step)


def compare(reference: str | Path, candidate: str | Path, *, noise: Iterable[str | Path] | None = None,
            steps: Iterable[int] | None = None, false_alarm: float = DEFAULT_FALSE_ALARM,
            progress: bool = False, block_scale: bool = True, accept_unmodelled: bool = False) -> Comparison:
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
    ``accept_unmodelled``: tensors recorded after an op without an error model (the noise
    samples' census, :mod:`tracer.compare.coverage`) stay ``ok``; by default they get the status
    ``unmodelled`` and the verdict is ``unverified`` instead of ``consistent``.
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
        noise_idx = [records_by_key(n, s) if s in n.steps() else {} for n in noisy_readers]
        for k in sorted(set(ref_idx) ^ set(cand_idx)):
            unmatched.append(f"step {s} {k}: only in the "
                             f"{'reference' if k in ref_idx else 'candidate'}")
        for k, ents in ref_idx.items():
            if k in cand_idx:
                plan.append((s, k, ents[0], cand_idx[k], [ni.get(k, {}).get(0) for ni in noise_idx]))
    plan.sort(key=lambda p: (p[0], p[2].index))
    per_tensor = false_alarm / max(len(plan), 1)  # Bonferroni: family-wise over the comparison
    restarted = samples_restart(noisy_readers)
    routes = {s: makes_topk_choice(ref, s) for s in wanted} if restarted else {}
    bar = _progress(len(plan), progress)
    rows = []
    changed: dict[tuple[int, str, int, int], ChoiceChange] = {}  # top-k choices that differ, per module call
    for s, k, ref_e, cand_entries, noise_es in plan:
        ref_t = ref.load(s, 0, ref_e.key)
        noisy = _noise_samples(noisy_readers, noise_es, s, ref_e)
        cap = few_sources(k.phase, restarted, routes.get(s, False))
        if cand.manifest(s, next(iter(cand_entries)))["mode"] == "stats":
            rows.append(check_stats_only(s, k, ref_e, ref_t, cand_entries, noisy, per_tensor, few_sources=cap))
        else:
            cand_t, notes = assembled_record(cand, s, cand_entries, k.name)
            rows.append(downstream_of_choices(
                check_routed(s, k, ref_e, ref_t, cand_t, notes, noisy, per_tensor, cand_entries, changed,
                              block_scale, few_sources=cap),
                ref_e.meta, changed))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    coverage = mark_unmodelled(rows, [p[4] for p in plan], noisy_readers, accept_unmodelled)
    first = next((r for r in rows if r.status not in (Status.OK, Status.UNCHECKED, Status.UNMODELLED)), None)
    return Comparison(str(reference), str(candidate), cand.run.get("layout", {}), rows, first,
                      localise(rows, first), unmatched, len(noisy_readers), false_alarm, coverage)


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
    for (ph, name, mb, call), ents in records_by_key(reader, step).items():
        if ph in out and mb == microbatch and call == 0 and name.startswith(prefix):
            out[ph][name] = assembled_record(reader, step, ents, name)[0]
    return out


