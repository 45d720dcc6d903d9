r"""FP8 / MX / FP6 / FP4 quantization and the scaled (FP8) GEMM.

Three error models, each elementwise and in both modes.

1. ``quantize``: the round trip ``x -> q -> x'`` of block-scaled quantization
-----------------------------------------------------------------------------
Computation model (NVIDIA Transformer Engine current/delayed/block scaling; OCP MX v1.0
§6.3; the recipes and scales of :mod:`ttrace_num.scaling`, which this module calls to get
the scales, never re-derives them). Per block (tensor, row, ``a x b`` tile, MX block of 32)
the scale ``s`` and its stored inverse ``s_inv = RN_sf(1/s)`` are given (``s`` from
``amax`` = the block's max, or a delayed-scaling ``amax`` from an amax history; MX: ``s =
1/X``, ``X = 2**(floor(log2 amax) - emax_elem)`` in E8M0). With ``c`` the compute format
(fp32 in TE kernels) and ``fmt`` the element format::

    t  = fl_c(x * s)                        # x stored exactly in c
    q  = RN_fmt(t), saturating at +-fmt.max  # OCP OFP8 v1.0 §5 "saturating" conversion;
                                             # OCP MX v1.0 §6.3: elements clamped to +-max
         | RN_fmt(t) with the cast's overflow # saturate=False: torch's cast ("Overflow" below)
    x' = fl_c(q * s_inv)  (dequant="scale_inv": TE, torch._scaled_mm, scaling.py)
       | fl_c(q / s)      (dequant="divide")
    x' rounded to out_fmt (default: c)

Bound, with ``a = |x| s`` (exact in float64 for ``x`` and ``s`` of <= fp32 precision)::

    e1  = half_ulp_c(a)      (0 when x*s is exact in c: power-of-two s, or p_x + p_s <= p_c)
    T   = a + e1             (>= |t|; half_ulp is monotone)
    E_s = e1 + { half_ulp_fmt(T)                       if T <= fmt.max
               { max(half_ulp_fmt(fmt.max), T - fmt.max) otherwise (saturation)
                             # |q - x s| <= E_s  (scaled domain)
    D   = s_inv E_s + |x| |s s_inv - 1|   (scale_inv)  |  E_s / s   (divide)
                             # |q s_inv - x| <= D: s_inv = (1/s)(1 + eps_s), and
                             # s s_inv - 1 = eps_s is computed exactly per block (0 for
                             # power-of-two scales, |eps_s| <= u_sf otherwise)
    e3  = half_ulp_c(|x| + D)   (0 for power-of-two scales whose scaled grid lies in c)
    |x' - x| <= D + e3 + half_ulp_out(|x| + D + e3)   (last term 0 if out_fmt holds c)

Why this is right and tight. In the normal range of ``fmt`` round to nearest errs by at
most half the spacing at ``|t|``, ``half_ulp_fmt(|t|) <= u_fmt |t|`` (Higham 2002, Thm 2.2);
below it (``|x s| < 2**emin``: "tiny" data, e.g. small elements of a block with one large
one) by the absolute ``fmt.subnormal_abs_error`` (half the subnormal spacing), which
``half_ulp`` returns there; divided by ``s`` (multiplied by ``s_inv``) this is
``s_inv * 2**(emin - m - 1)``. The bound uses half the spacing of the *actual* scaled
magnitude, not ``u |x s|``, so it is within a factor ``<= 2`` of the worst error at every
magnitude. Saturation (``|x s| > fmt.max``) is not round-off: the error is exactly ``|x|
- fmt.max / s``; it happens with delayed scaling when the amax history is below the
current amax (an "amax spike"), with MX for every format (``amax / X`` lies in
``[2**emax, 2**(emax+1))`` but ``fmt.max <= (2 - 2**-m) 2**emax < 2**(emax+1)``:
e.g. E4M3 ``|V|/X`` in ``(464, 512)`` -> 448, E2M1 ``(7, 8)`` -> 6, i.e. up to 25% error),
and when the fp32 scale ``s = RN(fmt.max / amax)`` was rounded up (``amax * s`` exceeds
``fmt.max`` by ``<= u_fp32 fmt.max``). Whether or not ``t`` exceeds ``fmt.max``,
``|q - t| <= max(half_ulp_fmt(fmt.max), |t| - fmt.max)`` when ``T > fmt.max``, because a
value ``<= fmt.max`` rounds to ``<= fmt.max`` (RN is monotone and ``fmt.max`` is on the
grid) and a larger one becomes ``+-fmt.max``. The fp32 scale's own rounding does not
enter the scaled-domain error (``q`` is on the grid of ``x s`` whatever ``s`` is); it
enters through ``s_inv != 1/s`` (term ``|x| |s s_inv - 1|``) in the ``scale_inv``
convention, and through the rounding of ``q / s`` in the ``divide`` convention.
A computation of ``x s`` or of the dequantization that is more accurate than ``c``
(:mod:`ttrace_num.scaling` computes both exactly in float64) is covered: ``e1``, ``e3 >= 0``.
Mode: one element is one or two roundings, for which the probabilistic model gives
nothing smaller than the worst case, so the probabilistic bound equals the
deterministic one (it holds with probability 1).

Overflow (``saturate=``, :func:`torch_cast_overflow`, :func:`cast_error`). A recipe that clamps
``x s`` to ``+-fmt.max`` before casting (TE and Megatron cast kernels, torchao/OCP MX) makes the
saturation error above exact. A bare cast does what the dtype does beyond its range, measured
on torch 2.13 (CPU): ``x.to(float8_e4m3fn)`` saturates at 448 (``+-inf`` too); ``float8_e5m2``
rounds to nearest with overflow: values ``>= max + hu(max) = 61440`` become ``+-inf`` (those
between 57344 and 61440 round to 57344); ``float8_e4m3fnuz`` / ``e5m2fnuz`` give NaN there. Hence
``|cast(y) - y| <= hu_fmt(min(|y|, max))`` below ``max + hu_fmt(max)`` (RN is monotone and ``max``
is on the grid; at the threshold the tie rounds away, ``max``'s significand being odd), and
beyond it ``max(hu(max), |y| - max)`` for a saturating cast, ``inf`` (no finite claim) for an
overflowing one. :func:`torch_cast_overflow` probes torch's cast of the format's dtype (formats
without one: their declared overflow; the OCP MX element formats saturate). ``saturate=None``
(default) is the clamp for MX recipes (the spec mandates it) and the bare cast otherwise:
``e5m2`` with an amax spike (delayed scaling) now gives ``inf`` where torch gives ``inf``
(previously a finite bound, violated on 617 of 2048 elements of such a tensor; ``e4m3fnuz``
659 of 2048, NaN). The scaled GEMM's output cast (``out_fmt``) uses the same rule:
``torch._scaled_mm`` saturates an ``e4m3`` output at 448 (the bound is finite there; it was
``inf``) and overflows ``e5m2``/fp16 outputs to ``inf``.

2. ``scaled_matmul``: the GEMM of quantized operands
----------------------------------------------------
``y = (S_a . Q_a) (Q_b . S_b)`` with ``Q_a`` (M,K) in ``fmt_a``, ``Q_b`` (K,N) in ``fmt_b``
and dequantization scales (``torch._scaled_mm``'s ``scale_a``/``scale_b`` = TE's
``scale_inv``): scalars (tensor-wise), ``(M,1)``/``(1,N)`` (row-wise), or blocks along K
(``(M, K/g)`` / ``(K/g, N)``, also ``(M/g', K/g)`` / ``(K/g, N/g')`` tiles: 1x128 / 128x128
of DeepSeek-V3 and TE ``Float8BlockScaling``; MX ``(M, K/32)`` E8M0). The exact result is
``sum_k (s_a q_a)_ik (q_b s_b)_kj``; the bound is on the computed minus that. Two kernels
(``scale_application``):

* ``"epilogue"`` (Hopper/Blackwell FP8 GEMMs, cuBLASLt, DeepSeek-V3 §3.3.2): products of
  two FP8 numbers are exact in the accumulator (``p_a + p_b <= p_inner``, 8 bits for
  E4M3). With a ``promotion_interval`` ``N_c`` the tensor core sums chains of ``N_c``
  products in a limited-precision accumulator (``inner_accum_fmt``), then each partial is
  converted (exactly) to the fp32 accumulator and added to a chain of partials ("partial
  results are copied to FP32 registers on CUDA cores, where full-precision FP32
  accumulation is performed", DeepSeek-V3 technical report, arXiv 2412.19437, §3.3.2).
  Scales constant along K are applied to the fp32 result (``fl(fl(acc s_a) s_b)``);
  scales that vary along K are applied to each partial at promotion (DeepSeek-V3
  §3.3.2), which needs promotion blocks inside the scale blocks (default
  ``N_c = gcd`` of the scale blocks, inner format = accumulation format).
  The tree is exactly :class:`~ttrace_num.bounds.summation.Summation` ``(accum=inner,
  split=ceil(K/N_c), reduce_fmt=accum)`` on ``K`` zero-padded to a multiple of ``N_c``
  (zero padding adds exact zeros), with one more ``accum`` level per non-power-of-two
  scale operand (the multiplications, whose subtrees are the partials or the whole sum).
* ``"inputs"`` (``torch._scaled_mm`` on CPU, ``aten/src/ATen/native/Blas.cpp``
  ``_scaled_mm_out_cpu_emulated``; fake-quant emulations): ``A' = fl32(Q_a s_a)``,
  ``B' = fl32(Q_b s_b)``, then an fp32 GEMM (MKL: order unknown, FMA or rounded products).

Bound, "epilogue" (identity (1) of :mod:`.summation` over this tree, two stages: the
chains on ``S``, the promotion/scaling/outer chain on ``T = sum_i |partial_i|``;
Higham 2002 §3.1, §4.2; probabilistic: Higham & Mary 2019, Connolly, Higham & Mary 2021)::

    |y_hat - y| <= acc + half_ulp_out(|y| + acc),   acc = sum_error_bound(S = |A_deq||B_deq|, T, ...)

with levels: inner format ``N_c - 1`` (+1 if products are inexact), accum ``ceil(K/N_c) - 1``
(+1 if inner -> accum is inexact) + one per non-power-of-two scale operand; underflow
counted for every rounding (the scale roundings once per partial when they vary along K).
"inputs" (composition, local because :class:`~.summation.Summation` has no levels acting on
each term before the sum; see the note below): the :func:`~.matmul.matmul` bound on the
fp32 operands ``A', B'`` plus the propagated dequantization roundings, identity (2) below
with ``|A' - A_deq| <= half_ulp_32(|A_deq|)`` (0 where exact)::

    |y_hat - y| <= matmul_bound(A', B') + |A_deq - A'| |B'| + |A_deq| |B_deq - B'|   (or its Azuma form)

(the failure probability is split equally between the two).
Note for :mod:`.summation`: an ``extra_leaf_depths`` argument of ``sum_error_bound``
(levels applied to each term before the tree, stage ``S``, ``n`` roundings per level)
would express the "inputs" model as one tree; the composition above is equivalent to
first order.

Tightness (bench/cases/fp8.py, tests/test_bounds_fp8.py): with bf16/fp16 outputs of an fp32
accumulation the output rounding dominates (median ~1-2). With fp32 outputs the bound is
loose (deterministic ~10^2-10^3, probabilistic ~20-250 on random data), and so is the
14-bit inner accumulator (bf16 output: probabilistic ~3-9; fp16: ~60), because sums of
FP8 products (8-bit significands, on a coarse common grid) are often exact: many additions
do not round at all, which no bound built on ``|delta| <= u`` per addition can see. The
bound is what a kernel may legitimately do (worst case / random rounding errors), not what
random FP8 data happens to produce.

The limited-precision accumulator is an *assumption*: Hopper's FP8 WGMMA keeps "around 14
bits" (DeepSeek-V3 §3.3.2; measured, not documented by NVIDIA). The default
``inner_accum_fmt`` is ``custom(e=8, m=13)`` (14 significant bits, fp32 exponent range,
round to nearest): the conservative reading of "14 bits". Hardware that truncates
instead of rounding errs by up to one ulp, i.e. as a round-to-nearest format with one
bit less: pass ``custom(e=8, m=12)`` for it, and use the deterministic mode (truncation
is biased, outside the probabilistic model).

3. ``quantized_matmul``: quantize both operands, then the scaled GEMM
---------------------------------------------------------------------
Error relative to the exact product ``A B`` of the *unquantized* inputs. ``A`` is quantized
along K with ``recipe_a``, ``B`` through ``B^T`` (N,K) with ``recipe_b`` (so "row" means one
scale per output column, "1x128" blocks of 128 along K: the layout of
``torch._scaled_mm``'s column-major ``b``). With ``A_hat = Q_a S_a`` (exact), ``dA = A_hat -
A``, ``|dA| <= D_A`` (term ``D`` of model 1, which is the error of the values the GEMM
consumes), and the same for B::

    A_hat B_hat - A B = dA B_hat + A dB                                             (2)
    deterministic:  |.| <= D_A (|B| + D_B) + |A| D_B

Probabilistic: split ``dA = dA_r + dA_d`` into the rounding part (``s_inv * E_s`` of
elements that cannot saturate) and the deterministic part (saturation, and ``|x||s s_inv
- 1|``, the same for a whole block). Revealing B's roundings before A's, the terms of (2)
built from rounding parts form a martingale under the Higham-Mary model (each rounding
error has zero mean given the previous ones), with increments bounded by ``|A_ik|
R_B,kj`` and ``R_A,ik (|B|+D_B)_kj``; Azuma-Hoeffding gives with probability ``>= 1 -
2 exp(-lambda^2/2)``::

    |(2)| <= Det_A (|B| + D_B) + |A| Det_B + lambda sqrt( A^2 R_B^2 + R_A^2 (|B| + D_B)^2 )

(matrix products of elementwise squares; the deterministic form is used where smaller).
Plus the GEMM bound of model 2 on the quantized operands (triangle inequality); the
failure probability is split equally between the two. Every ``|.||.|`` product is
computed as a rigorous float64 upper bound (:func:`~.matmul.matmul_statistics`).

Tightness: ``quantize`` ~1 (per tensor, the worst element attains the half-ulp of its
actual scaled magnitude; ~3 where every small element flushes to zero). ``quantized_matmul``
in deterministic mode adds ``K`` worst-case quantization errors that in practice cancel like
a random walk (~``sqrt(K)`` of them survive), so it is ~8-10 loose at K = 256-512 on random
data; the probabilistic mode removes that factor (median ~1.4-3.5: the quantization errors
dominate the GEMM's; ~1.1-1.5 for heavy tails, ~3.5 with saturation, which is deterministic).

Sources: OCP 8-bit Floating Point Specification (OFP8) v1.0, 2023 (E4M3/E5M2 encodings,
saturating conversion); OCP Microscaling Formats (MX) Specification v1.0, 2023 (§5 element
formats FP8/FP6/FP4, E8M0 scale, §6.3 conversion with clamping); Micikevicius et al., "FP8
Formats for Deep Learning", arXiv 2209.05433, 2022 (per-tensor scaling, E4M3 forward /
E5M2 backward); NVIDIA Transformer Engine documentation ("Using FP8 with Transformer
Engine": delayed scaling with amax history, current scaling, ``Float8BlockScaling``);
DeepSeek-AI, DeepSeek-V3 Technical Report, arXiv 2412.19437, §3.3 (fine-grained 1x128 /
128x128 quantization, increased accumulation precision by promotion every N_C = 128);
Higham, Accuracy and Stability of Numerical Algorithms (2002) §2.2, §3.1, §4.2; Higham &
Mary, SISC 41(5) 2019; Connolly, Higham & Mary, SISC 43(1) 2021.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import torch

from .. import scaling
from ..formats import FloatFormat, custom, get_format, half_ulp
from ..rounding import round_to
from .base import Bound, Explanation, lambda_for
from .common import f64, register, resolve_mode
from .matmul import matmul, matmul_statistics, partial_abs_sum
from .summation import (Depths, Summation, conversion_exact, sum_error_bound,
                        underflow_term)

__all__ = ["quantize", "scaled_matmul", "quantized_matmul", "ScaledGemm", "QuantError", "quantization_error",
           "expand_scale", "TENSOR_CORE_ACCUM", "DEFAULT_QUANT_FMT", "torch_cast_overflow", "cast_error"]

ScaleApplication = Literal["epilogue", "inputs"]
Dequant = Literal["scale_inv", "divide"]

FP32 = get_format("fp32")
#: Default format of the quantized operands (OCP E4M3, the forward-pass FP8 format).
DEFAULT_QUANT_FMT = get_format("e4m3")
#: Assumed limited-precision accumulator of Hopper FP8 tensor cores: 14 significant bits
#: ("around 14 bits", DeepSeek-V3 §3.3.2), fp32 exponent range, round to nearest.
TENSOR_CORE_ACCUM = custom(8, 13, name="tc_accum(e8m13)")

SOURCE_Q = ("OCP OFP8 v1.0 (2023) §5; OCP MX v1.0 (2023) §6.3; Micikevicius et al. arXiv 2209.05433; "
            "NVIDIA Transformer Engine docs (delayed/current/block scaling); Higham (2002) Thm 2.2")
SOURCE_G = ("DeepSeek-V3 technical report arXiv 2412.19437 §3.3.2 (promotion interval); Higham (2002) §3.1, §4.2; "
            "Higham & Mary SISC 2019; Connolly, Higham & Mary SISC 2021; torch Blas.cpp _scaled_mm_out_cpu_emulated")


@functools.lru_cache(maxsize=None)
def torch_cast_overflow(fmt: FloatFormat) -> str:
    """What a cast to ``fmt`` does with a finite value beyond ``fmt.max`` (module docstring,
    "Overflow"): ``"saturate"``, ``"inf"`` or ``"nan"``. For a format with a torch dtype, torch's
    own cast is probed (torch 2.13 CPU: ``float8_e4m3fn`` saturates, even ``+-inf``;
    ``float8_e5m2`` overflows to ``+-inf``; the ``fnuz`` types give NaN); otherwise the format's
    default (OCP MX element formats saturate; a ``custom`` format: its ``overflow``)."""
    if fmt.torch_dtype is None:
        return fmt.default_overflow
    r = float(torch.tensor([fmt.max * 4.0], dtype=torch.float32).to(fmt.torch_dtype).to(torch.float32))
    return "saturate" if r == fmt.max else ("inf" if math.isinf(r) else "nan")


def _overflow(fmt: FloatFormat, saturate: bool | None, recipe: "scaling.ScalingRecipe | None" = None) -> str:
    """The overflow behaviour a conversion to ``fmt`` is modelled with: ``saturate=True``: the recipe
    clamps to ``+-fmt.max`` before casting (TE, Megatron, torchao MX); ``False``: the cast alone
    (:func:`torch_cast_overflow`); ``None``: clamped for MX recipes (OCP MX v1.0 §6.3 mandates it),
    else the cast alone."""
    if saturate is None:
        saturate = recipe is not None and recipe.granularity == "mx"
    if not isinstance(saturate, bool):
        raise TypeError(f"saturate must be True, False or None, got {saturate!r}")
    return "saturate" if saturate else torch_cast_overflow(fmt)


def cast_error(mag: torch.Tensor, fmt: FloatFormat, overflow: str) -> torch.Tensor:
    """Bound on ``|cast(y) - y|`` for every ``|y| <= mag`` (round to nearest): ``half_ulp_fmt(mag)``
    up to ``fmt.max``; ``half_ulp_fmt(fmt.max)`` for ``fmt.max < mag < fmt.max + half_ulp_fmt(fmt.max)``
    (such values round to ``+-fmt.max``: RN is monotone and ``fmt.max`` is on the grid); beyond:
    ``max(half_ulp(max), mag - fmt.max)`` if the cast saturates, else ``inf`` (the result is
    ``+-inf`` or NaN: no finite claim; the tie at the threshold rounds away, ``fmt.max`` having an
    odd significand)."""
    top = half_ulp(torch.tensor(fmt.max, dtype=torch.float64), fmt)
    below = half_ulp(mag.clamp(max=fmt.max), fmt)
    if overflow == "saturate":
        return torch.where(mag > fmt.max, torch.maximum(top.expand_as(mag), mag - fmt.max), below)
    return torch.where(mag >= fmt.max + top, torch.full_like(mag, math.inf), below)


def _is_pow2(t: torch.Tensor) -> torch.Tensor:
    """Elementwise: is ``|t|`` a power of two (finite, non-zero)?"""
    m, _ = torch.frexp(t.abs())
    return m == 0.5


# ----------------------------------------------------------------------------- quantize
@dataclass
class QuantError:
    """Elementwise quantization error bounds of one tensor (float64, shape of ``x``).

    ``rounding``: bound on the round-off part of ``q s_inv - x`` (``s_inv E_s`` on elements
    that cannot saturate, else 0); ``deterministic``: the rest (saturation, and the
    block-constant ``|x| |s s_inv - 1|``). ``rounding + deterministic`` bounds ``|q s_inv - x|``
    (or ``|q/s - x|``). ``saturating``: mask of the elements that may saturate (``T > fmt.max``).
    ``quantized``: the :class:`~ttrace_num.scaling.Quantized` whose scales were used.
    """

    rounding: torch.Tensor
    deterministic: torch.Tensor
    saturating: torch.Tensor
    quantized: scaling.Quantized

    @property
    def total(self) -> torch.Tensor:
        return self.rounding + self.deterministic


def _precision(x: torch.Tensor) -> int:
    """Significand bits of ``x``'s storage format (53 for float64 and non-float dtypes)."""
    try:
        return get_format(x.dtype).precision
    except ValueError:
        return 53


