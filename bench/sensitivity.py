"""Sensitivity against peers: the smallest corruption each method flags, on the same tensors.

    python -m bench.sensitivity [--out out/sensitivity] [--dtypes bf16,fp32] [--write docs/sensitivity.md]

1. Traces (once, cached under ``--out/<dtype>``): the demo's megatron-core GPT, a
   single-device reference with noise samples and one clean candidate (TP=2 + SP + PP=2 with
   the distributed optimizer, 4 gloo ranks), made by :func:`examples.megatron_cpu.demo.trace_runs`.
2. The clean candidate is compared once with :func:`tracer.compare.check.compare`: the number of
   compared tensors fixes our per-tensor false-alarm rate (Bonferroni), exactly as in a
   real comparison.
3. For each target tensor (:data:`TARGETS`: 5 parameter gradients, phase ``grad``, and 5
   activations, phase ``fwd``, across layers, steps and microbatches) the shard that the
   candidate's lowest rank holding it wrote (TP rank 0 of its pipeline stage) is multiplied
   by ``1 + delta`` (in float64, cast back to the stored dtype), the shards are assembled
   exactly as :func:`tracer.compare.check.compare` does, and each method (:data:`METHODS`) is asked
   whether it flags the tensor. The smallest flagged ``delta`` in ``[1e-8, 1]`` is found by
   bisection on a log scale (:func:`smallest_delta`). A method that flags the uncorrupted
   tensor is a false positive (``FP``).

The methods (see :func:`peer_flags`):

* ``ours``: the tensor's verdict from :func:`tracer.compare.judge.check_tensor` (error
  ``||cand - ref||_2`` over the noise-sample threshold), with the per-tensor false-alarm
  rate of the whole clean comparison;
* ``assert_close``: :func:`torch.testing.assert_close` with its defaults for the stored dtype
  (bf16: rtol 1.6e-2, atol 1e-5; fp32: rtol 1.3e-6, atol 1e-5) on the full tensors;
* ``cosine``: flagged when the cosine similarity of the full tensors is < 0.99;
* ``max_abs``: flagged when ``max |cand - ref| > 1e-3``;
* ``depth``: Megatron-LM's gradient comparison rule (Theorem 5.3 of arXiv 2506.09280),
  flagged when ``||cand - ref||_2 / ||ref||_2 > k C^(L+1-l) eps`` with ``k = 4``,
  ``C = 1.03``, ``L`` the number of layers, ``l`` the 1-based layer index
  (:func:`layer_index`) and ``eps`` the machine epsilon of the run's compute dtype (bf16 for
  a bf16 run even where the traced tensor is stored in fp32, as Megatron-LM uses the
  training precision's eps);
* ``depth_k0``: the same rule with ``k`` raised to ``k0``, the smallest ``k`` for which it flags no
  tensor of the target's phase in the whole clean comparison (:func:`clean_census`): the
  depth rule made free of false positives on this run, a calibration no user of the rule
  would have without a clean reference run of their own.
"""
from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tracer.trace.schema import Entry, RecordKey

__all__ = [
    "METHODS",
    "TARGETS",
    "Target",
    "ceiling_table",
    "coherent_scale",
    "corrupt_shard",
    "depth_bound",
    "flag_assert_close",
    "flag_cosine",
    "flag_depth",
    "flag_max_abs",
    "layer_index",
    "main",
    "measure",
    "peer_flags",
    "smallest_delta",
]

METHODS = ("ours", "assert_close", "cosine", "max_abs", "depth", "depth_k0", "ours_norm")
PEERS = METHODS[1:]
FIXED_PEERS = PEERS[:4]   # the peers as published; depth_k0 is the depth rule with k set to zero FP,
                          # ours_norm ours without the block-scale statistic (compare(block_scale=False))
DELTA_LO, DELTA_HI = 1e-8, 1.0
COS_MIN, MAX_ABS = 0.99, 1e-3
DEPTH_K, DEPTH_C = 4.0, 1.03
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


@dataclass(frozen=True)
class Target:
    """One traced tensor of the candidate to corrupt."""

    step: int
    phase: str
    name: str
    microbatch: int = 0
    call: int = 0

    @property
    def kind(self) -> str:
        return "grad" if self.phase == "grad" else "activation"


#: 5 weight gradients (after the reduction, phase ``grad``) and 5 forward activations,
#: across both layers, all steps and several microbatches of the demo model.
TARGETS: tuple[Target, ...] = (
    Target(0, "grad", "decoder.layers.0.mlp.linear_fc1.weight"),
    Target(1, "grad", "decoder.layers.1.mlp.linear_fc1.weight"),
    Target(2, "grad", "decoder.layers.0.self_attention.linear_qkv.weight"),
    Target(0, "grad", "decoder.layers.1.self_attention.linear_proj.weight"),
    Target(1, "grad", "decoder.layers.0.mlp.linear_fc2.weight"),
    Target(0, "fwd", "decoder.layers.0.mlp.linear_fc1.output.0", 0),
    Target(1, "fwd", "decoder.layers.1.mlp.linear_fc1.output.0", 1),
    Target(2, "fwd", "decoder.layers.0.self_attention.linear_qkv.output.0", 2),
    Target(0, "fwd", "decoder.layers.1.self_attention.core_attention.output", 3),
    Target(1, "fwd", "decoder.layers.0.mlp.linear_fc2.output.0", 0),
)


