"""Bit-exactness of round_to against ml_dtypes and torch casts.

* exhaustive for every format of at most 8 bits: all float16 and bfloat16 bit patterns,
  every value of the target format, every midpoint between neighbours (the ties), and
  the values one float32 ulp and one float64 ulp either side of each midpoint;
* >= 10**6 random values (log-uniform over the whole range, subnormals, overflow, exact
  ties) for fp32->bf16, fp32->fp16, fp64->fp32 and fp32->tf32;
* custom formats, stochastic rounding, and negative controls showing the checks fail
  when the rounding is wrong.
"""
from __future__ import annotations

import functools
import math

import ml_dtypes
import numpy as np
import pytest
import torch

from ttrace_num.formats import FloatFormat, custom, get_format
from ttrace_num.rounding import quantum, representable, round_to

SMALL = ["e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz", "e8m0", "e2m3", "e3m2", "e2m1"]
# torch's cast overflow behaviour per dtype (platform.md: e4m3fn saturates even from inf)
TORCH_OVERFLOW = {"e4m3": "saturate", "e5m2": "inf", "e4m3fnuz": "nan", "e5m2fnuz": "nan", "e8m0": "nan"}
NO_NAN = {"e2m3", "e3m2", "e2m1"}
# numpy warns when casting signalling NaNs / out-of-range values; that is what we test
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")


# ------------------------------------------------------------------------ helpers
def _ml_dtype(fmt: FloatFormat):
    return getattr(ml_dtypes, fmt.ml_dtypes_name)


def _ml_cast(x: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return x.astype(_ml_dtype(fmt)).astype(np.float64)


def _torch_cast(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    return torch.from_numpy(x).to(dtype).to(torch.float64).numpy()


def _rt(x: np.ndarray, fmt, **kw) -> np.ndarray:
    return round_to(torch.from_numpy(np.ascontiguousarray(x)), fmt, **kw).numpy()


def _mismatch(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Mask of elements whose float64 bit patterns differ (any NaN equals any NaN)."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    same = (got.view(np.int64) == ref.view(np.int64)) | (np.isnan(got) & np.isnan(ref))
    return ~same


def assert_bits_equal(got, ref, x, what: str) -> None:
    bad = _mismatch(got, ref)
    if bad.any():
        i = np.nonzero(bad)[0][:8]
        rows = ", ".join(f"x={x[j]!r}: got {got[j]!r} want {ref[j]!r}" for j in i)
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.size} differ; e.g. {rows}")


def _all_f16() -> np.ndarray:
    return np.arange(2**16, dtype=np.uint16).view(np.float16).astype(np.float32)


def _all_bf16() -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return np.arange(2**16, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)


def _values(fmt: FloatFormat) -> np.ndarray:
    """Every finite value of a <= 8-bit ml_dtypes format, decoded by ml_dtypes, sorted, unique."""
    with np.errstate(invalid="ignore"):
        v = np.arange(2**fmt.bits, dtype=np.uint8).view(_ml_dtype(fmt)).astype(np.float64)
    return np.unique(v[np.isfinite(v)])


def _midpoints(vals: np.ndarray, fmt: FloatFormat) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lo, hi, mid) for consecutive finite values, plus ties and points beyond +-max."""
    lo, hi = vals[:-1], vals[1:]
    mid = (lo + hi) / 2  # exact in float64
    top_gap = fmt.max - vals[vals < fmt.max].max()
    beyond = fmt.max + top_gap * np.array([0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0])
    beyond = beyond[beyond < 2.0**128]  # stay inside float32's range (e8m0's max is 2**127)
    beyond = np.concatenate([beyond, -beyond]) if fmt.signed else beyond
    return lo, hi, np.concatenate([mid, beyond])


def _exhaustive_inputs(fmt: FloatFormat) -> np.ndarray:
    """float32 inputs: all f16/bf16 patterns, the format's values, midpoints +- 1 float32 ulp."""
    vals = _values(fmt)
    _, _, mids = _midpoints(vals, fmt)
    m32 = mids.astype(np.float32)
    assert np.array_equal(m32.astype(np.float64), mids)  # ties are exact float32 values
    near = np.concatenate([np.nextafter(m32, np.float32(-np.inf)), np.nextafter(m32, np.float32(np.inf))])
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan], dtype=np.float32)
    return np.concatenate([_all_f16(), _all_bf16(), vals.astype(np.float32), -vals.astype(np.float32),
                           m32, near, special])


