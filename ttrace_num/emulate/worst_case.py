r"""Worst-case rounding emulation: executions of the computation models that *attain* the bounds.

The deterministic bounds of :mod:`ttrace_num.bounds` hold for every rounding the model
allows: ``fl_f(t) = t (1 + delta)`` with ``|delta| <= u_f`` (Higham 2002, §2.2, model (2.4)),
or its half-ulp refinement ``|fl_f(t) - t| <= half_ulp_f(t)`` where a bound uses that
(output roundings, the last ``fl_c`` of softmax), an exp/log within ``k`` ulps, i.e. a
relative error ``<= 2 k u``. An emulation that at every rounding applies the *largest*
allowed error, in the direction that increases the final error, is therefore a legitimate
execution of the model: a correct bound is never below its error, and a bound that is
first-order tight is attained by it up to ``1 + O(n u)``. A bound that lost a term, or
whose constant shrank by 1%, falls below it on inputs where that term matters: this is
what the sharp tests (``tests/test_sharp_*.py``) and the mutation check
(``bench/mutation.py``) use it for.

Everything is evaluated in float64 on values carried exactly by the model (``t (1 + u)``
is not a number of the format: the model only states the size of the error, and the
emulation is an execution of the *model*, not of a floating-point unit). The float64
evaluation itself errs by ``~2^-53`` relative per operation, ``2^-29`` of an fp32 rounding
(``u = 2^-24``): negligible against the 1% the tests resolve.

``sign = +1`` rounds every value up in magnitude (``t (1 + u)``), ``-1`` down: for a sum of
positive terms rounding every node up maximises the error (identity (1) of
:mod:`ttrace_num.bounds.summation`: ``error = sum_v delta_v s'_v``, every ``s'_v > 0``).
"""
from __future__ import annotations

import torch

from ..bounds.norms import MomentOps, State, SumOps, TorchCPULayout, _ratio, torch_cpu_moments, torch_cpu_sum
from ..bounds.summation import Summation, conversion_exact, products_exact
from ..formats import FloatFormat, get_format, half_ulp
from ..rounding import round_to

__all__ = ["rel_round", "half_ulp_round", "worst_sum", "worst_matmul", "worst_softmax", "worst_log_softmax",
           "worst_quantize", "worst_torch_cpu_sum", "worst_rms_norm", "worst_layer_norm", "worst_layer_norm_torch_cpu",
           "worst_attention_one_key", "F64_SLACK", "sharp_verdict"]

#: the float64 arithmetic of an emulation against its bound: a worst case may sit on the bound
F64_SLACK = 1.0 + 1e-12


def sharp_verdict(name: str, bound: torch.Tensor, err: torch.Tensor, factor: float) -> str | None:
    """``None`` when sharp case ``name`` holds (``err <= bound``, up to :data:`F64_SLACK`) and its
    bound is attained (``bound <= factor * err``), else what failed. The check of every sharp test
    module, and of ``bench/mutation.py``: a lost term fails the first, a spurious one the second."""
    if not torch.isfinite(bound).all():
        return f"{name}: bound not finite"
    if not (err <= bound * F64_SLACK).all():
        return f"{name}: worst-case execution exceeds the bound by {float((err / bound).max())}"
    ratio = bound / err
    if not (ratio <= factor).all():
        return f"{name}: bound/worst = {float(ratio.max())} > {factor}: not sharp"
    return None


def rel_round(t: torch.Tensor, fmt: FloatFormat, sign: float | torch.Tensor) -> torch.Tensor:
    """``t (1 + sign u_f)``: the largest relative rounding error the model allows (``|sign| <= 1``)."""
    return t * (1.0 + sign * get_format(fmt).u)


def half_ulp_round(t: torch.Tensor, fmt: FloatFormat, sign: float | torch.Tensor) -> torch.Tensor:
    """``t + sign half_ulp_f(t)``: the largest round-to-nearest error at ``t`` (half-ulp model)."""
    return t + sign * half_ulp(t, get_format(fmt))


