r"""Collectives: all-reduce, reduce-scatter, all-gather, and the all-reduce difference bound.

Computation model
-----------------
``k`` ranks each hold a partial ``x_r`` (the input ``partials`` stacks them: shape
``(k, ...)``). An **all-reduce** in format ``f`` (the dtype of the reduced tensor: every
hop's result is stored and sent in ``f``) computes, for every element, a ``k``-term sum:

* each partial is first converted to ``f`` (exact when it is already on ``f``'s grid;
  one rounding level otherwise: e.g. fp32 gradients all-reduced in bf16, Megatron's
  ``grad_reduce_in_fp32=False``);
* the ``k`` values are added pairwise along a binary tree whose every node rounds to
  ``f``: a **ring** (Thakur, Rabenseifner & Gropp 2005, §4, "ring" reduce-scatter phase of
  an all-reduce; gloo's default) sends chunk ``c`` around the ring, each rank adding its
  own contribution: a left-to-right chain of height ``k-1``, starting at a rank that
  depends on the chunk (gloo: rank ``c-1``, then ``c-2``, ..., ``c``; measured bitwise on
  gloo in ``tests/test_bounds_collectives.py``), so different elements see different
  orders, all of height ``k-1``; a **tree** (recursive halving/doubling, binomial tree,
  gloo's bcube, the same paper §4.4-4.5) has height ``ceil(log2 k)``;
* the result is replicated to every rank by an all-gather (copies, exact).

``algorithm="any"`` (the default) covers every order: every binary tree over ``k`` leaves
has height at most ``k-1``, and the chain bound depends only on the height (Higham 2002,
§4.2, eq. (4.6): the bound ``gamma_{k-1} sum |x_i|`` holds for any ordering).
``"ring"`` gives the same bound (height ``k-1``); ``"tree"`` the pairwise one.
``"gloo"`` states the *known* order of gloo's ring all-reduce (``ProcessGroupGloo``'s
default; :func:`gloo_ring_chunks`, :func:`ring_orders`) and gets the tighter bound (3); it
is wrong for any other order (a test shows the textbook ring violates it). torch 2.13's
gloo has no shared-memory all-reduce (a torchrun-style ``LOCAL_WORLD_SIZE`` leaves the ring
in place, tested); gloo builds that have one (``allreduce_shm.cc``: a rank-order sum) need
``"any"``.

Bound for an unknown order (ring / tree / any)
----------------------------------------------
With ``S = sum_r |x_r|``, ``s = sum_r x_r`` and ``d`` the number of rounding levels
(``k-1`` or ``ceil(log2 k)`` additions, plus 1 for the conversion when it is inexact), the
identity (1) of :mod:`.summation` ``computed - s = sum_v delta_v s'_v`` splits into the
**last rounding** (the root addition, or the conversion when ``k = 1``) and the others.
The root rounds ``a + b``, the sum of its two computed children, and
``|(a + b) - s| <= theta_{d-1} S`` (both subtrees have at most ``d-1`` levels), so::

    |computed - s| <= acc + half_ulp_f(|s| + acc),     acc = coef(d-1) * S + eta       (2)

with ``coef`` the deterministic ``theta = (1+u_f)**(d-1) - 1`` or, in probabilistic mode,
``min(theta, lambda (1+theta) sqrt(d-1) u_f)`` (Azuma-Hoeffding over the ``d-1`` non-root
levels, Higham & Mary 2019 model; the root's rounding is bounded deterministically), and
``eta = k eta_f`` the absolute underflow allowance of the ``k`` conversions when they are
inexact (0 otherwise: a sum of two numbers of ``f`` is exact when it is subnormal, Hauser
1996, Higham 2002 §2.1, so additions never add an absolute term; :mod:`.summation`).
Bounding the root by ``half_ulp`` of the result's magnitude instead of ``u_f S`` makes
the bound attainable: for ``k = 2`` it is exactly the rounding of one addition.
(Summation statistics and coefficients come from :mod:`.summation`; only the root is
separated here.) Probabilistic mode never helps for small ``k``: ``lambda sqrt(d-1) >=
d-1`` while ``d - 1 <= lambda**2`` (e.g. ``k <= 30`` at ``lambda = 5.3``). The bound grows
like ``k u S`` while the partial sums of random-sign data grow like ``sqrt(j)``, so it is
loose for large ``k`` (median tightness ~6 at ``k = 16``, ~20 at ``k = 64`` on random
normal data, bench/cases/collectives.py); no order-free bound can do much better, since
some order (all positive terms first) does make the partial sums as large as ``S``.

Bound for a known order (gloo)
------------------------------
When every element's chain order is known (ranks ``o_1, ..., o_k``), the exact partial
sums ``P_j = x_{o_1} + ... + x_{o_j}`` are computable and the error is bounded hop by hop
(an a-priori form of the running error analysis of Higham 2002, §3.3): with ``c_j`` the
conversion error of the ``j``-th term (``half_ulp_f(|x_{o_j}|)``, 0 when exact), ``E_1 = c_1``,
and hop ``j`` rounding ``s_hat_{j-1} + t_hat_j`` (within ``E_{j-1} + c_j`` of ``P_j``) with an
error of at most ``r_j = half_ulp_f(|P_j| + E_{j-1} + c_j)``::

    E_j = E_{j-1} + c_j + r_j,          |computed - s| <= E_k                            (3)

Probabilistic: these ``2k - 1`` rounding errors form a martingale with increments bounded by
``c_j`` and ``r_j`` (Higham-Mary model), so by Azuma-Hoeffding ``|computed - s| <= min(E_k,
lambda sqrt(sum_j c_j**2 + r_j**2))`` with probability ``>= 1 - 2 exp(-lambda**2/2)``.
``P_j`` is evaluated in float64 and enlarged by that sum's error bound
``gamma_{k+1}(2**-53) sum_{i<=j} |x_{o_i}|``. Median tightness on random normal data
(bench): ~1.0 at ``k = 4``, ~1.5 at ``k = 16``, ~2.7 at ``k = 64``.

``reduce_op="avg"`` (sum, then one division by ``k`` in ``f``, as gloo's ``ReduceOp.AVG`` for
all-reduce does; for reduce-scatter gloo's AVG is wrong, pytorch#162338, so sum and divide)::

    |fl(computed / k) - s/k| <= bound_sum / k + last,

``last = half_ulp_f((|s| + bound_sum) / k)`` for the rounded division, or for ``k`` a power
of two (a division exact unless the quotient is subnormal) ``f``'s subnormal half-spacing
``eta_f`` (added everywhere: it is below ``half_ulp_f`` of every normal number). A result
stored in ``out_fmt != f`` adds ``half_ulp_out`` of its magnitude
(:func:`.summation.output_rounding`).

**Reduce-scatter** (``reduce_scatter_tensor``): every element of every shard is the same
``k``-term sum (gloo computes the full all-reduce and keeps the shard: bitwise equal,
measured), so the bound is the shard of the all-reduce bound of the whole input.
**All-gather** copies bytes: the result is exact (bound 0), unless the shards are first
converted to a narrower ``fmt`` (one rounding, ``half_ulp_f(|x|)``).

Difference bound (:func:`all_reduce_difference`): ``|all-reduce result - fl_out(sum of the
same partials on one device in fp32)|``, the smaller of
:func:`~ttrace_num.bounds.summation.sum_difference_bound` (the all-reduce modelled as a
sum split into ``k`` one-term parts whose partials are converted to ``f`` and reduced by
the ring/tree in ``f``; no node is shared with the one-device chain, whose order differs
from the ring's rotating one, so in probabilistic mode all roundings of both add in
quadrature) and the triangle inequality through the exact sum with the deterministic
bounds (2) or (3) and the reference's :func:`~ttrace_num.bounds.summation.sum_error_bound`
(tighter for small ``k``, where (2)/(3) bound the last rounding by ``half_ulp``).

Sources: N. J. Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed. (2002),
§4.2 (summation in any order; pairwise), Lemma 3.1; Higham & Mary, SISC 41(5) 2019 and
Connolly, Higham & Mary, SISC 43(1) 2021 (probabilistic model); R. Thakur, R. Rabenseifner,
W. Gropp, "Optimization of collective communication operations in MPICH", IJHPCA 19(1)
2005 (ring, recursive doubling/halving and tree algorithms); gloo ``gloo/allreduce.cc``
``ring()`` (segments of at most ``kMaxSegmentSize = 1 MiB``; rank ``r`` sends its share of
chunk ``r + 1`` to rank ``r - 1``), checked bit for bit against ``torch.distributed`` 2.13
on gloo at 2 and 4 processes and with in-process groups of 3 and 8 ranks
(tests/test_bounds_collectives.py).
"""
from __future__ import annotations

