"""Layouts of the torchtitan-style harness and how a model is parallelised for one (torchtitan's recipe).

A :class:`Layout` names the mesh sizes and features of one run, ``r<R>.s<S>.t<T>[+feature...]``:
``R`` data-parallel replicas and ``S`` shards (FSDP2 over ``S`` ranks; HSDP when ``R > 1``), ``T``
tensor-parallel ranks, and the features ``sp`` (sequence parallelism), ``lp`` (``loss_parallel``:
the cross entropy on vocabulary-sharded logits), ``ac`` (activation checkpointing of every block),
``tied`` (output projection tied to the embedding), ``fp32`` is not a feature: the dtype is the
run's. The world is ``R * S * T`` ranks on a device mesh ``("dp_replicate", "dp_shard", "tp")``
(``dp_replicate`` and ``tp`` left out where their size is 1, as torchtitan's ``ParallelDims`` does),
tensor-parallel rank fastest.

:func:`parallelize` is torchtitan's ``parallelize_llama``, in its order: the tensor-parallel plan
(``apply_tp``), activation checkpointing (``apply_ac``), then FSDP2 (``apply_fsdp``: each block, then
the root) with ``MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32)`` in bf16 runs. Every layout
applies ``fully_shard``, over one rank where it has no data parallelism, so that mixed precision is
one policy in every layout and in the single-process reference (:meth:`Layout.reference`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

__all__ = ["FEATURES", "Layout", "build_mesh", "fsdp_reduction", "mixed_precision_policy", "parallelize",
           "reshard_after_backward", "tp_plan"]

FEATURES = ("sp", "lp", "ac", "tied")


@dataclass(frozen=True)
class Layout:
    """Mesh sizes and features of one run; ``Layout()`` is the single-process reference."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    sp: bool = False
    lp: bool = False
    ac: bool = False
    tied: bool = False

    def __post_init__(self) -> None:
        for k in ("dp_replicate", "dp_shard", "tp"):
            if getattr(self, k) < 1:
                raise ValueError(f"layout {k} must be >= 1, got {getattr(self, k)}")
        if (self.sp or self.lp) and self.tp == 1:
            raise ValueError("sequence parallelism and loss_parallel need tp > 1")
        if self.tied and self.tp > 1:
            raise ValueError("tied embeddings under tensor parallelism are not part of this harness: "
                             "torchtitan shards the embedding row-wise and the output column-wise, "
                             "one DTensor cannot be both")

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def name(self) -> str:
        return (f"r{self.dp_replicate}.s{self.dp_shard}.t{self.tp}"
                + "".join(f"+{f}" for f in FEATURES if getattr(self, f)))

    @classmethod
    def parse(cls, name: str) -> Layout:
        """Inverse of :attr:`name`, e.g. ``"r1.s2.t2+sp"``."""
        sizes, *flags = name.split("+")
        unknown = set(flags) - set(FEATURES)
        if unknown:
            raise ValueError(f"layout {name!r}: unknown feature(s) {sorted(unknown)}; known: {FEATURES}")
        keys = {"r": "dp_replicate", "s": "dp_shard", "t": "tp"}
        try:
            kw: dict[str, Any] = {keys[p[0]]: int(p[1:]) for p in sizes.split(".")}
            return cls(**kw, **{f: True for f in flags})
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"layout {name!r} is not of the form rR.sS.tT[+feature...]: {e}") from e

    def reference(self) -> Layout:
        """The single-process layout of the same model (tied or not)."""
        return Layout(tied=self.tied)

    def with_(self, **kw: Any) -> Layout:
        return replace(self, **kw)


def build_mesh(layout: Layout) -> Any:
    """The device mesh (CPU, gloo): ``dp_shard`` (FSDP2's, of size 1 without data parallelism) and
    ``dp_replicate`` (HSDP) and ``tp`` where their size is over 1."""
    from torch.distributed.device_mesh import init_device_mesh
    dims = [(n, s) for n, s in (("dp_replicate", layout.dp_replicate), ("dp_shard", layout.dp_shard),
                                ("tp", layout.tp)) if s > 1 or n == "dp_shard"]
    return init_device_mesh("cpu", tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))


def tp_plan(layout: Layout) -> tuple[dict[str, Any], dict[str, Any]]:
    """torchtitan's tensor-parallel plan: (the model's top level, each block's)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )
    seq = Shard(1) if layout.sp else Replicate()
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if layout.lp else Replicate(),
                                  use_local_output=not layout.lp),
    }
    if layout.sp:
        top["norm"] = SequenceParallel()
    block = {
        "attention": PrepareModuleInput(input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None)),
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
        "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        "feed_forward.w3": ColwiseParallel(),
    }
    if layout.sp:
        block.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
    return top, block


def parallelize(model: nn.Module, layout: Layout, mesh: Any, dtype: torch.dtype,
                reshard_after_forward: bool = True) -> nn.Module:
    """Apply TP, activation checkpointing and FSDP2 to ``model`` in place (torchtitan's order);
    returns the model."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    names = mesh.mesh_dim_names
    if layout.tp > 1:
        top, block = tp_plan(layout)
        parallelize_module(model, mesh["tp"], top)
        for b in model.layers.values():
            parallelize_module(b, mesh["tp"], block)
    if layout.ac:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        for k, b in list(model.layers.items()):
            model.layers[k] = checkpoint_wrapper(b, preserve_rng_state=False)
    dp_mesh = mesh[tuple(n for n in names if n.startswith("dp"))]
    mp = mixed_precision_policy(dtype, mesh.get_rank())
    divide, force_sum = fsdp_reduction(layout)
    for m in [*model.layers.values(), model]:
        fully_shard(m, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        if force_sum:
            m.set_force_sum_reduction_for_comms(True)
        if divide is not None:
            m.set_gradient_divide_factor(divide)
        if not reshard_after_backward(layout):
            m.set_reshard_after_backward(False)
    return model


def mixed_precision_policy(dtype: torch.dtype, rank: int) -> Any:
    """FSDP2's policy on global rank ``rank``: bf16 parameters with fp32 gradient reduction in a bf16
    run (torchtitan's ``mixed_precision_param="bfloat16"``, ``mixed_precision_reduce="float32"``),
    none in an fp32 one. The same on every rank."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if dtype == torch.bfloat16 else MixedPrecisionPolicy())


def fsdp_reduction(layout: Layout) -> tuple[float | None, bool]:
    """FSDP2's gradient reduction settings: (``set_gradient_divide_factor`` or ``None`` for FSDP2's
    default, the data-parallel size; ``set_force_sum_reduction_for_comms``). Default: ``(None, False)``,
    nothing set, FSDP2 averages over ``dp_replicate * dp_shard``."""
    return None, False


def reshard_after_backward(layout: Layout) -> bool:
    """Whether FSDP2 frees the unsharded parameters after backward (its default, ``True``): the next
    forward all-gathers the parameters the optimizer has just updated."""
    return True
