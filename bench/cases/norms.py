"""Bench cases of the normalisation family: layer_norm and rms_norm, per format (fp32,
bf16, fp16), data (random normal; adversarial: large mean with small variance, near-constant
rows where eps dominates, heavy tails, a long row) and implementation (the torch CPU op, or
an emulation of the stated model: every operation rounded (no FMA), the two-pass model,
and the whole computation in bf16/fp16).

Shapes are small so that one trial (mpmath reference included) costs < 0.2 s."""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from bench.harness import Case
from ttrace_num.bounds.summation import Summation
from ttrace_num.emulate import norms as EN
from ttrace_num.reference import ops as ref

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ROWS, N = 4, 1024
EPS = {"layer_norm": 1e-5, "rms_norm": 1e-6}


def _maker(op: str, kind: str, fmt: str) -> Callable[[torch.Generator], tuple[tuple, dict]]:
    dt = DTYPES[fmt]

    def make(g: torch.Generator) -> tuple[tuple, dict]:
        n = 8192 if kind == "long" else N
        rows = 1 if kind == "long" else ROWS
        x = torch.randn(rows, n, generator=g)
        if kind == "shift":  # cancellation in x - mu (fp32: kappa = 1e4)
            x = x + (1e4 if fmt == "fp32" else 100.0)
        elif kind == "nearconst":  # sigma ~ 1e-4: r close to eps^-1/2
            x = 3.0 + 1e-4 * x
        elif kind == "heavy":  # 1% outliers 1e3 times larger
            x = x * torch.where(torch.rand(rows, n, generator=g) < 0.01, 1e3, 1.0)
        w = torch.randn(n, generator=g).to(dt)
        kw = {"normalized_shape": [n], "weight": w, "eps": EPS[op]}
        if op == "layer_norm":
            kw["bias"] = torch.randn(n, generator=g).to(dt)
        return (x.to(dt),), kw

    return make


def _cases() -> list[Case]:
    out: list[Case] = []
    torch_ops = {"layer_norm": F.layer_norm, "rms_norm": F.rms_norm}
    exact = {"layer_norm": ref.layer_norm, "rms_norm": ref.rms_norm}
    for op in ("layer_norm", "rms_norm"):
        for fmt in DTYPES:
            for kind in ("normal", "shift", "nearconst", "heavy", "long"):
                out.append(Case(op, kind, fmt, _maker(op, kind, fmt), torch_ops[op], exact[op]))
        for fmt in DTYPES:
            mk = _maker(op, "normal", fmt)
            if op == "layer_norm":
                out.append(Case(op, "normal, every op rounded (no FMA)", fmt, mk,
                                lambda x, **kw: EN.layer_norm(x, fma=False, **kw), exact[op], implementation="emulated"))
                out.append(Case(op, "normal, two-pass model", fmt, mk,
                                lambda x, **kw: EN.layer_norm(x, moments_model="two_pass", **kw), exact[op],
                                bound_kwargs={"moments": "two_pass"}, implementation="emulated"))
            else:
                rec = {"summation": Summation(accum="fp32")}
                out.append(Case(op, "normal, recursive sum, correctly rounded rsqrt", fmt, mk,
                                partial(EN.rms_norm, rsqrt="correctly_rounded", **rec), exact[op],
                                bound_kwargs={"library": "correctly_rounded", **rec}, implementation="emulated"))
            if fmt != "fp32":
                emu = EN.layer_norm if op == "layer_norm" else EN.rms_norm
                out.append(Case(op, f"normal, {fmt} compute", fmt, mk, partial(emu, compute_fmt=fmt), exact[op],
                                bound_kwargs={"compute_fmt": fmt}, implementation="emulated"))
    return out


CASES: list[Case] = _cases()
