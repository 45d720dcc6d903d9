"""Local (own-rounding) bound of one recognised op call, shared by the analytic shadow and
the empirical noise injector: ``tolerance`` of the op (one run vs exact), or the bound on
the difference of two runs' computation models (``difference``; two bounds add when the
models are not known to be bitwise identical)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

import ttrace_num as tn
from ..bounds.summation import conversion_exact
from ..formats import NARROW_DTYPES, get_format, half_ulp
from .calls import OpCall

if TYPE_CHECKING:
    from ..calibrate import Calibration

__all__ = ["LocalBounds", "ModelPolicy"]

#: ``policy(module_path, op) -> (kwargs of run A, kwargs of run B, bitwise_identical)`` or None.
ModelPolicy = Callable[[str, str], "tuple[dict, dict, bool] | None"]

_ZERO = torch.zeros((), dtype=torch.float64)


@dataclass
class LocalBounds:
    """``calibration``: a :class:`~ttrace_num.calibrate.Calibration` or the path of its file
    (probabilistic mode only): the ops it calibrates get ``tolerance(..., calibration=...)``
    (``min(kappa * B, deterministic bound)``), the others the analytic bound."""

    mode: str = "deterministic"
    failure_probability: float | None = None
    policy: ModelPolicy | None = None
    against_exact: bool = False
    calibration: "Calibration | str | Path | None" = None

    def __post_init__(self) -> None:
        if self.calibration is not None:
            from ..calibrate import load
            if self.mode != "probabilistic":
                raise ValueError("a calibration rescales the probabilistic bounds; use mode='probabilistic'")
            if isinstance(self.calibration, (str, Path)):
                self.calibration = load(self.calibration)

    def tolerance_kwargs(self, op: str) -> dict:
        """:meth:`common_kwargs`, or for an op the calibration covers ``mode`` and ``calibration``."""
        if self.calibration is not None and self.calibration.covers(op):
            return {"mode": self.mode, "calibration": self.calibration}
        return self.common_kwargs()

    def common_kwargs(self) -> dict:
        """The ``mode``/``failure_probability`` keywords every local bound is computed with."""
        if self.mode == "probabilistic" and self.failure_probability:
            return {"mode": self.mode, "failure_probability": self.failure_probability}
        return {"mode": self.mode}

    def terms(self, call: OpCall, out: torch.Tensor, module: str, *, fp32: bool = False) -> list[torch.Tensor]:
        """Independent local error bounds of ``call`` (result ``out``, inside ``module``): one
        per run whose rounding is not shared (two for two runs of the same model, one against
        exact or for a difference model, none for bitwise-identical runs). ``fp32``: see
        :meth:`rounding`."""
        if call.kind == "index":
            return []  # a gather of stored rows (F.embedding): no rounding
        if call.kind == "rounding":
            if call.exact or (call.op == "cast" and out.dtype == call.inputs[0].dtype):
                return []  # exact scaling, or a cast to the same format (no rounding)
            one = self.rounding(out, call.inputs, fp32=fp32)
            return [one] if self.against_exact else [one, one]
        common = self.common_kwargs()
        if self.against_exact:
            return [tn.tolerance(call.op, *call.inputs, **self.tolerance_kwargs(call.op), **call.kwargs).abs]
        models = self.policy(module, call.op) if self.policy else None
        if models is None:
            b = tn.tolerance(call.op, *call.inputs, **self.tolerance_kwargs(call.op), **call.kwargs).abs
            return [b, b]
        ka, kb, bitwise = models
        if bitwise and ka == kb:
            return []
        return [tn.difference(call.op, *call.inputs, model_a=ka, model_b=kb, **common, **call.kwargs).abs]

    def of(self, call: OpCall, out: torch.Tensor, module: str, *, fp32: bool = False) -> torch.Tensor:
        """Elementwise local bound of ``call``: the sum of its independent terms (the two runs'
        equal bounds doubled in one pass, exactly). ``fp32``: see :meth:`rounding`."""
        terms = self.terms(call, out, module, fp32=fp32)
        if len(terms) == 2 and terms[0] is terms[1]:
            return terms[0] * 2
        return sum(terms, _ZERO)

    def rounding(self, out: torch.Tensor, inputs: tuple, *, fp32: bool = False) -> torch.Tensor:
        """One rounding of an elementwise result into ``out``'s format (0 for a widening cast).

        ``fp32=True``: for a float32 ``out``, the same values in float32 where they are normal
        float32 numbers (:func:`_fp32_rounding`; float64 otherwise), so that the noise injector
        can draw and add the noise in float32, exactly (``NoiseInjector._noise``). Off by
        default: squares of these amplitudes (the shadow's quadrature mode) need float64."""
        fmt = get_format(out.dtype)
        if len(inputs) == 1 and out.dtype != inputs[0].dtype and conversion_exact(get_format(inputs[0].dtype), fmt):
            return _ZERO
        if fp32 and out.dtype == torch.float32:
            amplitude = _fp32_rounding(out)
            if amplitude is not None:
                return amplitude
        if out.dtype in NARROW_DTYPES:
            return torch.index_select(_rounding_table(out.dtype), 0,
                                      out.detach().view(torch.int16).reshape(-1).to(torch.int32).bitwise_and_(0xFFFF)
                                      ).view(out.shape)
        return half_ulp(out.detach().double().abs() * (1 + 2 * fmt.u), fmt)


#: bit patterns of 2^-102 and of the largest float32 ``v`` with ``v (1 + 2u)`` not over the format's
#: maximum: a nonzero float32 result outside them keeps the float64 arithmetic in :func:`_fp32_rounding`
_FP32_EXACT_MIN_BITS = (127 - 102) << 23
_FP32_EXACT_MAX_BITS = 0x7F7FFFFD
_FP32_INF_BITS = 0x7F800000


def _fp32_rounding(out: torch.Tensor) -> torch.Tensor | None:
    """``half_ulp(|v| (1 + 2u))`` for the fp32 format of each value ``v`` of a float32 ``out``,
    in float32, from its bits: the values of :meth:`LocalBounds.rounding`'s float64 arithmetic
    (``tests/test_local_rounding.py``), in a few passes over float32 and int32 instead of ~10
    over float64.

    For a normal ``v`` in ``[2^e, 2^(e+1))`` the result is ``u 2^E``, ``2^E`` the binade of
    ``|v| (1 + 2u)``: ``E = e + 1`` exactly when ``v``'s mantissa bits are all ones (``|v| (1 +
    2^-23) >= 2^(e+1)`` iff ``m >= 2^24 - 1`` for ``|v| = m 2^(e-23)``), i.e. when adding 1 to
    ``|v|``'s bit pattern carries into the exponent field. So ``2^E`` is the exponent field of
    ``bits(|v|) + 1``; for inf and NaN that field is infinity, which the final ``minimum`` with
    ``|v|`` keeps for inf and turns into NaN for NaN; the minimum also gives 0 at 0 and leaves
    every other value (``u 2^E <= |v|``). ``None`` (the caller keeps float64) when a nonzero
    ``|v|`` is below 2^-102, subnormals included (its half-ulp is no normal float32 number, so
    ``U b`` would not be exact in float32), or is one of the two largest finite values (``|v| (1
    + 2u)`` exceeds the maximum there: the float64 arithmetic gives infinity)."""
    bits = out.detach().view(torch.int32) & 0x7FFFFFFF
    if bool((((bits > 0) & (bits < _FP32_EXACT_MIN_BITS))
             | ((bits > _FP32_EXACT_MAX_BITS) & (bits < _FP32_INF_BITS))).any()):
        return None
    amplitude = ((bits + 1) & _FP32_INF_BITS).view(torch.float32).mul_(get_format(torch.float32).u)
    return torch.minimum(amplitude, bits.view(torch.float32), out=amplitude)


@functools.cache
def _rounding_table(dtype: torch.dtype) -> torch.Tensor:
    """``half_ulp(|v| (1 + 2u))`` (float32; ``|v| (1 + 2u)`` and its half-ulp are exact there)
    for each of the 65536 values ``v`` of a 16-bit ``dtype``, indexed by ``v``'s bits: the
    rounding amplitude of a bf16/fp16 result is one gather from this table, the same values
    as the arithmetic (``tests/test_local_rounding.py`` checks every bit pattern), at a third of
    its passes over the result. Built once per dtype."""
    fmt = get_format(dtype)
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)  # bits i at index i
    return half_ulp(every.float().abs_().mul_(1 + 2 * fmt.u), fmt, torch.float32)
