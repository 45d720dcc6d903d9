r"""Propagation of elementwise input-difference bounds through one operator: ``|J| v``.

If the inputs of an op carry differences bounded elementwise by ``v`` (two runs that
already differ), the outputs differ by at most (first order, Higham 2002 §1.7 "condition
numbers"; exact where noted)::

    |f(x + dx) - f(x)| <~ |J_f(x)| v                                         (P)

Each function below returns that bound for one op family. Where the exact nonlinear form
is cheap it is used instead of (P), and bilinear ops include their second-order term so
the bound is rigorous.

* ``linear``/``matmul`` (exact, bilinear): ``|A+dA)(B+dB) - AB| <= |dA||B| + |A||dB| + |dA||dB|``.
* ``add``: ``v_x + v_y`` (exact). ``mul``: ``|x| v_y + v_x |y| + v_x v_y`` (exact).
* ``softmax`` (rigorous; :func:`ttrace_num.bounds.softmax_jacobian.softmax_perturbation`):
  ``p_i(x+d)/p_i(x) = e^{d_i} / sum_j p_j e^{d_j}`` and Jensen
  ``sum_j p_j e^{d_j} >= e^{-sum_j p_j v_j}`` give
  ``|dp_i| <= p_i max(e^{v_i + p.v} - 1, 1 - e^{-v_i} / sum_j p_j e^{v_j})``.
* ``layer_norm`` (first order): with ``xh = (x - mu)/sigma``,
  ``J = diag(w)/sigma (I - 11^T/n - xh xh^T/n)``, so
  ``|J| v <= |w|/sigma (v + mean(v) + |xh| mean(|xh| v))``; weight/bias differences add
  ``|xh| v_w + v_b``.
* ``rms_norm`` (first order): ``J = diag(w)/r (I - xh xh^T/n)``, ``r = rms(x)``:
  ``|J| v <= |w|/r (v + |xh| mean(|xh| v))`` (+ ``|xh| v_w``).
* elementwise ``f`` (gelu, silu): mean-value theorem, rigorous:
  ``|f(x+d) - f(x)| <= max_{|t-x|<=v} |f'(t)| v <= (|f'(x)| + M2 v) v`` with
  ``M2 = max |f''|`` (gelu: ``M2 = 2 phi(0) = 0.7979``, at 0; silu: ``M2 = 0.5`` at 0).
"""
from __future__ import annotations

import math

import torch

from ..bounds.softmax_jacobian import softmax_perturbation as softmax

__all__ = ["matmul", "linear", "add", "mul", "softmax", "layer_norm", "rms_norm", "gelu", "silu", "scale"]

_SQRT2 = math.sqrt(2.0)
GELU_M2 = 2.0 / math.sqrt(2.0 * math.pi)  # max |gelu''| = 2 phi(0)
SILU_M2 = 0.5                             # max |silu''| = 1/2 at 0


def _z(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like, dtype=torch.float64) if t is None else t


def matmul(a: torch.Tensor, b: torch.Tensor, va: torch.Tensor | None, vb: torch.Tensor | None) -> torch.Tensor:
    a64, b64 = a.double(), b.double()
    out = torch.zeros(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]), dtype=torch.float64)
    if va is not None:
        out = out + torch.matmul(va, b64.abs())
    if vb is not None:
        out = out + torch.matmul(a64.abs(), vb)
    if va is not None and vb is not None:
        out = out + torch.matmul(va, vb)
    return out


def linear(x: torch.Tensor, w: torch.Tensor, vx, vw, vb) -> torch.Tensor:
    out = matmul(x, w.transpose(-1, -2), vx, None if vw is None else vw.transpose(-1, -2))
    return out if vb is None else out + vb


def add(vx: torch.Tensor | None, vy: torch.Tensor | None) -> torch.Tensor:
    if vx is None:
        return vy
    if vy is None:
        return vx
    return vx + vy