# ----------------------------------------------------------------------------- rules
def smallest_delta(flags: Callable[[float], bool], lo: float = DELTA_LO, hi: float = DELTA_HI,
                   rel_tol: float = 0.01) -> float:
    """Smallest ``delta`` in ``[lo, hi]`` with ``flags(delta)``, by bisection on ``log(delta)``.

    Assumes ``flags`` is monotone (never flagged below some delta, always above). Returns
    ``lo`` when ``flags(lo)`` already holds (the true value is ``<= lo``), ``inf`` when
    ``flags(hi)`` does not, else a flagged delta within a factor ``1 + rel_tol`` above the
    smallest one.
    """
    if flags(lo):
        return lo
    if not flags(hi):
        return math.inf
    while hi / lo > 1.0 + rel_tol:
        mid = math.sqrt(lo * hi)
        if flags(mid):
            hi = mid
        else:
            lo = mid
    return hi


def coherent_scale(cand: torch.Tensor, ref: torch.Tensor, region: torch.Tensor) -> float:
    r"""The least-squares scale of ``cand`` against ``ref`` on ``region`` (a boolean mask), less one:
    ``a = <c - r, r>_S / <r, r>_S`` (``nan`` when ``r`` is zero there).

    A shard corrupted by ``1 + delta`` moves ``a`` by ``delta (1 + a)`` and leaves the rest of
    ``c - r`` (orthogonal to ``r``) unchanged to first order, so the corruption is visible only
    along ``r``. A correct run already differs from the reference along ``r`` by its own ``a``
    (a legitimate coherent scale: a per-token normalisation, or a parameter that an earlier
    Adam step moved by a different sign, rescales a whole shard): a ``delta`` within the spread
    of ``a`` over correct runs cannot be told from a correct run by any per-tensor method, so
    ``max(|a| of the clean candidate, cast floor)`` is a floor for every method's smallest
    detectable ``delta`` on that shard (one sample of the spread, not a bound).
    """
    r = ref.detach().double().reshape(-1)[region.reshape(-1)]
    c = cand.detach().double().reshape(-1)[region.reshape(-1)]
    rr = float(torch.dot(r, r))
    return float(torch.dot(c - r, r)) / rr if rr > 0 else math.nan


def corrupt_shard(shard: torch.Tensor, delta: float) -> torch.Tensor:
    """``shard * (1 + delta)`` computed in float64 and cast back to the stored dtype."""
    return (shard.double() * (1.0 + delta)).to(shard.dtype)


def flag_assert_close(cand: torch.Tensor, ref: torch.Tensor) -> bool:
    """True when :func:`torch.testing.assert_close` (defaults for the dtype) rejects ``cand``."""
    try:
        torch.testing.assert_close(cand, ref)
    except AssertionError:
        return True
    return False


def flag_cosine(cand: torch.Tensor, ref: torch.Tensor, min_cos: float = COS_MIN) -> bool:
    """True when the cosine similarity of the flattened tensors is below ``min_cos``."""
    c, r = cand.double().reshape(-1), ref.double().reshape(-1)
    cos = float(torch.nn.functional.cosine_similarity(c, r, dim=0, eps=1e-300))
    return cos < min_cos


def flag_max_abs(cand: torch.Tensor, ref: torch.Tensor, atol: float = MAX_ABS) -> bool:
    """True when the largest elementwise difference exceeds ``atol``."""
    return float((cand.double() - ref.double()).abs().max()) > atol


def depth_bound(layer: int, num_layers: int, eps: float, k: float = DEPTH_K, c: float = DEPTH_C) -> float:
    """Megatron-LM's relative tolerance ``k * C**(L + 1 - l) * eps`` for layer ``l`` of ``L``."""
    return k * c ** (num_layers + 1 - layer) * eps


def flag_depth(cand: torch.Tensor, ref: torch.Tensor, bound: float) -> bool:
    """True when ``||cand - ref||_2 / ||ref||_2`` exceeds ``bound`` (:func:`depth_bound`)."""
    c, r = cand.double(), ref.double()
    rn = float(torch.linalg.vector_norm(r))
    err = float(torch.linalg.vector_norm(c - r))
    return err > bound * rn if rn > 0 else err > 0


def layer_index(name: str, num_layers: int) -> int:
    """1-based layer ``l`` of a tensor for the depth rule: ``decoder.layers.i`` -> ``i + 1``;
    the embedding -> 0; anything after the last layer (final norm, output layer, loss) -> ``L + 1``."""
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    if m:
        return int(m.group(1)) + 1
    return 0 if name.startswith("embedding") else num_layers + 1


def peer_flags(cand: torch.Tensor, ref: torch.Tensor, bound: float) -> dict[str, bool]:
    """Verdict of every peer method on one pair of full tensors."""
    return {"assert_close": flag_assert_close(cand, ref), "cosine": flag_cosine(cand, ref),
            "max_abs": flag_max_abs(cand, ref), "depth": flag_depth(cand, ref, bound)}


# ----------------------------------------------------------------------------- traces
def ensure_traces(root: Path, dtype: str, *, steps: int, seed: int, noise_samples: int, resync: bool = False,
                  log=print) -> Path:
    """The reference and clean candidate traces under ``root/<dtype>`` (``root/<dtype>-resync``
    with the reference re-synchronised to the candidate at every step: :mod:`tracer.capture.resync`),
    traced once, then reused."""
    out = root / (dtype + ("-resync" if resync else ""))
    if (out / "ref" / "run.json").is_file() and (out / "cand_clean" / "run.json").is_file():
        log(f"  {dtype}: reusing traces under {out}")
        return out
    from examples.megatron_cpu.demo import CANDIDATE, trace_runs
    log(f"  {dtype}: tracing reference ({noise_samples} noise samples) and clean candidate "
        f"{CANDIDATE} for {steps} steps into {out} ...")
    # the samples whole: the coherent scale of each sample is reported (column `legit scale`)
    trace_runs(out, steps=steps, seed=seed, dtype=dtype, bug=None, noise_samples=noise_samples,
               noise_store="tensors", resync=resync, log=log)
    return out


