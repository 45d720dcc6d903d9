r"""Scaled dot-product attention, standard and online (flash), forward and backward.

Notation (one batch/head, one query row ``i``; ``j`` runs over the ``Lk`` keys, ``k`` over
the ``dv`` value columns). Exact: ``s_j = scale q.k_j + mask_j`` (masked keys excluded),
``M = max_j s_j``, ``w_j = exp(s_j - M)``, ``W = sum_j w_j >= 1``, ``p_j = w_j / W``,
``O_k = sum_j p_j v_jk``. ``u_f`` is the unit roundoff of format ``f``, ``hu_f(x)`` the
round-to-nearest error bound at magnitude ``x`` (:func:`~ttrace_num.formats.half_ulp`).

Computation models
------------------
Formats: inputs ``q, k, v`` stored in ``fmt`` (taken exactly); ``c = compute_fmt``
(default fp32) for every arithmetic step; ``score_fmt`` (``sf``, default ``c``) the format
the scores are stored in before the softmax; ``p_fmt`` (``pf``, default ``c``) the format
``P`` is rounded to before the ``P V`` product; ``out_fmt`` (default ``fmt``).
FlashAttention-2 (Dao 2023, §3.1 and Algorithm 1; its CUDA kernels convert ``P`` to the
input dtype before the second GEMM) and torch's CPU flash kernel (``FlashAttentionKernel
.cpp``: ``P`` is stored in ``scalar_t`` for bf16/fp16) use ``p_fmt = fmt``.

1. Scores: ``s_hat_j`` = the ``d``-term dot product accumulated in ``c`` (any order: the
   recursive model of :mod:`.summation`, ``d - 1`` levels), every product counted as a
   rounding (exact or not), plus **two** more ``c`` levels for the scaling: this covers
   ``fl(fl(q.k) * scale)`` (torch CPU flash, FA2), a GEMM ``alpha`` and the math backend's
   ``(q sqrt(scale)) . (k sqrt(scale))``. The scale constant itself is rounded (``scale``
   or ``sqrt(scale)`` to ``c`` from a double): a relative error common to every score,
   ``|eps_sc| <= (1 + u_c)^2 (1 + 2^-52)^2 - 1``. An additive float mask costs one more
   ``c`` rounding at the result's magnitude (``fl(a*scale + mask)``, fused or not); a
   boolean mask (``-inf``/``0``) and ``is_causal`` (top-left, ``j <= i``, as torch) are exact.
   When ``sf != c`` the scores are rounded to ``sf`` after the product, the scaling and the
   mask addition (a chain of narrow-dtype torch ops): ``2 + [mask]`` roundings.
2. Softmax, shifted by the (running) maximum ``m``, which is exact: ``t_j = fl_c(s_hat_j -
   m)`` (error ``|tau_j| <= h_j = hu_c(|s_j - m| + bounds)``), ``e_j = exp_c(t_j)`` within
   ``exp_ulps`` ulps (``|eps_j| <= c_e = 2 exp_ulps u_c``; results below ``2 min_normal_c``
   may be flushed to zero: absolute error ``<= 2 min_normal_c``).
3. ``algorithm="standard"``: ``l = sum_j e_j`` (recursive in ``c``), ``r = fl_c(1/l)``,
   ``p_hat_j = fl_c(e_j r)`` (a direct division is the special case ``delta_r = 0``),
   ``P~_j = fl_pf(p_hat_j)``, ``O = fl_out(sum_j P~_j v_j)`` (recursive in ``c``).
   ``algorithm="online"`` (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022,
   Algorithm 1; FlashAttention-2): keys in ``T = ceil(Lk / b)`` blocks of ``block_size = b``;
   per block ``t``: running max ``m_t``, ``e_j = exp_c(fl_c(s_hat_j - m_t))``, ``P~_j =
   fl_pf(e_j)``, ``alpha_t = exp_c(fl_c(m_{t-1} - m_t))``, ``l_t = fl(fl(alpha_t l_{t-1}) +
   fl(sum_{j in t} e_j))`` (the block sum uses the unrounded ``e_j``), ``acc_t =
   fl(fl(alpha_t acc_{t-1}) + sum_{j in t} P~_j v_j)`` (the block GEMM with the carried
   accumulator as one more term, any order); finally ``O = fl_out(fl_c(acc_T fl_c(1/l_T)))``.
   torch's CPU ``scaled_dot_product_attention`` (flash kernel) is this model with
   ``b = 512`` (``kvSplitSize``), ``p_fmt = fmt``, exp = ``Vectorized::exp_u20`` (see
   :data:`EXP_U20_ULPS`): :func:`torch_cpu_sdpa_model` returns these settings.
4. ``exp2=True`` (GPU kernels: FlashAttention-2/3 ``scale_apply_exp2``, the memory-efficient
   kernel): ``e_j = exp2_c(fl_c(fl_c(S_j c2) - fl_c(m_t c2)))`` with ``S_j = q.k_j`` unscaled and
   ``c2 = fl(scale log2 e)`` (FA2 fuses the first product into an FMA; torch's build, with
   ``UNFUSE_FMA``, rounds it); rescale ``alpha = exp2_c(fl_c(fl_c(m_{t-1} - m_t) c2))``. Each
   rounding at magnitude ``y`` (log2 units) errs by ``<= u_c y``, i.e. ``<= u_c y ln 2`` in natural
   units, and ``y ln 2`` is the natural-unit magnitude (``ln 2 log2 e = 1``), so the shift error is
   ``h_j = u_c (|s_j - m_t| + |s_j| + |m_t| + 3 (Delta_j + dt_j))`` (three roundings: the product,
   the max's product, the subtraction; the rounding of ``m_t c2`` is *not* relative to ``s_j - m_t``)
   and the rescale's ``h_alpha = 2 u_c (|m_{t-1} - m_t| + 2 dt)``; ``c2``'s own error is a
   relative error common to all scores (``eps_sc``: two roundings). Exp: ``GPU_EXP_ULPS``.

Default: the kernels torch runs (``algorithm=None``)
----------------------------------------------------
A user testing ``scaled_dot_product_attention`` does not choose the kernel: torch picks the
math backend (``_scaled_dot_product_attention_math``, any device: bf16/fp16 inputs upcast to
fp32 unless ``allowFP16BF16ReductionMathSDP`` is set, ``q`` and ``k`` each scaled by
``sqrt(scale)``, a materialised softmax), its CPU flash kernel,
or on GPU FlashAttention-2 or the memory-efficient kernel. Their models differ in the
roundings (``P`` rounded to the input dtype before the ``P V`` GEMM in every flash-type
kernel: FA2 converts the fp32 ``P`` fragment to the element type for the second MMA, the CPU
kernel stores it in ``scalar_t``; the math backend keeps ``P`` in fp32), in the blocks
(``T = ceil(Lk / b)`` rescales) and in the exp. Measured: torch's CPU SDPA violated the
``standard`` model (``P`` in fp32) on 0.3-28% of its bf16/fp16 outputs (L = 256-1024). The
default bound is the elementwise maximum over the kernels (each bound holds for its kernel,
so the maximum holds for whichever runs): the math backend (``standard``, ``p_fmt = c``,
exp within :data:`GPU_EXP_ULPS` (CUDA ``expf``; the CPU's is within 1)), torch's CPU flash
kernel (:func:`torch_cpu_sdpa_model`), and the GPU online kernels (``exp2=True``, ``p_fmt`` =
input dtype, :data:`GPU_EXP_ULPS`) with key blocks :data:`GPU_BLOCK_SIZES`. Stating one kernel
(``algorithm=``, ``block_size=``, ``p_fmt=``, ``exp_ulps=``) gives its own, tighter bound. Not
covered: FlashAttention-3's other block sizes (state them), tensor-core accumulation that
is not IEEE fp32 (the GEMMs are modelled as fp32 round-to-nearest), manual attention with
scores rounded to a narrow dtype (``score_fmt``), the math backend with
``allowFP16BF16ReductionMathSDP`` (the same, in effect).

Dead keys (``-1e9`` / ``finfo.min`` additive masks)
---------------------------------------------------
Every computed running max is ``>= m_low_t = max_{k in blocks <= t} (s_k - Delta_k)`` (it is the
max of computed scores, each within ``Delta_k``). A key with ``s_j + Delta_j < m_low_t(j)``
attains neither the exact nor the computed running max, so ``|m_hat_t - m_t| <= dt`` with
``dt`` the max ``Delta`` over the *other* keys of the prefix. Its computed exp argument is
``<= X_j = s_j - m_t + Delta_j + dt + u_c (|s_j - m_t| + Delta_j + dt)`` (plus the ``exp2`` terms);
if ``X_j <= log(min_normal_c)`` the key is *dead*: its exact and computed weights both lie in
``[0, min_normal_c (1 + c_e)]`` (a correct exp of an argument below ``log min_normal`` is at most
``min_normal`` plus ``exp_ulps`` ulps, or flushed to 0), so its error is the absolute
``eta_j <= 2 min_normal_c`` (the underflow term every model already carries) and it gets no
relative perturbation (``Lambda_j = 0``), no share of ``max Lambda``, and its (huge) score error
does not enter ``dt``. This is rigorous for any mask value; ``-inf`` is exact as before. A score
whose rounding may overflow (``|s| + Delta >= max_c (1 + u_c)``) has a bounded error (``hu_c(max)``)
only if it does not overflow; an overflow of a negative score gives ``-inf``, i.e. weight 0, which
a dead key has anyway; on a live key there is no finite claim (``inf``). Limitation: in the
online model a key block whose every key is masked and that precedes every unmasked key of its
row (left padding longer than a block) keeps its keys live: their score errors (``~u |mask|``) then
make the bound huge or ``inf``: never a wrong claim, but no useful one (use ``-inf`` or a bool mask).

Rounding depths (for :mod:`.summation`'s ``theta``/``sigma``): scores ``d + 2``; standard:
``l``: ``Lk - 1``, ``P V``: ``Lk - 1`` (+1 if ``p_pf + p_fmt > p_c``: inexact products);
online: ``l``: ``b - 1 + 2 (T - 1)`` (one rescale and one addition per later block),
``acc``: ``Lk + T - 2`` (+1): a leaf of block 1 sees ``b - 1`` levels in its block and,
in each later block, the rescale and up to ``b`` additions of the carried term. Each
rescale ``fl(alpha acc)`` is a unary node of the summation tree: the identity ``computed -
ideal = sum_v delta_v s'_v (prod of later alphas)`` and ``|err| <= theta S*`` hold with
``S*`` the sum of the leaves scaled by the alphas above them (induction over the tree,
as in :mod:`.summation`), i.e. ``l* = sum_j e_j c_t`` and ``sum_j |P~_j v_j| c_t``,
``c_t = prod_{r>t} alpha_hat_r``: every rescale is one more rounding level applied to
everything accumulated so far, and the early blocks see ``T - 1`` of them.

Derivation (forward)
--------------------
**Weights.** With a common factor removed (the shift by ``m`` cancels in the ratio, and in
the online algorithm ``e_j prod_{r>t(j)} alpha_hat_r = exp(s_hat_j - m_T + tau_j + sum_r
tau_alpha_r) (1 + eps_j) prod (1 + eps_alpha_r)``), the computed un-normalised weights
are ``w_j exp(lambda_j)`` with ``|lambda_j| <= Lam_j = Delta_j + h_j + L(c_e) +
sum_{r > t(j)} (h_alpha_r + L(c_e))``, ``L(x) = -log(1 - x)``, ``Delta_j`` the score
error bound. The exactly normalised ``p'_j = softmax(s + lambda)_j`` satisfies
``|p'_j - p_j| <= J_j`` from the rigorous softmax perturbation bound
(:func:`.softmax_jacobian.softmax_perturbation`: ``p_j max(e^{Lam_j + p.Lam} - 1, 1 -
e^{-Lam_j}/sum p e^Lam)``), or, whichever is smaller, the form that is tight for a dominant
entry (``~2 (1 - p_j) Lam`` instead of ``~2 Lam``): ``p'_j / p_j = 1 / (p_j + sum_{k != j} p_k
e^{lambda_k - lambda_j})`` with ``|lambda_k - lambda_j| <= x_j = Lam_j + max Lam`` gives ``|p'_j/p_j -
1| <= max(o (1 - e^{-x_j}) / (1 - o (1 - e^{-x_j})), o (e^{x_j} - 1))``, ``o >= 1 - p_j``. Since
``sum_j (p'_j - p_j) = 0``, ``O' - O = sum_j (p'_j -
p_j)(v_j - c)`` for any column constant ``c``: ``|O' - O| <= E1 = min_c J @ |V - c|``
(``c`` = 0 or the column median). Exp results that may underflow add ``eta_j`` absolute
weight errors (``E_eta``).

**Normalisation and P V, standard.** ``l_hat = (sum e)(1 + beta)``, ``|beta| <= b_l =
theta_l + eta_l / W_low``; ``p_hat_j = p'_j (1 + kappa)(1 + delta_y_j)``, ``1 + kappa =
(1 + delta_r)/(1 + beta)``, ``|kappa| <= K = (1 + u_c)/(1 - b_l) - 1``. Exactly::

    O_hat - O = (O' - O) + kappa O' + (1 + kappa) sum_j p'_j delta_y_j v_j + sum_j rho_j v_j + E_pv

(``rho_j`` the rounding to ``pf``, ``|rho_j| <= hu_pf(p_bar_j)``, ``p_bar = (p + J)(1 + K)
(1 + u_c)``; ``E_pv`` the ``P V`` summation identity, ``|E_pv| <= theta_pv S_pv``, ``S_pv =
(p_bar + rho_bar) @ |V|``). Deterministic:
``E = E1 + K (|O| + E1) + u_c (1 + K)((p + J) @ |V|) + rho_bar @ |V| + theta_pv S_pv + eta + E_eta``.

**Online.** ``O_hat = (acc* + E_acc) r_hat (1 + delta_o)``, ``acc* / l* = X0 = O' + sum_j
rho'_j v_j`` with ``rho'_j = rho_j c_t / l*``, ``|rho'_j| <= hu_pf(e_bar_j) c_bar_t / W_low``
(the ``pf`` rounding acts on the *un-normalised* ``e_j``, at its own binade), ``r_hat l* =
(1 + kappa_r)``, ``|kappa_r| <= K_r = (1 + u_c)/(1 - b_l) - 1``::

    O_hat - O = (X0 - O) + kappa_r X0 + E_acc r_hat + delta_o (acc* + E_acc) r_hat

Deterministic: ``E = E1 + rho'_bar @ |V| + K_r X0_bar + (1 + K_r)(theta_acc S + u_c (X0_bar +
theta_acc S)) + eta + E_eta``, ``S = (p + J + rho'_bar) @ |V|``, ``X0_bar = |O| + E1 + rho'_bar @ |V|``.

Both: ``|fl_out(O_hat) - O| <= E + hu_out(|O| + E)`` (0 when ``c`` converts exactly to ``out``).

Probabilistic mode
------------------
Higham-Mary model: every rounding error (and exp error) has zero mean conditional on
the errors of the operations before it in the topological order: scores; shifts and
exps (and the online rescale factors); roundings to ``pf``; the denominator's sum;
the reciprocal; the ``P V`` (accumulator) sum; the final product. Expanding the exact
identities above, the error is ``sum_k delta_k C_k + R`` where each ``C_k`` is known
before ``delta_k`` is drawn and bounded deterministically, and ``R`` is a deterministic
second-order remainder. Linear terms (Azuma-Hoeffding, one martingale per output
element, ``lambda = lambda_for(p)``):

* ``O' - O = sum_j p_j (v_j - O) lambda_j + sum_j rem_j (v_j - c)``: the score roundings
  (Azuma proxy ``sigma_j^2 = ((1 + theta_s) scale (|q||k|)_j)^2 (d+2) u_c^2`` plus the mask
  and ``sf`` roundings), ``tau_j`` (``h_j``), ``eps_j`` (``c_e``), with coefficient ``p_j (v_j -
  O)``; online: each rescale factor's ``tau_alpha_r``, ``eps_alpha_r`` with coefficient
  ``G_r = sum_{j in blocks < r} p_j (v_j - O)``. ``sum_j (p_j (v_j - O))^2 x_j`` is evaluated
  as ``(p^2 x) @ V^2 - 2 O (p^2 x) @ V + O^2 sum p^2 x`` (with its float64 slack).
  ``rem_j`` (rigorous): with ``rho_j = e^{Lam_j} - 1 - Lam_j`` and ``Mv = p.Lam + p.rho``,
  ``|rem_j| <= p_j (rho_j + p.rho + Mv (Lam_j + p.Lam)) / (1 - Mv)``.
* standard: ``delta_r`` (coefficient ``O'``), ``beta`` (``O' s'_v / sum e``, Azuma
  ``(1 + theta_l) sigma_l |O'|``), ``delta_y_j`` (``(1 + kappa) p'_j v_j``), ``rho_j`` (``v_j``),
  ``E_pv`` (``(1 + theta_pv) sigma_pv S_pv``); remainder ``kappa_2 O'``, ``|kappa_2| <= f2 =
  u_c b_l + (1 + u_c) b_l^2 / (1 - b_l)``.
* online: ``rho'_j``, ``delta_r`` and ``beta`` (coefficient ``X0``), ``E_acc r_hat``, ``delta_o``;
  remainder ``f2 X0_bar``.
* remainders: ``sum_j rem_j |v_j - c|``, ``(-log(1 - c_e) - c_e)(sqrt(p@V^2 - O^2) + sum_r
  |G_r|)`` (log of the exp errors), the common scale-constant term ``eps_sc |sum_j p_j (v_j -
  O) scale q.k_j|`` and the underflow terms, all deterministic.

``E_prob = min(E_det, lambda sqrt(sum C_k^2 u_k^2) + R)``; the output rounding stays a
deterministic ``hu_out`` term outside ``lambda``, as in :mod:`.summation`.

Backward (:func:`attention_backward`, ops ``attention_dq``/``attention_dk``/``attention_dv``)
-----------------------------------------------------------------------------------------
Exact: ``dV = P^T dO``, ``dP = dO V^T``, ``D_i = sum_k dO_ik O_ik = sum_j P_ij dP_ij``,
``dS = P * (dP - D)``, ``dQ = scale dS K``, ``dK = scale dS^T Q``. Computed: ``P_hat`` in ``c``
with an elementwise bound ``b_P``: ``"standard"``: the stored softmax output (the bound above
with ``V = I``, linearised per entry: ``p_j (lambda_j - p.lambda) + p_j (delta_r - beta +
delta_y_j)`` plus ``rem_j``), rounded to ``pf`` (the tensor ``P V`` used); ``"online"``: recomputed
from the stored log-sum-exp ``L_hat = fl_c(m_hat + fl_c(log_c l_hat))`` (FlashAttention-2
Algorithm 2, torch CPU flash backward): ``P_hat_j = exp_c(fl_c(s_hat_j - L_hat))``; since
``m_hat + log l* = L + log sum_j p_j e^{lambda_j}``, ``|L_hat - L| <= dL = log(sum p e^Lam) + L(b_l) +
c_log |log l_hat| + hu_c(|L| + .)`` (Jensen gives the lower side ``-p.Lam``; ``c_log = 2 log_ulps
u_c``), so ``|P_hat_j - p_j| <= p_j (exp(Delta_j + h'_j + dL)(1 + c_e) - 1)``, ``h'_j = hu_c(|s_j - L| +
.)``. ``P~ = fl_pf(P_hat)`` in the ``dV`` GEMM; ``D`` from ``delta="output"`` (``rowsum(dO * O_hat)``,
``O_hat`` the stored forward output with its bound; FlashAttention-2 / torch flash) or
``"probs"`` (``rowsum(P_hat * dP_hat)``, torch's softmax backward); ``dS_hat = fl_c(P_hat fl_c(dP_hat -
D_hat))`` then ``fl_dsf`` (``ds_fmt``, default ``pf``); the three GEMMs accumulate in ``c``
(recursive; the scaling counted as two more levels, as for the scores, with the common
constant error ``eps_sc``); with ``grad_accum_fmt`` the gradient GEMMs are split into blocks
(``q_block_size`` rows for ``dK``, ``dV``; ``block_size`` keys for ``dQ``) accumulated as
``C = fl_acc(fl_c(C + fl_c(scale block)))`` (torch's CPU flash backward accumulates
``grad_q/k/v`` in the storage dtype across blocks): ``Summation(split, reduce_fmt=grad_accum_fmt)``
plus one ``c`` level per block for the carried addition, with the partial sums ``T`` of
:func:`.matmul.partial_abs_sum`. Composition, per element: ``|x_hat y_hat - x y| <= b_x |y| + (|x| +
b_x) b_y`` and ``|fl(a) - a| <= hu(|a| + b)`` per rounding; a GEMM ``A_hat @ B``: ``b_A @ |B|`` plus
:func:`.summation.sum_error_bound` on ``(|A| + b_A) @ |B|``.

Probabilistic backward: every sub-bound holds with probability ``1 - p / n_ev`` (``n_ev = 3
max(Lq, Lk) + dv + 4`` bounds the events one output element uses; union bound). The
intermediates ``P`` and ``dS`` also carry a split ``err = lin + r``: ``lin`` a martingale of
roundings private to the entry (scores, shift and exp of entry ``ij``; the ``dP_ij`` GEMM;
the roundings of ``g_ij = dP_ij - D_i`` and ``dS_ij``) with Azuma proxy ``sig2``, and ``|r| <= rest``
(``D_i``'s error, the row-common ``p_j (p.lambda - delta_r + beta)`` and ``p_j (L_hat - L)``, second-
order products). A GEMM then propagates ``min(b_A @ |B|, lambda sqrt(sig2_A @ B^2) + rest_A @ |B|)``:
the private errors of different entries average out. Manual autograd through narrow-dtype
torch ops (``dP`` rounded to bf16 by a bf16 GEMM, say) is not this model.
GQA: ``dK``, ``dV`` of a key/value head sum the ``Hq/Hkv`` per-query-head gradients (a sum in
``c`` rounded to ``out``; each summand's bound includes its own output rounding, so the
model covers summing rounded or unrounded per-head gradients).

Fully masked rows: the exact softmax is 0/0; torch (math ``_safe_softmax`` and the CPU
flash kernel) returns 0 for such rows, and this library defines the exact output there
as 0 too: the bound is 0 (a NaN or non-zero output is a real discrepancy).

Tightness (``bench/cases/attention.py``, 20 instances per case; median over instances of
``min_i bound_i / err_i``, the same in both modes unless stated): bf16/fp16 forward 1.5-2
(torch SDPA and the emulated models: the output rounding, and for flash the ``P`` rounding,
dominate); manual bf16/fp16 attention 1.3-6 (three roundings of the scores to the narrow
dtype are budgeted worst case); bf16/fp16 backward 1.2-1.5 (``dV``) and 3.5-5.7 (``dQ``, ``dK``:
the ``dS`` rounding to the narrow dtype composed over ``Lk`` keys, where Azuma only beats the
worst case for ``Lk >~ 40``). fp32: forward 6-13 probabilistic / 9-45 deterministic (33 / 91
for flat rows: identical keys give identical computed scores, whose budgeted errors cancel
exactly), backward 23-57 / 30-150. In fp32 the summation bounds, valid for any order,
charge every level of the ``P V`` sum at ``S = sum_j p_j |v_j|`` (and every score level at
``scale (|q||k|)_j``) while the data-oblivious orders of real kernels see partial sums of
size ``~|O|``, about ``S / sqrt(Lk)`` for random-sign values: with ``Lk = 2048`` the fp32 forward
is ~100x (probabilistic) loose. The backward composes the per-entry bounds of ``P``, ``dP``,
``D`` and ``dS`` with absolute values (only the entries' private errors are averaged), which
costs another factor of a few. ``compute_fmt="bf16"`` (every step in bf16) is 25-60: the
worst-case score errors ``(d + 2) u scale (|q||k|)_j`` enter the second-order softmax terms.

Sources: Dao et al., "FlashAttention", NeurIPS 2022 (Algorithm 1); Dao, "FlashAttention-2",
2023 (§3.1, Algorithms 1-2); Milakov & Gimelshein, "Online normalizer calculation for
softmax", 2018; Blanchard, Higham & Mary, IMA J. Numer. Anal. 41(4) 2021 (shifted
softmax); Higham, Accuracy and Stability of Numerical Algorithms (2002) §2.2, §3.1;
Higham & Mary, SISC 41(5) 2019 and Connolly, Higham & Mary, SISC 43(1) 2021
(probabilistic model, martingale form); torch ``aten/src/ATen/native/cpu/FlashAttentionKernel.cpp``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..formats import FloatFormat, get_format, half_ulp
from .base import Bound, Explanation, lambda_for
from .common import Precision, f64, register, resolve_mode, resolve_precision
from .matmul import partial_abs_sum
from .softmax_jacobian import softmax_perturbation
from .summation import (
    Depths,
    Summation,
    conversion_exact,
    output_rounding,
    sigma_coefficient,
    sum_error_bound,
    theta,
    underflow_term,
)

__all__ = [
    "ALGORITHMS",
    "EXP_U20_ULPS",
    "GPU_BLOCK_SIZES",
    "GPU_EXP_ULPS",
    "AttentionGrads",
    "attention",
    "attention_backward",
    "attention_dk",
    "attention_dq",
    "attention_dv",
    "torch_cpu_sdpa_model",
]

SOURCE = ("Dao et al. 2022 (FlashAttention, Alg. 1); Dao 2023 (FlashAttention-2, §3.1, Alg. 1-2); "
          "Milakov & Gimelshein 2018 (online softmax); Blanchard, Higham & Mary, IMA JNA 2021; "
          "Higham (2002) §2.2, §3.1; Higham & Mary SISC 2019, Connolly, Higham & Mary SISC 2021")

ALGORITHMS = ("standard", "online")

#: Accuracy of torch's ``Vectorized<float>::exp_u20`` (used by the CPU flash-attention kernel
#: for ``exp(s - m)``), in ulps (``|error| <= 2 * EXP_U20_ULPS * u`` relative). The source
#: (``vec256_float.h``) claims "ULP=20"; its argument reduction uses a single-float ``ln 2``, so
#: the error grows with ``|x|``. Measured with a bit-exact emulation
#: (:func:`ttrace_num.emulate.attention.exp_u20`, FMAs rounded exactly) over *every* float32 in
#: ``[-87.5, -2^-30]``: max relative error ``6.479 u`` (at ``x = -86.3523``), i.e. 3.24 ulps;
#: results below ``2^-125`` are flushed to 0 (absolute error ``<= 1.42 min_normal``, covered by
#: the ``2 min_normal`` term). Glibc ``expf`` (the scalar tail, the rescale factors) and SLEEF's
#: ``expf_u10`` (the backward's recomputation) are within 1 ulp.
EXP_U20_ULPS = 3.25

#: Accuracy of the exp/exp2 of NVIDIA GPU kernels in ulps: ``expf`` and ``exp2f`` are documented to
#: 2 ulps over the full range (CUDA C++ Programming Guide, "Mathematical Functions", single
#: precision); FlashAttention-2/3 and the memory-efficient kernel call ``exp2f`` (results flushed
#: below the normal range with ``-ftz``: covered by the ``2 min_normal`` term). Documented, not
#: measured here (no GPU): ``bench/`` validates it on a CUDA machine.
GPU_EXP_ULPS = 2.0

#: Key-block sizes of the GPU online-softmax kernels the default model covers: FlashAttention-2
#: (``kBlockN`` 32, 64 or 128 by head dimension and architecture, ``csrc/flash_attn/src/
#: flash_fwd_launch_template.h``) and the memory-efficient kernel (``kKeysPerBlock`` 64 or 128).
#: FlashAttention-3's other sizes (e.g. 80, 176) must be stated (``algorithm="online",
#: block_size=...``).
GPU_BLOCK_SIZES = (32, 64, 128)

_U64 = 2.0 ** -53
#: final slack on a bound evaluated in float64 from float64 statistics (sums of <= 2^30
#: non-negative terms: (1 + 2^-53)^(2^30) - 1 < 2^-22)
_EVAL_SLACK = 2.0 ** -20


def _L(x: float) -> float:
    """``-log(1 - x)``: bound on ``|log(1 + eps)|`` for ``|eps| <= x < 1``."""
    return -math.log1p(-x)


# ----------------------------------------------------------------------------- problem setup
@dataclass
class _Problem:
    q: torch.Tensor          # (..., Lq, d) float64
    k: torch.Tensor          # (..., Lk, d) float64, heads expanded (GQA)
    v: torch.Tensor          # (..., Lk, dv) float64, heads expanded
    blocked: torch.Tensor    # (..., Lq, Lk) bool: True = excluded from the softmax
    add: torch.Tensor | None  # additive float mask (finite part, 0 where blocked), float64
    scale: float             # float64 value of the scale
    default_scale: bool      # scale = 1/sqrt(d) exactly (not representable: the float64 value is within 2^-52)
    rep: int                 # query heads per key/value head (GQA)

    @property
    def Lq(self) -> int:
        return self.q.shape[-2]

    @property
    def Lk(self) -> int:
        return self.k.shape[-2]


def _expand_kv(q: torch.Tensor, t: torch.Tensor, enable_gqa: bool) -> tuple[torch.Tensor, int]:
    if q.dim() < 3 or t.dim() < 3 or q.shape[-3] == t.shape[-3]:
        return t, 1
    hq, hk = q.shape[-3], t.shape[-3]
    if not enable_gqa and hk != 1:  # one key/value head broadcasts (its gradient sums over the heads, as GQA)
        raise ValueError(f"query has {hq} heads and key/value {hk}: pass enable_gqa=True for grouped-query attention")
    if hq % hk:
        raise ValueError(f"grouped-query attention needs query heads ({hq}) divisible by key/value heads ({hk})")
    return t.repeat_interleave(hq // hk, dim=-3), hq // hk


def _validate(q, k, v, attn_mask, mask, scale) -> None:
    """Clear errors for arguments torch's ``scaled_dot_product_attention`` rejects (or that have no
    meaning here), before any computation."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(f"attention: {name} must be at least 2-D (..., L, d), got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"attention: q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}; torch's "
                         "scaled_dot_product_attention requires one dtype: cast them to the dtype the kernel runs in")
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2] or k.dim() != v.dim():
        raise ValueError(f"attention: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit "
                         "(need q (..., Lq, d), k (..., Lk, d), v (..., Lk, dv))")
    if k.dim() >= 3 and k.shape[:-2] != v.shape[:-2]:
        raise ValueError(f"attention: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same batch and head dims")
    try:
        torch.broadcast_shapes(q.shape[:-3], k.shape[:-3])
    except RuntimeError:
        raise ValueError(f"attention: batch dims of q {tuple(q.shape)} and k {tuple(k.shape)} do not broadcast") from None
    if attn_mask is not None and mask is not None:
        raise ValueError("attention: pass either attn_mask (torch SDPA: bool True = attend) or mask (bool True = "
                         "masked out), not both")
    m = attn_mask if attn_mask is not None else mask
    if m is not None:
        name = "attn_mask" if attn_mask is not None else "mask"
        if not isinstance(m, torch.Tensor):
            raise TypeError(f"attention: {name} must be a torch.Tensor (bool or floating), got {type(m).__name__}")
        if m.dtype != torch.bool and not m.dtype.is_floating_point:
            raise TypeError(f"attention: {name} must be bool or floating (additive), got {m.dtype}")
        out_shape = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3]) + q.shape[-3:-2] + (q.shape[-2], k.shape[-2])
        try:
            ok = torch.broadcast_shapes(m.shape, out_shape) == out_shape
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"attention: {name} of shape {tuple(m.shape)} does not broadcast to the scores' shape "
                             f"{tuple(out_shape)} (..., Lq, Lk)")
    if scale is not None:
        try:
            if isinstance(scale, (bool, complex)):
                raise TypeError
            scale = float(scale)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"attention: scale must be a real number or None, got {scale!r}") from None
        if not math.isfinite(scale):
            raise ValueError(f"attention: scale must be finite, got {scale}")