def _tree(x: torch.Tensor, algorithm: str, block: int, fmt: FloatFormat, sign: float) -> torch.Tensor:
    """Sum along the last dim with the tree of ``algorithm`` (as :mod:`.summation` emulates it),
    every addition rounded by :func:`rel_round`."""
    n = x.shape[-1]
    if n == 1:
        return x[..., 0]
    if algorithm == "recursive":
        s = x[..., 0]
        for k in range(1, n):
            s = rel_round(s + x[..., k], fmt, sign)
        return s
    if algorithm == "pairwise":
        while x.shape[-1] > 1:
            m = x.shape[-1] // 2 * 2
            pairs = rel_round(x[..., 0:m:2] + x[..., 1:m:2], fmt, sign)
            x = torch.cat([pairs, x[..., m:]], -1)
        return x[..., 0]
    if algorithm == "blocked":
        sums = [_tree(x[..., i:i + block], "recursive", block, fmt, sign) for i in range(0, n, block)]
        return _tree(torch.stack(sums, -1), "recursive", block, fmt, sign)
    raise ValueError(f"unknown summation algorithm {algorithm!r}")


def worst_sum(x: torch.Tensor, summation: Summation, sign: float = 1.0, exact_terms: bool = True) -> torch.Tensor:
    """The sum of ``x`` (float64) along its last dim under ``summation`` (order, split and
    reduction as :func:`ttrace_num.emulate.summation.emulate_sum`), every rounding the
    model counts (the terms' rounding into ``accum`` unless ``exact_terms``, every node of
    the parts' trees, the conversion of the partials to ``reduce_fmt`` when inexact, every
    node of the reduction) applied as ``t (1 + sign u)``."""
    x = x.to(torch.float64)
    if not exact_terms:
        x = rel_round(x, summation.accum, sign)
    n = x.shape[-1]
    ps = summation.part_size(n)
    partials = [_tree(x[..., i:i + ps], summation.algorithm, summation.block, summation.accum, sign)
                for i in range(0, n, ps)]
    if len(partials) == 1:
        return partials[0]
    rf = summation.reduce_fmt or summation.accum
    p = torch.stack(partials, -1)
    if not conversion_exact(summation.accum, rf):
        p = rel_round(p, rf, sign)
    return _tree(p, summation.reduce_algorithm, summation.block, rf, sign)


def worst_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
                 summation: Summation | None = None, fmt=None, out_fmt=None, sign: float = 1.0) -> torch.Tensor:
    """``A @ B (+ bias)`` (2-D) under the matmul model of :func:`ttrace_num.bounds.matmul.matmul`,
    every rounding at its largest error in direction ``sign``: the products (when not exact
    in the accumulator), the summation tree, the output rounding (half-ulp, when the final
    format does not convert exactly to ``out_fmt``). For non-negative ``A``, ``B`` and ``sign =
    +1`` this is the largest error the model allows for that order."""
    storage = get_format(fmt if fmt is not None else a.dtype)
    summ = summation if summation is not None else Summation()
    out = get_format(out_fmt if out_fmt is not None else a.dtype)
    terms = a.to(torch.float64)[:, None, :] * b.to(torch.float64).T[None, :, :]
    if bias is not None:
        terms = torch.cat([terms, bias.to(torch.float64).expand(terms.shape[:2])[..., None]], -1)
    y = worst_sum(terms, summ, sign, exact_terms=products_exact(storage, summ.accum))
    return y if conversion_exact(summ.final_fmt, out) else half_ulp_round(y, out, sign)


def _exp_terms(a: torch.Tensor, h: torch.Tensor, cu: float, sign: torch.Tensor, c: FloatFormat) -> torch.Tensor:
    """``exp_c(fl_c(a))`` at its largest error in direction ``sign`` (per element): the
    argument off by ``sign h`` (its half-ulp rounding), the exp off by ``sign c_exp u`` and,
    where the result may be below ``c``'s normal range, by the absolute ``2
    subnormal_abs_error`` (one subnormal ulp) of the model."""
    e = torch.exp(a + sign * h) * (1.0 + sign * cu)
    under = torch.exp(a - h) < c.min_normal
    return e + torch.where(under, sign * 2.0 * c.subnormal_abs_error, torch.zeros_like(e))


