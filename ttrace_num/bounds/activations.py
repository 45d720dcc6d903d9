r"""Elementwise activations (``gelu`` erf/tanh, ``silu``, ``swiglu``) and the residual ``add``.

Notation: ``c`` is the compute format (unit roundoff ``u``), ``o`` the output (storage)
format, ``hu_f(t)`` = :func:`~ttrace_num.formats.half_ulp` (the round-to-nearest error
bound of format ``f`` at magnitude ``<= t``; absolute below the normal range, ``inf``
above ``f.max``). Inputs are the stored values, taken as exact. Every bound below is the
sum of: terms from *roundings* of IEEE operations in ``c`` (``r_k``, ``|r_k| <= hu_c(.)``),
terms from the *library function's own error* (``ERF``, ``TANH``, ``EXP``: a fixed,
data-dependent error, never random), terms from rounded *constants*, and the final
*output rounding* ``hu_o(|y| + err_c)`` (0 when ``c -> o`` is exact).

Computation model (stated for torch CPU and verified there, see below): the input is
converted to ``c`` (fp32 for bf16/fp16/fp32 inputs; exact), the activation is evaluated
in ``c`` by the formula below, and the result is rounded once to ``o``.

gelu, ``approximate="none"``::

    t^ = fl(x * c1^), c1^ = fl(1/sqrt 2);  e^ = ERF(t^), |ERF(t) - erf(t)| <= A_erf
    s^ = fl(1 + e^);  h^ = fl(x/2);  y_c = fl(h^ * s^);  y = fl_o(y_c)

With ``s = 1 + erf(x/sqrt2) = 2 Phi(x)`` and ``h = x/2``:

* ``|t^ - t| <= |x| |c1^ - c1| + hu_c(|x| c1^) =: dt``;
* ``|erf(t^) - erf(t)| <= erf'(t) r_t + |x||c1^-c1| (2/sqrt pi) e^{-tl^2} + 0.49 dt^2``
  (Taylor with ``max|erf''| = (4/sqrt pi)/sqrt(2e) < 0.98``; ``tl = max(0, |t| - dt)``),
  or ``erfc(tl)`` when smaller (both values within ``erfc(tl)`` of ``+-1``);
* ``|s^ - s| <= ds := A_erf + d_erf + hu_c(s + A_erf + d_erf)``;
* ``|h^ s^ - h s| <= h ds + dh (s + ds)`` (``dh = hu_c(h)`` only if ``x/2`` is subnormal);
* ``|y_c - g| <= h ds + dh(s + ds) + hu_c(g + h ds + dh(s+ds))``.

The absolute term ``h * A_erf`` is what matters in the left tail: for ``x << 0``, ``s``
is tiny and ``1 + e^`` cancels, so the *relative* error of gelu is unbounded there (torch
returns 0 for ``x < -5.9`` in fp32 where ``gelu(x) = x Phi(x)`` is ~1e-9 or smaller);
the bound is then ``~|x| A_erf / 2``, absolute.

gelu, ``approximate="tanh"``: ``u = beta (x + kappa x^3)`` with ``beta = sqrt(2/pi)``,
``kappa = 0.044715`` (exact decimal, as the reference), both rounded to ``c``::

    x3 = fl(fl(x x) x);  k3 = fl(kappa^ x3);  a = fl(x + k3);  u^ = fl(beta^ a)
    s^ = fl(1 + TANH(u^)), |TANH(v) - tanh(v)| <= A_tanh;  y_c = fl(fl(x/2) s^)

``x`` and ``kappa x^3`` have the same sign, so every step is a relative perturbation:
``|u^ - u| <= du`` accumulated step by step (each step: propagated error + constant
error + ``hu_c`` of the magnitude); then ``|tanh(u^) - tanh(u)| <= sech^2(max(0,|u|-du)) du``
(mean value theorem; ``sech^2`` decreases in ``|v|``). If an intermediate overflows in
``c`` (``|x|^3 > c.max``) then ``u^ = +-inf`` with the sign of ``x`` and ``TANH = +-1``,
so the error of ``s^`` is ``1 - tanh(|u|) + A_tanh``. The rest is as for the erf form.

silu: ``y_c = fl(x / fl(1 + EXP(-x)))``, ``|EXP(v) - e^v| <= R_exp e^v + eta_c``
(``eta_c`` = half the subnormal spacing). With ``e = e^{-x}``, ``d = 1 + e``:
``|d^ - d| <= dd := R_exp e + eta_c + hu_c(d + R_exp e + eta_c)`` and
``|x/d^ - x/d| <= |x| dd / (d (d - dd))``; then ``+ hu_c(|y| + .)``. Relative error about
``R_exp e/(1+e) + 2u``. If ``EXP(-x)`` may overflow (``e (1 + R_exp) >= c.max / 2``,
i.e. ``x < -88`` in fp32) the computed value is ``0`` or ``x/d^`` with
``d^ >= e (1 - R_exp)``, so the error is at most ``|y| + |x| / (e (1 - R_exp))`` (+ rounding).

swiglu (Megatron ``swiglu``: ``a, b = chunk(x, 2, dim)``; ``silu(a) * b``). Unfused
(Megatron's eager function, the default): ``silu(a)`` is rounded to ``o`` and the product
is evaluated in ``c`` (exact when ``2 p_o <= p_c``, e.g. bf16 x bf16 in fp32) and rounded
to ``o``: ``|y - s b| <= |b| B_silu(a) + hu_c(.) + hu_o(|s b| + .)`` with ``B_silu`` the silu
bound *including* its rounding to ``o``. Fused (``fused=True``: a compiled/JIT kernel that
keeps ``silu(a)`` in ``c``): ``B_silu`` without the rounding to ``o``, one final rounding.

add: ``y = fl_o(fl_c(x^ + y^))`` with ``x^ = fl_c(x)`` (exact when the storage embeds in
``c``): ``|err| <= dx + dy + hu_c(|x+y| + dx + dy) + hu_o(|x+y| + .)``, and **0** where the
exact sum is representable in both ``c`` and ``o`` (checked exactly with TwoSum). On CPU,
bf16/fp16 adds are computed in fp32 and rounded to the storage format, so the bound is
``hu_fp32 + hu_o``: the fp32 term covers the (rare) double rounding.

Flush to zero (``ftz=True``, the default). AVX512-BF16 kernels convert fp32 to bf16 with
``vcvtneps2bf16``, which flushes results below bf16's normal range to 0 (measured: torch
2.13's bf16 ``gelu`` on an AVX512-BF16 EPYC, 158 violations of the gradual-underflow bound);
other FTZ kernels (GPU fast-math, ``torch.set_flush_denormal``) flush in ``c``. Where the
computed result (within ``err`` of ``|y|``) may lie below the normal range of ``c`` or ``o``
its flush costs at most ``min(|y| + err, min_normal)``: the bound is the larger of that and
``err`` there (:func:`flushed`). Only results below ``2^-126`` (bf16, fp32) or ``6.1e-5``
(fp16) change: tightness on normal data
is unchanged. ``ftz=False``: gradual underflow (a kernel known not to flush).

Library errors (:class:`LibraryErrors`). For torch CPU in fp32 the constants are
*measured*, not derived: ``A_erf`` and ``A_tanh`` (absolute, in units of ``u_c``) and
``R_exp`` (relative, units of ``u_c``) are the smallest constants for which the stated
formulas hold on every tested input (:func:`_implied_constant`), for the kernels torch
actually runs: ``F.gelu`` is oneDNN's ``gelu_erf`` when mkldnn is enabled (the default),
ATen's vectorised Abramowitz-Stegun 7.1.26 ``erf`` (|approximation error| <= 1.5e-7 = 2.5 u,
plus the cancellation in ``1 - r t exp(-t^2)`` evaluated in fp32) otherwise; ``F.silu`` is
ATen's ``x / (1 + exp(-x))`` (Sleef ``expf`` u10); tanh-gelu ATen with Sleef ``tanhf`` u10
(documented <= 1 ulp). Measured on torch 2.13.0+cpu (AVX2; elementwise results do not
depend on the vector width), maximised over mkldnn on/off and both signs:

* a sweep of every 61st fp32 bit pattern with ``|x| < 64`` plus 10^6 uniform in [-20, 20]
  (3.8e7 inputs; :func:`measure_torch_cpu_constants`): ``A_erf`` 8.68 u, ``A_tanh`` 0.99998 u,
  ``R_exp`` 1.03 u;
* gelu, exhaustively: every fp32 with ``2^-8 <= |x| < 2^-1`` (the binades where the
  implied constant peaks; 6 x 8.4e6 values per sign and kernel), every 61st bit pattern of
  the other binades in ``[2^-14, 8)`` (per-binade maxima 0.99-7.2 u there): max
  ``A_erf`` = 9.147 u (ATen path, ``x`` in [1/32, 1/16)); oneDNN 8.88 u;
* ``torch.rsqrt`` (ATen ``Vectorized::rsqrt`` = ``fl(1 / fl(sqrt(w)))``, two correct
  roundings, at most ``2u/(1-u)``): every fp32 in [1, 4) (exhaustive; exact under scaling
  by 4): 1.49999993 u.

Per dispatch (``ATEN_CPU_CAPABILITY``; :mod:`ttrace_num.cpu_kernels`), max over mkldnn on/off,
in units of ``u``; ``default`` and ``avx2`` measured on a 2-core AMD EPYC Zen3 (AVX2) with
:func:`_implied_constant` sweeps (every 997th fp32 bit pattern with ``|x| < 64``, both signs,
10^6 uniform in [-20, 20], and every 13th fp32 of the binades ``[2^-8, 2^-1)`` for gelu: 3.2e6
+ 9.0e6 inputs), ``avx512`` recorded on an AMD EPYC with avx512_bf16 (the whole-range test
sweep; tanh-gelu and silu had no violation at 1.0 and 1.5):

=========== ========== ========== ========= =====================================
dispatch    ``A_erf``  ``A_tanh`` ``R_exp`` note
=========== ========== ========== ========= =====================================
default     8.66       1.19       1.00      scalar ATen tanh-gelu above 1 ulp
avx2        9.147      0.99998    1.03      exhaustive in the peak binades (above)
avx512      10.2       <= 1.0     <= 1.5    4 gelu violations at 9.5 (sweep only)
=========== ========== ========== ========= =====================================

These are measured kernel constants, not fudge factors: :data:`TORCH_CPU` takes their maximum
over the characterised dispatches, each the smallest multiple of ``u/2`` strictly above it:
``A_erf = 10.5 u``, ``A_tanh = 1.5 u``, ``R_exp = 1.5 u``, ``rsqrt_rel = 1.5 u`` (before: 9.5 and
1.0, the avx2 values, violated on the default and avx512 dispatches). A test re-measures them
on a fresh random sample on the dispatch it runs on (:mod:`tests.test_bounds_activations`).
For other compute formats (and for the emulations of :mod:`ttrace_num.emulate.activations`)
the model is a *correctly rounded* library function: ``A = u/2`` (|erf|, |tanh| < 1),
``R_exp = 1``, ``rsqrt_rel = 1``. Other hardware (GPU ``erff``/``tanhf``/``__expf``):
pass ``library=LibraryErrors(...)`` with that platform's documented or measured values.

Probabilistic mode: only the roundings of IEEE operations in ``c`` are random (mean
independent, Higham & Mary 2019); library errors, constants, second-order remainders and
the output rounding are kept deterministic. With ``k`` random terms ``b_k`` the bound is
``fixed + min(sum b_k, lambda sqrt(sum b_k^2)) + output``; with the 2-6 roundings of these
ops and ``lambda >= 2.45`` (failure probability <= 0.1) this equals the deterministic bound,
as it should: there is nothing to average over in one elementwise evaluation.

Tightness (bench: median over trials of bound/error at the worst element): bf16/fp16
outputs 1.0 (the output rounding dominates); fp32: silu 1.0-1.3, tanh-gelu 1.2-1.8, gelu
1.5-2.0 (the measured ``A_erf`` is attained only on a few inputs near ``|x| ~ 0.05``),
swiglu 1.0-1.2, add 1.0 (exact results get a 0 bound). In the gelu tails (``x < -6`` in fp32) the bound is
``~|x| A_erf/2`` while torch's error is ``|gelu(x)|`` (it returns 0): loose in ratio, but
that element is never the tightest one, and a correct kernel that evaluated ``1 + erf`` by
cancellation may err that much.

Sources: Higham, *Accuracy and Stability of Numerical Algorithms* (2002) §2.2 (the
rounding model), §3.1 (error propagation); Abramowitz & Stegun (1964) 7.1.26; Higham &
Mary, SISC 41(5) 2019 (probabilistic model); Megatron-LM ``fused_bias_swiglu.py``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch

from ..cpu_kernels import warn_if_uncharacterised
from ..formats import FloatFormat, get_format, half_ulp
from ..rounding import representable, round_to
from .base import Bound, Explanation
from .common import (
    FP32,
    ModeSpec,
    Precision,
    f64,
    register,
    resolve_mode,
    resolve_precision,
)
from .summation import conversion_exact, products_exact

__all__ = [
    "CORRECTLY_ROUNDED",
    "TORCH_CPU",
    "LibraryErrors",
    "add",
    "combine",
    "gelu",
    "gelu_error",
    "flushed",
    "hu",
    "inflate",
    "measure_torch_cpu_constants",
    "resolve_library",
    "silu",
    "silu_error",
    "swiglu",
]

SOURCE = ("Higham, Accuracy and Stability of Numerical Algorithms (2002) §2.2, §3.1; library errors measured "
          "(see ttrace_num.bounds.activations); probabilistic: Higham & Mary, SISC 41(5) 2019")

_SQRT_PI = math.sqrt(math.pi)
#: relative error of magnitudes evaluated in float64 (a handful of float64 operations,
#: each <= 2**-53): every float64-evaluated magnitude is multiplied by 1 + 2**-40.
_F64_SLACK = 2.0 ** -40
#: max |g'| of gelu (erf: Phi(x) + x phi(x) at x = sqrt 2 is 1.12890; tanh form 1.12899)
#: and of silu (1.09984 at x = 2.3994), rounded up: Lipschitz constants for inputs that
#: are not representable in the compute format.
_LIPSCHITZ = {"gelu": 1.1300, "silu": 1.1000}


def inflate(t: torch.Tensor) -> torch.Tensor:
    """Magnitude computed in float64 -> a safe upper bound (times ``1 + 2**-40``)."""
    return t * (1.0 + _F64_SLACK)


def hu(t: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """``half_ulp`` of a float64 magnitude; NaN magnitudes give inf, and magnitude 0 gives
    the subnormal bound (``half_ulp(0)`` computes the exponent of 0 as -1)."""
    h = torch.nan_to_num(half_ulp(t, fmt), nan=math.inf, posinf=math.inf)
    return torch.where(t == 0, torch.full_like(h, fmt.subnormal_abs_error), h)


def combine(fixed: torch.Tensor, random_terms: list[torch.Tensor], ms: ModeSpec) -> torch.Tensor:
    """``fixed + sum b_k`` (deterministic) or ``fixed + min(sum b_k, lambda sqrt(sum b_k^2))``.

    ``b_k`` bound the martingale increments (roundings with predictable coefficients);
    Azuma-Hoeffding: ``|sum| <= lambda sqrt(sum b_k^2)`` with probability ``>= 1 - 2 exp(-lambda^2/2)``."""
    if not random_terms:
        return fixed
    s = sum(random_terms)
    if ms.mode == "deterministic":
        return fixed + s
    q = torch.sqrt(sum(b * b for b in random_terms))
    return fixed + torch.minimum(s, ms.lam * q)


# ----------------------------------------------------------------------------- library model


@dataclass(frozen=True)
class LibraryErrors:
    """Error model of the elementary functions a kernel calls, in units of ``u`` of the
    compute format: ``|ERF(t) - erf(t)| <= erf_abs u``, ``|TANH(t) - tanh(t)| <= tanh_abs u``,
    ``|EXP(t) - e^t| <= exp_rel u e^t + eta``, ``|RSQRT(w) - w^-1/2| <= rsqrt_rel u w^-1/2``.

    ``fmt`` is the compute format the constants were measured for (``None``: the
    correctly rounded model, valid in any format)."""

    name: str
    erf_abs: float
    tanh_abs: float
    exp_rel: float
    rsqrt_rel: float
    fmt: FloatFormat | None = None


#: torch 2.13 CPU kernels in fp32: the maximum over the characterised dispatches (default, avx2,
#: avx512; :data:`ttrace_num.cpu_kernels.CHARACTERISED`) of the measured constants (module docstring).
TORCH_CPU = LibraryErrors("torch_cpu", erf_abs=10.5, tanh_abs=1.5, exp_rel=1.5, rsqrt_rel=1.5, fmt=FP32)
#: correctly rounded elementary functions (the emulations; any format).
CORRECTLY_ROUNDED = LibraryErrors("correctly_rounded", erf_abs=0.5, tanh_abs=0.5, exp_rel=1.0, rsqrt_rel=1.0)


def resolve_library(library: LibraryErrors | str | None, compute: FloatFormat) -> LibraryErrors:
    """Default: :data:`TORCH_CPU` when computing in fp32, else :data:`CORRECTLY_ROUNDED`.
    :data:`TORCH_CPU` warns once where torch runs CPU kernels it was not measured on
    (:mod:`ttrace_num.cpu_kernels`)."""
    if library is None:
        library = TORCH_CPU if compute == FP32 else CORRECTLY_ROUNDED
    if isinstance(library, str):
        table = {"torch_cpu": TORCH_CPU, "correctly_rounded": CORRECTLY_ROUNDED}
        if library not in table:
            raise ValueError(f"unknown library {library!r}; use one of {sorted(table)} or a LibraryErrors")
        library = table[library]
    if library.fmt is not None and library.fmt != compute:
        raise ValueError(f"library errors {library.name!r} were measured for {library.fmt}, not {compute}; "
                         "pass library='correctly_rounded' or your own LibraryErrors")
    if library is TORCH_CPU:
        warn_if_uncharacterised()
    return library


def _const_error(value: float | Fraction, c: FloatFormat) -> tuple[float, float]:
    """``(fl_c(value), |fl_c(value) - value|)`` for a real constant given as float64 or Fraction
    (the float64 of an irrational constant is within 2**-53 relative: that is added)."""
    v64 = float(value)
    vc = float(round_to(torch.tensor(v64, dtype=torch.float64), c))
    if isinstance(value, Fraction):
        err = abs(Fraction(vc) - value)
        return vc, float(err) * (1 + 2.0 ** -50)
    return vc, abs(vc - v64) + abs(v64) * 2.0 ** -52


# ----------------------------------------------------------------------------- per-op error parts


@dataclass
class _Parts:
    """Error of the value computed in ``c`` (before the output rounding):
    ``fixed`` (deterministic), ``random`` (rounding increments), ``mag`` ~ ``|y|``."""

    fixed: torch.Tensor
    random: list[torch.Tensor]
    mag: torch.Tensor

    def total(self, ms: ModeSpec) -> torch.Tensor:
        return combine(self.fixed, self.random, ms)


def _subnormal_half(h: torch.Tensor, c: FloatFormat) -> torch.Tensor:
    """Error of ``fl_c(x/2)``: 0 when ``x/2`` is normal (exact), else ``hu_c``."""
    return torch.where(h < c.min_normal, hu(h, c), torch.zeros_like(h))


def _half_times_s(ax: torch.Tensor, s: torch.Tensor, ds_fixed: torch.Tensor, ds_rand: list[torch.Tensor],
                  c: FloatFormat) -> _Parts:
    """``y_c = fl(fl(x/2) * s^)`` given ``|s^ - s| <= ds`` (split fixed/random); ``g = x s / 2``."""
    h = ax * 0.5
    ds = ds_fixed + sum(ds_rand)
    dh = _subnormal_half(h, c)
    g = inflate(h * s)
    pre = h * ds + dh * (s + ds)
    prod = hu(g + pre, c)
    return _Parts(fixed=h * ds_fixed, random=[h * b for b in ds_rand] + [dh * (s + ds), prod], mag=g)


def _gelu_erf_parts(x: torch.Tensor, c: FloatFormat, lib: LibraryErrors) -> _Parts:
    ax = x.abs()
    c1 = 1.0 / math.sqrt(2.0)
    c1h, dc1 = _const_error(c1, c)
    t = ax * c1
    r_t = hu(ax * c1h, c)  # rounding of x * c1^
    dt = ax * dc1 + r_t
    tl = (t - dt).clamp(min=0.0)
    slope = (2.0 / _SQRT_PI) * torch.exp(-tl * tl)
    rem = 0.49 * dt * dt  # second-order Taylor remainder, max|erf''|/2 < 0.49
    s = inflate(torch.special.erfc(-x * c1))  # 1 + erf(x/sqrt 2) = 2 Phi(x)
    a_erf = lib.erf_abs * c.u
    d_erf_fixed = slope * ax * dc1 + rem
    d_erf_rand = slope * r_t
    # far in the tails erf(t^) and erf(t) are both within erfc(tl) of +-1 (same sign)
    alt = torch.where(tl > 0, torch.special.erfc(tl), torch.full_like(tl, 2.0))
    use_alt = alt < d_erf_fixed + d_erf_rand
    d_erf_fixed = torch.where(use_alt, alt, d_erf_fixed)
    d_erf_rand = torch.where(use_alt, torch.zeros_like(alt), d_erf_rand)
    r_s = hu(s + a_erf + d_erf_fixed + d_erf_rand, c)  # rounding of 1 + e^
    return _half_times_s(ax, s, a_erf + d_erf_fixed, [d_erf_rand, r_s], c)


def _gelu_tanh_parts(x: torch.Tensor, c: FloatFormat, lib: LibraryErrors) -> _Parts:
    ax = x.abs()
    dbeta = _const_error(math.sqrt(2.0 / math.pi), c)[1]
    dkappa = _const_error(Fraction("0.044715"), c)[1]
    beta, kappa = math.sqrt(2.0 / math.pi), float(Fraction("0.044715"))
    # |u^ - u| accumulated over the chain (all terms share the sign of x): deterministic
    x2 = ax * ax
    e2 = hu(x2, c)
    x3 = inflate(x2 * ax)
    e3 = e2 * ax + hu((x2 + e2) * ax, c)
    k3 = inflate(kappa * x3)
    ek = dkappa * (x3 + e3) + kappa * e3 + hu((kappa + dkappa) * (x3 + e3), c)
    a = inflate(ax + k3)
    ea = ek + hu(a + ek, c)
    u_t = inflate(beta * a)
    du = dbeta * (a + ea) + beta * ea + hu((beta + dbeta) * (a + ea), c)
    ul = (u_t - du).clamp(min=0.0)
    sech2 = 1.0 / torch.cosh(ul).square()
    d_tanh = sech2 * du
    # overflow of x^3 (or later) in c: u^ = +-inf with the sign of x, TANH = +-1
    sat = 2.0 / (1.0 + torch.exp(2.0 * u_t))  # 1 - tanh(|u|)
    d_tanh = torch.where(torch.isfinite(du), torch.nan_to_num(d_tanh, nan=math.inf, posinf=math.inf), sat)
    s = inflate(2.0 * torch.sigmoid(2.0 * beta * torch.sign(x) * a))  # 1 + tanh(u)
    a_tanh = lib.tanh_abs * c.u
    r_s = hu(s + a_tanh + d_tanh, c)
    return _half_times_s(ax, s, a_tanh + d_tanh, [r_s], c)


def _silu_parts(x: torch.Tensor, c: FloatFormat, lib: LibraryErrors) -> _Parts:
    ax = x.abs()
    e = torch.exp(-x)  # may be inf (x < -709): then the overflow branch applies
    R = lib.exp_rel * c.u
    eta = c.subnormal_abs_error
    d = 1.0 + e
    y = inflate(ax / d)
    ex_err = R * e + eta  # library error of EXP(-x)
    r_d = hu(inflate(d) + ex_err, c)  # rounding of 1 + EXP
    dd = ex_err + r_d
    den = d * (d - dd)
    q_fixed = ax * ex_err / den
    q_rand = ax * r_d / den
    r_y = hu(y + q_fixed + q_rand, c)
    overflow = e * (1.0 + R) >= c.max / 2
    safe = ~overflow & torch.isfinite(den) & (den > 0)
    # possible overflow of EXP(-x): y^ is 0 or x/d^ with d^ >= e (1 - R)
    worst = y + ax / (e * (1.0 - R)) * (1.0 + c.u) + eta + hu(ax / (e * (1.0 - R)), c)
    zero = torch.zeros_like(x)
    fixed = torch.where(safe, q_fixed, torch.nan_to_num(worst, nan=math.inf, posinf=math.inf))
    return _Parts(fixed=fixed, random=[torch.where(safe, q_rand, zero), torch.where(safe, r_y, zero)], mag=y)


def _parts(op: str, x: torch.Tensor, c: FloatFormat, lib: LibraryErrors, approximate: str = "none") -> _Parts:
    if op == "gelu":
        if approximate == "none":
            return _gelu_erf_parts(x, c, lib)
        if approximate == "tanh":
            return _gelu_tanh_parts(x, c, lib)
        raise ValueError(f"approximate must be 'none' or 'tanh', not {approximate!r}")
    return _silu_parts(x, c, lib)


def flushed(err: torch.Tensor, mag: torch.Tensor, fmts: tuple[FloatFormat, ...]) -> torch.Tensor:
    """``err`` with the flush to zero of a result that may lie below the normal range
    (module docstring, "Flush to zero"): ``max(err, min(mag + err, m))`` where the computed
    result may be below ``m``, the largest ``min_normal`` of ``fmts`` (the formats it is held
    in): the flushed value is below ``m`` and below ``mag + err``.

    ``mag`` is the ops' magnitude: ``|y| (1 + 2^-38)`` plus at most twice the Lipschitz term
    that ``err`` already contains, so ``mag <= |y| (1 + 2^-38) + 2.01 err`` and the computed
    result is at least ``|y| - err >= mag (1 - 2^-30) - 4 err``: the flush is possible where
    that is below ``m``."""
    m = max(f.min_normal for f in fmts)
    may = mag * (1.0 - 2.0 ** -30) - 4.0 * err < m
    return torch.where(may, torch.maximum(err, torch.clamp(mag + err, max=m)), err)


def _elementwise_error(op: str, x: torch.Tensor, prec: Precision, lib: LibraryErrors, ms: ModeSpec,
                       out: FloatFormat | None, approximate: str = "none", ftz: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bound, magnitude)`` of ``fl_out(f_c(x))`` for ``f`` = gelu/silu; ``out=None``: no
    output rounding (the value stays in ``c``). Inputs not representable in ``c`` are
    rounded first (error ``L |x_c - x|``, ``L`` = Lipschitz constant of ``f``). ``ftz``: the
    result may be flushed to 0 where it would be subnormal in ``c`` or ``out``."""
    c = prec.compute
    x64 = f64(x)
    xc = x64 if conversion_exact(prec.storage, c) else round_to(x64, c)
    parts = _parts(op, xc, c, lib, approximate)
    err = parts.total(ms) + _LIPSCHITZ[op] * (xc - x64).abs()
    mag = parts.mag + _LIPSCHITZ[op] * (xc - x64).abs()
    if out is not None and not conversion_exact(c, out):
        err = err + hu(mag + err, out)
    if ftz:
        err = flushed(err, mag, (c,) if out is None else (c, out))
    bad = ~torch.isfinite(x64)
    err = torch.where(bad, torch.full_like(err, math.inf), err)
    return err, mag


