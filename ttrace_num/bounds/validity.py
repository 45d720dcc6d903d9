r"""Where the random-rounding model of ``mode="probabilistic"`` and ``mode="statistical"`` does
not hold: repeated identical addends (and stagnating chains), per op, and what is charged there.

Why repeated addends break the model
------------------------------------
Both modes treat each rounding ``delta_j s_j`` of a sum as a mean-zero error independent of
the others (Higham & Mary 2019; Connolly, Higham & Mary 2021), so ``n`` of them add like a
random walk, ``~sqrt(n) u``. That is the behaviour of distinct addends: the low-order bits of
``s_{j-1} + t_j`` are scrambled by every new ``t_j``. When the *same* addend ``t`` is added
again and again (a constant operand row and column of a GEMM, a row of equal logits, a
constant tensor summed), the partial sums move by the same step and their rounding errors
follow a deterministic pattern that shares a sign: ``0.1`` summed 4096 times in fp32 errs by
``~1e-4`` relative, 60 times the ``sqrt(n) u`` the model expects, and the probabilistic bound
is violated on every element (``tests/test_validity.py``). The same holds for roundings that
repeat with the addend itself: the product ``a b`` of a repeated pair rounds the same way
every time, and equal logits share their exp and subtraction errors.

What is done (derivation)
-------------------------
Per output element, :func:`check` finds ``r``, the multiplicity of its most frequent nonzero
addend (zeros add exactly and are ignored): for matmul the number of ``k`` with
``a_ik = mode(a_i.)`` and ``b_kj = mode(b_.j)`` (a 0/1 GEMM of the two indicator matrices: a
constant row and column give ``r = K``); for sum/mean the modal value along the reduced
dims; for softmax/log_softmax and attention the modal ``exp(x_j - m)`` of the row (a repeated logit
or score; masked entries add an exact 0). The ``r`` roundings of the repeated addend are then *not* treated as random: each
is at most ``u (1 + theta) S`` (``|s_hat_v| <= (1 + theta) S``, :mod:`.summation`, with
``S = sum |t|``, ``theta = (1+u)^n - 1``), so together at most ``r c u (1 + theta) S``
(``c = 2`` when the products are rounded, as their roundings repeat too). The other
roundings still satisfy the model, and their variance (or Azuma proxy) is at most the
model's, which sums non-negative contributions of all roundings. Hence, on the model's
event, ``|err| <= bound_mode + charge`` with

* matmul, sum, mean: ``charge = r c u_acc (1 + theta) S`` (``/n`` for the mean);
* softmax: ``charge_i = y_i (r u (1 + theta) + g)``, ``g = c_exp u + hu_c(|x_G - m|)`` the
  repeated logit's exp and subtraction error (shared by the group ``G``: its effect on
  ``y_i``, ``y_i (1_{i in G} - w_G) g``, is at most ``y_i g``); log_softmax: ``r u (1 + theta) + g``;
* attention: ``charge = r u (1 + theta) (O + sum_j y_j |V_j|) + w_G (g + g_s) (max_j |V_j| + |O|)``
  (the row sum and the ``P V`` sum each add ``r`` repeated terms; ``g_s`` the repeated
  score's own GEMM error bound, ``d u |q| |k| scale``).

Elements with ``r >= r_min(n)`` take ``min(bound_mode + charge, deterministic bound)`` (which
one depends on the data only, never on the rounding errors, so the claim's probability is
unchanged); the deterministic bound (``~(n - 1) u S``) wins once ``r u S`` exceeds it, which
happens for ``r`` a sizeable fraction of ``n`` (constant data: always). ``Bound.explain()``
says how many elements were charged and how many fell back.

Threshold. A repeated addend's roundings are coherent only where its copies are added one
after the other (or onto partial sums that moved by the same steps); between two copies, any
distinct addend scrambles the low bits again. ``r`` copies in ``n`` places, arranged at random
(random data, or a random order), have about ``r^2/n`` adjacent pairs: below ``r = sqrt(n)``
at most about one, so the copies' errors are as independent as the others'. Hence
``r_min(n) = max(2, ceil(sqrt(n)))`` (32 for ``n = 1024``): random bf16 data, whose values
repeat 5-10 times in a row of 1024 by chance, is not charged (charging it would loosen small
outputs of a bf16 sum by up to 2x); constant data (``r = n``) always is. What a contiguous
block of ``r < sqrt(n)`` equal addends can do is at most ``r u S``, below about one standard
deviation of the model (``sigma ~ u S sqrt(n/3)/n`` per unit of ``S/n``). Measured violation
rates as a function of the repeated fraction ``f = r/n``, with and without the charge:
docs/bounds.md, "Statistical mode".

Stagnation: a chain in a narrow accumulator can absorb its addends
(:func:`~.summation_variance.may_stagnate`); with an unknown order the largest partial sum is
at most ``S``, so elements with ``u_acc S >= 1/2 rms(t)`` (matmul, sum, mean) take the
deterministic bound (never for fp32 accumulation below ``~10^7`` terms of one scale).

Not detected: several distinct values each repeated many times (only the most frequent one
is charged), and addends that are distinct but whose roundings are correlated by their bit
patterns (e.g. small integers: their sums are exact, which is harmless).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..formats import FloatFormat, half_ulp
from .common import Precision, f64
from .reduction import reduced_dims
from .statistical import attention_scores
from .summation import Summation, conversion_exact, products_exact
from .summation_variance import STAGNATION_MARGIN

__all__ = ["Validity", "check", "modal_multiplicity", "repeat_threshold", "VALIDITY_OPS"]


@dataclass
class Validity:
    """``marked``: elements where the model needs the charge (``r >= r_min(n)`` or stagnation);
    ``charge``: the deterministic allowance for the repeated roundings (``inf`` where only
    the deterministic bound is valid); ``multiplicity``: ``r``; all broadcast to the output."""

    marked: torch.Tensor
    charge: torch.Tensor
    multiplicity: torch.Tensor
    stagnating: int = 0


def modal_multiplicity(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indicator, count)`` along ``dim``: where each slice equals its most frequent nonzero
    finite value, and that value's multiplicity (keepdim; 0 when the slice has none)."""
    x64 = x.detach().movedim(dim, -1)
    if x64.dtype not in (torch.float32, torch.float64):  # values compared exactly: float32 holds bf16/fp16
        x64 = x64.float()
    eligible = (x64 != 0) & torch.isfinite(x64)
    key = torch.where(eligible, x64, torch.full_like(x64, math.nan)).contiguous()
    s, _ = key.sort(-1)  # NaN sorted last
    n = s.shape[-1]
    if n == 0:
        z = torch.zeros(*s.shape[:-1], 1, dtype=torch.float64)
        return torch.zeros_like(x64, dtype=torch.bool).movedim(-1, dim), z.movedim(-1, dim)
    idx = torch.arange(n).expand_as(s)
    start = torch.ones_like(s, dtype=torch.bool)
    start[..., 1:] = s[..., 1:] != s[..., :-1]  # NaN != NaN: every NaN starts its own run
    run_start = torch.where(start, idx, torch.zeros_like(idx)).cummax(-1).values
    length = torch.where(torch.isnan(s), torch.zeros_like(idx), idx - run_start + 1)
    count, at = length.max(-1, keepdim=True)
    value = s.gather(-1, at)
    ind = eligible & (x64 == value)
    return ind.movedim(-1, dim), count.double().movedim(-1, dim)


