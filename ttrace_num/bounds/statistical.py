r"""``mode="statistical"``: the tolerance of "is this difference expected?", from the *variance*
of the rounding error, for matmul/linear/bmm, sum, mean, softmax, log_softmax and attention.

What it claims
--------------
For each output element, ``P(|computed - exact| > bound) <= false_alarm`` under the model
below, with ``bound = z sigma + r_out`` where

* ``sigma^2`` is the variance of the error of the computation under an *unknown summation
  order* (a random-order recursive chain, the largest of the usual orders) and *random
  round-to-nearest errors*: every rounding of a value ``v`` to a format with half-ulp
  ``h(v)`` commits an error uniform on ``[-h, h]`` with ``h <= u |v|``, mean 0 and independent
  of the others (:mod:`.summation_variance`, identity (1): ``(u^2/3) (n+1)(Q/6 + C^2/3)`` for
  an ``n``-term sum with ``Q = sum t^2``, ``C = sum t``), propagated to first order through
  the op (below);
* ``z = sqrt(2 ln(2 / false_alarm))`` (5.39 at 1e-6). Why this ``z`` and not the normal
  quantile (4.89 at 1e-6), and why no central limit theorem is needed: a uniform variable on
  ``[-h, h]`` is *strictly sub-Gaussian*, ``E exp(t X) = sinh(t h)/(t h) <= exp(t^2 h^2 / 6)``,
  its variance proxy equals its variance ``h^2/3``. The first-order error is a sum of such
  variables times coefficients fixed by the data (in evaluation order a martingale whose
  increments are conditionally sub-Gaussian with proxy ``c_j^2 u^2/3``), so Chernoff's bound
  gives ``P(|err| > z sigma) <= 2 exp(-z^2 / 2)`` for *every* number of terms, 1 included.
  The price is 10% over the Gaussian quantile; in exchange the claim does not depend on
  ``n`` being large, and there is no small-``n`` regime to fall back from.
* ``r_out``: the rounding of the result into a narrower output format (fp32 accumulator
  stored in bf16), added *linearly* as its deterministic half-ulp ``hu_out(|y| + z sigma)``:
  ``|fl_out(s) - y| <= |s - y| + |fl_out(s) - s|`` holds always, and ``|s - y| <= z sigma``
  on the claimed event. Adding it in quadrature (``z sqrt(sigma^2 + h^2/3)``) is *not* valid
  per element: the value being rounded is (almost) fixed by the data, so that rounding's
  error is not random for one element; and since ``z/sqrt(3) = 3.1 > 1`` quadrature would
  also be looser where the rounding dominates (bf16/fp16 outputs).

Where it does not hold (and what is done): the roundings are not mean-independent when the
same addend is added again and again (constant operands, equal logits): their errors share
a sign and add linearly. :mod:`.validity` detects repeated addends; the dispatcher
(:func:`ttrace_num.tolerance`) charges their roundings deterministically and falls back to
the deterministic bound where that is smaller. A chain in a narrow accumulator can also
stagnate (:func:`~.summation_variance.may_stagnate`): such elements fall back too.

Order. The random-order variance is an *average* over orders; for one order ``sum_j s_j^2`` has
an exponential tail, so its ``z`` does not give the claimed rate per element (measured 7.6e-6
and 1.3e-5 at 8x64x8 and 8x128x8 against 1e-6). Where the kernel's order is known the variance
is that order's own (:mod:`.summation_variance`, "Known orders": the claim is then exact under
the rounding model): ``sum``/``mean`` of a contiguous fp32 CPU tensor over its last dim or all
dims, not split across threads, take ATen's cascade tree
(:func:`aten_cascade_applies`); a GEMM (no split declared, ``batch M K N <= CHAIN_BUDGET``)
takes ``max(random-order variance, index-order chain variance)`` (:func:`_index_chain_variance`;
MKL sums each output of an 8x8 fp32 GEMM as that chain, products rounded, bit for bit). Larger
GEMMs (MKL's blocked kernel, whose order is not documented) and the sums inside softmax and
attention keep the average: their rate is measured, not derived (docs/bounds.md).

Per op (first order; ``hu_f`` = :func:`~ttrace_num.formats.half_ulp` in format ``f``,
``c`` the compute format):

* matmul/linear/bmm: :func:`~.summation_variance.matmul_variance` (products of fp32 inputs
  counted as rounded: no FMA assumed), or the index-order chain's where larger, then ``r_out``.
* sum/mean: :func:`~.summation_variance.order_variance` (the cascade tree) where it applies,
  else :func:`~.summation_variance.sum_variance` over the reduced elements; mean
  divides the variance by ``n^2`` and adds the division's rounding ``hu_final(|y|)^2/3``.
* softmax (row of ``n`` logits, ``y_j = E_j / S``, ``E_j = exp(x_j - m)``): the relative
  error of ``e_j`` is ``alpha_j = tau_j + eps_j`` (the subtraction's rounding, variance
  ``hu_c(|x_j - m|)^2/3`` when inexact, and exp's error, uniform within ``exp_ulps`` ulp:
  variance ``(2 exp_ulps hu_c(E_j)/E_j)^2/3``), the row sum adds ``acc``
  (``Var = sum_variance(Q = sum E^2, C = S)``), the reciprocal ``delta_r``; then
  ``y_hat_i - y_i = y_i [(1 - y_i) alpha_i - sum_{j != i} y_j alpha_j - acc/S + delta_r] + rho_i``
  (``rho_i`` the product's rounding), so
  ``sigma_i^2 = y_i^2 [(1-y_i)^2 v_i - y_i^2 v_i + sum_j y_j^2 v_j + Var(acc)/S^2 + v_r] + hu_c(y_i)^2/3``.
* log_softmax: ``t_i - L_hat``, ``L_hat = fl_st(log(fl_st(s)))``:
  ``sigma_i^2 = (1-y_i)^2 v^tau_i - y_i^2 v^tau_i + sum_j y_j^2 v_j + Var(acc)/S^2 + v_st
  + (2 log_ulps hu_c(L))^2/3 + hu_st(L)^2/3 [st narrower than c] + hu_c(|x_i - m - L|)^2/3``.
* attention (row ``i``, keys ``j``, value column ``c``): score errors (the ``d``-term GEMM's
  variance, times ``scale^2``, plus the scaling's and an additive mask's rounding, and
  ``2 + [mask]`` roundings into ``score_fmt`` when the scores are stored narrower), the
  softmax's ``alpha_j``, ``P`` rounded to ``p_fmt`` before ``P V`` (numerator only), the
  ``P V`` GEMM and the row sum (identity (1)), the final ``1/l`` and product:
  ``sigma^2 = sum_j y_j^2 (V_jc - O_ic)^2 v_j + sum_j y_j^2 V_jc^2 v^P_j + Var(acc_N)
  + O^2 (Var(acc_l) + v_r) + hu_c(O)^2/3`` (``v_j`` = score + subtraction + exp variances;
  ``O = sum_j y_j V_j`` makes the row's common errors cancel: the ``V_jc - O_ic`` centring),
  plus, for online softmax over ``T > 1`` key blocks of ``b``, ``T - 1`` rescalings: the one
  after block ``t`` multiplies the running numerator ``N_t = sum_{j < t b} y_j V_j`` and row sum
  ``W_t = sum_{j < t b} y_j`` (normalised) by ``alpha_hat = alpha (1 + eps)``, which moves the
  earlier blocks' weight against the later ones: ``eps (N_t - W_t O)``
  (``v_alpha = (2 exp_ulps u)^2/3 + hu_c(range)^2/3``), plus the two products' roundings
  (``u^2/3 (N_t^2 + W_t^2 O^2)``).

Sources: Higham & Mary, SISC 41(5) 2019 (random rounding errors); Connolly, Higham & Mary,
SISC 43(1) 2021 (mean-independence, martingale form); sub-Gaussian tails: Vershynin,
*High-Dimensional Probability* (2018) §2.5; the uniform's moment generating function
``sinh(x)/x <= exp(x^2/6)`` (termwise comparison of the series ``x^{2k}/(2k+1)!`` and
``(x^2/6)^k/k!``). Measured tightness and violation rates: docs/bounds.md, "Statistical mode".
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..formats import FloatFormat, get_format, half_ulp
from ..rounding import round_to
from .base import Bound, Explanation, lambda_for
from .attention import torch_cpu_sdpa_model
from .common import Precision, f64, resolve_precision
from .reduction import reduced_dims
from .summation import Summation, conversion_exact, products_exact
from .summation_variance import aten_sum_lanes, chain_variance, matmul_sum_statistics, order_variance, sum_variance

__all__ = ["STATISTICAL_OPS", "DEFAULT_FALSE_ALARM", "CHAIN_BUDGET", "aten_cascade_applies", "false_alarm_factor",
           "statistical_tolerance", "Statistics",
           "kernel_model"]

#: default per-element false-alarm rate of ``mode="statistical"``
DEFAULT_FALSE_ALARM = 1e-6

SOURCE = ("Higham & Mary, SISC 41(5) 2019; Connolly, Higham & Mary, SISC 43(1) 2021; sub-Gaussian "
          "(uniform) rounding errors, Chernoff bound: Vershynin 2018 §2.5; variance of an unknown-order "
          "sum: ttrace_num.bounds.summation_variance")
ASSUMPTIONS = ("rounding errors uniform within half an ulp, mean 0, independent (round-to-nearest on "
               "non-repeating data)",
               "summation order unknown: a random-order recursive chain (the largest of the usual orders)",
               "first order in u")


def false_alarm_factor(false_alarm: float) -> float:
    """``z = sqrt(2 ln(2/false_alarm))``: the Chernoff factor of a strictly sub-Gaussian error
    (module docstring). ``false_alarm`` in (0, 1)."""
    if not isinstance(false_alarm, (int, float)) or not 0.0 < float(false_alarm) < 1.0:
        raise ValueError(f"false_alarm must be a number in (0, 1) (the per-element false-alarm rate, "
                         f"e.g. 1e-6), got {false_alarm!r}")
    return lambda_for(float(false_alarm))


@dataclass
class Statistics:
    """What one op's statistical bound is made of (elementwise, float64, broadcast to the
    output): ``var`` (``sigma^2``), ``magnitude`` (``|y|``), ``out_fmt`` (the output format
    when the result is rounded into it after the computation, else ``None``), ``values`` and
    ``formula`` for the explanation."""

    var: torch.Tensor
    magnitude: torch.Tensor
    out_fmt: FloatFormat | None
    values: dict[str, Any]
    formula: str


def _finish(st: Statistics, z: float) -> torch.Tensor:
    """``z sigma + hu_out(|y| + z sigma)`` (the output rounding linearly, module docstring)."""
    zs = z * st.var.clamp(min=0).sqrt()
    if st.out_fmt is None:
        return zs
    return zs + half_ulp(st.magnitude + zs, st.out_fmt)


def _out_rounds(final: FloatFormat, out: FloatFormat) -> FloatFormat | None:
    return None if conversion_exact(final, out) else out


# ------------------------------------------------------------------------------ matmul
#: largest ``batch x M x K x N`` product tensor for which the index-order chain's own variance
#: (:func:`_index_chain_variance`) is computed (float64: 32 MiB)
CHAIN_BUDGET = 1 << 22


def _index_chain_variance(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, accum: FloatFormat,
                          exact: bool) -> torch.Tensor | None:
    """:func:`~.summation_variance.chain_variance` of every output of ``a @ b (+ bias)`` summed
    as one chain in index order ``k = 0..K-1`` (the bias first or last: the larger), or ``None``
    above :data:`CHAIN_BUDGET` (module docstring, "Order"). With rounded products the ``+ Q``
    term of both chains counts the bias as one: its ``u^2/3 bias^2`` is taken back out."""
    a64, b64 = f64(a), f64(b)
    shape = torch.broadcast_shapes(a64.shape[:-1] + (1,), b64.shape[:-2] + (1, 1)) + (a64.shape[-1], b64.shape[-1])
    if math.prod(shape) > CHAIN_BUDGET:
        return None
    terms = a64.unsqueeze(-1) * b64.unsqueeze(-3)  # (..., M, K, N)
    var = chain_variance(terms, accum, dim=-2, exact_terms=exact)
    if bias is None:
        return var
    bias64 = f64(bias).unsqueeze(-2)
    last = chain_variance(torch.cat([terms, bias64.expand_as(terms[..., :1, :])], -2), accum, dim=-2,
                          exact_terms=exact)
    first = chain_variance(torch.cat([bias64.expand_as(terms[..., :1, :]), terms], -2), accum, dim=-2,
                           exact_terms=exact)
    return torch.maximum(last, first) - (0.0 if exact else bias64.squeeze(-2).square() * accum.u ** 2 / 3.0)


def _matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, prec: Precision,
            summation: Summation | None) -> Statistics:
    summ = summation if summation is not None else Summation(accum=prec.compute)
    q, c, n, _ = matmul_sum_statistics(a, b, bias)
    exact = products_exact(prec.storage, summ.accum)
    var = sum_variance(q, c, n, summ, exact_products=exact)
    chain = _index_chain_variance(a, b, bias, summ.accum, exact) if summ.parts(n) == 1 else None
    if chain is not None:
        var = torch.maximum(var, chain)
    return Statistics(var, c.abs(), _out_rounds(summ.final_fmt, prec.out),
                      {"K": a.shape[-1], "summation": summ.describe(), "products_exact": exact,
                       "index-order chain": chain is not None},
                      "z sqrt(max(alpha Q + beta C^2, chain: u^2/3 sum_j s_j^2 [+ Q])) + hu_out(|y| + z sigma), "
                      "Q = (A*A)(B*B), C = A B")


# ------------------------------------------------------------------------------ sum, mean
#: ATen's ``internal::GRAIN_SIZE``: a reduction to one output over at least this many elements
#: is split across threads (a tree this module does not model)
_ATEN_GRAIN_SIZE = 32768


def aten_cascade_applies(x: torch.Tensor, dims: tuple[int, ...], prec: Precision, summation: Summation | None
                         ) -> bool:
    """Whether ``torch.sum(x, dims)`` runs ATen's CPU cascade sum in the order of
    :func:`~.summation_variance.aten_cascade_sum`: no ``summation`` declared, an fp32 CPU tensor
    computed in fp32, contiguous, reduced over its last dim or over all dims (one row), and not
    split across threads (more than one output, fewer than ``GRAIN_SIZE`` elements, or one
    thread: ``TensorIterator``'s ``parallel_reduce``). Checked on this machine bit for bit under
    the ``default`` and ``avx2`` dispatches (``tests/test_statistical.py``)."""
    if summation is not None or x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous():
        return False
    if prec.compute.name != "fp32" or x.dim() == 0 or x.numel() == 0:
        return False
    whole = dims == tuple(range(x.dim()))
    if dims != (x.dim() - 1,) and not whole:
        return False
    one_output = whole or x.numel() == x.shape[-1]
    return not one_output or x.numel() < _ATEN_GRAIN_SIZE or torch.get_num_threads() == 1


def _sum(op: str, x: torch.Tensor, dim, keepdim: bool, prec: Precision, summation: Summation | None) -> Statistics:
    summ = summation if summation is not None else Summation(accum=prec.compute)
    dims = tuple(sorted(reduced_dims(op, x, dim)))
    x64 = f64(x)
    n = math.prod(x.shape[d] for d in dims) if dims else 1
    q = x64.square().sum(dims, keepdim=keepdim) if dims else x64.square()
    c = x64.sum(dims, keepdim=keepdim) if dims else x64.clone()
    tree = aten_cascade_applies(x, dims, prec, summation)
    if tree:  # the kernel's own order: the variance of its node sums (no average over orders)
        rows = x64.reshape(-1) if len(dims) > 1 else x64
        var = order_variance(rows, summ.accum).reshape(c.shape)
    else:
        var = sum_variance(q, c, n, summ, exact_products=conversion_exact(prec.storage, summ.accum))
    if op == "mean":
        c = c / n
        var = var / n**2 + half_ulp(c.abs(), summ.final_fmt) ** 2 / 3.0
    order = f"ATen CPU cascade sum, {aten_sum_lanes()} lanes" if tree else summ.describe()
    return Statistics(var, c.abs(), _out_rounds(summ.final_fmt, prec.out), {"n": n, "summation": order},
                      "z sqrt(alpha Q + beta C^2" + (")/n [+ division]" if op == "mean" else ")")
                      + " + hu_out(|y| + z sigma), Q = sum x^2, C = sum x")


# ------------------------------------------------------------------------------ softmax
@dataclass
class _SoftmaxRows:
    """Exact row quantities (rows along the last dim, float64): ``a = x - m`` (``-inf``
    masked), ``E = exp(a)``, ``S``, ``y``, ``v_tau``/``v_eps`` (relative variances of the
    subtraction and the exp), ``var_acc`` (the row sum's variance over ``S^2``), ``n``."""

    a: torch.Tensor
    E: torch.Tensor
    S: torch.Tensor
    y: torch.Tensor
    v_tau: torch.Tensor
    v_eps: torch.Tensor
    var_acc: torch.Tensor
    empty: torch.Tensor


def _softmax_rows(x64: torch.Tensor, c: FloatFormat, summ: Summation, exp_ulps: float) -> _SoftmaxRows:
    masked = x64 == -math.inf
    m = x64.amax(-1, keepdim=True)
    empty = m == -math.inf
    a = torch.where(masked | empty, torch.full_like(x64, -math.inf), x64 - torch.where(empty, 0.0, m))
    finite_a = torch.where(masked | empty, torch.zeros_like(a), a)
    exact = round_to(finite_a, c) == finite_a
    v_tau = torch.where(exact, torch.zeros_like(a), half_ulp(finite_a.abs(), c) ** 2 / 3.0)
    E = torch.exp(a)
    S = E.sum(-1, keepdim=True)
    Ssafe = torch.where(S > 0, S, torch.ones_like(S))
    y = E / Ssafe
    rel = torch.where(E > 0, 2.0 * exp_ulps * half_ulp(E, c) / torch.where(E > 0, E, torch.ones_like(E)),
                      torch.zeros_like(E))
    v_eps = rel.square() / 3.0
    n = x64.shape[-1]
    var_acc = sum_variance(E.square().sum(-1, keepdim=True), S, n, summ) / Ssafe.square()
    return _SoftmaxRows(a, E, Ssafe, y, v_tau, v_eps, var_acc, empty)


def _softmax(x: torch.Tensor, dim: int, prec: Precision, summation: Summation | None, division: str,
             exp_ulps: float) -> Statistics:
    if division not in ("reciprocal", "divide"):
        raise ValueError(f"division must be 'reciprocal' or 'divide', got {division!r}")
    c = prec.compute
    summ = summation if summation is not None else Summation(accum=c)
    r = _softmax_rows(f64(x).movedim(dim, -1), c, summ, exp_ulps)
    v = r.v_tau + r.v_eps
    W = (r.y.square() * v).sum(-1, keepdim=True)
    v_r = (half_ulp(1.0 / r.S, c) * r.S) ** 2 / 3.0 if division == "reciprocal" else torch.zeros_like(r.S)
    rel = (1 - r.y).square() * v - r.y.square() * v + W + r.var_acc + v_r
    var = r.y.square() * rel.clamp(min=0) + half_ulp(r.y, c) ** 2 / 3.0
    var = torch.where(r.empty, torch.zeros_like(var), var)
    return Statistics(var.movedim(-1, dim), r.y.movedim(-1, dim), _out_rounds(c, prec.out),
                      {"n": x.shape[dim], "summation": summ.describe(), "exp_ulps": exp_ulps, "division": division},
                      "z sqrt(y_i^2 [(1-y_i)^2 v_i - y_i^2 v_i + sum_j y_j^2 v_j + Var(acc)/S^2 + v_r] "
                      "+ hu_c(y_i)^2/3) + hu_out(.)")


def _log_softmax(x: torch.Tensor, dim: int, prec: Precision, summation: Summation | None, stats_fmt,
                 exp_ulps: float, log_ulps: float) -> Statistics:
    c = prec.compute
    st = get_format(stats_fmt) if stats_fmt is not None else prec.storage
    summ = summation if summation is not None else Summation(accum=c)
    r = _softmax_rows(f64(x).movedim(dim, -1), c, summ, exp_ulps)
    L = r.S.log()
    W = (r.y.square() * (r.v_tau + r.v_eps)).sum(-1, keepdim=True)
    var = (1 - r.y).square() * r.v_tau - r.y.square() * r.v_tau + W + r.var_acc
    var = var + (2.0 * log_ulps * half_ulp(L, c)) ** 2 / 3.0
    if not conversion_exact(c, st):
        var = var + (half_ulp(r.S, st) / r.S) ** 2 / 3.0 + half_ulp(L, st) ** 2 / 3.0
    out = torch.where(r.a == -math.inf, torch.full_like(r.a, math.inf), r.a - L)
    var = var + half_ulp(torch.where(torch.isfinite(out), out, torch.zeros_like(out)).abs(), c) ** 2 / 3.0
    var = torch.where(r.empty | (r.a == -math.inf), torch.zeros_like(var), var.clamp(min=0))
    return Statistics(var.movedim(-1, dim), out.abs().movedim(-1, dim), _out_rounds(c, prec.out),
                      {"n": x.shape[dim], "summation": summ.describe(), "stats_fmt": str(st), "exp_ulps": exp_ulps,
                       "log_ulps": log_ulps},
                      "z sqrt((1-y_i)^2 v_tau_i - y_i^2 v_tau_i + sum_j y_j^2 v_j + Var(acc)/S^2 + v_st "
                      "+ (2 log_ulps hu_c(L))^2/3 + hu_st(L)^2/3 + hu_c(|x_i - m - L|)^2/3) + hu_out(.)")


# ------------------------------------------------------------------------------ attention
def attention_scores(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool,
                     scale: float | None, enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float,
                                                                    int]:
    """``(s, blocked, add, scale, rep)``: exact scores ``scale q k^T + mask`` (float64, ``-inf``
    where blocked), the blocked mask, the additive mask (zeros if none), the scale, and the
    GQA repeat factor (``k`` is expanded by it)."""
    rep = 1
    if q.dim() >= 3 and k.dim() >= 3 and q.shape[-3] != k.shape[-3]:
        if not enable_gqa or q.shape[-3] % k.shape[-3]:
            raise ValueError(f"query has {q.shape[-3]} heads and key/value {k.shape[-3]}: pass enable_gqa=True "
                             "with query heads divisible by key/value heads")
        rep = q.shape[-3] // k.shape[-3]
    k64 = f64(k).repeat_interleave(rep, dim=-3) if rep > 1 else f64(k)
    sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    s = sc * (f64(q) @ k64.transpose(-1, -2))
    Lq, Lk = q.shape[-2], k.shape[-2]
    blocked = torch.zeros(Lq, Lk, dtype=torch.bool)
    add = torch.zeros(Lq, Lk, dtype=torch.float64)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            blocked = ~attn_mask
        else:
            a = f64(attn_mask)
            blocked = a == -math.inf
            add = torch.where(blocked, torch.zeros_like(a), a)
    if is_causal:
        blocked = blocked | torch.ones(Lq, Lk, dtype=torch.bool).triu(1)
    s = torch.where(blocked, torch.full_like(s, -math.inf), s + add)
    return s, blocked, add, sc, rep


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prec: Precision, attn_mask, is_causal: bool,
               scale, enable_gqa: bool, algorithm: str, block_size: int, p_fmt, score_fmt, exp_ulps: float
               ) -> Statistics:
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit attention")
    if algorithm not in ("standard", "online") or block_size < 1:
        raise ValueError(f"algorithm must be 'standard' or 'online' and block_size >= 1, got {algorithm!r}, "
                         f"{block_size!r}")
    c = prec.compute
    pf = get_format(p_fmt) if p_fmt is not None else prec.storage
    s, blocked, add, sc, rep = attention_scores(q, k, attn_mask, is_causal, scale, enable_gqa)
    v64 = f64(v).repeat_interleave(rep, dim=-3) if rep > 1 else f64(v)
    k64 = f64(k).repeat_interleave(rep, dim=-3) if rep > 1 else f64(k)
    q64, d, Lk = f64(q), q.shape[-1], k.shape[-2]
    # 1. score variance: the d-term GEMM (times scale^2), the scaling, an additive mask
    qk = q64 @ k64.transpose(-1, -2)
    var_s = sum_variance(q64.square() @ k64.square().transpose(-1, -2), qk, d, Summation(accum=c),
                         exact_products=products_exact(prec.storage, c)) * sc**2
    sfin = torch.where(blocked, torch.zeros_like(s), s)
    if math.frexp(sc)[0] != 0.5:
        var_s = var_s + half_ulp((sc * qk).abs(), c) ** 2 / 3.0
    masked_add = bool((add != 0).any())
    if masked_add:
        var_s = var_s + half_ulp(sfin.abs(), c) ** 2 / 3.0
    sf = get_format(score_fmt) if score_fmt is not None else c
    if not conversion_exact(c, sf):  # scores stored in sf after the product, the scaling [and the mask]
        var_s = var_s + (2 + masked_add) * half_ulp(sfin.abs(), sf) ** 2 / 3.0
    # 2. softmax: subtraction and exp (relative variances of e_j), the row sum
    rows = _softmax_rows(s, c, Summation(accum=c), exp_ulps)
    y = rows.y
    vj = torch.where(blocked, torch.zeros_like(var_s), var_s) + rows.v_tau + rows.v_eps
    E = rows.E
    vP = torch.where(E > 0, (half_ulp(E, pf) / torch.where(E > 0, E, torch.ones_like(E))) ** 2 / 3.0,
                     torch.zeros_like(E)) if not conversion_exact(c, pf) else torch.zeros_like(E)
    O = y @ v64
    y2v = y.square() * vj
    centred = (y2v @ v64.square() - 2 * O * (y2v @ v64) + O.square() * y2v.sum(-1, keepdim=True)).clamp(min=0)
    n_keys = Lk
    pv_exact = pf.precision + prec.storage.precision <= c.precision
    var_n = sum_variance(y.square() @ v64.square(), O, n_keys, Summation(accum=c), exact_products=pv_exact)
    var = centred + (y.square() * vP) @ v64.square() + var_n + O.square() * rows.var_acc
    var = var + O.square() * (half_ulp(1.0 / rows.S, c) * rows.S) ** 2 / 3.0 + half_ulp(O.abs(), c) ** 2 / 3.0
    T = math.ceil(Lk / block_size) if algorithm == "online" else 1
    if T > 1:  # T - 1 rescalings of the running numerator and row sum
        rng = (sfin.amax(-1, keepdim=True) - torch.where(blocked, sfin.amax(-1, keepdim=True), sfin).amin(-1, keepdim=True))
        v_alpha = (2.0 * exp_ulps * c.u) ** 2 / 3.0 + half_ulp(rng, c) ** 2 / 3.0
        for t in range(1, T):
            Pt = y[..., : t * block_size]
            Nt = Pt @ v64[..., : t * block_size, :]  # the earlier blocks' numerator (normalised)
            Wt = Pt.sum(-1, keepdim=True)            # and their share of the row sum
            var = var + v_alpha * (Nt - Wt * O).square() + c.u**2 / 3.0 * (Nt.square() + (Wt * O).square())
    empty = rows.empty.expand_as(var) if rows.empty.shape != var.shape else rows.empty
    var = torch.where(empty, torch.zeros_like(var), var)
    return Statistics(var, O.abs(), _out_rounds(c, prec.out),
                      {"d": d, "Lk": Lk, "scale": sc, "p_fmt": str(pf), "exp_ulps": exp_ulps,
                       "key blocks": T},
                      "z sqrt(sum_j y_j^2 (V_j - O)^2 v_j + sum_j y_j^2 V_j^2 v^P_j + Var(acc_PV) + O^2 (Var(acc_l) "
                      "+ v_r) + hu_c(O)^2/3 [+ (T-1) rescalings]) + hu_out(|O| + z sigma)")


# ------------------------------------------------------------------------------ dispatch
def _matmul_entry(a, b, *, bias=None, prec, summation=None) -> Statistics:
    return _matmul(a, b, bias, prec, summation)


def _linear_entry(x, weight, bias=None, *, prec, summation=None) -> Statistics:
    return _matmul(x, weight.transpose(-1, -2), bias, prec, summation)


def _sum_entry(x, dim=None, keepdim=False, *, prec, summation=None) -> Statistics:
    return _sum("sum", x, dim, keepdim, prec, summation)


def _mean_entry(x, dim=None, keepdim=False, *, prec, summation=None) -> Statistics:
    return _sum("mean", x, dim, keepdim, prec, summation)


def _softmax_entry(x, dim=-1, *, prec, summation=None, division="reciprocal", exp_ulps=1.0) -> Statistics:
    return _softmax(x, dim, prec, summation, division, exp_ulps)


def _log_softmax_entry(x, dim=-1, *, prec, summation=None, stats_fmt=None, exp_ulps=1.0,
                       log_ulps=1.0) -> Statistics:
    return _log_softmax(x, dim, prec, summation, stats_fmt, exp_ulps, log_ulps)


def _attention_entry(q, k, v, *, prec, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
                     algorithm="standard", block_size=128, p_fmt=None, score_fmt=None, exp_ulps=1.0) -> Statistics:
    if is_causal and attn_mask is not None:
        raise ValueError("pass either is_causal=True or attn_mask, not both (as torch's scaled_dot_product_attention)")
    return _attention(q, k, v, prec, attn_mask, is_causal, scale, enable_gqa, algorithm, block_size, p_fmt,
                      score_fmt, exp_ulps)


_ENTRIES: dict[str, Callable[..., Statistics]] = {
    "matmul": _matmul_entry, "mm": _matmul_entry, "bmm": _matmul_entry, "linear": _linear_entry,
    "sum": _sum_entry, "mean": _mean_entry, "softmax": _softmax_entry, "log_softmax": _log_softmax_entry,
    "attention": _attention_entry, "scaled_dot_product_attention": _attention_entry, "sdpa": _attention_entry,
}
#: ops (and aliases) that support ``mode="statistical"``
STATISTICAL_OPS = tuple(_ENTRIES)


def kernel_model(op: str, inputs: tuple) -> dict[str, Any]:
    """Default model keywords of ``mode="statistical"`` (and of its deterministic fallback)
    where the kernel a user runs is not the op's own default: attention takes torch's CPU
    ``scaled_dot_product_attention`` (:func:`~.attention.torch_cpu_sdpa_model`: online softmax
    over key blocks of 512, ``P`` in the input dtype, exp within 3.25 ulp), which also covers
    a manual standard attention in fp32 (no rescaling: fewer roundings)."""
    if op in ("attention", "scaled_dot_product_attention", "sdpa") and inputs and isinstance(inputs[0], torch.Tensor):
        return torch_cpu_sdpa_model(inputs[0])
    return {}


def statistical_tolerance(op: str, *inputs: torch.Tensor, fmt=None, compute_fmt=None, out_fmt=None,
                          false_alarm: float = DEFAULT_FALSE_ALARM, **op_kwargs: Any) -> Bound:
    """The ``mode="statistical"`` bound of ``op`` (module docstring), before the validity
    checks of :mod:`.validity` (which :func:`ttrace_num.tolerance` applies)."""
    if op not in _ENTRIES:
        raise ValueError(f"mode='statistical' is not supported for op {op!r}; it is for: "
                         f"{', '.join(STATISTICAL_OPS)} (use mode='probabilistic' or 'deterministic' for the others)")
    z = false_alarm_factor(false_alarm)
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs[:1]):
        raise TypeError(f"{op}: the inputs must be torch tensors")
    prec = resolve_precision(tuple(t for t in inputs if isinstance(t, torch.Tensor)), fmt, compute_fmt, out_fmt)
    try:
        st = _ENTRIES[op](*inputs, prec=prec, **{**kernel_model(op, inputs), **op_kwargs})
    except TypeError as e:
        raise TypeError(f"{op} with mode='statistical': {e}") from None
    if torch.isnan(st.var).any():
        raise ValueError(f"{op}: the inputs contain NaN or Inf; mode='statistical' needs finite inputs")
    bound = _finish(st, z)
    values = {**st.values, "z": z, "false_alarm": false_alarm, "precision": prec.describe(),
              "max sigma": float(st.var.clamp(min=0).sqrt().max()) if st.var.numel() else 0.0}
    assumptions = ASSUMPTIONS + (("result rounded to the output format: its half-ulp added linearly",)
                                 if st.out_fmt is not None else ())
    return Bound(abs=bound, mode="statistical", failure_probability=float(false_alarm), magnitude=st.magnitude,
                 explanation=Explanation(op=op, formula=st.formula, source=SOURCE, assumptions=assumptions,
                                         values=values))
