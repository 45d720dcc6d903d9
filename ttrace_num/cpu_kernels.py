"""Which CPU kernels torch dispatches, and whether the torch-CPU kernel models describe them.

The models of torch's CPU kernels in :mod:`ttrace_num.bounds` (the measured elementary-function
constants :data:`~ttrace_num.bounds.activations.TORCH_CPU`, the bit-exact emulations of ATen's
layer norm and of the bf16/fp16 backward kernels) were characterised on ATen's **AVX2**
kernels, with oneDNN limited to AVX2. On a CPU with AVX512, torch 2.13 dispatches other
kernels, and measured on one (AMD EPYC with avx512_bf16, torch 2.13.0):

* fp32 ``gelu``: ``erf`` up to 10.2 ulp (the model says 9.5): 4 violations of the gelu bound
  over the whole-range sweep;
* bf16 ``gelu`` and bf16 GEMMs: results that should be bf16 subnormals flushed to zero (158
  violations of the bf16 gelu sweep, 2 of the subnormal bf16 matmul cases);
* the layer-norm emulation no longer bit-exact (the layer-norm *bounds* still held), and bf16
  ``gelu_backward`` agreeing with its emulation on 96% of elements instead of > 99%.

With ``ATEN_CPU_CAPABILITY=avx2`` and ``ONEDNN_MAX_CPU_ISA=AVX2`` in the environment before
torch is imported, the same machine runs the modelled kernels and all of these hold (the test
suite runs that way: ``make test``). GPU kernels are not concerned.
"""
from __future__ import annotations

import os
import warnings

import torch

__all__ = ["MODELLED_ENV", "runs_modelled_kernels", "warn_if_unmodelled"]

#: Environment under which torch dispatches the CPU kernels the models describe.
MODELLED_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}

_checked = False


def _cpu_has_avx512() -> bool:
    probe = getattr(torch.cpu, "_is_avx512_supported", None)
    return bool(probe()) if probe is not None else "AVX512" in torch.backends.cpu.get_cpu_capability().upper()


def runs_modelled_kernels() -> bool:
    """True when torch dispatches the AVX2-level CPU kernels the models were characterised on:
    ATen's dispatch capability is not AVX512 and oneDNN cannot use AVX512 (no AVX512 on this
    CPU, or ``ONEDNN_MAX_CPU_ISA=AVX2``)."""
    if "AVX512" in torch.backends.cpu.get_cpu_capability().upper():
        return False
    return not _cpu_has_avx512() or os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() == "AVX2"


def warn_if_unmodelled() -> None:
    """Warn once per process when a torch-CPU kernel model is used on kernels it does not
    describe. The dispatch is fixed once torch is loaded, so it is checked once: every bound
    that uses :data:`~ttrace_num.bounds.activations.TORCH_CPU` calls this."""
    global _checked
    if _checked:
        return
    _checked = True
    if runs_modelled_kernels():
        return
    env = " ".join(f"{k}={v}" for k, v in MODELLED_ENV.items())
    warnings.warn(f"torch dispatches AVX512 CPU kernels here ({torch.backends.cpu.get_cpu_capability()}); "
                  "ttrace_num's torch-CPU kernel models were measured on the AVX2 kernels and can be "
                  f"exceeded (erf 10.2 vs 9.5 ulp, bf16 subnormals flushed). Set {env} before importing "
                  "torch (docs/bounds.md, 'CPU kernel dispatch').", RuntimeWarning, stacklevel=3)
