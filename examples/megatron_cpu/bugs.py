"""Injected bugs for the megatron CPU harness: small named monkeypatches, from the catalogue and beyond it.

A bug is a function ``inject(model, config, optimizer) -> undo`` registered with
:func:`bug`, with the layout it needs and the first divergence it must produce
(``expected_phase``, ``expected_name`` as an ``fnmatch`` pattern on the canonical name).
It patches megatron-core or the harness for one run, never the installed files, and
``undo()`` restores everything. Adding one takes about 20 lines::

    @bug("my_bug", catalogue="B99", bug_class="wrong scale factor", needs={"tp": 2},
         expected_phase="grad", expected_name="*linear_fc2.weight",
         doc="what goes wrong, and where")
    def _my_bug(model, config, optimizer):
        ...patch...
        return lambda: ...unpatch...

``build_and_train(..., bug="my_bug")`` injects it on every rank after the model and the
optimizer are built.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from examples.bug_registry import Bug, Registry
from examples.bug_registry import replace as _replace
from tracer.capture.optim_state import chained, param_groups

__all__ = ["BUGS", "Bug", "bug", "inject"]

BUGS = Registry()
bug = BUGS.bug


def inject(name: str, *, model: Any, config: Any, optimizer: Any) -> Callable[[], None]:
    """Apply bug ``name`` to this rank's run; returns the function that undoes it."""
    return BUGS.inject(name, model, config, optimizer)


def _params(model: Any, pattern: str) -> list:
    found = [p for n, p in model.named_parameters() if pattern in n]
    if not found:
        raise ValueError(f"no parameter name contains {pattern!r}")
    return found


def _modules(model: Any, cls: type) -> list:
    """This rank's modules of type ``cls``; a bug that finds none cannot act, so it says so."""
    found = [m for m in model.modules() if isinstance(m, cls)]
    if not found:
        raise ValueError(f"no {cls.__name__} module on this rank")
    return found


@bug("sp_norm_grad_not_reduced", catalogue="B23/B04", bug_class="missing reduction of a replicated param's grad",
     needs={"tp": 2, "sp": True}, expected_phase="grad_local", expected_name="decoder.layers.0.input_layernorm.weight",
     doc="norm params lose their `sequence_parallel` tag (NeMo looked for another attribute name), so "
         "finalize_model_grads never all-reduces their per-sequence-shard grads over TP")
def _sp_norm(model, config, optimizer):
    norms = _params(model, "layernorm")
    for p in norms:
        p.sequence_parallel = False

    def undo():
        for p in norms:
            p.sequence_parallel = True
    return undo


@bug("grad_norm_undercounts_tp_shards", catalogue="B19", bug_class="norm accounting", needs={"tp": 2},
     expected_phase="grad_norm", expected_name="grad_norm",
     doc="the grad-norm filter checks ownership with the wrong rule for the column-parallel and "
         "vocab-parallel weights (TP-sharded along dim 0): they are counted as TP duplicates, only TP "
         "rank 0's shard enters the norm, and the clip coefficient is wrong")
def _grad_norm(model, config, optimizer):
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    orig = tensor_parallel.param_is_not_tensor_parallel_duplicate

    def filtered(param, tp_group=None):  # param: the optimizer's fp32 main copy (attributes copied)
        if getattr(param, "tensor_model_parallel", False) and getattr(param, "partition_dim", None) == 0:
            return ps.get_tensor_model_parallel_rank() == 0
        return orig(param, tp_group)
    return _replace(tensor_parallel, "param_is_not_tensor_parallel_duplicate", filtered)


@bug("vocab_ce_local_denominator", catalogue="B13", bug_class="partition-local statistic used as global",
     needs={"tp": 2}, expected_phase="loss", expected_name="loss_per_token",
     doc="the vocab-parallel cross entropy divides by this rank's partition of sum(exp(logits)) instead "
         "of the all-reduced sum over the whole vocabulary")
def _vocab_ce(model, config, optimizer):
    from megatron.core.tensor_parallel.cross_entropy import (
        VocabParallelCrossEntropy as V,
    )
    orig = V.calculate_cross_entropy_loss

    def local(exp_logits, predicted_logits, sum_exp_logits):
        return orig(exp_logits, predicted_logits, exp_logits.sum(dim=-1))
    return _replace(V, "calculate_cross_entropy_loss", staticmethod(local))


@bug("lost_grad_contribution", catalogue="B27", bug_class="lost gradient contribution",
     needs={"tp": 2}, expected_phase="grad_local", expected_name="decoder.layers.0.mlp.linear_fc1.weight",
     doc="global rank 0 loses its accumulated fc1 weight grad before the cross-rank reduction "
         "(a hook that fired twice reset the accumulator)")
def _lost_grad(model, config, optimizer):
    import torch.distributed as dist
    victims = _params(model, "linear_fc1.weight")
    orig = config.finalize_model_grads_func

    def finalize(*a, **k):
        if dist.get_rank() == 0:
            for p in victims:
                p.main_grad.zero_()
        return orig(*a, **k)
    return _replace(config, "finalize_model_grads_func", finalize)


class _Done:
    """The handle of a collective that a patched, synchronous replacement already completed."""

    def wait(self) -> None:
        return None


