"""Sharp tests of the deterministic summation / matmul / split-K bounds (issue 33).

Each case drives the terms of one bound to their worst case with the worst-case rounding
emulation (:mod:`ttrace_num.emulate.worst_case`: every rounding at its largest allowed
error, in the direction that increases the error; a legitimate execution of the model)
on inputs built so that the bound is attained: non-negative terms whose mass sits in the
first two terms of every part (the leaves of the longest path, so every level of the
tree acts on the full ``S``; with a split, in the first two parts, so that the reduction
acts on the full ``T``). Two assertions, so a case fails both ways:

* ``err <= bound`` everywhere (the bound is valid for this execution of its model);
* ``bound <= SHARP * err`` everywhere: the derivation (``docs/bounds.md``, module docstring
  of :mod:`ttrace_num.bounds.summation`) is first-order tight for these inputs, up to the
  rigorous slack of the statistics (``(K+1) u_w`` relative, ~4e-6): a bound that lost a
  term, or whose constant shrank by 1%, fails the first assertion; one that gained a
  spurious term fails the second.

Adversarial real computations (torch on stagnating positive data, subnormal products)
are checked against the exact reference (:func:`ttrace_num.reference.dot.exact_matmul`).
``CASES`` is also the probe set of ``bench/mutation.py``.
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch

import ttrace_num as tn
from ttrace_num.bounds.summation import Summation
from ttrace_num.emulate.summation import emulate_sum
from ttrace_num.emulate.worst_case import sharp_verdict, rel_round, worst_matmul, worst_sum
from ttrace_num.reference.dot import exact_matmul, exact_sum

#: first-order tightness of the bounds at their worst case: 1 + O(n u) (measured <= 1 + 1.4e-4, fp16 split-K partials)
SHARP = 1.0 + 5e-4
#: cases attained within a stated larger factor: flush to zero (see :func:`_flushed_products`);
#: gradual underflow, where the relative ``theta S`` part and the statistics' ``(K+1) eta_w``
#: slack are not attained by the same products (0.19%)
LOOSER = {"matmul_flushed_products": 2.01, "matmul_subnormal_products": 1.003}
K = 64


def _lead(rows: int, k: int, parts: int, lead_parts: int = 2, rest: float = 0.0) -> torch.Tensor:
    """Non-negative ``(rows, k)`` bf16 operand: 1 at the first two positions of the first
    ``lead_parts`` of ``parts`` contiguous parts, ``rest`` elsewhere."""
    a = torch.full((rows, k), rest)
    ps = -(-k // parts)
    for i in range(min(parts, lead_parts)):
        a[:, i * ps:i * ps + 2] = 1.0
    return a.bfloat16()


def _mm_case(summ: Summation, out: str, bias: float = 0.0, lead_parts: int = 2, rest: float = 0.0):
    """Mass in the first two products of the first ``lead_parts`` parts, ``rest`` elsewhere; a
    ``bias`` (the last term of the last part: one rounding in its part, so small unless the
    reduction dominates). ``rest = 2^-25`` is absorbed by the fp32 statistics (``fl(S) = 2 <
    S``): only their rigorous ``gamma_{K+1}`` slack keeps the bound above the emulation."""
    def case() -> tuple[torch.Tensor, torch.Tensor]:
        a = _lead(3, K, summ.split, lead_parts, rest)
        b = torch.ones(K, 2, dtype=a.dtype)
        bi = torch.full((2,), bias, dtype=a.dtype) if bias else None
        bound = tn.tolerance("matmul", a, b, bias=bi, out_fmt=out, summation=summ).abs
        exact = exact_matmul(a, b) + (0.0 if bi is None else bi.double())
        worst = worst_matmul(a, b, bi, summation=summ, out_fmt=out)
        return bound, (worst - exact).abs()
    return case


def _sum_case(summ: Summation, out: str):
    def case() -> tuple[torch.Tensor, torch.Tensor]:
        x = _lead(2, K, summ.split)
        bound = tn.tolerance("sum", x, dim=-1, out_fmt=out, summation=summ).abs
        worst = worst_sum(x.double(), summ)
        return bound, (worst - exact_sum(x.double(), dim=-1)).abs()
    return case


def _fp32_products() -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 inputs in fp32: the products are rounded too (one more level, leaf_depths)."""
    a = _lead(2, K, 1).float() * (1 + 2.0 ** -12)
    b = torch.full((K, 2), 1 + 2.0 ** -13)
    bound = tn.tolerance("matmul", a, b).abs
    return bound, (worst_matmul(a, b, summation=Summation()) - exact_matmul(a, b)).abs()


def _binade_crossing() -> tuple[torch.Tensor, torch.Tensor]:
    """``y = 2 - 2^-22`` just below a power of two, accumulated error pushing it above: the
    output rounding must be taken at ``|y| + acc`` (half an ulp of bf16 at 2, not below 2)."""
    a = torch.zeros(2, K)
    a[:, 0], a[:, 1] = 1.0, 1.0 - 2.0 ** -22
    b = torch.ones(K, 2)
    bound = tn.tolerance("matmul", a, b, out_fmt="bf16").abs
    worst = worst_matmul(a, b, summation=Summation(), out_fmt="bf16")
    return bound, (worst - exact_matmul(a, b)).abs()


