"""Plumbing shared by the operator modules: precision resolution, the op registry,
float64 helpers. No error model lives here."""
from __future__ import annotations

import contextvars
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..formats import FloatFormat, get_format
from ..rounding import round_to
from .base import DEFAULT_FAILURE_PROBABILITY, Bound, check_mode, lambda_for
from .summation import conversion_exact

__all__ = ["Precision", "resolve_precision", "register", "OPS", "op_names", "lookup", "f64", "ModeSpec", "resolve_mode",
           "InputFormatError", "check_representable", "check_no_nan"]

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


@dataclass
class _OuterCall:
    """State of the registered model call a user made (models call each other: ``linear``
    calls ``matmul``, ``mse_loss`` passes its float64 squared differences to ``mean``):
    whether its inputs were checked against their storage format yet."""

    checked: bool = False


#: the user's call in progress (None outside any registered model)
_CALL: contextvars.ContextVar[_OuterCall | None] = contextvars.ContextVar("ttrace_num_outer_call", default=None)


class InputFormatError(ValueError):
    """A floating input holds values its declared storage format cannot represent."""


def check_representable(inputs: tuple[torch.Tensor, ...], fmt: FloatFormat) -> None:
    """Raise :class:`InputFormatError` if a finite value of a floating input is not a value of
    ``fmt``: every bound takes the stored inputs as exact in the storage format (the model
    starts from them; a value off the grid would carry an unmodelled rounding of up to half an
    ulp of ``fmt``). A round trip, ``x -> fmt -> x`` (torch's cast where ``fmt`` has a dtype,
    else :func:`~ttrace_num.rounding.round_to`), skipped for inputs whose dtype embeds in
    ``fmt`` (bf16 data with ``fmt="fp32"``). Infinities and NaN are left to the op (and to
    :func:`check_no_nan`)."""
    for i, t in enumerate(inputs):
        if not (isinstance(t, torch.Tensor) and t.is_floating_point()) or t.numel() == 0:
            continue
        if conversion_exact(_format_of(t), fmt):
            continue
        x = t.detach()
        back = (x.to(fmt.torch_dtype).to(x.dtype) if fmt.torch_dtype is not None
                else round_to(x, fmt).to(x.dtype))
        off = (back != x) & torch.isfinite(x)
        if bool(off.any()):
            idx = tuple(int(j) for j in torch.nonzero(off)[0])
            raise InputFormatError(
                f"input {i} (shape {tuple(t.shape)}, dtype {t.dtype}) holds {float(x[idx])!r} at index {idx}, which "
                f"is not a {fmt.name} value ({int(off.sum())} such values): the bound assumes the inputs are stored "
                f"in fmt={fmt.name}. Pass the format the data are stored in (fmt=None: their dtype), or round them "
                f"to {fmt.name} first (ttrace_num.round_to(x, {fmt.name!r}), or x.to(dtype) where it has one)")


def resolve_precision(inputs: tuple[torch.Tensor, ...], fmt=None, compute_fmt=None, out_fmt=None) -> Precision:
    """Defaults: storage = the first floating input's dtype; compute = fp32 for formats
    narrower than fp32 (what CPU and GPU kernels do for bf16/fp16/fp8), else the storage
    format; output = storage. The first resolution within a registered op's call (that of
    the user's inputs; not those of intermediates a model passes to another model, nor in
    emulators) requires every floating input to hold values of the storage format
    (:func:`check_representable`; :class:`InputFormatError` otherwise)."""
    if fmt is None:
        floats = [t for t in inputs if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not floats:
            raise ValueError("no floating-point input to infer the format from; pass fmt=")
        fmt = _format_of(floats[0])
    fmt = get_format(fmt)
    call = _CALL.get()
    if call is not None and not call.checked:
        call.checked = True
        check_representable(inputs, fmt)
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


def check_no_nan(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming ``op`` and the argument if a floating tensor argument holds
    NaN: a NaN input makes every result it reaches NaN, for which no error bound exists (one
    policy for every op, applied by :func:`register`). Infinities pass: they are legitimate
    inputs of some ops (a ``-inf`` attention or softmax mask), each op's model handles them."""
    named = [(f"input {i}", t) for i, t in enumerate(args)] + [(f"argument {k!r}", t) for k, t in kwargs.items()]
    for what, t in named:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and bool(torch.isnan(t.detach()).any()):
            idx = tuple(int(j) for j in torch.nonzero(torch.isnan(t.detach()))[0])
            raise ValueError(f"{op}: {what} (shape {tuple(t.shape)}, dtype {t.dtype}) contains NaN (first at index "
                             f"{idx}); a tolerance is defined for NaN-free inputs only: find where the NaN comes from "
                             "(or mask it out) before asking for a bound")


def register(name: str, *aliases: str) -> Callable[[Callable[..., Bound]], Callable[..., Bound]]:
    """Register an error model under ``name`` (and aliases) for :func:`ttrace_num.tolerance`.

    The registered (and returned) function checks its arguments first, the same way for every
    op: NaN inputs are refused (:func:`check_no_nan`), and an input not representable in its
    storage format (:class:`InputFormatError` from :func:`resolve_precision`) is reported as a
    ``ValueError`` that names the op. Only the outermost call checks and names: a model that
    calls another (``linear`` -> ``matmul``) reports under the op the user asked for."""

    def deco(fn: Callable[..., Bound]) -> Callable[..., Bound]:
        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Bound:
            if _CALL.get() is not None:  # a model called by another op's model: the outer call checks and names
                return fn(*args, **kwargs)
            check_no_nan(name, args, kwargs)
            token = _CALL.set(_OuterCall())
            try:
                return fn(*args, **kwargs)
            except InputFormatError as e:
                raise ValueError(f"{name}: {e}") from None
            finally:
                _CALL.reset(token)

        for n in (name, *aliases):
            if n in _CANONICAL and OPS[n] is not checked:
                raise ValueError(f"op name {n!r} registered twice")
            OPS[n] = checked
            _CANONICAL[n] = name
        return checked

    return deco


def op_names() -> list[str]:
    return sorted(set(_CANONICAL.values()))


def lookup(op: str) -> Callable[..., Bound]:
    try:
        return OPS[op]
    except KeyError:
        raise ValueError(f"unknown op {op!r}; known ops: {', '.join(op_names())}") from None
