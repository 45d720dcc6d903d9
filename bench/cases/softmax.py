"""Bench cases of the softmax family: softmax, log_softmax, cross_entropy and Megatron's
vocab-parallel cross entropy, per format (fp32, bf16, fp16), data (random normal and
adversarial: peaked rows with underflowing exps, masked (-inf) entries, a +-1e4 spread,
a long row) and implementation (the torch CPU op, or the emulated computation model).

Shapes are small so that one trial (mpmath reference included) costs < 0.2 s."""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from bench.harness import Case
from ttrace_num.bounds.summation import Summation
from ttrace_num.emulate.softmax import (emulate_cross_entropy, emulate_log_softmax, emulate_softmax,
                                        emulate_vocab_parallel_cross_entropy)
from ttrace_num.formats import get_format
from ttrace_num.reference import ops as ref

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ROWS, COLS = 8, 128


def _maker(kind: str, fmt: str) -> Callable[[torch.Generator], tuple[tuple, dict]]:
    dt = DTYPES[fmt]
    big = 1e4 if fmt != "fp16" else 3e4

    def make(g: torch.Generator) -> tuple[tuple, dict]:
        if kind == "long":
            x = torch.randn(1, 2048, generator=g) * 3
        else:
            x = torch.randn(ROWS, COLS, generator=g) * 2
        if kind == "peaked":
            # one logit 1e3 above the rest (their exps underflow to 0) and one up to `depth`
            # below it (subnormal exps: fp32's range ends near e^-103, fp16's near e^-17)
            depth = 12.0 if fmt == "fp16" else 95.0
            x[:, 0] += 1e3
            x[:, 1] = x[:, 0] - depth * torch.rand(ROWS, generator=g)
        elif kind == "masked":
            x[:, torch.rand(COLS, generator=g) < 0.3] = -math.inf
        elif kind == "spread":
            x = (torch.rand(ROWS, COLS, generator=g) * 2 - 1) * big
            x[:, :16] = x.max(1, keepdim=True).values - 8 * torch.rand(ROWS, 16, generator=g)
        return (x.to(dt),), {}

    return make


def _softmax_cases() -> list[Case]:
    out: list[Case] = []
    ops = {"softmax": (torch.softmax, emulate_softmax, ref.softmax),
           "log_softmax": (torch.log_softmax, emulate_log_softmax, ref.log_softmax)}
    for op, (torch_op, emu, exact) in ops.items():
        run_torch = (lambda f: (lambda x: f(x, -1)))(torch_op)
        for fmt in DTYPES:
            out.append(Case(op, "normal", fmt, _maker("normal", fmt), run_torch, exact))
            out.append(Case(op, "normal", fmt, _maker("normal", fmt), emu, exact, implementation="emulated"))
            for kind in ("peaked", "masked", "spread", "long"):
                out.append(Case(op, kind, fmt, _maker(kind, fmt), run_torch, exact))
        summ = Summation(accum=get_format("bf16"), algorithm="pairwise")
        low = {"compute_fmt": "bf16", "summation": summ}
        out.append(Case(op, "normal, bf16 compute pairwise", "fp32", _maker("normal", "fp32"),
                        (lambda f: (lambda x: f(x, **low)))(emu), exact, bound_kwargs=low, implementation="emulated"))
    return out


def _ce_maker(fmt: str, reduction: str, ls: float) -> Callable[[torch.Generator], tuple[tuple, dict]]:
    def make(g: torch.Generator) -> tuple[tuple, dict]:
        x = (torch.randn(ROWS, COLS, generator=g) * 2).to(DTYPES[fmt])
        t = torch.randint(0, COLS, (ROWS,), generator=g)
        return (x, t), {"reduction": reduction, "label_smoothing": ls}

    return make


def _ce_exact(x: torch.Tensor, t: torch.Tensor, reduction: str, label_smoothing: float) -> torch.Tensor:
    return ref.cross_entropy(x, t, reduction=reduction, label_smoothing=label_smoothing)


def _ce_cases() -> list[Case]:
    out: list[Case] = []
    for fmt in DTYPES:
        for red in ("none", "mean"):
            mk = _ce_maker(fmt, red, 0.0)
            out.append(Case("cross_entropy", f"normal, {red}", fmt, mk, F.cross_entropy, _ce_exact))
            out.append(Case("cross_entropy", f"normal, {red}", fmt, mk, emulate_cross_entropy, _ce_exact,
                            implementation="emulated"))
        out.append(Case("cross_entropy", "normal, mean, label_smoothing=0.1", fmt, _ce_maker(fmt, "mean", 0.1),
                        F.cross_entropy, _ce_exact))
    return out


def _vp_cases() -> list[Case]:
    out: list[Case] = []
    for tp in (2, 4):
        for rf in ("fp32", "bf16"):
            def make(g: torch.Generator, tp=tp, rf=rf) -> tuple[tuple, dict]:
                x = torch.randn(ROWS, 2 * COLS, generator=g) * 2
                t = torch.randint(0, 2 * COLS, (ROWS,), generator=g)
                return (x, t), {"tp": tp, "reduce_fmt": rf}

            out.append(Case("vocab_parallel_cross_entropy", f"normal, tp={tp}, all-reduce {rf}", "fp32", make,
                            emulate_vocab_parallel_cross_entropy,
                            lambda x, t, **kw: ref.cross_entropy(x, t, reduction="none"), implementation="emulated"))
    return out


CASES: list[Case] = _softmax_cases() + _ce_cases() + _vp_cases()
