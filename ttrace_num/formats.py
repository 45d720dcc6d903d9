"""Floating-point formats as data.

A format is a sign bit (optional), ``exponent_bits`` of biased exponent and
``mantissa_bits`` of explicit significand, plus the choices that differ between
real formats: the exponent bias, which encodings mean Inf/NaN, whether values
below the normal range are subnormal, and what an out-of-range cast does by
default (overflow to Inf, to NaN, or saturate at the largest finite value).

Notation (used across the library and in ``docs/bounds.md``):

* precision ``p = mantissa_bits + 1`` significand bits, hidden bit included;
* unit roundoff ``u = 2**-p``: round-to-nearest gives ``|fl(x) - x| <= u |x|``
  for ``x`` in the normal range (Higham, *Accuracy and Stability of Numerical
  Algorithms*, 2nd ed., Thm 2.2);
* machine epsilon ``eps = 2**-mantissa_bits = 2u`` (spacing of the numbers in [1, 2));
* ``emin = 1 - bias``: exponent of the smallest normal ``2**emin``;
* the smallest subnormal is ``2**(emin - mantissa_bits)``; below the normal range
  round-to-nearest has the *absolute* error bound ``2**(emin - mantissa_bits - 1)``.

Special-value conventions (``nan_encoding``):

* ``"ieee"``: IEEE 754, the all-ones exponent is Inf (mantissa 0) or NaN;
* ``"fn"``: finite-only OCP FP8 E4M3: no Inf, only the all-ones pattern
  ``S.1111.111`` is NaN, so the largest finite value has mantissa ``1..10``;
* ``"fnuz"``: finite, NaN encoded as negative zero (AMD/Graphcore FP8): every
  exponent code is finite, there is no -0;
* ``"none"``: no Inf and no NaN (OCP MX FP6/FP4 element formats);
* ``"e8m0"``: the OCP MX scale format: unsigned, 8 exponent bits, no mantissa,
  no zero, 0xFF is NaN.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

NanEncoding = Literal["ieee", "fn", "fnuz", "none", "e8m0"]
Overflow = Literal["inf", "nan", "saturate"]

__all__ = [
    "FloatFormat",
    "FORMATS",
    "get_format",
    "custom",
    "known_formats",
    "half_ulp",
    "NARROW_DTYPES",
]


@dataclass(frozen=True, repr=False)
class FloatFormat:
    """A binary floating-point format. Frozen, hashable, comparable by value.

    Build the standard ones with :func:`get_format` (``"bf16"``, ``"e4m3"``, ...) and
    arbitrary ones with :func:`custom`.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    nan_encoding: NanEncoding = "ieee"
    signed: bool = True
    subnormals: bool = True
    default_overflow: Overflow = "inf"
    torch_dtype: torch.dtype | None = field(default=None, compare=False)
    ml_dtypes_name: str | None = field(default=None, compare=False)
    aliases: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.exponent_bits < 1:
            raise ValueError(f"format {self.name!r}: exponent_bits must be >= 1, got {self.exponent_bits}")
        if self.mantissa_bits < 0:
            raise ValueError(f"format {self.name!r}: mantissa_bits must be >= 0, got {self.mantissa_bits}")
        if self.exponent_bits + self.mantissa_bits > 63:
            raise ValueError(f"format {self.name!r}: more than 64 bits are not supported")
        if self.nan_encoding == "fn" and self.mantissa_bits < 1:
            raise ValueError(f"format {self.name!r}: the 'fn' NaN encoding needs at least one mantissa bit")
        if self.nan_encoding == "ieee" and self.exponent_bits < 2:
            raise ValueError(f"format {self.name!r}: IEEE Inf/NaN encodings need at least 2 exponent bits")

    # ------------------------------------------------------------------ constants
    @property
    def precision(self) -> int:
        """Significand bits including the hidden bit, ``p``."""
        return self.mantissa_bits + 1

    @property
    def u(self) -> float:
        """Unit roundoff ``2**-p`` of round-to-nearest."""
        return 2.0 ** (-self.precision)

    @property
    def eps(self) -> float:
        """Machine epsilon ``2**-mantissa_bits`` (the gap from 1 to the next number)."""
        return 2.0 ** (-self.mantissa_bits)

    @property
    def has_inf(self) -> bool:
        return self.nan_encoding == "ieee"

    @property
    def has_nan(self) -> bool:
        return self.nan_encoding != "none"

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number, ``1 - bias``.

        For ``e8m0`` (no subnormals, every code is a power of two) it is ``-bias``.
        """
        return -self.bias if self.nan_encoding == "e8m0" else 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest finite number."""
        top_code = 2**self.exponent_bits - 1
        if self.nan_encoding in ("ieee", "e8m0"):
            top_code -= 1  # all-ones exponent is reserved for Inf/NaN
        return top_code - self.bias

    @property
    def max(self) -> float:
        """Largest finite value."""
        m = self.mantissa_bits
        frac_codes = 2**m - 1  # all-ones mantissa
        if self.nan_encoding == "fn":
            frac_codes -= 1  # S.1111.111 is NaN
        return math.ldexp(1.0 + frac_codes / 2**m, self.emax)

    @property
    def min_normal(self) -> float:
        return math.ldexp(1.0, self.emin)

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value (the smallest normal when there are no subnormals)."""
        if not self.subnormals or self.mantissa_bits == 0:
            return self.min_normal
        return math.ldexp(1.0, self.emin - self.mantissa_bits)

    @property
    def subnormal_abs_error(self) -> float:
        """Absolute error bound of round-to-nearest below the normal range: half the
        subnormal spacing ``2**(emin - m - 1)`` (or ``min_normal/2``-ish without subnormals)."""
        if not self.subnormals:
            return self.min_normal / 2 if self.mantissa_bits > 0 else self.min_normal
        return math.ldexp(1.0, self.emin - self.mantissa_bits - 1)

    @property
    def bits(self) -> int:
        return int(self.signed) + self.exponent_bits + self.mantissa_bits

    def constants(self) -> dict[str, float | int | str | bool]:
        """The format's constants as a plain dict (for tables and JSON)."""
        return {
            "name": self.name,
            "bits": self.bits,
            "exponent_bits": self.exponent_bits,
            "mantissa_bits": self.mantissa_bits,
            "bias": self.bias,
            "precision": self.precision,
            "u": self.u,
            "eps": self.eps,
            "emin": self.emin,
            "emax": self.emax,
            "max": self.max,
            "min_normal": self.min_normal,
            "min_subnormal": self.min_subnormal,
            "inf": self.has_inf,
            "nan": self.nan_encoding,
            "overflow": self.default_overflow,
        }

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"FloatFormat({self.name!r})"

    def with_overflow(self, overflow: Overflow) -> "FloatFormat":
        """The same format with another default overflow behaviour (e.g. saturating FP8 casts)."""
        return replace(self, default_overflow=overflow)


