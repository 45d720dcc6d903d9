"""Shared machinery of the bounds benchmark (``bench/bounds_table.py``).

A :class:`Case` is one operator on one kind of data in one format: how to draw inputs,
how to compute the op (the real torch CPU op, or an emulation of the stated computation
model), and its exact reference. :func:`evaluate` draws ``trials`` instances and reports
violations and tightness.

A case runs in the modes of ``Case.modes`` (default deterministic and probabilistic; the
statistical rows of ``bench/cases/statistical.py`` declare theirs, for ops in
:data:`ttrace_num.bounds.statistical.STATISTICAL_OPS`), ``Case.trials`` instances when set (the
statistical rows' >= 10^4), else the table's ``--trials``.
For the probabilistic and statistical modes the violations are tested against the claimed
per-element rate ``p``: :func:`binomial_tail` is ``P(X >= violations)`` for ``X ~ Binomial(
elements, p)`` (one-sided: a small value means more violations than the claim allows).

Tightness of one instance = ``min_i bound_i / err_i`` = ``1 / max_i (err_i / bound_i)``:
how close the instance's worst element comes to the bound (1 = attained, 4 = the worst
element used a quarter of its budget). Elements with zero error are ignored; an instance
whose elements all have zero error has tightness ``inf`` (reported separately as ``exact``).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import ttrace_num as tn
from ttrace_num.bounds.statistical import STATISTICAL_OPS


@dataclass
class Case:
    op: str
    label: str
    fmt: str
    make: Callable[[torch.Generator], tuple[tuple, dict]]
    run: Callable[..., torch.Tensor]
    exact: Callable[..., torch.Tensor]
    bound_kwargs: dict[str, Any] = field(default_factory=dict)
    implementation: str = "torch"  # or "emulated"
    modes: tuple[str, ...] = ("deterministic", "probabilistic")
    trials: int | None = None  # None: the table's --trials

    def __post_init__(self) -> None:
        if "statistical" in self.modes and self.op not in STATISTICAL_OPS:
            raise ValueError(f"case {self.op} / {self.label}: mode 'statistical' is for {STATISTICAL_OPS}")


@dataclass
class Result:
    op: str
    label: str
    fmt: str
    implementation: str
    mode: str
    trials: int
    elements: int
    violations: int
    claimed_rate: float
    exact_instances: int
    tight_median: float
    tight_max: float

    @property
    def p_value(self) -> float:
        """One-sided binomial test of the violations at the claimed per-element rate."""
        return binomial_tail(self.violations, self.elements, self.claimed_rate)

    def row(self) -> list[str]:
        viol = str(self.violations)
        if self.mode == "statistical":
            viol += f" of {self.elements:.3g} (p={self.p_value:.2g})"
        return [self.op, self.label, self.fmt, self.implementation, self.mode, str(self.trials),
                viol, f"{self.tight_median:.3g}", f"{self.tight_max:.3g}"]


def binomial_tail(k: int, n: int, p: float) -> float:
    """``P(X >= k)``, ``X ~ Binomial(n, p)`` (1 for ``k = 0``; 0 when ``p = 0 < k``), summed in
    log space from ``k`` up to where the terms fall below 1e-300 of the first."""
    if k <= 0:
        return 1.0
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    logp, log1p_ = math.log(p), math.log1p(-p)
    terms = []
    for i in range(k, n + 1):
        t = math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * logp + (n - i) * log1p_
        terms.append(t)
        if t < terms[0] - 700 or (i > k + 10 and t < max(terms) - 40):
            break
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def evaluate(case: Case, mode: str, trials: int, seed: int = 0) -> Result:
    g = torch.Generator().manual_seed(seed)
    violations = elements = exact_inst = 0
    tights: list[float] = []
    claimed = 0.0
    for _ in range(trials):
        inputs, kwargs = case.make(g)
        computed = case.run(*inputs, **kwargs).to(torch.float64)
        exact = case.exact(*inputs, **kwargs).to(torch.float64)
        bound = tn.tolerance(case.op, *inputs, mode=mode, **{**kwargs, **case.bound_kwargs})
        b = torch.broadcast_to(bound.abs, exact.shape)
        err = (computed - exact).abs()
        both_nan = torch.isnan(computed) & torch.isnan(exact)
        err = torch.where(both_nan, torch.zeros_like(err), err)
        violations += int((err > b).sum())
        elements += err.numel()
        claimed = bound.failure_probability
        nz = err > 0
        if nz.any():
            tights.append(float((b[nz] / err[nz]).min()))
        else:
            exact_inst += 1
    finite = [t for t in tights if math.isfinite(t)]
    return Result(case.op, case.label, case.fmt, case.implementation, mode, trials, elements, violations, claimed,
                  exact_inst, statistics.median(finite) if finite else math.inf, max(finite) if finite else math.inf)
