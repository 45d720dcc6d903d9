"""Emulations of the computation models of :mod:`ttrace_num.bounds.activations`.

Every intermediate is rounded to the compute format with
:func:`~ttrace_num.rounding.round_to` (round to nearest even), the elementary functions
(``erf``, ``tanh``, ``exp``) are *correctly rounded* to the compute format (float64
value, then one rounding), and the result is rounded once to the output format. The
inputs are the stored values. ``ftz=True`` (gelu, silu) emulates a flush-to-zero kernel: the
result is set to 0 where it is below the normal range of the compute format, and again
after its rounding to the output format (AVX512-BF16's ``vcvtneps2bf16``). Results are
float64 tensors holding output-format values. Vectorised; the formulas are exactly those stated in the bounds module.
"""
from __future__ import annotations

import math

import torch

from ..formats import FloatFormat, get_format
from ..rounding import round_to

__all__ = ["add", "gelu", "silu", "swiglu"]


def _fmts(x: torch.Tensor, compute_fmt, out_fmt) -> tuple[FloatFormat, FloatFormat]:
    c = get_format(compute_fmt)
    o = get_format(out_fmt) if out_fmt is not None else get_format(x.dtype)
    return c, o


def _result(yc: torch.Tensor, c: FloatFormat, o: FloatFormat, ftz: bool) -> torch.Tensor:
    """``fl_o(yc)``; with ``ftz`` values below ``c``'s, then ``o``'s, normal range flushed to 0."""
    if not ftz:
        return round_to(yc, o)
    y = round_to(yc.masked_fill(yc.abs() < c.min_normal, 0.0), o)
    return y.masked_fill(y.abs() < o.min_normal, 0.0)


def _silu_c(x: torch.Tensor, c: FloatFormat) -> torch.Tensor:
    """``fl(x / fl(1 + EXP(-x)))`` in ``c``; ``x`` float64 on the ``c`` grid."""
    e = round_to(torch.exp(-x), c)
    d = round_to(1.0 + e, c)
    return round_to(x / d, c)


def gelu(x: torch.Tensor, approximate: str = "none", *, compute_fmt="fp32", out_fmt=None,
         ftz: bool = False) -> torch.Tensor:
    """``fl_o(fl(fl(x/2) * fl(1 + ERF(fl(x * fl(1/sqrt2))))))`` or the tanh form (see the bounds)."""
    c, o = _fmts(x, compute_fmt, out_fmt)
    r = lambda t: round_to(t, c)
    xc = r(x.to(torch.float64))
    h = r(xc * 0.5)
    if approximate == "none":
        c1 = float(r(torch.tensor(1.0 / math.sqrt(2.0), dtype=torch.float64)))
        t = r(xc * c1)
        s = r(1.0 + r(torch.special.erf(t)))
    elif approximate == "tanh":
        beta = float(r(torch.tensor(math.sqrt(2.0 / math.pi), dtype=torch.float64)))
        kappa = float(r(torch.tensor(0.044715, dtype=torch.float64)))
        x3 = r(r(xc * xc) * xc)
        u = r(beta * r(xc + r(kappa * x3)))
        s = r(1.0 + r(torch.tanh(u)))
    else:
        raise ValueError(f"approximate must be 'none' or 'tanh', not {approximate!r}")
    return _result(r(h * s), c, o, ftz)


def silu(x: torch.Tensor, *, compute_fmt="fp32", out_fmt=None, ftz: bool = False) -> torch.Tensor:
    """``fl_o(fl(x / fl(1 + EXP(-x))))`` in the compute format."""
    c, o = _fmts(x, compute_fmt, out_fmt)
    return _result(_silu_c(round_to(x.to(torch.float64), c), c), c, o, ftz)


def swiglu(x: torch.Tensor, dim: int = -1, *, fused: bool = False, compute_fmt="fp32", out_fmt=None) -> torch.Tensor:
    """Megatron ``silu(a) * b``; unfused: ``silu(a)`` rounded to the output format first."""
    c, o = _fmts(x, compute_fmt, out_fmt)
    a, b = torch.chunk(x.to(torch.float64), 2, dim=dim)
    s = _silu_c(round_to(a, c), c)
    if not fused:
        s = round_to(s, o)
    return round_to(round_to(s * round_to(b, c), c), o)


def add(x: torch.Tensor, y: torch.Tensor, *, compute_fmt="fp32", out_fmt=None) -> torch.Tensor:
    """``fl_o(fl_c(fl_c(x) + fl_c(y)))`` (the float64 sum of two values of <= 24-bit
    significands within 2**29 of each other's exponent is exact; otherwise it is rounded
    once more in float64, far below the compute-format rounding)."""
    c, o = _fmts(x, compute_fmt, out_fmt)
    xc, yc = round_to(x.to(torch.float64), c), round_to(y.to(torch.float64), c)
    return round_to(round_to(xc + yc, c), o)
