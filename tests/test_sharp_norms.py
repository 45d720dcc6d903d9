"""Sharp tests of the deterministic layer_norm / rms_norm bounds (issue 33).

The worst-case emulations :func:`ttrace_num.emulate.worst_case.worst_rms_norm` and
:func:`~ttrace_num.emulate.worst_case.worst_layer_norm` run the computation models of
:mod:`ttrace_num.bounds.norms` with every rounding at its largest size in the direction that
increases the error (``W^`` smallest so ``r^`` largest, the mean towards ``x_i``, the output
roundings away from zero). On rows whose mass sits where the summation bound charges it
(the deepest leaf of ATen's cascade for ``rms_norm``; the first two entries of a recursive
sum) they attain the bound up to ``1 + O(2/n)`` (the few entries outside the head) and
second-order terms. Each case asserts ``err <= bound`` and ``bound <= factor * err`` against
the exact references (:mod:`ttrace_num.reference.ops`). ``CASES`` is also the probe set of
``bench/mutation.py``.

Covered: ``rms_norm`` (ATen cascade default and a recursive ``Summation``; squares rounded
or exact (bf16); ``eps``; weight; output rounding) and ``layer_norm`` with
``moments="two_pass"``, ``centering="subtract"`` (mean, subtraction, variance, ``eps``,
``1/sqrt``, weight, bias, output) and with the default ``moments="torch_cpu"`` (the
Welford/Chan tree of :class:`~ttrace_num.bounds.norms.BoundOps`, emulated by
:func:`~ttrace_num.emulate.worst_case.worst_layer_norm_torch_cpu`; fp32 and bf16 storage, 32-byte
vectors): its mean part is attained to ``1 + 3e-3`` at the elements with ``d_i ~ 0`` of a
large-mean row, its ``M`` part only to ``~1.48`` (the coupling of the group-mean errors into
``P`` and ``r1``, charged to the mean and to ``M`` independently, are not attained by one
execution). Not covered: ``centering="fold"`` (no emulation yet).
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch

import ttrace_num as tn
from ttrace_num.bounds.summation import Summation
from ttrace_num.bounds.norms import TorchCPULayout
from ttrace_num.emulate.worst_case import sharp_verdict, worst_layer_norm, worst_layer_norm_torch_cpu, worst_rms_norm, worst_torch_cpu_sum
from ttrace_num.formats import get_format
from ttrace_num.reference import ops as ref

#: rms_norm: every term of the bound is charged to the one checked element (measured <= 1 + 1e-6)
SHARP_RMS = 1.0 + 1e-5
#: layer_norm, n = 1024: the n - 2 tail entries get fewer roundings than the recursive sums'
#: ``theta_{n-1}`` charges them (their share of ``sum d^2`` is ~2/n), and the bias rounding of
#: the tail entries is a half-ulp at a smaller magnitude than charged (measured <= 1 + 2.5e-3)
SHARP_LN = 1.0 + 3e-3
#: layer_norm torch_cpu, elements with d_i ~ 0 of a row of mean 100 (kappa ~ 100): the bound is
#: E_mu r (1 + rho_r) + hu(dd r); every local rounding of the mean (r1, r2, r3, c^ - c) is
#: attained; not attained: the magnitudes' error terms (E_A + E_B in |delta^|, O(u) relative),
#: the coupling part of rho_r and the |d_i| r rho_r term (|d_i| ~ 1e-3 sigma) (measured <= 1.003)
SHARP_LN_CPU_MEAN = 1.0 + 1e-2
#: layer_norm torch_cpu, every element of a zero-mean fp32 row: the M part of the bound is
#: attained only up to its coupling terms (the group-mean errors in P, r1 in the mean and in M
#: independently; measured <= 1.48 at the largest |d_i|, 1.003 at d_i ~ 0)
SHARP_LN_CPU_ALL = 1.5
#: layer_norm torch_cpu, bf16 storage (output rounding to bf16 dominates; measured <= 1.03)
SHARP_LN_CPU_BF16 = 1.05
RECURSIVE = Summation(accum=get_format("fp32"))
#: case-name prefix -> sharpness factor (first match)
SHARP = (("rms", SHARP_RMS), ("ln_cpu_mean", SHARP_LN_CPU_MEAN), ("ln_cpu_all", SHARP_LN_CPU_ALL),
         ("ln_cpu_bf16", SHARP_LN_CPU_BF16), ("ln", SHARP_LN))


def _deepest_leaf(n: int, lanes: int = 8) -> int:
    """Index of a value with the most roundings in ATen's CPU sum of ``n`` values."""
    return int(worst_torch_cpu_sum(torch.eye(n, dtype=torch.float64), lanes, "fp32", 1.0).argmax())


