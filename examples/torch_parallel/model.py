"""A small transformer in plain PyTorch, sharded the way megatron-core shards a GPT.

One definition serves every layout (:class:`~examples.torch_parallel.layout.Layout`): the
single-device reference (``Layout()``) and candidates with tensor (TP), sequence (SP),
context (CP) and data/expert (DP = EP) parallelism, FP8 by fake-quant and a mixture of
experts. Every rank builds the *full* weights from the seed and keeps its shard, so the
reference and every candidate start from the same parameters.

Per microbatch (one sequence of ``seq`` tokens, features ``x`` [seq, hidden], targets
[seq, out]), each rank holds its tokens: the CP zigzag chunks
(:func:`~examples.torch_parallel.ring_attention.cp_positions`), and under SP the TP rank's
contiguous block of those. Each layer (pre-norm, RMSNorm):

* attention: ``qkv`` column-parallel (whole heads per TP rank; weight rows ordered
  ``[head, (q, k, v), dh]`` as megatron's fused QKV, so the TP shard is a contiguous block),
  RoPE at the tokens' global positions, causal attention (ring attention over the CP group
  when ``cp > 1``), ``proj`` row-parallel, then the partial outputs summed over TP
  (all-reduce, or reduce-scatter under SP) and added to the residual;
* MLP (``fc1`` column-parallel, GELU, ``fc2`` row-parallel) or, with ``moe``, a
  mixture of experts (:mod:`~examples.torch_parallel.moe`) with experts sharded over the DP
  group (EP = DP), router and experts replicated over TP;
* with ``fp8`` the four linears of a layer run in FP8 by fake-quant
  (:mod:`~examples.torch_parallel.fp8`; delayed scaling, amax reduced over all ranks);
* with ``recompute`` each layer is recomputed in backward (``torch.utils.checkpoint``).

Then a final RMSNorm and a replicated linear head; the loss of a rank is
``sum over its tokens of ||y - target||^2 / (seq * out)`` (its share of the microbatch's
mean squared error; the shares of the TP (under SP) and CP ranks of one sequence sum to the
microbatch loss). The MoE auxiliary loss is returned separately and added for the backward
only (as megatron's ``MoEAuxLossAutoScaler`` does): every rank sharing the sequence holds
the whole sequence's value, and its backward reaches only the rank's own tokens, so the
gradients summed over those ranks are the single-device ones
(:func:`examples.torch_parallel.moe.switch_aux_loss`).

Parameters carry two attributes the training step reads: ``sequence_parallel`` (replicated
over TP but fed by TP-split tokens: its gradient is summed over TP under SP, as megatron's
``finalize_model_grads``) and ``expert`` (sharded over the EP = DP group).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from examples.torch_parallel import comm
from examples.torch_parallel import ring_attention as ra
from examples.torch_parallel.layout import Groups, Layout

__all__ = ["ModelConfig", "TinyLM", "shard_tokens"]


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the harness model (small enough for 2 CPU cores, every dim divisible by 4)."""

    hidden: int = 32
    heads: int = 4
    ffn: int = 64
    layers: int = 2
    seq: int = 16
    out: int = 8
    experts: int = 4
    topk: int = 2
    aux_coeff: float = 0.01


def _full_weight(gen: torch.Generator, rows: int, cols: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=gen) / math.sqrt(cols)


