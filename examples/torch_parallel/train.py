"""One rank of the plain-PyTorch harness: model, data, gradient reduction, tracing placements.

:class:`Run` builds this rank's :class:`~examples.torch_parallel.model.TinyLM` for a
:class:`~examples.torch_parallel.layout.Layout` and trains it with Adam on a fixed
synthetic global batch of ``GLOBAL_MICROBATCHES`` sequences per step (the same in every run;
DP rank ``d`` runs microbatches ``d*n .. d*n+n-1``, ``n = GLOBAL_MICROBATCHES / dp``).

Gradient scaling (megatron-core's convention): each microbatch's loss share is multiplied
by ``dp * cp / GLOBAL_MICROBATCHES`` before backward, and :func:`reduce_gradients` sums
the gradients and multiplies them by ``1 / (dp * cp)`` (:func:`dense_grad_scale`): over
TP first for ``sequence_parallel`` parameters under SP, then over the DP x CP group for
dense parameters, over CP only for expert parameters (their DP = EP contributions were
already summed by the token dispatcher's backward). All factors are powers of two, so the
scaling is exact and the reduced gradient is the single-device gradient up to summation
order.

Tracing (:func:`tracer_for`): :class:`tracer.adapters.ddp.DDPTracer` with this harness's
placements (:func:`module_placement`, :func:`param_placement`, :func:`loss_dims`) and
activation gradients stored times ``1 / (dp * cp)``.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from examples.torch_parallel import comm
from examples.torch_parallel.layout import Groups, Layout
from examples.torch_parallel.model import ModelConfig, TinyLM, shard_tokens
from tracer.trace.canonical import Placement, ShardDim
from tracer.compare.decisions import topk_consumer_meta, topk_meta
from tracer.adapters.ddp import DDPTracer
from tracer.trace.store import TraceWriter

__all__ = ["DTYPES", "GLOBAL_MICROBATCHES", "Run", "reduce_gradients", "tracer_for"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GLOBAL_MICROBATCHES = 4


def global_batch(step: int, cfg: ModelConfig, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The step's (features, targets) per microbatch, identical in every run."""
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(cfg.seq, cfg.hidden, generator=g).to(dtype), torch.randn(cfg.seq, cfg.out, generator=g).to(dtype))
            for _ in range(GLOBAL_MICROBATCHES)]


def dense_grad_scale(layout: Layout) -> float:
    """Factor of the summed dense gradients: ``1 / (dp * cp)`` (the loss was scaled by ``dp * cp``)."""
    return 1.0 / (layout.dp * layout.cp)


def expert_grad_scale(layout: Layout) -> float:
    """Factor of the summed expert gradients: ``1 / (dp * cp)`` as well (EP = DP)."""
    return 1.0 / (layout.dp * layout.cp)


def amax_group(groups: Groups) -> Any:
    """The FP8 amax reduction group: every rank (TP x CP x DP, as Transformer Engine's amax
    reduction group in megatron), so each scale is computed from the global amax, exactly
    the single-device reference's (a maximum is exact in any order)."""
    return groups.world


def tp_reduce_sequence_parallel(p: nn.Parameter, layout: Layout) -> bool:
    """Does ``p``'s gradient need the TP all-reduce? Under SP, every TP-replicated parameter
    fed by TP-split tokens (megatron: the ``sequence_parallel`` attribute)."""
    return layout.sp and getattr(p, "sequence_parallel", False)


def reduce_gradients(model: nn.Module, layout: Layout, groups: Groups) -> None:
    """Turn each rank's local gradients into the reduced (single-device) gradient, in place."""
    for p in model.parameters():
        if p.grad is None:
            continue
        g = p.grad
        if tp_reduce_sequence_parallel(p, layout):
            g = comm.all_reduce(g, groups.tp)
        if getattr(p, "expert", False):
            g = comm.all_reduce(g, groups.cp) * expert_grad_scale(layout)
        else:
            g = comm.all_reduce(g, groups.dp_cp) * dense_grad_scale(layout)
        p.grad = g