def _ddp_buffers(model: Any) -> list:
    """The DDP wrapper's grad buffers (dense and expert-parallel)."""
    bufs = list(getattr(model, "buffers", [])) + list(getattr(model, "expert_parallel_buffers", []))
    if not bufs:
        raise ValueError("bug needs the DistributedDataParallel-wrapped model (no grad buffers found)")
    return bufs


@bug("dp_grad_scale_skipped", catalogue="B06", bug_class="wrong scale factor", needs={"dp": 2},
     expected_phase="grad", expected_name="*",
     doc="the 1/dp pre-scaling of the data-parallel gradient reduction is skipped (B06 scaled by dp "
         "instead of dp*cp): every bucket's `gradient_scaling_factor` is 1, so the reduced grads are the "
         "sum over DP ranks instead of the mean. Each rank's contribution is right (grad_local agrees); "
         "the first reduced grad in execution order is dp times too large")
def _dp_scale(model, config, optimizer):
    buckets = [b for buf in _ddp_buffers(model) for b in buf.buckets]
    saved = [b.gradient_scaling_factor for b in buckets]
    for b in buckets:
        b.gradient_scaling_factor = 1.0

    def undo():
        for b, s in zip(buckets, saved):
            b.gradient_scaling_factor = s
    return undo


@bug("tied_embedding_grad_not_allreduced", catalogue="B07/B08", bug_class="collectives in the wrong order",
     needs={"pp": 2}, expected_phase="grad", expected_name="embedding.word_embeddings.weight",
     doc="the all-reduce of the tied word-embedding / output-layer grads across the first and last PP "
         "stages never happens (B08: it ran on a zero buffer; B07: on mismatched shards), so each stage "
         "updates its copy with its own half of the gradient and the tied copies drift apart")
def _tied_embedding(model, config, optimizer):
    import importlib
    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")  # the module, not the function
    return _replace(fmg, "_allreduce_word_embedding_grads", lambda *a, **k: None)


@bug("tp_activation_grad_not_reduced", catalogue="B16", bug_class="missing reduction of an activation gradient",
     needs={"tp": 2, "sp": False}, expected_phase="bwd", expected_name="decoder.layers.1.pre_mlp_layernorm*",
     doc="the column-parallel fc1 of layer 1 consumes a TP-replicated input but its input gradient is "
         "not all-reduced over TP (bigcode MQA: the replicated KV projection's dgrad was never reduced); "
         "each TP rank back-propagates only its own partial sum into the pre-MLP norm, whose replicated "
         "output gradient then differs across TP ranks and from the reference")
def _tp_act_grad(model, config, optimizer):
    mods = [m for n, m in model.named_modules() if n.endswith("decoder.layers.1.mlp.linear_fc1")]
    if not mods:
        raise ValueError("no decoder.layers.1.mlp.linear_fc1 on this rank")
    saved = [(m.allreduce_dgrad, m.disable_grad_reduce) for m in mods]
    for m in mods:
        m.allreduce_dgrad, m.disable_grad_reduce = False, True  # no dgrad all-reduce, no copy_to_tp region

    def undo():
        for m, (a, d) in zip(mods, saved):
            m.allreduce_dgrad, m.disable_grad_reduce = a, d
    return undo


@bug("sp_dgrad_reduce_scatter_skipped", catalogue="B16/B10", bug_class="missing reduction of an activation gradient",
     needs={"tp": 2, "sp": True}, expected_phase="bwd", expected_name="decoder.final_layernorm.output_grad",
     doc="under SP the column-parallel linears all-gather their sequence-sharded input; the backward "
         "reduce-scatter of the input gradient is replaced by taking this rank's chunk of its own partial "
         "gradient (no sum over TP). The output layer is column-parallel too (vocab-parallel logits), so "
         "the first wrong tensor in backward order is the gradient into its input, the final norm's "
         "output (sequence-sharded: no replica to drift)")
def _sp_dgrad(model, config, optimizer):
    import torch.distributed as dist
    from megatron.core.tensor_parallel import layers

    def chunk_only(output, input, group=None, async_op=False):
        output.copy_(input.chunk(dist.get_world_size(group), dim=0)[dist.get_rank(group)])
        return _Done() if async_op else None
    return _replace(layers, "dist_reduce_scatter_func", chunk_only)


@bug("loss_not_normalised_by_microbatches", catalogue="B21", bug_class="wrong scale factor", needs={"pp": 2},
     expected_phase="bwd", expected_name="output_layer*",
     doc="the pipeline schedule back-propagates the sum of the microbatch losses instead of their mean "
         "(torchtitan #2972: PP divided only for logging): `forward_step_calc_loss` is called with "
         "num_microbatches=1. The traced loss (the loss function's value) agrees; the first gradient, "
         "the output layer's output grad, is num_microbatches times too large")
def _loss_norm(model, config, optimizer):
    import inspect

    from megatron.core.pipeline_parallel import schedules
    orig = schedules.forward_step_calc_loss
    sig = inspect.signature(orig)

    def summed(*a, **k):
        bound = sig.bind(*a, **k)
        bound.arguments["num_microbatches"] = 1
        return orig(*bound.args, **bound.kwargs)
    return _replace(schedules, "forward_step_calc_loss", summed)


