"""Tests of the exact / high-precision references (ttrace_num.reference).

Ground truth here is independent of the code under test:
* ``fractions.Fraction`` (exact rational arithmetic) for sums, dot products and matmuls,
  rounded to float64 by CPython's correctly rounded int/int division;
* straightforward high-level mpmath formulas at 80 digits for the non-linear operators;
* torch's float64 ops for semantics (same formula conventions, ~1e-14 agreement).
Negative controls show that each comparison can fail (naive float64 summation, wrong
variance normalisation, wrong label-smoothing convention, ``float(mpf)`` double rounding).
"""
from __future__ import annotations

import math
import random
from fractions import Fraction

import mpmath
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ttrace_num.reference as R

from ttrace_num.reference import mp as MP

# --------------------------------------------------------------------------- exact helpers


def fr_round(fr: Fraction) -> float:
    """Correctly rounded float64 of a Fraction (ties to even; overflow -> inf)."""
    try:
        return fr.numerator / fr.denominator
    except OverflowError:
        return math.inf if fr > 0 else -math.inf


def fr_sum(vals) -> float:
    return fr_round(sum((Fraction(float(v)) for v in vals), Fraction(0)))


def fr_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Correctly rounded a @ b (2-D) by exact rational arithmetic."""
    A = [[Fraction(v) for v in row] for row in a.double().tolist()]
    B = [[Fraction(v) for v in row] for row in b.double().t().tolist()]
    out = [[fr_round(sum((x * y for x, y in zip(ra, cb)), Fraction(0))) for cb in B] for ra in A]
    return torch.tensor(out, dtype=torch.float64)


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str = ""):
    got = got.double()
    want = want.double()
    assert got.shape == want.shape, (what, got.shape, want.shape)
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    if not bool(same.all()):
        i = (~same).nonzero()[0].tolist()
        raise AssertionError(f"{what}: {int((~same).sum())} mismatches; first at {i}: got {got[tuple(i)].item()!r} want {want[tuple(i)].item()!r}")


def ulp_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in float64 ulps (ordered-integer difference), finite inputs."""
    ia = a.double().view(torch.int64)
    ib = b.double().view(torch.int64)
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFFFFFFFFFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFFFFFFFFFFFFFF), ib)
    return (ia - ib).abs()


def fp32_full_mantissa(shape, gen, lo=-8, hi=8):
    """fp32 values with random full 24-bit mantissas and exponents in [lo, hi)."""
    m = torch.randint(1 << 23, 1 << 24, shape, generator=gen).double()
    e = torch.randint(lo, hi, shape, generator=gen).double()
    s = torch.randint(0, 2, shape, generator=gen).double() * 2 - 1
    x = (s * m * torch.pow(2.0, e - 23)).float()
    assert bool((x.double() == s * m * torch.pow(2.0, e - 23)).all())
    return x


# --------------------------------------------------------------------------- mp.py


def test_raw_to_float_correct_rounding_and_float_mpf_defect():
    rng = random.Random(5)
    for _ in range(20000):
        e = rng.choice([rng.randint(-1130, -1000), rng.randint(-1100, 1030), rng.randint(1000, 1030)])
        if rng.random() < 0.4:  # exact ties and near ties at every position
            k = rng.randint(1, 70)
            man = (rng.getrandbits(54) << k) | (1 << (k - 1)) | rng.randint(0, 1)
        else:
            man = rng.getrandbits(rng.choice([1, 30, 53, 54, 120, 170])) | 1
        sign = rng.randint(0, 1)
        x = mpmath.libmp.from_man_exp(-man if sign else man, e)
        fr = Fraction(man) * Fraction(2) ** e * (-1 if sign else 1)
        assert MP.raw_to_float(x) == fr_round(fr), (man, e)
    # float(mpf) double-rounds in the subnormal range; mpf_to_float does not
    with mpmath.workdps(50):
        x = (mpmath.mpf(1) / 2 + mpmath.mpf(2) ** -60) * mpmath.mpf(2) ** -1074
        assert float(x) == 0.0  # mpmath's conversion: wrong
        assert MP.mpf_to_float(x) == 5e-324  # correct: just above half the smallest step