def _theta(u: float, n: int) -> float:
    return math.expm1(n * math.log1p(u))


def _stagnating(u: float, n: int, abs_sum: torch.Tensor, sq_sum: torch.Tensor) -> torch.Tensor:
    """``u S >= m rms(t)`` (module docstring, "Stagnation"); all False when impossible
    (``S <= n^1.5 rms``)."""
    if u * n**1.5 < STAGNATION_MARGIN:
        return torch.zeros_like(abs_sum, dtype=torch.bool)
    return u * abs_sum >= STAGNATION_MARGIN * (sq_sum / max(n, 1)).sqrt()


def repeat_threshold(n: int) -> int:
    """Smallest multiplicity charged: ``max(2, ceil(sqrt(n)))`` (module docstring, "Threshold")."""
    return max(2, math.ceil(math.sqrt(n)))


def _finish(r: torch.Tensor, charge: torch.Tensor, n: int, stag: torch.Tensor | None = None) -> Validity:
    marked = r >= repeat_threshold(n)
    charge = torch.where(marked, charge, torch.zeros_like(charge))
    n_stag = 0
    if stag is not None and bool(stag.any()):
        charge = torch.where(stag, torch.full_like(charge, math.inf), charge)
        marked = marked | stag
        n_stag = int(stag.sum())
    return Validity(marked, charge, r, n_stag)