def _shifted(x: torch.Tensor, c: FloatFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, h)``: ``a = x - max`` (float64, exact for the inputs used) and the half-ulp of its
    rounding to ``c`` (0 where ``a`` is representable in ``c``)."""
    x = x.to(torch.float64)
    a = x - x.max(-1, keepdim=True).values
    h = torch.where(round_to(a, c) == a, torch.zeros_like(a), half_ulp(a, c))
    return a, h


def worst_softmax(x: torch.Tensor, *, compute_fmt="fp32", out_fmt="fp32", summation: Summation | None = None,
                  division: str = "reciprocal", exp_ulps: float = 1.0) -> torch.Tensor:
    """Per element ``i`` of each row (last dim), the largest ``softmax_hat_i - y_i`` the model of
    :func:`ttrace_num.bounds.softmax.softmax` allows: ``e_i`` rounded up
    (argument ``+h_i``, exp ``+c_exp u``), every other ``e_j`` down, the row sum's every node
    down (``1 - u``), ``fl(1/s)`` up (``"reciprocal"``), the product ``e_i r`` up by
    ``half_ulp_c`` and the output up by ``half_ulp_out``. One emulated row per element (the
    directions depend on ``i``): rows of ``n`` entries cost ``n^2`` exps."""
    c, out = get_format(compute_fmt), get_format(out_fmt)
    summ = summation if summation is not None else Summation(accum=c)
    a, h = _shifted(x, c)
    n = a.shape[-1]
    sign = 2.0 * torch.eye(n, dtype=torch.float64) - 1.0          # row i: +1 at i, -1 elsewhere
    e = _exp_terms(a[..., None, :], h[..., None, :], 2.0 * exp_ulps * c.u, sign, c)  # (..., i, j)
    s = worst_sum(e, summ, -1.0)                                  # (..., i)
    ei = torch.diagonal(e, dim1=-2, dim2=-1)
    if division == "reciprocal":
        p = ei * (rel_round(1.0 / s, c, 1.0))
    elif division == "divide":
        p = ei / s
    else:
        raise ValueError(f"division must be 'reciprocal' or 'divide', not {division!r}")
    yc = half_ulp_round(p, c, 1.0)
    return yc if conversion_exact(c, out) else half_ulp_round(yc, out, 1.0)


def worst_log_softmax(x: torch.Tensor, *, compute_fmt="fp32", out_fmt="fp32", stats_fmt="fp32",
                      summation: Summation | None = None, exp_ulps: float = 1.0, log_ulps: float = 1.0
                      ) -> torch.Tensor:
    """Per element, the largest ``log_softmax_hat_i - (a_i - L)`` of the model of
    :func:`ttrace_num.bounds.softmax.log_softmax` (no underflowing exp): the argument ``t_i``
    up by ``h_i`` and every other ``t_j`` down, every exp down, the row sum's every node
    down, its conversion to ``stats_fmt`` down, ``log`` down by ``c_log u``, its rounding to
    ``stats_fmt`` down by ``half_ulp``, then ``t_i - L_hat`` up by ``half_ulp_c`` and the output
    up by ``half_ulp_out``."""
    c, out, st = get_format(compute_fmt), get_format(out_fmt), get_format(stats_fmt)
    summ = summation if summation is not None else Summation(accum=c)
    a, h = _shifted(x, c)
    n = a.shape[-1]
    targ = 2.0 * torch.eye(n, dtype=torch.float64) - 1.0           # argument directions for target i
    e = torch.exp(a[..., None, :] + targ * h[..., None, :]) * (1.0 - 2.0 * exp_ulps * c.u)
    s = worst_sum(e, summ, -1.0)
    if not conversion_exact(c, st):
        s = rel_round(s, st, -1.0)
    lg = torch.log(s) * (1.0 - 2.0 * log_ulps * c.u)
    if not conversion_exact(c, st):
        lg = half_ulp_round(lg, st, -1.0)
    t = a + h                                                      # t_i rounded up
    r = t - lg
    yc = r + half_ulp(r, c)                                        # r > ... : up = towards +inf
    y = yc if conversion_exact(c, out) else yc + half_ulp(yc, out)
    return y


def worst_quantize(x: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor, fmt, *, compute_fmt="fp32",
                   out_fmt=None) -> torch.Tensor:
    """``x' = fl_out(fl_c(q s_inv))``, ``q = RN_fmt(fl_c(x s))``, every rounding at its largest
    error away from zero (``x >= 0`` assumed; saturating at ``fmt.max``): ``x s`` up by
    ``half_ulp_c``, the element rounding up by ``half_ulp_fmt`` (what a tie or a value just
    below a midpoint gives), the dequantization up by ``half_ulp_c``, the output up. The
    model of :func:`ttrace_num.bounds.fp8.quantize` (``dequant="scale_inv"``), for non-saturating
    elements."""
    f, c = get_format(fmt), get_format(compute_fmt)
    out = get_format(out_fmt) if out_fmt is not None else c
    t = x.to(torch.float64) * scale
    t = torch.where(t == round_to(t, c), t, half_ulp_round(t, c, 1.0))
    q = half_ulp_round(t, f, 1.0)
    d = q * scale_inv
    d = torch.where(d == round_to(d, c), d, half_ulp_round(d, c, 1.0))
    return d if conversion_exact(c, out) else half_ulp_round(d, out, 1.0)


class _WorstSumOps(SumOps):
    """:func:`~ttrace_num.bounds.norms.torch_cpu_sum`'s schedule on float64 values, every
    addition of two non-empty accumulators rounded by :func:`rel_round` (an addition to the
    empty accumulator is exact, as in the tree height the bound counts)."""

    def __init__(self, x: torch.Tensor, lanes: int, fmt: FloatFormat, sign: float, ilp: int = 4) -> None:
        self.x, self.lanes, self.fmt, self.sign, self.ilp = x, lanes, fmt, sign, ilp

    def block(self, i: int) -> torch.Tensor:
        w = self.ilp * self.lanes
        return self.x[..., i * w:(i + 1) * w].reshape(*self.x.shape[:-1], self.ilp, self.lanes)

    def vector(self, k: int) -> torch.Tensor:
        return self.x[..., k * self.lanes:(k + 1) * self.lanes]

    def scalar(self, k: int) -> torch.Tensor:
        return self.x[..., k]

    def add(self, a, b):
        if a is None or b is None:
            return b if a is None else a
        return rel_round(a + b, self.fmt, self.sign)

    def part(self, a: torch.Tensor, k: int, axis: str) -> torch.Tensor:
        return a[..., k, :] if axis == "stream" else a[..., k]


def worst_torch_cpu_sum(x: torch.Tensor, lanes: int, fmt, sign: float = 1.0) -> torch.Tensor:
    """ATen's CPU sum (:func:`~ttrace_num.bounds.norms.torch_cpu_sum`) of ``x`` (last dim) with
    ``lanes`` lanes (1 below ``lanes`` values, as :func:`~ttrace_num.bounds.norms.rms_norm`),
    every rounding at ``t (1 + sign u)``. A term at a leaf of depth ``h`` gets ``(1 + sign
    u)^h``: the bound's tree height is attained by a row whose mass sits at a deepest leaf."""
    x = x.to(torch.float64)
    n = x.shape[-1]
    total = torch_cpu_sum(n, lanes if n >= lanes else 1, _WorstSumOps(x, lanes if n >= lanes else 1,
                                                                       get_format(fmt), sign))
    return torch.zeros(x.shape[:-1], dtype=torch.float64) if total is None else total


