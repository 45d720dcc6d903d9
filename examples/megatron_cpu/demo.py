"""The demo: a real megatron-core GPT on CPU/gloo, traced against its single-device reference.

    python -m examples.megatron_cpu.demo [--out demo_out] [--steps 3] [--bug sp_norm_grad_not_reduced]

1. reference: one process, bf16 (fp32 main params), ``--steps`` Adam steps, traced, with
   ``--noise-samples`` noisy trajectories for the thresholds (:mod:`examples.megatron_cpu.traced`);
2. candidate: TP=2 + SP + PP=2 with the distributed optimizer, 4 gloo ranks, traced twice:
   clean, then with ``--bug`` injected (:mod:`examples.megatron_cpu.bugs`);
3. both candidates compared with :func:`tracer.compare.check.compare`; a summary is printed (and, when
   the first divergence is a module's forward output, that module is re-run on the
   candidate's inputs: :mod:`examples.megatron_cpu.localise`), and a JSON report and a PNG
   plot per candidate are written under ``--out``.

``--resync``: the candidates run first, and each gets a reference of its own that starts every
step from its state (:mod:`tracer.capture.resync`).

``--out`` is emptied only if the demo created it (it holds the marker file ``.ttrace-demo``);
an empty or absent directory is used, anything else (a directory of other files, a file, a
symbolic link) is refused with exit status 2 (:func:`prepare_out`).
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from examples.gloo import run_gloo
from examples.megatron_cpu.bugs import BUGS
from ttrace_num.cli import UsageError, int_at_least, run_cli

CANDIDATE = {"tp": 2, "pp": 2, "dp": 1, "sp": True, "distopt": True}
MARKER = ".ttrace-demo"


def prepare_out(out: Path) -> None:
    """Make ``out`` an empty directory marked as the demo's: create it, use it if empty, empty it
    if the demo created it (it holds :data:`MARKER`); refuse (:class:`UsageError`) a symbolic
    link, a file, or a directory with other content, which is never deleted."""
    if out.is_symlink():
        raise UsageError(f"--out {out} is a symbolic link; give a directory path that is not a link")
    if out.exists():
        if not out.is_dir():
            raise UsageError(f"--out {out} exists and is not a directory")
        if (out / MARKER).is_file():
            shutil.rmtree(out)  # the demo's own output of an earlier run (rmtree does not follow links)
        elif any(out.iterdir()):
            raise UsageError(f"--out {out} exists and was not created by the demo (no {MARKER} in it); refusing to "
                             "delete it: choose another --out, or empty or remove it yourself")
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("created by examples/megatron_cpu/demo.py; the demo empties this directory when run "
                              "again with the same --out\n")


def _trace_worker(rank: int, world: int, jobs: list[dict]) -> list[dict]:
    import warnings
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    from examples.megatron_cpu.gpt import build_and_train
    out = []
    for job in jobs:
        r = build_and_train(job["layout"], steps=job["steps"], seed=job["seed"], dtype=job["dtype"],
                            trace=job["trace"], bug=job.get("bug"), **job.get("model", {}))
        out.append({"losses": [float(x) for x in r["losses"]], "trace": r["trace"], "step_s": r["step_s"]})
    return out


def trace_runs(out: Path, *, steps: int, seed: int, dtype: str, bug: str | None, noise_samples: int,
               candidate: dict = CANDIDATE, noise_store: str = "moments", resync: bool = False,
               log=print) -> dict[str, dict]:
    """Trace the reference and the candidate(s) into ``out/{ref,cand_clean,cand_bug}``;
    ``noise_store``: how the reference's noise samples are stored (``tracer.capture.noise_sampler.NoiseSampler``).

    ``resync``: the reference is re-synchronised to each candidate at every step
    (:mod:`tracer.capture.resync`): the candidates run first and also trace their optimizer state
    (capture ``optim``, which the comparison does not compare), then one reference per
    candidate (``out/ref`` for the clean one, ``out/ref_bug`` for the buggy one) starts every
    step from that candidate's state."""
    world = candidate["tp"] * candidate["pp"] * candidate["dp"]
    from tracer.adapters.megatron import DEFAULT_CAPTURE
    capture = {"capture": DEFAULT_CAPTURE + ("optim",)} if resync else {}
    ref_job = {"layout": {"tp": 1, "pp": 1, "dp": 1}, "steps": steps, "seed": seed, "dtype": dtype}
    ref_trace = {"noise_samples": noise_samples, "noise_store": noise_store, "noise_tp": candidate["tp"]}
    cand_jobs = {"cand_clean": {"layout": candidate, "steps": steps, "seed": seed, "dtype": dtype,
                                "trace": {"root": str(out / "cand_clean"), **capture}}}
    if bug:
        cand_jobs["cand_bug"] = {**cand_jobs["cand_clean"], "trace": {"root": str(out / "cand_bug"), **capture},
                                 "bug": bug}
    refs = {"ref": "cand_clean", "ref_bug": "cand_bug"} if resync else {"ref": None}

    def run_refs() -> dict[str, dict]:
        runs = {}
        for ref, cand in refs.items():
            if cand is not None and cand not in cand_jobs:
                continue
            t = time.perf_counter()
            sync = {"resync_from": str(out / cand)} if cand else {}
            runs[ref] = run_gloo(_trace_worker, 1, [{**ref_job, "trace": {"root": str(out / ref), **ref_trace,
                                                                           **sync}}])[0][0]
            log(f"  reference traced ({noise_samples} noise samples{', re-synchronised to ' + cand if cand else ''})"
                f": {time.perf_counter() - t:.1f} s")
        return runs

    runs = {} if resync else run_refs()
    t = time.perf_counter()
    cand = run_gloo(_trace_worker, world, list(cand_jobs.values()))[0]
    log(f"  candidate(s) traced on {world} gloo ranks: {time.perf_counter() - t:.1f} s")
    runs.update(zip(cand_jobs, cand))
    if resync:
        runs.update(run_refs())
    return runs


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ttrace demo", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="demo_out", help=f"directory for traces and reports (emptied if the demo created "
                    f"it: it holds {MARKER}; else it must be empty or absent)")
    ap.add_argument("--steps", type=int_at_least(1), default=3)
    ap.add_argument("--seed", type=int_at_least(0), default=1234)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--noise-samples", type=int_at_least(1), default=4)
    ap.add_argument("--resync", action="store_true",
                    help="re-synchronise a reference to each candidate at every step (tracer.capture.resync)")
    ap.add_argument("--bug", default="sp_norm_grad_not_reduced", choices=sorted(BUGS),
                    help="catalogue bug injected into the second candidate run")
    ap.set_defaults(func=run)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 the clean candidate consistent and the buggy one divergent, 1 otherwise,
    2 bad input, 3 internal error (:func:`ttrace_num.cli.run_cli`)."""
    from tracer.errors import TraceError
    return run_cli(build_parser(), argv, bad_input=(TraceError,))


def run(a: argparse.Namespace) -> int:
    from tracer.compare.check import compare
    from tracer.report.summary import plot, summary, write_json
    out = Path(a.out)
    prepare_out(out)
    t0 = time.perf_counter()
    lay = ".".join(f"{k}{v}" for k, v in CANDIDATE.items() if k in ("tp", "pp", "dp")) + "+sp+distopt"
    print(f"ttrace demo: megatron-core GPT ({a.dtype}), reference (1 process) vs candidate {lay}, "
          f"{a.steps} steps; injected bug: {a.bug}")
    runs = trace_runs(out, steps=a.steps, seed=a.seed, dtype=a.dtype, bug=a.bug, noise_samples=a.noise_samples,
                      resync=a.resync)
    print(f"  losses: reference {[round(x, 5) for x in runs['ref']['losses']]}, clean candidate "
          f"{[round(x, 5) for x in runs['cand_clean']['losses']]}, buggy candidate "
          f"{[round(x, 5) for x in runs['cand_bug']['losses']]}")
    print(f"  trace size per step: reference {runs['ref']['trace']['bytes'] / a.steps / 1e6:.2f} MB (+ noise "
          f"samples), candidate rank 0 {runs['cand_clean']['trace']['bytes'] / a.steps / 1e6:.2f} MB")
    status = 0
    for name, title in (("cand_clean", "clean candidate"), ("cand_bug", f"candidate with bug {a.bug}")):
        t = time.perf_counter()
        ref = "ref_bug" if a.resync and name == "cand_bug" else "ref"
        c = compare(out / ref, out / name, progress=sys.stderr.isatty())
        print(f"\n== {title} (compared in {time.perf_counter() - t:.1f} s) ==")
        print(summary(c))
        if c.first is not None and c.first.phase == "fwd":
            from examples.megatron_cpu.localise import rerun_first_divergence
            verdict = rerun_first_divergence(c, seed=a.seed, dtype=a.dtype, noise_tp=CANDIDATE["tp"], resync=a.resync)
            print(f"  {verdict}")
        j, p = write_json(c, out / f"report_{name}.json"), plot(c, out / f"report_{name}.png", title=title)
        print(f"  report: {j}  plot: {p}")
        expected_ok = (c.first is None) if name == "cand_clean" else (c.first is not None)
        status |= 0 if expected_ok else 1
    print(f"\ndemo finished in {time.perf_counter() - t0:.0f} s; reports and traces under {out}/")
    return status


if __name__ == "__main__":
    sys.exit(main())
