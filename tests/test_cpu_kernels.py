"""ttrace_num.cpu_kernels: the suite runs the modelled kernels, and the warning names the fix."""
import os
import subprocess
import sys

import pytest
import torch

from ttrace_num import cpu_kernels


def test_the_suite_runs_the_modelled_kernels():
    # `make test` exports MODELLED_ENV; run bare on an AVX512 machine, the kernel-model tests fail
    assert cpu_kernels.runs_modelled_kernels(), (
        f"torch dispatches {torch.backends.cpu.get_cpu_capability()} kernels: run the suite through "
        f"`make test` or with {cpu_kernels.MODELLED_ENV} in the environment")


@pytest.mark.skipif(not getattr(torch.cpu, "_is_avx512_supported", lambda: False)(),
                    reason="the AVX512 kernels exist only on an AVX512 CPU")
def test_avx512_dispatch_warns_once_and_names_the_environment():
    env = {k: v for k, v in os.environ.items() if k not in cpu_kernels.MODELLED_ENV}
    code = ("import warnings, torch, ttrace_num as tn\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    tn.tolerance('gelu', torch.randn(8)); tn.tolerance('gelu', torch.randn(8))\n"
            "print(sum('ATEN_CPU_CAPABILITY=avx2' in str(x.message) for x in w))\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"
