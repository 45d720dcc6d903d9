"""Detection benchmark (issue 8): false positives over clean megatron-core and plain-PyTorch
layouts, and every registered bug caught at the tensor and phase it declares.

    python -m bench.detection clean|detect|all [--quick] [--bug NAME ...] [--layouts NAME ...]
                              [--seeds 0 1 2] [--dtypes fp32 bf16] [--steps 3] [--out DIR]
                              [--write docs/detection.md]

* ``clean``: every (layout, dtype) row of the clean matrix, for every seed, is traced (real
  megatron-core under gloo; ``torch:`` layouts on the plain-PyTorch harness,
  :mod:`examples.torch_parallel`; ``titan:`` layouts on the torchtitan-style FSDP2/HSDP/DTensor
  harness, :mod:`examples.torchtitan_cpu`) and compared with the single-device reference
  (:func:`tracer.compare.check.compare`). Per row: tensors compared, tensors not ``ok`` (goal 0),
  the largest error/threshold (the safety margin), wall time.
* ``detect``: every registered bug (:mod:`examples.megatron_cpu.bugs`,
  :mod:`examples.torch_parallel.bugs`, :mod:`examples.torchtitan_cpu.bugs`; or ``--bug``) runs on the first layout (smallest world)
  that satisfies its ``needs``; the first divergence found is checked against the declared one
  (phase equal, name matching the declared ``fnmatch`` pattern), and replicated copies that
  drifted across ranks are reported.
* ``all``: both, sharing the launches.
* ``--resync``: each candidate (clean or buggy) gets a reference of its own, re-synchronised to
  it at every step (:mod:`tracer.capture.resync`: the candidate also traces its optimizer state, and
  FP8 amax histories, then its reference starts every step from that state), run in one
  world-1 launch per harness after the candidates.

Virtual pipelining (``+vpp2``: 2 model chunks per stage, megatron's interleaved schedule) needs
4 layers on 2 stages: those layouts run a 4-layer model (:data:`VPP_MODEL`) against their own
single-process reference.

Cost control: one reference trace per harness, model, seed and dtype (with ``--noise-samples`` noise
samples, modelling a TP split of the largest TP in the run, and for the torchtitan-style harness the
largest data-parallel size's fp32 gradient reduction), all references in one world-1
gloo launch, and all candidates of one world size in one launch. Candidate traces are deleted
once compared (``--keep-traces`` keeps them).

``--quick`` is the CI-sized subset (:data:`QUICK_ROWS` x 1 seed x 3 steps, one row per harness
feature group, and the bugs :data:`QUICK_BUGS`). The exit status is 1 on any false positive
or any missed or misplaced bug, else 0. ``--write FILE`` replaces the tables this command
produced in FILE, an existing page, between its ``<!-- detection:* -->`` markers.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import math
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from examples.bug_registry import Bug
from tracer.errors import TraceError
from examples.megatron_cpu.bugs import BUGS as MEGATRON_BUGS
from examples.megatron_cpu.gpt import layout_name
from examples.torch_parallel.bugs import BUGS as TORCH_BUGS
from examples.torch_parallel.layout import Layout
from examples.torchtitan_cpu.bugs import BUGS as TITAN_BUGS
from examples.torchtitan_cpu.parallelize import Layout as TitanLayout

__all__ = [
    "LAYOUTS",
    "QUICK_BUGS",
    "QUICK_ROWS",
    "BugRow",
    "CleanRow",
    "Job",
    "bug_rows",
    "clean_rows",
    "main",
    "pick_layout",
    "run_jobs",
]


def _lay(tp: int = 1, pp: int = 1, dp: int = 1, sp: bool = False, distopt: bool = False, vpp: int = 1
         ) -> dict[str, Any]:
    return {"tp": tp, "pp": pp, "dp": dp, "sp": sp, "distopt": distopt, **({"vpp": vpp} if vpp > 1 else {})}


#: megatron-core model of the virtual-pipeline layouts: 4 layers (2 stages x 2 chunks of one layer);
#: the other megatron layouts use the harness's 2-layer default. A model has its own reference.
VPP_MODEL = {"num_layers": 4}


#: the clean matrix's layouts (world <= 4), by :func:`layout_name`; every one runs in each dtype
LAYOUTS: dict[str, dict[str, Any]] = {layout_name(l): l for l in (
    _lay(tp=2), _lay(tp=2, sp=True), _lay(pp=2), _lay(dp=2), _lay(dp=2, distopt=True),
    _lay(tp=4), _lay(tp=4, sp=True), _lay(tp=2, pp=2), _lay(tp=2, pp=2, sp=True),
    _lay(tp=2, pp=2, sp=True, distopt=True), _lay(tp=2, dp=2), _lay(tp=2, dp=2, sp=True, distopt=True),
    _lay(pp=2, dp=2), _lay(pp=2, dp=2, distopt=True), _lay(pp=2, vpp=2), _lay(tp=2, pp=2, sp=True, vpp=2))}
#: the plain-PyTorch harness's layouts (``examples/torch_parallel``): CP, FP8, MoE, world <= 4
TORCH = "torch:"
LAYOUTS.update({TORCH + n: {"torch": Layout.parse(n)} for n in (
    "tp2.cp1.dp1+sp", "tp1.cp2.dp1", "tp1.cp4.dp1", "tp2.cp2.dp1+sp", "tp1.cp2.dp2",
    "tp2.cp1.dp1+fp8", "tp2.cp1.dp1+sp+fp8", "tp2.cp2.dp1+fp8", "tp1.cp1.dp2+fp8", "tp1.cp1.dp2+fp8+recompute",
    "tp1.cp1.dp2+moe", "tp2.cp1.dp1+sp+moe", "tp1.cp2.dp2+moe")})
#: the torchtitan-style harness's layouts (``examples/torchtitan_cpu``): FSDP2, HSDP, DTensor TP/SP,
#: loss_parallel, activation checkpointing, tied embeddings, world <= 4
TITAN = "titan:"
LAYOUTS.update({TITAN + n: {"titan": TitanLayout.parse(n)} for n in (
    "r1.s2.t1", "r1.s4.t1", "r2.s2.t1", "r1.s1.t2", "r1.s1.t2+sp", "r1.s1.t2+sp+lp", "r1.s2.t2+sp",
    "r1.s2.t1+ac", "r1.s2.t1+tied")})
#: every bug of the three harnesses (names are unique across them)
BUGS: dict[str, Bug] = {**MEGATRON_BUGS, **TORCH_BUGS, **TITAN_BUGS}
assert len(BUGS) == len(MEGATRON_BUGS) + len(TORCH_BUGS) + len(TITAN_BUGS), "bug names must be unique"
DTYPES = ("fp32", "bf16")
SEEDS = (0, 1, 2)
STEPS = 3
NOISE_SAMPLES = 4
BUG_SEED, BUG_DTYPE = 0, "bf16"
#: the CI subset: (layout, dtype) rows, one seed, and bugs placed on those layouts
QUICK_ROWS = (("tp2.pp2.dp1+sp", "bf16"), ("tp2.pp1.dp2+sp+distopt", "fp32"), ("tp1.pp2.dp1+vpp2", "bf16"),
              ("torch:tp1.cp2.dp1", "fp32"), ("torch:tp2.cp2.dp1+fp8", "bf16"), ("titan:r1.s2.t2+sp", "bf16"))
QUICK_BUGS = ("sp_norm_grad_not_reduced", "tied_embedding_grad_not_allreduced", "dp_grad_scale_skipped",
              "vpp_p2p_mispaired", "cp_ring_backward_stale_kv", "norm_grad_times_tp_with_cp_fp8",
              "sp_rope_rank_offset")
LAUNCH_TIMEOUT_S = 3 * 3600.0


def _world(layout: dict[str, Any]) -> int:
    if "torch" in layout:
        return layout["torch"].world
    if "titan" in layout:
        return layout["titan"].world
    return int(layout.get("tp", 1)) * int(layout.get("pp", 1)) * int(layout.get("dp", 1))


def _dtypes(name: str) -> tuple[str, ...]:
    """The dtypes a clean layout runs in: FP8 layouts in bf16 only (FP8 training keeps bf16
    activations and weights, as Transformer Engine recipes do; fp32 + FP8 is discussed in
    docs/detection.md), every other layout in both."""
    return ("bf16",) if "torch" in LAYOUTS[name] and LAYOUTS[name]["torch"].fp8 else DTYPES


def _torch_reference(name: str) -> str:
    """The reference layout of a plain-PyTorch layout: one rank, the same model features."""
    return TORCH + Layout.parse(name[len(TORCH):]).reference().name


def _titan_reference(name: str) -> str:
    """The reference layout of a torchtitan-style layout: one rank, the same model (tied or not)."""
    return TITAN + TitanLayout.parse(name[len(TITAN):]).reference().name


def _harness(name: str) -> str:
    """The harness of a layout or reference name: ``torch``, ``titan`` or ``megatron``."""
    return "torch" if name.startswith(TORCH) else "titan" if name.startswith(TITAN) else "megatron"


def _tp(name: str) -> int:
    lay = LAYOUTS[name]
    return lay["torch"].tp if "torch" in lay else lay["titan"].tp if "titan" in lay else int(lay["tp"])


def _dp(name: str) -> int:
    lay = LAYOUTS[name]
    return lay["torch"].dp if "torch" in lay else lay["titan"].dp if "titan" in lay else int(lay["dp"])


def _reference(name: str) -> str:
    """The reference of a clean layout: the plain-PyTorch or torchtitan-style one
    (:func:`_torch_reference`, :func:`_titan_reference`), or megatron-core's single process for its
    model (``reference``, ``reference+vpp-model``)."""
    if name.startswith(TORCH):
        return _torch_reference(name)
    if name.startswith(TITAN):
        return _titan_reference(name)
    return "reference+vpp-model" if int(LAYOUTS[name].get("vpp", 1)) > 1 else "reference"


def _reference_of(name: str) -> str:
    """``name`` itself when it names a reference, else the reference of the clean layout ``name``."""
    return name if name.startswith("reference") or name not in LAYOUTS else _reference(name)


def _model(name: str) -> dict[str, Any]:
    """Model-size overrides of a megatron-core layout or reference (``build_and_train`` keywords)."""
    return dict(VPP_MODEL) if _reference_of(name) == "reference+vpp-model" else {}


@dataclass
class Job:
    """One traced run: the reference (world 1, noise samples) or a candidate."""

    kind: str                      # ref | clean | bug
    layout: str                    # key of LAYOUTS; a reference: "reference" (megatron) or its torch: layout
    seed: int
    dtype: str
    steps: int
    root: str
    bug: str | None = None
    noise_samples: int = 0
    noise_tp: int = 2
    noise_dp: int = 1               # torchtitan-style references: the largest data-parallel size modelled
    resync_from: str | None = None  # a reference re-synchronised to this candidate trace (tracer.capture.resync)
    optim: bool = False             # a candidate that also traces its optimizer state (capture "optim")

    @property
    def world(self) -> int:
        return 1 if self.kind == "ref" else _world(LAYOUTS[self.layout])

    @property
    def harness(self) -> str:
        return _harness(self.layout)

    def spec(self) -> dict[str, Any]:
        """The job as :func:`examples.megatron_cpu.demo._trace_worker`,
        :func:`examples.torch_parallel.run.trace_job` or :func:`examples.torchtitan_cpu.run.trace_job`
        takes it."""
        if self.harness == "titan":
            if self.resync_from or self.optim:
                raise ValueError(f"{self.layout}: --resync is not supported on the torchtitan-style harness")
            return {"harness": "titan", "layout": self.layout[len(TITAN):], "dtype": self.dtype, "seed": self.seed,
                    "steps": self.steps, "root": self.root, "bug": self.bug, "noise_samples": self.noise_samples,
                    "noise_tp": self.noise_tp, "noise_dp": self.noise_dp}
        if self.harness == "torch":
            return {"harness": "torch", "layout": self.layout[len(TORCH):], "dtype": self.dtype, "seed": self.seed,
                    "steps": self.steps, "root": self.root, "bug": self.bug, "noise_samples": self.noise_samples,
                    "noise_split": self.noise_tp, "resync_from": self.resync_from, "optim": self.optim}
        trace: dict[str, Any] = {"root": self.root}
        lay = _lay() if self.kind == "ref" else LAYOUTS[self.layout]
        if self.kind == "ref":
            trace.update(noise_samples=self.noise_samples, noise_tp=self.noise_tp)
        if self.resync_from:
            trace["resync_from"] = self.resync_from
        if self.optim:
            from tracer.adapters.megatron import DEFAULT_CAPTURE
            trace["capture"] = DEFAULT_CAPTURE + ("optim",)
        return {"layout": lay, "steps": self.steps, "seed": self.seed, "dtype": self.dtype, "trace": trace,
                "bug": self.bug, "model": _model(self.layout)}


def _job_worker(rank: int, world: int, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Gloo worker: each job through the demo's trace worker, timed (wall seconds per job)."""
    from examples.megatron_cpu.demo import _trace_worker
    from examples.torch_parallel.run import trace_job
    from examples.torchtitan_cpu.run import trace_job as titan_trace_job
    out = []
    for job in jobs:
        t = time.perf_counter()
        if job.get("harness") == "torch":
            rec = trace_job(job)
        elif job.get("harness") == "titan":
            rec = titan_trace_job(job)
        else:
            rec = _trace_worker(rank, world, [job])[0]
        out.append({**rec, "wall_s": time.perf_counter() - t})
    return out