# ----------------------------------------------------------------------------- measurement
@dataclass
class Case:
    """A target tensor with everything needed to re-check it under corruption."""

    target: Target
    ref_e: Entry
    ref_t: torch.Tensor
    noisy: list[torch.Tensor]
    shards: dict[int, torch.Tensor]
    entries: dict[int, Entry]
    rank: int                       # the candidate rank whose shard is corrupted
    per_tensor: float               # our per-tensor false-alarm rate
    few_sources: bool               # tracer.compare.check.few_sources for this tensor, as compare decides it
    bound: float                    # the depth rule's relative bound
    layer: int
    elementwise: bool = False       # the element statistic tests this tensor, as compare decides it
    k0: float = math.nan            # the depth rule's zero-false-positive k for this phase (clean_census)

    def full(self, delta: float) -> tuple[torch.Tensor, list[str]]:
        """The candidate's assembled tensor with the chosen shard scaled by ``1 + delta``."""
        return self.assembled(corrupt_shard(self.shards[self.rank], delta) if delta else None)

    def assembled(self, shard: torch.Tensor | None = None) -> tuple[torch.Tensor, list[str]]:
        """The candidate's assembled tensor, with ``shard`` in place of the chosen rank's (None:
        the clean one), and the replica notes, exactly as :func:`tracer.compare.check.compare` assembles it."""
        from tracer.trace.canonical import assemble
        shards = dict(self.shards)
        if shard is not None:
            shards[self.rank] = shard
        full, report = assemble(shards, {r: e.placement for r, e in self.entries.items()},
                                name=self.target.name)
        notes = [f"replicas over {d.group} differ" for d in report.replicas if not d.equal]
        return full, notes

    def ours(self, delta: float, block_scale: bool = True):
        """Our verdict (a :class:`tracer.compare.judge.TensorCheck`) on the corrupted candidate."""
        return self.verdict(*self.full(delta), block_scale=block_scale)

    def verdict(self, full: torch.Tensor, notes: list[str], block_scale: bool = True):
        """Our verdict on an assembled candidate tensor (``block_scale=False``: the norm statistic alone)."""
        from tracer.compare.judge import check_tensor
        t = self.target
        return check_tensor(t.step, RecordKey(t.phase, t.name, t.microbatch, t.call), self.ref_e, self.ref_t, full, notes,
                          self.noisy, self.per_tensor, self.entries, block_scale=block_scale,
                          few_sources=self.few_sources, elementwise=self.elementwise and block_scale)

    def flags(self, method: str, delta: float) -> bool:
        """Does ``method`` flag the tensor when the shard is scaled by ``1 + delta``?"""
        return self.flags_tensor(method, *self.full(delta))

    def flags_tensor(self, method: str, full: torch.Tensor, notes: list[str]) -> bool:
        """Does ``method`` flag the assembled candidate tensor ``full``?"""
        if method == "ours":
            return self.verdict(full, notes).status != "ok"
        if method == "ours_norm":
            return self.verdict(full, notes, block_scale=False).status != "ok"
        ref = self.ref_t
        full = full if full.dtype == ref.dtype else full.to(ref.dtype)
        if method == "assert_close":
            return flag_assert_close(full, ref)
        if method == "cosine":
            return flag_cosine(full, ref)
        if method == "max_abs":
            return flag_max_abs(full, ref)
        if method == "depth":
            return flag_depth(full, ref, self.bound)
        if method == "depth_k0":
            return flag_depth(full, ref, self.bound * self.k0 / DEPTH_K)
        raise ValueError(f"unknown method {method!r}")

    def region(self) -> torch.Tensor | None:
        """Boolean mask of the corrupted shard's elements in the full tensor (None when the
        shard is a pending sum, which covers no region of its own)."""
        from tracer.trace.canonical import shard
        pl = self.entries[self.rank].placement
        if any(d.kind == "partial" for d in pl.dims):
            return None
        ids = torch.arange(self.ref_t.numel(), dtype=torch.int64).reshape(self.ref_t.shape)
        mask = torch.zeros(self.ref_t.numel(), dtype=torch.bool)
        mask[shard(ids, pl).reshape(-1)] = True
        return mask.reshape(self.ref_t.shape)

    def cast_changes(self, delta: float) -> bool:
        """Does the cast back to the stored dtype keep any change at all?"""
        s = self.shards[self.rank]
        return not torch.equal(corrupt_shard(s, delta), s)


@dataclass
class Result:
    """The measured sensitivity of every method on one target."""

    dtype: str
    target: Target
    rank: int
    stored_dtype: str
    shape: list[int]
    shard_fraction: float           # ||shard|| / ||full|| of the clean candidate
    cast_floor: float               # smallest delta the cast to the stored dtype does not erase
    threshold: float                # our threshold
    clean_ratio: float              # our error / threshold on the clean candidate
    bound: float                    # the depth rule's relative bound
    legit_scale: float = math.nan   # |coherent_scale| of the clean candidate's shard
    noise_scale: float = math.nan   # largest |coherent_scale| of the noise samples' shard
    clean: dict[str, bool] = field(default_factory=dict)    # flagged on the clean tensor (FP)
    delta: dict[str, float] = field(default_factory=dict)   # smallest flagged delta (inf: never)

    @property
    def floor(self) -> float:
        """The smallest delta any per-tensor method can hope to flag here (:func:`coherent_scale`)."""
        return max(self.cast_floor, self.legit_scale) if math.isfinite(self.legit_scale) else self.cast_floor

    def ratio(self, peer: str, base: str = "ours") -> float | None:
        """peer delta / our delta (``base``: ours or ours_norm; None when either flags the clean tensor)."""
        if self.clean.get(peer) or self.clean.get(base):
            return None
        return self.delta[peer] / self.delta[base]


