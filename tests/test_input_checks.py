"""One input policy for every registered op (``ttrace_num.bounds.common.register`` and
``resolve_precision``):

* a NaN input raises a ``ValueError`` naming the op and the input (index or keyword);
* a floating input that is not a value of the declared storage format ``fmt`` (fp32 data
  with ``fmt="bf16"``) raises a ``ValueError`` naming the op, the input and the format;
* infinities go through to the op (a ``-inf`` mask is a legitimate input).

Inputs are each op's first case of the bounds benchmark (``bench/cases``; small shapes)."""
from __future__ import annotations

import functools

import pytest
import torch

import ttrace_num as tn
from bench.bounds_table import load_cases
from ttrace_num.bounds.common import _CANONICAL

#: ops whose ``fmt`` is not the storage format of their tensor inputs
FMT_NOT_STORAGE = {
    "all_reduce": "fmt is the format of the reduction: fp32 partials reduced in bf16 are a modelled conversion",
    "all_gather": "fmt is the format of the reduction (collectives: see all_reduce)",
    "reduce_scatter": "fmt is the format of the reduction (collectives: see all_reduce)",
    "quantize": "fmt is the target format of the quantization of (fp32) data",
    "quantized_matmul": "fmt is the target format of the operands' quantization",
    "scaled_matmul": "the operands are fp8 tensors whose dtype is their format; fmt is not taken",
}


@functools.cache
def _cases() -> dict[str, object]:
    out: dict[str, object] = {}
    for c in load_cases(None):
        out.setdefault(_CANONICAL.get(c.op, c.op), c)
    return out


def _call(op: str) -> tuple[str, list, dict]:
    """``(name, inputs, kwargs)`` of a valid fp32 call of ``op``."""
    g = torch.Generator().manual_seed(0)
    if op in ("mse_loss", "mse_loss_backward"):  # no bench case
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
        return op, [x, y] + ([torch.ones(())] if op == "mse_loss_backward" else []), {}
    case = _cases()[op]
    inputs, kw = case.make(g)
    return case.op, list(inputs), {**kw, **case.bound_kwargs}


def test_every_op_has_a_call():
    assert {op for op in tn.ops()} <= set(_cases()) | {"mse_loss", "mse_loss_backward"}


@pytest.mark.parametrize("op", tn.ops())
def test_nan_input_is_refused_naming_op_and_input(op):
    name, inputs, kw = _call(op)
    i = next(j for j, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.is_floating_point())
    inputs[i] = inputs[i].clone()
    inputs[i].view(-1)[inputs[i].numel() // 2] = float("nan")
    with pytest.raises(ValueError, match=rf"^{name}: input {i} \(shape .*\) contains NaN .* NaN-free inputs only"):
        tn.tolerance(name, *inputs, **kw)


def test_nan_in_a_keyword_tensor_is_named():
    x = torch.randn(4, 64)
    w = torch.ones(64)
    w[3] = float("nan")
    with pytest.raises(ValueError, match=r"^layer_norm: argument 'weight' .* contains NaN"):
        tn.tolerance("layer_norm", x, weight=w)


@pytest.mark.parametrize("op", [o for o in tn.ops() if o not in FMT_NOT_STORAGE])
def test_input_off_the_declared_format_is_refused(op):
    name, inputs, kw = _call(op)
    kw = {k: v for k, v in kw.items() if k != "fmt"}
    # fp32 values that are not bf16 values (odd fp32 mantissas)
    off = [t.float() * (1 + 2.0 ** -20) + 2.0 ** -30 if isinstance(t, torch.Tensor) and t.is_floating_point() else t
           for t in inputs]
    with pytest.raises(ValueError, match=rf"^{name}: input \d+ \(shape .*\) holds .* not a bf16 value.*fmt=bf16"):
        tn.tolerance(name, *off, fmt="bf16", **kw)
    on = [tn.round_to(t, "bf16").float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in off]
    tn.tolerance(name, *on, fmt="bf16", **kw)  # the same data on the bf16 grid are accepted


def test_mixed_storage_is_checked_against_the_first_inputs_format():
    a = torch.randn(8, 32).bfloat16()
    b = torch.randn(32, 4)  # fp32 values, not bf16
    with pytest.raises(ValueError, match=r"^matmul: input 1 .* not a bf16 value"):
        tn.tolerance("matmul", a, b)
    tn.tolerance("matmul", a, b.bfloat16().float())  # on the grid: fine


def test_wider_formats_and_custom_formats():
    x = torch.randn(4, 32).bfloat16()
    tn.tolerance("softmax", x, fmt="fp32")  # bf16 values are fp32 values: no check needed
    e = tn.round_to(torch.randn(4, 32, dtype=torch.float64), "custom(e=4, m=3)")
    tn.tolerance("sum", e, fmt="custom(e=4, m=3)", compute_fmt="fp32")
    with pytest.raises(ValueError, match="not a custom"):
        tn.tolerance("sum", e + 2.0 ** -20, fmt="custom(e=4, m=3)", compute_fmt="fp32")


def test_infinities_go_through_to_the_op():
    x = torch.randn(4, 16).bfloat16()
    x[:, 8:] = float("-inf")  # a -inf mask
    b = tn.tolerance("softmax", x, dim=-1)
    assert torch.isfinite(b.abs).all()
