"""tracer.compare.check's per-tensor verdicts: NaN/Inf (the all-finite fast path must not hide them), float32
arithmetic against float64, and the threshold of a tensor no noise sample moved."""
import math

import pytest
import torch

from tracer.compare.judge import check_tensor
from tracer.trace.canonical import Placement
from tracer.trace.schema import Entry, RecordKey

ENTRY = Entry(key="fwd/m.output/mb0/i0", name="m.output", phase="fwd", step=0, microbatch=0, index=0, dtype="float32",
              shape=(64,), placement=Placement(()), meta={"module": "m"}, stats=None)
KEY = RecordKey("fwd", "m.output", 0, 0)


def _verdict(ref: torch.Tensor, cand: torch.Tensor):
    noisy = [ref + 1e-3 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    return check_tensor(0, KEY, ENTRY, ref, cand, [], noisy, 1e-2, {})


def test_finite_tensors_get_a_threshold():
    ref = torch.randn(64, generator=torch.Generator().manual_seed(0))
    row = _verdict(ref, ref.clone())
    assert row.status == "ok" and row.error == 0.0 and row.threshold > 0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_nonfinite_candidate_element_is_flagged(bad):
    ref = torch.randn(64, generator=torch.Generator().manual_seed(0))
    cand = ref.clone()
    cand[5] = bad
    row = _verdict(ref, cand)
    assert row.status == "nonfinite" and "first at index [5]" in row.note


def test_the_same_nonfinite_pattern_in_both_is_compared_on_the_rest():
    ref = torch.randn(64, generator=torch.Generator().manual_seed(0))
    ref[3], ref[9] = math.inf, math.nan
    row = _verdict(ref, ref.clone())
    assert row.status == "ok" and row.error == 0.0
    cand = ref.clone()
    cand[20] += 1.0  # a finite element far off: over threshold
    assert _verdict(ref, cand).status == "over"


def test_float64_values_whose_sum_overflows_are_finite():
    ref = torch.full((4,), 1e308, dtype=torch.float64)
    assert math.isinf(float(ref.sum()))
    row = check_tensor(0, KEY, ENTRY, ref, ref.clone(), [], [ref.clone()] * 4, 1e-2, {})
    assert row.status == "ok"


def test_float32_arithmetic_agrees_with_float64():
    gen = torch.Generator().manual_seed(1)
    ref = torch.randn(4096, generator=gen).bfloat16()
    cand = (ref.float() + 0.01 * torch.randn(4096, generator=gen)).bfloat16()
    noisy = [(ref.float() + 0.01 * torch.randn(4096, generator=gen)).bfloat16() for _ in range(4)]
    fast = check_tensor(0, KEY, ENTRY, ref, cand, [], noisy, 1e-2, {})
    exact = check_tensor(0, KEY, ENTRY, ref, cand, [], noisy, 1e-2, {}, torch.float64)
    assert fast.error == pytest.approx(exact.error, rel=1e-5)
    assert fast.threshold == pytest.approx(exact.threshold, rel=1e-5)
    assert fast.n_eff == pytest.approx(exact.n_eff, rel=1e-4)


def test_a_float32_overflow_falls_back_to_float64():
    ref = torch.tensor([3e38, 1.0, 2.0], dtype=torch.float32)
    cand = ref.clone()
    cand[0] = -3e38  # the difference overflows float32, not float64
    row = check_tensor(0, KEY, ENTRY, ref, cand, [], [ref.clone()] * 4, 1e-2, {})
    assert row.status == "over" and row.error == pytest.approx(6e38, rel=1e-6)


def test_a_tensor_no_sample_moved_gets_two_ulp():
    """Every sample rounded to the reference's value (an fp32 loss): the threshold is 2 ulp, so
    the float64 sum of rounded partial losses 1.125 ulp away passes and 2.5 ulp does not."""
    ref = torch.tensor(2.0638, dtype=torch.float32)
    ulp = 2.0 ** -22  # fp32 spacing in [2, 4)
    noisy = [ref.clone()] * 4
    ok = check_tensor(0, RecordKey("loss", "loss", 1, 0), ENTRY, ref, ref.double() + 1.125 * ulp, [], noisy, 1e-2, {})
    assert ok.status == "ok" and ok.threshold == pytest.approx(2 * ulp) and ok.ratio == pytest.approx(0.5625)
    bad = check_tensor(0, RecordKey("loss", "loss", 1, 0), ENTRY, ref, ref.double() + 2.5 * ulp, [], noisy, 1e-2, {})
    assert bad.status == "over"


def test_few_source_cap_is_lifted_only_before_the_update_of_restarted_samples(tmp_path):
    """tracer.compare.check.samples_restart reads the samples' run.json meta; few_sources keeps the cap
    on every phase of unrestarted samples, of a step with a top-k choice, and on the phases
    after the optimizer update."""
    from tracer.compare.check import few_sources, samples_restart
    from tracer.trace.schema import PRE_UPDATE_PHASES
    from tracer.trace.store import TraceReader, TraceWriter
    for name, meta in (("restarted", {"restarts_each_step": True}), ("plain", None)):
        TraceWriter(tmp_path / name, 0, 1, {}, "sig", run_meta=meta).close()
    restarted, plain = TraceReader(tmp_path / "restarted"), TraceReader(tmp_path / "plain")
    assert samples_restart([restarted, restarted]) and not samples_restart([restarted, plain])
    assert not samples_restart([])
    assert all(not few_sources(p, True, False) and few_sources(p, False, False) for p in PRE_UPDATE_PHASES)
    assert all(few_sources(p, True, True) for p in PRE_UPDATE_PHASES)  # a top-k choice in the step
    assert all(few_sources(p, True, False) for p in ("param", "main_param", "exp_avg", "state"))


def test_without_the_few_source_cap_n_eff_is_the_participation_ratio():
    """Four samples whose squared norms spread widely: the cap (2 mean^2 / var) binds, and
    without it n_eff is the participation ratio; the threshold factor follows F(n, 4n)."""
    from tracer.compare.thresholds import _f_quantile, moments_threshold
    z = [1.0, 1.0, 1.0, 5.0]              # mean 2, var 4: moment estimate 2
    m_sq = 16 * (8.0 / 16) ** 2           # 16 equal elements of m: participation ratio 16
    capped, free = moments_threshold(z, m_sq, 1e-5), moments_threshold(z, m_sq, 1e-5, few_sources=False)
    assert capped.n_eff == pytest.approx(2.0) and free.n_eff == pytest.approx(16.0)
    assert free.factor == pytest.approx(math.sqrt(_f_quantile(1e-5, 16, 64)))
    assert free.threshold < capped.threshold and free.rms_deviation == capped.rms_deviation