def load_case(ref_root: Path, cand_root: Path, target: Target, per_tensor: float, num_layers: int,
              eps: float) -> Case:
    """Everything :func:`tracer.compare.check.compare` would read for ``target`` (read-only)."""
    from tracer.compare.check import (few_sources, makes_topk_choice, noise_dirs, records_by_key, samples_restart,
                                      shared_start_steps)
    from tracer.compare.elementwise import element_statistic_applies
    from tracer.trace.store import TraceReader
    ref, cand = TraceReader(ref_root), TraceReader(cand_root)
    key = RecordKey(target.phase, target.name, target.microbatch, target.call)
    ref_e = records_by_key(ref, target.step)[key][0]
    entries = records_by_key(cand, target.step)[key]
    readers = [TraceReader(d) for d in noise_dirs(ref_root)]
    noisy = [n.load(target.step, 0, records_by_key(n, target.step)[key][0].key) for n in readers]
    layer = layer_index(target.name, num_layers)
    restarted, discrete = samples_restart(readers), makes_topk_choice(ref, target.step)
    shared = shared_start_steps(ref, cand, readers, sorted(set(ref.steps()) & set(cand.steps())), restarted)
    return Case(target, ref_e, ref.load(target.step, 0, ref_e.key), noisy,
                {r: cand.load(target.step, r, e.key) for r, e in entries.items()}, entries, min(entries),
                per_tensor, few_sources(target.phase, restarted, discrete), depth_bound(layer, num_layers, eps), layer,
                element_statistic_applies(target.phase, target.step in shared, discrete))


def measure(case: Case, dtype: str, clean_row) -> Result:
    """Clean verdicts and smallest flagged delta of every method on one case."""
    clean_ours = case.ours(0.0)
    if not (math.isclose(clean_ours.error, clean_row.error, rel_tol=1e-12, abs_tol=0.0)
            and math.isclose(clean_ours.threshold, clean_row.threshold, rel_tol=1e-12, abs_tol=0.0)):
        raise AssertionError(f"{case.target}: re-check differs from compare(): error {clean_ours.error} vs "
                             f"{clean_row.error}, threshold {clean_ours.threshold} vs {clean_row.threshold}")
    full, _ = case.full(0.0)
    sn = float(torch.linalg.vector_norm(case.shards[case.rank].double()))
    fn = float(torch.linalg.vector_norm(full.double()))
    res = Result(dtype, case.target, case.rank, str(case.ref_e.dtype), list(case.ref_t.shape),
                 sn / fn if fn else 0.0, smallest_delta(case.cast_changes, lo=1e-9), clean_ours.threshold,
                 clean_ours.ratio, case.bound)
    region = case.region()
    if region is not None:
        res.legit_scale = abs(coherent_scale(full, case.ref_t, region))
        res.noise_scale = max(abs(coherent_scale(n, case.ref_t, region)) for n in case.noisy)
    for m in METHODS:
        res.clean[m] = case.flags(m, 0.0)
        res.delta[m] = smallest_delta(lambda d, m=m: case.flags(m, d))
    return res


def num_layers_of(reader) -> int:
    """``num_layers`` from a trace's model signature."""
    m = re.search(r"num_layers=(\d+)", reader.model_signature)
    if not m:
        raise ValueError(f"no num_layers in the model signature {reader.model_signature!r}")
    return int(m.group(1))


def run_dtype(root: Path, dtype: str, targets: tuple[Target, ...], log=print
              ) -> tuple[list[Result], Any, tuple[dict[str, dict[str, int]], float, str]]:
    """Compare the clean candidate once, count the peers' false positives over it
    (:func:`clean_census`), then measure every target; returns the results, the comparison
    and the census."""
    cmp, census, cases = clean_cases(root, dtype, targets, log)
    rows = {(r.step, r.phase, r.name, r.microbatch, r.call): r for r in cmp.rows}
    out = []
    for i, (tg, case) in enumerate(zip(targets, cases)):
        t = time.perf_counter()
        case = case()
        case.k0 = census[1][tg.phase][0]
        res = measure(case, dtype, rows[(tg.step, tg.phase, tg.name, tg.microbatch, tg.call)])
        out.append(res)
        log(f"  [{i + 1}/{len(targets)}] {dtype} step {tg.step} {tg.phase} {tg.name} mb {tg.microbatch} "
            f"(rank {res.rank}): " + ", ".join(f"{m} {_fmt_delta(res, m)}" for m in METHODS)
            + f"  ({time.perf_counter() - t:.1f} s)")
    return out, cmp, census


def clean_cases(root: Path, dtype: str, targets: tuple[Target, ...], log=print
                ) -> tuple[Any, tuple[dict[str, dict[str, int]], dict[str, tuple[float, str]]], list[Callable[[], Case]]]:
    """The clean comparison (logged), the peers' clean census (:func:`clean_census`), and for each
    target a function that loads its :class:`Case` with the comparison's per-tensor false-alarm rate."""
    from tracer.compare.check import compare
    from tracer.trace.store import TraceReader
    t = time.perf_counter()
    cmp = compare(root / "ref", root / "cand_clean")
    tested = [r.element_ratio for r in cmp.rows if not math.isnan(r.element_ratio)]
    log(f"  {dtype}: clean comparison of {len(cmp.rows)} tensors in {time.perf_counter() - t:.1f} s: "
        f"{cmp.counts()}, largest ratio {cmp.max_ratio_ok:.3f}, first divergence "
        f"{cmp.first.label if cmp.first else 'none'}; element statistic on {len(tested)} tensors, largest "
        f"{max(tested, default=math.nan):.3f}; exactness rule: {cmp.exactness}")
    census = clean_census(root, dtype, log=log)
    per_tensor = cmp.false_alarm / max(len(cmp.rows), 1)
    num_layers = num_layers_of(TraceReader(root / "ref"))
    eps = torch.finfo(COMPUTE_DTYPES[dtype]).eps
    return cmp, census, [lambda tg=tg: load_case(root / "ref", root / "cand_clean", tg, per_tensor, num_layers, eps)
                         for tg in targets]


