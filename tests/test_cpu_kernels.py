"""ttrace_num.cpu_kernels: which dispatch this is, whether it is characterised, and the warning
(once, naming the dispatch) only where it is not."""
import subprocess
import sys
import warnings

import torch

import ttrace_num as tn
from ttrace_num import cpu_kernels


def test_dispatch_is_torchs_capability_and_the_x86_ones_are_characterised():
    assert cpu_kernels.dispatch() == torch.backends.cpu.get_cpu_capability().lower()
    for cap in ("default", "avx2", "avx512", "AVX2"):
        assert cpu_kernels.is_characterised(cap)
    assert not cpu_kernels.is_characterised("sve256")


def test_no_warning_on_a_characterised_dispatch(monkeypatch):
    """The scalar ``default`` dispatch, in a subprocess (ATen fixes it at import): a TORCH_CPU
    bound warns nothing (the AVX512 warning every process printed before is gone); the same
    in this process, whatever characterised dispatch it runs."""
    code = ("import warnings, torch, ttrace_num as tn\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    tn.tolerance('gelu', torch.randn(8))\n"
            "print(torch.backends.cpu.get_cpu_capability(), sum('CPU kernels' in str(x.message) for x in w))\n")
    out = subprocess.run([sys.executable, "-c", code], env={"ATEN_CPU_CAPABILITY": "default", "PATH": ""},
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["DEFAULT", "0"]
    monkeypatch.setattr(cpu_kernels, "_warned", False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        tn.tolerance("gelu", torch.randn(8))
    assert cpu_kernels.is_characterised() and not [x for x in w if "CPU kernels" in str(x.message)]


def test_an_uncharacterised_dispatch_warns_once_and_names_it(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "dispatch", lambda: "sve256")
    monkeypatch.setattr(cpu_kernels, "_warned", False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        tn.tolerance("gelu", torch.randn(8))
        tn.tolerance("silu", torch.randn(8))
    msgs = [str(x.message) for x in w if "CPU kernels" in str(x.message)]
    assert len(msgs) == 1 and "'sve256'" in msgs[0] and "LibraryErrors" in msgs[0]
