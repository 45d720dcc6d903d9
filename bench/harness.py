"""Shared machinery of the bounds benchmark (``bench/bounds_table.py``).

A :class:`Case` is one operator on one kind of data in one format: how to draw inputs,
how to compute the op (the real torch CPU op, or an emulation of the stated computation
model), and its exact reference. :func:`evaluate` draws ``trials`` instances and reports
violations and tightness.

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

    def row(self) -> list[str]:
        return [self.op, self.label, self.fmt, self.implementation, self.mode, str(self.trials),
                str(self.violations), f"{self.tight_median:.3g}", f"{self.tight_max:.3g}"]


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
