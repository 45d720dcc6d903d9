"""Tracing a megatron-core model: canonical names, shard placements and the grad/step hooks.

:class:`MegatronTracer` wraps a :class:`tracer.capture.hooks.Tracer` around the *unwrapped*
``GPTModel`` (or any megatron-core module) of one rank and derives everything the
checker needs from Megatron's own metadata, never from the user:

* **names**: ``decoder.layers.<i>`` is renumbered to the global layer index with the
  stage's offset (:func:`tracer.trace.canonical.layer_offset`, which mirrors megatron-core's
  ``get_transformer_layer_offset``; virtual pipeline chunks included), so every layout
  uses the single-device names.  The tied output-layer weight of the last pipeline stage
  is the word-embedding weight of the first stage (``share_embeddings_and_output_weights``).
* **parameter placements** from ``param.tensor_model_parallel`` / ``partition_dim``
  (TP column/row/vocab shards) and ``param.sequence_parallel`` (TP-replicated params whose
  grads megatron all-reduces under SP); parameters are replicated over DP, and under the
  distributed optimizer the *reduced* grads are this rank's flat range of the param in
  its DDP bucket (``bucket.param_to_index``, reduce-scatter shard ``dp_rank``).
* **activation placements** per module class (:data:`ACTIVATION_RULES`): megatron keeps
  hidden states as ``[s, b, h]``; under sequence parallelism the tensors between TP regions
  are split along ``s`` (dim 0) over TP; column-parallel outputs and attention heads are
  split over TP along their last (head) dim; row-parallel inputs likewise. A column-parallel
  linear that gathers its output (its ``gather_output``, as ``GPTModel(parallel_output=False)``
  builds the output layer, or the call's ``runtime_gather_output``) has it replicated over TP
  (:func:`activation_rule`).
* **phases**: ``fwd`` and ``bwd`` (module hooks, per microbatch, numbered globally over DP
  ranks so that DP replicas of a layer are told apart), ``loss``, ``grad_local`` (the
  ``main_grad`` each rank contributes to the reduction, i.e. scaled by megatron's
  ``1/dp`` factor, before ``finalize_model_grads``), ``grad`` (after it), ``grad_norm``,
  ``options`` (the optimizer's learning rate, eps, weight decay..., given the optimizer),
  ``cast`` (how many model-parameter elements are not the cast of their fp32 main copy: 0 in a
  correct run, given the optimizer) and ``param`` (after ``optimizer.step()``); with capture
  ``optim`` also each param's fp32 main copy and Adam moments (``main_param``, ``exp_avg``,
  ``exp_avg_sq``: :mod:`tracer.capture.resync`).

Usage (inside the training loop of every rank; see docs/tracing.md)::

    mt = MegatronTracer(ddp_model, config, TraceWriter(root, rank, world, parallel_layout(config), signature))
    for step in range(steps):
        with mt.step(step):
            forward_backward_func(..., forward_step_func=mt.wrap_forward_step(forward_step))
            ok, grad_norm, _ = optimizer.step()
            mt.after_optimizer_step(grad_norm)
    mt.remove()
"""
from __future__ import annotations

import contextlib
import fnmatch
import re
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tracer.trace.canonical import Placement, ShardDim, layer_offset, renumber
from tracer.capture.hooks import Tracer
from tracer.capture.optim_state import cast_mismatches, main_param_and_state, optimizer_options
from tracer.trace.schema import SAME_ARITHMETIC_META, Phase
from tracer.trace.store import TraceWriter
from tracer.adapters.base import phases_of

if TYPE_CHECKING:
    from ttrace_num.propagate.layout import LayoutRule

__all__ = ["ACTIVATION_RULES", "DEFAULT_CAPTURE", "MegatronTracer", "activation_rule", "injector_models",
           "layout_rule", "noise_policy", "parallel_coordinates", "parallel_layout", "reference_noise", "unwrap"]

#: Role of each traced tensor of a module class -> how it is split over TP.
#: Values: ``"seq"`` (dim 0 split over TP under sequence parallelism, else replicated),
#: ``"last"`` (last dim split over TP), ``("dim", d)`` (dim ``d`` split over TP),
#: ``"rep"`` (replicated over TP), ``"stages"`` (replicated over TP and every pipeline stage
#: builds it, e.g. the rotary table). Keys are record suffixes (``input.0``, ``input.hidden_states``,
#: ``output.0``...) or ``"*"`` for the default of the class.
ACTIVATION_RULES: dict[str, dict[str, Any]] = {
    "VocabParallelEmbedding": {"input.0": "rep", "*": "seq"},
    "LanguageModelEmbedding": {"input.input_ids": "rep", "input.position_ids": "rep", "*": "seq"},
    "RotaryEmbedding": {"*": "stages"},
    "ColumnParallelLinear": {"input.0": "seq", "input.weight": ("dim", 0), "output.0": "last",
                             "output.1": ("dim", 0), "*": "rep"},
    "RowParallelLinear": {"input.0": "last", "output.0": "seq", "*": "rep"},
    "DotProductAttention": {"input.0": ("dim", 2), "input.1": ("dim", 2), "input.2": ("dim", 2),
                            "output": "last", "*": "rep"},
    "FusedScaleMaskSoftmax": {"input.0": ("dim", 1), "output": ("dim", 1), "*": "rep"},
    "SelfAttention": {"input.0": "seq", "input.hidden_states": "seq", "output.0": "seq", "*": "rep"},
    "MLP": {"input.0": "seq", "output.0": "seq", "*": "rep"},
    "TransformerLayer": {"input.hidden_states": "seq", "output.0": "seq", "*": "rep"},
}
#: what :class:`MegatronTracer` records by default (``optim``, the optimizer's state, is opt-in)
DEFAULT_CAPTURE = ("fwd_in", "fwd_out", "bwd_out", "grad_local", "grad", "options", "cast", "param")
_NORMS = ("LayerNorm", "RMSNorm", "WrappedTorchNorm", "FusedLayerNorm", "TENorm")
#: No-op modules of the local spec (q/k norms, cross attention of a decoder-only model).
_SKIPPED_CLASSES = ("IdentityOp", "IdentityFuncOp", "Dropout",
                    # its output is [b, s, h], or [s/tp, b, h] under SP (transposed inside): the
                    # enclosing LanguageModelEmbedding's [s, b, h] output is traced instead
                    "VocabParallelEmbedding")