def run_jobs(jobs: list[Job], log: Callable[[str], None] = print) -> dict[str, dict[str, Any]]:
    """Run ``jobs``: one gloo launch per harness and world size (references first); results by ``root``.

    Each result has ``wall_s`` (the job's wall time on rank 0, build included), ``losses`` and
    ``launch_s`` (the whole launch, start-up included, shared by its jobs)."""
    from examples.gloo import run_gloo
    out: dict[str, dict[str, Any]] = {}
    for harness, world in sorted({(j.harness, j.world) for j in jobs}):
        batch = [j for j in jobs if (j.harness, j.world) == (harness, world)]
        log(f"  launch {harness} world {world}: {len(batch)} run(s) "
            f"({', '.join(sorted({j.layout for j in batch}))})")
        t = time.perf_counter()
        per_rank = run_gloo(_job_worker, world, [j.spec() for j in batch], timeout_s=LAUNCH_TIMEOUT_S)
        launch_s = time.perf_counter() - t
        log(f"  launch {harness} world {world} done in {launch_s:.0f} s")
        for j, rec in zip(batch, per_rank[0]):
            out[j.root] = {**rec, "launch_s": launch_s}
    return out


def _satisfies(needs: dict[str, Any], layout: dict[str, Any]) -> bool:
    """Numbers in ``needs`` are minimums (``{"tp": 2}``: TP >= 2), booleans must be equal;
    ``dtype`` is not a layout property and is ignored here."""
    for k, v in needs.items():
        if k == "dtype":
            continue
        have = layout.get(k, False if isinstance(v, bool) else 1)
        if isinstance(v, bool):
            if bool(have) != v:
                return False
        elif int(have) < int(v):
            return False
    return True


