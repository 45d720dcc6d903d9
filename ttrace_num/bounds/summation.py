r"""Summation, the kernel of every reduction, dot product and matmul.

Computation model
-----------------
A sum of ``n`` terms is evaluated by a binary tree of additions. Every node ``v`` of
the tree rounds its exact result to a format ``f(v)``: ``s_hat_v = (s_hat'_v)(1 + delta_v)``
with ``|delta_v| <= u_f(v)``, where ``s_hat'_v`` is the sum of the node's computed children
(for a leaf: the product ``a_k b_k`` of a dot product, when it is rounded). A
:class:`Summation` states the tree: the accumulation format, the algorithm
(``recursive``: a left-to-right chain, also FMA-based dot products; ``pairwise``;
``blocked(b)``: chains of ``b`` then a chain of block sums) and an optional split of the
terms into ``split`` contiguous parts (split-K, tensor parallelism) whose partial sums
are rounded to ``reduce_fmt`` and reduced by a chain (``recursive``, e.g. a ring
all-reduce) or a tree (``pairwise``).

What a model covers. The error bound depends on the tree only through ``d_f``, the
largest number of roundings in format ``f`` on one root-to-leaf path. So a model covers
*every* computation whose paths have at most ``d_f`` roundings in each format, whatever
its order: ``recursive`` over ``n`` terms (height ``n - 1``, the largest of any binary
tree with ``n`` leaves) is valid for any summation order, hence the safe default for a
kernel whose order is unknown (MKL, cuBLAS). The order matters only when two
computations are compared (:func:`sum_difference_bound`): rounding errors can be shared
and cancel only if the trees are really known, which :attr:`Summation.known_order`
asserts.

The exact identity (by induction over the tree: the error of a node is the error of its
children plus its own rounding)::

    computed - exact = sum_v delta_v * s_hat'_v                                  (1)

with ``|s_hat'_v| <= (1 + theta) S_v``, where ``S_v`` is the sum of ``|x_i|`` under ``v``
and ``theta`` the deterministic relative bound below. An *antichain* of nodes (no node
an ancestor of another) has disjoint subtrees, so ``sum_{v in antichain} S_v <= S`` and
``sum S_v**2 <= S**2`` with ``S = sum |x_i|``. By Mirsky's theorem (the dual of Dilworth's)
the nodes of format ``f`` split into ``d_f`` antichains, ``d_f`` being the longest chain of
``f``-nodes, i.e. the largest number of ``f``-roundings on one root-to-leaf path. Hence

* deterministic: ``|err| <= theta * S`` with ``theta = prod_f (1 + u_f)**d_f - 1`` (every
  term is multiplied by the roundings on its path: Higham 2002, Lemma 3.1, §3.1, §4.2),
  which is at most the first-order form ``(1 + theta) (sum_f d_f u_f) S``;
* probabilistic: in evaluation order the terms of (1) form a martingale when the
  ``delta_v`` are mean-independent (the model of Higham & Mary 2019; Connolly, Higham &
  Mary 2021), each bounded by ``c_v = u_f (1 + theta) S_v``; Azuma-Hoeffding gives, with
  probability at least ``1 - 2 exp(-lambda**2 / 2)``,
  ``|err| <= lambda sqrt(sum_v c_v**2) <= lambda (1 + theta) sqrt(sum_f d_f u_f**2) * S``.

Growth of the partial sums (probabilistic mode). ``(1 + theta)`` bounds ``|s_hat'_v| / S_v``
in the worst case; when ``sum_f d_f u_f`` is not small (fp16 accumulation over thousands
of terms, bf16 over hundreds) it explodes (``theta ~ exp(d u) - 1``). Under the same model
a computed partial sum is ``sum_i x_i prod_{w on i's path below v} (1 + delta_w)``; along one
path the ``delta_w`` are, in evaluation order, martingale differences, so by the maximal
Azuma-Hoeffding inequality and ``|log(1+delta) - delta| <= delta^2/(1-u)`` *every* prefix
product of one path stays within ``g = exp(lambda' sqrt(sum_f d_f u_f^2) + sum_f d_f
u_f^2/(1-u_f)) - 1`` of 1 with probability ``>= 1 - 2 exp(-lambda'^2/2)`` (Higham & Mary 2019,
Thm 2.4, in maximal form). With a union bound over the ``n`` terms' paths (and the
partials' paths of the outer stage), ``|s_hat'_v| <= (1 + g) S_v`` at every node; the terms
``delta_v s_hat'_v 1{that holds at v}`` are still martingale differences (the event is
known before ``delta_v``), bounded by ``u (1 + g) S_v``, and equal the error's terms when
the event holds everywhere. So, splitting the failure probability ``p`` into ``p/2`` for
Azuma and ``p/2`` over the paths (``lambda_2 = lambda(p/2)``, ``lambda' = lambda(p/(2 m))``,
``m`` paths): ``|err| <= lambda_2 (1 + g) sqrt(sum_f d_f u_f^2) S``. The bound used is the
smallest of the deterministic one and the two probabilistic forms (which one depends on
``n`` and the formats only, never on the rounding errors, so the minimum still fails with
probability at most ``p``); ``g`` also replaces ``theta_in`` in ``T_hat`` below.

Underflow. Below the normal range a rounding is ``fl(z) = z (1 + delta) + eta`` with
``|eta| <= eta_f = fmt.subnormal_abs_error``. The sum of two numbers of format ``f`` is
exact when it is subnormal (Hauser 1996; Higham 2002, §2.1), so ``eta`` arises only where
a node's operands are not both in its format: the rounding (or fused use) of each of
the ``n`` products/terms, the conversion of each partial sum to ``reduce_fmt``, and extra
levels such as a mean's division. The bound adds ``sum_f r_f eta_f`` with ``r_f`` those
counts (:meth:`Summation.roundings`; in a format without subnormals, which flushes,
every addition is counted too).

Flush to zero (``Summation(ftz=True)``). Kernels such as AVX512-BF16 GEMMs (``vdpbf16ps``
flushes its fp32 results below ``2^-126`` and reads bf16 subnormals as 0) and GPU tensor
cores may replace a value below the normal range of the format it is held in by 0 (FTZ).
A flushed value ``z`` has ``|z| < min_normal_f``, so such a rounding is
``fl(z) = z (1 + delta) + eta`` with ``|eta| < min_normal_f`` (``delta = 0``, ``eta = -z``)
and every rounding of the tree can do it, additions included (the exact sum of two normals
can be subnormal): ``eta = sum_f r_f min_normal_f`` with ``r_f`` all roundings per format
(:meth:`Summation.roundings`: ``n`` products, ``n - k`` additions, the partials' conversions
and additions), i.e. ``(2n - k) min_normal(accum)`` for ``k`` parts in one format. The result
rounded to ``o`` may be flushed where it may be below ``min_normal_o`` (``|y|_lower - acc <
min_normal_o``; everywhere without a lower bound on ``|y|``): error ``<= min(t, min_normal_o)``,
``t = |y| + acc`` (:func:`output_rounding` takes the larger of that and ``half_ulp_o(t)``
there). Inputs read as zero (DAZ)
are the caller's term (the matmul adds ``|A_sub| |B| + |A| |B_sub|``, the products with a
subnormal operand). These terms matter only for results within a few ``n min_normal`` of 0
(``n 2^-126`` for fp32 accumulation, ``6.1e-5`` for fp16 outputs): bf16/fp16 tightness on
normal data is unchanged.

Overflow. The model (1) assumes no rounding overflows. Every computed partial sum (and
product) of a stage satisfies ``|s_hat_v| <= (1 + theta) M`` (``M = S`` in the parts,
``T_hat`` in the reduction, below; in probabilistic mode the path growth ``g`` replaces
``theta`` under the event the claim already rests on). Where that exceeds the largest finite
value of a format the stage holds values in (``accum``, the leaf formats, ``reduce_fmt``), the
kernel may return ``inf`` (torch does: e.g. an fp16 all-reduce of partials of +-6e4 whose sum
is small), and the bound there is ``inf`` (:func:`overflow_possible`); the output rounding is
``inf`` above the output format's maximum (:func:`~ttrace_num.formats.half_ulp`). Values
after ``extra_depths`` (a mean's division) are not checked: those levels do not grow the sum.

Two stages (split sums, and levels applied to the whole sum)
------------------------------------------------------------
With ``split = k`` parts the computed sum is the reduction of the computed partial sums
``p_hat_i`` (exact: ``p_i``). Each ``p_hat_i`` is within ``theta_in S_i`` of ``p_i``, so
``sum_i |p_hat_i| <= T_hat = T + theta_in S`` with ``T = sum_i |p_i|``, and the reduction
(conversion to ``reduce_fmt``, reduce tree, then any ``extra_depths`` such as a mean's
division) is a sum of the ``p_hat_i``: its nodes satisfy (1) with ``T_hat`` in place of
``S`` (its antichains have ``sum |s_hat'_v| <= (1 + theta_out) T_hat``). Hence

* deterministic: ``|err| <= theta_in S + theta_out T_hat``;
* probabilistic (one martingale over both stages):
  ``|err| <= lambda sqrt((1+theta_in)**2 s_in**2 S**2 + (1+theta_out)**2 s_out**2 T_hat**2)``
  with ``s**2 = sum_f d_f u_f**2`` over the stage's levels.

``T <= S`` always (``T = S`` recovers the single-stage bounds above); ``T = |exact sum|``
for one part. A caller that can bound ``T`` (a matmul: ``sum_i |A_i B_i|`` from ``k``
partial products, the cost of one more matmul in total) makes the reduction levels scale
with the partial sums, not with ``S``: for random-sign data ``T ~ sqrt(k n)`` versus
``S ~ n``, which is what makes a split-K / tensor-parallel bf16 reduction bound tight.

Difference of two models
------------------------
Two computations of the same sum ``a`` and ``b`` differ, by (1), by
``err_a - err_b = sum_{v in A} delta_v s'_v - sum_{v in B} delta_v s'_v``. Nodes that are
the same operation in both (same operands, same order, same format) have identical
``delta_v s'_v`` and cancel exactly; this requires both trees to be known
(``known_order=True`` on both models; an emulation, a documented kernel). With ``d'_a``,
``d'_b`` the per-format chain lengths of the *unshared* nodes:

* deterministic: the smaller of ``bound_a + bound_b`` (triangle inequality through the
  exact sum) and the unshared part of (1), ``sum_{side, stage} (1+theta) c(d') M`` with
  ``c(d) = sum_f d_f u_f`` and ``M`` the stage's magnitude (``S`` or ``T_hat``);
* probabilistic: one martingale over the unshared nodes of both computations (the
  Higham-Mary model makes the roundings of both runs mean-independent), Azuma-Hoeffding:
  ``lambda sqrt(sum_{side, stage} ((1+theta) M)**2 sum_f d'_f u_f**2)``: quadrature instead
  of the sum of two worst cases. This holds for unknown orders too (nothing shared). The
  output roundings need each side's magnitude, i.e. each side's own accumulation bound:
  three events, each given ``p/3``; the smaller of this, the deterministic bound and the sum
  of the two single bounds at ``p/2`` is used (each fails with probability at most ``p`` and
  the choice depends on the data only, so the minimum does too).

Shared nodes recognised (both ``known_order``): identical models share every node
(difference 0, the computations are bitwise equal); the same inner trees (format,
algorithm, part size) share every inner node; the same accumulation format shares the
rounded products; a recursive chain split into ``k`` contiguous parts shares the first
part's chain with the unsplit chain. Without a known order nothing is shared, not even
between two computations of the same model: a real kernel's order can depend on the
shapes and memory layout (MKL's fp32 GEMM gives different bits for ``(A @ B)[:, :1]`` and
``A @ B[:, :1]``, see ``tests/test_bounds_matmul.py``), so two "identical" models of
unknown order are two independent computations.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Literal

import torch

from ..formats import FloatFormat, get_format, half_ulp

Algorithm = Literal["recursive", "pairwise", "blocked"]
ALGORITHMS = ("recursive", "pairwise", "blocked")

Depths = dict[FloatFormat, int]


def _merge(*ds: Depths) -> Depths:
    out: Depths = {}
    for d in ds:
        for f, k in d.items():
            if k > 0:
                out[f] = out.get(f, 0) + k
    return out

__all__ = [
    "Summation",
    "tree_height",
    "theta",
    "sigma_coefficient",
    "linear_coefficient",
    "products_exact",
    "conversion_exact",
    "output_rounding",
    "accumulation_terms",
    "underflow_term",
    "difference_depths",
    "unshared_depths",
    "sum_error_bound",
    "sum_difference_bound",
    "path_growth",
    "overflow_possible",
]


def tree_height(n: int, algorithm: Algorithm, block: int = 32) -> int:
    """Levels of additions on the longest root-to-leaf path of an ``n``-term sum."""
    if n <= 1:
        return 0
    if algorithm == "recursive":
        return n - 1
    if algorithm == "pairwise":
        return math.ceil(math.log2(n))
    if algorithm == "blocked":
        b = max(1, min(block, n))
        return (b - 1) + (math.ceil(n / b) - 1)
    raise ValueError(f"unknown summation algorithm {algorithm!r}; use one of {ALGORITHMS}")


@dataclass(frozen=True)
class Summation:
    """How an ``n``-term sum (or dot product) is evaluated.

    Args:
        accum: accumulation format (fp32 for CPU bf16 GEMMs and most GPU kernels).
        algorithm: ``"recursive"`` (left-to-right, FMA chains; its height ``n-1`` is the
            largest of any order, so it is the safe model of a kernel whose order is
            unknown), ``"pairwise"`` or ``"blocked"``.
        block: block length for ``"blocked"``.
        split: number of contiguous parts the terms are split into (split-K, tensor
            parallel row-parallel linear). Each part is summed with ``algorithm`` in ``accum``.
        reduce_fmt: format the partial sums are rounded to and reduced in (e.g. bf16 for a
            gloo bf16 all-reduce); ``None`` means ``accum``.
        reduce_algorithm: how the ``split`` partials are combined: ``"recursive"`` (ring /
            sequential) or ``"pairwise"`` (tree).
        known_order: ``True`` asserts that the computation evaluates exactly this tree in
            this order (an emulation, a kernel whose order is documented). Only then may
            :func:`sum_difference_bound` cancel roundings shared with another model.
            ``False`` (default): the model only bounds the depths of an unknown tree,
            which is all the error bound of a single computation needs.
        ftz: the kernel may flush to zero every product, partial sum and result that lies
            below the normal range of the format it is held in, and read subnormal inputs as
            zero (FTZ/DAZ: AVX512-BF16 ``vdpbf16ps`` GEMMs, GPU tensor cores). Each rounding
            of the tree then has the absolute error ``min_normal`` of its format, additions
            included, and a result below the output's normal range may become 0 (module
            docstring, "Flush to zero"). ``False``: gradual underflow (IEEE).
    """

    accum: FloatFormat = get_format("fp32")
    algorithm: Algorithm = "recursive"
    block: int = 32
    split: int = 1
    reduce_fmt: FloatFormat | None = None
    reduce_algorithm: Algorithm = "recursive"
    known_order: bool = False
    ftz: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "accum", get_format(self.accum))
        if self.reduce_fmt is not None:
            object.__setattr__(self, "reduce_fmt", get_format(self.reduce_fmt))
        for a in (self.algorithm, self.reduce_algorithm):
            if a not in ALGORITHMS:
                raise ValueError(f"unknown summation algorithm {a!r}; use one of {ALGORITHMS}")
        if self.split < 1 or self.block < 1:
            raise ValueError(f"split and block must be >= 1 (got split={self.split}, block={self.block})")

    @property
    def final_fmt(self) -> FloatFormat:
        """Format of the last rounding of the sum."""
        return (self.reduce_fmt or self.accum) if self.split > 1 else self.accum

    def part_size(self, n: int) -> int:
        return math.ceil(n / self.split)

    def parts(self, n: int) -> int:
        """Number of non-empty parts of ``ceil(n / split)`` terms."""
        return math.ceil(n / self.part_size(n)) if n > 0 else 0

    def inner_depths(self, n: int, exact_products: bool = True) -> Depths:
        """Largest number of roundings per format on one path inside a part (all ``n`` terms
        when ``split == 1``): the part's tree in ``accum``, plus one level for rounding the
        terms into ``accum`` when ``exact_products=False`` (the products of a dot product,
        e.g. fp32 inputs accumulated in fp32)."""
        inner = tree_height(self.part_size(n), self.algorithm, self.block) + (0 if exact_products else 1)
        return {self.accum: inner} if inner else {}

    def outer_depths(self, n: int) -> Depths:
        """Largest number of roundings per format on one path of the reduction of the
        partial sums: their conversion to ``reduce_fmt`` (when inexact) and the reduce tree."""
        if self.split == 1 or n <= 1:
            return {}
        rf = self.reduce_fmt or self.accum
        outer = tree_height(self.parts(n), self.reduce_algorithm, self.block)
        outer += int(not conversion_exact(self.accum, rf))
        return {rf: outer} if outer else {}

    def depths(self, n: int, exact_products: bool = True) -> Depths:
        """``d_f``: largest number of roundings per format on one root-to-leaf path of an
        ``n``-term sum (inner and outer levels together)."""
        return _merge(self.inner_depths(n, exact_products), self.outer_depths(n))

    def roundings(self, n: int) -> Depths:
        """Per format, the number of roundings of one output's tree that can underflow with
        an absolute error (see the module docstring): the ``n`` terms' rounding into
        ``accum`` (counted even for products exact in precision: they can underflow) and
        the conversion of each partial sum to ``reduce_fmt``. Additions of two numbers of
        the node's format are exact when subnormal and are not counted, unless the format
        has no subnormals or the kernel flushes them (``ftz``)."""
        if n <= 0:
            return {}
        k = self.parts(n)
        rf = self.reduce_fmt or self.accum
        r: Depths = {self.accum: n + (0 if self.accum.subnormals and not self.ftz else n - k)}
        if k > 1:
            r[rf] = r.get(rf, 0) + (0 if conversion_exact(self.accum, rf) else k) \
                + (0 if rf.subnormals and not self.ftz else k - 1)
        return r

    def describe(self) -> str:
        s = f"{self.algorithm}" + (f"(b={self.block})" if self.algorithm == "blocked" else "")
        s += f" in {self.accum}"
        if self.split > 1:
            s += f", split into {self.split} parts reduced {self.reduce_algorithm} in {self.reduce_fmt or self.accum}"
        if self.known_order:
            s += ", known order"
        if self.ftz:
            s += ", subnormals may be flushed to zero"
        return s


def products_exact(in_fmt: FloatFormat, accum: FloatFormat) -> bool:
    """A product of two ``in_fmt`` numbers is exact in ``accum`` (ignoring underflow)
    when ``2 p_in <= p_accum`` (e.g. bf16 x bf16 in fp32: 16 <= 24)."""
    return 2 * in_fmt.precision <= accum.precision


def conversion_exact(src: FloatFormat, dst: FloatFormat) -> bool:
    """Every finite ``src`` value is representable in ``dst``."""
    return (src == dst) or (dst.mantissa_bits >= src.mantissa_bits and dst.emax >= src.emax
                            and dst.emin - dst.mantissa_bits * dst.subnormals
                            <= src.emin - src.mantissa_bits * src.subnormals)


def overflow_possible(partial_sum_upper: torch.Tensor, fmt: "FloatFormat | str") -> torch.Tensor:
    """Bool tensor: ``True`` where a value of magnitude up to ``partial_sum_upper`` (an upper
    bound on a computed partial sum, product or result held in ``fmt``, before its rounding)
    may not be representable in ``fmt``: ``partial_sum_upper > fmt.max`` (also for NaN).

    Above ``fmt.max`` round-to-nearest overflows to ``inf`` from ``max + half_ulp(max)`` on
    (IEEE formats; a saturating or finite-only format returns ``max`` or NaN), so a finite bound
    there would be a false claim: callers make their bound ``inf`` where this is ``True``
    (:func:`sum_error_bound` does it for the partial sums of every stage). Conservative by half
    an ulp at ``max``, like :func:`~ttrace_num.formats.half_ulp`."""
    if not isinstance(partial_sum_upper, torch.Tensor):
        raise TypeError(f"partial_sum_upper must be a torch.Tensor, got {type(partial_sum_upper).__name__}")
    return ~(partial_sum_upper.abs() <= get_format(fmt).max)


def theta(depths: Depths) -> float:
    """``prod_f (1 + u_f)**d_f - 1``: deterministic relative error of ``d_f`` roundings per format."""
    return math.prod((1.0 + f.u) ** d for f, d in depths.items()) - 1.0


def linear_coefficient(depths: Depths) -> float:
    """``sum_f d_f u_f`` (first-order deterministic coefficient)."""
    return sum(d * f.u for f, d in depths.items())


def sigma_coefficient(depths: Depths) -> float:
    """``sqrt(sum_f d_f u_f**2)`` (Azuma-Hoeffding scale of the martingale (1))."""
    return math.sqrt(sum(d * f.u**2 for f, d in depths.items()))


def underflow_term(roundings: Depths, ftz: bool = False) -> float:
    """``sum_f r_f eta_f``: absolute error of ``r_f`` roundings below the normal range, with
    ``eta_f`` half the subnormal spacing (gradual underflow), or ``min_normal_f`` when the
    kernel may flush results below the normal range to zero (``ftz``: the flushed value is
    smaller than ``min_normal_f``)."""
    return sum(k * (f.min_normal if ftz else f.subnormal_abs_error) for f, k in roundings.items())


def accumulation_terms(depths: Depths, roundings: Depths, mode: str, lam: float) -> tuple[float, float]:
    """``(coef, absolute)`` with ``|err| <= coef * S + absolute`` for the sum's accumulation.

    deterministic: ``coef = theta``; probabilistic: ``coef = min(theta, lambda (1+theta)
    sqrt(sum d u^2))`` (the deterministic bound is also a probabilistic one)."""
    th = theta(depths)
    coef = th
    if mode == "probabilistic":
        coef = min(th, lam * (1.0 + th) * sigma_coefficient(depths))
    return coef, underflow_term(roundings)


def output_rounding(magnitude_upper: torch.Tensor, last: FloatFormat, out: FloatFormat, ftz: bool = False,
                    magnitude_lower: torch.Tensor | None = None) -> torch.Tensor | float:
    """Bound on rounding a value of magnitude ``<= t = magnitude_upper`` from ``last`` to ``out``:
    ``half_ulp_out(t)``, or 0 when the conversion is exact. With ``ftz`` (the kernel may flush
    a value below ``min_normal_out`` to 0, error ``< min(t, min_normal_out)``):
    ``max(half_ulp_out(t), min(t, min_normal_out))`` where the value may be below the normal
    range: where ``magnitude_lower`` (a lower bound on it; ``None``: 0) is below it."""
    if conversion_exact(last, out):
        return 0.0
    h = half_ulp(magnitude_upper, out)
    if not ftz:
        return h
    flush = torch.maximum(h, magnitude_upper.abs().clamp(max=out.min_normal))
    return flush if magnitude_lower is None else torch.where(magnitude_lower < out.min_normal, flush, h)


@dataclass(frozen=True)
class _Stage:
    """Rounding levels acting on one kind of operands (see "Two stages" in the module
    docstring): ``depths`` (longest chain of them per format), ``theta`` (``|s'_v| <=
    (1 + theta) M_v``) and ``magnitude`` (``M``: a bound on ``sum M_v`` over an antichain;
    ``None`` for a stage without levels)."""

    depths: Depths
    theta: float
    magnitude: torch.Tensor | None

    def linear(self, depths: Depths) -> list[tuple[float, torch.Tensor]]:
        """``(1 + theta) (sum_f d_f u_f) M``, the deterministic bound of levels ``depths`` of this
        stage, as terms ``(coefficient, M)`` of :func:`_linear` (none without levels)."""
        if not depths or self.magnitude is None:
            return []
        return [((1.0 + self.theta) * linear_coefficient(depths), self.magnitude)]

    def deviation(self, depths: Depths) -> list[tuple[float, torch.Tensor]]:
        """``(1 + theta) sqrt(sum_f d_f u_f**2) M``, the square root of the Azuma-Hoeffding
        variance proxy of levels ``depths``, as terms ``(coefficient, M)`` of :func:`_quadrature`."""
        if not depths or self.magnitude is None:
            return []
        return [((1.0 + self.theta) * sigma_coefficient(depths), self.magnitude)]


def _grouped(terms: list[tuple[float, torch.Tensor]], combine: Callable[[float, float], float]
             ) -> list[tuple[float, torch.Tensor]]:
    """``terms`` with the coefficients of one tensor combined (the stages of both sides of a
    difference, and the inner stage of every bound, share the tensor ``S``)."""
    out: dict[int, tuple[float, torch.Tensor]] = {}
    for c, t in terms:
        k = id(t)
        out[k] = (combine(out[k][0], c), t) if k in out else (c, t)
    return list(out.values())


def _linear(terms: list[tuple[float, torch.Tensor]], like: torch.Tensor) -> torch.Tensor:
    """``sum_k c_k M_k`` (one pass per distinct tensor; zeros shaped like ``like`` when empty)."""
    grouped = _grouped(terms, lambda a, b: a + b)
    if not grouped:
        return torch.zeros_like(like)
    c, t = grouped[0]
    acc = t * c
    for c, t in grouped[1:]:
        acc = torch.add(acc, t, alpha=c)
    return acc


def _quadrature(terms: list[tuple[float, torch.Tensor]], like: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``scale sqrt(sum_k (c_k M_k)**2)``, the coefficients of one tensor combined in quadrature
    first (zeros shaped like ``like`` when empty)."""
    grouped = _grouped(terms, math.hypot)
    if not grouped:
        return torch.zeros_like(like)
    if len(grouped) == 1:
        c, t = grouped[0]
        return t * (scale * c)
    c, t = grouped[0]
    sq = (t * t).mul_((scale * c) ** 2)
    for c, t in grouped[1:]:
        sq = torch.addcmul(sq, t, t, value=(scale * c) ** 2)
    return sq.sqrt_()