def test_tensor_mpf_roundtrip_exact_all_dtypes():
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(500, generator=gen, dtype=torch.float64) * torch.pow(10.0, torch.randint(-30, 30, (500,), generator=gen).double())
    extras = torch.tensor([0.0, 5e-324, -2.2250738585072014e-308, 1.7976931348623157e308, 1e-45, 2.0**-149])
    for dt in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        x = torch.cat([base, extras.double()]).to(dt)
        ms = MP.to_mpf(x)
        for m, v in zip(ms, x.double().tolist()):
            if math.isfinite(v):
                assert Fraction(*mpmath.libmp.to_rational(m._mpf_)) == Fraction(v)
        back = MP.from_mpf(ms, x.shape)
        assert_bits_equal(back, x.double(), f"roundtrip {dt}")
        assert_bits_equal(MP.from_raw(MP.to_raw(x), x.shape), x.double(), f"raw roundtrip {dt}")


def test_workdps_context():
    assert MP.get_dps() == MP.DEFAULT_DPS == 50
    with MP.workdps(80) as d:
        assert d == 80 and MP.get_dps() == 80 and mpmath.mp.dps == 80
    assert MP.get_dps() == 50
    with pytest.raises(ValueError):
        MP.resolve_prec(10)


# --------------------------------------------------------------------------- sums


def _sum_cases():
    rng = np.random.default_rng(3)
    cases = {}
    cases["normal"] = rng.standard_normal((6, 300))
    # huge +x and -x with tiny remainders (condition number ~1e30)
    big = rng.standard_normal((6, 100)) * 1e20
    tiny = rng.standard_normal((6, 20)) * 1e-10
    c = np.concatenate([big, -big, tiny], axis=1)
    cases["cancel"] = np.take_along_axis(c, rng.permuted(np.tile(np.arange(c.shape[1]), (6, 1)), axis=1), axis=1)
    cases["subnormal"] = rng.standard_normal((6, 200)) * 1e-310
    cases["mixed"] = rng.standard_normal((6, 200)) * 10.0 ** rng.integers(-300, 300, (6, 200))
    # exact ties of the final rounding: 1 + 2^-53 spread in pieces
    cases["ties"] = np.array([[1.0, 2.0**-53, 2.0**-80, -(2.0**-80)], [1.0, 2.0**-53, 2.0**-54, -(2.0**-54)], [3.0, 2.0**-52, 0.0, 0.0], [1.0, -(2.0**-54), -(2.0**-106), 0.0]])
    return cases


@pytest.mark.parametrize("name", ["normal", "cancel", "subnormal", "mixed", "ties"])
def test_exact_sum_vs_fraction(name):
    x = torch.from_numpy(_sum_cases()[name])
    got = R.exact_sum(x, dim=-1)
    want = torch.tensor([fr_sum(r) for r in x.tolist()], dtype=torch.float64)
    assert_bits_equal(got, want, name)
    # dim / keepdim / dim=None / transposed (non-contiguous) input
    assert_bits_equal(R.exact_sum(x.t(), dim=0, keepdim=True), want[None, :], name + " dim0")
    assert_bits_equal(R.exact_sum(x, dim=None), torch.tensor(fr_sum(x.reshape(-1).tolist()), dtype=torch.float64), name + " all")
    assert_bits_equal(R.sum_ref(x, dim=1), want, name + " sum_ref")


def test_naive_summation_is_detected_as_inexact():
    """Negative control: the same comparison flags plain float64 summation as wrong."""
    x = torch.from_numpy(_sum_cases()["cancel"])
    want = torch.tensor([fr_sum(r) for r in x.tolist()], dtype=torch.float64)
    naive = x.sum(-1)  # float64 pairwise summation: loses everything to cancellation
    assert not bool((naive == want).all())
    with pytest.raises(AssertionError):
        assert_bits_equal(naive, want, "naive")
    # a single-precision-ish pass of compensated summation (Kahan) is not exact either
    kahan = []
    for r in x.tolist():
        s = c = 0.0
        for v in r:
            y = v - c
            t = s + y
            c = (t - s) - y
            s = t
        kahan.append(s)
    assert not bool((torch.tensor(kahan, dtype=torch.float64) == want).all())
    assert_bits_equal(R.exact_sum(x), want, "exact")


def test_exact_sum_specials_and_overflow():
    inf, nan = math.inf, math.nan
    rows = [[1.0, inf, 2.0], [inf, -inf], [nan, 1.0], [1e308, 1e308, -1e308], [1e308, 1e308], [-1e308, -1e308, 1.0]]
    want = [inf, nan, nan, 1e308, inf, -inf]
    got = [R.exact_sum(torch.tensor(r, dtype=torch.float64)).item() for r in rows]
    for g, w, r in zip(got, want, rows):
        assert (g == w) or (math.isnan(g) and math.isnan(w)), (r, g, w)
    assert R.exact_sum(torch.zeros(3, 0)).tolist() == [0.0, 0.0, 0.0]


