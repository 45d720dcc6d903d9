"""Fast unit tests of bench.sensitivity's bisection and peer rules, on synthetic tensors (no megatron)."""
from __future__ import annotations

import math

import pytest
import torch

from bench.sensitivity import (
    DELTA_LO,
    corrupt_shard,
    depth_bound,
    flag_assert_close,
    flag_cosine,
    flag_depth,
    flag_max_abs,
    layer_index,
    peer_flags,
    smallest_delta,
)


def test_smallest_delta_finds_threshold_within_tolerance() -> None:
    calls = []

    def flags(d: float) -> bool:
        calls.append(d)
        return d > 0.0123

    d = smallest_delta(flags, rel_tol=0.01)
    assert 0.0123 < d <= 0.0123 * 1.01
    assert len(calls) < 40


def test_smallest_delta_edges() -> None:
    assert smallest_delta(lambda d: True) == DELTA_LO      # flagged at the lower end: "<= 1e-8"
    assert math.isinf(smallest_delta(lambda d: False))      # never flagged up to 1


def test_corrupt_shard_cast_erases_small_deltas_in_bf16() -> None:
    x = torch.tensor([1.0, 1.5, -3.0], dtype=torch.bfloat16)
    assert torch.equal(corrupt_shard(x, 1e-4), x)           # below half an ulp (2^-9 relative): erased
    assert not torch.equal(corrupt_shard(x, 1e-2), x)
    y = torch.tensor([1.0, 1.5, -3.0], dtype=torch.float32)
    assert corrupt_shard(y, 1e-4).dtype == torch.float32
    assert not torch.equal(corrupt_shard(y, 1e-4), y)


def test_cosine_bisection_matches_closed_form() -> None:
    # two orthogonal shards of equal norm; scaling the first by (1 + d) gives
    # cos = (2 + d) / (sqrt 2 * sqrt((1 + d)^2 + 1))
    ref = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)

    def cand(d: float) -> torch.Tensor:
        return torch.cat([corrupt_shard(ref[:2], d), ref[2:]])

    d = smallest_delta(lambda d: flag_cosine(cand(d), ref), rel_tol=1e-3)
    f = lambda d: (2 + d) / (math.sqrt(2) * math.sqrt((1 + d) ** 2 + 1)) - 0.99
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) > 0 else (lo, mid)
    assert d == pytest.approx(hi, rel=2e-3)


def test_assert_close_uses_dtype_defaults() -> None:
    ref = torch.ones(8, dtype=torch.bfloat16)
    assert not flag_assert_close(ref.clone(), ref)
    assert not flag_assert_close(corrupt_shard(ref, 0.0078), ref)   # one bf16 ulp < rtol 1.6e-2
    assert flag_assert_close(corrupt_shard(ref, 0.05), ref)
    r32 = torch.ones(8)
    assert flag_assert_close(corrupt_shard(r32, 1e-4), r32)         # fp32: rtol 1.3e-6, atol 1e-5


def test_max_abs_and_depth_rules() -> None:
    ref = torch.ones(100, dtype=torch.float64)
    assert not flag_max_abs(ref + 1e-4, ref) and flag_max_abs(ref + 2e-3, ref)
    eps = torch.finfo(torch.bfloat16).eps
    b = depth_bound(1, 2, eps)
    assert b == pytest.approx(4 * 1.03 ** 2 * 2 ** -7)
    assert depth_bound(3, 2, eps) == pytest.approx(4 * eps)
    assert not flag_depth(ref * (1 + 0.9 * b), ref, b) and flag_depth(ref * (1 + 1.1 * b), ref, b)
    flags = peer_flags(ref * 1.5, ref, b)
    assert flags == {"assert_close": True, "cosine": False, "max_abs": True, "depth": True}


def test_layer_index() -> None:
    assert layer_index("decoder.layers.0.mlp.linear_fc1.weight", 2) == 1
    assert layer_index("decoder.layers.1.self_attention.linear_proj.output.0", 2) == 2
    assert layer_index("embedding.word_embeddings.weight", 2) == 0
    assert layer_index("decoder.final_layernorm.weight", 2) == 3


def test_ratio_bounds_and_median() -> None:
    from bench.sensitivity import Result, Target, median_ratio, ratio_bound

    def res(ours: float, peer: float, fp: bool = False) -> Result:
        r = Result("bf16", Target(0, "grad", "x"), 0, "float32", [2], 0.7, 1e-8, 1.0, 0.5, 0.03)
        r.clean = {"ours": False, "cosine": fp}
        r.delta = {"ours": ours, "cosine": peer}
        return r

    assert ratio_bound(res(0.01, 0.1), "cosine") == pytest.approx((10.0, "="))
    assert ratio_bound(res(0.01, math.inf), "cosine") == pytest.approx((100.0, ">="))
    assert ratio_bound(res(0.01, DELTA_LO), "cosine")[1] == "<="
    assert ratio_bound(res(0.01, 0.1, fp=True), "cosine") is None
    med, n, fps = median_ratio([res(0.01, 0.1), res(0.01, 0.3), res(0.01, 0.2, fp=True)], "cosine")
    assert (med, n, fps) == ("20", 2, 1)


def test_coherent_scale_sees_only_the_shard_scaling() -> None:
    from bench.sensitivity import coherent_scale
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(64, 32, generator=g, dtype=torch.float64)
    region = torch.zeros(64, 32, dtype=torch.bool)
    region[:, :16] = True                                   # a column shard
    cand = ref.clone()
    cand[:, :16] *= 1.0 + 3e-3
    assert coherent_scale(cand, ref, region) == pytest.approx(3e-3, rel=1e-9)
    assert coherent_scale(cand, ref, ~region) == 0.0        # the other shard is untouched
    noise = torch.randn(64, 32, generator=g, dtype=torch.float64)
    noise -= (noise * ref).sum() / (ref * ref).sum() * ref   # orthogonal to ref: no scale at all
    assert abs(coherent_scale(ref + 1e-2 * noise, ref, torch.ones_like(region))) < 1e-15
    assert math.isnan(coherent_scale(ref, torch.zeros_like(ref), region))


def test_floor_and_ceiling_table() -> None:
    from bench.sensitivity import Result, Target, ceiling_table
    r = Result("bf16", Target(2, "grad", "x"), 0, "float32", [2], 0.7, 1e-8, 1.0, 0.5, 0.03, legit_scale=0.02)
    r.clean = {m: False for m in ("ours", "assert_close", "cosine", "max_abs", "depth")}
    r.delta = {"ours": 0.2, "assert_close": 0.5, "cosine": 0.3, "max_abs": 0.1, "depth": math.inf}
    assert r.floor == 0.02
    row = ceiling_table([r]).splitlines()[2]
    # ours 0.2/0.02 = 10 (a 10x lead over ours is possible), max_abs 5 (not), depth never flags: 1/0.02
    assert "| 10, 1/1 |" in row and "| 5, 0/1 |" in row and "| 50, 1/1 |" in row