import math
from typing import Literal

import torch

from ..formats import FloatFormat, get_format, half_ulp
from ..rounding import round_to
from .base import Bound, Explanation
from .common import f64, register, resolve_mode
from .summation import (Summation, accumulation_terms, conversion_exact, output_rounding, sum_difference_bound,
                        sum_error_bound, tree_height, float64_sum_statistics)

__all__ = ["all_reduce", "reduce_scatter", "all_gather", "all_reduce_difference", "reduction_summation",
           "gloo_ring_chunks", "ring_orders", "element_size", "GLOO_MAX_SEGMENT_BYTES"]

CollectiveAlgorithm = Literal["ring", "tree", "any", "gloo"]
ALGORITHMS = ("ring", "tree", "any", "gloo")

#: gloo's ``AllreduceOptionsImpl::kMaxSegmentSize`` (bytes per send/recv of its ring)
GLOO_MAX_SEGMENT_BYTES = 1 << 20

SOURCE = ("Higham, Accuracy and Stability of Numerical Algorithms (2002) §4.2, Lemma 3.1, §3.3; Thakur, "
          "Rabenseifner & Gropp, Optimization of collective communication operations in MPICH, IJHPCA 19(1) "
          "2005; probabilistic: Higham & Mary, SISC 41(5) 2019")

