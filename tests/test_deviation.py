"""Noise samples stored as deviation moments (tracer.compare.deviation) give the thresholds of the whole samples."""
from __future__ import annotations

import math

import pytest
import torch

from tracer.compare.check import compare
from tracer.compare.decisions import TOPK_META
from tracer.trace.schema import Entry
from tracer.compare.deviation import (DEVIATION_FIELD, MOMENT_CHUNK, DeviationOf, MomentAccumulator, MomentWriter,
                              combined_moments, work_dtype)
from tracer.errors import TraceError
from tracer.trace.store import TraceReader, TraceWriter
from tracer.compare.thresholds import deviation_threshold, moments_threshold

LAYOUT = {"tp": 1}
SIG = "toy-model"


def _moments(ref: torch.Tensor, noisy: list[torch.Tensor], phase: str, factor_c: float = 2.0):
    """Moments of ``noisy`` as MomentWriter computes them, combined with ``c`` weighted by ``factor_c``."""
    acc = MomentAccumulator()
    work = work_dtype(ref.dtype)
    dev = DeviationOf(ref.to(work), ref.dtype, phase)
    zqc = [acc.moments(("fwd", "x", 0, 0), dev(n)).tolist() for n in noisy]
    return [z for z, _, _ in zqc], math.fsum(q for _, q, _ in zqc) + factor_c * math.fsum(c for _, _, c in zqc)


@pytest.mark.parametrize("dtype,phase,rows", [(torch.float32, "fwd", 64), (torch.bfloat16, "fwd", 64),
                                               (torch.bfloat16, "param", 64), (torch.float64, "fwd", 4200)])
def test_moments_give_the_threshold_of_the_whole_samples(dtype, phase, rows):
    """z_s and ||m||^2 = sum q + 2 sum c reproduce deviation_threshold; the factor 2 of the cross
    terms is what makes them agree (negative control: 1 gives another n_eff and threshold).
    4200 x 32 elements: the later samples' moments in chunks (MOMENT_CHUNK)."""
    g = torch.Generator().manual_seed(3)
    ref = torch.randn(rows, 32, generator=g).to(dtype)
    # a few dominant elements make n_eff depend on the cross terms
    scale = torch.ones(rows, 32)
    scale[0, :4] = 30.0
    noisy = [(ref.float() + 1e-2 * scale * torch.randn(rows, 32, generator=g)).to(dtype) for _ in range(4)]
    work = work_dtype(dtype)
    dev = DeviationOf(ref.to(work), dtype, phase)
    whole = deviation_threshold([dev(n) for n in noisy])
    z, m_sq = _moments(ref, noisy, phase)
    ours = moments_threshold(z, m_sq)
    assert ours.threshold == pytest.approx(whole.threshold, rel=1e-6)
    assert ours.n_eff == pytest.approx(whole.n_eff, rel=1e-6)
    z, m_sq_wrong = _moments(ref, noisy, phase, factor_c=1.0)
    assert moments_threshold(z, m_sq_wrong).n_eff > 1.2 * whole.n_eff