class Run:
    """This rank's model and optimizer for ``layout`` (``dtype`` ``"fp32"``/``"bf16"``)."""

    def __init__(self, layout: Layout, dtype: str, seed: int = 0, cfg: ModelConfig = ModelConfig()) -> None:
        if GLOBAL_MICROBATCHES % layout.dp:
            raise ValueError(f"dp={layout.dp} must divide the {GLOBAL_MICROBATCHES} microbatches of a step")
        self.layout, self.dtype, self.cfg = layout, dtype, cfg
        self.groups = Groups(layout)
        torch.manual_seed(seed)
        self.model = TinyLM(cfg, layout, self.groups, DTYPES[dtype], seed)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.n_local = GLOBAL_MICROBATCHES // layout.dp

    def microbatches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        d = self.groups.dp_rank
        return global_batch(step, self.cfg, DTYPES[self.dtype])[d * self.n_local:(d + 1) * self.n_local]

    def train_step(self, step: int, tr: DDPTracer | None = None, writer: TraceWriter | None = None) -> float:
        """One optimizer step; traced by ``tr`` into ``writer`` (None: its own) when given.
        Returns this rank's summed loss shares (a diagnostic)."""
        lay, grp = self.layout, self.groups
        scale = lay.dp * lay.cp / GLOBAL_MICROBATCHES
        total = 0.0
        with (tr.step(step, writer) if tr else contextlib.nullcontext()):
            for i, (x, y) in enumerate(self.microbatches(step)):
                if tr:
                    tr.microbatch(i)
                loss, aux = self.model(shard_tokens(x, lay, grp), shard_tokens(y, lay, grp), i)
                if tr:
                    tr.record_loss(loss)
                ((loss if aux is None else loss + aux) * scale).backward()
                total += float(loss.detach())
            reduce_gradients(self.model, lay, grp)
            if tr:
                tr.after_backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.end_step_fp8()
            if tr:
                tr.after_optimizer_step()
                self.record_fp8_scales(tr)
        return total

    def fp8_states(self) -> dict[str, Any]:
        """``{module name: Fp8State}`` of every FP8 linear (empty without FP8)."""
        return {n: m.fp8 for n, m in self.model.named_modules() if isinstance(getattr(m, "fp8", None), nn.Module)}

    def record_fp8_scales(self, tr: DDPTracer) -> None:
        """Trace every FP8 linear's scales after the step-boundary update (phase ``fp8_scale``,
        record ``<linear>.fp8.scale``: the x, w and g scales). They must be the same on every
        rank (each is computed from the amax reduced over all ranks), so they are stored
        replicated over TP, CP and DP and the checker compares the copies bitwise: an amax
        reduced over the wrong group shows there, at the step where it happened (B09, B12)."""
        placement, g = self._fp8_placement(), self._g_factor()
        meta = {"g_scaled_by": self.layout.dp * self.layout.cp}
        for name, st in self.fp8_states().items():
            tr.tracer.set_microbatch(0)
            tr.tracer.record(f"{name}.fp8.scale", st.meta.scale * g, "fp8_scale", placement=placement, meta=meta)
            if "optim" in tr.capture:  # the delayed-scaling history, for a re-synchronised reference
                tr.tracer.record(f"{name}.fp8.amax_history", st.meta.amax_history / g, "state", placement=placement,
                                 meta=meta)

    def _fp8_placement(self) -> dict[str, Any]:
        """FP8 scales and histories: the same on every rank (replicated over TP, CP and DP)."""
        lay, grp = self.layout, self.groups
        return Placement(tuple(ShardDim(None, g, r, n, "replicated") for g, r, n in
                               (("dp", grp.dp_rank, lay.dp), ("cp", grp.cp_rank, lay.cp), ("tp", grp.tp_rank, lay.tp))
                               if n > 1)).to_dict()

    def _g_factor(self) -> torch.Tensor:
        """A rank's output gradients are dp*cp times the reference's (its loss share is scaled by
        dp*cp), so its g amax is too and its g scale 1/(dp*cp) times: scales are stored times
        this factor and amaxes divided by it, as the reference's (a power of two: exact)."""
        return torch.tensor([1.0, 1.0, float(self.layout.dp * self.layout.cp)])

    def load_fp8_state(self, scales: dict[str, torch.Tensor], histories: dict[str, torch.Tensor]) -> None:
        """Start the next step from a candidate's delayed-scaling state (as recorded by
        :meth:`record_fp8_scales` with capture ``optim``, full tensors by record name): each FP8
        linear's amax history and scales, converted back to this run's gradient scale."""
        g = self._g_factor()
        for name, st in self.fp8_states().items():
            if f"{name}.fp8.amax_history" not in histories:
                raise ValueError(f"the candidate's trace has no FP8 amax history of {name}: trace it with capture "
                                 "'optim' to re-synchronise a reference to it")
            m = st.meta
            m.amax_history = histories[f"{name}.fp8.amax_history"].to(torch.float32) * g
            m.scale = scales[f"{name}.fp8.scale"].to(torch.float32) / g
            m.scale_inv = torch.reciprocal(m.scale)
            m.amax, m.recompute = torch.zeros_like(m.amax), False

    def end_step_fp8(self) -> None:
        """Delayed scaling: every FP8 linear's amaxes reduced over :func:`amax_group`, scales updated."""
        for st in self.fp8_states().values():
            st.end_step(amax_group(self.groups))


# --- placements -------------------------------------------------------------------------------

_FEATURE_SHARDED = ("qkv", "fc1", "core_attn")   # outputs: this TP rank's features (last dim)
_PARTIAL = ("proj", "fc2")                       # outputs: partial sums over TP
_COLUMN_WEIGHTS = ("qkv.weight", "fc1.weight")   # TP shards along dim 0
_ROW_WEIGHTS = ("proj.weight", "fc2.weight")     # TP shards along dim 1


