r"""Context-parallel (CP) causal attention: zigzag layout, RoPE, and P2P ring attention.

Plain-PyTorch, CPU/gloo version of Megatron-LM / Transformer Engine's P2P context-parallel
attention (``AttnFuncWithCPAndKVP2P``) with the load-balanced ("zigzag") sequence layout,
for a bug-detection harness. Tensors have **no batch dim**: ``q, k, v`` are ``[s, heads, dh]``
(the local shard under CP), ``positions`` are the global token positions of the local rows.

Layout (:func:`zigzag_indices`)
    The global sequence of length ``S`` is cut into ``2 cp`` equal chunks of ``c = S / (2 cp)``
    tokens; CP rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``, concatenated in that order,
    so every rank gets the same amount of causal work. Identical to the ``zigzag`` kind of
    :func:`tracer.trace.canonical.shard` on the sequence dim.

RoPE (:func:`rope_angles`, :func:`rope`)
    ``inv_freq_i = base^(-2i/dh)`` (``i < dh/2``), ``theta_{t,i} = pos_t inv_freq_i`` in fp32,
    ``emb = [theta, theta]`` (non-interleaved halves); with ``x = [x1, x2]``,
    ``rotate_half(x) = [-x2, x1]`` and ``rope(x) = x cos(emb) + rotate_half(x) sin(emb)``;
    ``cos``/``sin`` are cast to ``x.dtype`` and the products are in ``x.dtype`` (Megatron's
    ``apply_rotary_pos_emb_bshd``). Under CP every rank must rotate with its *global*
    positions :func:`cp_positions` (zigzag); contiguous positions are bug B29.

Attention (:func:`attention`, the single-device reference)
    ``S = scale q k^T`` (``scale = 1/sqrt(dh)``), masked where ``k_pos > q_pos`` (causal by
    global position), ``P = softmax(S)`` in fp32 cast back to the input dtype (Megatron's
    unfused-softmax fallback), ``O = P v``; the GEMMs in the input dtype (torch ops only, so a
    ``TorchFunctionMode`` such as :class:`ttrace_num.propagate.noise.NoiseInjector` sees them).

Ring attention (:class:`RingAttention`, :func:`ring_attention`), ``cp`` ring steps.
    Forward: at step ``i`` rank ``r`` holds the K/V block (and its positions) of rank
    ``src = (r - i) mod cp``, received from rank ``r - 1`` while the previous block was being
    computed (non-blocking ``isend``/``irecv``, posted before the compute: no deadlock).
    Online softmax (Milakov & Gimelshein 2018; FlashAttention-2 Alg. 1), all in fp32, per
    query row: ``S_b = scale q k_b^T`` (masked ``-inf``), ``m' = max(m, rowmax S_b)``,
    ``alpha = exp(m - m')``, ``E = exp(S_b - m')``, ``l' = alpha l + rowsum E``,
    ``acc' = alpha acc + fl_dtype(E) v_b`` (``E`` rounded to the input dtype before the ``P V``
    GEMM, like FlashAttention-2; the GEMM in fp32). A row with no unmasked key so far has
    ``m = -inf``; the shift uses 0 instead, so ``alpha = E = 0`` and no NaN appears.
    Finally ``O = acc / l`` (0 where ``l = 0``) cast to the input dtype, and the
    log-sum-exp ``L = m + log l`` (fp32, ``-inf`` where ``l = 0``) is saved.

    Backward (FlashAttention-2 Alg. 2 on the ring): ``D = rowsum(dO * O)`` (fp32); a second
    ring pass over the same blocks: ``P_b = exp(S_b - L)`` with the **global** ``L``,
    ``dV_b = fl_dtype(P_b)^T dO``, ``dP_b = dO v_b^T``, ``dS_b = P_b * (dP_b - D)``,
    ``dQ += fl_dtype(dS_b) k_b``, ``dK_b = fl_dtype(dS_b)^T q`` (all fp32 GEMMs). The fp32
    accumulators ``dK_b, dV_b`` of a block travel around the ring behind it: rank ``r`` adds
    its contribution for ``src``'s block to the partial sum received from rank ``r - 1`` and
    passes it on to ``r + 1``; after ``cp`` hops it is back at the owner. ``scale`` is applied
    once to the finished ``dQ`` and ``dK``, which are then cast to the input dtypes.

    Numerically this is the ``algorithm="online"`` model of :mod:`ttrace_num.bounds.attention`
    with ``T = cp`` key blocks of ``S / cp`` keys (in this rank's ring order),
    ``p_fmt = ds_fmt = dtype``, ``delta="output"``, fp32 everywhere else.

Harness hooks: module-level functions looked up at call time, so a bug is one monkeypatch:

* :func:`cp_positions` ``(seq_len, cp, cp_rank)`` -> this rank's global positions
  (correct: :func:`zigzag_indices`; B29: the contiguous chunk ``arange(r S/cp, (r+1) S/cp)``).
* :func:`_backward_kv` ``(step, kv_now, kv_step0)`` -> the ``(k, v)`` block the backward uses at
  ring step ``step`` (correct: ``kv_now``; B28: ``kv_step0``, the stale local block).
* :func:`_backward_lse` ``(lse_global, scores)`` -> the log-sum-exp ``P_b = exp(S_b - L)`` uses
  (correct: ``lse_global``; B02-like: the block-local ``torch.logsumexp(scores, -1)``).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["zigzag_indices", "cp_positions", "rope_angles", "rotate_half", "rope", "attention",
           "RingAttention", "ring_attention"]


# ----------------------------------------------------------------------------- layout
def zigzag_indices(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Global positions held by ``cp_rank``: chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp``.

    ``seq_len`` must be divisible by ``2 cp`` (when ``cp > 1``); ``cp = 1`` gives
    ``arange(seq_len)``. Equals ``tracer.trace.canonical.shard(arange(seq_len), zigzag ShardDim)``.
    """
    if cp == 1:
        return torch.arange(seq_len, dtype=torch.long)
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank {cp_rank} outside [0, {cp})")
    if seq_len % (2 * cp):
        raise ValueError(f"zigzag: seq_len {seq_len} is not divisible by 2*cp = {2 * cp}")
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(cp_rank * c, (cp_rank + 1) * c),
                      torch.arange((2 * cp - 1 - cp_rank) * c, (2 * cp - cp_rank) * c)]).long()