def path_growth(depths: Depths, lam_path: float) -> float:
    """``min(theta, exp(lambda' sqrt(sum d u^2) + sum d u^2/(1-u)) - 1)``: bound on
    ``|prod (1 + delta) - 1|`` over every prefix of a path with ``d_f`` roundings per
    format, the second form holding with probability ``>= 1 - 2 exp(-lambda'^2/2)`` under
    the Higham-Mary model (module docstring, "Growth of the partial sums")."""
    if not depths:
        return 0.0
    r = sum(d * f.u**2 / (1.0 - f.u) for f, d in depths.items())
    return min(theta(depths), math.expm1(lam_path * sigma_coefficient(depths) + r))


def _stages(s: Summation, n: int, exact_products: bool, abs_sum: torch.Tensor, magnitude: torch.Tensor,
            partial_abs_sum: torch.Tensor | None, extra_depths: Depths | None,
            leaf_depths: Depths | None = None, growth: Callable[[Depths], float] = theta
            ) -> tuple[_Stage, _Stage]:
    """The inner stage (``leaf_depths`` applied to each term, then the parts' trees, on
    ``S``) and the outer stage (conversion and reduction of the partials, then
    ``extra_depths``, on ``T_hat = T + g_in S``), where ``T`` bounds ``sum_i |p_i|`` over
    the exact partial sums: ``|exact sum|`` when there is one part, ``partial_abs_sum`` when
    given, else ``S``; ``g = growth(depths)`` bounds the relative growth of a stage's
    partial sums (``theta``, or :func:`path_growth` in probabilistic mode)."""
    din = _merge(s.inner_depths(n, exact_products), leaf_depths or {})
    dout = _merge(s.outer_depths(n), extra_depths or {})
    g_in = growth(din)
    inner = _Stage(din, g_in, abs_sum)
    if not dout:
        return inner, _Stage({}, 0.0, None)
    if s.parts(n) <= 1:
        t = torch.minimum(magnitude, abs_sum)
    elif partial_abs_sum is not None:
        t = torch.minimum(partial_abs_sum, abs_sum)
    else:
        t = abs_sum
    return inner, _Stage(dout, growth(dout), torch.add(t, abs_sum, alpha=g_in) if g_in else t)


