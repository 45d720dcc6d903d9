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

**Distributed reference** (docs/distributed-reference.md): the reference may itself be a trusted
multi-rank layout (megatron-core TP=2 as the reference of TP=4) when it carries its own noise
samples, traced by the same multi-rank run (:class:`~tracer.capture.noise_sampler.NoiseSampler` on
every rank: the same world size, ``noise_sample_of`` its run id). Its tensors and its samples'
are assembled from their shards with their placements exactly as the candidate's are, and
their replicated copies must agree bitwise too: a reference whose replicas differ is refused
(:class:`~tracer.errors.ReferenceReplicasError`: a reference that disagrees with itself cannot
vouch for anything), a sample whose replicas differ likewise (:class:`~tracer.errors.NoiseSampleError`:
its ranks were not perturbed alike). The execution order is each record's index on the lowest
rank that holds it: the true order on a reference without pipeline parallelism, where every rank
records every tensor in the same order.

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

import dataclasses
import difflib
import fnmatch
import math
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tracer.compare.coverage import Coverage, mark_unmodelled, verdict as coverage_verdict
from tracer.compare.decisions import TOPK_META, ChoiceChange
from tracer.compare.deviation import DEVIATION_FIELD, SampleMoments, combined_moments
from tracer.compare.elementwise import element_statistic_applies
from tracer.compare.exactness import apply_exactness, kernels_differ
from tracer.compare.judge import TensorCheck, check_routed, check_stats_only, downstream_of_choices
from tracer.compare.localise import localise
from tracer.compare.sign_flips import without_sign_flips
from tracer.compare.thresholds import DEFAULT_FALSE_ALARM
from tracer.errors import (
    EmptyTraceError,
    IncomparableRunsError,
    MissingStepError,
    NoiseSampleError,
    NoNoiseError,
    ReferenceReplicasError,
    SameRunError,
    SwappedTracesError,
    TraceError,
    UnmatchedRecordsError,
)
from tracer.trace.canonical import AssemblyReport, assemble
from tracer.trace.schema import (CARRIED_PHASES, CHECKED_PHASES, PRE_UPDATE_PHASES, SAME_ARITHMETIC_META, Entry, Phase,
                                 RecordKey, Status)
from tracer.trace.store import TraceReader, manifest_path

__all__ = ["Comparison", "assembled_phases", "assembled_record", "assembled_records", "compare", "few_sources",
           "makes_topk_choice", "noise_dirs", "records_by_key", "samples_restart", "shared_start_steps"]



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
    #: wrapper prefixes stripped from record names so that the traces match, per side
    #: (``{"candidate": ["module."]}``); empty when the names matched as they are
    stripped_prefixes: dict[str, list[str]] = field(default_factory=dict)
    #: records left out by ``compare(skip=...)`` (``"step S phase name mb M"``, either side)
    skipped: list[str] = field(default_factory=list)
    #: the reference's layout (its ``run.json``) and world size: more than 1 rank is a
    #: distributed reference (module doc)
    reference_layout: dict[str, Any] = field(default_factory=dict)
    reference_world_size: int = 1
    #: the exactness rule (tracer.compare.exactness): how many records it judged, or why it was not applied
    exactness: str = ""

    @property
    def distributed_reference(self) -> bool:
        """Whether the reference was traced on several ranks (module doc, "Distributed reference")."""
        return self.reference_world_size > 1

    @property
    def verdict(self) -> str:
        """``DIVERGENT``, ``unverified`` (tensors depend on unmodelled ops, or no tensor could be
        judged at all: :attr:`nothing_judged`) or ``consistent``."""
        if self.first is None and self.nothing_judged:
            return "unverified"
        return coverage_verdict(self.first, self.coverage)

    @property
    def nothing_judged(self) -> bool:
        """No compared tensor was found within its threshold (every one unchecked: no noise sample
        traced it, or a top-k choice changed upstream): "consistent" would vouch for nothing."""
        return not any(r.status == Status.OK for r in self.rows)

    @property
    def max_ratio_ok(self) -> float:
        """Largest error/threshold among the tensors within threshold (the safety margin)."""
        return max((r.ratio for r in self.rows if r.status == Status.OK and math.isfinite(r.ratio)), default=0.0)

    def counts(self) -> dict[str, int]:
        """Tensors per status, keyed by the status's name (``"ok"``, ``"over"``, ...)."""
        c: dict[str, int] = defaultdict(int)
        for r in self.rows:
            c[str(r.status)] += 1
        return dict(c)

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "reference": self.reference, "candidate": self.candidate,
                "candidate_layout": self.candidate_layout, "distributed_reference": self.distributed_reference,
                "reference_layout": self.reference_layout, "reference_world_size": self.reference_world_size,
                "counts": self.counts(),
                "max_ratio_within_threshold": self.max_ratio_ok, "noise_samples": self.noise_samples,
                "false_alarm_per_comparison": self.false_alarm,
                "first_divergence": None if self.first is None else asdict(self.first),
                "localisation": self.localisation, "unmatched": self.unmatched,
                "stripped_prefixes": self.stripped_prefixes, "skipped": self.skipped, "exactness": self.exactness,
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


