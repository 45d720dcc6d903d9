"""Traced runs of the plain-PyTorch harness: the worker the benchmark and tests launch.

    run_gloo(trace_worker, world, [job, ...])

Command line (one reference with its noise samples, one candidate, the comparison):

    python -m examples.torch_parallel.run --layout tp2.cp2.dp1+sp [--bug NAME] [--dtype bf16]
                                          [--seed 0] [--steps 3] [--noise-samples 4] [--out DIR]

A job is a dict ``{"layout": "tp2.cp2.dp1+sp", "dtype": "bf16", "seed": 0, "steps": 3,
"root": DIR, "bug": None, "noise_samples": 0, "noise_split": 1}``; every job of one launch has
``Layout.parse(layout).world`` equal to the launch's world size. A reference is a job whose
layout has world 1: with ``noise_samples > 0`` its steps run through
:class:`tracer.capture.noise_sampler.NoiseSampler` with :func:`reference_noise`, which gives the
thresholds. Each job returns ``{"root", "losses", "wall_s"}`` (rank 0's losses: the summed
loss shares of its microbatches per step, a diagnostic). Re-synchronisation
(:mod:`tracer.capture.resync`): a candidate job with ``"optim": True`` also traces its optimizer state
and FP8 amax histories; a reference job with ``"resync_from": candidate root`` starts every step
from that state.
"""
from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from examples.gloo import released_groups
from examples.torch_parallel.layout import Layout
from examples.torch_parallel.train import Run, tracer_for
from tracer.compare.check import assembled_phases
from tracer.capture.noise_sampler import NoiseSampler
from tracer.capture.resync import candidate_state, load_state
from tracer.trace.store import TraceWriter

__all__ = ["TORCH_PARALLEL_ACCEPTED", "main", "reference_noise", "signature", "trace_worker", "trace_job"]


#: ops of the harness's model without an error model, accepted unperturbed (by torch name,
#: wherever they occur), and why; the comparison lists them (:mod:`tracer.compare.coverage`)
_ROPE = "the rotary angles (ring_attention.rope_angles): a function of the positions alone, the same in every run"
_MOE = ("the mixture of experts' routing weights and switch aux loss (moe.py): not perturbed; its clean runs "
        "were measured within their thresholds without it (docs/detection.md)")
TORCH_PARALLEL_ACCEPTED = {
    "torch.Tensor.__rpow__": _ROPE, "torch.Tensor.__rtruediv__": _ROPE, "torch.Tensor.cos": _ROPE,
    "torch.Tensor.sin": _ROPE,
    "torch.Tensor.__pow__": "the loss, sum((y - target)^2) / n in fp32 (model.py): its square and sum are not "
                            "perturbed",
    "torch.Tensor.sum": "the loss's fp32 sum over every element (model.py, see torch.Tensor.__pow__)",
    "torch.Tensor.div": _MOE, "torch.Tensor.index_add": _MOE, "torch.Tensor.index_add_": _MOE, "torch.sum": _MOE,
}


def signature(layout: Layout, dtype: str, seed: int) -> str:
    """What must agree between a reference and its candidates (the model, not the layout)."""
    ref = layout.reference()
    return f"torch_parallel TinyLM, features {ref.name}, {dtype}, seed {seed}, Adam"


def reference_noise(split: int, dtype: str, layout: Layout) -> dict[str, Any]:
    """:class:`~tracer.capture.noise_sampler.NoiseSampler` keywords for a reference compared with
    candidates whose reductions are split over up to ``split`` ranks in ``dtype``: the models
    megatron's reference uses (:func:`tracer.adapters.megatron.injector_models`: split GEMMs and
    parameter-gradient sums, variance-matched GEMMs and fp32 sums; bound-sized bf16 GEMM noise
    for a mixture of experts), and with FP8 the FP8 GEMM's autograd Function runs its
    backward under the injector. The ops of the model without an error model are accepted
    unperturbed (:data:`TORCH_PARALLEL_ACCEPTED`, with their reasons: :mod:`ttrace_num.propagate.census`)."""
    from tracer.adapters.megatron import injector_models
    kw: dict[str, Any] = {"injector_kwargs": {**injector_models(split, dtype, routed=layout.moe),
                                              "accepted": dict(TORCH_PARALLEL_ACCEPTED)}}
    if layout.fp8:
        from examples.torch_parallel.fp8 import Fp8LinearFunction
        kw["custom_functions"] = (Fp8LinearFunction,)
    return kw


