"""Injected bugs for the plain-PyTorch harness: the catalogue's CP, FP8 and MoE bugs, and three beyond it.

Each bug is a ``patch(run) -> undo`` (``run``: this rank's
:class:`~examples.torch_parallel.train.Run`, after the model and optimizer are built),
registered in :data:`BUGS` with the catalogue entry, its class, the layout it needs
(``needs``: a layout name, see :class:`~examples.torch_parallel.layout.Layout`) and the
first divergence it must produce. It replaces one small module-level function of the
harness (looked up at call time) or one parameter attribute, never an installed file.
Adding one takes about 15 lines::

    @bug("my_bug", catalogue="B99", bug_class="wrong scale factor", needs="tp1.cp2.dp1",
         expected_phase="grad", expected_name="layers.0.ln1.weight",
         doc="what goes wrong, and where")
    def _my_bug(run):
        return replace(train, "dense_grad_scale", lambda layout: 1.0 / layout.dp)

``trace_job({..., "bug": "my_bug"})`` (:mod:`examples.torch_parallel.run`) injects it on every
rank of the candidate.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from examples.bug_registry import Registry, replace
from examples.torch_parallel import comm, fp8, moe, train
from examples.torch_parallel import ring_attention as ra

__all__ = ["BUGS", "UNIT_PATCHES", "bug"]

BUGS = Registry()
bug = BUGS.bug


# --- context parallelism -------------------------------------------------------------------------

@bug("cp_ring_backward_stale_kv", catalogue="B28", bug_class="layout/indexing (stale buffer)",
     needs={"layout": "tp1.cp2.dp1"}, expected_phase="bwd", expected_name="layers.1.qkv.output_grad",
     doc="the ring-attention backward computes every ring step against the K/V block it held at "
         "step 0 (saved tensors reused) instead of the block it has received")
def _stale_kv(run):
    return replace(ra, "_backward_kv", stale_backward_kv)


def stale_backward_kv(step: int, kv_now: tuple, kv_step0: tuple) -> tuple:
    """B28's ``ring_attention._backward_kv``: the K/V block saved at ring step 0."""
    return kv_step0


@bug("cp_ring_backward_block_lse", catalogue="B02", bug_class="layout/indexing (wrong normaliser)",
     needs={"layout": "tp1.cp2.dp1"}, expected_phase="bwd", expected_name="layers.1.qkv.output_grad",
     doc="the ring-attention backward recomputes each block's probabilities with the block's own "
         "log-sum-exp instead of the global one: forward right, dQ/dK/dV wrong (relative error O(1))")
def _block_lse(run):
    return replace(ra, "_backward_lse", block_local_lse)