def test_moments_leave_a_float64_deviation_unchanged():
    d = torch.randn(MOMENT_CHUNK + 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    kept, acc = d.clone(), MomentAccumulator()
    first, later = acc.moments(("fwd", "x", 0, 0), d), acc.moments(("fwd", "x", 0, 0), d)
    assert torch.equal(d, kept)
    z = float(d.square().sum())
    assert first.tolist() == pytest.approx([z, float(d.pow(4).sum()), 0.0], rel=1e-12)
    assert later.tolist() == pytest.approx([z, float(d.pow(4).sum()), float(d.pow(4).sum())], rel=1e-12)


def test_deviation_zeroes_the_reference_non_finite_positions():
    ref = torch.tensor([1.0, float("inf"), 2.0, float("nan")])
    noisy = torch.tensor([1.5, float("inf"), 2.0, float("nan")])
    assert DeviationOf(ref, ref.dtype, "fwd")(noisy).tolist() == [0.5, 0.0, 0.0, 0.0]


# ------------------------------------------------------------------ traces
def _trace(root, tensors: dict[str, torch.Tensor], writer=None, meta=None):
    w = writer or TraceWriter(root, 0, 1, LAYOUT, SIG)
    for name, t in tensors.items():
        w.add(name, t, phase="fwd", step=0, meta=(meta or {}).get(name))
    w.flush_step(0)
    return w


def _runs(tmp_path, store: str, samples: int = 4, meta=None):
    """A reference (with ``samples`` noise samples stored as ``store``) and a candidate."""
    g = torch.Generator().manual_seed(11)
    ref = {"a": torch.randn(32, 16, generator=g), "b": torch.randn(8, generator=g).to(torch.bfloat16),
           "idx": torch.arange(6)}
    root = tmp_path / store / "ref"
    _trace(root, ref)
    acc = MomentAccumulator()
    for i in range(samples):
        noisy = {k: (v + 1e-3 * torch.randn(v.shape, generator=g).to(v.dtype)) if v.is_floating_point() else v
                 for k, v in ref.items()}
        sroot = root / "noise" / f"sample_{i}"
        w = (MomentWriter(sroot, root, i, acc, LAYOUT, SIG) if store == "moments"
             else TraceWriter(sroot, 0, 1, LAYOUT, SIG))
        _trace(sroot, noisy, w, meta)
    cand = {k: (v + 5e-4 * torch.randn(v.shape, generator=g).to(v.dtype)) if v.is_floating_point() else v
            for k, v in ref.items()}
    _trace(tmp_path / store / "cand", cand)
    return root, tmp_path / store / "cand"


def test_compare_reads_moments_as_it_reads_whole_samples(tmp_path):
    rows = {}
    for store in ("moments", "tensors"):
        ref, cand = _runs(tmp_path, store)
        rows[store] = {r.name: r for r in compare(ref, cand).rows}
    assert set(rows["moments"]) == {"a", "b", "idx"}
    for name, whole in rows["tensors"].items():
        mom = rows["moments"][name]
        assert mom.status == whole.status
        assert mom.threshold == pytest.approx(whole.threshold, rel=1e-6, abs=0.0)
        assert mom.scale_threshold == pytest.approx(whole.scale_threshold, rel=1e-6, abs=0.0, nan_ok=True)
        # the element statistic (step 0 of traces that all begin there): from the summaries alike
        assert mom.element_ratio == pytest.approx(whole.element_ratio, rel=1e-9, abs=0.0, nan_ok=True)
    assert rows["moments"]["a"].scale_threshold > 0 and rows["moments"]["b"].scale_threshold > 0
    assert rows["moments"]["a"].element_ratio > 0 and rows["moments"]["b"].element_ratio >= 0
    # turned off, also when the samples stored their block coordinates: the norm alone
    off = {r.name: r for r in compare(tmp_path / "moments" / "ref", tmp_path / "moments" / "cand",
                                      block_scale=False).rows}
    assert math.isnan(off["a"].scale_threshold) and math.isnan(off["a"].scale_error)
    assert off["a"].ratio == off["a"].error / off["a"].threshold
    # what the moments trace holds: 3 moments, the block coordinates (4 x 4 blocks of [32, 16], 4 of
    # [8]) and the element summary (L, then row and column sums of d^2: 1 + 32 + 16, 1 + 1 + 8) in
    # float64 per floating tensor, integers whole
    sample = TraceReader(tmp_path / "moments" / "ref" / "noise" / "sample_0")
    by_name = {e.name: e for e in sample.entries(0, 0)}
    assert by_name["a"].extra[DEVIATION_FIELD] == {"dtype": "float32", "shape": [32, 16], "sample": 0, "blocks": 16,
                                                   "element_rows": 32, "element_flips": True}
    # the moments, the block coordinates, then L_s, K_s and the margins
    assert (by_name["a"].dtype, by_name["a"].shape) == ("float64", (3 + 16 + 2 + 32 + 16,))
    assert by_name["b"].shape == (3 + 4 + 2 + 1 + 8,)
    assert DEVIATION_FIELD not in by_name["idx"].extra and by_name["idx"].shape == (6,)


def test_top_k_scores_are_stored_whole(tmp_path):
    ref, _ = _runs(tmp_path, "moments", samples=1, meta={"a": {TOPK_META: {"k": 2, "dim": -1}}})
    e = {e.name: e for e in TraceReader(ref / "noise" / "sample_0").entries(0, 0)}
    assert DEVIATION_FIELD not in e["a"].extra and e["a"].shape == (32, 16)
    assert DEVIATION_FIELD in e["b"].extra


def test_a_subset_of_moment_samples_is_refused(tmp_path):
    ref, cand = _runs(tmp_path, "moments", samples=3)
    with pytest.raises(TraceError, match="whole set 0..S-1"):
        compare(ref, cand, noise=[ref / "noise" / "sample_1", ref / "noise" / "sample_2"])
    compare(ref, cand, noise=[ref / "noise" / "sample_0", ref / "noise" / "sample_1"])  # a prefix is a whole set


def test_mixed_stores_are_refused(tmp_path):
    ref_m, cand = _runs(tmp_path, "moments", samples=2)
    ref_t, _ = _runs(tmp_path, "tensors", samples=2)
    with pytest.raises(TraceError, match="some noise samples store this tensor whole"):
        compare(ref_m, cand, noise=[ref_m / "noise" / "sample_0", ref_t / "noise" / "sample_1"])


def test_moments_of_another_shape_are_refused():
    entry = {"key": "fwd/a/mb0/i0", "name": "a", "phase": "fwd", "step": 0, "microbatch": 0, "index": 0,
             "dtype": "float64", "shape": [3], "placement": {}, "meta": {}, "stats": None}
    e = Entry.from_dict({**entry, DEVIATION_FIELD: {"shape": [5], "dtype": "float32", "sample": 0}})
    ref = Entry.from_dict({**entry, "dtype": "float32", "shape": [4]})
    with pytest.raises(TraceError, match="belong to another run"):
        combined_moments([e], [torch.zeros(3, dtype=torch.float64)], ref, None, 0)


def test_the_writer_needs_a_flushed_full_reference(tmp_path):
    acc = MomentAccumulator()
    ref = tmp_path / "ref"
    TraceWriter(ref, 0, 1, LAYOUT, SIG)  # run.json only: step 0 never flushed
    w = MomentWriter(tmp_path / "s0", ref, 0, acc, LAYOUT, SIG)
    with pytest.raises(TraceError, match="flushed first"):
        w.add("a", torch.ones(3), phase="fwd", step=0)
    stats_ref = tmp_path / "stats_ref"
    _trace(stats_ref, {"a": torch.ones(3)}, TraceWriter(stats_ref, 0, 1, LAYOUT, SIG, mode="stats"))
    w = MomentWriter(tmp_path / "s1", stats_ref, 0, acc, LAYOUT, SIG)
    with pytest.raises(TraceError, match="stats mode"):
        w.add("a", torch.ones(3), phase="fwd", step=0)


def test_a_tensor_the_clean_step_did_not_trace_is_stored_whole(tmp_path):
    acc = MomentAccumulator()
    ref = tmp_path / "ref"
    _trace(ref, {"a": torch.ones(3)})
    w = MomentWriter(tmp_path / "s0", ref, 0, acc, LAYOUT, SIG)
    _trace(tmp_path / "s0", {"a": torch.full((3,), 2.0), "new": torch.ones(2), }, w)
    e = {e.name: e for e in TraceReader(tmp_path / "s0").entries(0, 0)}
    assert DEVIATION_FIELD in e["a"].extra and DEVIATION_FIELD not in e["new"].extra
    # z = q = 3 (d = 1 everywhere), c = 0 (first sample), then one block per element: y_b = d r / |r| = 1,
    # then the element summary: L = (1 - ulp(2)) / 1 (each element against the others' mean square 1), the
    # flip count K = 1 (no element's scale is below its ulp), the one row's sum 3, the columns' sums 1
    values = TraceReader(tmp_path / "s0").load(0, 0, e["a"].key).tolist()
    assert values[:6] == [3.0, 3.0, 0.0, 1.0, 1.0, 1.0]
    assert values[6] == pytest.approx(1 - 2 ** -22, rel=1e-12) and values[7:] == [1.0, 3.0, 1.0, 1.0, 1.0]


# ------------------------------------------------------------------ a real noise sampler
def _train(root, store: str | None, perturb: float = 0.0, steps: int = 2, background: bool = False):
    """A tiny MLP trained with Adam, traced (reference: with 3 noise samples stored as ``store``;
    ``background``: the run's writer writes on its own thread)."""
    from tracer.adapters.ddp import DDPTracer
    from tracer.capture.noise_sampler import NoiseSampler
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    writer = TraceWriter(root, 0, 1, LAYOUT, SIG, background=background)
    tr = DDPTracer(model, writer)
    sampler = None if store is None else NoiseSampler(model, opt, root, layout=LAYOUT, signature=SIG, samples=3,
                                                      store=store, clean_writer=writer if background else None)

    def one_step(step, w=None):
        with tr.step(step, w):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x + perturb), y)
            tr.record_loss(loss)
            loss.backward()
            tr.after_backward()
            opt.step()
            tr.after_optimizer_step()
    for s in range(steps):
        if sampler is None:
            one_step(s)
        else:
            sampler.step(s, lambda w, s=s: one_step(s, w))
    tr.remove()
    writer.close()
    return sampler