def pick_layout(b: Bug, names: list[str]) -> str | None:
    """The first layout among ``names`` with the smallest world that satisfies ``b.needs``; a
    plain-PyTorch or torchtitan-style bug names its layout (``needs["layout"]``)."""
    if "layout" in b.needs:
        name = (TITAN if TITAN_BUGS.get(b.name) is b else TORCH) + b.needs["layout"]
        return name if name in names else None
    ok = [n for n in names if _harness(n) == "megatron" and _satisfies(b.needs, LAYOUTS[n])]
    return min(ok, key=lambda n: (_world(LAYOUTS[n]), names.index(n))) if ok else None


@dataclass
class CleanRow:
    """One (layout, dtype) row of the clean matrix, over its seeds."""

    layout: str
    dtype: str
    seeds: list[int]
    steps: int
    tensors: int = 0
    over: int = 0                  # not ok and not unchecked (over, nonfinite, replicas)
    unchecked: int = 0
    unmatched: int = 0
    max_ratio: float = 0.0         # largest finite error/threshold over all compared tensors
    worst: str = ""
    max_ratio_noise: float = math.nan  # the same over tensors whose threshold comes from noise samples
    worst_noise: str = ""              # (the others, which no sample moved, get one ulp per element)
    trace_s: float = 0.0           # traced runs' wall time (sum over seeds, build included)
    compare_s: float = 0.0
    false_positives: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class BugRow:
    """One bug's detection result."""

    bug: str
    catalogue: str
    bug_class: str
    layout: str
    dtype: str
    expected: str
    found: str = ""
    detected: bool = False
    placed: bool = False           # detected at the declared phase and name
    ratio: float = math.nan        # error/threshold at the first divergence
    status: str = ""
    replicas_drift: bool = False
    localisation: str = ""
    trace_s: float = 0.0
    compare_s: float = 0.0
    note: str = ""


