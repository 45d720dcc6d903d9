"""Traced runs of the torchtitan-style harness: the worker the benchmark and tests launch.

    run_gloo(trace_worker, world, [job, ...])

Command line (one reference with its noise samples, one candidate, the comparison):

    python -m examples.torchtitan_cpu.run --layout r1.s2.t2+sp [--bug NAME] [--dtype bf16]
                                          [--seed 0] [--steps 3] [--noise-samples 4] [--out DIR]

A job is a dict ``{"layout": "r1.s2.t2+sp", "dtype": "bf16", "seed": 0, "steps": 3, "root": DIR,
"bug": None, "noise_samples": 0, "noise_tp": 1, "noise_dp": 1}``; every job of one launch has
``Layout.parse(layout).world`` equal to the launch's world size. A job with ``noise_samples > 0``
is a reference: its steps run through :class:`tracer.capture.noise_sampler.NoiseSampler` with
:func:`reference_noise`, modelling candidates with up to ``noise_tp`` tensor-parallel and
``noise_dp`` data-parallel ranks. A reference of several ranks (a distributed reference,
docs/distributed-reference.md: FSDP2 over 2 ranks as the reference of FSDP2 x TP) takes its samples
on every rank in lockstep, and its noise models its own split as well as the candidates'. Each job
returns ``{"root", "losses", "wall_s"}``.
"""
from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

from examples.gloo import released_groups
from examples.torchtitan_cpu.parallelize import Layout
from examples.torchtitan_cpu.train import Run, tracer_for
from tracer.capture.noise_sampler import NoiseSampler
from tracer.trace.store import TraceWriter

__all__ = ["TITAN_ACCEPTED", "main", "reference_noise", "signature", "trace_job", "trace_worker"]

_CLIP = ("clip_grad_norm_ over FSDP2's DTensor gradients (train.clip_gradients): the total norm, an fp32 sum of "
         "squares whose rounding (<= n u relative, n <= 2^17) is orders of magnitude below the gradients' own "
         "deviations, which the noise samples carry into it; the clip coefficient scales every gradient alike")
#: ops of the harness's training step without an error model, accepted unperturbed (by name, as the noise
#: injector's census counts them), and why; the comparison lists them (:mod:`tracer.compare.coverage`)
TITAN_ACCEPTED: dict[str, str] = {f"DTensor {name}": _CLIP for name in (
    "torch._foreach_norm", "torch.linalg.vector_norm", "torch.stack", "torch.Tensor.add", "torch.Tensor.__rtruediv__",
    "torch._foreach_mul_", "torch.Tensor.clamp")}
_COPY_IN = ("FSDP2's all-gather over more than one rank (a distributed reference, docs/distributed-reference.md): "
            "the copy of each rank's parameter shards into the all-gather buffer, cast elementwise to "
            "MixedPrecisionPolicy's param dtype, and of the gathered buffer out into the unsharded parameters; "
            "a copy and a deterministic cast, the same code on the same values in every layout (the noise "
            "samples' perturbed parameters are cast by it as they are)")
TITAN_ACCEPTED.update({"fsdp.all_gather_copy_in": _COPY_IN, "torch._foreach_copy_": _COPY_IN})


def signature(layout: Layout, dtype: str, seed: int) -> str:
    """What must agree between a reference and its candidates (the model, not the layout)."""
    return f"torchtitan_cpu Llama, {layout.reference().name}, {dtype}, seed {seed}, AdamW"


def reference_noise(tp: int, dp: int, dtype: str, reference: Layout | None = None) -> dict[str, Any]:
    """:class:`~tracer.capture.noise_sampler.NoiseSampler` keywords for a reference of candidates with
    up to ``tp`` tensor-parallel and ``dp`` data-parallel ranks (:func:`tracer.adapters.dtensor.injector_models`:
    GEMMs split over ``tp``, parameter gradients summed over ``dp`` in FSDP2's fp32 reduce dtype).

    ``reference``: the reference's own layout, when it has several ranks (a distributed reference).
    Its data-parallel reduction (FSDP2's reduce-scatter, fp32 under the harness's
    ``MixedPrecisionPolicy``, as the candidates') needs no model of its own; a tensor-parallel
    split of its own is modelled as the reference's side of the noise
    (:func:`tracer.adapters.megatron.injector_models`, ``reference_split``). Sequence parallelism in
    the reference splits its norm-weight gradient sums over tokens, which the models do not
    know: refused (docs/distributed-reference.md, "When it is sound")."""
    from tracer.adapters.dtensor import injector_models
    layout = {"mesh": {"tp": tp}, "dp": dp, "mixed_precision": {"reduce_dtype": "fp32"}}
    kw = injector_models(layout, dtype)
    if reference is not None and reference.sp:
        raise ValueError(f"a reference with sequence parallelism ({reference.name}) is not modelled: its norm-weight "
                         "gradient sums are split over tokens; use a reference without sp")
    if reference is not None and reference.tp > 1:
        from tracer.adapters.megatron import injector_models as split_models
        own = split_models(tp, dtype, reference_split=reference.tp)
        kw.update(policy=own["policy"], reference_model=own["reference_model"])
    return {"injector_kwargs": {**kw, "accepted": dict(TITAN_ACCEPTED)}}


