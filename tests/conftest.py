"""Run the CPU kernels the bound models describe (ttrace_num.cpu_kernels), also under a bare
``pytest``: the environment must be set before torch is first imported, and the gloo workers
the tests spawn inherit it."""
import os

for _name, _value in {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}.items():
    os.environ.setdefault(_name, _value)
