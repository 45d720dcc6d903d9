"""Bench cases of the attention family: ``attention`` forward and ``attention_dq``/``_dk``/``_dv``,
per format (fp32, bf16, fp16), data (random normal and adversarial: peaked rows, flat rows,
large scores, near-constant values, causal + padding masks, an additive mask, grouped-query
heads) and implementation (torch's CPU ``scaled_dot_product_attention`` with
:func:`~ttrace_num.bounds.attention.torch_cpu_sdpa_model`, manual standard attention with
torch ops, or the emulated computation models).

:func:`make_inputs` is also used by ``tests/test_bounds_attention.py``. Shapes are small
(one head group, 16 queries, 32 keys, d = 16) so that one trial, mpmath reference
included, costs < 0.2 s."""
from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.harness import Case
from ttrace_num.bounds.attention import torch_cpu_sdpa_model
from ttrace_num.emulate.attention import (
    emulate_attention,
    emulate_attention_backward,
    exact_attention,
    exact_attention_backward,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KINDS = ("normal", "peaked", "flat", "large", "const_v", "heavy", "causal_padding", "additive", "gqa", "masked_rows")


def make_inputs(kind: str, dtype: torch.dtype, g: torch.Generator, B: int = 1, H: int = 2, Lq: int = 16,
                Lk: int = 32, d: int = 16) -> tuple[tuple[torch.Tensor, ...], dict]:
    """``((q, k, v), sdpa_kwargs)`` of one data kind (the kwargs use torch SDPA's names).

    * ``normal``: N(0, 1) entries; ``peaked``: one key aligned with each query and scaled so
      its weight dominates (scores up to ~30); ``flat``: all keys equal (uniform weights);
      ``large``: N(0, 9) entries (scores ~ +-30, exps down to e^-60); ``const_v``: values
      1 + 1e-3 noise (the output cancels to ~1, ``v_j - O`` tiny); ``heavy``: Student-t(2)
      entries clipped to +-50; ``causal_padding``: causal plus the last keys masked in one
      batch row; ``additive``: an N(0, 4) float mask with some ``-inf``; ``gqa``: 4 query
      heads over 2 key/value heads; ``masked_rows``: some query rows with every key masked.
    """
    Hq = 4 if kind == "gqa" else H
    Hkv = 2 if kind == "gqa" else H
    rn = lambda *s: torch.randn(*s, generator=g)
    q, k, v = rn(B, Hq, Lq, d), rn(B, Hkv, Lk, d), rn(B, Hkv, Lk, d)
    kw: dict = {}
    if kind == "peaked":
        idx = torch.randint(0, Lk, (Lq,), generator=g)
        k[..., idx[: min(Lq, Lk)], :] = q[..., : min(Lq, Lk), :][:, :Hkv] * 2.0
        q = q * 1.5
    elif kind == "flat":
        k = k[..., :1, :].expand_as(k).clone()
    elif kind == "large":
        q, k = q * 3, k * 3
    elif kind == "const_v":
        v = 1 + 1e-3 * v
    elif kind == "heavy":  # Student-t(2) = N(0,1) / sqrt(chi2_2 / 2), chi2_2 / 2 = -log U
        q, k, v = ((x / torch.sqrt(-torch.log(torch.rand(x.shape, generator=g)))).clamp(-50, 50) for x in (q, k, v))
    elif kind == "causal_padding":
        m = torch.ones(B, 1, Lq, Lk, dtype=torch.bool).tril()
        m[0, :, :, Lk - 5:] = False
        m[..., 0] = True  # keep key 0 so that no row is empty
        kw["attn_mask"] = m
    elif kind == "additive":
        a = 2 * rn(1, 1, Lq, Lk)
        a[torch.rand(1, 1, Lq, Lk, generator=g) < 0.2] = -math.inf
        a[..., 0] = 0.0
        kw["attn_mask"] = a.to(dtype)
    elif kind == "gqa":
        kw["enable_gqa"] = True
    elif kind == "masked_rows":
        m = torch.ones(Lq, Lk, dtype=torch.bool)
        m[torch.rand(Lq, generator=g) < 0.25] = False
        kw["attn_mask"] = m
    elif kind != "normal":
        raise ValueError(f"unknown data kind {kind!r}")
    return (q.to(dtype), k.to(dtype), v.to(dtype)), kw


def _maker(kind: str, fmt: str, backward: bool = False) -> Callable[[torch.Generator], tuple[tuple, dict]]:
    def make(g: torch.Generator) -> tuple[tuple, dict]:
        (q, k, v), kw = make_inputs(kind, DTYPES[fmt], g, H=1 if backward else 2)
        if backward:
            return (q, k, v, torch.randn(q.shape, generator=g).to(q.dtype)), kw
        return (q, k, v), kw

    return make


def sdpa(q, k, v, **kw) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, **kw)


def sdpa_grads(q, k, v, do, **kw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    F.scaled_dot_product_attention(qq, kk, vv, **kw).backward(do)
    return qq.grad, kk.grad, vv.grad


def manual(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False) -> torch.Tensor:
    """Standard attention with torch ops in the input dtype: ``(q @ k^T) * scale``, mask,
    ``softmax`` (fp32 inside for bf16/fp16, output in the input dtype), ``@ v``."""
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        r = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(r, -3), v.repeat_interleave(r, -3)
    s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else s + attn_mask
    return s.softmax(-1) @ v


def manual_model(dtype: torch.dtype) -> dict:
    """The model of :func:`manual`: scores stored in the input dtype, ``P`` in the input dtype."""
    return {} if dtype == torch.float32 else {"score_fmt": dtype, "p_fmt": dtype}


def _grad(i: int, f: Callable) -> Callable:
    return lambda *a, **kw: f(*a, **kw)[i]


def _cases() -> list[Case]:
    out: list[Case] = []
    for fmt, dt in DTYPES.items():
        flash = torch_cpu_sdpa_model(torch.empty(1, 1, 16, 16, dtype=dt))
        for kind in ("normal", "peaked", "large", "causal_padding", "additive", "gqa", "masked_rows"):
            out.append(Case("attention", kind, fmt, _maker(kind, fmt), sdpa, exact_attention, bound_kwargs=flash))
        for kind in ("normal", "flat", "const_v", "heavy"):
            out.append(Case("attention", f"{kind}, manual", fmt, _maker(kind, fmt), manual, exact_attention,
                            bound_kwargs=manual_model(dt)))
        for alg, extra in (("standard", {}), ("online", {"block_size": 8, "p_fmt": dt})):
            model = {"algorithm": alg, **extra}
            emu = functools.partial(emulate_attention, **model)
            out.append(Case("attention", f"normal, {alg}", fmt, _maker("normal", fmt), emu, exact_attention,
                            bound_kwargs=model, implementation="emulated"))
        flash_b = torch_cpu_sdpa_model(torch.empty(1, 1, 16, 16, dtype=dt), backward=True)
        for i, op in enumerate(("attention_dq", "attention_dk", "attention_dv")):
            out.append(Case(op, "normal", fmt, _maker("normal", fmt, True), _grad(i, sdpa_grads),
                            _grad(i, exact_attention_backward), bound_kwargs=flash_b))
            model = {"algorithm": "online", "block_size": 8, "p_fmt": dt, "ds_fmt": dt}
            emu = functools.partial(emulate_attention_backward, **model)
            out.append(Case(op, "causal_padding, online", fmt, _maker("causal_padding", fmt, True), _grad(i, emu),
                            _grad(i, exact_attention_backward), bound_kwargs=model, implementation="emulated"))
    return out


CASES = _cases()