def _away(t: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """``t`` rounded away from zero by ``half_ulp_fmt(t)`` (the half-ulp model's largest error)."""
    return half_ulp_round(t, fmt, torch.sign(t))


def _affine_worst(z: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                  c: FloatFormat, out: FloatFormat) -> torch.Tensor:
    """``fl_out(fl_c(fl_c(z w) + b))`` with every rounding away from zero (``z``, ``z w`` and
    ``z w + b`` of one sign: the errors add), the output's only when ``c -> out`` is inexact."""
    t = z
    if weight is not None:
        t = _away(t * weight.to(torch.float64), c)
    if bias is not None:
        t = _away(t + bias.to(torch.float64), c)
    return t if conversion_exact(c, out) else _away(t, out)


def worst_rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *,
                   summation: Summation | None = None, lanes: int = 8, compute_fmt="fp32", out_fmt=None,
                   rsqrt_ulps: float = 1.5) -> torch.Tensor:
    """``fl_o(fl(fl(x r^) w))``, ``r^ = RSQRT(fl(fl(fl(sum fl(x^2)) / n) + eps^))`` (the model of
    :func:`ttrace_num.bounds.norms.rms_norm`, last dim), at its largest error: every square,
    node of the sum (``summation``, or ATen's cascade with ``lanes`` lanes when ``None``) and
    the division by ``n`` rounded *down* (``1 - u``), ``+ eps^`` down by ``half_ulp_c`` (so
    ``W^`` is smallest and ``r^`` largest), ``RSQRT`` up by ``rsqrt_ulps u``, then ``x r^``,
    ``* w`` and the output away from zero by half an ulp."""
    c = get_format(compute_fmt)
    out = get_format(out_fmt if out_fmt is not None else x.dtype)
    x64 = x.to(torch.float64)
    n = x64.shape[-1]
    sq = x64 * x64
    if not products_exact(get_format(x.dtype), c):
        sq = rel_round(sq, c, -1.0)
    s = worst_torch_cpu_sum(sq, lanes, c, -1.0) if summation is None else worst_sum(sq, summation, -1.0)
    ms = rel_round(s / n, c, -1.0)[..., None]
    w_hat = half_ulp_round(ms + float(round_to(torch.tensor(eps, dtype=torch.float64), c)), c, -1.0)
    r = w_hat.rsqrt() * (1.0 + rsqrt_ulps * c.u)
    return _affine_worst(_away(x64 * r, c), weight, None, c, out)


