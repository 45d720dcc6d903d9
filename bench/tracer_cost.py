"""Cost of tracing and comparing, on real megatron-core (CPU/gloo).

    python -m bench.tracer_cost [--quick] [--models demo,large] [--write docs/cost.md] [--out DIR] [--keep]
    python -m bench.tracer_cost --models xl --steps 3 --compare-reps 3 --profile-model xl --write docs/cost-xl.md
    python -m bench.tracer_cost --titan [--steps 6] [--reps 3] [--write docs/cost.md]

Measured by default on two models: the demo model (``examples.megatron_cpu.gpt.DEFAULT_MODEL``)
and a larger one (hidden 256, 4 layers, ffn 1024, seq 128, vocab 1024); ``--models xl`` takes
one whose step is dominated by its GEMMs rather than by per-op overhead (hidden 1024, 4 layers,
ffn 4096, seq 512, vocab 4096: 54M parameters, ~1.3 s a step). In bf16 with fp32 main
params (the demo's dtype), global batch 4 (large, xl: 1) in micro batches of 1, on two layouts: one process
(world 1, tp1) and tp2+sp (world 2). One gloo launch per world size runs every job.

1. **Tracing overhead**: the median wall time of a traced step over that of an untraced
   step (``build_and_train``'s ``step_s``, first step dropped as warm-up; world 2: the
   slowest rank per step), for ``TraceWriter`` mode ``stats`` (manifests only), ``full``
   (tensors too) and ``full`` with ``background=True`` (each step written, and its copies'
   statistics taken, on the writer's thread while the run goes on: ``full_bg``). Modes run in turn, ``--reps`` times in a rotated order, and the measured
   steps of every repetition are pooled, so that a slow patch of a shared machine does not
   land on one mode only.
2. **Trace bytes per step and rank** (manifest + tensor file), full and stats.
3. **Compare throughput**: :func:`tracer.compare.check.compare` of the tp2 candidate against the
   world-1 reference (with its noise samples), in GB of reference + candidate trace (the
   noise samples, also read, in a separate column) per second, over the first
   ``--compare-steps`` steps; then one ``cProfile`` run of a comparison (``--profile-model``,
   default the demo's: the large one takes minutes), split into where the time goes. Stats-only
   tracing and a noise sample are profiled too (demo, 2-step runs).
4. **Cost of the thresholds**: the reference traced with ``S`` noise samples against the
   same reference without them; the difference per step, per noise sample, over a clean
   traced step (a noise sample re-runs the step under ``ttrace_num``'s noise injector, from
   a snapshot of the model and optimizer state).

``--titan`` measures, instead of the above, the torchtitan-style harness (``examples/torchtitan_cpu``,
:class:`tracer.adapters.dtensor.DTensorTracer`) on its FSDP2 x TP layout with sequence parallelism,
``r1.s2.t2+sp`` (world 4), in ``--dtype``: the median step time untraced, traced in ``stats`` and
in ``full`` mode (ratios to the untraced step; the first step of each run dropped as warm-up,
the slowest rank per step, ``--reps`` runs per mode in rotated order, steps pooled) and the trace
bytes per step and rank. Every mode runs the harness's own :meth:`Run.train_step
<examples.torchtitan_cpu.train.Run.train_step>`: the untraced one with :class:`_Untraced`, an object
with the tracer's methods that do nothing (no hooks registered, no writer), so that the step runs
the same model, loss, backward, FSDP2 all-gathers and reduce-scatters, TP/SP collectives, gradient
clipping (``clip_gradients`` is called for its result either way) and optimizer step, and differs
from a traced one only by the tracer's hooks, copies, statistics and writes. With ``--write`` the
section "FSDP2 x TP (torchtitan-style harness)" of that file is replaced (or appended); a full run
with ``--write`` keeps that section of the file it overwrites.

Timings are wall time on whatever the machine gives (the load average is printed): on a
shared 2-core machine they move from run to run (the demo's untraced step took 95 ms in one
run and 330 ms in another under a load average of ~50). They are taken on this machine's own
CPU kernels: the AVX2 pin that ``bench/__init__.py`` sets for the bound models is undone here
(on AVX2, bf16 GEMMs have no native kernel and the larger model's untraced step takes 663 ms
instead of 56 ms, which would flatter every ratio: stats-only 1.34x instead of 4.75x).
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.gloo import run_gloo
from examples.megatron_cpu.gpt import DEFAULT_MODEL, layout_name

def _kernels() -> str:
    """The CPU kernels torch dispatches here."""
    import torch
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "unrestricted")
    return f"ATen {torch.backends.cpu.get_cpu_capability()}, oneDNN {isa}"


MODELS: dict[str, dict[str, int]] = {
    "demo": dict(DEFAULT_MODEL),
    "large": {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "ffn_hidden_size": 1024,
              "vocab_size": 1024, "seq_length": 128},
    "xl": {"num_layers": 4, "hidden_size": 1024, "num_attention_heads": 8, "ffn_hidden_size": 4096,
           "vocab_size": 4096, "seq_length": 512},
}
LAYOUTS: dict[int, dict[str, Any]] = {1: {"tp": 1, "pp": 1, "dp": 1},
                                      2: {"tp": 2, "pp": 1, "dp": 1, "sp": True}}
MODES = ("untraced", "stats", "full", "full_bg")
#: sequences per step (micro batches of 1): the large model takes 1, to keep a bf16 step near 2 s
#: on one CPU thread (with 4 sequences it took ~6.5 s)
GLOBAL_BATCH = {"demo": 4, "large": 1, "xl": 1}
SEED = 1234


def _model_desc(model: str) -> str:
    sizes = MODELS[model]
    return (f"hidden {sizes['hidden_size']}, {sizes['num_layers']} layers, ffn {sizes['ffn_hidden_size']}, "
            f"seq {sizes['seq_length']}, vocab {sizes['vocab_size']}, global batch {GLOBAL_BATCH[model]}")


def _worker(rank: int, world: int, jobs: list[dict]) -> list[dict]:
    """Run every job of one launch; return this rank's step times per job."""
    import warnings
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    from examples.megatron_cpu.gpt import build_and_train
    out = []
    for j in jobs:
        t = time.perf_counter()
        prof = cProfile.Profile() if j.get("profile") else None
        if prof is not None:
            prof.enable()
        r = build_and_train(j["layout"], steps=j["steps"], seed=SEED, dtype=j["dtype"],
                            global_batch=j["global_batch"], trace=j["trace"], **j["sizes"])
        rec = {"step_s": list(r["step_s"]), "build_s": r["build_s"], "total_s": time.perf_counter() - t,
               "amplitudes": [(r.get("trace") or {}).get(k, 0) for k in ("amplitudes_reused", "amplitudes_patched",
                                                                         "amplitudes_computed")],
               "sample_seconds": (r.get("trace") or {}).get("sample_seconds", [])}
        if prof is not None:
            prof.disable()
            rec["profile"] = _profile_text(prof, j["profile"])
        out.append(rec)
        if rank == 0:
            print(f"    [world {world}] {j['model']:5s} {j['label']:12s} steps "
                  f"{' '.join(f'{s:.3f}' for s in r['step_s'])} s", flush=True)
    return out


