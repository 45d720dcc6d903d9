"""Format constants against torch.finfo / ml_dtypes.finfo, custom formats, and half_ulp."""
from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest
import torch

from ttrace_num.formats import (
    FORMATS,
    FloatFormat,
    custom,
    get_format,
    half_ulp,
    known_formats,
)
from ttrace_num.rounding import round_to

ML_FORMATS = [f for f in FORMATS.values() if f.ml_dtypes_name]
TORCH_FORMATS = [f for f in FORMATS.values() if f.torch_dtype is not None]


def _np_dtype(fmt: FloatFormat) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, fmt.ml_dtypes_name, None) or fmt.ml_dtypes_name)


def _without_name(fmt: FloatFormat) -> dict:
    c = fmt.constants()
    c.pop("name")
    return c


def _ml_values(fmt: FloatFormat) -> np.ndarray:
    """Every finite value of a <= 8-bit ml_dtypes format, decoded by ml_dtypes (sorted, unique)."""
    dt = _np_dtype(fmt)
    with np.errstate(invalid="ignore"):
        v = np.arange(2**fmt.bits, dtype=np.uint8).view(dt).astype(np.float64)
    return np.unique(v[np.isfinite(v)])


# ---------------------------------------------------------------- constants vs finfo
def test_registry_has_the_expected_formats():
    assert set(known_formats()) >= {"fp64", "fp32", "tf32", "bf16", "fp16", "e4m3", "e5m2", "e4m3fnuz",
                                    "e5m2fnuz", "e8m0", "e2m3", "e3m2", "e2m1"}
    # every torch float8 dtype this torch build has is covered
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"):
        if hasattr(torch, name):
            assert get_format(getattr(torch, name)).torch_dtype == getattr(torch, name)


@pytest.mark.parametrize("fmt", TORCH_FORMATS, ids=str)
def test_constants_match_torch_finfo(fmt):
    fi = torch.finfo(fmt.torch_dtype)
    assert fmt.max == fi.max
    assert fmt.min_normal == fi.smallest_normal == fi.tiny
    assert fmt.bits == fi.bits
    if fmt.signed:
        assert fi.min == -fmt.max
    else:
        assert fi.min == fmt.min_normal  # unsigned e8m0: the smallest value is 2**-127
    if fmt.name == "e5m2fnuz":
        # torch reports eps=0.125 for float8_e5m2fnuz, but the grid after 1.0 is 1.25
        # (ml_dtypes and the enumerated values agree with 0.25): a torch quirk, not ours.
        assert fi.eps == 0.125 and fmt.eps == 0.25
    else:
        assert fmt.eps == fi.eps


@pytest.mark.parametrize("fmt", ML_FORMATS, ids=str)
def test_constants_match_ml_dtypes_finfo(fmt):
    fi = ml_dtypes.finfo(_np_dtype(fmt))
    assert fmt.max == float(fi.max)
    assert fmt.min_normal == float(fi.smallest_normal)
    assert fmt.min_subnormal == float(fi.smallest_subnormal)
    assert fmt.eps == float(fi.eps)
    assert fmt.bits == fi.bits
    assert fmt.mantissa_bits == fi.nmant
    assert fmt.exponent_bits == fi.nexp
    assert fmt.emax == fi.maxexp - 1  # numpy's maxexp is the first exponent that overflows
    assert fmt.emin == fi.minexp


@pytest.mark.parametrize("fmt", [f for f in ML_FORMATS if f.bits <= 8], ids=str)
def test_constants_match_enumerated_values(fmt):
    """Independent of finfo: decode every bit pattern with ml_dtypes and read the constants off."""
    v = _ml_values(fmt)
    pos = v[v > 0]
    assert pos.max() == fmt.max
    assert pos.min() == fmt.min_subnormal
    after_one = pos[pos > 1.0].min()
    assert after_one - 1.0 == fmt.eps
    assert fmt.has_inf == bool(np.isinf(np.arange(256, dtype=np.uint8).view(_np_dtype(fmt)).astype(np.float64)).any())
    assert (v < 0).any() == fmt.signed
    # count of distinct finite values: 2 * (#positive) + zero(s) for signed formats
    n_pos = len(pos)
    if fmt.signed:
        assert len(v) == 2 * n_pos + 1
    else:
        assert len(v) == n_pos