# ------------------------------------------------------------------------ exhaustive, <= 8 bits
@functools.cache
def _cached_inputs(name: str) -> np.ndarray:
    x = _exhaustive_inputs(get_format(name))
    return x


@pytest.fixture(params=SMALL)
def small(request):
    return get_format(request.param), _cached_inputs(request.param)


def test_exhaustive_inputs_cover_the_interesting_classes(small):
    fmt, x = small
    assert x.size > 2 * 65536
    a = np.abs(x[np.isfinite(x)]).astype(np.float64)
    assert np.isnan(x).any() and np.isinf(x).any()
    assert ((a > 0) & (a < fmt.min_normal)).any()  # below the normal range
    assert (a > fmt.max).any()  # overflow
    assert np.isin(_values(fmt), x.astype(np.float64)).all()  # every representable value


def test_exhaustive_matches_ml_dtypes(small):
    fmt, x = small
    got, ref = _rt(x, fmt), _ml_cast(x, fmt)
    keep = ~np.isnan(x) if fmt.name in NO_NAN else np.ones(x.shape, bool)  # documented NaN difference
    assert_bits_equal(got[keep], ref[keep], x[keep], f"round_to vs ml_dtypes {fmt}")


@pytest.mark.parametrize("name", [n for n in SMALL if get_format(n).torch_dtype is not None])
def test_exhaustive_matches_torch_cast(name):
    fmt, x = get_format(name), _cached_inputs(name)
    ref = _torch_cast(x, fmt.torch_dtype)
    if fmt.name == "e8m0":
        # torch ignores the sign and maps +-0 to 2**-127 (documented in round_to)
        got = _rt(np.abs(x), fmt)
        got[x == 0] = 2.0**-127
    else:
        got = _rt(x, fmt, overflow=TORCH_OVERFLOW[fmt.name])
    assert_bits_equal(got, ref, x, f"round_to vs torch cast {fmt}")


def test_exhaustive_matches_torch_cast_from_half_and_bfloat16_sources():
    """Casting the 16-bit tensors directly (no float32 in our code) gives the same bits."""
    for name in ("e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz"):
        fmt = get_format(name)
        for src in (torch.float16, torch.bfloat16):
            t = torch.arange(2**16, dtype=torch.int32).to(torch.int16).view(src)
            ref = t.to(fmt.torch_dtype).to(torch.float64).numpy()
            got = round_to(t, fmt, overflow=TORCH_OVERFLOW[name]).numpy()
            assert_bits_equal(got, ref, t.double().numpy(), f"{src}->{fmt}")


def test_ties_and_fp64_neighbours_round_correctly(small):
    """At each midpoint the result is the even neighbour (as ml_dtypes says); one float64 ulp
    below/above it, the lower/upper neighbour: single rounding, no float32 intermediate."""
    fmt, _ = small
    vals = _values(fmt)
    lo, hi, _ = _midpoints(vals, fmt)
    mid = (lo + hi) / 2
    if fmt.name == "e8m0":  # documented quirk binade (2**-127, 2**-126), tested separately
        keep = lo != 2.0**-127
        lo, hi, mid = lo[keep], hi[keep], mid[keep]
    below, above = np.nextafter(mid, -np.inf), np.nextafter(mid, np.inf)
    assert np.array_equal(_rt(below, fmt), lo)
    assert np.array_equal(_rt(above, fmt), hi)
    tie = _rt(mid, fmt)
    assert np.all((tie == lo) | (tie == hi))
    assert_bits_equal(tie, _ml_cast(mid.astype(np.float32), fmt), mid, f"ties {fmt}")
    if fmt.signed and fmt.nan_encoding != "fnuz":  # zeros keep the sign of x
        z = _rt(np.concatenate([below, above]), fmt)
        xs = np.concatenate([below, above])
        assert np.array_equal(np.signbit(z[z == 0]), np.signbit(xs[z == 0]))


