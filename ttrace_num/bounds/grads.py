r"""Backward (gradient) computations of the basic ops: linear/matmul, softmax, log_softmax,
cross entropy, layer norm, rms norm, gelu and silu.

Every bound is elementwise on ``|computed gradient - exact gradient|``. The inputs (the
upstream gradient ``g = dL/dout`` and the forward tensors: inputs, weights, and the forward
*outputs* where the backward formula uses them) are the stored values, taken as exact. The
exact gradient is the derivative of the exact operator at the stored inputs: e.g. for
``softmax_backward(y, g)`` the exact value is ``y (g - sum_j g_j y_j)`` of the stored ``y``
and ``g``; for ``layer_norm_backward`` it is the gradient of the exact layer norm (exact
mean and variance) while torch uses the forward's *saved, rounded* statistics, whose error
is part of the bound; for ``cross_entropy_backward(logits, target)`` it is
``(softmax(logits) - onehot)/N`` while torch uses the forward's *stored* ``log_softmax``.

Notation: ``s`` storage format of the inputs, ``c`` compute (opmath) format, ``o`` output
format (defaults :func:`~ttrace_num.bounds.common.resolve_precision`: ``c = fp32`` for
bf16/fp16, ``o = s``); ``u = u_c``; ``hu_f(t)`` = half an ulp of ``f`` at magnitudes
``<= t`` (:func:`~ttrace_num.formats.half_ulp`; absolute below the normal range, monotone),
the error bound of one rounding to ``f``. A rounding whose operands are exact in the
result format costs nothing; FMA contraction only removes roundings, so every bound below,
which charges each rounding that may happen, covers the contracted kernels too.
``E_sum`` denotes :func:`~ttrace_num.bounds.summation.sum_error_bound` (result left in
``c``) of a stated :class:`~ttrace_num.bounds.summation.Summation` (default recursive in
``c``: valid for any order, e.g. torch's vector lanes). Magnitudes are float64 values made
rigorous upper bounds (``gamma_{n+2}(2^-53)`` slack for float64 sums, ``1 + 2^-40`` for a
few float64 operations).

API: one registered op per gradient tensor, each returning one :class:`~.base.Bound` (so
``tn.tolerance(op, ...)`` and the bench harness treat them like any op): ``linear_backward_input``
``(g, weight)``, ``linear_backward_weight (g, x)``, ``linear_backward_bias (g)``,
``matmul_backward_a (g, b)``, ``matmul_backward_b (a, g)``, ``softmax_backward (y, g, dim)``,
``log_softmax_backward (y_log, g, dim)``, ``cross_entropy_backward (logits, target, reduction,
label_smoothing, ignore_index, grad_output)``, ``layer_norm_backward_input``/``_weight``/``_bias``
``(g, x, weight, eps)``, ``rms_norm_backward_input``/``_weight (g, x, weight, eps)``,
``gelu_backward (g, x, approximate)``, ``silu_backward (g, x)``. The multi-output ops also have
an unregistered function returning all their bounds at once (:func:`layer_norm_backward` ->
:class:`LayerNormGrads`, :func:`rms_norm_backward` -> :class:`RMSNormGrads`), as
:mod:`.attention` does for its backward.

What torch CPU does (torch 2.13, checked in ``tests/test_bounds_grads.py``): for bf16/fp16
every backward kernel below converts its inputs to fp32, computes in fp32 and rounds
**once** to the storage dtype (the emulation of :mod:`ttrace_num.emulate.grads` reproduces
the bf16/fp16 results bit for bit, except where torch's own ``erf``/``tanh`` differ from
the correctly rounded ones by an ulp), with three exceptions found there: layer norm's
``grad_weight``/``grad_bias`` are accumulated over the rows in a buffer of the *input*
dtype (a bf16 rounding per row), the forward statistics ``mean``/``rstd`` it uses are saved
in the input dtype unless the weight is fp32 ("mixed type"), and cross entropy's upstream
gradient values are ``scalar_t`` arithmetic (each scalar step rounded to the input dtype).
The composite ``rms_norm`` upcasts ``x`` to fp32, so its whole autograd runs in fp32 and the
gradient is rounded once by the cast's backward.

Linear and matmul (:func:`linear_backward_input` ... :func:`matmul_backward_b`)
-----------------------------------------------------------------------------
``grad_x = g @ W``, ``grad_W = g^T x`` (a GEMM over the flattened tokens, ``K`` = number
of tokens), ``grad_b = sum_tokens g``, ``grad_A = g @ B^T``, ``grad_B = A^T @ g``: thin
wrappers of :func:`.matmul.matmul` and :func:`.reduction.sum_` with the transposes (CPU bf16
GEMMs accumulate in fp32 and round once; ``summation=`` states another accumulation, e.g.
split-K or a tensor-parallel reduction of ``grad_W``).

softmax_backward (``y`` the stored softmax output)
----------------------------------------------------
Model (ATen ``_softmax_backward_data``, last dim or not): ``D^ = sum_j fl_c(g_j y_j)`` in
``c``; ``t_i = fl_c(g_i - D^)``; ``p_i = fl_c(t_i y_i)``; ``fl_o(p_i)``. Exact:
``y_i (g_i - D)``, ``D = sum_j g_j y_j``. With ``E_D = E_sum(S = sum_j |g_j y_j|, |D|, n)``
(one more level for the products when ``2 p_s > p_c``)::

    |t_i - (g_i - D)| <= dt_i := E_D + hu_c(|g_i - D| + E_D)
    |err_i| <= y_i dt_i + hu_c(y_i (|g_i - D| + dt_i)) + hu_o(y_i |g_i - D| + ..)

(the product of exact ``y_i`` and ``t_i``: ``|t_i y_i - y_i(g_i - D)| = y_i |t_i - (g_i - D)|``).
This is the dot-product analysis of Higham (2002) §3.1 followed by two rounded elementwise
operations; the cancellation in ``g_i - D`` (e.g. ``g`` constant along the row, where the
exact gradient is ``c y_i (1 - sum y)``, tiny) is absorbed by the absolute ``E_D``: the
computed gradient there is pure rounding noise of size ``y_i u S`` and the bound says so.
The same structure is the softmax part of the attention backward in Blanchard, Higham &
Mary (2021)-style analyses (``dS = P (dP - D)``; :mod:`.attention`).

log_softmax_backward (``y_log`` the stored log_softmax output)
----------------------------------------------------------------
Model (ATen, ``x - exp(y) * sum`` in the vectorised kernel): ``s^ = sum_j g_j`` in ``c``,
``e_i = EXP(y_log_i)`` with ``|EXP(t) - e^t| <= c_exp e^t + eta``, ``c_exp = 2 exp_ulps u``
(``exp_ulps = 1``: SLEEF ``expf_u10``, the constant of :mod:`.softmax`; ``eta`` one
subnormal ulp below the normal range); ``q_i = fl_c(e_i s^)``; ``fl_o(fl_c(g_i - q_i))``.
Exact: ``g_i - E_i s``, ``E_i = exp(y_log_i)``, ``s = sum g``. With ``E_s = E_sum(sum|g|, |s|, n)``
and ``de_i = c_exp E_i + eta`` (plus ``E_i expm1(h_i)`` if ``y_log`` is not exact in ``c``)::

    |q_i - E_i s| <= dq_i := de_i (|s| + E_s) + E_i E_s + hu_c(E_i |s| + ..)
    |err_i| <= dq_i + hu_c(|g_i - E_i s| + dq_i) + hu_o(|g_i - E_i s| + ..)

cross_entropy_backward (logits, class-index targets, no class weights)
------------------------------------------------------------------------
torch's autograd of ``F.cross_entropy`` (``log_softmax`` -> ``nll_loss``; with label
smoothing ``eps`` also ``-(lp.sum(1))`` reduced and combined as ``(1-eps) nll + (eps/C)
smooth``), traced from the autograd graph and ATen (``LossNLL.cpp``):

1. ``lp^`` = the forward's stored log_softmax (storage format), within ``b_lp`` of
   ``lp = log softmax(x)``: the :func:`.softmax.log_softmax` bound.
2. The upstream gradient of ``lp``: ``go`` (the loss's stored gradient, default 1),
   ``a = fl_s(fl_c(go fl_c(1 - eps)))`` (``MulBackward`` by a Python scalar; ``a = go`` when
   ``eps = 0``), ``w = -fl_s(a / fl_s(N))`` (``nll_loss_backward``: ``scalar_t`` arithmetic,
   ``total_weight = N`` non-ignored rows stored in ``s``; ``w = -a`` for ``"sum"``) at the
   target; with smoothing ``b = -fl_s(fl_s(fl_c(go fl_c(eps/C))) / fl_s(N))`` everywhere
   (``DivBackward`` by the int64 count, cast to ``s``) and the two gradients accumulated
   at the target, ``G_t = fl_s(fl_c(w + b))``. Ignored rows: ``G = 0``, gradient exactly 0.
   Each of these scalar steps is bounded by its roundings (``hu_c`` then ``hu_s``; the
   constants ``1 - eps``, ``eps/C`` within ``hu_s`` of their value, valid whether torch
   rounds them to ``c`` or to ``s``): ``|G^_j - G*_j| <= dG_j``, ``G* = -go((1-eps) onehot +
   eps/C)/N``.
3. ``log_softmax_backward(lp^, G^)`` as above, with inexact inputs: ``S^ = sum_j G^_j`` in
   ``c``, ``|S^ - S*| <= dS := sum_j dG_j + E_sum(sum_j (|G*_j| + dG_j), |S*| + .., C)``,
   ``S* = -go/N``; ``EXP(lp^_j)``: ``|EXP(lp^_j) - p_j| <= de_j := p_j (expm1(b_lp_j) + c_exp
   e^{b_lp_j}) + eta`` (``exp(lp^) = p exp(lp^ - lp)``); then
   ``|q_j - p_j S*| <= de_j (|S*| + dS) + p_j dS + hu_c(.)`` and
   ``|err_j| <= dG_j + dq_j + hu_c(|grad*_j| + ..) + hu_s(|grad*_j| + ..)`` with
   ``grad*_j = go (p_j - (1-eps)[j=t] - eps/C)/N``.

For bf16 logits the term ``p_j b_lp_j`` (the forward's stored ``lp`` rounded to bf16:
``b_lp ~ hu_bf16(|lp|)``, up to ``2^-5`` for ``|lp| ~ 8``) dominates: torch's gradient of a
bf16 cross entropy carries the bf16 rounding of log-probabilities, not only of the result.

layer_norm_backward (ops ``layer_norm_backward_input``/``_weight``/``_bias``)
------------------------------------------------------------------------------
torch CPU (``LayerNormBackwardKernelImplInternal``, ``layer_norm_kernel.cpp``): with the
saved ``m^ = fl_st(mu^)`` and ``a = fl_st(r^)`` (``mu^`` and ``r^ = fl(1/fl(sqrt(fl(v^ + eps))))``
from the forward's ``RowwiseMoments`` in ``c``, :mod:`.norms`; ``st`` = the statistics format:
fp32 when the weight is fp32 with bf16/fp16 input, else the input dtype), per row::

    ds^ = sum_j fl(fl(g_j x_j) w_j),  db^ = sum_j fl(g_j w_j)                    (in c)
    b^ = fl(fl(fl(fl(fl(fl(db^ m^) - ds^) a) a) a) fl(1/N))
    c0 = fl(fl(-b^ m^) - fl(fl(db^ a) fl(1/N)))
    dx_j = fl_o(fl(fl(fl(fl(a g_j) w_j) + fl(b^ x_j)) + c0))

Exact (``d_j = x_j - mu``, ``r = (v + eps)^{-1/2}``, ``P = sum_j g_j w_j d_j``):
``dx*_j = r g_j w_j + B* x_j + C*`` with ``B* = (db* mu - ds*) r^3/N = -P r^3/N``,
``C* = -B* mu - db* r/N``; indeed ``r (gw - mean(gw) - z mean(gw z))`` (Ba, Kiros & Hinton
2016) expands to this. Errors: the statistics ``|m^ - mu| <= E_m`` (``E_mu`` of
:func:`.norms.moment_errors` plus the rounding to ``st``), ``|a - r| <= E_a = r rho + hu_st(r (1 +
rho))`` with ``rho = sqrt(W / max(eps^, W - dW)) (1+u)/(1-u) - 1`` the relative error of
``r^`` (``W = v + eps``, ``dW`` the error of ``fl(v^ + eps^)``; the computed variance is >= 0,
so ``W^ >= eps^``: the bound of :mod:`.norms` §2, restated); ``E_ds``, ``E_db`` = ``E_sum`` with
one or two rounding levels per term. Then, step by step (``F = (1 + E_a/r)^3 (1 + sigma)``,
``sigma = |fl(1/N) N - 1|``):

* ``K^ = fl(fl(db^ m^) - ds^)`` vs ``K* = db* mu - ds* = -P``:
  ``E_K = E_db |m^| + |db*| E_m + E_ds + hu_c(|db^ m^|) + hu_c(|K*| + ..)``: the
  cancellation of the folded formula (``ds*`` and ``db* mu`` are both ``~ N |mu| |gw|``)
  enters through ``E_ds`` and ``E_db |mu|``, relative to ``u sum|g w x|``, not to ``|P|``;
* ``|b^ - B*| <= E_b := (E_K F + |K*|(F - 1) + ((1+u)^4 - 1)(|K*| + E_K) F) r^3/N`` (+ underflow);
* the exact identity ``(b^ x_j + c0) - (B* x_j + C*) = (b^ - B*) d_j - b^ (m^ - mu) -
  (db^ a fl(1/N) - db* r/N) + rho_c`` (``rho_c`` the three roundings inside ``c0``) shows
  that ``b^``'s error is multiplied by ``|d_j|``, not by ``|x_j|``: with ``E_v = E_db r (1 +
  E_a/r)(1 + sigma)/N + |db*| r ((1 + E_a/r)(1 + sigma) - 1)/N``::

      |dx^_j - dx*_j| <= |g_j w_j| E_a + E_b |d_j| + |b^| E_m + E_v + |rho_c|
                         + [roundings of a g, * w, b^ x_j, the two additions] + hu_o(..)

  The ``1/sigma`` amplification: ``E_b |d_j| ~ E_K r^2 |z_j| / N`` and ``|b^| E_m ~ |P| r^3 E_m / N``;
  for a near-constant row ``r`` is capped by ``eps^{-1/2}`` and these terms are large:
  the bound is large where torch's gradient really is inaccurate. The saved statistics
  matter: for bf16 rows with ``|mu| >> sigma`` the bf16 rounding of ``mean`` (``|b^| E_m``)
  dominates, and the same bound computed as if they were saved in fp32 is violated by
  torch (tests).

``grad_weight_j = sum_rows g_ij z^_ij``, ``z^ = fl(fl(a x) + fl(-a m^))`` (the kernel's
``dy * (a x + b)``), ``|z^ - z| <= E_a |d| + a E_m`` (statistics: fixed) ``+ hu_c(a |m^|) +
hu_c(a |x|) + hu_c(|z| + ..)`` (roundings), ``|t^ - g z| <= |g| dz + hu_c(|g z| + ..)``;
accumulated over the rows per thread in a buffer of the input dtype (each step
``fl_s(fl_c(buf + t))``: a chain of ``ceil(M/T)`` rows per thread, ``T`` = intra-op threads),
then the ``T`` buffers summed in ``c`` and stored in ``st``: the Summation
``(accum=s, split=T, reduce_fmt=c, recursive)`` with the extra ``c`` rounding of every chain
step as ``leaf_depths`` (the bound depends on the per-path rounding counts only) and the
terms rounded into ``s``. ``grad_bias`` the same over ``g`` (exact terms). bf16 chains of
``M/T`` rows make these gradients loose in absolute terms (``~ lambda sqrt(M/T) u_bf16 sum|g z|``):
that is torch's real accuracy, which the bound reports; ``param_summation=`` states another
reduction (a GPU kernel, fp32 buffers).

rms_norm_backward (ops ``rms_norm_backward_input``/``_weight``)
-----------------------------------------------------------------
torch CPU ``rms_norm`` is a composite: ``xf = x.float()`` (bf16/fp16), ``r^ = rsqrt(fl(fl(
fl(sum fl(xf^2)) / N) + eps))`` (``RSQRT`` within ``rsqrt_rel u``, :data:`.activations.TORCH_CPU`),
``y = cast(fl(fl(xf r^) w))``. Its autograd (``MulBackward0``, ``RsqrtBackward0 = -0.5 grad
r^3``, ``MeanBackward1 = grad / N``, ``PowBackward0 = grad * 2x``, accumulation of the two
paths into ``xf``, cast)::

    A_j = fl(fl(g_j w_j) r^);  R^ = sum_j fl(fl(g_j w_j) x_j)                    (in c)
    r3 = fl(fl(r^ r^) r^);  m1 = fl(-0.5 R^ r3);  m2 = fl(m1 / N)
    dx_j = fl_o(fl(A_j + fl(m2 (2 x_j))))

Exact: ``dx*_j = r g_j w_j - r^3 x_j Q*/N``, ``Q* = sum g w x``. With ``rho`` the relative
error of ``r^`` (:mod:`.norms`' rms statistics: ``E_ms = E_sum`` of the squares plus the
division, ``rho = sqrt(W / max(eps^, W - dW))(1 + rsqrt_rel u) - 1``), ``rho3 = (1+rho)^3 (1+u)^2 - 1``::

    dA_j = |g_j w_j| r rho + hu_c(..)
    dm1 = (E_Q r^3 (1 + rho3) + |Q*| r^3 rho3)/2 + hu_c(.),   dm2 = dm1/N + hu_c(.)
    |err_j| <= dA_j + 2|x_j| dm2 + hu_c(2|x_j||m2|) + hu_c(|dx*_j| + ..) + hu_o(|dx*_j| + ..)

``grad_weight_j = cast(sum_rows fl(g z^))``, ``z^ = fl(x r^)`` the forward's saved product:
``|z^ - z| <= |x| r rho + hu_c(|x| r (1 + rho))``; the row sum (torch's ``sum_to_size``, order
unknown) is ``E_sum`` in ``c`` under ``param_summation``, then rounded to the weight's format.

gelu_backward, silu_backward
------------------------------
ATen ``GeluBackwardKernelImpl`` (bf16/fp16: converted to fp32, rounded once)::

    erf:  cdf = 0.5 fl(1 + ERF(fl(x alpha^))),  pdf = fl(beta^ EXP(fl(fl(x x) (-0.5))))
          d = fl(cdf + fl(x pdf)),  res = fl_o(fl(g d))
    tanh: u^ = fl(beta^ fl(x + fl(kappa^ fl(fl(x x) x)))),  th = TANH(u^)
          d = fl(0.5 fl(1 + th) + fl(fl(fl(0.5 x) fl(1 - fl(th th))) fl(beta^ fl(1 + fl(fl(3 kappa^) fl(x x))))))

silu (``silu_backward_kernel``): ``s = fl(1 / fl(1 + EXP(-x)))``,
``res = fl_o(fl(fl(g s) fl(1 + fl(x fl(1 - s)))))``. Each step is bounded by propagation
(mean value theorem for ``erf``, ``exp``, ``tanh``, ``1/d``: the derivative's largest value
on the uncertainty interval; all-positive products and sums as relative errors
``(1+u)^k - 1``) plus ``hu_c`` of each rounding and the library errors ``|ERF - erf| <= A_erf u``,
``|TANH - tanh| <= A_tanh u`` (absolute), ``|EXP(t) - e^t| <= R_exp u e^t + eta``: the constants
of :class:`.activations.LibraryErrors`, default :data:`.activations.TORCH_CPU` for fp32
compute, :data:`.activations.CORRECTLY_ROUNDED` otherwise. The constants ``alpha^ = fl_c(1/sqrt 2)``,
``beta^`` (erf: ``1/sqrt(2 pi)``, both torch's fp32 and reduced-type evaluations bounded),
``kappa^ = fl_c(0.044715)``, ``fl_c(3 kappa^)`` are charged with their exact errors. gelu' has a
zero at ``x = -0.75`` and silu' at ``x = -1.28``: there the bound is absolute (cancellation
of ``cdf + x pdf``, ``1 + x(1 - s)``); in the tails ``TANH = +-1`` exactly while the model
allows ``A_tanh u`` and ``1 - th^2`` amplifies it by ``|x|^3``: loose in ratio for ``|x| > 4``.

Probabilistic mode
------------------
Sums are the only place where many independent roundings average: ``E_sum`` uses its
Azuma-Hoeffding form (Higham & Mary 2019; :mod:`.summation`), and the rounding terms of the
``M`` rows entering ``grad_weight`` are a martingale (``min(sum b_i, lambda sqrt(sum b_i^2))``).
Statistics errors (the forward's saved ``mean``/``rstd``), library errors, constants and the
few elementwise roundings of one output element stay deterministic. Each output element
uses ``k`` probabilistic events (e.g. layer norm ``grad_x``: the row's moments, ``ds``, ``db``),
each given ``failure_probability / k`` (union bound; a row statistics event used by all
``M`` rows of a ``grad_weight`` column is given ``p/(k M)``). gelu/silu: no sum, so the
probabilistic bound equals the deterministic one.

Tightness (median over instances of ``min_i bound_i/err_i``, torch CPU, random normal data,
probabilistic mode, ``bench/cases/grads.py``): bf16/fp16 outputs 1.0-1.3 for every op except
layer norm's ``grad_weight``/``grad_bias`` (~3-4: the bound sums the worst cases of the chain's
bf16 roundings, ``sqrt`` of their count with Azuma, while a short chain's actual error is a few
of them) and cross entropy with label smoothing (~1.5-2.3); fp32: log_softmax backward ~1.2,
cross entropy ~1.5-3.7, gelu/silu ~1.8 (the measured library constants are nearly attained),
and ~10-20 for the ops with a row or column sum (softmax backward, layer/rms norm, and the
matmul/sum wrappers ~6-60): the sum's error is charged at ``lambda sqrt(n) u sum|terms|``
(``n u`` deterministic) for *any* order and shared by the whole row, while the element with
the largest observed error is limited by its own 2-3 roundings (the trade-off of
:mod:`.matmul`'s docstring; state the kernel's real tree with ``summation=`` when known).

Sources: Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed. (2002) §2.2
(rounding model, Thm 2.2), §3.1 (error propagation, Lemma 3.1), §4.2 (summation); Higham &
Mary, SISC 41(5) 2019, Connolly, Higham & Mary, SISC 43(1) 2021 (probabilistic model);
Blanchard, Higham & Mary, IMA J. Numer. Anal. 41(4) 2021 (softmax / log-sum-exp);
Chan, Golub & LeVeque (1983) (moments); Ba, Kiros & Hinton, "Layer Normalization" (2016)
(gradient formula); torch ATen ``SoftMaxKernel.cpp``, ``LossNLL.cpp``, ``layer_norm_kernel.cpp``,
``Activation.cpp`` and ``derivatives.yaml`` (the computation models).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import NamedTuple

import torch

from ..formats import FloatFormat, get_format
from ..rounding import round_to
from .activations import LibraryErrors, hu, inflate, resolve_library
from .base import Bound, Explanation, lambda_for
from .common import ModeSpec, Precision, f64, register, resolve_mode, resolve_precision
from .matmul import matmul
from .norms import TorchCPULayout, moment_errors
from .reduction import sum_ as reduction_sum
from .softmax import log_softmax as log_softmax_bound
from .summation import (
    Summation,
    conversion_exact,
    output_rounding,
    products_exact,
    sum_error_bound,
)

__all__ = [
    "LayerNormGrads",
    "RMSNormGrads",
    "cross_entropy_backward",
    "gelu_backward",
    "layer_norm_backward",
    "layer_norm_backward_bias",
    "layer_norm_backward_input",
    "layer_norm_backward_weight",
    "layer_norm_param_summation",
    "linear_backward_bias",
    "linear_backward_input",
    "linear_backward_weight",
    "log_softmax_backward",
    "matmul_backward_a",
    "matmul_backward_b",
    "rms_norm_backward",
    "rms_norm_backward_input",
    "rms_norm_backward_weight",
    "silu_backward",
    "softmax_backward",
]

SOURCE = ("Higham (2002) §2.2, §3.1, §4.2; Higham & Mary SISC 2019, Connolly, Higham & Mary SISC 2021 "
          "(probabilistic); Blanchard, Higham & Mary IMA JNA 2021 (softmax); torch ATen backward kernels")

_U53 = 2.0 ** -53


# ============================================================================ helpers
def _gam(n: int) -> float:
    """``gamma_{n+2}(2^-53)``: relative slack of an ``n``-term float64 sum (any order) and
    one or two further float64 operations on it."""
    k = (n + 2) * _U53
    return k / (1.0 - k)


def _slack(n: int) -> float:
    """Relative slack covering the float64 evaluation of a magnitude built from an ``n``-term
    sum and a few further operations (including the ``1 + 2^-40`` inflations)."""
    return max(2.0 ** -36, 8 * _gam(n))


def _sum64(t: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(value, |value| upper, sum|t| upper)`` of a float64 sum along ``dim`` (keepdim)."""
    g = _gam(t.shape[dim])
    S = t.abs().sum(dim, keepdim=True) * (1 + g)
    v = t.sum(dim, keepdim=True)
    return v, v.abs() + g * S, S