@bug("grad_norm_wrong_group", catalogue="B31/B09", bug_class="collective on the wrong group",
     needs={"tp": 2, "pp": 2}, expected_phase="grad_norm", expected_name="grad_norm",
     doc="the grad norm's sum of squares is all-reduced over the tensor-parallel group instead of the "
         "model-parallel group (TP x PP): each pipeline stage computes the norm of its own layers only, "
         "the stages disagree on the norm (a replicated scalar) and clip with the wrong coefficient")
def _norm_group(model, config, optimizer):
    from megatron.core import parallel_state as ps
    opts = chained(optimizer)
    saved = [o.__dict__.get("grad_stats_parallel_group", _MISSING) for o in opts]
    for o in opts:
        o.grad_stats_parallel_group = ps.get_tensor_model_parallel_group()

    def undo():
        for o, s in zip(opts, saved):
            if s is _MISSING:
                o.__dict__.pop("grad_stats_parallel_group", None)
            else:
                o.grad_stats_parallel_group = s
    return undo


_MISSING = object()


@bug("vpp_p2p_mispaired", catalogue="B26-like (gloo harness caveat)", bug_class="mispaired point-to-point messages",
     needs={"pp": 2, "vpp": 2}, expected_phase="bwd", expected_name="decoder.layers.1.output_grad*",
     doc="virtual pipelining on 2 stages with batched p2p (megatron's default `batch_p2p_comm=True`): "
         "each rank's previous and next stage are the same peer, and gloo pairs the batched isend/irecv "
         "by posting order: a chunk receives a forward activation where it expects the gradient of its "
         "output (same shape, no error), first the last layer of chunk 0 (layer 1 of 4); found while "
         "building the VPP layouts (the harness turns batching off there)")
def _vpp_batched_p2p(model, config, optimizer):
    saved = config.batch_p2p_comm
    config.batch_p2p_comm = True

    def undo():
        config.batch_p2p_comm = saved
    return undo


# --- beyond the catalogue: bugs written after the detector was built, to try it on bugs it was
# not designed around (docs/detection.md, "Bugs beyond the catalogue") ---------------------------

@bug("row_parallel_bias_per_rank", catalogue="-", bug_class="wrong scale factor", needs={"tp": 2},
     expected_phase="fwd", expected_name="decoder.layers.0.self_attention.linear_proj.output*", expected_step=1,
     doc="the row-parallel linears (attention projection, fc2) add their bias to each rank's partial "
         "output before the all-reduce, so the output carries tp times the bias; each rank's bias grad "
         "is still right. The biases start at zero, so nothing differs until the first update: the "
         "first divergence is the first row-parallel output of step 1")
def _row_bias(model, config, optimizer):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import layers
    orig = layers.RowParallelLinear.forward
    extra = ps.get_tensor_model_parallel_world_size() - 1

    def biased_per_rank(self, input_):
        out, bias = orig(self, input_)
        if bias is not None:  # skip_bias_add: the caller adds `bias` once more
            out = out + extra * bias.detach()
        return out, bias
    return _replace(layers.RowParallelLinear, "forward", biased_per_rank)


@bug("sp_allgather_reversed", catalogue="-", bug_class="layout/indexing (wrong order)",
     needs={"tp": 2, "sp": True}, expected_phase="fwd",
     expected_name="decoder.layers.0.self_attention.linear_qkv.output*",
     doc="the sequence-parallel all-gather in front of the column-parallel linears concatenates the "
         "ranks' sequence chunks in reverse rank order (every gathered shape is right)")
def _sp_gather(model, config, optimizer):
    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel import layers
    orig = layers.dist_all_gather_func

    def reversed_gather(output, input, group=None, async_op=False):
        orig(output, input, group=group, async_op=False)
        chunks = output.chunk(dist.get_world_size(group), dim=0)
        output.copy_(torch.cat(chunks[::-1]))
        return _Done() if async_op else None
    return _replace(layers, "dist_all_gather_func", reversed_gather)


@bug("vocab_embedding_end_off_by_one", catalogue="-", bug_class="layout/indexing (off by one)", needs={"tp": 2},
     expected_phase="fwd", expected_name="embedding.output",
     doc="the vocab-parallel embedding treats the last token id of its partition as out of range "
         "(`vocab_end_index` one short): that token embeds to zeros on every rank")
def _vocab_end(model, config, optimizer):
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding
    mods = _modules(model, VocabParallelEmbedding)
    for m in mods:
        m.vocab_end_index -= 1

    def undo():
        for m in mods:
            m.vocab_end_index += 1
    return undo


@bug("distopt_param_gather_skipped", catalogue="-", bug_class="missing collective",
     needs={"dp": 2, "distopt": True}, expected_phase="param", expected_name="*",
     doc="the distributed optimizer's all-gather of the updated parameters is skipped: each DP rank "
         "updates its own shard of the parameter buffer and keeps the previous step's values elsewhere")
def _distopt_gather(model, config, optimizer):
    from megatron.core.distributed import param_and_grad_buffer as pgb
    group_cls = pgb._ParamAndGradBucketGroup
    orig = group_cls.start_param_sync

    def skipped(self, force_sync=False):
        if force_sync:  # the initial broadcast of the weights
            return orig(self, force_sync=force_sync)
        self.param_gather_dispatched, self.param_gather_handle = True, None
    return _replace(group_cls, "start_param_sync", skipped)