def _f(name: str, e: int, m: int, bias: int, nan: NanEncoding, overflow: Overflow,
       torch_dtype: torch.dtype | None, ml: str | None, aliases: tuple[str, ...], **kw) -> FloatFormat:
    return FloatFormat(name=name, exponent_bits=e, mantissa_bits=m, bias=bias, nan_encoding=nan,
                       default_overflow=overflow, torch_dtype=torch_dtype, ml_dtypes_name=ml,
                       aliases=aliases, **kw)


def _dt(name: str) -> torch.dtype | None:
    return getattr(torch, name, None)


FORMATS: dict[str, FloatFormat] = {f.name: f for f in [
    _f("fp64", 11, 52, 1023, "ieee", "inf", torch.float64, "float64", ("float64", "double")),
    _f("fp32", 8, 23, 127, "ieee", "inf", torch.float32, "float32", ("float32", "float", "single")),
    _f("tf32", 8, 10, 127, "ieee", "inf", None, None, ("tensorfloat32",)),
    _f("bf16", 8, 7, 127, "ieee", "inf", torch.bfloat16, "bfloat16", ("bfloat16",)),
    _f("fp16", 5, 10, 15, "ieee", "inf", torch.float16, "float16", ("float16", "half")),
    _f("e4m3", 4, 3, 7, "fn", "nan", _dt("float8_e4m3fn"), "float8_e4m3fn",
       ("e4m3fn", "float8_e4m3fn", "fp8_e4m3")),
    _f("e5m2", 5, 2, 15, "ieee", "inf", _dt("float8_e5m2"), "float8_e5m2", ("float8_e5m2", "fp8_e5m2")),
    _f("e4m3fnuz", 4, 3, 8, "fnuz", "nan", _dt("float8_e4m3fnuz"), "float8_e4m3fnuz", ("float8_e4m3fnuz",)),
    _f("e5m2fnuz", 5, 2, 16, "fnuz", "nan", _dt("float8_e5m2fnuz"), "float8_e5m2fnuz", ("float8_e5m2fnuz",)),
    _f("e8m0", 8, 0, 127, "e8m0", "nan", _dt("float8_e8m0fnu"), "float8_e8m0fnu",
       ("e8m0fnu", "float8_e8m0fnu"), signed=False, subnormals=False),
    _f("e2m3", 2, 3, 1, "none", "saturate", None, "float6_e2m3fn", ("fp6_e2m3", "float6_e2m3fn", "e2m3fn")),
    _f("e3m2", 3, 2, 3, "none", "saturate", None, "float6_e3m2fn", ("fp6_e3m2", "float6_e3m2fn", "e3m2fn")),
    _f("e2m1", 2, 1, 1, "none", "saturate", None, "float4_e2m1fn", ("fp4", "fp4_e2m1", "float4_e2m1fn", "e2m1fn")),
]}