def shared_start_steps(ref: TraceReader, cand: TraceReader, noise: list[TraceReader], steps: Iterable[int],
                       restarted: bool) -> set[int]:
    """The compared steps that the candidate and every noise sample began from the reference's
    parameters: every step when the samples restart from the re-synchronised state
    (:func:`samples_restart`; the candidate is the state they restart from), else the first step
    of the comparison when it is the first step of every trace (differential testing starts both
    runs from one state; before any update no Adam sign flip separates them)."""
    steps = sorted(steps)
    if restarted or not steps:
        return set(steps)
    first = steps[0]
    return {first} if all(r.steps() and min(r.steps()) == first for r in (ref, cand, *noise)) else set()


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


def _assembled(reader: TraceReader, step: int, entries: dict[int, Entry], name: str, side: str = "candidate"
               ) -> tuple[torch.Tensor, AssemblyReport]:
    """The full tensor of one record of ``side`` from every rank's shard, and the assembly's report."""
    shards = {r: reader.load(step, r, e.key) for r, e in entries.items()}
    placements = {r: e.placement for r, e in entries.items()}
    try:
        return assemble(shards, placements, name=name)
    except ValueError as exc:
        raise TraceError(f"cannot assemble the {side}'s shards: {exc}", path=reader.root, step=step,
                         tensor=name) from exc


def _replica_notes(report: AssemblyReport) -> list[str]:
    """One note per group of copies marked as replicated that disagree."""
    return [f"replicas over {d.group} differ: ranks {list(d.reference)} vs {list(d.other)}, "
            f"max |diff| {d.max_abs_diff:.3g}" for d in report.replicas if not d.equal]


def assembled_record(reader: TraceReader, step: int, entries: dict[int, Entry], name: str
                     ) -> tuple[torch.Tensor, list[str]]:
    """The full tensor of one record assembled from every rank's shard, and notes on copies
    marked as replicated that disagree (and on a ``cast`` record's findings)."""
    full, report = _assembled(reader, step, entries, name)
    notes = _replica_notes(report)
    notes += [f"rank {r}: " + _listed(e.meta["differing"])  # a `cast` record's findings
              for r, e in sorted(entries.items()) if e.meta.get("differing")]
    return full, notes


def _listed(differing: list[list], shown: int = 3) -> str:
    """``[[param, differing, checked], ...]`` (a ``cast`` record's meta) as a short phrase."""
    out = ", ".join(f"{p} ({n} of {m} elements)" for p, n, m in differing[:shown])
    return out + (f" and {len(differing) - shown} more" if len(differing) > shown else "")


def _reference_record(ref: TraceReader, step: int, entries: dict[int, Entry]) -> tuple[torch.Tensor, Entry]:
    """One record of the reference: its tensor and the entry that describes it. A single-device
    reference's as stored; a distributed reference's assembled from its shards (module doc), its
    replicas bitwise equal or the comparison refused (:class:`~tracer.errors.ReferenceReplicasError`),
    described by the lowest rank's entry with the full shape and no statistics (a shard's
    statistics are not the tensor's)."""
    first = entries[min(entries)]
    if ref.world_size == 1:
        return ref.load(step, min(entries), first.key), first
    full, report = _assembled(ref, step, entries, first.name, "reference")
    bad = _replica_notes(report)
    if bad:
        raise ReferenceReplicasError(
            f"the distributed reference {str(ref.root)!r} disagrees with itself: its copies of tensor "
            f"'{first.name}' ({first.phase}, mb {first.microbatch}) at step {step}, marked replicated by its "
            f"placements, differ ({'; '.join(bad)}): a reference whose replicas differ computes the same thing "
            "differently on its ranks (a bug of the reference layout, or ranks not started alike), so no verdict "
            "against it means anything; check the reference layout against a single device at small scale "
            "(docs/distributed-reference.md) or use another reference", path=ref.root, step=step, tensor=first.name)
    return full, dataclasses.replace(first, shape=tuple(full.shape), stats=None)