def gelu_error(x: torch.Tensor, prec: Precision, lib: LibraryErrors, ms: ModeSpec, approximate: str = "none",
               out: FloatFormat | None = None, ftz: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bound, |gelu(x)| upper)`` of gelu computed in ``prec.compute`` then rounded to ``out``."""
    return _elementwise_error("gelu", x, prec, lib, ms, out, approximate, ftz)


def silu_error(x: torch.Tensor, prec: Precision, lib: LibraryErrors, ms: ModeSpec,
               out: FloatFormat | None = None, ftz: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bound, |silu(x)| upper)`` of silu computed in ``prec.compute`` then rounded to ``out``."""
    return _elementwise_error("silu", x, prec, lib, ms, out, ftz=ftz)


def _assumptions(prec: Precision, lib: LibraryErrors, ms: ModeSpec) -> tuple[str, ...]:
    a = [f"computed in {prec.compute}, rounded once to {prec.out} ({prec.describe()})",
         f"library functions: {lib.name} (erf {lib.erf_abs}u abs, tanh {lib.tanh_abs}u abs, exp {lib.exp_rel}u rel)"]
    if ms.mode == "probabilistic":
        a.append("roundings mean-independent (Higham-Mary); library errors and output rounding deterministic")
    return tuple(a)


def _values(prec: Precision, lib: LibraryErrors, ms: ModeSpec, **kw) -> dict:
    v = {"compute": str(prec.compute), "output": str(prec.out), "u": prec.compute.u, "library": lib.name, **kw}
    if ms.mode == "probabilistic":
        v["lambda"] = ms.lam
    return v