def test_a_noise_sampler_times_each_sample(tmp_path):
    sampler = _train(tmp_path / "ref", "moments", steps=2)
    assert len(sampler.sample_seconds) == 2 and all(len(s) == 3 and min(s) > 0 for s in sampler.sample_seconds)


def test_a_noise_sampler_storing_moments_gives_the_thresholds_of_whole_samples(tmp_path):
    """The same reference, its samples stored as moments and whole: the same thresholds and
    verdicts against a candidate (the writer's arithmetic must not run under the injector: it
    would perturb the deviations and shift the noise draws)."""
    for store in ("moments", "tensors"):
        _train(tmp_path / store, store)
    _train(tmp_path / "cand", None, perturb=1e-7)
    rows = {s: compare(tmp_path / s, tmp_path / "cand").rows for s in ("moments", "tensors")}
    assert len(rows["moments"]) == len(rows["tensors"]) > 20
    for a, b in zip(rows["moments"], rows["tensors"]):
        assert (a.step, a.phase, a.name, a.status) == (b.step, b.phase, b.name, b.status)
        assert a.threshold == pytest.approx(b.threshold, rel=1e-5, abs=0.0)
    assert sum(r.threshold > 0 for r in rows["moments"]) > 20


def test_a_background_reference_writer_gives_the_same_thresholds(tmp_path):
    """A reference whose writer writes in the background (the samples wait for each clean step
    through ``clean_writer``) gives the thresholds of one written synchronously, bit for bit."""
    for name, background in (("sync", False), ("bg", True)):
        _train(tmp_path / name, "moments", background=background)
    _train(tmp_path / "cand", None, perturb=1e-7)
    rows = {s: compare(tmp_path / s, tmp_path / "cand").rows for s in ("sync", "bg")}
    assert len(rows["sync"]) == len(rows["bg"]) > 20
    assert [(r.step, r.phase, r.name, r.status, r.threshold) for r in rows["sync"]] == \
        [(r.step, r.phase, r.name, r.status, r.threshold) for r in rows["bg"]]


