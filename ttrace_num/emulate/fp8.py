r"""Emulation of the FP8 / MX computation models of :mod:`ttrace_num.bounds.fp8`, with every
intermediate rounded to its stated format by :func:`~ttrace_num.rounding.round_to`.

* :func:`emulate_fake_quant`: ``x -> t = fl_c(x s) -> q = RN_fmt(t) (saturating) ->
  fl_c(q s_inv)`` (or ``fl_c(q / s)``) ``-> out_fmt``; the scales are those of
  :func:`ttrace_num.scaling.quantize` (which itself computes ``x s`` exactly, i.e. the
  model with ``compute_fmt="fp64"``). The products ``x s`` and ``q s_inv`` of numbers of at
  most 24 significant bits are exact in float64, so ``round_to`` of them is the single
  correct rounding; ``q / s`` is rounded twice (float64, then ``c``), which is innocuous
  for ``p_c <= 25`` (Figueroa, "When is double rounding innocuous?", SIGNUM 1995).
* :func:`emulate_scaled_matmul`: ``(S_a Q_a)(Q_b S_b)`` as
  :class:`~ttrace_num.bounds.fp8.ScaledGemm` states: ``"epilogue"``: exact products, chains
  of ``N_c`` in the inner accumulator, partials promoted into an ``accum`` chain, scales
  multiplied at the end (constant along K) or on each partial at promotion (varying along
  K); ``"inputs"``: ``fl(Q s)`` operands, then a GEMM in ``accum`` with rounded products.
  Built on :func:`ttrace_num.emulate.summation.emulate_matmul` / ``emulate_terms``
  (recursive chains), vectorised over the outputs.
* :func:`emulate_quantized_matmul`: both at once (``B`` quantized through ``B^T``).

Real-cast counterparts (no ``round_to``; the kernels the models describe, run on the CPU):
:func:`cast_fake_quant` is a TE-style fp32 kernel with torch's own fp8 casts (ml_dtypes'
casts for FP6/FP4, which torch lacks), and :func:`cast_quantized_matmul` multiplies two such
fake-quantized operands with torch's fp32 GEMM, i.e. the ``"inputs"`` model that
``torch._scaled_mm`` implements on CPU, for every recipe.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import torch

from .. import scaling
from ..bounds.fp8 import ScaledGemm, expand_scale
from ..bounds.summation import Summation
from ..formats import FloatFormat, get_format
from ..rounding import round_to
from .summation import emulate_matmul, emulate_terms

__all__ = ["emulate_quantize", "emulate_fake_quant", "emulate_scaled_matmul", "emulate_quantized_matmul",
           "cast_fake_quant", "cast_quantized_matmul"]


def emulate_quantize(x: torch.Tensor, fmt: "FloatFormat | str", recipe: "scaling.ScalingRecipe | str" = "tensor",
                     amax=None, compute_fmt: "FloatFormat | str" = "fp32") -> scaling.Quantized:
    """:func:`ttrace_num.scaling.quantize` with ``x * s`` rounded to ``compute_fmt`` before the
    saturating rounding to ``fmt`` (what a TE cast kernel does in fp32). Same scales."""
    qz = scaling.quantize(x, fmt, recipe, amax)
    x64 = x.detach().to(torch.float64)
    if qz.recipe.granularity == "mx":
        t = x64 / qz.expand(qz.scale_inv)  # exact division by a power of two
    else:
        t = x64 * qz.expand(qz.scale)  # exact for x, s of <= 26 bits each
    t = round_to(t, compute_fmt)
    values = round_to(t, qz.fmt, overflow="saturate")
    return scaling.Quantized(values=values, scale=qz.scale, recipe=qz.recipe, fmt=qz.fmt, amax=qz.amax,
                             saturated=t.abs() > qz.fmt.max)


def emulate_fake_quant(x: torch.Tensor, fmt: "FloatFormat | str", recipe: "scaling.ScalingRecipe | str" = "tensor",
                       amax=None, *, compute_fmt: "FloatFormat | str" = "fp32", dequant: str = "scale_inv",
                       out_fmt: "FloatFormat | str | None" = None) -> torch.Tensor:
    """``dequantize(quantize(x))`` with the roundings of the model of
    :func:`ttrace_num.bounds.fp8.quantize`; float64 result on ``out_fmt``'s grid."""
    c = get_format(compute_fmt)
    qz = emulate_quantize(x, fmt, recipe, amax, c)
    if dequant == "scale_inv":
        y = qz.values * qz.expand(qz.scale_inv)
    elif dequant == "divide":
        y = qz.values / qz.expand(qz.scale)
    else:
        raise ValueError(f"dequant must be 'scale_inv' or 'divide', got {dequant!r}")
    y = round_to(y, c)
    return round_to(y, out_fmt) if out_fmt is not None else y