def _problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask, mask, is_causal: bool, scale,
             enable_gqa: bool) -> _Problem:
    _validate(q, k, v, attn_mask, mask, scale)
    q64 = f64(q)
    k64, rep = _expand_kv(q, f64(k), enable_gqa)
    v64, _ = _expand_kv(q, f64(v), enable_gqa)
    Lq, Lk = q.shape[-2], k.shape[-2]
    blocked = torch.zeros(Lq, Lk, dtype=torch.bool)
    add = None
    m = attn_mask if attn_mask is not None else mask
    if m is not None:
        if m.dtype == torch.bool:
            blocked = (~m) if attn_mask is not None else m.clone()
        else:
            a = f64(m)
            blocked = a == -math.inf
            add = torch.where(blocked, torch.zeros_like(a), a)
            if not torch.isfinite(add).all():
                raise ValueError("additive attention mask with NaN or +inf entries")
    if is_causal:
        blocked = blocked | torch.ones(Lq, Lk, dtype=torch.bool).triu(1)
    sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _Problem(q64, k64, v64, blocked, add, sc, scale is None, rep)


# ----------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class _Model:
    prec: Precision
    sf: FloatFormat          # score format
    pf: FloatFormat          # format P is rounded to before P V
    algorithm: str
    block: int
    exp_ulps: float
    exp2: bool = False       # exp2-based shift (GPU kernels: exp2f(s c2 - fl(m c2)), module docstring)

    @property
    def c(self) -> FloatFormat:
        return self.prec.compute

    @property
    def cu(self) -> float:
        return 2.0 * self.exp_ulps * self.c.u

    def blocks(self, Lk: int) -> tuple[int, int]:
        """``(b, T)``: block length and number of key blocks (one block for "standard")."""
        b = Lk if self.algorithm == "standard" else max(1, min(self.block, Lk))
        return b, math.ceil(Lk / b)

    def pf_rounds(self) -> bool:
        return not conversion_exact(self.c, self.pf)

    def pv_products_exact(self) -> bool:
        return self.pf.precision + self.prec.storage.precision <= self.c.precision

    def describe(self) -> str:
        s = (f"{self.algorithm}" + (f" (key blocks of {self.block})" if self.algorithm == "online" else "")
             + f"; {self.prec.describe()}; scores in {self.sf}; P rounded to {self.pf} before P V; "
             f"exp within {self.exp_ulps:g} ulp" + (" (exp2 of a scaled argument)" if self.exp2 else ""))
        return s


