"""The default bounds hold on the ATen CPU dispatches torch may pick (``ATEN_CPU_CAPABILITY``,
fixed at import: one subprocess per dispatch), against the real kernels and exact references:
the elementary-function constants at the inputs where a dispatch peaks (the scalar ``default``
kernel's tanh-gelu reaches 1.19 u at ``x = -0x1.2a6e4p+0``: the avx2-measured ``A_tanh = 1.0``
was violated there), whole-range bf16 activation sweeps, and bf16 GEMMs whose products are in
fp32's subnormal range."""
import json
import subprocess
import sys

import pytest

from ttrace_num.bounds.activations import TORCH_CPU

CHECK = r"""
import json, torch, torch.nn.functional as F, ttrace_num as tn
from ttrace_num import reference as ref
from ttrace_num.bounds.activations import _implied_constant, FP32
from ttrace_num.reference.dot import exact_matmul
torch.set_num_threads(1)
out = {"dispatch": torch.backends.cpu.get_cpu_capability().lower(), "erf": 0.0, "tanh": 0.0, "violations": 0}
peaks = torch.tensor([float.fromhex("-0x1.2a6e4p+0"), float.fromhex("0x1.21a1p+0"), 0.0546875, -0.05859375])
bits = torch.arange(0, 1 << 16, 7, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
x = bits[torch.isfinite(bits)]
ops = [(F.gelu, ref.gelu(x), tn.tolerance("gelu", x).abs), (F.silu, ref.silu(x), tn.tolerance("silu", x).abs),
       (lambda t: F.gelu(t, approximate="tanh"), ref.gelu(x, approximate="tanh"),
        tn.tolerance("gelu", x, approximate="tanh").abs)]
for mk in (True, False):
    with torch.backends.mkldnn.flags(enabled=mk):
        out["erf"] = max(out["erf"], float(_implied_constant("gelu", peaks, F.gelu(peaks), FP32).max()))
        y = F.gelu(peaks, approximate="tanh")
        out["tanh"] = max(out["tanh"], float(_implied_constant("gelu_tanh", peaks, y, FP32).max()))
        for f, exact, bound in ops:
            out["violations"] += int(((f(x).double() - exact).abs() > bound).sum())
gen = torch.Generator().manual_seed(0)
for scale in (2.0 ** -65, 1.0):
    a = (torch.randn(32, 64, generator=gen) * scale).bfloat16()
    b = (torch.randn(64, 16, generator=gen) * scale).bfloat16()
    err = ((a @ b).double() - exact_matmul(a, b)).abs()
    out["violations"] += int((err > tn.tolerance("matmul", a, b).abs).sum())
print(json.dumps(out))
"""


@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_default_bounds_hold_on_the_dispatch(capability):
    run = subprocess.run([sys.executable, "-c", CHECK], env={"ATEN_CPU_CAPABILITY": capability, "PATH": ""},
                         capture_output=True, text=True, check=True)
    res = json.loads(run.stdout.strip().splitlines()[-1])
    assert res["dispatch"] == capability
    assert res["erf"] <= TORCH_CPU.erf_abs and res["tanh"] <= TORCH_CPU.tanh_abs, res
    assert res["violations"] == 0, res
    if capability == "default":
        assert res["tanh"] > 1.0  # the constant measured on avx2 alone did not hold here


def test_the_constants_cover_the_recorded_avx512_kernels():
    """The AVX512 dispatch (AMD EPYC with avx512_bf16, torch 2.13.0; not runnable here) measured
    ``erf`` at 10.2 u: :data:`TORCH_CPU` must be above it."""
    assert TORCH_CPU.erf_abs > 10.2
