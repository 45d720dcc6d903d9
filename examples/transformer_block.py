"""A plain-PyTorch pre-norm transformer block and its tensor-parallel twin.

Used by the layer-tolerance validation (tests, bench) and the docs. ``Block`` is the
single-device reference; ``TensorParallelBlock`` is the Megatron-style split of the same
weights over ``tp`` ranks: QKV and FC1 column-parallel (each rank owns a slice of heads /
FFN features), projection and FC2 row-parallel (each rank multiplies its slice of the
reduction dimension; partial outputs are summed by an all-reduce in the activation dtype).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def _attention(qkv: torch.Tensor, heads: int, dh: int) -> torch.Tensor:
    seq = qkv.shape[0]
    q, k, v = (t.reshape(seq, heads, dh).transpose(0, 1) for t in qkv.chunk(3, dim=-1))
    scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(dh))
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)
    p = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    return torch.matmul(p, v).transpose(0, 1).reshape(seq, heads * dh)


class Block(nn.Module):
    """``x + proj(attn(ln1(x)))`` then ``+ fc2(act(fc1(ln2(.))))``; causal; no biases in linears."""

    def __init__(self, hidden: int = 256, heads: int = 4, ffn: int | None = None, act: str = "gelu",
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0):
        super().__init__()
        ffn = ffn or 4 * hidden
        g = torch.Generator().manual_seed(seed)
        self.hidden, self.heads, self.dh, self.act = hidden, heads, hidden // heads, act

        def w(o, i):
            return nn.Parameter((torch.randn(o, i, generator=g) / math.sqrt(i)).to(dtype))
        self.ln1 = nn.LayerNorm(hidden, dtype=dtype)
        self.ln2 = nn.LayerNorm(hidden, dtype=dtype)
        with torch.no_grad():
            for ln in (self.ln1, self.ln2):
                ln.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=g))
                ln.bias.copy_(0.1 * torch.randn(hidden, generator=g))
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False, dtype=dtype)
        self.proj = nn.Linear(hidden, hidden, bias=False, dtype=dtype)
        self.fc1 = nn.Linear(hidden, ffn, bias=False, dtype=dtype)
        self.fc2 = nn.Linear(ffn, hidden, bias=False, dtype=dtype)
        self.qkv.weight, self.proj.weight = w(3 * hidden, hidden), w(hidden, hidden)
        self.fc1.weight, self.fc2.weight = w(ffn, hidden), w(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(_attention(self.qkv(self.ln1(x)), self.heads, self.dh))
        h = self.fc1(self.ln2(x))
        return x + self.fc2(F.gelu(h) if self.act == "gelu" else F.silu(h))


class TensorParallelBlock(nn.Module):
    """Rank ``rank``'s shard of :class:`Block` under tensor parallelism of size ``tp``.

    ``all_reduce`` sums partial outputs across ranks (default: ``torch.distributed`` SUM in
    the activation dtype); pass ``all_reduce=lambda t: t`` to inspect one rank's partial.
    """

    def __init__(self, full: Block, tp: int, rank: int, all_reduce=None):
        super().__init__()
        self.tp, self.rank = tp, rank
        self.heads, self.dh, self.act = full.heads // tp, full.dh, full.act
        h = full.hidden
        self.all_reduce = all_reduce or (lambda t: (dist.all_reduce(t), t)[1])
        self.ln1, self.ln2 = full.ln1, full.ln2
        hs = h // tp
        q, k, v = full.qkv.weight.detach().chunk(3, dim=0)
        sl = slice(rank * hs, (rank + 1) * hs)
        self.qkv = nn.Linear(h, 3 * hs, bias=False, dtype=q.dtype)
        self.qkv.weight = nn.Parameter(torch.cat([q[sl], k[sl], v[sl]]))
        self.proj = nn.Linear(hs, h, bias=False, dtype=q.dtype)
        self.proj.weight = nn.Parameter(full.proj.weight.detach()[:, sl].clone())
        fs = full.fc1.weight.shape[0] // tp
        fsl = slice(rank * fs, (rank + 1) * fs)
        self.fc1 = nn.Linear(h, fs, bias=False, dtype=q.dtype)
        self.fc1.weight = nn.Parameter(full.fc1.weight.detach()[fsl].clone())
        self.fc2 = nn.Linear(fs, h, bias=False, dtype=q.dtype)
        self.fc2.weight = nn.Parameter(full.fc2.weight.detach()[:, fsl].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.all_reduce(self.proj(_attention(self.qkv(self.ln1(x)), self.heads, self.dh)))
        h = self.fc1(self.ln2(x))
        return x + self.all_reduce(self.fc2(F.gelu(h) if self.act == "gelu" else F.silu(h)))
