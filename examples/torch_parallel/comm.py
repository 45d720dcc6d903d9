"""Differentiable collectives for the harness's tensor and sequence parallelism (gloo, CPU).

The four conjugate pairs of Megatron's ``tensor_parallel.mappings`` (Shoeybi et al. 2019,
Korthikanti et al. 2022), on dim 0 (tokens) for the sequence-parallel ones:

=====================  =========================  ==========================
function               forward                    backward
=====================  =========================  ==========================
``copy_to``            identity                   all-reduce (sum)
``reduce_from``        all-reduce (sum)           identity
``gather_seq``         all-gather along dim 0     reduce-scatter along dim 0
``reduce_scatter_seq`` reduce-scatter along dim 0 all-gather along dim 0
=====================  =========================  ==========================

``group=None`` (size 1) makes each of them the identity. Sums run in the tensor's dtype (a
bf16 all-reduce rounds in bf16, as NCCL does). The reduce-scatter is an all-reduce followed
by taking this rank's block: the same sums as gloo's ``reduce_scatter`` (which torch 2.13
has), bitwise for two ranks, through the one reduction path every dtype takes. The raw
collectives (:func:`all_reduce`, :func:`all_gather_seq`, :func:`reduce_scatter_seq_raw`) are
also the MoE dispatcher's and the FP8 linear's. Every collective is a module-level function
looked up at call time, so a harness bug can replace one (e.g. skip a reduction) for one run.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_reduce", "all_gather_seq", "reduce_scatter_seq_raw", "copy_to", "reduce_from",
           "gather_seq", "reduce_scatter_seq"]


def all_reduce(t: torch.Tensor, group: Any, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """Sum (or ``op``) of ``t`` over ``group``, a new tensor (``t`` itself when ``group`` is None)."""
    if group is None:
        return t
    out = t.detach().contiguous().clone()
    dist.all_reduce(out, op=op, group=group)
    return out


def all_gather_seq(t: torch.Tensor, group: Any) -> torch.Tensor:
    """The group's tensors concatenated along dim 0, in group-rank order."""
    if group is None:
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=0)


def reduce_scatter_seq_raw(t: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's block (along dim 0) of the sum of ``t`` over the group."""
    if group is None:
        return t
    world = dist.get_world_size(group)
    if t.shape[0] % world:
        raise ValueError(f"reduce-scatter: dim 0 ({t.shape[0]}) is not divisible by the group size "
                         f"{world}; pad the tokens to a multiple of the group size")
    total = all_reduce(t, group)
    return total.chunk(world, dim=0)[dist.get_rank(group)].contiguous()


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g, ctx.group), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter_seq_raw(g, ctx.group), None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_seq_raw(x, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather_seq(g, ctx.group), None


def copy_to(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Enter a tensor-parallel region: identity; the input gradient is summed over ``group``."""
    return x if group is None else _CopyTo.apply(x, group)


def reduce_from(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Leave a tensor-parallel region: sum the partial outputs over ``group``."""
    return x if group is None else _ReduceFrom.apply(x, group)


def gather_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sequence parallel -> tensor parallel: all-gather the token shards along dim 0."""
    return x if group is None else _GatherSeq.apply(x, group)


def reduce_scatter_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Tensor parallel -> sequence parallel: sum the partials and keep this rank's tokens."""
    return x if group is None else _ReduceScatterSeq.apply(x, group)
