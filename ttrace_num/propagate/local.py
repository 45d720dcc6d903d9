"""Local (own-rounding) bound of one recognised op call, shared by the analytic shadow and
the empirical noise injector: ``tolerance`` of the op (one run vs exact), or the bound on
the difference of two runs' computation models (``difference``; two bounds add when the
models are not known to be bitwise identical)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import ttrace_num as tn
from ..bounds.summation import conversion_exact
from ..formats import get_format, half_ulp
from .calls import OpCall

__all__ = ["LocalBounds", "ModelPolicy"]

#: ``policy(module_path, op) -> (kwargs of run A, kwargs of run B, bitwise_identical)`` or None.
ModelPolicy = Callable[[str, str], "tuple[dict, dict, bool] | None"]

_ZERO = torch.zeros((), dtype=torch.float64)


@dataclass
class LocalBounds:
    mode: str = "deterministic"
    failure_probability: float | None = None
    policy: ModelPolicy | None = None
    against_exact: bool = False

    def _common(self) -> dict:
        if self.mode == "probabilistic" and self.failure_probability:
            return {"mode": self.mode, "failure_probability": self.failure_probability}
        return {"mode": self.mode}

    def of(self, call: OpCall, out: torch.Tensor, module: str) -> torch.Tensor:
        """Elementwise local bound for ``call`` whose result is ``out`` (inside ``module``)."""
        if call.kind == "rounding":
            return _ZERO if call.exact else self.rounding(out, call.inputs)
        return self.op(call.op, call.inputs, call.kwargs, module)

    def op(self, op: str, inputs: tuple, kwargs: dict, module: str) -> torch.Tensor:
        common = self._common()
        if self.against_exact:
            return tn.tolerance(op, *inputs, **common, **kwargs).abs
        models = self.policy(module, op) if self.policy else None
        if models is None:
            return 2.0 * tn.tolerance(op, *inputs, **common, **kwargs).abs
        ka, kb, bitwise = models
        if bitwise and ka == kb:
            return _ZERO
        return tn.difference(op, *inputs, model_a=ka, model_b=kb, **common, **kwargs).abs

    def rounding(self, out: torch.Tensor, inputs: tuple) -> torch.Tensor:
        """One rounding of an elementwise result into ``out``'s format (0 for a widening cast)."""
        fmt = get_format(out.dtype)
        if len(inputs) == 1 and out.dtype != inputs[0].dtype and conversion_exact(get_format(inputs[0].dtype), fmt):
            return _ZERO
        one = half_ulp(out.detach().double().abs() * (1 + 2 * fmt.u), fmt)
        return one if self.against_exact else 2.0 * one
