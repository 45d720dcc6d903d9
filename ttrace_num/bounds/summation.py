r"""Summation, the kernel of every reduction, dot product and matmul.

Computation model
-----------------
A sum of ``n`` terms is evaluated by a tree of additions. Every node ``v`` of the tree
rounds its exact result to a format ``f(v)``: ``s_hat_v = (s_hat'_v)(1 + delta_v)`` with
``|delta_v| <= u_f(v)``, where ``s_hat'_v`` is the sum of the node's computed children.
A :class:`Summation` states the tree: the accumulation format, the algorithm
(``recursive``: a left-to-right chain, also FMA-based dot products; ``pairwise``;
``blocked(b)``: chains of ``b`` then a chain of block sums) and an optional split of the
terms into ``split`` contiguous parts (split-K, tensor parallelism) whose partial sums
are rounded to ``reduce_fmt`` and reduced by a chain (``recursive``, e.g. a ring
all-reduce) or a tree (``pairwise``).

The exact identity (by induction over the tree)::

    computed - exact = sum_v delta_v * s_hat'_v                                  (1)

with ``|s_hat'_v| <= (1 + theta) S_v`` where ``S_v`` is the sum of ``|x_i|`` under ``v``
and ``theta`` the deterministic relative bound below. Nodes at equal depth have
disjoint subtrees, so grouping the nodes of one format ``f`` by depth gives
``sum_{v in f} S_v <= d_f S`` and ``sum_{v in f} S_v^2 <= d_f S^2`` with ``d_f`` the
number of such levels ("depth in format f") and ``S = sum |x_i|``. Hence

* deterministic:  ``|err| <= (1 + theta) * (sum_f d_f u_f) * S + underflow`` and also
  ``|err| <= theta * S`` with ``theta = prod_f (1 + u_f)**d_f - 1`` (Higham 2002, Lemma 3.1,
  §4.2 / §3.1; the smaller of the two is used: ``theta`` itself);
* probabilistic: the terms of (1) form a martingale when the ``delta_v`` are
  mean-independent (Higham & Mary 2019 model; Connolly, Higham & Mary 2021), each bounded
  by ``u_f S_v (1 + theta)``; Azuma-Hoeffding gives, with probability at least
  ``1 - 2 exp(-lambda**2 / 2)``,
  ``|err| <= lambda (1 + theta) sqrt(sum_f d_f u_f**2) * S + underflow``.

Rounding below the normal range is absolute, not relative: each rounding may add
``eta_f = fmt.subnormal_abs_error``; the bound adds ``sum_f n_f eta_f`` with ``n_f`` the
number of roundings in format ``f`` on the way to one output (at most ``n`` per level).

Difference of two models
------------------------
Two computations of the same sum whose trees share nodes (same operands, same order,
same format: identical rounding errors) differ by (1) summed over the *unshared* nodes
only, exactly: ``err_a - err_b = sum_{v in A\shared} delta_v s'_v - sum_{v in B\shared} ...``.
Deterministic: ``(1+theta)(sum_f (d'_a,f + d'_b,f) u_f) S``; probabilistic: Azuma over
the union of unshared nodes: ``lambda (1+theta) sqrt(sum_f (d'_a,f + d'_b,f) u_f^2) S``
(quadrature instead of the sum of two worst cases). Sharing is recognised for identical
models (difference 0) and for a recursive chain split into ``k`` contiguous parts versus
the unsplit chain in the same format (the first part's chain is shared).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch

from ..formats import FloatFormat, get_format, half_ulp

Algorithm = Literal["recursive", "pairwise", "blocked"]
ALGORITHMS = ("recursive", "pairwise", "blocked")

Depths = dict[FloatFormat, int]

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
    "difference_depths",
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
        algorithm: ``"recursive"`` (left-to-right, FMA chains; the worst case for any
            order, so the safe default for a kernel whose order is unknown),
            ``"pairwise"`` or ``"blocked"``.
        block: block length for ``"blocked"``.
        split: number of contiguous parts the terms are split into (split-K, tensor
            parallel row-parallel linear). Each part is summed with ``algorithm`` in ``accum``.
        reduce_fmt: format the partial sums are rounded to and reduced in (e.g. bf16 for a
            gloo bf16 all-reduce); ``None`` means ``accum``.
        reduce_algorithm: how the ``split`` partials are combined: ``"recursive"`` (ring /
            sequential) or ``"pairwise"`` (tree).
    """

    accum: FloatFormat = get_format("fp32")
    algorithm: Algorithm = "recursive"
    block: int = 32
    split: int = 1
    reduce_fmt: FloatFormat | None = None
    reduce_algorithm: Algorithm = "recursive"

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

    def depths(self, n: int, exact_products: bool = True) -> Depths:
        """Levels of roundings per format (``d_f``) for an ``n``-term sum.

        ``exact_products=False`` adds one level for rounding the products of a dot
        product (e.g. fp32 inputs accumulated in fp32)."""
        d: Depths = {}
        inner = tree_height(self.part_size(n), self.algorithm, self.block) + (0 if exact_products else 1)
        if inner:
            d[self.accum] = inner
        if self.split > 1 and n > 1:
            rf = self.reduce_fmt or self.accum
            outer = tree_height(min(self.split, n), self.reduce_algorithm, self.block)
            outer += int(not conversion_exact(self.accum, rf))  # partials rounded to rf
            if outer:
                d[rf] = d.get(rf, 0) + outer
        return d

    def roundings(self, n: int, exact_products: bool = True) -> Depths:
        """Upper bound on the number of roundings per format along one output's tree (for
        the underflow term): ``n`` per level at most."""
        return {f: k * n for f, k in self.depths(n, exact_products).items()}

    def describe(self) -> str:
        s = f"{self.algorithm}" + (f"(b={self.block})" if self.algorithm == "blocked" else "")
        s += f" in {self.accum}"
        if self.split > 1:
            s += f", split into {self.split} parts reduced {self.reduce_algorithm} in {self.reduce_fmt or self.accum}"
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