_STAGE_DEPENDENT = ("GPTModel", "TransformerBlock")
#: classes whose forward computes each output element as a single-device run does under any
#: TP/SP/PP/DP layout (a column-parallel GEMM reduces over the whole input dim on one rank, a norm
#: over one row, attention within one head, the vocab-parallel lookup sums one value with zeros):
#: the records of such a module, and of a container made only of such modules, are marked
#: :data:`~tracer.trace.schema.SAME_ARITHMETIC_META` (tracer.compare.exactness). A row-parallel GEMM
#: splits its reduction over TP (unchanged only at TP = 1); any other class is not assumed.
_SAME_FORWARD_CLASSES = frozenset(("LanguageModelEmbedding", "VocabParallelEmbedding", "RotaryEmbedding",
                                   "ColumnParallelLinear", "DotProductAttention", "FusedScaleMaskSoftmax",
                                   "SelfAttention", "MLP", "TransformerLayer", "IdentityOp", "IdentityFuncOp")
                                  + tuple(n for n in _NORMS if n != "TENorm"))


def _matches(param_name: str, patterns: Sequence[str]) -> bool:
    """A parameter is selected by a pattern matching its name or its module's name."""
    owner = param_name.rpartition(".")[0]
    return any(fnmatch.fnmatchcase(n, p) for n in (owner, param_name) for p in patterns)


def unwrap(model: nn.Module) -> nn.Module:
    """The module under megatron's DDP / Float16Module wrappers (their ``.module``)."""
    while type(model).__name__ in ("DistributedDataParallel", "Float16Module", "DDP") and hasattr(model, "module"):
        model = model.module
    return model


def parallel_coordinates(ps: Any = None) -> dict[str, Any]:
    """This rank's sizes *and* coordinates from megatron's ``parallel_state`` (or ``ps``, any
    object with its getters): what the adapter's placements need. Rank-dependent: never the
    layout a writer records (:func:`parallel_layout`)."""
    if ps is None:
        from megatron.core import parallel_state as ps
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(), "vpp": vpp or 1,
            "tp_rank": ps.get_tensor_model_parallel_rank(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "dp_rank": ps.get_data_parallel_rank(),
            "first_stage": ps.is_pipeline_first_stage(ignore_virtual=True),
            "last_stage": ps.is_pipeline_last_stage(ignore_virtual=True)}


#: the keys of :func:`parallel_coordinates` that name this rank's place, not the run's layout
_RANK_KEYS = ("tp_rank", "pp_rank", "dp_rank", "first_stage", "last_stage")


def parallel_layout(config: Any = None, *, ps: Any = None) -> dict[str, Any]:
    """The run's layout, the same on every rank: the parallel sizes ``tp``, ``pp``, ``dp``,
    ``vpp`` from megatron's ``parallel_state`` (or ``ps``), and ``sp`` (sequence parallelism)
    when the ``TransformerConfig`` is given. This is what a :class:`~tracer.trace.store.TraceWriter`
    records: the reader compares every rank's manifest layout with the one rank 0 wrote to
    ``run.json``, so a rank coordinate in it would make ``ttrace compare`` refuse the trace as
    "another model, layout or run". A rank's coordinates belong in its records' placements."""
    out = {k: v for k, v in parallel_coordinates(ps).items() if k not in _RANK_KEYS}
    if config is not None:
        out["sp"] = bool(getattr(config, "sequence_parallel", False))
    return out


def _tp(par: dict, dim: int) -> ShardDim:
    return ShardDim(dim, "tp", par["tp_rank"], par["tp"])


def activation_rule(module: nn.Module | None, cls: str, role: str, gather: bool | None = None) -> Any:
    """The :data:`ACTIVATION_RULES` rule of record ``role`` (``output.0``, ``input.hidden_states``...;
    a gradient's role is its tensor's) of a module of class ``cls``, read from the module's
    own configuration where it decides the placement: a ``ColumnParallelLinear`` with
    ``gather_output`` (megatron-core's flag; ``GPTModel(parallel_output=False)`` builds its
    output layer with ``gather_output=True``) all-gathers its output over TP, which is then
    replicated over TP, not split on its last dim. ``gather``: the call's
    ``runtime_gather_output`` when it passed one (it overrides the module's flag, as in
    megatron's ``forward``)."""
    rules = ACTIVATION_RULES.get(cls) or ({"*": "seq"} if cls in _NORMS or "Norm" in cls else {"*": "rep"})
    keys = [role] + ([role + ".0"] if "." not in role else [role.split(".")[0]]) + ["*"]
    rule = next((rules[k] for k in keys if k in rules), "rep")
    if cls == "ColumnParallelLinear" and role in ("output", "output.0"):
        gathered = bool(getattr(module, "gather_output", False)) if gather is None else bool(gather)
        if gathered:
            rule = "rep"
    return rule