def test_mean_ref_vs_fraction():
    x = torch.from_numpy(_sum_cases()["mixed"])
    for n in (x.shape[1], 7, 3):
        xs = x[:, :n]
        want = torch.tensor([fr_round(sum(map(Fraction, r), Fraction(0)) / n) for r in xs.tolist()], dtype=torch.float64)
        assert_bits_equal(R.mean_ref(xs, dim=-1), want, f"mean n={n}")
    sub = torch.tensor([[5e-324, 5e-324, 5e-324, 0.0]], dtype=torch.float64)  # mean = 0.75 * 2^-1074
    assert R.mean_ref(sub, dim=1).item() == 5e-324
    assert math.isnan(R.mean_ref(torch.zeros(2, 0), dim=1)[0].item())


# --------------------------------------------------------------------------- matmul


def _matmul_cases():
    g = torch.Generator().manual_seed(7)
    cases = {}
    cases["fp32_full_mantissa"] = (fp32_full_mantissa((5, 33), g), fp32_full_mantissa((33, 4), g))
    cases["bf16"] = (torch.randn(4, 40, generator=g).bfloat16(), torch.randn(40, 3, generator=g).bfloat16())
    cases["fp16"] = (torch.randn(3, 17, generator=g).half(), torch.randn(17, 5, generator=g).half())
    cases["fp64"] = (torch.randn(4, 23, generator=g, dtype=torch.float64), torch.randn(23, 3, generator=g, dtype=torch.float64))
    sub = torch.tensor([1e-45, 3e-45, -2e-44, 1.1754942e-38, 5.877472e-39], dtype=torch.float32)
    cases["fp32_subnormal"] = (sub[torch.randint(0, 5, (3, 12), generator=g)] * torch.randn(3, 12, generator=g).sign(), torch.randn(12, 4, generator=g) * 1e-30)
    # cancellation: rows [x, -x, t] against columns [y, y, s]: products cancel, tiny remainder
    x = fp32_full_mantissa((4, 16), g, 10, 20)
    y = fp32_full_mantissa((16, 3), g, 10, 20)
    t = fp32_full_mantissa((4, 3), g, -40, -30)
    cases["cancel"] = (torch.cat([x, -x, t], 1), torch.cat([y, y, torch.ones(3, 3)], 0))
    # float64 beyond the TwoProduct-safe range: rational fallback
    cases["fp64_extreme"] = (
        torch.tensor([[1e300, -1e300, 1e-300], [1e-200, 3e-200, 1.0]], dtype=torch.float64),
        torch.tensor([[1e10, 1.0], [1e10, 2.0], [1e-10, 1e-200]], dtype=torch.float64),
    )
    return cases


@pytest.mark.parametrize("name", list(_matmul_cases()))
@pytest.mark.parametrize("method", ["fsum", "dot2"])
def test_exact_matmul_vs_fraction(name, method):
    a, b = _matmul_cases()[name]
    want = fr_matmul(a, b)
    assert_bits_equal(R.exact_matmul(a, b, method=method), want, f"{name} {method}")
    if method == "dot2":
        # the double-double carries a rigorous bound: |hi + lo - exact| <= err
        r = R.dot2_matmul(a, b)
        A = [[Fraction(v) for v in row] for row in a.double().tolist()]
        Bc = [[Fraction(v) for v in row] for row in b.double().t().tolist()]
        for i in range(a.shape[0]):
            for j in range(b.shape[1]):
                if r.unsafe[i, j]:
                    continue
                ex = sum((p * q for p, q in zip(A[i], Bc[j])), Fraction(0))
                assert abs(Fraction(r.hi[i, j].item()) + Fraction(r.lo[i, j].item()) - ex) <= Fraction(r.err[i, j].item())


def test_matmul_specials():
    inf, nan = math.inf, math.nan
    a = torch.tensor([[1.0, inf], [1.0, 2.0], [inf, -inf], [0.0, inf], [nan, 0.0]], dtype=torch.float32)
    b = torch.tensor([[1.0, 1.0], [2.0, -1.0]], dtype=torch.float32)
    want = torch.tensor([[inf, -inf], [5.0, -1.0], [nan, inf], [inf, -inf], [nan, nan]], dtype=torch.float64)
    for method in ("fsum", "dot2"):
        assert_bits_equal(R.exact_matmul(a, b, method=method), want, method)
        assert_bits_equal(R.exact_matmul(a, b, method=method, certify=False), want, method)


