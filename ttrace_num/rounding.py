"""Round torch tensors to any :class:`~ttrace_num.formats.FloatFormat`.

``round_to(x, fmt)`` returns, in float64, the value that a cast of ``x`` to ``fmt``
produces: round to nearest, ties to even, with gradual underflow (subnormals),
and out-of-range values handled as the format does (Inf, NaN or saturation).
Every format with at most 52 mantissa bits and a representable exponent range is
exactly representable in float64, so the result is exact.

Algorithm (one rounding, no double rounding): for ``a = |x|`` let
``e = max(floor(log2 a), emin)``; the representable numbers near ``a`` are the
multiples of the quantum ``q = 2**(e - m)``; ``x / q`` is exact (power-of-two
scaling), so ``round_half_even(x / q) * q`` is the correctly rounded value on the
format's grid with an unbounded exponent. Then values whose magnitude exceeds
``fmt.max`` overflow.  Stochastic rounding rounds ``y = x / q`` up with probability
``y - floor(y)`` (exactly, by comparing a 53-bit uniform draw with the exact
fraction), so that ``E[result] = x``.

Verified bit for bit (``tests/test_rounding.py``) against ``ml_dtypes`` and torch
casts, exhaustively for every format of at most 8 bits; the differences that remain
are deliberate and listed in :func:`round_to`.
"""
from __future__ import annotations

import math

import torch

from .formats import FloatFormat, Overflow, get_format

__all__ = ["round_to", "quantum", "representable"]