@bug("norm_eps_differs_on_one_rank", catalogue="-", bug_class="configuration differs across ranks",
     needs={"tp": 2, "sp": True}, expected_phase="fwd", expected_name="decoder.layers.0.input_layernorm.output",
     doc="TP rank 1 builds its norms with eps 1e-6 instead of 1e-5 (a default that differs between "
         "two config paths); under SP that rank normalises its half of the sequence differently")
def _norm_eps(model, config, optimizer):
    from megatron.core import parallel_state as ps
    norms = [m for m in model.modules() if "Norm" in type(m).__name__ and hasattr(m, "eps")]
    if not norms:
        raise ValueError("no norm module with an `eps` attribute")
    saved = [m.eps for m in norms]
    if ps.get_tensor_model_parallel_rank() == 1:
        for m in norms:
            m.eps = 1e-6

    def undo():
        for m, e in zip(norms, saved):
            m.eps = e
    return undo


def _shadow(objects: list, attribute: str, make: Callable[[Any], Any]) -> Callable[[], None]:
    """Set ``obj.<attribute> = make(obj)`` on each object, an instance attribute that shadows
    its class's method; returns the undo that deletes them (the class's method shows again)."""
    for obj in objects:
        setattr(obj, attribute, make(obj))

    def undo():
        for obj in objects:
            delattr(obj, attribute)
    return undo


def _on_data_parallel_rank_1(optimizer: Any, option: str, value: Callable[[Any], Any]) -> Callable[[], None]:
    """On DP rank 1, set ``option`` of every param group of the optimizer to ``value(old)``."""
    from megatron.core import parallel_state as ps
    groups = param_groups(optimizer)
    saved = [g[option] for g in groups]
    if ps.get_data_parallel_rank() == 1:
        for g in groups:
            g[option] = value(g[option])

    def undo():
        for g, s in zip(groups, saved):
            g[option] = s
    return undo


@bug("param_copy_truncates", catalogue="-", bug_class="wrong rounding mode", needs={"distopt": True},
     expected_phase="cast", expected_name="optimizer.main_param_cast",
     doc="the optimizer copies its updated fp32 main parameters into the bf16 model parameters by "
         "truncation (round toward zero) instead of round-to-nearest-even: about half the elements "
         "end one ulp smaller in magnitude than the reference's cast (patched in the distributed "
         "optimizer and in megatron's plain mixed-precision optimizer)")
def _param_truncated(model, config, optimizer):
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    def truncated(main):  # round toward zero to bf16: clear the low 16 bits of the fp32 pattern
        return (main.detach().view(torch.int32) & -65536).view(torch.float32)

    def distributed(self):
        orig_distributed(self)
        for mains, models in zip(self.shard_fp32_from_float16_groups, self.model_float16_groups):
            for main, p in zip(mains, models):
                rng = self._get_model_param_range_map(p)["gbuf_world_in_bucket"]
                gbuf, _, bucket = self.model_param_gbuf_map[p]
                self.buffers[gbuf].buckets[bucket].param_data.view(-1)[rng.start:rng.end].copy_(truncated(main))

    def plain(self):
        orig_plain(self)
        models, mains = self._get_model_and_main_params_data_float16()
        for p, main in zip(models, mains):
            p.copy_(truncated(main))
    orig_distributed = DistributedOptimizer._copy_main_params_to_model_params
    orig_plain = Float16OptimizerWithFloat16Params._copy_main_params_to_model_params
    undo = [_replace(DistributedOptimizer, "_copy_main_params_to_model_params", distributed),
            _replace(Float16OptimizerWithFloat16Params, "_copy_main_params_to_model_params", plain)]
    return lambda: [u() for u in undo]


@bug("data_parallel_ranks_read_the_same_samples", catalogue="-", bug_class="data sharding",
     needs={"dp": 2}, expected_phase="fwd", expected_name="embedding.*",
     doc="the data sampler ignores the DP rank: every DP rank trains on DP rank 0's samples (tokens and "
         "labels), so half the global batch is never seen and the other half counts twice; the loss "
         "still falls")
def _same_samples(model, config, optimizer):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel
    orig = GPTModel.forward
    group = ps.get_data_parallel_group()
    src = dist.get_global_rank(group, 0)

    def rank0_samples(self, input_ids, position_ids, attention_mask, *args, labels=None, **kwargs):
        for t in (input_ids, labels):  # every DP rank runs the same schedule: the broadcasts pair up
            if t is not None:
                dist.broadcast(t, src, group=group)
        return orig(self, input_ids, position_ids, attention_mask, *args, labels=labels, **kwargs)
    return _replace(GPTModel, "forward", rank0_samples)


@bug("attention_scale_from_partition_width", catalogue="-", bug_class="partition-local statistic used as global",
     needs={"tp": 2}, expected_phase="fwd",
     expected_name="decoder.layers.0.self_attention.core_attention.scale_mask_softmax.input*",
     doc="core attention derives its head dimension from the rank's partition of the hidden size divided "
         "by the number of heads of the whole model, so under TP the head dimension is tp times too "
         "small and the softmax scale 1/sqrt(d) sqrt(tp) times too large (right at TP=1)")