def clean_census(root: Path, dtype: str, log=print
                 ) -> tuple[dict[str, dict[str, int]], dict[str, tuple[float, str]]]:
    """How many tensors of the whole clean comparison each published peer flags, per phase.

    Every floating-point tensor that :func:`tracer.compare.check.compare` checks (same keys, same
    assembled candidate tensors via :func:`tracer.compare.check.assembled_record`) is given to every peer rule.
    Returns ``{phase: {"tensors": n, peer: flagged, ...}}`` plus an ``"all"`` row, and per phase
    ``(k0, tensor)``: the smallest ``k`` of the depth rule that flags none of that phase's
    tensors (the largest ``(||cand - ref|| / ||ref||) / (C^(L+1-l) eps)``), and the tensor
    that sets it.
    """
    from tracer.compare.check import assembled_record, records_by_key
    from tracer.trace.store import TraceReader
    t = time.perf_counter()
    ref, cand = TraceReader(root / "ref"), TraceReader(root / "cand_clean")
    num_layers, eps = num_layers_of(ref), torch.finfo(COMPUTE_DTYPES[dtype]).eps
    out: dict[str, dict[str, int]] = {}
    k0: dict[str, tuple[float, str]] = {}
    for s in sorted(set(ref.steps()) & set(cand.steps())):
        ri, ci = records_by_key(ref, s), records_by_key(cand, s)
        for k, ents in ri.items():
            if k not in ci:
                continue
            r = ref.load(s, 0, ents[0].key)
            if not r.is_floating_point():
                continue
            c, _ = assembled_record(cand, s, ci[k], k.name)
            if tuple(c.shape) != tuple(r.shape):
                continue
            bound = depth_bound(layer_index(k[1], num_layers), num_layers, eps)
            flags = peer_flags(c if c.dtype == r.dtype else c.to(r.dtype), r, bound)
            rn = float(torch.linalg.vector_norm(r.double()))
            if rn > 0:
                kk = float(torch.linalg.vector_norm(c.double() - r.double())) / rn / bound * DEPTH_K
                for ph in (k[0], "all"):
                    if kk > k0.get(ph, (0.0, ""))[0]:
                        k0[ph] = (kk, f"step {s} {k[0]} {k[1]} (mb {k[2]})")
            for ph in (k[0], "all"):
                row = out.setdefault(ph, {"tensors": 0, **{p: 0 for p in FIXED_PEERS}})
                row["tensors"] += 1
                for p in FIXED_PEERS:
                    row[p] += int(flags[p])
    log(f"  {dtype}: peers on the whole clean comparison ({out.get('all', {}).get('tensors', 0)} float tensors, "
        f"{time.perf_counter() - t:.1f} s): " + ", ".join(f"{p} flags {out['all'][p]}" for p in FIXED_PEERS)
        + "; zero-FP depth k0: " + ", ".join(f"{ph} {v[0]:.3g}" for ph, v in sorted(k0.items())))
    return out, k0


def census_table(census: dict[str, dict[str, dict[str, int]]], comparisons: dict[str, Any]) -> str:
    """Markdown table: false positives of every method over the whole clean comparison."""
    lines = ["| dtype | phase | float tensors | ours | " + " | ".join(FIXED_PEERS) + " |",
             "|" + "---|" * (4 + len(FIXED_PEERS))]
    for dt, by_phase in census.items():
        rows = comparisons[dt].rows
        for ph, row in sorted(by_phase.items(), key=lambda kv: (kv[0] == "all", kv[0])):
            ours = sum(1 for r in rows if r.status not in ("ok", "unchecked") and ph in ("all", r.phase))
            lines.append(f"| {dt} | {ph} | {row['tensors']} | {ours} | " + " | ".join(str(row[p]) for p in FIXED_PEERS) + " |")
    return "\n".join(lines)


def k0_table(census: dict[str, tuple[dict[str, dict[str, int]], dict[str, tuple[float, str]]]]) -> str:
    """Markdown table of the depth rule's zero-false-positive k per dtype and phase."""
    lines = ["| dtype | phase | k0 | set by |", "|---|---|---|---|"]
    for dt, (_, k0) in census.items():
        for ph, (k, at) in sorted(k0.items(), key=lambda kv: (kv[0] == "all", kv[0])):
            lines.append(f"| {dt} | {ph} | {k:.3g} | {at} |")
    return "\n".join(lines)


