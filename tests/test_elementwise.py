"""The element statistic (tracer.compare.elementwise): its false-alarm rate under its model, what it
sees that the norm statistic does not, its tail scale, and where the checker applies it."""
from __future__ import annotations

import math
import types

import pytest
import torch

from tracer.compare.check import shared_start_steps
from tracer.compare.elementwise import (element_statistic_applies, element_test, pooled_scale, storage_allowance,
                                       summarize)
from tracer.compare.thresholds import deviation_threshold


def _legit(gen: torch.Generator, rows: int = 40, cols: int = 50) -> torch.Tensor:
    """A legitimate difference: Gaussian, with a row x column (rank-1) variance spread over 100x."""
    r = torch.logspace(-1, 0, rows, dtype=torch.float64)[:, None]
    c = torch.logspace(-1, 0, cols, dtype=torch.float64)[None, :]
    return torch.randn(rows, cols, generator=gen, dtype=torch.float64) * r * c * 1e-3


#: a reference stored in float64: its storage allowance is negligible (2^-52 relative)
REF = torch.ones(40, 50, dtype=torch.float64)
F64 = torch.float64


def _test(e, deviations, ref=REF, stored=F64, q=1e-3):
    """The element statistic of ``e`` against samples given whole (summarised as the checker does)."""
    return element_test(e, [summarize(d, ref, stored) for d in deviations], ref, stored, q)


def _scale(deviations, ref=REF, stored=F64):
    return pooled_scale([summarize(d, ref, stored) for d in deviations]).sqrt()


def test_false_alarm_rate_within_its_claim_under_the_model():
    """Candidate and 4 samples drawn alike: over 400 tensors at q = 0.05 each, at most the claimed
    rate flags (expected <= 20; the statistic is conservative, so far fewer), and the largest
    ratio is not vanishingly small (the threshold is not 1000x loose)."""
    gen = torch.Generator().manual_seed(0)
    ratios = []
    for _ in range(400):
        e = _legit(gen)
        t = _test(e, [_legit(gen) for _ in range(4)], q=0.05)
        ratios.append(t.ratio)
    assert sum(r > 1 for r in ratios) <= 20
    assert 0.3 < max(ratios)


def test_one_wrong_element_the_norm_statistic_misses():
    """One element 20x its own legitimate scale: the element statistic flags it, the norm
    statistic (the whole tensor's norm against the samples') does not."""
    gen = torch.Generator().manual_seed(1)
    samples = [_legit(gen) for _ in range(4)]
    e = _legit(gen)
    w = _scale(samples)
    e[3, 7] += 20 * float(w[3, 7])
    q = 1e-4
    assert _test(e, samples, q=q).ratio > 1
    assert _test(e, samples, q=q).index == 3 * 50 + 7
    assert float(torch.linalg.vector_norm(e)) < deviation_threshold(samples, q).threshold


def test_heavy_tailed_samples_raise_the_tail_scale():
    """Samples whose largest values are far beyond a Gaussian's at the 1/N level (one element
    moved by 100x its row's scale in each) raise sigma in proportion; Gaussian ones keep it near 1
    (the largest of 4 draws, each against a one-sample fit: 1.5 here)."""
    gen = torch.Generator().manual_seed(2)
    gauss = [_legit(gen) for _ in range(4)]
    e = _legit(gen)
    assert _test(e, gauss).tail_scale < 2
    spiky = []
    for s, d in enumerate(gauss):
        d = d.clone()
        d[s, s] = 1e-1
        spiky.append(d)
    assert _test(e, spiky).tail_scale > 5


def test_storage_allowance_keeps_a_one_ulp_difference_legitimate():
    """bf16 values one ulp apart where no sample moved: legitimate (the allowance, twice where no
    sample moved: module doc, "No spread"), and a difference of 3 ulps at one element is flagged
    (nothing else can explain it)."""
    ref = torch.linspace(1, 2, 64, dtype=torch.float64).to(torch.bfloat16).double()
    ulp = storage_allowance(ref, torch.zeros_like(ref), torch.bfloat16)
    assert torch.equal(ulp, torch.where(ref < 2, 2.0 ** -7, 2.0 ** -6).double())
    e = torch.zeros(64, dtype=torch.float64)
    e[::7] = ulp[::7]
    zeros = [torch.zeros(64, dtype=torch.float64) for _ in range(4)]
    assert _test(e, zeros, ref, torch.bfloat16).ratio == 0
    e[10] = 2 * ulp[10]
    assert _test(e, zeros, ref, torch.bfloat16).ratio == 0
    e[10] = 3 * ulp[10]
    assert math.isinf(_test(e, zeros, ref, torch.bfloat16).ratio)
    moved = [torch.full((64,), 1e-3, dtype=torch.float64)] * 4  # with a spread, one allowance: 2 ulps are over
    e[10] = 2 * ulp[10]
    assert _test(e, moved, ref, torch.bfloat16).ratio > 1


def test_the_allowance_is_added_once_not_multiplied_by_the_tail_quantile():
    """Samples moving every element by 0.1 ulp: an element 1 ulp + 3 sample scales off passes, one
    1 ulp + 20 sample scales off (z ~ 5.9 at this size) fails."""
    gen = torch.Generator().manual_seed(3)
    ref = torch.full((32, 32), 1.5, dtype=torch.float64)
    ulp = 2.0 ** -7
    samples = [torch.randn(32, 32, generator=gen, dtype=torch.float64) * 0.1 * ulp for _ in range(4)]
    w = float(_scale(samples, ref, torch.bfloat16)[5, 5])
    e = torch.zeros(32, 32, dtype=torch.float64)
    e[5, 5] = ulp + 3 * w
    assert _test(e, samples, ref, torch.bfloat16).ratio < 1
    e[5, 5] = ulp + 20 * w
    assert _test(e, samples, ref, torch.bfloat16).ratio > 1