def test_float64_inputs_are_rounded_once_unlike_ml_dtypes_and_torch(small):
    """Documented difference: ml_dtypes and torch convert float64 through float32 (two
    roundings). round_to(x) is the correctly rounded value; round_to(float32(x)) reproduces
    the libraries bit for bit."""
    fmt, _ = small
    lo, hi, _ = _midpoints(_values(fmt), fmt)
    mid = (lo + hi) / 2
    x = np.concatenate([np.nextafter(mid, -np.inf), np.nextafter(mid, np.inf)])
    x32 = x.astype(np.float32).astype(np.float64)
    assert_bits_equal(_rt(x32, fmt)[~np.isnan(x)], _ml_cast(x, fmt)[~np.isnan(x)], x, f"ml double rounding {fmt}")
    if fmt.torch_dtype is not None and fmt.name != "e8m0":
        ov = TORCH_OVERFLOW[fmt.name]
        assert_bits_equal(_rt(x32, fmt, overflow=ov), _torch_cast(x, fmt.torch_dtype), x, f"torch double rounding {fmt}")
    # ... and the double rounding really differs from ours somewhere (else this test says nothing)
    assert _mismatch(_rt(x, fmt), _ml_cast(x, fmt)).sum() > 0


def test_nan_into_formats_without_nan_is_nan():
    """Documented difference: ml_dtypes turns NaN into a signed zero for e2m3/e3m2/e2m1;
    round_to keeps the NaN (a NaN must not silently become 0)."""
    x = np.array([np.nan, -np.nan], dtype=np.float32)
    for name in sorted(NO_NAN):
        fmt = get_format(name)
        assert not fmt.has_nan
        assert np.isnan(_rt(x, fmt)).all()
        assert np.isnan(_rt(x, fmt, overflow="saturate")).all()
        ml = _ml_cast(x, fmt)
        assert (ml == 0).all()  # what ml_dtypes does instead
        # infinities saturate (the formats' default), like ml_dtypes
        inf = np.array([np.inf, -np.inf], dtype=np.float32)
        assert np.array_equal(_rt(inf, fmt), [fmt.max, -fmt.max])
        assert np.array_equal(_ml_cast(inf, fmt), [fmt.max, -fmt.max])


def test_e8m0_edge_cases():
    """e8m0 follows ml_dtypes: zero and negatives are NaN, ties round up, (2**-127, 2**-126)
    rounds up to 2**-126; torch differs on zero (2**-127) and on negatives (uses |x|)."""
    f = get_format("e8m0")
    x = np.array([0.0, -0.0, -1.0, -3.0, 1.5, 3.0, 6.0, 0.75, 2.0**-127, 2.0**-127 * 1.01, 2.0**-127 * 1.49,
                  2.0**-127 * 1.5, 2.0**-130, 2.0**127, 2.0**127 * 1.49, 2.0**127 * 1.5, np.inf, np.nan])
    want = np.array([np.nan, np.nan, np.nan, np.nan, 2.0, 4.0, 8.0, 1.0, 2.0**-127, 2.0**-126, 2.0**-126,
                     2.0**-126, 2.0**-127, 2.0**127, 2.0**127, np.nan, np.nan, np.nan])
    got = _rt(x, f)
    assert_bits_equal(got, want, x, "e8m0 hand values")
    x32 = x.astype(np.float32)
    assert_bits_equal(got, _ml_cast(x32, f), x, "e8m0 vs ml_dtypes")
    t = _torch_cast(x32, torch.float8_e8m0fnu)
    assert t[0] == t[1] == 2.0**-127  # torch: zero -> smallest scale
    assert t[2] == 1.0 and t[3] == 4.0  # torch: sign ignored
    fin = (x > 0) & np.isfinite(x)
    assert_bits_equal(t[fin], got[fin], x[fin], "e8m0 vs torch on positive inputs")
    # ties go to the even significand (2), i.e. up, at every binade
    k = np.arange(-126, 127, dtype=np.float64)
    assert np.array_equal(_rt(1.5 * np.exp2(k), f), np.exp2(k + 1))
    assert _rt(np.array([np.inf]), f, overflow="saturate")[0] == f.max


