"""Distributed references: a trusted multi-rank layout as the reference of another (issue 32, part 3).

    python -m bench.distributed_reference [--quick] [--pairs NAME ...] [--out DIR] [--write docs/distributed-reference.md]

For every registered *pair* (:data:`PAIRS`): trace the reference layout with its own noise samples
(taken on all its ranks in lockstep, modelling its own split and the candidate's), trace each clean
candidate layout, and each bug of the pair on its bug layout, then compare every candidate with
the reference (:func:`tracer.compare.check.compare`, which accepts a multi-rank reference that
carries its own samples: docs/distributed-reference.md). Prints (and with ``--write`` writes into
the page's ``<!-- detection:distref-*:begin/end -->`` blocks) two tables: per pair, candidate and
dtype the tensors compared, how many are over threshold (goal 0) and the largest error/threshold;
per bug, its declared first divergence and the one found.

Runs go through :func:`examples.gloo.run_gloo`, one launch per world size with every job of that
size batched (references and candidates alike: nothing depends on another run's trace).

Adding a pair
-------------
A pair names a *harness* (:data:`HARNESSES`): a trace-job function called on every rank of a launch
with one job dict, ``{"harness", "layout", "dtype", "seed", "steps", "root", "bug", "noise_samples",
"noise_split"}`` (the form :func:`examples.torch_parallel.run.trace_job` takes; ``noise_samples > 0``
on the reference only, ``noise_split`` the candidate's split the samples must model), the number of
ranks a layout needs, and the bug registry whose ``expected_phase``/``expected_name``/``expected_step``
the bug rows are checked against. A PyTorch-native pair, FSDP2 over 2 ranks as the reference of
FSDP2 x TP, is about ten lines (``titan-fsdp2-vs-fsdp2xtp2`` below)::

    HARNESSES["titan"] = Harness("bench.distributed_reference:titan_trace_job",  # job dict -> dict
                                 _titan_world,                                   # ranks of a layout
                                 "examples.torchtitan_cpu.bugs:BUGS")
    PAIRS["titan-fsdp2-vs-fsdp2xtp2"] = Pair(harness="titan", reference="r1.s2.t1",
                                             candidates=("r1.s2.t2+sp", "r2.s2.t1"), noise_split=2, noise_dp=4,
                                             bugs=("sp_rope_rank_offset", ...), bug_layout="r1.s2.t2+sp",
                                             bug_layouts=(("hsdp_divide_factor_shard_only", "r2.s2.t1"), ...))

(``bug_layouts``: a bug injected into another candidate than ``bug_layout``; ``noise_dp``: the
candidates' data-parallel size, for a harness whose noise models it.)
"""
from __future__ import annotations

import argparse
import fnmatch
import importlib
import json
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.detection import _fmt_ratio, _log, write_page

__all__ = ["HARNESSES", "PAIRS", "Harness", "Pair", "megatron_layout", "megatron_trace_job", "run_pairs",
           "titan_trace_job"]

LAUNCH_TIMEOUT_S = 3600


def megatron_layout(name: str) -> dict[str, Any]:
    """``"tp4.sp"`` -> ``{"tp": 4, "pp": 1, "dp": 1, "sp": True, "distopt": False}`` (tokens
    ``tpN``, ``ppN``, ``dpN``, ``vppN``, ``sp``, ``distopt``, separated by dots)."""
    out: dict[str, Any] = {"tp": 1, "pp": 1, "dp": 1, "sp": False, "distopt": False}
    for tok in name.split("."):
        if tok in ("sp", "distopt"):
            out[tok] = True
        elif tok[:3] == "vpp" and tok[3:].isdigit():
            out["vpp"] = int(tok[3:])
        elif tok[:2] in ("tp", "pp", "dp") and tok[2:].isdigit():
            out[tok[:2]] = int(tok[2:])
        else:
            raise ValueError(f"bad megatron layout token {tok!r} in {name!r}")
    return out