def quantization_error(x: torch.Tensor, fmt: "FloatFormat | str", recipe: "scaling.ScalingRecipe | str",
                       amax=None, compute_fmt: "FloatFormat | str" = FP32,
                       dequant: Dequant = "scale_inv", saturate: bool | None = None) -> QuantError:
    """Bound on ``|q s_inv - x|`` (``dequant="scale_inv"``) or ``|q/s - x|`` (``"divide"``) per
    element, before the dequantization is rounded; see the module docstring (model 1).
    ``saturate``: see :func:`quantize` (elements whose cast may overflow to inf/NaN get ``inf``).

    ``x`` must convert exactly to ``compute_fmt`` (bf16/fp16/fp32 into fp32)."""
    fmt, c = get_format(fmt), get_format(compute_fmt)
    recipe = scaling.get_recipe(recipe)
    overflow = _overflow(fmt, saturate, recipe)
    px = _precision(x)
    if px > c.precision:
        raise ValueError(f"x of dtype {x.dtype} does not convert exactly to compute_fmt={c}; "
                         "pass x in its storage dtype (e.g. float32/bfloat16) or compute_fmt='fp64'")
    if dequant not in ("scale_inv", "divide"):
        raise ValueError(f"dequant must be 'scale_inv' or 'divide', got {dequant!r}")
    qz = scaling.quantize(x, fmt, recipe, amax)
    s = qz.expand(qz.scale)
    s_inv = qz.expand(qz.scale_inv)
    ax = f64(x).abs()
    a = ax * s
    pow2 = _is_pow2(s)
    if px + recipe.scale_format.precision > 53:
        a = torch.where(pow2, a, a * (1.0 + 2.0**-52))  # the float64 product was rounded: bound it above
    mult_exact = pow2 | (px + recipe.scale_format.precision <= c.precision)
    e1 = torch.where(mult_exact & (a >= c.min_normal), torch.zeros_like(a), half_ulp(a, c))
    t_hi = a + e1
    sat = t_hi > fmt.max  # may round to (saturating) or beyond (overflowing cast) +-fmt.max
    e_s = cast_error(t_hi, fmt, overflow) + e1
    if dequant == "scale_inv":
        d_scaled = s_inv * e_s
        d_scale = ax * (s * s_inv - 1.0).abs()
    else:
        d_scaled = e_s / s
        d_scale = torch.zeros_like(ax)
    zero = torch.zeros_like(ax)
    return QuantError(rounding=torch.where(sat, zero, d_scaled),
                      deterministic=d_scale + torch.where(sat, d_scaled, zero), saturating=sat, quantized=qz)


