"""Run the CPU kernels the bound models describe (ttrace_num.cpu_kernels), also under a bare
``pytest``: the environment must be set before torch is first imported, and the gloo workers
the tests spawn inherit it (``bench/__init__.py`` sets it)."""
import bench  # noqa: F401  (pins the CPU kernels before torch is imported)