def _ref_root(out: Path, seed: int, dtype: str, layout: str = "reference") -> Path:
    """Trace directory of the reference of ``layout`` (a clean layout or a reference's name)."""
    ref = _reference_of(layout)
    if ref.startswith(TORCH):
        return out / f"ref_torch_{Layout.parse(ref[len(TORCH):]).reference().name}_{dtype}_s{seed}"
    if ref.startswith(TITAN):
        return out / f"ref_titan_{TitanLayout.parse(ref[len(TITAN):]).reference().name}_{dtype}_s{seed}"
    return out / (f"ref_{dtype}_s{seed}" if ref == "reference" else f"ref_vpp-model_{dtype}_s{seed}")


def _compare(ref: Path, cand: Path):
    from tracer.compare.check import compare
    t = time.perf_counter()
    c = compare(ref, cand)
    return c, time.perf_counter() - t


#: the reference trace of a candidate: (candidate trace, its layout, seed, dtype) -> directory
ReferenceOf = Callable[[Path, str, int, str], Path]


def clean_rows(rows: list[tuple[str, str]], seeds: list[int], steps: int, out: Path,
               results: dict[str, dict[str, Any]], keep: bool, log: Callable[[str], None],
               reference: ReferenceOf) -> list[CleanRow]:
    """Compare every traced clean candidate with its reference and aggregate per row."""
    table = []
    for name, dtype in rows:
        row = CleanRow(name, dtype, list(seeds), steps)
        for seed in seeds:
            cand = out / f"clean_{name}_{dtype}_s{seed}"
            try:
                c, dt = _compare(reference(cand, name, seed, dtype), cand)
            except TraceError as exc:  # a refused comparison is a failed row, never a crash of the benchmark
                row.over += 1
                row.false_positives.append({"seed": seed, "step": -1, "phase": "-", "name": "-", "microbatch": -1,
                                            "status": "refused", "ratio": math.inf, "note": str(exc)[:300]})
                log(f"  clean {name} {dtype} seed {seed}: REFUSED: {str(exc)[:300]}")
                continue
            row.compare_s += dt
            row.trace_s += results[str(cand)]["wall_s"]
            row.tensors += len(c.rows)
            row.unmatched += len(c.unmatched)
            for r in c.rows:
                if r.status == "unchecked":
                    row.unchecked += 1
                    continue
                if math.isfinite(r.ratio) and r.ratio > row.max_ratio:
                    row.max_ratio, row.worst = r.ratio, f"seed {seed} {r.label}"
                modelled = r.factor != 1.0  # noise_threshold's F factor; unmodelled_threshold sets 1
                if modelled and math.isfinite(r.ratio) and not r.ratio <= row.max_ratio_noise:
                    row.max_ratio_noise, row.worst_noise = r.ratio, f"seed {seed} {r.label}"
                if r.status != "ok":
                    row.over += 1
                    row.false_positives.append({"seed": seed, "step": r.step, "phase": r.phase, "name": r.name,
                                                "microbatch": r.microbatch, "status": r.status, "ratio": r.ratio,
                                                "note": r.note})
            if not keep:
                shutil.rmtree(cand, ignore_errors=True)
        flag = "OK" if row.over == 0 else f"FALSE POSITIVES: {row.over}"
        log(f"  clean {name:24s} {dtype}: {row.tensors} tensors, {row.over} over, max ratio "
            f"{row.max_ratio:.3f} ({row.worst}), among noise thresholds {row.max_ratio_noise:.3f} "
            f"({row.worst_noise}); traced {row.trace_s:.0f} s, compared {row.compare_s:.0f} s  {flag}")
        for fp in row.false_positives[:5]:
            log(f"    over: seed {fp['seed']} step {fp['step']} {fp['phase']} {fp['name']} (mb {fp['microbatch']}) "
                f"status {fp['status']} ratio {fp['ratio']:.3g} {fp['note']}")
        table.append(row)
    return table


