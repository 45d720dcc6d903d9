"""Sharp tests of the deterministic attention bounds (issue 33), stated kernels only.

:func:`ttrace_num.emulate.worst_case.worst_attention_one_key` runs the ``"standard"`` and
``"online"`` models of :mod:`ttrace_num.bounds.attention` on a single key (``Lk = 1``), every
rounding at its largest error away from zero. With one key the softmax is exactly 1 whatever
the score and exp errors (they cancel in ``e / l``), so the emulation exercises the
normalisation (``K`` / ``K_r``: the reciprocal and ``beta``), the ``fl(e r)`` rounding
(``delta_y``), the rounding of ``P`` to ``p_fmt`` (``rho`` / ``rho'``, with the exp error
putting ``e`` in the binade above 1 for the online model), the ``P V`` product level
(``theta_pv`` / ``theta_acc``), the online final product (``delta_o``) and the output
rounding, and attains the bound within ``1 + 3e-6``. Each case asserts ``err <= bound`` and
``bound <= SHARP * err`` against the exact output ``O = v``.

Not covered (no worst-case emulation yet): the score GEMM's ``Delta_j`` and the scale
constant ``eps_sc``, the shift ``h_j`` and exp ``c_e`` perturbations of the weights (``E1``,
``J``), the row-sum levels ``theta_l`` for ``Lk > 1``, the online rescales (``h_alpha``,
``T - 1`` levels), masks, underflow terms and the default (``algorithm=None``) union of
kernel models; ``exp2`` kernels. ``CASES`` is also the probe set of ``bench/mutation.py``.
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch

import ttrace_num as tn
from ttrace_num.emulate.worst_case import sharp_verdict, worst_attention_one_key

#: measured <= 1 + 2.6e-6 (the bound's float64 slack and W_low = 1 - c_e against e = 1 + c_e)
SHARP = 1.0 + 1e-5


def _case(algorithm: str, p_fmt: str | None = None, dtype: torch.dtype = torch.float32):
    def case() -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        q = torch.randn(1, 1, 2, 4, generator=g).to(dtype)
        k = torch.randn(1, 1, 1, 4, generator=g).to(dtype)
        v = torch.tensor([[[[1.3, -0.7, 3.1, -2.2]]]]).to(dtype)
        bound = tn.tolerance("attention", q, k, v, algorithm=algorithm, p_fmt=p_fmt).abs
        err = (worst_attention_one_key(v, algorithm=algorithm, p_fmt=p_fmt) - v.double()).abs()
        return bound, err.expand_as(bound)
    return case


CASES: dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]] = {
    "standard_fp32": _case("standard"),
    "standard_p_bf16": _case("standard", "bf16"),
    "standard_bf16_out": _case("standard", dtype=torch.bfloat16),
    "online_fp32": _case("online"),
    "online_p_bf16": _case("online", "bf16"),
    "online_bf16_out": _case("online", dtype=torch.bfloat16),
}


def verdict(name: str, bound: torch.Tensor, err: torch.Tensor) -> str | None:
    """:func:`~ttrace_num.emulate.worst_case.sharp_verdict` of case ``name`` (also used by
    ``bench/mutation.py``)."""
    return sharp_verdict(name, bound, err, SHARP)


@pytest.mark.parametrize("name", sorted(CASES))
def test_worst_case_attains_bound(name: str) -> None:
    failure = verdict(name, *CASES[name]())
    assert failure is None, failure