def cp_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """This CP rank's global token positions (for RoPE and the causal mask): the zigzag layout.

    Patch point of bug B29 (RoPE positions wrong under CP): a contiguous chunk
    ``torch.arange(cp_rank * seq_len // cp, (cp_rank + 1) * seq_len // cp)`` instead.
    """
    return zigzag_indices(seq_len, cp, cp_rank)


# ----------------------------------------------------------------------------- RoPE
def rope_angles(positions: torch.Tensor, dh: int, base: float = 10000.0) -> torch.Tensor:
    """``[s, dh]`` fp32 angles ``[theta, theta]``, ``theta_{t,i} = pos_t base^(-2i/dh)``, ``i < dh/2``."""
    if dh % 2:
        raise ValueError(f"RoPE needs an even head dim, got {dh}")
    inv_freq = 1.0 / (base ** (torch.arange(0, dh, 2, dtype=torch.float32) / dh))
    theta = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([theta, theta], dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dim (non-interleaved halves)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[s, heads, dh]`` at global ``positions`` ``[s]``:
    ``x cos(emb) + rotate_half(x) sin(emb)``, ``emb = rope_angles(positions)`` (fp32),
    ``cos``/``sin`` cast to ``x.dtype`` and the arithmetic in ``x.dtype`` (Megatron)."""
    emb = rope_angles(positions, x.shape[-1], base)[:, None, :]  # [s, 1, dh]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    return x * cos + rotate_half(x) * sin


# ----------------------------------------------------------------------------- reference
def _causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """``[sq, sk]`` bool, True = masked out (key later than query)."""
    return k_pos[None, :] > q_pos[:, None]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
              k_pos: torch.Tensor) -> torch.Tensor:
    """Plain causal attention by global positions; ``q, k, v`` ``[s, heads, dh]`` -> ``[sq, heads, dh]``.

    ``O = softmax(scale q k^T masked where k_pos > q_pos) v``, ``scale = 1/sqrt(dh)``; the GEMMs
    and the scaling in the input dtype, the softmax in fp32 cast back to the input dtype.
    A query row with no unmasked key gives NaN (never the case for causal global positions).
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [h, s, dh]
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    scores = scores.masked_fill(_causal_mask(q_pos, k_pos), float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, vh).transpose(0, 1)


# ----------------------------------------------------------------------------- harness hooks
def _backward_kv(step: int, kv_now: tuple[torch.Tensor, torch.Tensor],
                 kv_step0: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(k, v)`` block the ring backward computes with at ``step``: the one it holds now.

    Bug B28 (diffusers #14265): ``return kv_step0`` (K/V saved at ring step 0 reused)."""
    return kv_now


def _backward_lse(lse_global: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp ``[h, sq]`` the backward normalises block ``scores`` ``[h, sq, sk]`` with:
    the global one saved by the forward.

    B02-like bug: ``return torch.logsumexp(scores, -1)`` (block-local normalisation, forward
    unaffected, dQ/dK/dV wrong)."""
    return lse_global


# ----------------------------------------------------------------------------- ring
def _group_info(group: Any) -> tuple[int, int, int, int]:
    """``(cp, cp_rank, next global rank, previous global rank)``; ``group=None`` means cp = 1."""
    if group is None:
        return 1, 0, 0, 0
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    return cp, r, dist.get_global_rank(group, (r + 1) % cp), dist.get_global_rank(group, (r - 1) % cp)


def _exchange(send: list[torch.Tensor], nxt: int, prv: int, group: Any, tag0: int
              ) -> tuple[list[torch.Tensor], list[Any]]:
    """Post non-blocking sends of ``send`` to ``nxt`` and receives of same-shaped tensors from
    ``prv`` (distinct tags per tensor); return the receive buffers and all requests."""
    bufs = [torch.empty_like(t) for t in send]
    reqs = []
    for i, (t, b) in enumerate(zip(send, bufs)):
        reqs.append(dist.isend(t.contiguous(), dst=nxt, group=group, tag=tag0 + i))
        reqs.append(dist.irecv(b, src=prv, group=group, tag=tag0 + i))
    return bufs, reqs


def _wait(reqs: list[Any]) -> None:
    for q in reqs:
        q.wait()


def _block_scores(q32: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """``[h, sq, sk]`` fp32 ``scale q k^T``, ``-inf`` where ``k_pos > q_pos``; ``q32`` is ``[h, sq, dh]`` fp32."""
    s = torch.matmul(q32, k.float().transpose(0, 1).transpose(-1, -2)) * scale
    return s.masked_fill(_causal_mask(q_pos, k_pos), float("-inf"))


class RingAttention(torch.autograd.Function):
    """P2P ring attention over the CP ``group`` (module docstring for the math).

    ``forward(ctx, q, k, v, positions, group)``: ``q, k, v`` ``[s_local, heads, dh]`` of one
    floating dtype, ``positions`` ``[s_local]`` this rank's global positions (the same layout
    on every rank, e.g. :func:`cp_positions`). Returns ``[s_local, heads, dh]``.
    """

    @staticmethod
    def forward(ctx, q, k, v, positions, group):  # noqa: D102
        cp, _, nxt, prv = _group_info(group)
        dtype, scale = q.dtype, 1.0 / math.sqrt(q.shape[-1])
        q32 = q.float().transpose(0, 1)  # [h, sq, dh]
        h, sq, dh = q32.shape
        m = torch.full((h, sq), float("-inf"))
        l = torch.zeros(h, sq)
        acc = torch.zeros(h, sq, v.shape[-1])
        kb, vb, pb = k, v, positions
        for step in range(cp):
            reqs = []
            if step < cp - 1:  # pass this block on while computing it
                (kn, vn, pn), reqs = _exchange([kb, vb, pb], nxt, prv, group, tag0=0)
            s = _block_scores(q32, kb, positions, pb, scale)
            m_new = torch.maximum(m, s.amax(dim=-1))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m - m_safe)
            e = torch.exp(s - m_safe[..., None])
            l = alpha * l + e.sum(dim=-1)
            acc = alpha[..., None] * acc + torch.matmul(e.to(dtype).float(), vb.float().transpose(0, 1))
            m = m_new
            if reqs:
                _wait(reqs)
                kb, vb, pb = kn, vn, pn
        live = l > 0
        l_safe = torch.where(live, l, torch.ones_like(l))
        out32 = torch.where(live[..., None], acc / l_safe[..., None], torch.zeros_like(acc))
        lse = torch.where(live, m + torch.log(l_safe), torch.full_like(l, float("-inf")))
        out = out32.to(dtype).transpose(0, 1).contiguous()
        ctx.save_for_backward(q, k, v, positions, out, lse)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: D102
        q, k, v, positions, out, lse = ctx.saved_tensors
        group = ctx.group
        cp, _, nxt, prv = _group_info(group)
        dtype, scale = q.dtype, 1.0 / math.sqrt(q.shape[-1])
        q32 = q.float().transpose(0, 1)
        do32 = dout.float().transpose(0, 1)  # [h, sq, dh]
        D = (do32 * out.float().transpose(0, 1)).sum(dim=-1)  # [h, sq]
        dq = torch.zeros_like(q32)
        kv0 = (k, v)
        kb, vb, pb = k, v, positions
        dkv = None  # (dk, dv) partial sums of the block held now, fp32 [h, sk, dh]
        dkv_reqs: list[Any] = []
        for step in range(cp):
            reqs = []
            if step < cp - 1:
                (kn, vn, pn), reqs = _exchange([kb, vb, pb], nxt, prv, group, tag0=0)
            kc, vc = _backward_kv(step, (kb, vb), kv0)
            s = _block_scores(q32, kc, positions, pb, scale)
            L = _backward_lse(lse, s)
            L = torch.where(torch.isfinite(L), L, torch.zeros_like(L))  # rows with no key: P = 0
            p = torch.exp(s - L[..., None])
            dv_b = torch.matmul(p.to(dtype).float().transpose(-1, -2), do32)
            dp = torch.matmul(do32, vc.float().transpose(0, 1).transpose(-1, -2))
            ds = (p * (dp - D[..., None])).to(dtype).float()
            dq = dq + torch.matmul(ds, kc.float().transpose(0, 1))
            dk_b = torch.matmul(ds.transpose(-1, -2), q32)
            if dkv_reqs:  # the partial sums for this block from rank r - 1
                _wait(dkv_reqs)
                dkv = (dkv[0] + dk_b, dkv[1] + dv_b)
            else:
                dkv = (dk_b, dv_b)
            if cp > 1:  # pass the partial sums on behind the block; back home after cp hops
                dkv, dkv_reqs = _exchange(list(dkv), nxt, prv, group, tag0=8)
            if reqs:
                _wait(reqs)
                kb, vb, pb = kn, vn, pn
        _wait(dkv_reqs)
        dk32, dv32 = dkv
        dq = (dq * scale).to(dtype).transpose(0, 1).contiguous()
        dk = (dk32 * scale).to(k.dtype).transpose(0, 1).contiguous()
        dv = dv32.to(v.dtype).transpose(0, 1).contiguous()
        return dq, dk, dv, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   group: Any = None) -> torch.Tensor:
    """Causal attention of this rank's ``q, k, v`` ``[s_local, heads, dh]`` over the whole
    sequence split across the CP ``group`` (:class:`RingAttention`). ``group=None`` or a group
    of size 1 runs the single-device :func:`attention` (the reference's code path)."""
    if group is None or dist.get_world_size(group) == 1:
        return attention(q, k, v, positions, positions)
    return RingAttention.apply(q, k, v, positions, group)