def _attention_scale(model, config, optimizer):
    import math

    from megatron.core.transformer.dot_product_attention import DotProductAttention
    mods = _modules(model, DotProductAttention)
    saved = [m.softmax_scale for m in mods]
    for m in mods:
        m.softmax_scale = 1.0 / math.sqrt(m.hidden_size_per_partition / m.config.num_attention_heads)

    def undo():
        for m, v in zip(mods, saved):
            m.softmax_scale = v
    return undo


@bug("adam_step_count_reset_on_one_rank", catalogue="-", bug_class="optimizer state",
     needs={"dp": 2, "distopt": True}, expected_phase="options", expected_name="optimizer.state.step",
     expected_step=1,
     doc="DP rank 1's Adam restarts its step count before every update (as after a resume that loads "
         "the moments but not the step), so from the second update on its shard gets the bias "
         "correction of a first step; the step counts (capture options) differ across ranks")
def _adam_step_reset(model, config, optimizer):
    from megatron.core import parallel_state as ps
    inner = [getattr(o, "optimizer", o) for o in chained(optimizer)]
    if ps.get_data_parallel_rank() != 1:
        return lambda: None

    def restarting(opt):
        orig = opt.step

        def step(*args, **kwargs):
            for state in opt.state.values():
                if "step" in state:
                    state["step"] = state["step"] * 0 if hasattr(state["step"], "mul") else 0
            return orig(*args, **kwargs)
        return step
    return _shadow(inner, "step", restarting)


@bug("layernorm_variance_accumulated_in_bf16", catalogue="-", bug_class="precision lost (accumulation in bf16)",
     needs={"tp": 2, "sp": True}, expected_phase="fwd", expected_name="decoder.layers.0.input_layernorm.output",
     doc="the layer norms of a bf16 run accumulate each row's mean and variance in bf16, element by "
         "element (a naive kernel without an fp32 accumulator): the statistics carry the round-off of a "
         "sum of `hidden` terms at 2^-9 per addition, on every rank")
def _norm_bf16_accumulation(model, config, optimizer):
    import torch
    norms = _modules(model, torch.nn.LayerNorm)

    def bf16_sum(x):  # sum over the last dim, one bf16 rounding per addition, in order
        acc = x[..., 0]
        for k in range(1, x.shape[-1]):
            acc = acc + x[..., k]
        return acc.unsqueeze(-1)

    def bf16_accumulating(m):
        def forward(x):
            if x.dtype != torch.bfloat16:
                return torch.nn.LayerNorm.forward(m, x)
            n = x.shape[-1]
            mean = bf16_sum(x) / n
            var = bf16_sum((x - mean).square()) / n
            return ((x - mean).float() * torch.rsqrt(var.float() + m.eps) * m.weight.float()
                    + m.bias.float()).bfloat16()
        return forward
    return _shadow(norms, "forward", bf16_accumulating)


# The three optimizer options below change the fp32 main parameters of one DP rank's shard by
# ~1e-5 relative at step 0: in bf16 below the model parameters' storage precision. They show
# first in the optimizer's options (capture "options"); docs/detection.md, "Bugs beyond the
# catalogue", gives what the parameters alone show.

@bug("adam_eps_differs_on_one_rank", catalogue="-", bug_class="configuration differs across ranks",
     needs={"dp": 2, "distopt": True}, expected_phase="options", expected_name="optimizer.eps",
     doc="DP rank 1's Adam uses eps 1e-6 instead of 1e-8 for the shard of the parameters it updates")
def _adam_eps(model, config, optimizer):
    return _on_data_parallel_rank_1(optimizer, "eps", lambda old: 1e-6)


@bug("weight_decay_on_one_rank", catalogue="-", bug_class="configuration differs across ranks",
     needs={"dp": 2, "distopt": True}, expected_phase="options", expected_name="optimizer.weight_decay",
     doc="DP rank 1 applies weight decay 0.01 (the run's is 0) to the shard of the parameters it updates")
def _weight_decay(model, config, optimizer):
    return _on_data_parallel_rank_1(optimizer, "weight_decay", lambda old: 0.01)


@bug("lr_differs_on_one_rank", catalogue="-", bug_class="configuration differs across ranks",
     needs={"dp": 2, "distopt": True}, expected_phase="options", expected_name="optimizer.lr",
     doc="DP rank 1's learning rate is 1% larger than the run's (a schedule evaluated at another step)")
def _lr(model, config, optimizer):
    return _on_data_parallel_rank_1(optimizer, "lr", lambda old: old * 1.01)


# --- a third round beyond the catalogue, written blind (docs/detection.md, "Bugs beyond the
# catalogue"): masking, stale state across steps, a shard the optimizer never updates, labels
# misaligned on one pipeline stage, and a backward that does not match its forward ---------------

@bug("causal_mask_dropped_on_one_tp_rank", catalogue="-", bug_class="masking",
     needs={"tp": 2}, expected_phase="fwd",
     expected_name="decoder.layers.0.self_attention.core_attention.scale_mask_softmax.output*",
     doc="TP rank 1's attention softmax is handed an empty mask (a mask built for another shape and "
         "broadcast to nothing masked): its heads attend to future tokens, TP rank 0's do not")