def worst_layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                     eps: float = 1e-5, *, summation: Summation | None = None, compute_fmt="fp32",
                     out_fmt=None) -> torch.Tensor:
    """Per element ``i`` of each row (last dim; rows with a positive sum), the largest error of
    the ``moments="two_pass"``, ``centering="subtract"`` model of
    :func:`ttrace_num.bounds.norms.layer_norm`: ``mu^ = fl(fl(sum x)/n)`` with every node and
    the division rounded *towards* ``x_i`` (``1 - sign(d_i) u``: ``|x_i - mu^|`` largest),
    ``d^_i = fl(x_i - mu^)`` away from zero; the variance ``fl(fl(sum fl(d^_j^2))/n)`` with the
    subtractions rounded towards zero and every square, node and the division down,
    ``+ eps^`` down (``W^`` smallest), ``fl(1/fl(sqrt(W^)))`` up by ``(1+u)/(1-u)``; then
    ``d^_i r^``, ``* w``, ``+ b`` and the output away from zero. The bound charges the
    subtraction of element ``i`` independently in the variance (``2 |d_i| rho_i``) and in the
    output (``dd_i``), so the emulation rounds them independently (one row per element, as
    :func:`worst_softmax`). One emulated row per element: rows of ``n`` cost ``n^2``."""
    c = get_format(compute_fmt)
    out = get_format(out_fmt if out_fmt is not None else x.dtype)
    summ = summation if summation is not None else Summation(accum=c)
    x64 = x.to(torch.float64)
    n = x64.shape[-1]
    d_sign = torch.sign(x64 - x64.mean(-1, keepdim=True))             # (..., i)
    mu_sign = -d_sign[..., :, None]                                    # (..., i, 1): mean towards x_i
    xs = x64[..., None, :].expand(*x64.shape[:-1], n, n)               # (..., i, j)
    up, down = worst_sum(xs, summ, 1.0), worst_sum(xs, summ, -1.0)
    s = torch.where(mu_sign[..., 0] > 0, up, down)
    mu = rel_round(s / n, c, mu_sign[..., 0])[..., None]               # (..., i, 1)
    dv = x64[..., None, :] - mu
    dv = half_ulp_round(dv, c, -torch.sign(dv))                        # towards zero: variance smallest
    v = rel_round(worst_sum(rel_round(dv * dv, c, -1.0), summ, -1.0) / n, c, -1.0)
    eps_h = float(round_to(torch.tensor(eps, dtype=torch.float64), c))
    r = half_ulp_round(v + eps_h, c, -1.0).rsqrt() * ((1.0 + c.u) / (1.0 - c.u))
    di = _away(x64 - mu[..., 0], c)
    return _affine_worst(_away(di * r, c), weight, bias, c, out)


