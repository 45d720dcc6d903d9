"""Tracing PyTorch-native distributed training: FSDP2, HSDP and DTensor tensor/sequence parallelism.

:class:`DTensorTracer` traces one rank of a torchtitan-style run: a model parallelised with
``parallelize_module`` (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``,
``PrepareModuleInput``, ``loss_parallel``) on the ``tp`` dimension of a device mesh and sharded
with ``fully_shard`` (FSDP2; HSDP on a 2-D data-parallel mesh) on its data-parallel dimensions,
with or without activation checkpointing and ``torch.compile``. See docs/tracing-torchtitan.md.

What is recorded, and the placement each record gets:

* **DTensors** (FSDP2's sharded parameters and their reduce-scattered gradients, a tensor-parallel
  module's raw output, a ``SequenceParallel`` norm's output, ``loss_parallel`` logits): the local
  shard, with the placement its spec gives (:mod:`tracer.trace.dtensor`: ``Shard``, strided
  shards of FSDP2 x TP, ``Replicate``, ``Partial``, uneven ``torch.chunk`` shards, 1-D and 2-D
  meshes; the mesh dimension names are the group names).
* **module outputs** are recorded *before* the module's other forward hooks (``prepend``): as the
  module computed them, before a parallel style's output function redistributes a pending sum
  or turns a DTensor into a local tensor, and before FSDP2's post-forward casts them.
* **plain tensors** (activations between parallelised modules, FSDP-only runs): under data
  parallelism each rank holds whole microbatches (global microbatch numbers, as
  :class:`~tracer.adapters.ddp.DDPTracer`); on a ``tp`` mesh dimension they are replicated over it,
  or, with ``sequence_parallel=True``, the activations among them (floating tensors of at least
  ``seq_dim + 2`` dimensions: batch, sequence, hidden) are split on ``seq_dim`` (torch's
  ``SequenceParallel`` / ``RowwiseParallel(output_layouts=Shard(1))`` convention) while token ids
  and position tables stay replicated. A module whose plain tensors are
  split otherwise (e.g. an attention kernel module fed head-sharded q/k/v) is named in
  ``plain_placements`` (``fnmatch`` pattern on the canonical module name -> DTensor placement on
  the tp dimension, e.g. ``{"*.sdpa": Shard(1)}``). A plain tensor that a parallel style made local
  from a module's DTensor output (``use_local_output``) keeps that output's layout, whichever module
  returns it (the logits gathered by ``ColwiseParallel(output_layouts=Replicate())`` are replicated).
* **parameters** (``grad``: ``p.grad`` after the backward of the last microbatch, i.e. after
  FSDP2's reduce-scatter, in the reduce dtype; ``param``: after ``optimizer.step()``): as their
  spec says, and replicated over the mesh dimensions their mesh lacks (a norm weight that the
  tensor-parallel plan leaves out is FSDP2-sharded on the data-parallel mesh alone, one copy per
  tp rank: the checker requires the copies to agree bitwise); a parameter that is not a DTensor
  is replicated over the whole mesh.
* **unsharded gradients** (capture ``grad_local``, phase ``grad_local``): each microbatch's
  gradient of the parameter the module computed with -- FSDP2's unsharded (all-gathered,
  ``param_dtype``) parameter -- before FSDP2 reduce-scatters it, taken with a tensor hook on the
  parameter the module holds during its forward. Stored times ``1/dp`` like activation gradients
  (each rank's loss is the mean over its own samples), so that it equals the single-device
  gradient of the same microbatch.
* **canonical names**: the wrapper components ``_checkpoint_wrapped_module``, ``_orig_mod``
  (``torch.compile``), ``_fsdp_wrapped_module`` and DDP's ``module`` are removed from every name
  and the wrapper modules themselves are not traced (their inner module is), so checkpointed,
  compiled and eager models give the same records.
* **layout** (the same on every rank): the mesh sizes by dimension name, the data-parallel size,
  ``sequence_parallel``, and FSDP2's ``MixedPrecisionPolicy`` (param and reduce dtypes) read from
  the ``fully_shard`` modules. The thresholds model it: :func:`injector_models` gives the noise
  sampler the reduce dtype of the gradient reduce-scatter and the TP split of the candidate.
"""
from __future__ import annotations

