"""Tests for tracer.trace.canonical: shard -> assemble round trips, replicas, partials, PP renumbering."""
from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tracer.trace.canonical import (
    AssemblyReport,
    Placement,
    ShardDim,
    assemble,
    global_expert_name,
    global_layer_name,
    layer_offset,
    renumber,
    shard,
)


def _all(full: torch.Tensor, levels: list[tuple], full_shape=None):
    """Shard ``full`` for every rank combination; levels = [(dim, group, size, kind), ...]."""
    shards, placements = {}, {}
    for coords in itertools.product(*[range(s) for _, _, s, _ in levels]):
        p = Placement(tuple(ShardDim(d, g, r, s, k) for (d, g, s, k), r in zip(levels, coords)),
                      full_shape=full_shape)
        shards[coords] = shard(full, p)
        placements[coords] = p
    return shards, placements


def _roundtrip(full, levels, **kw):
    shards, placements = _all(full, levels, **kw)
    out, rep = assemble(shards, placements, name="w")
    assert out.dtype == full.dtype
    assert torch.equal(out, full)
    assert rep.replicas_agree and not rep.partial_groups
    return shards, rep


G = torch.Generator().manual_seed(0)


def randn(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=G).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("levels,shape", [
    ([(0, "tp", 4, "contiguous")], (8, 6)),          # column-parallel weight
    ([(1, "tp", 2, "contiguous")], (6, 8)),          # row-parallel weight
    ([(0, "tp", 4, "contiguous")], (50, 6)),         # vocab-parallel, uneven
    ([(0, "sp", 2, "contiguous")], (8, 3, 4)),       # SP sequence (s, b, h)
    ([(1, "cp", 2, "zigzag")], (2, 8, 4)),           # CP zigzag, 2 ranks
    ([(1, "cp", 4, "zigzag")], (2, 16, 4)),          # CP zigzag, 4 ranks
    ([(-1, "tp", 2, "contiguous"), (0, "sp", 2, "contiguous")], (4, 2, 6)),  # TP x SP
    ([(0, "cp", 2, "zigzag"), (2, "tp", 2, "contiguous"), (0, "sp", 2, "contiguous")], (16, 2, 4)),
    ([(0, "ep", 2, "contiguous"), (1, "tp", 2, "contiguous")], (4, 6, 3)),   # experts x TP
])
def test_roundtrip_dim_kinds(levels, shape, dtype):
    full = randn(*shape, dtype=dtype)
    shards, _ = _roundtrip(full, levels, full_shape=shape)
    n = 1
    for _, _, s, _ in levels:
        n *= s
    assert len(shards) == n


def test_zigzag_layout_is_megatron_load_balancing():
    full = torch.arange(16)
    p = [Placement((ShardDim(0, "cp", r, 4, "zigzag"),)) for r in range(4)]
    assert [shard(full, q).tolist() for q in p] == [[0, 1, 14, 15], [2, 3, 12, 13],
                                                    [4, 5, 10, 11], [6, 7, 8, 9]]
    out, _ = assemble({r: shard(full, q) for r, q in enumerate(p)}, dict(enumerate(p)))
    assert torch.equal(out, full)