# ----------------------------------------------------------------------------- registered ops


@register("gelu")
def gelu(x: torch.Tensor, approximate: str = "none", *, fmt=None, compute_fmt=None, out_fmt=None,
         library: LibraryErrors | str | None = None, ftz: bool = True, mode: str = "deterministic",
         failure_probability: float | None = None) -> Bound:
    """Bound on ``|F.gelu(x, approximate) - gelu(x)|``; see the module docstring. ``ftz=True``
    (default): results that would be subnormal may be flushed to 0 (AVX512-BF16 kernels do)."""
    prec = resolve_precision((x,), fmt, compute_fmt, out_fmt)
    lib = resolve_library(library, prec.compute)
    ms = resolve_mode(mode, failure_probability)
    err, mag = gelu_error(x, prec, lib, ms, approximate, prec.out, ftz)
    formula = ("|err| <= (|x|/2) ds + hu_c(|g| + ..) + hu_out(|g| + ..), ds = A_lib + propagated t/u error "
               "+ hu_c(1 + f)")
    return Bound(abs=err, mode=ms.mode, failure_probability=ms.failure_probability, magnitude=mag,
                 explanation=Explanation(op=f"gelu({approximate})", formula=formula, source=SOURCE,
                                         assumptions=_assumptions(prec, lib, ms),
                                         values=_values(prec, lib, ms, approximate=approximate)))