def worst_attention_one_key(v: torch.Tensor, *, algorithm: str = "standard", compute_fmt="fp32", p_fmt=None,
                            out_fmt=None, exp_ulps: float = 1.0) -> torch.Tensor:
    """Attention with a single key (``Lk = 1``: ``p = 1``, ``O = v``, the scores' and the
    softmax's perturbations cancel exactly) under the models of
    :func:`ttrace_num.bounds.attention.attention`, every rounding at its largest error away from
    zero. ``"standard"``: ``r = fl(1/e)`` up, ``p^ = fl(e r)`` up, ``fl_pf(p^)`` up by
    ``half_ulp_pf`` when ``pf != c``, the product ``P~ v`` up (its one rounding level), the
    output. ``"online"``: ``e = exp(0) (1 + c_e)`` (the largest exp error, in the binade above
    1), ``P~ = fl_pf(e)`` up by ``half_ulp_pf(e)``, ``acc = fl(P~ v)`` up, ``l = e`` (one term,
    exact), ``fl(acc fl(1/l))`` with both roundings up, the output. ``v``: ``(..., 1, dv)``."""
    c = get_format(compute_fmt)
    pf = get_format(p_fmt) if p_fmt is not None else c
    out = get_format(out_fmt if out_fmt is not None else v.dtype)
    v64 = v.to(torch.float64)
    if algorithm == "standard":
        e = torch.ones((), dtype=torch.float64)
        p = rel_round(e * rel_round(1.0 / e, c, 1.0), c, 1.0)
        pt = p if conversion_exact(c, pf) else half_ulp_round(p, pf, 1.0)
        o = rel_round(pt * v64, c, 1.0)
    elif algorithm == "online":
        e = torch.tensor(1.0 + 2.0 * exp_ulps * c.u, dtype=torch.float64)
        pt = e if conversion_exact(c, pf) else half_ulp_round(e, pf, 1.0)
        acc = rel_round(pt * v64, c, 1.0)
        o = rel_round(acc * rel_round(1.0 / e, c, 1.0), c, 1.0)
    else:
        raise ValueError(f"algorithm must be 'standard' or 'online', not {algorithm!r}")
    return o if conversion_exact(c, out) else _away(o, out)