def _profile_text(prof: cProfile.Profile, restrict: str, n: int = 14) -> str:
    """The ``n`` functions with most own time, then the ``n`` functions of ``restrict`` (a
    regular expression on file paths) with most cumulative time."""
    out = []
    for key, pattern in (("tottime", None), ("cumulative", restrict)):
        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf)
        st.sort_stats(key).print_stats(*((pattern, n) if pattern else (n,)))
        lines = [ln.replace(str(Path(__file__).resolve().parents[1]) + os.sep, "")
                 for ln in buf.getvalue().splitlines() if ln.strip()]
        lines = [ln for ln in lines if not ln.lstrip().startswith(("Ordered by", "List reduced"))]
        out.append(f"-- by {key}" + (f" (files matching {pattern!r})" if pattern else "") + ":\n"
                   + "\n".join(ln[:160] for ln in lines))
    return "\n".join(out)


def _trace_spec(mode: str, root: Path) -> dict | None:
    """The harness's ``trace`` argument for a measured mode (``full_bg``: full, background writer)."""
    if mode == "untraced":
        return None
    return {"root": str(root), "mode": mode.removesuffix("_bg"), "background": mode.endswith("_bg")}


def _jobs(world: int, out: Path, models: list[str], *, steps: int, reps: int, dtype: str, noise_samples: int,
          profile: bool = True) -> list[dict]:
    """The jobs of one launch: every model x mode x repetition (rotated order); on world 1 also
    the reference with noise samples (full mode), which is the comparison's reference."""
    jobs = []
    for model in models:
        for rep in range(reps):
            for i in range(len(MODES)):
                mode = MODES[(i + rep) % len(MODES)]
                root = out / f"w{world}" / model / f"{mode}_r{rep}"
                trace = _trace_spec(mode, root)
                jobs.append({"model": model, "mode": mode, "rep": rep, "label": f"{mode} r{rep}",
                             "layout": LAYOUTS[world], "steps": steps, "dtype": dtype, "trace": trace})
        if world == 1 and noise_samples:
            root = out / "w1" / model / "noise"
            jobs.append({"model": model, "mode": "noise", "rep": 0, "label": f"noise S={noise_samples}",
                         "layout": LAYOUTS[1], "steps": steps, "dtype": dtype,
                         "trace": {"root": str(root), "mode": "full", "noise_samples": noise_samples,
                                   "noise_tp": LAYOUTS[2]["tp"]}})
    if world == 1 and profile and "demo" in models:  # where the tracing and the noise samples spend their time
        for mode, extra in (("stats", {}), ("full", {"noise_samples": 1, "noise_tp": LAYOUTS[2]["tp"]})):
            root = out / "w1" / "demo" / f"profile_{mode}"
            jobs.append({"model": "demo", "mode": f"profile {mode}", "rep": 0, "label": f"profile {mode}",
                         "layout": LAYOUTS[1], "steps": 2, "dtype": dtype, "profile": "tracer/|ttrace_num/",
                         "trace": {"root": str(root), "mode": mode, **extra}})
    for j in jobs:  # the workers re-import this module: give them the sizes, not a name to look up
        j["sizes"], j["global_batch"] = dict(MODELS[j["model"]]), GLOBAL_BATCH[j["model"]]
    return jobs