_SUMMATION_ALGORITHM = {"ring": "recursive", "any": "recursive", "gloo": "recursive", "tree": "pairwise"}


def element_size(fmt: FloatFormat) -> int:
    """Bytes per element of ``fmt`` on the wire (its torch dtype's, else its bits rounded up)."""
    if fmt.torch_dtype is not None:
        return torch.empty((), dtype=fmt.torch_dtype).element_size()
    return math.ceil((int(fmt.signed) + fmt.exponent_bits + fmt.mantissa_bits) / 8)


def gloo_ring_chunks(n: int, k: int, element_size: int, max_segment_bytes: int = GLOO_MAX_SEGMENT_BYTES
                     ) -> torch.Tensor:
    """Chunk index (the rank that ends up owning the reduced element) of each of ``n`` elements
    in gloo's ring all-reduce over ``k`` ranks.

    gloo cuts the buffer into ``S = roundup(max(ceil(bytes / max_segment_bytes), 2k), k)``
    segments of ``ceil(n / S)`` elements; chunk ``c`` is segments ``[c S/k, (c+1) S/k)``,
    hence contiguous elements ``[c L, (c+1) L)`` with ``L = (S/k) ceil(n / S)`` (the last
    chunks may be short or empty)."""
    nbytes = n * element_size
    segs = max(-(-nbytes // max_segment_bytes), 2 * k)
    segs = -(-segs // k) * k
    seg_len = -(-n // segs)
    return torch.arange(n) // max(1, (segs // k) * seg_len)


def ring_orders(chunks: torch.Tensor, k: int, start: int = -1, step: int = -1) -> torch.Tensor:
    """``(k, n)`` rank order of every element's chain: row ``j`` is the rank whose partial is
    the ``j``-th term, ``(chunk + start + j step) mod k``. The defaults are gloo's ring: chunk
    ``c`` is ``x_{c-1} + x_{c-2} + ... + x_c`` (ranks mod ``k``)."""
    if math.gcd(step, k) != 1:
        raise ValueError(f"step {step} does not visit every one of {k} ranks")
    j = torch.arange(k)[:, None]
    return (chunks[None, :] + start + j * step) % k


def _storage_format(t: torch.Tensor) -> FloatFormat:
    try:
        return get_format(t.dtype)
    except ValueError:
        raise ValueError(f"partials of dtype {t.dtype} have no known float format; pass fmt=") from None


def _reduction_format(partials: torch.Tensor, fmt, compute_fmt) -> FloatFormat:
    """``fmt`` (the reduced tensor's dtype); ``compute_fmt`` is accepted as a synonym because
    every hop's result is stored and sent in that format (there is no wider accumulator)."""
    if fmt is not None and compute_fmt is not None and get_format(fmt) != get_format(compute_fmt):
        raise ValueError(f"an all-reduce rounds every hop to the reduced tensor's format: fmt={fmt} and "
                         f"compute_fmt={compute_fmt} cannot differ")
    spec = fmt if fmt is not None else compute_fmt
    return get_format(spec) if spec is not None else _storage_format(partials)


def _on_grid(x: torch.Tensor, fmt: FloatFormat) -> bool:
    """Every value of ``x`` is representable in ``fmt`` (its conversion is exact)."""
    if conversion_exact(_storage_format(x), fmt):
        return True
    finite = x[torch.isfinite(x)]
    if fmt.torch_dtype is not None:  # a cast changes exactly the values off the grid (or out of range)
        return bool((finite.to(fmt.torch_dtype).to(finite.dtype) == finite).all())
    return bool((round_to(finite, fmt) == f64(finite)).all())


def _sum_statistics(partials: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rigorous float64 upper bounds on ``S = sum_r |x_r|`` and ``|s| = |sum_r x_r|`` over dim 0."""
    s_abs, y_mag, _ = float64_sum_statistics(partials, 0)
    return s_abs, y_mag


def reduction_summation(partials: torch.Tensor, fmt: FloatFormat, algorithm: CollectiveAlgorithm) -> Summation:
    """The all-reduce of ``partials`` (shape ``(k, ...)``) as a :class:`Summation` of ``k`` terms split
    into ``k`` one-term parts: the parts are converted to ``fmt`` (a level only when some
    partial is not on ``fmt``'s grid) and reduced by a chain (ring/any) or a tree in ``fmt``."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; use one of {ALGORITHMS}")
    accum = fmt if _on_grid(partials, fmt) else _storage_format(partials)
    return Summation(accum=accum, split=partials.shape[0], reduce_fmt=fmt,
                     reduce_algorithm=_SUMMATION_ALGORITHM[algorithm])  # type: ignore[arg-type]


def _sum_bound(partials: torch.Tensor, f: FloatFormat, algorithm: CollectiveAlgorithm, reduce_op: str,
               mode: str, lam: float) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Bound (2) of the module docstring (and the division for ``reduce_op="avg"``), result in ``f``.
    Returns ``(bound, |result| upper, values)``."""
    if reduce_op not in ("sum", "avg"):
        raise ValueError(f"reduce_op must be 'sum' or 'avg', got {reduce_op!r}")
    k = partials.shape[0]
    summ = reduction_summation(partials, f, algorithm)
    conversion = not conversion_exact(summ.accum, f)
    # levels in f on one element's path: the reduction tree, plus the conversion if inexact
    d = tree_height(k, summ.reduce_algorithm) + int(conversion)
    s_abs, y_mag = _sum_statistics(partials)
    values = {"k": k, "algorithm": algorithm, "format": str(f), "levels": d, "conversion": conversion}
    if algorithm == "gloo":
        bound = _known_chain_bound(partials, f, conversion, mode, lam)
    else:
        rest = {f: d - 1} if d > 1 else {}
        # only the k conversions can underflow with an absolute error: a sum of two numbers
        # of f is exact when subnormal (and the root's rounding is bounded by half_ulp below)
        coef, eta = accumulation_terms(rest, {f: k} if conversion else {}, mode, lam)
        acc = coef * s_abs + eta
        bound = acc + (half_ulp(y_mag + acc, f) if d >= 1 else 0.0)
        values.update(coef=coef, eta=eta)
    mag = y_mag + bound
    if reduce_op == "avg":
        if k & (k - 1) == 0:  # power of two: exact unless the quotient is subnormal
            last = f.subnormal_abs_error
        else:
            last = half_ulp(mag / k, f)
        bound = bound / k + last
        mag = mag / k
        values["reduce_op"] = "avg (sum, then one division by k in f)"
    return bound, mag, values


def _known_chain_bound(partials: torch.Tensor, f: FloatFormat, conversion: bool, mode: str, lam: float
                       ) -> torch.Tensor:
    """Bound (3) of the module docstring along gloo's ring order, shaped like ``partials[0]``."""
    k = partials.shape[0]
    x = f64(partials).reshape(k, -1)
    t = x.gather(0, ring_orders(gloo_ring_chunks(x.shape[1], k, element_size(f)), k))
    g = (k + 1) * 2.0**-53
    prefix = t.cumsum(0).abs() + g / (1 - g) * t.abs().cumsum(0)  # >= |P_j|
    conv = half_ulp(t, f) if conversion else torch.zeros_like(t)
    err, var = conv[0], conv[0] ** 2
    for j in range(1, k):
        e_in = err + conv[j]
        r = half_ulp(prefix[j] + e_in, f)
        err = e_in + r
        var = var + conv[j] ** 2 + r**2
    if mode == "probabilistic":
        err = torch.minimum(err, lam * var.sqrt())
    return err.reshape(partials.shape[1:])


def _formula(mode: str, algorithm: str) -> str:
    if algorithm == "gloo":
        prob = "" if mode == "deterministic" else "; probabilistic: min(E_k, lambda sqrt(sum_j c_j^2 + r_j^2))"
        return ("|err| <= E_k, E_j = E_{j-1} + c_j + r_j, r_j = half_ulp_f(|P_j| + E_{j-1} + c_j), P_j = exact "
                "partial sums along gloo's ring order, c_j = conversion errors" + prob)
    coef = "theta_{d-1}" if mode == "deterministic" else "min(theta_{d-1}, lambda (1+theta) sqrt(d-1) u_f)"
    return (f"|err| <= acc + half_ulp_f(|s| + acc), acc = {coef} * S + eta, S = sum_r |x_r|, "
            "d = tree height (+1 if the partials are converted to f)")


@register("all_reduce", "allreduce")
def all_reduce(partials: torch.Tensor, *, fmt=None, compute_fmt=None, out_fmt=None,
               algorithm: CollectiveAlgorithm = "any", reduce_op: str = "sum", mode: str = "deterministic",
               failure_probability: float | None = None) -> Bound:
    """Elementwise bound on ``|all_reduce(x_0, ..., x_{k-1}) - sum_r x_r|`` (``/ k`` for ``reduce_op="avg"``).

    Args:
        partials: ``(k, ...)``: the ``k`` ranks' contributions stacked (their values are exact).
        fmt: format of the reduction (the reduced tensor's dtype); default the partials'
            dtype. fp32 partials reduced in bf16 count one more level (their conversion).
        compute_fmt: synonym of ``fmt`` (hops are stored in ``fmt``; must not differ).
        out_fmt: format the result is stored in afterwards (default ``fmt``).
        algorithm: ``"ring"`` (chain of height ``k-1``), ``"tree"`` (height ``ceil(log2 k)``),
            ``"any"`` (default: valid for every order; equals ``"ring"``) or ``"gloo"`` (the known
            order of gloo's ring all-reduce of the flattened tensor: the tight bound (3)).
        reduce_op: ``"sum"`` or ``"avg"`` (sum, then divide by ``k`` in ``fmt``; ``torch.distributed``'s
            ``ReduceOp.SUM`` / ``ReduceOp.AVG``; named so because ``tolerance``'s first argument is ``op``).
        mode / failure_probability: see :mod:`ttrace_num.bounds.base`.
    Returns a :class:`Bound` shaped like ``partials[0]``.
    """
    f = _reduction_format(partials, fmt, compute_fmt)
    ms = resolve_mode(mode, failure_probability)
    bound, mag, values = _sum_bound(partials, f, algorithm, reduce_op, ms.mode, ms.lam)
    out = get_format(out_fmt) if out_fmt is not None else f
    bound = bound + output_rounding(mag, f, out)
    values["output"] = str(out)
    if ms.mode == "probabilistic":
        values["lambda"] = ms.lam
    assumptions = [f"each of the {partials.shape[0]} partials converted to {f}, every hop rounded to {f} "
                   f"(round to nearest), {algorithm} order"]
    if ms.mode == "probabilistic":
        assumptions.append("rounding errors mean-independent (Higham-Mary model)"
                           + ("" if algorithm == "gloo" else "; the last rounding bounded deterministically"))
    return Bound(abs=bound, mode=ms.mode, failure_probability=ms.failure_probability, magnitude=mag,
                 explanation=Explanation(op="all_reduce", formula=_formula(ms.mode, algorithm), source=SOURCE,
                                         assumptions=tuple(assumptions), values=values))


@register("reduce_scatter", "reduce_scatter_tensor")
def reduce_scatter(partials: torch.Tensor, rank: int | None = None, *, fmt=None, compute_fmt=None, out_fmt=None,
                   algorithm: CollectiveAlgorithm = "any", reduce_op: str = "sum", mode: str = "deterministic",
                   failure_probability: float | None = None) -> Bound:
    """Bound for ``reduce_scatter_tensor``: rank ``r``'s output is rows ``[r m, (r+1) m)`` of the
    sum of the ranks' inputs (``m = n / k``).

    Args:
        partials: ``(k, n, ...)``: every rank's full input (``n`` divisible by ``k``).
        rank: the shard to bound (shape ``(n/k, ...)``); ``None``: every shard, concatenated
            in rank order (shape ``(n, ...)``, the all-reduce bound).
        Other arguments as :func:`all_reduce`.
    """
    k, n = partials.shape[0], partials.shape[1]
    if n % k:
        raise ValueError(f"reduce_scatter_tensor needs dim 1 of partials ({n}) divisible by k={k}")
    if rank is not None and not 0 <= rank < k:
        raise ValueError(f"rank must be in [0, {k}), got {rank}")
    # the bound of the whole all-reduce (gloo's order depends on the whole tensor's layout)
    b = all_reduce(partials, fmt=fmt, compute_fmt=compute_fmt, out_fmt=out_fmt, algorithm=algorithm,
                   reduce_op=reduce_op, mode=mode, failure_probability=failure_probability)
    e = b.explanation
    shard = slice(None) if rank is None else slice(rank * (n // k), (rank + 1) * (n // k))
    return Bound(abs=b.abs[shard], mode=b.mode, failure_probability=b.failure_probability, magnitude=b.magnitude[shard],
                 explanation=Explanation(op="reduce_scatter", formula="every shard element is a k-term all-reduce "
                                         "sum: " + e.formula, source=e.source, assumptions=e.assumptions,
                                         values={**e.values, "rank": "all" if rank is None else rank}))


@register("all_gather", "all_gather_into_tensor")
def all_gather(shards: torch.Tensor, *, fmt=None, compute_fmt=None, out_fmt=None, mode: str = "deterministic",
               failure_probability: float | None = None) -> Bound:
    """Bound for ``all_gather_into_tensor``: the output ``(k m, ...)`` is the shards ``(k, m, ...)``
    concatenated, a copy: bound 0. With ``fmt`` (the gathered tensor's format) narrower than
    the shards' values, their conversion adds ``half_ulp_fmt(|x|)``."""
    ms = resolve_mode(mode, failure_probability)
    f = _reduction_format(shards, fmt, compute_fmt)
    out = get_format(out_fmt) if out_fmt is not None else f
    x = f64(shards).reshape(-1, *shards.shape[2:])
    bound = torch.zeros_like(x)
    if not _on_grid(shards, f):
        bound = half_ulp(x, f)
    bound = bound + output_rounding(x.abs() + bound, f, out)
    exact = not bool(bound.any())
    return Bound(abs=bound, mode=ms.mode, failure_probability=ms.failure_probability, magnitude=x.abs(),
                 explanation=Explanation(
                     op="all_gather",
                     formula="0: the gathered tensor is a byte copy of the shards" if exact
                     else "half_ulp_f(|x|): the shards are rounded to the gathered format",
                     source="definition of all-gather (Thakur, Rabenseifner & Gropp 2005 §3: no arithmetic)",
                     values={"k": shards.shape[0], "format": str(f), "output": str(out)}))


def all_reduce_difference(partials: torch.Tensor, *, fmt=None, algorithm: CollectiveAlgorithm = "any",
                          reference: Summation | None = None, reference_out_fmt=None,
                          mode: str = "deterministic", failure_probability: float | None = None) -> Bound:
    """Elementwise bound on ``|all_reduce(partials) in fmt - fl_out(sum of the partials on one device)|``.

    The one-device sum is ``reference`` (default ``Summation(accum=fp32)``: a chain in fp32,
    any order) rounded to ``reference_out_fmt`` (default ``fmt``). The bound is the smaller of
    :func:`~ttrace_num.bounds.summation.sum_difference_bound` (the all-reduce as
    :func:`reduction_summation`; no rounding is shared, module docstring) and the triangle
    inequality through the exact sum with the two deterministic bounds (tighter for small
    ``k``: the all-reduce's last rounding is ``half_ulp`` of the result, not ``u_f S``).
    """
    f = _reduction_format(partials, fmt, None)
    ref = reference if reference is not None else Summation(accum=get_format("fp32"))
    ref_out = get_format(reference_out_fmt) if reference_out_fmt is not None else f
    ms = resolve_mode(mode, failure_probability)
    k = partials.shape[0]
    ar = reduction_summation(partials, f, algorithm)
    s_abs, y_mag = _sum_statistics(partials)
    # the reference takes the partials as exact terms unless they are off its accumulator's grid
    exact_terms = _on_grid(partials, ref.accum)
    joint, values = sum_difference_bound(s_abs, y_mag, k, ar, ref, f, ref_out, ms.mode, ms.lam, exact_terms)
    # deterministic triangle: the minimum fails no more often than `joint` does
    ref_bound, _ = sum_error_bound(s_abs, y_mag, k, ref, ref_out, "deterministic", math.inf, exact_terms)
    triangle = _sum_bound(partials, f, algorithm, "sum", "deterministic", math.inf)[0] + ref_bound
    bound = torch.minimum(joint, triangle)
    return Bound(abs=bound, mode=ms.mode, failure_probability=ms.failure_probability, magnitude=y_mag,
                 explanation=Explanation(
                     op="all_reduce difference",
                     formula="min(joint, triangle): joint = (1+theta) c(d') S + eta_a + eta_b + out_a + out_b over "
                             "every level of both trees (none shared); triangle = deterministic all_reduce bound + "
                             "deterministic reference bound",
                     source=SOURCE + "; difference identity (1) of ttrace_num.bounds.summation",
                     assumptions=(f"all-reduce: {ar.describe()}", f"reference: {ref.describe()} -> {ref_out}"),
                     values=values))