def trace_job(job: dict[str, Any]) -> dict[str, Any]:
    """Run and trace one job on this rank (see the module docstring)."""
    from examples.torch_parallel.bugs import BUGS
    t0 = time.perf_counter()
    with released_groups():  # the job's process groups end with it (their gloo threads too)
        layout = Layout.parse(job["layout"])
        run = Run(layout, job["dtype"], seed=job.get("seed", 0))
        sig = signature(layout, job["dtype"], job.get("seed", 0))
        lay = {"layout": layout.name, "dtype": job["dtype"]}
        writer = TraceWriter(job["root"], run.groups.rank, layout.world, lay, sig)
        tr = tracer_for(run, writer, optim=bool(job.get("optim")))
        resync_from = job.get("resync_from")
        undo = BUGS.inject(job["bug"], run) if job.get("bug") else None
        losses = []
        try:
            samples = int(job.get("noise_samples", 0))
            sampler = None
            if samples and layout.world == 1:
                sampler = NoiseSampler(run.model, run.opt, job["root"], layout=lay, signature=sig, samples=samples,
                                       seed=job.get("seed", 0), restart=bool(resync_from),
                                       **reference_noise(int(job.get("noise_split", 1)), job["dtype"], layout))
            for step in range(job["steps"]):
                if resync_from and step > 0:
                    _resync(run, resync_from, step - 1)
                if sampler:
                    losses.append(sampler.step(step, partial(run.train_step, step, tr)))
                else:
                    losses.append(run.train_step(step, tr))
        finally:
            tr.remove()
            if undo:
                undo()
        return {"root": job["root"], "losses": losses, "wall_s": time.perf_counter() - t0}


def _resync(run: Run, candidate: str, step: int) -> None:
    """Start the next step of this (single-rank) run from the candidate's state at the end of
    ``step``: parameters, Adam moments and FP8 delayed-scaling state (:mod:`tracer.capture.resync`)."""
    load_state(run.opt, list(run.model.named_parameters()), candidate_state(candidate, step))
    if run.fp8_states():
        fp8 = assembled_phases(candidate, step, ("fp8_scale", "state"))
        run.load_fp8_state(fp8["fp8_scale"], fp8["state"])


def trace_worker(rank: int, world: int, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """gloo worker: every job in order (each job builds its own process groups)."""
    return [trace_job(j) for j in jobs]


def _parse(ap: argparse.ArgumentParser, name: str) -> Layout:
    try:
        return Layout.parse(name)
    except ValueError as exc:
        ap.error(str(exc))  # exits (status 2)


def main(argv: list[str] | None = None) -> int:
    """Trace the single-device reference (with noise samples) and the candidate ``--layout``
    (with ``--bug`` injected, if given), compare them and print the verdict. Exit status 0
    consistent, 1 divergent."""
    from examples.gloo import run_gloo
    from examples.torch_parallel.bugs import BUGS
    from tracer.compare.check import compare
    from tracer.report.summary import summary
    ap = argparse.ArgumentParser(prog="python -m examples.torch_parallel.run", description=main.__doc__)
    ap.add_argument("--layout", help="candidate layout, e.g. tp2.cp2.dp1+sp, tp1.cp1.dp2+fp8 (default with "
                                     "--bug: the layout the bug declares)")
    ap.add_argument("--bug", choices=sorted(BUGS), metavar="NAME",
                    help="inject this bug into the candidate: " + ", ".join(sorted(BUGS)))
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--noise-samples", type=int, default=4, help="reference noise samples (default 4)")
    ap.add_argument("--out", type=Path, default=Path("out/torch_parallel"), help="trace directory")
    a = ap.parse_args(argv)
    needed = BUGS[a.bug].needs["layout"] if a.bug else None
    if a.layout is None and needed is None:
        ap.error("name a candidate --layout (or a --bug, which brings its own)")
    layout = _parse(ap, a.layout or needed)
    if needed is not None and layout != Layout.parse(needed):
        ap.error(f"bug {a.bug} runs on layout {needed} (its declared needs), not {a.layout}: drop --layout "
                 "or pass that one")
    job = {"dtype": a.dtype, "seed": a.seed, "steps": a.steps}
    ref, cand = a.out / "reference", a.out / ("bug_" + a.bug if a.bug else "candidate")
    print(f"tracing the reference ({layout.reference().name}, {a.noise_samples} noise samples) -> {ref}",
          flush=True)
    run_gloo(trace_worker, 1, [{**job, "layout": layout.reference().name, "root": str(ref),
                                "noise_samples": a.noise_samples, "noise_split": layout.tp}])
    print(f"tracing the candidate ({layout.name}{', bug ' + a.bug if a.bug else ''}, world {layout.world}) "
          f"-> {cand}", flush=True)
    run_gloo(trace_worker, layout.world, [{**job, "layout": layout.name, "root": str(cand), "bug": a.bug}])
    c = compare(ref, cand)
    print(summary(c))
    return 0 if c.first is None else 1


if __name__ == "__main__":
    sys.exit(main())