def _mul(x: torch.Tensor, s: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """``fl_fmt(x * s)`` (the float64 product of two values of <= 26 bits is exact)."""
    return round_to(x * s, fmt)


def emulate_scaled_matmul(a: torch.Tensor, b: torch.Tensor, scale_a, scale_b, model: ScaledGemm | None = None
                          ) -> torch.Tensor:
    """``(scale_a . a) @ (b . scale_b)`` computed as ``model`` states (default
    ``ScaledGemm()``: fp32 accumulation, scales in the epilogue, fp32 output); ``a`` (M,K)
    and ``b`` (K,N) hold values on their formats' grids; scales as in
    :func:`ttrace_num.bounds.fp8.scaled_matmul`. Returns float64 on ``model.out``'s grid."""
    model = model or ScaledGemm()
    acc = model.accum
    a64, b64 = a.detach().to(torch.float64), b.detach().to(torch.float64)
    (m, k), n = a64.shape, b64.shape[1]
    sa, _, kb_a = expand_scale(scale_a, m, k, "scale_a")
    sb, kb_b, _ = expand_scale(scale_b, k, n, "scale_b")
    if model.scale_application == "inputs":
        return emulate_matmul(_mul(a64, sa, acc), _mul(b64, sb, acc), Summation(accum=acc), model.out)
    blk, nb, varying = model.blocking(k, math.gcd(kb_a, kb_b))
    inner = model.inner
    pad = nb * blk - k
    if pad:  # zero padding: exact zeros added at the end of the last chain
        a64 = torch.cat([a64, a64.new_zeros(m, pad)], dim=1)
        b64 = torch.cat([b64, b64.new_zeros(pad, n)], dim=0)
        sa = torch.cat([sa, sa[:, -1:].expand(m, pad)], dim=1)
        sb = torch.cat([sb, sb[-1:, :].expand(pad, n)], dim=0)
    if not varying:
        summ = Summation(accum=inner, split=nb, reduce_fmt=acc) if nb > 1 else Summation(accum=inner)
        y = round_to(emulate_matmul(a64, b64, summ, summ.final_fmt), acc)
        y = _mul(_mul(y, sa[:, :1], acc), sb[:1, :], acc)
        return round_to(y, model.out)
    partials = []
    for j in range(nb):
        ks = slice(j * blk, (j + 1) * blk)
        p = round_to(emulate_matmul(a64[:, ks], b64[ks, :], Summation(accum=inner), inner), acc)
        partials.append(_mul(_mul(p, sa[:, j * blk:j * blk + 1], acc), sb[j * blk:j * blk + 1, :], acc))
    return emulate_terms(torch.stack(partials, dim=-1), Summation(accum=acc), model.out)


def emulate_quantized_matmul(a: torch.Tensor, b: torch.Tensor, *, fmt_a: "FloatFormat | str" = "e4m3",
                             fmt_b: "FloatFormat | str" = "e4m3", recipe_a: "scaling.ScalingRecipe | str" = "tensor",
                             recipe_b: "scaling.ScalingRecipe | str" = "tensor", amax_a=None, amax_b=None,
                             model: ScaledGemm | None = None) -> torch.Tensor:
    """Quantize ``a`` and ``b.T`` (recipes along K, ``x s`` rounded to ``model.accum``), then
    :func:`emulate_scaled_matmul` with the ``scale_inv`` dequantization scales."""
    model = model or ScaledGemm()
    qa = emulate_quantize(a, fmt_a, recipe_a, amax_a, model.accum)
    qbt = emulate_quantize(b.transpose(0, 1), fmt_b, recipe_b, amax_b, model.accum)
    sb = qbt.scale_inv
    return emulate_scaled_matmul(qa.values, qbt.values.transpose(0, 1), qa.scale_inv,
                                 sb if sb.dim() == 0 else sb.transpose(0, 1), model)


def _cast(t: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """fp32 ``t`` cast to ``fmt`` by torch (fp8 dtypes) or ml_dtypes
    (FP6/FP4), round to nearest even, and back to fp32 (exact)."""
    if fmt.torch_dtype is not None:
        return t.to(fmt.torch_dtype).float()
    if fmt.ml_dtypes_name is None:
        raise ValueError(f"format {fmt} has neither a torch nor an ml_dtypes dtype; use emulate_fake_quant")
    return torch.from_numpy(t.numpy().astype(getattr(ml_dtypes, fmt.ml_dtypes_name)).astype(np.float32))


def cast_fake_quant(x: torch.Tensor, fmt: "FloatFormat | str", recipe: "scaling.ScalingRecipe | str" = "tensor",
                    amax=None, saturate: bool = True) -> torch.Tensor:
    """What a TE-style fp32 kernel computes, with real casts: ``t = fp32(x * s)`` (MX: ``x *
    (1/X)``, exact), clamp to ``+-fmt.max`` (saturation; ``saturate=False``: no clamp, the cast's
    own overflow: torch's ``e5m2`` gives ``inf``, ``fnuz`` NaN), cast to ``fmt``, ``fp32(q * scale_inv)``;
    scales from :func:`ttrace_num.scaling.quantize`. Returns float64 (fp32 values)."""
    f = get_format(fmt)
    qz = scaling.quantize(x, f, recipe, amax)
    s, s_inv = qz.expand(qz.scale).float(), qz.expand(qz.scale_inv).float()
    t = x.float() * s
    if saturate:
        t = t.clamp(-f.max, f.max)
    return (_cast(t, f) * s_inv).double()


def cast_quantized_matmul(a: torch.Tensor, b: torch.Tensor, *, fmt_a: "FloatFormat | str" = "e4m3",
                          fmt_b: "FloatFormat | str" = "e4m3", recipe_a: "scaling.ScalingRecipe | str" = "tensor",
                          recipe_b: "scaling.ScalingRecipe | str" = "tensor", amax_a=None, amax_b=None,
                          out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``cast_fake_quant(a) @ cast_fake_quant(b.T).T`` by torch's fp32 GEMM, rounded to
    ``out_dtype``: the ``"inputs"`` model of :class:`~ttrace_num.bounds.fp8.ScaledGemm` for any
    recipe (``torch._scaled_mm`` on CPU does this for tensor-wise and row-wise scales)."""
    a_deq = cast_fake_quant(a, fmt_a, recipe_a, amax_a).float()
    b_deq = cast_fake_quant(b.transpose(0, 1), fmt_b, recipe_b, amax_b).float().transpose(0, 1)
    return (a_deq @ b_deq).to(out_dtype)
