r"""Analytic composition of per-op bounds through a module: the *error shadow*.

:class:`ErrorShadow` is a ``TorchFunctionMode``. While a module runs forward under it, every
tensor ``t`` produced by a supported op gets a *shadow* ``v(t)``: an elementwise bound on
the difference between two runs (or between a run and the exact result). For each op::

    v(out) = local(op, inputs) + |J_op| v(inputs)                                   (C)

* ``local``: the op's own rounding: ``ttrace_num.tolerance`` (one run vs exact), or for two
  runs the difference of their computation models (``ttrace_num.difference``, which cancels
  shared roundings; for ops whose two models are not known to be bitwise identical the
  two bounds add: triangle inequality through the exact result);
* ``|J| v``: first-order propagation of the differences the inputs already carry
  (:mod:`.jacobian`; exact for bilinear and linear ops, rigorous for softmax and the
  elementwise activations, first order for the norms).

Structural ops (views, reshapes, transposes, indexing, split/cat, masked_fill...) apply to
the shadow exactly as to the tensor. Casts to a narrower format add the cast's rounding.
An op that touches a shadowed tensor and has no rule raises ``NotImplementedError`` naming
the op and the module it ran in: the result would otherwise be silently wrong.

Deterministic mode composes worst cases coherently: (C) as written. It is a bound for
every admissible rounding, and for that very reason it grows fast with depth: a K-term
dot product of inputs that each may be off by one ulp may be off by K ulps.

Probabilistic mode composes in quadrature. Under the mean-independence model (Higham &
Mary 2019) the output difference is, to first order, ``sum_k J_k e_k`` over the local
errors ``e_k`` of every op (``|e_k| <= b_k``, ``E[e_k | earlier errors] = 0``): a
martingale with increments bounded by ``|J_k| b_k``. Azuma-Hoeffding bounds it by
``lambda sqrt(w)`` with ``w = sum_k (J_k b_k)^2``, which the shadow propagates as squared
scales (``w_out = sum b_local^2 + sum_j J_ij^2 w_j``, :mod:`.jacobian` ``*_sq``). Two runs
of the same op contribute two independent terms ``b^2 + b^2`` (not ``(2b)^2``). Each
element's bound fails with probability ``2 exp(-lambda^2/2) = failure_probability``
(per element, as everywhere in the library; a statement about all ``N`` elements of an
output follows by the union bound with ``failure_probability / N``).
The local bounds ``b_k`` themselves are taken at their probabilistic values (they already
include their own ``lambda``), which makes the composition conservative.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from .calls import classify
from .local import LocalBounds, ModelPolicy
from ..bounds.base import DEFAULT_FAILURE_PROBABILITY, lambda_for

__all__ = ["ErrorShadow", "OpRecord", "ModelPolicy"]


@dataclass
class OpRecord:
    """One op of the traced forward: where it ran and how its bound splits."""

    index: int
    op: str
    module: str
    shape: tuple[int, ...]
    local_max: float
    propagated_max: float

    @property
    def total_max(self) -> float:
        return self.local_max + self.propagated_max


class ErrorShadow(TorchFunctionMode):
    """Carry an elementwise difference bound beside every tensor of a forward pass.

    Args:
        mode: ``"deterministic"`` or ``"probabilistic"`` (per-element local bounds).
        failure_probability: per-element failure probability of each local bound.
        policy: ``policy(module_path, op)`` returns ``(kwargs_a, kwargs_b, bitwise)`` for ops
            whose two runs use different computation models (e.g. a tensor-parallel split:
            ``({}, {"summation": Summation(split=2, reduce_fmt="bf16")}, False)``), or None for
            "same model, not known to be bitwise identical" (the two bounds add).
        against_exact: bound one run against the exact result instead of two runs' difference.
    """

    def __init__(self, mode: str = "deterministic", failure_probability: float | None = None,
                 policy: ModelPolicy | None = None, against_exact: bool = False):
        super().__init__()
        self.local = LocalBounds(mode, failure_probability, policy, against_exact)
        self.quadrature = mode == "probabilistic"
        self.lam = lambda_for(failure_probability or DEFAULT_FAILURE_PROBABILITY) if self.quadrature else 1.0
        self.shadow: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # quadrature mode: the last op's own local bound (sum and sum of squares of its terms),
        # added outside lambda at that tensor (see _final)
        self.own: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.records: list[OpRecord] = []
        self.module_stack: list[str] = [""]

    # ----------------------------------------------------------- public helpers
    def set(self, t: torch.Tensor, v: torch.Tensor | float = 0.0) -> None:
        """Declare that ``t`` carries a difference bounded by ``v`` (default: none)."""
        v = torch.broadcast_to(torch.as_tensor(v, dtype=torch.float64), t.shape).clone()
        self.shadow[t] = v * v if self.quadrature else v

    def get(self, t: Any) -> torch.Tensor | None:
        """The raw shadow: ``v`` (deterministic) or the squared scale ``w`` (probabilistic)."""
        if isinstance(t, torch.Tensor):
            return self.shadow.get(t)
        return None

    def _final(self, raw: torch.Tensor, own: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Deterministic: ``v``. Quadrature: ``b_own + lambda sqrt(w - b_own_sq)``: the last op's
        own error is bounded by its local bound surely, the upstream ones by Azuma."""
        if not self.quadrature:
            return raw
        if own is None:
            return self.lam * raw.sqrt()
        loc, loc_sq = own
        return loc + self.lam * (raw - loc_sq).clamp(min=0).sqrt()

    def bound_of(self, t: torch.Tensor) -> torch.Tensor:
        """Elementwise bound on the difference carried by ``t``."""
        v = self.get(t)
        return torch.zeros(t.shape, dtype=torch.float64) if v is None else self._final(v, self.own.get(t))

    def _record(self, op: str, out: torch.Tensor, terms: list[torch.Tensor], prop) -> torch.Tensor:
        zero = torch.zeros((), dtype=torch.float64)
        prop_t = zero if prop is None else torch.as_tensor(prop, dtype=torch.float64)
        loc = sum(terms, zero)
        if self.quadrature:
            loc_sq = sum((b * b for b in terms), zero)
            self.shadow[out] = torch.broadcast_to(loc_sq + prop_t, out.shape).clone()
            self.own[out] = (torch.broadcast_to(loc, out.shape).clone(), torch.broadcast_to(loc_sq, out.shape).clone())
            inherited = self.lam * prop_t.sqrt()
        else:
            self.shadow[out] = torch.broadcast_to(loc + prop_t, out.shape).clone()
            inherited = prop_t
        self.records.append(OpRecord(len(self.records), op, self.module_stack[-1], tuple(out.shape),
                                     float(loc.max()), float(inherited.max())))
        return out

    # ---------------------------------------------------------------- dispatch
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat_in = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
        flat_in += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
        if not any(self.get(t) is not None for t in flat_in) or not any(
                isinstance(o, torch.Tensor) for o in _as_tuple(out)):
            return out  # nothing shadowed flows in (masks, constants, parameters alone)
        # torch pops this mode while its handler runs, so the rules' own torch calls are plain
        return self._propagate(func, args, kwargs, out)

    def _propagate(self, func, args, kwargs, out):
        call = classify(func, args, kwargs)
        if call is None:
            raise NotImplementedError(
                f"ErrorShadow: no error model for {getattr(func, '__qualname__', func)} in module "
                f"{self.module_stack[-1]!r}; supported: linear, matmul, softmax, layer_norm, rms_norm, gelu, "
                f"silu, add/sub, mul/div by scalar, elementwise mul, casts, and view-like ops")
        if call.kind == "structural":
            sout = func(*[self._sh(a) for a in args], **kwargs)
            for o, s in zip(_as_tuple(out), _as_tuple(sout)):
                if isinstance(o, torch.Tensor):
                    self.shadow[o] = s
            owns = [self.own.get(a) for a in args if isinstance(a, torch.Tensor)]
            if self.quadrature and len(owns) == 1 and owns[0] is not None:  # a view of one tensor
                parts = [func(own_part, *args[1:], **kwargs) for own_part in owns[0]]
                for i, o in enumerate(_as_tuple(out)):
                    if isinstance(o, torch.Tensor):
                        self.own[o] = tuple(_as_tuple(p)[i] for p in parts)
            return out
        if call.kind == "masked_fill":
            self.shadow[out] = self._sh(args[0]).masked_fill(call.kwargs["mask"], 0.0)
            return out
        if call.op == "cast" and out is args[0]:
            return out  # .to() of the same dtype returns the tensor itself
        terms = self.local.terms(call, out, self.module_stack[-1])
        prop = (call.propagate_sq if self.quadrature else call.propagate)(self.get, out)
        return self._record(call.op, out, terms, prop)

    def _sh(self, a):
        """Raw shadows of ``a`` (zeros for unshadowed tensors), for structural ops."""
        if isinstance(a, torch.Tensor):
            v = self.get(a)
            return torch.zeros(a.shape, dtype=torch.float64) if v is None else v
        if isinstance(a, (list, tuple)):
            return type(a)(self._sh(x) for x in a)
        return a


def _as_tuple(x):
    return tuple(x) if isinstance(x, (list, tuple)) else (x,)