def _e_sum(S: torch.Tensor, mag: torch.Tensor, n: int, summ: Summation, c: FloatFormat, ms: ModeSpec,
           lam: float, exact_products: bool = True, leaf: int = 0) -> torch.Tensor:
    """``E_sum``: bound on a sum of ``n`` exact terms computed under ``summ`` and left in ``c``
    (``leaf`` rounding levels applied to each term first); ``inf`` where it may overflow."""
    b, _ = sum_error_bound(S, mag, n, summ, c, ms.mode, lam, exact_products,
                           leaf_depths={c: leaf} if leaf else None)
    return torch.where(S * (1 + 2 * n * c.u) >= c.max, torch.full_like(b, math.inf), b)


def _const_err(value: float | Fraction, f: FloatFormat) -> tuple[float, float]:
    """``(fl_f(value), bound on |fl_f(value) - value|)``; a float64 ``value`` stands for a real
    constant within ``2^-52`` relative of it (added)."""
    vf = float(round_to(torch.tensor(float(value), dtype=torch.float64), f))
    if isinstance(value, Fraction):
        return vf, float(abs(Fraction(vf) - value)) * (1 + 2.0 ** -50)
    return vf, abs(vf - float(value)) + abs(float(value)) * 2.0 ** -52


def _out(mag: torch.Tensor, err: torch.Tensor, c: FloatFormat, o: FloatFormat) -> torch.Tensor:
    """``err + hu_o(|exact| + err)``: the final rounding ``c -> o`` (0 when exact)."""
    return err + output_rounding(mag + err, c, o)