@pytest.mark.parametrize("dp_outer", [True, False])
def test_replicated_tp_x_dp_and_drift_reported(dp_outer):
    full = randn(6, 4, dtype=torch.float32)
    levels = [(None, "dp", 3, "replicated"), (0, "tp", 2, "contiguous")]
    if not dp_outer:  # compare shard by shard instead of assembled replica by replica
        levels = levels[::-1]
    _, rep = _roundtrip(full, levels)
    assert len(rep.replicas) == (2 if dp_outer else 4) and rep.max_replica_diff == 0.0
    shards, placements = _all(full, levels)
    drifting = (2, 1) if dp_outer else (1, 2)  # dp 2, tp 1
    shards[drifting] = shards[drifting].clone()
    before = float(shards[drifting][0, 0])
    shards[drifting][0, 0] += 0.25
    drift = abs(float(shards[drifting][0, 0]) - before)  # 0.25 up to the fp32 rounding of the sum
    order = list(shards)[::-1]  # insertion order must not matter
    out, rep = assemble({k: shards[k] for k in order}, {k: placements[k] for k in order}, name="w")
    assert torch.equal(out, full)  # first replica kept ...
    bad = [r for r in rep.replicas if not r.equal]  # ... but the drift is reported
    assert len(bad) == 1 and drifting in bad[0].other and bad[0].group == "dp"
    if dp_outer:
        assert bad[0].reference == ((0, 0), (0, 1)) and bad[0].other == ((2, 0), (2, 1))
    else:
        assert bad[0].reference == ((1, 0),) and bad[0].other == ((1, 2),)
    assert bad[0].max_abs_diff == drift and rep.max_replica_diff == drift and not rep.replicas_agree
    assert abs(drift - 0.25) <= 2 ** -24 * (abs(before) + 0.25)


def test_replica_nan_handling():
    a = torch.tensor([1.0, float("nan")])
    p = {r: Placement((ShardDim(None, "dp", r, 2, "replicated"),)) for r in range(2)}
    _, rep = assemble({0: a, 1: a.clone()}, p)
    assert rep.replicas_agree
    _, rep = assemble({0: a, 1: torch.tensor([1.0, 2.0])}, p)
    assert not rep.replicas_agree and rep.max_replica_diff == float("inf")
    inf = float("inf")
    _, rep = assemble({0: torch.tensor([inf, 1.0]), 1: torch.tensor([inf, 1.5])}, p)
    assert rep.max_replica_diff == 0.5  # equal infinities do not count as a difference
    _, rep = assemble({0: torch.tensor([inf]), 1: torch.tensor([torch.finfo(torch.float32).max])}, p)
    assert not rep.replicas_agree and rep.max_replica_diff == inf


def test_partial_sum_float64_exact():
    g = torch.Generator().manual_seed(1)
    parts = [torch.randint(-100, 100, (5, 7), generator=g).to(torch.bfloat16) for _ in range(4)]
    exact = sum(p.to(torch.float64) for p in parts)
    pl = {r: Placement((ShardDim(None, "tp", r, 4, "partial"),)) for r in range(4)}
    out, rep = assemble(dict(enumerate(parts)), pl, name="fc2.out")
    assert out.dtype == torch.float64 and torch.equal(out, exact)
    assert rep.partial_groups == ["tp"] and rep.original_dtype == torch.bfloat16
    assert torch.equal(rep.full_original_dtype, exact.to(torch.bfloat16))


def test_partial_roundtrip_and_composition_with_sp():
    # row-parallel output before reduce-scatter: partial over tp, then sequence-sharded over sp
    full = torch.randint(-8, 8, (8, 3)).to(torch.float32)
    shards, placements = _all(full, [(0, "sp", 2, "contiguous"), (None, "tp", 2, "partial")])
    out, rep = assemble(shards, placements)
    assert out.dtype == torch.float64 and torch.equal(out, full.double())
    assert rep.partial_groups == ["tp"]


@pytest.mark.parametrize("bounds", [[0, 7, 7, 20, 24], [0, 1, 23, 24, 24]])
def test_flat_shard_uneven_ranges_with_tp(bounds):
    # distributed optimizer over dp=4 on a TP-local (3, 8) slice of a (6, 8) parameter;
    # a rank with an empty range may also be absent
    full = randn(6, 8, dtype=torch.float32)
    shards, placements = {}, {}
    for tp in range(2):
        for dp in range(4):
            s, e = bounds[dp], bounds[dp + 1]
            p = Placement((ShardDim(0, "tp", tp, 2), ShardDim(None, "dp", dp, 4, "flat_shard", s, e, (3, 8))))
            if e > s:
                shards[(tp, dp)], placements[(tp, dp)] = shard(full, p), p
    out, _ = assemble(shards, placements)
    assert torch.equal(out, full)


