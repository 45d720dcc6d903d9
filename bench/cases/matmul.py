"""Bench cases of the matmul family: matmul, bmm, linear (with bias), per format (fp32,
bf16, fp16), data (random normal; adversarial: all positive, cancellation, heavy tails,
a long K = 16384, subnormal products, fp16 outputs near overflow) and implementation
(the torch CPU kernel, or an emulation of a stated computation model: bf16/fp16
accumulation, pairwise/blocked orders, split-K reduced in bf16, FP8 storage).

fp16 GEMMs run through ``F.linear`` (``torch.mm`` in fp16 is ~100x slower on CPU).
The exact reference is ``ttrace_num.reference.dot.exact_matmul`` (correctly rounded).
Shapes keep one trial under ~0.2 s."""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from bench.harness import Case
from ttrace_num.bounds.summation import Summation
from ttrace_num.emulate.summation import emulate_matmul
from ttrace_num.formats import get_format
from ttrace_num.reference.dot import exact_matmul
from ttrace_num.rounding import round_to

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SHAPES = {"long": (4, 16384, 4), "subnormal": (16, 512, 16)}
DEFAULT_SHAPE = (32, 1024, 32)
EMULATED_SHAPE = (16, 1024, 16)


def _values(kind: str, m: int, k: int, n: int, fmt: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Operands on ``fmt``'s grid: torch tensors of its dtype (float32 for FP8 formats)."""
    if kind in ("normal", "long"):
        a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    elif kind == "positive":
        a, b = torch.rand(m, k, generator=g), torch.rand(k, n, generator=g)
    elif kind == "cancel":  # the second half of K cancels the first up to ~2**-8
        h, bh = torch.randn(m, k // 2, generator=g), torch.randn(k // 2, n, generator=g)
        a = torch.cat([h, h], dim=1)
        b = torch.cat([bh, -bh * (1 + 2.0 ** -8 * torch.randn(k // 2, n, generator=g))], dim=0)
    elif kind == "heavy":  # Cauchy-like entries times lognormal magnitudes
        a = torch.tan(math.pi * (torch.rand(m, k, generator=g) - 0.5)).clamp(-1e3, 1e3) * torch.exp(torch.randn(m, k, generator=g))
        b = torch.tan(math.pi * (torch.rand(k, n, generator=g) - 0.5)).clamp(-1e3, 1e3)
    elif kind == "overflow":  # |products| <= 0.9 * 65504 / K: fp16 results near the top of the range
        r = math.sqrt(0.9 * 65504 / k)
        a, b = r * torch.rand(m, k, generator=g), r * torch.rand(k, n, generator=g)
    elif kind == "subnormal":  # products below the normal range of the accumulation
        e = -8 if fmt == "fp16" else -70
        a, b = torch.randn(m, k, generator=g) * 2.0 ** e, torch.randn(k, n, generator=g) * 2.0 ** e
    else:
        raise ValueError(kind)
    f = get_format(fmt)
    a, b = round_to(a.clamp(-f.max / 2, f.max / 2), f), round_to(b.clamp(-f.max / 2, f.max / 2), f)
    if fmt == "fp16":  # keep |A||B| below fp16's top (heavy tails)
        s = float((a.abs() @ b.abs()).max())
        if s > 65504:
            a = round_to(a * 2.0 ** -math.ceil(math.log2(s / 32768)), f)
    dt = DTYPES.get(fmt, torch.float32)
    return a.to(dt), b.to(dt)


def _maker(kind: str, fmt: str, batch: int = 0, bias: bool = False, emulated: bool = False
           ) -> Callable[[torch.Generator], tuple[tuple, dict]]:
    m, k, n = SHAPES.get(kind, EMULATED_SHAPE if emulated else DEFAULT_SHAPE)

    def make(g: torch.Generator) -> tuple[tuple, dict]:
        if batch:
            pairs = [_values(kind, m, k, n, fmt, g) for _ in range(batch)]
            return (torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])), {}
        a, b = _values(kind, m, k, n, fmt, g)
        if bias:  # linear(x, weight, bias): weight = b^T (non-contiguous), a bias of the outputs' size
            bvec = round_to(8 * torch.randn(n, generator=g), fmt).to(a.dtype)
            return (a, b.T, bvec), {}
        return (a, b), {}

    return make


def _fp16_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp16 GEMMs through F.linear (2-D weights), one per batch entry."""
    if b.dim() == 2:
        return F.linear(a, b.T.contiguous())
    return torch.stack([F.linear(x, w.T.contiguous()) for x, w in zip(a, b)])


def _torch_matmul(fmt: str) -> Callable[..., torch.Tensor]:
    return _fp16_matmul if fmt == "fp16" else torch.matmul


def _exact_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    ones = torch.ones(*x.shape[:-1], 1, dtype=torch.float64)
    return exact_matmul(torch.cat([x.double(), ones], -1), torch.cat([w.double(), bias.double()[:, None]], -1).T)


def _tp(k: int, reduce_dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    """Row-parallel linear: k torch matmuls over contiguous K-slices, summed in order in
    ``reduce_dtype`` (an all-reduce as seen by one element), output in a's dtype. With an
    fp32 reduction the partial GEMMs run on fp32 copies of the operands (fp32 partials);
    otherwise each partial is the GEMM's output in a's dtype."""
    def run(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ks = a.shape[-1] // k
        if reduce_dtype == torch.float32:
            a, b, out = a.float(), b.float(), a.dtype
        else:
            out = a.dtype
        acc = None
        for i in range(k):
            p = (a[..., i * ks:(i + 1) * ks] @ b[i * ks:(i + 1) * ks]).to(reduce_dtype)
            acc = p if acc is None else acc + p
        return acc.to(out)

    return run


def _emulated(summ: Summation, out: str) -> Callable[..., torch.Tensor]:
    return lambda a, b: emulate_matmul(a, b, summ, out)


def _cases() -> list[Case]:
    out: list[Case] = []
    for fmt in DTYPES:
        run = _torch_matmul(fmt)
        kinds = ["normal", "positive", "cancel", "heavy", "long", "subnormal"] + (["overflow"] if fmt == "fp16" else [])
        for kind in kinds:
            out.append(Case("matmul", kind, fmt, _maker(kind, fmt), run, exact_matmul))
        out.append(Case("bmm", "normal, batch 4", fmt, _maker("normal", fmt, batch=4), run, exact_matmul))
        out.append(Case("linear", "normal, bias", fmt, _maker("normal", fmt, bias=True), F.linear, _exact_linear))
        # the model each precision's default accumulation implies, emulated
        out.append(Case("matmul", "normal", fmt, _maker("normal", fmt, emulated=True), _emulated(Summation(), fmt),
                        exact_matmul, implementation="emulated"))
    # tensor parallelism: 4 row-parallel partial GEMMs all-reduced in bf16 / fp32
    for fmt, red in (("bf16", torch.bfloat16), ("bf16", torch.float32), ("fp32", torch.bfloat16)):
        summ = Summation(split=4, reduce_fmt="bf16" if red == torch.bfloat16 else "fp32")
        out.append(Case("matmul", f"normal, TP4 {summ.reduce_fmt} all-reduce", fmt, _maker("normal", fmt), _tp(4, red),
                        exact_matmul, bound_kwargs={"summation": summ}))
    # emulated computation models no CPU kernel implements
    emulated = [  # (label, storage, summation, out)
        ("normal", "bf16", Summation(accum="bf16", algorithm="pairwise"), "bf16"),
        ("normal", "fp16", Summation(accum="fp16", algorithm="blocked", block=32), "fp16"),
        ("positive", "bf16", Summation(accum="bf16"), "fp32"),
        ("normal", "bf16", Summation(split=8, reduce_fmt="bf16"), "bf16"),
        ("cancel", "fp32", Summation(split=4, reduce_fmt="bf16", reduce_algorithm="pairwise"), "fp32"),
        ("normal", "e4m3", Summation(), "bf16"),
        ("normal", "e5m2", Summation(algorithm="blocked", block=64), "bf16"),
    ]
    for kind, storage, summ, o in emulated:
        kw = {"summation": summ, "fmt": storage, "out_fmt": o}
        out.append(Case("matmul", f"{kind}, {summ.describe()} -> {o}", storage, _maker(kind, storage, emulated=True),
                        _emulated(summ, o), exact_matmul, bound_kwargs=kw, implementation="emulated"))
    return out


CASES: list[Case] = _cases()
