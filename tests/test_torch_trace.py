"""Traced comparison of a plain PyTorch DDP run (examples/torch_ddp.py, tracer/adapters/ddp.py).

Two gloo launches for the whole module: world 1 traces the single-device references (fp32
and bf16, 3 steps, 3 noise samples each), world 2 traces the DDP candidates (fp32, bf16)
and the injected bug (bf16: rank 1 keeps its local gradient of one parameter). Clean
candidates must be reported consistent (0 tensors over threshold); the bug must be found at
step 0, phase grad, on that parameter, as disagreeing DP replicas. The training step the
example runs is the documented integration (docs/tracing-pytorch.md).
"""
from __future__ import annotations

import inspect
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from examples import torch_ddp as ex
from examples.gloo import run_gloo
from tracer.trace.canonical import Placement, assemble, shard
from tracer.compare.check import compare
from tracer.adapters.ddp import ddp_placement
from tracer.trace.dtensor import dtensor_placement
from tracer.trace.store import TraceReader

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
DTYPES = ("fp32", "bf16")


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("torch_ddp_traces")
    refs = [{"root": str(root / f"ref_{d}"), "dtype": d, "steps": STEPS} for d in DTYPES]
    cands = [{"root": str(root / f"ddp_{d}"), "dtype": d, "steps": STEPS} for d in DTYPES]
    cands.append({"root": str(root / "bug_bf16"), "dtype": "bf16", "steps": STEPS, "bug": True})
    t0 = time.perf_counter()
    run_gloo(ex.reference_worker, 1, refs)
    t1 = time.perf_counter()
    run_gloo(ex.candidate_worker, ex.DP, cands)
    print(f"\ntraced references in {t1 - t0:.0f} s, DDP candidates in {time.perf_counter() - t1:.0f} s")
    return root


@pytest.mark.parametrize("dtype", DTYPES)
def test_clean_ddp_is_consistent(traces, dtype):
    c = compare(traces / f"ref_{dtype}", traces / f"ddp_{dtype}")
    print(f"\nDDP {dtype}: {len(c.rows)} tensors, max error/threshold {c.max_ratio_ok:.3f}")
    assert not c.unmatched, c.unmatched[:5]
    assert {r.step for r in c.rows} == set(range(STEPS))
    assert {r.phase for r in c.rows} == {"fwd", "bwd", "loss", "grad", "param"}
    assert {r.microbatch for r in c.rows if r.phase == "loss"} == set(range(ex.GLOBAL_MICROBATCHES))
    assert c.first is None, (c.first, c.localisation)
    assert c.counts() == {"ok": len(c.rows)}
    # not vacuous: the runs do differ (gradient accumulation order) and the noise moved every grad
    assert any(r.error > 0 for r in c.rows if r.phase == "grad" and r.step == 0)
    assert all(r.threshold > 0 for r in c.rows if r.phase == "grad")


def test_bug_detected_at_expected_tensor(traces):
    c = compare(traces / "ref_bf16", traces / "bug_bf16")
    assert c.first is not None, "skipped all-reduce not detected"
    f = c.first
    print(f"\nbug: first divergence {f.label} ({f.status}); {c.localisation}")
    assert {"step": f.step, "phase": f.phase, "name": f.name, "status": f.status} == ex.EXPECTED_BUG
    assert "replicas over dp differ" in f.note and "reduction over that group is missing" in c.localisation


def test_report_json_and_summary_have_plain_strings(traces, tmp_path):
    """Statuses are str enums (tracer.trace.schema.Status), the report's phase tables are keyed by
    Phase members: the JSON report, the summary and the plot write plain names."""
    import json

    from tracer.report.summary import plot, summary, write_json
    from tracer.trace.schema import Status
    c = compare(traces / "ref_bf16", traces / "bug_bf16")
    assert isinstance(c.first.status, Status)
    text = write_json(c, tmp_path / "r.json").read_text()
    assert "Status" not in text and "Phase" not in text
    d = json.loads(text)
    assert {"ok", "replicas"} <= set(d["counts"]) and all(type(k) is str for k in d["counts"])
    assert (d["first_divergence"]["status"], d["first_divergence"]["phase"]) == (str(c.first.status), str(c.first.phase))
    assert {r["status"] for r in d["tensors"]} == {str(r.status) for r in c.rows}
    assert {r["phase"] for r in d["tensors"]} == {"fwd", "bwd", "loss", "grad", "param"}
    s = summary(c)
    assert "Status" not in s and "Phase" not in s and f"phase {c.first.phase}," in s
    plot(c, tmp_path / "r.png")