def test_placement_json_roundtrip():
    p = Placement((ShardDim(0, "tp", 1, 2), ShardDim(1, "cp", 0, 2, "zigzag"),
                   ShardDim(None, "dp", 3, 4, "replicated"),
                   ShardDim(None, "dp", 1, 4, "flat_shard", 5, 9, (3, 4))), full_shape=(4, 8),
                  valid_shape=(None, 7))
    d = json.loads(json.dumps(p.to_dict()))
    assert Placement.from_dict(d) == p
    # assemble accepts the stored dicts directly
    full = torch.arange(12.0).reshape(3, 4)
    pls = {r: Placement((ShardDim(0, "tp", r, 3),)).to_dict() for r in range(3)}
    out, _ = assemble({r: shard(full, Placement.from_dict(pls[r])) for r in range(3)}, pls)
    assert torch.equal(out, full)


def test_vocab_padding_cropped():
    # vocab 50 padded to 64 for TP=4 (Megatron pads to a multiple of divisible_by * tp)
    logits = randn(3, 50, dtype=torch.float32)
    pls = {r: Placement((ShardDim(1, "tp", r, 4),), full_shape=(3, 64), valid_shape=(None, 50))
           for r in range(4)}
    shards = {r: shard(logits, p) for r, p in pls.items()}
    assert all(t.shape == (3, 16) for t in shards.values()) and not shards[3][:, 2:].any()
    out, _ = assemble(shards, {r: p.to_dict() for r, p in pls.items()}, name="logits")
    assert torch.equal(out, logits)
    with pytest.raises(ValueError, match="must lie within full_shape"):
        Placement(valid_shape=(3, 50))


# ----------------------------------------------------------------------------- errors

def test_error_missing_rank():
    full = torch.arange(24.0).reshape(4, 6)
    shards, pl = _all(full, [(0, "tp", 2, "contiguous"), (1, "sp", 3, "contiguous")])
    del shards[(1, 2)], pl[(1, 2)]
    with pytest.raises(ValueError, match=r"decoder.x: missing sp rank\(s\) \[2\] of 3"):
        assemble(shards, pl, name="decoder.x")
    shards, pl = _all(full, [(0, "tp", 2, "contiguous"), (1, "sp", 3, "contiguous")])
    for c in [(1, 0), (1, 1), (1, 2)]:
        del shards[c], pl[c]
    with pytest.raises(ValueError, match=r"missing tp rank\(s\) \[1\] of 2"):
        assemble(shards, pl, name="decoder.x")


def test_error_shape_mismatch_names_rank():
    full = torch.arange(24.0).reshape(4, 6)
    shards, pl = _all(full, [(0, "tp", 2, "contiguous")])
    shards[(1,)] = shards[(1,)][:, :5]
    with pytest.raises(ValueError, match=r"w: rank \(1,\) has shape \(2, 5\), incompatible"):
        assemble(shards, pl, name="w")
    shards, pl = _all(full, [(None, "dp", 2, "replicated")])
    shards[(1,)] = shards[(1,)][:3]
    with pytest.raises(ValueError, match=r"rank \(1,\) has shape \(3, 6\).*replicated group dp"):
        assemble(shards, pl, name="w")
    shards, pl = _all(full, [(0, "tp", 2, "contiguous")], full_shape=(4, 7))
    with pytest.raises(ValueError, match=r"assembled shape \(4, 6\) != declared full shape \(4, 7\)"):
        assemble(shards, pl, name="w")