def _finite(b: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """``inf`` where an input is not finite or the bound is NaN (no finite claim)."""
    bad = torch.isnan(b)
    for t in inputs:
        bad = bad | ~torch.isfinite(torch.broadcast_to(t, b.shape))
    return torch.where(bad, torch.full_like(b, math.inf), b)


def _sub_mode(ms: ModeSpec, events: float) -> ModeSpec:
    if ms.mode == "deterministic":
        return ms
    p = ms.failure_probability / events
    return ModeSpec(ms.mode, p, lambda_for(p))


def _bound(abs_: torch.Tensor, ms: ModeSpec, op: str, formula: str, prec: Precision | None,
           mag: torch.Tensor | None, assumptions: Sequence[str] = (), values: dict | None = None,
           terms: tuple[Explanation, ...] = ()) -> Bound:
    vals = dict(values or {})
    if prec is not None:
        vals["precision"] = prec.describe()
    if ms.mode == "probabilistic":
        vals["lambda"] = ms.lam
    return Bound(abs=abs_, mode=ms.mode, failure_probability=ms.failure_probability, magnitude=mag,
                 explanation=Explanation(op=op, formula=formula, source=SOURCE, assumptions=tuple(assumptions),
                                         values=vals, terms=terms))


def _wrap(inner: Bound, op: str, formula: str) -> Bound:
    """A matmul/sum bound relabelled as the gradient it bounds."""
    return Bound(abs=inner.abs, mode=inner.mode, failure_probability=inner.failure_probability,
                 magnitude=inner.magnitude,
                 explanation=Explanation(op=op, formula=formula, source=inner.explanation.source,
                                         terms=(inner.explanation,)))


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


# ============================================================================ linear / matmul
@register("linear_backward_input")
def linear_backward_input(g: torch.Tensor, weight: torch.Tensor, **kw) -> Bound:
    """Bound on ``grad_x = g @ W`` (``W`` of shape ``(out, in)``): :func:`.matmul.matmul`; keywords
    as there (``summation=``, ``fmt=``, ``mode=``...)."""
    return _wrap(matmul(g, weight, **kw), "linear_backward_input", "grad_x = g @ W: matmul bound")


@register("linear_backward_weight")
def linear_backward_weight(g: torch.Tensor, x: torch.Tensor, **kw) -> Bound:
    """Bound on ``grad_W = g^T x`` summed over every leading dim (a GEMM with ``K`` = number of
    tokens): :func:`.matmul.matmul` of the flattened ``g^T`` and ``x``."""
    return _wrap(matmul(_flat(g).transpose(0, 1), _flat(x), **kw), "linear_backward_weight",
                 "grad_W = g^T x over the flattened tokens: matmul bound")


@register("linear_backward_bias")
def linear_backward_bias(g: torch.Tensor, **kw) -> Bound:
    """Bound on ``grad_b = sum of g over every leading dim``: :func:`.reduction.sum_`."""
    return _wrap(reduction_sum(_flat(g), 0, **kw), "linear_backward_bias", "grad_b = sum_tokens g: sum bound")


@register("matmul_backward_a")
def matmul_backward_a(g: torch.Tensor, b: torch.Tensor, **kw) -> Bound:
    """Bound on ``grad_A = g @ B^T`` of ``A @ B`` (batched, no broadcasting of ``B``)."""
    return _wrap(matmul(g, b.transpose(-1, -2), **kw), "matmul_backward_a", "grad_A = g @ B^T: matmul bound")


@register("matmul_backward_b")
def matmul_backward_b(a: torch.Tensor, g: torch.Tensor, **kw) -> Bound:
    """Bound on ``grad_B = A^T @ g`` of ``A @ B`` (batched; a 2-D ``B`` shared by a batched ``A``
    is :func:`linear_backward_weight`)."""
    return _wrap(matmul(a.transpose(-1, -2), g, **kw), "matmul_backward_b", "grad_B = A^T @ g: matmul bound")


# ============================================================================ softmax family
def _prec_mode(inputs: tuple[torch.Tensor, ...], fmt, compute_fmt, out_fmt, mode, failure_probability,
               summation: Summation | None) -> tuple[Precision, ModeSpec, Summation]:
    prec = resolve_precision(inputs, fmt, compute_fmt, out_fmt)
    ms = resolve_mode(mode, failure_probability)
    return prec, ms, summation if summation is not None else Summation(accum=prec.compute)


def _normalized_size(x: torch.Tensor, normalized_shape) -> tuple[tuple[int, ...], int]:
    """``(normalized_shape, n)`` of a norm over the trailing dims (default: the last), ``n``
    the number of elements each row normalises."""
    if normalized_shape is None:
        normalized_shape = (x.shape[-1],)
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    return tuple(normalized_shape), math.prod(normalized_shape)


@register("softmax_backward")
def softmax_backward(y: torch.Tensor, g: torch.Tensor, dim: int = -1, *, summation: Summation | None = None,
                     fmt=None, compute_fmt=None, out_fmt=None, mode: str = "deterministic",
                     failure_probability: float | None = None) -> Bound:
    """Bound on the computed ``y * (g - sum(g * y, dim))`` (``y`` the stored softmax output);
    module docstring. ``summation``: the row dot product's model (default recursive in ``c``)."""
    prec, ms, summ = _prec_mode((y, g), fmt, compute_fmt, out_fmt, mode, failure_probability, summation)
    c = prec.compute
    y64, g64 = f64(y).movedim(dim, -1), f64(g).movedim(dim, -1)
    n = y64.shape[-1]
    D, Dm, S = _sum64(g64 * y64)
    E_D = _e_sum(S, Dm, n, summ, c, ms, ms.lam, products_exact(prec.storage, c))
    A = (g64 - D).abs() + _gam(n) * (S + g64.abs())  # >= |g_i - D|
    ay = y64.abs()
    dt = E_D + hu(A + E_D, c)
    err = _out(ay * A, ay * dt + hu(ay * (A + dt), c), c, prec.out)
    err = _finite(err, y64, g64).movedim(-1, dim)
    return _bound(err, ms, "softmax_backward",
                  "|err_i| <= y_i dt_i + hu_c(y_i(|g_i - D| + dt_i)) + hu_o(..), dt_i = E_D + hu_c(|g_i - D| + E_D), "
                  "E_D = sum bound of D = sum_j g_j y_j", prec, (ay * A).movedim(-1, dim),
                  (f"row sum: {summ.describe()}", "y, g exact as stored"), {"n": n})


def _exp_terms(yl: torch.Tensor, c: FloatFormat, exp_ulps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(E upper, de)``: ``E = exp(y_log)`` and ``|EXP(fl_c(y_log)) - E| <= de``."""
    E = inflate(torch.exp(yl))
    h = torch.where(round_to(yl, c) == yl, torch.zeros_like(yl), hu(yl.abs(), c))
    cexp = 2.0 * exp_ulps * c.u
    de = E * (torch.expm1(h) + cexp * torch.exp(h)) + 2.0 * c.subnormal_abs_error
    return E, de


@register("log_softmax_backward")
def log_softmax_backward(y_log: torch.Tensor, g: torch.Tensor, dim: int = -1, *,
                         summation: Summation | None = None, exp_ulps: float = 1.0, fmt=None, compute_fmt=None,
                         out_fmt=None, mode: str = "deterministic", failure_probability: float | None = None) -> Bound:
    """Bound on the computed ``g - exp(y_log) * sum(g, dim)`` (``y_log`` the stored log_softmax
    output); ``exp_ulps``: accuracy of the kernel's ``exp`` (as :mod:`.softmax`)."""
    prec, ms, summ = _prec_mode((y_log, g), fmt, compute_fmt, out_fmt, mode, failure_probability, summation)
    c = prec.compute
    yl, g64 = f64(y_log).movedim(dim, -1), f64(g).movedim(dim, -1)
    n = yl.shape[-1]
    s, sm, S = _sum64(g64)
    E_s = _e_sum(S, sm, n, summ, c, ms, ms.lam, conversion_exact(prec.storage, c))
    E, de = _exp_terms(yl, c, exp_ulps)
    dq = de * (sm + E_s) + E * E_s
    dq = dq + hu(E * sm + dq, c)
    R = (g64 - E * s).abs() + 4 * _gam(n) * (g64.abs() + E * S)  # >= |g_i - E_i s|
    err = _out(R, dq + hu(R + dq, c), c, prec.out)
    err = _finite(err, torch.where(yl == -math.inf, 0.0, yl), g64).movedim(-1, dim)  # -inf: masked, exp = 0
    return _bound(err, ms, "log_softmax_backward",
                  "|err_i| <= dq_i + hu_c(|g_i - E_i s| + dq_i) + hu_o(..), dq_i = de_i(|s| + E_s) + E_i E_s + hu_c(E_i|s| + ..), "
                  "de_i = 2 exp_ulps u E_i + eta", prec, R.movedim(-1, dim),
                  (f"row sum: {summ.describe()}", f"exp within {exp_ulps:g} ulp (SLEEF expf_u10)"), {"n": n})


def _scalar_step(mag: float, err: float, prec: Precision) -> float:
    """Error after one ``scalar_t`` op of a value of magnitude ``<= mag`` carrying ``err``:
    computed in ``c`` then stored in ``s``."""
    t = torch.tensor(mag + err, dtype=torch.float64)
    r1 = float(hu(t, prec.compute))
    return err + r1 + float(output_rounding(t + r1, prec.compute, prec.storage))


def _ce_upstream(go: float, n_keep: int, C: int, reduction: str, eps: float, prec: Precision
                 ) -> tuple[float, float, float, float]:
    """``(w*, dw, b*, db)``: the exact upstream gradients of ``lp`` at the target (``-w*``
    from nll) and everywhere (``-b*`` from the smoothing term) and bounds on the computed ones
    (module docstring, cross entropy step 2); ``b* = db = 0`` without smoothing."""
    s = prec.storage
    N = float(n_keep) if reduction == "mean" else 1.0
    Nh = float(round_to(torch.tensor(N, dtype=torch.float64), s))

    def scaled(kappa: float) -> tuple[float, float]:
        ex = abs(go) * kappa
        if kappa == 1.0:
            val, err = ex, 0.0
        else:
            dk = float(hu(torch.tensor(kappa, dtype=torch.float64), s)) + kappa * 2.0 ** -52  # fl_c or fl_s
            val, err = ex, _scalar_step(ex, abs(go) * dk, prec)
        if reduction == "mean":
            q = val / N
            err = _scalar_step(q, err / Nh + val * abs(1.0 / Nh - 1.0 / N), prec)
            val = q
        return val, err

    w, dw = scaled(1.0 - eps)
    if not eps:
        return w, dw, 0.0, 0.0
    b, db = scaled(eps / C)
    return w, dw, b, db


@register("cross_entropy_backward")
def cross_entropy_backward(logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean",
                           label_smoothing: float = 0.0, ignore_index: int = -100, grad_output: float = 1.0, *,
                           summation: Summation | None = None, stats_fmt=None, exp_ulps: float = 1.0,
                           log_ulps: float = 1.0, fmt=None, compute_fmt=None, mode: str = "deterministic",
                           failure_probability: float | None = None) -> Bound:
    """Bound on torch's ``d F.cross_entropy(logits, target, reduction, label_smoothing) / d logits``
    (logits ``(N, C)``, class-index targets, no class weights; ``grad_output``: the loss's
    upstream gradient, e.g. a loss scale, stored in the logits' dtype). ``summation``/
    ``stats_fmt``/``exp_ulps``/``log_ulps``: the forward log_softmax's model (:func:`.softmax.log_softmax`)
    and the class sum of the backward. Module docstring."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum' (a scalar loss), not {reduction!r}")
    if logits.dim() != 2:
        raise ValueError("cross_entropy_backward expects logits of shape (N, C)")
    prec, ms, summ = _prec_mode((logits,), fmt, compute_fmt, None, mode, failure_probability, summation)
    c, s = prec.compute, prec.storage
    N_rows, C = logits.shape
    tgt = target.reshape(-1).to(torch.int64)
    keep = tgt != ignore_index
    n_keep = int(keep.sum())
    eps = float(label_smoothing)
    go = float(round_to(torch.tensor(float(grad_output), dtype=torch.float64), s))
    # two probabilistic events per element: the forward log_softmax bound and the class sum
    ms2 = _sub_mode(ms, 2)
    b_lp = log_softmax_bound(logits, -1, fmt=s, compute_fmt=c, out_fmt=s, summation=summation, stats_fmt=stats_fmt,
                             exp_ulps=exp_ulps, log_ulps=log_ulps, mode=ms.mode,
                             failure_probability=ms2.failure_probability if ms.mode == "probabilistic" else None).abs
    x64 = f64(logits)
    fin = torch.where(torch.isfinite(x64), x64, torch.zeros_like(x64))
    rel64 = (C + 8 + 4 * float(fin.abs().max()) if fin.numel() else 0.0) * 2.0 ** -52  # float64 log_softmax
    p = torch.exp(torch.log_softmax(x64, -1)) * (1 + rel64)  # upper bound on softmax(x)
    w, dw, b, db = _ce_upstream(go, max(n_keep, 1), C, reduction, eps, prec)
    onehot = torch.zeros_like(x64, dtype=torch.bool)
    onehot[torch.arange(N_rows), torch.where(keep, tgt, torch.zeros_like(tgt))] = True
    Gm = torch.where(onehot, torch.tensor(w + b, dtype=torch.float64), torch.tensor(b, dtype=torch.float64))
    if eps:
        dGt = _scalar_step(w + b, dw + db, prec)
        dG = torch.where(onehot, torch.tensor(dGt, dtype=torch.float64), torch.tensor(db, dtype=torch.float64))
    else:
        dG = torch.where(onehot, torch.tensor(dw, dtype=torch.float64), torch.zeros((), dtype=torch.float64))
    Sstar = abs(go) / (max(n_keep, 1) if reduction == "mean" else 1.0)  # |sum_j G*_j|
    sdG = dG.sum(-1, keepdim=True)
    E_S = _e_sum((Gm + dG).sum(-1, keepdim=True), Sstar + sdG, C, summ, c, ms2, ms2.lam)
    dS = sdG + E_S
    cexp = 2.0 * exp_ulps * c.u
    de = p * (torch.expm1(b_lp) + cexp * torch.exp(b_lp)) + 2.0 * c.subnormal_abs_error
    dq = de * (Sstar + dS) + p * dS
    dq = dq + hu(p * Sstar + dq, c)
    # |exact gradient| = |go| |p_j - (1-eps)[j=t] - eps/C| / N (float64, with its slack)
    kap = torch.where(onehot, torch.tensor(1.0 - eps + eps / C, dtype=torch.float64),
                      torch.tensor(eps / C, dtype=torch.float64))
    ex = Sstar * ((torch.exp(torch.log_softmax(x64, -1)) - kap).abs() + rel64 * (p + kap))
    err = dG + dq
    err = _out(ex, err + hu(ex + err, c), c, s)
    err = torch.where(keep[:, None], _finite(err, x64), torch.zeros_like(err))
    return _bound(err, ms, "cross_entropy_backward",
                  "|err_j| <= dG_j + dq_j + hu_c(|grad*_j| + ..) + hu_s(..), dq_j = de_j(|S*| + dS) + p_j dS + hu_c(.), "
                  "de_j = p_j(expm1(b_lp) + c_exp e^b_lp) + eta, dS = sum dG + E_sum", prec, ex,
                  ("forward log_softmax stored in the logits' dtype (bound b_lp of softmax.log_softmax)",
                   "upstream gradients of nll/smoothing as torch's autograd scalar_t steps",
                   f"class sum: {summ.describe()}", "ignored rows: gradient exactly 0"),
                  {"C": C, "rows": n_keep, "reduction": reduction, "label_smoothing": eps, "grad_output": go})


# ============================================================================ layer norm
class LayerNormGrads(NamedTuple):
    """Bounds on the three gradients of layer norm."""

    dx: Bound
    dweight: Bound
    dbias: Bound


class RMSNormGrads(NamedTuple):
    """Bounds on the two gradients of rms norm (``dweight`` is ``None`` without a weight)."""

    dx: Bound
    dweight: Bound | None


def layer_norm_param_summation(rows: int, threads: int, storage: FloatFormat, c: FloatFormat
                               ) -> tuple[Summation, int]:
    """``(Summation, extra c levels per term)`` of torch CPU's ``dgamma``/``dbeta`` reduction over
    ``rows``: per thread a chain in a buffer of the input dtype (each step rounded to ``c`` then
    to the buffer), the ``threads`` buffers summed in ``c`` (module docstring)."""
    s = Summation(accum=storage, split=max(1, threads), reduce_fmt=c, reduce_algorithm="recursive")
    extra = 0 if storage == c else max(0, s.part_size(rows) - 1)
    return s, extra


def _stats_fmt(prec: Precision, weight: torch.Tensor | None, stats_fmt) -> FloatFormat:
    if stats_fmt is not None:
        return get_format(stats_fmt)
    if weight is not None and weight.dtype == torch.float32 and prec.storage.precision < 24:
        return get_format("fp32")
    return prec.storage


def _rstd_rho(v: torch.Tensor, e_v: torch.Tensor, eps: float, c: FloatFormat, rel: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(r, rho)``: ``r = (v + eps)^{-1/2}`` (upper) and the relative error bound of the computed
    ``RSQRT(fl(v^ + eps^))`` (``|v^ - v| <= e_v``, ``v^ >= 0``; ``rel``: relative error of the
    reciprocal square root step): ``sqrt(W / max(eps^, W - dW))(1 + rel) - 1`` (:mod:`.norms` §2),
    or ``1 - sqrt(W / (W + dW))(1 - rel)`` when larger (``eps^ = fl(eps)`` may exceed ``W``)."""
    eps_h, deps = _const_err(float(eps), c)
    W = v + eps
    dW = e_v + deps + hu(inflate(W) + e_v + deps, c)
    w_lo = torch.clamp(W - dW, min=eps_h)
    up = torch.where(w_lo > 0, torch.sqrt(W / w_lo.clamp(min=1e-300)), torch.full_like(W, math.inf)) * (1 + rel) - 1
    down = 1 - torch.sqrt(W / (W + dW)) * (1 - rel)  # W^ <= W + dW (also when eps^ > W, e.g. v = 0)
    return inflate(1.0 / torch.sqrt(W)), torch.maximum(up, down)


def _row_sums(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, summ: Summation, prec: Precision, wfmt,
              ms: ModeSpec) -> tuple[torch.Tensor, ...]:
    """``(E_ds, db*, |db*|, E_db)`` per row: the errors of the computed ``ds = sum g w x`` and
    ``db = sum g w`` (one or two product roundings per term), and ``db*``."""
    c, s = prec.compute, prec.storage
    n = x.shape[-1]
    ex_s = products_exact(s, c)
    if wfmt is None:  # ds = sum g x, db = sum g
        k_ds, k_db = int(not ex_s), 0
    elif wfmt == s:  # fl(fl(g x) w), fl(g w)
        k_ds, k_db = int(not ex_s) + 1, int(not ex_s)
    else:  # mixed type: fl(x fl(g w))
        k_ds, k_db = 2, 1
    _, dsm, S_ds = _sum64(g * w * x)
    db, dbm, S_db = _sum64(g * w)
    E_ds = _e_sum(S_ds, dsm, n, summ, c, ms, ms.lam, True, k_ds)
    E_db = _e_sum(S_db, dbm, n, summ, c, ms, ms.lam, True, k_db)
    return E_ds, db, dbm, E_db


def _ln_dx(rows, dy, w, wfmt, me, E_m, a_up, E_a, r, n, prec, summ, ms) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer norm ``grad_x`` bound (module docstring); ``(bound, |dx*| upper)``, shape ``(rows, n)``."""
    c = prec.compute
    u = c.u
    mu = me.mu
    d = rows - mu
    slack = _slack(n) * rows.abs().amax(-1, keepdim=True)  # float64 mean and d = x - mu
    ad = d.abs() + slack
    E_ds, db, dbm, E_db = _row_sums(dy, rows, w, summ, prec, wfmt, ms)
    P, Pm, _ = _sum64(dy * w * d)
    Pm = Pm + (dy * w).abs().sum(-1, keepdim=True) * slack
    m_up = mu.abs() + E_m
    db_up = dbm + E_db
    r1 = hu(db_up * m_up, c)
    E_K = E_db * m_up + dbm * E_m + E_ds + r1
    E_K = E_K + hu(Pm + E_K, c)
    scale, _ = _const_err(1.0 / n, c)
    sigma = abs(scale * n - 1.0)
    ra = E_a / r
    F = (1 + ra) ** 3 * (1 + sigma)
    r3n = r ** 3 / n
    eta = c.subnormal_abs_error
    E_b = (E_K * F + Pm * (F - 1) + ((1 + u) ** 4 - 1) * (Pm + E_K) * F) * r3n + 4 * eta * (1 + a_up) ** 3
    B = Pm * r3n
    b_up = B + E_b
    E_v = E_db * r * (1 + ra) * (1 + sigma) / n + dbm * r * ((1 + ra) * (1 + sigma) - 1) / n
    Cm = B * mu.abs() + dbm * r / n
    rho_c = hu(b_up * m_up, c) + hu(db_up * a_up, c) * scale + hu(db_up * a_up * scale * (1 + u), c)
    rho_c = rho_c + hu(Cm + E_b * mu.abs() + b_up * E_m + E_v + rho_c, c)
    gw = (dy * w).abs()
    dA1 = gw * E_a + hu(a_up * dy.abs(), c) * w.abs() + (hu(a_up * gw * (1 + u), c) if wfmt is not None else 0.0)
    rB = hu(b_up * rows.abs(), c)
    exact = r * dy * w - P * r3n * d - db * r / n  # dx* = r g w + B* d_j - db* r / N
    ex = exact.abs() + _slack(n) * (r * gw + Pm * r3n * ad + dbm * r / n)
    err = dA1 + E_b * ad + b_up * E_m + E_v + rho_c + rB
    # |fl(a g w) + fl(b x_j)| <= |r g w + B* x_j| + errors (B* = -P r^3/N)
    s1 = (r * dy * w - P * r3n * rows).abs() + _slack(n) * (r * gw + Pm * r3n * rows.abs()) + err
    err = err + hu(s1, c)
    err = err + hu(ex + err, c)
    return _out(ex, err, c, prec.out), ex


def layer_norm_backward(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-5, *,
                        normalized_shape: int | Sequence[int] | None = None, moments: str = "torch_cpu",
                        layout: TorchCPULayout | None = None, summation: Summation | None = None,
                        param_summation: Summation | None = None, threads: int | None = None, stats_fmt=None,
                        fmt=None, compute_fmt=None, out_fmt=None, mode: str = "deterministic",
                        failure_probability: float | None = None) -> LayerNormGrads:
    """Bounds on the three gradients of ``F.layer_norm(x, normalized_shape, weight, bias, eps)``
    for torch CPU's backward (module docstring). Returns :class:`LayerNormGrads` (the registered
    ops ``layer_norm_backward_input``/``_weight``/``_bias`` return one each).

    Args:
        g: upstream gradient (shape of ``x``); ``x``, ``weight``: the forward's stored inputs.
        normalized_shape: default the last dim.
        moments, layout: the forward's mean/variance model (:func:`.norms.moment_errors`).
        summation: the backward's row sums ``ds``, ``db`` (default recursive in ``c``).
        param_summation: the reduction over rows of ``grad_weight``/``grad_bias`` (default
            torch CPU's: :func:`layer_norm_param_summation` with ``threads``).
        threads: intra-op threads of the run (default ``torch.get_num_threads()``).
        stats_fmt: format of the saved mean/rstd and of ``grad_weight``/``grad_bias`` (default:
            fp32 for an fp32 weight with bf16/fp16 input, else the input's).
    """
    normalized_shape, n = _normalized_size(x, normalized_shape)
    prec, ms, summ = _prec_mode((x,), fmt, compute_fmt, out_fmt, mode, failure_probability, summation)
    c, s = prec.compute, prec.storage
    st = _stats_fmt(prec, weight, stats_fmt)
    rows, dy = f64(x).reshape(-1, n), f64(g).reshape(-1, n)
    M = rows.shape[0]
    wfmt = None if weight is None else get_format(weight.dtype)
    w = f64(weight).reshape(n) if weight is not None else torch.ones(n, dtype=torch.float64)
    rel = (1 + c.u) / (1 - c.u) - 1  # fl(1 / fl(sqrt(.))), both correctly rounded

    def stats(msub: ModeSpec):
        me = moment_errors(rows, prec, msub, moments, layout, summation)
        E_m = me.e_mu + output_rounding(me.mu.abs() + me.e_mu, c, st)
        r, rho = _rstd_rho(me.v, me.e_v, eps, c, rel)
        E_a = r * rho + output_rounding(r * (1 + rho), c, st)
        return me, E_m, r, E_a, r + E_a

    # grad_x: three events (moments, ds, db)
    m3 = _sub_mode(ms, 3)
    me, E_m, r, E_a, a_up = stats(m3)
    dx, dx_mag = _ln_dx(rows, dy, w, wfmt, me, E_m, a_up, E_a, r, n, prec, summ, m3)
    dx = _finite(dx, rows, dy)
    common = (f"saved mean/rstd in {st} (moments: {me.values['moments']})", "FMA contraction allowed (covered)")
    bx = _bound(dx.reshape(x.shape), ms, "layer_norm_backward_input",
                "|err_j| <= |g_j w_j| E_a + E_b |d_j| + |b| E_m + E_v + rho_c + roundings + hu_o(..)", prec,
                dx_mag.reshape(x.shape), common + (f"row sums: {summ.describe()}",), {"n": n})
    # grad_weight / grad_bias: column sums over the M rows
    T = threads if threads is not None else torch.get_num_threads()
    if param_summation is None:
        psumm, extra = layer_norm_param_summation(M, T, s, c)
    else:
        psumm, extra = param_summation, 0
    # grad_weight: events = the M rows' statistics (p/(3M) each), the term roundings, the sum
    mw = _sub_mode(ms, 3)
    _, E_m_w, r_w, E_a_w, a_up_w = stats(_sub_mode(ms, 3 * M)) if ms.mode == "probabilistic" else (
        me, E_m, r, E_a, a_up)
    mu = me.mu
    d = rows - mu
    ad = d.abs() + _slack(n) * rows.abs().amax(-1, keepdim=True)
    z = d * r_w
    az = inflate(z.abs())
    m_up = mu.abs() + E_m_w
    dz_fix = E_a_w * ad + a_up_w * E_m_w
    dz_rnd = hu(a_up_w * m_up, c) + hu(a_up_w * rows.abs(), c)
    dz_rnd = dz_rnd + hu(az + dz_fix + dz_rnd, c)
    ady = dy.abs()
    t_fix = ady * dz_fix
    t_rnd = ady * dz_rnd + hu(ady * (az + dz_fix + dz_rnd), c)
    fixed = t_fix.sum(0)
    rnd = t_rnd.sum(0)
    if ms.mode == "probabilistic":
        rnd = torch.minimum(rnd, mw.lam * torch.sqrt((t_rnd * t_rnd).sum(0)))
    gz = dy * z
    _, gzm, S_gz = _sum64(gz, 0)
    pre = fixed + rnd
    S_t = S_gz[0] + (t_fix + t_rnd).sum(0)
    acc, _ = sum_error_bound(S_t, gzm[0] + pre, M, psumm, st, mw.mode, mw.lam,
                             exact_products=conversion_exact(c, psumm.accum),
                             leaf_depths={c: extra} if extra else None)
    dwb = _finite(pre + acc, S_t)
    bw = _bound(dwb.reshape(normalized_shape), ms, "layer_norm_backward_weight",
                "|err_j| <= sum_i |g_ij| dz_fix_ij + [sum_i t_rnd_ij or lambda sqrt(sum t_rnd^2)] + sum bound over rows",
                prec, gzm[0].reshape(normalized_shape),
                common + (f"rows reduced: {psumm.describe()}" + (f", +{extra} {c} levels per path" if extra else ""),),
                {"rows": M, "threads": T})
    # grad_bias: exact terms g, one event
    _, gm, S_g = _sum64(dy, 0)
    accb, _ = sum_error_bound(S_g[0], gm[0], M, psumm, st, ms.mode, ms.lam,
                              exact_products=conversion_exact(s, psumm.accum),
                              leaf_depths={c: extra} if extra else None)
    bb = _bound(_finite(accb, S_g[0]).reshape(normalized_shape), ms, "layer_norm_backward_bias",
                "sum bound of sum_rows g under the rows' reduction", prec, gm[0].reshape(normalized_shape),
                (f"rows reduced: {psumm.describe()}",), {"rows": M, "threads": T})
    return LayerNormGrads(bx, bw, bb)


@register("layer_norm_backward_input")
def layer_norm_backward_input(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None = None,
                              eps: float = 1e-5, **kw) -> Bound:
    """Bound on layer norm's ``grad_x``: :func:`layer_norm_backward` ``.dx``."""
    return layer_norm_backward(g, x, weight, eps, **kw).dx


@register("layer_norm_backward_weight")
def layer_norm_backward_weight(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None = None,
                               eps: float = 1e-5, **kw) -> Bound:
    """Bound on layer norm's ``grad_weight``: :func:`layer_norm_backward` ``.dweight``."""
    return layer_norm_backward(g, x, weight, eps, **kw).dweight


@register("layer_norm_backward_bias")
def layer_norm_backward_bias(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None = None,
                             eps: float = 1e-5, **kw) -> Bound:
    """Bound on layer norm's ``grad_bias``: :func:`layer_norm_backward` ``.dbias``."""
    return layer_norm_backward(g, x, weight, eps, **kw).dbias


# ============================================================================ rms norm
def rms_norm_backward(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None = None, eps: float | None = None,
                      *, normalized_shape: int | Sequence[int] | None = None, summation: Summation | None = None,
                      param_summation: Summation | None = None, library: LibraryErrors | str | None = None,
                      fmt=None, compute_fmt=None, out_fmt=None, mode: str = "deterministic",
                      failure_probability: float | None = None) -> RMSNormGrads:
    """Bounds on the gradients of torch's composite ``rms_norm`` (module docstring); ``eps=None``:
    torch's default ``finfo(compute format).eps``. ``summation``: the forward's mean of squares
    and the backward's row sum; ``param_summation``: the row sum of ``grad_weight`` (default
    recursive in ``c``); ``library``: the ``rsqrt`` accuracy (:class:`.activations.LibraryErrors`)."""
    normalized_shape, n = _normalized_size(x, normalized_shape)
    prec, ms, summ = _prec_mode((x,), fmt, compute_fmt, out_fmt, mode, failure_probability, summation)
    c, s = prec.compute, prec.storage
    u = c.u
    lib = resolve_library(library, c)
    if eps is None:
        eps = c.eps
    rows, dy = f64(x).reshape(-1, n), f64(g).reshape(-1, n)
    M = rows.shape[0]
    wfmt = None if weight is None else get_format(weight.dtype)
    w = f64(weight).reshape(n) if weight is not None else torch.ones(n, dtype=torch.float64)

    def stats(msub: ModeSpec) -> tuple[torch.Tensor, torch.Tensor]:
        _, msm, S2 = _sum64(rows * rows)
        e_ms, _ = sum_error_bound(S2 / n, msm / n, n, summ, c, msub.mode, msub.lam,
                                  exact_products=products_exact(s, c), extra_depths={c: 1})
        e_ms = torch.where(S2 * (1 + 2 * n * u) >= c.max, torch.full_like(e_ms, math.inf), e_ms)
        return _rstd_rho(msm / n, e_ms, eps, c, lib.rsqrt_rel * u)

    # grad_x: two events (statistics, the row sum Q)
    m2_ = _sub_mode(ms, 2)
    r, rho = stats(m2_)
    gw = dy * w
    agw = gw.abs()
    gw_exact = wfmt is None or (products_exact(s, c) and products_exact(wfmt, c))
    Q, Qm, SQ = _sum64(gw * rows)
    E_Q = _e_sum(SQ, Qm, n, summ, c, m2_, m2_.lam, True, 1 + (0 if gw_exact else 1))
    r_gw = torch.zeros_like(agw) if gw_exact else hu(agw, c)
    dA = agw * r * rho + r_gw * r * (1 + rho)
    dA = dA + hu(agw * r * (1 + rho) + dA, c)
    rho3 = (1 + rho) ** 3 * (1 + u) ** 2 - 1
    r3 = r ** 3
    m1 = 0.5 * Qm * r3
    # -0.5 R^ may be subnormal (one eta), then times r3
    dm1 = 0.5 * (E_Q * r3 * (1 + rho3) + Qm * r3 * rho3) + c.subnormal_abs_error * r3 * (1 + rho3)
    dm1 = dm1 + hu(m1 + dm1, c)
    dm2 = dm1 / n
    dm2 = dm2 + hu((m1 + dm1) / n, c)
    ax = rows.abs()
    dB = 2 * ax * dm2 + hu(2 * ax * (m1 / n + dm2), c)
    exact = r * gw - r3 * rows * Q / n
    ex = exact.abs() + 4 * _gam(n) * (r * agw + r3 * ax * SQ / n)
    err = dA + dB
    err = err + hu(ex + err, c)
    dx = _finite(_out(ex, err, c, prec.out), rows, dy)
    bx = _bound(dx.reshape(x.shape), ms, "rms_norm_backward_input",
                "|err_j| <= |g_j w_j| r rho + 2|x_j| dm2 + roundings + hu_o(..), dm1 = (E_Q r^3(1+rho3) + |Q| r^3 rho3)/2",
                prec, ex.reshape(x.shape),
                (f"sums: {summ.describe()}", f"rsqrt within {lib.rsqrt_rel} u ({lib.name})"), {"n": n, "eps": eps})
    if weight is None:
        return RMSNormGrads(bx, None)
    # grad_weight: M rows' statistics (p/(3M) each), term roundings, the sum over rows
    mw = _sub_mode(ms, 3)
    rw, rhow = stats(_sub_mode(ms, 3 * M)) if ms.mode == "probabilistic" else (r, rho)
    z = rows * rw
    az = inflate(z.abs())
    dz_fix = ax * rw * rhow
    dz_rnd = hu(ax * rw * (1 + rhow), c)
    ady = dy.abs()
    t_fix = ady * dz_fix
    t_rnd = ady * dz_rnd + hu(ady * (az + dz_fix + dz_rnd), c)
    rnd = t_rnd.sum(0)
    if ms.mode == "probabilistic":
        rnd = torch.minimum(rnd, mw.lam * torch.sqrt((t_rnd * t_rnd).sum(0)))
    pre = t_fix.sum(0) + rnd
    _, gzm, S_gz = _sum64(dy * z, 0)
    psumm = param_summation if param_summation is not None else Summation(accum=c)
    S_t = S_gz[0] + (t_fix + t_rnd).sum(0)
    acc = _e_sum(S_t, gzm[0] + pre, M, psumm, c, mw, mw.lam)
    err = _out(gzm[0], pre + acc, c, wfmt)
    bw = _bound(_finite(err, S_t).reshape(normalized_shape), ms, "rms_norm_backward_weight",
                "|err_j| <= sum_i |g_ij| |x_ij| r rho + [rounding martingale] + sum bound + hu_w(..)", prec,
                gzm[0].reshape(normalized_shape), (f"rows reduced: {psumm.describe()}, cast to {wfmt}",), {"rows": M})
    return RMSNormGrads(bx, bw)


@register("rms_norm_backward_input")
def rms_norm_backward_input(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None = None,
                            eps: float | None = None, **kw) -> Bound:
    """Bound on rms norm's ``grad_x``: :func:`rms_norm_backward` ``.dx``."""
    return rms_norm_backward(g, x, weight, eps, **kw).dx


@register("rms_norm_backward_weight")
def rms_norm_backward_weight(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float | None = None,
                             **kw) -> Bound:
    """Bound on rms norm's ``grad_weight``: :func:`rms_norm_backward` ``.dweight``."""
    if weight is None:
        raise ValueError("rms_norm_backward_weight needs the weight")
    return rms_norm_backward(g, x, weight, eps, **kw).dweight


# ============================================================================ gelu / silu
def _gelu_erf_derivative(x: torch.Tensor, prec: Precision, lib: LibraryErrors) -> tuple[torch.Tensor, torch.Tensor]:
    """``(|gelu'(x)| upper, bound on |d^ - gelu'(x)|)`` for the erf form (module docstring)."""
    c = prec.compute
    ax = x.abs()
    a_h, da = _const_err(1.0 / math.sqrt(2.0), c)
    beta = 1.0 / math.sqrt(2.0 * math.pi)
    # torch's fp32 kernel rounds the double product, the reduced-type kernel multiplies float constants
    b32 = float(round_to(torch.tensor(2.0 / math.sqrt(math.pi) / math.sqrt(2.0) * 0.5), c))
    b16 = float(round_to(torch.tensor(_const_err(2.0 / math.sqrt(math.pi), c)[0] * a_h, dtype=torch.float64), c)) * 0.5
    dbeta = max(abs(b32 - beta), abs(b16 - beta)) + beta * 2.0 ** -52
    bh = beta + dbeta
    eta = c.subnormal_abs_error
    dt = ax * da + hu(ax * a_h, c)
    tl = (ax / math.sqrt(2.0) - dt).clamp(min=0.0)
    d_erf = lib.erf_abs * c.u + (2.0 / math.sqrt(math.pi)) * torch.exp(-tl * tl) * dt
    one_p = torch.special.erfc(-x / math.sqrt(2.0))  # 1 + erf(x/sqrt2)
    ds = d_erf + hu(inflate(one_p) + d_erf, c)
    x2 = x * x
    dq = 0.5 * torch.where(round_to(x2, c) == x2, torch.zeros_like(x2), hu(x2, c))
    dq = dq + torch.where(0.5 * x2 < c.min_normal, torch.full_like(x2, eta), torch.zeros_like(x2))
    phi0 = torch.exp(-0.5 * x2)
    dE = torch.where(ax < 40, phi0 * (torch.expm1(dq) + lib.exp_rel * c.u * torch.exp(dq)), torch.zeros_like(x2)) + eta
    dp = dbeta * (phi0 + dE) + beta * dE
    dp = dp + hu(bh * (phi0 + dE), c)
    xp = inflate(ax * beta * phi0)
    dxp = ax * dp + hu(xp + ax * dp, c)
    der = 0.5 * torch.special.erfc(-x / math.sqrt(2.0)) + x * beta * phi0
    der_up = der.abs() + 2.0 ** -40 * (0.5 * one_p + xp)
    dd = 0.5 * ds + dxp
    return der_up, dd + hu(der_up + dd, c)


def _gelu_tanh_derivative(x: torch.Tensor, prec: Precision, lib: LibraryErrors) -> tuple[torch.Tensor, torch.Tensor]:
    """``(|gelu_tanh'(x)| upper, bound on |d^ - gelu_tanh'(x)|)`` (module docstring)."""
    c = prec.compute
    u = c.u
    eta = c.subnormal_abs_error
    ax = x.abs()
    beta = math.sqrt(2.0 / math.pi)
    kappa = Fraction("0.044715")
    b_h, db = _const_err(beta, c)
    k_h, dk = _const_err(kappa, c)
    k3_h = float(round_to(torch.tensor(3.0 * k_h, dtype=torch.float64), c))
    rb, rk = db / beta, dk / float(kappa)
    r3k = float(abs(Fraction(k3_h) - 3 * kappa) / (3 * kappa)) * (1 + 2.0 ** -50)
    kf = float(kappa)
    uu = beta * (x + kf * x ** 3)
    au = inflate(uu.abs())
    rho_u = (1 + rb) * (1 + rk) * (1 + u) ** 5 - 1
    du = rho_u * au + 3 * eta * (b_h + 1) * (1 + ax)
    ul = (au - du).clamp(min=0.0)
    sech2_l = 1.0 / torch.cosh(ul) ** 2
    th = torch.tanh(uu)
    dth = lib.tanh_abs * u + sech2_l * du
    dth = torch.minimum(dth, torch.full_like(dth, 2.0))
    ath = th.abs()
    dr = dth + hu(inflate(1 + th) + dth, c)
    sech2 = inflate(1.0 / torch.cosh(uu) ** 2)
    dtsq = dth * (2 * ath + dth)
    dtsq = dtsq + hu(th * th + dtsq, c)
    dtd = dtsq + hu(sech2 + dtsq, c)
    ID = inflate(beta * (1 + 3 * kf * x * x))
    rho_id = (1 + rb) * (1 + r3k) * (1 + u) ** 4 - 1
    dID = rho_id * ID + 3 * eta * (b_h + 1)
    half = 0.5 * ax
    dl = torch.where(half < c.min_normal, hu(half, c), torch.zeros_like(half))
    L1 = half * sech2
    dL1 = half * dtd + dl * (sech2 + dtd)
    dL1 = dL1 + hu(L1 + dL1, c)
    dRD = dL1 * (ID + dID) + L1 * dID
    dRD = dRD + hu(L1 * ID + dRD, c)
    der = 0.5 * (1 + th) + 0.5 * x * (1.0 / torch.cosh(uu) ** 2) * beta * (1 + 3 * kf * x * x)
    der_up = der.abs() + 2.0 ** -40 * (inflate(1 + th) + L1 * ID)
    dd = 0.5 * dr + dRD
    dd = dd + hu(der_up + dd, c)
    # |x|^2 overflowing in c makes torch's 0 * inf a NaN: no finite claim
    dd = torch.where(x * x * (1 + 4 * u) >= c.max, torch.full_like(dd, math.inf), dd)
    return der_up, dd


def _silu_derivative(x: torch.Tensor, prec: Precision, lib: LibraryErrors) -> tuple[torch.Tensor, torch.Tensor,
                                                                                      torch.Tensor, torch.Tensor]:
    """``(sigma, K, ds, dk)``: ``s^ = fl(1/fl(1 + EXP(-x)))`` within ``ds`` of ``sigma = sigmoid(x)``,
    ``k^ = fl(1 + fl(x fl(1 - s^)))`` within ``dk`` of ``K = 1 + x (1 - sigma)`` (module docstring)."""
    c = prec.compute
    u = c.u
    eta = c.subnormal_abs_error
    R = lib.exp_rel * u
    ax = x.abs()
    E = torch.exp(-x)
    d = 1.0 + E
    sig = torch.sigmoid(x)
    om = torch.sigmoid(-x)
    dd1 = R * E + eta
    dd1 = dd1 + hu(inflate(d) + dd1, c)
    q = dd1 / (d * (d - dd1))
    ds = q + hu(inflate(sig) + q, c)
    dom = ds + hu(inflate(om) + ds, c)
    dxo = ax * dom + hu(ax * (om + dom), c)
    K = 1.0 + x * om
    dk = dxo + hu(inflate(K.abs()) + ax * 2.0 ** -50 + dxo, c)
    return sig, K, ds, dk


def _elementwise_backward(op: str, g: torch.Tensor, x: torch.Tensor, approximate: str, library, fmt, compute_fmt,
                          out_fmt, mode, failure_probability) -> Bound:
    prec = resolve_precision((x, g), fmt, compute_fmt, out_fmt)
    ms = resolve_mode(mode, failure_probability)
    c = prec.compute
    lib = resolve_library(library, c)
    x64, g64 = torch.broadcast_tensors(f64(x), f64(g))
    ag = g64.abs()
    xc = x64 if conversion_exact(prec.storage, c) else round_to(x64, c)
    if op == "silu":
        sig, K, ds, dk = _silu_derivative(xc, prec, lib)
        dgs = ag * ds + hu(ag * (inflate(sig) + ds), c)
        mag = inflate(ag * sig * K.abs())
        err = dgs * (K.abs() + dk) + ag * sig * dk
        err = err + hu(mag + err, c)
        # EXP(-x) may overflow (x < -88 in fp32): result 0 or tiny; |err| <= |exact| + |computed|
        E = torch.exp(-xc)
        ovf = ~(E * (1 + lib.exp_rel * c.u) * (1 + 4 * c.u) < c.max / 2)
        big = ag * (1 + xc.abs()) / (E * (1 - lib.exp_rel * c.u)) * (1 + (1 + c.u) ** 6) + 4 * c.subnormal_abs_error
        err = torch.where(ovf, big, err)
        formula = "|err| <= (|g| ds + hu_c)(|K| + dk) + |g| sigma dk + hu_c(..) + hu_o(..), K = 1 + x(1 - sigma)"
    else:
        if approximate == "none":
            der, dd = _gelu_erf_derivative(xc, prec, lib)
        elif approximate == "tanh":
            der, dd = _gelu_tanh_derivative(xc, prec, lib)
        else:
            raise ValueError(f"approximate must be 'none' or 'tanh', not {approximate!r}")
        mag = ag * der
        err = ag * dd + hu(mag + ag * dd, c)
        formula = "|err| <= |g| dd + hu_c(|g|(|gelu'| + dd)) + hu_o(..), dd = propagated roundings + library errors"
    if not conversion_exact(prec.storage, c):  # inputs rounded into c: Lipschitz constant of the derivative
        err = err + ag * 1.2 * (xc - x64).abs()
    err = _finite(_out(mag, err, c, prec.out), x64, g64)
    name = f"{op}_backward" + (f"({approximate})" if op == "gelu" else "")
    return _bound(err, ms, name, formula, prec, mag,
                  ((f"library functions: {lib.name} (erf {lib.erf_abs}u abs, tanh {lib.tanh_abs}u abs, "
                   f"exp {lib.exp_rel}u rel)"), "probabilistic mode = deterministic (no sum)"))


@register("gelu_backward")
def gelu_backward(g: torch.Tensor, x: torch.Tensor, approximate: str = "none", *,
                  library: LibraryErrors | str | None = None, fmt=None, compute_fmt=None, out_fmt=None,
                  mode: str = "deterministic", failure_probability: float | None = None) -> Bound:
    """Bound on torch's ``gelu_backward(g, x, approximate)`` = ``g * gelu'(x)`` (module docstring)."""
    return _elementwise_backward("gelu", g, x, approximate, library, fmt, compute_fmt, out_fmt, mode,
                                 failure_probability)


@register("silu_backward")
def silu_backward(g: torch.Tensor, x: torch.Tensor, *, library: LibraryErrors | str | None = None, fmt=None,
                  compute_fmt=None, out_fmt=None, mode: str = "deterministic",
                  failure_probability: float | None = None) -> Bound:
    """Bound on torch's ``silu_backward(g, x)`` = ``g * silu'(x)`` (module docstring)."""
    return _elementwise_backward("silu", g, x, "none", library, fmt, compute_fmt, out_fmt, mode,
                                 failure_probability)