_ALIASES: dict[str, str] = {}
for _fmt in FORMATS.values():
    _ALIASES[_fmt.name] = _fmt.name
    for _a in _fmt.aliases:
        _ALIASES[_a] = _fmt.name

_CUSTOM_RE = re.compile(r"^custom\((.*)\)$")


def custom(exponent_bits: int, mantissa_bits: int, bias: int | None = None, *,
           nan_encoding: NanEncoding = "ieee", subnormals: bool = True, signed: bool = True,
           overflow: Overflow | None = None, name: str | None = None) -> FloatFormat:
    """A user-defined format with ``exponent_bits`` (e) and ``mantissa_bits`` (m).

    ``bias`` defaults to the IEEE choice ``2**(e-1) - 1``. ``nan_encoding`` selects the
    special values (see the module docstring); ``overflow`` defaults to ``"inf"`` for
    IEEE encodings, ``"nan"`` for ``fn``/``fnuz`` and ``"saturate"`` for ``"none"``.

    >>> custom(3, 2).u
    0.125
    """
    defaults = {"ieee": "inf", "fn": "nan", "fnuz": "nan", "none": "saturate", "e8m0": "nan"}
    if nan_encoding not in defaults:
        raise ValueError(f"nan_encoding must be one of {sorted(defaults)}, got {nan_encoding!r}")
    if overflow is None:
        overflow = defaults[nan_encoding]
    if overflow not in ("inf", "nan", "saturate"):
        raise ValueError(f"overflow must be 'inf', 'nan' or 'saturate', got {overflow!r}")
    if bias is None:
        bias = 2 ** (exponent_bits - 1) - 1
    if name is None:
        name = f"custom(e={exponent_bits},m={mantissa_bits},bias={bias},{nan_encoding})"
    return FloatFormat(name=name, exponent_bits=exponent_bits, mantissa_bits=mantissa_bits, bias=bias,
                       nan_encoding=nan_encoding, signed=signed, subnormals=subnormals,
                       default_overflow=overflow)