def _sterbenz(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Where ``fl(a - b)`` is exact by Sterbenz's lemma (same sign, ``|b|/2 <= |a| <= 2|b|``)."""
    return ((a * b) > 0) & (2 * a.abs() >= b.abs()) & (a.abs() <= 2 * b.abs())


def _sub_worst(a: torch.Tensor, b: torch.Tensor, c: FloatFormat, sign: torch.Tensor | float) -> torch.Tensor:
    """``fl(a - b)`` off by ``sign half_ulp_c``, exact where Sterbenz's lemma applies (where the
    bound's :func:`~ttrace_num.bounds.norms.sub_rounding` charges 0)."""
    t = a - b
    return torch.where(_sterbenz(a, b), t, half_ulp_round(t, c, sign))


def _add_worst(a: torch.Tensor, b: torch.Tensor, c: FloatFormat, sign: torch.Tensor | float) -> torch.Tensor:
    """``fl(a + b)`` (``a`` a c-number) off by ``sign min(half_ulp_c(a + b), |b|)``: the largest
    error of the model (``a`` itself is a candidate of the rounding)."""
    t = a + b
    return t + sign * torch.minimum(half_ulp(t, c), b.abs())


class _WorstMomentOps(MomentOps):
    """ATen's ``RowwiseMoments`` merges (:func:`~ttrace_num.bounds.norms.torch_cpu_moments`) on
    float64 values, every rounding of the model of :class:`~ttrace_num.bounds.norms.BoundOps`
    at its largest size: the mean's local error ``(c^ - c) delta^ + c r1 + r2 + r3`` of every
    node in direction ``mean_sign`` (``c^ = c + mean_sign sign(delta^) dc``, ``delta^``'s
    rounding ``r1``, ``q^ = fl(c^ delta^)``'s ``r2``, ``fl(mA^ + q^)``'s ``r3 = min(hu, |q^|)``,
    Sterbenz-exact differences exact; with ``shrink_delta`` ``r1`` is instead towards zero, which
    makes ``|delta^|`` and so ``M^`` smaller: the bound charges ``r1`` to the mean and to ``M``
    independently, one execution cannot take both), and every rounding of ``M`` *down* (``W^`` smallest):
    ``fl(x - m^)`` towards zero, the products ``delta^ F^`` (Welford, half-ulp) and
    ``((delta^ delta^) c^) nA`` (merge, relative ``u`` each, ``c^ = c - dc``) towards zero, the
    additions down by ``min(hu, smaller operand)``. The bound uses ``c^`` only through
    ``|c^ - c| <= dc`` per use, so each use taking its worst end is an execution of the model."""

    def __init__(self, c: FloatFormat, mean_sign: float, shrink_delta: bool = False) -> None:
        self.c, self.s, self.shrink = c, mean_sign, shrink_delta

    def leaf(self, x: torch.Tensor) -> State:
        return {"m": x, "M": torch.zeros_like(x)}

    def _mean(self, a: State, b: State, cc: float, dc: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(m^, delta^)`` of the merge of ``a`` and ``b`` (weight ``cc`` of ``b``)."""
        t = b["m"] - a["m"]
        delta = _sub_worst(b["m"], a["m"], self.c, -torch.sign(t) if self.shrink else self.s)
        ch = cc + self.s * torch.sign(delta) * dc
        q = half_ulp_round(ch * delta, self.c, self.s)
        return _add_worst(a["m"], q, self.c, self.s), delta

    def welford(self, st: State, x: torch.Tensor, n_before: int, division: bool) -> State:
        nv = n_before + 1
        m, delta = self._mean(st, self.leaf(x), 1.0 / nv, 0.0 if division else _ratio(1, nv, self.c)[1])
        f = x - m
        f = torch.where(_sterbenz(x, m), f, half_ulp_round(f, self.c, -torch.sign(f)))
        p = delta * f
        p = half_ulp_round(p, self.c, -torch.sign(p))
        return {"m": m, "M": _add_worst(st["M"], p, self.c, -1.0)}

    def merge(self, a: State, b: State, na: int, nb: int, scalar: bool) -> State:
        c = self.c
        cc, dc = nb / (na + nb), _ratio(nb, na + nb, c)[1]
        m, delta = self._mean(a, b, cc, dc)
        p = rel_round(rel_round(rel_round(delta * delta, c, -1.0) * (cc - dc), c, -1.0) * na, c, -1.0)
        return {"m": m, "M": _add_worst(a["M"], _add_worst(b["M"], p, c, -1.0), c, -1.0)}


def worst_layer_norm_torch_cpu(x: torch.Tensor, weight: torch.Tensor | None = None,
                               bias: torch.Tensor | None = None, eps: float = 1e-5, *,
                               layout: TorchCPULayout | None = None, compute_fmt="fp32",
                               out_fmt=None) -> torch.Tensor:
    """Per element ``i`` of each row (last dim), the largest error of the ``moments="torch_cpu"``,
    ``centering="subtract"`` model of :func:`ttrace_num.bounds.norms.layer_norm`: the moment
    tree of :class:`_WorstMomentOps` with the mean rounded *away from* ``x_i`` (``mean_sign =
    -sign(d_i)``: ``|x_i - mu^|`` largest) and ``M`` down, ``delta^`` rounded with the mean or
    towards zero (``shrink_delta``); ``v^ = fl(M^ / N)`` down,
    ``W^ = fl(v^ + eps^)`` down, ``fl(1/fl(sqrt(W^)))`` up by ``(1+u)/(1-u)``; ``d^_i = fl(x_i -
    mu^)`` away from zero (exact where Sterbenz's lemma applies), then ``d^_i r^``, ``* w``,
    ``+ b`` and the output away from zero. Four runs of the tree per row (mean direction x
    ``shrink_delta``); per element the run farthest from the float64 layer norm (each run is an
    execution of the model, so the largest of them is one too)."""
    c = get_format(compute_fmt)
    out = get_format(out_fmt if out_fmt is not None else x.dtype)
    x64 = x.to(torch.float64).reshape(-1, x.shape[-1])
    n = x64.shape[-1]
    mean = x64.mean(-1, keepdim=True)
    up = x64 < mean                                                    # mean rounded up for these elements
    eps_h = float(round_to(torch.tensor(eps, dtype=torch.float64), c))
    exact = _affine_worst((x64 - mean) * ((x64 - mean) ** 2).mean(-1, keepdim=True).add(eps).rsqrt(),
                          weight, bias, get_format("fp64"), get_format("fp64"))
    best = None
    for shrink in (False, True):
        runs = [torch_cpu_moments(x64, _WorstMomentOps(c, s, shrink), get_format(x.dtype), layout)[0]
                for s in (1.0, -1.0)]
        mu = torch.where(up, runs[0]["m"][:, None], runs[1]["m"][:, None])
        M = torch.where(up, runs[0]["M"][:, None], runs[1]["M"][:, None])
        v = half_ulp_round(M / n, c, -1.0)
        r = half_ulp_round(v + eps_h, c, -1.0).rsqrt() * ((1.0 + c.u) / (1.0 - c.u))
        di = x64 - mu
        di = torch.where(_sterbenz(x64, mu), di, _away(di, c))
        y = _affine_worst(_away(di * r, c), weight, bias, c, out)
        best = y if best is None else torch.where((y - exact).abs() > (best - exact).abs(), y, best)
    return best.reshape(x.shape)