def _token_dims(layout: Layout, groups: Groups, tp_kind: str) -> list[ShardDim]:
    dims = []
    if layout.cp > 1:
        dims.append(ShardDim(0, "cp", groups.cp_rank, layout.cp, "zigzag"))
    if layout.tp > 1:
        if tp_kind == "seq":
            dims.append(ShardDim(0, "tp", groups.tp_rank, layout.tp, "contiguous"))
        elif tp_kind == "feature":
            dims.append(ShardDim(1, "tp", groups.tp_rank, layout.tp, "contiguous"))
        else:
            dims.append(ShardDim(None, "tp", groups.tp_rank, layout.tp, tp_kind))
    return dims


def module_placement(layout: Layout, groups: Groups, local: str, name: str, tensor: torch.Tensor
                     ) -> dict[str, Any]:
    """Placement of a module's output (record ``name``) or its gradient on this rank: tokens
    CP-zigzag sharded; over TP feature-sharded inside the TP region, partial after a
    row-parallel GEMM (its gradient replicated), token-sharded (SP) or replicated elsewhere. Scalars (the MoE auxiliary loss) are
    replicated over the ranks sharing the sequence."""
    leaf = local.rpartition(".")[2]
    if tensor.dim() == 0:
        dims = [ShardDim(None, g, r, n, "replicated") for g, r, n in
                (("cp", groups.cp_rank, layout.cp), ("tp", groups.tp_rank, layout.tp)) if n > 1]
    elif leaf in _FEATURE_SHARDED:
        dims = _token_dims(layout, groups, "feature")
    elif leaf in _PARTIAL:  # the gradient of a pending sum is the same on every TP rank
        dims = _token_dims(layout, groups, "replicated" if name.endswith("_grad") else "partial")
    else:
        dims = _token_dims(layout, groups, "seq" if layout.sp else "replicated")
    return Placement(tuple(dims)).to_dict()


def param_placement(layout: Layout, groups: Groups, local: str, p: nn.Parameter) -> dict[str, Any]:
    """Placement of a parameter (and its reduced gradient): TP shards of the column/row-
    parallel weights, expert shards over EP (= DP), replicated over every other group."""
    tp = None
    if layout.tp > 1:
        if local.endswith(_COLUMN_WEIGHTS):
            tp = ShardDim(0, "tp", groups.tp_rank, layout.tp, "contiguous")
        elif local.endswith(_ROW_WEIGHTS):
            tp = ShardDim(1, "tp", groups.tp_rank, layout.tp, "contiguous")
        else:
            tp = ShardDim(None, "tp", groups.tp_rank, layout.tp, "replicated")
    dims = [ShardDim(None, "cp", groups.cp_rank, layout.cp, "replicated")] if layout.cp > 1 else []
    if getattr(p, "expert", False):
        dims += [tp] if tp else []
        dims += [ShardDim(0, "ep", groups.dp_rank, layout.dp, "contiguous")] if layout.dp > 1 else []
    else:
        dims = ([ShardDim(None, "dp", groups.dp_rank, layout.dp, "replicated")] if layout.dp > 1 else []) + dims
        dims += [tp] if tp else []
    return Placement(tuple(dims)).to_dict()


def loss_dims(layout: Layout, groups: Groups) -> list[ShardDim]:
    """A microbatch loss share: partial over CP, and over TP under SP (replicated without)."""
    dims = [ShardDim(None, "cp", groups.cp_rank, layout.cp, "partial")] if layout.cp > 1 else []
    if layout.tp > 1:
        dims.append(ShardDim(None, "tp", groups.tp_rank, layout.tp, "partial" if layout.sp else "replicated"))
    return dims


def tracer_for(run: Run, writer: TraceWriter, optim: bool = False) -> DDPTracer:
    """A :class:`~tracer.adapters.ddp.DDPTracer` over ``run``'s model with the harness placements.
    Traced: every module's output and output gradient except the MoE router's (integer expert
    indices; its linear's logits are traced, marked as the scores of a top-k choice for the
    checker, and the MoE layer's outputs as consumers of that choice, :mod:`tracer.compare.decisions`), the losses, reduced gradients, updated parameters and,
    with FP8, the scales (:meth:`Run.record_fp8_scales`); ``optim``: also the optimizer's state and
    the FP8 amax histories, for a reference re-synchronised to this run (:mod:`tracer.capture.resync`)."""
    lay, grp = run.layout, run.groups
    params = dict(run.model.named_parameters())
    return DDPTracer(run.model, writer, num_microbatches=run.n_local, dp_rank=grp.dp_rank, dp=lay.dp,
                     exclude=("", "layers", "*.moe.router", "*.fp8"),
                     capture=("fwd_out", "bwd_out", "grad", "options", "param") + (("optim",) if optim else ()),
                     optimizer=run.opt,
                     placement_fn=lambda local, name, t: module_placement(lay, grp, local, name, t),
                     param_placement=lambda local: param_placement(lay, grp, local, params[local]),
                     loss_placement=Placement(tuple(loss_dims(lay, grp))).to_dict(),
                     grad_scale=1.0 / (lay.dp * lay.cp),
                     module_meta={"*.moe.router.linear": topk_meta(run.cfg.topk),
                                  "*.moe": topk_consumer_meta("router.linear")})