def _sample_tensor(n: TraceReader, step: int, entries: dict[int, Entry], name: str) -> torch.Tensor:
    """One record of one noise sample: as stored (one rank), or assembled from the shards of a
    distributed reference's sample, whose replicated copies must agree bitwise
    (:class:`~tracer.errors.NoiseSampleError` otherwise: its ranks were not perturbed alike)."""
    if n.world_size == 1:
        return n.load(step, min(entries), entries[min(entries)].key)
    if any(DEVIATION_FIELD in e.extra for e in entries.values()):
        raise NoiseSampleError(f"noise sample {str(n.root)!r} of a distributed reference stores tensor '{name}' as "
                               "moments of each shard's deviation, which cannot be assembled into the full tensor's "
                               "(tracer.capture.noise_sampler, 'Distributed reference'): re-record the samples "
                               "whole (NoiseSampler(store='tensors'))", path=n.root, step=step, tensor=name)
    full, report = _assembled(n, step, entries, name, "noise sample")
    bad = _replica_notes(report)
    if bad:
        raise NoiseSampleError(f"noise sample {str(n.root)!r} of a distributed reference holds copies of tensor "
                               f"'{name}' at step {step} that its placements mark replicated and that differ "
                               f"({'; '.join(bad)}): its ranks did not perturb the replicated computation alike "
                               "(the injector seeded per rank, or ranks out of lockstep), so its spread is not a "
                               "legitimate one; re-record the samples with one NoiseSampler seed on every rank",
                               path=n.root, step=step, tensor=name)
    return full


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="compare", unit="tensor", file=sys.stderr, leave=False)


def _noise_samples(readers: list[TraceReader], by_rank: list[dict[int, Entry] | None], step: int,
                   ref_e: Entry, ref_t: torch.Tensor | None = None) -> "list[torch.Tensor] | SampleMoments":
    """One tensor's noise samples (``by_rank``: per sample, its entries by rank): whole tensors
    (assembled from a distributed reference's shards, :func:`_sample_tensor`), or their moments
    when the samples were stored as moments (:mod:`tracer.compare.deviation`); ``[]`` when a sample
    lacks the tensor. With ``ref_t`` (the clean reference's tensor), a sample with NaN/Inf where
    it has none is refused (:class:`~tracer.errors.NoiseSampleError`)."""
    if not by_rank or any(not d for d in by_rank):
        return []
    if any(n.world_size > 1 for n in readers):
        stored = [_sample_tensor(n, step, d, ref_e.name) for n, d in zip(readers, by_rank)]
        if ref_t is not None:  # a shard's statistics are not the tensor's: judged by the values
            _refuse_nonfinite_noise(readers, [dataclasses.replace(d[min(d)], stats=None) for d in by_rank],
                                    stored, step, ref_e, ref_t)
        return stored
    entries = [d[min(d)] for d in by_rank]
    as_moments = [DEVIATION_FIELD in e.extra for e in entries]
    if any(as_moments) and not all(as_moments):
        raise TraceError("some noise samples store this tensor whole and others as moments: use noise samples "
                         "of one reference run", path=readers[as_moments.index(True)].root, step=step,
                         tensor=ref_e.name)
    stored = [n.load(step, min(d), e.key) for n, d, e in zip(readers, by_rank, entries)]
    if ref_t is not None:
        _refuse_nonfinite_noise(readers, entries, stored, step, ref_e, ref_t)
    if not all(as_moments):
        return stored
    return combined_moments(entries, stored, ref_e, readers[0].root.parent, step)


#: wrapper segments a framework inserts into module names (torch.compile, FSDP, activation
#: checkpointing), stripped anywhere in a name; ``module`` (DDP, DataParallel) only at its start
WRAPPER_SEGMENTS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
LEADING_WRAPPERS = ("module",) + WRAPPER_SEGMENTS


