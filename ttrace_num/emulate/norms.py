"""Emulations of the computation models of :mod:`ttrace_num.bounds.norms`.

Every operation is rounded to the compute format with :func:`~ttrace_num.rounding.round_to`;
``fma=True`` evaluates the fused multiply-adds that torch CPU uses with one rounding
(``a*b`` is exact in float64 for operands of <= 26 significant bits; the float64 sum of
the product and the addend is then rounded to the compute format: the double rounding
this may cause is below 2^-53 relative, far inside the bound's slack). With the default
settings (fp32 compute, torch's vector layout, ``fma=True``) :func:`layer_norm`'s mean and
``1/sqrt(var+eps)`` equal torch's CPU ``native_layer_norm`` bit for bit (tests), and
:func:`rms_norm` (ATen's cascade sum, ``fl(1/fl(sqrt))``) equals ``torch.rms_norm``. Sums
of the two-pass model (and of rms_norm with a ``Summation``) reuse
:func:`ttrace_num.emulate.summation.emulate_mean`.
Results are float64 tensors holding output-format values.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..bounds.norms import (
    MomentOps,
    State,
    SumOps,
    TorchCPULayout,
    default_layout,
    torch_cpu_moments,
    torch_cpu_sum,
)
from ..bounds.summation import Summation
from ..formats import FloatFormat, get_format
from ..rounding import round_to
from .summation import emulate_mean

__all__ = ["RoundingOps", "layer_norm", "moments", "rms_norm"]


class SumRoundingOps(SumOps):
    """The additions of ATen's CPU sum (:func:`ttrace_num.bounds.norms.torch_cpu_sum`) on
    rows ``x`` (float64, ``(rows, n)``), each rounded to ``c``."""

    def __init__(self, x: torch.Tensor, c: FloatFormat, lanes: int, ilp: int = 4):
        self.x, self.c, self.lanes, self.ilp = x, c, lanes, ilp

    def block(self, i: int) -> torch.Tensor:
        L, k = self.lanes, self.ilp
        return self.x[:, k * i * L:(k * i + k) * L].reshape(self.x.shape[0], k, L)

    def vector(self, i: int) -> torch.Tensor:
        return self.x[:, i * self.lanes:(i + 1) * self.lanes]

    def scalar(self, k: int) -> torch.Tensor:
        return self.x[:, k]

    def add(self, a, b):
        if a is None:
            return b
        if b is None:
            return a
        return round_to(a + b, self.c)

    def part(self, a: torch.Tensor, k: int, axis: str) -> torch.Tensor:
        return a[:, k] if axis == "stream" else a[..., k]


class RoundingOps(MomentOps):
    """The merges of ATen's ``RowwiseMoments`` evaluated in format ``c`` (see the bounds module)."""

    def __init__(self, c: FloatFormat, fma: bool = True):
        self.c = c
        self.fma = fma

    def r(self, t: torch.Tensor | float) -> torch.Tensor:
        return round_to(torch.as_tensor(t, dtype=torch.float64), self.c)

    def f(self, a, b, d) -> torch.Tensor:
        """``a * b + d``: fused (one rounding) or two roundings."""
        if self.fma:
            return self.r(a * b + d)
        return self.r(self.r(a * b) + d)

    def leaf(self, x: torch.Tensor) -> State:
        return {"m": x, "M": torch.zeros_like(x)}

    def welford(self, st: State, x: torch.Tensor, n_before: int, division: bool) -> State:
        r, m, M = self.r, st["m"], st["M"]
        delta = r(x - m)
        if division:  # scalar tail: m1 += delta / m0
            m_new = r(m + r(delta / float(r(n_before + 1))))
        else:  # vector chunk: m1 = fma(1/(j+1), delta, m1)
            m_new = self.f(float(r(1.0 / float(r(n_before + 1)))), delta, m)
        return {"m": m_new, "M": self.f(delta, r(x - m_new), M)}

    def merge(self, a: State, b: State, na: int, nb: int, scalar: bool) -> State:
        r = self.r
        nah, nbh, nvh = float(r(na)), float(r(nb)), float(r(na + nb))
        c = float(r(nbh / nvh))
        delta = r(b["m"] - a["m"])
        if scalar:  # AddMoments: m1 += c*delta; m2 += m2_add + delta*delta*c*m0
            m = self.f(c, delta, a["m"])
            inner = self.f(r(r(delta * delta) * c), nah, b["M"])
            return {"m": m, "M": r(a["M"] + inner)}
        # AddMomentsVec
        m2_tmp = r(a["M"] + b["M"])
        cd = r(c * delta)
        m0d = r(delta * nah)
        return {"m": r(a["m"] + cd), "M": self.f(m0d, cd, m2_tmp)}


def _rows(x: torch.Tensor, normalized_shape) -> tuple[torch.Tensor, int]:
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    n = math.prod(normalized_shape)
    return x.detach().to(torch.float64).reshape(-1, n), n