def _dequant_rounding(qe: QuantError, x: torch.Tensor, fmt: FloatFormat, c: FloatFormat,
                      dequant: Dequant) -> torch.Tensor:
    """Bound on the rounding of ``q s_inv`` (or ``q / s``) to ``c``: 0 where the scaled grid of
    ``fmt`` lies inside ``c`` (power-of-two multiplier, ``p_fmt <= p_c``, range), else
    ``half_ulp_c(|x| + D)``."""
    qz = qe.quantized
    mult = qz.expand(qz.scale_inv) if dequant == "scale_inv" else 1.0 / qz.expand(qz.scale)
    exact = (_is_pow2(mult) & (fmt.precision <= c.precision)
             & (fmt.min_subnormal * mult >= c.min_subnormal) & (fmt.max * mult <= c.max))
    m = f64(x).abs() + qe.total
    return torch.where(exact, torch.zeros_like(m), half_ulp(m, c))


@register("quantize", "fake_quant")
def quantize(x: torch.Tensor, *, fmt=None, recipe: "scaling.ScalingRecipe | str" = "tensor", amax=None,
             compute_fmt=None, out_fmt=None, dequant: Dequant = "scale_inv", saturate: bool | None = None,
             mode: str = "deterministic", failure_probability: float | None = None) -> Bound:
    """Elementwise bound on ``|dequantize(quantize(x)) - x|`` (model 1 of the module docstring).

    Args:
        x: the high-precision tensor (its dtype must convert exactly to ``compute_fmt``).
        fmt: the low-precision element format (``"e4m3"`` default, ``"e5m2"``, ``"e4m3fnuz"``,
            ``"e2m3"``, ``"e3m2"``, ``"e2m1"``, ``custom(...)``).
        recipe: :class:`~ttrace_num.scaling.ScalingRecipe` or ``"tensor"``, ``"row"``,
            ``"1x128"``, ``"128x128"``, ``"mx32"``.
        amax: delayed scaling: amax per block from the history (elements above saturate).
        compute_fmt: format of ``x * s`` and of the dequantization (fp32 default, as TE).
        out_fmt: format the dequantized tensor is stored in (default ``compute_fmt``).
        dequant: ``"scale_inv"`` (``q * RN(1/s)``, TE / ``_scaled_mm`` / scaling.py) or
            ``"divide"`` (``q / s``).
        saturate: ``True``: ``x s`` is clamped to ``+-fmt.max`` before the cast (TE, Megatron,
            torchao MX); ``False``: the cast's own overflow (torch's: ``e4m3`` saturates,
            ``e5m2`` gives ``+-inf``, ``fnuz`` NaN: :func:`torch_cast_overflow`), the bound is
            ``inf`` on elements that may overflow; ``None`` (default): ``True`` for MX recipes
            (OCP MX v1.0 §6.3), else ``False``.
    """
    fmt = get_format(fmt) if fmt is not None else DEFAULT_QUANT_FMT
    c = get_format(compute_fmt) if compute_fmt is not None else FP32
    out = get_format(out_fmt) if out_fmt is not None else c
    ms = resolve_mode(mode, failure_probability)
    qe = quantization_error(x, fmt, recipe, amax, c, dequant, saturate)
    overflow = _overflow(fmt, saturate, qe.quantized.recipe)
    e3 = _dequant_rounding(qe, x, fmt, c, dequant)
    mag = f64(x).abs() + qe.total + e3
    bound = qe.total + e3 + _output_cast(mag, c, out)
    values = {"fmt": str(fmt), "recipe": str(qe.quantized.recipe), "compute": str(c), "out": str(out),
              "dequant": dequant, "overflow": overflow, "possibly_saturating": int(qe.saturating.sum()),
              "u_fmt": fmt.u, "max_rel_bound": float((bound / f64(x).abs()).nan_to_num(0, 0, 0).max())
              if x.numel() else 0.0}
    assumptions = [f"conversion to fmt: round to nearest even; beyond +-max: {overflow}"
                   + (" (bound inf where it may overflow)" if overflow != "saturate" else ""),
                   "x*s computed in compute_fmt from x stored exactly in it",
                   f"dequantization {'q * scale_inv' if dequant == 'scale_inv' else 'q / s'} rounded to {c}"]
    if ms.mode == "probabilistic":
        assumptions.append("one rounding per element: the probabilistic bound equals the worst case "
                           "(holds with probability 1)")
    return Bound(abs=bound, mode=ms.mode, failure_probability=ms.failure_probability, magnitude=f64(x).abs(),
                 explanation=Explanation(
                     op="quantize",
                     formula="|x'-x| <= D + e3 + half_ulp_out(|x|+D+e3); D = s_inv*E_s + |x||s*s_inv-1|, "
                             "E_s = e1 + (half_ulp_fmt(|x|s+e1) | saturation |x|s+e1-fmt.max | overflow inf)",
                     source=SOURCE_Q, assumptions=tuple(assumptions), values=values))


