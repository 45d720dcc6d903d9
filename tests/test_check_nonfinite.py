"""tracer.check's per-tensor verdict on NaN/Inf (the all-finite fast path must not hide them)."""
import math

import pytest
import torch

from tracer.check import _check_one

ENTRY = {"index": 0, "meta": {"module": "m"}, "dtype": "float32"}
KEY = ("fwd", "m.output", 0, 0)


def _verdict(ref: torch.Tensor, cand: torch.Tensor):
    noisy = [ref + 1e-3 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    return _check_one(0, KEY, ENTRY, ref, cand, [], noisy, 1e-2, {})


def test_finite_tensors_get_a_threshold():
    ref = torch.randn(64, generator=torch.Generator().manual_seed(0))
    row = _verdict(ref, ref.clone())
    assert row.status == "ok" and row.error == 0.0 and row.threshold > 0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_nonfinite_candidate_element_is_flagged(bad):
    ref = torch.randn(64, generator=torch.Generator().manual_seed(0))
    cand = ref.clone()
    cand[5] = bad
    row = _verdict(ref, cand)
    assert row.status == "nonfinite" and "first at index [5]" in row.note


def test_the_same_nonfinite_pattern_in_both_is_compared_on_the_rest():
    ref = torch.randn(64, generator=torch.Generator().manual_seed(0))
    ref[3], ref[9] = math.inf, math.nan
    row = _verdict(ref, ref.clone())
    assert row.status == "ok" and row.error == 0.0
    cand = ref.clone()
    cand[20] += 1.0  # a finite element far off: over threshold
    assert _verdict(ref, cand).status == "over"


def test_float64_values_whose_sum_overflows_are_finite():
    ref = torch.full((4,), 1e308, dtype=torch.float64)
    assert math.isinf(float(ref.sum()))
    row = _check_one(0, KEY, ENTRY, ref, ref.clone(), [], [ref.clone()] * 4, 1e-2, {})
    assert row.status == "ok"