def test_fnuz_has_no_negative_zero_and_overflows_to_nan():
    for name in ("e4m3fnuz", "e5m2fnuz"):
        f = get_format(name)
        x = np.array([-0.0, -f.min_subnormal / 4, -f.min_subnormal / 2, -f.max * 2, np.inf])
        got = _rt(x, f)
        assert not np.signbit(got[:3]).any() and (got[:3] == 0).all()
        assert np.isnan(got[3:]).all()
        assert np.array_equal(_rt(x[3:], f, overflow="saturate"), [-f.max, f.max])


def test_overflow_modes():
    x = np.array([1e6, -1e6, np.inf, -np.inf, 500.0, 464.0, -464.0, 465.0])
    e4m3 = get_format("e4m3")
    assert np.array_equal(_rt(x, e4m3, overflow="saturate"), [448, -448, 448, -448, 448, 448, -448, 448])
    assert np.isnan(_rt(x[:5], e4m3)).all()  # default: non-saturating fn cast -> NaN
    assert np.array_equal(_rt(x[5:7], e4m3), [448, -448])  # the tie above max rounds to even (448)
    assert np.isnan(_rt(x[7:], e4m3)).all()
    e5m2 = get_format("e5m2")
    y = np.array([61439.0, 61440.0, -61440.0, 1e9])
    assert np.array_equal(_rt(y, e5m2), [57344, np.inf, -np.inf, np.inf])  # tie 61440: odd max -> up -> inf
    assert np.array_equal(_rt(y, e5m2, overflow="saturate"), [57344, 57344, -57344, 57344])
    assert np.isnan(_rt(y[1:], e5m2, overflow="nan")).all()


# ------------------------------------------------------------------------ large random sets
N = 1_000_000


def _rne_bits_reference(bits: np.ndarray, drop: int) -> np.ndarray:
    """Round float32 bit patterns to (23 - drop) mantissa bits, RNE, by integer ops (no NaN)."""
    b = bits.astype(np.uint64)
    half = np.uint64((1 << (drop - 1)) - 1)
    lsb = (b >> np.uint64(drop)) & np.uint64(1)
    r = (b + half + lsb) & ~np.uint64((1 << drop) - 1)
    return (r & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.float32).astype(np.float64)