def strip_wrappers(name: str) -> tuple[str, tuple[str, ...]]:
    """``name`` without the wrappers' segments (:data:`WRAPPER_SEGMENTS`, and ``module`` leading it)
    and the prefixes removed (``"module."``, ...), e.g. ``module.layers.0._checkpoint_wrapped_module.attn``
    -> ``layers.0.attn``, ``("module.", "_checkpoint_wrapped_module.")``."""
    parts = name.split(".")
    kept: list[str] = []
    removed: list[str] = []
    leading = True
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if not last and ((leading and part in LEADING_WRAPPERS) or part in WRAPPER_SEGMENTS):
            removed.append(part + ".")
            continue
        leading = False
        kept.append(part)
    return ".".join(kept), tuple(dict.fromkeys(removed))


def _skipped(key: RecordKey, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(f"{key.phase} {key.name}", p) or fnmatch.fnmatchcase(key.name, p)
               for p in patterns)


def _renamed(index: dict[RecordKey, dict[int, Entry]]) -> tuple[dict[RecordKey, RecordKey], set[str]] | None:
    """key -> key with its name's wrappers stripped, and the prefixes removed; None when stripping
    makes two records one."""
    out, removed = {}, set()
    for k in index:
        name, gone = strip_wrappers(k.name)
        out[k] = k._replace(name=name)
        removed.update(gone)
    return (out, removed) if len(set(out.values())) == len(out) else None


def _match(ref_idx: dict[RecordKey, dict[int, Entry]], cand_idx: dict[RecordKey, dict[int, Entry]]
           ) -> tuple[dict[RecordKey, dict[int, Entry]], dict[RecordKey, dict[int, Entry]], dict[str, set[str]]]:
    """The two sides' records keyed alike: as they are when the checked ones match, else with the
    wrappers' segments stripped from both sides' names where that makes them match (the prefixes
    removed, per side, in the third value); as they are when stripping does not help."""
    checked = lambda idx: {k for k in idx if k.phase in CHECKED_PHASES}
    if checked(ref_idx) == checked(cand_idx):
        return ref_idx, cand_idx, {}
    rr, cr = _renamed(ref_idx), _renamed(cand_idx)
    if rr is None or cr is None:
        return ref_idx, cand_idx, {}
    ref2 = {rr[0][k]: v for k, v in ref_idx.items()}
    cand2 = {cr[0][k]: v for k, v in cand_idx.items()}
    if checked(ref2) != checked(cand2):
        return ref_idx, cand_idx, {}
    removed = {side: prefixes for side, prefixes in (("reference", rr[1]), ("candidate", cr[1])) if prefixes}
    return ref2, cand2, removed


def _unmatched_error(reference: str | Path, candidate: str | Path, step: int, only_ref: list[RecordKey],
                     only_cand: list[RecordKey], ref_keys: Iterable[RecordKey], cand_keys: Iterable[RecordKey]
                     ) -> UnmatchedRecordsError:
    """The one-paragraph refusal of records of a checked phase that one trace lacks."""
    ref_names = sorted({k.name for k in ref_keys})
    cand_names = sorted({k.name for k in cand_keys})
    shown = lambda ks: ", ".join(f"'{k}'" for k in ks[:3]) + (f" and {len(ks) - 3} more" if len(ks) > 3 else "")
    parts = [f"reference {str(reference)!r} and candidate {str(candidate)!r} do not trace the same tensors at "
             f"step {step}, even with the known wrapper prefixes ({', '.join(p + '.' for p in LEADING_WRAPPERS)}) "
             "stripped:"]
    if only_ref:
        parts.append(f"{len(only_ref)} records only in the reference ({shown(only_ref)})")
    if only_cand:
        parts.append(f"{len(only_cand)} only in the candidate ({shown(only_cand)})")
    close = []
    for k, pool in [(k, cand_names) for k in only_ref[:2]] + [(k, ref_names) for k in only_cand[:2]]:
        near = difflib.get_close_matches(k.name, pool, n=2, cutoff=0.5)
        side = "the candidate" if pool is cand_names else "the reference"
        close.append(f"'{k.name}' ~ {', '.join(repr(n) for n in near)} in {side}" if near else
                     f"'{k.name}' has no close name in {side}")
    msg = "; ".join(parts[1:])
    return UnmatchedRecordsError(
        f"{parts[0]} {msg}; closest names: {'; '.join(close)}. A verdict over the records both traced would "
        "hide the rest: trace the same modules and phases in both runs (the same model, the same integration "
        "and capture options, the module names as the reference has them), or, if leaving those records out "
        "is intended, name them with compare(skip=[...]) (fnmatch patterns over 'phase name' or the name).",
        path=candidate, step=step)