def _measured(jobs: list[dict], per_rank: list[list[dict]], model: str, mode: str) -> list[float]:
    """Pooled step times (slowest rank per step, warm-up step dropped) of one model and mode."""
    out = []
    for i, j in enumerate(jobs):
        if j["model"] == model and j["mode"] == mode:
            steps = zip(*(r[i]["step_s"] for r in per_rank))
            out += [max(s) for s in steps][1:]
    return out


def trace_bytes(root: Path, rank: int) -> tuple[float, int]:
    """Mean bytes per step of ``rank``'s files (manifest + tensors) under ``root``, and the step count."""
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    if not steps:
        return 0.0, 0
    total = sum(f.stat().st_size for s in steps for f in s.glob(f"rank_{rank:05d}.*"))
    return total / len(steps), len(steps)


def _dir_bytes(root: Path, *, noise: bool, steps: int | None = None) -> int:
    """Bytes of the step directories of a trace (the first ``steps`` steps, default all), without
    (``noise=False``) or only (``noise=True``) its noise samples (``root/noise/sample_*``)."""
    bases = sorted((root / "noise").glob("sample_*")) if noise else [root]
    total = 0
    for base in bases:
        dirs = sorted(p for p in base.glob("step_*") if p.is_dir())
        for d in dirs[:steps]:
            total += sum(f.stat().st_size for f in d.iterdir() if f.is_file())
    return total


#: functions whose cumulative time the profile table shows: (label, file suffix, function name)
PROFILE_PARTS = (
    ("compare (total)", "tracer/compare/check.py", "compare"),
    ("validate (manifests + safetensors headers)", "tracer/trace/store.py", "validate"),
    ("index entries by key (manifests)", "tracer/compare/check.py", "records_by_key"),
    ("load tensors (TraceReader.load)", "tracer/trace/store.py", "load"),
    ("assemble candidate shards (assembled_record, incl. its loads)", "tracer/compare/check.py", "assembled_record"),
    ("canonical.assemble", "tracer/trace/canonical.py", "assemble"),
    ("check one tensor (check_tensor)", "tracer/compare/judge.py", "check_tensor"),
    ("noise samples' moments (combined_moments)", "tracer/compare/deviation.py", "combined_moments"),
    ("noise threshold (moments_threshold, incl. F quantile)", "tracer/compare/thresholds.py", "moments_threshold"),
    ("F quantile (scipy.special.fdtri)", "tracer/compare/thresholds.py", "_f_quantile"),
    ("unmodelled_threshold", "tracer/compare/thresholds.py", "unmodelled_threshold"),
    ("storage-rounding excess (bf16 params)", "tracer/compare/deviation.py", "_far"),
    ("difference norms, chunk by chunk (tensors without the block statistic)", "tracer/compare/difference.py",
     "difference_norms"),
    ("difference norms and block-scale coordinates, one pass (_block_pass)", "tracer/compare/blockscale.py", "_block_pass"),
    ("block-scale threshold (deviation_threshold)", "tracer/compare/thresholds.py", "deviation_threshold"),
    ("worst ranks (_worst_ranks)", "tracer/compare/check.py", "_worst_ranks"),
)