def theta(depths: Depths) -> float:
    """``prod_f (1 + u_f)**d_f - 1``: deterministic relative error of ``d_f`` roundings per format."""
    return math.prod((1.0 + f.u) ** d for f, d in depths.items()) - 1.0


def linear_coefficient(depths: Depths) -> float:
    """``sum_f d_f u_f`` (first-order deterministic coefficient)."""
    return sum(d * f.u for f, d in depths.items())


def sigma_coefficient(depths: Depths) -> float:
    """``sqrt(sum_f d_f u_f**2)`` (Azuma-Hoeffding scale of the martingale (1))."""
    return math.sqrt(sum(d * f.u**2 for f, d in depths.items()))


def underflow_term(roundings: Depths) -> float:
    return sum(k * f.subnormal_abs_error for f, k in roundings.items())


def accumulation_terms(depths: Depths, roundings: Depths, mode: str, lam: float) -> tuple[float, float]:
    """``(coef, absolute)`` with ``|err| <= coef * S + absolute`` for the sum's accumulation.

    deterministic: ``coef = theta``; probabilistic: ``coef = min(theta, lambda (1+theta)
    sqrt(sum d u^2))`` (the deterministic bound is also a probabilistic one)."""
    th = theta(depths)
    coef = th
    if mode == "probabilistic":
        coef = min(th, lam * (1.0 + th) * sigma_coefficient(depths))
    return coef, underflow_term(roundings)


def output_rounding(magnitude_upper: torch.Tensor, last: FloatFormat, out: FloatFormat) -> torch.Tensor | float:
    """Bound on rounding a value of magnitude ``<= magnitude_upper`` from ``last`` to ``out``:
    ``half_ulp_out(magnitude_upper)``, or 0 when the conversion is exact."""
    if conversion_exact(last, out):
        return 0.0
    return half_ulp(magnitude_upper, out)


def _shared_prefix(a: Summation, b: Summation, n: int) -> int:
    """Levels of the unsplit chain shared with the first part of a split chain (0 if none)."""
    if a.algorithm != "recursive" or b.algorithm != "recursive" or a.accum != b.accum:
        return 0
    if a.split > 1 and b.split == 1:
        return max(0, tree_height(a.part_size(n), "recursive"))
    return 0


def difference_depths(a: Summation, b: Summation, n: int, exact_products: bool = True) -> Depths:
    """Levels per format of the *unshared* nodes of two models of the same ``n``-term sum
    (see the module docstring). Identical models share every node: ``{}``."""
    if a == b:
        return {}
    shared = _shared_prefix(a, b, n) or _shared_prefix(b, a, n)
    da, db = a.depths(n, exact_products), b.depths(n, exact_products)
    if shared:
        split, whole = (a, b) if a.split > 1 else (b, a)
        ds, dw = (da, db) if split is a else (db, da)
        # the chain of `whole` loses its first `shared` levels; the split's inner parts
        # 2..k keep theirs (grouped by depth they still need `shared` levels), so only
        # the whole-chain side shrinks.
        dw = dict(dw)
        dw[whole.accum] = dw.get(whole.accum, 0) - shared
        da, db = (ds, dw) if split is a else (dw, ds)
    out: Depths = {}
    for d in (da, db):
        for f, k in d.items():
            if k > 0:
                out[f] = out.get(f, 0) + k
    return out


