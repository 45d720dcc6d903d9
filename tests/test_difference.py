"""tracer.compare.difference: the norms of a difference chunk by chunk, against float64 references."""
from __future__ import annotations

import math

import pytest
import torch

from tracer.compare.difference import difference_norms


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("chunk", [7, 1 << 10, 1 << 17])
def test_norms_match_float64_over_chunks(dtype, chunk):
    """Error, reference norm and largest difference within float32's summation error of the
    float64 values, whether the tensor is one chunk or hundreds (the last one partial); a
    wrong combination of the chunks (their plain sum instead of sqrt of the sum of squares) fails."""
    g = torch.Generator().manual_seed(3)
    ref = (torch.randn(3, 1000, generator=g) * 4).to(dtype)
    cand = (ref.float() * (1 + 1e-2 * torch.randn(ref.shape, generator=g))).to(dtype)
    error, ref_norm, max_abs = difference_norms(ref, cand, torch.float32, chunk)
    d = cand.double() - ref.double()
    assert math.isclose(error, float(d.norm()), rel_tol=1e-6)
    assert math.isclose(ref_norm, float(ref.double().norm()), rel_tol=1e-6)
    assert max_abs == float(d.abs().max())
    if chunk < ref.numel():
        chunks = torch.split(d.reshape(-1), chunk)
        assert not math.isclose(error, sum(float(c.norm()) for c in chunks), rel_tol=1e-3)


def test_non_finite_or_overflowing_values_give_none():
    """NaN or Inf in either tensor, or a float32 overflow of the squares, give None (the
    elementwise path then locates them); float64 takes the overflowing values."""
    ref = torch.ones(300)
    for bad in (math.nan, math.inf):
        cand = ref.clone()
        cand[123] = bad
        assert difference_norms(ref, cand, torch.float32, 64) is None
        assert difference_norms(cand, ref, torch.float32, 64) is None
    big = torch.full((300,), 3e30)
    assert difference_norms(big, -big, torch.float32, 64) is None
    error, _, _ = difference_norms(big, -big, torch.float64, 64)
    assert math.isclose(error, 6e30 * math.sqrt(300), rel_tol=1e-6)  # 3e30 in float32


def test_empty_and_mismatched_tensors():
    assert difference_norms(torch.ones(0), torch.ones(0), torch.float32) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="300 reference elements vs 301"):
        difference_norms(torch.ones(300), torch.ones(301), torch.float32)