def test_matmul_shapes_broadcast_and_noncontiguous():
    g = torch.Generator().manual_seed(11)
    a = torch.randn(2, 3, 5, 9, generator=g)
    b = torch.randn(9, 4, generator=g)
    got = R.exact_matmul(a, b)
    assert got.shape == (2, 3, 5, 4) and got.dtype == torch.float64
    for i in range(2):
        for j in range(3):
            assert_bits_equal(got[i, j], fr_matmul(a[i, j], b), "batched")
    b3 = torch.randn(3, 9, 4, generator=g)
    got = R.exact_matmul(a, b3)  # (2,3,5,9) @ (3,9,4)
    assert_bits_equal(got[1, 2], fr_matmul(a[1, 2], b3[2]), "broadcast batch")
    assert_bits_equal(R.exact_matmul(a, b3, method="fsum"), got, "fsum batched")
    # transposed / sliced views
    at = torch.randn(9, 5, generator=g).t()
    bt = torch.randn(8, 9, generator=g)[::2].t()
    assert not at.is_contiguous() and not bt.is_contiguous()
    assert_bits_equal(R.exact_matmul(at, bt), fr_matmul(at, bt), "non-contiguous")
    # vector cases follow torch.matmul
    v = torch.randn(9, generator=g)
    assert R.exact_matmul(v, b).shape == (4,)
    assert R.exact_matmul(a, v).shape == (2, 3, 5)
    assert R.exact_matmul(v, v).shape == ()
    assert R.exact_matmul(v, b3).shape == (3, 4)
    assert R.exact_matmul(v, v).item() == fr_round(sum((Fraction(p) * Fraction(p) for p in v.double().tolist()), Fraction(0)))
    assert_bits_equal(R.exact_dot(a, a, dim=-1), R.exact_sum(a.double() * a.double(), dim=-1), "exact_dot")


def test_dot2_vs_fsum_agreement_large_k():
    """Plain Dot2 (certify=False) against fsum on random fp32 data, K up to 16384.

    Required: equal in >= 99.9% of elements and within 1 ulp elsewhere (a difference can
    only come from an exact or near tie of the final rounding that Dot2's compensation
    breaks the wrong way). Measured with these seeds (and fp32/bf16/fp16/fp64 data up to
    K=16384 offline): no difference at all. With certify=True (default) equal everywhere."""
    g = torch.Generator().manual_seed(2024)
    total = differ = 0
    for K, M, N in ((1, 8, 8), (7, 16, 16), (256, 48, 48), (4096, 24, 24), (16384, 12, 12)):
        a = torch.randn(M, K, generator=g)
        b = torch.randn(K, N, generator=g)
        f = R.exact_matmul(a, b, method="fsum")
        plain = R.exact_matmul(a, b, certify=False)
        assert_bits_equal(R.exact_matmul(a, b), f, f"certified dot2 K={K}")
        d = ulp_diff(plain, f)
        assert int(d.max()) <= 1, K
        total += d.numel()
        differ += int((d > 0).sum())
    assert differ <= 0.001 * total, (differ, total)