@register("silu")
def silu(x: torch.Tensor, *, fmt=None, compute_fmt=None, out_fmt=None, library: LibraryErrors | str | None = None,
         ftz: bool = True, mode: str = "deterministic", failure_probability: float | None = None) -> Bound:
    """Bound on ``|F.silu(x) - silu(x)|``; see the module docstring. ``ftz``: as :func:`gelu`."""
    prec = resolve_precision((x,), fmt, compute_fmt, out_fmt)
    lib = resolve_library(library, prec.compute)
    ms = resolve_mode(mode, failure_probability)
    err, mag = silu_error(x, prec, lib, ms, prec.out, ftz)
    formula = "|err| <= |x| dd/(d(d-dd)) + hu_c(|y|+..) + hu_out(|y|+..), d = 1+e^-x, dd = R e + eta + hu_c(d+..)"
    return Bound(abs=err, mode=ms.mode, failure_probability=ms.failure_probability, magnitude=mag,
                 explanation=Explanation(op="silu", formula=formula, source=SOURCE,
                                         assumptions=_assumptions(prec, lib, ms), values=_values(prec, lib, ms)))


@register("swiglu")
def swiglu(x: torch.Tensor, dim: int = -1, *, fused: bool = False, fmt=None, compute_fmt=None, out_fmt=None,
           library: LibraryErrors | str | None = None, ftz: bool = True, mode: str = "deterministic",
           failure_probability: float | None = None) -> Bound:
    """Bound on Megatron's ``swiglu(x) = silu(a) * b`` with ``a, b = torch.chunk(x, 2, dim)``.

    ``fused=False`` (default): eager Megatron, ``silu(a)`` rounded to the output format,
    then the product rounded again; ``fused=True``: one rounding (compiled kernel)."""
    prec = resolve_precision((x,), fmt, compute_fmt, out_fmt)
    lib = resolve_library(library, prec.compute)
    ms = resolve_mode(mode, failure_probability)
    if x.shape[dim] % 2:
        raise ValueError(f"swiglu needs an even size along dim {dim}, got {x.shape[dim]}")
    a, b = torch.chunk(x, 2, dim=dim)
    c, o = prec.compute, prec.out
    b64 = f64(b).abs()
    e_s, s_mag = silu_error(a, prec, lib, ms, None if fused else o, ftz)
    # the product silu^ * b: exact in c when both factors are o/storage values and 2p <= p_c
    pre = b64 * e_s
    ymag = inflate(s_mag * b64)
    exact_prod = (not fused) and products_exact(o, c) and products_exact(prec.storage, c)
    r_p = torch.zeros_like(pre) if exact_prod else hu(ymag + pre, c)
    err = combine(pre, [r_p], ms)
    if not conversion_exact(c, o):
        err = err + hu(ymag + err, o)
    if ftz:
        err = flushed(err, ymag, (c, o))
    bad = ~(torch.isfinite(f64(a)) & torch.isfinite(b64)) | torch.isnan(err)
    err = torch.where(bad, torch.full_like(err, math.inf), err)
    return Bound(abs=err, mode=ms.mode, failure_probability=ms.failure_probability, magnitude=ymag,
                 explanation=Explanation(
                     op="swiglu", formula="|err| <= |b| B_silu(a) + hu_c(|s b| + ..) + hu_out(|s b| + ..)",
                     source=SOURCE + "; Megatron-LM swiglu", assumptions=_assumptions(prec, lib, ms),
                     values=_values(prec, lib, ms, fused=fused, product_exact_in_compute=exact_prod)))


