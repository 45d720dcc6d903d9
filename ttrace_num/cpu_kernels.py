"""Which CPU kernels torch dispatches, and whether the torch-CPU kernel models were characterised on them.

ATen picks its vectorised CPU kernels once per process from ``ATEN_CPU_CAPABILITY`` (or the best
the CPU supports): ``default`` (scalar code), ``avx2``, ``avx512`` on x86, other names elsewhere
(``sve256``, ``vsx``, ``zvector``...). The models of torch's CPU kernels in
:mod:`ttrace_num.bounds` hold on every dispatch in :data:`CHARACTERISED`:

* the elementary-function constants :data:`~ttrace_num.bounds.activations.TORCH_CPU` are the
  maximum of the constants measured on each of them (docs/bounds.md, "Elementary-function
  constants per dispatch"): ``default`` and ``avx2`` measured on a 2-core AMD EPYC (Zen3, AVX2,
  torch 2.13.0), ``avx512`` on an AMD EPYC with avx512_bf16 (torch 2.13.0: ``erf`` 10.2 ulp);
* flush to zero (the AVX512-BF16 GEMM and bf16 conversion ``vcvtneps2bf16`` flush subnormal
  results) is in the models (``Summation(ftz=True)``, the activations' ``ftz=True``).

Bit-exact emulations of ATen kernels (layer norm, the bf16/fp16 backward kernels) reproduce one
dispatch's arithmetic; their tests declare which (``@pytest.mark.cpu_dispatch``,
``tests/conftest.py``) and skip elsewhere. A dispatch not in :data:`CHARACTERISED` (ARM, POWER,
s390x) gets one warning per process when a ``TORCH_CPU`` model is used. GPU kernels are not
concerned (pass their :class:`~ttrace_num.bounds.activations.LibraryErrors`).
"""
from __future__ import annotations

import warnings

import torch

__all__ = ["CHARACTERISED", "dispatch", "is_characterised", "warn_if_uncharacterised"]

#: ATen CPU capabilities whose kernels the torch-CPU models were characterised on (lower case),
#: with where.
CHARACTERISED: dict[str, str] = {
    "default": "measured on AMD EPYC Zen3 (AVX2), torch 2.13.0, ATEN_CPU_CAPABILITY=default",
    "avx2": "measured on AMD EPYC Zen3 (AVX2), torch 2.13.0",
    "avx512": "measured on AMD EPYC with avx512_bf16, torch 2.13.0 (erf 10.2 ulp, bf16 FTZ)",
}

_warned = False


def dispatch() -> str:
    """The ATen CPU capability torch dispatches in this process, lower case (``"avx2"``...)."""
    return torch.backends.cpu.get_cpu_capability().lower()


def is_characterised(capability: str | None = None) -> bool:
    """Whether the torch-CPU kernel models were characterised on ``capability`` (default: this
    process's :func:`dispatch`)."""
    return (capability or dispatch()).lower() in CHARACTERISED


def warn_if_uncharacterised() -> None:
    """Warn once per process when a torch-CPU kernel model is used on a dispatch it was never
    characterised on (the dispatch is fixed once torch is loaded): every bound that uses
    :data:`~ttrace_num.bounds.activations.TORCH_CPU` calls this."""
    global _warned
    if _warned or is_characterised():
        return
    _warned = True
    warnings.warn(f"torch dispatches {dispatch()!r} CPU kernels here; ttrace_num's torch-CPU kernel constants were "
                  f"characterised on {sorted(CHARACTERISED)} only and may be exceeded: measure them "
                  "(ttrace_num.bounds.activations.measure_torch_cpu_constants) and pass library=LibraryErrors(...) "
                  "(docs/bounds.md, 'CPU kernel dispatch').", RuntimeWarning, stacklevel=3)