def test_dot2_ill_conditioned_needs_certificate():
    """Dot products with condition ~1e30+: the plain Dot2 result can be off, the
    certificate catches every such element and the fsum fallback fixes it."""
    g = torch.Generator().manual_seed(3)
    K = 64
    x = fp32_full_mantissa((40, K // 2), g, 20, 40)
    y = fp32_full_mantissa((K // 2, 1), g, 20, 40)
    small = fp32_full_mantissa((40, 1), g, -60, -50)
    # columns: y, -y(+1ulp noise) ... products cancel to leave tiny, non-representable remainders
    a = torch.cat([x, x, small], 1)
    b = torch.cat([y, -y, torch.ones(1, 1)], 0).expand(-1, 5).contiguous()
    b[: K // 2, 1:] = b[: K // 2, 1:] * (1 + torch.rand(K // 2, 4, generator=g) * 1e-6).float()
    want = fr_matmul(a, b)
    r = R.dot2_matmul(a, b)
    assert_bits_equal(R.exact_matmul(a, b), want, "certified")
    # certified elements are right; the plain result may not be where uncertified
    cert = r.certified
    assert_bits_equal(r.hi[cert], want[cert], "certified subset")
    assert not bool(cert.all())  # the certificate did have work to do here
    # the a-priori Dot2 bound holds for the plain result (against the exact value: the
    # plain result can sit 1 ulp from the correctly rounded one, e.g. when hi + lo is a
    # tie and the exact value is a hair beyond it; it stays faithful)
    u = Fraction(1, 2**53)
    n = a.shape[1]
    gam = n * u / (1 - n * u)
    absab = R.abs_matmul(a, b, upper=True)
    A = [[Fraction(v) for v in row] for row in a.double().tolist()]
    Bc = [[Fraction(v) for v in row] for row in b.double().t().tolist()]
    off_by_one = 0
    for i in range(a.shape[0]):
        for j in range(b.shape[1]):
            ex = sum((p * q for p, q in zip(A[i], Bc[j])), Fraction(0))
            hi = r.hi[i, j].item()
            assert abs(Fraction(hi) - ex) <= u * abs(ex) + gam**2 * Fraction(absab[i, j].item())
            off_by_one += hi != want[i, j].item()
            assert ulp_diff(r.hi[i, j], want[i, j]).item() <= 1


def test_dot2_speed_target_shape():
    """The 128x4096x128 case of the spec (timed in the report; checked on a corner)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(128, 4096, generator=g)
    b = torch.randn(4096, 128, generator=g)
    got = R.exact_matmul(a, b)
    assert_bits_equal(got[:6, :5], R.exact_matmul(a[:6], b[:, :5], method="fsum"), "corner")
    # the float64 BLAS product agrees to ~1e-13 relative of |A||B| (semantic sanity)
    assert bool(((got - a.double() @ b.double()).abs() <= 1e-13 * R.abs_matmul(a, b)).all())


def test_abs_matmul_and_sum_abs_are_upper_bounds():
    g = torch.Generator().manual_seed(9)
    a = torch.randn(6, 50, generator=g, dtype=torch.float64)
    b = torch.randn(50, 4, generator=g, dtype=torch.float64)
    ex = fr_matmul(a.abs(), b.abs())
    ub = R.abs_matmul(a, b, upper=True)
    assert bool((ub >= ex).all()) and bool((ub <= ex * (1 + 1e-12)).all())
    assert bool(((R.abs_matmul(a, b) - ex).abs() <= 1e-13 * ex).all())
    s = R.sum_abs(a, dim=1, upper=True)
    assert bool((s >= R.exact_sum(a.abs(), dim=1)).all())
    assert R.sum_abs(a, dim=None).shape == ()


# --------------------------------------------------------------------------- ops: independent mpmath


def mp_ref(fn, xs, dps=80):
    with mpmath.workdps(dps):
        return fn([mpmath.mpf(v) for v in xs])


def hl_softmax(row, log=False):
    def f(v):
        finite = [t for t in v if t != -mpmath.inf]
        m = max(finite)
        es = [mpmath.exp(t - m) if t != -mpmath.inf else mpmath.mpf(0) for t in v]
        S = mpmath.fsum(es)
        if log:
            return [MP.mpf_to_float((t - m) - mpmath.log(S)) if t != -mpmath.inf else -math.inf for t in v]
        return [MP.mpf_to_float(e / S) for e in es]

    return mp_ref(f, row)


def hl_layer_norm(row, w, b, eps):
    def f(v):
        n = len(v)
        mean = mpmath.fsum(v) / n
        var = mpmath.fsum([(t - mean) ** 2 for t in v]) / n
        r = 1 / mpmath.sqrt(var + mpmath.mpf(eps))
        return [MP.mpf_to_float((t - mean) * r * mpmath.mpf(wi) + mpmath.mpf(bi)) for t, wi, bi in zip(v, w, b)]

    return mp_ref(f, row, dps=120)


def test_softmax_family_vs_high_level_mpmath():
    g = torch.Generator().manual_seed(21)
    x = torch.randn(6, 40, generator=g) * 4
    x[1, 5:9] = -math.inf  # masked
    x[2] = x[2] * 2500  # ~1e4 spread: most exps underflow in float64
    x[3, :] = 0.0  # exact zeros: uniform
    x[4, 0] = 1e4  # one dominant logit
    sm, lsm = R.softmax(x), R.log_softmax(x)
    for i, row in enumerate(x.double().tolist()):
        assert sm[i].tolist() == hl_softmax(row), i
        assert lsm[i].tolist() == hl_softmax(row, log=True), i
    assert sm[3].tolist() == [1 / 40] * 40 and (sm[1, 5:9] == 0).all() and (lsm[1, 5:9] == -math.inf).all()
    # fully masked row and +inf / NaN rows give NaN like torch
    y = torch.tensor([[-math.inf, -math.inf], [math.inf, 1.0], [math.nan, 1.0], [-math.inf, 3.0]])
    for ref, tor in ((R.softmax, torch.softmax), (R.log_softmax, torch.log_softmax)):
        assert_bits_equal(ref(y), tor(y.double(), -1), ref.__name__ + " specials")


def test_layer_norm_rms_norm_vs_high_level_mpmath():
    g = torch.Generator().manual_seed(22)
    x = torch.randn(3, 24, generator=g) * 3 + 100  # large mean: cancellation in x - mean
    w = torch.randn(24, generator=g)
    b = torch.randn(24, generator=g)
    got = R.layer_norm(x, (24,), w, b, eps=1e-5)
    for i, row in enumerate(x.double().tolist()):
        assert got[i].tolist() == hl_layer_norm(row, w.double().tolist(), b.double().tolist(), 1e-5), i

    def hl_rms(v):
        ms = mpmath.fsum([t * t for t in v]) / len(v)
        r = 1 / mpmath.sqrt(ms + mpmath.mpf(1e-6))
        return [MP.mpf_to_float(t * r * mpmath.mpf(wi)) for t, wi in zip(v, w.double().tolist())]

    got = R.rms_norm(x, (24,), w, eps=1e-6)
    for i, row in enumerate(x.double().tolist()):
        assert got[i].tolist() == mp_ref(hl_rms, row), i


def test_layer_norm_constant_row_and_bias_cancellation():
    x = torch.full((2, 16), 3.25)
    b = torch.linspace(-1, 1, 16)
    w = torch.randn(16)
    out = R.layer_norm(x, 16, w, b)
    assert_bits_equal(out, b.double().expand(2, 16), "constant row -> bias")
    assert R.layer_norm(x, 16).abs().max().item() == 0.0
    # eps = 0 and a constant row: 0/0 -> NaN, as torch
    assert torch.isnan(R.layer_norm(x, 16, eps=0.0)).all()
    # non-finite rows follow torch
    y = torch.tensor([[math.inf, 1.0, 2.0], [1.0, 2.0, 4.0]])
    assert_bits_equal(R.layer_norm(y, 3)[0], F.layer_norm(y.double(), (3,))[0], "inf row")
    assert_bits_equal(R.rms_norm(y, 3)[0], F.rms_norm(y.double(), (3,), eps=1e-6)[0], "rms inf row")


def test_elementwise_vs_high_level_mpmath_including_tails():
    xs = [-40.5, -38.0, -20.0, -8.489848136901855, -3.0, -1e-3, -1e-300, 0.0, 5e-324, 1e-8, 0.5, 2.0, 7.0, 13.0, 14.0, 300.0]
    x = torch.tensor(xs, dtype=torch.float64)
    sqrt2 = lambda: mpmath.sqrt(2)  # noqa: E731
    hl = {
        "gelu": lambda v: [MP.mpf_to_float(t / 2 * mpmath.erfc(-t / sqrt2())) for t in v],
        "gelu_tanh": lambda v: [MP.mpf_to_float(t / 2 * (1 + mpmath.tanh(mpmath.sqrt(2 / mpmath.pi) * (t + mpmath.mpf("0.044715") * t**3)))) for t in v],
        "silu": lambda v: [MP.mpf_to_float(t / (1 + mpmath.exp(-t))) for t in v],
    }
    got = {"gelu": R.gelu(x), "gelu_tanh": R.gelu(x, approximate="tanh"), "silu": R.silu(x)}
    for k in hl:
        want = mp_ref(hl[k], xs, dps=400)  # 1 + tanh(u) cancels badly for u << 0: lots of digits
        assert got[k].tolist() == want, k
    # torch's float64 gelu loses the tail (1 + erf(z) cancels): the reference does not
    assert F.gelu(torch.tensor([-8.489848136901855], dtype=torch.float64)).item() == 0.0
    assert got["gelu"][3].item() < -8e-17
    # swiglu: silu(a) * b with a, b the two halves
    g = torch.Generator().manual_seed(23)
    z = torch.randn(3, 10, generator=g)
    a, b = z.double().chunk(2, -1)
    want = [mp_ref(lambda v: [MP.mpf_to_float(p / (1 + mpmath.exp(-p)) * q) for p, q in zip(v[:5], v[5:])], ra + rb) for ra, rb in zip(a.tolist(), b.tolist())]
    assert R.swiglu(z).tolist() == want
    # non-finite inputs follow torch
    s = torch.tensor([math.inf, -math.inf, math.nan], dtype=torch.float64)
    for ref, tor in ((R.silu, F.silu), (R.gelu, F.gelu)):
        assert_bits_equal(ref(s), tor(s), ref.__name__ + " specials")


def test_cross_entropy_vs_high_level_mpmath():
    g = torch.Generator().manual_seed(24)
    x = torch.randn(5, 30, generator=g) * 3
    x[1, 3] = -math.inf
    t = torch.tensor([0, 4, 29, 7, -100])
    ls = 0.1

    def hl(v, tgt):
        m = max(u for u in v if u != -mpmath.inf)
        lse = m + mpmath.log(mpmath.fsum([mpmath.exp(u - m) for u in v]))
        nll = lse - v[tgt]
        smooth = mpmath.fsum([lse - u for u in v if u != -mpmath.inf])
        return nll, smooth

    with mpmath.workdps(80):
        parts = [hl([mpmath.mpf(u) for u in row], tg) for row, tg in zip(x.double().tolist(), t.tolist()) if tg != -100]
        none0 = [MP.mpf_to_float(p[0]) for p in parts] + [0.0]
        lsm = [(1 - mpmath.mpf(ls)) * p[0] + mpmath.mpf(ls) / 30 * p[1] for p in parts]
        none_ls = [MP.mpf_to_float(v) for v in lsm]
        mean0 = MP.mpf_to_float(mpmath.fsum([p[0] for p in parts]) / 4)
        sum_ls = MP.mpf_to_float(mpmath.fsum(lsm))
    assert R.cross_entropy(x, t, reduction="none").tolist() == none0
    assert R.cross_entropy(x, t, reduction="mean").item() == mean0
    # row 1 has a -inf logit: with smoothing its loss is +inf (as torch)
    r = R.cross_entropy(x, t, reduction="none", label_smoothing=ls)
    assert r[1].item() == math.inf and r[4].item() == 0.0
    keep = [0, 2, 3]
    assert [r[i].item() for i in keep] == [none_ls[i] for i in keep]
    x2 = x.clone()
    x2[1, 3] = 0.0
    r2 = R.cross_entropy(x2, t, reduction="sum", label_smoothing=ls)
    assert r2.item() > 0 and math.isfinite(r2.item())
    assert R.cross_entropy(x, t, reduction="sum", label_smoothing=ls).item() == math.inf
    del sum_ls
    # all ignored: mean is NaN like torch
    assert math.isnan(R.cross_entropy(x[:1], torch.tensor([-100])).item())


# --------------------------------------------------------------------------- ops vs torch semantics


def _close(got, want, scale, tol=1e-14):
    return bool(((got - want).abs() <= tol * scale).all())


def test_ops_agree_with_torch_float64_semantics():
    g = torch.Generator().manual_seed(31)
    x = torch.randn(4, 6, 50, generator=g) * 2
    for dim in (-1, 1, 0):
        assert _close(R.softmax(x, dim), torch.softmax(x.double(), dim), 1.0)
        assert _close(R.log_softmax(x, dim), torch.log_softmax(x.double(), dim), R.log_softmax(x, dim).abs() + 1)
    # cross entropy: (N, C), (N, C, d), (C,), label smoothing, ignore_index, reductions
    logits = torch.randn(8, 50, generator=g) * 3
    tgt = torch.randint(0, 50, (8,), generator=g)
    tgt[2] = -100
    for red in ("none", "mean", "sum"):
        for ls in (0.0, 0.2):
            got = R.cross_entropy(logits, tgt, red, ls)
            want = F.cross_entropy(logits.double(), tgt, reduction=red, label_smoothing=ls)
            assert got.shape == want.shape and _close(got, want, want.abs() + 1), (red, ls)
    l3 = torch.randn(2, 7, 3, generator=g)
    t3 = torch.randint(0, 7, (2, 3), generator=g)
    assert _close(R.cross_entropy(l3, t3, "none", 0.1), F.cross_entropy(l3.double(), t3, reduction="none", label_smoothing=0.1), 10.0)
    assert _close(R.cross_entropy(l3[0, :, 0], t3[0, 0]), F.cross_entropy(l3[0, :, 0].double(), t3[0, 0]), 10.0)
    # normalisation, multi-dim normalized_shape
    y = torch.randn(3, 4, 32, generator=g) * 5 + 2
    w = torch.randn(4, 32, generator=g)
    bb = torch.randn(4, 32, generator=g)
    assert _close(R.layer_norm(y, (4, 32), w, bb), F.layer_norm(y.double(), (4, 32), w.double(), bb.double()), 10.0)
    assert _close(R.layer_norm(y, 32, eps=1e-3), F.layer_norm(y.double(), (32,), eps=1e-3), 10.0)
    assert _close(R.rms_norm(y, (4, 32), w), F.rms_norm(y.double(), [4, 32], w.double(), 1e-6), 10.0)
    yb = y.bfloat16()
    # torch computes bf16 rms_norm in fp32 and its default eps is fp32's (checked against F.rms_norm on bf16)
    assert _close(R.rms_norm(yb, 32, eps=None), F.rms_norm(yb.double(), [32], eps=torch.finfo(torch.float32).eps), 10.0)
    # activations (torch's tail is only absolutely accurate: scale by |x|)
    z = torch.randn(200, generator=g) * 4
    for ref, tor in ((R.gelu, F.gelu), (lambda t: R.gelu(t, "tanh"), lambda t: F.gelu(t, approximate="tanh")), (R.silu, F.silu)):
        assert _close(ref(z), tor(z.double()), z.double().abs() + 1e-300)
    zz = torch.randn(3, 8, generator=g)
    a, b = zz.double().chunk(2, -1)
    assert _close(R.swiglu(zz), F.silu(a) * b, 10.0)
    assert _close(R.mean_ref(y, dim=1), y.double().mean(1), 10.0)


def test_semantic_mistakes_are_detected():
    """Negative controls: plausible wrong conventions differ from torch far above 1e-14."""
    g = torch.Generator().manual_seed(32)
    y = torch.randn(4, 32, generator=g)
    ref = R.layer_norm(y, 32)
    yd = y.double()
    unbiased = (yd - yd.mean(-1, keepdim=True)) / torch.sqrt(yd.var(-1, unbiased=True, keepdim=True) + 1e-5)
    assert not _close(unbiased, ref, 10.0)
    eps_outside = (yd - yd.mean(-1, keepdim=True)) / (yd.std(-1, unbiased=False, keepdim=True) + 1e-5)
    assert not _close(eps_outside, ref, 10.0)
    logits = torch.randn(6, 20, generator=g)
    t = torch.randint(0, 20, (6,), generator=g)
    good = R.cross_entropy(logits, t, "none", 0.1)
    lsm = torch.log_softmax(logits.double(), -1)
    nll = -lsm.gather(1, t[:, None])[:, 0]
    wrong = (1 - 0.1) * nll - 0.1 / 19 * (lsm.sum(-1) - lsm.gather(1, t[:, None])[:, 0])  # spread over the other classes only
    assert not _close(wrong, good, 10.0)
    right = (1 - 0.1) * nll - 0.1 / 20 * lsm.sum(-1)
    assert _close(right, good, 10.0)


def test_precision_self_consistency_40_vs_80_digits():
    g = torch.Generator().manual_seed(41)
    x = torch.randn(3, 64, generator=g) * 6
    x[0, :4] = -math.inf
    x[1] *= 1000
    w = torch.randn(64, generator=g)
    b = torch.randn(64, generator=g)
    t = torch.randint(0, 64, (3,), generator=g)
    fns = {
        "softmax": lambda d: R.softmax(x, dps=d),
        "log_softmax": lambda d: R.log_softmax(x, dps=d),
        "ce": lambda d: R.cross_entropy(x[1:], t[1:], "none", 0.1, dps=d),
        "layer_norm": lambda d: R.layer_norm(x[1:], 64, w, b, dps=d),
        "rms_norm": lambda d: R.rms_norm(x[1:], 64, w, dps=d),
        "gelu": lambda d: R.gelu(x[1:, :24], dps=d),
        "gelu_tanh": lambda d: R.gelu(x[1:], "tanh", dps=d),
        "silu": lambda d: R.silu(x[1:], dps=d),
        "swiglu": lambda d: R.swiglu(x[1:], dps=d),
    }
    for name, fn in fns.items():
        assert_bits_equal(fn(40), fn(80), name)
    with MP.workdps(80):
        assert_bits_equal(R.softmax(x), fns["softmax"](40), "workdps")


def test_lead_sizes_run_and_match_torch():
    """Sizes the bounds tests use: (64, 1024) softmax, (32, 4096) layer norm."""
    g = torch.Generator().manual_seed(51)
    x = torch.randn(64, 1024, generator=g) * 3
    assert _close(R.softmax(x), torch.softmax(x.double(), -1), 1.0)
    y = (torch.randn(32, 4096, generator=g) * 2 + 1).bfloat16()
    w = torch.randn(4096, generator=g)
    assert _close(R.layer_norm(y, 4096, w), F.layer_norm(y.double(), (4096,), w.double()), 10.0)
