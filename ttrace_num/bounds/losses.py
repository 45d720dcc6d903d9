r"""Mean squared error loss (``F.mse_loss``), forward and backward, as torch computes it on CPU.

Notation: inputs ``x``, ``y`` stored in format ``s`` (same shape, taken exactly), ``c`` the
compute format (fp32 for formats narrower than fp32, else ``s``), ``u_f`` the unit roundoff of
format ``f``, ``hu_f(t)`` the round-to-nearest error bound at magnitude ``t``
(:func:`~ttrace_num.formats.half_ulp`, monotone in ``t``), ``d = x - y``, ``m = |d|``.

Forward (``aten/src/ATen/native/Loss.cpp`` ``mse_loss``: the elementwise ``mse_stub``, then
``apply_loss_reduction``; the stub, ``BinaryOpsKernel.cpp`` ``mse_kernel``, computes
``diff = a - b; return diff * diff`` in ``scalar_t``, so for bf16/fp16 each of the two
operations is computed in ``c`` and rounded to ``s``):

* ``d_hat = fl_s(fl_c(x - y))``: ``|d_hat - d| <= delta = hu_c(m) + hu_s(m + hu_c(m))`` (one
  rounding in each format, the second at a magnitude at most ``m + hu_c(m)``; ``hu_s(m)`` alone
  when ``c = s``);
* ``q_hat = fl_s(fl_c(d_hat^2))``: with ``Q = (m + delta)^2 >= d_hat^2``,
  ``|q_hat - d_hat^2| <= rho = hu_c(Q) + hu_s(Q + hu_c(Q))`` (``hu_s(Q)`` when ``c = s``), and
  ``|d_hat^2 - d^2| = |d_hat - d| |d_hat + d| <= delta (2 m + delta)``.

So each stored square is within ``B = delta (2 m + delta) + rho`` of ``d^2`` and at most
``Q + rho`` in magnitude. ``reduction="none"``: the bound is ``B``. ``"sum"``/``"mean"``: the
reduction of the stored squares, bounded by the ``sum``/``mean`` models of :mod:`.reduction`
(any summation order; the mean's division and output rounding included), evaluated at the
upper bounds ``Q + rho`` of the terms (the squares are non-negative, so their sum's magnitude
and the sum of their magnitudes are both at most the sum of the upper bounds, and the
reduction bound is monotone in both), plus ``sum B`` (``/ n`` for the mean) for the terms'
own errors.

Backward (``mse_loss_backward``: ``norm = 2 / n`` for the mean, 2 otherwise; the CPU kernel
``PointwiseOpsKernel.cpp`` ``mse_backward_cpu_kernel`` computes ``scalar_val * (self - target) *
grad`` in ``scalar_t``, ``scalar_val = norm`` converted to ``s``): up to four roundings, each
one in ``c`` then one in ``s``: the difference, the constant's conversion (none when ``s`` holds
``norm``), the product with it (none when the converted constant is a power of two) and the
product with ``grad_output`` (none where that is a power of two or zero). With ``k`` of them
per element, in the normal range ``|g_hat - g| <= gamma_k |g|``, ``gamma_k = ((1 + u_c)(1 +
u_s))^k - 1`` (``(1 + u_s)^k - 1`` when ``c = s``; Higham 2002, Lemma 3.1), ``g = norm (x - y)
grad_output`` exact. Below the normal range each rounding adds at most ``eta_s``
(``fmt.subnormal_abs_error``), multiplied by the factors applied after it (``|grad_output|``
for the difference and the constant, ``1`` for the last product): ``(1 + gamma) eta_s (1 +
|grad_output| (1 + norm + m))`` bounds them together (each intermediate magnitude at most
``(1 + gamma)`` times its exact value plus the same terms).

Sources: Higham, *Accuracy and Stability of Numerical Algorithms* (2002) §2.2 and Lemma 3.1;
torch ``aten/src/ATen/native/Loss.cpp``, ``cpu/BinaryOpsKernel.cpp`` (``mse_kernel``),
``cpu/PointwiseOpsKernel.cpp`` (``mse_backward_cpu_kernel``).
"""
from __future__ import annotations

import torch

from ..formats import FloatFormat, half_ulp
from ..rounding import round_to
from .base import Bound, Explanation
from .common import f64, register, resolve_mode, resolve_precision
from .reduction import mean, sum_

__all__ = ["mse_loss", "mse_loss_backward"]

SOURCE = ("Higham, Accuracy and Stability of Numerical Algorithms (2002) §2.2, Lemma 3.1; torch "
          "aten/src/ATen/native/Loss.cpp, cpu/BinaryOpsKernel.cpp (mse_kernel), "
          "cpu/PointwiseOpsKernel.cpp (mse_backward_cpu_kernel)")
_U64 = 2.0 ** -52  # float64 evaluation slack on a magnitude computed by one float64 operation


def _round_twice(t: torch.Tensor, c: FloatFormat, s: FloatFormat) -> torch.Tensor:
    """Bound of ``fl_s(fl_c(z))`` against ``z`` for ``|z| <= t``: ``hu_c(t) + hu_s(t + hu_c(t))``,
    or ``hu_s(t)`` when ``c`` is ``s``."""
    if c == s:
        return half_ulp(t, s)
    hc = half_ulp(t, c)
    return hc + half_ulp(t + hc, s)


