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
from .bounds.base import MODES, Bound, Explanation, check_mode
from .bounds.common import lookup, op_names, resolve_precision
from .bounds.statistical import DEFAULT_FALSE_ALARM, kernel_model, statistical_tolerance
from .bounds.validity import VALIDITY_OPS
from .bounds.validity import check as check_validity
from .bounds.summation import Summation
from .formats import FORMATS, FloatFormat, custom, get_format
from .rounding import round_to

__version__ = "0.1.0"

__all__ = ["tolerance", "difference", "ops", "Bound", "Explanation", "Summation", "FloatFormat",
           "FORMATS", "custom", "get_format", "round_to", "__version__"]


def tolerance(op: str, *inputs: torch.Tensor, fmt=None, compute_fmt=None,
              mode: str = "deterministic", calibration=None, false_alarm: float | None = None,
              **op_kwargs: Any) -> Bound:
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
        mode: ``"deterministic"`` (worst case), ``"probabilistic"`` (per element, with
            probability ``>= 1 - failure_probability``; pass ``failure_probability=``) or
            ``"statistical"`` (``z(false_alarm)`` standard deviations of the error expected
            under an unknown summation order and random rounding: "is this difference
            expected?", tight enough for fp32 kernels; ops in
            :data:`~ttrace_num.bounds.statistical.STATISTICAL_OPS`, see
            :mod:`ttrace_num.bounds.statistical`). In the probabilistic and statistical modes,
            elements whose addends repeat (constant operands, equal logits) are charged for
            those roundings deterministically or take the deterministic bound
            (:mod:`ttrace_num.bounds.validity`; ``Bound.explain()`` says how many).
        false_alarm: per-element false-alarm rate of ``mode="statistical"`` (default 1e-6).
        calibration: a :class:`~ttrace_num.calibrate.Calibration` or the path of a file from
            ``ttrace calibrate``: returns ``min(kappa * probabilistic bound, deterministic
            bound)`` (probabilistic mode only; see :mod:`ttrace_num.calibrate`).
        op_kwargs: the operator's own arguments (``dim=``, ``eps=``, ``weight=``,
            ``summation=Summation(...)``, ``out_fmt=``...).

    Returns:
        :class:`Bound`; ``Bound.abs`` broadcasts to the op's output; ``Bound.explain()`` prints
        the formula, its source and the values used.
    """
    check_mode(mode, MODES)
    if false_alarm is not None and mode != "statistical":
        raise ValueError(f"false_alarm is the rate of mode='statistical' (got mode={mode!r}); "
                         "use failure_probability= with mode='probabilistic'")
    if calibration is not None:
        if mode == "statistical":
            raise ValueError("calibration applies to mode='probabilistic'; mode='statistical' takes no calibration")
        from .calibrate import apply_calibration
        return apply_calibration(op, inputs, calibration, fmt=fmt, compute_fmt=compute_fmt, mode=mode, **op_kwargs)
    if mode == "statistical":
        bound = statistical_tolerance(op, *inputs, fmt=fmt, compute_fmt=compute_fmt,
                                      false_alarm=DEFAULT_FALSE_ALARM if false_alarm is None else false_alarm,
                                      **op_kwargs)
        det_kwargs = {**kernel_model(op, inputs), **op_kwargs}
    else:
        bound = lookup(op)(*inputs, fmt=fmt, compute_fmt=compute_fmt, mode=mode, **op_kwargs)
        det_kwargs = op_kwargs
    if mode == "deterministic" or op not in VALIDITY_OPS:
        return bound
    return _apply_validity(op, inputs, bound, fmt, compute_fmt, det_kwargs)


def _apply_validity(op: str, inputs: tuple, bound: Bound, fmt, compute_fmt, op_kwargs: dict[str, Any]) -> Bound:
    """Elements whose addends repeat take ``min(bound + charge, deterministic bound)``
    (:mod:`ttrace_num.bounds.validity`); the explanation says how many and why."""
    prec = resolve_precision(tuple(t for t in inputs if isinstance(t, torch.Tensor)), fmt, compute_fmt,
                             op_kwargs.get("out_fmt"))
    kw = {k: v for k, v in op_kwargs.items() if k not in ("out_fmt", "failure_probability")}
    v = check_validity(op, inputs, prec, kw, exp_ulps=float(op_kwargs.get("exp_ulps", 1.0)))
    if v is None or not bool(v.marked.any()):
        return bound
    base = torch.broadcast_to(bound.abs, torch.broadcast_shapes(bound.abs.shape, v.marked.shape))
    det_kw = {k: x for k, x in op_kwargs.items() if k != "failure_probability"}
    det = lookup(op)(*inputs, fmt=fmt, compute_fmt=compute_fmt, mode="deterministic", **det_kw).abs
    det = torch.broadcast_to(det, base.shape)
    marked = torch.broadcast_to(v.marked, base.shape)
    charged = base + torch.broadcast_to(v.charge, base.shape)
    fell_back = marked & (det <= charged)
    new = torch.where(marked, torch.minimum(charged, det), base)
    n_marked, n_back = int(marked.sum()), int(fell_back.sum())
    note = Explanation(
        op="validity (repeated addends)",
        formula="r >= max(2, sqrt(n)) (most frequent nonzero addend repeated r times): "
                "min(bound + r c u (1+theta) S, deterministic)",
        source="ttrace_num.bounds.validity: repeated addends' roundings share a sign, so they are charged "
               "deterministically; the other roundings keep the random model",
        assumptions=(f"{n_marked} of {base.numel()} elements have repeated addends (largest multiplicity "
                     f"{int(v.multiplicity.max())}) or a stagnating chain ({v.stagnating}): their roundings are not "
                     f"mean-independent; {n_back} of them fell back to the deterministic bound",),
        values={"charged": n_marked, "fell_back": n_back})
    expl = Explanation(op=bound.explanation.op, formula=bound.explanation.formula, source=bound.explanation.source,
                       assumptions=bound.explanation.assumptions, values=bound.explanation.values,
                       terms=bound.explanation.terms + (note,))
    return Bound(abs=new, mode=bound.mode, failure_probability=bound.failure_probability, explanation=expl,
                 magnitude=bound.magnitude)


def difference(op: str, *inputs: torch.Tensor, model_a: dict[str, Any], model_b: dict[str, Any],
               mode: str = "deterministic", **common: Any) -> Bound:
    """Bound on ``|result_a - result_b|`` for two correct computation models of one op.

    ``model_a``/``model_b`` are keyword sets for the op (e.g. ``{"summation": Summation(split=2,
    reduce_fmt="bf16")}``). Ops with a dedicated difference model (matmul/linear) use it and
    cancel shared roundings; for the others the bound is the sum of the two bounds
    (triangle inequality through the exact result).
    """
    if op in ("matmul", "mm", "bmm", "linear") and set(model_a) | set(model_b) <= {"summation", "out_fmt"} \
            and mode != "statistical":  # statistical: the two tolerances added (rates add)
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
