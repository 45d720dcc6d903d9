"""Tracing inside the megatron CPU harness: the candidate's trace, and the reference's trace
plus its noise samples (:class:`tracer.capture.noise_sampler.NoiseSampler`, the thresholds' source).

This is also the reference recipe for a real megatron-core job (docs/tracing.md): one
:class:`tracer.adapters.megatron.MegatronTracer` per rank, and on the reference a ``NoiseSampler``
whose injector models the candidate's split reductions
(:func:`tracer.adapters.megatron.reference_noise`).

Op coverage (:mod:`ttrace_num.propagate.census`): the ops of megatron-core's GPT that no error
model covers are accepted unperturbed, each with its reason (megatron-core's own by
:func:`tracer.adapters.megatron.reference_noise`, this harness's loss by :data:`HARNESS_ACCEPTED`;
in every noise sample's ``run.json`` as ``accepted_ops``): the comparison then lists them instead
of marking the tensors after them ``unmodelled``.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tracer.adapters.megatron import DEFAULT_CAPTURE, MegatronTracer, reference_noise
from tracer.capture.noise_sampler import NoiseSampler
from tracer.capture.resync import candidate_state, load_state
from tracer.trace.store import TraceWriter

__all__ = ["HARNESS_ACCEPTED", "TracedRun"]

#: ops of this harness without an error model, accepted unperturbed (by torch name), and why;
#: megatron-core's own are accepted by :func:`tracer.adapters.megatron.reference_noise`
HARNESS_ACCEPTED = {
    "torch.Tensor.mean": "the harness's loss_func: the fp32 mean of the per-token losses (not perturbed)",
}


class TracedRun:
    """One rank's tracing of a harness run: ``trace = {"root": dir, "mode": "full"|"stats",
    "background": bool, "noise_samples": S, "noise_tp": T, "noise_seed": k, "reuse_amplitudes": bool,
    "capture": [...], "resync_from": dir, "layout_noise": bool}``; ``S > 0`` only on a reference: the single-process one,
    or a distributed one (every rank of a TP/DP reference runs the samples in lockstep, stored
    whole, docs/distributed-reference.md; its noise models its own TP split and the candidate's
    ``noise_tp``);
    ``layout_noise``: the samples perturb only what candidates with up to ``noise_tp``
    tensor-parallel ranks compute differently (:func:`tracer.adapters.megatron.layout_rule`);
    False (the default): every op by two runs' bounds. Opt-in, because the megatron detection
    matrix found false positives with it (docs/detection.md, issue 34): on a reference's own
    trajectory, whose thresholds after an update rest on the samples flipping Adam's near-zero
    updates as often as a candidate (the TP=4 bf16 rows at seed 2: the step-2 embedding output,
    1.36x), and on re-synchronised fp32 references, whose gradient norm (computed inside the
    optimizer's step, not perturbed) no sample moved any more while the candidate's differs by a
    few ulps (2 of 32 rows, ratio inf);
    ``background``: the writer writes each step on a thread of its own
    (``TraceWriter(background=True)``); ``resync_from``: the candidate's trace (captured with
    ``optim``, full mode) this reference re-synchronises to at every step (:mod:`tracer.capture.resync`)."""

    def __init__(self, trace: dict, model: Any, config: Any, optimizer: Any, *,
                 layout: dict, dtype: str, num_microbatches: int, signature: str) -> None:
        self.root = Path(trace["root"])
        self.optimizer = optimizer
        rank, world = dist.get_rank(), dist.get_world_size()
        lay = {k: layout.get(k) for k in ("tp", "pp", "dp", "sp", "distopt")} | {"dtype": dtype}
        if int(layout.get("vpp", 1)) > 1:
            lay["vpp"] = int(layout["vpp"])
        self.writer = TraceWriter(self.root, rank, world, lay, signature, mode=trace.get("mode", "full"),
                                  run_id=str(trace.get("run_id", "")), background=bool(trace.get("background", False)))
        self.resync_from = trace.get("resync_from")
        self.mt = MegatronTracer(model, config, self.writer, num_microbatches=num_microbatches, optimizer=optimizer,
                                 capture=trace.get("capture", DEFAULT_CAPTURE))
        self.sampler = None
        self.scope = None  # the noise's ModuleScope on the reference model (hooks removed by close)
        samples = int(trace.get("noise_samples", 0))
        if samples:
            by_layout = bool(trace.get("layout_noise", False))
            noise = reference_noise(int(trace.get("noise_tp", 2)), dtype, reference_tp=int(layout.get("tp", 1)),
                                    model=model if by_layout and not isinstance(model, list) else None)
            self.scope = noise["injector_kwargs"].get("module_of")
            self.sampler = NoiseSampler(model, optimizer, self.root, layout=lay, signature=signature,
                                        samples=samples, seed=int(trace.get("noise_seed", 0)),
                                        reuse_amplitudes=bool(trace.get("reuse_amplitudes", True)),
                                        store=trace.get("noise_store"), clean_writer=self.writer,
                                        restart=self.resync_from is not None, **_with_accepted(noise))

    def step(self, step: int, forward_backward: Callable, forward_step: Callable) -> tuple[float, list]:
        """Run (and trace) one step: ``forward_backward(step_fn)`` runs megatron's schedule
        with ``step_fn`` as ``forward_step_func`` and returns its microbatch losses; then the
        optimizer steps. Returns the grad norm and the clean run's microbatch losses.
        Re-synchronised (``resync_from``), step ``t >= 1`` starts from the candidate's state at the
        end of step ``t - 1`` (:mod:`tracer.capture.resync`)."""
        if self.resync_from is not None and step > 0:
            load_state(self.optimizer, self.mt.canonical_params(), candidate_state(self.resync_from, step - 1))
        fwd = self.mt.wrap_forward_step(forward_step)

        def traced_step(writer: TraceWriter | None = None):
            with self.mt.step(step, writer=writer):
                losses = forward_backward(fwd)
                _ok, gnorm, _ = self.optimizer.step()
                self.mt.after_optimizer_step(gnorm)
            return gnorm, losses

        return traced_step() if self.sampler is None else self.sampler.step(step, traced_step)

    def summary(self) -> dict:
        """Where the trace is and its size (waits for a background writer: everything on disk)."""
        self.writer.wait()
        files = self.root.glob(f"step_*/rank_{dist.get_rank():05d}.safetensors")
        return {"root": str(self.root), "bytes": sum(f.stat().st_size for f in files),
                "noise_samples": len(self.sampler.writers) if self.sampler else 0,
                "amplitudes_reused": self.sampler.amplitude_hits if self.sampler else 0,
                "amplitudes_patched": self.sampler.amplitude_patched if self.sampler else 0,
                "amplitudes_computed": self.sampler.amplitude_misses if self.sampler else 0,
                "sample_seconds": self.sampler.sample_seconds if self.sampler else []}

    def close(self) -> None:
        self.mt.remove()
        if self.scope is not None:
            self.scope.remove()
        self.writer.wait()


def _with_accepted(kw: dict[str, Any]) -> dict[str, Any]:
    """``reference_noise``'s keywords with :data:`HARNESS_ACCEPTED` in the injector's ``accepted``."""
    inj = dict(kw.get("injector_kwargs") or {})
    inj["accepted"] = {**(inj.get("accepted") or {}), **HARNESS_ACCEPTED}
    return {**kw, "injector_kwargs": inj}