def test_tf32_hand_values():
    f = get_format("tf32")
    assert (f.exponent_bits, f.mantissa_bits, f.bias) == (8, 10, 127)
    assert f.bits == 19
    assert f.max == (2 - 2.0**-10) * 2.0**127
    assert f.min_normal == 2.0**-126
    assert f.min_subnormal == 2.0**-136
    assert f.eps == 2.0**-10 and f.u == 2.0**-11
    assert f.has_inf and f.has_nan
    # same range as fp32, so the same overflow threshold up to the mantissa
    assert f.max < get_format("fp32").max


@pytest.mark.parametrize("name,u", [("fp32", 2.0**-24), ("bf16", 2.0**-8), ("fp16", 2.0**-11),
                                    ("e4m3", 2.0**-4), ("e5m2", 2.0**-3), ("tf32", 2.0**-11)])
def test_unit_roundoff_matches_design_notation(name, u):
    f = get_format(name)
    assert f.u == u and f.eps == 2 * u and f.precision == f.mantissa_bits + 1


# ---------------------------------------------------------------- custom formats
@pytest.mark.parametrize("e,m,name", [(5, 10, "fp16"), (8, 7, "bf16"), (8, 23, "fp32"), (11, 52, "fp64"),
                                      (8, 10, "tf32"), (5, 2, "e5m2")])
def test_custom_ieee_defaults_reproduce_standard_constants(e, m, name):
    assert _without_name(custom(e, m)) == _without_name(get_format(name))


@pytest.mark.parametrize("kw,name", [
    (dict(exponent_bits=4, mantissa_bits=3, bias=7, nan_encoding="fn"), "e4m3"),
    (dict(exponent_bits=4, mantissa_bits=3, bias=8, nan_encoding="fnuz"), "e4m3fnuz"),
    (dict(exponent_bits=5, mantissa_bits=2, bias=16, nan_encoding="fnuz"), "e5m2fnuz"),
    (dict(exponent_bits=2, mantissa_bits=3, bias=1, nan_encoding="none"), "e2m3"),
    (dict(exponent_bits=3, mantissa_bits=2, bias=3, nan_encoding="none"), "e3m2"),
    (dict(exponent_bits=2, mantissa_bits=1, bias=1, nan_encoding="none"), "e2m1"),
])
def test_custom_special_encodings_reproduce_standard_constants(kw, name):
    f = custom(**kw)
    assert _without_name(f) == _without_name(get_format(name))


def test_custom_encodings_change_the_constants():
    """The encodings are not cosmetic: fn loses one code at the top, ieee a whole binade."""
    ieee, fn, fnuz, none = (custom(4, 3, 7, nan_encoding=n) for n in ("ieee", "fn", "fnuz", "none"))
    assert ieee.max == 240.0 and fn.max == 448.0 and fnuz.max == 480.0 and none.max == 480.0
    assert ieee.has_inf and not fn.has_inf and fn.has_nan and fnuz.has_nan and not none.has_nan
    assert ieee.default_overflow == "inf" and fn.default_overflow == "nan" and none.default_overflow == "saturate"
    assert custom(3, 2).bias == 3 and custom(5, 10).bias == 15