@pytest.mark.parametrize("bounds,msg", [
    ([(0, 10), (8, 24)], r"overlap over dp: rank 0 ends at 10, rank 1 starts at 8"),
    ([(0, 10), (12, 24)], r"leave a gap \[10, 12\) over dp between rank 0 and rank 1"),
    ([(0, 10), (10, 20)], r"over dp cover \[0, 20\) not \[0, 24\) of shape \(4, 6\)"),
])
def test_error_flat_ranges(bounds, msg):
    full = torch.arange(24.0).reshape(4, 6)
    shards, pl = {}, {}
    for r, (s, e) in enumerate(bounds):
        pl[r] = Placement((ShardDim(None, "dp", r, 2, "flat_shard", s, e, (4, 6)),))
        shards[r] = full.reshape(-1)[s:e]
    with pytest.raises(ValueError, match="p.w: flat_shard ranges " + msg):
        assemble(shards, pl, name="p.w")


def test_error_layout_disagreement_and_duplicates_and_bad_specs():
    full = torch.arange(8.0)
    pl = {0: Placement((ShardDim(0, "tp", 0, 2),)), 1: Placement((ShardDim(0, "cp", 1, 2),))}
    with pytest.raises(ValueError, match="w: rank 1's placement .* disagrees with rank 0's"):
        assemble({0: full[:4], 1: full[4:]}, pl, name="w")
    pl = {0: Placement((ShardDim(0, "tp", 0, 2),)), 5: Placement((ShardDim(0, "tp", 0, 2),))}
    with pytest.raises(ValueError, match="ranks 0 and 5 have the same placement"):
        assemble({0: full[:4], 5: full[:4]}, pl, name="w")
    with pytest.raises(ValueError, match="different ranks"):
        assemble({0: full}, {1: Placement()}, name="w")
    with pytest.raises(ValueError, match="not a shard-dim dict"):
        Placement.from_dict({"dims": [{"dim": 0, "rank": 0, "size": 2}]})
    with pytest.raises(ValueError, match="rank < size"):
        ShardDim(0, "tp", 2, 2)
    with pytest.raises(ValueError, match="unknown shard kind"):
        ShardDim(0, "tp", 0, 2, "striped")
    with pytest.raises(ValueError, match="needs start, end and shape"):
        ShardDim(None, "dp", 0, 2, "flat_shard")
    with pytest.raises(ValueError, match=r"ranks hold different dtypes .*'1': 'torch.float64'"):
        assemble({0: full[:4], 1: full[4:].double()},
                 {r: Placement((ShardDim(0, "tp", r, 2),)) for r in range(2)}, name="w")
    with pytest.raises(ValueError, match="rank 0's 1-d tensor has no dim 1"):
        assemble({0: full[:4], 1: full[4:]}, {r: Placement((ShardDim(1, "tp", r, 2),)) for r in range(2)})
    with pytest.raises(ValueError, match="odd length 3 on zigzag"):
        assemble({r: full[:3] for r in range(2)},
                 {r: Placement((ShardDim(0, "cp", r, 2, "zigzag"),)) for r in range(2)})


def test_report_type():
    _, rep = assemble({0: torch.ones(2)}, {0: Placement()})
    assert isinstance(rep, AssemblyReport) and rep.replicas == [] and rep.full_original_dtype is None


# ----------------------------------------------------------------------------- pipeline

def test_layer_renumbering_pp2_pp4():
    name = "module.decoder.layers.0.mlp.linear_fc1.weight"
    assert global_layer_name(name, 1, 4) == "module.decoder.layers.4.mlp.linear_fc1.weight"
    assert [global_layer_name("decoder.layers.1.self_attention", r, 2) for r in range(4)] == \
        [f"decoder.layers.{1 + 2 * r}.self_attention" for r in range(4)]
    assert global_layer_name("embedding.word_embeddings.weight", 1, 4) == "embedding.word_embeddings.weight"
    assert global_layer_name("decoder.layers.3", 1, 4) == "decoder.layers.7"


