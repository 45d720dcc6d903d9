"""ttrace_num.propagate.local: the rounding amplitude of a bf16/fp16 result, from its table."""
from __future__ import annotations

import pytest
import torch

from ttrace_num.formats import get_format, half_ulp
from ttrace_num.propagate.local import LocalBounds


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_table_gives_the_arithmetic_amplitude_of_every_bit_pattern(dtype):
    """``LocalBounds.rounding`` of a 16-bit result (a gather from a table) equals
    ``half_ulp(|v| (1 + 2u))`` computed in float32 on all 65536 values, NaN and Inf
    included, also for a non-contiguous result; the factor ``1 + 2u`` is visible (it moves the
    largest value of each binade up one), so a table without it would fail."""
    fmt = get_format(dtype)
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype).reshape(256, 256)
    want = half_ulp(every.float().abs() * (1 + 2 * fmt.u), fmt, torch.float32)
    for out in (every, every.t()):
        got = LocalBounds().rounding(out, (out.float(),))
        expect = want if out is every else want.t()
        assert got.dtype == torch.float32 and got.shape == out.shape
        assert torch.equal(got.isnan(), expect.isnan()) and torch.equal(got.nan_to_num(), expect.nan_to_num())
    without_factor = half_ulp(every.float().abs(), fmt, torch.float32)
    assert int((without_factor != want).sum()) > 200


def test_a_widening_cast_has_no_rounding():
    out = torch.ones(3, dtype=torch.float32)
    assert float(LocalBounds().rounding(out, (out.to(torch.bfloat16),)).sum()) == 0.0