def test_custom_formats_are_values():
    assert custom(3, 2) == custom(3, 2) and hash(custom(3, 2)) == hash(custom(3, 2))
    assert custom(3, 2) != custom(3, 2, bias=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        custom(3, 2).mantissa_bits = 5  # type: ignore[misc]


@pytest.mark.parametrize("spec,expect", [
    ("custom(e=3, m=2)", custom(3, 2)),
    ("custom(3,2)", custom(3, 2)),
    (" custom( e = 3 , m = 2 ) ", custom(3, 2)),
    ("custom(4,3,bias=7,nan=fn)", custom(4, 3, 7, nan_encoding="fn")),
    ("custom(4,3,7,nan=fn)", custom(4, 3, 7, nan_encoding="fn")),
    ("custom(e=4,m=3,bias=8,nan_encoding=fnuz)", custom(4, 3, 8, nan_encoding="fnuz")),
    ("custom(e=2,m=1,nan=none)", custom(2, 1, nan_encoding="none")),
    ("custom(e=5,m=2,overflow=saturate)", custom(5, 2, overflow="saturate")),
    ("custom(e=5,m=2,subnormals=false)", custom(5, 2, subnormals=False)),
])
def test_get_format_parses_custom_strings(spec, expect):
    assert get_format(spec) == expect


def test_parsed_custom_e4m3_has_e4m3_constants():
    assert _without_name(get_format("custom(4,3,bias=7,nan=fn)")) == _without_name(get_format("e4m3"))


@pytest.mark.parametrize("spec", ["bf16", "BF16", "bfloat16", " bfloat16 ", torch.bfloat16, FORMATS["bf16"]])
def test_get_format_aliases(spec):
    assert get_format(spec) is FORMATS["bf16"]


@pytest.mark.parametrize("spec,match", [
    ("fp7", "unknown format"),
    ("e4m4", "unknown format"),
    ("", "unknown format"),
    ("custom(m=2)", "needs e and m"),
    ("custom(3)", "needs e and m"),
    ("custom(3,2,foo=1)", "unknown custom-format field"),
    ("custom(e=x,m=2)", "e must be an integer, got 'x'"),
    ("custom(3,2,3,4)", "at most 3 positional fields"),
    ("custom(3,2,e=4)", "given both by position and by name"),
    ("custom(0,2,nan=none)", "exponent_bits"),
    ("custom(3,-1)", "mantissa_bits"),
    ("custom(4,0,nan=fn)", "'fn'"),
    ("custom(1,2)", "at least 2 exponent bits"),
    ("custom(40,40)", "64 bits"),
    (torch.int32, "no known floating-point format"),
])
def test_get_format_rejects_bad_specs_with_value_error(spec, match):
    with pytest.raises(ValueError, match=match):
        get_format(spec)


def test_unknown_name_error_lists_the_known_formats():
    with pytest.raises(ValueError) as ei:
        get_format("fp7")
    for name in ("bf16", "e4m3", "custom("):
        assert name in str(ei.value)


def test_unknown_nan_encoding_is_value_error():
    with pytest.raises(ValueError):
        get_format("custom(3,2,nan=bogus)")


@pytest.mark.parametrize("spec", ["custom(3,2,overflow=bogus)", "custom(3,2,subnormals=maybe)"])
def test_bad_overflow_or_subnormals_is_value_error(spec):
    with pytest.raises(ValueError):
        get_format(spec)


# ---------------------------------------------------------------- half_ulp
HALF_ULP_FORMATS = [get_format(n) for n in ("fp32", "tf32", "bf16", "fp16", "e4m3", "e5m2", "e4m3fnuz",
                                            "e5m2fnuz", "e2m3", "e3m2", "e2m1")] + [custom(3, 2), custom(6, 4, bias=20)]


def _log_uniform(fmt: FloatFormat, n: int, gen: torch.Generator, lo_extra: int = 8, hi_extra: int = 2):
    """Positive magnitudes log-uniform from below the smallest subnormal to above max."""
    lo = math.log2(fmt.min_subnormal) - lo_extra
    hi = math.log2(fmt.max) + hi_extra
    return torch.exp2(lo + (hi - lo) * torch.rand(n, dtype=torch.float64, generator=gen))


@pytest.mark.parametrize("fmt", HALF_ULP_FORMATS, ids=str)
def test_half_ulp_properties(fmt):
    gen = torch.Generator().manual_seed(1234)
    t = _log_uniform(fmt, 20000, gen).sort().values
    h = half_ulp(t, fmt)
    # sign does not matter
    assert torch.equal(half_ulp(-t, fmt), h)
    # monotone non-decreasing in |t|
    assert bool((h[1:] >= h[:-1]).all())
    normal = (t >= fmt.min_normal) & (t <= fmt.max)
    sub = t < fmt.min_normal
    over = t > fmt.max
    assert normal.any() and sub.any() and over.any()
    # normal range: u * 2**floor(log2 t), computed independently with math.frexp
    expect = torch.tensor([math.ldexp(fmt.u, math.frexp(v)[1] - 1) for v in t[normal].tolist()], dtype=torch.float64)
    assert torch.equal(h[normal], expect)
    assert bool((h[normal] <= fmt.u * t[normal]).all())
    # below the normal range: the absolute bound
    assert bool((h[sub] == fmt.subnormal_abs_error).all())
    # overflow is not round-off
    assert bool(torch.isinf(h[over]).all())
    # at exact binade boundaries: 2**e -> u * 2**e
    e = torch.arange(fmt.emin, fmt.emax + 1, dtype=torch.float64)
    assert torch.equal(half_ulp(torch.exp2(e), fmt), fmt.u * torch.exp2(e))


@pytest.mark.parametrize("fmt", HALF_ULP_FORMATS + [get_format("fp64")], ids=str)
def test_half_ulp_at_zero_nan_and_float64_subnormals(fmt):
    t = torch.tensor([0.0, -0.0, float("nan"), 5e-324, 1e-310, 1.0], dtype=torch.float64)
    h = half_ulp(t, fmt)
    assert h[:2].tolist() == [0.0, 0.0] and math.isnan(h[2])
    assert h[5] == fmt.u
    # a float64 subnormal is below every format's normal range: its absolute bound (float64:
    # u * 2**emin = 2**-1075, which float64 rounds to 0)
    assert h[3:5].tolist() == [math.ldexp(fmt.u, fmt.emin)] * 2 if fmt.subnormals else \
        h[3:5].tolist() == [fmt.subnormal_abs_error] * 2


FLOAT32_HALF_ULP_FORMATS = [f for f in HALF_ULP_FORMATS if f.name not in ("fp32",)]


@pytest.mark.parametrize("fmt", FLOAT32_HALF_ULP_FORMATS, ids=str)
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_half_ulp_in_float32_equals_float64(fmt, src):
    """The float32 path builds the same powers of two as the float64 one, subnormal results,
    zero, NaN and overflow included."""
    gen = torch.Generator().manual_seed(7)
    t = torch.cat([_log_uniform(fmt, 20000, gen, lo_extra=30, hi_extra=30),
                   torch.tensor([0.0, float("nan"), float("inf"), 1e-45, 3e38], dtype=torch.float64)])
    t = (t * torch.where(torch.rand(t.shape, generator=gen) < 0.5, -1.0, 1.0).double()).to(src)
    h32 = half_ulp(t, fmt, torch.float32)
    assert h32.dtype == torch.float32
    assert torch.equal(h32.double().nan_to_num(-1.0), half_ulp(t.double(), fmt).nan_to_num(-1.0))


def test_half_ulp_in_float32_refuses_what_it_cannot_represent():
    """fp32's own half-ulp of subnormals (2**-150) and e8m0's range (emin -127) are not float32
    numbers; a float64 input would be rounded: each gets a ValueError naming the way out."""
    for t, fmt in ((torch.ones(3), "fp32"), (torch.ones(3), "e8m0"), (torch.ones(3, dtype=torch.float64), "bf16")):
        with pytest.raises(ValueError, match="dtype=torch.float64"):
            half_ulp(t, get_format(fmt), torch.float32)
    with pytest.raises(ValueError, match="float64 or float32"):
        half_ulp(torch.ones(3), get_format("bf16"), torch.float16)


@pytest.mark.parametrize("fmt", HALF_ULP_FORMATS + [get_format("e8m0")], ids=str)
def test_round_to_error_is_within_half_ulp(fmt):
    gen = torch.Generator().manual_seed(99)
    t = _log_uniform(fmt, 50000, gen, hi_extra=0)
    t = t[t <= fmt.max]
    if fmt.nan_encoding == "e8m0":
        # documented e8m0 quirk (ml_dtypes/torch): (2**-127, 2**-126) rounds up to 2**-126,
        # which exceeds half an ulp of 2**-127; half_ulp states the round-to-nearest bound.
        t = t[(t <= fmt.min_normal) | (t >= 2 * fmt.min_normal)]
        x = t
    else:
        sign = torch.where(torch.rand(t.shape, generator=gen) < 0.5, -1.0, 1.0).to(torch.float64)
        x = t * sign
    err = (round_to(x, fmt, overflow="saturate") - x).abs()
    bound = half_ulp(x, fmt)
    assert bool((err <= bound).all())
    # and the bound is attained up to a factor close to 1 (not vacuous)
    assert float((err / bound).max()) > 0.99


def test_half_ulp_bound_is_violated_by_the_wrong_format():
    """Negative control: bf16 rounding errors do not fit in fp16's half_ulp."""
    gen = torch.Generator().manual_seed(5)
    x = 1 + torch.rand(10000, dtype=torch.float64, generator=gen)
    err = (round_to(x, "bf16") - x).abs()
    assert bool((err > half_ulp(x, get_format("fp16"))).any())
