"""Repeated addends break the random-rounding model (ttrace_num/bounds/validity.py): constant
operands, constant rows and a row of equal logits violate the probabilistic (and statistical)
bound *as the op models compute it* (the models alone, without the validity charge: the code
before bounds/validity.py) on every element, and hold through :func:`ttrace_num.tolerance`;
random data keeps its bound."""
from __future__ import annotations

import pytest
import torch

import ttrace_num as tn
from ttrace_num.bounds.common import lookup
from ttrace_num.bounds.statistical import statistical_tolerance
from ttrace_num.bounds.summation import Summation
from ttrace_num.bounds.validity import modal_multiplicity
from ttrace_num.emulate.softmax import emulate_softmax
from ttrace_num.emulate.summation import emulate_matmul, emulate_sum
from ttrace_num.reference import ops as ref
from ttrace_num.reference.dot import exact_matmul, exact_sum


def _unchecked(op, mode, *ins, **kw):
    """The mode's bound without the validity charge (the code before it)."""
    if mode == "statistical":
        return statistical_tolerance(op, *ins, **kw).abs
    return lookup(op)(*ins, mode=mode, **kw).abs


def _violations(op, mode, ins, computed, exact, **kw):
    err = (computed.double() - exact.double()).abs()
    return int((err > _unchecked(op, mode, *ins, **kw)).sum()), int((err > tn.tolerance(op, *ins, mode=mode, **kw).abs).sum())


def test_constant_operands_matmul():
    # torch's own fp32 GEMM at these shapes sums each output in one chain
    a, b = torch.full((8, 1024), 0.7), torch.full((1024, 8), 0.3)
    for mode in ("probabilistic", "statistical"):
        old, new = _violations("matmul", mode, (a, b), a @ b, exact_matmul(a, b))
        assert old == 64 and new == 0, (mode, old, new)
    a = torch.full((4, 1024), 0.1)
    y = emulate_matmul(a, a.T.contiguous() * 3, Summation(), "fp32")
    old, new = _violations("matmul", "statistical", (a, a.T * 3), y, exact_matmul(a, a.T * 3))
    assert old == 16 and new == 0


def test_constant_rows_sum():
    x = torch.full((4, 4096), 0.1)
    y = emulate_sum(x, -1, Summation(), "fp32")  # a recursive fp32 chain
    for mode in ("probabilistic", "statistical"):
        old, new = _violations("sum", mode, (x,), y, exact_sum(x, -1), dim=-1)
        assert old == 4 and new == 0, (mode, old, new)


def test_equal_logits_softmax():
    x = torch.zeros(4, 2048)
    x[:, 0] = 2.5  # the 2047 others are equal: exp(-2.5) added 2047 times
    y = emulate_softmax(x, -1)
    for mode in ("probabilistic", "statistical"):
        old, new = _violations("softmax", mode, (x,), y, ref.softmax(x))
        assert old == x.numel() and new == 0, (mode, old, new)
    text = tn.tolerance("softmax", x, mode="statistical").explain()
    assert "8192 of 8192 elements have repeated addends" in text and "fell back to the deterministic bound" in text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_data_keeps_its_bound(dtype):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 512, generator=g).to(dtype), torch.randn(512, 16, generator=g).to(dtype)
    x = (torch.randn(8, 1024, generator=g)).to(dtype)
    for mode in ("probabilistic", "statistical"):
        assert torch.equal(tn.tolerance("matmul", a, b, mode=mode).abs, _unchecked("matmul", mode, a, b))
        new, old = tn.tolerance("sum", x, dim=-1, mode=mode).abs, _unchecked("sum", mode, x, dim=-1)
        assert torch.equal(new, old)  # bf16 values repeat 5-10 times by chance: below sqrt(n), not charged


def test_modal_multiplicity():
    x = torch.tensor([[1.0, 2.0, 2.0, 0.0, 0.0, 0.0], [3.0, -1.0, 3.0, 3.0, float("-inf"), 5.0]])
    ind, r = modal_multiplicity(x, -1)
    assert r.flatten().tolist() == [2.0, 3.0]  # zeros and -inf do not count
    assert ind.tolist() == [[False, True, True, False, False, False], [True, False, True, True, False, False]]