def _causal_mask(model, config, optimizer):
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    mods = _modules(model, FusedScaleMaskSoftmax)
    if ps.get_tensor_model_parallel_rank() != 1:
        return lambda: None

    def unmasked(m):
        def forward(input, mask, softmax_offset=None):
            empty = torch.zeros(input.shape[-2:], dtype=torch.bool)
            return FusedScaleMaskSoftmax.forward(m, input, empty, softmax_offset)
        return forward
    return _shadow(mods, "forward", unmasked)


@bug("grad_buffer_not_zeroed_on_one_dp_rank", catalogue="-", bug_class="stale state across steps",
     needs={"dp": 2}, expected_phase="grad_local", expected_name="*", expected_step=1,
     doc="DP rank 1 skips zeroing its gradient buffer at the start of a step (a `zero_grad_buffer` that "
         "returns early), so from step 1 on its accumulated grads start from the previous step's "
         "reduced ones; step 0 starts from a zero buffer and is right")
def _grad_not_zeroed(model, config, optimizer):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel
    chunks = [model] if isinstance(model, DistributedDataParallel) else list(model)
    if ps.get_data_parallel_rank() != 1:
        return lambda: None

    def keeping_grads(ddp):
        def zero_grad_buffer():
            buffers = _ddp_buffers(ddp)
            undo = _shadow(buffers, "reset", lambda b: (lambda: None))
            try:
                DistributedDataParallel.zero_grad_buffer(ddp)
            finally:
                undo()
        return zero_grad_buffer
    return _shadow(chunks, "zero_grad_buffer", keeping_grads)


@bug("tp_shard_left_out_of_optimizer", catalogue="-", bug_class="parameter never updated",
     needs={"tp": 2}, expected_phase="param", expected_name="decoder.layers.*.mlp.linear_fc2.weight",
     doc="TP rank 1's shard of the fc2 weights never reaches the optimizer (a param list built on that "
         "rank before the MLP was rebuilt): its grads are computed and reduced, but the update leaves "
         "the shard, main copy included, at its initial values")
def _shard_not_updated(model, config, optimizer):
    import torch
    from megatron.core import parallel_state as ps

    from tracer.capture.optim_state import main_param_and_state
    victims = _params(model, "linear_fc2.weight")
    if ps.get_tensor_model_parallel_rank() != 1:
        return lambda: None

    def frozen(opt):
        orig = opt.step

        def step(*args, **kwargs):
            copies = []
            for p in victims:
                found = main_param_and_state(opt, p)
                main = found[0]["main_param"] if found is not None else None
                copies.append((p, p.detach().clone(), main, None if main is None else main.detach().clone()))
            out = orig(*args, **kwargs)
            with torch.no_grad():
                for p, saved, main, saved_main in copies:
                    p.copy_(saved)
                    if main is not None:
                        main.copy_(saved_main)
            return out
        return step
    return _shadow([optimizer], "step", frozen)


@bug("labels_shifted_on_last_pipeline_stage", catalogue="-", bug_class="data misaligned across pipeline stages",
     needs={"pp": 2}, expected_phase="loss", expected_name="loss_per_token",
     doc="the last pipeline stage, which reads the labels itself, shifts them by one token once more "
         "(labels built from the tokens a second time): every logit is scored against the token after "
         "its target; the first stage's activations are right")
def _labels_shifted(model, config, optimizer):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel
    mods = _modules(model, GPTModel)
    if not ps.is_pipeline_last_stage():
        return lambda: None

    def shifted(m):
        def forward(input_ids, position_ids, attention_mask, *args, labels=None, **kwargs):
            if labels is not None:
                labels = labels.roll(-1, dims=1)
            return GPTModel.forward(m, input_ids, position_ids, attention_mask, *args, labels=labels, **kwargs)
        return forward
    return _shadow(mods, "forward", shifted)


@bug("gelu_backward_uses_tanh_approximation", catalogue="-", bug_class="backward does not match forward",
     needs={"tp": 2, "dtype": "fp32"}, expected_phase="bwd",
     expected_name="decoder.layers.1.mlp.linear_fc1.output_grad*",
     doc="the MLP's activation computes the exact (erf) GELU forward but back-propagates the derivative "
         "of the tanh approximation (a fused kernel whose two halves disagree): the derivative is off by "
         "up to 8.7e-4, ~1e-4 on this model's activations, the forward is right. Registered in fp32: in "
         "bf16 the change is below the output gradient's rounding and no comparison can place it "
         "(docs/detection.md)")
def _gelu_backward(model, config, optimizer):
    import torch
    from megatron.core.transformer.mlp import MLP
    mods = _modules(model, MLP)

    class GeluTanhBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return torch.nn.functional.gelu(x)

        @staticmethod
        def backward(ctx, g):  # torch's own backward kernel of the tanh approximation
            (x,) = ctx.saved_tensors
            return torch.ops.aten.gelu_backward(g, x, approximate="tanh")
    return _shadow(mods, "activation_func", lambda m: GeluTanhBackward.apply)


