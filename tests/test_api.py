"""The public API: tolerance()/difference() dispatch, Bound views, assert_close messages."""
import math

import pytest
import torch

import ttrace_num as tn
from ttrace_num.bounds.base import lambda_for
from ttrace_num.testing import BoundViolation, assert_close


def _ab(dtype=torch.bfloat16, m=16, k=256, n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(dtype), torch.randn(k, n, generator=g).to(dtype)


def test_unknown_op_lists_known_ops():
    with pytest.raises(ValueError, match="known ops: .*matmul"):
        tn.tolerance("matmull", torch.ones(2, 2), torch.ones(2, 2))


def test_unknown_mode_is_rejected():
    a, b = _ab()
    with pytest.raises(ValueError, match="mode must be one of"):
        tn.tolerance("matmul", a, b, mode="optimistic")


def test_lambda_matches_azuma_tail():
    for p in (1e-2, 1e-6, 1e-12):
        lam = lambda_for(p)
        assert math.isclose(2 * math.exp(-lam**2 / 2), p, rel_tol=1e-12)


def test_probabilistic_bound_is_smaller_and_never_larger_than_deterministic():
    a, b = _ab(torch.float32, k=2048)
    det = tn.tolerance("matmul", a, b)
    prob = tn.tolerance("matmul", a, b, mode="probabilistic")
    assert (prob.abs <= det.abs).all()
    assert prob.max() < det.max()
    assert prob.failure_probability == 1e-6 and det.failure_probability == 0.0


def test_explain_names_formula_source_and_values():
    a, b = _ab()
    text = tn.tolerance("matmul", a, b, mode="probabilistic").explain()
    for needle in ("probabilistic", "Higham", "lambda=", "bf16", "|A||B|"):
        assert needle in text


def test_atol_rtol_cover_the_elementwise_bound():
    a, b = _ab()
    bound = tn.tolerance("matmul", a, b)
    atol, rtol = bound.atol_rtol()
    mag = bound.magnitude
    assert (bound.abs <= atol + rtol * mag + 1e-300).all()


def test_norm_bound_dominates_the_error_norm():
    a, b = _ab(k=1024)
    bound = tn.tolerance("matmul", a, b)
    err = ((a @ b).double() - a.double() @ b.double()).abs()
    assert torch.linalg.vector_norm(err) <= bound.norm(2)
    assert err.max() <= bound.norm(math.inf)


def test_sum_of_bounds_adds_failure_probabilities():
    a, b = _ab()
    p = tn.tolerance("matmul", a, b, mode="probabilistic", failure_probability=1e-3)
    s = p + p
    assert s.failure_probability == pytest.approx(2e-3)
    assert torch.equal(s.abs, 2 * p.abs)


def test_assert_close_passes_correct_and_reports_wrong_results():
    a, b = _ab(k=512)
    expected = a.double() @ b.double()
    bound = tn.tolerance("matmul", a, b)
    assert_close(a @ b, expected, bound=bound)
    wrong = (a @ b).double()
    wrong[3, 5] += 50 * float(bound.abs[3, 5])
    wrong[7, 1] += 2 * float(bound.abs[7, 1])
    with pytest.raises(BoundViolation) as info:
        assert_close(wrong, expected, bound=bound, msg="my kernel")
    msg = str(info.value)
    assert msg.startswith("my kernel: 2 of 128 elements")
    # the worst element is listed first, with its index, values and how far over it is
    first = msg.splitlines()[1]
    assert "index (3, 5)" in first and "x the bound" in first
    assert "(7, 1)" in msg.splitlines()[2]
    assert info.value.mask.sum() == 2


def test_assert_close_nan_handling():
    e = torch.tensor([1.0, float("nan")])
    assert_close(torch.tensor([1.0, float("nan")]), e, bound=0.0)
    with pytest.raises(BoundViolation, match="1 of 2"):
        assert_close(torch.tensor([1.0, 2.0]), e, bound=0.0)
    with pytest.raises(BoundViolation):
        assert_close(torch.tensor([1.0, float("nan")]), e, bound=0.0, equal_nan=False)


def test_difference_of_identical_models_is_zero_and_split_is_tighter_than_sum():
    a, b = _ab(torch.float32, k=1024)
    known = tn.Summation(known_order=True)  # the same known tree twice: bitwise equal results
    same = tn.difference("matmul", a, b, model_a={"summation": known}, model_b={"summation": known})
    assert same.max() == 0.0
    # the same model with an unknown kernel order shares nothing (kernels change order with shape)
    unknown = tn.difference("matmul", a, b, model_a={"summation": tn.Summation()}, model_b={"summation": tn.Summation()})
    assert unknown.max() > 0.0
    # known trees: the split chain shares its first part with the unsplit chain (deterministic gain);
    # unknown orders: the unshared roundings add in quadrature (probabilistic gain)
    for mode, whole, split in [("deterministic", known, tn.Summation(split=2, known_order=True)),
                               ("probabilistic", tn.Summation(), tn.Summation(split=2))]:
        d = tn.difference("matmul", a, b, model_a={"summation": whole}, model_b={"summation": split}, mode=mode)
        s = tn.tolerance("matmul", a, b, summation=whole, mode=mode) + tn.tolerance("matmul", a, b, summation=split, mode=mode)
        assert (d.abs <= s.abs).all() and d.max() < 0.9 * s.max(), mode


def test_custom_format_flows_through_tolerance():
    a, b = _ab(torch.float32)
    e3m2 = tn.get_format("custom(e=3, m=2)")
    a8 = tn.round_to(a / 8, e3m2).float()  # values on the e3m2 grid
    b8 = tn.round_to(b / 8, e3m2).float()
    bound = tn.tolerance("matmul", a8, b8, fmt=e3m2, compute_fmt="fp32", out_fmt="fp32")
    assert "products_exact=True" in bound.explain()  # 2*3 bits <= 24