# ----------------------------------------------------------------------------- scaled GEMM
def expand_scale(scale, rows: int, cols: int, name: str) -> tuple[torch.Tensor, int, int]:
    """A dequantization scale (scalar, or 2-D ``(r, c)`` with ``rows % r == cols % c == 0``)
    broadcast to ``(rows, cols)`` float64, with the block sizes ``(rows // r, cols // c)``."""
    s = torch.as_tensor(scale).detach().to(torch.float64)
    if s.numel() == 1:
        return s.reshape(1, 1).expand(rows, cols), rows, cols
    if s.dim() != 2 or rows % s.shape[0] or cols % s.shape[1]:
        raise ValueError(f"{name} of shape {tuple(s.shape)} does not tile the ({rows}, {cols}) operand: use a "
                         "scalar, a 2-D tensor whose dims divide the operand's, e.g. (M, 1) / (1, N) row-wise, "
                         "(M, K//128) / (K//128, N) blocks along K")
    br, bc = rows // s.shape[0], cols // s.shape[1]
    return s.repeat_interleave(br, 0).repeat_interleave(bc, 1), br, bc


@dataclass(frozen=True)
class ScaledGemm:
    """Computation model of a scaled low-precision GEMM (module docstring, model 2).

    Args:
        accum: accumulation format (fp32).
        promotion_interval: ``N_c``: products are summed in chains of ``N_c`` in
            ``inner_accum`` and the partials added into an ``accum`` chain; None = one chain
            in ``accum`` (or, with scales that vary along K, chains of the scale block).
        inner_accum: format of the limited-precision inner accumulator (default
            :data:`TENSOR_CORE_ACCUM` when ``promotion_interval`` is given, else ``accum``).
        scale_application: ``"epilogue"`` (GPU) or ``"inputs"`` (``torch._scaled_mm`` on CPU).
        out: output format.
    """

    accum: FloatFormat = FP32
    promotion_interval: int | None = None
    inner_accum: FloatFormat | None = None
    scale_application: ScaleApplication = "epilogue"
    out: FloatFormat = FP32

    def __post_init__(self) -> None:
        object.__setattr__(self, "accum", get_format(self.accum))
        object.__setattr__(self, "out", get_format(self.out))
        if self.inner_accum is not None:
            object.__setattr__(self, "inner_accum", get_format(self.inner_accum))
        if self.scale_application not in ("epilogue", "inputs"):
            raise ValueError(f"scale_application must be 'epilogue' or 'inputs', got {self.scale_application!r}")
        if self.promotion_interval is not None and self.promotion_interval < 1:
            raise ValueError(f"promotion_interval must be >= 1, got {self.promotion_interval}")
        if self.scale_application == "inputs" and (self.promotion_interval or self.inner_accum):
            raise ValueError("scale_application='inputs' (dequantize, then an fp32 GEMM) has no promotion "
                             "interval / inner accumulator")

    @property
    def inner(self) -> FloatFormat:
        if self.inner_accum is not None:
            return self.inner_accum
        return TENSOR_CORE_ACCUM if self.promotion_interval is not None else self.accum

    def blocking(self, k: int, k_block_scales: int) -> tuple[int, int, bool]:
        """``(block, n_blocks, scales_per_block)`` for ``K = k`` with scales constant over
        ``k_block_scales`` consecutive K indices (``k`` when constant along K)."""
        varying = k_block_scales < k
        b = self.promotion_interval
        if b is None:
            b = k_block_scales if varying else max(k, 1)
        if varying and k_block_scales % b:
            raise ValueError(f"scales vary along K in blocks of {k_block_scales}; promotion_interval={b} must "
                             "divide it (each promoted partial is multiplied by one scale)")
        return b, math.ceil(k / b) if k else 1, varying

    def describe(self) -> str:
        if self.scale_application == "inputs":
            return f"dequantize inputs to {self.accum}, GEMM in {self.accum}, out {self.out}"
        s = f"products exact, chains in {self.inner}"
        if self.promotion_interval:
            s += f" promoted every {self.promotion_interval} into {self.accum}"
        return s + f", scales in {self.accum} epilogue/at promotion, out {self.out}"

    def summation(self, k: int, k_block_scales: int) -> tuple[Summation, int, bool]:
        """The epilogue model's tree as a :class:`~.summation.Summation` on ``K`` padded to
        ``n_blocks * block`` terms (exact zeros): ``(summation, padded K, scales vary along K)``."""
        b, nb, varying = self.blocking(k, k_block_scales)
        summ = Summation(accum=self.inner, split=nb, reduce_fmt=self.accum) if nb > 1 else Summation(accum=self.inner)
        return summ, nb * b, varying


