"""Test-suite hooks. The suite runs on whatever CPU kernels torch dispatches (no ISA is forced:
the bound models cover every characterised dispatch, :mod:`ttrace_num.cpu_kernels`).

``@pytest.mark.cpu_dispatch("avx2", "default")`` marks a test that reproduces one ATen CPU
dispatch bit for bit (an emulation of a kernel's arithmetic): it is skipped, with the reason,
on any other dispatch (``ATEN_CPU_CAPABILITY`` or the CPU's best)."""
import pytest

from ttrace_num.cpu_kernels import dispatch


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cpu_dispatch(*capabilities): the test reproduces these ATen CPU dispatches "
                                       "bit for bit (lower case, e.g. 'avx2', 'default'); skipped on the others")


def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("cpu_dispatch")
    if marker is None:
        return
    allowed = {str(c).lower() for c in marker.args}
    if not allowed:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.cpu_dispatch needs at least one capability")
    if dispatch() not in allowed:
        pytest.skip(f"bit-exact emulation of the {sorted(allowed)} ATen CPU kernels; torch dispatches "
                    f"{dispatch()!r} here (ATEN_CPU_CAPABILITY={sorted(allowed)[0]} runs it)")