def mul(x: torch.Tensor, y, vx, vy) -> torch.Tensor:
    x64 = x.double()
    y64 = y.double() if isinstance(y, torch.Tensor) else torch.tensor(float(y), dtype=torch.float64)
    out = 0
    if vx is not None:
        out = out + vx * y64.abs()
    if vy is not None:
        out = out + x64.abs() * vy
    if vx is not None and vy is not None:
        out = out + vx * vy
    return out


def scale(v: torch.Tensor, factor: float) -> torch.Tensor:
    return v * abs(factor)


def _stats(x: torch.Tensor, dims: tuple[int, ...], eps: float, centered: bool):
    x64 = x.double()
    mu = x64.mean(dims, keepdim=True) if centered else torch.zeros((), dtype=torch.float64)
    var = ((x64 - mu) ** 2).mean(dims, keepdim=True)
    sigma = torch.sqrt(var + eps)
    return (x64 - mu) / sigma, sigma


def layer_norm(x, normalized_shape, weight, vx, vw, vb, eps: float) -> torch.Tensor:
    dims = tuple(range(-len(normalized_shape), 0))
    xh, sigma = _stats(x, dims, eps, centered=True)
    w = weight.double().abs() if weight is not None else 1.0
    out = 0
    if vx is not None:
        out = w / sigma * (vx + vx.mean(dims, keepdim=True) + xh.abs() * (xh.abs() * vx).mean(dims, keepdim=True))
    if vw is not None:
        out = out + xh.abs() * vw
    if vb is not None:
        out = out + vb
    return out


def rms_norm(x, normalized_shape, weight, vx, vw, eps: float) -> torch.Tensor:
    dims = tuple(range(-len(normalized_shape), 0))
    xh, r = _stats(x, dims, eps, centered=False)
    w = weight.double().abs() if weight is not None else 1.0
    out = 0
    if vx is not None:
        out = w / r * (vx + xh.abs() * (xh.abs() * vx).mean(dims, keepdim=True))
    if vw is not None:
        out = out + xh.abs() * vw
    return out