def _inf_where_overflow(bound: torch.Tensor, held: list[tuple[_Stage, set[FloatFormat]]]) -> torch.Tensor:
    """``bound`` with ``inf`` where a partial sum of a stage may overflow a format it is held
    in (module docstring, "Overflow"): every computed partial sum of a stage is at most
    ``(1 + theta) M`` (``M = S`` for the products and the parts' trees, ``T_hat`` for the
    reduction of the partials). One reduction per stage first: overflow is rare."""
    for st, fmts in held:
        if st.magnitude is None or not fmts:
            continue
        lowest = min(f.max for f in fmts)
        if not st.magnitude.numel() or float(st.magnitude.max()) * (1.0 + st.theta) <= lowest:
            continue
        upper = st.magnitude * (1.0 + st.theta)
        mask = torch.zeros_like(bound, dtype=torch.bool)
        for f in fmts:
            mask |= overflow_possible(upper, f)
        bound = bound.masked_fill(mask, math.inf)
    return bound


def _deterministic(inner: _Stage, outer: _Stage) -> torch.Tensor:
    """``theta_in S + theta_out T_hat`` (module docstring, "Two stages")."""
    terms = [(inner.theta, inner.magnitude)]
    if outer.magnitude is not None:
        terms.append((outer.theta, outer.magnitude))
    return _linear(terms, inner.magnitude)


