r"""Expected rounding error of a sum evaluated in an unknown order: a variance, not a bound.

The bounds of :mod:`.summation` hold for *any* order and with probability ``1 - p``; for fp32
sums over random-sign data they are 100-1000x the error a kernel commits
(:mod:`.matmul`, "Tightness"). A noise sample of a traced reference
(:mod:`tracer.compare.thresholds`) needs something else: noise whose *variance* is that of the
legitimate difference between two runs, since its thresholds already carry the statistical
factor. This module gives that variance.

Model
-----
A recursive sum ``s_j = fl(s_{j-1} + t_{pi(j)})`` commits ``s_j delta_j`` at every addition,
the ``delta_j`` independent, mean 0, ``|delta_j| <= u`` (the probabilistic model of Higham &
Mary 2019), uniform on ``[-u, u]`` for round-to-nearest: variance ``u^2 / 3``. To first
order ``err = sum_{j>=2} delta_j s_j``, so ``Var(err | order) = (u^2/3) sum_{j>=2} s_j^2``.

The order of a kernel is unknown: take it uniformly random (exchangeable terms). With
``Q = sum_i t_i^2`` and ``C = sum_i t_i`` over the ``n`` terms, a prefix of ``j`` terms drawn
without replacement has ``E[s_j^2] = j^2 C^2/n^2 + j (n-j)/(n-1) (Q/n - C^2/n^2)``, and summing
over ``j = 1..n`` (``sum j^2 = n(n+1)(2n+1)/6``, ``sum j(n-j) = n(n+1)(n-1)/6``)::

    sum_j E[s_j^2] = (n + 1) (Q/6 + C^2/3)                                    (1)

exactly (``tests/test_summation_variance.py`` enumerates every permutation). Hence, for one
run of a sum of ``n`` terms split into ``k`` contiguous parts of ``m = ceil(n/k)`` terms,
each a chain in format ``a`` (unit roundoff ``u_a``), the partials reduced by a chain in
format ``r``:

* the parts: ``(u_a^2/3) (m + 1) (Q/6 + k P/3)``, ``P = E[p_i^2] = m(n-m)/(n-1) (Q/n - C^2/n^2)
  + m^2 C^2/n^2`` the mean square of a partial (``P = C^2`` for ``k = 1``, recovering (1));
* the reduction (``k > 1``): (1) over the ``k`` partials, ``(u_r^2/3) (k + 1) (k P/6 + C^2/3)``,
  plus ``(u_r^2/3) k P`` when the partials are rounded into ``r``;
* products that are not exact in ``a`` (fp32 inputs accumulated in fp32 without FMA):
  ``(u_a^2/3) Q``.

The difference of two runs whose orders are unknown (nothing shared, roundings independent)
has the sum of their variances (:func:`difference_std`).

Why it is a safe variance for real kernels, and where it is not a bound: a blocked,
vectorised or pairwise kernel adds into several shorter chains, whose partial sums are
smaller than a single chain's, so its ``sum_j s_j^2`` is smaller than (1) in expectation. The
recursive random-order chain is the largest of the usual orders (measured on this machine's
fp32 GEMMs: the actual spread of a split-vs-unsplit difference is 0.1-0.5x of
:func:`difference_std`, ``tests/test_summation_variance.py``). It is an *expected* value
over orders and roundings: a particular order on particular data can exceed it, which is
what the statistical factor of a threshold built on it is for. First order only (the
``delta_i delta_j`` terms are ``O(n u^2)`` smaller); no underflow term (a variance of the
subnormal absolute errors would be below fp32's ``2^-149``-scale and is ignored).
The result is assumed to stay in the final format of the sum: a result then rounded to a
narrower format (a bf16 GEMM's fp32 accumulator stored in bf16) adds that rounding's variance,
:func:`rounding_variance`, as :func:`gemm_difference_variance` does.

Rounding a result into a narrow format
--------------------------------------
Round-to-nearest of a value ``v`` whose bits below the format's precision are not special
commits an error uniform on ``[-h, h]``, ``h = half_ulp(v)`` (:func:`~ttrace_num.formats.half_ulp`:
``u 2^e`` in the binade ``[2^e, 2^(e+1))``, at most ``u |v|``): variance ``h^2 / 3``
(:func:`rounding_variance`; measured on random bf16 roundings within 2% of it,
``tests/test_summation_variance.py``). Two runs whose pre-rounding values differ by much less
than the spacing round to the same value far more often than independent roundings would, so
counting the two roundings as independent over-states their difference (safe): that is the
case of a GEMM that a TP candidate does not split (a column-parallel forward), whose two runs
differ by 0 at most elements. The rounding of a run whose sum already ends in the narrow
format (a reduction of bf16 partials in bf16, ``Summation.final_fmt``) is part of its chain
and is not added again.

A bf16 GEMM, one unsplit run against a TP-split one (fp32 partials rounded to bf16 and reduced
in bf16: the row-parallel forward and the column-parallel input gradient), differs by the two
output roundings and those of the partials and of their reduction. Measured on this machine's
bf16 GEMMs split like that (``tests/test_summation_variance.py``, K = 64-4096): the rms
difference is 0.73-0.78x the model's standard deviation for tp = 2 and 4, while noise ``U b``
from the probabilistic bound of that difference (what the noise injector draws without a
variance model) has 1.9-2.6x (tp = 2) and 3.7-4.1x (tp = 4) the model's standard deviation.
The megatron and plain-PyTorch references use it for bf16 GEMMs except in models with top-k
routing (:func:`tracer.adapters.megatron.injector_models`).

Where the model fails: stagnation
---------------------------------
The ``delta_j`` are independent with mean 0 only while each addend is large against the
spacing of the running sum. A chain in a narrow format over many terms of one sign (a bf16
chain adding one token's gradient at a time, as torch's CPU layer-norm backward does for
``dbeta``/``dgamma``) grows a running sum whose half-ulp exceeds the addends: they are then
absorbed, each error is ``-t`` (the sign of the coherent part, not random), and the errors add
linearly instead of as a random walk. Measured on that kernel (bias gradient over all tokens vs
over two halves added in fp32, gradients ``0.01 (z + kappa v)``, ``z`` and ``v`` standard normal,
``v`` shared by the tokens), rms difference over the model's standard deviation: 0.3-0.8 for
every ``kappa`` in 0-10 at 128 tokens; 1.83 at 256 tokens and ``kappa = 10``, 1.53 at 512 and
``kappa = 3``, 4.7 at 1024 and ``kappa = 3``. :func:`may_stagnate` marks where that can happen,
``u max_j |S_j| >= m rms(t)`` with ``S_j`` the prefix sums in the chain's order and ``m = 1/2``:
an addend below half the rms (38% of normal ones) can be absorbed once the running sum's
half-ulp (``u |S|`` at most) reaches it. ``m = 1`` (the rms addend absorbed) leaves the 256-token
case above unmarked at 1.83x; with ``m = 1/2`` the unmarked elements of every measured case are
within 0.19-0.84x of the model. Since ``max |S_j| <= K rms(t)``, no chain shorter than
``m / u`` terms (128 in bf16) is ever marked. Marked elements take a deterministic bound of
:mod:`.summation` instead (``tests/test_summation_variance.py``): safe, but a median 100-200x
their actual difference at 256-1024 tokens (more at 2048), so a tensor made of such sums is
checked only coarsely.

Below that, the absorption is partial but still one-sided: an addend is rounded to the running
sum's spacing, ``e_j = rnd(t_j) - t_j``, and where the addends are coherent and not much larger
than that spacing the errors do not average out. Measured on the cost bench's larger model
(128 tokens, TP2 + SP, bf16): the clean candidate's ``input_layernorm.bias`` gradients were
1.1-2.3% larger than the reference's in every element block, beyond this variance; on synthetic
gradients over 128 tokens the kernel's squared difference is 1.03x the variance at coherence 3
and 6.5x at coherence 10 (``tests/test_summation_variance.py``). Such a chain
is deterministic given its terms and their order, and :func:`chain_split_difference` emulates
it: the difference between one running sum in the narrow format over all terms and ``k``
contiguous parts summed alike, then added exactly, is that of torch's CPU layer-norm
backward over all tokens vs over ``k`` sequence shards (bitwise equal to the kernel with one
thread, ``tests/test_summation_variance.py``). The noise of such a sum then gets that
difference's square on top of the variance.

Known orders
------------
(1) is an average over orders. For one fixed order ``sum_j s_j^2`` fluctuates around it with
an exponential tail (a random walk's ``int W^2``), so a bound ``z sqrt((1))`` holds for the
*mixture* over orders at a rate far above ``2 exp(-z^2/2)``: measured on MKL's fp32 8x8 GEMMs
(one chain in index order), 7.6e-6 at K = 64 and 1.3e-5 at K = 128 over 10^6 elements against
a claimed 1e-6 (docs/bounds.md, "Statistical mode"). Where the order is known, the
conditional proxy is computed instead: with the order fixed, ``err = sum_v delta_v s_v`` is a
martingale whose increments are sub-Gaussian with proxy ``(u^2/3) s_v^2``, so
``V = (u^2/3) sum_v s_v^2`` over the additions ``v`` of that order, ``s_v`` its exact node
sums, gives ``P(|err| > z sqrt(V)) <= 2 exp(-z^2/2)`` with no average over orders left:

* :func:`chain_variance`: a recursive chain in index order (``s_j`` the exact prefix sums, ``+ Q``
  for rounded products);
* :func:`order_variance`: ATen's CPU cascade sum (:func:`aten_cascade_sum`, the tree of
  ``SumKernel.cpp``, reproduced bit for bit under the ``default`` and ``avx2`` dispatches; the
  vector width is the only dispatch-dependent parameter: 8 lanes there, 16 under AVX512).
  An addition of a structural zero (the first term of an accumulator) is exact and not counted.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from ..formats import FloatFormat, half_ulp
from .summation import Summation, conversion_exact

__all__ = ["aten_cascade_sum", "aten_sum_lanes", "chain_split_difference", "chain_variance", "order_variance", "difference_std", "gemm_difference_variance", "matmul_sum_statistics",
           "matmul_variance", "may_stagnate", "rounding_variance", "sum_variance", "variance_coefficients"]

#: ``m`` of :func:`may_stagnate` (module docstring, "Where the model fails")
STAGNATION_MARGIN = 0.5


def variance_coefficients(n: int, summation: Summation | None = None, exact_products: bool = True
                          ) -> tuple[float, float]:
    """``(alpha, beta)`` such that :func:`sum_variance` is ``alpha Q + beta C^2``: every term of
    the model (module docstring) is linear in ``Q`` and ``C^2``, through ``P = p_Q Q + p_C C^2``
    with ``p_Q = m(n-m)/((n-1) n)`` and ``p_C = m/n^2 (m - (n-m)/(n-1)) >= 0``, so both
    coefficients are non-negative (no cancellation in the sum) and the variance of a whole
    tensor of sums costs two elementwise passes."""
    s = summation or Summation()
    if n <= 1:
        return 0.0, 0.0
    k, m = s.parts(n), s.part_size(n)
    p_q = m * (n - m) / ((n - 1) * n)
    p_c = m / n**2 * (m - (n - m) / (n - 1))
    ua2 = s.accum.u ** 2 / 3.0
    alpha = ua2 * (m + 1) * (1.0 / 6.0 + k * p_q / 3.0) + (0.0 if exact_products else ua2)
    beta = ua2 * (m + 1) * k * p_c / 3.0
    if k > 1:  # identity (1) over the k partials, whose mean square is P
        rf: FloatFormat = s.reduce_fmt or s.accum
        ur2 = rf.u ** 2 / 3.0
        alpha += ur2 * (k + 1) * k * p_q / 6.0
        beta += ur2 * (k + 1) * (k * p_c / 6.0 + 1.0 / 3.0)
        if not conversion_exact(s.accum, rf):
            alpha += ur2 * k * p_q
            beta += ur2 * k * p_c
    return alpha, beta


def sum_variance(sq_sum: torch.Tensor, total: torch.Tensor, n: int, summation: Summation | None = None,
                 exact_products: bool = True) -> torch.Tensor:
    """Variance of the rounding error of one run of an ``n``-term sum in a random order
    (module docstring), elementwise from ``Q = sum t^2`` (``sq_sum``) and ``C = sum t``
    (``total``), float64: ``alpha Q + beta C^2`` (:func:`variance_coefficients`).
    ``summation``: accumulation format and split (the algorithm is taken as a random-order
    chain whatever it says: the largest of the usual orders)."""
    return _combined(sq_sum, total, *variance_coefficients(n, summation, exact_products))


def _combined(q: torch.Tensor, c: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """``alpha Q + beta C^2`` elementwise in float64 (zeros when both coefficients are)."""
    q, c = q.double(), c.double()
    if alpha == 0.0 and beta == 0.0:
        return torch.zeros_like(q)
    return torch.addcmul(q * alpha, c, c, value=beta)


def may_stagnate(terms: torch.Tensor, accum: FloatFormat, margin: float = STAGNATION_MARGIN) -> torch.Tensor:
    """Where a recursive chain in format ``accum`` adding ``terms`` along dim 0, in that order,
    can absorb its addends (module docstring, "Where the model fails"), elementwise over the
    other dims: ``u max_j |S_j| >= margin rms(t)``, ``S_j`` the prefix sums (float64)."""
    t = terms.double()
    peak = t.cumsum(0).abs().amax(0)
    rms = t.square().mean(0).sqrt()
    return accum.u * peak >= margin * rms


def chain_split_difference(terms: torch.Tensor, dtype: torch.dtype, split: int) -> torch.Tensor:
    """A running sum of ``terms`` along dim 0, in that order, stored in ``dtype`` after every
    addition (each addition exact in float32, then rounded), minus the same over ``split``
    contiguous parts whose results are added exactly; elementwise over the other dims, float64
    (module docstring, "Where the model fails"). 0 for ``split <= 1``."""
    t = terms.detach().float()
    if split <= 1 or t.shape[0] < 2:
        return torch.zeros(t.shape[1:], dtype=torch.float64)

    def chain(rows: torch.Tensor) -> torch.Tensor:
        s = torch.zeros(rows.shape[1:], dtype=dtype)
        for row in rows:
            s = (s.float() + row).to(dtype)
        return s.double()
    size = -(-t.shape[0] // split)
    return chain(t) - sum(chain(t[i:i + size]) for i in range(0, t.shape[0], size))


def matmul_sum_statistics(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, int, bool]:
    """``(Q, C, n, exact_products)`` of every output of ``a @ b (+ bias)`` for
    :func:`sum_variance`: ``Q = (a*a) @ (b*b) (+ bias^2)``, ``C = a @ b (+ bias)`` (float64
    tensors), ``n`` terms (the ``K`` products, then the bias); products of fp32 inputs count as
    rounded (no FMA assumed), of bf16/fp16 inputs as exact.

    The two GEMMs run in float32 on operands scaled by powers of two (:func:`_unit_scaled`:
    exact, and no square or sum can overflow), 2.3x faster than in float64 on this CPU (512 x
    1024 x 4096: 52 vs 120 ms, where the bf16 GEMM itself takes 11 ms). What that costs in
    accuracy: ``Q`` is a sum of non-negative terms, the squares of bf16/fp16 values are exact
    in float32 (16 and 22 significant bits), so ``Q`` is within ``gamma_(K+1)`` relative of the
    exact one (``(K + 2) u``, ``u = 2^-24``: 2.4e-4 at ``K = 4096`` in the worst case). ``C``
    is within ``gamma_K sum |a_i b_i|`` of the exact sum; under the random-rounding model the
    variance itself rests on, that error is ``~u sqrt(K)`` of ``sum |a_i b_i|``, and its effect
    on the ``C^2`` terms of the variance, relative to the variance, is below ``~6 K u`` (1.5e-3
    at ``K = 4096``; the model's own accuracy against real kernels is 0.73-0.78x). Measured
    against the float64 statistics (``tests/test_summation_variance.py``): the variance agrees
    within 1e-5 relative on random and cancelling GEMMs, K = 64-4096, at scales 2^-100 to 2^100.
    Operands with NaN/Inf take float64 (the statistics are then not finite either way).
    """
    (a32, ea), (b32, eb) = _unit_scaled(a), _unit_scaled(b)
    if a32 is None or b32 is None:
        a64, b64 = a.detach().double(), b.detach().double()
        q, c = torch.matmul(a64 * a64, b64 * b64), torch.matmul(a64, b64)
    else:
        q = torch.matmul(a32 * a32, b32 * b32).double().mul_(2.0 ** (2 * (ea + eb)))
        c = torch.matmul(a32, b32).double().mul_(2.0 ** (ea + eb))
    n = a.shape[-1]
    if bias is not None:
        bias64 = bias.detach().double()
        q, c, n = q + bias64 * bias64, c + bias64, n + 1
    exact = a.dtype in (torch.bfloat16, torch.float16) and b.dtype in (torch.bfloat16, torch.float16)
    return q, c, n, exact


def _unit_scaled(x: torch.Tensor) -> tuple[torch.Tensor | None, int]:
    """``(x 2^-e, e)`` in float32, ``2^(e-1) <= max |x| < 2^e``: the scaled values are below 1 in
    magnitude, so their squares, and sums of up to ``2^100`` products of them, stay in float32's
    range. The scaling is exact except for values below ``2^-126`` of the largest; the squares
    of values below ``2^-63`` of the largest lose precision (float32 subnormals) or vanish, a
    share of ``Q`` below ``2^-126`` of the largest term. ``(None, 0)`` when ``x`` has a value
    that is not finite."""
    x32 = x.detach().float()
    largest = float(x32.abs().amax()) if x32.numel() else 0.0
    if not math.isfinite(largest):
        return None, 0
    e = max(math.frexp(largest)[1], -126) if largest > 0 else 0  # 2^126 is a float32, 2^130 is not
    return (x32 * 2.0 ** -e if e else x32), e


def matmul_variance(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
                    summation: Summation | None = None) -> torch.Tensor:
    """:func:`sum_variance` of every output of ``a @ b (+ bias)`` (:func:`matmul_sum_statistics`)."""
    q, c, n, exact = matmul_sum_statistics(a, b, bias)
    return sum_variance(q, c, n, summation, exact_products=exact)


def rounding_variance(values: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Variance of one round-to-nearest of ``values`` into ``fmt``, elementwise, float64:
    ``half_ulp(v)^2 / 3`` (module docstring, "Rounding a result into a narrow format")."""
    return half_ulp(values.detach().double(), fmt) ** 2 / 3.0


def gemm_difference_variance(q: torch.Tensor, c: torch.Tensor, n: int, exact_products: bool,
                             models: tuple[Summation | None, ...], out_fmt: FloatFormat | None = None
                             ) -> torch.Tensor:
    """Variance of the difference of independent runs (``models``, ``None``: the default
    unsplit fp32 sum) of sums with statistics ``Q``, ``C`` over ``n`` terms
    (:func:`matmul_sum_statistics`), each run's result stored in ``out_fmt``: the sum of their
    :func:`sum_variance`, plus :func:`rounding_variance` of ``C`` for each run whose sum ends
    in a format wider than ``out_fmt`` (module docstring)."""
    alpha = beta = 0.0
    rounded = 0  # runs whose result is rounded into out_fmt after their sum
    for model in models:
        s = model or Summation()
        a, b = variance_coefficients(n, s, exact_products)
        alpha, beta = alpha + a, beta + b
        rounded += out_fmt is not None and s.final_fmt.u < out_fmt.u
    var = _combined(q, c, alpha, beta)
    return var.add_(rounding_variance(c, out_fmt), alpha=rounded) if rounded else var


def difference_std(*variances: torch.Tensor) -> torch.Tensor:
    """Standard deviation of the difference of independent runs: ``sqrt(sum of variances)``."""
    return torch.sqrt(sum(variances[1:], variances[0]))



# ------------------------------------------------------------------------------ known orders
def chain_variance(terms: torch.Tensor, accum: FloatFormat, dim: int = -1, exact_terms: bool = True) -> torch.Tensor:
    r"""Variance proxy of the error of *one* recursive chain adding ``terms`` along ``dim`` in
    index order (module docstring, "Known orders"): ``(u^2/3) (sum_{j>=2} s_j^2 [+ Q when the
    terms are rounded products])``, ``s_j`` the exact prefix sums, float64."""
    t = terms.double().movedim(dim, -1)
    s = t.cumsum(-1)[..., 1:]
    v = s.square().sum(-1)
    if not exact_terms:
        v = v + t.square().sum(-1)
    return v * (accum.u ** 2 / 3.0)


def aten_sum_lanes() -> int:
    """Lanes of ``Vectorized<float>`` in the ATen CPU kernels this process dispatches to:
    16 under AVX512, else 8 (AVX2, and the ``default`` build, whose generic ``Vectorized``
    is 32 bytes wide)."""
    return 16 if torch.backends.cpu.get_cpu_capability().upper().startswith("AVX512") else 8


def _ceil_log2(x: int) -> int:
    return 1 if x <= 2 else int(x - 1).bit_length()


Fold = Callable[[torch.Tensor, int], torch.Tensor]


def aten_cascade_sum(x: torch.Tensor, add: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                     lanes: int | None = None) -> torch.Tensor:
    r"""The summation tree of ATen's CPU ``sum`` over the last dim of a contiguous row
    (``aten/src/ATen/native/cpu/SumKernel.cpp``: ``vectorized_inner_sum`` -> ``row_sum`` ->
    ``multi_row_sum``), walked with ``add`` at every node whose operands are both (structurally)
    nonzero (each chain of one level at once, vectorised): ``add = lambda a, b: (a +
    b).float().double()`` reproduces the fp32 kernel bit for bit (``tests/test_statistical.py``);
    :func:`order_variance` walks it exactly (float64 prefix sums) to get its node sums.

    Tree, for ``n`` terms and ``W`` = :func:`aten_sum_lanes` (``W = 1``, scalar, when ``n < W``):
    the ``n // W`` full vectors are read as ``size_ilp = n // (4W)`` groups of 4 (``ilp_factor``),
    each of the 4 accumulators (vectors of ``W`` lanes) a 4-level cascade: level 0 adds
    ``2^p`` vectors (``p = max(4, ceil_log2(size_ilp) // 4)``), then is added into level 1,
    level 1 into 2 each ``2^(2p)``, level 2 into 3 each ``2^(3p)``; then the levels are added into
    level 0, the leftover vectors into accumulator 0, accumulators 1-3 into 0; the scalar tail
    ``x[n - n % W:]`` is a chain, into which the ``W`` lanes of accumulator 0 are added in turn."""
    def fold(t: torch.Tensor, dim: int) -> torch.Tensor:
        acc = t.select(dim, 0)
        for i in range(1, t.shape[dim]):
            acc = add(acc, t.select(dim, i))
        return acc
    return _cascade(x, fold, lanes)


def _cascade(x: torch.Tensor, fold: Fold, lanes: int | None) -> torch.Tensor:
    """:func:`aten_cascade_sum` with every chain of the tree evaluated by ``fold(items, dim)`` (a
    chain along ``dim`` whose first item enters exactly), one level's chains at once."""
    n, w = x.shape[-1], lanes or aten_sum_lanes()
    w = w if n >= w else 1
    vec_size, groups = n // w, n // w // 4
    step = 1 << max(4, _ceil_log2(groups) // 4)
    vec = x[..., :vec_size * w].reshape(x.shape[:-1] + (vec_size, w))
    items: torch.Tensor | None = vec[..., :groups * 4, :].reshape(x.shape[:-1] + (groups, 4, w))
    levels: list[torch.Tensor] = []  # acc[0..3] at the end of the loop, each (..., 4, W)
    for _ in range(3):  # level j adds its items in chains of `step`, each then added into level j+1
        if items is None:
            break
        full = items.shape[-3] // step
        tail = items[..., full * step:, :, :]
        if tail.shape[-3]:
            levels.append(fold(tail, -3))
        items = fold(items[..., :full * step, :, :].reshape(items.shape[:-3] + (full, step) + items.shape[-2:]),
                     -3) if full else None
    if items is not None:  # level 3: one chain, never cascaded
        levels.append(fold(items, -3))
    lane_sums = x.new_zeros(x.shape[:-1] + (0,))
    if levels or vec_size > groups * 4:
        ps = fold(torch.stack(levels, -3), -3) if levels else None  # (..., 4, W)
        first = ([ps[..., 0, :]] if ps is not None else []) + [vec[..., v, :] for v in range(groups * 4, vec_size)]
        ps0 = fold(torch.stack(first, -2), -2)
        if ps is not None:
            ps0 = fold(torch.stack([ps0, ps[..., 1, :], ps[..., 2, :], ps[..., 3, :]], -2), -2)
        lane_sums = ps0
    final = torch.cat([x[..., vec_size * w:], lane_sums], -1)
    return fold(final, -1) if final.shape[-1] else torch.zeros(x.shape[:-1], dtype=x.dtype)


def order_variance(x: torch.Tensor, accum: FloatFormat, lanes: int | None = None) -> torch.Tensor:
    r"""Variance proxy of the error of ATen's CPU cascade sum (:func:`aten_cascade_sum`) of
    ``x`` over its last dim: ``(u^2/3) sum_v s_v^2`` over the tree's additions ``v`` (both
    operands nonzero), ``s_v`` the exact node sums (module docstring, "Known orders"), float64."""
    squares: list[torch.Tensor] = []

    def fold(t: torch.Tensor, dim: int) -> torch.Tensor:
        c = t.cumsum(dim)
        if c.shape[dim] > 1:
            squares.append(c.narrow(dim, 1, c.shape[dim] - 1).square().reshape(x.shape[:-1] + (-1,)).sum(-1))
        return c.select(dim, -1)
    _cascade(x.double(), fold, lanes)
    total = torch.stack(squares).sum(0) if squares else torch.zeros(x.shape[:-1], dtype=torch.float64)
    return total * (accum.u ** 2 / 3.0)
