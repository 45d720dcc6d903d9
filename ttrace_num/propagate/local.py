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
            if call.exact:
                return []
            one = self.rounding(out, call.inputs)
            return [one] if self.against_exact else [one, one]
        common = self.common_kwargs()
        if self.against_exact:
            return [tn.tolerance(call.op, *call.inputs, **common, **call.kwargs).abs]
        models = self.policy(module, call.op) if self.policy else None
        if models is None:
            b = tn.tolerance(call.op, *call.inputs, **common, **call.kwargs).abs
            return [b, b]
        ka, kb, bitwise = models
        if bitwise and ka == kb:
            return []
        return [tn.difference(call.op, *call.inputs, model_a=ka, model_b=kb, **common, **call.kwargs).abs]

    def of(self, call: OpCall, out: torch.Tensor, module: str) -> torch.Tensor:
        """Elementwise local bound of ``call``: the sum of its independent terms."""
        return sum(self.terms(call, out, module), _ZERO)

    def rounding(self, out: torch.Tensor, inputs: tuple) -> torch.Tensor:
        """One rounding of an elementwise result into ``out``'s format (0 for a widening cast)."""
        fmt = get_format(out.dtype)
        if len(inputs) == 1 and out.dtype != inputs[0].dtype and conversion_exact(get_format(inputs[0].dtype), fmt):
            return _ZERO
        return half_ulp(out.detach().double().abs() * (1 + 2 * fmt.u), fmt)