def megatron_trace_job(job: dict[str, Any]) -> dict[str, Any]:
    """The megatron-core CPU harness's trace job (:func:`examples.megatron_cpu.demo._trace_worker`)
    for a job dict of this module (module doc); a reference job (``noise_samples > 0``) models its
    own TP split and the candidate's ``noise_split`` (:mod:`examples.megatron_cpu.traced`)."""
    from examples.megatron_cpu.demo import _trace_worker
    import torch.distributed as dist
    trace: dict[str, Any] = {"root": job["root"]}
    if job.get("noise_samples"):
        trace.update(noise_samples=int(job["noise_samples"]), noise_tp=int(job["noise_split"]))
    spec = {"layout": megatron_layout(job["layout"]), "steps": job["steps"], "seed": job["seed"],
            "dtype": job["dtype"], "trace": trace, "bug": job.get("bug")}
    return _trace_worker(dist.get_rank(), dist.get_world_size(), [spec])[0]


def titan_trace_job(job: dict[str, Any]) -> dict[str, Any]:
    """The torchtitan-style harness's trace job (:func:`examples.torchtitan_cpu.run.trace_job`) for a
    job dict of this module: ``noise_split`` is the candidates' largest TP (``noise_tp``), ``noise_dp``
    their largest data-parallel size; a reference job models its own layout's split as well."""
    from examples.torchtitan_cpu.run import trace_job
    return trace_job({**job, "noise_tp": int(job.get("noise_split", 1)), "noise_dp": int(job.get("noise_dp", 1))})


def _titan_world(layout: str) -> int:
    from examples.torchtitan_cpu.parallelize import Layout
    return Layout.parse(layout).world


@dataclass(frozen=True)
class Harness:
    """How to run one harness's jobs (module doc, "Adding a pair")."""

    trace_job: str                     # "module:function", job dict -> dict, called on every rank
    world: Callable[[str], int]        # ranks a layout needs
    bugs: str                          # "module:REGISTRY" of the harness's bugs


def _torch_world(layout: str) -> int:
    from examples.torch_parallel.layout import Layout
    return Layout.parse(layout).world


HARNESSES: dict[str, Harness] = {
    "megatron": Harness("bench.distributed_reference:megatron_trace_job",
                        lambda lay: math.prod(megatron_layout(lay)[k] for k in ("tp", "pp", "dp")),
                        "examples.megatron_cpu.bugs:BUGS"),
    "torch": Harness("examples.torch_parallel.run:trace_job", _torch_world, "examples.torch_parallel.bugs:BUGS"),
    "titan": Harness("bench.distributed_reference:titan_trace_job", _titan_world, "examples.torchtitan_cpu.bugs:BUGS"),
}


@dataclass(frozen=True)
class Pair:
    """A reference layout, the candidate layouts checked against it, and the bugs injected into
    ``bug_layout`` (one of the candidates), in the harness's own layout names."""

    harness: str
    reference: str
    candidates: tuple[str, ...]
    noise_split: int                   # the candidates' largest split, modelled by the reference's samples
    bugs: tuple[str, ...] = ()
    bug_layout: str | None = None
    #: per bug, a candidate other than ``bug_layout`` to inject it into (e.g. the layout its registry names)
    bug_layouts: tuple[tuple[str, str], ...] = ()
    noise_dp: int = 1                  # the candidates' largest data-parallel size (harnesses that model it)
    dtypes: tuple[str, ...] = ("bf16", "fp32")
    bug_dtype: str = "bf16"
    noise_samples: int = 4
    steps: int = 2
    quick: bool = True                 # part of --quick (one seed), which should stay under ~3 minutes

    def layout_of(self, bug: str) -> str:
        """The candidate layout ``bug`` is injected into."""
        return dict(self.bug_layouts).get(bug) or self.bug_layout or self.candidates[0]


