"""Bench cases of the FP8 / MX family: ``quantize`` (round trip through a low-precision format
under a scaling recipe), ``scaled_matmul`` (the GEMM of quantized operands) and
``quantized_matmul`` (quantize both operands, then the scaled GEMM, against the exact
product of the unquantized inputs).

``fmt`` is the storage format of the high-precision tensors (quantize, quantized_matmul) or
the output format (scaled_matmul); the element format and recipe are in the label.
``torch``: real casts (torch's fp8 dtypes, fp32 multiplies), ``torch._scaled_mm`` on CPU, and
torch's fp32 GEMM on fake-quantized operands (the ``"inputs"`` model).
``emulated``: :mod:`ttrace_num.emulate.fp8` with every step rounded by ``round_to``: FP6/FP4
formats, and the GPU ``"epilogue"`` model with a 14-bit tensor-core accumulator promoted
into fp32 every 128 products (DeepSeek-V3 §3.3.2).

Data: ``normal``; ``heavy`` (power-law tail); ``tiny`` (one element in 32 is large, the
others land in the subnormal range after scaling); ``spike`` (delayed scaling whose amax
history is 10x below the current amax: saturation).
"""
from __future__ import annotations

import torch

from bench.harness import Case
from ttrace_num import scaling
from ttrace_num.bounds.fp8 import ScaledGemm, expand_scale  # importing it registers the fp8 ops
from ttrace_num.emulate.fp8 import (cast_fake_quant, cast_quantized_matmul, emulate_fake_quant,
                                    emulate_quantized_matmul, emulate_scaled_matmul)