def _check(x: torch.Tensor, y: torch.Tensor, reduction: str) -> None:
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"reduction must be 'none', 'mean' or 'sum', not {reduction!r}")
    if x.shape != y.shape:
        raise ValueError(f"mse_loss bound expects input and target of one shape, got {tuple(x.shape)} and "
                         f"{tuple(y.shape)} (broadcasting is not modelled)")


@register("mse_loss")
def mse_loss(x: torch.Tensor, y: torch.Tensor, *, reduction: str = "mean", fmt=None, compute_fmt=None,
             out_fmt=None, mode: str = "deterministic", failure_probability: float | None = None) -> Bound:
    """Bound on ``|F.mse_loss(x, y, reduction=reduction) - exact|`` (module docstring)."""
    _check(x, y, reduction)
    prec = resolve_precision((x, y), fmt, compute_fmt, out_fmt)
    ms = resolve_mode(mode, failure_probability)
    s, c = prec.storage, prec.compute
    m = (f64(x) - f64(y)).abs() * (1 + _U64)
    delta = _round_twice(m, c, s)
    big_q = ((m + delta) ** 2) * (1 + 2 * _U64)
    rho = _round_twice(big_q, c, s)
    own = delta * (2 * m + delta) * (1 + 2 * _U64) + rho
    values = {"n": x.numel(), "reduction": reduction}
    if reduction == "none":
        bound = own
    else:
        terms = (big_q + rho).reshape(-1)
        model = mean if reduction == "mean" else sum_
        red = model(terms, dim=0, fmt=s, compute_fmt=c, out_fmt=prec.out, mode=ms.mode,
                    failure_probability=ms.failure_probability if ms.mode == "probabilistic" else None).abs
        total = own.sum() * (1 + x.numel() * _U64)
        bound = red + (total / max(x.numel(), 1) if reduction == "mean" else total)
    return Bound(abs=bound, mode=ms.mode, failure_probability=ms.failure_probability,
                 explanation=Explanation(
                     op="mse_loss",
                     formula="per element B = delta (2m + delta) + rho, delta = rounding of x - y, rho = rounding of "
                             "d_hat^2 (each fl_s(fl_c(.))); mean/sum: reduction bound at the terms' upper bounds "
                             "(m + delta)^2 + rho, plus sum B (/ n)",
                     source=SOURCE, assumptions=(prec.describe(), "inputs exact as stored; any summation order"),
                     values=values))


@register("mse_loss_backward")
def mse_loss_backward(x: torch.Tensor, y: torch.Tensor, grad_output: torch.Tensor, *, reduction: str = "mean",
                      fmt=None, compute_fmt=None, mode: str = "deterministic",
                      failure_probability: float | None = None) -> Bound:
    """Bound on torch's computed ``d F.mse_loss(x, y, reduction) / d x`` given the upstream
    gradient ``grad_output`` (a scalar for ``"mean"``/``"sum"``, elementwise for ``"none"``);
    module docstring. The gradient of ``y`` is its negation (the same bound)."""
    _check(x, y, reduction)
    prec = resolve_precision((x, y), fmt, compute_fmt, None)
    ms = resolve_mode(mode, failure_probability)
    s, c = prec.storage, prec.compute
    norm = 2.0 / max(x.numel(), 1) if reduction == "mean" else 2.0
    m = (f64(x) - f64(y)).abs()
    go = f64(torch.as_tensor(grad_output)).abs()
    exact = norm * m * go * (1 + 3 * _U64)
    norm_s = float(round_to(torch.tensor(norm, dtype=torch.float64), s))
    k = (1 + int(norm_s != norm) + int(not _power_of_two(torch.tensor(norm_s))) + (~_power_of_two(go)).double())
    gamma = (((1 + c.u) * (1 + s.u)) if c != s else (1 + s.u)) ** k - 1
    bound = gamma * exact + (1 + gamma) * s.subnormal_abs_error * (1 + go * (1 + norm + m))
    return Bound(abs=bound, mode=ms.mode, failure_probability=ms.failure_probability,
                 explanation=Explanation(
                     op="mse_loss_backward",
                     formula="gamma_k |norm (x - y) grad_output| + (1 + gamma_k) eta_s (1 + |grad_output| (1 + norm + "
                             "|x - y|)), gamma_k = ((1 + u_c)(1 + u_s))^k - 1, k <= 4 inexact roundings",
                     source=SOURCE, assumptions=(prec.describe(), "roundings: the difference; the constant's conversion, "
                                                 "the products with it and with grad_output unless exact"),
                     values={"norm": norm, "max_roundings": int(k.max()), "reduction": reduction}))


def _power_of_two(t: torch.Tensor) -> torch.Tensor:
    """Elementwise: ``t`` is zero or a power of two (a product with it is exact in the normal range)."""
    mant, _ = torch.frexp(t.double().abs())
    return (mant == 0.5) | (t == 0)
