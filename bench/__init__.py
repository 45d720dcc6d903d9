"""Benchmarks (``python -m bench.<name>``).

Importing the package pins torch's CPU kernels to the ones ttrace_num's torch-CPU models were
measured on (ATen AVX2, oneDNN up to AVX2: :mod:`ttrace_num.cpu_kernels`) unless the
environment already says otherwise. It must happen before torch is first imported, which
``python -m bench.x`` guarantees (this file runs first); the gloo workers inherit it. The test
suite imports it for the same reason (``tests/conftest.py``)."""
import os

#: the names this package set (the user had not): a benchmark of speed undoes them (bench.tracer_cost)
PINNED: list[str] = []
for _name, _value in {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}.items():
    if _name not in os.environ:
        os.environ[_name] = _value
        PINNED.append(_name)