def test_candidate_records(traces):
    """Global microbatch numbers, the 1/dp activation-gradient scale, replicated params."""
    r = TraceReader(traces / "ddp_fp32")
    assert r.ranks(0) == [0, 1]
    n = ex.GLOBAL_MICROBATCHES // ex.DP
    for rank in (0, 1):
        ents = r.entries(0, rank)
        assert {e.microbatch for e in ents if e.phase == "fwd"} == set(range(rank * n, (rank + 1) * n))
        bwd = [e for e in ents if e.phase == "bwd"]
        assert bwd and all(e.meta["scaled_by"] == 1 / ex.DP for e in bwd)
        for e in ents:
            if e.phase in ("grad", "param"):
                assert e.placement == Placement.from_dict(ddp_placement(rank, ex.DP))
            else:
                assert not e.placement.dims
    ref = TraceReader(traces / "ref_fp32")
    assert all(not e.placement.dims and "scaled_by" not in e.meta for e in ref.entries(0, 0))


def test_integration_snippet_is_the_tested_code():
    """Every line of the doc's python blocks is a line of the example (which the tests run),
    and the training step adds at most 10 lines to a plain DDP step."""
    src = {line.strip() for line in (ROOT / "examples" / "torch_ddp.py").read_text().splitlines()}
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "tracing-pytorch.md").read_text(), flags=re.DOTALL)
    assert blocks
    for block in blocks:
        for line in block.splitlines():
            if line.strip() and not line.strip().startswith("#"):
                assert line.strip() in src, f"doc line not in examples/torch_ddp.py: {line!r}"
    step_src = inspect.getsource(ex.train_step)
    assert 0 < sum("# trace" in line for line in step_src.splitlines()) <= 10


def test_dtensor_placement_without_a_process_group():
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

    class Mesh:  # a 2 x 2 mesh ("dp", "tp") seen from coordinate (1, 0)
        mesh_dim_names = ("dp", "tp")

        def size(self, i: int) -> int:
            return 2

        def get_coordinate(self) -> list[int]:
            return [1, 0]

    full = torch.arange(24.0).reshape(4, 6)
    t = SimpleNamespace(placements=(Shard(0), Shard(-1)), device_mesh=Mesh(), shape=full.shape)
    pl = Placement.from_dict(dtensor_placement(t))
    assert [(d.dim, d.group, d.rank, d.size, d.kind) for d in pl.dims] == [
        (0, "dp", 1, 2, "contiguous"), (1, "tp", 0, 2, "contiguous")]
    assert pl.full_shape == (4, 6)
    assert torch.equal(shard(full, pl), full[2:4, 0:3])
    # every coordinate's shard reassembles the full tensor
    pls = {}
    for a in (0, 1):
        for b in (0, 1):
            Mesh.get_coordinate = lambda self, a=a, b=b: [a, b]
            pls[2 * a + b] = Placement.from_dict(dtensor_placement(t))
    got, _ = assemble({r: shard(full, p) for r, p in pls.items()}, pls, name="w")
    assert torch.equal(got, full)
    t2 = SimpleNamespace(placements=(Replicate(), Partial()), device_mesh=Mesh(), shape=full.shape)
    assert [d.kind for d in Placement.from_dict(dtensor_placement(t2)).dims] == ["replicated", "partial"]
    with pytest.raises(ValueError, match="only a pending sum"):
        dtensor_placement(SimpleNamespace(placements=(Partial("max"), Replicate()), device_mesh=Mesh(),
                                          shape=full.shape))