def validate(root: Path, res: Result, factor: float = 1.05) -> tuple[str, str]:
    """End-to-end check of our delta: a full :func:`tracer.compare.check.compare` of the candidate
    whose stored shard reads back scaled by ``1 + delta * factor`` and ``1 + delta / factor``;
    returns the target's status in each."""
    import tracer.compare.check as chk
    from tracer.trace.store import TraceReader
    tg = res.target
    cand_root = (root / "cand_clean").resolve()
    out = []
    for d in (res.delta["ours"] * factor, res.delta["ours"] / factor):
        class Corrupted(TraceReader):
            scale = d

            def load(self, step: int, rank: int, key: str) -> torch.Tensor:
                t = super().load(step, rank, key)
                e = self.entry(step, rank, key)
                if (Path(self.root).resolve() == cand_root and step == tg.step and rank == res.rank
                        and e.record_key == (tg.phase, tg.name, tg.microbatch, tg.call)):
                    t = corrupt_shard(t, self.scale)
                return t

        saved = chk.TraceReader
        chk.TraceReader = Corrupted
        try:
            cmp = chk.compare(root / "ref", root / "cand_clean")
        finally:
            chk.TraceReader = saved
        row = next(r for r in cmp.rows if (r.step, r.phase, r.name, r.microbatch, r.call)
                   == (tg.step, tg.phase, tg.name, tg.microbatch, tg.call))
        out.append(f"{row.status} ({row.ratio:.3f}; first: {cmp.first.label if cmp.first else 'none'})")
    return out[0], out[1]


# ----------------------------------------------------------------------------- report
def _fmt_delta(res: Result, m: str) -> str:
    if res.clean[m]:
        return "FP"
    d = res.delta[m]
    if math.isinf(d):
        return f"> {DELTA_HI:g}"
    if d <= DELTA_LO:
        return f"<= {DELTA_LO:g}"
    return f"{d:.3g}"


def ratio_bound(res: Result, peer: str, base: str = "ours") -> tuple[float, str] | None:
    """peer delta / our delta and what it is: ``"="`` measured, ``">="`` a lower bound (the peer
    never flags up to ``DELTA_HI``, or ours flags already at ``DELTA_LO``), ``"<="`` an upper bound
    (the peer flags already at ``DELTA_LO``); None when either method flags the clean tensor."""
    r = res.ratio(peer, base)
    if r is None:
        return None
    p, o = res.delta[peer], res.delta[base]
    lower = math.isinf(p) or o <= DELTA_LO
    upper = p <= DELTA_LO
    if math.isinf(p):
        p = DELTA_HI
    if math.isinf(o):
        return (0.0, "<=") if not math.isinf(res.delta[peer]) else None
    kind = "=" if lower == upper else (">=" if lower else "<=")
    return p / o, kind


def _fmt_ratio(res: Result, peer: str) -> str:
    rb = ratio_bound(res, peer)
    if rb is None:
        return "FP" if res.clean[peer] else "n/a"
    r, kind = rb
    return ("" if kind == "=" else kind + " ") + f"{r:.3g}"


def median_ratio(results: list[Result], peer: str, base: str = "ours") -> tuple[str, int, int]:
    """Median of peer/ours over the results where neither is FP (bounds enter at their value,
    and the median is marked as a bound when any entry is one), the number of such results,
    and the number of tensors where the peer flags the clean candidate."""
    vals, kinds = [], set()
    for r in results:
        rb = ratio_bound(r, peer, base)
        if rb is None:
            continue
        vals.append(rb[0])
        kinds.add(rb[1])
    fps = sum(1 for r in results if r.clean[peer])
    if not vals:
        return "n/a", 0, fps
    kinds.discard("=")
    tag = "" if not kinds else (kinds.pop() + " " if len(kinds) == 1 else "~")
    return tag + f"{statistics.median(vals):.3g}", len(vals), fps


def table(results: list[Result]) -> str:
    """Markdown table of the results."""
    head = ("| dtype | step | phase | tensor (mb) | stored | shard rank | cast floor | legit scale (noise) | "
            "ours (clean ratio) | " + " | ".join(PEERS) + " | " + " | ".join(f"{p}/ours" for p in PEERS) + " |")
    lines = [head, "|" + "---|" * (9 + 2 * len(PEERS))]
    for r in results:
        t = r.target
        lines.append(f"| {r.dtype} | {t.step} | {t.phase} | `{t.name}` ({t.microbatch}) | {r.stored_dtype} | "
                     f"{r.rank} | {r.cast_floor:.2g} | {r.legit_scale:.2g} ({r.noise_scale:.2g}) | "
                     f"{_fmt_delta(r, 'ours')} ({r.clean_ratio:.2f}) | "
                     + " | ".join(_fmt_delta(r, p) for p in PEERS) + " | "
                     + " | ".join(_fmt_ratio(r, p) for p in PEERS) + " |")
    return "\n".join(lines)