def _rms_case(n: int, head: float, tail: float, summation: Summation | None = None, dtype=torch.float32,
              eps: float = 1e-6, weight: float | None = None):
    def case() -> tuple[torch.Tensor, torch.Tensor]:
        cols = [_deepest_leaf(n)] if summation is None else [0, 1]
        x = torch.full((1, n), tail)
        x[0, cols] = head
        x = x.to(dtype)
        w = None if weight is None else torch.full((n,), weight).to(dtype)
        bound = tn.tolerance("rms_norm", x, n, w, eps=eps, summation=summation).abs
        err = (worst_rms_norm(x, w, eps, summation=summation) - ref.rms_norm(x, n, w, eps=eps)).abs()
        return bound[..., cols], err[..., cols]
    return case


def _ln_case(head: float, n: int = 1024, dtype=torch.float32, eps: float = 1e-5, affine: bool = False):
    def case() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.zeros(1, n)
        x[0, :2] = head
        x = x.to(dtype)
        w = torch.full((n,), 1.7).to(dtype) if affine else None
        b = torch.full((n,), 0.3).to(dtype) if affine else None
        bound = tn.tolerance("layer_norm", x, n, w, b, eps=eps, moments="two_pass", centering="subtract").abs
        err = (worst_layer_norm(x, w, b, eps) - ref.layer_norm(x, n, w, b, eps=eps)).abs()
        return bound, err
    return case


CPU32 = TorchCPULayout(vector_bytes=32)


def _ln_cpu_case(n: int, mean: float, dtype=torch.float32, central: bool = False, affine: bool = False):
    """``mean + N(0, 1)`` (seeded), ``moments="torch_cpu"`` (32-byte vectors), subtract
    centering; ``central``: only the element with the smallest ``|d_i|`` (the mean's terms)."""
    def case() -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        x = (mean + torch.randn(1, n, generator=g)).to(dtype)
        w = torch.full((n,), 1.7).to(dtype) if affine else None
        b = torch.full((n,), 0.3).to(dtype) if affine else None
        bound = tn.tolerance("layer_norm", x, n, w, b, layout=CPU32, centering="subtract").abs
        err = (worst_layer_norm_torch_cpu(x, w, b, layout=CPU32) - ref.layer_norm(x, n, w, b)).abs()
        if central:
            x64 = x.double()
            cols = [int((x64 - x64.mean()).abs().argmin())]
            return bound[..., cols], err[..., cols]
        return bound, err
    return case


CASES: dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]] = {
    # mass at the deepest leaf (11 roundings for n = 64, 26 for 1024): theta(h + 2) of W
    "rms_cpu_64": _rms_case(64, 1.3, 1e-4),
    "rms_cpu_1024": _rms_case(1024, 1.3, 1e-4),
    "rms_recursive": _rms_case(64, 1.3, 1e-4, RECURSIVE),
    # mean square ~ eps: the rounding of eps and of W^ = ms^ + eps^ are a third of rho_r
    "rms_eps": _rms_case(64, 1e-3, 1e-7, RECURSIVE),
    # weight product and bf16 output rounding (exact squares of bf16 values in fp32)
    "rms_weight": _rms_case(64, 1.3, 1e-4, weight=1.7),
    "rms_bf16": _rms_case(64, 1.3, 1e-4, dtype=torch.bfloat16, weight=1.7),
    # mean error (theta_n S/n and the division), subtraction, variance, 1/sqrt, z rounding
    "ln_two_pass": _ln_case(3.1),
    # |x| ~ sqrt(eps): eps^'s rounding and the + eps^ rounding
    "ln_eps": _ln_case(3e-3),
    # weight and bias roundings
    "ln_affine": _ln_case(3.1, affine=True),
    # bf16 storage, subtract centering: the output rounding dominates
    "ln_bf16": _ln_case(3.1, dtype=torch.bfloat16),
    # torch_cpu moments: mean terms (Welford r1/r2/r3, c^ - c, Chan merges) at d_i ~ 0, kappa ~ 100
    "ln_cpu_mean_64": _ln_cpu_case(64, 100.0, central=True),
    "ln_cpu_mean_1024": _ln_cpu_case(1024, 100.0, central=True),
    # torch_cpu moments, every element: M's roundings (Welford products, additions, merges)
    "ln_cpu_all_64": _ln_cpu_case(64, 0.0),
    "ln_cpu_all_1024": _ln_cpu_case(1024, 0.0, affine=True),
    # bf16 storage (16-element vectors split in two fp32 halves), kappa ~ 1000
    "ln_cpu_bf16_64": _ln_cpu_case(64, 1000.0, dtype=torch.bfloat16),
    "ln_cpu_bf16_1024": _ln_cpu_case(1024, 1000.0, dtype=torch.bfloat16),
}


def verdict(name: str, bound: torch.Tensor, err: torch.Tensor) -> str | None:
    """:func:`~ttrace_num.emulate.worst_case.sharp_verdict` of case ``name`` (also used by
    ``bench/mutation.py``)."""
    return sharp_verdict(name, bound, err, next(f for prefix, f in SHARP if name.startswith(prefix)))


@pytest.mark.parametrize("name", sorted(CASES))
def test_worst_case_attains_bound(name: str) -> None:
    failure = verdict(name, *CASES[name]())
    assert failure is None, failure
