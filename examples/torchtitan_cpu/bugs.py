"""Injected bugs of the torchtitan-style harness (FSDP2, HSDP, DTensor TP/SP).

Each bug is a ``patch(run) -> undo`` registered in :data:`BUGS` with the catalogue entry it
reproduces, its class, the layout it needs (``needs={"layout": "r1.s2.t1"}``, a
:class:`~examples.torchtitan_cpu.parallelize.Layout` name) and the first divergence it must
produce (``expected_phase``, ``expected_name``: an ``fnmatch`` pattern on the canonical name,
``expected_step``: ``None`` for any). ``run`` is this rank's
:class:`~examples.torchtitan_cpu.train.Run` *before its model is built* (its ``layout``, ``dtype``,
``mesh``, ``dp_rank`` and ``tp_rank`` are set): the patch replaces one small module-level function
of the harness (looked up at call time), so a bug may change a build step (the tensor-parallel
plan, FSDP2's settings: :mod:`examples.torchtitan_cpu.parallelize`) as well as a training one
(:mod:`examples.torchtitan_cpu.train`, :mod:`examples.torchtitan_cpu.model`).
``trace_job({..., "bug": NAME})`` (:mod:`examples.torchtitan_cpu.run`) injects it on every rank of
the candidate.

The expected first divergences were declared before the bugs were first run.
"""
from __future__ import annotations

import torch

from examples.bug_registry import Registry, replace
from examples.torchtitan_cpu import model as titan_model
from examples.torchtitan_cpu import parallelize, train

__all__ = ["BUGS", "bug"]

BUGS = Registry()
bug = BUGS.bug


# --- gradient reduction and accumulation (FSDP2 / HSDP) -------------------------------------------

@bug("fsdp_grad_accum_doubled", catalogue="B24", bug_class="wrong accumulation (stale buffer)",
     needs={"layout": "r1.s1.t2+sp"}, expected_phase="grad", expected_name="tok_embeddings.weight",
     doc="(moved from r1.s1.t2, whose norm weights the tracer cannot assemble: FSDP2 DTensors on the dp-only "
         "mesh carry no tp placement) the gradient accumulation buffer is doubled before every microbatch's gradient is added "
         "(buf_k = 2 buf_{k-1} + g_k, as when the accumulate reads the buffer it is writing: FSDP2 over a "
         "data-parallel group of size 1, where the reduce-scatter is a copy): over the 4 microbatches "
         "of a step the gradient is 8 g_0 + 4 g_1 + 2 g_2 + g_3 instead of their sum. Each microbatch's "
         "unsharded gradient (grad_local) is right; the accumulated p.grad is the first wrong tensor")
def _grad_accum_doubled(run):
    return replace(train, "microbatch_backward", doubling_microbatch_backward)