def _same_run(a: TraceReader, b: TraceReader) -> str | None:
    """How two traces are one run: "directory" (the same one), "run id" (a copy), or None."""
    if a.root.resolve() == b.root.resolve():
        return "directory"
    return "run id" if a.run_id and a.run_id == b.run_id else None


def _refuse_swapped_or_same(ref: TraceReader, cand: TraceReader, noisy: list[TraceReader]) -> None:
    """The refusals that need no record: swapped traces, the candidate or a noise sample being the
    reference itself (same directory or run id), no noise samples."""
    same = _same_run(ref, cand)
    if same:
        how = "are the same directory" if same == "directory" else \
            f"are of the same run (run id {ref.run_id!r}; a copy of one trace?)"
        raise SameRunError(f"reference {str(ref.root)!r} and candidate {str(cand.root)!r} {how}: comparing a run "
                           "with itself says nothing; give the reference (the single-device run with noise samples) "
                           "first, then the candidate traced by the run under test", path=cand.root)
    if ref.world_size > 1:
        problem = _distributed_reference_problem(ref, noisy)
        if problem:
            raise SwappedTracesError(
                f"reference {str(ref.root)!r} was traced on {ref.world_size} ranks and {problem}: a reference is "
                "either the single-device run with noise samples, or a distributed reference, a trusted multi-rank "
                "layout that carries noise samples traced by that same run (NoiseSampler on every rank: the same "
                "world size, meta noise_sample_of its run id; docs/distributed-reference.md); is this the "
                f"candidate (reference and candidate swapped)? the candidate {str(cand.root)!r} has "
                f"{cand.world_size} rank(s)", path=ref.root)
    if not noisy:
        has = bool(noise_dirs(cand.root))
        raise NoNoiseError(f"reference {str(ref.root)!r} has no noise samples (no noise/sample_*/run.json, and "
                           "none given with noise=): without them every threshold would be meaningless; record "
                           "them with the reference (tracer.capture.noise_sampler.NoiseSampler) or pass their "
                           "directories as noise=" + (" (the candidate has noise samples: reference and "
                                                      "candidate swapped?)" if has else ""), path=ref.root)
    for n in noisy:
        for what, other in (("the reference", ref), ("the candidate", cand)):
            same = _same_run(n, other)
            if same:
                how = "is" if same == "directory" else f"has the run id {n.run_id!r} of"
                raise SameRunError(f"noise sample {str(n.root)!r} {how} {what} ({str(other.root)!r}), not a noise "
                                   "sample: a sample is a separate perturbed run of the reference, "
                                   "reference/noise/sample_K; pass those (or leave noise= out)", path=n.root)
        if n.world_size != ref.world_size:
            what = ("a noise sample is a single-device run of the reference (reference/noise/sample_K)"
                    if ref.world_size == 1 else f"a noise sample of a distributed reference is traced by the same "
                    f"run, on its {ref.world_size} ranks (reference/noise/sample_K)")
            raise SameRunError(f"noise sample {str(n.root)!r} was traced on {n.world_size} ranks; {what}",
                               path=n.root)
        of = (n.run.get("meta") or {}).get("noise_sample_of")
        if of and ref.run_id and of != ref.run_id:
            raise NoiseSampleError(f"noise sample {str(n.root)!r} perturbs the reference run {of!r}, not this "
                                   f"reference ({str(ref.root)!r}, run id {ref.run_id!r}): its thresholds describe "
                                   "another run; use the noise samples traced with this reference", path=n.root)


def _distributed_reference_problem(ref: TraceReader, noisy: list[TraceReader]) -> str | None:
    """Why a multi-rank reference is not a distributed reference (module doc), or None: it has
    noise samples, each traced by the same run (same world size, ``noise_sample_of`` its run id)."""
    if not noisy:
        return "has no noise samples"
    for n in noisy:
        of = (n.run.get("meta") or {}).get("noise_sample_of")
        if n.world_size != ref.world_size:
            return f"its noise sample {str(n.root)!r} was traced on {n.world_size} rank(s)"
        if not ref.run_id or of != ref.run_id:
            return (f"its noise sample {str(n.root)!r} does not name it as the run it perturbs (noise_sample_of "
                    f"{of!r}, the reference's run id {ref.run_id!r})")
    return None