def bug_rows(placed: list[tuple[str, str]], out: Path, results: dict[str, dict[str, Any]], keep: bool,
             log: Callable[[str], None], reference: ReferenceOf) -> list[BugRow]:
    """Compare every traced bug run with its reference; check the declared first divergence."""
    table = []
    for name, lay in placed:
        b = BUGS[name]
        dtype = b.needs.get("dtype", BUG_DTYPE)
        step = "" if b.expected_step is None else f" (step {b.expected_step})"
        row = BugRow(name, b.catalogue, b.bug_class, lay, dtype, f"{b.expected_phase} {b.expected_name}{step}")
        cand = out / f"bug_{name}"
        row.trace_s = results[str(cand)]["wall_s"]
        try:
            c, row.compare_s = _compare(reference(cand, lay, BUG_SEED, dtype), cand)
        except TraceError as exc:  # refused (fail closed): not a placed detection; reported, not a crash
            row.status, row.note = "refused", str(exc)[:300]
            log(f"  bug {name} on {lay}: REFUSED: {row.note}")
            table.append(row)
            continue
        f = c.first
        row.detected = f is not None
        row.replicas_drift = any(r.status == "replicas" or "replicas over" in r.note for r in c.rows)
        if f is not None:
            row.found = f"{f.phase} {f.name} (step {f.step}, mb {f.microbatch})"
            row.placed = (f.phase == b.expected_phase and fnmatch.fnmatchcase(f.name, b.expected_name)
                          and b.expected_step in (None, f.step))
            row.ratio, row.status, row.localisation = f.ratio, f.status, c.localisation
        verdict = ("placed" if row.placed else "MISPLACED") if row.detected else "MISSED"
        log(f"  bug {name:36s} on {lay}: {verdict}; expected {row.expected}, found {row.found or '-'} "
            f"({row.status}, ratio {row.ratio:.3g}); replicas drift: {row.replicas_drift}; "
            f"traced {row.trace_s:.0f} s, compared {row.compare_s:.0f} s")
        if not keep:
            shutil.rmtree(cand, ignore_errors=True)
        table.append(row)
    return table


