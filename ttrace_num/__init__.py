"""ttrace-num: derived numerical tolerances for ML operators.

Quick start::

    import torch, ttrace_num as tn
    from ttrace_num.reference.dot import exact_matmul
    from ttrace_num.testing import assert_close
    a, b = torch.randn(64, 512, dtype=torch.bfloat16), torch.randn(512, 32, dtype=torch.bfloat16)
    bound = tn.tolerance("matmul", a, b)             # bf16 storage, fp32 accumulation
    print(bound.max(), bound.explain())
    assert_close(a @ b, exact_matmul(a, b), bound=bound)
"""
from __future__ import annotations

from typing import Any

import torch

from . import bounds  # noqa: F401  (importing it registers every error model)
from .bounds.base import Bound, Explanation
from .bounds.common import lookup, op_names
from .bounds.summation import Summation
from .formats import FORMATS, FloatFormat, custom, get_format
from .rounding import round_to

__version__ = "0.1.0"

__all__ = ["tolerance", "difference", "ops", "Bound", "Explanation", "Summation", "FloatFormat",
           "FORMATS", "custom", "get_format", "round_to", "__version__"]


def tolerance(op: str, *inputs: torch.Tensor, fmt=None, compute_fmt=None,
              mode: str = "deterministic", calibration=None, **op_kwargs: Any) -> Bound:
    """Elementwise bound on ``|computed - exact|`` for ``op`` applied to ``inputs``.

    Args:
        op: operator name (see :func:`ops`): ``"matmul"``, ``"linear"``, ``"sum"``, ``"mean"``,
            ``"softmax"``, ``"log_softmax"``, ``"cross_entropy"``, ``"layer_norm"``,
            ``"rms_norm"``, ``"gelu"``, ``"silu"``, ``"swiglu"``, ``"add"``...
        inputs: the operator's stored inputs (torch tensors; their dtype gives the default
            storage format).
        fmt: storage format of the inputs (name, FloatFormat or torch dtype).
        compute_fmt: format of the accumulations/intermediates (default fp32 for formats
            narrower than fp32, else ``fmt``).
        mode: ``"deterministic"`` (worst case) or ``"probabilistic"`` (per element, with
            probability ``>= 1 - failure_probability``; pass ``failure_probability=``).
        calibration: a :class:`~ttrace_num.calibrate.Calibration` or the path of a file from
            ``ttrace calibrate``: returns ``min(kappa * probabilistic bound, deterministic
            bound)`` (probabilistic mode only; see :mod:`ttrace_num.calibrate`).
        op_kwargs: the operator's own arguments (``dim=``, ``eps=``, ``weight=``,
            ``summation=Summation(...)``, ``out_fmt=``...).

    Returns:
        :class:`Bound`; ``Bound.abs`` broadcasts to the op's output; ``Bound.explain()`` prints
        the formula, its source and the values used.
    """
    if calibration is not None:
        from .calibrate import apply_calibration
        return apply_calibration(op, inputs, calibration, fmt=fmt, compute_fmt=compute_fmt, mode=mode, **op_kwargs)
    return lookup(op)(*inputs, fmt=fmt, compute_fmt=compute_fmt, mode=mode, **op_kwargs)


def difference(op: str, *inputs: torch.Tensor, model_a: dict[str, Any], model_b: dict[str, Any],
               mode: str = "deterministic", **common: Any) -> Bound:
    """Bound on ``|result_a - result_b|`` for two correct computation models of one op.

    ``model_a``/``model_b`` are keyword sets for the op (e.g. ``{"summation": Summation(split=2,
    reduce_fmt="bf16")}``). Ops with a dedicated difference model (matmul/linear) use it and
    cancel shared roundings; for the others the bound is the sum of the two bounds
    (triangle inequality through the exact result).
    """
    if op in ("matmul", "mm", "bmm", "linear") and set(model_a) | set(model_b) <= {"summation", "out_fmt"}:
        from .bounds.matmul import matmul_difference
        a, b = inputs[0], inputs[1]
        if op == "linear":
            b = b.transpose(-1, -2)
        bias = inputs[2] if len(inputs) > 2 else common.pop("bias", None)
        prec_default = Summation(accum=get_format(common.get("compute_fmt") or "fp32"))
        return matmul_difference(a, b, model_a=model_a.get("summation", prec_default),
                                 model_b=model_b.get("summation", prec_default), bias=bias,
                                 fmt=common.get("fmt"), out_fmt_a=model_a.get("out_fmt"),
                                 out_fmt_b=model_b.get("out_fmt"), mode=mode,
                                 failure_probability=common.get("failure_probability"))
    return (tolerance(op, *inputs, mode=mode, **{**common, **model_a})
            + tolerance(op, *inputs, mode=mode, **{**common, **model_b}))


def ops() -> list[str]:
    """Names of every operator with an error model."""
    return op_names()
