"""DTensors in a trace: this rank's local shard and the placement that assembles it.

A ``DTensor`` (``torch.distributed.tensor``: FSDP2's sharded parameters and gradients,
tensor/sequence parallelism's module inputs and outputs, ``loss_parallel``'s logits) is
stored as its local shard (``t.to_local()``) with a :class:`~tracer.trace.canonical.Placement`
read from its spec: one :class:`~tracer.trace.canonical.ShardDim` per mesh dimension,

=====================================  ==================================================
DTensor placement on mesh dim ``i``    ShardDim over group ``mesh_dim_names[i]``
=====================================  ==================================================
``Shard(d)``                           ``contiguous`` on tensor dim ``d`` (``torch.chunk``
                                       sizes: uneven shards, the last ranks shorter or empty)
``_StridedShard(d, split_factor=k)``   ``contiguous`` on dim ``d``, applied *after* the mesh
                                       dims to its right that shard dim ``d`` (FSDP2 x TP:
                                       TP shards a weight first, FSDP2 shards the TP shard)
``Replicate()``                        ``replicated`` (the checker requires equal copies)
``Partial("sum")``                     ``partial`` (a pending sum, assembled in float64); a
                                       masked partial (vocabulary-parallel embedding) is stored
                                       with the out-of-range rows zeroed, the summand it means
=====================================  ==================================================

in the order the shards were cut, outermost first (mesh order, but a strided shard after the
dims it follows), which :func:`tracer.trace.canonical.assemble` undoes innermost first.
``full_shape`` is the DTensor's global shape. Other placements (``Partial("max")``) are refused with a ``ValueError`` naming them:
a placement the checker cannot assemble must not be stored as if it could.

Functional collectives hand back an ``AsyncCollectiveTensor`` (e.g. a ``RowwiseParallel``
output before anything reads it): :func:`local_shard` waits for it, the only synchronisation
the tracer adds, on a tensor the next op would wait for anyway.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tracer.trace.canonical import Placement, ShardDim

__all__ = ["dtensor_placement", "is_dtensor", "local_shard"]


def is_dtensor(t: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (False where torch has no DTensor)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(t, DTensor)


def _waited(t: torch.Tensor) -> torch.Tensor:
    """``t``, or the tensor an ``AsyncCollectiveTensor`` stands for once its collective completed."""
    try:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
    except ImportError:
        return t
    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def local_shard(t: torch.Tensor) -> tuple[torch.Tensor, Placement | None]:
    """``(local tensor, placement)`` of a DTensor; ``(t, None)`` for any other tensor (an
    ``AsyncCollectiveTensor`` waited for). The local tensor is a view, not a copy."""
    if is_dtensor(t):
        return _masked(_waited(t.to_local()), t.placements), Placement.from_dict(dtensor_placement(t))
    return _waited(t), None


def _masked(local: torch.Tensor, placements: Sequence[Any]) -> torch.Tensor:
    """The summand a masked partial stands for: a vocabulary-parallel embedding's (or gather's)
    local result holds rows of token ids outside this rank's range until the reduction zeroes them
    (``_MaskPartial``'s mask buffer); a copy with those rows zeroed, else ``local`` itself."""
    for pl in placements:
        mask = getattr(getattr(pl, "mask_buffer", None), "data", None)
        if mask is not None:
            local = local.detach().clone()
            if local.dim() == mask.dim():
                local[mask] = 0
            else:
                local[mask, :] = 0
    return local


def dtensor_placement(t: Any, group_names: Sequence[str] | None = None, world: Any = None) -> dict[str, Any]:
    """Placement dict of this rank's local shard of a ``DTensor`` (see the module docstring).

    Group names are the mesh's ``mesh_dim_names`` (or ``group_names``, or ``mesh<i>``).
    ``world``: the run's whole device mesh (named dimensions), for a *parameter* (or its gradient or
    optimizer state): one on a sub-mesh of it (FSDP2's parameters that a tensor-parallel plan leaves
    out live on the data-parallel mesh alone) is held by every rank of the dimensions its mesh
    lacks: ``replicated`` over each of them (outermost), so that the checker compares those copies
    instead of finding two ranks with one coordinate. Not for activations: data-parallel ranks hold
    different microbatches of those, told apart by their global microbatch numbers.
    Duck-typed on ``placements``, ``device_mesh`` (``size(i)``, ``get_coordinate()``) and
    ``shape``. Raises ``ValueError`` for a rank outside the mesh, a partial other than a sum,
    and a strided shard whose split factor is not the product of the mesh dims it follows.
    """
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard
    mesh = t.device_mesh
    names = list(group_names or getattr(mesh, "mesh_dim_names", None) or
                 [f"mesh{i}" for i in range(len(t.placements))])
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError("this rank is not in the DTensor's device mesh")
    ndim = max(len(t.shape), 1)
    dims: list[ShardDim] = []
    strided: list[tuple[int, ShardDim, int]] = []  # (mesh dim, its ShardDim, split factor)
    for i, pl in enumerate(t.placements):
        rank, size = int(coord[i]), int(mesh.size(i))
        if isinstance(pl, _StridedShard):
            strided.append((i, ShardDim(int(pl.dim) % ndim, names[i], rank, size, "contiguous"),
                            int(pl.split_factor)))
            dims.append(strided[-1][1])
        elif isinstance(pl, Shard):
            dims.append(ShardDim(int(pl.dim) % ndim, names[i], rank, size, "contiguous"))
        elif isinstance(pl, Replicate):
            dims.append(ShardDim(None, names[i], rank, size, "replicated"))
        elif isinstance(pl, Partial):
            if getattr(pl, "reduce_op", "sum") != "sum":
                raise ValueError(f"Partial({pl.reduce_op!r}) over {names[i]}: only a pending sum is supported")
            dims.append(ShardDim(None, names[i], rank, size, "partial"))
        else:
            raise ValueError(f"unsupported DTensor placement {pl!r} on mesh dim {i} ({names[i]}): the "
                             "checker could not assemble it; exclude this module or record a redistributed copy")
    for i, sd, factor in strided:  # cut after the later mesh dims that shard the same tensor dim
        later = [d for d in dims[i + 1:] if d.kind == "contiguous" and d.dim == sd.dim]
        if factor != int(torch.tensor([d.size for d in later], dtype=torch.int64).prod()):
            raise ValueError(f"_StridedShard({sd.dim}, split_factor={factor}) over {sd.group}: the mesh dims "
                             f"after it shard dim {sd.dim} into {[d.size for d in later]} pieces; only a split "
                             "factor equal to their product (FSDP2 over a TP shard) is supported")
        dims.remove(sd)
        dims.insert(dims.index(later[-1]) + 1 if later else i, sd)
    if world is not None:
        world_names, world_coord = tuple(world.mesh_dim_names or ()), world.get_coordinate()
        dims[:0] = [ShardDim(None, n, int(world_coord[j]), int(world.size(j)), "replicated")
                    for j, n in enumerate(world_names) if n not in names and int(world.size(j)) > 1]
    return Placement(tuple(dims), full_shape=tuple(t.shape)).to_dict()