def _nonfinite_count(e: Entry) -> int | None:
    """NaN + Inf values of a stored record by its manifest statistics (taken by the writer of what it
    stored, which the checksum vouches for), None when it has none."""
    st = e.stats
    if not st or "nan_count" not in st or "inf_count" not in st:
        return None
    return int(st["nan_count"] or 0) + int(st["inf_count"] or 0)


def _refuse_nonfinite_noise(readers: list[TraceReader], entries: list[Entry], stored: list[torch.Tensor],
                            step: int, ref_e: Entry, ref_t: torch.Tensor) -> None:
    """A noise sample with NaN/Inf where the clean reference has none (its manifest statistics,
    or the stored sample or moments) would make the threshold meaningless: refused."""
    ref_bad = _nonfinite_count(ref_e)
    floating = ref_t.is_floating_point()
    ref_finite = ref_bad == 0 if ref_bad is not None else (bool(torch.isfinite(ref_t).all()) if floating else True)
    for n, e, t in zip(readers, entries, stored):
        st = e.stats or {}
        bad = _nonfinite_count(e)
        found = ref_finite and bool(bad)
        if bad is None and not found and t.is_floating_point():  # no statistics to go by: the values
            if DEVIATION_FIELD in e.extra:  # moments: finite wherever the reference is
                found = ref_finite and not bool(torch.isfinite(t).all())
            elif t.shape == ref_t.shape and floating:
                found = bool((~torch.isfinite(t) & torch.isfinite(ref_t)).any())
        if found:
            raise NoiseSampleError(
                f"noise sample {str(n.root)!r} holds NaN/Inf in tensor '{ref_e.name}' ({ref_e.phase}, mb "
                f"{ref_e.microbatch}) at step {step} (its manifest: {st.get('nan_count', '?')} NaN, "
                f"{st.get('inf_count', '?')} Inf) where the clean reference has none: a threshold from it would "
                "be meaningless (one corrupted value can raise a threshold by orders of magnitude and hide a "
                "bug); re-record that noise sample or leave it out of noise=",
                path=manifest_path(n.root, step, 0), step=step, tensor=ref_e.name)


