"""Traced runs of the plain-PyTorch harness: the worker the benchmark and tests launch.

    run_gloo(trace_worker, world, [job, ...])

A job is a dict ``{"layout": "tp2.cp2.dp1+sp", "dtype": "bf16", "seed": 0, "steps": 3,
"root": DIR, "bug": None, "noise_samples": 0, "noise_split": 1}``; every job of one launch has
``Layout.parse(layout).world`` equal to the launch's world size. A reference is a job whose
layout has world 1: with ``noise_samples > 0`` its steps run through
:class:`tracer.reference.NoiseSampler` with :func:`reference_noise`, which gives the
thresholds. Each job returns ``{"root", "losses", "wall_s"}`` (rank 0's losses: the summed
loss shares of its microbatches per step, a diagnostic).
"""
from __future__ import annotations

import time
from functools import partial
from typing import Any

import torch

from examples.torch_parallel.layout import Layout
from examples.torch_parallel.train import Run, tracer_for
from tracer.reference import NoiseSampler
from tracer.store import TraceWriter

__all__ = ["reference_noise", "signature", "trace_worker", "trace_job"]


def signature(layout: Layout, dtype: str, seed: int) -> str:
    """What must agree between a reference and its candidates (the model, not the layout)."""
    ref = layout.reference()
    return f"torch_parallel TinyLM, features {ref.name}, {dtype}, seed {seed}, Adam"


def reference_noise(split: int, dtype: str, layout: Layout) -> dict[str, Any]:
    """:class:`~tracer.reference.NoiseSampler` keywords for a reference compared with
    candidates whose reductions are split over up to ``split`` ranks in ``dtype``: every
    GEMM gets the difference bound of a ``split``-way split with a reduction in ``dtype``
    (the policy megatron's reference uses, :func:`tracer.megatron.noise_policy`), the
    parameter-gradient sums over tokens the same split model, and the FP8 GEMM's autograd
    Function runs its backward under the injector."""
    from tracer.megatron import noise_policy
    from ttrace_num.bounds.summation import Summation
    kw: dict[str, Any] = {"injector_kwargs": {"policy": noise_policy(split, dtype),
                                              "grad_summation": Summation(split=max(split, 1), reduce_fmt=dtype)}}
    if layout.fp8:
        from examples.torch_parallel.fp8 import Fp8LinearFunction
        kw["custom_functions"] = (Fp8LinearFunction,)
    return kw


def trace_job(job: dict[str, Any]) -> dict[str, Any]:
    """Run and trace one job on this rank (see the module docstring)."""
    from examples.torch_parallel.bugs import BUGS
    t0 = time.perf_counter()
    layout = Layout.parse(job["layout"])
    run = Run(layout, job["dtype"], seed=job.get("seed", 0))
    sig = signature(layout, job["dtype"], job.get("seed", 0))
    lay = {"layout": layout.name, "dtype": job["dtype"]}
    writer = TraceWriter(job["root"], run.groups.rank, layout.world, lay, sig)
    tr = tracer_for(run, writer)
    undo = BUGS.inject(job["bug"], run) if job.get("bug") else None
    losses = []
    try:
        samples = int(job.get("noise_samples", 0))
        sampler = None
        if samples and layout.world == 1:
            sampler = NoiseSampler(run.model, run.opt, job["root"], layout=lay, signature=sig, samples=samples,
                                   seed=job.get("seed", 0),
                                   **reference_noise(int(job.get("noise_split", 1)), job["dtype"], layout))
        for step in range(job["steps"]):
            if sampler:
                losses.append(sampler.step(step, partial(run.train_step, step, tr)))
            else:
                losses.append(run.train_step(step, tr))
    finally:
        tr.remove()
        if undo:
            undo()
    return {"root": job["root"], "losses": losses, "wall_s": time.perf_counter() - t0}


def trace_worker(rank: int, world: int, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """gloo worker: every job in order (each job builds its own process groups)."""
    return [trace_job(j) for j in jobs]