def moments(rows: torch.Tensor, c: FloatFormat, storage: FloatFormat, model: str = "torch_cpu",
            layout: TorchCPULayout | None = None, fma: bool = True,
            summation: Summation | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Computed ``(mean, var)`` of each row (keepdim), ``model`` = ``"torch_cpu"`` or
    ``"two_pass"`` (sums as ``summation`` states, default recursive in ``c``)."""
    N = rows.shape[-1]
    if model == "torch_cpu":
        ops = RoundingOps(c, fma)
        st, _ = torch_cpu_moments(rows, ops, storage, layout)
        mu = st["m"].unsqueeze(-1)
        var = ops.r(st["M"].unsqueeze(-1) / float(ops.r(N)))
        return mu, var
    if model != "two_pass":
        raise ValueError(f"unknown moments model {model!r}")
    summ = summation if summation is not None else Summation(accum=c)
    mu = emulate_mean(rows, -1, summ, c).unsqueeze(-1)
    d = round_to(rows - mu, c)
    var = emulate_mean(round_to(d * d, c), -1, summ, c).unsqueeze(-1)
    return mu, var


def layer_norm(x: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5, *, compute_fmt="fp32", out_fmt=None,
               moments_model: str = "torch_cpu", centering: str | None = None,
               layout: TorchCPULayout | None = None, fma: bool = True,
               summation: Summation | None = None) -> torch.Tensor:
    """Layer norm as stated in :mod:`ttrace_num.bounds.norms` (default: torch CPU's algorithm)."""
    c = get_format(compute_fmt)
    storage = get_format(x.dtype)
    o = get_format(out_fmt) if out_fmt is not None else storage
    if centering is None:
        centering = "subtract" if storage.precision >= c.precision else "fold"
    rows, n = _rows(x, normalized_shape)
    r = lambda t: round_to(t, c)
    mu, var = moments(rows, c, storage, moments_model, layout, fma, summation)
    rstd = r(1.0 / r(torch.sqrt(r(var + float(r(torch.tensor(float(eps))))))))
    f = (lambda a, b, d: r(a * b + d)) if fma else (lambda a, b, d: r(r(a * b) + d))
    if centering == "subtract":
        z = r(r(rows - mu) * rstd)
    else:
        z = f(rows, rstd, r(-rstd * mu))
    w = None if weight is None else weight.detach().to(torch.float64).reshape(n)
    b = None if bias is None else bias.detach().to(torch.float64).reshape(n)
    if w is not None and b is not None:
        y = f(z, w, b)
    elif w is not None:
        y = r(z * w)
    elif b is not None:
        y = r(z + b)
    else:
        y = z
    return round_to(y, o).reshape(x.shape)


def rms_norm(x: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
             eps: float | None = 1e-6, *, compute_fmt="fp32", out_fmt=None,
             summation: Summation | str | None = None, layout: TorchCPULayout | None = None,
             rsqrt: str | None = None) -> torch.Tensor:
    """``fl_o(fl(fl(x * RSQRT(fl(fl(sum fl(x^2)) / n) + eps)) * w))`` in the compute format.

    ``summation``: ``"torch_cpu"`` (default, ATen's cascade sum with the ``layout``'s lanes)
    or a :class:`~ttrace_num.bounds.summation.Summation`. ``rsqrt``: ``"sqrt_div"``
    (``fl(1/fl(sqrt))``, torch's; default for fp32) or ``"correctly_rounded"`` (default
    otherwise). The defaults reproduce ``torch.rms_norm`` bit for bit."""
    c = get_format(compute_fmt)
    storage = get_format(x.dtype)
    o = get_format(out_fmt) if out_fmt is not None else storage
    if eps is None:
        eps = c.eps
    if rsqrt is None:
        rsqrt = "sqrt_div" if c == get_format("fp32") else "correctly_rounded"
    rows, n = _rows(x, normalized_shape)
    r = lambda t: round_to(t, c)
    sq = r(rows * rows)
    if summation is None or summation == "torch_cpu":
        lanes = (layout or default_layout()).lanes
        s = torch_cpu_sum(n, lanes if n >= lanes else 1, SumRoundingOps(sq, c, lanes if n >= lanes else 1))
        ms = r(s / float(r(torch.tensor(float(n))))).unsqueeze(-1)
    else:
        ms = emulate_mean(sq, -1, summation, c).unsqueeze(-1)
    w_ = r(ms + float(r(torch.tensor(float(eps)))))
    if rsqrt == "sqrt_div":
        rs = r(1.0 / r(torch.sqrt(w_)))
    elif rsqrt == "correctly_rounded":
        rs = r(1.0 / torch.sqrt(w_))
    else:
        raise ValueError(f"rsqrt must be 'sqrt_div' or 'correctly_rounded', not {rsqrt!r}")
    y = r(rows * rs)
    if weight is not None:
        y = r(y * weight.detach().to(torch.float64).reshape(n))
    return round_to(y, o).reshape(x.shape)
