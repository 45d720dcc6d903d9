r"""Softmax, log_softmax, cross entropy and Megatron's vocab-parallel cross entropy.

Computation model (the shifted algorithm, per row of ``n`` entries along ``dim``)
-------------------------------------------------------------------------------
Inputs are taken exactly as stored (storage format ``fmt``); ``c`` is the compute format,
``out`` the output format (defaults: :func:`~ttrace_num.bounds.common.resolve_precision`:
fp32 compute for bf16/fp16 storage, output = storage; torch CPU computes bf16/fp16
softmax and log_softmax internally in fp32 and rounds once to the storage dtype: the tests
find torch and :mod:`ttrace_num.emulate.softmax` bitwise equal up to rare 1-ulp
differences coming from torch's exp, which is not correctly rounded).

1. ``m = max_j x_j``: exact.
2. ``t_j = fl_c(x_j - m) = a_j + tau_j`` with ``a_j = x_j - m <= 0`` and
   ``|tau_j| <= h_j := half_ulp_c(|a_j|)``, or ``h_j = 0`` when ``a_j`` is representable
   in ``c`` (checked per element: Sterbenz cases, bf16 inputs in fp32, ...).
3. ``e_j = exp_c(t_j) = exp(t_j)(1 + eps_j) [+ eta_j]`` with ``|eps_j| <= c_exp u_c`` and,
   when ``exp(t_j)`` is below the normal range of ``c``, an absolute ``|eta_j| <= 2
   subnormal_abs_error_c`` (one ulp there). ``c_exp = 2 exp_ulps`` (an error of ``k`` ulps
   is at most ``2k u`` relative). Default ``exp_ulps = 1``: SLEEF's ``expf_u10`` (torch's
   vectorised exp on CPU) is documented to 1.0 ulp, glibc's ``expf`` (scalar tails) to
   less than 1 ulp; measured on this machine (200k arguments in [-87.3, -17.5] against
   float64 exp, whose error is 2^-29 fp32 ulp, and a sample against mpmath in
   ``tests/test_bounds_softmax.py::test_exp_and_log_error_model``) the exp inside
   ``torch.softmax`` reaches 0.96 ulp (no growth with ``|t|``) and ``torch.exp`` 0.57 ulp. Hence ``e_j = E_j (1 + alpha_j) [+ eta_j]``, ``E_j = exp(a_j)``,
   ``alpha_j = e^{tau_j}(1 + eps_j) - 1``, ``|alpha_j| <= A_j := e^{h_j}(1 + c_exp u) - 1``:
   the argument's rounding is amplified by ``|a_j|`` (``exp(a + tau) = exp(a) e^tau``,
   ``|tau| <= u |a|``), Blanchard, Higham & Mary (2021) §2.
4. ``s = sum_j e_j`` under a :class:`~ttrace_num.bounds.summation.Summation` (default:
   recursive in ``c``, valid for any order): ``s = sum_j e_j + acc``, ``|acc| <= theta
   sum_j e_j + eta_sum`` (Higham 2002 Lemma 3.1; ``theta``, ``sigma`` of
   :mod:`.summation`; ``eta_sum = (n + split)`` subnormal roundings: a tree has ``n - 1``
   internal nodes).
5. softmax: ``division="reciprocal"`` (torch CPU): ``r = fl_c(1/s)``, ``y_i = fl_c(e_i r)``;
   ``"divide"``: ``y_i = fl_c(e_i / s)``; then ``fl_out``.
   log_softmax: ``s' = fl_st(s)``, ``L = fl_st(log_c(s'))`` with ``log_c`` within
   ``log_ulps`` ulps (SLEEF ``logf_u10``: 1 ulp; measured 0.45 ulp), ``st = stats_fmt``
   (torch CPU keeps the row sum and its log in the *storage* dtype, the default; a GPU
   kernel keeps them in ``c``: pass ``stats_fmt=c``), output ``fl_out(fl_c(t_i - L))``.

Exact quantities: ``S = sum_j E_j >= 1`` (the max contributes ``exp(0) = 1``),
``y_i = E_i / S``, ``L = log S``. Write ``s = S (1 + beta)``:
``beta = sum_j y_j alpha_j + (sum_j eta_j + acc) / S``.

Softmax bound (derivation)
--------------------------
With ``r = (1 + delta_r)/s`` (``delta_r = 0`` for "divide") the product before the last
rounding is ``p_i = e_i r`` and, exactly,

    p_i - y_i = [ y_i ( alpha_i (1 - y_i) - sum_{j != i} y_j alpha_j - acc/S + delta_r
                        + alpha_i delta_r ) + eta_i (1 + delta_r)/S - y_i sum_j eta_j / S ] / (1 + beta)

(``e_i`` appears in both numerator and ``s``: the correlation gives the factor
``1 - y_i``; a peaked row's top entry is almost exact.) Deterministically
``|beta| <= B = Abar + eta_e + theta (1 + Abar + eta_e) + eta_sum`` (``Abar = sum_j y_j A_j``,
``eta_e`` = the underflowing exps' ``eta``), so

    |p_i - y_i| <= [ y_i N_i + eta_i (1 + u_r) + y_i eta_e ] / (1 - B),
    N_i = (1 - y_i) A_i + sum_{j != i} y_j A_j + theta (1 + Abar + eta_e) + eta_sum + u_r (1 + A_i)

and ``|y_hat_i - y_i| <= |p_i - y_i| + half_ulp_c(y_i + |p_i - y_i|) + half_ulp_out(...)``
(the last ``fl_c`` and the output rounding are kept as deterministic half-ulp terms;
``half_ulp_out`` is 0 when ``c`` converts exactly to ``out``). The second-order terms are
kept rigorously: ``A_j`` is the exact ``e^h (1 + c u) - 1``, the ``alpha_i delta_r``
product is in ``N_i``, and the ``1/(1 - B)`` factor bounds ``1/(1 + beta)``. ``B >= 1``
(e.g. bf16 accumulation of a long row) gives ``inf``: no finite claim is possible there.
This is an elementwise form of the analysis of the shifted softmax in Blanchard, Higham &
Mary (2021) §3 (their relative bound of about ``(n + 2) u`` plus the ``|x_i - m| u``
argument terms): here ``n u`` becomes ``theta`` of the stated summation tree and the
exp/subtraction terms are weighted by the probabilities ``y_j``.

log_softmax bound
-----------------
``t_i - L_hat - (a_i - L) = tau_i - (L_hat - L)`` and
``L_hat - L = log(1 + beta') + eps_L log(s') + rho``, ``1 + beta' = (1 + beta)(1 + delta_st)``
(``|delta_st| <= u_st`` when ``c -> st`` rounds), ``|eps_L| <= c_log u_c``, ``rho`` the
rounding of the log to ``st`` (``half_ulp_st``). With ``|beta'| <= B'``,
``|log(1 + beta')| <= D = -log(1 - B')`` and ``|log(1 + beta') - beta'| <= D - B'``:

    |err_i| <= (1-y_i) h_i + sum_{j!=i} y_j h_j + c_exp u + theta (1 + Abar + eta_e) + u_st
               + c_log u (L + D) + rho + [Rbar + eta_e + eta_sum + B u_st + (D - B')]
               + half_ulp_c(|a_i - L| + ...) + half_ulp_out(...)

(``R_j = A_j - h_j - c_exp u`` the second-order part of ``alpha_j``, ``Rbar = sum y_j R_j``).
The absolute error is about the relative error of ``s`` plus log's own rounding plus the
roundings of the subtraction at magnitude ``|a_i - L|`` (Blanchard, Higham & Mary 2021 §2:
log-sum-exp is well conditioned, condition ``1/|lse|`` relative = absolute ``1``).

Probabilistic mode
------------------
The linear parts (``tau_j``, ``eps_j``, the summation's ``delta_v s_v`` (identity (1) of
:mod:`.summation`), ``delta_r``, ``delta_st``, ``eps_L``, ``rho``) are martingale differences
under the Higham-Mary model (mean-independent roundings, and the exp/log errors are
modelled the same way), with bounds ``(1-y_i) h_i``, ``y_j h_j``, ``y_j c_exp u``,
``(1 + theta) sigma (1 + Abar + eta_e)`` (the summation, as in :mod:`.summation`), ``u_r``,
``u_st``, ``c_log u (L + D)``, ``rho``; Azuma-Hoeffding: ``|lin| <= lambda sqrt(sum b_k^2)``
(the log's difference is bounded on the event ``|beta'| <= B'``, fixed before ``eps_L`` is
drawn: a stopped martingale). The second-order remainders are added deterministically and
``min(deterministic linear, lambda sqrt(.))`` is used. ``B`` itself is replaced by
``min(B_det, B_prob)`` (another Azuma event on the linear part of ``beta``), so each
element's claim uses two events: ``lambda = lambda_for(p/2)`` for both (union bound, total
failure probability ``<= p``). The last ``fl_c`` and ``fl_out`` stay deterministic half-ulp
terms outside the ``lambda`` factor, as in :func:`.summation.sum_error_bound`.

Tightness: for bf16/fp16 outputs the output rounding dominates (median tightness ~1-2).
For fp32 outputs the dominant term is the denominator's summation error, bounded by
Azuma over every level of the tree at the full row mass ``S``: with ``lambda ~ 5.5`` and
the recursive default this is ``~ 5.5 sqrt(n) u`` against an observed relative error of
``s`` of a few ``u``, and every element of a row shares that error, so the fp32 median
tightness is ~5-8 (probabilistic, n = 128) to ~14 (n = 2048), and the deterministic one
grows like ``n u / (sqrt(n) u)`` (~10 at n = 128, ~100 at n = 2048): the price of a bound
valid for any summation order (state the kernel's real tree with ``summation=``).

Cross entropy
-------------
torch (``cross_entropy`` = ``log_softmax`` in the storage dtype, then ``nll_loss``):
per sample ``-lp[target]`` (exact negation: the log_softmax bound at the target);
``"sum"``/``"mean"``: the CPU cascade sum of ``nll_loss`` in the storage dtype
(``scalar_t`` arithmetic: each ``+`` is an fp32 (compute) rounding followed by a storage
rounding) whose tree height is computed exactly (:func:`nll_cascade_height`), then
``/ fl_out(count)`` (``count`` rounded to the storage format: ``1/fl(N) = (1+delta)/N``,
one more level, Higham Thm 2.3). Errors: ``sum_n b_n`` propagated plus the reduction's
``accumulation_terms`` over ``sum_n (|l_n| + b_n)``. Label smoothing ``eps``:
``(1-eps) nll + (eps/C) smooth``, ``smooth_n = -fl_out(sum_j lp_nj)`` (a sum over classes in
``c``) reduced by a recursive sum (and ``/ count``); the scalars ``1-eps``, ``eps/C`` are
rounded to ``c``; each tensor op rounds to ``c`` then ``out``. In probabilistic mode every
component bound is given failure probability ``p/k`` (``k`` = number of probabilistic
events behind the output, union bound); the per-sample error bounds are added.

Tightness of the reductions (``"mean"``/``"sum"``) is limited (median ~15-50 on random
data): the per-sample errors enter as a sum of worst cases while the observed errors of
different samples partly cancel, and the storage-dtype cascade is bounded by
``theta`` of its height times the full ``sum |l_n|`` (:mod:`.summation`), whereas the
partial sums of a chain average about half of it and the roundings are random.

Vocab-parallel cross entropy (Megatron)
---------------------------------------
Logits ``(N, V)`` split into ``tp`` contiguous shards; local max, all-reduce MAX (exact:
the same ``m``), local ``sum exp(x - m)`` in ``c``, partials all-reduced (SUM) in
``reduce_fmt`` (a ring: a chain of ``tp`` partials), predicted logit ``t_target`` (the
all-reduce adds zeros: exact), ``loss = fl_c(log_c(s) - t_target)``. This is the
log_softmax model at the target with ``Summation(split=tp, reduce_fmt=...,
reduce_algorithm="recursive")`` and ``st = c``, output ``c``.

Difference vocab-parallel vs single device (:func:`vocab_parallel_difference`): the max
and every ``t_j`` are shared (same operands, same format); with the same exp
implementation (``same_exp=True``) the ``e_j`` are shared too, so the two losses differ
by ``log s_A - log s_B`` (two summation trees over the same terms:
:func:`.summation.sum_difference_bound`, propagated through ``log``:
``|log s_A - log s_B| <= -log(1 - |s_A - s_B| / s_B)``, ``s_B >= S (1 - B)``), the two
logs' own errors, the stats roundings, and the two final roundings.

Special values: ``-inf`` logits are masked: their softmax output is exactly 0 (bound 0)
and log_softmax ``-inf`` (bound 0). Rows that are entirely ``-inf`` or contain NaN/+inf
give NaN in torch and in exact arithmetic; their bound is ``inf`` (no finite claim;
compare NaN as equal). Cross entropy with a masked target, or with label smoothing over a
row with masked entries, is ``+inf``: bound ``inf``.

Entries whose exp is exactly 0 (additive masks: ``-1e9``, ``finfo.min``)
----------------------------------------------------------------------
Assumption: the compute format's exp returns exactly 0 below ``T_c = log(min_subnormal_c) - 1``
(exact result below ``min_subnormal / e``, under half the smallest subnormal: a correctly
rounded exp gives 0; SLEEF ``expf_u10`` returns 0 below -104, glibc ``expf`` below -103.97, both
above fp32's ``T = -104.28``). If ``a_j + tau_j < T_c`` (every value ``t_j`` the shift can
produce is below it), or ``a_j <= -max_c`` (``t_j`` is ``-max_c`` or ``-inf``), then ``e_j = 0``
in every computation of the model: write ``e_j = E_j (1 + alpha_j) + eta_j`` with
``alpha_j = 0`` and ``eta_j = -E_j``, ``|eta_j| = E_j < min_subnormal_c / e``, inside the
underflow allowance ``eta_j`` that such an entry already has. So ``A_j = R_j = 0`` and
``h_j = 0`` in every sum over ``j`` (``tau_j`` of up to ``half_ulp(1e9)`` would otherwise enter
``A_j = e^{tau_j} - 1``: ``inf`` for ``finfo.min``, and ``0 * inf`` made every output of the row
``inf``). The entry's own softmax output is computed as exactly 0 through every later
rounding, so its error is ``y_j`` itself (bound ``min(bound, y_j)``); its log_softmax output
keeps ``tau_j`` (the shift's rounding is in ``t_j - L``). The last roundings use
:func:`half_ulp_to_max`: a value between ``max`` and the overflow threshold ``max +
half_ulp(max)`` rounds to ``max`` (an fp16 ``-65504`` mask minus ``L``), not to ``inf``.
Limitation: fp32 log_softmax at a ``finfo.min`` entry stays ``inf`` (the magnitude bound
``|a_i - L| + tau_i`` crosses fp32's overflow threshold although the computed ``t_i`` is at most
``max``).

Overflow to ``inf`` (:func:`.summation.overflow_possible`)
----------------------------------------------------------
Every partial sum of the row sum is at most ``(1 + theta) S (1 + Abar + eta_e)``: where that may
exceed the maximum of a format the tree holds it in, ``B = inf``. log_softmax's stored row sum
``s' = fl_st(s)``, ``s <= S (1 + B)``: a flat fp16 row of more than 65504 entries makes ``s'``
``inf`` and torch returns ``-inf``: ``B' = inf`` there. Cross entropy: the partial sums of the
``nll`` cascade (and of the label-smoothing reduction) are at most ``(1 + theta) sum_n (|l_n| +
b_n)`` (non-negative terms), the class sum ``fl_out(sum_j lp_nj)`` at most ``sum_j |lp_nj| +
b``, the scaled and added components at most their magnitude plus error: ``inf`` where any of
them may exceed the format it is held in.

Kernel paths (torch CPU, ``kernel="torch_cpu"``)
------------------------------------------------
Over the last dim torch CPU runs the model above. Over another dim (ATen ``_vec_softmax``,
``aten/src/ATen/native/cpu/SoftMaxKernel.cpp``, torch 2.13), bf16/fp16: the ``outer * inner``
columns are split by ``parallel_for(0, outer*inner, 0)`` into ``threads`` ranges of
``ceil(outer*inner / threads)`` columns; a range is walked in blocks of ``V`` columns
(``Vectorized<scalar_t>::size()``: 16 with 32-byte vectors, AVX2 and the default dispatch
alike, 32 with AVX512) inside each row of ``inner`` columns, and the fewer-than-``V`` columns left
before the end of a row or of the range take a scalar tail: ``e = exp(x - m)`` (fp32) is summed
(fp32, unrounded) but *stored in the storage dtype* and divided after: ``y = fl_st(fl_c(fl_st(e)
/ s))`` (:func:`torch_cpu_exp_stored` gives those rows; measured on this machine with 1, 2 and
3 threads: it predicts exactly where torch differs from the one-rounding model, 0.6-25% of the
elements on the shapes of the tests). With ``e'_i = e_i + rho_i``, ``|rho_i| <= half_ulp_st(e_i)``
and ``s`` unchanged, ``p'_i - y_i = (p_i - y_i) + rho_i (1 + delta_r) / s`` and ``|s| >= S (1 - B)``,
so the bound of such a row gains ``half_ulp_st(E_i (1 + A_i) + eta_i) (1 + u_r) / (S (1 - B))``
(about half an ulp of ``y_i`` in the storage format: the measured error reaches 0.9998 of the
bound there). fp32 stores ``e`` in fp32 (no extra rounding); log_softmax over a non-last dim
keeps fp32 throughout (measured: the unchanged bound holds, largest error/bound 0.93).
``kernel="fused"`` drops the extra rounding (GPU kernels). The vectorised path divides (``u_r
= 0`` would do; the default reciprocal model is kept, a few percent looser).

Rows are processed in chunks of :data:`.norms.CHUNK_ELEMENTS` elements (the float64 working
set of ~20 arrays per chunk), and every row statistic is a sequential per-row sum (``cumsum``):
the bound is bitwise that of one pass, in memory bounded by the two float64 results plus a
constant.

Source: Blanchard, Higham & Mary, "Accurate computation of the log-sum-exp and softmax
functions", IMA J. Numer. Anal. 41(4), 2021, §2-3 (shifted algorithm, error analysis of
softmax and log-sum-exp); Higham, Accuracy and Stability of Numerical Algorithms (2002),
§2.2 (Thm 2.2, 2.3), §3.1, Lemma 3.1; Higham & Mary, SISC 41(5) 2019 and Connolly,
Higham & Mary, SISC 43(1) 2021 (probabilistic model, martingale form); SLEEF
documentation (``expf_u10``/``logf_u10``: 1.0-ulp bounds).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..formats import FloatFormat, get_format, half_ulp
from ..rounding import round_to
from .base import Bound, Explanation, lambda_for
from .common import Precision, f64, register, resolve_mode, resolve_precision
from .norms import TorchCPULayout, check_dim, default_layout, map_row_chunks
from .summation import (Depths, Summation, accumulation_terms, conversion_exact, output_rounding, overflow_possible,
                        sigma_coefficient, sum_difference_bound, sum_error_bound, theta, underflow_term)

__all__ = ["softmax", "log_softmax", "cross_entropy", "vocab_parallel_cross_entropy",
           "vocab_parallel_difference", "nll_cascade_height"]

SOURCE = ("Blanchard, Higham & Mary, IMA J. Numer. Anal. 41(4) 2021 §2-3 (shifted softmax / log-sum-exp); "
          "Higham (2002) §2.2, §3.1, Lemma 3.1; probabilistic: Higham & Mary SISC 2019, "
          "Connolly, Higham & Mary SISC 2021 (martingale form)")

#: float64 evaluation slack of the exact statistics (y, S, L): exp (1 ulp), the argument
#: (|a| <= 745 times 2^-53), the n-term sum and the division, in units of 2^-52.
_F64_SLACK_TERMS = 760


@dataclass
class _Rows:
    """Per-row statistics of the shifted algorithm (last dim = the softmax dim)."""

    n: int
    valid: torch.Tensor    # (..., 1) bool: finite max, no NaN/+inf
    masked: torch.Tensor   # (..., n) bool: -inf entries
    zero: torch.Tensor     # (..., n) bool: exp(t_j) is exactly 0 (not masked)
    a: torch.Tensor        # (..., n) x - m (float64; 0 where masked)
    y: torch.Tensor        # upper bound on y_j (0 where masked)
    om: torch.Tensor       # upper bound on 1 - y_j
    L: torch.Tensor        # (..., 1) upper bound on log S
    tau: torch.Tensor      # bound on |tau_j| (the shift's rounding)
    h: torch.Tensor        # tau_j's bound where it enters alpha_j (0 where exp(t_j) is exactly 0)
    A: torch.Tensor        # bound on |alpha_j|
    R: torch.Tensor        # A - h - c_exp u (second-order part)
    eta_i: torch.Tensor    # per-element exp underflow term
    eta_e: torch.Tensor    # (..., 1) sum of eta_j
    Rbar: torch.Tensor     # sum_j y_j R_j
    Hbar: torch.Tensor     # sum_j y_j h_j
    ysum: torch.Tensor     # sum_j y_j (upper, ~1)
    qh2: torch.Tensor      # sum_j y_j^2 h_j^2
    qy2: torch.Tensor      # sum_j y_j^2
    se: torch.Tensor       # upper bound on sum_j e_j / S
    S: torch.Tensor        # (..., 1) S = sum_j exp(a_j) (float64, >= 1)
    theta: float
    sigma: float
    eta_sum: float
    cu: float              # c_exp * u_c
    B: torch.Tensor        # bound on |beta|, inf where >= 1


def _inf_where(bad: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.where(bad, torch.full_like(v, math.inf), v)


def half_ulp_to_max(t: torch.Tensor, f: FloatFormat) -> torch.Tensor:
    """Bound on the rounding to ``f`` of a value of magnitude ``<= t``, up to ``f``'s overflow
    threshold: a value in ``(max, max + half_ulp(max))`` rounds to ``max`` (error below
    ``half_ulp(max)``); ``inf`` from the threshold on (it may round to ``inf``)."""
    hm = float(half_ulp(torch.tensor(f.max, dtype=torch.float64), f))
    return torch.where(t < f.max + hm, half_ulp(t.clamp(max=f.max), f), torch.full_like(t, math.inf))


def exp_zero_threshold(c: FloatFormat) -> float:
    """Arguments below which the compute format's exp returns exactly 0: ``log(min_subnormal_c)
    - 1`` (exact result below ``min_subnormal / e``, under half the smallest subnormal: a
    correctly rounded exp gives 0; SLEEF ``expf_u10`` returns 0 below -104 and glibc ``expf``
    below -103.97, both above fp32's threshold -104.28)."""
    return math.log(c.min_subnormal) - 1.0


def _row_stats(x64: torch.Tensor, c: FloatFormat, summ: Summation, exp_ulps: float, mode: str,
               lam: float) -> _Rows:
    """Statistics of every row of ``x64`` (last dim) for the bounds of the module docstring."""
    n = x64.shape[-1]
    nan_or_pinf = (torch.isnan(x64) | (x64 == math.inf)).any(-1, keepdim=True)
    masked = x64 == -math.inf
    valid = ~nan_or_pinf & ~masked.all(-1, keepdim=True)
    xs = torch.where(valid & ~masked, x64, torch.zeros_like(x64))
    m = torch.where(valid & ~masked, x64, torch.full_like(x64, -math.inf)).max(-1, keepdim=True).values
    m = torch.where(valid, m, torch.zeros_like(m))
    xs = torch.where(masked, m.expand_as(xs), xs)
    a = xs - m
    # exactness of the float64 difference (TwoSum error term) and representability in c
    bb = a - xs
    err64 = (xs - (a - bb)) + (-m - bb)
    exact = (err64 == 0) & (round_to(a, c) == a)
    tau = torch.where(exact | masked, torch.zeros_like(a), half_ulp_to_max(a.abs() * (1 + 2.0 ** -52), c))
    # exp(t_j) is exactly 0 for every t_j within tau_j of a_j, or when t_j <= -max_c (module
    # docstring, "Entries whose exp is exactly 0"): alpha_j = 0, |e_j - E_j| = E_j < eta_j
    zero = ~masked & ((a + tau < exp_zero_threshold(c)) | (a <= -c.max))
    h = torch.where(zero, torch.zeros_like(tau), tau)
    u = c.u
    cu = 2.0 * exp_ulps * u
    E = torch.where(masked, torch.zeros_like(a), torch.exp(a))
    S = _row_sum(E)
    g = (n + _F64_SLACK_TERMS) * 2.0 ** -52
    y = (E / S * (1 + g)).clamp(max=1.0)
    om = (1.0 - E / S * (1 - g)).clamp(min=0.0, max=1.0)
    L = torch.log(S) + 2 * g
    em1 = torch.expm1(h)
    A = torch.where(masked | zero, torch.zeros_like(h), em1 * (1 + cu) + cu)
    R = torch.where(masked | zero, torch.zeros_like(h), (em1 - h) + em1 * cu)
    # exp results possibly below c's normal range: one subnormal ulp of absolute error
    under = ~masked & (torch.exp(a - h) < c.min_normal)
    eta_i = torch.where(under, torch.full_like(a, 2 * c.subnormal_abs_error), torch.zeros_like(a))
    eta_e = _row_sum(eta_i)
    Abar = _row_sum(y * A)
    Rbar = _row_sum(y * R)
    Hbar = _row_sum(y * h)
    ysum = _row_sum(y)
    qh2 = _row_sum(y * y * h * h)
    qy2 = _row_sum(y * y)
    depths = summ.depths(n)
    th, sig = theta(depths), sigma_coefficient(depths)
    eta_sum = underflow_term({f: n + summ.split for f in depths})
    se = 1.0 + Abar + eta_e
    B = Abar + eta_e + th * se + eta_sum
    if mode == "probabilistic":
        lin = lam * torch.sqrt(qh2 + cu * cu * qy2 + ((1 + th) * sig * se) ** 2)
        B = torch.minimum(B, lin + Rbar + eta_e + eta_sum)
    # every partial sum of the e_j is at most (1 + theta) S se: held in a format it may overflow
    # (an fp16 accumulator), s may be inf
    big = (B >= 1) | _overflows(S * se * (1 + th), depths)
    B = _inf_where(big, B)
    return _Rows(n, valid, masked, zero, a, y, om, L, tau, h, A, R, eta_i, eta_e, Rbar, Hbar, ysum, qh2, qy2, se, S,
                 th, sig, eta_sum, cu, B)


def _row_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (keepdim) in a fixed sequential order per row: float64 results that
    do not depend on the other rows of the batch (``Tensor.sum`` may vectorise across rows), so
    that chunks of rows give bitwise the bounds of one pass."""
    return t.cumsum(-1)[..., -1:] if t.shape[-1] else t.sum(-1, keepdim=True)


def _overflows(upper: torch.Tensor, fmts) -> torch.Tensor:
    """``True`` where a value of magnitude up to ``upper`` held in any of ``fmts`` may overflow
    (:func:`.summation.overflow_possible`)."""
    mask = torch.zeros_like(upper, dtype=torch.bool)
    for f in fmts:
        mask |= overflow_possible(upper, f)
    return mask


def _lambdas(ms_mode: str, p: float, events: int) -> float:
    return lambda_for(p / events) if ms_mode == "probabilistic" else math.inf


def _division_u(division: str, c: FloatFormat) -> float:
    if division == "reciprocal":
        return c.u
    if division == "divide":
        return 0.0
    raise ValueError(f"division must be 'reciprocal' or 'divide', not {division!r}")


def _softmax_rows(r: _Rows, c: FloatFormat, out: FloatFormat, ur: float, mode: str, lam: float,
                  stored: torch.Tensor | None = None, st: FloatFormat | None = None) -> torch.Tensor:
    """Softmax bound of the rows; ``stored`` (bool, ``(..., 1)``): rows whose ``e_j`` are
    rounded to ``st`` before the division (module docstring, "Kernel paths")."""
    y, om, h, cu = r.y, r.om, r.h, r.cu
    lin = om * (h + cu) + (r.Hbar + cu * r.ysum - y * (h + cu)).clamp(min=0) + r.theta * r.se + ur
    rem = om * r.R + (r.Rbar - y * r.R).clamp(min=0) + ur * r.A + r.eta_sum
    if mode == "probabilistic":
        q2 = (om ** 2 * (h * h + cu * cu) + (r.qh2 + cu * cu * r.qy2 - y * y * (h * h + cu * cu)).clamp(min=0)
              + ((1 + r.theta) * r.sigma * r.se) ** 2 + ur * ur)
        lin = torch.minimum(lin, lam * torch.sqrt(q2))
    num = y * (lin + rem) + r.eta_i * (1 + ur) + y * r.eta_e
    ep = num / (1.0 - r.B)
    if stored is not None and bool(stored.any()):
        e_up = torch.where(r.masked, torch.zeros_like(r.a), torch.exp(r.a)) * (1 + r.A) + r.eta_i
        extra = half_ulp(e_up, st) * (1 + ur) / (r.S * (1.0 - r.B))
        ep = ep + torch.where(stored, extra, torch.zeros_like(extra))
    ep = _inf_where(~torch.isfinite(r.B).expand_as(ep), ep)
    fin = half_ulp(y + ep, c)
    tot = ep + fin
    tot = tot + output_rounding(y + tot, c, out)
    # a zero exp gives exactly 0 through every later rounding: the error is y_i itself (y bounds
    # it up to float64's underflow of exp(a_i), below its smallest subnormal)
    tot = torch.where(r.zero, torch.minimum(tot, y + math.ulp(0.0)), tot)
    tot = torch.where(r.masked, torch.zeros_like(tot), tot)
    return _inf_where(~r.valid.expand_as(tot), tot)


def _log_softmax_rows(r: _Rows, c: FloatFormat, out: FloatFormat, st: FloatFormat, log_ulps: float, mode: str,
                      lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bound, magnitude)`` of log_softmax on the rows; magnitude = upper bound on ``|a_i - L|``."""
    y, om, h, cu, u = r.y, r.om, r.h, r.cu, c.u
    st_rounds = not conversion_exact(c, st)
    ust = st.u if st_rounds else 0.0
    Bp = r.B + ust * (1 + r.B)
    # s' = fl_st(s), s <= S (1 + B): an fp16 row sum of a long flat row is inf (torch: -inf outputs)
    Bp = _inf_where((Bp >= 1) | _overflows(r.S * (1 + r.B), (st,)), Bp)
    D = -torch.log1p(-Bp)
    Lmag = r.L + D
    clog = 2.0 * log_ulps * u
    log_term = clog * Lmag
    rho = half_ulp(Lmag * (1 + clog), st) if st_rounds else torch.zeros_like(Lmag)
    lin = (om * r.tau + (r.Hbar - y * h).clamp(min=0) + cu * r.ysum + r.theta * r.se + ust + log_term + rho)
    rem = r.Rbar + r.eta_e + r.eta_sum + r.B * ust + (D - Bp)
    if mode == "probabilistic":
        q2 = (om ** 2 * r.tau ** 2 + (r.qh2 - y * y * h * h).clamp(min=0) + cu * cu * r.qy2
              + ((1 + r.theta) * r.sigma * r.se) ** 2 + ust ** 2 + log_term ** 2 + rho ** 2)
        lin = torch.minimum(lin, lam * torch.sqrt(q2))
    err = lin + rem
    err = _inf_where(~torch.isfinite(Bp), err).expand_as(h)
    mag = r.L - r.a
    fin = half_ulp_to_max(mag + err, c)
    tot = err + fin
    if not conversion_exact(c, out):
        tot = tot + half_ulp_to_max(mag + tot, out)
    tot = torch.where(r.masked, torch.zeros_like(tot), tot)
    return _inf_where(~r.valid.expand_as(tot), tot), mag


def _common_args(x: torch.Tensor, fmt, compute_fmt, out_fmt, summation, mode, failure_probability):
    prec = resolve_precision((x,), fmt, compute_fmt, out_fmt)
    summ = summation if summation is not None else Summation(accum=prec.compute)
    ms = resolve_mode(mode, failure_probability)
    return prec, summ, ms


def _assumptions(prec: Precision, summ: Summation, exp_ulps: float, mode: str, extra: tuple[str, ...] = ()):
    a = [f"shifted algorithm; {prec.describe()}", f"denominator summation: {summ.describe()}",
         f"exp within {exp_ulps:g} ulp of the compute format (1 subnormal ulp below the normal range)",
         *extra]
    if mode == "probabilistic":
        a.append("rounding (and exp/log) errors mean-independent (Higham-Mary model); lambda = lambda_for(p/2)")
    return tuple(a)


def torch_cpu_exp_stored(shape: tuple[int, ...], dim: int, storage: FloatFormat, *, threads: int | None = None,
                         layout: TorchCPULayout | None = None) -> torch.Tensor:
    """Which softmax rows of torch's CPU kernel over a non-last ``dim`` store ``exp(x - m)`` in
    the storage dtype before dividing (module docstring, "Kernel paths"): a bool tensor of the
    shape of the input without ``dim`` (the rows' order of ``x.movedim(dim, -1)``).

    ATen ``_vec_softmax`` (``SoftMaxKernel.cpp``, bf16/fp16): ``parallel_for(0, outer * inner,
    0, ...)`` splits the ``outer * inner`` columns into ``threads`` contiguous ranges of
    ``ceil(outer * inner / threads)`` (one range with one thread); each range walks its
    columns in steps of ``V = Vectorized<scalar_t>::size()`` (16 with 32-byte vectors, 32 with
    AVX512) inside one row of ``inner`` columns; the columns left over at the end of a row
    segment (fewer than ``V`` before the row's or the range's end) take the scalar tail, which
    stores ``scalar_t(exp(x - m))`` and divides that. ``threads`` defaults to
    ``torch.get_num_threads()`` (the range split depends on it), ``layout`` to the running
    build's vector width."""
    dim = dim % len(shape)
    outer, inner = math.prod(shape[:dim]), math.prod(shape[dim + 1:])
    total = outer * inner
    V = (layout or default_layout()).vec_elems(storage)
    T = threads if threads is not None else torch.get_num_threads()
    if isinstance(T, bool) or not isinstance(T, int) or T < 1:
        raise ValueError(f"threads must be a positive int, not {threads!r}")
    chunk = max(-(-total // T) if T > 1 and total > 1 else total, 1)
    p = torch.arange(total, dtype=torch.int64)
    begin = p // chunk * chunk
    end = (begin + chunk).clamp(max=total)
    row = p // inner * inner
    i0 = torch.maximum(row, begin)
    i1 = torch.minimum(row + inner, end)
    scalar = (p - i0) >= V * ((i1 - i0) // V)
    return scalar.reshape(tuple(shape[:dim]) + tuple(shape[dim + 1:]))


def _stored_rows(x: torch.Tensor, dim: int, prec: Precision, kernel: str, threads: int | None,
                 layout: TorchCPULayout | None) -> torch.Tensor | None:
    """``(rows, 1)`` bool mask of the rows whose exps are stored in the storage format, or None."""
    if kernel not in ("torch_cpu", "fused"):
        raise ValueError(f"kernel must be 'torch_cpu' or 'fused', not {kernel!r}")
    if kernel == "fused" or x.dim() < 2 or dim == x.dim() - 1 or conversion_exact(prec.compute, prec.storage):
        return None
    return torch_cpu_exp_stored(tuple(x.shape), dim, prec.storage, threads=threads, layout=layout).reshape(-1, 1)


def _scalars(r: _Rows) -> tuple[int, float, float, float]:
    """The per-call constants of the row statistics (kept per chunk instead of the rows)."""
    return r.n, r.theta, r.sigma, r.cu


def _by_rows(x: torch.Tensor, dim: int, fn) -> tuple[torch.Tensor, torch.Tensor, list]:
    """:func:`.norms.map_row_chunks` over the rows of ``x.movedim(dim, -1)``; the two results
    back in ``x``'s layout."""
    xm = x.detach().movedim(dim, -1)
    b, m, extras = map_row_chunks(xm.reshape(-1, xm.shape[-1]), fn)
    return b.reshape(xm.shape).movedim(-1, dim), m.reshape(xm.shape).movedim(-1, dim), extras


@register("softmax")
def softmax(x: torch.Tensor, dim: int = -1, *, fmt=None, compute_fmt=None, out_fmt=None,
            summation: Summation | None = None, division: str = "reciprocal", exp_ulps: float = 1.0,
            kernel: str = "torch_cpu", threads: int | None = None, layout: TorchCPULayout | None = None,
            mode: str = "deterministic", failure_probability: float | None = None) -> Bound:
    """Elementwise bound on ``|softmax_hat(x) - softmax(x)|`` along ``dim`` (module docstring).

    Args:
        summation: the denominator's summation model (default recursive in the compute format).
        division: ``"reciprocal"`` (``e * fl(1/s)``, torch CPU) or ``"divide"`` (``fl(e / s)``).
        exp_ulps: accuracy of the compute format's exp in ulps (default 1, SLEEF u10).
        kernel: ``"torch_cpu"`` (default): over a non-last ``dim`` of a bf16/fp16 input the
            rows that take ATen's scalar tail round ``e_j`` to the storage format before the
            division (:func:`torch_cpu_exp_stored`, with ``threads`` and ``layout``);
            ``"fused"``: ``e_j`` stays in the compute format (a GPU kernel).
    """
    dim = check_dim(x, dim)
    prec, summ, ms = _common_args(x, fmt, compute_fmt, out_fmt, summation, mode, failure_probability)
    ur = _division_u(division, prec.compute)
    lam = _lambdas(ms.mode, ms.failure_probability, 2)
    stored = _stored_rows(x, dim, prec, kernel, threads, layout)

    def rows_fn(x64: torch.Tensor, sl: slice):
        r = _row_stats(x64, prec.compute, summ, exp_ulps, ms.mode, lam)
        b = _softmax_rows(r, prec.compute, prec.out, ur, ms.mode, lam,
                          None if stored is None else stored[sl], prec.storage)
        fin = torch.isfinite(r.B)
        return b, r.y, _scalars(r) + (float(r.B[fin].max()) if bool(fin.any()) else -math.inf,)

    bound, mag, ex = _by_rows(x.reshape(1) if x.dim() == 0 else x, dim, rows_fn)
    n, th, sig, cu = ex[-1][:4]
    max_b = max(e[4] for e in ex)
    values = {"n": n, "theta": th, "sigma": sig, "c_exp*u": cu, "u_r": ur,
              "max_B": max_b if max_b > -math.inf else math.inf,
              "kernel": kernel, "rows with exp stored in the storage format":
                  0 if stored is None else int(stored.sum())}
    if ms.mode == "probabilistic":
        values["lambda"] = lam
    if x.dim() == 0:
        bound, mag = bound.reshape(()), mag.reshape(())
    return Bound(abs=bound, mode=ms.mode, failure_probability=ms.failure_probability,
                 magnitude=mag,
                 explanation=Explanation(
                     op="softmax",
                     formula="|err_i| <= [y_i N_i + eta_i(1+u_r) + y_i eta_e]/(1-B) [+ half_ulp_st(e_i)(1+u_r)/(S(1-B)) "
                             "where e_i is stored] + half_ulp_c(.) + half_ulp_out(.), "
                             "N_i = (1-y_i)A_i + sum_{j!=i} y_j A_j + theta(1+Abar+eta_e) + eta_sum + u_r(1+A_i)",
                     source=SOURCE + "; torch aten/src/ATen/native/cpu/SoftMaxKernel.cpp (_vec_softmax)",
                     assumptions=_assumptions(prec, summ, exp_ulps, ms.mode, (f"division: {division}",
                                                                              f"kernel paths: {kernel}")),
                     values=values))


def _log_softmax_core(x64: torch.Tensor, prec: Precision, summ: Summation, st: FloatFormat, exp_ulps: float,
                      log_ulps: float, mode: str, lam: float) -> tuple[torch.Tensor, torch.Tensor, _Rows]:
    r = _row_stats(x64, prec.compute, summ, exp_ulps, mode, lam)
    b, mag = _log_softmax_rows(r, prec.compute, prec.out, st, log_ulps, mode, lam)
    return b, mag, r


@register("log_softmax")
def log_softmax(x: torch.Tensor, dim: int = -1, *, fmt=None, compute_fmt=None, out_fmt=None,
                summation: Summation | None = None, stats_fmt=None, exp_ulps: float = 1.0, log_ulps: float = 1.0,
                mode: str = "deterministic", failure_probability: float | None = None) -> Bound:
    """Elementwise bound on ``|log_softmax_hat(x) - log_softmax(x)|`` along ``dim``.

    ``stats_fmt``: format the row sum and its log are stored in between the passes
    (default: the storage format, as torch CPU; a GPU kernel keeps the compute format).
    torch CPU's kernel over a non-last dim keeps its intermediates in the compute format
    (measured: no extra rounding, module docstring "Kernel paths").
    """
    dim = check_dim(x, dim)
    prec, summ, ms = _common_args(x, fmt, compute_fmt, out_fmt, summation, mode, failure_probability)
    st = get_format(stats_fmt) if stats_fmt is not None else prec.storage
    lam = _lambdas(ms.mode, ms.failure_probability, 2)

    def rows_fn(x64: torch.Tensor, sl: slice):
        b, mag, r = _log_softmax_core(x64, prec, summ, st, exp_ulps, log_ulps, ms.mode, lam)
        return b, mag, _scalars(r)

    b, mag, ex = _by_rows(x.reshape(1) if x.dim() == 0 else x, dim, rows_fn)
    n, th, sig, cu = ex[-1]
    values = {"n": n, "theta": th, "sigma": sig, "c_exp*u": cu, "c_log*u": 2 * log_ulps * prec.compute.u,
              "stats_fmt": str(st)}
    if ms.mode == "probabilistic":
        values["lambda"] = lam
    if x.dim() == 0:
        b, mag = b.reshape(()), mag.reshape(())
    return Bound(abs=b, mode=ms.mode, failure_probability=ms.failure_probability,
                 magnitude=mag,
                 explanation=Explanation(
                     op="log_softmax",
                     formula="|err_i| <= (1-y_i)h_i + sum_{j!=i} y_j h_j + c_exp u + theta(1+Abar+eta_e) + u_st + "
                             "c_log u (L+D) + rho + remainders + half_ulp_c(|a_i-L|+.) + half_ulp_out(.)",
                     source=SOURCE,
                     assumptions=_assumptions(prec, summ, exp_ulps, ms.mode,
                                              (f"log within {log_ulps:g} ulp; row sum and log stored in {st}",)),
                     values=values))


# ------------------------------------------------------------------------- cross entropy
def nll_cascade_height(rows: list[int]) -> int:
    """Height (roundings on the longest leaf-to-root path) of torch CPU ``nll_loss``'s
    cascade sum over the non-ignored row indices ``rows`` (8 levels; level ``j`` flushes
    into ``j+1`` when ``b & (15 << 4j) == 0``; adding to an empty level, or ``0 + level``
    at the end, is exact)."""
    levels: list[int | None] = [None] * 8

    def add(acc: int | None, v: int | None) -> int | None:
        if v is None:
            return acc
        return v if acc is None else max(acc, v) + 1

    for b in rows:
        levels[0] = add(levels[0], 0)
        for j in range(7):
            if b & (15 << (4 * j)):
                break
            levels[j + 1] = add(levels[j + 1], levels[j])
            levels[j] = None
    acc: int | None = None
    for lv in levels:
        acc = add(acc, lv)
    return acc or 0


def _op_depths(prec: Precision, levels: int) -> Depths:
    """Rounding levels of ``levels`` tensor ops of the storage dtype: each rounds to the
    compute (opmath) format, then to the output format."""
    d: Depths = {prec.compute: levels}
    if not conversion_exact(prec.compute, prec.out):
        d[prec.out] = d.get(prec.out, 0) + levels
    return d


def _merge(*ds: Depths) -> Depths:
    out: Depths = {}
    for d in ds:
        for f, k in d.items():
            if k:
                out[f] = out.get(f, 0) + k
    return out


def _reduce(vals_mag: torch.Tensor, vals_err: torch.Tensor, depths: Depths, mode: str, lam: float, n: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Error of a reduction of ``n`` computed values (each within ``vals_err`` of exact values of
    magnitude ``<= vals_mag``) whose own roundings have ``depths`` levels (all relative to
    the whole sum, the division included): ``(magnitude, error)``."""
    coef, eta = accumulation_terms(depths, {f: k * n for f, k in depths.items()}, mode, lam)
    S = (vals_mag + vals_err).sum()
    err = vals_err.sum() + coef * S + eta
    # every partial sum of the (non-negative) computed values is at most (1 + theta) S: one held
    # in a format it may overflow (the fp16 cascade of a long batch) makes the result inf
    err = _inf_where(_overflows(S * (1 + theta(depths)), depths), err)
    return vals_mag.sum(), err


def _scale(mag: torch.Tensor, err: torch.Tensor, const: float, prec: Precision) -> tuple[torch.Tensor, torch.Tensor]:
    """``fl_out(fl_c(P * fl_c(const)))`` for ``|P_hat - P| <= err``, ``|P| <= mag``; the scalar is
    a float64 value (itself within 2^-53 relative of the exact one) rounded to the compute format."""
    dc = half_ulp(torch.tensor(abs(const) * (1 + 2.0 ** -52)), prec.compute) + abs(const) * 2.0 ** -52
    e = abs(const) * err + dc * (mag + err)
    pm = (abs(const) + dc) * (mag + err)
    e = e + half_ulp(pm, prec.compute)
    e = e + output_rounding(pm + half_ulp(pm, prec.compute), prec.compute, prec.out)
    e = _inf_where(_overflows(pm + e, (prec.compute, prec.out)), e)
    return abs(const) * mag, e


def _add(m1, e1, m2, e2, prec: Precision):
    e = e1 + e2
    s = m1 + m2 + e
    e = _inf_where(_overflows(s, (prec.compute, prec.out)), e)
    e = e + half_ulp(s, prec.compute)
    e = e + output_rounding(s + half_ulp(s, prec.compute), prec.compute, prec.out)
    return m1 + m2, e


def _check_cross_entropy(logits: torch.Tensor, target: torch.Tensor, reduction: str, label_smoothing: float,
                         ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Validated ``(target as int64, non-ignored mask, label_smoothing)``; a ``ValueError`` naming
    the argument for what torch would refuse (or what the bound does not model)."""
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"reduction must be 'none', 'mean' or 'sum', not {reduction!r}")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError("cross_entropy bound expects logits of shape (N, C), got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    N, C = logits.shape
    if not isinstance(target, torch.Tensor) or target.is_floating_point() or target.is_complex():
        raise ValueError("target must be a tensor of class indices (an integer dtype) of shape (N,); "
                         "class-probability targets are not modelled")
    if tuple(target.shape) != (N,):
        raise ValueError(f"target must have shape (N,) = ({N},) for logits of shape {tuple(logits.shape)}, "
                         f"got {tuple(target.shape)}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    tgt = target.to(torch.int64)
    keep = tgt != ignore_index
    bad = keep & ((tgt < 0) | (tgt >= C))
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise ValueError(f"target[{i}] = {int(tgt[i])} is not a class index in [0, {C}) (nor ignore_index="
                         f"{ignore_index}); pass class indices of the {C} classes")
    eps = float(label_smoothing)
    if not 0.0 <= eps <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    return tgt, keep, eps


@register("cross_entropy")
def cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, reduction: str = "mean",
                  label_smoothing: float = 0.0, ignore_index: int = -100, fmt=None, compute_fmt=None,
                  out_fmt=None, summation: Summation | None = None, stats_fmt=None, exp_ulps: float = 1.0,
                  log_ulps: float = 1.0, mode: str = "deterministic",
                  failure_probability: float | None = None) -> Bound:
    """Bound on ``|F.cross_entropy(logits, target) - exact|`` (logits ``(N, C)``, class-index
    targets, no weights) for torch's CPU computation (module docstring)."""
    tgt, keep, eps = _check_cross_entropy(logits, target, reduction, label_smoothing, ignore_index)
    prec, summ, ms = _common_args(logits, fmt, compute_fmt, out_fmt, summation, mode, failure_probability)
    st = get_format(stats_fmt) if stats_fmt is not None else prec.storage
    N, C = logits.shape
    rows = [int(i) for i in torch.nonzero(keep).flatten()]
    # probabilistic events behind one output (union bound): per row, its elements' claims,
    # its beta event and, with smoothing, the class sum; plus one per reduction over rows.
    per_row = (C if eps else 1) + 1 + (1 if eps else 0)
    events = per_row if reduction == "none" else len(rows) * per_row + 1 + (1 if eps else 0)
    lam = _lambdas(ms.mode, ms.failure_probability, max(events, 2))
    b, mag, r = _log_softmax_core(f64(logits), prec, summ, st, exp_ulps, log_ulps, ms.mode, lam)
    safe = torch.where(keep, tgt, torch.zeros_like(tgt))
    zero = torch.zeros((), dtype=torch.float64)
    nb = torch.where(keep, b.gather(1, safe[:, None])[:, 0], zero)
    nm = torch.where(keep, mag.gather(1, safe[:, None])[:, 0], zero)
    # a masked target (or, with label smoothing, any masked entry) gives a loss of +inf
    inf_rows = keep & (r.masked.gather(1, safe[:, None])[:, 0] | (r.masked.any(-1) if eps else False))
    nb = torch.where(inf_rows, torch.full_like(nb, math.inf), nb)
    cnt = len(rows)
    count_levels = int(round_to(torch.tensor(float(cnt)), prec.out) != cnt) if cnt else 0

    def reduce(vm: torch.Tensor, ve: torch.Tensor, base: Depths) -> tuple[torch.Tensor, torch.Tensor]:
        if reduction == "none":
            return vm, ve
        extra: Depths = {}
        if reduction == "mean":
            extra = _merge(_op_depths(prec, 1), {prec.out: count_levels})
        m_, e_ = _reduce(vm[keep], ve[keep], _merge(base, extra), ms.mode, lam, max(cnt, 1))
        if reduction == "mean":
            m_, e_ = m_ / max(cnt, 1), e_ / max(cnt, 1)
        return m_, e_

    nll_m, nll_e = reduce(nm, nb, _op_depths(prec, nll_cascade_height(rows)))
    values = {"C": C, "rows": cnt, "theta": r.theta, "reduction": reduction, "label_smoothing": eps}
    if eps:
        # smooth_n = -fl_out(sum_j lp_hat_nj), a sum over classes in the compute format
        lp_err = b.sum(-1)
        sm_sum, _ = sum_error_bound((mag + b).sum(-1), mag.sum(-1) + lp_err, C, Summation(accum=prec.compute),
                                    prec.out, ms.mode, lam)
        sm_e = torch.where(keep, lp_err + sm_sum, zero)
        # fl_out of the class sum: inf where it may exceed the output format (fp16, a long flat row)
        sm_e = _inf_where(keep & _overflows(mag.sum(-1) + sm_e, (prec.out,)), sm_e)
        sm_e = torch.where(keep & r.masked.any(-1), torch.full_like(sm_e, math.inf), sm_e)
        sm_m = torch.where(keep, mag.sum(-1), zero)
        rd = reduction != "none"
        sm_m, sm_e = reduce(sm_m, sm_e, _merge(Summation(accum=prec.compute).depths(max(cnt, 1)),
                                               {prec.out: 1} if rd and not conversion_exact(prec.compute, prec.out)
                                               else {}))
        m1, e1 = _scale(nll_m, nll_e, 1.0 - eps, prec)
        m2, e2 = _scale(sm_m, sm_e, eps / C, prec)
        _, tot = _add(m1, e1, m2, e2, prec)
    else:
        tot = nll_e
    if reduction == "none":
        tot = torch.where(keep, tot, zero)  # ignored samples are exactly 0
    if ms.mode == "probabilistic":
        values.update(lam=lam, events=events)
    return Bound(abs=tot, mode=ms.mode, failure_probability=ms.failure_probability,
                 explanation=Explanation(
                     op="cross_entropy",
                     formula="log_softmax bound at the target (exact negation); reductions: sum_n b_n + coef * sum_n(|l_n|+b_n) "
                             "(cascade height, /fl(count)); label smoothing: (1-eps) nll + (eps/C) smooth with every op rounded",
                     source=SOURCE + "; torch aten/src/ATen/native/LossNLL.cpp (nll_loss cascade, label smoothing)",
                     assumptions=_assumptions(prec, summ, exp_ulps, ms.mode,
                                              (f"log within {log_ulps:g} ulp; row sum and log stored in {st}",
                                               "union bound over the probabilistic events (lambda_for(p/events))")),
                     values=values))


# ------------------------------------------------------------------- vocab parallel (Megatron)
def _vp_models(prec: Precision, tp: int, reduce_fmt, local: Summation | None) -> Summation:
    base = local if local is not None else Summation(accum=prec.compute)
    rf = get_format(reduce_fmt) if reduce_fmt is not None else prec.compute
    return replace(base, split=tp, reduce_fmt=rf, reduce_algorithm="recursive")


@register("vocab_parallel_cross_entropy")
def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, tp: int, reduce_fmt=None,
                                 local_summation: Summation | None = None, fmt=None, compute_fmt=None,
                                 out_fmt=None, exp_ulps: float = 1.0, log_ulps: float = 1.0,
                                 mode: str = "deterministic", failure_probability: float | None = None) -> Bound:
    """Per-token bound for Megatron's ``vocab_parallel_cross_entropy`` (logits ``(N, V)`` as
    the full, unsharded tensor; ``tp`` contiguous shards; partial sums all-reduced in
    ``reduce_fmt``, default the compute format; loss in the compute format unless ``out_fmt``)."""
    prec0 = resolve_precision((logits,), fmt, compute_fmt, None)
    prec = Precision(prec0.storage, prec0.compute, get_format(out_fmt) if out_fmt is not None else prec0.compute)
    summ = _vp_models(prec, tp, reduce_fmt, local_summation)
    ms = resolve_mode(mode, failure_probability)
    lam = _lambdas(ms.mode, ms.failure_probability, 2)
    b, _, r = _log_softmax_core(f64(logits), prec, summ, prec.compute, exp_ulps, log_ulps, ms.mode, lam)
    tgt = target.reshape(-1, 1).to(torch.int64)
    bound = b.gather(1, tgt)[:, 0]
    values = {"V": r.n, "tp": tp, "theta": r.theta, "sigma": r.sigma}
    if ms.mode == "probabilistic":
        values["lambda"] = lam
    return Bound(abs=bound, mode=ms.mode, failure_probability=ms.failure_probability,
                 explanation=Explanation(
                     op="vocab_parallel_cross_entropy",
                     formula="log_softmax bound at the target with Summation(split=tp, reduce_fmt, ring) and stats in c",
                     source=SOURCE + "; Megatron-LM tensor_parallel/cross_entropy.py (VocabParallelCrossEntropy)",
                     assumptions=_assumptions(prec, summ, exp_ulps, ms.mode, ("all-reduce MAX exact; predicted-logit "
                                                                              "all-reduce adds zeros (exact)",)),
                     values=values))


def vocab_parallel_difference(logits: torch.Tensor, target: torch.Tensor, *, tp: int, reduce_fmt=None,
                              local_summation: Summation | None = None, single_summation: Summation | None = None,
                              single_stats_fmt=None, single_out_fmt=None, same_exp: bool = False, fmt=None,
                              compute_fmt=None, exp_ulps: float = 1.0, log_ulps: float = 1.0,
                              mode: str = "deterministic", failure_probability: float | None = None) -> Bound:
    """Per-token bound on ``|loss_vp - loss_single|``: Megatron's vocab-parallel loss (model A,
    see :func:`vocab_parallel_cross_entropy`) against a single-device cross entropy by the
    same shifted algorithm (model B: ``single_summation`` (default recursive in ``c``), row
    sum and log stored in ``single_stats_fmt`` (default ``c``; torch CPU on bf16 logits:
    pass the storage format), output ``single_out_fmt`` (default ``c``)).

    Shared between A and B: the max (exact) and every ``t_j = fl_c(x_j - m)``; with
    ``same_exp=True`` also the ``e_j``. See the module docstring for the composition."""
    prec0 = resolve_precision((logits,), fmt, compute_fmt, None)
    c = prec0.compute
    ms = resolve_mode(mode, failure_probability)
    # events: the summation difference, the beta bounds of A and B, and A's and B's own
    # bounds (which set the magnitudes of the final roundings)
    lam = _lambdas(ms.mode, ms.failure_probability, 5)
    sa = _vp_models(prec0, tp, reduce_fmt, local_summation)
    sb = single_summation if single_summation is not None else Summation(accum=c)
    st_b = get_format(single_stats_fmt) if single_stats_fmt is not None else c
    out_b = get_format(single_out_fmt) if single_out_fmt is not None else c
    x64 = f64(logits)
    ra = _row_stats(x64, c, sa, exp_ulps, ms.mode, lam)
    rb = _row_stats(x64, c, sb, exp_ulps, ms.mode, lam)
    E = torch.where(ra.masked, torch.zeros_like(ra.a), torch.exp(ra.a))
    S = E.sum(-1, keepdim=True)
    # |s_A - s_B|: the two trees over the same e_j (sum_difference_bound), plus the two exps
    Se = S * ra.se
    ds, dvals = sum_difference_bound(Se, Se, ra.n, sa, sb, sa.final_fmt, sb.final_fmt, ms.mode, lam)
    if not same_exp:
        ds = ds + 2 * ((E * torch.exp(ra.h)).sum(-1, keepdim=True) * ra.cu + ra.eta_e)
    rel = _inf_where(~torch.isfinite(rb.B), ds / (S * (1 - rb.B)))
    rel = _inf_where(~(rel < 1), rel)
    dlog = -torch.log1p(-rel)
    Bmax = torch.maximum(ra.B, rb.B)
    ust_b = st_b.u if not conversion_exact(c, st_b) else 0.0
    Dmax = -torch.log1p(-(Bmax + ust_b * (1 + Bmax)))
    Lmag = ra.L + Dmax
    clog = 2.0 * log_ulps * c.u
    diff = dlog + 2 * clog * Lmag
    if ust_b:
        diff = diff - torch.log1p(torch.full_like(diff, -ust_b)) + half_ulp(Lmag * (1 + clog), st_b)
    tgt = target.reshape(-1, 1).to(torch.int64)
    mag = (ra.L - ra.a).gather(1, tgt)
    # each side's own error bound (for the magnitude of its last roundings)
    ba, _ = _log_softmax_rows(ra, c, c, c, log_ulps, ms.mode, lam)
    bb_, _ = _log_softmax_rows(rb, c, out_b, st_b, log_ulps, ms.mode, lam)
    ea, eb = ba.gather(1, tgt), bb_.gather(1, tgt)
    fin = half_ulp(mag + ea, c) + half_ulp(mag + eb, c) + output_rounding(mag + eb, c, out_b)
    bound = (diff + fin)[:, 0]
    bad = (~ra.valid[:, 0] | ra.masked.gather(1, tgt)[:, 0] | ~torch.isfinite(Dmax[:, 0])
           | torch.isnan(bound))
    bound = torch.where(bad, torch.full_like(bound, math.inf), bound)
    values = {"V": ra.n, "tp": tp, **{f"sum_{k}": v for k, v in dvals.items()}, "same_exp": same_exp}
    if ms.mode == "probabilistic":
        values["lambda"] = lam
    return Bound(abs=bound, mode=ms.mode, failure_probability=ms.failure_probability,
                 explanation=Explanation(
                     op="vocab_parallel_cross_entropy difference",
                     formula="|l_A - l_B| <= -log(1 - |s_A - s_B|/(S(1-B))) + 2 c_log u (L+D) [+ stats roundings] "
                             "+ half_ulp_c(l_A) + half_ulp_c(l_B) [+ half_ulp_out(l_B)], |s_A - s_B| by sum_difference_bound",
                     source=SOURCE + "; shared-node cancellation: ttrace_num.bounds.summation",
                     assumptions=(f"A: {sa.describe()}, stats and output in {c}",
                                  f"B: {sb.describe()}, stats in {st_b}, output {out_b}",
                                  "same max and same t_j in both" + ("; same exp implementation" if same_exp else "")),
                     values=values))