def _formats(a: torch.Tensor, b: torch.Tensor, fmt, fmt_a, fmt_b) -> tuple[FloatFormat, FloatFormat]:
    def one(t: torch.Tensor, f) -> FloatFormat:
        if f is not None:
            return get_format(f)
        if fmt is not None:
            return get_format(fmt)
        if t.dtype.itemsize == 1 and t.dtype.is_floating_point:
            return get_format(t.dtype)
        return DEFAULT_QUANT_FMT
    return one(a, fmt_a), one(b, fmt_b)


GEMM_FORMULA = {
    "epilogue": "|err| <= acc + half_ulp_out(|y| + acc), acc = two-stage summation bound on S = |S_a Q_a||Q_b S_b| "
                "(inner chains) and T = sum |partials| (promotion, scales, outer chain)",
    "inputs": "|err| <= matmul_bound(A', B') + |A_deq - A'||B'| + |A_deq||B_deq - B'| (or Azuma form), "
              "A' = fl(S_a Q_a), B' = fl(Q_b S_b)",
}


def _pad_k(a: torch.Tensor, b: torch.Tensor, k_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    extra = k_pad - a.shape[-1]
    if extra <= 0:
        return a, b
    return (torch.cat([a, a.new_zeros(a.shape[0], extra)], dim=1),
            torch.cat([b, b.new_zeros(extra, b.shape[1])], dim=0))


def _propagate(a_abs: torch.Tensor, r_a: torch.Tensor, d_a: torch.Tensor, b_abs: torch.Tensor,
               r_b: torch.Tensor, d_b: torch.Tensor, mode: str, lam: float) -> torch.Tensor:
    """Bound on ``|A_hat B_hat - A B|`` for ``A_hat = A + dA``, ``|dA| <= r_a + d_a`` elementwise
    (``r``: rounding parts, mean-independent in the probabilistic model; ``d``: deterministic
    parts), likewise ``B``; identity (2) of the module docstring::

        |dA B_hat + A dB| <= d_a (|B| + D_B) + |A| d_b + [r_a (|B| + D_B) + |A| r_b
                             or lambda sqrt(r_a^2 (|B| + D_B)^2 + A^2 r_b^2)]

    every product a rigorous float64 upper bound (:func:`~.matmul.matmul_statistics`)."""
    def prod(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return matmul_statistics(x, y)[0]

    b_hat = b_abs + r_b + d_b
    det = prod(d_a, b_hat) + prod(a_abs, d_b)
    rand = prod(r_a, b_hat) + prod(a_abs, r_b)
    if mode == "probabilistic":
        rand = torch.minimum(rand, lam * (prod(r_a * r_a, b_hat * b_hat) + prod(a_abs * a_abs, r_b * r_b)).sqrt())
    return det + rand


def _lam(mode: str, p: float) -> float:
    return lambda_for(p) if mode == "probabilistic" else math.inf


def _gemm_bound(qa: torch.Tensor, qb: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, k_block: int,
                fa: FloatFormat, fb: FloatFormat, model: ScaledGemm, mode: str, p: float
                ) -> tuple[torch.Tensor, torch.Tensor, dict, str]:
    """``(bound, |y| upper, values, formula)`` for the scaled GEMM of ``Q_a``, ``Q_b`` with expanded
    dequantization scales ``sa`` (M,K), ``sb`` (K,N): model 2 of the module docstring.
    ``p``: failure probability (probabilistic mode)."""
    a_deq, b_deq = f64(qa) * sa, f64(qb) * sb  # exact: <= 11 + 24 bits
    acc_f = model.accum
    pow2_a, pow2_b = bool(_is_pow2(sa).all()), bool(_is_pow2(sb).all())
    if model.scale_application == "inputs":
        # operands A' = fl(Q_a s_a), B' = fl(Q_b s_b); then the matmul bound on A', B'
        # plus the propagated dequantization roundings (identity (2), rounding parts only)
        a_in, b_in = round_to(a_deq, acc_f), round_to(b_deq, acc_f)
        r_a = torch.where(a_in == a_deq, 0.0, half_ulp(a_deq, acc_f))
        r_b = torch.where(b_in == b_deq, 0.0, half_ulp(b_deq, acc_f))
        zero_a, zero_b = torch.zeros_like(r_a), torch.zeros_like(r_b)
        deq = _propagate(a_deq.abs(), r_a, zero_a, b_deq.abs(), r_b, zero_b, mode, _lam(mode, p / 2))
        # products of the GEMM's operands are exact when the scales are powers of two
        # (operands keep the elements' precision) and 2 max(p_a, p_b) <= p_accum
        # (A' holds the elements' significands on fp32's exponent range: a custom format says so)
        storage = (custom(acc_f.exponent_bits, max(fa.mantissa_bits, fb.mantissa_bits), acc_f.bias)
                   if pow2_a and pow2_b else acc_f)
        mm = matmul(a_in, b_in, fmt=storage, compute_fmt=acc_f, out_fmt=acc_f, mode=mode,
                    failure_probability=p / 2 if mode == "probabilistic" else None)
        ymag = matmul_statistics(a_deq, b_deq)[1]
        values = {"K": qa.shape[-1], "model": model.describe(), "max_dequant_term": float(deq.max()) if
                  deq.numel() else 0.0, **dict(mm.explanation.values)}
        err = deq + mm.abs
        return err + _output_cast(ymag + err, acc_f, model.out), ymag, values, GEMM_FORMULA["inputs"]
    summ, k_pad, varying = model.summation(qa.shape[-1], k_block)
    a_p, b_p = _pad_k(a_deq, b_deq, k_pad)
    s, ymag, _ = matmul_statistics(a_p, b_p)
    scale_levels = int(not pow2_a) + int(not pow2_b)
    extra: Depths = {}
    if scale_levels or not conversion_exact(summ.final_fmt, acc_f):
        extra[acc_f] = scale_levels + int(not conversion_exact(summ.final_fmt, acc_f))
    acc, values = sum_error_bound(s, ymag, k_pad, summ, summ.final_fmt, mode, _lam(mode, p),
                                  exact_products=fa.precision + fb.precision <= summ.accum.precision,
                                  extra_depths=extra, partial_abs_sum=partial_abs_sum(a_p, b_p, None, summ, s))
    if varying and scale_levels:  # the scale roundings happen once per partial, each may underflow
        acc = acc + underflow_term({acc_f: (summ.parts(k_pad) - 1) * scale_levels})
    values.update(model=model.describe(), scale_levels=scale_levels, formats=f"{fa} x {fb}")
    return acc + _output_cast(ymag + acc, acc_f, model.out), ymag, values, GEMM_FORMULA["epilogue"]


def _output_cast(mag: torch.Tensor, acc_f: FloatFormat, out: FloatFormat) -> torch.Tensor:
    """The GEMM result's conversion from ``acc_f`` to ``out`` (module docstring, "Overflow"): torch's
    ``_scaled_mm`` (CPU, 2.13) saturates an ``e4m3`` output at 448, and gives ``inf`` for ``e5m2``,
    fp16 or bf16 beyond their range: :func:`cast_error` with :func:`torch_cast_overflow`."""
    if conversion_exact(acc_f, out):
        return torch.zeros_like(mag)
    return cast_error(mag, out, torch_cast_overflow(out))


def _model(compute_fmt, out_fmt, promotion_interval, inner_accum_fmt, scale_application) -> ScaledGemm:
    return ScaledGemm(accum=get_format(compute_fmt) if compute_fmt is not None else FP32,
                      promotion_interval=promotion_interval,
                      inner_accum=get_format(inner_accum_fmt) if inner_accum_fmt is not None else None,
                      scale_application=scale_application,
                      out=get_format(out_fmt) if out_fmt is not None else FP32)


@register("scaled_matmul", "scaled_mm", "_scaled_mm")
def scaled_matmul(a: torch.Tensor, b: torch.Tensor, *, scale_a, scale_b, fmt=None, fmt_a=None, fmt_b=None,
                  compute_fmt=None, out_fmt=None, promotion_interval: int | None = None, inner_accum_fmt=None,
                  scale_application: ScaleApplication = "epilogue", mode: str = "deterministic",
                  failure_probability: float | None = None) -> Bound:
    """Elementwise bound on ``|computed - (S_a Q_a)(Q_b S_b)|`` for a scaled GEMM (model 2).

    Args:
        a, b: the quantized operands ``Q_a`` (M,K) and ``Q_b`` (K,N) (fp8 torch tensors, or
            float tensors whose values are on ``fmt_a`` / ``fmt_b``'s grid).
        scale_a, scale_b: dequantization scales (``torch._scaled_mm``'s): scalars, ``(M,1)`` /
            ``(1,N)``, or blocks along K ``(M, K//g)`` / ``(K//g, N)`` (tiles ``(M//g', K//g)`` /
            ``(K//g, N//g')``).
        fmt, fmt_a, fmt_b: element formats (default: the fp8 dtype of the operand, else E4M3).
        compute_fmt: accumulation format (fp32). out_fmt: output format (fp32).
        promotion_interval, inner_accum_fmt: Hopper-style promotion (default inner format
            :data:`TENSOR_CORE_ACCUM` = 14 significant bits, an assumption).
        scale_application: ``"epilogue"`` (GPU kernels) or ``"inputs"`` (CPU ``torch._scaled_mm``).
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"scaled_matmul needs (M,K) @ (K,N) operands, got {tuple(a.shape)} and {tuple(b.shape)}")
    fa, fb = _formats(a, b, fmt, fmt_a, fmt_b)
    model = _model(compute_fmt, out_fmt, promotion_interval, inner_accum_fmt, scale_application)
    ms = resolve_mode(mode, failure_probability)
    (m, k), n = a.shape, b.shape[1]
    sa, _, kb_a = expand_scale(scale_a, m, k, "scale_a")
    sb, kb_b, _ = expand_scale(scale_b, k, n, "scale_b")
    bound, ymag, values, formula = _gemm_bound(a, b, sa, sb, math.gcd(kb_a, kb_b), fa, fb, model, ms.mode,
                                               ms.failure_probability)
    return Bound(abs=bound, mode=ms.mode, failure_probability=ms.failure_probability, magnitude=ymag,
                 explanation=Explanation(
                     op="scaled_matmul",
                     formula=formula,
                     source=SOURCE_G,
                     assumptions=(f"computation: {model.describe()}",
                                  f"inner accumulator {model.inner}: round to nearest (assumed)",
                                  "no overflow in the accumulators"),
                     values=values))


# ----------------------------------------------------------------------------- quantized GEMM
@register("quantized_matmul", "fp8_matmul")
def quantized_matmul(a: torch.Tensor, b: torch.Tensor, *, fmt=None, fmt_a=None, fmt_b=None,
                     recipe: "scaling.ScalingRecipe | str" = "tensor", recipe_a=None, recipe_b=None,
                     amax_a=None, amax_b=None, compute_fmt=None, out_fmt=None,
                     promotion_interval: int | None = None, inner_accum_fmt=None,
                     scale_application: ScaleApplication = "epilogue", saturate: bool | None = None,
                     mode: str = "deterministic", failure_probability: float | None = None) -> Bound:
    """Elementwise bound on ``|computed - A @ B|`` for quantize-both-then-scaled-GEMM (model 3).

    ``A`` (M,K) is quantized with ``recipe_a`` and ``B`` (K,N) through ``B.T`` (N,K) with
    ``recipe_b`` (both default ``recipe``), each to its format (default ``fmt``, else E4M3),
    with delayed-scaling amaxes ``amax_a`` / ``amax_b`` (compact shapes of ``A`` / ``B.T``);
    ``x * s`` in ``compute_fmt`` (fp32); the GEMM consumes ``Q`` and ``scale_inv`` as
    :func:`scaled_matmul` describes (the remaining arguments are its model). ``saturate``: the
    quantization's overflow, as :func:`quantize` (``inf`` where a cast may overflow).
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"quantized_matmul needs (M,K) @ (K,N) inputs, got {tuple(a.shape)} and {tuple(b.shape)}")
    fa = get_format(fmt_a if fmt_a is not None else (fmt if fmt is not None else DEFAULT_QUANT_FMT))
    fb = get_format(fmt_b if fmt_b is not None else (fmt if fmt is not None else DEFAULT_QUANT_FMT))
    ra = scaling.get_recipe(recipe_a if recipe_a is not None else recipe)
    rb = scaling.get_recipe(recipe_b if recipe_b is not None else recipe)
    model = _model(compute_fmt, out_fmt, promotion_interval, inner_accum_fmt, scale_application)
    ms = resolve_mode(mode, failure_probability)
    # the failure probability is shared equally by the quantization part and the GEMM part
    p = ms.failure_probability / 2
    qa = quantization_error(a, fa, ra, amax_a, model.accum, saturate=saturate)
    qbt = quantization_error(b.transpose(0, 1), fb, rb, amax_b, model.accum, saturate=saturate)
    za, zbt = qa.quantized, qbt.quantized
    sa, sb = za.expand(za.scale_inv), zbt.expand(zbt.scale_inv).transpose(0, 1)
    kb = math.gcd(_k_block(ra, a.shape[1]), _k_block(rb, a.shape[1]))
    gemm, _, gvalues, gformula = _gemm_bound(za.values, zbt.values.transpose(0, 1), sa, sb, kb, fa, fb, model, ms.mode, p)
    quant = _propagate(f64(a).abs(), qa.rounding, qa.deterministic, f64(b).abs(), qbt.rounding.transpose(0, 1),
                       qbt.deterministic.transpose(0, 1), ms.mode, _lam(ms.mode, p))
    values = {"formats": f"{fa} x {fb}", "recipes": f"{ra} / {rb}(B^T)",
              "possibly_saturating": int(qa.saturating.sum() + qbt.saturating.sum()), "max_quant_term": float(quant.max())
              if quant.numel() else 0.0, "max_gemm_term": float(gemm.max()) if gemm.numel() else 0.0}
    if ms.mode == "probabilistic":
        values["lambda"] = _lam(ms.mode, p)
    gexp = Explanation(op="scaled_matmul", formula=gformula, source=SOURCE_G, values=gvalues)
    formula = ("|err| <= Det_A(|B|+D_B) + |A|Det_B + " +
               ("R_A(|B|+D_B) + |A|R_B" if ms.mode == "deterministic"
                else "min(R_A(|B|+D_B) + |A|R_B, lambda sqrt(R_A^2(|B|+D_B)^2 + A^2 R_B^2))") + " + GEMM bound")
    assumptions = ["B quantized through B^T (recipes along K)",
                   f"conversions: round to nearest even; beyond +-max: A {_overflow(fa, saturate, ra)}, "
                   f"B {_overflow(fb, saturate, rb)} (inf bound where a non-saturating cast may overflow)"]
    if ms.mode == "probabilistic":
        assumptions.append("quantization and accumulation rounding errors mean-independent (Higham-Mary model); "
                           "failure probability split equally between quantization and GEMM")
    return Bound(abs=quant + gemm, mode=ms.mode, failure_probability=ms.failure_probability,
                 magnitude=matmul_statistics(f64(a), f64(b))[1],
                 explanation=Explanation(op="quantized_matmul", formula=formula, source=SOURCE_Q + "; " + SOURCE_G,
                                         assumptions=tuple(assumptions), values=values, terms=(gexp,)))


def _k_block(r: scaling.ScalingRecipe, k: int) -> int:
    """Length of the runs of K (last dim) over which a recipe's scale is constant."""
    if r.granularity == "tile":
        return r.tile[1]
    if r.granularity == "mx":
        return r.block
    return k