# ------------------------------------------------------------------ statistics-only candidates
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("work", [torch.float32, torch.float64])
def test_storage_rounding_excess_equals_its_formula_everywhere(dtype, work):
    """The excess evaluated only where ``x != ref`` equals the formula on every
    element, bit for bit: equal values, one-ulp flips (across powers of two too), larger
    differences, sign changes, zeros, subnormals and NaN/Inf of the candidate, on the working
    dtype's values and on the stored ones."""
    from tracer.compare.deviation import storage_rounding_excess
    from ttrace_num.formats import get_format, half_ulp
    fmt = get_format(dtype)
    g = torch.Generator().manual_seed(11)
    n = 1 << 14
    tiny = torch.finfo(dtype).tiny
    ref = torch.cat([torch.randn(n, generator=g) * torch.exp2(torch.randint(-12, 12, (n,), generator=g).float()),
                     torch.exp2(torch.randint(-10, 10, (256,), generator=g).float()),       # powers of two
                     tiny * torch.randint(-8, 8, (256,), generator=g).float() / 8,            # subnormals
                     torch.zeros(64)]).to(dtype)
    up = torch.nextafter(ref, torch.full_like(ref, math.inf))
    down = torch.nextafter(ref, torch.full_like(ref, -math.inf))
    pick = torch.randint(0, 6, ref.shape, generator=g)
    x = torch.where(pick == 0, up, torch.where(pick == 1, down, ref))
    x = torch.where(pick == 2, (ref.float() * (1 + 0.01 * torch.randn(ref.shape, generator=g))).to(dtype), x)
    x = torch.where(pick == 3, -ref, x)
    x = torch.where(pick == 4, torch.nextafter(up, torch.full_like(ref, math.inf)), x)   # two ulps
    x[:3] = torch.tensor([math.nan, math.inf, -math.inf]).to(dtype)
    r, c = ref.to(work), x.to(work)
    want = ((c - r).abs() - 2 * half_ulp(torch.maximum(c.abs(), r.abs()), fmt, work)).clamp_min(0.0)
    got = storage_rounding_excess("param", dtype, r)(c)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    finite = storage_rounding_excess("param", dtype, r[3:])
    assert math.isclose(finite.norm(c[3:]), float(torch.linalg.vector_norm(want[3:])), rel_tol=1e-6)  # the norm alone
    stored = storage_rounding_excess("param", dtype, ref[3:])  # on the stored values, converted where unequal
    assert torch.equal(stored(x[3:]), want[3:].to(stored(x[3:]).dtype))


