"""Sharp tests of the deterministic softmax / log_softmax bounds (issue 33).

The worst-case rounding emulation (:func:`ttrace_num.emulate.worst_case.worst_softmax`,
:func:`~ttrace_num.emulate.worst_case.worst_log_softmax`) applies, per output element, every
rounding of the model of :mod:`ttrace_num.bounds.softmax` at its largest error in the
direction that increases that element's error. On rows whose mass sits in their first two
entries (so that every level of the recursive row sum acts on the full ``S``) it attains
the bound up to second-order terms: each term of ``N_i`` (exp ``A_j`` incl. the argument's
``h_j``, the sum's ``theta``, the division ``u_r``), the final ``half_ulp_c``, the stats
format's rounding and the log's ``c_log u`` of log_softmax, is exercised by one of the
rows below; a dropped term or a 1% smaller constant fails ``err <= bound``, a spurious term
fails ``bound <= SHARP * err``. Errors are taken against the mpmath reference
(:mod:`ttrace_num.reference.ops`). ``CASES`` is also the probe set of ``bench/mutation.py``.
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch

import ttrace_num as tn
from ttrace_num.emulate.worst_case import sharp_verdict, worst_log_softmax, worst_softmax
from ttrace_num.reference import ops as ref

#: first-order tightness at the worst case (measured <= 1 + 6e-6)
SHARP = 1.0 + 1e-4

ROWS = {
    # n = 2, y = 1/2: the division's u_r is 1/5 of the bound
    "two": torch.tensor([[0.0, 0.0]]),
    # 64 entries, mass in the first two: the row sum's theta = 63 u dominates
    "long": torch.cat([torch.zeros(1, 2), torch.full((1, 62), -30.0)], 1),
    # fp32 arguments whose x - m is inexact in fp32: the argument terms h_j = 8u..16u
    "exp_arguments": torch.tensor([[0.0, -1.3, -17.1, -20.3]]),
    # exps below fp32's normal range (S ~ 1): the absolute eta_i (2 subnormal ulps) and the
    # final half-ulp at a subnormal y are the whole bound of the last two entries
    "underflow": torch.tensor([[0.0, -30.0, -100.0, -101.5]]),
}


def _softmax_case(row: str, division: str, compute: str = "fp32", cols: slice = slice(None)):
    def case() -> tuple[torch.Tensor, torch.Tensor]:
        x = ROWS[row]
        bound = tn.tolerance("softmax", x, dim=-1, compute_fmt=compute, out_fmt="fp32", division=division).abs
        err = (worst_softmax(x, compute_fmt=compute, division=division) - ref.softmax(x, dim=-1)).abs()
        return bound[..., cols], err[..., cols]
    return case


def _log_softmax_case(row: str, stats: str, compute: str = "fp32", cols: slice = slice(None)):
    def case() -> tuple[torch.Tensor, torch.Tensor]:
        x = ROWS[row]
        bound = tn.tolerance("log_softmax", x, dim=-1, compute_fmt=compute, out_fmt="fp32", stats_fmt=stats).abs
        err = (worst_log_softmax(x, compute_fmt=compute, stats_fmt=stats) - ref.log_softmax(x, dim=-1)).abs()
        return bound[..., cols], err[..., cols]
    return case


CASES: dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]] = {
    **{f"softmax_{r}_{d}": _softmax_case(r, d) for r in ROWS for d in ("reciprocal", "divide")},
    **{f"log_softmax_{r}_stats_{s}": _log_softmax_case(r, s) for r in ROWS for s in ("fp32", "bf16")},
    # bf16 compute: the arguments' h_j = 2^-4 make the second-order remainders R_j ~ h^2/2
    # (3% of A_j) and D - B' visible at the two small entries (attained within 0.5%)
    "softmax_exp_arguments_bf16compute": _softmax_case("exp_arguments", "reciprocal", "bf16", slice(2, None)),
    "log_softmax_exp_arguments_bf16compute": _log_softmax_case("exp_arguments", "fp32", "bf16", slice(2, None)),
}
#: cases attained within a stated larger factor (second-order terms of bf16 compute)
LOOSER = {"softmax_exp_arguments_bf16compute": 1.01, "log_softmax_exp_arguments_bf16compute": 1.01}


def verdict(name: str, bound: torch.Tensor, err: torch.Tensor) -> str | None:
    """:func:`~ttrace_num.emulate.worst_case.sharp_verdict` of case ``name`` (also used by
    ``bench/mutation.py``)."""
    return sharp_verdict(name, bound, err, LOOSER.get(name, SHARP))


@pytest.mark.parametrize("name", sorted(CASES))
def test_worst_case_attains_bound(name: str) -> None:
    failure = verdict(name, *CASES[name]())
    assert failure is None, failure


def test_underflowing_exp_real_kernel() -> None:
    """Adversarial row for torch's kernel: an entry whose exp is subnormal in fp32 (the
    absolute ``eta_i`` term, 2 subnormal ulps, and the final half-ulp at a subnormal ``y``
    make its whole bound): torch's fp32 softmax is within it, and the bound is within 4x of
    the largest error the model allows there (3 subnormal ulps; a subnormal ``y`` is one)."""
    x = torch.tensor([[0.0, -100.0, -101.5, -1.0]])
    got = torch.softmax(x, -1).double()
    exact = ref.softmax(x, dim=-1)
    bound = tn.tolerance("softmax", x, dim=-1).abs
    assert ((got - exact).abs() <= bound).all()
    eta = tn.formats.get_format("fp32").subnormal_abs_error
    assert (bound[0, 1:3] <= 4 * 3 * eta).all() and (bound[0, 1:3] >= 3 * eta).all()