# --- markdown ----------------------------------------------------------------------------------

def _fmt_ratio(x: float) -> str:
    if not math.isfinite(x):
        return "inf" if x > 0 else "-"
    return f"{x:.3g}"


def clean_markdown(rows: list[CleanRow], command: str, total_s: float) -> str:
    """The clean-matrix table."""
    lines = [f"Produced by `{command}` ({total_s / 60:.1f} min on this machine, 2 CPU cores shared).", "",
             ("| layout | dtype | seeds x steps | tensors compared | over threshold | unchecked | largest "
              "error/threshold (safety margin) | at | largest among noise-sample thresholds | at | traced s | "
              "compare s |"),
             "|---|---|---|---:|---:|---:|---:|---|---:|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.layout} | {r.dtype} | {len(r.seeds)} x {r.steps} | {r.tensors} | {r.over} | {r.unchecked} | "
                     f"{_fmt_ratio(r.max_ratio)} | {r.worst} | {_fmt_ratio(r.max_ratio_noise)} | "
                     f"{r.worst_noise or 'not recorded'} | {r.trace_s:.0f} | {r.compare_s:.0f} |")
    fps = [(r, fp) for r in rows for fp in r.false_positives]
    lines += ["", (f"False positives: {len(fps)} tensor(s) over threshold in "
                   f"{sum(r.tensors for r in rows)} compared; {sum(r.unchecked for r in rows)} unchecked (no "
                   "noise sample traced them, or they consume or follow a top-k choice that legitimately "
                   "changed: tracer.compare.decisions).")]
    for r, fp in fps[:20]:
        lines.append(f"- {r.layout} {r.dtype} seed {fp['seed']} step {fp['step']} {fp['phase']} {fp['name']} "
                     f"(mb {fp['microbatch']}): {fp['status']}, ratio {_fmt_ratio(fp['ratio'])} {fp['note']}")
    return "\n".join(lines)


def bug_markdown(rows: list[BugRow], command: str, total_s: float) -> str:
    """The bug table."""
    n, det = len(rows), sum(r.detected for r in rows)
    placed = sum(r.placed for r in rows)
    lines = [(f"Produced by `{command}` ({total_s / 60:.1f} min on this machine); each bug in "
              f"{BUG_DTYPE} (unless its layout names another dtype), seed {BUG_SEED}, on the smallest layout "
              "that satisfies its `needs`."), "",
             ("| bug | catalogue | class | layout | detected | first divergence expected | found | "
              "error/threshold there | replicas drift |"),
             "|---|---|---|---|---|---|---|---:|---|"]
    for r in rows:
        mark = ("yes" if r.placed else "yes, elsewhere") if r.detected else "**no**"
        layout = r.layout if r.dtype == BUG_DTYPE else f"{r.layout} ({r.dtype})"
        lines.append(f"| `{r.bug}` | {r.catalogue} | {r.bug_class} | {layout} | {mark} | {r.expected} | "
                     f"{r.found or '-'} | {_fmt_ratio(r.ratio)}{' (' + r.status + ')' if r.status else ''} | "
                     f"{'yes' if r.replicas_drift else 'no'} |")
    lines += ["", f"Detected {det}/{n}; first divergence at the declared phase and tensor: {placed}/{n}."]
    return "\n".join(lines)


