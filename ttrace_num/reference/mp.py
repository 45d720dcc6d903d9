"""mpmath helpers: working precision, exact tensor <-> mpf conversion, correct rounding.

Conventions
-----------
* Working precision is given in decimal digits (``dps``, as ``mpmath.mp.dps``);
  the default is :data:`DEFAULT_DPS` = 50 (169 bits). :func:`workdps` changes the
  default for the references of this package *and* ``mpmath.mp.dps`` inside a
  ``with`` block; every reference function also takes an explicit ``dps=``.
* Tensor -> mpf is **exact**: every bf16/fp16/fp32/fp8 value is exact in float64, and
  float64 -> mpf is exact.
* mpf -> float64 is **correctly rounded** (round to nearest, ties to even) over the
  whole range, subnormals included. Note: ``float(mpf)`` rounds to nearest at 53 bits
  and then lets ``math.ldexp`` round a second time when the result is subnormal
  (double rounding: e.g. ``(0.5 + 2**-60) * 2**-1074`` gives 0.0 instead of
  ``2**-1074``). :func:`mpf_to_float` does not have that defect.

For speed the reference operators work on mpmath's raw tuples ("raw mpf":
``(sign, man, exp, bc)``) with the low-level functions of ``mpmath.libmp`` and an
explicit precision in bits; :func:`to_raw` / :func:`from_raw` convert tensors to and
from lists of those. Measured on the project's CPU (python backend; gmpy2 changes
these by 1.0-2x): ``mpmath.mpf(float)`` 2.4 us, ``libmp.from_float`` 1-2.5 us,
``libmp.mpf_exp`` at 169 bits 5-12 us, ``mpf_mul`` ~1 us, ``mpf_div`` 2.5 us,
``mpf_erfc`` 10-130 us (grows with the argument).
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterable, Iterator, Sequence

import mpmath
import torch
from mpmath import libmp

__all__ = [
    "DEFAULT_DPS",
    "MIN_DPS",
    "get_dps",
    "dps_to_prec",
    "resolve_prec",
    "workdps",
    "to_float64_list",
    "to_raw",
    "to_mpf",
    "from_raw",
    "from_mpf",
    "raw_to_float",
    "mpf_to_float",
    "float_to_raw",
]

DEFAULT_DPS = 50
#: references are documented as evaluated at >= this many digits
MIN_DPS = 40

_state = {"dps": DEFAULT_DPS}

_ldexp = math.ldexp
_normalize1 = libmp.normalize1
_to_float = libmp.to_float
_from_float = libmp.from_float
_fzero = libmp.fzero
_finf = libmp.finf
_fninf = libmp.fninf
_fnan = libmp.fnan
_inf = math.inf


def get_dps() -> int:
    """The current default working precision in decimal digits."""
    return _state["dps"]


def dps_to_prec(dps: int) -> int:
    """Bits of precision for ``dps`` decimal digits (mpmath's own conversion)."""
    return libmp.dps_to_prec(int(dps))


def resolve_prec(dps: int | None) -> int:
    """Working precision in bits for an explicit ``dps`` (None: the current default)."""
    d = get_dps() if dps is None else int(dps)
    if d < 15:
        raise ValueError(f"dps={d}: a reference needs more than double precision")
    return dps_to_prec(d)


@contextlib.contextmanager
def workdps(dps: int = DEFAULT_DPS) -> Iterator[int]:
    """``with workdps(80): ...`` evaluates references (and ``mpmath.mp``) at ``dps`` digits."""
    dps = int(dps)
    if dps < 15:
        raise ValueError("dps must be >= 15")
    old = _state["dps"]
    _state["dps"] = dps
    try:
        with mpmath.workdps(dps):
            yield dps
    finally:
        _state["dps"] = old


# --------------------------------------------------------------------------- tensors


def to_float64_list(t: torch.Tensor | Sequence[float] | float) -> list[float]:
    """Flattened values as Python floats (exact for every real float dtype)."""
    if isinstance(t, torch.Tensor):
        if t.is_complex():
            raise TypeError("complex tensors are not supported")
        return t.detach().to("cpu", torch.float64).reshape(-1).tolist()
    if isinstance(t, (int, float)):
        return [float(t)]
    return [float(v) for v in t]


def float_to_raw(x: float) -> tuple:
    """Exact raw mpf of a Python float (inf and nan included; -0.0 becomes 0)."""
    return _from_float(x)


def to_raw(t: torch.Tensor | Sequence[float]) -> list[tuple]:
    """Flattened tensor -> list of exact raw mpf tuples (-0.0 becomes +0)."""
    ff = _from_float
    return [ff(v) for v in to_float64_list(t)]


def to_mpf(t: torch.Tensor | Sequence[float]) -> list[mpmath.mpf]:
    """Flattened tensor -> list of exact ``mpmath.mpf`` (independent of mp.prec)."""
    make = mpmath.mp.make_mpf
    ff = _from_float
    return [make(ff(v)) for v in to_float64_list(t)]


def raw_to_float(x: tuple) -> float:
    """Correctly rounded (nearest, ties to even) float64 of a raw mpf, subnormals included."""
    sign, man, exp, bc = x
    if not man:
        if x == _fzero:
            return 0.0
        if x == _finf:
            return _inf
        if x == _fninf:
            return -_inf
        return math.nan
    top = exp + bc  # 2**(top-1) <= |x| < 2**top
    if top >= -1021:  # normal range (or overflow): one rounding to 53 bits is correct
        return _to_float(x, False, "n")
    # subnormal range: round once, directly to the grid of 2**-1074
    nbits = top + 1074
    if nbits <= 0:
        # |x| < 2**-1074; it rounds up only if |x| > 2**-1075 (= half the smallest step)
        if nbits == 0 and not (man == 1 and exp == -1075):
            v = 5e-324
        else:
            v = 0.0
        return -v if sign else v
    if bc > nbits:
        sign, man, exp, bc = _normalize1(sign, man, exp, bc, nbits, "n")
    v = _ldexp(int(man), exp)  # exact: on the 2**-1074 grid
    return -v if sign else v


def mpf_to_float(x) -> float:
    """Correctly rounded float64 of an ``mpmath.mpf`` (or raw tuple, or number)."""
    if isinstance(x, tuple):
        return raw_to_float(x)
    if isinstance(x, mpmath.mpf):
        return raw_to_float(x._mpf_)
    return float(x)


def from_raw(values: Iterable[tuple], shape: Sequence[int] | torch.Size | None = None) -> torch.Tensor:
    """List of raw mpf -> float64 tensor (correctly rounded), reshaped to ``shape``."""
    rf = raw_to_float
    out = torch.tensor([rf(v) for v in values], dtype=torch.float64)
    return out.reshape(tuple(shape)) if shape is not None else out


def from_mpf(values: Iterable, shape: Sequence[int] | torch.Size | None = None) -> torch.Tensor:
    """List of ``mpf`` (or raw tuples / numbers) -> float64 tensor, correctly rounded."""
    cf = mpf_to_float
    out = torch.tensor([cf(v) for v in values], dtype=torch.float64)
    return out.reshape(tuple(shape)) if shape is not None else out
