"""Bench cases of the reductions sum and mean, per format (fp32, bf16, fp16), data
(random normal; adversarial: all positive, cancellation, heavy tails, one peaked term,
long rows of 16384, subnormals, fp16 sums near overflow) and implementation (torch's
CPU reduction, or an emulation of a stated computation model: bf16/fp16 accumulation,
pairwise order, a split reduced in bf16).

The exact reference is ``ttrace_num.reference.dot.exact_sum`` (correctly rounded; the
mean divides it by ``n`` in float64). One trial costs a few ms."""
from __future__ import annotations

import math
from typing import Callable

import torch

from bench.harness import Case
from ttrace_num.bounds.summation import Summation
from ttrace_num.emulate.summation import emulate_mean, emulate_sum
from ttrace_num.reference.dot import exact_sum
from ttrace_num.rounding import round_to

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ROWS, COLS = 32, 1024


def _maker(kind: str, fmt: str) -> Callable[[torch.Generator], tuple[tuple, dict]]:
    def make(g: torch.Generator) -> tuple[tuple, dict]:
        m, n = (4, 16384) if kind == "long" else (ROWS, COLS)
        if kind in ("normal", "long"):
            x = torch.randn(m, n, generator=g)
        elif kind == "positive":
            x = torch.rand(m, n, generator=g)
        elif kind == "cancel":  # x, -x (1 + O(2^-6)): |sum| << sum |x|
            h = torch.randn(m, n // 2, generator=g)
            x = torch.cat([h, -h * (1 + 2.0 ** -6 * torch.randn(m, n // 2, generator=g))], dim=1)
        elif kind == "heavy":  # Cauchy-like times lognormal, scaled below fp16's top
            x = torch.tan(math.pi * (torch.rand(m, n, generator=g) - 0.5)).clamp(-1e4, 1e4) * torch.exp(torch.randn(m, n, generator=g))
            if fmt == "fp16":
                x = x * (30000 / float(x.abs().sum(-1).max()))
        elif kind == "peaked":  # one large term, the rest far below its ulp
            x = torch.randn(m, n, generator=g) * 2.0 ** -10
            x[:, 0] = 1000.0
        elif kind == "subnormal":
            x = torch.randn(m, n, generator=g) * (2.0 ** -20 if fmt == "fp16" else 2.0 ** -130)
        elif kind == "overflow":  # fp16 sums up to 0.9 * 65504
            x = 0.9 * 65504 / n * torch.rand(m, n, generator=g)
        else:
            raise ValueError(kind)
        return (round_to(x, fmt).to(DTYPES[fmt]),), {"dim": -1}

    return make


def _exact_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    return exact_sum(x, dim)


def _exact_mean(x: torch.Tensor, dim: int) -> torch.Tensor:
    return exact_sum(x, dim) / x.shape[dim]


def _cases() -> list[Case]:
    out: list[Case] = []
    ops = {"sum": (torch.sum, emulate_sum, _exact_sum), "mean": (torch.mean, emulate_mean, _exact_mean)}
    for op, (torch_op, emu, exact) in ops.items():
        for fmt in DTYPES:
            kinds = ["normal", "positive", "cancel", "heavy", "peaked", "long", "subnormal"]
            kinds += ["overflow"] if fmt == "fp16" else []
            for kind in kinds:
                out.append(Case(op, kind, fmt, _maker(kind, fmt), torch_op, exact))
            default = Summation()
            out.append(Case(op, "normal", fmt, _maker("normal", fmt),
                            (lambda f, o: (lambda x, dim: f(x, dim, default, o)))(emu, fmt), exact,
                            implementation="emulated"))
        for kind, fmt, summ, o in (("normal", "bf16", Summation(accum="bf16"), "bf16"),
                                   ("positive", "fp16", Summation(accum="fp16", algorithm="pairwise"), "fp16"),
                                   ("normal", "bf16", Summation(split=8, reduce_fmt="bf16"), "bf16")):
            out.append(Case(op, f"{kind}, {summ.describe()}", fmt, _maker(kind, fmt),
                            (lambda f, s, o_: (lambda x, dim: f(x, dim, s, o_)))(emu, summ, o), exact,
                            bound_kwargs={"summation": summ, "out_fmt": o}, implementation="emulated"))
    return out


CASES: list[Case] = _cases()