def write_page(path: Path, blocks: dict[str, str]) -> Path:
    """Replace the ``<!-- detection:NAME:begin/end -->`` blocks of ``path``; other text is left
    alone (the page's prose is written by hand: ``docs/detection.md``)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such page; --write replaces the tables of an existing page "
                                "(docs/detection.md) between its <!-- detection:NAME:begin/end --> markers")
    text = path.read_text()
    for name, body in blocks.items():
        begin, end = f"<!-- detection:{name}:begin -->", f"<!-- detection:{name}:end -->"
        if begin not in text or end not in text:
            raise ValueError(f"{path} has no {begin} ... {end} block")
        head, rest = text.split(begin, 1)
        text = head + begin + "\n" + body.strip() + "\n" + end + rest.split(end, 1)[1]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _render(summary: dict[str, Any], write: str | None) -> int:
    """Print (and with ``write``, write) the tables of a ``detection.json``; exit status as the run's."""
    clean = [CleanRow(**r) for r in summary["clean"]]
    bugrows = [BugRow(**r) for r in summary["bugs"]]
    blocks = {}
    if clean:
        blocks["clean"] = clean_markdown(clean, summary["command"], summary["total_s"])
    if bugrows:
        blocks["bugs"] = bug_markdown(bugrows, summary["command"], summary["total_s"])
    print("\n\n".join(blocks.values()))
    if write:
        _log(f"wrote {write_page(Path(write), blocks)}")
    return 1 if (sum(r.over for r in clean) or any(not r.placed for r in bugrows)) else 0


# --- command line -------------------------------------------------------------------------------