def trace_job(job: dict[str, Any]) -> dict[str, Any]:
    """Run and trace one job on this rank (see the module docstring)."""
    t0 = time.perf_counter()
    with released_groups():  # also forgets DTensor's cached meshes of this job's (destroyed) groups
        layout = Layout.parse(job["layout"])
        seed = int(job.get("seed", 0))
        run = Run(layout, job["dtype"], seed=seed, bug=job.get("bug"))
        sig = signature(layout, job["dtype"], seed)
        rank = run.mesh.get_rank()
        writer = TraceWriter(job["root"], rank, layout.world, {"layout": layout.name, "dtype": job["dtype"]}, sig)
        tr = tracer_for(run, writer)
        undo = run.undo_bug
        losses = []
        try:
            samples = int(job.get("noise_samples", 0))
            sampler = None
            if samples:
                sampler = NoiseSampler(run.model, run.opt, job["root"], layout={"layout": layout.name,
                                                                                 "dtype": job["dtype"]},
                                       signature=sig, samples=samples, seed=seed, clean_writer=writer,
                                       **reference_noise(int(job.get("noise_tp", 1)), int(job.get("noise_dp", 1)),
                                                         job["dtype"], layout if layout.world > 1 else None))
            for step in range(int(job["steps"])):
                if sampler:
                    losses.append(sampler.step(step, partial(run.train_step, step, tr)))
                else:
                    losses.append(run.train_step(step, tr))
        finally:
            tr.close()
            if undo:
                undo()
        return {"root": job["root"], "losses": losses, "wall_s": time.perf_counter() - t0}


def trace_worker(rank: int, world: int, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """gloo worker: every job in order."""
    return [trace_job(j) for j in jobs]


def main(argv: list[str] | None = None) -> int:
    """Trace the single-process reference (with noise samples) and the candidate ``--layout`` (with
    ``--bug``), compare them and print the verdict. Exit status 0 consistent, 1 divergent."""
    from examples.gloo import run_gloo
    from examples.torchtitan_cpu.bugs import BUGS
    from tracer.compare.check import compare
    from tracer.report.summary import summary
    ap = argparse.ArgumentParser(prog="python -m examples.torchtitan_cpu.run", description=main.__doc__)
    ap.add_argument("--layout", default=None, help="candidate layout rR.sS.tT[+sp+lp+ac+tied] (default with --bug: "
                                                   "the bug's)")
    ap.add_argument("--bug", choices=sorted(BUGS), metavar="NAME", help="inject this bug: " + ", ".join(sorted(BUGS)))
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--noise-samples", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("out/torchtitan_cpu"))
    a = ap.parse_args(argv)
    name = a.layout or (BUGS[a.bug].needs["layout"] if a.bug else None)
    if name is None:
        ap.error("name a candidate --layout (or a --bug, which brings its own)")
    try:
        layout = Layout.parse(name)
    except ValueError as exc:
        ap.error(str(exc))
    job = {"dtype": a.dtype, "seed": a.seed, "steps": a.steps}
    ref, cand = a.out / "reference", a.out / ("bug_" + a.bug if a.bug else "candidate")
    print(f"tracing the reference ({layout.reference().name}, {a.noise_samples} noise samples) -> {ref}", flush=True)
    run_gloo(trace_worker, 1, [{**job, "layout": layout.reference().name, "root": str(ref),
                                "noise_samples": a.noise_samples, "noise_tp": layout.tp, "noise_dp": layout.dp}])
    print(f"tracing the candidate ({layout.name}{', bug ' + a.bug if a.bug else ''}, world {layout.world}) -> {cand}",
          flush=True)
    run_gloo(trace_worker, layout.world, [{**job, "layout": layout.name, "root": str(cand), "bug": a.bug}])
    c = compare(ref, cand)
    print(summary(c))
    return 0 if c.first is None else 1


if __name__ == "__main__":
    sys.exit(main())
