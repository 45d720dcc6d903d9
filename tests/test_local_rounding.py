"""ttrace_num.propagate.local: the rounding amplitude of a bf16/fp16 result, from its table, and of
a float32 result, from its bits; the noise injector's float32 arithmetic on float32 results."""
from __future__ import annotations

import pytest
import torch

from ttrace_num.formats import get_format, half_ulp
from ttrace_num.propagate import local
from ttrace_num.propagate.local import LocalBounds
from ttrace_num.propagate.noise import NoiseInjector


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


def _fp32_edge_values() -> torch.Tensor:
    """float32 values at every binade's edges (the first and last three patterns of each exponent
    field from 2^-102 up, so the mantissa of all ones that the factor ``1 + 2u`` lifts into the
    next binade is there), random ones, 0, -0, inf, -inf, NaN, both signs."""
    edges = [b + k for e in range(127 - 102, 255) for b in (e << 23,) for k in (0, 1, 2, (1 << 23) - 3,
                                                                                  (1 << 23) - 2, (1 << 23) - 1)
             if b + k <= 0x7F7FFFFD]
    bits = torch.tensor(edges, dtype=torch.int32)
    special = torch.tensor([0.0, float("inf"), float("nan"), 2.0 ** -102])
    g = torch.Generator().manual_seed(0)
    rand = torch.randn(4000, generator=g) * torch.exp2(torch.randint(-90, 100, (4000,), generator=g).float())
    v = torch.cat([bits.view(torch.float32), special, rand])
    return torch.cat([v, -v])


def test_float32_amplitudes_from_the_bits_equal_the_float64_arithmetic():
    """``rounding(fp32=True)`` of a float32 result: float32 values equal to the float64
    ``half_ulp(|v| (1 + 2u))`` bit for bit on every binade edge, 0, inf and NaN, also for a
    non-contiguous result; the factor ``1 + 2u`` is visible (the mantissa of all ones moves up),
    so amplitudes without it would fail. A result holding a nonzero value below 2^-102 (its
    amplitude is not a normal float32 number) or one of the two largest finite values (whose
    amplitude is infinite) keeps float64."""
    fmt = get_format(torch.float32)
    v = _fp32_edge_values().reshape(2, -1)
    want = half_ulp(v.double().abs() * (1 + 2 * fmt.u), fmt)
    for out, expect in ((v, want), (v.t(), want.t())):
        got = LocalBounds().rounding(out, (out.double(),), fp32=True)
        assert got.dtype == torch.float32 and got.shape == out.shape
        assert torch.equal(got.isnan(), expect.isnan())
        assert torch.equal(got.double().nan_to_num(), expect.nan_to_num())
        assert _bitwise_equal(LocalBounds().rounding(out, (out.double(),)), expect)  # the default: float64
    assert int((half_ulp(v.double().abs(), fmt) != want).sum()) >= 2 * 153
    largest = torch.tensor([0x7F7FFFFE, 0x7F7FFFFF], dtype=torch.int32).view(torch.float32)
    for tiny in (2.0 ** -103, 1e-45, -2.0 ** -110, float(largest[0]), -float(largest[1])):
        out = torch.tensor([1.0, tiny, 0.0])
        got = LocalBounds().rounding(out, (out.double(),), fp32=True)
        assert got.dtype == torch.float64
        assert torch.equal(got, half_ulp(out.double().abs() * (1 + 2 * fmt.u), fmt))


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("against_exact", [False, True])
@pytest.mark.parametrize("magnitudes", ["float32 path", "with fallbacks"])
def test_the_injector_perturbs_float32_results_as_the_float64_arithmetic_did(against_exact, magnitudes,
                                                                             monkeypatch):
    """A noise injector's float32 results of rounding ops (a scalar scale, an elementwise product,
    a narrowing cast), drawn and added in float32, equal bit for bit those of the float64
    arithmetic (the same generator seed, ``_fp32_rounding`` switched off), edge values
    included, with and without autograd: on magnitudes in [2^-50, 2^50], where every result
    takes the float32 path (checked), and on the whole range, where tiny and overflowing results
    fall back to float64 and infinite amplitudes give inf/NaN. Two runs' noise (an ulp) moves
    some elements (the test can fail); one run's against exact (half an ulp) rounds back to the
    result everywhere, in both arithmetics."""
    v = _fp32_edge_values()
    keep = torch.isfinite(v) & (((v.abs() >= 2.0 ** -50) & (v.abs() <= 2.0 ** 50)) if magnitudes == "float32 path"
                                else (v.abs() < 1e30))
    v = v[keep]

    def run() -> list[torch.Tensor]:
        x = v.clone().requires_grad_(True)
        inj = NoiseInjector(torch.Generator().manual_seed(5), mode="probabilistic", against_exact=against_exact)
        with inj:
            outs = [v * 0.3, v * v.flip(0), v.double().to(torch.float32), x * 0.7]
        outs[-1].sum().backward()
        return [o.detach() for o in outs] + [x.grad]

    fast = run()
    if magnitudes == "float32 path":
        assert all(local._fp32_rounding(o) is not None for o in fast[:4])
    monkeypatch.setattr(local, "_fp32_rounding", lambda out: None)
    slow = run()
    assert all(a.dtype == torch.float32 and _bitwise_equal(a, b) for a, b in zip(fast, slow))
    assert torch.equal(fast[0], v * 0.3) == against_exact