def gelu_slope(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``|gelu'(x)|`` (erf or tanh form)."""
    x64 = x.double()
    if approximate == "tanh":
        c = math.sqrt(2.0 / math.pi)
        t = torch.tanh(c * (x64 + 0.044715 * x64**3))
        return (0.5 * (1 + t) + 0.5 * x64 * (1 - t * t) * c * (1 + 3 * 0.044715 * x64 * x64)).abs()
    cdf = 0.5 * (1.0 + torch.erf(x64 / _SQRT2))
    pdf = torch.exp(-0.5 * x64 * x64) / math.sqrt(2 * math.pi)
    return (cdf + x64 * pdf).abs()


def silu_slope(x: torch.Tensor) -> torch.Tensor:
    """``|silu'(x)| = |s (1 + x (1 - s))|``, ``s = sigmoid(x)``."""
    x64 = x.double()
    s = torch.sigmoid(x64)
    return (s * (1 + x64 * (1 - s))).abs()


def gelu(x: torch.Tensor, v: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    # max |f''| is attained at 0 for both forms: f''(0) = sqrt(2/pi) = 2 phi(0)
    return (gelu_slope(x, approximate) + GELU_M2 * v) * v


def silu(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return (silu_slope(x) + SILU_M2 * v) * v


# ---------------------------------------------------------------------------------------
# Quadrature (probabilistic) propagation of squared scales: sum_j J_ij^2 w_j.
#
# Under the mean-independence model the output difference is, to first order, a sum
# sum_k J_k e_k of local errors with |e_k| <= b_k and E[e_k | earlier errors] = 0: a
# martingale with increments bounded by |J_k| b_k, so Azuma-Hoeffding bounds it by
# lambda * sqrt(sum_k (J_k b_k)^2). The functions below propagate the squared scales
# w = sum (J b)^2 elementwise (w_out = b_local^2 + sum_j J_ij^2 w_j), first order.
# ---------------------------------------------------------------------------------------

def matmul_sq(a, b, wa, wb) -> torch.Tensor:
    a64, b64 = a.double(), b.double()
    out = 0
    if wa is not None:
        out = out + torch.matmul(wa, b64 * b64)
    if wb is not None:
        out = out + torch.matmul(a64 * a64, wb)
    if wa is not None and wb is not None:
        out = out + torch.matmul(wa, wb)
    return out


def linear_sq(x, w, wx, ww, wb) -> torch.Tensor:
    out = matmul_sq(x, w.transpose(-1, -2), wx, None if ww is None else ww.transpose(-1, -2))
    return out if wb is None else out + wb


def mul_sq(x, y, wx, wy) -> torch.Tensor:
    x64 = x.double()
    y64 = y.double() if isinstance(y, torch.Tensor) else torch.tensor(float(y), dtype=torch.float64)
    out = 0
    if wx is not None:
        out = out + wx * y64 * y64
    if wy is not None:
        out = out + x64 * x64 * wy
    if wx is not None and wy is not None:
        out = out + wx * wy
    return out


def softmax_sq(p: torch.Tensor, w: torch.Tensor, dim: int) -> torch.Tensor:
    """Exact ``sum_j J_ij^2 w_j`` for ``J_ij = p_i (delta_ij - p_j)``:
    ``p_i^2 (w_i (1 - 2 p_i) + sum_j p_j^2 w_j)``."""
    p64 = p.double()
    return torch.nan_to_num(p64 * p64 * (w * (1 - 2 * p64) + (p64 * p64 * w).sum(dim, keepdim=True)), nan=0.0)


def layer_norm_sq(x, normalized_shape, weight, wx, ww, wb, eps: float) -> torch.Tensor:
    """Exact ``sum_j J_ij^2 w_j`` for ``J_ij = (g_i/sigma)(delta_ij - (1 + xh_i xh_j)/n)``:
    ``(g_i/sigma)^2 [w_i (1 - 2(1 + xh_i^2)/n) + (sum_j w_j + 2 xh_i sum_j xh_j w_j
    + xh_i^2 sum_j xh_j^2 w_j) / n^2]`` (``g`` = weight)."""
    dims = tuple(range(-len(normalized_shape), 0))
    xh, sigma = _stats(x, dims, eps, centered=True)
    n = math.prod(normalized_shape)
    g2 = weight.double() ** 2 if weight is not None else 1.0
    out = 0
    if wx is not None:
        s0 = wx.sum(dims, keepdim=True)
        s1 = (xh * wx).sum(dims, keepdim=True)
        s2 = (xh * xh * wx).sum(dims, keepdim=True)
        out = g2 / sigma**2 * (wx * (1 - 2 * (1 + xh * xh) / n) + (s0 + 2 * xh * s1 + xh * xh * s2) / n**2)
    if ww is not None:
        out = out + xh * xh * ww
    if wb is not None:
        out = out + wb
    return out


def rms_norm_sq(x, normalized_shape, weight, wx, ww, eps: float) -> torch.Tensor:
    """Exact ``sum_j J_ij^2 w_j`` for ``J_ij = (g_i/r)(delta_ij - xh_i xh_j / n)``:
    ``(g_i/r)^2 [w_i (1 - 2 xh_i^2/n) + xh_i^2 sum_j xh_j^2 w_j / n^2]``."""
    dims = tuple(range(-len(normalized_shape), 0))
    xh, r = _stats(x, dims, eps, centered=False)
    n = math.prod(normalized_shape)
    g2 = weight.double() ** 2 if weight is not None else 1.0
    out = 0
    if wx is not None:
        out = g2 / r**2 * (wx * (1 - 2 * xh * xh / n) + xh * xh * (xh * xh * wx).sum(dims, keepdim=True) / n**2)
    if ww is not None:
        out = out + xh * xh * ww
    return out


def add_sq(wx, wy):
    return add(wx, wy)


def scale_sq(w: torch.Tensor, factor: float) -> torch.Tensor:
    return w * factor * factor


def gelu_sq(x, w, approximate: str = "none") -> torch.Tensor:
    """First order: ``gelu'(x)^2 w`` (the second-order term is O(w^2), negligible at round-off scale)."""
    return gelu_slope(x, approximate) ** 2 * w


def silu_sq(x, w) -> torch.Tensor:
    return silu_slope(x) ** 2 * w
