"""Plumbing shared by the operator modules: precision resolution, the op registry,
float64 helpers. No error model lives here."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..formats import FloatFormat, get_format
from .base import DEFAULT_FAILURE_PROBABILITY, Bound, check_mode, lambda_for

__all__ = ["Precision", "resolve_precision", "register", "OPS", "op_names", "lookup", "f64", "ModeSpec", "resolve_mode"]

FP32 = get_format("fp32")
FP64 = get_format("fp64")


@dataclass(frozen=True)
class Precision:
    """Formats of one operator's computation: ``storage`` of the inputs, ``compute`` (the
    format intermediate results and accumulations are rounded to) and ``out`` (the format
    the result is stored in)."""

    storage: FloatFormat
    compute: FloatFormat
    out: FloatFormat

    def describe(self) -> str:
        return f"inputs {self.storage}, compute {self.compute}, output {self.out}"


def _format_of(t: torch.Tensor) -> FloatFormat:
    try:
        return get_format(t.dtype)
    except ValueError:
        raise ValueError(f"input of dtype {t.dtype} has no known float format; pass fmt= explicitly") from None


def resolve_precision(inputs: tuple[torch.Tensor, ...], fmt=None, compute_fmt=None, out_fmt=None) -> Precision:
    """Defaults: storage = the first floating input's dtype; compute = fp32 for formats
    narrower than fp32 (what CPU and GPU kernels do for bf16/fp16/fp8), else the storage
    format; output = storage."""
    if fmt is None:
        floats = [t for t in inputs if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not floats:
            raise ValueError("no floating-point input to infer the format from; pass fmt=")
        fmt = _format_of(floats[0])
    fmt = get_format(fmt)
    if compute_fmt is None:
        compute_fmt = FP32 if fmt.precision < FP32.precision else fmt
    compute_fmt = get_format(compute_fmt)
    out_fmt = get_format(out_fmt) if out_fmt is not None else fmt
    return Precision(fmt, compute_fmt, out_fmt)


@dataclass(frozen=True)
class ModeSpec:
    mode: str
    failure_probability: float
    lam: float


def resolve_mode(mode: str, failure_probability: float | None) -> ModeSpec:
    mode = check_mode(mode)
    if mode == "deterministic":
        return ModeSpec(mode, 0.0, math.inf)
    p = DEFAULT_FAILURE_PROBABILITY if failure_probability is None else failure_probability
    return ModeSpec(mode, p, lambda_for(p))


def f64(t: torch.Tensor) -> torch.Tensor:
    """Exact float64 copy (every format up to fp64 embeds exactly)."""
    return t.detach().to(torch.float64)


# ------------------------------------------------------------------ registry
OPS: dict[str, Callable[..., Bound]] = {}
_CANONICAL: dict[str, str] = {}


def register(name: str, *aliases: str) -> Callable[[Callable[..., Bound]], Callable[..., Bound]]:
    """Register an error model under ``name`` (and aliases) for :func:`ttrace_num.tolerance`."""

    def deco(fn: Callable[..., Bound]) -> Callable[..., Bound]:
        for n in (name, *aliases):
            if n in _CANONICAL and OPS[n] is not fn:
                raise ValueError(f"op name {n!r} registered twice")
            OPS[n] = fn
            _CANONICAL[n] = name
        return fn

    return deco


def op_names() -> list[str]:
    return sorted(set(_CANONICAL.values()))


def lookup(op: str) -> Callable[..., Bound]:
    try:
        return OPS[op]
    except KeyError:
        raise ValueError(f"unknown op {op!r}; known ops: {', '.join(op_names())}") from None
