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

    def terms(self, call: OpCall, out: torch.Tensor, module: str) -> list[torch.Tensor]:
        """Independent local error bounds of ``call`` (result ``out``, inside ``module``): one
        per run whose rounding is not shared (two for two runs of the same model, one against
        exact or for a difference model, none for bitwise-identical runs)."""
        if call.kind == "rounding":
            if call.exact or (call.op == "cast" and out.dtype == call.inputs[0].dtype):
                return []  # exact scaling, or a cast to the same format (no rounding)
            one = self.rounding(out, call.inputs)
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

    def of(self, call: OpCall, out: torch.Tensor, module: str) -> torch.Tensor:
        """Elementwise local bound of ``call``: the sum of its independent terms (the two runs'
        equal bounds doubled in one pass, exactly)."""
        terms = self.terms(call, out, module)
        if len(terms) == 2 and terms[0] is terms[1]:
            return terms[0] * 2
        return sum(terms, _ZERO)

    def rounding(self, out: torch.Tensor, inputs: tuple) -> torch.Tensor:
        """One rounding of an elementwise result into ``out``'s format (0 for a widening cast)."""
        fmt = get_format(out.dtype)
        if len(inputs) == 1 and out.dtype != inputs[0].dtype and conversion_exact(get_format(inputs[0].dtype), fmt):
            return _ZERO
        if out.dtype in NARROW_DTYPES:
            return torch.index_select(_rounding_table(out.dtype), 0,
                                      out.detach().view(torch.int16).reshape(-1).to(torch.int32).bitwise_and_(0xFFFF)
                                      ).view(out.shape)
        return half_ulp(out.detach().double().abs() * (1 + 2 * fmt.u), fmt)


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