def _matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, prec: Precision,
            summation: Summation | None) -> Validity:
    summ = summation if summation is not None else Summation(accum=prec.compute)
    ia, _ = modal_multiplicity(a, -1)
    ib, _ = modal_multiplicity(b, -2)
    r = ia.double() @ ib.double()
    n = a.shape[-1] + (bias is not None)
    u = summ.accum.u
    if not bool((r >= repeat_threshold(n)).any()) and u * n**1.5 < STAGNATION_MARGIN:  # nothing to do
        return _finish(r, torch.zeros_like(r), n)
    a64, b64 = f64(a).abs(), f64(b).abs()
    S = a64 @ b64
    sq = a64.square() @ b64.square()
    if bias is not None:
        S, sq = S + f64(bias).abs(), sq + f64(bias).square()
    c = 1 if products_exact(prec.storage, summ.accum) else 2
    return _finish(r, r * c * u * (1 + _theta(u, n)) * S, n, _stagnating(u, n, S, sq))


def _sum(op: str, x: torch.Tensor, dim, keepdim: bool, prec: Precision, summation: Summation | None) -> Validity:
    summ = summation if summation is not None else Summation(accum=prec.compute)
    dims = tuple(sorted(reduced_dims(op, x, dim)))
    x64 = f64(x)
    if not dims:
        z = torch.zeros_like(x64)
        return Validity(z.bool(), z, z)
    rest = [d for d in range(x.dim()) if d not in dims]
    flat = x64.permute(*rest, *dims).reshape(*[x.shape[d] for d in rest], -1)
    _, r = modal_multiplicity(flat, -1)
    r = r.squeeze(-1)
    n = flat.shape[-1]
    S = flat.abs().sum(-1)
    sq = flat.square().sum(-1)
    if keepdim:
        shape = [1 if d in dims else x.shape[d] for d in range(x.dim())]
        r, S, sq = r.reshape(shape), S.reshape(shape), sq.reshape(shape)
    u = summ.accum.u
    c = 1 if conversion_exact(prec.storage, summ.accum) else 2
    scale = 1.0 / n if op == "mean" else 1.0
    return _finish(r, r * c * u * (1 + _theta(u, n)) * S * scale, n, _stagnating(u, n, S, sq))


def _exp_group(x64: torch.Tensor, c: FloatFormat, exp_ulps: float) -> tuple[torch.Tensor, ...]:
    """Row quantities of the most repeated addend of a row sum of exps (rows along the last
    dim; the addends are ``E_j = exp(x_j - m)``, so a repeated logit 0 counts and a masked
    ``-inf`` does not): ``(ind, r, y, w_G, g)``."""
    m = x64.amax(-1, keepdim=True)
    finite_m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    a = x64 - finite_m
    E = torch.exp(a)
    ind, r = modal_multiplicity(E, -1)
    S = E.sum(-1, keepdim=True)
    y = E / torch.where(S > 0, S, torch.ones_like(S))
    w = (y * ind).sum(-1, keepdim=True)
    aG = torch.where(ind, a.abs(), torch.zeros_like(a)).amax(-1, keepdim=True)
    g = 2.0 * exp_ulps * c.u + half_ulp(aG, c)
    return ind, r, y, w, g