from ttrace_num.formats import get_format
from ttrace_num.reference.dot import exact_matmul

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _data(kind: str, shape: tuple[int, int], storage: str, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(shape, generator=g)
    if kind == "heavy":
        x = x / torch.rand(shape, generator=g).clamp_min(1e-2) ** 1.5  # stays inside fp16's range
    elif kind == "tiny":
        x = x * 10.0 ** (-6 + 4 * torch.rand(shape, generator=g))
        x[:, ::32] = 10.0
    return x.to(DTYPES[storage])


def _amax(kind: str, x: torch.Tensor):
    return x.float().abs().max() / 10 if kind == "spike" else None


# ------------------------------------------------------------------------------ quantize
QUANTIZE = [  # (element format, recipe, data)
    ("e4m3", "tensor", "normal"), ("e4m3", "tensor", "spike"), ("e5m2", "row", "heavy"),
    ("e4m3", "1x128", "tiny"), ("e4m3", "128x128", "normal"), ("e4m3", "mx32", "normal"),
    ("e4m3fnuz", "row", "normal"), ("e2m1", "mx32", "normal"), ("e3m2", "mx32", "heavy"), ("e2m3", "1x128", "tiny"),
]


def _quantize_maker(fmt: str, recipe: str, kind: str, storage: str):
    def make(g: torch.Generator) -> tuple[tuple, dict]:
        x = _data("normal" if kind == "spike" else kind, (128, 256), storage, g)
        return (x,), {"fmt": fmt, "recipe": recipe, "amax": _amax(kind, x)}
    return make


def _quantize_cases() -> list[Case]:
    out = []
    for storage in DTYPES:
        for fmt, recipe, kind in QUANTIZE if storage == "fp32" else QUANTIZE[:4]:  # fewer configs for bf16/fp16
            label = f"{fmt} {recipe} {kind}"
            exact = (lambda x, **kw: x.to(torch.float64))
            make = _quantize_maker(fmt, recipe, kind, storage)
            if get_format(fmt).torch_dtype is not None:
                out.append(Case("quantize", label, storage, make,
                                lambda x, fmt, recipe, amax: cast_fake_quant(x, fmt, recipe, amax), exact))
            out.append(Case("quantize", label, storage, make,
                            lambda x, fmt, recipe, amax: emulate_fake_quant(x, fmt, recipe, amax), exact,
                            implementation="emulated"))
    return out


# ------------------------------------------------------------------------------ scaled_matmul
def _scaled_maker(kind: str, recipe: str, shape: tuple[int, int, int], out: str):
    """Quantized operands (E4M3, B through B^T) and their dequantization scales."""
    def make(g: torch.Generator) -> tuple[tuple, dict]:
        m, k, n = shape
        a, b = _data(kind, (m, k), "fp32", g), _data(kind, (k, n), "fp32", g)
        qa, qbt = scaling.quantize(a, "e4m3", recipe), scaling.quantize(b.T, "e4m3", recipe)
        sb = qbt.scale_inv if qbt.scale_inv.dim() == 0 else qbt.scale_inv.T.contiguous()
        a8 = qa.values.to(torch.float8_e4m3fn)
        b8 = qbt.values.to(torch.float8_e4m3fn).T  # column-major
        return (a8, b8), {"scale_a": qa.scale_inv, "scale_b": sb, "out_fmt": out}
    return make


def _scaled_exact(a, b, scale_a, scale_b, out_fmt):
    m, k = a.shape
    n = b.shape[1]
    sa = expand_scale(scale_a, m, k, "scale_a")[0]
    sb = expand_scale(scale_b, k, n, "scale_b")[0]
    return exact_matmul(a.double() * sa, b.double() * sb)


def _scaled_mm(a, b, scale_a, scale_b, out_fmt):
    return torch._scaled_mm(a, b, scale_a.float(), scale_b.float(), out_dtype=DTYPES[out_fmt])


def _scaled_emulated(promotion: int):
    def run(a, b, scale_a, scale_b, out_fmt):
        return emulate_scaled_matmul(a, b, scale_a, scale_b, ScaledGemm(promotion_interval=promotion, out=out_fmt))
    return run


def _scaled_cases() -> list[Case]:
    out = []
    for o in DTYPES:
        for kind in ("normal", "heavy") if o != "fp16" else ("normal",):  # heavy overflows fp16
            for recipe in ("tensor", "row"):
                out.append(Case("scaled_matmul", f"e4m3 {recipe} {kind} K=1024", o,
                                _scaled_maker(kind, recipe, (32, 1024, 32), o), _scaled_mm, _scaled_exact,
                                {"scale_application": "inputs"}))
            for recipe in ("tensor", "1x128"):
                out.append(Case("scaled_matmul", f"e4m3 {recipe} {kind} K=256 promote/128 tc14", o,
                                _scaled_maker(kind, recipe, (16, 256, 16), o), _scaled_emulated(128), _scaled_exact,
                                {"promotion_interval": 128}, implementation="emulated"))
    return out


# ------------------------------------------------------------------------------ quantized_matmul
QMM = [  # (format of A, of B, recipe of A, of B^T, data)
    ("e4m3", "e4m3", "tensor", "tensor", "normal"), ("e4m3", "e4m3", "tensor", "tensor", "spike"),
    ("e4m3", "e5m2", "row", "row", "heavy"), ("e4m3", "e4m3", "1x128", "128x128", "normal"),
    ("e4m3", "e4m3", "mx32", "mx32", "normal"), ("e2m1", "e2m1", "mx32", "mx32", "normal"),
]


def _qmm_maker(fa: str, fb: str, ra: str, rb: str, kind: str, shape: tuple[int, int, int], storage: str):
    def make(g: torch.Generator) -> tuple[tuple, dict]:
        m, k, n = shape
        a = _data("normal" if kind == "spike" else kind, (m, k), storage, g)
        b = _data("normal" if kind == "spike" else kind, (k, n), storage, g)
        return (a, b), {"fmt_a": fa, "fmt_b": fb, "recipe_a": ra, "recipe_b": rb, "amax_a": _amax(kind, a)}
    return make


def _qmm_torch(a, b, fmt_a, fmt_b, recipe_a, recipe_b, amax_a):
    return cast_quantized_matmul(a, b, fmt_a=fmt_a, fmt_b=fmt_b, recipe_a=recipe_a, recipe_b=recipe_b,
                                 amax_a=amax_a, out_dtype=a.dtype)


def _qmm_emulated(a, b, fmt_a, fmt_b, recipe_a, recipe_b, amax_a):
    pi = 32 if recipe_a == "mx32" else 128
    return emulate_quantized_matmul(a, b, fmt_a=fmt_a, fmt_b=fmt_b, recipe_a=recipe_a, recipe_b=recipe_b,
                                    amax_a=amax_a, model=ScaledGemm(promotion_interval=pi, out=get_format(a.dtype)))


def _qmm_cases() -> list[Case]:
    out = []
    exact = (lambda a, b, **kw: exact_matmul(a, b))
    for storage in DTYPES:
        for fa, fb, ra, rb, kind in QMM if storage == "fp32" else QMM[:4]:  # fewer configs for bf16/fp16
            if storage == "fp16" and kind == "heavy":
                kind = "normal"  # the products of heavy-tailed operands overflow fp16
            label = f"{fa}x{fb} {ra}/{rb} {kind}"
            if fa != "e2m1":
                out.append(Case("quantized_matmul", label, storage,
                                _qmm_maker(fa, fb, ra, rb, kind, (32, 256, 128), storage), _qmm_torch, exact,
                                {"scale_application": "inputs", "out_fmt": storage}))
            pi = 32 if ra == "mx32" else 128
            out.append(Case("quantized_matmul", label + f" promote/{pi} tc14", storage,
                            _qmm_maker(fa, fb, ra, rb, kind, (8, 256, 128), storage), _qmm_emulated, exact,
                            {"promotion_interval": pi, "out_fmt": storage}, implementation="emulated"))
    return out


CASES = _quantize_cases() + _scaled_cases() + _qmm_cases()