def test_storage_rounding_allowance_bounds_what_the_excess_removes():
    """||x - ref|| - ||excess(x)|| <= the allowance from norms, on one-ulp flips of bf16 values just
    above powers of two (where it is nearly attained) and on random differences; a factor 1
    instead of 2 is violated (negative control)."""
    from tracer.compare.deviation import storage_rounding_allowance, storage_rounding_excess
    g = torch.Generator().manual_seed(5)
    signs = torch.where(torch.rand(4096, generator=g) < 0.5, -1.0, 1.0)
    ref = (torch.exp2(torch.randint(-20, 20, (4096,), generator=g).float()) * 1.0078125 * signs).to(torch.bfloat16)
    flips = (ref.float().abs() * (1 + 2.0 ** -7)).to(torch.bfloat16) * torch.sign(ref)  # one bf16 ulp up
    for x in (flips, (ref.float() * (1 + 0.05 * torch.randn(4096, generator=g))).to(torch.bfloat16)):
        r32, x32 = ref.float(), x.float()
        removed = float((x32 - r32).norm()) - float(storage_rounding_excess("param", torch.bfloat16, r32)(x32).norm())
        allowance = storage_rounding_allowance("param", torch.bfloat16, float(x32.norm()), float(r32.norm()), 4096)
        assert 0 <= removed <= allowance
    removed_flips = float((flips.float() - ref.float()).norm())
    half = storage_rounding_allowance("param", torch.bfloat16, float(flips.float().norm()), float(ref.float().norm()),
                                      4096) / 2
    assert removed_flips > half  # the factor 2 is needed
    assert storage_rounding_allowance("fwd", torch.bfloat16, 1.0, 1.0, 10) == 0.0
    assert storage_rounding_allowance("param", torch.float32, 1.0, 1.0, 10) == 0.0


def test_a_statistics_only_candidate_is_held_to_the_excess_like_its_threshold(tmp_path):
    """Moments of a bf16 parameter hold storage-rounding excesses (one-ulp flips removed); a
    stats-only candidate whose values are one-ulp flips of the reference (a legitimate
    difference, norm moved by ~2^-8) is within it (without the allowance it was flagged)."""
    g = torch.Generator().manual_seed(2)
    ref = (1.0078125 * torch.ones(256)).to(torch.bfloat16)
    root = tmp_path / "ref"
    w = TraceWriter(root, 0, 1, LAYOUT, SIG)
    w.add("p", ref, phase="param", step=0)
    w.flush_step(0)
    acc = MomentAccumulator()
    for i in range(4):
        noisy = ref.float().clone()
        noisy[torch.randint(0, 256, (3,), generator=g)] += 0.05  # a few elements beyond one ulp
        sw = MomentWriter(root / "noise" / f"sample_{i}", root, i, acc, LAYOUT, SIG)
        sw.add("p", noisy.to(torch.bfloat16), phase="param", step=0)
        sw.flush_step(0)
    cw = TraceWriter(tmp_path / "cand", 0, 1, LAYOUT, SIG, mode="stats")
    cw.add("p", (ref.float() * (1 + 2.0 ** -7)).to(torch.bfloat16), phase="param", step=0)
    cw.flush_step(0)
    row = compare(root, tmp_path / "cand").rows[0]
    assert row.status == "ok", row
