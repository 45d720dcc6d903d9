"""The DTensor/FSDP2 adapter without a process group: placements read from DTensor specs (FSDP2 x TP
strided shards, masked partials), canonical names under activation checkpointing and torch.compile.

The adapter on real FSDP2/HSDP/TP runs (gloo) is tested by tests/test_torchtitan_harness.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tracer.adapters.dtensor import DTensorTracer, _chunk, canonical_module_name, injector_models
from tracer.trace.canonical import Placement, assemble
from tracer.trace.dtensor import _masked, dtensor_placement
from tracer.trace.store import TraceReader, TraceWriter
from ttrace_num.formats import get_format


class _Mesh:
    """A mesh seen from ``coord``: by default 2 x 2 ("dp", "tp"); every dimension of size ``size``."""

    def __init__(self, coord: tuple[int, ...], names: tuple[str, ...] = ("dp", "tp"), size: int = 2) -> None:
        self.coord, self.mesh_dim_names, self._size = coord, names, size

    def size(self, i: int) -> int:
        return self._size

    def get_coordinate(self) -> list[int]:
        return list(self.coord)


def test_strided_shard_of_fsdp2_over_tp_assembles_in_torch_order():
    """torch's own example (_StridedShard's docstring): an 8x8 weight, TP shards rows first, FSDP2
    shards each TP shard: rank (dp, tp) holds rows chunk index 2*tp + dp... as the table says."""
    from torch.distributed.tensor.placement_types import Shard, _StridedShard
    full = torch.arange(64.0).reshape(8, 8)
    shard_index = {(0, 0): 0, (0, 1): 2, (1, 0): 1, (1, 1): 3}  # the docstring's table
    shards, placements = {}, {}
    for coord, k in shard_index.items():
        t = SimpleNamespace(placements=(_StridedShard(0, split_factor=2), Shard(0)), device_mesh=_Mesh(coord),
                            shape=full.shape)
        placements[coord] = Placement.from_dict(dtensor_placement(t))
        shards[coord] = full[2 * k:2 * k + 2]
    assert [d.group for d in placements[(0, 0)].dims] == ["tp", "dp"]  # cut by tp first, then dp
    got, _ = assemble(shards, placements, name="w")
    assert torch.equal(got, full)
    # the same rows under plain Shard(0), Shard(0) (dp first) would be another tensor: the order matters
    plain = {c: Placement.from_dict(dtensor_placement(SimpleNamespace(placements=(Shard(0), Shard(0)),
                                                                       device_mesh=_Mesh(c), shape=full.shape)))
             for c in shard_index}
    assert not torch.equal(assemble(shards, plain, name="w")[0], full)


def test_strided_shard_with_an_inconsistent_split_factor_is_refused():
    from torch.distributed.tensor.placement_types import Shard, _StridedShard
    t = SimpleNamespace(placements=(_StridedShard(0, split_factor=4), Shard(0)), device_mesh=_Mesh((0, 0)),
                        shape=(8, 8))
    with pytest.raises(ValueError, match="split factor"):
        dtensor_placement(t)


def test_masked_partial_is_stored_as_its_summand():
    """A vocabulary-parallel embedding's local result holds garbage rows for ids outside the rank's
    range until the reduction masks them: the stored copy has them zeroed, the original is untouched."""
    local = torch.ones(2, 3, 4)
    mask = torch.tensor([[True, False, False], [False, False, True]])
    pl = SimpleNamespace(mask_buffer=SimpleNamespace(data=mask))
    out = _masked(local, (pl,))
    assert out[0, 0].abs().sum() == 0 and out[1, 2].abs().sum() == 0 and out[0, 1].sum() == 4
    assert local.sum() == 24  # not modified in place
    assert _masked(local, (SimpleNamespace(),)) is local


@pytest.mark.parametrize("n,size", [(5, 4), (8, 2), (7, 3), (1, 4), (128, 2)])
def test_chunk_lengths_are_torch_chunk(n, size):
    expect = [c.numel() for c in torch.empty(n).chunk(size)] + [0] * size
    assert [_chunk(n, size, r) for r in range(size)] == expect[:size]


def test_canonical_names_drop_wrappers():
    assert canonical_module_name("layers.0._checkpoint_wrapped_module.attention.wq") == "layers.0.attention.wq"
    assert canonical_module_name("_orig_mod.layers.1") == "layers.1"
    assert canonical_module_name("module._fsdp_wrapped_module.norm") == "norm"
    assert canonical_module_name("_orig_mod") == ""


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(8)
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.layers:
            x = b(x)
        return self.head(x)


def _trace(model: nn.Module, root, params: nn.Module) -> tuple[set, dict]:
    torch.manual_seed(0)
    opt = torch.optim.AdamW(params.parameters(), lr=1e-2)
    tr = DTensorTracer(model, TraceWriter(root, 0, 1, {"dp": 1}, "net"), optimizer=opt)
    x = torch.randn(2, 3, 8)
    with tr.step(0):
        tr.microbatch(0)
        loss = model(x).square().mean()
        tr.record_loss(loss)
        loss.backward()
        tr.after_backward()
        tr.record_grad_norm(torch.nn.utils.clip_grad_norm_(params.parameters(), 1.0))
        opt.step()
        tr.after_optimizer_step()
    tr.close()
    r = TraceReader(root)
    ents = r.entries(0, 0)
    return {(e.phase, e.name, e.microbatch) for e in ents}, {e.name + "/" + e.phase: r.load(0, 0, e.key) for e in ents}


def test_checkpointed_and_compiled_models_trace_the_eager_names_and_values(tmp_path):
    """Activation checkpointing (checkpoint_wrapper, non-reentrant: forward hooks run again in the
    recompute and are not traced twice) and torch.compile (backend "eager": dynamo around the
    hooks) record exactly the eager model's records, with bitwise equal values."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    torch.manual_seed(1)
    eager = _Net()
    state = {k: v.clone() for k, v in eager.state_dict().items()}
    keys, values = _trace(eager, tmp_path / "eager", eager)
    assert ("grad_local", "layers.0.fc.weight", 0) in keys and ("grad_norm", "grad_norm", 0) in keys
    ckpt = _Net()
    ckpt.load_state_dict(state)
    for i, b in enumerate(list(ckpt.layers)):
        ckpt.layers[i] = checkpoint_wrapper(b)
    k2, v2 = _trace(ckpt, tmp_path / "ckpt", ckpt)
    assert k2 == keys
    assert all(torch.equal(values[n], v2[n]) for n in values)
    comp_inner = _Net()
    comp_inner.load_state_dict(state)
    compiled = torch.compile(comp_inner, backend="eager")
    k3, v3 = _trace(compiled, tmp_path / "compiled", comp_inner)
    assert k3 == keys
    assert all(torch.equal(values[n], v3[n]) for n in values)