def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.detection", description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["clean", "detect", "all"])
    ap.add_argument("--quick", action="store_true", help="the CI subset (see the module docstring)")
    ap.add_argument("--bug", nargs="+", action="extend", choices=sorted(BUGS), metavar="NAME",
                    help="bug(s) to run, repeatable (default: all): " + ", ".join(sorted(BUGS)))
    ap.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), metavar="LAYOUT",
                    help="clean layouts (default: all): " + ", ".join(sorted(LAYOUTS)))
    ap.add_argument("--seeds", nargs="+", type=int, default=None, help=f"default {list(SEEDS)}")
    ap.add_argument("--dtypes", nargs="+", choices=DTYPES, default=None, help=f"default {list(DTYPES)}")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--noise-samples", type=int, default=NOISE_SAMPLES)
    ap.add_argument("--resync", action="store_true",
                    help="every candidate gets a reference of its own, re-synchronised to it at every step "
                         "(tracer.capture.resync), instead of one shared reference per seed and dtype")
    ap.add_argument("--out", default="out/detection", help="trace directory (replaced)")
    ap.add_argument("--keep-traces", action="store_true", help="keep candidate traces after comparing")
    ap.add_argument("--write", default=None, help="markdown page whose tables are replaced")
    ap.add_argument("--from-json", default=None,
                    help="run nothing: render the tables of an earlier run's detection.json (with --write)")
    a = ap.parse_args(argv)
    if a.from_json:
        return _render(json.loads(Path(a.from_json).read_text()), a.write)
    args = list(argv if argv is not None else sys.argv[1:])
    shown = [x for i, x in enumerate(args) if x != "--write" and (i == 0 or args[i - 1] != "--write")
             and not x.startswith("--write=")]
    command = "python -m bench.detection " + " ".join(shlex.quote(x) for x in shown)
    do_clean, do_bugs = a.command in ("clean", "all"), a.command in ("detect", "all")
    if a.quick:
        rows = list(QUICK_ROWS)
        seeds = a.seeds or [0]
        bugs = a.bug or list(QUICK_BUGS)
        bug_layouts = sorted({n for n, _ in QUICK_ROWS}, key=list(LAYOUTS).index)
    else:
        names = a.layouts or list(LAYOUTS)
        rows = [(n, d) for n in names for d in (a.dtypes or DTYPES) if d in _dtypes(n)]
        seeds = a.seeds or list(SEEDS)
        bugs = a.bug or list(BUGS)
        bug_layouts = names
    if not do_clean:
        rows = []
    placed: list[tuple[str, str]] = []
    skipped: list[str] = []
    if a.resync:  # the torchtitan-style harness does not trace optimizer state: no re-synchronised reference
        titan_rows = sorted({n for n, _ in rows if _harness(n) == "titan"})
        rows = [(n, d) for n, d in rows if _harness(n) != "titan"]
        bug_layouts = [n for n in bug_layouts if _harness(n) != "titan"]
        skipped += [f"layout {n}: --resync is not supported on the torchtitan-style harness" for n in titan_rows]
    for name in (bugs if do_bugs else []):
        lay = pick_layout(BUGS[name], bug_layouts)
        if lay is None:
            skipped.append(f"bug {name}: no layout among {bug_layouts} satisfies {BUGS[name].needs}")
        else:
            placed.append((name, lay))
    out = Path(a.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    # one reference per (reference layout, seed, dtype): megatron's, and one per model-feature set
    # of the plain-PyTorch layouts; each models a TP split of the largest TP of its harness
    cands = [(n, d, s) for n, d in rows for s in seeds] + [
        (lay, BUGS[n].needs.get("dtype", BUG_DTYPE), BUG_SEED) for n, lay in placed]
    noise_tp = {h: max([_tp(n) for n, _, _ in cands if _harness(n) == h] + [1]) for h in ("megatron", "torch")}
    if any(_harness(n) == "titan" for n, _, _ in cands):  # and the largest data-parallel size
        noise_tp["titan"] = max(_tp(n) for n, _, _ in cands if _harness(n) == "titan")
    noise_dp = max([_dp(n) for n, _, _ in cands if _harness(n) == "titan"] + [1])
    def reference(cand: Path, layout: str, seed: int, dtype: str) -> Path:
        return Path(f"{cand}_ref") if a.resync else _ref_root(out, seed, dtype, layout)

    refs = [] if a.resync else sorted({(_reference(n), s, d) for n, d, s in cands})
    jobs = [Job("ref", r, s, d, a.steps, str(_ref_root(out, s, d, r)), noise_samples=a.noise_samples,
                noise_tp=noise_tp[_harness(r)], noise_dp=noise_dp) for r, s, d in refs]
    jobs += [Job("clean", n, s, d, a.steps, str(out / f"clean_{n}_{d}_s{s}"), optim=a.resync)
             for n, d in rows for s in seeds]
    jobs += [Job("bug", lay, BUG_SEED, BUGS[n].needs.get("dtype", BUG_DTYPE), a.steps, str(out / f"bug_{n}"),
                 bug=n, optim=a.resync) for n, lay in placed]
    # re-synchronised references run after their candidates, whose traces they load
    synced_refs = [Job("ref", _reference(j.layout), j.seed, j.dtype, a.steps, str(reference(Path(j.root), j.layout,
                                                                                          j.seed, j.dtype)),
                       noise_samples=a.noise_samples, noise_tp=noise_tp[j.harness], noise_dp=noise_dp,
                       resync_from=j.root)
                   for j in jobs if j.optim]
    t0 = time.perf_counter()
    _log(f"detection benchmark: {len(rows)} clean row(s) x {len(seeds)} seed(s), {len(placed)} bug(s), "
         f"{a.steps} steps, {len(refs) + len(synced_refs)} reference(s) ({len(synced_refs)} re-synchronised) "
         f"with {a.noise_samples} noise samples (TP {noise_tp}"
         + (f", torchtitan-style DP {noise_dp})" if "titan" in noise_tp else ")"))
    for s in skipped:
        _log(f"  skipped {s}")
    results = run_jobs(jobs, log=_log)
    results.update(run_jobs(synced_refs, log=_log) if synced_refs else {})
    traced_s = time.perf_counter() - t0
    _log(f"traced everything in {traced_s:.0f} s; comparing")
    clean = clean_rows(rows, seeds, a.steps, out, results, a.keep_traces, _log, reference) if rows else []
    bugrows = bug_rows(placed, out, results, a.keep_traces, _log, reference) if placed else []
    total = time.perf_counter() - t0
    fps = sum(r.over for r in clean)
    bad = [r.bug for r in bugrows if not r.placed]
    summary = {"command": command, "total_s": total, "traced_s": traced_s, "noise_tp": noise_tp, "resync": a.resync,
               "clean": [asdict(r) for r in clean], "bugs": [asdict(r) for r in bugrows], "skipped": skipped,
               "launches_s": sorted({(j.world, round(results[j.root]["launch_s"], 1)) for j in jobs + synced_refs})}
    (out / "detection.json").write_text(json.dumps(summary, indent=1, default=str))
    if clean:
        print("\n" + clean_markdown(clean, command, total))
    if bugrows:
        print("\n" + bug_markdown(bugrows, command, total))
    if a.write:
        blocks = {}
        if clean:
            blocks["clean"] = clean_markdown(clean, command, total)
        if bugrows:
            blocks["bugs"] = bug_markdown(bugrows, command, total)
        _log(f"wrote {write_page(Path(a.write), blocks)}")
    _log(f"done in {total:.0f} s: {fps} false positive tensor(s); missed or misplaced bugs: {bad or 'none'}")
    return 1 if (fps or bad) else 0


if __name__ == "__main__":
    sys.exit(main())