def profile_compare(ref: Path, cand: Path, steps: list[int]) -> tuple[float, list[tuple[str, float, int]], str]:
    """cProfile one comparison; returns total seconds, the :data:`PROFILE_PARTS` rows
    (label, cumulative s, calls) and the top functions by own time (text)."""
    from tracer.compare.check import compare
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    compare(ref, cand, steps=steps)
    prof.disable()
    total = time.perf_counter() - t
    st = pstats.Stats(prof)
    rows = []
    for label, suffix, fn in PROFILE_PARTS:
        cum, calls = 0.0, 0
        for (file, _line, name), (_cc, nc, _tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
            if name == fn and file.replace(os.sep, "/").endswith(suffix):
                cum, calls = cum + ct, calls + nc
        rows.append((label, cum, calls))
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).strip_dirs().sort_stats("tottime").print_stats(15)
    top = "\n".join(ln for ln in buf.getvalue().splitlines()
                    if ln.strip() and not ln.lstrip().startswith(("Ordered by", "List reduced")))
    return total, rows, top

#: the torchtitan-style harness's FSDP2 x TP layout with sequence parallelism (``--titan``)
TITAN_LAYOUT = "r1.s2.t2+sp"
TITAN_MODES = ("untraced", "stats", "full")
TITAN_SECTION = "## FSDP2 x TP (torchtitan-style harness)"


class _Untraced:
    """The tracer interface :meth:`Run.train_step <examples.torchtitan_cpu.train.Run.train_step>`
    calls, doing nothing: the untraced baseline runs the harness's step itself, its arguments
    (``clip_gradients(model)``) evaluated as in a traced step, with no hook on the model."""

    @contextlib.contextmanager
    def step(self, step: int, writer: Any = None):
        yield self

    def microbatch(self, i: int) -> None:
        pass

    def record_loss(self, loss: Any) -> None:
        pass

    def after_backward(self) -> None:
        pass

    def record_grad_norm(self, norm: Any) -> None:
        pass

    def after_optimizer_step(self) -> None:
        pass

    def close(self) -> None:
        pass


def _titan_worker(rank: int, world: int, jobs: list[dict]) -> list[dict]:
    """Run every ``--titan`` job of one launch; return this rank's step times per job."""
    import warnings
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    import gc
    from examples.torchtitan_cpu.parallelize import Layout
    from examples.torchtitan_cpu.run import signature
    from examples.torchtitan_cpu.train import Run, tracer_for
    from tracer.trace.store import TraceWriter
    out = []
    for j in jobs:
        # no released_groups() here: with the groups of the first job destroyed, the second job's
        # mesh (equal to the first's: the same sizes and names) failed in a TP redistribute with
        # "Could not resolve the process group registered under the name 4" (a cache keyed by mesh
        # equality); the groups of a launch's few jobs stay alive instead (same ranks, same collectives)
        layout = Layout.parse(j["layout"])
        t = time.perf_counter()
        run = Run(layout, j["dtype"], seed=SEED)
        build_s = time.perf_counter() - t
        if j["mode"] == "untraced":
            tr: Any = _Untraced()
        else:
            writer = TraceWriter(j["root"], run.mesh.get_rank(), layout.world,
                                 {"layout": layout.name, "dtype": j["dtype"]},
                                 signature(layout, j["dtype"], SEED), mode=j["mode"])
            tr = tracer_for(run, writer)
        step_s = []
        try:
            for step in range(j["steps"]):
                t = time.perf_counter()
                run.train_step(step, tr)
                step_s.append(time.perf_counter() - t)
        finally:
            tr.close()
        del run, tr
        gc.collect()
        out.append({"step_s": step_s, "build_s": build_s})
        if rank == 0:
            print(f"    [world {world}] titan {j['label']:12s} steps "
                  f"{' '.join(f'{s:.3f}' for s in step_s)} s", flush=True)
    return out