class MegatronTracer:
    """Trace one rank of a megatron-core training run (see the module docstring).

    Args:
        model: the rank's model, wrapped (DDP, Float16Module) or not; megatron's DDP
            wrapper is needed for the distributed-optimizer grad ranges. Under virtual
            pipeline parallelism: the list of the rank's model chunks, in virtual-stage order
            (as megatron's schedule takes them); every chunk is traced, its layers renumbered
            with its own offset.
        config: the ``TransformerConfig`` (``sequence_parallel``, ``num_layers``,
            ``finalize_model_grads_func`` are read; the latter is wrapped to record grads).
        writer: this rank's :class:`~tracer.trace.store.TraceWriter`.
        include, exclude: ``fnmatch`` patterns on local module names (as
            :class:`~tracer.capture.hooks.Tracer`; with several chunks, prefixed by the chunk's index,
            ``"1.decoder.layers.0"``); no-op modules (identity ops, dropout) are excluded.
        capture: subset of ``fwd_in fwd_out bwd_out bwd_in grad_local grad options cast param optim``;
            ``options``: the numeric options of the optimizer's param groups (learning rate, eps,
            weight decay...; :func:`tracer.capture.optim_state.optimizer_options`, recorded only with
            ``optimizer``), replicated over every rank and compared exactly;
            ``cast``: after the optimizer step, the number of this rank's model-parameter
            elements that differ from the round-to-nearest cast of their fp32 main copy
            (:func:`tracer.capture.optim_state.cast_mismatches`; recorded only with ``optimizer``), one
            int64 record ``optimizer.main_param_cast`` replicated over every rank, 0 in a correct
            run and compared exactly (its meta names the parameters that differ);
            ``optim``: after the optimizer step, each param's fp32 main copy and Adam moments
            (phases ``main_param``, ``exp_avg``, ``exp_avg_sq``; needs ``optimizer``), the state a
            reference re-synchronised to this run loads (:mod:`tracer.capture.resync`).
        num_microbatches: microbatches per step on this rank (numbers the microbatches
            of DP rank ``r`` from ``r * num_microbatches``; every chunk sees them in order).
        vpp_chunk: the virtual pipeline chunk a single ``model`` is (None without VPP).
        optimizer: the run's megatron-core optimizer (needed by captures ``optim``, ``options``
            and ``cast``).
    """

    def __init__(self, model: nn.Module | Sequence[nn.Module], config: Any, writer: TraceWriter, *,
                 include: Sequence[str] = ("*",), exclude: Sequence[str] = (),
                 capture: Sequence[str] = DEFAULT_CAPTURE,
                 num_microbatches: int = 1, vpp_chunk: int | None = None, optimizer: Any = None,
                 role: str | None = None, coordinates: dict[str, Any] | None = None) -> None:
        self.ddps = list(model) if isinstance(model, (list, tuple)) else [model]
        self.chunks = [unwrap(m) for m in self.ddps]
        # several chunks are traced as the children "0", "1", ... of one container
        self.model = self.chunks[0] if len(self.chunks) == 1 else nn.ModuleList(self.chunks)
        self.config = config
        self.writer = writer
        self.optimizer = optimizer
        self.par = dict(coordinates) if coordinates is not None else parallel_coordinates()
        self.sp = bool(getattr(config, "sequence_parallel", False))
        world = self.par["tp"] * self.par["pp"] * self.par["dp"]
        #: ``"reference"`` or ``"candidate"`` (protocol :class:`tracer.adapters.base.Adapter`);
        #: default: a single-rank run is the reference
        self.role = role or ("reference" if world == 1 else "candidate")
        self.capture = set(capture)
        self.num_microbatches = int(num_microbatches)
        if len(self.chunks) > 1:
            self.offsets = [layer_offset(self.par["pp_rank"], self.par["pp"], config.num_layers, c, self.par["vpp"])
                            for c in range(len(self.chunks))]
        else:
            self.offsets = [layer_offset(self.par["pp_rank"], self.par["pp"], config.num_layers, vpp_chunk,
                                         self.par["vpp"] if vpp_chunk is not None else None)]
        self._classes = {n: type(m).__name__ for n, m in self.model.named_modules()}
        self._modules = dict(self.model.named_modules())
        # a ColumnParallelLinear call may override its gather_output (runtime_gather_output):
        # read each call's value before the tracer's output hook computes the placement
        self._runtime_gather: dict[str, bool | None] = {}
        self._gather_hooks = [m.register_forward_pre_hook(self._gather_hook(n), with_kwargs=True)
                              for n, m in self._modules.items() if self._classes[n] == "ColumnParallelLinear"]
        # per-record lookups that depend only on names (and a tensor's rank): computed once
        self._canonical: dict[str, str] = {}
        self._activation_placements: dict[tuple[str, str, int, bool | None], dict[str, Any]] = {}
        skipped = [n for n, c in self._classes.items() if c in _SKIPPED_CLASSES]
        # containers whose records depend on the pipeline stage (the root returns hidden states
        # on all but the last stage; the decoder block holds a stage's layers): their children
        # are traced instead, and the per-token loss is recorded by wrap_forward_step. Every
        # chunk builds the same rotary table: the first chunk's is traced.
        stage_dependent = [n for n, c in self._classes.items() if c in _STAGE_DEPENDENT or n == ""]
        repeated = [f"{c}.rotary_pos_emb" for c in range(1, len(self.chunks))]
        same = self._same_forward_modules()
        self.tracer = Tracer(self.model, writer, include=include,
                             module_meta={n: {SAME_ARITHMETIC_META: True} for n in same},
                             exclude=list(exclude) + stage_dependent + repeated + skipped
                             + [s + ".*" for s in skipped if s],
                             capture=[c for c in capture if c in ("fwd_in", "fwd_out", "bwd_out", "bwd_in")],
                             name_fn=self.canonical_name, placement_fn=self.activation_placement,
                             # each DP rank's loss is the mean over its own microbatches, dp times
                             # its share of the global mean: activation grads are dp times too large
                             grad_scale=1.0 / self.par["dp"])
        self.params = {n: p for n, p in self.model.named_parameters()
                       if _matches(n, include) and not _matches(n, exclude)}
        self._orig_finalize = config.finalize_model_grads_func
        config.finalize_model_grads_func = self._finalize
        self._counters = [0] * len(self.chunks)  # microbatches each chunk has started this step

    def _same_forward_modules(self) -> list[str]:
        """Local names of the modules whose forward this layout computes as a single-device run
        does (:data:`_SAME_FORWARD_CLASSES`; a dropout only with ``p = 0``): the module and every
        module inside it."""
        def same(name: str, m: nn.Module) -> bool:
            cls = self._classes[name]
            if cls == "Dropout":
                return float(getattr(m, "p", 1.0)) == 0.0
            return cls in _SAME_FORWARD_CLASSES or (cls == "RowParallelLinear" and self.par["tp"] == 1)
        names = [n for n in self._modules if n]
        changed = set()  # a module that is not the same, and every module that contains it
        for n in names:
            if not same(n, self._modules[n]):
                parts = n.split(".")
                changed.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        return [n for n in names if n not in changed]

    # names ------------------------------------------------------------------------
    def _chunk(self, local: str) -> tuple[int, str]:
        """(chunk index, name inside the chunk) of a local module or parameter name."""
        if len(self.chunks) == 1:
            return 0, local
        head, _, rest = local.partition(".")
        return int(head), rest

    def canonical_name(self, local: str) -> str:
        """Single-device name of a local module or parameter name."""
        name = self._canonical.get(local)
        if name is None:
            c, inner = self._chunk(local)
            name = renumber(inner, "layers", self.offsets[c]) if re.search(r"(^|\.)layers\.\d+(\.|$)", inner) else inner
            self._canonical[local] = name
        return name

    def _param_name(self, local: str) -> tuple[str, bool]:
        """(canonical name, is the tied copy of the word embeddings on the last stage)."""
        c, inner = self._chunk(local)
        tied = inner == "output_layer.weight" and getattr(self.chunks[c], "share_embeddings_and_output_weights", False)
        return ("embedding.word_embeddings.weight" if tied else self.canonical_name(local)), tied

    def canonical_params(self) -> list[tuple[str, torch.Tensor]]:
        """(canonical name, parameter) of every traced parameter; the tied output-layer copy of
        the word embeddings is listed under the embeddings' name."""
        return [(self._param_name(local)[0], p) for local, p in self.params.items()]

    # placements -------------------------------------------------------------------
    def _rule_dims(self, rule: Any, t: torch.Tensor) -> list[ShardDim]:
        if rule == "stages":
            pp = [ShardDim(None, "pp", self.par["pp_rank"], self.par["pp"], "replicated")] if self.par["pp"] > 1 else []
            return self._rule_dims("rep", t) + pp
        if self.par["tp"] == 1 or rule == "rep":
            return [ShardDim(None, "tp", self.par["tp_rank"], self.par["tp"], "replicated")] if self.par["tp"] > 1 else []
        if rule == "seq":
            return [_tp(self.par, 0)] if self.sp else self._rule_dims("rep", t)
        if rule == "last":
            return [_tp(self.par, t.dim() - 1)]
        return [_tp(self.par, rule[1])]

    def activation_placement(self, local: str, name: str, t: torch.Tensor) -> dict[str, Any]:
        """Placement of a module record ``name`` (canonical) of local module ``local`` (the
        writer copies it; computed once per module, record and tensor rank)."""
        key = (local, name, t.dim(), self._runtime_gather.get(local))
        if key not in self._activation_placements:
            self._activation_placements[key] = self._activation_placement(local, name, t)
        return self._activation_placements[key]

    def _activation_placement(self, local: str, name: str, t: torch.Tensor) -> dict[str, Any]:
        suffix = name[len(self.canonical_name(local)):].lstrip(".")
        role = re.sub(r"_grad", "", suffix)  # output_grad.0 -> output.0
        rule = activation_rule(self._modules.get(local), self._classes.get(local, ""), role,
                               self._runtime_gather.get(local))
        return Placement(tuple(self._rule_dims(rule, t))).to_dict()

    def _gather_hook(self, local: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self._runtime_gather[local] = kwargs.get("runtime_gather_output")
        return hook

    def param_placement(self, local: str, p: torch.Tensor, phase: str) -> dict[str, Any]:
        """Placement of parameter ``local`` in ``phase`` (``grad_local`` / ``grad`` / ``param``)."""
        dims: list[ShardDim] = []
        if getattr(p, "tensor_model_parallel", False):
            dims.append(_tp(self.par, int(p.partition_dim)))
        elif self.par["tp"] > 1:
            kind = "partial" if phase == Phase.GRAD_LOCAL and getattr(p, "sequence_parallel", False) else "replicated"
            dims.append(ShardDim(None, "tp", self.par["tp_rank"], self.par["tp"], kind))
        _, tied = self._param_name(local)
        c, inner = self._chunk(local)
        if getattr(self.chunks[c], "share_embeddings_and_output_weights", False) and self.par["pp"] > 1 and (
                tied or inner == "embedding.word_embeddings.weight"):
            kind = "partial" if phase == Phase.GRAD_LOCAL else "replicated"
            dims.append(ShardDim(None, "tied", 1 if tied else 0, 2, kind))
        if self.par["dp"] > 1:
            kind = "partial" if phase == Phase.GRAD_LOCAL else "replicated"
            dims.append(ShardDim(None, "dp", self.par["dp_rank"], self.par["dp"], kind))
        return Placement(tuple(dims)).to_dict()

    # grad and step hooks ------------------------------------------------------------
    def _distopt_range(self, p: torch.Tensor) -> tuple[int, int] | None:
        """This rank's valid range ``[start, end)`` of ``p``'s flattened reduced grad."""
        dp, r = self.par["dp"], self.par["dp_rank"]
        for buf in [b for d in self.ddps for b in getattr(d, "buffers", []) + getattr(d, "expert_parallel_buffers", [])]:
            if p in buf.param_index_map:  # buffer coordinates, with megatron's alignment padding
                start, end, bucket_id = buf.param_index_map[p]
                bucket = buf.buckets[bucket_id]
                shard = bucket.grad_data.numel() // dp
                lo, hi = max(start, bucket.offset + r * shard), min(end, bucket.offset + (r + 1) * shard)
                return (lo - start, hi - start) if lo < hi else None
        raise ValueError(f"parameter of shape {tuple(p.shape)} is in no DDP bucket: pass the DDP-wrapped model")

    def _record_grads(self, phase: str) -> None:
        self.tracer.set_microbatch(0)  # per-step tensors: not of a microbatch
        distopt = bool(getattr(getattr(self.ddps[0], "ddp_config", None), "use_distributed_optimizer", False))
        for local, p in self.params.items():
            g = getattr(p, "main_grad", None)
            if g is None:
                g = p.grad
            if g is None:
                continue
            name, _ = self._param_name(local)
            placement = self.param_placement(local, p, phase)
            meta = {"param": local}
            if phase == Phase.GRAD_LOCAL and self.par["dp"] > 1:
                g = g * (1.0 / self.par["dp"])  # megatron's gradient_scaling_factor (a copy; exact for dp = 2^k)
                meta["scaled_by"] = 1.0 / self.par["dp"]
            if phase == Phase.GRAD and distopt and self.par["dp"] > 1:
                rng = self._distopt_range(p)
                if rng is None:
                    continue
                placement = self._flat_shard(placement, rng, p)
                g = g.reshape(-1)[rng[0]:rng[1]]
            self.tracer.record(name, g, phase, placement=placement, meta=meta)

    def _flat_shard(self, placement: Placement | dict[str, Any], rng: tuple[int, int], p: torch.Tensor) -> dict[str, Any]:
        """``placement`` with its DP replication replaced by this rank's flat range ``rng`` of
        ``p`` (the distributed optimizer's shard of a reduced grad, main param or moment)."""
        dims = [d for d in Placement.of(placement).dims if d.group != "dp"]
        dims.append(ShardDim(None, "dp", self.par["dp_rank"], self.par["dp"], "flat_shard",
                             start=rng[0], end=rng[1], shape=tuple(p.shape)))
        return Placement(tuple(dims)).to_dict()

    def _finalize(self, *args: Any, **kwargs: Any) -> Any:
        if self.tracer.active and "grad_local" in self.capture:
            self._record_grads(Phase.GRAD_LOCAL)
        out = self._orig_finalize(*args, **kwargs)
        if self.tracer.active and "grad" in self.capture:
            self._record_grads(Phase.GRAD)
        return out

    def wrap_forward_step(self, forward_step: Callable) -> Callable:
        """Wrap megatron's ``forward_step_func`` so that records carry the global microbatch
        number and the loss of each microbatch is recorded (phase ``loss``). Under virtual
        pipelining the schedule passes the chunk it runs; each chunk counts its own
        microbatches."""
        ids = [id(m) for m in self.ddps]

        def step_fn(data_iterator: Any, model: nn.Module, *rest: Any) -> Any:
            c = ids.index(id(model)) if id(model) in ids else 0
            mb = self.par["dp_rank"] * self.num_microbatches + self._counters[c]
            self._counters[c] += 1
            self.tracer.set_microbatch(mb)
            output, loss_func = forward_step(data_iterator, model, *rest)
            last = self.par["last_stage"] and c == len(self.chunks) - 1
            if self.tracer.active and last and isinstance(output, torch.Tensor):
                self.tracer.record("loss_per_token", output.detach(), Phase.LOSS, placement=self._replicated_all())

            def traced_loss(*a: Any, **k: Any) -> Any:
                out = loss_func(*a, **k)
                loss = out[0] if isinstance(out, tuple) else out
                if self.tracer.active:
                    self.tracer.record("loss", loss.detach(), Phase.LOSS, placement=self._replicated_all())
                return out
            return output, traced_loss
        return step_fn

    def _replicated_all(self) -> dict[str, Any]:
        dims = [ShardDim(None, "tp", self.par["tp_rank"], self.par["tp"], "replicated")] if self.par["tp"] > 1 else []
        return Placement(tuple(dims)).to_dict()

    def after_optimizer_step(self, grad_norm: float | torch.Tensor | None) -> None:
        """Record the grad norm (phase ``grad_norm``), the optimizer's options (``options``, with
        an ``optimizer``), the check that the model parameters are the cast of their main copies
        (``cast``, with an ``optimizer``) and the updated parameters (``param``). Runs with torch
        functions disabled: the checks are the tracer's own arithmetic, which a noise injector of the
        traced run must neither perturb nor count."""
        with torch._C.DisableTorchFunction():
            self._after_optimizer_step(grad_norm)

    def _after_optimizer_step(self, grad_norm: float | torch.Tensor | None) -> None:
        self.tracer.set_microbatch(0)
        if grad_norm is not None:
            gn = grad_norm if isinstance(grad_norm, torch.Tensor) else torch.tensor(float(grad_norm), dtype=torch.float64)
            self.tracer.record("grad_norm", gn.reshape(()), Phase.GRAD_NORM, placement=self._all_replicas())
        if "options" in self.capture and self.optimizer is not None:
            for name, t in optimizer_options(self.optimizer).items():
                self.tracer.record(f"optimizer.{name}", t, Phase.OPTIONS, placement=self._all_replicas())
        if "cast" in self.capture and self.optimizer is not None:
            self._record_cast_check()
        if "param" in self.capture:
            for local, p in self.params.items():
                name, _ = self._param_name(local)
                self.tracer.record(name, p, Phase.PARAM, placement=self.param_placement(local, p, Phase.PARAM),
                                   meta={"param": local})
        if "optim" in self.capture:
            self._record_optimizer_state()

    def _record_cast_check(self) -> None:
        """Record how many of this rank's model-parameter elements differ from the cast of their
        fp32 main copy (:func:`~tracer.capture.optim_state.cast_mismatches`), summed over its params, as
        ``optimizer.main_param_cast`` (phase ``cast``): an int64 that is 0 on every rank of a
        correct run, hence replicated over all of them and compared exactly. Its meta gives the
        elements checked and the first parameters that differ, with their counts."""
        differing, checked, where = 0, 0, []
        for local, p in self.params.items():
            found = cast_mismatches(self.optimizer, p)
            if found is None:
                continue
            differing, checked = differing + found[0], checked + found[1]
            if found[0]:
                where.append([self._param_name(local)[0], found[0], found[1]])
        self.tracer.record("optimizer.main_param_cast", torch.tensor(differing, dtype=torch.int64), Phase.CAST,
                           placement=self._all_replicas(), meta={"checked": checked, "differing": where[:8]})

    def _record_optimizer_state(self) -> None:
        """Record each parameter's fp32 main copy (phase ``main_param``) and Adam moments
        (``exp_avg``, ``exp_avg_sq``), in the param's own shape, or as this rank's flat range of
        it under the distributed optimizer with DP > 1 (what :mod:`tracer.capture.resync` loads)."""
        if self.optimizer is None:
            raise ValueError("capture 'optim' records the optimizer's state: pass MegatronTracer(..., optimizer=...)")
        for local, p in self.params.items():
            found = main_param_and_state(self.optimizer, p)
            if found is None:  # none of p in this rank's shard of the distributed optimizer
                continue
            tensors, rng = found
            name, _ = self._param_name(local)
            placement = self.param_placement(local, p, Phase.PARAM)
            whole = rng is None or self.par["dp"] == 1  # else: a flat range, maybe all of p, on this DP rank
            if not whole:
                placement = self._flat_shard(placement, rng, p)
            for phase, t in tensors.items():
                self.tracer.record(name, t.view(p.shape) if whole else t, phase, placement=placement,
                                   meta={"param": local})

    def _all_replicas(self) -> dict[str, Any]:
        dims = [ShardDim(None, g, self.par[f"{g}_rank"], self.par[g], "replicated")
                for g in ("tp", "pp", "dp") if self.par[g] > 1]
        return Placement(tuple(dims)).to_dict()

    # steps --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, step: int, writer: TraceWriter | None = None) -> Iterator[MegatronTracer]:
        """Trace one optimizer step (flushes this rank's file at the end), into ``writer``
        if given (e.g. a noise sample's trace) instead of the tracer's own."""
        self._counters = [0] * len(self.chunks)
        self.tracer.writer = writer or self.writer
        try:
            with self.tracer.step(step):
                yield self
        finally:
            self.tracer.writer = self.writer

    def remove(self) -> None:
        """Remove the hooks and restore ``config.finalize_model_grads_func``."""
        self.tracer.remove()
        for h in self._gather_hooks:
            h.remove()
        self._gather_hooks = []
        self.config.finalize_model_grads_func = self._orig_finalize

    # the adapter protocol (tracer.adapters.base.Adapter) ---------------------------------------
    @property
    def layout(self) -> dict[str, Any]:
        """The run's layout, rank-independent (as :func:`parallel_layout`)."""
        return {k: v for k, v in self.par.items() if k not in _RANK_KEYS} | {"sp": self.sp}

    @property
    def phases(self) -> tuple[Phase, ...]:
        """The phases this tracer records, from its capture options (in a step's order)."""
        needs_optimizer = () if self.optimizer is not None else ("options", "cast")
        return phases_of([c for c in self.capture if c not in needs_optimizer], grad_norm=True)

    def record_placement(self, local: str, name: str, t: torch.Tensor) -> Placement:
        """Placement of module record ``name`` of local module ``local`` (:meth:`activation_placement`)."""
        return Placement.of(self.activation_placement(local, name, t))

    def parameter_placement(self, local: str, phase: str) -> Placement:
        """Placement of parameter ``local``'s record in ``phase`` (:meth:`param_placement`; the
        distributed optimizer's flat range of a reduced grad is applied when recording)."""
        return Placement.of(self.param_placement(local, self.params[local], phase))

    def microbatch(self, i: int) -> None:
        """Start local microbatch ``i`` outside :meth:`wrap_forward_step` (which numbers them
        itself): records get the global number ``dp_rank * num_microbatches + i``."""
        self.tracer.set_microbatch(self.par["dp_rank"] * self.num_microbatches + int(i))

    def close(self) -> None:
        """End tracing (:meth:`remove`)."""
        self.remove()


# reference side: what the noise samples must model --------------------------------------------

def noise_policy(tp: int, dtype: str, reference_tp: int = 1):
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

    ``reference_tp``: the tensor parallelism of the reference itself (a distributed
    reference, docs/distributed-reference.md): its GEMMs are then the ``reference_tp``-way
    split instead of the unsplit fp32 one (``reference_tp = 1``, a single-device reference).
    """
    if max(tp, reference_tp) <= 1 or dtype != "bf16":
        return None
    from ttrace_num.bounds.summation import Summation
    split = {"summation": Summation(split=max(tp, 1), reduce_fmt="bf16")}
    plain = {"summation": Summation(split=reference_tp, reduce_fmt="bf16") if reference_tp > 1 else Summation()}

    def policy(path: str, op: str):
        return (plain, split, False) if op in ("matmul", "linear") else None
    return policy


def _megatron_functions() -> tuple[type, ...]:
    """megatron-core's autograd Functions whose backward does arithmetic (GEMMs, the
    vocab-parallel cross entropy's softmax)."""
    from megatron.core.tensor_parallel.cross_entropy import _VocabParallelCrossEntropy
    from megatron.core.tensor_parallel.layers import (
        LinearWithGradAccumulationAndAsyncCommunication,
    )
    return (LinearWithGradAccumulationAndAsyncCommunication, _VocabParallelCrossEntropy)


def injector_models(split: int, dtype: str, routed: bool = False, reference_split: int = 1) -> dict[str, Any]:
    """:class:`~ttrace_num.propagate.noise.NoiseInjector` keywords for candidates whose
    reductions are split over up to ``split`` ranks in ``dtype`` (``"bf16"``/``"fp32"``): the
    GEMM policy (:func:`noise_policy`, for the GEMMs outside the variance model), the
    summation model of parameter-gradient sums over tokens (split, partials in ``dtype``) and
    variance-matched noise (``variance_model``: an unsplit run vs a ``split``-way one whose
    partials are reduced in ``dtype``, :mod:`ttrace_num.bounds.summation_variance`) for the
    GEMMs, the rounding of a bf16 result included, and for the fp32 parameter-gradient sums.

    ``reference_split``: a distributed reference that splits its own GEMMs over that many TP
    ranks (docs/distributed-reference.md): the noise then models the difference of *both*
    splits, the reference's (``reference_model``, and the policy's first run) and the
    candidate's, instead of an unsplit run against the candidate's.

    ``routed``: the model makes top-k routing choices (a mixture of experts). In bf16 its
    GEMMs then keep their bound-sized noise: a correct candidate flips a near-tied choice
    now and then, and its effect downstream is covered only when the samples flip choices as
    often. With variance-matched bf16 GEMM noise they did not: one clean MoE tensor of the
    detection matrix reached 1.02x its threshold (``docs/detection.md``, "Sensitivity")."""
    from ttrace_num.bounds.summation import Summation
    model = Summation(split=max(split, 1), reduce_fmt=dtype)
    out = {"policy": noise_policy(split, dtype, reference_split), "grad_summation": model,
           "variance_model": None if routed and dtype != "fp32" else model}
    if reference_split > 1:
        out["reference_model"] = Summation(split=reference_split, reduce_fmt=dtype)
    return out


#: ops of megatron-core's GPT without an error model, accepted unperturbed (by torch name, wherever
#: they occur: a coarse but stated acceptance, listed in every comparison's report), and why; their
#: legitimate differences are not sampled
MEGATRON_CORE_ACCEPTED = {
    "torch.baddbmm": "megatron's unfused attention scores (baddbmm, beta=0): a GEMM over the head dim, which no "
                     "tensor- or sequence-parallel layout splits (heads are split, the head dim is not); its "
                     "rounding is the same kernel on the same inputs in reference and candidate",
    "torch.cos": "the rotary table: a function of the positions alone, the same inputs in every run",
    "torch.sin": "the rotary table: a function of the positions alone, the same inputs in every run",
    "torch.exp": "inside megatron's vocab-parallel cross entropy (its vocabulary sum is perturbed, the "
                 "elementwise exp, log, shift and division are not)",
    "torch.log": "inside megatron's vocab-parallel cross entropy (see torch.exp)",
    "torch.Tensor.sub_": "inside megatron's vocab-parallel cross entropy (see torch.exp)",
    "torch.Tensor.div_": "inside megatron's vocab-parallel cross entropy (see torch.exp)",
    "torch.Tensor.mul_": "inside megatron's vocab-parallel cross entropy backward (the gradient times its upstream "
                         "gradient; in-place scalings by a power of two elsewhere are exact anyway)",
}


def layout_rule(model: nn.Module, candidate_tp: int, dtype: str) -> "LayoutRule":
    """What megatron-core candidates with tensor parallelism up to ``candidate_tp`` (with or
    without sequence parallelism, any pipeline or data parallelism, activations in ``dtype``)
    change, per module of the single-device reference ``model`` (its names as
    ``unwrap(model).named_modules()`` gives them): the rule of
    :mod:`ttrace_num.propagate.layout`.

    For a module of a class in :data:`_SAME_FORWARD_CLASSES`, or a ``RowParallelLinear``:

    * ``forward_gemm``: a row-parallel GEMM's reduction is split over ``tp`` ranks and the
      partials summed in ``dtype`` (all-reduce, or reduce-scatter under SP):
      ``Summation(split=tp, reduce_fmt=dtype)``; a column-parallel one reduces over the whole
      input dim on one rank: identical;
    * ``dgrad``: the transpose: a column-parallel input gradient is split (its output dim is),
      a row-parallel one is identical;
    * ``wgrad``: a sum over the tokens of one microbatch, all of them on the rank (SP gathers
      the input before it): identical. Microbatches accumulate into ``main_grad`` and data-parallel
      ranks reduce it in gradient hooks outside every module: the default model there;
    * ``token_sum`` (norm weights and biases, biases): split over the ``tp`` ranks of a sequence-
      parallel candidate, each rank summing its tokens, the parts reduced in ``dtype``;
    * ``op`` (norms, softmax, attention within a head, rotary, activations, residual adds, their
      backward): identical.

    Everything else (the loss and the vocabulary-parallel cross entropy at the model's root, the
    optimizer, gradient hooks, modules of other classes such as a mixture of experts): ``None``,
    the injector's default. At ``candidate_tp = 1`` every split above is identical."""
    from ttrace_num.bounds.summation import Summation
    from ttrace_num.propagate.layout import IDENTICAL
    classes = {n: type(m).__name__ for n, m in unwrap(model).named_modules() if n}
    split = Summation(split=candidate_tp, reduce_fmt=dtype) if candidate_tp > 1 else IDENTICAL

    def rule(module: str, computation: str):
        cls = classes.get(module)
        if cls is None or (cls not in _SAME_FORWARD_CLASSES and cls != "RowParallelLinear"):
            return None
        if computation == "forward_gemm":
            return split if cls == "RowParallelLinear" else IDENTICAL
        if computation == "dgrad":
            return split if cls == "ColumnParallelLinear" else IDENTICAL
        if computation == "token_sum":
            return split
        return IDENTICAL
    return rule


def reference_noise(candidate_tp: int, dtype: str, routed: bool = False, reference_tp: int = 1,
                    model: nn.Module | None = None) -> dict[str, Any]:
    """Keyword arguments of :class:`tracer.capture.noise_sampler.NoiseSampler` for a megatron-core
    reference compared against candidates with tensor parallelism up to ``candidate_tp`` in
    ``dtype``: :func:`injector_models` (``routed``: a mixture-of-experts model; ``reference_tp``:
    the reference's own tensor parallelism, a distributed reference) with
    :data:`MEGATRON_CORE_ACCEPTED`, and megatron's autograd Functions whose backward computes.

    ``model``: the single-device reference; its noise then follows what the candidates' layout
    changes (:func:`layout_rule`, :mod:`ttrace_num.propagate.layout`): the injector gets the rule
    and a :class:`~ttrace_num.propagate.layout.ModuleScope` on the model as ``module_of`` (remove
    its hooks with ``.remove()`` when the run ends). Not for a distributed reference
    (``reference_tp > 1``, whose own splits the rule does not describe) nor a routed model."""
    models = injector_models(candidate_tp, dtype, routed, reference_split=reference_tp)
    if model is not None and reference_tp == 1 and not routed:
        from ttrace_num.propagate.layout import ModuleScope
        models.update(layout=layout_rule(model, candidate_tp, dtype), module_of=ModuleScope(unwrap(model)))
    return {"injector_kwargs": {**models, "accepted": dict(MEGATRON_CORE_ACCEPTED)},
            "custom_functions": _megatron_functions()}
