"""Sharp tests of the deterministic FP8 / MX quantize bound (issue 33).

The bound of :func:`ttrace_num.bounds.fp8.quantize` (module docstring, model 1) is half the
element format's spacing at the scaled magnitude (times ``s_inv``), the scale's own
``|x| |s s_inv - 1|``, the roundings of ``x s`` and of the dequantization to the compute
format, and saturation. Each case attains it:

* **ties** (power-of-two MX scales): elements exactly half-way between two grid points
  of the element format; round to nearest errs by exactly ``half_ulp_fmt``, so
  :func:`ttrace_num.scaling.fake_quant` (the exact round trip) attains the bound exactly;
* **saturation** (MX E2M1, ``|x|/X`` in ``(6, 8)``): the error is exactly ``|x| - 6 X``;
* **worst-case rounding** (per-tensor fp32 scale ``fmt.max / amax``, not a power of two):
  :func:`ttrace_num.emulate.worst_case.worst_quantize` puts ``x s``, the element rounding
  and the dequantization at their largest errors; with ``out_fmt=bf16`` the output
  rounding too.

Both ``err <= bound`` and ``bound <= SHARP * err`` are asserted on every element.
``CASES`` is also the probe set of ``bench/mutation.py``.
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch

import ttrace_num as tn
from ttrace_num import scaling
from ttrace_num.emulate.worst_case import sharp_verdict, worst_quantize

#: the ties and saturation are attained exactly; the worst-case emulation to 1 + O(u)
SHARP = 1.0 + 1e-6


def _ties() -> tuple[torch.Tensor, torch.Tensor]:
    """One MX block of 32 E4M3 elements, amax 14 (shared scale ``X = 2^(3 - 8)``): besides the
    amax, midpoints ``2^e (1 + (2j + 1)/16)`` of the E4M3 grid (in units of ``X``), +-."""
    mids = torch.tensor([2.0 ** e * (1 + (2 * j + 1) / 16) for e, j in ((-3, 0), (-1, 3), (0, 1), (1, 6), (2, 2),
                                                                       (3, 7), (4, 4), (6, 5), (8, 0), (5, 1))])
    x = torch.cat([torch.tensor([448.0]), mids, -mids, torch.zeros(11)]).reshape(1, 32) * 2.0 ** -5
    bound = tn.tolerance("quantize", x, fmt="e4m3", recipe="mx32").abs
    err = (scaling.fake_quant(x, "e4m3", "mx32") - x.double()).abs()
    return bound[:, 1:21], err[:, 1:21]


def _saturation() -> tuple[torch.Tensor, torch.Tensor]:
    """MX E2M1: amax = 7.5 gives X = 2^(2 - 2) = 1; 7.5, 7.25 and 7 saturate to 6 (errors
    ``|x| - 6`` >= half an ulp of 6: the saturation term is the bound)."""
    x = torch.cat([torch.tensor([7.5, 7.0, 7.25, -7.25]), torch.full((28,), 0.25)]).reshape(1, 32)
    bound = tn.tolerance("quantize", x, fmt="e2m1", recipe="mx32").abs
    err = (scaling.fake_quant(x, "e2m1", "mx32") - x.double()).abs()
    return bound[:, :4], err[:, :4]


def _worst(out_fmt: str | None):
    def case() -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        x = torch.rand(4, 32, generator=g) * 3.0 + 0.01
        x[0, 0] = 3.3  # amax: s = RN_fp32(448 / 3.3), not a power of two
        qz = scaling.quantize(x, "e4m3", "tensor")
        s, s_inv = qz.expand(qz.scale), qz.expand(qz.scale_inv)
        bound = tn.tolerance("quantize", x, fmt="e4m3", recipe="tensor", out_fmt=out_fmt).abs
        err = (worst_quantize(x, s, s_inv, "e4m3", out_fmt=out_fmt) - x.double()).abs()
        return bound[1:], err[1:]  # row 0 holds the amax (x s = 448: saturation, not rounding)
    return case


CASES: dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]] = {
    "mx_e4m3_ties": _ties,
    "mx_e2m1_saturation": _saturation,
    "tensor_e4m3_worst": _worst(None),
    "tensor_e4m3_worst_bf16out": _worst("bf16"),
}


def verdict(name: str, bound: torch.Tensor, err: torch.Tensor) -> str | None:
    """:func:`~ttrace_num.emulate.worst_case.sharp_verdict` of case ``name`` (also used by
    ``bench/mutation.py``)."""
    return sharp_verdict(name, bound, err, SHARP)


@pytest.mark.parametrize("name", sorted(CASES))
def test_quantize_bound_attained(name: str) -> None:
    failure = verdict(name, *CASES[name]())
    assert failure is None, failure
