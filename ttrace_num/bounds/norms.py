r"""Layer normalisation (``layer_norm``) and RMS normalisation (``rms_norm``).

Notation: row ``x_1..x_n`` (stored values, exact), ``mu = sum x / n``, ``d_i = x_i - mu``,
biased variance ``v = sum d_i^2 / n`` (torch semantics), ``W = v + eps``,
``r = W^{-1/2}``, ``z_i = d_i r``, output ``y_i = z_i w_i + b_i``. ``c`` = compute format
(unit roundoff ``u``), ``o`` = output format, ``hu_f(t)`` = half an ulp of ``f`` at
magnitude ``<= t`` (:func:`~ttrace_num.formats.half_ulp`; absolute below the normal range).
Every bound is ``|y^_i - y_i| <= ...`` per element, for the stated computation model.

1. Mean and variance
--------------------
``moments="torch_cpu"`` (default; torch's CPU ``layer_norm``, verified *bit for bit*
against ``torch.native_layer_norm``'s mean/rstd, see tests): ATen's ``RowwiseMoments``
(``aten/src/ATen/native/cpu/moments_utils.h``) is a tree of Welford/Chan updates. The row
is read as vectors of ``V`` elements (``V = vector_bytes / sizeof(storage)``) accumulated
in ``L`` fp32 lanes (``L = vector_bytes / 4``; a bf16/fp16 vector is split in two halves):
per lane, chunks of 16 vectors are reduced by Welford's update, chunk results are merged by
a binary-counter cascade (pairwise) and the cascade's stack by a chain, the ``N mod V``
remaining elements by a scalar Welford chain, then the ``L`` lanes by a chain of Chan
merges; ``var = M / N``. Each merge of groups ``A`` and ``B`` (``n = nA + nB``,
``c = nB / n``, ``delta = mB - mA``) computes, in ``c``::

    delta^ = fl(mB^ - mA^);  q^ = fl(c^ delta^);  m^ = fl(mA^ + q^)
    M^ = two additions of M_A^, M_B^, P^ (any order),  P^ ~ nA c delta^2 (<= 3 roundings)

(Welford: ``B`` is one element, ``c^ = fl(1/n)`` or a division, ``P^ = fl(delta^ fl(x - m^))``).
FMA contraction (which torch uses) only removes roundings and is covered.

Error analysis (running, on the actual tree). Writing ``e = m^ - m`` for the group means,
the exact identity ``m^_v = (1-c) mA^ + c mB^ + (c^ - c) delta^ + c r1 + r2 + r3``
(``r1, r2, r3`` the roundings of ``delta^``, ``q^``, ``m^``) gives
``e_v = (1-c) e_A + c e_B + local_v`` and by induction
``mu^ - mu = sum_v (n_v / n) local_v`` (a convex, not additive, accumulation: the analogue
of Higham 2002 Lemma 3.1 for the mean; Chan, Golub & LeVeque 1983 for the updating
formulas). Bounds: ``|r1| <= hu(|delta| + E_A + E_B)``, ``|r2| <= hu((c + dc) |delta^|)``,
``|r3| <= hu(|m_v| + ...)``, ``dc = |c^ - c|`` (exact constant). For ``M``:
``M_v = M_A + M_B + nA c delta^2`` exactly, so
``M^_v - M_v = (M^_A - M_A) + (M^_B - M_B) + (P^ - P) + (two addition roundings)`` where
``|P^ - P|`` has a *coupling* part (``2 nA c |delta| (E_A + E_B) + ...``: the group-mean
errors enter the between-group sum of squares, the reason Welford's variance error grows
with the condition number ``kappa = |mu|/sigma`` (Chan-Golub-LeVeque: ``n kappa u`` for
plain Welford; here the tree is shallow)) and ``<= 3`` product roundings. The group means
``m_v`` and sums of squares ``M_v`` of every node are evaluated in float64 alongside
(the "shadow" tree, relative error ~1e-15, covered by inflating magnitudes by
``1 + 2^-40``), so the bound is data dependent and tight; it costs about two float64
passes over the data. ``moments="two_pass"``: ``mu^ = fl(fl(sum x)/n)`` and
``v^ = fl(fl(sum fl(d^_i^2))/n)``, ``d^_i = fl(x_i - mu^)``, sums under a
:class:`~ttrace_num.bounds.summation.Summation` (default recursive: any order). Then
(Higham 2002 §1.9, §4; Chan-Golub-LeVeque 1983) ``|mu^ - mu| <= E_mu`` from
:func:`~ttrace_num.bounds.summation.sum_error_bound` with one extra level for the division,
and, because ``sum d_i = 0`` exactly, the first-order effect of ``mu^ - mu`` on
``sum d^_i^2`` cancels::

    sum d^_i^2 = n v + 2 sum d_i rho_i + sum (mu - mu^ + rho_i)^2,   |rho_i| <= hu(|d_i| + E_mu)

and the sum of the ``n`` rounded squares is again a ``sum_error_bound`` (products rounded).

Two exact facts sharpen every rounding term above (both models and the output stage):
an addition ``fl(a + b)`` with ``a`` a c-number errs by at most ``|b|`` (``a`` itself is a
candidate of the rounding), so ``|r3| <= min(hu(.), |q^|)`` and the additions of ``M`` err
by at most ``|P^| + min(M_A^, M_B^)`` (a constant row gives exactly 0, as the kernel does);
and by Sterbenz's lemma ``fl(a - b)`` is exact when ``b/2 <= a <= 2b`` for every ``a, b``
within the error bounds (``x - mu^`` for large-mean rows, ``delta^`` in the Welford steps).
A sum that may overflow in ``c`` makes ``dW = inf`` (see below).

2. From the moments to the output (both models)
-----------------------------------------------
``W^ = fl(v^ + eps^)`` (``eps^ = fl_c(eps)``): ``|W^ - W| <= dW = E_v + |eps^ - eps| +
hu(W + E_v + |eps^-eps|)``.
``r^ = fl(1 / fl(sqrt(W^)))`` (correctly rounded ``sqrt`` and division, as torch CPU):
``r^/r = sqrt(W/W^) (1+a3)/(1+a2)``. The computed variance is a sum of non-negative
terms (every Welford increment ``delta^ fl(x - m^)`` is >= 0: ``m^`` stays between the old
mean and ``x``, both c-numbers; Chan's ``P^`` is a product of same-sign factors), so
``W^ >= eps^`` and ``W^ in [W_lo, W + dW]``, ``W_lo = max(eps^, W - dW)``. Hence
``|r^ - r| <= rho_r r`` with ``rho_r = max(sqrt(W / W_lo) (1+u)/(1-u) - 1,
1 - sqrt(W / (W + dW)) (1 - 2u/(1-u)))`` (the second is 1 when a sum may overflow in ``c``:
``dW = inf``, ``r^ = 0``, the output loses everything but stays bounded): the error of ``r^``
stays finite when the variance is lost entirely (near-constant rows, or a condition number
beyond ``1/u``), capped through ``eps^{-1/2}``.

Centering ``"subtract"`` (torch CPU fp32: ``y = fma(fl(fl(x - mu^) r^), w, b)``)::

    |d^_i - d_i| <= dd_i := E_mu + hu(|d_i| + E_mu)
    |z^_i - z_i| <= dz_i := dd_i r (1+rho_r) + |d_i| r rho_r + hu((|d_i| + dd_i) r (1+rho_r))

Centering ``"fold"`` (torch CPU bf16/fp16: ``y = fma(fma(x, r^, fl(-r^ mu^)), w, b)``, the
mean folded into a shift: cancellation between ``x r^`` and ``r^ mu^``)::

    dz_i := |d_i| r rho_r + E_mu r (1+rho_r) + hu(|x_i| r (1+rho_r)) + hu(r (1+rho_r)(|mu| + E_mu))
            + hu(|z_i| + ...)

Affine: ``|t^ - t| <= dz |w| + hu((|z| + dz)|w|) [weight] + hu(|t| + ...) [bias]``, then
``+ hu_o(|t| + dt)`` (0 when ``c -> o`` is exact).

**The 1/sigma amplification.** The mean's error enters as ``E_mu r = E_mu / sqrt(v + eps)``
and the variance's as ``|d_i| r rho_r ~ |z_i| E_v / (2 W)``. For ``x = 1e4 + N(0, 1)`` in
fp32, ``E_mu ~ u 1e4`` so the output error is ``~1e4 u`` in units of the output (all
implementations lose those digits: the data has condition number ``kappa = 1e4``); for a
near-constant row ``sigma -> 0`` and ``r`` is capped by ``eps^{-1/2}`` (316 for 1e-5):
the bound is ``E_mu / sqrt(eps)``. Forgetting the factor ``r`` (bounding ``|z^ - z|`` by
``E_mu + ...``) is violated on such data (tests).

3. rms_norm
-----------
torch CPU (``torch.rms_norm``, verified bit for bit): in ``c`` (fp32 for bf16/fp16/fp32),
``ms^ = fl(fl(sum fl(x_i^2)) / n)`` (torch's ``mean``), ``W^ = fl(ms^ + eps^)``,
``r^ = RSQRT(W^)`` (``torch.rsqrt`` = ``fl(1/fl(sqrt))``: relative error <= ``rsqrt_rel u``,
measured 1.5 u, see :mod:`.activations`), ``y = fl_o(fl(fl(x r^) w))``. ``eps=None`` is
torch's default ``finfo(compute format).eps`` (the *opmath* type: fp32 eps for bf16 inputs).
The sum is ATen's CPU sum (``SumKernel.cpp``, :func:`torch_cpu_sum`, verified bit for bit
against ``torch.sum``): ``n // L`` vectors in 4 interleaved streams, each a 4-level cascade
of chains of 16 (longer for n > 2^18), the streams and the ``L`` lanes then chained; its
tree height (:func:`torch_cpu_sum_height`: 26 for n = 1024, 41 for 16384 with 8 lanes)
is what the summation bound needs (it depends on the tree only through the height, see
:mod:`.summation`), so ``E_ms = theta(h + [x^2 rounded] + 1) ms + eta`` (or its Azuma form,
:func:`~ttrace_num.bounds.summation.accumulation_terms`; all terms >= 0, so relative), and
a :class:`~ttrace_num.bounds.summation.Summation` can be passed instead. Then
``rho_r = sqrt(W / W_lo) (1 + rsqrt_rel u) - 1``, ``dz = |x| r rho_r + hu(|x| r (1 + rho_r))``,
the weight product and the output rounding as above.

Probabilistic mode. The roundings inside the moments are martingale increments (Higham &
Mary 2019 model): the mean error is ``fixed + sum_k b_k xi_k`` with bounds ``b_k`` on the
increments propagated with the convex weights ``(n_v/n)``; ``M``'s own roundings likewise
(weight 1); the coupling terms, constants and second-order terms stay deterministic. Each
of the two (mean, ``M``) gets ``min(sum b_k, lambda sqrt(sum b_k^2))`` with ``lambda`` for
half the failure probability (union bound; three pieces for ``two_pass``). The few output
roundings stay deterministic.

Tightness (bench, torch CPU, median of bound/error at the worst element). bf16/fp16
outputs: the output rounding dominates, 1.0-1.07. fp32 layer_norm: random normal 1.1
(the last rounding, of ``+ b``, is nearly attained), heavy tails / long rows 1.0-1.1,
large mean ``1e4 + N(0,1)`` 9 (deterministic) / 6 (probabilistic), near-constant rows
10 / 7: there the mean's and the variance's worst cases (propagated through the running
analysis, each merge taking its worst case) dominate the output while the real errors
partly cancel. fp32 rms_norm: ~6-7 (n = 1024) to ~9-10 (n = 8192): ``rho_r`` is dominated by
``theta`` of the cascade's ~28-43 roundings of the sum of squares (``lambda sqrt(d) ~ d``
there, so the probabilistic form gains little), while the observed relative error is
~2-3 u. With the recursive ``Summation`` (any order) it would be ~200 / ~35.

Scale. Rows are bounded in chunks of :data:`CHUNK_ELEMENTS` elements (:func:`map_row_chunks`):
every quantity above is per row, so the result is bitwise that of one pass (tested), and the
extra memory is the two float64 results plus a constant working set instead of ~30 float64
copies of the input (a 2^26-element fp32 tensor took 7.5-9 GB).

Sources: Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed. (2002), §1.9
(two-pass variance), §3.1, Lemma 3.1, §4.2 (summation); Chan, Golub & LeVeque, "Algorithms
for computing the sample variance", Amer. Statist. 37 (1983); Welford (1962); Higham &
Mary, SISC 41(5) 2019 and Connolly, Higham & Mary, SISC 43(1) 2021 (probabilistic).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

import torch

from ..formats import FloatFormat
from .activations import LibraryErrors, hu, inflate, resolve_library
from .base import Bound, Explanation, lambda_for
from .common import ModeSpec, Precision, f64, register, resolve_mode, resolve_precision
from .summation import (
    Summation,
    accumulation_terms,
    conversion_exact,
    products_exact,
    sum_error_bound,
)

__all__ = [
    "MomentErrors",
    "TorchCPULayout",
    "default_layout",
    "layer_norm",
    "moment_errors",
    "check_dim",
    "map_row_chunks",
    "rms_norm",
    "torch_cpu_moments",
]

SOURCE = ("Higham (2002) §1.9, §3.1, §4.2; Chan, Golub & LeVeque, Amer. Statist. 37 (1983); "
          "probabilistic: Higham & Mary, SISC 41(5) 2019")

State = dict[str, torch.Tensor]


# ============================================================================ torch CPU layout


@dataclass(frozen=True)
class TorchCPULayout:
    """Vector geometry of ATen's ``RowwiseMoments``: ``vector_bytes`` = 32 (AVX2, default
    capability) or 64 (AVX512)."""

    vector_bytes: int = 32
    chunk: int = 16

    def vec_elems(self, storage: FloatFormat) -> int:
        """Elements per loaded vector (``Vectorized<T>::size()``; fp32 for fp32/fp64-free formats)."""
        return self.vector_bytes // (2 if storage.bits <= 16 else 4)

    @property
    def lanes(self) -> int:
        """fp32 accumulator lanes (``Vectorized<float>::size()``)."""
        return self.vector_bytes // 4


#: Rowwise bounds (norms, softmax family) process their rows in chunks of about this many
#: elements: the float64 working set (~20 arrays of a chunk's size) stays bounded whatever the
#: input's size, and every statistic is per row, so the results are bitwise those of one pass.
CHUNK_ELEMENTS = 1 << 19


def map_row_chunks(rows: torch.Tensor, fn) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Apply ``fn(rows64, sl) -> (bound, magnitude, extra)`` to chunks of rows of ``rows``
    (``(R, n)``, any dtype; each chunk converted to float64, about :data:`CHUNK_ELEMENTS`
    elements, at least one row; one empty chunk when ``R = 0``) and assemble the two float64
    ``(R, n)`` results; ``extra`` (small per-chunk values) is returned as a list."""
    R, n = rows.shape
    out_b = torch.empty((R, n), dtype=torch.float64)
    out_m = torch.empty((R, n), dtype=torch.float64)
    step = max(1, CHUNK_ELEMENTS // max(n, 1))
    extras = []
    for i in range(0, max(R, 1), step):
        sl = slice(i, min(i + step, R))
        b, m, e = fn(f64(rows[sl]), sl)
        out_b[sl], out_m[sl] = b, m
        extras.append(e)
    return out_b, out_m, extras


def check_dim(x: torch.Tensor, dim: int) -> int:
    """``dim`` normalised to ``[0, x.dim())``; a ``ValueError`` naming it when out of range."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    nd = max(x.dim(), 1)
    if not -nd <= dim < nd:
        raise ValueError(f"dim={dim} is out of range for an input of {x.dim()} dimensions "
                         f"(shape {tuple(x.shape)}); pass a dim in [{-nd}, {nd - 1}]")
    return dim % nd


def default_layout() -> TorchCPULayout:
    """The layout of the running torch build (``torch.backends.cpu.get_cpu_capability()``)."""
    cap = torch.backends.cpu.get_cpu_capability().upper()
    return TorchCPULayout(vector_bytes=64 if "AVX512" in cap else 32)


class MomentOps:
    """What a merge computes: the emulator rounds, the bound propagates error bounds.

    States are dicts of tensors (any leading shape); ``n`` counts are Python ints."""

    def leaf(self, x: torch.Tensor) -> State:  # pragma: no cover - interface
        raise NotImplementedError

    def welford(self, st: State, x: torch.Tensor, n_before: int, division: bool) -> State:  # pragma: no cover
        raise NotImplementedError

    def merge(self, a: State, b: State, na: int, nb: int, scalar: bool) -> State:  # pragma: no cover
        raise NotImplementedError


def _index(st: State, idx) -> State:
    return {k: v[idx] for k, v in st.items()}


def _ceil_log2(m: int) -> int:
    """ATen's ``utils::CeilLog2`` (1 for ``m <= 2``)."""
    return 1 if m <= 2 else (m - 1).bit_length()


def _welford_block(ops: MomentOps, xb: torch.Tensor, steps: int) -> State:
    """Welford over ``steps`` vectors; ``xb[..., j, :, :]`` is step ``j`` (vectorised over the rest)."""
    st = ops.leaf(xb[..., 0, :, :])
    for j in range(1, steps):
        st = ops.welford(st, xb[..., j, :, :], j, division=False)
    return st


def torch_cpu_moments(x: torch.Tensor, ops: MomentOps, storage: FloatFormat,
                      layout: TorchCPULayout | None = None) -> tuple[State, int]:
    """Run ATen's ``RowwiseMomentsImpl`` merge schedule on rows ``x`` (float64, shape
    ``(rows, N)``) with ``ops``; returns the root state (mean ``m``, sum of squares ``M``)
    and ``N``. Mirrors ``moments_utils.h`` of torch 2.13 (see the module docstring)."""
    layout = layout or default_layout()
    rows, N = x.shape
    V, L = layout.vec_elems(storage), layout.lanes
    halves = V // L
    n = N // V
    m = -(-n // layout.chunk)
    depth = _ceil_log2(m)
    # chunk results, vectorised over chunks: (rows, chunk, step, half, lane)
    full, rem = divmod(n, layout.chunk)
    chunks: list[tuple[State, int]] = []
    if full:
        xb = x[:, :full * layout.chunk * V].reshape(rows, full, layout.chunk, halves, L)
        blk = _welford_block(ops, xb, layout.chunk)
        chunks += [(_index(blk, (slice(None), i)), layout.chunk) for i in range(full)]
    if rem:
        xb = x[:, full * layout.chunk * V:n * V].reshape(rows, rem, halves, L)
        chunks.append((_welford_block(ops, xb, rem), rem))
    slots = max(depth, 1)
    stk: list[State | None] = [None] * slots
    cnt = [0] * slots

    def add_into(j: int, st: State, k: int) -> None:
        if cnt[j] == 0:
            stk[j] = st
        elif k:
            stk[j] = ops.merge(stk[j], st, cnt[j], k, scalar=False)
        cnt[j] += k

    for i, (st, m0) in enumerate(chunks):
        for h in range(halves):
            add_into(0, _index(st, (slice(None), h)), m0)
        mask, j = i + 1, 1
        while j < depth and (mask & 1) == 0:
            if cnt[j - 1]:
                add_into(j, stk[j - 1], cnt[j - 1])
            stk[j - 1], cnt[j - 1] = None, 0
            mask >>= 1
            j += 1
    for j in range(1, depth):
        if cnt[j]:
            add_into(0, stk[j], cnt[j])
    # scalar tail, then the lanes (AddMoments, a chain)
    tail: State | None = None
    t0 = 0
    for k in range(n * V, N):
        xk = x[:, k]
        tail = ops.leaf(xk) if t0 == 0 else ops.welford(tail, xk, t0, division=True)
        t0 += 1
    lane_n = n * V // L
    if lane_n:
        lanes = stk[0]
        for i in range(L):
            li = _index(lanes, (slice(None), i))
            tail = li if t0 == 0 else ops.merge(tail, li, t0, lane_n, scalar=True)
            t0 += lane_n
    return tail, N


class SumOps:
    """What an addition of the sum schedule does (emulation: round; height: count)."""

    def block(self, i: int):  # pragma: no cover - interface
        """The ``ilp`` vectors of block ``i`` (vector indices ``4 i .. 4 i + 3``)."""
        raise NotImplementedError

    def vector(self, i: int):  # pragma: no cover
        raise NotImplementedError

    def scalar(self, k: int):  # pragma: no cover
        raise NotImplementedError

    def add(self, a, b):  # pragma: no cover
        """``a + b`` rounded; ``None`` is the empty (exactly zero) accumulator."""
        raise NotImplementedError

    def part(self, a, k: int, axis: str):  # pragma: no cover
        """Stream ``k`` (``axis="stream"``) or lane ``k`` (``"lane"``) of accumulator ``a``."""
        raise NotImplementedError


def torch_cpu_sum(n: int, lanes: int, ops: SumOps, ilp: int = 4, levels: int = 4):
    """ATen's CPU sum of ``n`` contiguous fp32 values (``SumKernel.cpp``:
    ``vectorized_inner_sum`` -> ``row_sum`` -> ``multi_row_sum``), as a schedule of ``ops``
    additions: ``n // lanes`` vectors, read as ``ilp`` interleaved streams summed by a
    ``levels``-level cascade (chains of ``2^max(4, CeilLog2(size)/4)`` per level), the
    remaining vectors into stream 0, the streams combined by a chain; then a scalar chain
    over the ``n mod lanes`` last values followed by the ``lanes`` lane sums."""
    vec_size = n // lanes
    size = vec_size // ilp
    power = max(4, _ceil_log2(size) // levels)
    step, mask = 1 << power, (1 << power) - 1
    acc: list = [None] * levels
    i = 0
    while i + step <= size:
        for _ in range(step):
            acc[0] = ops.add(acc[0], ops.block(i))
            i += 1
        for j in range(1, levels):
            acc[j] = ops.add(acc[j], acc[j - 1])
            acc[j - 1] = None
            if i & (mask << (j * power)):
                break
    while i < size:
        acc[0] = ops.add(acc[0], ops.block(i))
        i += 1
    for j in range(1, levels):
        acc[0] = ops.add(acc[0], acc[j])
    streams = [None if acc[0] is None else ops.part(acc[0], k, "stream") for k in range(ilp)]
    for k in range(size * ilp, vec_size):
        streams[0] = ops.add(streams[0], ops.vector(k))
    vec = streams[0]
    for k in range(1, ilp):
        vec = ops.add(vec, streams[k])
    total = None
    for k in range(vec_size * lanes, n):
        total = ops.add(total, ops.scalar(k))
    for k in range(lanes):
        total = ops.add(total, None if vec is None else ops.part(vec, k, "lane"))
    return total


class _HeightOps(SumOps):
    """Counts the largest number of roundings on a leaf-to-root path (an addition to an
    empty accumulator is exact)."""

    def block(self, i: int) -> int:
        return 0

    vector = scalar = block

    def add(self, a, b):
        if a is None:
            return b
        if b is None:
            return a
        return max(a, b) + 1

    def part(self, a, k: int, axis: str):
        return a


@lru_cache(maxsize=1024)
def torch_cpu_sum_height(n: int, lanes: int = 8) -> int:
    """Tree height (roundings on the longest path) of :func:`torch_cpu_sum` for ``n`` values:
    e.g. 26 for n = 1024 and 49 for n = 16384 with 8 lanes (a recursive chain: n - 1)."""
    h = torch_cpu_sum(n, lanes, _HeightOps())
    return 0 if h is None else h


# ============================================================================ error propagation


def sub_rounding(a: torch.Tensor, ea: torch.Tensor, b: torch.Tensor, eb: torch.Tensor, mag: torch.Tensor,
                 c: FloatFormat) -> torch.Tensor:
    """Rounding error bound of ``fl(a^ - b^)`` for c-numbers ``a^ in [a +- ea]``,
    ``b^ in [b +- eb]`` with ``|a^ - b^| <= mag``: 0 when Sterbenz's lemma applies to every
    such pair (same sign, ``|b^|/2 <= |a^| <= 2|b^|``: the difference is exact), else
    ``hu_c(mag)``."""
    aa, ab = a.abs(), b.abs()
    exact = ((a * b) > 0) & (aa > ea) & (ab > eb) & (aa - ea >= (ab + eb) / 2) & (aa + ea <= 2 * (ab - eb))
    return torch.where(exact, torch.zeros_like(mag), hu(mag, c))


def _round_exact(v: Fraction, c: FloatFormat) -> Fraction:
    """Correct rounding (nearest, ties to even) of a rational to ``c`` (no overflow)."""
    if v == 0:
        return v
    a = abs(v)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    q = Fraction(2) ** (max(e, c.emin) - c.mantissa_bits)
    return round(v / q) * q  # Fraction.__round__: half to even


@lru_cache(maxsize=256)
def _conv(value: float, c: FloatFormat) -> tuple[float, float]:
    """``(fl_c(value), |fl_c(value) - value|)`` for a float64 constant (``eps``), exactly."""
    r = _round_exact(Fraction(value), c)
    return float(r), float(abs(r - Fraction(value))) * (1 + 2.0 ** -52)


@lru_cache(maxsize=4096)
def _ratio(nb: int, nv: int, c: FloatFormat) -> tuple[float, float]:
    """The kernel's constant ``c^ = fl(fl(nb) / fl(nv))`` (integer counts converted to ``c``,
    exact in fp32 below 2^24, then a correctly rounded division) and ``|c^ - nb/nv|``, both
    exact (rounded up to float64)."""
    ch = _round_exact(_round_exact(Fraction(nb), c) / _round_exact(Fraction(nv), c), c)
    err = abs(ch - Fraction(nb, nv))
    return float(ch), float(err) * (1 + 2.0 ** -52)


class BoundOps(MomentOps):
    """Shadow tree: exact (float64) group means ``m`` and sums of squares ``M``, with
    bounds on the computed ones: mean error ``Emf`` (fixed) + ``Emr`` (random, Azuma
    variance ``Vm``), ``M`` error ``EMf + EMr`` (``VM``). See the module docstring."""

    def __init__(self, c: FloatFormat):
        self.c = c

    def leaf(self, x: torch.Tensor) -> State:
        z = torch.zeros_like(x)
        return {"m": x, "M": z, "Emf": z, "Emr": z, "Vm": z, "EMf": z, "EMr": z, "VM": z}

    def _mean(self, a: State, b: State, cc: float, dc: float) -> tuple[State, torch.Tensor, torch.Tensor, torch.Tensor,
                                                                        torch.Tensor]:
        """Mean update; returns (new mean fields, |delta|, bound on |delta^|, bound on
        |delta^ - delta|, bound on the rounding of q^ = c^ delta^)."""
        c = self.c
        ea = a["Emf"] + a["Emr"]
        eb = b["Emf"] + b["Emr"]
        delta = b["m"] - a["m"]
        ad = inflate(delta.abs())
        dm = ad + ea + eb
        r1 = sub_rounding(b["m"], eb, a["m"], ea, dm, c)
        dD = dm + r1
        r2 = hu((cc + dc) * dD, c)
        m = a["m"] + cc * delta
        # fl(mA^ + q): mA^ is a c-number, so the error is also <= |q|
        r3 = torch.minimum(hu(inflate(m.abs()) + (1 - cc) * ea + cc * eb + dc * dD + cc * r1 + r2, c),
                           (cc + dc) * dD + r2)
        new = {"m": m,
               "Emf": (1 - cc) * a["Emf"] + cc * b["Emf"] + dc * dD,
               "Emr": (1 - cc) * a["Emr"] + cc * b["Emr"] + cc * r1 + r2 + r3,
               "Vm": (1 - cc) ** 2 * a["Vm"] + cc ** 2 * b["Vm"] + (cc * r1) ** 2 + r2 ** 2 + r3 ** 2}
        return new, ad, dD, ea + eb + r1, r2

    def welford(self, st: State, x: torch.Tensor, n_before: int, division: bool) -> State:
        c = self.c
        nv = n_before + 1
        cc = 1.0 / nv
        dc = 0.0 if division else _ratio(1, nv, c)[1]
        leaf = self.leaf(x)
        new, ad, dD, dd, _ = self._mean(st, leaf, cc, dc)
        em = new["Emf"] + new["Emr"]
        f2 = (1 - cc) * ad  # |x - m_v|
        ef2 = em + sub_rounding(x, torch.zeros_like(x), new["m"], em, f2 + em, c)  # |fl(x - m^_v) - (x - m_v)|
        p = inflate((1 - cc) * ad * ad)
        p_fix = dd * (f2 + ef2) + ad * ef2
        r5 = hu(dD * (f2 + ef2), c)  # product delta^ * F2^
        # M^ + P^: M^ is a c-number, so the error is also <= |P^|
        r6 = torch.minimum(hu(inflate(st["M"]) + st["EMf"] + st["EMr"] + p + p_fix + r5, c), p + p_fix + r5)
        new.update(M=st["M"] + p, EMf=st["EMf"] + p_fix, EMr=st["EMr"] + r5 + r6,
                   VM=st["VM"] + r5 ** 2 + r6 ** 2)
        return new

    def merge(self, a: State, b: State, na: int, nb: int, scalar: bool) -> State:
        c = self.c
        u = c.u
        nv = na + nb
        cc = nb / nv
        dc = _ratio(nb, nv, c)[1]
        dn = _ratio(na, 1, c)[1]
        new, ad, dD, dd, r2 = self._mean(a, b, cc, dc)
        p = inflate(na * cc * ad * ad)
        pstar = (na + dn) * (cc + dc) * dD * dD
        p_fix = ((na + dn) * (cc + dc) * dd * (2 * ad + dd) + (dn * (cc + dc) + na * dc) * ad * ad
                 + (1 + u) ** 2 * (na + dn) * dD * r2)
        rp = u * (1 + u) ** 2 * pstar  # each of <= 3 product roundings
        tot = inflate(a["M"] + b["M"]) + a["EMf"] + a["EMr"] + b["EMf"] + b["EMr"] + p + p_fix + 3 * rp
        # each of the two additions of c-numbers errs by <= the smaller operand: <= |P^| + min(M_A^, M_B^)
        small = p + p_fix + 3 * rp + torch.minimum(inflate(a["M"]) + a["EMf"] + a["EMr"],
                                                    inflate(b["M"]) + b["EMf"] + b["EMr"])
        ra = torch.minimum(hu(tot, c), small)
        new.update(M=a["M"] + b["M"] + p, EMf=a["EMf"] + b["EMf"] + p_fix,
                   EMr=a["EMr"] + b["EMr"] + 3 * rp + 2 * ra, VM=a["VM"] + b["VM"] + 3 * rp ** 2 + 2 * ra ** 2)
        return new


@dataclass
class MomentErrors:
    """Bounds on the computed mean and variance of each row (keepdim shape ``(rows, 1)``):
    ``mu``, ``v`` (float64 values), ``e_mu``, ``e_v`` (bounds for the mode)."""

    mu: torch.Tensor
    v: torch.Tensor
    e_mu: torch.Tensor
    e_v: torch.Tensor
    values: dict


def _two_part(fixed: torch.Tensor, rand: torch.Tensor, var: torch.Tensor, ms: ModeSpec, lam: float) -> torch.Tensor:
    if ms.mode == "deterministic":
        return fixed + rand
    return fixed + torch.minimum(rand, lam * torch.sqrt(var))


def _overflow(err: torch.Tensor, total: torch.Tensor, c: FloatFormat) -> torch.Tensor:
    """``inf`` where a sum of magnitude ``<= total`` (partial sums included: the bound of a
    sum of non-negative terms, or of ``sum |x_i|``) may overflow in ``c``
    (``sum_error_bound`` assumes no overflow)."""
    return torch.where(total >= c.max, torch.full_like(err, math.inf), err)


def _row_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 ``mu``, ``v`` (two-pass, float64) and ``|d_i|`` of each row ``(rows, N)``."""
    mu = x.mean(-1, keepdim=True)
    d = x - mu
    mu = mu + d.mean(-1, keepdim=True)  # one refinement step: |error| ~ 2^-53 mean|x|
    d = x - mu
    v = (d * d).mean(-1, keepdim=True)
    return mu, v, d.abs()


def moment_errors(x: torch.Tensor, prec: Precision, ms: ModeSpec, moments: str = "torch_cpu",
                  layout: TorchCPULayout | None = None, summation: Summation | None = None) -> MomentErrors:
    """Bounds on ``|mu^ - mu|`` and ``|v^ - v|`` per row of ``x`` (float64, ``(rows, N)``)."""
    c = prec.compute
    N = x.shape[-1]
    mu, v, ad = _row_stats(x)
    slack = 2.0 ** -45 * x.abs().amax(-1, keepdim=True)  # float64 mu/d evaluation
    if moments == "torch_cpu":
        lam = lambda_for(ms.failure_probability / 2) if ms.mode == "probabilistic" else math.inf
        root, _ = torch_cpu_moments(x, BoundOps(c), prec.storage, layout)
        root = {k: t.unsqueeze(-1) for k, t in root.items()}
        e_mu = _two_part(root["Emf"], root["Emr"], root["Vm"], ms, lam) + slack
        Nh, dN = _ratio(N, 1, c)
        e_M = _two_part(root["EMf"], root["EMr"], root["VM"], ms, lam)
        Mup = inflate(root["M"]) + e_M
        e_v = e_M / N + Mup * dN / (N * Nh) + hu(v + e_M / N + Mup * dN / (N * Nh), c)
        values = {"moments": f"torch CPU RowwiseMoments ({(layout or default_layout()).vector_bytes}-byte vectors)"}
        return MomentErrors(mu, v, e_mu, e_v, values)
    if moments != "two_pass":
        raise ValueError(f"moments must be 'torch_cpu' or 'two_pass', not {moments!r}")
    summ = summation if summation is not None else Summation(accum=c)
    lam = lambda_for(ms.failure_probability / 3) if ms.mode == "probabilistic" else math.inf
    S = inflate(x.abs().sum(-1, keepdim=True))
    e_mu, _ = sum_error_bound(S / N, mu.abs() + slack, N, summ, c, ms.mode, lam, extra_depths={c: 1})
    e_mu = _overflow(e_mu + slack, S * (1 + 2 * N * c.u), c)
    rho = hu(ad + slack + e_mu, c)
    incr = 2 * ad * rho  # the n subtraction roundings, coefficients 2 d_i (a martingale)
    dq_rand = incr.sum(-1, keepdim=True)
    if ms.mode == "probabilistic":
        dq_rand = torch.minimum(dq_rand, lam * torch.sqrt((incr * incr).sum(-1, keepdim=True)))
    dq = dq_rand + ((e_mu + slack + rho) ** 2).sum(-1, keepdim=True)
    Q = inflate(N * v) + dq
    e_s, _ = sum_error_bound(Q / N, Q / N, N, summ, c, ms.mode, lam, exact_products=False, extra_depths={c: 1})
    e_s = _overflow(e_s, Q * (1 + 2 * N * c.u), c)
    return MomentErrors(mu, v, e_mu, dq / N + e_s, {"moments": f"two-pass, summation {summ.describe()}"})


# ============================================================================ output stage


def _rho_r(dW: torch.Tensor, W: torch.Tensor, eps_hat: float, rsqrt_rel: float) -> torch.Tensor:
    """Relative error bound of the computed ``W^{-1/2}``: ``W^ in [W_lo, W + dW]`` with
    ``W_lo = max(eps^, W - dW)`` (the computed variance / mean square is a sum of
    non-negative terms, so ``fl(v^ + eps^) >= eps^``); ``inf`` when ``W_lo <= 0``. The
    lower side ``1 - sqrt(W/(W+dW))(1 - rel)`` is 1 when ``W^`` may overflow (``r^ = 0``)."""
    w_lo = torch.clamp(W - dW, min=eps_hat)
    base = torch.where(w_lo > 0, torch.sqrt(W / w_lo.clamp(min=1e-300)), torch.full_like(W, math.inf))
    up = base * (1.0 + rsqrt_rel) - 1.0
    down = 1.0 - torch.sqrt(W / (W + dW)) * (1.0 - rsqrt_rel)  # W^ up to W + dW (inf: overflow, r^ = 0)
    return torch.maximum(up, down)


def _affine_out(z: torch.Tensor, dz: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None,
                prec: Precision) -> tuple[torch.Tensor, torch.Tensor]:
    """Bound after ``* w`` and ``+ b`` (each rounded in c) and the output rounding; returns (bound, |y|)."""
    c, o = prec.compute, prec.out
    az = z.abs()
    if w is not None:
        aw = f64(w).abs()
        dt = dz * aw + hu(inflate(az * aw) + dz * aw, c)
        t = z * f64(w)
    else:
        dt, t = dz, z
    if b is not None:
        t = t + f64(b)
        dt = dt + hu(inflate(t.abs()) + dt, c)
    at = inflate(t.abs())
    if not conversion_exact(c, o):
        dt = dt + hu(at + dt, o)
    return dt, at


def _rows(x: torch.Tensor, normalized_shape) -> tuple[torch.Tensor, int]:
    """The rows ``(R, n)`` of ``x`` in its own dtype (a view when contiguous) and ``n``."""
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    k = len(tuple(normalized_shape))
    if tuple(x.shape[x.dim() - k:]) != tuple(normalized_shape):
        raise ValueError(f"normalized_shape {tuple(normalized_shape)} does not match input {tuple(x.shape)}")
    n = math.prod(normalized_shape)
    return x.detach().reshape(-1, n), n


def _normalized_last(x: torch.Tensor, normalized_shape, dim: int
                     ) -> tuple[torch.Tensor, tuple[int, ...], int | None]:
    """``(x, normalized_shape, back)``: without ``normalized_shape``, the norm runs over ``dim``,
    moved last (``back`` = ``dim``, for :func:`_finish` to move it back; None when already last)."""
    if normalized_shape is not None:
        return x, normalized_shape, None
    back = None
    dim = check_dim(x, dim)
    if dim != x.dim() - 1:
        x, back = x.movedim(dim, -1), dim
    return x, (x.shape[-1],), back


def _tmax(t: torch.Tensor) -> float:
    """``max(t)`` of a non-negative tensor (0 when empty; the maximum over chunks is the whole
    tensor's)."""
    return float(t.max()) if t.numel() else 0.0


def _flat(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if t is None else t.reshape(n)


def _inf_rows(err: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows with non-finite inputs (or NaN bounds) get ``inf``."""
    bad = ~torch.isfinite(rows).all(-1, keepdim=True)
    return torch.where(bad | torch.isnan(err), torch.full_like(err, math.inf), err)


def _finish(t: torch.Tensor, x: torch.Tensor, back: int | None) -> torch.Tensor:
    """Rows ``(R, n)`` back to the input's layout."""
    t = t.reshape(x.shape)
    return t if back is None else t.movedim(-1, back)


@register("layer_norm")
def layer_norm(x: torch.Tensor, normalized_shape: int | Sequence[int] | None = None,
               weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, eps: float = 1e-5, *,
               dim: int = -1, moments: str = "torch_cpu", centering: str | None = None,
               layout: TorchCPULayout | None = None, summation: Summation | None = None,
               fmt=None, compute_fmt=None, out_fmt=None, mode: str = "deterministic",
               failure_probability: float | None = None) -> Bound:
    """Bound on ``|F.layer_norm(x, normalized_shape, weight, bias, eps) - exact|`` per element.

    Args:
        normalized_shape: as torch (default: ``(x.shape[dim],)`` with ``dim=-1``).
        moments: ``"torch_cpu"`` (ATen's Welford cascade, default) or ``"two_pass"``.
        centering: ``"subtract"`` (``(x - mu^) r^``, torch CPU fp32) or ``"fold"``
            (``x r^ - mu^ r^``, torch CPU bf16/fp16); default by the storage format.
        layout: vector geometry of ``torch_cpu`` (default: the running build's).
        summation: sums of ``two_pass`` (default recursive in the compute format).
    """
    x, normalized_shape, back = _normalized_last(x, normalized_shape, dim)
    prec = resolve_precision((x,), fmt, compute_fmt, out_fmt)
    ms = resolve_mode(mode, failure_probability)
    c = prec.compute
    if centering is None:
        centering = "subtract" if prec.storage.precision >= c.precision else "fold"
    if centering not in ("subtract", "fold"):
        raise ValueError(f"centering must be 'subtract' or 'fold', not {centering!r}")
    rows, n = _rows(x, normalized_shape)
    eps_h, deps = _conv(float(eps), c)
    u = c.u
    w, bb = _flat(weight, n), _flat(bias, n)

    def rows_fn(rows: torch.Tensor, sl: slice):
        me = moment_errors(rows, prec, ms, moments, layout, summation)
        W = me.v + eps
        dW = me.e_v + deps + hu(inflate(W) + me.e_v + deps, c)
        rho = _rho_r(dW, W, eps_h, (1 + u) / (1 - u) - 1)
        r = inflate(1.0 / torch.sqrt(W))
        d = rows - me.mu
        ad = inflate(d.abs()) + 2.0 ** -45 * rows.abs().amax(-1, keepdim=True)
        z = d * r
        if centering == "subtract":
            dd = me.e_mu + sub_rounding(rows, torch.zeros_like(rows), me.mu, me.e_mu, ad + me.e_mu, c)
            dz = dd * r * (1 + rho) + ad * r * rho + hu((ad + dd) * r * (1 + rho), c)
        else:
            pre = ad * r * rho + me.e_mu * r * (1 + rho)
            pi = hu(rows.abs() * r * (1 + rho), c)
            beta = hu(r * (1 + rho) * (me.mu.abs() + me.e_mu), c)
            dz = pre + pi + beta + hu(inflate(z.abs()) + pre + pi + beta, c)
        err, mag = _affine_out(z, dz, w, bb, prec)
        return _inf_rows(err, rows), _inf_rows(mag, rows), (me.values, _tmax(rho), _tmax(r))

    err, mag, ex = map_row_chunks(rows, rows_fn)
    me_values = ex[0][0]
    rho_max, r_max = max(e[1] for e in ex), max(e[2] for e in ex)
    values = {**me_values, "n": n, "eps": eps, "centering": centering, "precision": prec.describe(),
              "max rho_r": rho_max, "max r = 1/sqrt(v+eps)": r_max}
    if ms.mode == "probabilistic":
        values["failure split"] = "mean / M (torch_cpu: 2 pieces; two_pass: 3)"
    return Bound(abs=_finish(err, x, back), mode=ms.mode, failure_probability=ms.failure_probability,
                 magnitude=_finish(mag, x, back),
                 explanation=Explanation(
                     op="layer_norm",
                     formula="|err_i| <= [E_mu r(1+rho_r) + |d_i| r rho_r + roundings] |w_i| + hu(..) + hu_out(|y_i| + ..), "
                             "rho_r = sqrt(W / max(eps^, W - dW)) (1+u)/(1-u) - 1",
                     source=SOURCE,
                     assumptions=(f"moments: {me_values['moments']}", f"centering: {centering}",
                                  "sqrt and division correctly rounded (r = 1/sqrt(v+eps))",
                                  "FMA contraction allowed (covered)"),
                     values=values))


@register("rms_norm")
def rms_norm(x: torch.Tensor, normalized_shape: int | Sequence[int] | None = None,
             weight: torch.Tensor | None = None, eps: float | None = 1e-6, *, dim: int = -1,
             summation: Summation | str | None = None, layout: TorchCPULayout | None = None,
             library: LibraryErrors | str | None = None, fmt=None, compute_fmt=None, out_fmt=None,
             mode: str = "deterministic", failure_probability: float | None = None) -> Bound:
    """Bound on ``|F.rms_norm(x, normalized_shape, weight, eps) - exact|``; ``eps=None`` is
    torch's default ``finfo(compute format).eps``. ``summation``: the tree of the sum of
    squares, ``"torch_cpu"`` (default: ATen's cascade, :func:`torch_cpu_sum`, with the
    ``layout``'s lanes) or a :class:`~ttrace_num.bounds.summation.Summation`. See the module
    docstring."""
    x, normalized_shape, back = _normalized_last(x, normalized_shape, dim)
    prec = resolve_precision((x,), fmt, compute_fmt, out_fmt)
    ms = resolve_mode(mode, failure_probability)
    c = prec.compute
    lib = resolve_library(library, c)
    if eps is None:
        eps = c.eps
    rows, n = _rows(x, normalized_shape)
    prod = 0 if products_exact(prec.storage, c) else 1  # x^2 rounded in c
    if summation is None or summation == "torch_cpu":
        lanes = (layout or default_layout()).lanes
        height = torch_cpu_sum_height(n, lanes if n >= lanes else 1)
        depths = {c: height + prod + 1}  # + the division by n
        coef, eta = accumulation_terms(depths, {c: (height + prod) * n + 1}, ms.mode, ms.lam)
        sdesc = f"torch CPU cascade sum ({lanes} lanes, tree height {height})"
    else:
        sdesc = summation.describe()
    eps_h, deps = _conv(float(eps), c)
    w = _flat(weight, n)

    def rows_fn(rows: torch.Tensor, sl: slice):
        S = inflate((rows * rows).sum(-1, keepdim=True))
        ms_ = S / n
        if summation is None or summation == "torch_cpu":
            e_ms = coef * ms_ + eta
        else:
            e_ms, _ = sum_error_bound(ms_, ms_, n, summation, c, ms.mode, ms.lam,
                                      exact_products=not prod, extra_depths={c: 1})
        e_ms = _overflow(e_ms, S * (1 + 2 * n * c.u), c)
        W = ms_ + eps
        dW = e_ms + deps + hu(inflate(W) + e_ms + deps, c)
        rho = _rho_r(dW, W, eps_h, lib.rsqrt_rel * c.u)
        r = inflate(1.0 / torch.sqrt(W))
        ax = rows.abs()
        dz = ax * r * rho + hu(ax * r * (1 + rho), c)
        err, mag = _affine_out(rows * r, dz, w, None, prec)
        return _inf_rows(err, rows), _inf_rows(mag, rows), _tmax(rho)

    err, mag, ex = map_row_chunks(rows, rows_fn)
    values = {"n": n, "eps": eps, "summation": sdesc, "precision": prec.describe(),
              "rsqrt": f"{lib.name} ({lib.rsqrt_rel} u)", "max rho_r": max(ex)}
    if ms.mode == "probabilistic":
        values["lambda"] = ms.lam
    return Bound(abs=_finish(err, x, back), mode=ms.mode, failure_probability=ms.failure_probability,
                 magnitude=_finish(mag, x, back),
                 explanation=Explanation(
                     op="rms_norm",
                     formula="|err_i| <= [|x_i| r rho_r + hu(|x_i| r(1+rho_r))] |w_i| + hu(..) + hu_out(..), "
                             "rho_r = sqrt(W / max(eps^, W - dW)) (1 + rsqrt_rel u) - 1, dW from the summation bound of sum x^2",
                     source=SOURCE, assumptions=(f"summation of x^2: {sdesc}",
                                                 "y = fl_out(fl(fl(x * rsqrt(mean(x^2) + eps)) * w)) in the compute format"),
                     values=values))