PAIRS: dict[str, Pair] = {
    # megatron-core TP=2 as the reference of TP=4 (with and without sequence parallelism)
    "megatron-tp2-vs-tp4": Pair(
        harness="megatron", reference="tp2", candidates=("tp4.sp", "tp4"), noise_split=4,
        bugs=("sp_norm_grad_not_reduced", "vocab_ce_local_denominator", "sp_allgather_reversed",
              "grad_norm_undercounts_tp_shards"), bug_layout="tp4.sp"),
    # PyTorch-native (torchtitan-style harness): FSDP2 over 2 ranks as the reference of FSDP2 x TP
    # with sequence parallelism (2 x 2) and of HSDP (2 replicas x 2 shards); each bug on the candidate
    # its registry names (needs["layout"]) where that is one of them, else on one with the parallel
    # dimensions it needs
    "titan-fsdp2-vs-fsdp2xtp2": Pair(
        harness="titan", reference="r1.s2.t1", candidates=("r1.s2.t2+sp", "r2.s2.t1"), noise_split=2, noise_dp=4,
        bugs=("sp_rope_rank_offset", "hsdp_divide_factor_shard_only", "clip_grad_norm_local_shards",
              "fsdp_avg_reduces_as_sum"),
        bug_layout="r1.s2.t2+sp", bug_layouts=(("hsdp_divide_factor_shard_only", "r2.s2.t1"),
                                               ("fsdp_avg_reduces_as_sum", "r2.s2.t1")),
        quick=False),  # 3.4 min for 3 seeds; with megatron's, one seed of both is over 3 minutes
}


def _resolve(path: str) -> Any:
    mod, _, attr = path.partition(":")
    return getattr(importlib.import_module(mod), attr)