def _titan_section(a: argparse.Namespace, steps: int, reps: int, out: Path) -> str:
    """Measure the ``--titan`` rows (module docstring); return their markdown section."""
    from examples.torchtitan_cpu.parallelize import Layout
    world = Layout.parse(TITAN_LAYOUT).world
    jobs = []
    for rep in range(reps):
        for i in range(len(TITAN_MODES)):
            mode = TITAN_MODES[(i + rep) % len(TITAN_MODES)]
            jobs.append({"model": "titan", "mode": mode, "rep": rep, "label": f"{mode} r{rep}",
                         "layout": TITAN_LAYOUT, "steps": steps, "dtype": a.dtype,
                         "root": str(out / "titan" / f"{mode}_r{rep}")})
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    print(f"tracer cost, torchtitan-style harness {TITAN_LAYOUT} (world {world}), {a.dtype}: {steps} steps per run "
          f"(first = warm-up), {reps} rep(s) per mode; traces in {out}; load average {load0[0]:.2f}", flush=True)
    per_rank = run_gloo(_titan_worker, world, jobs, timeout_s=3600.0)
    wall = time.perf_counter() - t0
    load1 = os.getloadavg()
    times = {mode: _measured(jobs, per_rank, "titan", mode) for mode in TITAN_MODES}
    med = {mode: _median(ts) for mode, ts in times.items()}
    base = med["untraced"]
    n = len(times["untraced"])
    by_rank = {mode: [trace_bytes(out / "titan" / f"{mode}_r0", r)[0] for r in range(world)]
               for mode in ("stats", "full")}
    cmd = (f"python -m bench.tracer_cost --titan --steps {steps} --reps {reps}"
           + (f" --dtype {a.dtype}" if a.dtype != "bf16" else "") + (f" --write {a.write}" if a.write else ""))
    from examples.torchtitan_cpu.model import ModelArgs
    from examples.torchtitan_cpu.train import GLOBAL_MICROBATCHES, MICRO_BATCH
    args = ModelArgs()
    lay = f"{TITAN_LAYOUT} (world {world})"
    md = [TITAN_SECTION + "\n",
          (f"Produced by `{cmd}` ({wall:.0f} s; load average {load0[0]:.2f} at the start, {load1[0]:.2f} at the end, "
           f"{os.cpu_count()} cores shared with other jobs, which may have been running; {world} gloo ranks of one "
           f"thread each on them; this machine's own CPU kernels ({_kernels()})). The harness's model "
           f"(`examples/torchtitan_cpu/model.py` defaults: dim {args.dim}, {args.n_layers} layers, {args.n_heads} "
           f"heads ({args.n_kv_heads} kv), vocab {args.vocab_size}, seq {args.max_seq_len}), global batch "
           f"{GLOBAL_MICROBATCHES} microbatches of {MICRO_BATCH} sequences, {a.dtype} FSDP2 (fp32 reduce) x TP=2 "
           f"with sequence parallelism, AdamW, the `DTensorTracer`'s default captures (`tracer_for`). {steps} steps "
           f"per run, the first dropped as warm-up; {reps} run(s) per mode in rotated order, steps pooled (n = "
           f"measured steps per mode); the slowest rank per step. The untraced step is the harness's own "
           f"`Run.train_step` given a tracer whose methods do nothing (`bench.tracer_cost._Untraced`: the same ops "
           f"and collectives, no hooks; docstring).\n"),
          _table(["layout", "untraced ms", "stats ms", "full ms", "stats / untraced", "full / untraced", "n"],
                 [[lay, f"{base * 1e3:.0f}", f"{med['stats'] * 1e3:.0f}", f"{med['full'] * 1e3:.0f}",
                   f"**{med['stats'] / base:.2f}x**", f"**{med['full'] / base:.2f}x**", str(n)]]),
          f"\nTrace bytes per step and rank (MB; ranks 0 / 1 / ... / {world - 1}):\n",
          _table(["layout", "mode", "MB per step per rank"],
                 [[lay, mode, " / ".join(f"{b / 1e6:.3f}" for b in by_rank[mode])] for mode in ("stats", "full")])]
    return "\n".join(md) + "\n"


def _replace_section(text: str, heading: str, section: str) -> str:
    """``text`` with its ``heading`` section (up to the next ``## `` heading) replaced by ``section``,
    or ``section`` appended."""
    lines = text.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.rstrip() == heading), None)
    if start is None:
        return text.rstrip("\n") + "\n\n" + section
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    rest = "".join(lines[end:])
    return "".join(lines[:start]) + section + ("\n" + rest if rest else "")


