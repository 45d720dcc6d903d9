"""Block-scaled quantization: the scaling recipes of FP8 / MX training, emulated in float64.

A *recipe* says which elements share one scale (the whole tensor, a row, a 1x128 or
128x128 tile, or an MX block of 32 consecutive elements) and how the scale is derived
from the block's ``amax = max |x|``. ``quantize(x, fmt, recipe)`` returns the values on
``fmt``'s grid and the scales; ``Quantized.dequantize()`` maps back; ``fake_quant`` is
both at once. Everything is float64 and exact except the one rounding to ``fmt`` (and,
for non power-of-two scales, the rounding of the scale itself to its storage format).

Conventions (``s`` = ``scale`` multiplies the input, ``s_inv`` = ``scale_inv`` multiplies
the stored values back; ``q`` = stored values):

**Tensor / row / tile recipes** (NVIDIA Transformer Engine, "current scaling";
``transformer_engine/common/recipe/recipe_common.cuh::compute_scale_from_amax`` and the
TE docs of ``DelayedScaling``, ``Float8CurrentScaling``, ``Float8BlockScaling``)::

    s     = RN_sf( fmt.max / amax / 2**margin )       # sf = scale_fmt, fp32 by default
    s     = 2**floor(log2 s)                          # only if power_of_two
    s     = 1                                         # if amax == 0 or amax is Inf/NaN
    q     = RN_fmt( x * s ),  saturating at +-fmt.max
    s_inv = RN_sf( 1 / s )                            # what TE stores (and _scaled_mm takes)
    x'    = q * s_inv                                 # dequantized

``amax`` is over the block (the tensor; the last dim for rows; ``a x b`` tiles of the last
two dims). An explicit ``amax`` argument (delayed scaling: the max of an amax history)
replaces the measured one; elements above it saturate to ``+-fmt.max / s``. ``margin m``
leaves ``2**m`` of headroom. Scales that overflow ``sf`` saturate at ``sf.max`` (TE uses
the float32 max). TE computes ``x * s`` in float32 and then casts (two roundings); here
``x * s`` is exact for float32/bf16 ``x`` and a float32 ``s`` (24 + 24 bits fit in 53), so
``q`` is the correctly rounded value; the two can differ only at near-ties.

Note the dequantization uses the stored ``s_inv = RN(1/s)``, as TE and
``torch._scaled_mm`` do; it differs from ``q / s`` by at most a relative ``u_sf`` (2**-24
for fp32 scales) and not at all for power-of-two scales.

**MX** (OCP Microscaling Formats (MX) Specification v1.0, section 6.3, "Conversion from
vector of scalar to MX"): blocks of ``k = block`` (32) consecutive elements along the last
dim share one E8M0 scale ``X``::

    shared_exp = floor(log2(amax_block)) - emax_elem      # emax_elem = fmt.emax (e4m3: 8, e2m1: 2)
    X          = 2**shared_exp                            # stored as E8M0: s_inv = X, s = 1 / X
    P_i        = RN_fmt( V_i / X ),  normal numbers above fmt.max clamped to +-fmt.max
    x'_i       = P_i * X

As in the spec's reference implementation (microsoft/microxcaling ``_quantize_mx``), a
shared exponent below the E8M0 range is clamped to ``-127`` (so an all-zero block gets
``X = 2**-127``), one above ``127`` makes ``X`` NaN, and so does a block containing Inf or
NaN (E8M0's only special value is NaN); a NaN scale makes the whole block NaN on
dequantization. ``margin`` (default 0) adds to ``shared_exp``. Because ``amax / X`` lies in
``[2**emax, 2**(emax+1))`` and ``fmt.max < 2**(emax+1)``, the largest elements of a block can
saturate (e.g. ``|V| / X`` in ``(464, 512)`` for E4M3): that is part of the format.

Error model (tested in ``tests/test_scaling.py``): for an element that does not saturate
(``|x * s| <= fmt.max``), ``|x' - x| <= u_fmt |x| + s_inv * fmt.subnormal_abs_error``
(the second term covers results in ``fmt``'s subnormal range), plus ``u_sf |x|`` for
non power-of-two scales, which this bound absorbs for formats with ``u_fmt**2 >= u_sf``
(every FP8/FP6/FP4 format with an fp32 scale).

Shapes: the last dim (and for ``a x b`` tiles with ``a > 1`` the second-to-last dim) must be
divisible by the block size; otherwise ``quantize`` raises ``ValueError`` naming the shape
and the recipe (pad first, e.g. ``torch.nn.functional.pad``, if you need a tail block).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

import torch

from .formats import FloatFormat, get_format
from .rounding import round_to

__all__ = [
    "ScalingRecipe",
    "Quantized",
    "quantize",
    "fake_quant",
    "scales_from_amax",
    "get_recipe",
    "per_tensor",
    "per_row",
    "tile_1x128",
    "tile_128x128",
    "mx",
]

Granularity = Literal["tensor", "row", "tile", "mx"]
_GRANULARITIES = ("tensor", "row", "tile", "mx")


@dataclass(frozen=True)
class ScalingRecipe:
    """Which elements share a scale and how the scale is computed (see the module docstring).

    Args:
        granularity: ``"tensor"``, ``"row"`` (last dim), ``"tile"`` (``tile = (a, b)`` over
            the last two dims; ``(1, 128)`` is per-row-per-128-columns) or ``"mx"``.
        tile: ``(a, b)`` for ``"tile"``; must be None otherwise.
        block: MX block size ``k`` along the last dim (OCP MX: 32).
        scale_fmt: storage format of the scale (None = fp32 for TE recipes; always E8M0 for
            MX). A format without mantissa bits (E8M0) needs ``power_of_two=True``.
        power_of_two: round the TE scale down to a power of two (TE ``force_pow_2_scales``),
            which makes ``x * s`` and ``q * s_inv`` exact. Implied for MX.
        margin: headroom exponent: ``s = fmt.max / amax / 2**margin`` (MX: ``X * 2**margin``).

    Build with the constructors (``ScalingRecipe.per_tensor()``, ``.per_row()``,
    ``.tile_1x128()``, ``.tile_128x128()``, ``.mx(block=32)``) or parse a string with
    :func:`get_recipe` (``"tensor"``, ``"row"``, ``"1x128"``, ``"128x128"``, ``"mx32"``).
    """

    granularity: Granularity = "tensor"
    tile: tuple[int, int] | None = None
    block: int = 32
    scale_fmt: FloatFormat | None = None
    power_of_two: bool = False
    margin: int = 0

    def __post_init__(self) -> None:
        g = self.granularity
        if g not in _GRANULARITIES:
            raise ValueError(f"unknown scaling granularity {g!r}; use one of {_GRANULARITIES}")
        if g == "tile":
            t = self.tile
            if (t is None or len(t) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1
                                                    for v in t)):
                raise ValueError(f"tile granularity needs tile=(rows, cols) of positive ints, got {t!r}")
            object.__setattr__(self, "tile", (int(t[0]), int(t[1])))
        elif self.tile is not None:
            raise ValueError(f"tile={self.tile!r} is only meaningful with granularity='tile', not {g!r}")
        if not isinstance(self.block, int) or isinstance(self.block, bool) or self.block < 1:
            raise ValueError(f"block must be a positive int, got {self.block!r}")
        if not isinstance(self.margin, int) or isinstance(self.margin, bool):
            raise ValueError(f"margin must be an int, got {self.margin!r}")
        sf = self.scale_fmt
        if sf is not None and not isinstance(sf, FloatFormat):
            sf = get_format(sf)
            object.__setattr__(self, "scale_fmt", sf)
        if g == "mx":
            if sf is None:
                sf = get_format("e8m0")
                object.__setattr__(self, "scale_fmt", sf)
            if sf.nan_encoding != "e8m0":
                raise ValueError(f"MX scales are E8M0 (OCP MX v1.0); got scale_fmt={sf}")
            object.__setattr__(self, "power_of_two", True)
        elif sf is not None and sf.mantissa_bits == 0 and not self.power_of_two:
            raise ValueError(f"scale_fmt={sf} holds only powers of two: pass power_of_two=True")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def per_tensor(cls, **kw) -> ScalingRecipe:
        """One scale for the whole tensor (TE delayed / current scaling)."""
        return cls("tensor", **kw)

    @classmethod
    def per_row(cls, **kw) -> ScalingRecipe:
        """One scale per row (amax over the last dim; ``_scaled_mm`` row-wise scales)."""
        return cls("row", **kw)

    @classmethod
    def tile_1x128(cls, **kw) -> ScalingRecipe:
        """One scale per 1x128 tile (TE ``Float8BlockScaling`` / DeepSeek-V3 activations)."""
        return cls("tile", tile=(1, 128), **kw)

    @classmethod
    def tile_128x128(cls, **kw) -> ScalingRecipe:
        """One scale per 128x128 tile (TE ``Float8BlockScaling`` / DeepSeek-V3 weights)."""
        return cls("tile", tile=(128, 128), **kw)

    @classmethod
    def mx(cls, block: int = 32, **kw) -> ScalingRecipe:
        """OCP MX: one E8M0 scale per ``block`` consecutive elements of the last dim."""
        return cls("mx", block=block, **kw)

    @classmethod
    def parse(cls, spec: str | ScalingRecipe) -> ScalingRecipe:
        return get_recipe(spec)

    # ------------------------------------------------------------------ description
    @property
    def name(self) -> str:
        if self.granularity == "tile":
            base = f"{self.tile[0]}x{self.tile[1]}"
        elif self.granularity == "mx":
            base = f"mx{self.block}"
        else:
            base = self.granularity
        extra = []
        if self.power_of_two and self.granularity != "mx":
            extra.append("pow2")
        if self.margin:
            extra.append(f"margin={self.margin}")
        if self.scale_fmt is not None and self.granularity != "mx":
            extra.append(f"scale={self.scale_fmt}")
        return base + "".join(f"[{e}]" for e in extra)

    def __str__(self) -> str:
        return self.name

    @property
    def scale_format(self) -> FloatFormat:
        """The format the scales are stored in (fp32 when ``scale_fmt`` is None)."""
        return self.scale_fmt if self.scale_fmt is not None else get_format("fp32")


_TILE_RE = re.compile(r"^(\d+)x(\d+)$")
_MX_RE = re.compile(r"^mx(?:fp)?(\d*)$")


def get_recipe(spec: str | ScalingRecipe) -> ScalingRecipe:
    """Parse ``"tensor"``, ``"row"``, ``"AxB"`` (``"1x128"``, ``"128x128"``), ``"mx"`` / ``"mxK"``
    (``"mx32"``); a :class:`ScalingRecipe` is returned unchanged."""
    if isinstance(spec, ScalingRecipe):
        return spec
    key = str(spec).strip().lower().replace("-", "_")
    if key in ("tensor", "per_tensor", "tensorwise"):
        return ScalingRecipe.per_tensor()
    if key in ("row", "per_row", "rowwise", "channel", "per_channel"):
        return ScalingRecipe.per_row()
    m = _TILE_RE.match(key)
    if m:
        return ScalingRecipe("tile", tile=(int(m.group(1)), int(m.group(2))))
    m = _MX_RE.match(key)
    if m:
        return ScalingRecipe.mx(block=int(m.group(1)) if m.group(1) else 32)
    raise ValueError(f"unknown scaling recipe {spec!r}; use 'tensor', 'row', 'AxB' (e.g. '1x128', "
                     f"'128x128') or 'mxK' (e.g. 'mx32')")


per_tensor = ScalingRecipe.per_tensor
per_row = ScalingRecipe.per_row
tile_1x128 = ScalingRecipe.tile_1x128
tile_128x128 = ScalingRecipe.tile_128x128
mx = ScalingRecipe.mx


# ---------------------------------------------------------------------- blocking
def _check_shape(shape: torch.Size, recipe: ScalingRecipe) -> tuple[int, int] | None:
    """(rows, cols) of one block along the last two dims, or None for the whole tensor."""
    g = recipe.granularity
    if g == "tensor":
        return None
    if len(shape) == 0:
        raise ValueError(f"recipe {recipe} needs a tensor with at least one dim, got shape {tuple(shape)}")
    if g == "row":
        return (1, shape[-1])
    a, b = recipe.tile if g == "tile" else (1, recipe.block)
    if a > 1 and len(shape) < 2:
        raise ValueError(f"recipe {recipe} needs a tensor with at least two dims, got shape {tuple(shape)}")
    if shape[-1] % b or (a > 1 and shape[-2] % a):
        what = f"last dim {shape[-1]} % {b}" if shape[-1] % b else f"second-to-last dim {shape[-2]} % {a}"
        raise ValueError(f"shape {tuple(shape)} does not divide into {a}x{b} blocks of recipe {recipe} "
                         f"({what} != 0); pad the tensor (e.g. torch.nn.functional.pad) or choose another recipe")
    return (a, b)


def _block_amax(x: torch.Tensor, recipe: ScalingRecipe) -> torch.Tensor:
    """max |x| per block, in the compact scale shape (NaN if the block has a NaN)."""
    blk = _check_shape(x.shape, recipe)
    a = x.abs()
    if blk is None:
        return a.amax() if a.numel() else torch.zeros((), dtype=a.dtype)
    r, c = blk
    if recipe.granularity == "row":
        return a.amax(dim=-1, keepdim=True)
    lead = a.shape[:-2] if r > 1 else a.shape[:-1]
    if r > 1:
        m, n = a.shape[-2], a.shape[-1]
        return a.reshape(*lead, m // r, r, n // c, c).amax(dim=(-3, -1))
    return a.reshape(*lead, a.shape[-1] // c, c).amax(dim=-1)


def _expand(s: torch.Tensor, shape: torch.Size, recipe: ScalingRecipe) -> torch.Tensor:
    """Per-block tensor (compact shape) -> one value per element of ``shape``."""
    blk = _check_shape(shape, recipe)
    if blk is None or recipe.granularity == "row":
        return s.expand(shape)
    r, c = blk
    out = s.repeat_interleave(c, dim=-1)
    if r > 1:
        out = out.repeat_interleave(r, dim=-2)
    return out


# ---------------------------------------------------------------------- scales
def scales_from_amax(amax: torch.Tensor, fmt: FloatFormat | str,
                     recipe: ScalingRecipe | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, scale_inv)`` (float64, same shape as ``amax``) for blocks with that amax.

    ``x * scale`` is rounded to ``fmt``; ``q * scale_inv`` dequantizes. Formulas in the
    module docstring (TE ``compute_scale_from_amax``; OCP MX v1.0 section 6.3).
    """
    fmt = get_format(fmt)
    recipe = get_recipe(recipe)
    a = torch.as_tensor(amax, dtype=torch.float64)
    sf = recipe.scale_format
    if recipe.granularity == "mx":
        _, e = torch.frexp(a)  # a = m * 2**e, m in [0.5, 1): floor(log2 a) = e - 1 (exact)
        x_exp = (e.to(torch.float64) - 1) - fmt.emax + recipe.margin
        x_exp = torch.where(a == 0, torch.full_like(x_exp, float(sf.emin)), x_exp)
        x_exp = x_exp.clamp(min=sf.emin)
        x_exp = torch.where((x_exp > sf.emax) | ~torch.isfinite(a), torch.full_like(x_exp, float("nan")), x_exp)
        scale_inv = torch.exp2(x_exp)  # exact: integer exponents in [-127, 127]
        return torch.exp2(-x_exp), scale_inv
    quotient = fmt.max / a / 2.0**recipe.margin
    if recipe.power_of_two:
        # TE: the fp32 quotient with its mantissa bits cleared (rounded down to 2**k),
        # then stored in the scale format (exact unless outside its range)
        s = round_to(quotient, "fp32", overflow="saturate")
        _, e = torch.frexp(s)
        s = torch.where(s > 0, torch.ldexp(torch.ones_like(s), (e - 1).to(torch.float64)), s)
    else:
        s = round_to(quotient, sf, overflow="saturate")
    s = torch.where(s == 0, torch.full_like(s, sf.min_subnormal), s)  # amax beyond the scale's range
    if recipe.power_of_two:
        s = round_to(s, sf, overflow="saturate")
    s = torch.where((a == 0) | ~torch.isfinite(a), torch.ones_like(s), s)
    return s, _scale_inv(s, recipe)