def doubling_microbatch_backward(model: torch.nn.Module, loss: torch.Tensor, n: int) -> None:
    """B24's ``train.microbatch_backward``: the accumulated gradients doubled, then this microbatch's added."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(2)
    (loss / n).backward()


@bug("fsdp_avg_reduces_as_sum", catalogue="B26", bug_class="wrong scale factor (collective op)",
     needs={"layout": "r1.s2.t1"}, expected_phase="grad", expected_name="tok_embeddings.weight",
     doc="ReduceOp.AVG silently a SUM (gloo): FSDP2's gradient reduce-scatter sums the data-parallel "
         "ranks' gradients and the divide factor is lost (set_force_sum_reduction_for_comms(True) with "
         "set_gradient_divide_factor(1.0)): every reduce-scattered gradient is dp = 2 times too large, the "
         "unsharded per-microbatch gradients (grad_local) are right")
def _avg_is_sum(run):
    return replace(parallelize, "fsdp_reduction", lambda layout: (1.0, True))


@bug("hsdp_divide_factor_shard_only", catalogue="B06", bug_class="wrong scale factor",
     needs={"layout": "r2.s2.t1"}, expected_phase="grad", expected_name="tok_embeddings.weight",
     doc="HSDP's gradient divide factor is the shard group's size (dp_shard) instead of the whole "
         "data-parallel size (dp_replicate x dp_shard): the reduce-scatter and the all-reduce over the "
         "replicas sum, the result is divided by 2 instead of 4, every gradient is dp_replicate = 2 times "
         "too large")
def _hsdp_divide(run):
    return replace(parallelize, "fsdp_reduction", lambda layout: (float(layout.dp_shard), True))


@bug("fsdp_params_not_regathered", catalogue="B99", bug_class="stale buffer (parameters not re-gathered)",
     needs={"layout": "r1.s2.t1"}, expected_phase="grad_norm", expected_name="grad_norm", expected_step=0,
     doc="FSDP2 keeps the unsharded parameters after backward (set_reshard_after_backward(False)) and "
         "nobody reshards them after the optimizer step: the next forward finds them unsharded, skips "
         "the all-gather and computes with the previous step's (bf16) copy. Step 0 is right, its updated "
         "(sharded) parameters too; step 1's first module (the root's tok_embeddings, which FSDP2 does not "
         "reshard after forward either) uses stale weights. Declared first as fwd tok_embeddings.output "
         "at step 1; found at step 0's grad norm, and the mechanism says why: FSDP2 registers the "
         "unsharded parameters on the modules while they are unsharded, so after this backward "
         "model.parameters() yields the unsharded copies, and clip_grad_norm_ (train.clip_gradients) "
         "computes the norm over their gradients instead of the reduce-scattered DTensor gradients the "
         "optimizer steps with; the stale forward comes after")
def _not_regathered(run):
    return replace(parallelize, "reshard_after_backward", lambda layout: False)


# --- tensor and sequence parallelism (DTensor plan) -----------------------------------------------

@bug("sp_ffn_norm_not_sequence_parallel", catalogue="B23/B04", bug_class="collective missing (norm grad over tp)",
     needs={"layout": "r1.s1.t2+sp"}, expected_phase="grad_local", expected_name="layers.1.ffn_norm.weight",
     doc="the tensor-parallel plan leaves ffn_norm out of SequenceParallel: the norm runs on each rank's "
         "sequence shard with a plain (FSDP2-only, not tp-replicated) weight, so its weight gradient is the "
         "rank's partial sum over its own tokens and is never all-reduced over tp. The forward is right; "
         "the first wrong tensor is the last block's ffn_norm weight gradient in the backward, whose tp "
         "copies disagree (withdrawn while the tracer could not assemble FSDP2 weights on the dp-only mesh; "
         "re-registered unchanged once it could, before its first comparison)")
def _norm_not_sp(run):
    return _edited_block_plan(lambda block: block.pop("ffn_norm", None))


@bug("rowwise_partial_output_as_replicate", catalogue="B17", bug_class="collective missing (pending sum)",
     needs={"layout": "r1.s1.t2"}, expected_phase="fwd", expected_name="layers.0.attention.output",
     doc="attention.wo's RowwiseParallel declares output_layouts=Partial(): its output keeps the pending "
         "sum over tp and use_local_output hands each rank its own partial product, which the residual "
         "add then uses as if it were replicated. wo's own output is recorded as the DTensor it computed "
         "(Partial: it sums correctly); the attention module returns the local tensor the style made of "
         "it, which has the full shape and so is recorded as replicated over tp: its copies disagree there "
         "(first declared at the residual stream entering ffn_norm, never run: the declaration was changed "
         "before the first comparison, from how the tracer places a plain tensor made local from a DTensor)")
def _partial_as_replicate(run):
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.parallel import RowwiseParallel
    return _edited_block_plan(lambda block: block.update({"attention.wo": RowwiseParallel(output_layouts=Partial())}))


def _edited_block_plan(edit):
    """Replace ``parallelize.tp_plan`` by one whose per-block plan ``edit(block)`` changed in place."""
    orig = parallelize.tp_plan

    def plan(layout):
        top, block = orig(layout)
        edit(block)
        return top, block
    return replace(parallelize, "tp_plan", plan)


@bug("sp_rope_rank_offset", catalogue="B29", bug_class="layout/indexing (wrong offset)",
     needs={"layout": "r1.s2.t2+sp"}, expected_phase="fwd", expected_name="layers.0.attention.wo.input",
     doc="under sequence parallelism RoPE is given a rank-dependent position offset tp_rank * local_seq "
         "(as if the rank still held its sequence shard), although attention runs on the all-gathered "
         "sequence: tp rank 1's heads rotate position p by angle (p + seq/2) mod seq, which changes the "
         "relative positions of pairs across the wrap. Declared first as fwd layers.0.attention.wo.input "
         "(the attention output), where it is first wrong. The norm statistics could not see it there: at "
         "initialisation (weights std 0.02) the logits q.k/sqrt(d) are ~1e-3, the softmax is almost "
         "uniform and the attention output barely depends on the rotation angles (its error stayed under "
         "the bf16 norm threshold), and it was found first at the gradient of the last block's q/k "
         "projections (dL/dq, dL/dk rotated back by the wrong angles linearly; declared there until issue "
         "34). The element statistic (tracer.compare.elementwise) sees the few wrong elements of the "
         "attention output at step 0: the declaration is the first one again")
def _rope_offset(run):
    offset = run.tp_rank * (run.args.max_seq_len // max(run.layout.tp, 1))

    def apply_rotary_emb(x, cos, sin, offset_=0):
        pos = (torch.arange(x.shape[1]) + offset) % cos.shape[0]
        c = cos[pos].to(x.dtype)[None, :, None, :]
        s = sin[pos].to(x.dtype)[None, :, None, :]
        return x * c + titan_model.rotate_half(x) * s
    return replace(titan_model, "apply_rotary_emb", apply_rotary_emb)


@bug("microbatch_loss_not_divided", catalogue="B21", bug_class="wrong scale factor",
     needs={"layout": "r1.s2.t1"}, expected_phase="bwd", expected_name="output*_grad",
     doc="each microbatch's loss is back-propagated without dividing by the rank's number of "
         "microbatches (2 here): the gradient of the step is the sum, not the mean, over the rank's "
         "microbatches, so every activation gradient, starting at the logits' (the first backward "
         "record), is 2 times too large. (Registered on r1.s2.t1+ac; moved to r1.s2.t1 before any "
         "comparison because the tracer's records of a checkpointed candidate do not match its "
         "reference's: recomputation re-records block outputs' gradients as 'call 1'.)")
def _loss_not_divided(run):
    return replace(train, "microbatch_backward", lambda model, loss, n: loss.backward())


@bug("dp_ranks_read_the_same_microbatches", catalogue="B99", bug_class="data sharding (wrong offset)",
     needs={"layout": "r1.s2.t1+tied"}, expected_phase="fwd", expected_name="input",
     doc="every data-parallel rank reads the first n microbatches of the global batch (the loader is not "
         "offset by the dp rank): dp rank 1 trains on microbatches 0..n-1 again instead of n..2n-1. The "
         "first wrong tensor is the model's input (token ids) of global microbatch n, the first one that "
         "dp rank 1 should have read (tied embeddings)")
def _same_microbatches(run):
    return replace(train.Run, "microbatches", lambda self, step: train.global_batch(step, self.args)[:self.n_local])


# --- optimizer step ---------------------------------------------------------------------------------

@bug("clip_grad_norm_local_shards", catalogue="B19", bug_class="collective missing (norm over shards)",
     needs={"layout": "r1.s2.t1"}, expected_phase="grad_norm", expected_name="grad_norm",
     doc="gradient clipping computes the norm of each rank's local FSDP2 shards (to_local()) instead of "
         "the DTensor gradients' global norm: each rank gets its own, too small total norm (and clip "
         "coefficient). The gradients before clipping are right; the recorded grad norm is the first "
         "wrong tensor")
def _clip_local(run):
    return replace(train, "clip_gradients", clip_local_shards)


def clip_local_shards(model: torch.nn.Module) -> torch.Tensor:
    """The bug's ``train.clip_gradients``: ``clip_grad_norm_`` over the local shards of the gradients."""
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
             for p in model.parameters() if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    coef = torch.clamp(train.MAX_NORM / (norm + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return norm
