"""One rank of the torchtitan-style harness: build, parallelise, train, trace.

:class:`Run` builds this rank's :class:`~examples.torchtitan_cpu.model.Transformer` for a
:class:`~examples.torchtitan_cpu.parallelize.Layout` (the same seed on every rank, then
``parallelize``: TP plan, activation checkpointing, FSDP2) and trains it the way torchtitan's
``Trainer.train_step`` does: a global batch of :data:`GLOBAL_MICROBATCHES` microbatches per step,
data-parallel rank ``d`` running microbatches ``d*n .. d*n+n-1`` (``n = GLOBAL_MICROBATCHES / dp``;
the tensor-parallel ranks of one data-parallel rank share them), each microbatch's
``cross_entropy(logits.float(), labels)`` divided by ``n`` before ``backward()`` (under
``loss_parallel()`` when the layout has ``lp``), FSDP2 averaging the gradients over the ``dp`` ranks
in its reduce-scatter, ``clip_grad_norm_`` over the DTensor gradients, AdamW with a linear warmup
(the learning rate of step ``s`` set from ``s``, :func:`lr_at`, so that a noise sample's re-run of
a step uses the step's rate).

:func:`tracer_for` is the whole integration (:class:`tracer.adapters.dtensor.DTensorTracer`), and
:meth:`Run.train_step` carries the trace calls, marked ``# trace``.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F

from examples.torchtitan_cpu.model import ModelArgs, Transformer
from examples.torchtitan_cpu.parallelize import Layout, build_mesh, parallelize
from tracer.adapters.dtensor import DTensorTracer
from tracer.trace.store import TraceWriter

__all__ = ["DTYPES", "GLOBAL_MICROBATCHES", "Run", "clip_gradients", "cross_entropy", "lr_at", "microbatch_backward",
           "tracer_for"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GLOBAL_MICROBATCHES = 4
MICRO_BATCH = 2          # sequences per microbatch
LR, WARMUP_STEPS, MAX_NORM, WEIGHT_DECAY = 3e-3, 2, 1.0, 0.1


def lr_at(step: int) -> float:
    """Linear warmup over :data:`WARMUP_STEPS` steps, then constant (torchtitan's ``warmup_stable``)."""
    return LR * min(1.0, (step + 1) / WARMUP_STEPS)


def global_batch(step: int, args: ModelArgs) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The step's (tokens, next-token labels) per microbatch, identical in every run."""
    g = torch.Generator().manual_seed(1000 + step)
    seqs = torch.randint(0, args.vocab_size, (GLOBAL_MICROBATCHES, MICRO_BATCH, args.max_seq_len + 1), generator=g)
    return [(s[:, :-1], s[:, 1:]) for s in seqs]


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torchtitan's loss: the mean cross entropy of the fp32 logits."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def microbatch_backward(model: torch.nn.Module, loss: torch.Tensor, n: int) -> None:
    """One microbatch's backward: ``loss / n``, its gradients accumulated into ``p.grad`` (by FSDP2,
    into the reduce-scattered sharded gradients)."""
    (loss / n).backward()


def clip_gradients(model: torch.nn.Module) -> torch.Tensor:
    """``clip_grad_norm_`` over the (DTensor) gradients; returns the total norm as a plain tensor.

    Gradients on different device meshes (a parameter that a tensor-parallel plan left out, sharded by
    FSDP2 on the data-parallel mesh only, beside 2-D ones; DTensor cannot stack their norms) get
    torchtitan's treatment of expert-parallel parameters: one norm per mesh, combined as plain tensors."""
    params = [p for p in model.parameters() if p.grad is not None]
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    if len(groups) <= 1:
        norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    norms = [torch.nn.utils.get_total_norm([p.grad for p in ps], foreach=True) for ps in groups.values()]
    norm = torch.linalg.vector_norm(torch.stack([n.full_tensor() if hasattr(n, "full_tensor") else n
                                                 for n in norms]))
    coef = min(1.0, MAX_NORM / (float(norm) + 1e-6))
    with torch.no_grad():
        for p in params:
            p.grad.mul_(coef)
    return norm


class Run:
    """This rank's model, optimizer and data for ``layout`` in ``dtype`` (``"fp32"``/``"bf16"``)."""

    def __init__(self, layout: Layout, dtype: str, seed: int = 0, args: ModelArgs | None = None,
                 bug: str | None = None) -> None:
        self.layout, self.dtype = layout, dtype
        self.args = args or ModelArgs(tied_embeddings=layout.tied)
        self.mesh = build_mesh(layout)
        names = self.mesh.mesh_dim_names
        coord = self.mesh.get_coordinate()
        self.dp_rank = 0
        for i, n in enumerate(names):
            if n.startswith("dp"):
                self.dp_rank = self.dp_rank * self.mesh.size(i) + int(coord[i])
        self.tp_rank = int(coord[names.index("tp")]) if "tp" in names else 0
        # an injected bug (examples.torchtitan_cpu.bugs) patches the harness before the model is built,
        # so that it may replace a build step (the TP plan, FSDP2's settings) as well as a training one
        self.undo_bug = None
        if bug:
            from examples.torchtitan_cpu.bugs import BUGS
            self.undo_bug = BUGS.inject(bug, self)
        torch.manual_seed(seed)
        self.model = parallelize(Transformer(self.args), layout, self.mesh, DTYPES[dtype])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr_at(0), weight_decay=WEIGHT_DECAY, foreach=True)
        self.n_local = GLOBAL_MICROBATCHES // layout.dp

    def microbatches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        n = self.n_local
        return global_batch(step, self.args)[self.dp_rank * n:(self.dp_rank + 1) * n]

    def loss_context(self) -> Any:
        """``loss_parallel()`` for a layout with ``lp`` (forward and backward of the loss), else nothing."""
        if self.layout.lp:
            from torch.distributed.tensor.parallel import loss_parallel
            return loss_parallel()
        return contextlib.nullcontext()

    def train_step(self, step: int, tr: DTensorTracer, writer: TraceWriter | None = None) -> float:
        """One optimizer step over this rank's microbatches; returns the sum of their losses / n."""
        for g in self.opt.param_groups:
            g["lr"] = lr_at(step)
        total = 0.0
        with tr.step(step, writer):                                          # trace
            for i, (tokens, labels) in enumerate(self.microbatches(step)):
                tr.microbatch(i)                                             # trace
                with self.loss_context():
                    loss = cross_entropy(self.model(tokens), labels)
                    tr.record_loss(loss)                                     # trace
                    microbatch_backward(self.model, loss, self.n_local)
                total += float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss) / self.n_local
            tr.after_backward()                                              # trace
            tr.record_grad_norm(clip_gradients(self.model))                  # trace
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            tr.after_optimizer_step()                                        # trace
        return total


def tracer_for(run: Run, writer: TraceWriter, capture: tuple[str, ...] | None = None) -> DTensorTracer:
    """The run's tracer: everything the adapter records by default (module inputs, outputs and
    output gradients, unsharded and reduce-scattered gradients, the grad norm, the updated
    parameters)."""
    kw = {"capture": capture} if capture else {}
    return DTensorTracer(run.model, writer, mesh=run.mesh, num_microbatches=run.n_local,
                         sequence_parallel=run.layout.sp, optimizer=run.opt, **kw)