def _shared_chain(split: Summation, whole: Summation, n: int) -> int:
    """Levels of the unsplit recursive chain ``whole`` shared with the first part of the
    split chain ``split`` (same format, both orders known); 0 if none."""
    if (split.split > 1 and whole.split == 1 and split.algorithm == whole.algorithm == "recursive"
            and split.accum == whole.accum and split.known_order and whole.known_order):
        return tree_height(split.part_size(n), "recursive")
    return 0


def _same_inner_trees(a: Summation, b: Summation, n: int) -> bool:
    return (a.accum == b.accum and a.algorithm == b.algorithm and a.part_size(n) == b.part_size(n)
            and (a.algorithm != "blocked" or a.block == b.block))


def unshared_depths(a: Summation, b: Summation, n: int, exact_products: bool = True
                    ) -> tuple[tuple[Depths, Depths], tuple[Depths, Depths]]:
    """``((inner'_a, outer'_a), (inner'_b, outer'_b))``: per stage and format, the longest
    chain of nodes of each computation that the other does not perform identically (module
    docstring, "Difference of two models"). Nothing is shared unless both orders are known."""
    ia, oa = dict(a.inner_depths(n, exact_products)), a.outer_depths(n)
    ib, ob = dict(b.inner_depths(n, exact_products)), b.outer_depths(n)
    if not (a.known_order and b.known_order):
        return (ia, oa), (ib, ob)
    if a == b:
        return ({}, {}), ({}, {})
    if _same_inner_trees(a, b, n):
        return ({}, oa), ({}, ob)
    if not exact_products and a.accum == b.accum:
        # the n products are rounded identically in both: that level is shared
        ia[a.accum] -= 1
        ib[b.accum] -= 1
    # The unsplit chain loses its first `shared` levels (they are the split's first part);
    # parts 2..k of the split are not shared and are as long, so the split side keeps them.
    for split, whole, dw in ((a, b, ib), (b, a, ia)):
        shared = _shared_chain(split, whole, n)
        if shared:
            dw[whole.accum] -= shared
    return (_merge(ia), oa), (_merge(ib), ob)