def _job_worker(rank: int, world: int, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Gloo worker: each job through its harness's trace job, timed."""
    out = []
    for job in jobs:
        t = time.perf_counter()
        rec = _resolve(HARNESSES[job["harness"]].trace_job)(job)
        out.append({"root": job["root"], "losses": [float(x) for x in (rec or {}).get("losses", [])],
                    "wall_s": time.perf_counter() - t})
    return out


@dataclass
class Run:
    """One traced run of a pair."""

    pair: str
    kind: str                          # ref | clean | bug
    layout: str
    dtype: str
    seed: int
    root: str
    bug: str | None = None

    def job(self, p: Pair) -> dict[str, Any]:
        return {"harness": p.harness, "layout": self.layout, "dtype": self.dtype, "seed": self.seed,
                "steps": p.steps, "root": self.root, "bug": self.bug,
                "noise_samples": p.noise_samples if self.kind == "ref" else 0, "noise_split": p.noise_split,
                "noise_dp": p.noise_dp}


def plan(names: list[str], seeds: list[int], out: Path) -> list[Run]:
    """Every run of the pairs ``names``: per dtype and seed a reference and the clean candidates;
    the bugs on ``bug_layout`` in ``bug_dtype`` at the first seed."""
    runs = []
    for name in names:
        p = PAIRS[name]
        for dtype in p.dtypes:
            for seed in seeds:
                ref = str(out / name / f"ref_{p.reference}_{dtype}_s{seed}")
                runs.append(Run(name, "ref", p.reference, dtype, seed, ref))
                runs += [Run(name, "clean", c, dtype, seed, str(out / name / f"cand_{c}_{dtype}_s{seed}"))
                         for c in p.candidates]
        runs += [Run(name, "bug", p.layout_of(b), p.bug_dtype, seeds[0],
                     str(out / name / f"bug_{b}_{p.bug_dtype}_s{seeds[0]}"), b) for b in p.bugs]
    return runs


def launch(runs: list[Run], log: Callable[[str], None] = _log) -> dict[str, dict[str, Any]]:
    """One gloo launch per world size (every job of that size batched); results by ``root``."""
    from examples.gloo import run_gloo
    by_world: dict[int, list[Run]] = {}
    for r in runs:
        p = PAIRS[r.pair]
        by_world.setdefault(HARNESSES[p.harness].world(r.layout), []).append(r)
    out: dict[str, dict[str, Any]] = {}
    for world, batch in sorted(by_world.items()):
        log(f"launch world {world}: {len(batch)} run(s)")
        t = time.perf_counter()
        per_rank = run_gloo(_job_worker, world, [r.job(PAIRS[r.pair]) for r in batch], timeout_s=LAUNCH_TIMEOUT_S)
        log(f"launch world {world} done in {time.perf_counter() - t:.0f} s")
        out.update({rec["root"]: rec for rec in per_rank[0]})
    return out


@dataclass
class CleanRow:
    pair: str
    reference: str
    candidate: str
    dtype: str
    seeds: list[int]
    steps: int
    tensors: int = 0
    over: int = 0
    max_ratio: float = 0.0
    worst: str = ""
    compare_s: float = 0.0
    false_positives: list[str] = field(default_factory=list)


@dataclass
class BugRow:
    pair: str
    bug: str
    candidate: str
    dtype: str
    expected: str
    found: str
    ratio: float
    placed: bool


def _expected(b: Any) -> str:
    step = f"step {b.expected_step} " if b.expected_step is not None else ""
    return f"{step}{b.expected_phase} {b.expected_name}"


def judge(runs: list[Run], log: Callable[[str], None] = _log) -> tuple[list[CleanRow], list[BugRow]]:
    """Compare every candidate with its reference; the two tables' rows. Compares on one thread:
    on this shared 2-core machine torch's intra-op threads made the block-scale pass of whole noise
    samples (a distributed reference's) ~15x slower under load (146 s vs 10 s for one comparison)."""
    import torch
    from tracer.compare.check import compare
    torch.set_num_threads(1)
    refs = {(r.pair, r.dtype, r.seed): Path(r.root) for r in runs if r.kind == "ref"}
    clean: dict[tuple, CleanRow] = {}
    bugs = []
    for r in runs:
        if r.kind == "ref":
            continue
        p = PAIRS[r.pair]
        t = time.perf_counter()
        c = compare(refs[(r.pair, r.dtype, r.seed)], r.root)
        dt = time.perf_counter() - t
        if r.kind == "clean":
            row = clean.setdefault((r.pair, r.layout, r.dtype), CleanRow(r.pair, p.reference, r.layout, r.dtype, [],
                                                                        p.steps))
            row.seeds.append(r.seed)
            row.tensors += len(c.rows)
            bad = [x for x in c.rows if str(x.status) not in ("ok",)]
            row.over += len(bad)
            row.false_positives += [f"seed {r.seed}: {x.label} {x.status} ratio {_fmt_ratio(x.ratio)}" for x in bad]
            worst = max((x for x in c.rows if math.isfinite(x.ratio)), key=lambda x: x.ratio, default=None)
            if worst is not None and worst.ratio >= row.max_ratio:
                row.max_ratio, row.worst = worst.ratio, f"seed {r.seed}: {worst.label}"
            row.compare_s += dt
            log(f"{r.pair} {r.layout} {r.dtype} seed {r.seed}: {c.verdict}, {len(c.rows)} tensors, largest ratio "
                f"{_fmt_ratio(c.max_ratio_ok)} ({dt:.1f} s)")
        else:
            b = _resolve(HARNESSES[p.harness].bugs)[r.bug]
            f = c.first
            found = "-" if f is None else f"step {f.step} {f.phase} {f.name}"
            placed = f is not None and f.phase == b.expected_phase and fnmatch.fnmatchcase(f.name, b.expected_name) \
                and (b.expected_step is None or f.step == b.expected_step)
            bugs.append(BugRow(r.pair, r.bug, r.layout, r.dtype, _expected(b), found,
                               math.nan if f is None else f.ratio, placed))
            log(f"{r.pair} bug {r.bug}: {c.verdict}, first {found} (expected {_expected(b)}) ({dt:.1f} s)")
    return list(clean.values()), bugs


def markdown(clean: list[CleanRow], bugs: list[BugRow], command: str, total_s: float) -> dict[str, str]:
    """The page's two blocks (``distref-clean``, ``distref-bugs``)."""
    lines = [f"Produced by `{command}` ({total_s / 60:.1f} min on this machine, 2 CPU cores shared).", "",
             "| pair | reference | candidate | dtype | seeds x steps | tensors compared | over threshold | "
             "largest error/threshold | at | compare s |", "|---|---|---|---|---|---:|---:|---:|---|---:|"]
    for r in clean:
        lines.append(f"| {r.pair} | {r.reference} | {r.candidate} | {r.dtype} | {len(r.seeds)} x {r.steps} | "
                     f"{r.tensors} | {r.over} | {_fmt_ratio(r.max_ratio)} | {r.worst} | {r.compare_s:.0f} |")
    fps = [fp for r in clean for fp in r.false_positives]
    lines += ["", f"Over threshold: {len(fps)} of {sum(r.tensors for r in clean)} tensors compared."]
    lines += [f"- {fp}" for fp in fps[:20]]
    blines = ["| pair | bug | candidate | dtype | first divergence expected | found | error/threshold there | "
              "at the declared place |", "|---|---|---|---|---|---|---:|---|"]
    for b in bugs:
        blines.append(f"| {b.pair} | `{b.bug}` | {b.candidate} | {b.dtype} | {b.expected} | {b.found} | "
                      f"{_fmt_ratio(b.ratio)} | {'yes' if b.placed else '**no**'} |")
    blines += ["", f"Detected at the declared first divergence: {sum(b.placed for b in bugs)}/{len(bugs)}."]
    return {"distref-clean": "\n".join(lines), "distref-bugs": "\n".join(blines)}


def run_pairs(names: list[str], seeds: list[int], out: Path, log: Callable[[str], None] = _log,
              trace: bool = True) -> tuple[list[CleanRow], list[BugRow]]:
    """Trace (unless ``trace=False``: the traces are under ``out`` already) and compare every run
    of the pairs ``names`` under ``out``."""
    runs = plan(names, seeds, out)
    if trace:
        launch(runs, log)
    return judge(runs, log)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.distributed_reference", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one seed instead of three, the pairs marked quick")
    ap.add_argument("--pairs", nargs="+", default=None, choices=sorted(PAIRS),
                    help="default: every pair (with --quick: those marked quick)")
    ap.add_argument("--out", default=None, help="trace directory (default: a temporary one, removed afterwards)")
    ap.add_argument("--write", default=None, help="replace the tables of this page (docs/distributed-reference.md)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    ap.add_argument("--compare-only", action="store_true", help="compare the traces an earlier run left in --out")
    a = ap.parse_args(argv)
    seeds = [0] if a.quick else [0, 1, 2]
    command = "python -m bench.distributed_reference" + (" --quick" if a.quick else "")
    t0 = time.perf_counter()
    if a.compare_only and not a.out:
        ap.error("--compare-only needs --out (the directory of an earlier run's traces)")
    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="distref_"))
    try:
        names = a.pairs or [n for n in sorted(PAIRS) if PAIRS[n].quick or not a.quick]
        clean, bugs = run_pairs(names, seeds, out, trace=not a.compare_only)
    finally:
        if not a.out:
            shutil.rmtree(out, ignore_errors=True)
    blocks = markdown(clean, bugs, command, time.perf_counter() - t0)
    print("\n\n".join(blocks.values()))
    if a.json:
        Path(a.json).write_text(json.dumps({"clean": [asdict(r) for r in clean], "bugs": [asdict(b) for b in bugs]},
                                           indent=1))
    if a.write:
        _log(f"wrote {write_page(Path(a.write), blocks)}")
    return 1 if (sum(r.over for r in clean) or not all(b.placed for b in bugs)) else 0


if __name__ == "__main__":
    sys.exit(main())