def _two_sum(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Knuth's TwoSum in float64: ``s + e == a + b`` exactly (no overflow)."""
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, e


def _embeds(t: torch.Tensor, fmt: FloatFormat) -> bool:
    """Every value of ``t``'s dtype is a value of ``fmt`` (its conversion into ``fmt`` is exact)."""
    try:
        return isinstance(t, torch.Tensor) and conversion_exact(get_format(t.dtype), fmt)
    except ValueError:  # a dtype without a known format (integers)
        return False


@register("add", "residual_add")
def add(x: torch.Tensor, y: torch.Tensor, *, fmt=None, compute_fmt=None, out_fmt=None, mode: str = "deterministic",
        failure_probability: float | None = None) -> Bound:
    """Bound on ``|fl_out(fl_c(x + y)) - (x + y)|`` (elementwise, broadcasting); see the module docstring."""
    prec = resolve_precision((x, y), fmt, compute_fmt, out_fmt)
    ms = resolve_mode(mode, failure_probability)
    c, o = prec.compute, prec.out
    x64, y64 = torch.broadcast_tensors(f64(x), f64(y))
    # conversion errors dx, dy into c; none for an input whose dtype embeds in c (bf16 into fp32)
    conversions = [(t64 - round_to(t64, c)).abs() for t, t64 in ((x, x64), (y, y64)) if not _embeds(t, c)]
    s, e = _two_sum(x64, y64)
    mag = s.abs() + e.abs()
    r_c = hu(sum(conversions, mag), c)
    err = combine(torch.zeros_like(mag), conversions + [r_c], ms)
    if not conversion_exact(c, o):
        err = err + hu(mag + err, o)
    # the exact sum representable in c and o (and inputs exact in c): the result is exact
    exact = (e == 0) & representable(s, c) & representable(s, o)
    for d in conversions:
        exact &= d == 0
    err = torch.where(exact, torch.zeros_like(err), err)
    bad = ~(torch.isfinite(x64) & torch.isfinite(y64) & torch.isfinite(s))
    err = torch.where(bad, torch.full_like(err, math.inf), err)
    return Bound(abs=err, mode=ms.mode, failure_probability=ms.failure_probability, magnitude=mag,
                 explanation=Explanation(
                     op="add", formula="|err| <= dx + dy + hu_c(|x+y| + dx + dy) + hu_out(|x+y| + ..); 0 if exact",
                     source="Higham (2002) §2.2 (rounding model); TwoSum (Knuth) for exactness",
                     assumptions=(f"{prec.describe()}; inputs converted to {c} (dx, dy: conversion errors)",),
                     values={"compute": str(c), "output": str(o)}))


# ----------------------------------------------------------------------------- measurement


def _implied_constant(kind: str, x: torch.Tensor, computed: torch.Tensor, c: FloatFormat) -> torch.Tensor:
    """Smallest library constant (units of ``u_c``) for which the deterministic formula holds
    at each input: the bound is ``b0 + k * coef`` plus monotone ``hu`` terms, so
    ``(err - b0) / coef`` with ``b0`` evaluated at constant 0 is sufficient (conservative)."""
    zero = LibraryErrors("zero", 0.0, 0.0, 0.0, 0.0)
    ms = ModeSpec("deterministic", 0.0, math.inf)
    x64 = f64(x)
    ax = x64.abs()
    if kind == "gelu":
        exact = 0.5 * x64 * torch.special.erfc(-x64 / math.sqrt(2.0))
        b0 = _gelu_erf_parts(x64, c, zero).total(ms)
        coef = 0.5 * ax * c.u
    elif kind == "gelu_tanh":
        u_t = math.sqrt(2.0 / math.pi) * (x64 + 0.044715 * x64 ** 3)
        exact = x64 * torch.sigmoid(2.0 * u_t)
        b0 = _gelu_tanh_parts(x64, c, zero).total(ms)
        coef = 0.5 * ax * c.u
    elif kind == "silu":
        exact = x64 * torch.sigmoid(x64)
        b0 = _silu_parts(x64, c, zero).total(ms)
        e = torch.exp(-x64)
        d = 1.0 + e
        coef = ax * e * c.u / (d * d)
    else:
        raise ValueError(kind)
    err = (f64(computed) - exact).abs()
    need = ((err - b0) / coef).clamp(min=0.0)
    return torch.where(torch.isfinite(need) & (coef > 0), need, torch.zeros_like(need))


def _fp32_binade(e: int, stride: int = 1) -> torch.Tensor:
    """Every ``stride``-th positive fp32 in ``[2^e, 2^(e+1))``."""
    base = (e + 127) << 23
    return torch.arange(base, base + (1 << 23), stride, dtype=torch.int64).to(torch.int32).view(torch.float32)


def measure_torch_cpu_constants(stride: int = 61, max_abs: float = 64.0, uniform: int = 10 ** 6, seed: int = 0,
                                dense_binades: tuple[int, int] | None = None) -> dict[str, float]:
    """Measure the implied fp32 library constants of torch's CPU kernels (see the module
    docstring): max over every ``stride``-th fp32 bit pattern with ``|x| < max_abs`` (both
    signs) plus ``uniform`` draws in [-20, 20], and, for gelu, every fp32 in the binades
    ``[2^lo, 2^hi)`` of ``dense_binades`` (minutes per binade); kernels run with mkldnn
    enabled and disabled. Also the max relative error of ``torch.rsqrt`` over every fp32
    in [1, 4). Values in units of ``u = 2**-24``."""
    import torch.nn.functional as F

    c = FP32
    bits = torch.arange(0, 0x42800000, stride, dtype=torch.int64).to(torch.int32)  # up to 64.0
    pos = bits.view(torch.float32)
    pos = pos[(pos < max_abs) & torch.isfinite(pos)]
    g = torch.Generator().manual_seed(seed)
    xs = torch.cat([pos, -pos, torch.rand(uniform, generator=g) * 40 - 20])
    kernels = {"gelu": lambda t: F.gelu(t), "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu}
    out = {k: 0.0 for k in kernels}
    dense = [] if dense_binades is None else [_fp32_binade(e) for e in range(*dense_binades)]
    for mk in (True, False):
        with torch.backends.mkldnn.flags(enabled=mk):
            for name, fn in kernels.items():
                for chunk in xs.split(1 << 22):
                    out[name] = max(out[name], float(_implied_constant(name, chunk, fn(chunk), c).max()))
            for xb in dense:
                for sgn in (1.0, -1.0):
                    t = sgn * xb
                    out["gelu"] = max(out["gelu"], float(_implied_constant("gelu", t, F.gelu(t), c).max()))
    w = torch.cat([_fp32_binade(0), _fp32_binade(1)])  # [1, 4)
    rel = ((f64(torch.rsqrt(w)) - torch.rsqrt(f64(w))).abs() * torch.sqrt(f64(w))).max()
    out["rsqrt"] = float(rel) / c.u
    return out
