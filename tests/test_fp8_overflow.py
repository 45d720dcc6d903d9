"""FP8 overflow as torch does it (issue 33): ``x.to(float8_e4m3fn)`` saturates at 448 (even
``+-inf``), ``float8_e5m2`` overflows to ``+-inf``, the ``fnuz`` types give NaN, and
``torch._scaled_mm``'s output saturates for ``e4m3`` and overflows for ``e5m2``/fp16
(measured, torch 2.13 CPU). The quantize / quantized-GEMM / scaled-GEMM bounds must be
``inf`` exactly where such a cast may overflow, finite (and exact for saturation) elsewhere;
``saturate=True`` states the clamping recipes (TE, Megatron, MX). Checked against torch's
casts and the exact (float64 / fsum) references."""
import math

import pytest
import torch

import ttrace_num as tn
from ttrace_num import scaling
from ttrace_num.bounds.fp8 import cast_error, torch_cast_overflow
from ttrace_num.emulate.fp8 import cast_fake_quant
from ttrace_num.formats import get_format
from ttrace_num.reference import exact_matmul

FP8 = ("e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz")


@pytest.mark.parametrize("name", FP8)
def test_cast_error_matches_torch_casts_around_max(name):
    """Every float32 in [0.9 max, 1.2 max] (and 10 max, inf): torch's cast error is within
    cast_error; cast_error is inf exactly where torch's cast gives inf/NaN."""
    f = get_format(name)
    lo, hi = torch.tensor(0.9 * f.max).view(torch.int32), torch.tensor(1.2 * f.max).view(torch.int32)
    x = torch.cat([torch.arange(int(lo), int(hi), 997, dtype=torch.int32).view(torch.float32),
                   torch.tensor([f.max, 10 * f.max])])
    y = x.to(f.torch_dtype).float().double()
    err = (y - x.double()).abs().nan_to_num(nan=math.inf, posinf=math.inf)
    b = cast_error(x.double(), f, torch_cast_overflow(f))
    assert bool((err <= b).all())
    assert torch.equal(torch.isinf(b), torch.isinf(err))
    expected = {"e4m3": "saturate", "e5m2": "inf", "e4m3fnuz": "nan", "e5m2fnuz": "nan"}[name]
    assert torch_cast_overflow(f) == expected


def _spike(seed: int):
    """Delayed scaling with an amax history 4x below the current amax: elements beyond fmt.max."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 64, generator=g)
    return x, x.abs().max() / 4


@pytest.mark.parametrize("name", FP8)
def test_quantize_with_torch_cast_overflow(name):
    x, amax = _spike(1)
    exact = x.double()
    torch_cast = cast_fake_quant(x, name, "tensor", amax, saturate=False)  # torch's own cast, no clamp
    err = (torch_cast - exact).abs().nan_to_num(nan=math.inf, posinf=math.inf)
    b = tn.tolerance("quantize", x, fmt=name, amax=amax).abs  # default: the cast's own overflow
    assert bool((err <= b).all()), name
    sat = scaling.quantize(x, name, "tensor", amax).saturated
    clear = x.abs() > 1.1 * amax  # well beyond the saturation point: the error is |x| - max / s
    if torch_cast_overflow(get_format(name)) == "saturate":
        assert bool(torch.isfinite(b).all())
        assert clear.any() and float((b[clear] / err[clear]).max()) < 1 + 1e-4  # saturation bounded exactly
    else:
        assert bool(torch.isinf(err).any())  # overflow really happened, and is not hidden by a finite claim
        assert torch.equal(torch.isinf(b), torch.isinf(err))
    # the clamping recipe (TE / Megatron) stays finite and exact on the saturated elements
    clamped = cast_fake_quant(x, name, "tensor", amax, saturate=True)
    errc = (clamped - exact).abs()
    bc = tn.tolerance("quantize", x, fmt=name, amax=amax, saturate=True).abs
    assert bool(torch.isfinite(bc).all()) and bool((errc <= bc).all())
    assert sat.any() and float((bc[clear] / errc[clear]).max()) < 1 + 1e-4


def test_quantized_matmul_gives_inf_where_a_cast_overflows():
    x, amax = _spike(2)
    w = torch.randn(64, 16, generator=torch.Generator().manual_seed(3))
    b = tn.tolerance("quantized_matmul", x, w, fmt="e5m2", amax_a=amax, scale_application="inputs")
    rows = scaling.quantize(x, "e5m2", "tensor", amax).saturated.any(1)
    assert bool(torch.isinf(b.abs[rows]).all()) and bool(torch.isfinite(b.abs[~rows]).all())
    bs = tn.tolerance("quantized_matmul", x, w, fmt="e5m2", amax_a=amax, scale_application="inputs", saturate=True)
    assert bool(torch.isfinite(bs.abs).all())
    with pytest.raises(TypeError, match="saturate"):
        tn.tolerance("quantize", x, fmt="e5m2", saturate="yes")


@pytest.mark.parametrize("out", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float16])
def test_scaled_mm_output_overflow(out):
    """_scaled_mm's output cast: e4m3 saturates at 448 (finite error, bounded), e5m2 and fp16
    overflow to inf (bound inf there)."""
    g = torch.Generator().manual_seed(4)
    a8 = (torch.randn(16, 32, generator=g) * 8).to(torch.float8_e4m3fn)
    b8 = (torch.randn(16, 32, generator=g) * 8).to(torch.float8_e4m3fn).T
    sa = torch.tensor(1.0)
    for sb in (torch.tensor(0.25), torch.tensor(64.0)):
        y = torch._scaled_mm(a8, b8, sa, sb, out_dtype=out).double()
        exact = exact_matmul(a8.double() * sa.double(), b8.double() * sb.double())
        err = (y - exact).abs().nan_to_num(nan=math.inf, posinf=math.inf)
        bound = tn.tolerance("scaled_matmul", a8, b8, scale_a=sa, scale_b=sb, out_fmt=out,
                             scale_application="inputs").abs
        assert bool((err <= bound).all()), (out, float(sb))
        assert torch.equal(torch.isinf(bound), torch.isinf(err)) or out == torch.float8_e4m3fn
        if out == torch.float8_e4m3fn:
            assert bool(torch.isfinite(bound).all())
    assert bool(torch.isinf(err).any()) != (out == torch.float8_e4m3fn)  # the large scale overflows (or saturates)