def test_injector_models_follow_the_candidate_layout():
    tp2 = injector_models({"mesh": {"dp_shard": 2, "tp": 2}, "dp": 2, "mixed_precision": {"reduce_dtype": "fp32"}},
                          "bf16")
    assert tp2["grad_summation"].split == 2 and tp2["grad_summation"].reduce_fmt == get_format("bf16")
    bf16_reduce = injector_models({"mesh": {"dp_shard": 4}, "dp": 4, "mixed_precision": {"reduce_dtype": "bf16"}},
                                  "bf16")
    assert bf16_reduce["grad_summation"].split == 4


def test_sequence_parallel_needs_a_tp_dimension():
    with pytest.raises(ValueError, match="sequence_parallel=True needs"):
        DTensorTracer(_Net(), None, sequence_parallel=True)


def test_the_documented_integration_is_the_harness_s_and_at_most_ten_lines():
    """docs/tracing-torchtitan.md's trace calls are the ones the harness's training step makes, and the
    step needs at most 10 added lines (issue 32)."""
    import inspect
    import re
    from pathlib import Path

    from examples.torchtitan_cpu.train import Run
    step_src = inspect.getsource(Run.train_step)
    marked = [line for line in step_src.splitlines() if line.rstrip().endswith("# trace")]
    assert 0 < len(marked) <= 10
    doc = (Path(__file__).resolve().parents[1] / "docs" / "tracing-torchtitan.md").read_text()
    calls = lambda text: set(re.findall(r"\btr\.(\w+)\(", text))
    doc_calls = calls("\n".join(line for line in doc.splitlines() if line.rstrip().endswith("# trace")))
    assert doc_calls == calls("\n".join(marked)) and {"step", "microbatch", "after_backward"} <= doc_calls