def quantum(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Spacing ``2**(max(floor(log2|x|), emin) - m)`` of ``fmt`` at ``x`` (float64)."""
    a = x.abs().to(torch.float64)
    _, exp = torch.frexp(a)
    e = (exp.to(torch.int64) - 1).clamp(min=fmt.emin)
    return torch.ldexp(torch.ones_like(a), (e - fmt.mantissa_bits).to(torch.float64))


#: formats whose torch cast from float64 is exact exactly when the value is representable
#: (IEEE formats with Inf: an unrepresentable value, rounded once or twice, becomes another value)
_CAST_CHECKED = (torch.float32, torch.bfloat16, torch.float16)


def representable(x: torch.Tensor, fmt: FloatFormat | str) -> torch.Tensor:
    """Elementwise ``round_to(x, fmt) == x``: ``x`` is a value of ``fmt`` (NaN never is).

    For fp32, bf16 and fp16 this is a cast round trip, two passes instead of
    :func:`round_to`'s fifteen: a representable value survives any cast chain exactly (torch
    casts float64 to bf16/fp16 through float32, and every such value is a float32 value), and
    an unrepresentable one becomes another value, ``+-inf`` beyond the range."""
    fmt = get_format(fmt)
    if fmt.torch_dtype in _CAST_CHECKED:
        return x.to(fmt.torch_dtype).to(x.dtype) == x
    return round_to(x, fmt) == x


def round_to(x: torch.Tensor, fmt: FloatFormat | str, *, overflow: Overflow | None = None,
             stochastic: bool = False, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round ``x`` to ``fmt`` and return the rounded values as float64.

    Args:
        x: any real torch tensor (converted to float64 first; float64 holds every
            bf16/fp16/fp32 value exactly).
        fmt: a format or its name (``"bf16"``, ``"e4m3"``, ``"custom(e=3,m=2)"``...).
        overflow: what a magnitude above ``fmt.max`` becomes: ``"inf"`` (IEEE),
            ``"nan"`` (OCP FP8 non-saturating casts) or ``"saturate"`` (clamp to
            ``±fmt.max``, as torch's cast to float8_e4m3fn does). Defaults to the
            format's ``default_overflow``. Infinite inputs follow the same rule.
            ``"inf"`` on a format without Inf gives NaN.
        stochastic: stochastic rounding instead of round-to-nearest-even: ``x``
            becomes one of its two neighbours on the grid, the upper one with
            probability ``(x - lo) / (hi - lo)``, so the result is unbiased.
        generator: random generator for stochastic rounding (reproducibility).

    Formats without subnormals flush results below ``min_normal`` to the nearest of
    ``0``/``min_normal``; unsigned formats map negative inputs to NaN.

    Agreement with the reference casts (bit for bit; see ``tests/test_rounding.py``):
    equal to ``numpy.ndarray.astype(ml_dtypes.<fmt>)`` with the format's default overflow
    (checked exhaustively for the <= 8-bit formats on every float16 and bfloat16 bit
    pattern, every value, every tie and its float32 neighbours; on 10**6 random float32
    values for bf16/fp16), and to torch's casts with ``overflow="saturate"`` for
    ``float8_e4m3fn`` (torch saturates, even ``±inf``), ``"inf"`` for ``float8_e5m2``,
    ``"nan"`` for the ``fnuz`` types. Deliberate differences:

    * **float64 inputs are rounded once.** torch and ml_dtypes convert float64 to a
      narrow format through float32, i.e. they round twice; for a float64 value that
      is not a float32 value and lies within a float32 rounding of a tie of ``fmt``
      they can return the other neighbour. ``round_to`` returns the correctly rounded
      value. To reproduce the double-rounded cast, pass ``x.to(torch.float32)``.
    * **NaN into a format without NaN** (``e2m3``, ``e3m2``, ``e2m1``, ``nan_encoding
      = "none"``): ml_dtypes 0.6 returns a signed zero (sign bit *opposite* to the
      NaN's); ``round_to`` returns NaN. The float64 result can carry a NaN, and turning
      an upstream NaN into a silent zero would hide exactly the kind of fault this
      library is meant to find; the OCP MX v1.0 element formats have no NaN encoding,
      so no conversion is "right". (In an MX block a NaN makes the E8M0 scale NaN.)
    * **e8m0** (``float8_e8m0fnu``): round_to follows ml_dtypes: ``±0`` and negative
      inputs give NaN (the format has no zero and no sign), ``±inf`` gives NaN (or
      ``max`` with ``overflow="saturate"``), ties ``1.5 * 2**k`` round up (for a format
      without mantissa bits "even" means the even significand 2), magnitudes below
      ``2**-127`` give ``2**-127``, and, as both ml_dtypes and torch do, every value in
      the open binade ``(2**-127, 2**-126)`` gives ``2**-126``: their bit-level rounding
      treats the float32 subnormal ``2**-127`` as having a zero implicit bit, so any
      excess over ``2**-127`` rounds up. (Round-to-nearest only; the error there can
      exceed half an ulp, so ``half_ulp`` does not bound it.) torch's cast differs from
      ml_dtypes and ``round_to`` in two ways: it ignores the sign (a negative ``x``
      gives the rounding of ``|x|``) and maps ``±0`` to ``2**-127``.
    """
    fmt = get_format(fmt)
    overflow = overflow or fmt.default_overflow
    xd = x.to(torch.float64)
    if fmt.mantissa_bits >= 52 and fmt.exponent_bits >= 11:
        return xd.clone()
    q = quantum(xd, fmt)
    y = xd / q
    if stochastic:
        fl = torch.floor(y)
        frac = y - fl  # exact
        noise = torch.rand(y.shape, dtype=torch.float64, generator=generator, device=y.device)
        r = (fl + (noise < frac).to(torch.float64)) * q
    else:
        r = torch.round(y) * q  # torch.round rounds half to even
    finite = torch.isfinite(xd)
    nan = torch.full_like(xd, math.nan)
    if not fmt.subnormals:
        lo = fmt.min_normal
        small = r.abs() < lo
        if fmt.nan_encoding == "e8m0":
            # no zero: everything below the smallest power of two goes to it
            r = torch.where(small & finite, torch.full_like(r, lo), r)
            if not stochastic:
                # ml_dtypes/torch: (2**-127, 2**-126) -> 2**-126 (see docstring)
                a = xd.abs()
                r = torch.where((a > lo) & (a < 2 * lo), torch.full_like(r, 2 * lo), r)
            r = torch.where(xd == 0, nan, r)
        else:
            r = torch.where(small & finite, torch.where(xd.abs() >= lo / 2, torch.sign(xd) * lo, 0.0 * xd), r)
    big = (r.abs() > fmt.max) | ~finite
    if overflow == "saturate":
        over = torch.sign(xd) * fmt.max
    elif overflow == "inf" and fmt.has_inf:
        over = torch.sign(xd) * math.inf
    else:
        over = nan
    r = torch.where(big, over, r)
    r = torch.where(torch.isnan(xd), nan, r)
    if not fmt.signed:
        r = torch.where(xd < 0, nan, r)
    if fmt.nan_encoding == "fnuz":
        r = r + 0.0  # no negative zero in fnuz formats: -0.0 + 0.0 == +0.0
    return r