def difference_depths(a: Summation, b: Summation, n: int, exact_products: bool = True) -> Depths:
    """Per format, the unshared levels of both computations together (all stages)."""
    (ia, oa), (ib, ob) = unshared_depths(a, b, n, exact_products)
    return _merge(ia, oa, ib, ob)


def with_accum(s: Summation, accum: "FloatFormat | str") -> Summation:
    return replace(s, accum=get_format(accum))


def sum_error_bound(abs_sum: torch.Tensor, magnitude: torch.Tensor, n: int, summation: Summation,
                    out_fmt: FloatFormat, mode: str, lam: float, exact_products: bool = True,
                    extra_depths: Depths | None = None, partial_abs_sum: torch.Tensor | None = None,
                    leaf_depths: Depths | None = None, magnitude_lower: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, dict]:
    """Elementwise bound on ``|fl_out(computed sum) - exact sum|`` from the sum's statistics.

    Args:
        abs_sum: ``S = sum |x_i|`` per output (an upper bound is fine), float64.
        magnitude: an upper bound on ``|exact sum|`` per output, float64.
        n: number of terms.
        exact_products: the terms are exact in ``summation.accum`` (else one more level).
        extra_depths: further rounding levels applied to the whole computed sum (e.g. the
            division of a mean, ``{compute_fmt: 1}``); each may also underflow once.
        partial_abs_sum: with ``summation.split > 1``, an upper bound on ``T = sum_i |p_i|``
            over the exact partial sums of the parts (tightens the reduction levels).
        leaf_depths: rounding levels applied to each term before the tree (e.g. operands
            converted to another format, a scale applied to every product); ``n``
            roundings per level, each may underflow.
        magnitude_lower: a lower bound on ``|exact sum|`` (only used with ``summation.ftz``:
            the output may be flushed only where ``magnitude_lower - acc < min_normal_out``;
            ``None``: everywhere).
    Returns ``(abs_bound, values)``; ``values`` are the plugged-in constants for explanations.

    Bound (module docstring, "Two stages"): ``acc = theta_in S + theta_out T_hat + eta``,
    probabilistic ``min(that, lambda sqrt((1+theta_in)^2 s_in^2 S^2 + (1+theta_out)^2 s_out^2
    T_hat^2) + eta)`` with ``s^2 = sum_f d_f u_f^2``; plus the rounding of the result to
    ``out_fmt``: ``half_ulp_out(magnitude + acc)`` (the computed sum is within ``acc`` of the
    exact one, and ``half_ulp`` is monotone).
    """
    args = (summation, n, exact_products, abs_sum, magnitude, partial_abs_sum, extra_depths, leaf_depths)
    inner, outer = _stages(*args)
    roundings = _merge(summation.roundings(n), extra_depths or {}, {f: k * n for f, k in (leaf_depths or {}).items()})
    eta = underflow_term(roundings, summation.ftz)
    if mode == "probabilistic":
        # growth of the partial sums bounded per path (probability split: p/2 for the error's
        # martingale, p/2 over the paths of the n terms and of the partials)
        lam2 = math.sqrt(lam**2 + 2.0 * math.log(2.0))
        paths = n + (summation.parts(n) if outer.depths else 0)
        lam_path = math.sqrt(lam**2 + 2.0 * math.log(2.0 * paths))
        p_in, p_out = _stages(*args, growth=lambda d: path_growth(d, lam_path))
    if outer.magnitude is None:  # one stage: a scalar coefficient times S (one pass over the data)
        coef = inner.theta
        if mode == "probabilistic":
            sig = sigma_coefficient(inner.depths)
            coef = min(coef, lam * (1.0 + inner.theta) * sig, lam2 * (1.0 + p_in.theta) * sig)
        acc = abs_sum * coef + eta
    else:
        acc = _deterministic(inner, outer)
        if mode == "probabilistic":
            like = inner.magnitude
            torch.minimum(acc, _quadrature(inner.deviation(inner.depths) + outer.deviation(outer.depths), like, lam),
                          out=acc)
            torch.minimum(acc, _quadrature(p_in.deviation(p_in.depths) + p_out.deviation(p_out.depths), like, lam2),
                          out=acc)
        acc += eta
    low = None if magnitude_lower is None else magnitude_lower - acc
    bound = acc + output_rounding(magnitude + acc, summation.final_fmt, out_fmt, summation.ftz, low)
    held = [(inner, set(inner.depths) | {summation.accum}), (outer, set(summation.outer_depths(n)))]
    if mode == "probabilistic":  # the growth the probabilistic claim rests on, where smaller
        held = [(min(st, pst, key=lambda x: x.theta), fmts) for (st, fmts), pst in zip(held, (p_in, p_out))]
    bound = _inf_where_overflow(bound, held)
    values = {"n": n, "summation": summation.describe(),
              "depths": {str(f): d for f, d in _merge(inner.depths, outer.depths).items()},
              "theta_inner": inner.theta, "theta_outer": outer.theta, "eta": eta, "output": str(out_fmt)}
    if partial_abs_sum is not None:
        values["T"] = "sum_i |partial_i|"
    if mode == "probabilistic":
        values["lambda"] = lam
    return bound, values


