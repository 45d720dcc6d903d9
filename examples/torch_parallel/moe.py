"""A small mixture-of-experts layer with expert parallelism, for the CPU/gloo bug harness.

Plain PyTorch, no batch dim: ``x`` is ``[T, hidden]`` (this rank's tokens). The layout copies
megatron-core's MoE with the *allgather* token dispatcher (``MoEAllGatherTokenDispatcher``):

* :class:`Router`: fp32 gate (megatron ``moe_router_dtype=fp32``), softmax, top-k,
  renormalised top-k probabilities;
* :func:`switch_aux_loss`: Switch/GShard load-balancing loss over the statistics of the
  whole sequence (``stat_group`` = the ranks that hold pieces of one sequence: sequence /
  context parallelism);
* :class:`Experts`: this EP rank's experts, stacked ``fc1 [E_local, ffn, hidden]``,
  ``fc2 [E_local, hidden, ffn]``, GELU;
* :class:`MoE`: router + experts + dispatcher (all-gather the EP group's tokens, run the
  local experts on the tokens routed to them, reduce-scatter the partial outputs).

``ep_group=None`` and ``stat_group=None`` run the same math on one device without
collectives (every collective below is the identity for ``group=None``).

Bug injection: the functions named ``_...`` at module level are looked up at call time, so a
harness replaces one with ``monkeypatch.setattr(moe, "_aux_token_count", ...)`` (or
``unittest.mock.patch``) for one run. See :data:`PATCH_POINTS`.

Gradient conventions (what a harness must do with the grads):

* **Router weight** (replicated on every rank of ``stat_group``): each rank's ``.grad`` is
  its tokens' part; the single-device gradient is the SUM over ``stat_group``
  (:func:`reduce_replicated_grads`; megatron does it through the ``sequence_parallel``
  attribute of the router weight, the attribute whose absence was bug B04).
* **Expert weights** (sharded over ``ep_group``): each rank's grad is already the full
  gradient of its shard (every rank runs its experts on *all* gathered tokens); the
  single-device tensors are the EP shards concatenated along dim 0. No reduction over EP
  (a reduction there, or a missing division when data-parallel grads are averaged, is B31).
* **Aux loss**: every rank's returned ``aux`` has the value of the whole-sequence loss. Its
  gradient is arranged so that summing the per-rank gradients over ``stat_group`` gives the
  single-device gradient (see :func:`switch_aux_loss`), i.e. each rank backpropagates
  ``main_loss_of_its_tokens + aux`` and the harness sums grads, exactly as for the main loss.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from examples.torch_parallel.comm import all_gather_seq, all_reduce, reduce_from, reduce_scatter_seq_raw

__all__ = [
    "PATCH_POINTS",
    "Experts",
    "MoE",
    "Router",
    "group_rank",
    "group_size",
    "reduce_replicated_grads",
    "switch_aux_loss",
]

#: module-level functions a bug patch replaces (name -> what the correct one returns)
PATCH_POINTS = {
    "_aux_token_count": "number of tokens of the whole sequence (local count summed over stat_group)",
    "_aux_expert_counts": "per-expert top-k assignment counts summed over stat_group (a new tensor)",
    "_aux_prob_sum": "per-expert prob sums summed over stat_group; backward = identity",
    "_all_gather_backward": "grad of the EP all-gather: this rank's block of the SUM over ep_group",
    "_reduce_scatter": "this rank's block of the SUM over ep_group of the gathered-token outputs",
    "_replicated_params": "parameters whose grads must be summed over stat_group (the router weight)",
}


# ============================================================================ collectives
def group_size(group: Any) -> int:
    """Size of ``group``; 1 for ``None`` (single device)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Any) -> int:
    """This process's rank in ``group``; 0 for ``None``."""
    return 0 if group is None else dist.get_rank(group)


