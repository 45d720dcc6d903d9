"""The block-scale statistic (tracer.compare.blockscale): exact coordinates, the shard-scaling
signal it keeps whole, its false-alarm rate under the thresholds' model, and the check
flagging a scaled shard that the norm of the difference misses."""
from __future__ import annotations

import math

import pytest
import torch

import tracer.compare.blockscale as blockscale
from tracer.compare.blockscale import block_grid, block_scales, block_scales_and_norms
from tracer.compare.judge import check_tensor
from tracer.trace.canonical import Placement
from tracer.trace.schema import Entry, RecordKey
from tracer.compare.deviation import block_scale_applies
from tracer.compare.difference import difference_norms
from tracer.compare.thresholds import deviation_threshold


def _exact(ref: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y_b = <x - r, r>_b / ||r||_b, block by block in float64 with explicit index ranges."""
    shape = tuple(ref.shape)
    rows, cols = (shape[0] if shape else 1), (shape[-1] if len(shape) >= 2 else 1)
    r = ref.double().reshape(rows, -1, cols)
    d = x.double().reshape(rows, -1, cols) - r
    b0, b1 = block_grid(shape)
    out = []
    for i in range(b0):
        ri = [k for k in range(rows) if k * b0 // rows == i]
        for j in range(b1):
            cj = [k for k in range(cols) if k * b1 // cols == j]
            rb, db = r[ri][:, :, cj], d[ri][:, :, cj]
            p = float((rb * rb).sum())
            out.append(float((db * rb).sum()) / math.sqrt(p) if p > 0 else 0.0)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("shape", [(37, 5), (3, 7, 9), (8,), (2,), (), (1, 3, 11), (4096, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_coordinates_are_the_exact_projection(shape, dtype, monkeypatch):
    monkeypatch.setattr(blockscale, "_CHUNK", 1000)  # several chunks of rows on the larger shapes
    g = torch.Generator().manual_seed(3)
    ref = torch.randn(shape, generator=g).to(dtype)
    x = (ref.double() + 1e-2 * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)
    if ref.dim() >= 1 and ref.shape[0] >= 4:
        ref[: ref.shape[0] // 4] = 0  # a zero block has coordinate 0
    work = torch.float64 if dtype == torch.float64 else torch.float32
    y = block_scales(ref, x, work)
    assert y.dtype == torch.float64 and y.numel() == math.prod(block_grid(tuple(ref.shape)))
    assert torch.allclose(y, _exact(ref, x), rtol=1e-5, atol=1e-9)
    # the same from the deviation itself
    d = x.to(work) - ref.to(work)
    assert torch.allclose(block_scales(ref.to(work), d, work, deviation=True), y, rtol=1e-6, atol=1e-12)


def test_grid():
    assert block_grid((1024, 64)) == (4, 4)
    assert block_grid((2, 64)) == (2, 4)
    assert block_grid((512, 2, 3)) == (4, 3)
    assert block_grid((10,)) == (4, 1)
    assert block_grid(()) == (1, 1)
    assert not block_scale_applies("fwd", torch.zeros(1, 1))                 # one block: the norm says it all
    assert not block_scale_applies("fwd", torch.zeros(8, dtype=torch.int64))
    assert not block_scale_applies("param", torch.zeros(8, 8, dtype=torch.bfloat16))  # storage-rounding excess
    assert block_scale_applies("param", torch.zeros(8, 8))
    # a 1-D parameter's gradient is a token sum, maybe accumulated with a systematic bias
    for phase in ("grad_local", "grad", "main_grad"):
        assert not block_scale_applies(phase, torch.zeros(64))
        assert block_scale_applies(phase, torch.zeros(64, 64))
    assert block_scale_applies("param", torch.zeros(64)) and block_scale_applies("fwd", torch.zeros(64))


@pytest.mark.parametrize("shape", [(3, 1000), (600, 1, 300), (5000,), (1,)])
def test_one_pass_gives_the_coordinates_and_the_difference_norms(shape):
    """block_scales_and_norms: the coordinates of block_scales and the norms of
    difference_norms from one pass (within float32 summation error), None when a value is
    not finite; chunks of whole rows (600 x 300 spans several)."""
    g = torch.Generator().manual_seed(9)
    ref = torch.randn(shape, generator=g).bfloat16()
    cand = (ref.float() * (1 + 1e-2 * torch.randn(shape, generator=g))).bfloat16()
    y, norms = block_scales_and_norms(ref, cand, torch.float32)
    assert torch.equal(y, block_scales(ref, cand, torch.float32))
    for got, want in zip(norms, difference_norms(ref, cand, torch.float32)):
        assert math.isclose(got, want, rel_tol=1e-5)  # float32 sums of squares in other orders
    cand.view(-1)[0] = math.nan
    assert block_scales_and_norms(ref, cand, torch.float32)[1] is None


@pytest.mark.parametrize("dim", [0, -1])
def test_a_scaled_shard_keeps_its_whole_norm(dim):
    """A TP/SP shard (half of the first or last dimension) scaled by 1 + delta: ||y|| = delta ||r_S||."""
    g = torch.Generator().manual_seed(5)
    ref = torch.randn(64, 3, 32, generator=g, dtype=torch.float64)
    cand = ref.clone()
    shard = cand.narrow(dim, 0, ref.shape[dim] // 2)
    shard.mul_(1.01)
    y = block_scales(ref, cand, torch.float64)
    r_s = ref.narrow(dim, 0, ref.shape[dim] // 2)
    assert float(y.norm()) == pytest.approx(0.01 * float(r_s.norm()), rel=1e-12)


def _runs(g: torch.Generator, n_rows: int = 256, n_cols: int = 64, samples: int = 4, sigma: float = 1e-3):
    ref = torch.randn(n_rows, n_cols, generator=g, dtype=torch.float64)
    noisy = [ref + sigma * torch.randn(ref.shape, generator=g, dtype=torch.float64) for _ in range(samples)]
    cand = ref + sigma * torch.randn(ref.shape, generator=g, dtype=torch.float64)
    return ref, noisy, cand


def test_false_alarm_rate_under_the_model():
    """A correct candidate (same i.i.d. Gaussian deviation as the samples) exceeds the block
    threshold at most at the requested rate and not far below it: 1500 trials at q = 0.05.
    Conservative by ~2x, as the norm statistic is (measured over 4000 trials: 0.0225 and 0.023
    at q = 0.05, 0.002 and 0.003 at q = 0.01): n_eff is the smaller of two estimates from 4 samples."""
    g = torch.Generator().manual_seed(7)
    over = 0
    for _ in range(1500):
        ref, noisy, cand = _runs(g, 64, 16)
        th = deviation_threshold([block_scales(ref, n, torch.float64) for n in noisy], 0.05)
        over += float(block_scales(ref, cand, torch.float64).norm()) > th.threshold
    assert 0.005 <= over / 1500 <= 0.05


def _row(ref, cand, noisy, false_alarm=1e-4, block_scale=True):
    ref_e = Entry(key="fwd/t/mb0/i0", name="t", phase="fwd", step=0, microbatch=0, index=0, dtype="float64",
                  shape=tuple(ref.shape), placement=Placement(()), meta={}, stats=None)
    return check_tensor(0, RecordKey("fwd", "t", 0, 0), ref_e, ref, cand, [], noisy, false_alarm, {}, block_scale=block_scale)


def test_the_check_flags_a_scaled_shard_the_norm_misses():
    g = torch.Generator().manual_seed(9)
    ref, noisy, cand = _runs(g)
    clean = _row(ref, cand, noisy)
    assert clean.status == "ok" and clean.scale_threshold > 0 and clean.scale_error < clean.scale_threshold
    # a corruption 2x the block threshold, which the norm's threshold still admits: it adds in
    # quadrature to a legitimate difference ~6x its size
    r_s = ref[: ref.shape[0] // 2]
    delta = 2 * clean.scale_threshold / float(r_s.norm())
    bad = cand.clone()
    bad[: ref.shape[0] // 2] += delta * r_s
    row = _row(ref, bad, noisy)
    assert row.error < row.threshold          # the norm statistic alone passes it
    assert row.status == "over" and row.by_scale and row.ratio == pytest.approx(
        row.scale_error / row.scale_threshold) and row.ratio > 1.7
    # the same size of corruption without the reference's direction (a random pattern): not seen
    noise = torch.randn(r_s.shape, generator=g, dtype=torch.float64)
    other = cand.clone()
    other[: ref.shape[0] // 2] += noise * (delta * float(r_s.norm()) / float(noise.norm()))
    assert _row(ref, other, noisy).status == "ok"


def test_each_statistic_gets_half_the_false_alarm_probability():
    g = torch.Generator().manual_seed(13)
    ref, noisy, cand = _runs(g)
    row = _row(ref, cand, noisy, 1e-4)
    th = deviation_threshold([n - ref for n in noisy], 0.5e-4)
    assert row.threshold == pytest.approx(th.threshold, rel=1e-12)
    blocks = deviation_threshold([block_scales(ref, n, torch.float64) for n in noisy], 0.5e-4)
    assert row.scale_threshold == pytest.approx(blocks.threshold, rel=1e-12)
    # turned off: the norm statistic alone, at the whole probability
    alone = _row(ref, cand, noisy, 1e-4, block_scale=False)
    assert math.isnan(alone.scale_threshold)
    assert alone.threshold == pytest.approx(deviation_threshold([n - ref for n in noisy], 1e-4).threshold, rel=1e-12)
    # a scalar gets the norm statistic alone, at the whole probability
    one = _row(ref[:1, :1], cand[:1, :1], [n[:1, :1] for n in noisy], 1e-4)
    assert math.isnan(one.scale_threshold)
    assert one.threshold == pytest.approx(deviation_threshold([n[:1, :1] - ref[:1, :1] for n in noisy],
                                                              1e-4).threshold, rel=1e-12)