def sum_difference_bound(abs_sum: torch.Tensor, magnitude: torch.Tensor, n: int,
                         a: Summation, b: Summation, out_a: FloatFormat, out_b: FloatFormat,
                         mode: str, lam: float, exact_products: bool = True,
                         partial_abs_sum_a: torch.Tensor | None = None,
                         partial_abs_sum_b: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Elementwise bound on ``|result_a - result_b|`` for two computation models of one sum.

    Deterministic: ``min(bound_a + bound_b, sum_{sides, stages} (1+theta) c(d') M + eta_a
    + eta_b + out_a + out_b)`` with the unshared levels ``d'`` of each stage
    (:func:`unshared_depths`), ``c(d) = sum d u`` and ``out_*`` the output roundings at the
    magnitudes ``|y| + bound``. Identical models of a known order give 0.

    Probabilistic (failure probability ``p = 2 exp(-lambda^2/2)`` per element), the
    smallest of three bounds, each failing with probability at most ``p`` (the choice
    depends on the data only, not on the rounding errors, so the minimum fails with
    probability at most ``p`` too):

    * the deterministic bound above;
    * ``bound_a + bound_b``, each a probabilistic bound at ``p/2`` (union bound);
    * one martingale over the unshared nodes of both computations,
      ``lambda_3 sqrt(sum_{sides, stages} ((1+theta) M)^2 sum d' u^2)``, plus the output
      roundings at ``|y| + acc_side`` with each side's own probabilistic accumulation bound,
      all three at ``p/3`` (``lambda_3 = sqrt(lambda^2 + 2 ln 3)``).
    """
    if a == b and a.known_order and out_a == out_b:
        return torch.zeros_like(abs_sum), {"n": n, "note": "identical computations (same known tree) are bitwise equal"}
    sa = _stages(a, n, exact_products, abs_sum, magnitude, partial_abs_sum_a, None)
    sb = _stages(b, n, exact_products, abs_sum, magnitude, partial_abs_sum_b, None)
    unshared = unshared_depths(a, b, n, exact_products)
    pairs = [(st, d) for stages, ds in zip((sa, sb), unshared) for st, d in zip(stages, ds)]
    eta = underflow_term(a.roundings(n), a.ftz) + underflow_term(b.roundings(n), b.ftz)

    def outputs(acc_a: torch.Tensor, acc_b: torch.Tensor) -> torch.Tensor | float:
        """Both sides' output roundings at ``|y| + acc + eta`` (none where a conversion is exact)."""
        total: torch.Tensor | float = 0.0
        for side, out, acc in ((a, out_a, acc_a), (b, out_b, acc_b)):
            if not conversion_exact(side.final_fmt, out):
                total = total + output_rounding((magnitude + acc).add_(eta), side.final_fmt, out, side.ftz)
        return total

    det_a, det_b = _deterministic(*sa), _deterministic(*sb)
    unshared = _linear([term for st, d in pairs for term in st.linear(d)], abs_sum)  # 0 when no level differs
    bound = torch.minimum(det_a + det_b, unshared).add_(eta) + outputs(det_a, det_b)
    if mode == "probabilistic":
        lam2, lam3 = math.sqrt(lam**2 + 2 * math.log(2)), math.sqrt(lam**2 + 2 * math.log(3))
        tri = sum(sum_error_bound(abs_sum, magnitude, n, s, o, mode, lam2, exact_products, partial_abs_sum=t)[0]
                  for s, o, t in ((a, out_a, partial_abs_sum_a), (b, out_b, partial_abs_sum_b)))
        side = [torch.minimum(_deterministic(*st), _quadrature(st[0].deviation(st[0].depths)
                                                               + st[1].deviation(st[1].depths), abs_sum, lam3))
                for st in (sa, sb)]
        joint = _quadrature([term for st, d in pairs for term in st.deviation(d)], abs_sum, lam3).add_(eta) \
            + outputs(*side)
        bound = torch.minimum(bound, torch.minimum(tri, joint))
    bound = _inf_where_overflow(bound, [(st, fmts) for side, stages in ((a, sa), (b, sb)) for st, fmts in
                                        zip(stages, ({side.accum}, set(side.outer_depths(n))))])
    values = {"n": n, "model_a": a.describe(), "model_b": b.describe(),
              "unshared_depths": {str(f): k for f, k in difference_depths(a, b, n, exact_products).items()},
              "outputs": f"{out_a} / {out_b}"}
    if mode == "probabilistic":
        values["lambda"] = lam
    return bound, values


def float64_sum_statistics(x: torch.Tensor, dim: int, keepdim: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(S_upper, |y|_upper, g)``: rigorous upper bounds on ``S = sum |x_i|`` and ``|sum x_i|``
    along ``dim``, computed in float64. A float64 sum of ``n`` terms in any order is within
    ``g S`` of the exact one, ``g = gamma_n(2**-53)`` (Higham 2002, §4.2), and the computed
    ``sum |x_i|`` is at least ``S / (1 + g)``."""
    x64 = x.detach().to(torch.float64)
    n = x64.shape[dim]
    g = n * 2.0 ** -53 / (1 - n * 2.0 ** -53)
    s = x64.abs().sum(dim, keepdim=keepdim) * (1 + g)
    return s, x64.sum(dim, keepdim=keepdim).abs() + g * s, g