def _reduce_scatter(t: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's block (dim 0) of the sum of ``t`` over ``group``
    (:func:`~examples.torch_parallel.comm.reduce_scatter_seq_raw`). Patch point."""
    return reduce_scatter_seq_raw(t, group)


def _all_gather_backward(grad: torch.Tensor, group: Any) -> torch.Tensor:
    """Gradient of the EP all-gather w.r.t. this rank's input. Every rank consumes the gathered
    tensor, so d(sum_r L_r)/d x_me = sum_r (dL_r/d gathered)[my block]: a reduce-scatter.
    Patch point (B17-like bug: return ``grad``'s own block without the sum, i.e. treat a
    Partial gradient as Replicate)."""
    return _reduce_scatter(grad, group)


class _GatherTokens(torch.autograd.Function):
    """all-gather along dim 0; backward :func:`_all_gather_backward` (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, g):
        return _all_gather_backward(g.contiguous(), ctx.group), None


class _ScatterOutputs(torch.autograd.Function):
    """reduce-scatter along dim 0 (:func:`_reduce_scatter`); backward all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather_seq(g.contiguous(), ctx.group), None


def gather_tokens(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Differentiable EP all-gather of ``x`` along dim 0 (identity for ``group=None``)."""
    return x if group is None else _GatherTokens.apply(x, group)


def scatter_outputs(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Differentiable EP reduce-scatter of ``x`` along dim 0 (identity for ``group=None``)."""
    return x if group is None else _ScatterOutputs.apply(x, group)


# ============================================================================ aux-loss statistics
def _aux_token_count(local_count: int, stat_group: Any) -> int:
    """Number of tokens ``T`` of the sequence: the local count summed over ``stat_group``.
    Patch point (B30: return ``local_count``, the per-rank count)."""
    if stat_group is None:
        return int(local_count)
    t = torch.tensor([int(local_count)], dtype=torch.int64)
    dist.all_reduce(t, group=stat_group)
    return int(t.item())


def _aux_expert_counts(local_counts: torch.Tensor, stat_group: Any) -> torch.Tensor:
    """Top-k assignments per expert over the sequence: ``local_counts`` summed over
    ``stat_group`` into a NEW tensor (B30 variant #7452-10: in-place all-reduce of a tensor
    later reused as local). Patch point."""
    return all_reduce(local_counts, stat_group)


def _aux_prob_sum(local_sum: torch.Tensor, stat_group: Any) -> torch.Tensor:
    """``sum_t probs[t, e]`` over the sequence: the local sums all-reduced over
    ``stat_group``; backward identity (:func:`~examples.torch_parallel.comm.reduce_from`: the
    objective every rank differentiates is ONE copy of the loss built on the sum, so
    d(loss)/d(partial_r) = d(loss)/d(sum) for every r, the incoming grad). Patch point (e.g. a
    backward that also all-reduces: the aux gradient x ``|stat_group|``)."""
    return reduce_from(local_sum, stat_group)


def switch_aux_loss(probs: torch.Tensor, indices: torch.Tensor, num_experts: int, topk: int,
                    coeff: float, stat_group: Any = None) -> torch.Tensor:
    """Switch/GShard load-balancing loss (megatron ``switch_load_balancing_loss_func``).

    ``aux = coeff * E * sum_e f_e * P_e`` with, over ALL ``T`` tokens of the sequence,

    * ``f_e = c_e / (k T)``: ``c_e`` the number of top-k assignments to expert ``e``
      (not differentiable),
    * ``P_e = S_e / T``: ``S_e = sum_t probs[t, e]`` (full softmax, fp32).

    When the sequence is split over ``stat_group`` (each rank holds ``T_r`` tokens), ``c_e``,
    ``S_e`` and ``T`` are sums over the group (:func:`_aux_expert_counts`,
    :func:`_aux_prob_sum`, :func:`_aux_token_count`), so every rank returns the same value,
    the single-device aux loss. Gradient: ``d aux / d probs[t, e] = coeff E c_e / (k T^2)``
    for each local token ``t``. The all-reduce of ``S`` has an identity backward, so rank
    ``r``'s autograd gives exactly that for its own tokens; the harness sums parameter
    grads over ``stat_group``, which gives ``sum_r sum_{t in r} ... = sum_t ...``, the
    single-device gradient. (A backward that all-reduces the grad, the adjoint of the sum
    ``sum_r aux_r``, would give ``|stat_group|`` times it, because every rank holds a copy
    of the same loss; equivalently one could all-reduce in backward and divide each rank's
    loss by ``|stat_group|``.)

    Computed in fp32: ``aux = (coeff E / (k T^2)) * sum_e c_e S_e``.
    """
    local_counts = torch.zeros(num_experts, dtype=torch.float32)
    local_counts.index_add_(0, indices.reshape(-1), torch.ones(indices.numel(), dtype=torch.float32))
    counts = _aux_expert_counts(local_counts, stat_group)
    S = _aux_prob_sum(probs.float().sum(dim=0), stat_group)
    T = _aux_token_count(probs.shape[0], stat_group)
    scale = coeff * num_experts / (topk * float(T) * float(T))
    return torch.sum(counts * S) * scale


def _replicated_params(moe: MoE) -> list[nn.Parameter]:
    """Parameters replicated over ``stat_group`` whose grads are partial sums there: the
    router weight. Patch point (B04/B17: return ``[]``, the router grad is not reduced)."""
    return [moe.router.weight]


def reduce_replicated_grads(moe: MoE) -> None:
    """Sum the grads of :func:`_replicated_params` over ``moe.stat_group`` in place (what a
    harness / megatron's ``finalize_model_grads`` does for ``sequence_parallel`` params)."""
    if moe.stat_group is None:
        return
    for p in _replicated_params(moe):
        if p.grad is not None:
            dist.all_reduce(p.grad, group=moe.stat_group)


# ============================================================================ modules
class Router(nn.Module):
    """Top-k softmax gate, kept in fp32 whatever the model dtype.

    ``logits = x.float() @ W^T`` (``W`` fp32 ``[E, hidden]``), ``probs = softmax(logits)``,
    ``(v, idx) = topk(probs, k)``, ``weights = v / sum_j v_j`` (the top-k probabilities
    renormalised to sum to 1). Returns ``(idx [T, k] int64, weights [T, k] fp32, probs [T, E]
    fp32, logits [T, E] fp32)``."""

    def __init__(self, hidden: int, num_experts: int, topk: int = 2):
        super().__init__()
        self.num_experts, self.topk = num_experts, topk
        self.linear = nn.Linear(hidden, num_experts, bias=False, dtype=torch.float32)

    @property
    def weight(self) -> nn.Parameter:
        return self.linear.weight

    def forward(self, x: torch.Tensor):
        logits = self.linear(x.float())
        probs = torch.softmax(logits, dim=-1)
        top, idx = torch.topk(probs, self.topk, dim=-1)
        weights = top / top.sum(dim=-1, keepdim=True)
        return idx, weights, probs, logits


def init_full_weights(hidden: int, ffn: int, num_experts: int, seed: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 ``(router [E, hidden], fc1 [E, ffn, hidden], fc2 [E, hidden, ffn])`` from ``seed``:
    normal with std ``1/sqrt(fan_in)``, drawn in this order from one generator, so every
    layout (any EP) slices the same full tensors."""
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(num_experts, hidden, generator=g) / math.sqrt(hidden)
    fc1 = torch.randn(num_experts, ffn, hidden, generator=g) / math.sqrt(hidden)
    fc2 = torch.randn(num_experts, hidden, ffn, generator=g) / math.sqrt(ffn)
    return router, fc1, fc2


class Experts(nn.Module):
    """The ``E_local = E / ep`` experts of one EP rank.

    Expert ``i`` (global index ``ep_rank * E_local + i``) maps tokens ``x [n, hidden]`` to
    ``fc2_i(gelu(fc1_i(x)))``: ``h = x @ fc1[i]^T``, ``y = gelu(h) @ fc2[i]^T``, in the model
    dtype (bf16 matmuls accumulate in fp32 and round to bf16). ``fc1 [E_local, ffn, hidden]``
    and ``fc2 [E_local, hidden, ffn]`` are the EP shards (dim 0) of the full tensors of
    :func:`init_full_weights`."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, dtype: torch.dtype, seed: int,
                 ep_size: int = 1, ep_rank: int = 0):
        super().__init__()
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} not divisible by ep={ep_size}")
        self.num_local = num_experts // ep_size
        self.first = ep_rank * self.num_local
        _, fc1, fc2 = init_full_weights(hidden, ffn, num_experts, seed)
        sl = slice(self.first, self.first + self.num_local)
        self.fc1 = nn.Parameter(fc1[sl].to(dtype).contiguous())
        self.fc2 = nn.Parameter(fc2[sl].to(dtype).contiguous())

    def expert(self, i: int, x: torch.Tensor, capture: dict | None = None) -> torch.Tensor:
        """Local expert ``i`` on ``x [n, hidden]``."""
        h = x @ self.fc1[i].t()
        a = F.gelu(h)
        y = a @ self.fc2[i].t()
        if capture is not None:
            for t in (h, y):
                if t.requires_grad:
                    t.retain_grad()
            capture[self.first + i] = {"x": x, "h": h, "a": a, "y": y}
        return y


class MoE(nn.Module):
    """Router + experts + allgather token dispatcher. ``forward(x) -> (out, aux)``.

    With ``G = |ep_group|`` ranks, each holding ``T`` tokens:

    1. route the local tokens: ``idx, w = Router(x)`` (fp32); ``aux`` from
       :func:`switch_aux_loss` over ``stat_group``;
    2. all-gather ``x``, ``idx``, ``w`` over ``ep_group`` -> ``GT`` tokens in rank order
       (differentiable for ``x`` and ``w``: backward is a reduce-scatter);
    3. for each local expert ``e``: the gathered tokens with ``e`` among their top-k
       (ascending token order), ``c = (expert_e(x_sel).float() * w_sel).to(dtype)``,
       ``buf[tokens] += c`` (``buf [GT, hidden]`` zeros in the model dtype);
    4. ``out`` = this rank's block of ``sum over ep_group of buf`` (reduce-scatter; backward
       all-gather).

    So ``out[t] = sum_{j<k} w[t, j] * expert_{idx[t, j]}(x[t])``, the single-device result
    (``ep_group=None``), up to the order in which the ``k`` contributions are added.

    Set ``self.capture = {}`` to record the intermediates of the next forward (``logits``,
    ``probs``, ``idx``, ``w``, ``experts[global_e] = {x, h, a, y, c}``; ``logits``, ``h``,
    ``y`` retain their grads).
    """

    def __init__(self, hidden: int, ffn: int, num_experts: int, topk: int = 2,
                 dtype: torch.dtype = torch.float32, seed: int = 0, ep_group: Any = None,
                 stat_group: Any = None, aux_loss_coeff: float = 1e-2):
        super().__init__()
        self.hidden, self.ffn, self.num_experts, self.topk = hidden, ffn, num_experts, topk
        self.dtype, self.aux_loss_coeff = dtype, aux_loss_coeff
        self.ep_group, self.stat_group = ep_group, stat_group
        self.router = Router(hidden, num_experts, topk)
        with torch.no_grad():
            self.router.linear.weight.copy_(init_full_weights(hidden, ffn, num_experts, seed)[0])
        self.experts = Experts(hidden, ffn, num_experts, dtype, seed, group_size(ep_group), group_rank(ep_group))
        self.capture: dict | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cap = self.capture
        idx, w, probs, logits = self.router(x)
        aux = switch_aux_loss(probs, idx, self.num_experts, self.topk, self.aux_loss_coeff, self.stat_group)
        xg = gather_tokens(x, self.ep_group)
        idxg = all_gather_seq(idx, self.ep_group)
        wg = gather_tokens(w, self.ep_group)
        buf = torch.zeros(xg.shape[0], self.hidden, dtype=self.dtype)
        ex = {} if cap is not None else None
        for i in range(self.experts.num_local):
            e = self.experts.first + i
            tok, slot = (idxg == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            y = self.experts.expert(i, xg.index_select(0, tok), ex)
            c = (y.float() * wg[tok, slot].unsqueeze(-1)).to(self.dtype)
            if ex is not None:
                ex[e]["c"], ex[e]["tokens"] = c, tok
            buf = buf.index_add(0, tok, c)
        out = scatter_outputs(buf, self.ep_group)
        if cap is not None:
            if logits.requires_grad:
                logits.retain_grad()
            cap.update(logits=logits, probs=probs, idx=idx, w=w, experts=ex, aux=aux)
        return out, aux