def _fp32_bit_set(seed: int, tie_bit: int) -> np.ndarray:
    """N random float32 patterns (log-uniform magnitudes over the whole range, subnormals,
    Inf/NaN) + exact ties at ``tie_bit`` and their +-1 ulp neighbours + edge cases."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, size=N, dtype=np.uint64).astype(np.uint32)
    keep = np.uint32(~((1 << (tie_bit + 1)) - 1) & 0xFFFFFFFF)
    ties = (rng.integers(0, 2**32, size=N // 5, dtype=np.uint64).astype(np.uint32) & keep) | np.uint32(1 << tie_bit)
    edges = np.array([0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x80000001, 0x007FFFFF, 0x00800000,
                      0x7F800000, 0xFF800000, 0x7FC00000, 0x00000000, 0x80000000], dtype=np.uint32)
    return np.concatenate([bits, ties, ties - np.uint32(1), ties + np.uint32(1), edges])


def test_fp32_to_bf16_random_bit_exact():
    bits = _fp32_bit_set(1, 15)
    x = bits.view(np.float32)
    assert x.size >= N
    got = _rt(x, "bf16")
    assert_bits_equal(got, _torch_cast(x, torch.bfloat16), x, "bf16 vs torch")
    assert_bits_equal(got, _ml_cast(x, get_format("bf16")), x, "bf16 vs ml_dtypes")
    ok = ~np.isnan(x)
    assert_bits_equal(got[ok], _rne_bits_reference(bits[ok], 16), x[ok], "bf16 vs bit reference")
    # the set exercises overflow to inf and subnormal results
    assert np.isinf(got[np.isfinite(x)]).any() and ((got != 0) & (np.abs(got) < 2.0**-126)).any()


def test_fp32_to_tf32_random_bit_exact():
    """tf32 has no torch/ml_dtypes dtype: reference = RNE of the float32 mantissa to 10 bits
    by integer operations on the float32 bit pattern."""
    bits = _fp32_bit_set(2, 12)
    x = bits.view(np.float32)
    got = _rt(x, "tf32")
    ok = ~np.isnan(x)
    assert_bits_equal(got[ok], _rne_bits_reference(bits[ok], 13), x[ok], "tf32 vs bit reference")
    assert np.isnan(got[~ok]).all()
    assert _rt(np.array([3.4028234663852886e38], dtype=np.float32), "tf32")[0] == np.inf  # fp32 max -> inf


def _log_uniform(rng, n, lo_exp, hi_exp, dtype):
    mag = np.exp2(rng.uniform(lo_exp, hi_exp, n))
    return (mag * rng.choice([-1.0, 1.0], n)).astype(dtype)


def test_fp32_to_fp16_random_bit_exact():
    rng = np.random.default_rng(3)
    x = _log_uniform(rng, N, -30, 18, np.float32)  # below the subnormals (2**-24) to beyond 65504
    # exact ties: midpoints of consecutive positive fp16 values (incl. the overflow tie 65520)
    p = rng.integers(0, 0x7C00, size=N // 5).astype(np.uint16)
    v = p.view(np.float16).astype(np.float64)
    w = np.where(p + 1 == 0x7C00, 65536.0, (p + 1).astype(np.uint16).view(np.float16).astype(np.float64))
    mid = ((v + w) / 2 * rng.choice([-1.0, 1.0], p.size)).astype(np.float32)
    assert np.array_equal(mid.astype(np.float64) * 2, (v + w) * np.sign(mid))
    x = np.concatenate([x, mid, np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(-np.inf)),
                        np.array([65504, 65519.996, 65520, np.inf, np.nan, 2.0**-25, 2.0**-25 * 3], np.float32)])
    got = _rt(x, "fp16")
    assert_bits_equal(got, _torch_cast(x, torch.float16), x, "fp16 vs torch")
    assert_bits_equal(got, x.astype(np.float16).astype(np.float64), x, "fp16 vs numpy")
    assert_bits_equal(_rt(x, custom(5, 10)), got, x, "custom(5,10) vs fp16")


def test_fp64_to_fp32_random_bit_exact():
    rng = np.random.default_rng(4)
    e = rng.integers(1023 - 160, 1023 + 130, size=N).astype(np.uint64)
    mant = rng.integers(0, 2**52, size=N, dtype=np.uint64)
    sign = rng.integers(0, 2, size=N).astype(np.uint64)
    x = ((sign << np.uint64(63)) | (e << np.uint64(52)) | mant).view(np.float64)
    p = rng.integers(0, 0x7F800000, size=N // 5).astype(np.uint32)
    v = p.view(np.float32).astype(np.float64)
    w = np.where(p + 1 == 0x7F800000, 2.0**128, (p + 1).astype(np.uint32).view(np.float32).astype(np.float64))
    mid = (v + w) / 2
    x = np.concatenate([x, mid, -mid, np.nextafter(mid, np.inf), np.nextafter(mid, -np.inf),
                        np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 2.0**-150, 2.0**-150 * 1.0000001])])
    got = _rt(x, "fp32")
    with np.errstate(over="ignore"):
        assert_bits_equal(got, x.astype(np.float32).astype(np.float64), x, "fp32 vs numpy")
    assert_bits_equal(got, torch.from_numpy(x).float().double().numpy(), x, "fp32 vs torch")
    assert np.isinf(got[np.isfinite(x)]).any() and ((got != 0) & (np.abs(got) < 2.0**-126)).any()


# ------------------------------------------------------------------------ custom formats
def test_custom_8_7_is_bf16_on_random_bits():
    x = _fp32_bit_set(5, 15).view(np.float32)
    assert_bits_equal(_rt(x, custom(8, 7)), _torch_cast(x, torch.bfloat16), x, "custom(8,7) vs bf16")


def test_custom_fn_e4m3_is_e4m3_exhaustively():
    e4m3 = get_format("e4m3")
    x = _exhaustive_inputs(e4m3)
    assert_bits_equal(_rt(x, custom(4, 3, bias=7, nan_encoding="fn")), _ml_cast(x, e4m3), x, "custom fn vs e4m3")
    x2 = _exhaustive_inputs(get_format("e2m1"))
    keep = ~np.isnan(x2)
    assert_bits_equal(_rt(x2, "custom(2,1,bias=1,nan=none)")[keep], _ml_cast(x2, get_format("e2m1"))[keep],
                      x2[keep], "custom none vs e2m1")


def _brute_force(x: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    """Independent reference for any small format: enumerate every code's value and pick the
    nearest, ties to the even code; beyond max compare with the virtual next value."""
    E, M, B = fmt.exponent_bits, fmt.mantissa_bits, fmt.bias
    top = 2**E - 1 - (fmt.nan_encoding == "ieee")
    vals, codes = [], []
    for ec in range(top + 1):
        for mc in range(2**M):
            if fmt.nan_encoding == "fn" and ec == top and mc == 2**M - 1:
                continue
            v = math.ldexp(mc / 2**M, 1 - B) if ec == 0 else math.ldexp(1 + mc / 2**M, ec - B)
            vals.append(v)
            codes.append(ec * 2**M + mc)
    vals.append(2 * vals[-1] - vals[-2])  # virtual next value: overflow marker
    codes.append(codes[-1] + 1)
    vals, codes = np.array(vals), np.array(codes)
    a = np.abs(x)
    i = np.clip(np.searchsorted(vals, a), 1, len(vals) - 1)
    lo, hi = vals[i - 1], vals[i]
    dlo, dhi = a - lo, hi - a
    up = (dhi < dlo) | ((dhi == dlo) & (codes[i] % 2 == 0))
    r = np.where(up, hi, lo)
    r = np.where(a > vals[-1], np.inf, r)
    r = np.where(r > fmt.max, np.inf, r)
    return np.copysign(r, x)


@pytest.mark.parametrize("fmt", [custom(3, 4), custom(4, 3, 7), custom(6, 1), custom(3, 3, 2, nan_encoding="fn"),
                                 custom(2, 5, 0, nan_encoding="none"), custom(5, 2, 12, nan_encoding="fnuz")], ids=str)
def test_custom_formats_match_brute_force(fmt):
    rng = np.random.default_rng(6)
    lo, hi = math.log2(fmt.min_subnormal) - 3, math.log2(fmt.max) + 1
    x = _log_uniform(rng, 100_000, lo, hi, np.float64)
    # plus every midpoint of the grid (ties)
    grid = np.unique(np.abs(_brute_force(x, fmt)))
    grid = grid[np.isfinite(grid)]
    x = np.concatenate([x, (grid[1:] + grid[:-1]) / 2, -(grid[1:] + grid[:-1]) / 2])
    got = _rt(x, fmt, overflow="inf" if fmt.has_inf else "nan")
    ref = _brute_force(x, fmt)
    ref = np.where(np.isinf(ref) & (not fmt.has_inf), np.nan, ref)
    if fmt.nan_encoding == "fnuz":
        ref = ref + 0.0
    assert_bits_equal(got, ref, x, f"brute force {fmt}")


# ------------------------------------------------------------------------ negative controls
def test_negative_control_wrong_mantissa_does_not_match():
    """The comparisons above can fail: another mantissa width or exponent layout is caught."""
    e4m3 = get_format("e4m3")
    x = _exhaustive_inputs(e4m3)
    ref = _ml_cast(x, e4m3)
    for wrong in (custom(4, 2, bias=7, nan_encoding="fn"), get_format("e5m2"), custom(4, 3, bias=8, nan_encoding="fn"),
                  custom(4, 3, bias=7, nan_encoding="ieee")):
        assert _mismatch(_rt(x, wrong), ref).sum() > 100, wrong
    with pytest.raises(AssertionError, match="differ"):
        assert_bits_equal(_rt(x, custom(4, 2, bias=7, nan_encoding="fn")), ref, x, "deliberately wrong")
    # tf32 bit reference vs bf16 rounding: differ
    bits = _fp32_bit_set(7, 12)[:10000]
    ok = ~np.isnan(bits.view(np.float32))
    assert _mismatch(_rt(bits.view(np.float32)[ok], "bf16"), _rne_bits_reference(bits[ok], 13)).sum() > 1000


def test_negative_control_ties_away_is_caught():
    """Round-half-away (a classic emulation bug) differs from RNE on the midpoints."""
    f = get_format("e4m3")
    lo, hi, _ = _midpoints(_values(f), f)
    mid = (lo + hi) / 2
    q = quantum(torch.from_numpy(mid), f).numpy()
    away = np.sign(mid) * np.floor(np.abs(mid) / q + 0.5) * q
    assert _mismatch(away, _ml_cast(mid.astype(np.float32), f)).sum() > 50


# ------------------------------------------------------------------------ stochastic rounding
def _neighbours(x: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    i = np.searchsorted(vals, x, side="right")
    lo = vals[np.clip(i - 1, 0, len(vals) - 1)]
    j = np.searchsorted(vals, x, side="left")
    hi = vals[np.clip(j, 0, len(vals) - 1)]
    return lo, hi


@pytest.mark.parametrize("name", ["e4m3", "e2m1", "e5m2", "e3m2"])
def test_stochastic_result_is_a_neighbour(name):
    f = get_format(name)
    vals = _values(f)
    rng = np.random.default_rng(8)
    x = rng.uniform(-f.max, f.max, 200_000)
    x = np.concatenate([x, x / 2**10, vals])  # includes the subnormal range and exact values
    g = torch.Generator().manual_seed(0)
    r = _rt(x, f, stochastic=True, generator=g)
    lo, hi = _neighbours(x, vals)
    assert np.all((r == lo) | (r == hi))
    exact = np.isin(x, vals)
    assert np.array_equal(r[exact], x[exact])  # representable values never move
    # both neighbours actually occur (it is not round-to-nearest)
    inner = ~exact
    assert (r[inner] == lo[inner]).mean() > 0.2 and (r[inner] == hi[inner]).mean() > 0.2


def _hoeffding_tol(n: int, width: np.ndarray, delta: float = 1e-9) -> np.ndarray:
    """|mean - E| <= width * sqrt(ln(2/delta) / (2n)) with probability >= 1 - delta
    (Hoeffding, samples in an interval of length ``width``); ~6.5 sigma at p = 1/2."""
    return width * math.sqrt(math.log(2 / delta) / (2 * n))


def _assert_unbiased(samples: np.ndarray, x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
    n = samples.shape[1]
    dev = np.abs(samples.mean(axis=1) - x)
    tol = _hoeffding_tol(n, hi - lo)
    assert np.all(dev <= tol), f"bias {dev / (hi - lo)} exceeds Hoeffding tolerance {tol / (hi - lo)}"


def test_stochastic_rounding_is_unbiased():
    """Mean of n = 200000 draws vs x, for fractions 0.01..0.99 of the gap, in bf16, e4m3 (normal
    and subnormal) and e2m1. Fixed seed; tolerance from Hoeffding at delta = 1e-9, which is
    <= 0.0073 gaps, far below the 0.01..0.5-gap bias of nearest rounding (negative control)."""
    n = 200_000
    cases = []
    for name, base in (("bf16", 1.0), ("bf16", -3.0), ("e4m3", 1.0), ("e4m3", 2.0**-8), ("e2m1", 2.0)):
        f = get_format(name)
        gap = float(quantum(torch.tensor([base]), f)) * (1 if base > 0 else -1)
        for frac in (0.01, 0.25, 0.5, 0.7, 0.99):
            cases.append((f, base, base + frac * gap, gap))
    for f, base, x, gap in cases:
        xs = torch.full((n,), x, dtype=torch.float64)
        s = round_to(xs, f, stochastic=True, generator=torch.Generator().manual_seed(42)).numpy()[None]
        lo, hi = np.array([min(base, base + gap)]), np.array([max(base, base + gap)])
        assert set(np.unique(s)) <= {lo[0], hi[0]}
        _assert_unbiased(s, np.array([x]), lo, hi)
        # negative controls: nearest rounding, and a stochastic rounder biased by 2% of a gap
        rne = round_to(xs, f).numpy()[None]
        with pytest.raises(AssertionError, match="Hoeffding"):
            _assert_unbiased(rne, np.array([x]), lo, hi)
        u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(42)).numpy()
        frac = abs(x - base) / abs(gap)
        biased = np.where(u < frac + 0.02 if frac < 0.5 else u < frac - 0.02, base + gap, base)[None]
        with pytest.raises(AssertionError, match="Hoeffding"):
            _assert_unbiased(biased, np.array([x]), lo, hi)
    assert _hoeffding_tol(n, np.array(1.0)) < 0.0075


def test_stochastic_rounding_unbiased_over_random_inputs():
    """Aggregate: sum over 10**6 random x of (SR(x) - x) / gap is within Hoeffding's bound."""
    f = get_format("e4m3")
    rng = np.random.default_rng(9)
    x = rng.uniform(-400, 400, N)
    r = _rt(x, f, stochastic=True, generator=torch.Generator().manual_seed(1))
    lo, hi = _neighbours(x, _values(f))
    width = np.where(hi > lo, hi - lo, 1.0)
    z = (r - x) / width  # in [-1, 1], mean 0 if unbiased
    assert abs(z.mean()) <= 2 * math.sqrt(math.log(2 / 1e-9) / (2 * N))
    zr = (_rt(x, f) - x) / width  # RNE is unbiased on average too ... but not conditional on frac
    frac = (x - lo) / width
    sel = (frac > 0.05) & (frac < 0.45)
    assert abs(zr[sel].mean()) > 0.1 and abs(z[sel].mean()) < 0.01