def shard_tokens(t: torch.Tensor, layout: Layout, groups: Groups) -> torch.Tensor:
    """This rank's tokens (dim 0) of a whole-sequence tensor: CP zigzag, then the SP block."""
    if layout.cp > 1:
        t = t[ra.cp_positions(t.shape[0], layout.cp, groups.cp_rank)]
    if layout.sp:
        t = t.chunk(layout.tp, dim=0)[groups.tp_rank]
    return t


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` (``F.rms_norm``), replicated over TP."""

    def __init__(self, hidden: int, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone())
        self.weight.sequence_parallel = True
        self.hidden = hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.hidden,), self.weight, eps=1e-5)


class _ShardedLinear(nn.Module):
    """A linear layer holding this rank's block of the weight; plain or FP8 (fake-quant)."""

    def __init__(self, weight: torch.Tensor, layout: Layout, groups: Groups) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone())
        self.layout, self.groups = layout, groups
        if layout.fp8:
            from examples.torch_parallel.fp8 import Fp8State
            self.fp8 = Fp8State()

    def gemm(self, x: torch.Tensor, microbatch: int, sp_group: Any = None) -> torch.Tensor:
        """``x @ weight^T``; ``sp_group``: ``x`` is a token shard to all-gather first."""
        if not self.layout.fp8:
            return F.linear(comm.gather_seq(x, sp_group), self.weight)
        return self.fp8.linear(x, self.weight, microbatch=microbatch, sp_group=sp_group,
                               recompute=self.layout.recompute)


class ColumnLinear(_ShardedLinear):
    """Column-parallel: this rank's block of output features (``weight`` rows). Entry into
    the TP region: under SP the token shards are all-gathered (inside the FP8 GEMM, after
    quantisation, as Transformer Engine does), otherwise the input is copied (its gradient
    summed over TP)."""

    def forward(self, x: torch.Tensor, microbatch: int) -> torch.Tensor:
        tp = self.groups.tp
        return self.gemm(x, microbatch, sp_group=tp) if self.layout.sp else self.gemm(comm.copy_to(x, tp), microbatch)


class RowLinear(_ShardedLinear):
    """Row-parallel: this rank's block of input features (``weight`` columns); the output is
    a partial sum over TP, summed by the caller (so the trace records the partial)."""

    def forward(self, x: torch.Tensor, microbatch: int) -> torch.Tensor:
        return self.gemm(x, microbatch)


class CoreAttention(nn.Module):
    """RoPE at the tokens' global positions, then causal attention (ring attention over CP)."""

    def __init__(self, layout: Layout, groups: Groups) -> None:
        super().__init__()
        self.layout, self.groups = layout, groups

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, k = ra.rope(q, positions), ra.rope(k, positions)
        if self.layout.cp > 1:
            o = ra.ring_attention(q, k, v, positions, self.groups.cp)
        else:
            o = ra.attention(q, k, v, positions, positions)
        return o.reshape(o.shape[0], -1)


class Layer(nn.Module):
    """One pre-norm transformer layer (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, layout: Layout, groups: Groups, gen: torch.Generator, dtype: torch.dtype,
                 seed: int) -> None:
        super().__init__()
        h, tp, r = cfg.hidden, layout.tp, groups.tp_rank
        self.cfg, self.layout, self.groups = cfg, layout, groups
        self.dh, self.heads_local = h // cfg.heads, cfg.heads // tp
        norm_w = lambda: 1 + 0.1 * torch.randn(h, generator=gen)
        self.ln1 = RMSNorm(h, norm_w().to(dtype))
        qkv = _full_weight(gen, 3 * h, h)  # rows [head, (q, k, v), dh]
        self.qkv = ColumnLinear(qkv.chunk(tp, 0)[r].to(dtype), layout, groups)
        self.core_attn = CoreAttention(layout, groups)
        self.proj = RowLinear(_full_weight(gen, h, h).chunk(tp, 1)[r].to(dtype), layout, groups)
        self.ln2 = RMSNorm(h, norm_w().to(dtype))
        if layout.moe:
            from examples.torch_parallel.moe import MoE
            self.moe = MoE(h, cfg.ffn, cfg.experts, cfg.topk, dtype=dtype, seed=seed,
                           ep_group=groups.dp, stat_group=groups.tp_cp if layout.sp else groups.cp)
            for p in self.moe.parameters():
                p.sequence_parallel = True
            for p in self.moe.experts.parameters():
                p.expert = True
        else:
            self.fc1 = ColumnLinear(_full_weight(gen, cfg.ffn, h).chunk(tp, 0)[r].to(dtype), layout, groups)
            self.fc2 = RowLinear(_full_weight(gen, h, cfg.ffn).chunk(tp, 1)[r].to(dtype), layout, groups)
        self.aux_loss: torch.Tensor | None = None

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        tp = self.groups.tp
        return comm.reduce_scatter_seq(y, tp) if self.layout.sp else comm.reduce_from(y, tp)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, microbatch: int) -> torch.Tensor:
        qkv = self.qkv(self.ln1(x), microbatch)
        q, k, v = qkv.view(qkv.shape[0], self.heads_local, 3, self.dh).unbind(2)
        x = x + self._reduce(self.proj(self.core_attn(q, k, v, positions), microbatch))
        h = self.ln2(x)
        if self.layout.moe:
            out, self.aux_loss = self.moe(h)
            return x + out
        return x + self._reduce(self.fc2(F.gelu(self.fc1(h, microbatch)), microbatch))


class TinyLM(nn.Module):
    """The harness model (module docstring); ``forward`` returns this rank's loss share."""

    def __init__(self, cfg: ModelConfig, layout: Layout, groups: Groups, dtype: torch.dtype, seed: int = 0) -> None:
        super().__init__()
        self.cfg, self.layout, self.groups = cfg, layout, groups
        gen = torch.Generator().manual_seed(seed)
        self.layers = nn.ModuleList(Layer(cfg, layout, groups, gen, dtype, seed * 100 + i) for i in range(cfg.layers))
        self.final_ln = RMSNorm(cfg.hidden, (1 + 0.1 * torch.randn(cfg.hidden, generator=gen)).to(dtype))
        self.head = nn.Linear(cfg.hidden, cfg.out, bias=False, dtype=dtype)
        with torch.no_grad():
            self.head.weight.copy_(_full_weight(gen, cfg.out, cfg.hidden))
        self.head.weight.sequence_parallel = True

    def positions(self) -> torch.Tensor:
        """Global positions of this rank's CP tokens (the whole CP shard, also under SP)."""
        return ra.cp_positions(self.cfg.seq, self.layout.cp, self.groups.cp_rank)

    def forward(self, x: torch.Tensor, target: torch.Tensor, microbatch: int
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x``, ``target``: this rank's tokens (:func:`shard_tokens`); returns its loss share
        and the MoE auxiliary loss (None without MoE; see the module docstring)."""
        pos = self.positions()
        for layer in self.layers:
            if self.layout.recompute:
                x = checkpoint(layer, x, pos, microbatch, use_reentrant=False)
            else:
                x = layer(x, pos, microbatch)
        y = self.head(self.final_ln(x))
        loss = ((y.float() - target.float()) ** 2).sum() / (self.cfg.seq * self.cfg.out)
        aux = sum(layer.aux_loss for layer in self.layers) if self.layout.moe else None
        return loss, aux