def _parse_custom(args: str) -> FloatFormat:
    """Parse ``"e=3, m=2, bias=3, nan=none"`` or ``"3,2"`` into :func:`custom` arguments."""
    pos: list[int] = []
    kw: dict[str, object] = {}
    keymap = {"e": "exponent_bits", "m": "mantissa_bits", "bias": "bias", "nan": "nan_encoding",
              "nan_encoding": "nan_encoding", "subnormals": "subnormals", "overflow": "overflow",
              "exponent_bits": "exponent_bits", "mantissa_bits": "mantissa_bits"}
    def integer(field: str, v: str) -> int:
        try:
            return int(v)
        except ValueError:
            raise ValueError(f"custom format: {field} must be an integer, got {v!r} in 'custom({args})'") from None

    for part in filter(None, (p.strip() for p in args.split(","))):
        if "=" in part:
            k, v = (s.strip() for s in part.split("=", 1))
            if k not in keymap:
                raise ValueError(f"unknown custom-format field {k!r}; use e=, m=, bias=, nan=, subnormals=, overflow=")
            key = keymap[k]
            if key in kw:
                raise ValueError(f"custom format: field {k!r} given twice in 'custom({args})'")
            if key in ("nan_encoding", "overflow"):
                kw[key] = v
            elif key == "subnormals":
                if v.lower() not in ("1", "true", "yes", "0", "false", "no"):
                    raise ValueError(f"subnormals must be true or false, got {v!r}")
                kw[key] = v.lower() in ("1", "true", "yes")
            else:
                kw[key] = integer(k, v)
        else:
            pos.append(integer("a positional field", part))
    if len(pos) > 3:
        raise ValueError(f"custom format takes at most 3 positional fields (e, m, bias), got {len(pos)} in 'custom({args})'")
    for k, v in zip(("exponent_bits", "mantissa_bits", "bias"), pos):
        if k in kw:
            raise ValueError(f"custom format: {k} given both by position and by name in 'custom({args})'")
        kw[k] = v
    if "exponent_bits" not in kw or "mantissa_bits" not in kw:
        raise ValueError(f"custom format needs e and m, e.g. 'custom(e=3, m=2)'; got 'custom({args})'")
    return custom(**kw)  # type: ignore[arg-type]


def get_format(spec: "str | FloatFormat | torch.dtype") -> FloatFormat:
    """Look a format up by name, alias, torch dtype, or ``"custom(e=.., m=..)"``.

    Raises ``ValueError`` naming the known formats when ``spec`` is unknown.
    """
    if isinstance(spec, FloatFormat):
        return spec
    if isinstance(spec, torch.dtype):
        for f in FORMATS.values():
            if f.torch_dtype == spec:
                return f
        raise ValueError(f"torch dtype {spec} has no known floating-point format; known: {known_formats()}")
    key = str(spec).strip()
    m = _CUSTOM_RE.match(key.replace(" ", ""))
    if m:
        return _parse_custom(m.group(1))
    name = _ALIASES.get(key.lower())
    if name is None:
        raise ValueError(f"unknown format {spec!r}; known: {known_formats()} or 'custom(e=E, m=M[, bias=B, nan=ieee|fn|fnuz|none])'")
    return FORMATS[name]


def known_formats() -> list[str]:
    return list(FORMATS)


#: bit layout of the working types of :func:`half_ulp`: (integer view, mantissa bits,
#: exponent bias, log2 of the smallest subnormal, largest finite exponent)
_BITS = {torch.float64: (torch.int64, 52, 1023, -1074, 1023), torch.float32: (torch.int32, 23, 127, -149, 127)}
#: torch dtypes whose values and whose formats' half-ulps are all float32 numbers: their
#: :func:`half_ulp` can be computed with ``dtype=torch.float32`` (half the memory traffic of float64)
NARROW_DTYPES = (torch.bfloat16, torch.float16)
#: exponent-field width of those types
_EXP_BITS = {torch.float64: 11, torch.float32: 8}