def _kept_section(path: Path, heading: str) -> str:
    """The ``heading`` section of the file at ``path`` (empty if none)."""
    if not path.exists():
        return ""
    lines = path.read_text().splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.rstrip() == heading), None)
    if start is None:
        return ""
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "".join(lines[start:end])


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps, repetitions, noise samples")
    ap.add_argument("--write", type=Path, help="write the tables as markdown to this file (e.g. docs/cost.md)")
    ap.add_argument("--out", type=Path, help="trace directory (default: a temporary one, removed at the end)")
    ap.add_argument("--keep", action="store_true", help="keep the traces")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--steps", type=int, help="steps per run, the first one a warm-up (default 4, quick 3)")
    ap.add_argument("--reps", type=int, help="repetitions of each mode (default 2, quick 1)")
    ap.add_argument("--noise-samples", type=int, help="S of the reference (default 4, quick 2)")
    ap.add_argument("--compare-reps", type=int, help="timed comparisons per model (default 1)")
    ap.add_argument("--compare-steps", type=int, help="steps compared (the first ones; default 2, quick 1)")
    ap.add_argument("--models", default="demo,large",
                    help=f"comma-separated models to measure, of {', '.join(MODELS)} (default demo,large)")
    ap.add_argument("--profile-model", default="demo", choices=sorted(MODELS),
                    help="model whose comparison is profiled (default demo: the large one takes minutes)")
    ap.add_argument("--titan", action="store_true",
                    help=f"measure only the torchtitan-style harness on {TITAN_LAYOUT} (untraced, stats, full; "
                         f"--steps default 6, --reps default 3); --write replaces the section {TITAN_SECTION!r}")
    a = ap.parse_args(argv)
    if a.titan:
        steps, reps = a.steps or 6, a.reps or 3
        if steps < 2:
            ap.error("--steps must be >= 2 (the first step is a warm-up)")
        out = a.out or Path(tempfile.mkdtemp(prefix="ttrace_cost_"))
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        section = _titan_section(a, steps, reps, out)
        print("\n" + section)
        if a.write:
            a.write.parent.mkdir(parents=True, exist_ok=True)
            old = a.write.read_text() if a.write.exists() else ""
            a.write.write_text(_replace_section(old, TITAN_SECTION, section) if old else section)
            print(f"wrote {a.write}")
        if not a.keep and a.out is None:
            shutil.rmtree(out, ignore_errors=True)
        return 0
    steps = a.steps or (3 if a.quick else 4)
    reps = a.reps or (1 if a.quick else 2)
    S = a.noise_samples if a.noise_samples is not None else (2 if a.quick else 4)
    creps = a.compare_reps or 1
    csteps = a.compare_steps or (1 if a.quick else 2)
    if steps < 2:
        ap.error("--steps must be >= 2 (the first step is a warm-up)")
    models = [m for m in a.models.split(",") if m]
    if not models or any(m not in MODELS for m in models):
        ap.error(f"--models takes a comma-separated subset of {', '.join(MODELS)}, got {a.models!r}")
    if S < 1:
        ap.error("--noise-samples must be >= 1 (the comparison needs the reference's thresholds)")
    out = a.out or Path(tempfile.mkdtemp(prefix="ttrace_cost_"))
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = "python -m bench.tracer_cost" + (" --quick" if a.quick else "") + \
        "".join(f" {k} {v}" for k, v in (("--steps", a.steps), ("--reps", a.reps),
                                          ("--noise-samples", a.noise_samples), ("--compare-reps", a.compare_reps),
                                          ("--compare-steps", a.compare_steps))
                if v is not None) + (f" --dtype {a.dtype}" if a.dtype != "bf16" else "") + \
        (f" --profile-model {a.profile_model}" if a.profile_model != "demo" else "") + \
        (f" --models {a.models}" if a.models != "demo,large" else "") + \
        (f" --write {a.write}" if a.write else "")
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    print(f"tracer cost: {a.dtype}, global batch {GLOBAL_BATCH} (micro batch 1), {steps} steps per run "
          f"(first = warm-up), {reps} rep(s) per mode, S={S}; traces in {out}; load average {load0[0]:.2f}")
    results: dict[int, tuple[list[dict], list[list[dict]]]] = {}
    for world in (1, 2):
        jobs = _jobs(world, out, models, steps=steps, reps=reps, dtype=a.dtype, noise_samples=S)
        t = time.perf_counter()
        print(f"  launch world {world} ({layout_name(LAYOUTS[world])}): {len(jobs)} runs", flush=True)
        results[world] = (jobs, run_gloo(_worker, world, jobs, timeout_s=3600.0))
        print(f"  world {world} done in {time.perf_counter() - t:.0f} s", flush=True)

    # 1 + 2: overhead and bytes
    over_rows, bytes_rows = [], []
    med: dict[tuple[str, int, str], float] = {}
    for model in models:
        for world in (1, 2):
            jobs, per_rank = results[world]
            for mode in (*MODES, "noise"):
                med[(model, world, mode)] = _median(_measured(jobs, per_rank, model, mode))
            base = med[(model, world, "untraced")]
            lay = f"{layout_name(LAYOUTS[world])} (world {world})"
            n = len(_measured(jobs, per_rank, model, "untraced"))
            over_rows.append([model, lay, f"{base * 1e3:.0f}", f"{med[(model, world, 'stats')] * 1e3:.0f}",
                              f"{med[(model, world, 'full')] * 1e3:.0f}",
                              f"{med[(model, world, 'full_bg')] * 1e3:.0f}",
                              f"**{med[(model, world, 'stats')] / base:.2f}x**",
                              f"**{med[(model, world, 'full')] / base:.2f}x**",
                              f"**{med[(model, world, 'full_bg')] / base:.2f}x**", str(n)])
            for mode in ("stats", "full"):
                per = [trace_bytes(out / f"w{world}" / model / f"{mode}_r0", r)[0] for r in range(world)]
                bytes_rows.append([model, lay, mode, " / ".join(f"{b / 1e6:.3f}" for b in per)])
        noise_per_step = _dir_bytes(out / "w1" / model / "noise", noise=True) / steps
        bytes_rows.append([model, f"{layout_name(LAYOUTS[1])} (world 1)", f"noise samples (S={S}, all, stored as moments)",
                           f"{noise_per_step / 1e6:.3f}"])

    # 3: compare throughput
    from tracer.compare.check import compare
    cmp_rows = []
    false_pos: list[tuple[str, list]] = []  # the clean candidate must have none; reported as found
    prof = None
    for model in models:
        ref, cand = out / "w1" / model / "noise", out / "w2" / model / "full_r0"
        rc = _dir_bytes(ref, noise=False, steps=csteps) + _dir_bytes(cand, noise=False, steps=csteps)
        nb = _dir_bytes(ref, noise=True, steps=csteps)
        times = []
        for _ in range(creps):
            t = time.perf_counter()
            c = compare(ref, cand, steps=range(csteps))
            times.append(time.perf_counter() - t)
        tm = _median(times)
        over = [r for r in c.rows if r.status not in ("ok", "unchecked")]
        if over:
            false_pos.append((model, over))
        print(f"  compare {model}: {len(c.rows)} tensors, verdict {c.verdict}, {tm:.2f} s "
              f"({' '.join(f'{x:.2f}' for x in times)})", flush=True)
        cmp_rows.append([model, str(len(c.rows)), c.verdict, f"{rc / 1e6:.1f}", f"{nb / 1e6:.1f}", f"{tm:.2f}",
                         f"**{rc / 1e9 / tm:.2g}**", f"{(rc + nb) / 1e9 / tm:.2g}"])
        if model == a.profile_model:
            prof = profile_compare(ref, cand, list(range(csteps)))

    # 4: cost of the thresholds
    noise_rows = []
    for model in models:
        clean, noisy, untr = med[(model, 1, "full")], med[(model, 1, "noise")], med[(model, 1, "untraced")]
        per_sample = (noisy - clean) / S
        rec = next(rec for j, rec in zip(results[1][0], results[1][1][0]) if j["model"] == model and j["mode"] == "noise")
        reused, patched, computed = rec["amplitudes"]
        measured = rec["sample_seconds"][1:]  # the warm-up step dropped, as for the step times
        first = _median([s[0] for s in measured])
        later = _median([t for s in measured for t in s[1:]])
        noise_rows.append([model, str(S), f"{clean * 1e3:.0f}", f"{noisy * 1e3:.0f}", f"{per_sample * 1e3:.0f}",
                           f"{first * 1e3:.0f}", f"{later * 1e3:.0f}",
                           f"**{per_sample / clean:.2f}**", f"{per_sample / untr:.2f}",
                           f"**{(noisy - clean) / clean:.2f}**", f"{reused} / {patched} / {computed}"])

    load1 = os.getloadavg()
    wall = time.perf_counter() - t0
    profiles = {j["trace"]["mode"]: rec for j, rec in zip(results[1][0], results[1][1][0]) if "profile" in rec}

    def profile_md(mode: str, what: str) -> list[str]:
        rec = profiles.get(mode)
        if rec is None:
            return []
        return [(f"\n### Where the time goes: {what} (demo, world 1, cProfile of a 2-step run, build included; "
                f"steps {', '.join(f'{x:.2f}' for x in rec['step_s'])} s under the profiler)\n"),
                "```\n" + rec["profile"] + "\n```"]

    md = ["# Cost of tracing and comparing\n",
          (f"Produced by `{cmd}` ({wall:.0f} s; load average {load0[0]:.2f} at the start, {load1[0]:.2f} at "
          f"the end, {os.cpu_count()} cores shared with other jobs; this machine's own CPU kernels ("
          f"{_kernels()}); one thread per gloo rank, compare in the "
          f"parent with torch's default threads). Models: "
          + "; ".join(f"**{m}** ({_model_desc(m)})" for m in models)
          + f"; {a.dtype} with fp32 main params, micro batches of 1, Adam. {steps} steps "
          f"per run, the first dropped as warm-up; {reps} repetition(s) per mode in rotated order, steps pooled "
          f"(n = measured steps per mode); world 2: the slowest rank per step. Methodology: "
          f"`bench/tracer_cost.py` docstring.\n"),
          ("Caveats: wall times on a shared machine move with its load (compare runs of the command); "
          "the harness's process-wide cuda->cpu `TorchFunctionMode` (`examples/megatron_cpu/shim.py`) "
          "slows every op of the training step, traced or not, while the tracer's copies and statistics "
          "run with torch functions disabled, so the ratios may understate the tracer's relative cost.\n"),
          "## Traced step over untraced step (goals: stats <= 1.2x, full <= 2x)\n",
          _table(["model", "layout", "untraced ms", "stats ms", "full ms", "full, background writer ms",
                  "stats / untraced", "full / untraced", "full, background writer / untraced", "n"], over_rows),
          "\n## Trace bytes per step and rank (MB; world 2: rank 0 / rank 1)\n",
          _table(["model", "layout", "mode", "MB per step per rank"], bytes_rows)]
    md += profile_md("stats", "stats-only tracing")
    md += [(f"\n## Compare throughput (goal >= 1 GB/s)\n\n`tracer.compare.check.compare(reference, candidate)`: the "
           f"world-1 reference (full, with its S={S} noise samples) against the tp2+sp candidate (full), "
           f"the first {csteps} step(s) (compare's `steps=`), median of {creps} run(s). GB/s = (reference + "
           "candidate bytes, noise samples "
           "excluded) / seconds; the last column counts the noise samples too (they are read as well).\n"),
           _table(["model", "tensors", "verdict", "ref+cand MB", "noise MB", "compare s", "GB/s (ref+cand)",
                   "GB/s (all read)"], cmp_rows)]
    md += [f"\n**False positive** ({model} model, clean candidate {layout_name(LAYOUTS[2])}, {a.dtype}, seed "
           f"{SEED}, S={S}): {len(over)} tensor(s) over threshold; the first: step {r.step}, {r.phase} "
           f"{r.name} (mb {r.microbatch}), ratio {r.ratio:.3g}" + "".join(
               f"; then step {o.step} {o.phase} {o.name} (mb {o.microbatch}) {o.ratio:.3g}" for o in over[1:6])
           for model, over in false_pos for r in over[:1]]
    if prof is not None:
        total, parts, top = prof
        md += [(f"\n### Where compare's time goes ({a.profile_model} model, cProfile, {total:.2f} s under the "
                "profiler)\n\n"
               "Cumulative times; the rows nest (`check_tensor` contains `moments_threshold`, which contains "
               "the F quantile; `assembled_record` contains its loads; the noise samples are stored as moments, "
               "`tracer/compare/deviation.py`).\n"),
               _table(["part", "cumulative s", "share", "calls"],
                      [[lbl, f"{c:.2f}", f"{c / total:.0%}", str(n)] for lbl, c, n in parts]),
               "\nTop functions by own time:\n\n```\n" + top + "\n```"]
    md += [("\n## Cost of the thresholds (goal: <= one extra reference step in total)\n\n"
           f"Reference (world 1, full trace) with S={S} noise samples vs without, per step. A noise "
           "sample re-runs the step under the noise injector (every modelled op perturbed by its "
           "local bound) from a snapshot of model and optimizer state; the samples of a step share "
           "the amplitudes of the calls whose operands match, and a GEMM whose operands moved in a few "
           "rows recomputes only those rows (`ttrace_num/propagate/memo.py`).\n"),
           _table(["model", "S", "clean traced step ms", "step with S samples ms", "per noise sample ms",
                   "first sample ms (computes the amplitudes)", "each later sample ms (reuses them)",
                   "per sample / clean traced step", "per sample / untraced step",
                   "all S samples / clean traced step (extra reference steps)",
                   "amplitudes reused / patched (some rows recomputed) / computed (ttrace_num.propagate.memo)"],
                  noise_rows)]
    md += profile_md("full", "full tracing plus 1 noise sample per step")
    text = "\n".join(md) + "\n"
    print("\n" + text)
    if a.write:
        a.write.parent.mkdir(parents=True, exist_ok=True)
        kept = _kept_section(a.write, TITAN_SECTION)  # measured by --titan, not by this run
        a.write.write_text(text + ("\n" + kept if kept else ""))
        print(f"wrote {a.write}")
    if not a.keep and a.out is None:
        shutil.rmtree(out, ignore_errors=True)
    elif not a.keep:
        print(f"traces left in {out} (--out given)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
