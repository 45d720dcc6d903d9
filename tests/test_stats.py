"""Statistics of traced tensors (tracer/trace/stats.py): one at a time and a step's worth at once."""
import json
import math

import numpy as np
import pytest
import torch

import tracer.trace.stats as stats
from tracer.trace.stats import QUANTILES, STATS_CHUNK, PendingStats, _quantiles, tensor_stats, tensor_stats_many
from tracer.trace.store import TraceReader, TraceWriter


def test_stats_subsample_and_nonfinite():
    x = torch.arange(200_000, dtype=torch.float32)
    x[0], x[1], x[2] = float("nan"), float("inf"), float("-inf")
    s = tensor_stats(x, max_samples=1000)
    assert (s["nan_count"], s["inf_count"], s["finite_count"]) == (1, 2, 199_997)
    assert s["quantile_samples"] == 999 and s["absmax"] == 199_999  # the sample's NaN dropped
    xf = x[3:].double()
    assert s["norm"] == pytest.approx(float(xf.norm()), rel=1e-14)
    assert s["mean"] == pytest.approx(float(xf.mean()), rel=1e-14)
    c = tensor_stats(x, max_samples=1000, chunk=777)  # chunked: same statistics
    assert c["norm"] == pytest.approx(s["norm"], rel=1e-14) and c["mean"] == pytest.approx(s["mean"], rel=1e-14)
    assert {k: c[k] for k in ("nan_count", "inf_count", "absmax", "quantiles")} == \
        {k: s[k] for k in ("nan_count", "inf_count", "absmax", "quantiles")}
    y = x.clone()
    y[150_000] = float("nan")  # non-finite values in a later chunk as well
    for k in (777, STATS_CHUNK):
        t = tensor_stats(y, chunk=k)
        assert (t["nan_count"], t["inf_count"], t["finite_count"]) == (2, 2, 199_996)
        assert t["norm"] == pytest.approx(float(xf.norm().square().sub(150_000.0 ** 2).sqrt()), rel=1e-14)
    big = torch.tensor([1e300, 1e300], dtype=torch.float64)
    assert tensor_stats(big, chunk=1)["norm"] == pytest.approx(2 ** 0.5 * 1e300)  # no overflow across chunks
    assert s["quantiles"]["0.5"] == pytest.approx(100_000, rel=1e-2)
    json.dumps(s, allow_nan=False)  # strict JSON
    s = tensor_stats(torch.full((3,), float("nan")))
    assert s["norm"] is None and s["nan_count"] == 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64,
                                   torch.float8_e4m3fn, torch.int32, torch.bool])
@pytest.mark.parametrize("poison", [None, "nan", "inf"])
def test_chunked_statistics_match_an_exact_reference(dtype, poison):
    """Several chunks (the last one short), every dtype path (widened into the buffer, read in
    place as float64, extremes widened chunk by chunk for FP8/int/bool), and a NaN or an Inf in
    a middle chunk while the largest magnitude sits in another: the statistics of the finite
    elements, against math.fsum over the exact float64 values."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2500, generator=g) * 4).to(dtype) if dtype.is_floating_point else \
        (torch.randint(-50, 50, (2500,), generator=g).to(dtype))
    x[2100] = 100 if dtype != torch.bool else True  # the largest magnitude, in the last chunk
    if poison and dtype.is_floating_point and dtype != torch.float8_e4m3fn:
        x[1200] = float(poison)
    s = tensor_stats(x, chunk=1000)
    v = x.to(torch.float64)
    finite = v[torch.isfinite(v)].tolist()
    assert s["finite_count"] == len(finite) and s["absmax"] == max(map(abs, finite))
    assert s["norm"] == pytest.approx(math.sqrt(math.fsum(f * f for f in finite)), rel=1e-13)
    assert s["mean"] == pytest.approx(math.fsum(finite) / len(finite), rel=1e-12, abs=1e-15)
    one = tensor_stats(x, chunk=len(x))  # one chunk: the same statistics up to rounding
    assert one["norm"] == pytest.approx(s["norm"], rel=1e-14) and one["mean"] == pytest.approx(s["mean"], rel=1e-13)
    assert {k: v for k, v in one.items() if k not in ("norm", "mean")} == \
        {k: v for k, v in s.items() if k not in ("norm", "mean")}
    json.dumps(s, allow_nan=False)


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 1024])
def test_quantiles_are_numpys_linear_interpolation(n):
    s = torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    # the same order statistics and weights; numpy's lerp may round the last bit differently
    assert _quantiles(s, QUANTILES) == pytest.approx(np.quantile(s.numpy(), QUANTILES).tolist(),
                                                              rel=1e-15, abs=1e-300)


def _assorted() -> list[torch.Tensor]:
    """Tensors of every kind a step traces: dtypes, sizes below and above a batch row's and the
    subsample's, repeated sizes (one matrix), NaN/Inf, float64 overflow, empty, complex, large."""
    g = torch.Generator().manual_seed(0)
    out = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        for n in (1, 3, 64, 1000, 1025, 2048, 2048, 5000):
            out.append((torch.randn(n, generator=g) * 3 + 0.5).to(dtype))
    out += [torch.randn(2048, generator=g).to(torch.float8_e4m3fn), torch.arange(-7, 57),
            torch.rand(2048, generator=g) > 0.5, torch.randn(8, 16, 32, generator=g).bfloat16()]
    nan = torch.randn(2048, generator=g)
    nan[[3, 700]] = torch.tensor([float("nan"), float("inf")])
    out += [nan, torch.full((64,), float("-inf")), torch.tensor([1e200, -1e200], dtype=torch.float64),
            torch.empty(0), torch.randn(16, dtype=torch.complex64, generator=g),
            torch.randn(STATS_CHUNK + 5, generator=g).bfloat16()]
    return out