import fnmatch
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from tracer.adapters.ddp import DDPTracer
from tracer.trace.canonical import Placement, ShardDim
from tracer.trace.dtensor import dtensor_placement, is_dtensor
from tracer.trace.schema import Phase

__all__ = ["DTensorTracer", "WRAPPER_COMPONENTS", "canonical_module_name", "injector_models", "mixed_precision"]

#: name components that wrappers insert (activation checkpointing, torch.compile, FSDP1, DDP)
WRAPPER_COMPONENTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module", "module")
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def _is_wrapper(module: nn.Module) -> bool:
    """A module that only wraps another one (its child under a :data:`WRAPPER_COMPONENTS` name)."""
    wrappers = ("CheckpointWrapper", "OptimizedModule", "DistributedDataParallel", "FullyShardedDataParallel")
    return any(name in WRAPPER_COMPONENTS for name, _ in module.named_children()) and \
        any(c.__name__ in wrappers for c in type(module).__mro__)  # fully_shard subclasses: FSDPCheckpointWrapper


def canonical_module_name(local: str) -> str:
    """``local`` without the wrapper components (:data:`WRAPPER_COMPONENTS`)."""
    return ".".join(c for c in local.split(".") if c and c not in WRAPPER_COMPONENTS)


def mixed_precision(model: nn.Module) -> dict[str, str]:
    """FSDP2's ``MixedPrecisionPolicy`` of ``model``'s ``fully_shard`` modules: ``{"param_dtype",
    "reduce_dtype"}`` as short names (``"fp32"`` where the policy leaves a dtype unset); ``{}``
    without FSDP2. Raises ``ValueError`` if the modules disagree (one policy per run is modelled)."""
    from torch.distributed.fsdp import FSDPModule
    found = set()
    for m in model.modules():
        if isinstance(m, FSDPModule):
            pol = m._get_fsdp_state()._mp_policy
            found.add((pol.param_dtype, pol.reduce_dtype))
    if not found:
        return {}
    if len(found) > 1:
        raise ValueError(f"the fully_shard modules have different mixed-precision policies {sorted(map(str, found))}; "
                         "the thresholds model one policy per run")
    param, reduce = found.pop()
    name = lambda d: _DTYPE_NAMES.get(d, str(d).removeprefix("torch.")) if d is not None else None
    return {"param_dtype": name(param) or "fp32", "reduce_dtype": name(reduce) or name(param) or "fp32"}


def injector_models(layout: dict[str, Any], dtype: str) -> dict[str, Any]:
    """:class:`~ttrace_num.propagate.noise.NoiseInjector` keywords for a reference compared with a
    candidate of ``layout`` (a :attr:`DTensorTracer.layout`) in ``dtype``
    (:func:`tracer.adapters.megatron.injector_models`): its GEMMs split over its ``tp`` size, and the
    parameter-gradient sums over tokens split the same way, partials in ``dtype`` (a norm under
    sequence parallelism: each tp rank's weight gradient is a sum over its tokens, rounded to
    the param dtype before the reduction). FSDP2 reduces the microbatch gradients over ``dp`` in its
    reduce dtype: in fp32 that is one rounding of an fp32 sum, below the bf16/fp32 rounding of the
    gradients themselves; a narrower reduce dtype (``reduce_dtype=bf16``) is modelled as a split of
    those sums over ``tp * dp`` ranks reduced in it."""
    from tracer.adapters.megatron import injector_models as split_models
    from ttrace_num.bounds.summation import Summation
    tp = max(int(layout.get("mesh", {}).get("tp", 1)), 1)
    kw = split_models(tp, dtype)
    reduce = layout.get("mixed_precision", {}).get("reduce_dtype", dtype)
    if reduce in ("bf16", "fp16") and int(layout.get("dp", 1)) > 1:
        kw["grad_summation"] = Summation(split=tp * int(layout["dp"]), reduce_fmt=reduce)
    return kw