def test_layer_renumbering_vpp2():
    # 8 layers, pp=2, vpp=2: chunk 0 of stage 0 -> 0,1; stage 1 -> 2,3; chunk 1 -> 4,5 / 6,7
    got = {(c, r): global_layer_name("decoder.layers.1.mlp", r, 4, c, pp_size=2, vpp_size=2)
           for c in range(2) for r in range(2)}
    assert got == {(0, 0): "decoder.layers.1.mlp", (0, 1): "decoder.layers.3.mlp",
                   (1, 0): "decoder.layers.5.mlp", (1, 1): "decoder.layers.7.mlp"}
    # every global layer appears exactly once (pp=4, vpp=2, 16 layers)
    names = [global_layer_name(f"decoder.layers.{i}", r, 4, c, pp_size=4, vpp_size=2)
             for r in range(4) for c in range(2) for i in range(2)]
    assert sorted(names, key=lambda n: int(n.split(".")[-1])) == [f"decoder.layers.{i}" for i in range(16)]
    with pytest.raises(ValueError, match="needs pp_size and vpp_size"):
        global_layer_name("decoder.layers.0", 0, 4, 1)


def test_layer_offset_matches_megatron():
    """Cross-check against megatron-core's own get_transformer_layer_offset."""
    pytest.importorskip("megatron.core")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.transformer_layer import (
            get_transformer_layer_offset,
        )
    for pp, vpp, n, first, last in [(2, None, 8, None, None), (4, None, 16, None, None),
                                    (2, 2, 8, None, None), (4, 2, 16, None, None),
                                    (4, None, 14, 2, None), (4, None, 13, 3, 4), (3, 2, 12, 2, 2)]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = TransformerConfig(num_layers=n, hidden_size=8, num_attention_heads=1,
                                    pipeline_model_parallel_size=pp,
                                    virtual_pipeline_model_parallel_size=vpp,
                                    num_layers_in_first_pipeline_stage=first,
                                    num_layers_in_last_pipeline_stage=last, pipeline_dtype=torch.float32)
        for r in range(pp):
            for c in ([None] if vpp is None else range(vpp)):
                assert layer_offset(r, pp, n, c, vpp, num_layers_in_first_stage=first,
                                    num_layers_in_last_stage=last) == \
                    get_transformer_layer_offset(cfg, vp_stage=c, pp_rank=r), (pp, vpp, n, first, last, r, c)


def test_expert_and_generic_renumbering():
    assert global_expert_name("decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight", 3, 4) == \
        "decoder.layers.2.mlp.experts.local_experts.13.linear_fc1.weight"
    router = "decoder.layers.2.mlp.router.weight"
    assert global_expert_name(router, 3, 4) == router
    assert renumber("layers.2", "layers", 5) == "layers.7"
    assert renumber("a.sublayers.2.b.layers.1", "layers", 5) == "a.sublayers.2.b.layers.6"
    with pytest.raises(ValueError, match="no 'layers.<index>'"):
        renumber("final_layernorm.weight", "layers", 1)


# ----------------------------------------------------------------------------- dims annotations

def test_from_dims_annotation_roundtrip():
    sizes = {"tp": 2, "cp": 2, "dp": 2, "pp": 1}
    full = randn(2, 8, 6, 4, dtype=torch.float32)
    shards, pls = {}, {}
    for tp, cp, dp in itertools.product(range(2), repeat=3):
        p = Placement.from_dims("b s(cp,zigzag) h(tp) d(pp)", {"tp": tp, "cp": cp, "dp": dp, "pp": 0},
                                sizes, replicated=("dp",), full_shape=(2, 8, 6, 4))
        shards[(tp, cp, dp)], pls[(tp, cp, dp)] = shard(full, p), p
    assert pls[(1, 0, 1)].dims == (ShardDim(1, "cp", 0, 2, "zigzag"), ShardDim(2, "tp", 1, 2),
                                   ShardDim(None, "dp", 1, 2, "replicated"))
    out, rep = assemble(shards, pls, name="attn.out")
    assert torch.equal(out, full) and len(rep.replicas) == 4 and rep.replicas_agree