def with_accum(s: Summation, accum: "FloatFormat | str") -> Summation:
    return replace(s, accum=get_format(accum))


def _coef_text(mode: str) -> str:
    if mode == "deterministic":
        return "theta = prod_f (1+u_f)^d_f - 1"
    return "min(theta, lambda (1+theta) sqrt(sum_f d_f u_f^2))"


def sum_error_bound(abs_sum: torch.Tensor, magnitude: torch.Tensor, n: int, summation: Summation,
                    out_fmt: FloatFormat, mode: str, lam: float, exact_products: bool = True,
                    extra_depths: Depths | None = None) -> tuple[torch.Tensor, dict]:
    """Elementwise bound on ``|fl_out(computed sum) - exact sum|`` from the sum's statistics.

    Args:
        abs_sum: ``S = sum |x_i|`` per output (an upper bound is fine), float64.
        magnitude: an upper bound on ``|exact sum|`` per output, float64.
        n: number of terms.
        extra_depths: further rounding levels whose subtree is the whole sum (e.g. the
            division of a mean, ``{compute_fmt: 1}``).
    Returns ``(abs_bound, values)``; ``values`` are the plugged-in constants for explanations.

    Bound: ``acc = coef * S + eta`` (see :func:`accumulation_terms`), plus the rounding of
    the result to ``out_fmt``: ``half_ulp_out(magnitude + acc)`` (the computed sum is within
    ``acc`` of the exact one, and ``half_ulp`` is monotone).
    """
    depths = dict(summation.depths(n, exact_products))
    roundings = dict(summation.roundings(n, exact_products))
    for f, k in (extra_depths or {}).items():
        depths[f] = depths.get(f, 0) + k
        roundings[f] = roundings.get(f, 0) + k
    coef, eta = accumulation_terms(depths, roundings, mode, lam)
    acc = coef * abs_sum + eta
    out = output_rounding(magnitude + acc, summation.final_fmt, out_fmt)
    values = {"n": n, "summation": summation.describe(), "depths": {str(f): d for f, d in depths.items()},
              "coef": coef, "output": str(out_fmt)}
    if mode == "probabilistic":
        values["lambda"] = lam
    return acc + out, values


def sum_difference_bound(abs_sum: torch.Tensor, magnitude: torch.Tensor, n: int,
                         a: Summation, b: Summation, out_a: FloatFormat, out_b: FloatFormat,
                         mode: str, lam: float, exact_products: bool = True) -> tuple[torch.Tensor, dict]:
    """Elementwise bound on ``|result_a - result_b|`` for two computation models of one sum.

    ``(1+theta_max) * c(d') * S + eta_a + eta_b + out_a + out_b`` where ``d'`` are the levels
    of the unshared nodes (:func:`difference_depths`), ``c = sum d u`` (deterministic) or
    ``lambda sqrt(sum d u^2)`` (probabilistic, one martingale over both computations), and
    ``out_*`` the two output roundings. Identical models give 0.
    """
    if a == b and out_a == out_b:
        return torch.zeros_like(abs_sum), {"n": n, "note": "identical computation models are bitwise equal"}
    da, db = a.depths(n, exact_products), b.depths(n, exact_products)
    dd = difference_depths(a, b, n, exact_products)
    th = max(theta(da), theta(db))
    if mode == "deterministic":
        coef = (1.0 + th) * linear_coefficient(dd)
    else:
        coef = min((1.0 + th) * linear_coefficient(dd), lam * (1.0 + th) * sigma_coefficient(dd))
    eta = underflow_term(a.roundings(n, exact_products)) + underflow_term(b.roundings(n, exact_products))
    acc = coef * abs_sum + eta
    ca, _ = accumulation_terms(da, {}, "deterministic", lam)
    cb, _ = accumulation_terms(db, {}, "deterministic", lam)
    out = (output_rounding(magnitude + ca * abs_sum + eta, a.final_fmt, out_a)
           + output_rounding(magnitude + cb * abs_sum + eta, b.final_fmt, out_b))
    values = {"n": n, "model_a": a.describe(), "model_b": b.describe(),
              "unshared_depths": {str(f): k for f, k in dd.items()}, "coef": coef,
              "outputs": f"{out_a} / {out_b}"}
    return acc + out, values