def _model(inputs, fmt, compute_fmt, out_fmt, score_fmt, p_fmt, algorithm: str, block_size: int,
           exp_ulps: float, exp2: bool = False) -> _Model:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, not {algorithm!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    prec = resolve_precision(inputs, fmt, compute_fmt, out_fmt)
    sf = get_format(score_fmt) if score_fmt is not None else prec.compute
    pf = get_format(p_fmt) if p_fmt is not None else prec.compute
    return _Model(prec, sf, pf, algorithm, int(block_size), float(exp_ulps), bool(exp2))


def torch_cpu_sdpa_model(query: torch.Tensor, backward: bool = False) -> dict:
    """Keyword arguments that state torch's CPU ``scaled_dot_product_attention`` (the flash
    kernel it dispatches to: ``aten/src/ATen/native/cpu/FlashAttentionKernel.cpp``) as an
    attention model: online softmax over key blocks of 512, ``P`` stored in the input dtype
    before the ``P V`` GEMM, ``exp_u20`` (:data:`EXP_U20_ULPS`), fp32 accumulation. With
    ``backward=True`` also the backward kernel's choices: ``P`` recomputed from the stored
    log-sum-exp, ``D = rowsum(dO * O)``, ``dS`` stored in the input dtype, ``grad_q/k/v``
    accumulated in the input dtype across query blocks of 32/64/256 rows (by ``Lq``) and
    key blocks of 512."""
    st = get_format(query.dtype)
    kw = {"algorithm": "online", "block_size": 512, "p_fmt": st, "exp_ulps": EXP_U20_ULPS}
    if backward:
        lq = query.shape[-2]
        kw.update(delta="output", ds_fmt=st, grad_accum_fmt=st,
                  q_block_size=256 if lq >= 768 else (64 if lq >= 192 else 32))
    return kw


# ----------------------------------------------------------------------------- scores
@dataclass
class _Scores:
    s: torch.Tensor        # exact scores (float64), -inf where blocked
    sdot: torch.Tensor     # scale * q.k (float64)
    delta: torch.Tensor    # deterministic bound on |s_hat - s| (everything)
    var: torch.Tensor      # Azuma proxy (sum of squared bounds) of the martingale part
    fixed: torch.Tensor    # deterministic, non-martingale part (float64 slack, underflow)
    eps_sc: float          # common relative error of the scale constant
    depths: Depths
    ovf: torch.Tensor      # a rounding of this (negative) score may overflow to -inf: delta holds only if it does not


def _scores(pb: _Problem, md: _Model) -> _Scores:
    c, sf = md.c, md.sf
    d = pb.q.shape[-1]
    sdot = pb.scale * torch.matmul(pb.q, pb.k.transpose(-1, -2))
    sabs = pb.scale * torch.matmul(pb.q.abs(), pb.k.abs().transpose(-1, -2))
    sabs = sabs * (1 + (d + 2) * 2 * _U64)
    s = sdot if pb.add is None else sdot + pb.add
    # float64 evaluation: q.k ((d-1) levels, products exact for inputs up to fp32; d for fp64),
    # the scale product, the default scale 1/sqrt(d) (2 roundings), the mask addition
    f64err = (d + 4) * 2 * _U64 * sabs + 2 * _U64 * s.abs()
    depths: Depths = {c: d + 2}
    th, sg = theta(depths), sigma_coefficient(depths)
    eps_sc = (1 + c.u) ** 2 * (1 + 2 * _U64) ** 2 - 1
    eta = underflow_term({c: d + 2})
    lin = th * (1 + eps_sc) * sabs
    var = ((1 + th) * (1 + eps_sc) * sg * sabs) ** 2
    fixed = f64err + eta
    delta = lin + eps_sc * sdot.abs() + fixed
    ovf = torch.zeros_like(s, dtype=torch.bool)
    if pb.add is not None:
        hm, ovf = _rounding_below_overflow(s.abs() + delta, c, ovf)
        delta, var, lin = delta + hm, var + hm ** 2, lin + hm
    if not conversion_exact(c, sf):
        n_sf = 2 + (pb.add is not None)
        z = torch.maximum(s.abs(), sdot.abs())  # the product is rounded before the mask is added
        for _ in range(n_sf):
            r, ovf = _rounding_below_overflow(z + delta, sf, ovf, relative=True)
            delta, var = delta + r, var + r ** 2
    delta = torch.where(ovf & (s >= 0), torch.full_like(delta, math.inf), delta)  # +inf score: no claim
    blk = pb.blocked.expand_as(s)
    s = torch.where(blk, torch.full_like(s, -math.inf), s)
    zero = torch.zeros_like(delta)
    return _Scores(s, sdot, torch.where(blk, zero, delta), torch.where(blk, zero, var),
                   torch.where(blk, zero, fixed), eps_sc, depths, ovf & ~blk & (s < 0))


def _rounding_below_overflow(mag: torch.Tensor, f: FloatFormat, ovf: torch.Tensor, relative: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Error bound of one rounding to ``f`` of a value of magnitude ``<= mag`` *if it does not overflow*
    (``|x| < max + hu(max)`` rounds to at most ``max``: error ``<= hu_f(max)``), and the updated mask of
    values whose rounding may overflow (``mag >= max (1 + u_f)``; then the result is ``+-inf`` and the
    bound does not hold: :func:`_weights` keeps such a score only where it is dead, i.e. where a
    ``-inf`` score gives the same weight 0)."""
    m = mag.clamp(max=f.max)
    r = f.u * m if relative else half_ulp(m, f)
    return r, ovf | (mag >= f.max * (1 + f.u))


# ----------------------------------------------------------------------------- weights
def _blockify(x: torch.Tensor, T: int, b: int, fill: float) -> torch.Tensor:
    """``(..., Lk) -> (..., T, b)``, padding the last block with ``fill``."""
    pad = T * b - x.shape[-1]
    if pad:
        x = torch.cat([x, x.new_full(x.shape[:-1] + (pad,), fill)], dim=-1)
    return x.reshape(*x.shape[:-1], T, b)


def _peaked_perturbation(w: torch.Tensor, W: torch.Tensor, pu: torch.Tensor, lam: torch.Tensor,
                         lam_max: torch.Tensor) -> torch.Tensor:
    """A second rigorous bound on ``|softmax(s + lambda)_j - p_j|``, ``|lambda_k| <= Lam_k``, tight for
    dominant entries (where :func:`.softmax_jacobian.softmax_perturbation` gives ``~2 Lam`` instead of
    ``~2 (1 - p_j) Lam``): ``p'_j / p_j = 1 / (p_j + sum_{k != j} p_k e^{lambda_k - lambda_j})`` and
    ``|lambda_k - lambda_j| <= x_j = Lam_j + max Lam``, so with ``o_j >= 1 - p_j``
    ``|p'_j / p_j - 1| <= max(o_j (1 - e^{-x_j}) / (1 - o_j (1 - e^{-x_j})), o_j (e^{x_j} - 1))``.
    ``o_j = (W - w_j) / W + 2^-51`` (its float64 cancellation error is below ``2^-52``)."""
    o = ((W - w) / W + 2.0 ** -51).clamp(max=1.0)
    x = lam + lam_max
    dn = -torch.expm1(-x)
    return pu * torch.maximum(o * dn / (1 - o * dn), o * torch.expm1(x))


@dataclass
class _Weights:
    """Exact softmax statistics and the log-weight perturbation bounds of one problem."""

    valid: torch.Tensor    # (..., Lq, 1) row has an unmasked key
    blocked: torch.Tensor  # (..., Lq, Lk)
    p: torch.Tensor        # exact probabilities (float64; 0 masked / invalid rows)
    pu: torch.Tensor       # upper bound on p
    g: float               # relative float64 slack of p
    M: torch.Tensor        # (..., Lq, 1) row max (0 for invalid rows)
    L: torch.Tensor        # (..., Lq, 1) log-sum-exp M + log W
    tj: torch.Tensor       # (Lk,) block index of each key
    b: int
    T: int
    a_loc: torch.Tensor    # s - m_t(j) <= 0 (0 masked)
    ct: torch.Tensor       # (..., Lq, T) upper bound on the computed prod of later alphas, exp(m_t - M) * slack
    dt: torch.Tensor       # (..., Lq, Lk) bound on |m_hat_t(j) - m_t(j)|
    h: torch.Tensor        # shift-rounding bound h_j
    h_a: torch.Tensor      # (..., Lq, T) rescale-argument rounding bound (0 where no rescale)
    cu_a: torch.Tensor     # (..., Lq, T) exp error of the rescale factor (0 where none)
    lam: torch.Tensor      # Lam_j
    lam_max: torch.Tensor  # (..., Lq, 1)
    J: torch.Tensor        # |p' - p| bound (rigorous)
    rem: torch.Tensor      # second-order remainder of p' - p - p (lambda - p.lambda)
    eta_w: torch.Tensor    # absolute weight errors from underflowing exps (final units)
    eta_alpha: torch.Tensor  # (..., Lq, 1) absolute weight mass error from underflowing rescale factors
    W: torch.Tensor        # (..., Lq, 1)
    theta_l: float
    sigma_l: float
    b_l: torch.Tensor      # (..., Lq, 1) bound on |beta|
    W_low: torch.Tensor    # (..., Lq, 1) lower bound on the computed denominator (final units)


def _weights(sc: _Scores, md: _Model) -> _Weights:
    c = md.c
    s = sc.s
    Lk = s.shape[-1]
    b, T = md.blocks(Lk)
    blocked = ~torch.isfinite(s)
    tj = torch.arange(Lk) // b
    mrun = torch.cummax(_blockify(s, T, b, -math.inf).max(-1).values, dim=-1).values  # (..., Lq, T)
    # keys that can attain neither the exact nor the computed running max of their block (module
    # docstring, "Dead keys"): every computed running max is >= max_{k in blocks <= t} (s_k - Delta_k)
    mlow = torch.cummax(_blockify(s - sc.delta, T, b, -math.inf).max(-1).values, dim=-1).values
    cand = ~blocked & (s + sc.delta < mlow[..., tj])
    d_live = torch.where(cand, torch.zeros_like(s), sc.delta)
    M = mrun[..., -1:]
    valid = torch.isfinite(M)
    M = torch.where(valid, M, torch.zeros_like(M))
    zero = torch.zeros_like(s)
    a = torch.where(blocked, zero, s - M)
    w = torch.where(blocked, zero, torch.exp(a))
    W = w.sum(-1, keepdim=True).clamp(min=1.0)  # >= 1 on valid rows (the max contributes 1)
    p = torch.where(valid, w / W, zero)
    g = (Lk + 800) * 2.0 ** -52
    pu = (p * (1 + g)).clamp(max=1.0)
    L = M + torch.log(W)
    mt = torch.where(torch.isfinite(mrun), mrun, torch.zeros_like(mrun))
    a_loc = torch.where(blocked, zero, s - mt[..., tj])
    drun = torch.cummax(_blockify(d_live, T, b, 0.0).max(-1).values, dim=-1).values  # (..., Lq, T)
    dt = drun[..., tj]
    arg = (a_loc.abs() + sc.delta + dt) * (1 + 4 * _U64)
    if md.exp2:  # fl(s c2) (unfused), fl(m c2), the subtraction: u_c at |s|, |m_t|, |s - m_t| (natural units)
        h = c.u * (arg + (s.abs() + mt[..., tj].abs() + 2 * (sc.delta + dt)) * (1 + 4 * _U64))
    else:
        h = half_ulp(arg, c)
    h = torch.where(blocked, zero, h)
    # dead: the computed exp argument is <= X = a_loc + Delta + dt + u_c (|a_loc| + ...) (+ the exp2 terms)
    # <= log(min_normal): the computed weight and the exact one both lie in [0, min_normal (1 + c_e)]
    x_up = a_loc + sc.delta + dt + c.u * arg
    if md.exp2:
        x_up = x_up + c.u * (s.abs() + mt[..., tj].abs() + 2 * (sc.delta + dt)) * (1 + 4 * _U64)
    dead = cand & (x_up <= math.log(c.min_normal))
    h = torch.where(dead, zero, h)  # a dead key's whole error is absolute (eta_w below)
    live_ovf = (sc.ovf & ~dead).any(-1, keepdim=True)  # a live score may overflow: no finite claim on the row
    cu = md.cu
    # rescale factors alpha_r = exp(fl(m_{r-1} - m_r)), r >= 1, when m_{r-1} is finite
    fin_prev = torch.isfinite(mrun[..., :-1])
    dm = torch.where(fin_prev, mrun[..., 1:] - mrun[..., :-1], torch.zeros_like(mrun[..., 1:]))
    dm_up = dm + 2 * drun[..., 1:]
    # exp2 kernels: fl(fl(m_prev - m_cur) c2): two roundings at |dm| (natural units)
    h_a = torch.where(fin_prev, 2 * c.u * dm_up if md.exp2 else half_ulp(dm_up, c), torch.zeros_like(dm))
    cu_a = torch.where(fin_prev, torch.full_like(dm, cu), torch.zeros_like(dm))
    pad0 = torch.zeros_like(mrun[..., :1])
    h_a, cu_a = torch.cat([pad0, h_a], -1), torch.cat([pad0, cu_a], -1)
    per = h_a + torch.where(cu_a > 0, torch.full_like(cu_a, _L(cu)), torch.zeros_like(cu_a))
    A = per.flip(-1).cumsum(-1).flip(-1) - per  # sum over r > t
    lam = torch.where(blocked | dead, zero, sc.delta + h + _L(cu) + A[..., tj])
    lam = torch.where(live_ovf & ~blocked, torch.full_like(lam, math.inf), lam)
    lam_max = lam.max(-1, keepdim=True).values
    J = torch.where(valid, torch.minimum(softmax_perturbation(pu, lam, -1), _peaked_perturbation(w, W, pu, lam, lam_max)),
                    zero)
    rho = torch.expm1(lam) - lam
    pL = (pu * lam).sum(-1, keepdim=True)
    prho = (pu * rho).sum(-1, keepdim=True)
    Mv = pL + prho
    rem = pu * (rho + prho + Mv * (lam + pL)) / (1 - Mv)
    rem = torch.where((Mv >= 1).expand_as(rem), torch.full_like(rem, math.inf), rem)
    rem = torch.where(valid & ~blocked, rem, zero)
    # products of the computed rescale factors above block t, in final units
    ct = torch.exp(mt - M + A + drun + drun[..., -1:])
    # exps that may fall below 2 min_normal: absolute error 2 min_normal (flush to zero allowed)
    tiny = 2 * c.min_normal
    under = ~blocked & (torch.exp(a_loc - sc.delta - dt - h) < tiny)
    eta_w = torch.where(under, tiny * ct[..., tj], zero)
    under_a = fin_prev & (torch.exp(-(dm + 2 * drun[..., 1:]) - h_a[..., 1:]) < tiny)
    n_before = (torch.arange(1, T) * b).to(s.dtype)
    eta_alpha = (under_a * tiny * n_before * torch.exp(lam_max)).sum(-1, keepdim=True) if T > 1 else pad0
    depth_l = (b - 1 + 2 * (T - 1)) if T > 1 else Lk - 1
    dl: Depths = {c: depth_l} if depth_l > 0 else {}
    th_l, sg_l = theta(dl), sigma_coefficient(dl)
    eta_l = underflow_term({c: Lk + 2 * T})
    W0 = W * torch.exp(-lam_max) - eta_w.sum(-1, keepdim=True) - eta_alpha
    b_l = th_l + (eta_l + eta_alpha) / W0
    b_l = torch.where(b_l < 1, b_l, torch.full_like(b_l, math.inf))
    W_low = W0 * (1 - b_l)
    return _Weights(valid, blocked, p, pu, g, M, L, tj, b, T, a_loc, ct, dt, h, h_a, cu_a, lam, lam_max, J, rem,
                    eta_w, eta_alpha, W, th_l, sg_l, b_l, W_low)


# ----------------------------------------------------------------------------- forward bound
def _centred_abs(A: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """``min_c A @ |V - c|`` over ``c`` in {0, column median of V}: valid for ``sum_j dA_j v_j``
    whenever ``sum_j dA_j = 0`` and ``|dA| <= A`` (non-negative ``A``)."""
    med = V.median(dim=-2, keepdim=True).values
    return torch.minimum(torch.matmul(A, V.abs()), torch.matmul(A, (V - med).abs()))


def _centred_sq(q2: torch.Tensor, V: torch.Tensor, O: torch.Tensor) -> torch.Tensor:
    """Upper bound on ``sum_j q2_j (v_j - O)^2`` (``q2 >= 0``) from three matmuls; the float64
    cancellation error (``<= 4 (n + 2) 2^-52`` times the uncancelled magnitude) is added."""
    n = q2.shape[-1]
    a = torch.matmul(q2, V * V)
    b = torch.matmul(q2, V)
    c = q2.sum(-1, keepdim=True)
    val = a - 2 * O * b + O * O * c
    mag = a + 2 * O.abs() * torch.matmul(q2, V.abs()) + O * O * c
    return val.clamp(min=0) + 4 * (n + 2) * 2.0 ** -52 * mag


def _depth(n: int, extra: int, c: FloatFormat) -> tuple[float, float]:
    d = n + extra
    dd: Depths = {c: d} if d > 0 else {}
    return theta(dd), sigma_coefficient(dd)


def _forward(pb: _Problem, md: _Model, sc: _Scores, wt: _Weights, mode: str, lam: float
             ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(bound, |O| upper, values)`` of the forward output (module docstring)."""
    c, u, cu = md.c, md.c.u, md.cu
    V = pb.v
    Lk = pb.Lk
    Va = V.abs()
    p, pu, J = wt.p, wt.pu, wt.J
    O = torch.matmul(p, V)
    Oabs = O.abs() + (wt.g + (Lk + 2) * 2.0 ** -52) * torch.matmul(pu, Va)
    vmax = Va.max(dim=-2, keepdim=True).values
    E_eta = (torch.matmul(wt.eta_w, Va) + (wt.eta_w.sum(-1, keepdim=True) + 2 * wt.eta_alpha) * vmax) / wt.W_low
    E1 = _centred_abs(J, V)
    pJ = pu + J
    b_l = wt.b_l
    K = (1 + u) / (1 - b_l) - 1
    f2 = u * b_l + (1 + u) * b_l * b_l / (1 - b_l)
    exact_pv = md.pv_products_exact()
    zero = torch.zeros_like(p)
    pf_rounds = md.pf_rounds()
    if md.algorithm == "standard":
        th_o, sg_o = _depth(Lk - 1, 0 if exact_pv else 1, c)
        eta_o = underflow_term({c: Lk})
        Obar = Oabs + E1 + E_eta
        pbar = pJ * (1 + K) * (1 + u) + wt.eta_w / wt.W_low
        rho = torch.where(wt.blocked, zero, half_ulp(pbar, md.pf)) if pf_rounds else zero
        S = torch.matmul(pbar + rho, Va)
        det = (E1 + K * Obar + u * (1 + K) * torch.matmul(pJ, Va) + torch.matmul(rho, Va) + th_o * S + eta_o
               + E_eta)
        if mode == "probabilistic":
            var_o = ((u * Obar) ** 2 + ((1 + wt.theta_l) * wt.sigma_l * Obar) ** 2
                     + (u * (1 + K)) ** 2 * torch.matmul(pJ * pJ, V * V) + torch.matmul(rho * rho, V * V)
                     + ((1 + th_o) * sg_o * S) ** 2)
            rem_o = f2 * Obar + eta_o + E_eta
    else:
        T = wt.T
        th_o, sg_o = _depth(Lk - 1, (T - 1) + (0 if exact_pv else 1), c)
        eta_o = underflow_term({c: Lk + T}) / wt.W_low
        Kr = K
        if pf_rounds:
            ebar = torch.exp(wt.a_loc + sc.delta + wt.dt + wt.h) * (1 + cu) + 2 * c.min_normal
            rho = torch.where(wt.blocked, zero, half_ulp(ebar, md.pf) * wt.ct[..., wt.tj] / wt.W_low)
        else:
            rho = zero
        rV = torch.matmul(rho, Va)
        S = torch.matmul(pJ + rho, Va) + eta_o
        X0 = Oabs + E1 + rV + E_eta
        det = E1 + rV + Kr * X0 + (1 + Kr) * (th_o * S + u * (X0 + th_o * S)) + E_eta
        if mode == "probabilistic":
            var_o = (torch.matmul(rho * rho, V * V) + (u * X0) ** 2 + ((1 + wt.theta_l) * wt.sigma_l * X0) ** 2
                     + ((1 + th_o) * sg_o * (1 + Kr) * S) ** 2 + (u * (1 + Kr) * (X0 + th_o * S)) ** 2)
            rem_o = f2 * X0 + E_eta + (1 + Kr) * eta_o
    values = {"Lk": Lk, "theta_scores": theta(sc.depths), "theta_l": wt.theta_l, "theta_pv": th_o,
              "max_Lambda": float(wt.lam_max[wt.valid].max()) if wt.valid.any() else 0.0,
              "max_b_l": float(b_l[wt.valid].max()) if wt.valid.any() else 0.0}
    if mode == "probabilistic":
        var_tot = torch.where(wt.blocked, zero, sc.var + wt.h ** 2 + cu * cu)
        v_lin = _centred_sq(pu * pu * var_tot, V, O) + var_o
        L2 = _L(cu) - cu
        spread = torch.sqrt(_centred_sq(pu, V, O))  # >= sum_j p_j |v_j - O| (Cauchy-Schwarz, sum p = 1)
        rem = _centred_abs(wt.rem, V) + L2 * spread + rem_o
        if wt.T > 1:
            v_a, g_sum = _rescale_terms(wt, V, O)
            v_lin = v_lin + v_a
            rem = rem + L2 * g_sum
        # common scale-constant error and the deterministic parts of the score errors
        ps = pu * torch.where(wt.blocked, zero, sc.sdot)
        rem = rem + sc.eps_sc * ((torch.matmul(ps, V) - O * ps.sum(-1, keepdim=True)).abs()
                                 + 4 * (Lk + 2) * 2.0 ** -52 * (torch.matmul(ps.abs(), Va)
                                                               + Oabs * ps.abs().sum(-1, keepdim=True)))
        pfx = pu * sc.fixed
        rem = rem + torch.matmul(pfx, Va) + Oabs * pfx.sum(-1, keepdim=True)
        det = torch.minimum(det, lam * torch.sqrt(v_lin) + rem)
        values["lambda"] = lam
    det = torch.where(torch.isnan(det), torch.full_like(det, math.inf), det)
    tot = det + output_rounding(Oabs + det, c, md.prec.out)
    tot = torch.where(wt.valid, tot * (1 + _EVAL_SLACK), torch.zeros_like(tot))
    return tot, Oabs, values


def _rescale_terms(wt: _Weights, V: torch.Tensor, O: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online algorithm: ``(sum_r G_r^2 (h_alpha_r^2 + c_e^2), sum_r |G_r|)`` with ``G_r = sum_{j in
    blocks < r} p_j (v_j - O)`` (exclusive block prefix sums, float64 slack added)."""
    T, b = wt.T, wt.b
    pb = _blockify(wt.p, T, b, 0.0)                                       # (..., Lq, T, b)
    Vb = _blockify(V.transpose(-1, -2), T, b, 0.0)                        # (..., n, T, b)
    C = torch.einsum("...qtb,...ntb->...qtn", pb, Vb)
    Ca = torch.einsum("...qtb,...ntb->...qtn", pb, Vb.abs())
    Pc = pb.sum(-1)                                                       # (..., Lq, T)
    pre = lambda x, dim: x.cumsum(dim) - x
    Cp, Cap, Pp = pre(C, -2), pre(Ca, -2), pre(Pc, -1)
    Ou = O.unsqueeze(-2)                                                  # (..., Lq, 1, n)
    G = (Cp - Ou * Pp.unsqueeze(-1)).abs() + (wt.g + 4 * (wt.p.shape[-1] + 2) * 2.0 ** -52) * (
        Cap + Ou.abs() * Pp.unsqueeze(-1))
    w2 = (wt.h_a ** 2 + wt.cu_a ** 2).unsqueeze(-1)
    return (G * G * w2).sum(-2), (G * (wt.cu_a > 0).unsqueeze(-1)).sum(-2)


def _mask_kwargs(attn_mask, mask, is_causal, causal):
    """``(attn_mask, mask, causal)``; ``attn_mask`` with ``is_causal`` is rejected: torch's math backend
    raises there while its CPU flash kernel silently applies both (measured, torch 2.13), so the
    intent is ambiguous."""
    if attn_mask is not None and (is_causal or causal):
        raise ValueError("attention: attn_mask together with is_causal=True is ambiguous (torch's math backend "
                         "rejects it, its CPU flash kernel applies both): fold the causal mask into attn_mask, or "
                         "pass mask= (True = masked out) with causal=True to apply both")
    return attn_mask, mask, bool(is_causal or causal)


def _kernel_models(inputs, fmt, compute_fmt, out_fmt, score_fmt, Lk: int) -> list[_Model]:
    """The default model of :func:`attention`: one model per kernel it covers (module docstring,
    "Default: the kernels torch runs"), duplicates (same blocks for this ``Lk``) removed."""
    math_backend = _model(inputs, fmt, compute_fmt, out_fmt, score_fmt, None, "standard", 128, GPU_EXP_ULPS)
    st = math_backend.prec.storage
    members = [math_backend,
               _model(inputs, fmt, compute_fmt, out_fmt, score_fmt, st, "online", 512, EXP_U20_ULPS)]
    members += [_model(inputs, fmt, compute_fmt, out_fmt, score_fmt, st, "online", b, GPU_EXP_ULPS, exp2=True)
                for b in GPU_BLOCK_SIZES]
    out, seen = [], set()
    for md in members:
        key = (md.algorithm, md.blocks(Lk), md.exp_ulps, md.exp2)
        if key not in seen:
            seen.add(key)
            out.append(md)
    return out


@register("attention", "scaled_dot_product_attention", "sdpa")
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask: torch.Tensor | None = None,
              mask: torch.Tensor | None = None, is_causal: bool = False, causal: bool = False,
              scale: float | None = None, enable_gqa: bool = False, algorithm: str | None = None,
              block_size: int | None = None, fmt=None, compute_fmt=None, out_fmt=None, score_fmt=None, p_fmt=None,
              exp_ulps: float | None = None, mode: str = "deterministic",
              failure_probability: float | None = None) -> Bound:
    """Elementwise bound on ``|O_hat - O|`` for ``O = softmax(scale q k^T + mask) v`` (module docstring).

    Args:
        q, k, v: ``(..., Hq, Lq, d)``, ``(..., Hkv, Lk, d)``, ``(..., Hkv, Lk, dv)`` (stored values,
            taken exactly); ``Hq = Hkv`` unless ``enable_gqa`` (grouped heads, torch's
            ``repeat_interleave`` semantics).
        attn_mask: as ``torch.nn.functional.scaled_dot_product_attention``: bool (**True =
            attend**) or an additive float mask (``-inf`` entries are masked out exactly; very
            negative finite entries such as ``-1e9`` or ``finfo.min`` give dead keys: module
            docstring). Not together with ``is_causal`` (torch rejects it too).
        mask: the same with the opposite boolean convention (**True = masked out**); give at
            most one of ``attn_mask``/``mask``; ``mask`` may be combined with ``causal``.
        is_causal / causal: top-left causal mask (key ``j`` attends query ``i`` iff ``j <= i``).
        scale: default ``1/sqrt(d)`` (exact value); a finite number otherwise.
        algorithm: ``None`` (default): the union of the kernels torch and the GPU libraries run
            (the elementwise maximum of the bounds of :func:`_kernel_models`: the math backend,
            torch's CPU flash kernel, FlashAttention-2 and the memory-efficient kernel with their
            key blocks, ``P`` rounded to the input dtype, their exp). ``"standard"``
            (materialised softmax) or ``"online"`` (flash, key blocks of ``block_size``, default
            128) states one kernel exactly, and tighter (:func:`torch_cpu_sdpa_model`).
        fmt / compute_fmt / out_fmt: storage, compute (default fp32 for narrower storage)
            and output formats; ``score_fmt``: format of the stored scores (default compute);
            ``p_fmt``: format ``P`` is rounded to before ``P V`` (with a stated ``algorithm``:
            default compute; flash kernels use the input dtype).
        exp_ulps: accuracy of the compute format's exp (with a stated ``algorithm``: default 1;
            torch CPU flash: :data:`EXP_U20_ULPS`).

    Fully masked rows: the output is defined as 0 (torch's convention) and the bound is 0.
    """
    attn_mask, mask, causal = _mask_kwargs(attn_mask, mask, is_causal, causal)
    ms = resolve_mode(mode, failure_probability)
    pb = _problem(q, k, v, attn_mask, mask, causal, scale, enable_gqa)
    if algorithm is None and block_size is None and p_fmt is None and exp_ulps is None:
        models = _kernel_models((q, k, v), fmt, compute_fmt, out_fmt, score_fmt, pb.Lk)
    else:
        models = [_model((q, k, v), fmt, compute_fmt, out_fmt, score_fmt, p_fmt, algorithm or "standard",
                         128 if block_size is None else block_size, 1.0 if exp_ulps is None else exp_ulps)]
    sc = _scores(pb, models[0])  # the scores depend on the formats only, shared by every member
    bound = mag = values = None
    for md in models:
        b, m, vals = _forward(pb, md, sc, _weights(sc, md), ms.mode, ms.lam)
        if bound is None or len(models) == 1:
            bound, mag, values = b, m, vals
        else:
            bound, mag = torch.maximum(bound, b), torch.maximum(mag, m)
    described = "; or ".join(md.describe() for md in models)
    values.update(model=described, scale=pb.scale)
    formula = ("E1 + normalisation + P rounding + P V accumulation (module docstring), E1 = min_c |p' - p| @ |V - c| "
               "with |p' - p| <= softmax perturbation bound of Lam = Delta_score + h + L(c_e) [+ rescales]; "
               "+ hu_out(|O| + E)")
    if len(models) > 1:
        formula = "max over the kernels of: " + formula
    if ms.mode == "probabilistic":
        formula += "; or lambda sqrt(sum of squared predictable coefficients) + second-order remainder, if smaller"
    assumptions = [("any of: " if len(models) > 1 else "") + described,
                   "inputs exact as stored; any summation order in every sum",
                   "fully masked rows: output defined as 0 (bound 0)",
                   "dead keys (weight below the compute format's min normal in every correct computation): "
                   "absolute error only"]
    if ms.mode == "probabilistic":
        assumptions.append("rounding and exp errors mean-independent in the stated topological order "
                           "(Higham-Mary model)")
    return Bound(abs=bound, mode=ms.mode, failure_probability=ms.failure_probability, magnitude=mag,
                 explanation=Explanation(op="attention", formula=formula, source=SOURCE,
                                         assumptions=tuple(assumptions), values=values))


# ----------------------------------------------------------------------------- backward
class AttentionGrads(NamedTuple):
    """Bounds on the three input gradients of attention."""

    dq: Bound
    dk: Bound
    dv: Bound


@dataclass
class _Err:
    """Elementwise error bound of a backward intermediate. ``b``: its bound (in probabilistic
    mode, holding with the stated probability). Probabilistic mode also keeps the split used to
    propagate it through a GEMM: ``err = lin + r`` with ``|r| <= rest`` and ``lin`` a martingale of
    roundings private to the entry (no two entries share one) with Azuma proxy ``sig2``, so that
    ``sum_j B_j lin_j`` is one martingale with proxy ``sum_j B_j^2 sig2_j``."""

    b: torch.Tensor
    sig2: torch.Tensor | None = None
    rest: torch.Tensor | None = None

    def rounded(self, h: torch.Tensor) -> _Err:
        """One more rounding with error ``<= h`` (private to the entry)."""
        if self.sig2 is None:
            return _Err(self.b + h)
        return _Err(self.b + h, self.sig2 + h * h, self.rest)


def _stored_p(sc: _Scores, wt: _Weights, md: _Model, mode: str, lam: float) -> _Err:
    """``|p_hat - p|`` for the standard algorithm's softmax output in ``c`` (the forward derivation
    with ``V = I``: ``p_hat_j - p_j = p_j (lambda_j - p.lambda) + p_j (delta_r - beta + delta_y_j) +
    rem_j``). Private part: ``p_j lambda_j``, ``p'_j delta_y_j``; the rest: the row-common ``p_j (p.lambda
    - delta_r + beta)`` (its own Azuma event) and the second-order terms."""
    u, cu = md.c.u, md.cu
    p, pu, J = wt.p, wt.pu, wt.J
    K = (1 + u) / (1 - wt.b_l) - 1
    pJ = pu + J
    eta = wt.eta_w / wt.W_low
    det = J + pJ * ((1 + K) * (1 + u) - 1) + eta
    if mode != "probabilistic":
        return _Err(det)
    zero = torch.zeros_like(p)
    x = torch.where(wt.blocked, zero, sc.var + wt.h ** 2 + cu * cu)
    norm2 = u * u + ((1 + wt.theta_l) * wt.sigma_l) ** 2
    # coefficient of lambda_k in p'_j: p_j (delta_jk - p_k)
    others = ((pu * pu * x).sum(-1, keepdim=True) - p * p * x).clamp(min=0)
    var = pu * pu * ((1 - p) ** 2 * x + others) + pJ * pJ * (norm2 + ((1 + K) * u) ** 2)
    sd = torch.where(wt.blocked, zero, sc.sdot)
    common = sc.eps_sc * ((sd - (pu * sd).sum(-1, keepdim=True)).abs() + 4 * (sd.shape[-1] + 2) * 2.0 ** -52
                          * (sd.abs() + (pu * sd.abs()).sum(-1, keepdim=True)))
    fixed = sc.fixed + (pu * sc.fixed).sum(-1, keepdim=True)
    f2 = u * wt.b_l + (1 + u) * wt.b_l ** 2 / (1 - wt.b_l)
    rem = wt.rem + 2 * pu * (_L(cu) - cu) + pu * (common + fixed) + f2 * pJ + eta
    b = torch.minimum(det, lam * torch.sqrt(var) + rem)
    sig2 = pu * pu * x + ((1 + K) * pJ * u) ** 2
    row = lam * torch.sqrt((pu * pu * x).sum(-1, keepdim=True) + norm2)
    return _Err(b, sig2, pJ * row + rem)


def _recomputed_p(sc: _Scores, wt: _Weights, md: _Model, log_ulps: float, mode: str, lam: float) -> _Err:
    """``|P_hat - p|`` for ``P_hat = exp_c(fl_c(s_hat - L_hat))``, ``L_hat`` the forward's stored
    log-sum-exp ``fl_c(m_hat + fl_c(log_c l_hat))`` (module docstring). Private part: ``p_j (Delta s_j +
    tau'_j + eps_j)``; the rest: ``p_j |L_hat - L|`` (a separate Azuma event over the forward's
    roundings) and the second-order terms."""
    c, u, cu = md.c, md.c.u, md.cu
    p, pu = wt.p, wt.pu
    zero = torch.zeros_like(p)
    clog = 2.0 * log_ulps * u
    dmax = sc.delta.max(-1, keepdim=True).values
    lse_pert = torch.log((pu * torch.exp(wt.lam)).sum(-1, keepdim=True)).clamp(min=0)  # >= |log sum p e^lambda|
    dL_pre = lse_pert + torch.log1p(-wt.b_l).neg()
    lmag = torch.log(wt.W) + dmax + dL_pre
    fin = clog * lmag + half_ulp((wt.M.abs() + dmax + lmag * (1 + clog)) * (1 + 4 * _U64), c)
    dL = dL_pre + fin
    if mode == "probabilistic":
        x = torch.where(wt.blocked, zero, sc.var + wt.h ** 2 + cu * cu)
        v = (pu * pu * x).sum(-1, keepdim=True) + ((1 + wt.theta_l) * wt.sigma_l) ** 2
        if wt.T > 1:
            pre = _blockify(pu, wt.T, wt.b, 0.0).sum(-1)
            pre = pre.cumsum(-1) - pre
            v = v + (pre * pre * (wt.h_a ** 2 + wt.cu_a ** 2)).sum(-1, keepdim=True)
        pL = (pu * wt.lam).sum(-1, keepdim=True)
        rho = torch.expm1(wt.lam + pL) - wt.lam - pL
        sd = torch.where(wt.blocked, zero, sc.sdot)
        rem_L = ((pu * rho).sum(-1, keepdim=True) + (-torch.log1p(-wt.b_l) - wt.b_l) + (_L(cu) - cu) * wt.T
                 + sc.eps_sc * (pu * sd.abs()).sum(-1, keepdim=True) + (pu * sc.fixed).sum(-1, keepdim=True))
        dL = torch.minimum(dL, lam * torch.sqrt(v) + rem_L + fin)
    a = torch.where(wt.blocked, zero, sc.s - wt.L)  # s - L (float64: error <= 2^-53 (|s| + |L|) + log's)
    a_up = (a.abs() + sc.delta + dL) * (1 + 4 * _U64) + 4 * _U64 * (wt.L.abs() + 1)
    hp = torch.where(wt.blocked, zero, half_ulp(a_up, c))
    Y = sc.delta + hp + dL + wt.g
    tiny = 2 * c.min_normal
    eta = torch.where(~wt.blocked & (torch.exp(a - Y) < tiny), torch.full_like(p, tiny), zero)
    live = wt.valid & ~wt.blocked
    det = torch.where(live, pu * (torch.expm1(Y) * (1 + cu) + cu) + eta, zero)
    if mode != "probabilistic":
        return _Err(det)
    sig2 = torch.where(live, pu * pu * (sc.var + hp ** 2 + cu * cu), zero)
    sd = torch.where(wt.blocked, zero, sc.sdot)
    rest = pu * (dL + sc.fixed + sc.eps_sc * sd.abs() + wt.g + torch.expm1(Y) - Y + torch.expm1(Y) * cu) + eta
    rest = torch.where(live, rest, zero)
    return _Err(torch.minimum(det, lam * torch.sqrt(sig2) + rest), sig2, rest)


def _slack(n: int) -> float:
    """Relative float64 evaluation slack of an ``n``-term sum of products (times the uncancelled magnitude)."""
    return (n + 4) * 2.0 ** -52


def _private_sum(S: torch.Tensor, n: int, c: FloatFormat, exact_products: bool) -> tuple[torch.Tensor, float]:
    """``(sig2, eta)`` of an ``n``-term sum in ``c`` (any order) with ``sum |terms| <= S``: its
    rounding errors, private to the output entry, form a martingale with Azuma proxy
    ``((1 + theta) sigma S)^2`` (:mod:`.summation`); ``eta`` bounds the underflow part."""
    dd: Depths = {c: n - 1 + (0 if exact_products else 1)} if n > 1 or not exact_products else {}
    return ((1 + theta(dd)) * sigma_coefficient(dd) * S) ** 2, underflow_term({c: n})


def _gemm(A: torch.Tensor, eA: _Err, A_mag: torch.Tensor, B: torch.Tensor, summ: Summation, out: FloatFormat,
          mode: str, lam: float, exact_products: bool, scale: float = 1.0, eps_sc: float = 0.0,
          scaled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bound, |value| upper)`` for ``fl_out(scale (A_hat @ B))`` with ``|A_hat - A| <= eA.b``, ``|A| <=
    A_mag`` (float64 magnitudes), ``B`` exact: propagated ``scale (eA.b @ |B|) + eps_sc |value|`` plus the
    local :func:`.summation.sum_error_bound` on the computed operands (two more levels for the
    scaling). Probabilistic: also ``scale (lambda sqrt(eA.sig2 @ B^2) + eA.rest @ |B|)`` for the
    propagated part (the entries' private errors form one martingale), whichever is smaller."""
    n = A.shape[-1]
    Ba = B.abs()
    bA = eA.b
    val = scale * torch.matmul(A, B)
    unc = scale * torch.matmul(A_mag, Ba)
    mag = val.abs() + _slack(n) * unc + (unc - scale * torch.matmul(A.abs(), Ba)).clamp(min=0)
    prop = scale * (1 + eps_sc) * torch.matmul(bA, Ba)
    if eA.sig2 is not None:
        prop = torch.minimum(prop, scale * (1 + eps_sc) * (lam * torch.sqrt(torch.matmul(eA.sig2, Ba * Ba))
                                                           + torch.matmul(eA.rest, Ba)))
    prop = prop + eps_sc * mag
    S = scale * (1 + eps_sc) * (unc + torch.matmul(bA, Ba)) * (1 + _slack(n))
    T = None
    if summ.split > 1:  # partial sums of the computed terms: exact-operand partials + the operands' uncertainty
        T = partial_abs_sum(A, B, None, summ, unc * (1 + _slack(n)) / scale)
        T = scale * (1 + eps_sc) * (T * (1 + _slack(n)) + torch.matmul((A_mag - A.abs()).clamp(min=0) + bA, Ba))
    extra: Depths = {}
    if summ.split > 1:
        extra[summ.accum] = summ.parts(n)  # the carried addition of each block in the accumulation format
    if scaled:  # fl(scale * sum), a GEMM alpha, or (math backend) k sqrt(scale) rounded then times sqrt(scale)
        extra[summ.accum] = extra.get(summ.accum, 0) + 2
    acc, _ = sum_error_bound(S, mag + prop, n, summ, out, mode, lam, exact_products, extra_depths=extra or None,
                             partial_abs_sum=T)
    return prop + acc, mag


def _grad_summation(md: _Model, n: int, block: int | None, accum_fmt) -> Summation:
    if accum_fmt is None or block is None or block >= n:
        return Summation(accum=md.c)
    return Summation(accum=md.c, split=math.ceil(n / block), reduce_fmt=get_format(accum_fmt),
                     reduce_algorithm="recursive")


def _group(bound: torch.Tensor, mag: torch.Tensor, rep: int, md: _Model, mode: str, lam: float) -> torch.Tensor:
    """GQA: the ``rep`` consecutive query heads of a key/value head are summed (in ``c``, then ``out``)."""
    if rep == 1:
        return bound
    b = bound.reshape(*bound.shape[:-3], bound.shape[-3] // rep, rep, *bound.shape[-2:]).sum(-3)
    m = mag.reshape(*mag.shape[:-3], mag.shape[-3] // rep, rep, *mag.shape[-2:]).sum(-3)
    acc, _ = sum_error_bound(m + b, m + b, rep, Summation(accum=md.c), md.prec.out, mode, lam)
    return b + acc


def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, *,
                       attn_mask: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                       is_causal: bool = False, causal: bool = False, scale: float | None = None,
                       enable_gqa: bool = False, algorithm: str = "standard", block_size: int = 128,
                       delta: str | None = None, fmt=None, compute_fmt=None, out_fmt=None, score_fmt=None,
                       p_fmt=None, ds_fmt=None, grad_accum_fmt=None, q_block_size: int | None = None,
                       exp_ulps: float = 1.0, log_ulps: float = 1.0, mode: str = "deterministic",
                       failure_probability: float | None = None) -> AttentionGrads:
    """Elementwise bounds on the computed ``(dQ, dK, dV)`` of attention (module docstring, "Backward").

    Forward keywords as :func:`attention`. ``algorithm`` selects where ``P`` comes from:
    ``"standard"``: the stored softmax output (``p_fmt``-rounded: the tensor the forward's
    ``P V`` used); ``"online"``: recomputed from the stored log-sum-exp. ``delta``:
    ``"output"`` (``D = rowsum(dO * O)``, default for online) or ``"probs"`` (``rowsum(P * dP)``,
    default for standard). ``ds_fmt``: format ``dS`` is rounded to before the ``dQ``/``dK``
    GEMMs (default ``p_fmt``). ``grad_accum_fmt`` with ``q_block_size`` (``dK``, ``dV``) and
    ``block_size`` (``dQ``): gradients accumulated across blocks in that format (torch CPU
    flash: the storage dtype; :func:`torch_cpu_sdpa_model` with ``backward=True``).
    ``log_ulps``: accuracy of the log of the stored log-sum-exp (online). Probabilistic: every
    sub-bound uses ``failure_probability / n_ev`` (union bound over the events one output uses).
    """
    attn_mask, mask, causal = _mask_kwargs(attn_mask, mask, is_causal, causal)
    md = _model((q, k, v), fmt, compute_fmt, out_fmt, score_fmt, p_fmt, algorithm, block_size, exp_ulps)
    ms = resolve_mode(mode, failure_probability)
    delta = delta or ("probs" if algorithm == "standard" else "output")
    if delta not in ("output", "probs"):
        raise ValueError(f"delta must be 'output' or 'probs', not {delta!r}")
    dsf = get_format(ds_fmt) if ds_fmt is not None else md.pf
    pb = _problem(q, k, v, attn_mask, mask, causal, scale, enable_gqa)
    c, st, out = md.c, md.prec.storage, md.prec.out
    Lq, Lk, dv_ = pb.Lq, pb.Lk, pb.v.shape[-1]
    n_ev = 3 * max(Lq, Lk) + dv_ + 4
    lam = lambda_for(ms.failure_probability / n_ev) if ms.mode == "probabilistic" else math.inf
    sc = _scores(pb, md)
    wt = _weights(sc, md)
    zero = torch.zeros_like(wt.p)
    # P used by the backward (c), and P~ (pf) in the dV GEMM
    live = wt.valid & ~wt.blocked
    hpf = (lambda e: torch.where(live, half_ulp(wt.pu + e.b, md.pf), zero)) if md.pf_rounds() else None
    if algorithm == "standard":
        eP = _stored_p(sc, wt, md, ms.mode, lam)
        if hpf is not None:  # the stored softmax output is the tensor P V used
            eP = eP.rounded(hpf(eP))
        ePt = eP
    else:
        eP = _recomputed_p(sc, wt, md, log_ulps, ms.mode, lam)
        ePt = eP.rounded(hpf(eP)) if hpf is not None else eP
    P, Pu = wt.p, wt.pu
    bP = eP.b
    do = f64(grad_out)
    V, K, Q = pb.v, pb.k, pb.q
    prob = ms.mode == "probabilistic"
    # dP = dO V^T (c, no output rounding)
    dp_exact = 2 * st.precision <= c.precision
    b_dP, dP_mag = _gemm(do, _Err(torch.zeros_like(do)), do.abs(), V.transpose(-1, -2), Summation(accum=c), c,
                         ms.mode, lam, dp_exact)
    dP = torch.matmul(do, V.transpose(-1, -2))
    # D
    if delta == "output":
        bO, Oabs, _ = _forward(pb, md, sc, wt, ms.mode, lam)
        O = torch.matmul(P, V)
        prop = (do.abs() * bO).sum(-1, keepdim=True)
        S = (do.abs() * (Oabs + bO)).sum(-1, keepdim=True) * (1 + _slack(dv_))
        D = (do * O).sum(-1, keepdim=True)
        D_mag = D.abs() + _slack(dv_) * S
        acc, _ = sum_error_bound(S, D_mag + prop, dv_, Summation(accum=c), c, ms.mode, lam,
                                 st.precision + out.precision <= c.precision)
    else:
        prop = (bP * dP_mag + (Pu + bP) * b_dP).sum(-1, keepdim=True)
        S = ((Pu + bP) * (dP_mag + b_dP)).sum(-1, keepdim=True) * (1 + _slack(Lk))
        D = (P * dP).sum(-1, keepdim=True)
        D_mag = D.abs() + (_slack(Lk) + wt.g) * (Pu * dP_mag).sum(-1, keepdim=True)
        acc, _ = sum_error_bound(S, D_mag + prop, Lk, Summation(accum=c), c, ms.mode, lam, False)
    b_D = prop + acc
    # dS = fl_dsf(fl_c(P fl_c(dP - D)))
    g = dP - D
    g_mag = g.abs() + (dP_mag - dP.abs()) + (D_mag - D.abs()) + 2 * _U64 * (dP_mag + D_mag)
    b_g = b_dP + b_D
    h_g = half_ulp(g_mag + b_g, c)
    b_g = b_g + h_g
    dS = P * g
    dS_mag = Pu * g_mag * (1 + 2 * _U64)
    b_dS = bP * g_mag + (Pu + bP) * b_g
    h_s = half_ulp(dS_mag + b_dS, c)
    if not conversion_exact(c, dsf):
        h_s = h_s + half_ulp(dS_mag + b_dS + h_s, dsf)
    eS = _Err(torch.where(live, b_dS + h_s, zero))
    if prob:  # private parts: P's, dP's GEMM roundings, the two roundings; rest: D, P's common part, 2nd order
        sig2_dP, eta_dP = _private_sum(torch.matmul(do.abs(), V.abs().transpose(-1, -2)) * (1 + _slack(dv_)), dv_,
                                       c, dp_exact)
        sig2 = g_mag ** 2 * eP.sig2 + Pu * Pu * (sig2_dP + h_g ** 2) + h_s ** 2
        rest = g_mag * eP.rest + Pu * (eta_dP + b_D) + bP * b_g
        eS = _Err(eS.b, torch.where(live, sig2, zero), torch.where(live, rest, zero))
    dS_mag = torch.where(live, dS_mag, zero)
    # the three GEMMs
    ds_exact = dsf.precision + st.precision <= c.precision
    s_dq = _grad_summation(md, Lk, block_size, grad_accum_fmt)
    s_kv = _grad_summation(md, Lq, q_block_size, grad_accum_fmt)
    tr = lambda e: _Err(*(None if x is None else x.transpose(-1, -2) for x in (e.b, e.sig2, e.rest)))
    b_dq, _ = _gemm(dS, eS, dS_mag, K, s_dq, out, ms.mode, lam, ds_exact, pb.scale, sc.eps_sc, scaled=True)
    b_dk, dk_mag = _gemm(dS.transpose(-1, -2), tr(eS), dS_mag.transpose(-1, -2), Q, s_kv, out, ms.mode, lam,
                         ds_exact, pb.scale, sc.eps_sc, scaled=True)
    b_dv, dv_mag = _gemm(P.transpose(-1, -2), tr(ePt), Pu.transpose(-1, -2), do, s_kv, out, ms.mode, lam,
                         md.pf.precision + st.precision <= c.precision)
    b_dk = _group(b_dk, dk_mag, pb.rep, md, ms.mode, lam)
    b_dv = _group(b_dv, dv_mag, pb.rep, md, ms.mode, lam)
    source_p = "stored softmax output" if algorithm == "standard" else "recomputed from lse"
    assumptions = (md.describe(),
                   (f"P {source_p}; D from {'dO . O' if delta == 'output' else 'P . dP'}; dS in {dsf}; "
                    f"GEMMs: dQ {s_dq.describe()}, dK/dV {s_kv.describe()}"),
                   "fully masked rows: gradients defined as 0")
    values = {"Lq": Lq, "Lk": Lk, "events": n_ev}
    if ms.mode == "probabilistic":
        values["lambda"] = lam

    def mk(name: str, b: torch.Tensor) -> Bound:
        b = torch.where(torch.isnan(b), torch.full_like(b, math.inf), b) * (1 + _EVAL_SLACK)
        return Bound(abs=b, mode=ms.mode, failure_probability=ms.failure_probability,
                     explanation=Explanation(
                         op=f"attention {name}",
                         formula="composition: |x_hat y_hat - x y| <= b_x |y| + (|x| + b_x) b_y, hu per rounding; GEMMs: "
                                 "b_A @ |B| + sum_error_bound((|A| + b_A) @ |B|); P, O carry their forward bounds",
                         source=SOURCE, assumptions=assumptions, values=values))

    return AttentionGrads(mk("dQ", b_dq), mk("dK", b_dk), mk("dV", b_dv))


@register("attention_dq")
def attention_dq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, **kw) -> Bound:
    """Bound on the computed ``dQ`` of attention: :func:`attention_backward` ``.dq``."""
    return attention_backward(q, k, v, grad_out, **kw).dq


@register("attention_dk")
def attention_dk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, **kw) -> Bound:
    """Bound on the computed ``dK`` of attention: :func:`attention_backward` ``.dk``."""
    return attention_backward(q, k, v, grad_out, **kw).dk


@register("attention_dv")
def attention_dv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, **kw) -> Bound:
    """Bound on the computed ``dV`` of attention: :func:`attention_backward` ``.dv``."""
    return attention_backward(q, k, v, grad_out, **kw).dv
