"""Bench cases of the elementwise family: gelu (erf and tanh forms), silu, swiglu
(Megatron) and the residual add, per format (fp32, bf16, fp16), data (random normal; the
whole range: log-spaced magnitudes of both signs down to subnormals and up to the format's
limit; the left tail where gelu(x) ~ 0 and the small-|x| region where torch's erf
approximation errs most) and implementation (the torch CPU op, or the emulation of the
stated model with correctly rounded elementary functions, in fp32 or in bf16/fp16).

One trial is ~1000 elements (mpmath reference < 0.2 s)."""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from bench.harness import Case
from ttrace_num.emulate import activations as EA
from ttrace_num.reference import ops as ref
from ttrace_num.reference.dot import exact_sum

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SIZE = 1000
LIMIT = {"fp32": 38.0, "bf16": 38.0, "fp16": 4.5}  # log10 of the largest finite magnitude (about)
TINY = {"fp32": -44.0, "bf16": -40.0, "fp16": -7.5}  # log10 of the smallest subnormal (about)
CR = {"library": "correctly_rounded"}


def _values(kind: str, fmt: str, g: torch.Generator, n: int = SIZE) -> torch.Tensor:
    if kind == "normal":
        x = torch.randn(n, generator=g) * 3
    elif kind == "range":
        e = torch.rand(n, generator=g, dtype=torch.float64) * (LIMIT[fmt] - TINY[fmt]) + TINY[fmt]
        x = (torch.sign(torch.randn(n, generator=g, dtype=torch.float64)) * 10.0 ** e).float()
    elif kind == "tails":  # gelu(x) ~ 0 for x << 0, and 2^-8 <= |x| < 0.5
        x = torch.cat([-torch.rand(n // 2, generator=g) * 30 - 4,
                       torch.exp2(torch.rand(n - n // 2, generator=g) * 7 - 8) * torch.sign(torch.randn(n - n // 2, generator=g))])
    else:
        raise ValueError(kind)
    x = x.to(DTYPES[fmt])
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _maker(kind: str, fmt: str, kw: dict) -> Callable[[torch.Generator], tuple[tuple, dict]]:
    def make(g: torch.Generator) -> tuple[tuple, dict]:
        return (_values(kind, fmt, g),), dict(kw)

    return make


def _elementwise_cases() -> list[Case]:
    out: list[Case] = []
    ops = {
        "gelu": ("gelu", {}, lambda x, **kw: F.gelu(x, **kw), ref.gelu, EA.gelu),
        "gelu(tanh)": ("gelu", {"approximate": "tanh"}, lambda x, **kw: F.gelu(x, **kw), ref.gelu, EA.gelu),
        "silu": ("silu", {}, lambda x: F.silu(x), ref.silu, EA.silu),
    }
    for label, (op, kw, run, exact, emu) in ops.items():
        tag = "" if label == op else " tanh"
        for fmt in DTYPES:
            for kind in ("normal", "range", "tails"):
                out.append(Case(op, kind + tag, fmt, _maker(kind, fmt, kw), run, exact))
            out.append(Case(op, "normal" + tag, fmt, _maker("normal", fmt, kw), emu, exact, bound_kwargs=CR,
                            implementation="emulated"))
            if fmt != "fp32":
                out.append(Case(op, f"range{tag}, {fmt} compute", fmt, _maker("range", fmt, kw),
                                partial(emu, compute_fmt=fmt), exact,
                                bound_kwargs={"compute_fmt": fmt}, implementation="emulated"))
    return out


def _swiglu_eager(x: torch.Tensor) -> torch.Tensor:
    a, b = torch.chunk(x, 2, dim=-1)
    return F.silu(a) * b


def _swiglu_cases() -> list[Case]:
    out: list[Case] = []
    for fmt, dt in DTYPES.items():
        def make(g: torch.Generator, dt=dt) -> tuple[tuple, dict]:
            return ((torch.randn(8, 256, generator=g) * 3).to(dt),), {}

        out.append(Case("swiglu", "normal, eager (Megatron)", fmt, make, _swiglu_eager, ref.swiglu))
        out.append(Case("swiglu", "normal, fused (one rounding)", fmt, make, lambda x: EA.swiglu(x, fused=True),
                        ref.swiglu, bound_kwargs={"fused": True, **CR}, implementation="emulated"))
    return out


def _add_cases() -> list[Case]:
    out: list[Case] = []
    for fmt in DTYPES:
        for kind in ("normal", "range"):
            def make(g: torch.Generator, fmt=fmt, kind=kind) -> tuple[tuple, dict]:
                return (_values("normal", fmt, g, 4096), _values(kind, fmt, g, 4096)), {}

            out.append(Case("add", kind, fmt, make, torch.add, lambda x, y: exact_sum(torch.stack([x, y]), dim=0)))
        if fmt != "fp32":
            def make32(g: torch.Generator, fmt=fmt) -> tuple[tuple, dict]:
                return (_values("normal", fmt, g, 4096), _values("normal", fmt, g, 4096)), {}

            out.append(Case("add", f"normal, {fmt} compute", fmt, make32,
                            partial(EA.add, compute_fmt=fmt),
                            lambda x, y: exact_sum(torch.stack([x, y]), dim=0),
                            bound_kwargs={"compute_fmt": fmt}, implementation="emulated"))
    return out


CASES: list[Case] = _elementwise_cases() + _swiglu_cases() + _add_cases()