def _subnormal_products() -> tuple[torch.Tensor, torch.Tensor]:
    """Gradual underflow (``ftz=False``): bf16 products in fp32's subnormal range, each may
    err by the absolute ``eta = 2^-150`` (the underflow term ``sum_f r_f eta_f``, dominant here)."""
    a = torch.full((2, K), 2.0 ** -70 * (1 + 2.0 ** -7)).bfloat16()
    b = torch.full((K, 2), 2.0 ** -70 * (1 + 2.0 ** -7)).bfloat16()
    summ = Summation(ftz=False)
    bound = tn.tolerance("matmul", a, b, out_fmt="fp32", summation=summ).abs
    eta = tn.formats.get_format("fp32").subnormal_abs_error
    terms = a.double()[:, None, :] * b.double().T[None, :, :] + eta      # every product rounded up by eta
    return bound, (worst_sum(terms, summ) - exact_matmul(a, b)).abs()


def _flushed_products() -> tuple[torch.Tensor, torch.Tensor]:
    """Flush to zero (the default model): products just below fp32's normal range, all
    flushed (the computed result is 0, the error the exact sum ``K (1 - 2^-8) 2^-126``).
    The bound charges ``min_normal`` to each of the ``2K - 1`` roundings (products and
    additions); a flushed sum's additions add zeros, so it is attained within
    ``(2K - 1) / (K (1 - 2^-8)) < 2.01``: this case uses :data:`FTZ_SHARP`."""
    a = torch.full((2, K), 2.0 ** -63).bfloat16()
    b = torch.full((K, 2), 2.0 ** -63 * (1 - 2.0 ** -8)).bfloat16()
    bound = tn.tolerance("matmul", a, b, out_fmt="fp32").abs
    return bound, exact_matmul(a, b).abs()


CASES: dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]] = {
    "matmul_fp32out": _mm_case(Summation(), "fp32"),
    "matmul_bf16out": _mm_case(Summation(), "bf16"),
    "matmul_bias_fp32out": _mm_case(Summation(), "fp32", bias=2.0 ** -20),
    "matmul_bf16accum": _mm_case(Summation(accum="bf16"), "fp32"),
    "matmul_pairwise": _mm_case(Summation(algorithm="pairwise"), "fp32"),
    "matmul_blocked": _mm_case(Summation(algorithm="blocked", block=8), "fp32"),
    "matmul_fp32_products": _fp32_products,
    "matmul_binade_crossing": _binade_crossing,
    "matmul_subnormal_products": _subnormal_products,
    "matmul_flushed_products": _flushed_products,
    **{f"splitk{k}_{rf}_{alg}": _mm_case(Summation(split=k, reduce_fmt=rf, reduce_algorithm=alg), "fp32")
       for k in (2, 4) for rf in ("fp32", "bf16") for alg in ("recursive", "pairwise")},
    "splitk4_bf16_bf16out": _mm_case(Summation(split=4, reduce_fmt="bf16"), "bf16"),
    "splitk4_fp16_bias": _mm_case(Summation(split=4, reduce_fmt="fp16"), "fp32", bias=2.0 ** -20),
    "matmul_absorbed_tail": _mm_case(Summation(), "fp32", rest=2.0 ** -25),
    "splitk2_bf16_absorbed_tail": _mm_case(Summation(split=2, reduce_fmt="bf16"), "fp32", rest=2.0 ** -25),
    # the bias carries the last part's mass: the bf16 reduction acts on T = |p_1| + |bias|
    "splitk2_bf16_bias_partial": _mm_case(Summation(split=2, reduce_fmt="bf16"), "fp32", bias=1.0, lead_parts=1),
    "sum_fp32out": _sum_case(Summation(), "fp32"),
    "sum_bf16accum": _sum_case(Summation(accum="bf16"), "fp32"),
    "sum_split4_bf16": _sum_case(Summation(split=4, reduce_fmt="bf16"), "fp32"),
}


def verdict(name: str, bound: torch.Tensor, err: torch.Tensor) -> str | None:
    """:func:`~ttrace_num.emulate.worst_case.sharp_verdict` of case ``name`` (also used by
    ``bench/mutation.py``)."""
    return sharp_verdict(name, bound, err, LOOSER.get(name, SHARP))


@pytest.mark.parametrize("name", sorted(CASES))
def test_worst_case_attains_bound(name: str) -> None:
    failure = verdict(name, *CASES[name]())
    assert failure is None, failure


def test_stagnating_positive_sum_real_kernel() -> None:
    """Adversarial data for a real kernel: 1 followed by terms just below half an ulp of the
    running sum (bf16 accumulation stagnates: every rounding errs downwards by almost u).
    The emulated bf16 chain is within the bound, and attains it within 1 + O(K u)."""
    x = torch.cat([torch.ones(1, 1), torch.full((1, 31), 2.0 ** -8 * (1 - 2.0 ** -8))], 1).bfloat16()
    summ = Summation(accum="bf16")
    got = emulate_sum(x, -1, summ, "bf16")
    exact = exact_sum(x.double(), dim=-1)
    bound = tn.tolerance("sum", x, dim=-1, summation=summ).abs
    err = (got.double() - exact).abs()
    assert (err <= bound).all()
    assert (bound <= 1.25 * err).all()  # theta S (S ~ 1.12) + half_ulp_out vs 31 u (1 - 2^-8): 1.19


def test_worst_sum_is_the_model() -> None:
    """The emulation is the model: rounding every node up by u on a 2-term chain is (a+b)(1+u)."""
    x = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    assert float(worst_sum(x, Summation())) == float(rel_round(torch.tensor(3.0, dtype=torch.float64),
                                                               tn.formats.get_format("fp32"), 1.0))