def test_uneven_fsdp2_shards_with_an_empty_rank_are_stored_and_assembled(tmp_path):
    """FSDP2 cuts a 5-row weight over 4 ranks with torch.chunk: 2, 2, 1 and 0 rows. Every rank's shard,
    the empty one included, is written, read back and assembled into the full weight."""
    from torch.distributed.tensor.placement_types import Shard
    full = torch.arange(15.0).reshape(5, 3)
    pieces = full.chunk(4) + (full[5:],)  # torch.chunk gives 3 pieces; the 4th rank holds none
    for r in range(4):
        pl = dtensor_placement(SimpleNamespace(placements=(Shard(0),), device_mesh=_Mesh((r,), ("dp_shard",), 4),
                                                shape=full.shape))
        w = TraceWriter(tmp_path, r, 4, {"dp": 4}, "uneven")
        w.add("w", pieces[r].clone(), phase="param", step=0, placement=pl)
        w.flush_step(0)
        w.close()
    reader = TraceReader(tmp_path)
    shards = {r: reader.load(0, r, reader.entries(0, r)[0].key) for r in range(4)}
    assert [tuple(t.shape) for t in shards.values()] == [(2, 3), (2, 3), (1, 3), (0, 3)]
    got, _ = assemble(shards, {r: reader.entries(0, r)[0].placement for r in range(4)}, name="w")
    assert torch.equal(got, full)


def test_a_dtensor_on_a_sub_mesh_is_replicated_over_the_dimensions_it_lacks():
    """FSDP2 shards a norm weight that the TP plan leaves out on the dp mesh alone: every tp rank holds
    a copy. With the run's whole mesh the placement says so (replicated over tp, outermost), so the
    two tp ranks are copies to compare, not two claims of one coordinate."""
    from torch.distributed.tensor.placement_types import Shard
    full = torch.arange(8.0)
    shards, placements = {}, {}
    for dp in (0, 1):
        for tp in (0, 1):
            t = SimpleNamespace(placements=(Shard(0),), device_mesh=_Mesh((dp,), ("dp",)), shape=full.shape)
            placements[(dp, tp)] = Placement.from_dict(dtensor_placement(t, world=_Mesh((dp, tp))))
            shards[(dp, tp)] = full[4 * dp:4 * dp + 4]
    assert [(d.group, d.kind) for d in placements[(1, 1)].dims] == [("tp", "replicated"), ("dp", "contiguous")]
    got, report = assemble(shards, placements, name="norm.weight")
    assert torch.equal(got, full) and report.replicas_agree
    shards[(1, 1)] = shards[(1, 1)] + 1  # one tp rank's copy drifted: reported
    assert not assemble(shards, placements, name="norm.weight")[1].replicas_agree


def test_a_wrapper_that_fully_shard_subclassed_is_still_a_wrapper():
    """fully_shard turns a CheckpointWrapper's class into a subclass named FSDPCheckpointWrapper: still a
    wrapper, not traced (else its records doubled the inner block's: 'layers.0.output_grad call 1')."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper

    from tracer.adapters.dtensor import _is_wrapper
    w = checkpoint_wrapper(_Block())
    w.__class__ = type("FSDPCheckpointWrapper", (type(w),), {})
    assert isinstance(w, CheckpointWrapper) and _is_wrapper(w) and not _is_wrapper(_Block())