def half_ulp(t: torch.Tensor, fmt: FloatFormat, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Round-to-nearest error bound at magnitude ``t`` (elementwise, in ``dtype``).

    For ``|t|`` in the normal binade ``[2**e, 2**(e+1))`` this is ``u * 2**e`` (half the
    spacing there), at most ``u |t|``; below the normal range it is the absolute
    ``fmt.subnormal_abs_error``. Monotone non-decreasing in ``|t|``, so
    ``half_ulp(T)`` bounds the rounding error of every value of magnitude ``<= T``.
    At ``t = 0`` it is 0 (zero is representable, and the bound at magnitude 0 covers only 0).
    Above the largest finite value it returns ``+inf`` (overflow is not round-off).

    ``dtype`` float32 (half the memory traffic) takes a float32, bfloat16 or float16 ``t`` (exact
    in float32) and a format whose half-ulps are float32 numbers (e.g. bf16, fp16, FP8, FP6,
    FP4: ``emin >= -126`` and ``emin - p >= -149``); else a ``ValueError``. The values are the
    same powers of two as in float64.
    """
    if dtype == torch.float32:
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16) or fmt.emin < -126 \
                or fmt.emin - fmt.precision < -149:
            raise ValueError(f"half_ulp in float32 needs a float32/bfloat16/float16 tensor (got {t.dtype}) and a "
                             f"format whose half-ulps are float32 numbers (got {fmt.name}): use dtype=torch.float64")
    elif dtype != torch.float64:
        raise ValueError(f"half_ulp computes in float64 or float32, not {dtype}")
    t = t.abs().to(dtype)
    as_int, mant_bits, bias, min_exp, max_exp = _BITS[dtype]
    if fmt.emin >= 1 - bias and fmt.emin - fmt.precision >= min_exp:
        # every result is 2**max(e, emin) times 2**-p, exact: 2**e is t with its mantissa bits
        # cleared (0 for a zero or subnormal t, inf for inf and NaN), the product is a power of
        # two, and the clamp lifts whatever lies below 2**(emin - p) (which is no smaller than
        # the smallest subnormal) to it; three passes, in place after the first
        exponent_field = ((1 << (mant_bits + _EXP_BITS[dtype])) - 1) ^ ((1 << mant_bits) - 1)
        out = (t.view(as_int) & exponent_field).view(dtype)
        out.mul_(2.0 ** -fmt.precision).clamp_(min=2.0 ** (fmt.emin - fmt.precision))
        # 0 at t = 0 (exact in every format) and NaN at NaN, without a mask: t * 2**(-min_exp + emin - p)
        # is >= the result for every t > 0 (>= its smallest value at the smallest subnormal t, >= u t above)
        scale = -min_exp + fmt.emin - fmt.precision
        zero_at_zero = t * 2.0 ** min(scale, max_exp)
        if scale > max_exp:  # formats with a tiny range (FP4, FP6, FP8): a second, exact scaling
            zero_at_zero = zero_at_zero * 2.0 ** (scale - max_exp)
        torch.minimum(out, zero_at_zero, out=out)
    else:  # float64 itself: its half-ulp underflows to float64 subnormals
        _, exp = torch.frexp(t)  # t = mant * 2**exp, mant in [0.5, 1)
        out = torch.ldexp(torch.full_like(t, fmt.u), (exp - 1).clamp(min=fmt.emin).to(torch.float64))
        out.masked_fill_(t == 0, 0.0)
        out.masked_fill_(t.isnan(), math.nan)
    if not fmt.subnormals:
        out.masked_fill_(t < fmt.min_normal, fmt.subnormal_abs_error)
    if t.numel() and not float(t.max()) <= fmt.max:  # overflow (or a NaN) is rare: one reduction first
        out.masked_fill_(t > fmt.max, math.inf)
    return out