def compare(reference: str | Path, candidate: str | Path, *, noise: Iterable[str | Path] | None = None,
            steps: Iterable[int] | None = None, false_alarm: float = DEFAULT_FALSE_ALARM,
            progress: bool = False, block_scale: bool = True, accept_unmodelled: bool = False,
            skip: Iterable[str] | None = None, elementwise: bool = True, exact_unchanged: bool = True) -> Comparison:
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
    ``elementwise``: also test the element statistic (:mod:`tracer.compare.elementwise`) on the
    tensors where it applies: recorded before the optimizer update of a step that every run
    began from the reference's parameters (:func:`shared_start_steps`), without a top-k choice, with
    noise samples that carry its summaries; it sees a few wrong elements that the norm statistics average
    away. Each statistic tested on a tensor gets an equal share of its false-alarm probability.
    ``exact_unchanged``: a forward output of a module that the candidate's adapter marks as
    computed as in the reference, whose inputs matched bitwise in such a step, must match bitwise
    (:mod:`tracer.compare.exactness`; it assumes both runs use the same deterministic kernels: turn
    it off for a reference on other hardware).
    ``accept_unmodelled``: tensors recorded after an op without an error model (the noise
    samples' census, :mod:`tracer.compare.coverage`) stay ``ok``; by default they get the status
    ``unmodelled`` and the verdict is ``unverified`` instead of ``consistent``.
    ``skip``: fnmatch patterns over ``"phase name"`` or a record's name (e.g. ``"fwd *.dropout.*"``,
    ``"grad_norm *"``): those records are left out on both sides (listed in ``skipped``).

    Fails closed: raises a :class:`~tracer.errors.RefusedComparisonError` (one paragraph naming the
    files, what was found and what to do) rather than report a verdict over less than asked for:
    a record of a checked phase (:data:`~tracer.trace.schema.CHECKED_PHASES`) in one trace only,
    after the wrapper prefixes (``module.``, ``_orig_mod.``, ``_fsdp_wrapped_module.``,
    ``_checkpoint_wrapped_module.``) are stripped (which ones were is in ``stripped_prefixes``) and
    ``skip`` applied (:class:`~tracer.errors.UnmatchedRecordsError`); a requested step missing on a
    side (:class:`~tracer.errors.MissingStepError`); a candidate without tensors
    (:class:`~tracer.errors.EmptyTraceError`); no noise samples (:class:`~tracer.errors.NoNoiseError`);
    a multi-rank reference without noise samples of its own run and world size (a distributed
    reference carries them: module doc; :class:`~tracer.errors.SwappedTracesError`), or one whose
    replicated copies differ (:class:`~tracer.errors.ReferenceReplicasError`); the candidate or a noise
    sample being the reference (same directory or run id, :class:`~tracer.errors.SameRunError`);
    a noise sample with NaN/Inf where the reference has none (:class:`~tracer.errors.NoiseSampleError`).
    Raises :class:`~tracer.errors.IncomparableRunsError` when the traces are of different
    models or share no step, and :class:`~tracer.errors.TraceError` (naming file, rank,
    step and tensor) for missing ranks and corrupt files (a checksum mismatch:
    :class:`~tracer.errors.CorruptTraceError`). NaN/Inf in the candidate are findings (status
    ``nonfinite``), never exceptions.
    """
    ref, cand = TraceReader(reference), TraceReader(candidate)
    dirs = list(noise) if noise is not None else noise_dirs(reference)
    noisy_readers = [TraceReader(d) for d in dirs]
    patterns = [str(p) for p in (skip or ())]
    if ref.model_signature != cand.model_signature:
        raise IncomparableRunsError([f"model signature: reference {ref.model_signature!r} ({ref.root}), "
                                     f"candidate {cand.model_signature!r} ({cand.root})"])
    _refuse_swapped_or_same(ref, cand, noisy_readers)
    common = sorted(set(ref.steps()) & set(cand.steps()))
    if steps is None:
        wanted = common
    else:
        wanted = sorted(set(int(s) for s in steps))
        missing = [s for s in wanted if s not in common]
        if missing:
            raise MissingStepError(f"step(s) {missing} requested but not traced by both: reference "
                                   f"{str(ref.root)!r} has steps {ref.steps()}, candidate {str(cand.root)!r} has "
                                   f"steps {cand.steps()}; ask for steps both traced (common: {common}) or "
                                   "re-trace the missing ones", path=cand.root)
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
    if not any(cand.entries(s, r) for s in wanted for r in cand.ranks(s)):
        raise EmptyTraceError(f"candidate {str(cand.root)!r} holds no tensors at step(s) {wanted} (its manifests "
                              "list no entry): 'consistent' would mean nothing; check that the candidate's "
                              "integration traced (hooks attached, steps flushed) before comparing", path=cand.root)
    plan = []
    indexes: dict[int, tuple[dict, dict]] = {}  # step -> (reference, candidate) records by key, matched
    stripped: dict[str, set[str]] = {}
    skipped: list[str] = []
    for s in wanted:
        ref_idx, cand_idx = _compared(ref, s), _compared(cand, s)
        noise_idx = [records_by_key(n, s) if s in n.steps() else {} for n in noisy_readers]
        if patterns:
            for idx in (ref_idx, cand_idx):
                for k in [k for k in idx if _skipped(k, patterns)]:
                    skipped.append(f"step {s} {k} ({'reference' if idx is ref_idx else 'candidate'})")
                    del idx[k]
        ref_idx, cand_idx, removed = _match(ref_idx, cand_idx)
        if removed:  # both sides' names were stripped: the noise samples', named as the reference's, too
            noise_idx = [{ren[0][k]: v for k, v in ni.items()} if (ren := _renamed(ni)) else ni for ni in noise_idx]
        for side, prefixes in removed.items():
            stripped.setdefault(side, set()).update(prefixes)
        only_ref = sorted(k for k in set(ref_idx) - set(cand_idx) if k.phase in CHECKED_PHASES)
        only_cand = sorted(k for k in set(cand_idx) - set(ref_idx) if k.phase in CHECKED_PHASES)
        if only_ref or only_cand:
            raise _unmatched_error(reference, candidate, s, only_ref, only_cand, ref_idx, cand_idx)
        for k in sorted(set(ref_idx) ^ set(cand_idx)):
            unmatched.append(f"step {s} {k}: only in the "
                             f"{'reference' if k in ref_idx else 'candidate'}")
        indexes[s] = (ref_idx, cand_idx)
        for k, ents in ref_idx.items():
            if k in cand_idx:
                plan.append((s, k, ents, cand_idx[k], [ni.get(k) for ni in noise_idx]))
    if not plan:
        raise EmptyTraceError(f"nothing to compare between reference {str(ref.root)!r} and candidate "
                              f"{str(cand.root)!r} at step(s) {wanted}"
                              + (f" once skip={patterns} left out {len(skipped)} records" if skipped else "")
                              + ": 'consistent' would mean nothing", path=cand.root)
    plan.sort(key=lambda p: (p[0], p[2][min(p[2])].index))  # a distributed reference: module doc
    per_tensor = false_alarm / max(len(plan), 1)  # Bonferroni: family-wise over the comparison
    restarted = samples_restart(noisy_readers)
    shared = shared_start_steps(ref, cand, noisy_readers, wanted, restarted)
    # top-k choices matter where a step's records get the few-source exception or the element statistic
    routes = {s: makes_topk_choice(ref, s) for s in (wanted if restarted else shared)}
    same_arithmetic: set[tuple[int, str, int, int]] = set()
    bar = _progress(len(plan), progress)
    rows = []
    changed: dict[tuple[int, str, int, int], ChoiceChange] = {}  # top-k choices that differ, per module call
    for s, k, ref_ents, cand_entries, noise_es in plan:
        ref_t, ref_e = _reference_record(ref, s, ref_ents)
        noisy = _noise_samples(noisy_readers, noise_es, s, ref_e, ref_t)
        cap = few_sources(k.phase, restarted, routes.get(s, False))
        elements = elementwise and element_statistic_applies(k.phase, s in shared, routes.get(s, False))
        if all(e.meta.get(SAME_ARITHMETIC_META) is True for e in cand_entries.values()):
            same_arithmetic.add((s, k.name, k.microbatch, k.call))
        if cand.manifest(s, next(iter(cand_entries)))["mode"] == "stats":
            rows.append(check_stats_only(s, k, ref_e, ref_t, cand_entries, noisy, per_tensor, few_sources=cap))
        else:
            cand_t, notes = assembled_record(cand, s, cand_entries, k.name)

            def judge(c: torch.Tensor) -> TensorCheck:  # called in this iteration only
                return check_routed(s, k, ref_e, ref_t, c, notes, noisy, per_tensor, cand_entries, changed,
                                    block_scale, few_sources=cap, elementwise=elements)
            row = downstream_of_choices(judge(cand_t), ref_e.meta, changed)
            rows.append(without_sign_flips(row, ref_t, cand_t, lambda: _gradients(ref, cand, s, k.name, indexes[s]),
                                           judge))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    why_not = kernels_differ(ref.run, cand.run) if exact_unchanged else "turned off (exact_unchanged=False)"
    exactness = (f"not applied: {why_not}" if why_not else
                 f"{apply_exactness(rows, same_arithmetic, shared)} forward outputs required to match bitwise")
    coverage = mark_unmodelled(rows, [[e for d in p[4] for e in (d or {}).values()] for p in plan], noisy_readers,
                               accept_unmodelled)
    first = next((r for r in rows if r.status not in (Status.OK, Status.UNCHECKED, Status.UNMODELLED)), None)
    return Comparison(str(reference), str(candidate), cand.run.get("layout", {}), rows, first,
                      localise(rows, first), unmatched, len(noisy_readers), false_alarm, coverage,
                      {side: sorted(p) for side, p in stripped.items()}, skipped, ref.run.get("layout", {}),
                      ref.world_size, exactness)


def _gradients(ref: TraceReader, cand: TraceReader, step: int, name: str, index: tuple[dict, dict]
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The reference's and the candidate's ``grad`` record of parameter ``name`` at ``step``
    (:mod:`tracer.compare.sign_flips`), None where either did not trace it."""
    key = RecordKey(Phase.GRAD, name, 0, 0)
    ref_idx, cand_idx = index
    if key not in ref_idx or key not in cand_idx:
        return None
    return _reference_record(ref, step, ref_idx[key])[0], assembled_record(cand, step, cand_idx[key], name)[0]


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