# --- subtle precision bugs, written blind (issue 34): a few ulps lost where megatron-core keeps
# more precision, not a wrong formula. Each acts only on a bf16 run (where the bf16 rounding is
# not already the run's own); the declared first divergence was written before the detector ran ---

def _ddp_chunks(model: Any) -> list:
    """The DDP-wrapped model chunks of this rank (one without virtual pipelining)."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _bf16_round_trip(t: Any) -> None:
    """Round ``t`` (an fp32 buffer) to bf16 and back, in place."""
    import torch
    with torch.no_grad():
        t.copy_(t.to(torch.bfloat16))


@bug("microbatch_grads_accumulated_in_bf16", catalogue="-", bug_class="precision lost (accumulation in bf16)",
     needs={"tp": 2}, expected_phase="grad_local", expected_name="*",
     doc="the gradients of the microbatches are accumulated in bf16: after every microbatch's backward "
         "the fp32 main-grad buffer, into which the DDP hooks just added that microbatch's bf16 "
         "param grads, goes through a bf16 round trip (as a grad buffer kept in the params' dtype "
         "would), so every partial sum from the second microbatch on loses its bits below bf16. "
         "Forward, loss and activation grads are untouched (the buffer feeds nothing in the step); "
         "the first tensor that can differ is the accumulated grad each rank contributes "
         "(grad_local), on any parameter")
def _microbatch_bf16(model, config, optimizer):
    from megatron.core.pipeline_parallel import schedules
    if not config.bf16:
        return lambda: None
    buffers = [b for c in _ddp_chunks(model) for b in _ddp_buffers(c)]
    orig = schedules.backward_step

    def accumulating_in_bf16(*args, **kwargs):
        out = orig(*args, **kwargs)
        for b in buffers:
            _bf16_round_trip(b.grad_data)
        return out
    return _replace(schedules, "backward_step", accumulating_in_bf16)


@bug("softmax_without_max_subtraction_bf16", catalogue="-", bug_class="precision lost (softmax in bf16)",
     needs={"tp": 2}, expected_phase="fwd",
     expected_name="decoder.layers.0.self_attention.core_attention.scale_mask_softmax.output*",
     doc="the attention softmax of a bf16 run is computed in bf16 as exp(x) / sum(exp(x)), without "
         "subtracting the row maximum and without the fp32 upcast megatron's "
         "`attention_softmax_in_fp32` asks for: exp(x), its row sum and the quotient are each rounded to "
         "bf16 (the scores are small here, so nothing overflows: exp(x) ~ 1 carries only 2^-8 of "
         "relative precision). The scores going in agree; the first wrong tensor is the softmax "
         "output of layer 0, on every TP rank")
def _softmax_bf16(model, config, optimizer):
    import torch
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    mods = _modules(model, FusedScaleMaskSoftmax)

    def naive(m):
        def forward(input, mask, softmax_offset=None):
            if input.dtype != torch.bfloat16 or softmax_offset is not None or m.window_size is not None:
                return FusedScaleMaskSoftmax.forward(m, input, mask, softmax_offset)
            x = input * m.scale if m.scale is not None else input
            if mask is not None:
                x = x.masked_fill(mask, -10000.0)  # megatron's attention_mask_func, not in place
            e = torch.exp(x)                       # bf16 throughout, no max subtracted
            return e / e.sum(dim=-1, keepdim=True)
        return forward
    return _shadow(mods, "forward", naive)


@bug("dp_rank_reduces_grads_in_bf16", catalogue="-", bug_class="precision lost (reduction in bf16)",
     needs={"dp": 2}, expected_phase="grad", expected_name="embedding.word_embeddings.weight",
     doc="DP rank 1 reduces its gradients in bf16 instead of fp32 (`grad_reduce_in_fp32` lost on one "
         "rank's config path): its contribution enters the all-reduce / reduce-scatter rounded to bf16, "
         "and its copy of the reduced grads is kept in bf16. The local grads agree; the reduced grads "
         "of DP rank 1 are the bf16 rounding of DP rank 0's, so the DP replicas of the first reduced "
         "grad (the tied word embedding's, first in the parameters' order) disagree bitwise")
def _dp_bf16(model, config, optimizer):
    from megatron.core import parallel_state as ps
    if not config.bf16 or ps.get_data_parallel_rank() != 1:
        return lambda: None
    groups = [g for c in _ddp_chunks(model)
              for g in list(getattr(c, "bucket_groups", [])) + list(getattr(c, "expert_parallel_bucket_groups", []))]
    if not groups:
        raise ValueError("bug needs the DistributedDataParallel-wrapped model (no bucket groups found)")

    def in_bf16(group):
        orig = type(group).start_grad_sync

        def start_grad_sync(*args, **kwargs):
            for b in group.buckets:  # what this rank sends...
                _bf16_round_trip(b.grad_data)
            out = orig(group, *args, **kwargs)  # synchronous: overlap_grad_reduce is off
            for b in group.buckets:  # ...and what it keeps
                _bf16_round_trip(b.grad_data)
            return out
        return start_grad_sync
    return _shadow(groups, "start_grad_sync", in_bf16)


@bug("rotary_angles_computed_in_bf16", catalogue="-", bug_class="precision lost (table in bf16)",
     needs={"tp": 2}, expected_phase="fwd", expected_name="rotary_pos_emb.output*",
     doc="the rotary table of a bf16 run is computed in the params' dtype: positions and inverse "
         "frequencies are cast to bf16 and their outer product (the angles) is rounded to bf16 before "
         "being upcast again (an `inv_freq` converted by a model-wide `.bfloat16()`). Each angle is off by "
         "up to half a bf16 ulp of its own size plus the inverse frequency's rounding (up to ~0.03 rad "
         "at position 31). The rotary module's output, computed before the first layer, is the first "
         "wrong tensor")
def _rotary_bf16(model, config, optimizer):
    import torch
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    mods = _modules(model, RotaryEmbedding)
    if not config.bf16:
        return lambda: None

    def in_bf16(m):
        def get_freqs_non_repeated(max_seq_len, offset=0):
            dtype = m.inv_freq.dtype
            seq = torch.arange(max_seq_len, device=m.inv_freq.device, dtype=torch.bfloat16) + offset
            if m.seq_len_interpolation_factor is not None:
                seq *= 1 / m.seq_len_interpolation_factor
            return torch.outer(seq, m.inv_freq.to(torch.bfloat16)).to(dtype)
        return get_freqs_non_repeated
    return _shadow(mods, "get_freqs_non_repeated", in_bf16)


@bug("loss_averaged_in_bf16", catalogue="-", bug_class="precision lost (loss in bf16)",
     needs={"tp": 2}, expected_phase="loss", expected_name="loss",
     doc="the per-token losses of a bf16 run (fp32 out of megatron's vocab-parallel cross entropy) are "
         "cast to the params' dtype before the loss function averages them: every token's loss "
         "(~ln 128 = 4.85, bf16 ulp 2^-5) is rounded to bf16 first. The per-token losses traced out of "
         "the model agree; the microbatch loss differs by ~1e-3. The gradients do not change (d mean / "
         "d token = 1/32 and the 1/num_microbatches are exact through the cast): only the loss value is "
         "wrong, as a logged loss would be")
def _loss_bf16(model, config, optimizer):
    import inspect

    from megatron.core.pipeline_parallel import schedules
    if not config.bf16:
        return lambda: None
    orig = schedules.forward_step_calc_loss
    sig = inspect.signature(orig)

    def cast_first(*a, **k):
        bound = sig.bind(*a, **k)
        loss_func, dtype = bound.arguments["loss_func"], bound.arguments["config"].params_dtype
        if loss_func is not None:
            def in_params_dtype(output_tensor, *la, **lk):
                return loss_func(output_tensor.to(dtype), *la, **lk)
            bound.arguments["loss_func"] = in_params_dtype
        return orig(*bound.args, **bound.kwargs)
    return _replace(schedules, "forward_step_calc_loss", cast_first)


@bug("norm_weight_grad_summed_in_bf16", catalogue="-", bug_class="precision lost (reduction over tokens in bf16)",
     needs={"tp": 2}, expected_phase="grad_local", expected_name="*layernorm.weight",
     doc="the layer norms' backward sums the weight gradient over the tokens in bf16: each token's "
         "product grad_out * x_hat is rounded to bf16 and the 32 products of a microbatch are added one "
         "by one in bf16 (a naive kernel without an fp32 accumulator); the input and bias gradients "
         "are torch's own, the forward is unchanged. Nothing downstream of a norm weight's grad runs "
         "before the step, so the first wrong tensors are the norm weights' accumulated grads "
         "(grad_local), e.g. layer 0's input norm, first of them in the parameters' order")
def _norm_wgrad_bf16(model, config, optimizer):
    import torch
    import torch.nn.functional as F
    norms = _modules(model, torch.nn.LayerNorm)

    class WeightGradSummedInBf16(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias, shape, eps):
            ctx.save_for_backward(x, weight, bias)
            ctx.shape, ctx.eps = shape, eps
            return F.layer_norm(x, shape, weight, bias, eps)

        @staticmethod
        def backward(ctx, g):
            x, weight, bias = ctx.saved_tensors
            with torch.enable_grad():
                xs, ws, bs = (t.detach().requires_grad_() for t in (x, weight, bias))
                dx, _dw, db = torch.autograd.grad(F.layer_norm(xs, ctx.shape, ws, bs, ctx.eps), (xs, ws, bs), g)
            xf = x.float()
            mean, var = xf.mean(-1, keepdim=True), xf.var(-1, unbiased=False, keepdim=True)
            terms = (g.float() * (xf - mean) * torch.rsqrt(var + ctx.eps)).to(torch.bfloat16)
            terms = terms.reshape(-1, terms.shape[-1])
            dw = terms[0].clone()
            for k in range(1, terms.shape[0]):  # one bf16 rounding per token added
                dw = dw + terms[k]
            return dx, dw, db, None, None

    def bf16_wgrad(m):
        def forward(x):
            if x.dtype != torch.bfloat16 or m.weight is None or m.bias is None:
                return torch.nn.LayerNorm.forward(m, x)
            return WeightGradSummedInBf16.apply(x, m.weight, m.bias, m.normalized_shape, m.eps)
        return forward
    return _shadow(norms, "forward", bf16_wgrad)