def _softmax(op: str, x: torch.Tensor, dim: int, prec: Precision, summation: Summation | None,
             exp_ulps: float) -> Validity:
    c = prec.compute
    summ = summation if summation is not None else Summation(accum=c)
    x64 = f64(x).movedim(dim, -1)
    n = x64.shape[-1]
    _, r, y, _, g = _exp_group(x64, c, exp_ulps)
    rel = r * summ.accum.u * (1 + _theta(summ.accum.u, n)) + g
    charge = y * rel if op == "softmax" else rel.expand_as(y)
    return _finish(r.expand_as(y).movedim(-1, dim), charge.movedim(-1, dim), n)


def _attention(q, k, v, prec: Precision, attn_mask, is_causal, scale, enable_gqa, exp_ulps) -> Validity:
    c = prec.compute
    s, blocked, _, sc, rep = attention_scores(q, k, attn_mask, is_causal, scale, enable_gqa)
    ind, r, y, w, g = _exp_group(s, c, exp_ulps)
    v64 = f64(v).repeat_interleave(rep, dim=-3) if rep > 1 else f64(v)
    k64 = f64(k).repeat_interleave(rep, dim=-3) if rep > 1 else f64(k)
    O = y @ v64
    d, Lk = q.shape[-1], k.shape[-2]
    qk_abs = (f64(q).abs() @ k64.abs().transpose(-1, -2)) * sc
    g_s = (d * c.u * (1 + _theta(c.u, d)) * qk_abs * ind).amax(-1, keepdim=True)
    dev = v64.abs().amax(-2, keepdim=True) + O.abs()  # >= max_j |V_jc - O_ic|, without an Lq x Lk x dv tensor
    ru = r * c.u * (1 + _theta(c.u, Lk))
    charge = ru * (O.abs() + y @ v64.abs()) + w * (g + g_s) * dev
    return _finish(r.expand_as(O), charge, Lk)


#: ops :func:`check` covers (the others are returned unchecked)
VALIDITY_OPS = ("matmul", "mm", "bmm", "linear", "sum", "mean", "softmax", "log_softmax", "attention",
                "scaled_dot_product_attention", "sdpa")


def check(op: str, inputs: tuple, prec: Precision, op_kwargs: dict[str, Any], exp_ulps: float = 1.0) -> Validity | None:
    """The :class:`Validity` of ``op`` on ``inputs`` (module docstring), ``None`` for an op
    without a detector."""
    kw = op_kwargs
    if op in ("matmul", "mm", "bmm"):
        return _matmul(inputs[0], inputs[1], kw.get("bias"), prec, kw.get("summation"))
    if op == "linear":
        bias = inputs[2] if len(inputs) > 2 else kw.get("bias")
        return _matmul(inputs[0], inputs[1].transpose(-1, -2), bias, prec, kw.get("summation"))
    if op in ("sum", "mean"):
        dim = inputs[1] if len(inputs) > 1 else kw.get("dim")  # torch's default: every dim
        return _sum(op, inputs[0], dim, bool(kw.get("keepdim", False)), prec, kw.get("summation"))
    if op in ("softmax", "log_softmax"):
        dim = inputs[1] if len(inputs) > 1 else kw.get("dim", -1)
        return _softmax(op, inputs[0], dim, prec, kw.get("summation"), float(kw.get("exp_ulps", exp_ulps)))
    if op in ("attention", "scaled_dot_product_attention", "sdpa"):
        return _attention(inputs[0], inputs[1], inputs[2], prec, kw.get("attn_mask"), bool(kw.get("is_causal")),
                          kw.get("scale"), bool(kw.get("enable_gqa")), float(kw.get("exp_ulps", exp_ulps)))
    return None