def summary_table(results: list[Result], base: str = "ours", peers: tuple[str, ...] = PEERS) -> str:
    """Per dtype and kind: the median ratio (peer delta / ``base`` delta) and false-positive count of every peer."""
    lines = [f"| dtype | tensors | {base}: FP | " + " | ".join(f"{p}: median ratio (n), FP" for p in peers) + " |",
             "|" + "---|" * (3 + len(peers))]
    groups: dict[tuple[str, str], list[Result]] = {}
    for dt in dict.fromkeys(r.dtype for r in results):
        for kind in ("grad", "activation", "all"):
            groups[(dt, kind)] = [r for r in results if r.dtype == dt and kind in ("all", r.target.kind)]
    for (dt, kind), rs in groups.items():
        cells = []
        for p in peers:
            med, n, fp = median_ratio(rs, p, base)
            cells.append(f"{med} ({n}), FP {fp}/{len(rs)}")
        lines.append(f"| {dt} | {kind} ({len(rs)}) | {sum(r.clean[base] for r in rs)}/{len(rs)} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def ceiling_table(results: list[Result]) -> str:
    """Per dtype and kind: how far below each method any per-tensor method could go, i.e. the
    median of ``delta / floor`` (:attr:`Result.floor`), and on how many tensors a 10x lead over
    the peer is possible at all (``peer delta / floor >= 10``); FP tensors of a method are left out."""
    methods = ("ours",) + FIXED_PEERS
    lines = ["| dtype | tensors | " + " | ".join(f"{m}: median delta/floor, 10x possible" for m in methods) + " |",
             "|" + "---|" * (2 + len(methods))]
    for dt in dict.fromkeys(r.dtype for r in results):
        for kind in ("grad", "activation"):
            rs = [r for r in results if r.dtype == dt and r.target.kind == kind]
            cells = []
            for m in methods:
                vals = [min(r.delta[m], DELTA_HI) / r.floor for r in rs if not r.clean[m] and r.floor > 0]
                ten = sum(v >= 10 for v in vals)
                cells.append(f"{statistics.median(vals):.3g}, {ten}/{len(vals)}" if vals else "n/a (all FP)")
            lines.append(f"| {dt} | {kind} ({len(rs)}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: what the page of each mode says about the reference's trajectory
DEFAULT_NOTE = """
The reference runs its own trajectory: at step `t` it has drifted from the candidate by `t`
steps of legitimate round-off, amplified by Adam, and its noise samples follow trajectories of
their own to cover that drift. The same measurement with a reference re-synchronised to the
candidate at every step (`--resync`, `tracer.capture.resync`): [sensitivity-resync.md](sensitivity-resync.md).

A few corrupted entries of one shard (k = 1, 8, 64) and single bit flips, with the element
statistic (`tracer/compare/elementwise.py`): [sensitivity-sparse.md](sensitivity-sparse.md) and
[sensitivity-sparse-resync.md](sensitivity-sparse-resync.md); the statistics and their false-alarm
arithmetic: [detection-statistics.md](detection-statistics.md).
"""
RESYNC_NOTE = """
**Re-synchronised reference** (`--resync`, `tracer.capture.resync`): the candidate runs first and also
traces its optimizer state; the reference then starts every step `t >= 1` from the candidate's
fp32 main parameters and Adam moments at the end of step `t - 1`, and its noise samples start
each step from that same state. Every step thus compares one step of the candidate with one
step of the reference, for every method alike (the peers see the same re-synchronised
reference). Ours then checks the tensors recorded before each step's optimizer update
(gradients, activations) without the few-source cap on the thresholds' degrees of freedom
(`tracer.compare.check.few_sources`, `tracer.compare.thresholds`): no Adam flip can drive their deviation,
since every run starts the step from the same parameters; measured on this page's targets
before that rule, the cap cost up to 1.85x (bf16 max-abs median 8.28x, gradients 9.14x; depth
11.4x; fp32 depth 1.13x). The same measurement with a reference on its own trajectory:
[sensitivity.md](sensitivity.md).
"""


def write_doc(path: Path, results: list[Result], comparisons: dict[str, Any],
              census: dict[str, tuple[dict[str, dict[str, int]], dict[str, tuple[float, str]]]], command: str, runtime: float,
              validations: list[str], trace_s: float = 0.0, resync: bool = False) -> None:
    """Write ``docs/sensitivity.md`` (``docs/sensitivity-resync.md`` with ``resync``)."""
    traced = f"of which {trace_s:.0f} s tracing" if trace_s else "traces reused from an earlier run"
    clean = "\n".join(f"* {dt}: {len(c.rows)} tensors compared, {c.counts()}, largest error/threshold "
                      f"{c.max_ratio_ok:.3f}" for dt, c in comparisons.items())
    doc = f"""# Sensitivity against peers{" (re-synchronised reference)" if resync else ""}

Produced by `{command}` ({runtime:.0f} s on 2 shared CPU cores, {traced}).

**What is measured.** The demo's megatron-core GPT (2 layers, hidden 64, 3 Adam steps, 4
microbatches) is traced on one process (the reference, with 4 noise samples) and as a clean
TP=2 + SP + PP=2 candidate with the distributed optimizer on 4 gloo ranks
(`examples.megatron_cpu.demo.trace_runs`). On the candidate's trace, the shard of one tensor
written by one rank (TP rank 0 of the stage holding it) is multiplied by `1 + delta`
(in float64, then cast back to the stored dtype), and for each method the smallest flagged
`delta` in `[1e-8, 1]` is found by bisection on a log scale (to 1%). Every method sees the
same assembled full tensors (the candidate's shards assembled by `tracer.trace.canonical.assemble`,
as `tracer.compare.check.compare` does) and the same reference tensor. "FP" means the method already
flags the uncorrupted clean candidate (a false positive); `> 1` means it never flags up to
`delta = 1`; the ratio is the peer's delta over ours (> 1: ours detects a smaller corruption).
{RESYNC_NOTE if resync else DEFAULT_NOTE}
## Methods

* **ours**: `tracer.compare.check` on the tensor, as `tracer.compare.check.compare` runs by default:
  flagged when `||cand - ref||_2 > T`, `T` from the reference's noise samples
  (`tracer.compare.thresholds`), or when the difference's coordinates along the reference on 4 x 4
  blocks exceed their own threshold from the samples' coordinates (the block-scale
  statistic, `tracer/compare/blockscale.py`), each statistic at half the per-tensor false-alarm rate
  `0.01 / N` of the whole clean comparison (`N` tensors); the clean verdict and threshold are
  checked to be identical to those of `tracer.compare.check.compare`.
* **ours_norm**: ours with the norm statistic alone (`compare(block_scale=False)`), to show
  what the block-scale statistic adds.
* **assert_close**: `torch.testing.assert_close(cand, ref)` with its defaults for the stored
  dtype (bf16: rtol 1.6e-2, atol 1e-5; fp32: rtol 1.3e-6, atol 1e-5), elementwise
  `|cand - ref| <= atol + rtol |ref|`.
* **cosine**: flagged when `cos(cand, ref) < 0.99` (the fixed threshold of msprobe and others).
* **max_abs**: flagged when `max |cand - ref| > 1e-3`.
* **depth**: Megatron-LM's gradient comparison rule (commit `74bec5bed`, Theorem 5.3 of
  arXiv 2506.09280): flagged when `||cand - ref||_2 / ||ref||_2 > k C^(L+1-l) eps`, `k = 4`,
  `C = 1.03`, `L = 2` layers, `l` the 1-based layer of the tensor, `eps` the machine epsilon of
  the run's compute dtype (bf16: 2^-7 = 7.8e-3, also for the fp32-stored gradients of a bf16
  run, as Megatron-LM uses the training precision's eps; fp32: 2^-23).

Columns: `cast floor` is the smallest delta that survives the cast of the scaled shard back to
the stored dtype (below it the stored tensor is unchanged and nothing can detect the
corruption); `ours (clean ratio)` is our smallest flagged delta and, in parentheses, the clean
candidate's error/threshold for that tensor.

## Clean comparisons

{clean}

## Results

{table(results)}

## Summary

Median of peer delta / our delta over the tensors where neither method is FP, (n) the number
of such tensors, and the number of tensors on which the peer flags the clean candidate. A ratio
marked `>=` is a lower bound (the peer never flags up to delta = 1), `<=` an upper bound (the
peer flags already at delta = 1e-8, the lower end of the search); a median over bounds carries
the same mark (`~` when both kinds enter).

{summary_table(results)}

The same with the norm statistic alone as ours (peer delta / ours_norm delta):

{summary_table(results, base="ours_norm", peers=FIXED_PEERS + ("depth_k0",))}

## How far down any method could go

A shard scaled by `1 + delta` differs from the clean shard only along the reference itself;
a correct run already differs from the reference along that direction by its own coherent
scale `a = <c - r, r>_S / <r, r>_S` over the shard `S` (`bench.sensitivity.coherent_scale`;
column `legit scale`: `|a|` of the clean candidate, and in parentheses the largest `|a|` of the
4 noise samples, which over-estimate a correct run's difference by design). A `delta` inside
the spread of `a` over correct runs looks like a correct run to every per-tensor method, so
`floor = max(cast floor, |a| of the clean candidate)` is roughly the smallest corruption any
method can flag without false positives (one sample of the spread, not a bound). The table
gives each method's median `delta / floor`, and on how many tensors `peer delta / floor >= 10`,
i.e. on how many a 10x lead over that peer is possible at all:

{ceiling_table(results)}

## False positives over the whole clean comparison

Every floating-point tensor of the clean comparison (all phases, all steps, the same
assembled candidate tensors as `tracer.compare.check.compare`), and how many each method flags:

{census_table({k: v[0] for k, v in census.items()}, comparisons)}

The depth rule's zero-false-positive `k` per phase (used by column `depth_k0` above: the
smallest `k` that flags none of the phase's clean tensors, vs the published `k = 4`), and the
tensor that sets it:

{k0_table(census)}
"""
    if validations:
        doc += ("\n## End-to-end check\n\nA full `tracer.compare.check.compare` of the candidate whose stored shard "
                "reads back scaled by `1 + 1.05 delta` (left) and `1 + delta / 1.05` (right), for our "
                "delta: the target's status (ratio; first divergence of the comparison).\n\n"
                + "\n".join(validations) + "\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/sensitivity", help="trace cache directory (reused when present)")
    ap.add_argument("--dtypes", default="bf16,fp32", help="comma-separated run dtypes (bf16, fp32)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--noise-samples", type=int, default=4)
    ap.add_argument("--resync", action="store_true",
                    help="re-synchronise the reference to the candidate at every step (tracer.capture.resync): each step "
                         "compares one step of the candidate against one step of the reference")
    ap.add_argument("--validate", action="store_true",
                    help="also re-run the full comparison at our delta x 1.05 and / 1.05 for the first "
                         "gradient and the first activation target of each dtype (slow)")
    ap.add_argument("--write", default=None, help="write the markdown report here (e.g. docs/sensitivity.md)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    root = Path(a.out)
    results, comparisons, validations, census, trace_s = [], {}, [], {}, 0.0
    print(f"sensitivity: {len(TARGETS)} tensors x {len(METHODS)} methods, dtypes {a.dtypes}")
    for dtype in a.dtypes.split(","):
        t = time.perf_counter()
        d = ensure_traces(root, dtype, steps=a.steps, seed=a.seed, noise_samples=a.noise_samples, resync=a.resync)
        spent = time.perf_counter() - t
        trace_s += spent if spent > 1.0 else 0.0  # reusing cached traces takes milliseconds
        rs, comparisons[dtype], census[dtype] = run_dtype(d, dtype, TARGETS)
        results += rs
        if a.validate:
            firsts = [next(r for r in rs if r.target.kind == k) for k in ("grad", "activation")]
            for r in firsts:
                if r.clean["ours"] or not math.isfinite(r.delta["ours"]):
                    continue
                up, down = validate(d, r)
                line = (f"* {dtype} step {r.target.step} {r.target.phase} `{r.target.name}` "
                        f"(mb {r.target.microbatch}): {up} | {down}")
                print("  validate " + line[2:])
                validations.append(line)
    print()
    print(table(results))
    print()
    print(summary_table(results))
    print()
    print(census_table({k: v[0] for k, v in census.items()}, comparisons))
    runtime = time.perf_counter() - t0
    print(f"\nsensitivity finished in {runtime:.0f} s")
    if a.write:
        cmd = "python -m bench.sensitivity " + " ".join(argv if argv is not None else sys.argv[1:])
        write_doc(Path(a.write), results, comparisons, census, cmd.strip(), runtime, validations, trace_s,
                  resync=a.resync)
        print(f"wrote {a.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
