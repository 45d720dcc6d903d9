"""Benchmarks (``python -m bench.<name>``). They run on whatever CPU kernels torch dispatches:
the bound models cover every characterised dispatch (:mod:`ttrace_num.cpu_kernels`)."""