def test_from_dims_partial_and_errors():
    p = Placement.from_dims("s h(tp,partial)", {"tp": 1}, {"tp": 4})
    assert p.dims == (ShardDim(None, "tp", 1, 4, "partial"),)
    with pytest.raises(ValueError, match="group 'cp' has no rank/size"):
        Placement.from_dims("s(cp)", {"tp": 0}, {"tp": 2})
    with pytest.raises(ValueError, match="invalid dims token"):
        Placement.from_dims("s[cp]", {"cp": 0}, {"cp": 2})
    with pytest.raises(ValueError, match="duplicate axis names"):
        Placement.from_dims("s s", {}, {})
    with pytest.raises(ValueError, match="exactly one group"):
        Placement.from_dims("s(cp,tp)", {"cp": 0, "tp": 0}, {"cp": 2, "tp": 2})


# ----------------------------------------------------------------------------- property

@settings(max_examples=60, deadline=None)
@given(st.data())
def test_roundtrip_random_compositions(data):
    ndim = data.draw(st.integers(1, 3))
    nlev = data.draw(st.integers(1, 3))
    kinds = data.draw(st.lists(st.sampled_from(["contiguous", "zigzag", "replicated"]),
                               min_size=nlev, max_size=nlev))
    sizes = data.draw(st.lists(st.integers(1, 3), min_size=nlev, max_size=nlev))
    axes = data.draw(st.lists(st.integers(-ndim, ndim - 1), min_size=nlev, max_size=nlev))
    need = [1] * ndim  # each axis divisible by 2*size of every level that splits it
    for k, s, a in zip(kinds, sizes, axes):
        if k != "replicated":
            need[a % ndim] *= 2 * s
    shape = tuple(n * data.draw(st.integers(1, 2)) for n in need)
    full = torch.randn(shape, generator=G)
    levels = [(None if k == "replicated" else a, f"g{i}", s, k)
              for i, (k, s, a) in enumerate(zip(kinds, sizes, axes))]
    flat = data.draw(st.integers(0, 3))  # distributed-optimizer ranks on the innermost piece
    shards, pls = _all(full, levels)
    if flat:
        local = next(iter(shards.values()))
        cuts = sorted(data.draw(st.lists(st.integers(0, local.numel()), min_size=flat - 1,
                                         max_size=flat - 1)))
        bounds = [0, *cuts, local.numel()]
        shards2, pls2 = {}, {}
        for c, p in pls.items():
            for r in range(flat):
                q = Placement(p.dims + (ShardDim(None, "dp", r, flat, "flat_shard", bounds[r],
                                                 bounds[r + 1], tuple(local.shape)),))
                if bounds[r + 1] > bounds[r]:  # owners of nothing hold no shard
                    shards2[c + (r,)], pls2[c + (r,)] = shard(full, q), q
        shards, pls = shards2, pls2
    out, rep = assemble(shards, pls)
    assert torch.equal(out, full) and rep.replicas_agree


def test_docs_example_runs():
    text = (Path(__file__).resolve().parents[1] / "docs" / "tracing-canonical.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    assert blocks
    ns: dict = {}
    for code in blocks:
        exec(compile(code, "tracing-canonical.md", "exec"), ns)  # noqa: S102 -- the doc example


def test_through_trace_store(tmp_path):
    """Placements survive the store's manifest; assemble reads them back as dicts."""
    from tracer.trace.store import TraceReader, TraceWriter
    full = randn(4, 6, dtype=torch.bfloat16)
    for rank in range(2):
        p = Placement((ShardDim(0, "tp", rank, 2),), full_shape=(4, 6))
        w = TraceWriter(tmp_path, rank, 2, {"tp": 2}, "sig")
        key = w.add("decoder.layers.0.mlp.linear_fc1.weight", shard(full, p), phase="param", step=0,
                    placement=p.to_dict())
        w.flush_step(0)
        w.close()
    r = TraceReader(tmp_path)
    entries = {k: r.entry(0, k, key) for k in range(2)}
    out, _ = assemble({k: r.load(0, k, key) for k in range(2)},
                      {k: e.placement for k, e in entries.items()}, name=entries[0].name)
    assert torch.equal(out, full)