def test_a_difference_no_sample_can_explain_is_infinitely_over():
    e = torch.zeros(8, dtype=torch.float64)
    e[2] = 1e-30
    zeros = [torch.zeros(8, dtype=torch.float64) for _ in range(3)]
    ref = torch.zeros(8, dtype=torch.float64)
    assert math.isinf(_test(e, zeros, ref).ratio)
    assert _test(torch.zeros(8, dtype=torch.float64), zeros, ref).ratio == 0


def test_needs_samples():
    with pytest.raises(ValueError, match="summaries of the noise samples"):
        element_test(torch.zeros(3), [], torch.zeros(3), F64, 1e-3)


def test_summary_round_trip():
    """What a sample stored as moments keeps gives the statistic of the sample stored whole."""
    gen = torch.Generator().manual_seed(4)
    devs = [_legit(gen) for _ in range(4)]
    e = _legit(gen)
    flat = [summarize(d, REF, F64).flat() for d in devs]
    from tracer.compare.elementwise import ElementSummary
    back = [ElementSummary.from_flat(f, 40) for f in flat]
    assert element_test(e, back, REF, F64, 1e-3) == _test(e, devs)


def test_a_summary_written_before_the_flip_count_reads_as_one_allowance():
    gen = torch.Generator().manual_seed(4)
    s = summarize(_legit(gen), REF, F64)
    from tracer.compare.elementwise import ElementSummary
    old = torch.cat([s.flat()[:1], s.flat()[2:]])  # [L_s, rho..., kappa...]
    back = ElementSummary.from_flat(old, 40, flips=False)
    assert back.flips == 1 and torch.equal(back.rows, s.rows) and back.largest == s.largest


def _flipped(gen: torch.Generator, ulp: torch.Tensor, ulps: int, fraction: float = 0.01) -> torch.Tensor:
    """Rounding flips: a random ``fraction`` of the elements moved by ``ulps`` ulps, the rest not."""
    mask = torch.rand(ulp.shape, generator=gen, dtype=torch.float64) < fraction
    sign = torch.where(torch.rand(ulp.shape, generator=gen, dtype=torch.float64) < 0.5, -1.0, 1.0)
    return torch.where(mask, sign * ulps * ulp, 0.0)


def test_rounding_flips_of_several_ulps_are_allowed_as_the_samples_show_them():
    """fp32 values whose real change is below an ulp move by whole ulps (module doc, "Rounding
    flips"): samples with sparse 2-ulp flips make an isolated 2-ulp flip of the candidate
    legitimate (the Gaussian model alone calls it ~10 sigma), a 4-ulp move is still flagged; with
    samples that flip by one ulp only, the 2-ulp move is flagged."""
    gen = torch.Generator().manual_seed(5)
    ref = (1 + torch.rand(40, 50, generator=gen, dtype=torch.float64)).float().double()
    ulp = storage_allowance(ref, torch.zeros_like(ref), torch.float32)
    two = [_flipped(gen, ulp, 2) for _ in range(4)]
    assert all(summarize(d, ref, torch.float32).flips == 2 for d in two)
    e = torch.zeros_like(ref)
    e[7, 9] = 2 * ulp[7, 9]
    res = _test(e, two, ref, torch.float32)
    assert res.allowances == 2 and res.ratio == 0
    e[7, 9] = 4 * ulp[7, 9]
    assert _test(e, two, ref, torch.float32).ratio > 1
    one = [_flipped(gen, ulp, 1) for _ in range(4)]
    e[7, 9] = 2 * ulp[7, 9]
    assert _test(e, one, ref, torch.float32).ratio > 1


@pytest.mark.parametrize("phase,shared,discrete,applies", [
    ("fwd", True, False, True), ("bwd", True, False, True), ("grad", True, False, True), ("loss", True, False, True),
    ("param", True, False, False), ("exp_avg", True, False, False),   # after the update: Adam's sign flips
    ("fwd", False, False, False),                                      # a step the runs did not begin alike
    ("fwd", True, True, False),                                        # a top-k choice inside the step
])
def test_where_it_applies(phase, shared, discrete, applies):
    assert element_statistic_applies(phase, shared, discrete) is applies


def _reader(steps: list[int]):
    return types.SimpleNamespace(steps=lambda: steps)


def test_shared_start_steps():
    """Re-synchronised samples: every compared step; otherwise the first step, and only when it is
    the first step of every trace (a comparison of later steps alone began from drifted states)."""
    ref, cand, noise = _reader([0, 1, 2]), _reader([0, 1, 2]), [_reader([0, 1, 2])] * 2
    assert shared_start_steps(ref, cand, noise, [0, 1, 2], restarted=True) == {0, 1, 2}
    assert shared_start_steps(ref, cand, noise, [0, 1, 2], restarted=False) == {0}
    assert shared_start_steps(ref, cand, noise, [1, 2], restarted=False) == set()
    assert shared_start_steps(ref, _reader([1, 2]), noise, [1, 2], restarted=False) == set()
