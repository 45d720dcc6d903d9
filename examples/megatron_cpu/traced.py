"""Tracing inside the megatron CPU harness: the candidate's trace, and the reference's trace
plus its noise samples (the empirical thresholds of :mod:`tracer.thresholds`).

A reference run with ``noise_samples = S`` runs every step ``S + 1`` times from the same
state (model parameters, fp32 main parameters, Adam moments): ``S`` times under
:class:`ttrace_num.propagate.noise.NoiseInjector` (every modelled op's result perturbed by
a uniform random error as large as its probabilistic local bound for the difference
between the reference's and the candidate's computation models), each traced into
``root/noise/sample_<i>``, then once clean into ``root``, which advances the run. Each
sample keeps its own state from step to step (a noisy trajectory), so that its deviations
include those propagated from earlier steps, as a candidate's do.
The optimizer step runs without noise (elementwise Adam is the same computation in every
layout); its inputs, the grads, carry the propagated noise.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from tracer.megatron import MegatronTracer
from tracer.store import TraceWriter

__all__ = ["TracedRun", "noise_policy"]


def noise_policy(tp: int, dtype: str):
    """Computation models of the two runs for the noise injector.

    A candidate with tensor parallelism ``tp`` splits the reduction of its row-parallel
    GEMMs (forward) and column-parallel input-gradient GEMMs (backward) over ``tp`` ranks and
    sums the partials with an all-reduce in the activation dtype. The injector cannot tell
    which GEMM is split (megatron calls ``torch.matmul`` inside its own autograd functions),
    so in bf16 every GEMM gets the difference bound of one fp32-accumulated GEMM vs a
    ``tp``-way split with a bf16 reduction, which is >= 1.4x the bound of two unsplit runs
    (measured: 1.4-2.3x for tp = 2), hence safe for the unsplit ones too. In fp32 the
    default (two independent runs, ``2 b``) is larger than the split model's difference and
    is kept (``None``).
    """
    if tp <= 1 or dtype != "bf16":
        return None
    from ttrace_num.bounds.summation import Summation
    plain, split = {"summation": Summation()}, {"summation": Summation(split=tp, reduce_fmt="bf16")}

    def policy(path: str, op: str):
        return (plain, split, False) if op in ("matmul", "linear") else None
    return policy


def _megatron_functions() -> tuple[type, ...]:
    """megatron-core's autograd Functions whose backward does arithmetic (GEMMs)."""
    from megatron.core.tensor_parallel.layers import LinearWithGradAccumulationAndAsyncCommunication
    return (LinearWithGradAccumulationAndAsyncCommunication,)


class _StateSnapshot:
    """Copies of every tensor a training step changes: model params, the optimizer's
    (main) params and its state; :meth:`restore` puts them back bit for bit."""

    def __init__(self, model: torch.nn.Module, optimizer: Any) -> None:
        inner = optimizer.optimizer
        self.tensors = [p for p in model.parameters()] + [p for g in inner.param_groups for p in g["params"]]
        self.saved = [t.detach().clone() for t in self.tensors]
        self.state = {p: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
                      for p, st in inner.state.items()}
        self.inner = inner

    def restore(self) -> None:
        with torch.no_grad():
            for t, s in zip(self.tensors, self.saved):
                t.copy_(s)
        self.inner.state.clear()
        for p, st in self.state.items():
            self.inner.state[p] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}


class TracedRun:
    """One rank's tracing of a harness run (see the module docstring)."""

    def __init__(self, trace: dict, model: torch.nn.Module, config: Any, optimizer: Any, *,
                 layout: dict, dtype: str, num_microbatches: int, signature: str) -> None:
        self.root = Path(trace["root"])
        self.samples = int(trace.get("noise_samples", 0))
        self.noise_tp = int(trace.get("noise_tp", 2))
        self.noise_seed = int(trace.get("noise_seed", 0))
        self.model, self.optimizer, self.dtype = model, optimizer, dtype
        rank, world = dist.get_rank(), dist.get_world_size()
        if self.samples and world != 1:
            raise ValueError("noise samples are taken on the single-process reference only")
        lay = {k: layout.get(k) for k in ("tp", "pp", "dp", "sp", "distopt")} | {"dtype": dtype}
        mode = trace.get("mode", "full")
        self.writer = TraceWriter(self.root, rank, world, lay, signature, mode=mode,
                                  run_id=str(trace.get("run_id", "")))
        self.noise_writers = [TraceWriter(self.root / "noise" / f"sample_{i}", rank, world, lay, signature,
                                          mode="full", run_id=f"noise{i}") for i in range(self.samples)]
        self.mt = MegatronTracer(model, config, self.writer, num_microbatches=num_microbatches,
                                 capture=trace.get("capture", ("fwd_in", "fwd_out", "bwd_out", "grad_local",
                                                               "grad", "param")))
        self.bytes = 0
        self.states: list[_StateSnapshot] = []

    def step(self, step: int, forward_backward: Callable, forward_step: Callable) -> float:
        """Run (and trace) one step: ``forward_backward(step_fn)`` runs megatron's schedule
        with ``step_fn`` as ``forward_step_func``; then the optimizer steps. Returns the
        optimizer's grad norm.

        Each noise sample is its own trajectory: it continues from its own state of the
        previous step, so its deviations include every earlier step's, as a candidate's do."""
        from ttrace_num.bounds.summation import Summation
        from ttrace_num.propagate.noise import NoiseInjector, perturb_custom_backward
        fwd = self.mt.wrap_forward_step(forward_step)
        if self.samples:
            clean = _StateSnapshot(self.model, self.optimizer)
            if not self.states:
                self.states = [clean] * self.samples
            grad_sum = Summation(split=self.noise_tp, reduce_fmt=self.dtype)
            for i, w in enumerate(self.noise_writers):
                self.states[i].restore()
                gen = torch.Generator().manual_seed((self.noise_seed * 1_000_003 + step) * 101 + i)
                with self.mt.step(step, writer=w):
                    inj = NoiseInjector(gen, mode="probabilistic", policy=noise_policy(self.noise_tp, self.dtype),
                                        grad_summation=grad_sum)
                    with inj, perturb_custom_backward(inj, *_megatron_functions()):
                        forward_backward(fwd)
                    self.mt.after_optimizer_step(self.optimizer.step()[1])
                self.states[i] = _StateSnapshot(self.model, self.optimizer)
            clean.restore()
        with self.mt.step(step):
            forward_backward(fwd)
            _ok, gnorm, _ = self.optimizer.step()
            self.mt.after_optimizer_step(gnorm)
        f = self.root / f"step_{step:06d}" / f"rank_{dist.get_rank():05d}.safetensors"
        self.bytes += f.stat().st_size if f.exists() else 0
        return gnorm

    def summary(self) -> dict:
        return {"root": str(self.root), "bytes": self.bytes, "noise_samples": self.samples}

    def close(self) -> None:
        self.mt.remove()