def test_stochastic_rounding_is_reproducible_with_a_generator():
    x = torch.linspace(-3, 3, 10001, dtype=torch.float64)
    a = round_to(x, "e4m3", stochastic=True, generator=torch.Generator().manual_seed(7))
    b = round_to(x, "e4m3", stochastic=True, generator=torch.Generator().manual_seed(7))
    c = round_to(x, "e4m3", stochastic=True, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_stochastic_rounding_handles_specials():
    f = get_format("e4m3")
    x = torch.tensor([0.0, -0.0, math.nan, math.inf, 448.0, 1e4, -1e4])
    r = round_to(x, f, stochastic=True, overflow="saturate", generator=torch.Generator().manual_seed(0))
    assert r[0] == 0 and r[1] == 0 and math.isnan(r[2])
    assert r[3] == 448 and r[4] == 448 and r[5] == 448 and r[6] == -448


# ------------------------------------------------------------------------ misc
def test_round_to_accepts_names_dtypes_and_shapes():
    x = torch.randn(3, 4, 5, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    r = round_to(x, "bf16")
    assert r.dtype == torch.float64 and r.shape == x.shape
    assert torch.equal(r, x.to(torch.bfloat16).double())
    assert torch.equal(round_to(x, torch.bfloat16), r)
    assert torch.equal(round_to(x.to(torch.bfloat16), "e4m3"), x.to(torch.bfloat16).to(torch.float8_e4m3fn).double())
    assert torch.equal(round_to(x, "fp64"), x.double())
    assert round_to(torch.tensor(1.1), "e2m1").shape == ()


def test_quantum_is_the_grid_spacing():
    f = get_format("e4m3")
    vals = _values(f)
    pos = vals[vals > 0]
    q = quantum(torch.from_numpy(pos[:-1]), f).numpy()
    assert np.array_equal(q, np.diff(pos))


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16", "e4m3", "e5m2"])
def test_representable_is_round_to_equality(name):
    """The cast round trip of ``representable`` (fp32/bf16/fp16) and its round_to fallback
    agree with ``round_to(x, fmt) == x`` on random float64 values, values on the format's grid
    and their float64 neighbours, the format's extremes and Inf/NaN."""
    fmt = get_format(name)
    g = torch.Generator().manual_seed(3)
    randoms = torch.randn(20000, dtype=torch.float64, generator=g) * torch.exp2(torch.randint(-150, 130, (20000,), generator=g).double())
    on_grid = round_to(randoms.clamp(-fmt.max, fmt.max), fmt)  # representable by construction
    edges = torch.tensor([fmt.max, fmt.min_normal, fmt.min_subnormal if fmt.subnormals else fmt.min_normal, 0.0, -0.0,
                          math.inf, -math.inf, math.nan], dtype=torch.float64)
    above = torch.nextafter(on_grid, torch.full_like(on_grid, math.inf))
    x = torch.cat([randoms, on_grid, -on_grid, above, edges, -edges, torch.nextafter(edges, edges * 2),
                   torch.nextafter(on_grid, torch.zeros_like(on_grid))])
    got = representable(x, fmt)
    assert torch.equal(got, round_to(x, fmt) == x)
    assert bool(got[20000:40000].all()) and 0 < int(got.sum()) < x.numel()