def block_local_lse(lse_global: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """B02's ``ring_attention._backward_lse``: the block's own log-sum-exp."""
    return torch.logsumexp(scores, -1)


@bug("cp_rope_contiguous_positions", catalogue="B29", bug_class="layout/indexing (wrong offset)",
     needs={"layout": "tp1.cp2.dp1"}, expected_phase="fwd", expected_name="layers.0.core_attn.output",
     doc="RoPE uses contiguous positions rank*s .. rank*s+s-1 for a CP rank's tokens instead of their "
         "zigzag (load-balanced) global positions; the causal mask still uses the right ones")
def _rope_positions(run):
    orig, r = ra.rope, run.groups.cp_rank

    def rope(x, positions, base=10000.0):
        n = positions.numel()
        return orig(x, torch.arange(r * n, (r + 1) * n, dtype=positions.dtype), base)
    return replace(ra, "rope", rope)


@bug("cp_grad_scale_uses_dp", catalogue="B06", bug_class="wrong scale factor",
     needs={"layout": "tp1.cp2.dp1"}, expected_phase="grad", expected_name="layers.0.ln1.weight",
     doc="the summed gradients are divided by the DP size instead of DP x CP, while each rank's "
         "loss was scaled by DP x CP: every gradient is CP times too large")
def _cp_scale(run):
    return replace(train, "dense_grad_scale", lambda layout: 1.0 / layout.dp)


# --- FP8 -----------------------------------------------------------------------------------------

@bug("fp8_amax_reduced_over_dp_group", catalogue="B09", bug_class="collective on the wrong group",
     needs={"layout": "tp2.cp1.dp1+fp8"}, expected_phase="fp8_scale", expected_name="layers.0.qkv.fp8.scale",
     expected_step=0,
     doc="FP8 amaxes are reduced over the data-parallel group instead of the amax group (TP x CP x "
         "DP): the TP ranks' weight shards get different scales at the first update (the scale "
         "replicas differ), and step 1's GEMMs use them")
def _amax_group(run):
    return replace(train, "amax_group", lambda groups: groups.dp)


def amax_not_reduced(amaxes: torch.Tensor, group: Any) -> torch.Tensor:
    """B09 on a layout without DP, as ``fp8._reduce_amax``: the DP group has one rank, so no
    amax is reduced at all."""
    return amaxes.detach().clone()


@bug("fp8_wgrad_gather_wrong_dim", catalogue="B10", bug_class="layout/indexing (wrong dim)",
     needs={"layout": "tp2.cp1.dp1+sp+fp8"}, expected_phase="grad", expected_name="layers.0.qkv.weight",
     doc="under SP the FP8 input re-gathered for the weight gradient is concatenated along the "
         "wrong dim (an all-gather along dim 0 of x^T viewed as [in, tokens]): wgrad wrong, dgrad right")
def _wgrad_gather(run):
    return replace(fp8, "_gather_for_wgrad", gather_for_wgrad_wrong_dim)


def gather_for_wgrad_wrong_dim(x_local: torch.Tensor, group: Any) -> torch.Tensor:
    """B10's ``fp8._gather_for_wgrad`` (TE #530): ``gather_along_last_dim`` of ``x^T [in, t]``
    done with a dim-0 all-gather, then viewed as ``[in, p*t]``: right shape, wrong layout."""
    xt = x_local.t().contiguous()
    return comm.all_gather_seq(xt, group).reshape(xt.shape[0], -1).t()


@bug("fp8_cached_weight_wrong_scale_inv", catalogue="B11", bug_class="low-precision state (cache)",
     needs={"layout": "tp1.cp1.dp2+fp8"}, expected_phase="fwd", expected_name="layers.0.qkv.output",
     doc="on microbatches >= 1 the cached FP8 weight is decoded with a scale_inv recomputed from the "
         "current step's running amax instead of the one it was cast with")
def _cache_scale(run):
    return replace(fp8, "_cached_weight_scale_inv", cached_weight_scale_inv_updated)


def cached_weight_scale_inv_updated(entry: dict, meta: Any) -> torch.Tensor:
    """B11's ``fp8._cached_weight_scale_inv`` (TE #1047): the cached FP8 weight decoded with the
    weight ``scale_inv`` that an update including the step's running amax would give,
    ``RN(1 / RN(448 / max(history, running)))``, not the one it was cast with."""
    with torch._C.DisableTorchFunction():
        i = fp8._IDX["w"]
        m = torch.maximum(meta.amax_history[:, i].amax(), meta.amax[i])
        return torch.reciprocal(meta._scales(torch.stack([m, m, m]), meta.scale)[i])


@bug("fp8_recompute_bwd_amax_not_reduced", catalogue="B12", bug_class="low-precision state (amax)",
     needs={"layout": "tp1.cp1.dp2+fp8+recompute"}, expected_phase="fp8_scale",
     expected_name="layers.0.qkv.fp8.scale", expected_step=0,
     doc="with activation recompute the backward (gradient) amaxes are never reduced over the amax "
         "group: each DP rank's gradient scales follow its own data from the first update on")
def _bwd_amax(run):
    return replace(fp8, "_backward_amax_group", backward_amax_group_skipped_on_recompute)


def backward_amax_group_skipped_on_recompute(group: Any, recompute: bool) -> Any:
    """B12's ``fp8._backward_amax_group`` (TE #1190): no reduction when recompute was on."""
    return None if recompute else group


@bug("norm_grad_times_tp_with_cp_fp8", catalogue="B03", bug_class="wrong scale factor",
     needs={"layout": "tp2.cp2.dp1+fp8"}, expected_phase="grad", expected_name="layers.0.ln1.weight",
     doc="norm-weight gradients come out exactly TP times too large (summed over TP although every "
         "TP rank holds the same tokens), seen only with TP, CP and FP8 together")
def _norm_tp(run):
    orig = train.tp_reduce_sequence_parallel
    norms = {id(m.weight) for m in run.model.modules() if type(m).__name__ == "RMSNorm"}
    return replace(train, "tp_reduce_sequence_parallel",
                   lambda p, layout: orig(p, layout) or id(p) in norms)


# --- mixture of experts --------------------------------------------------------------------------

@bug("moe_router_grad_not_reduced", catalogue="B04/B17", bug_class="missing reduction of a replicated param's grad",
     needs={"layout": "tp2.cp1.dp1+sp+moe"}, expected_phase="grad", expected_name="layers.0.moe.router.linear.weight",
     doc="the replicated router lacks the `sequence_parallel` tag, so under SP its gradient (a partial "
         "sum over the TP ranks' tokens) is never all-reduced over TP: the TP replicas differ")
def _router(run):
    routers = [m.moe.router.weight for m in run.model.layers]
    for p in routers:
        del p.sequence_parallel

    def undo() -> None:
        for p in routers:
            p.sequence_parallel = True
    return undo


@bug("moe_aux_loss_local_token_count", catalogue="B30", bug_class="partition-local statistic used as global",
     needs={"layout": "tp2.cp1.dp1+sp+moe"}, expected_phase="fwd", expected_name="layers.0.moe.output.1",
     doc="the auxiliary load-balancing loss is normalised by the rank's own token count instead of the "
         "sequence's (tokens split over TP under SP, or over CP)")
def _aux_count(run):
    return replace(moe, "_aux_token_count", local_aux_token_count)


def local_aux_token_count(local_count: int, stat_group: Any) -> int:
    """B30's ``moe._aux_token_count``: the rank's own token count."""
    return int(local_count)


@bug("moe_expert_grad_not_divided_by_ep", catalogue="B31", bug_class="wrong scale factor",
     needs={"layout": "tp1.cp1.dp2+moe"}, expected_phase="grad", expected_name="layers.0.moe.experts.fc1",
     doc="expert gradients (already summed over the EP ranks by the token dispatcher) are not divided "
         "by the EP (= DP) size: EP times too large")
def _expert_scale(run):
    return replace(train, "expert_grad_scale", lambda layout: 1.0 / layout.cp)


#: the replacement functions above by catalogue id, for the harness modules' unit tests:
#: (module, attribute, replacement)
UNIT_PATCHES: dict[str, tuple[Any, str, Callable]] = {
    "B09": (fp8, "_reduce_amax", amax_not_reduced),
    "B02": (ra, "_backward_lse", block_local_lse),
    "B28": (ra, "_backward_kv", stale_backward_kv),
    "B10": (fp8, "_gather_for_wgrad", gather_for_wgrad_wrong_dim),
    "B11": (fp8, "_cached_weight_scale_inv", cached_weight_scale_inv_updated),
    "B12": (fp8, "_backward_amax_group", backward_amax_group_skipped_on_recompute),
    "B30": (moe, "_aux_token_count", local_aux_token_count),
}


# --- beyond the catalogue (docs/detection.md, "Bugs beyond the catalogue") ----------------------

@bug("cp_ring_key_positions_not_exchanged", catalogue="-", bug_class="layout/indexing (stale buffer)",
     needs={"layout": "tp1.cp2.dp1"}, expected_phase="fwd", expected_name="layers.0.core_attn.output",
     doc="the ring passes each K/V block on but not its global positions, so every block is masked "
         "with the local positions, as if it were the diagonal block")
def _ring_positions(run):
    exchange = ra._exchange

    def positions_kept_local(send: list, nxt: int, prv: int, group: Any, tag0: int) -> tuple[list, list]:
        bufs, reqs = exchange(send, nxt, prv, group, tag0)
        if len(send) == 3:  # (k, v, positions): the block's positions stay this rank's own
            bufs[2] = send[2]
        return bufs, reqs
    return replace(ra, "_exchange", positions_kept_local)


@bug("moe_routing_gathered_out_of_order", catalogue="-", bug_class="layout/indexing (wrong order)",
     needs={"layout": "tp1.cp1.dp2+moe"}, expected_phase="fwd", expected_name="layers.0.moe.output*",
     doc="the dispatcher all-gathers the tokens' expert indices in reverse rank order: each rank's "
         "tokens are computed by the experts another rank's tokens chose, with their own weights")
def _moe_idx(run):
    return replace(moe, "all_gather_seq", indices_gathered_reversed)


def indices_gathered_reversed(t: torch.Tensor, group: Any) -> torch.Tensor:
    """``moe.all_gather_seq`` with integer tensors' rank blocks in reverse order."""
    out = comm.all_gather_seq(t, group)
    if t.dtype.is_floating_point:
        return out
    return torch.cat(out.chunk(moe.group_size(group), dim=0)[::-1])


@bug("fp8_activation_cast_to_e5m2_on_one_tp_rank", catalogue="-", bug_class="wrong low-precision format",
     needs={"layout": "tp2.cp1.dp1+fp8"}, expected_phase="fwd", expected_name="layers.0.qkv.output",
     doc="TP rank 1 quantizes the forward activations to E5M2 instead of E4M3 (the HYBRID recipe's "
         "backward format used forward too): one mantissa bit fewer, and a scale for E5M2's range")
def _x_e5m2(run):
    if run.groups.tp_rank != 1:
        return lambda: None
    return replace(fp8, "FORMATS", {**fp8.FORMATS, "x": fp8.E5M2})