def test_many_is_one_at_a_time():
    """Counts, absmax and quantiles identical; norm and mean to float64 rounding (one row sum
    against a dot product and a sum of the same float64 values)."""
    ts = _assorted()
    for one, many in zip(map(tensor_stats, ts), tensor_stats_many(ts), strict=True):
        exact = {k: one[k] for k in one if k not in ("norm", "mean")}
        assert {k: many[k] for k in exact} == exact
        for k in ("norm", "mean"):
            assert (many[k] is None) == (one[k] is None)
            if one[k] is not None:
                assert many[k] == pytest.approx(one[k], rel=1e-13, abs=1e-300)
        json.dumps(many, allow_nan=False)


def test_many_splits_a_size_into_matrices_of_bounded_size(monkeypatch):
    ts = [torch.randn(100, generator=torch.Generator().manual_seed(i)) for i in range(25)]
    whole = tensor_stats_many(ts)
    monkeypatch.setattr(stats, "BATCH_ELEMENTS", 300)  # 3 rows per matrix: 9 matrices
    assert tensor_stats_many(ts) == whole
    assert [s["norm"] for s in whole] == pytest.approx([float(t.double().norm()) for t in ts], rel=1e-14)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.complex64])
@pytest.mark.parametrize("poison", [None, "nan", "inf"])
def test_pending_statistics_are_tensor_stats(dtype, poison):
    """PendingStats against tensor_stats and an exact reference: the same extremes, counts and
    subsample quantiles; the norm and mean within float64 rounding; with a NaN or an Inf the
    counts, the finite subsample's quantiles, and no norm, absmax or mean (class doc)."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(3001, generator=g, dtype=torch.float64) * 4).to(dtype)
    x[2100] = 100
    if poison:
        x[1200] = float(poison)
        x[1500] = float(poison)  # both on the stride-3 subsample
    got, want = PendingStats(x).resolve(), tensor_stats(x)
    unchanged = ("numel", "finite_count", "nan_count", "inf_count", "quantiles", "quantile_samples")
    assert {k: got[k] for k in unchanged} == {k: want[k] for k in unchanged}
    assert got["nan_count"] == 2 * (poison == "nan") and got["inf_count"] == 2 * (poison == "inf")
    if poison:
        assert got["norm"] is got["absmax"] is got["mean"] is None
        assert got["quantile_samples"] == 999  # 1001 strided samples, less the two poisoned ones
    else:
        v = torch.view_as_real(x).reshape(-1).tolist() if x.is_complex() else x.double().tolist()
        assert got["absmax"] == want["absmax"] == 100
        assert got["norm"] == pytest.approx(math.sqrt(math.fsum(f * f for f in v)), rel=1e-13)
        assert got["mean"] == pytest.approx(math.fsum(v) / len(v), rel=1e-12, abs=1e-15)
    json.dumps(got, allow_nan=False)


@pytest.mark.parametrize("bad", [torch.zeros(0), torch.ones(10, dtype=torch.int32), torch.ones(10).to(torch.float8_e4m3fn)])
def test_pending_statistics_refuse_what_torch_cannot_reduce(bad):
    assert not PendingStats.takes(bad)
    with pytest.raises(ValueError, match="use tensor_stats"):
        PendingStats(bad)


def test_staged_stats_mode_keeps_no_copy_of_a_large_tensor(tmp_path):
    """A staged stats-only writer (an accelerator's path, forced here) holds, per large tensor,
    the reductions and a subsample of MAX_STAT_SAMPLES values, not a copy; an FP8 tensor, which
    torch cannot reduce, is reduced at once; the statistics are those of the tensor as added."""
    big = torch.randn(4 * STATS_CHUNK, generator=torch.Generator().manual_seed(3))
    fp8 = big.to(torch.float8_e4m3fn)
    with TraceWriter(tmp_path, 0, 1, {"tp": 1}, "sig", mode="stats", stage=True) as w:
        w.add("big", big, phase="fwd", step=0)
        w.add("fp8", fp8, phase="fwd", step=0)
        want = tensor_stats(big)
        big.mul_(3)  # after the hook: must not show
        held = [b.stats_of for b in w._pending[0].values()]
        assert isinstance(held[0], PendingStats) and held[1] is None
        kept = [getattr(held[0], slot) for slot in PendingStats.__slots__]  # the event: None on the CPU
        assert sum(t.numel() for t in kept if isinstance(t, torch.Tensor)) <= stats.MAX_STAT_SAMPLES + 6
    got = {e.name: e.stats for e in TraceReader(tmp_path).entries(0, 0)}
    assert got["big"]["norm"] == pytest.approx(want["norm"], rel=1e-13) and got["big"]["absmax"] == want["absmax"]
    assert got["fp8"] == tensor_stats(fp8)


def test_stats_mode_takes_a_tensor_as_it_was_when_added(tmp_path):
    """Statistics are taken at the flush: a small tensor changed in place afterwards (a gradient
    accumulated into, an activation reused) must not change them."""
    small, large = torch.ones(64), torch.ones(STATS_CHUNK)
    with TraceWriter(tmp_path, 0, 1, {"tp": 1}, "sig", mode="stats") as w:
        w.add("small", small, phase="grad", step=0)
        w.add("large", large, phase="grad", step=0)
        small.mul_(3), large.mul_(3)
        w.flush_step(0)
    got = {e.name: e.stats for e in TraceReader(tmp_path).entries(0, 0)}
    assert got["small"]["norm"] == pytest.approx(8.0) and got["small"]["mean"] == 1.0
    assert got["large"]["mean"] == 1.0