def _chunk(n: int, size: int, rank: int) -> int:
    """Length of ``rank``'s piece of ``n`` cut by ``torch.chunk`` into ``size``: ``ceil(n / size)``,
    the last ranks shorter or empty."""
    c = -(-n // size)
    return max(0, min(c, n - rank * c))


class DTensorTracer(DDPTracer):
    """Trace one rank of an FSDP2 / HSDP / DTensor-parallel training loop (module docstring).

    Args:
        model: the parallelised model (after ``parallelize_module`` and ``fully_shard``), or the
            single-device reference (no mesh).
        writer: this rank's :class:`~tracer.trace.store.TraceWriter`.
        mesh: the run's ``DeviceMesh`` (``None``: the reference, one device). Its data-parallel
            dimensions are ``dp_dims`` (those present), its tensor-parallel one ``tp_dim``.
        num_microbatches: microbatches per step on this rank.
        sequence_parallel: plain activations are split on ``seq_dim`` over the tp dimension
            (else replicated over it).
        plain_placements: ``fnmatch`` pattern on canonical module names -> the DTensor
            placement on the tp dimension of that module's plain tensors.
        capture: subset of ``fwd_in fwd_out bwd_out bwd_in grad_local grad grad_norm options param optim``.
        Other keywords as :class:`~tracer.adapters.ddp.DDPTracer`.
    """

    def __init__(self, model: nn.Module, writer: Any, *, mesh: Any = None, num_microbatches: int = 1,
                 dp_dims: Sequence[str] = ("dp_replicate", "dp_shard", "dp"), tp_dim: str = "tp",
                 sequence_parallel: bool = False, seq_dim: int = 1,
                 plain_placements: dict[str, Any] | None = None, include: Sequence[str] = ("*",),
                 exclude: Sequence[str] = (),
                 capture: Sequence[str] = ("fwd_in", "fwd_out", "bwd_out", "grad_local", "grad", "grad_norm",
                                           "param"),
                 optimizer: Any = None, role: str | None = None,
                 module_meta: dict[str, dict[str, Any]] | None = None) -> None:
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ()) if mesh is not None else ()
        if mesh is not None and not names:
            raise ValueError("DTensorTracer needs a mesh with mesh_dim_names (init_device_mesh(..., "
                             "mesh_dim_names=(...))): the names are the groups of the trace's placements")
        sizes = {n: int(mesh.size(i)) for i, n in enumerate(names)}
        coord = list(mesh.get_coordinate()) if mesh is not None else []
        dp_names = [n for n in names if n in dp_dims]
        dp, dp_rank = 1, 0
        for n in dp_names:  # the data-parallel coordinate, outer dimension first
            dp, dp_rank = dp * sizes[n], dp_rank * sizes[n] + int(coord[names.index(n)])
        self.mesh, self.mesh_sizes = mesh, sizes
        self.tp_dim = tp_dim if tp_dim in sizes and sizes[tp_dim] > 1 else None
        self.tp_rank = int(coord[names.index(tp_dim)]) if self.tp_dim else 0
        self.sequence_parallel, self.seq_dim = bool(sequence_parallel), int(seq_dim)
        self._world_placement = Placement(tuple(ShardDim(None, n, int(coord[i]), sizes[n], "replicated")
                                                for i, n in enumerate(names) if sizes[n] > 1))
        if self.sequence_parallel and self.tp_dim is None:
            raise ValueError(f"sequence_parallel=True needs a tensor-parallel mesh dimension {tp_dim!r} of size > 1; "
                             f"the mesh has {sizes or 'none (a single-device run)'}")
        self.plain_placements = dict(plain_placements or {})
        wrappers = [n for n, m in model.named_modules() if _is_wrapper(m)]
        world = int(torch.tensor(list(sizes.values()) or [1]).prod())
        layout = {"mesh": sizes, "dp": dp, "sequence_parallel": self.sequence_parallel,
                  "mixed_precision": mixed_precision(model)}
        super().__init__(model, writer, num_microbatches=num_microbatches, dp_rank=dp_rank, dp=dp,
                         include=include, exclude=tuple(exclude) + tuple(wrappers), capture=capture,
                         placement_fn=self._plain_placement, param_placement=self._param_placement,
                         loss_placement=self._tp_replicated(),
                         module_meta=module_meta, optimizer=optimizer,
                         role=role or ("reference" if world == 1 else "candidate"), layout=layout,
                         name_fn=canonical_module_name, outputs_first=True, grad_placement_from_forward=True)
        self.capture = set(capture)
        self._unsharded_hooked: set[int] = set()
        #: id -> (weak reference, placement) of plain tensors a parallel style made from a module's
        #: DTensor output (:meth:`_note_local_output`), for the records of the modules that return them
        self._from_dtensor: dict[int, tuple[weakref.ref, Any]] = {}
        if self.tp_dim is not None:
            for module in self.tracer.modules.values():
                raw: list[Any] = []
                self.tracer._handles.append(module.register_forward_hook(self._note_raw_output(raw), prepend=True))
                self.tracer._handles.append(module.register_forward_hook(self._note_local_output(raw)))
        if "grad_local" in self.capture:
            for local, module in self.tracer.modules.items():
                if any(p is not None for p in module._parameters.values()):
                    self.tracer._handles.append(module.register_forward_pre_hook(self._watch_unsharded(local)))

    # placements ----------------------------------------------------------------------------------
    def _tp_placement(self, placement: Any, shape: tuple[int, ...]) -> Placement:
        """This rank's placement of a plain tensor that is one tp shard of ``placement``."""
        from torch.distributed.tensor.placement_types import Replicate, Shard
        size = self.mesh_sizes[self.tp_dim]
        if isinstance(placement, Shard):
            d = placement.dim % max(len(shape), 1)
            return Placement((ShardDim(d, self.tp_dim, self.tp_rank, size, "contiguous"),))
        if isinstance(placement, Replicate):
            return Placement((ShardDim(None, self.tp_dim, self.tp_rank, size, "replicated"),))
        raise ValueError(f"plain_placements: {placement!r} on {self.tp_dim}; give Shard(d) or Replicate()")

    def _plain_placement(self, local: str, name: str, t: torch.Tensor) -> dict[str, Any] | None:
        """Placement of a plain (non-DTensor) module record (module docstring); None for a DTensor
        (its spec places it, and its gradient's: :attr:`Tracer.grad_placement_from_forward`)."""
        if self.tp_dim is None or is_dtensor(t):
            return None  # data parallelism only: a whole tensor of this rank's microbatch
        from torch.distributed.tensor.placement_types import Replicate, Shard
        canon = canonical_module_name(local)
        pl = next((p for pat, p in self.plain_placements.items() if fnmatch.fnmatchcase(canon, pat)), None)
        known = self._from_dtensor.get(id(t))
        if pl is None and known is not None and known[0]() is t:
            pl = known[1]
        if pl is None:
            activation = t.is_floating_point() and t.dim() >= self.seq_dim + 2  # (batch, seq, hidden, ...)
            pl = Shard(self.seq_dim) if self.sequence_parallel and activation else Replicate()
        return self._tp_placement(pl, tuple(t.shape)).to_dict()

    def _note_raw_output(self, raw: list[Any]) -> Callable:
        """Forward hook run first: the module's DTensor outputs as it computed them (their specs)."""
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            raw[:] = [t for t in (output if isinstance(output, (tuple, list)) else (output,)) if is_dtensor(t)]
        return hook

    def _note_local_output(self, raw: list[Any]) -> Callable:
        """Forward hook run last: a plain tensor that a parallel style's output function made from the
        module's DTensor output (``use_local_output``) is that DTensor redistributed to the style's
        output layout, then made local; which layout it is, ``Replicate()`` or ``Shard(d)`` on the tp
        dimension, follows from its local shape against the DTensor's global shape (equal: replicated;
        one dim cut to this rank's ``torch.chunk`` share: split there). Noted by tensor identity for
        the records of the modules that return it (a block's attention, the model's logits)."""
        from torch.distributed.tensor.placement_types import Replicate, Shard

        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not self.tracer.active or not raw:
                return
            outs = [t for t in (output if isinstance(output, (tuple, list)) else (output,))
                    if isinstance(t, torch.Tensor) and not is_dtensor(t)]
            for t, d in zip(outs, raw):
                full, size = tuple(d.shape), self.mesh_sizes[self.tp_dim]
                cut = [i for i, (a, b) in enumerate(zip(t.shape, full)) if a != b]
                if tuple(t.shape) == full:
                    pl = Replicate()
                elif len(t.shape) == len(full) and len(cut) == 1 and t.shape[cut[0]] == _chunk(full[cut[0]], size,
                                                                                             self.tp_rank):
                    pl = Shard(cut[0])
                else:
                    continue
                self._from_dtensor[id(t)] = (weakref.ref(t), pl)
            raw.clear()
        return hook

    def _param_placement(self, local: str) -> dict[str, Any]:
        """A DTensor parameter's placement is its spec's, replicated over the mesh dimensions its own
        mesh lacks (:func:`~tracer.trace.dtensor.dtensor_placement` with ``world``); any other
        parameter is replicated over every mesh dimension. Its gradient and optimizer state share it."""
        p = self.params[local]
        return dtensor_placement(p, world=self.mesh) if is_dtensor(p) else self._world_placement.to_dict()

    # unsharded gradients (grad_local) ------------------------------------------------------------
    def _watch_unsharded(self, local: str) -> Callable:
        """Forward pre-hook: a tensor hook on each parameter the module holds now (FSDP2's unsharded
        parameter, after its own pre-forward), once per step and parameter object."""
        def hook(module: nn.Module, args: tuple) -> None:
            if not self.tracer.active:
                return
            for leaf, p in module._parameters.items():
                if p is None or not p.requires_grad or id(p) in self._unsharded_hooked:
                    continue
                self._unsharded_hooked.add(id(p))
                name = f"{canonical_module_name(local)}.{leaf}"
                self.tracer._tensor_handles.append(p.register_hook(self._unsharded_grad(name, f"{local}.{leaf}")))
        return hook

    def _unsharded_grad(self, name: str, local: str) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            if self.tracer.active:
                g = grad * self.tracer.grad_scale if self.tracer.grad_scale != 1.0 else grad  # a scaled copy
                placement = None if is_dtensor(g) else self._tp_replicated()
                self.tracer.record(name, g, Phase.GRAD_LOCAL, placement=placement,
                                   meta={"param": local, "scaled_by": self.tracer.grad_scale})
        return hook

    def _tp_replicated(self) -> dict[str, Any] | None:
        """A tensor every tp rank of a data-parallel rank computes whole (a plain unsharded gradient,
        the loss without ``loss_parallel``): replicated over tp; None without tensor parallelism."""
        if self.tp_dim is None:
            return None
        return Placement((ShardDim(None, self.tp_dim, self.tp_rank, self.mesh_sizes[self.tp_dim],
                                   "replicated"),)).to_dict()

    def record_grad_norm(self, norm: torch.Tensor) -> None:
        """Record the total gradient norm ``clip_grad_norm_`` returned (phase ``grad_norm``; a DTensor
        norm as its spec says, a plain one replicated over the mesh); capture ``grad_norm``."""
        if "grad_norm" in self.capture:
            self.tracer.set_microbatch(0)
            self.tracer.record("grad_norm", norm.detach(), Phase.GRAD_NORM,
                               placement=self._world_placement.to_dict())

    # lifecycle -----------------------------------------------------------------------------------
    def step(self, step: int, writer: Any = None):
        """As :meth:`DDPTracer.step`; the unsharded-gradient hooks are re-registered every step."""
        self._unsharded_hooked.clear()
        self._from_dtensor.clear()
        return super().step(step, writer)

    def canonical_name(self, local: str) -> str:
        """``local`` without wrapper components (:func:`canonical_module_name`)."""
        return canonical_module_name(local)

    def parameter_placement(self, local: str, phase: str) -> Placement:
        """The parameter's spec placement (a DTensor), else replicated over the mesh."""
        return Placement.from_dict(self._param_placement(local))