def _scale_inv(scale: torch.Tensor, recipe: ScalingRecipe) -> torch.Tensor:
    """The stored dequantization multiplier: ``RN_sf(1 / s)`` (TE); exact for powers of two."""
    if recipe.granularity == "mx":
        return 1.0 / scale  # exact: powers of two (NaN stays NaN)
    return round_to(1.0 / scale, recipe.scale_format, overflow="saturate")


# ---------------------------------------------------------------------- quantize
@dataclass(frozen=True, eq=False)
class Quantized:
    """A block-scaled tensor.

    Attributes:
        values: float64, same shape as the input, every element on ``fmt``'s grid: the
            stored low-precision values ``q`` (not multiplied back by the scale).
        scale: float64, one per block (compact shape: ``()`` per tensor, ``(..., M, 1)`` per
            row, ``(..., M // a, N // b)`` per ``a x b`` tile (``(..., M, N // b)`` for
            ``a = 1``), ``(..., N // block)`` for MX); ``values ~= x * scale``. Use
            :meth:`expand` to get one value per element.
        recipe, fmt: how it was quantized.
        amax: the per-block amax the scales were derived from (compact shape).
        saturated: bool mask (shape of ``values``) of the elements whose rounded value
            ``RN(x * scale)`` would exceed ``fmt.max`` in magnitude and that were clamped to
            ``+-fmt.max`` instead (their error is not round-off). A value just above
            ``fmt.max`` that rounds to it is not saturated.
    """

    values: torch.Tensor
    scale: torch.Tensor
    recipe: ScalingRecipe
    fmt: FloatFormat
    amax: torch.Tensor | None = None
    saturated: torch.Tensor | None = field(default=None, repr=False)

    @property
    def scale_inv(self) -> torch.Tensor:
        """Dequantization multiplier per block (compact shape): TE's ``scale_inv`` /
        ``torch._scaled_mm``'s ``scale_a``; for MX the E8M0 shared scale ``X = 2**shared_exp``."""
        return _scale_inv(self.scale, self.recipe)

    @property
    def shared_exponent(self) -> torch.Tensor:
        """MX only: the integer shared exponents ``log2 X`` (float64 so that NaN fits)."""
        if self.recipe.granularity != "mx":
            raise ValueError(f"shared_exponent is defined for MX recipes, not {self.recipe}")
        return torch.log2(self.scale_inv)

    def expand(self, per_block: torch.Tensor) -> torch.Tensor:
        """Broadcast a per-block tensor (e.g. ``scale``) to one value per element."""
        return _expand(per_block, self.values.shape, self.recipe)

    def dequantize(self) -> torch.Tensor:
        """``values * scale_inv`` per block, in float64."""
        return self.values * self.expand(self.scale_inv)

    def as_torch(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The stored values in a torch low-precision dtype (exact: they are on the grid)."""
        dtype = dtype or self.fmt.torch_dtype
        if dtype is None:
            raise ValueError(f"format {self.fmt} has no torch dtype; pass dtype=")
        return self.values.to(dtype)


def quantize(x: torch.Tensor, fmt: FloatFormat | str, recipe: ScalingRecipe | str = "tensor",
             amax: torch.Tensor | float | None = None) -> Quantized:
    """Quantize ``x`` to ``fmt`` with block scales chosen by ``recipe``.

    Args:
        x: real tensor (any dtype; computed in float64).
        fmt: element format (``"e4m3"``, ``"e5m2"``, ``"e2m1"``...).
        recipe: a :class:`ScalingRecipe` or a string for :func:`get_recipe`.
        amax: optional amax per block (a scalar, or a tensor broadcastable to the compact
            scale shape) instead of the measured one: delayed scaling. Elements with
            ``|x| > amax`` saturate.

    Returns a :class:`Quantized`; see the module docstring for the formulas.
    Raises ``ValueError`` when the shape does not divide into the recipe's blocks.
    """
    fmt = get_format(fmt)
    recipe = get_recipe(recipe)
    xd = x.to(torch.float64)
    measured = _block_amax(xd, recipe)
    if amax is None:
        a = measured
    else:
        try:
            a = torch.as_tensor(amax, dtype=torch.float64).broadcast_to(measured.shape).clone()
        except RuntimeError as err:
            raise ValueError(f"amax of shape {tuple(torch.as_tensor(amax).shape)} does not broadcast to the "
                             f"per-block shape {tuple(measured.shape)} of recipe {recipe} for x of shape "
                             f"{tuple(x.shape)}") from err
    scale, scale_inv = scales_from_amax(a, fmt, recipe)
    if recipe.granularity == "mx":
        y = xd / _expand(scale_inv, xd.shape, recipe)  # V_i / X, exact
    else:
        y = xd * _expand(scale, xd.shape, recipe)
    r = round_to(y, fmt, overflow="nan")
    saturated = torch.isnan(r) & ~torch.isnan(y)  # rounded beyond +-max (or +-inf): clamped
    values = torch.where(saturated, torch.sign(y) * fmt.max, r)  # == round_to(y, fmt, overflow="saturate")
    return Quantized(values=values, scale=scale, recipe=recipe, fmt=fmt, amax=a, saturated=saturated)


def fake_quant(x: torch.Tensor, fmt: FloatFormat | str, recipe: ScalingRecipe | str = "tensor",
               amax: torch.Tensor | float | None = None) -> torch.Tensor:
    """``quantize(x, fmt, recipe, amax).dequantize()``: ``x`` as the low-precision GEMM sees it (float64)."""
    return quantize(x, fmt, recipe, amax).dequantize()
