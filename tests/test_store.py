"""tracer.trace.store: round trips, atomic writes, and a clear error for every kind of bad input."""
import errno
import gc
import json
import os

import numpy as np
import pytest
import torch

import tracer.trace.store as store
from tracer.trace.canonical import Placement, ShardDim
from tracer.errors import (CorruptTraceError, IncomparableRunsError, ManifestMismatchError,
                           MissingRankError, TraceError, TraceWriteError)
from tracer.trace.store import TraceReader, _jsonable, TraceWriter, check_comparable, manifest_path, tensor_path

LAYOUT = {"tp": 2, "pp": 1, "dp": 1}
SIG = "gpt-tiny:cfg=abc123"


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 8, generator=g)
    return {
        "fp32": x,
        "bf16": (x * 3).to(torch.bfloat16),
        "fp8": (x * 10).to(torch.float8_e4m3fn),
        "fp64": x.double().t(),  # non-contiguous
        "ids": torch.randint(0, 100, (5,), generator=g),
    }


def _write_run(root, *, world_size=2, steps=(0, 1), mode="full", sig=SIG, run_id="r1", names=None,
               skip=()):
    """One writer per rank; every rank traces `names` at every step (rank-dependent values)."""
    for rank in range(world_size):
        w = TraceWriter(root, rank, world_size, LAYOUT, sig, run_id=run_id, mode=mode)
        for step in steps:
            if (step, rank) in skip:
                continue
            for name, t in _tensors(seed=10 * step + rank).items():
                if names is None or name in names:
                    w.add(f"layer.{name}", t, phase="fwd", step=step,
                          placement=Placement((ShardDim(0, "tp", rank, world_size),)))
            w.flush_step(step)
    return TraceReader(root)


def _bits(t):
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(
        {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def test_full_round_trip_bit_exact(tmp_path):
    r = _write_run(tmp_path)
    assert r.steps() == [0, 1] and r.ranks(1) == [0, 1] and r.world_size == 2
    r.validate()
    for step in (0, 1):
        for rank in (0, 1):
            entries = r.entries(step, rank)
            assert [e.index for e in entries] == list(range(5))
            for e, (name, t) in zip(entries, _tensors(seed=10 * step + rank).items()):
                assert e.name == f"layer.{name}" and e.phase == "fwd" and e.step == step
                assert e.placement == Placement((ShardDim(0, "tp", rank, 2),))
                got = r.load(step, rank, e.key)
                assert got.dtype == t.dtype and got.shape == t.shape
                assert torch.equal(_bits(got), _bits(t))  # bit-exact incl. bf16 and fp8
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["model_signature"] == SIG and run["layout"] == LAYOUT and run["world_size"] == 2
    assert run["schema_version"] == store.SCHEMA_VERSION and "library_version" in run


def test_training_tensor_untouched_and_copied(tmp_path):
    w = TraceWriter(tmp_path, 0, 1, LAYOUT, SIG)
    x = torch.randn(3, requires_grad=True)
    y = x * 2
    before = y.detach().clone()
    key = w.add("y", y, phase="fwd", step=0)
    y.data.add_(1.0)  # the training run goes on modifying its tensor
    w.flush_step(0)
    assert torch.equal(TraceReader(tmp_path).load(0, 0, key), before)


def test_stats_mode_has_no_tensor_file(tmp_path):
    r = _write_run(tmp_path, mode="stats")
    assert not tensor_path(tmp_path, 0, 0).exists()
    r.validate()
    e = r.entries(0, 1)[0]
    x = _tensors(seed=1)["fp32"].double()
    assert e.stats["norm"] == pytest.approx(float(x.norm()), rel=1e-12)
    assert e.stats["absmax"] == pytest.approx(float(x.abs().max()), rel=1e-12)
    assert e.stats["quantiles"]["0.5"] == pytest.approx(float(x.median().item()), abs=0.5)
    with pytest.raises(TraceError, match="stats mode"):
        r.load(0, 1, e.key)


def test_nan_inf_are_findings_not_errors(tmp_path):
    w = TraceWriter(tmp_path, 0, 1, LAYOUT, SIG)
    bad = torch.tensor([1.0, float("nan"), float("inf"), float("nan")], dtype=torch.bfloat16)
    w.add("ok", torch.ones(2), phase="fwd", step=3)
    w.add("attn.out", bad, phase="bwd", step=3, microbatch=1)
    w.add("overflow", torch.tensor([float("-inf"), 2.0]), phase="fwd", step=4)
    w.flush_step(3)
    w.flush_step(4)
    r = TraceReader(tmp_path)
    r.validate()
    f, g = r.findings()
    assert (g.step, g.tensor, g.nan_count, g.inf_count) == (4, "overflow", 0, 1)
    assert (f.step, f.rank, f.tensor, f.phase, f.microbatch, f.index) == (3, 0, "attn.out", "bwd", 1, 1)
    assert (f.nan_count, f.inf_count) == (2, 1)
    assert "2 NaN, 1 Inf" in str(f)
    assert torch.isnan(r.load(3, 0, f.key)).sum() == 2



@pytest.mark.parametrize("mode", ["full", "stats"])
def test_phase_members_write_the_same_bytes_as_their_names(tmp_path, mode):
    """A :class:`~tracer.trace.schema.Phase` member and its name write byte-identical manifests
    and tensor files (the manifest's phase and the tensor keys are plain strings)."""
    from tracer.trace.schema import Phase
    for sub, phases in (("names", ("fwd", "bwd", "grad_norm")), ("members", (Phase.FWD, Phase.BWD, Phase.GRAD_NORM))):
        w = TraceWriter(tmp_path / sub, 0, 1, LAYOUT, SIG, run_id="r1", mode=mode)
        for i, phase in enumerate(phases):
            w.add(f"t{i}", torch.arange(6.0).reshape(2, 3) * (i + 1), phase=phase, step=0, microbatch=i % 2,
                  meta={"call": 0})
        w.flush_step(0)
    m_names, m_members = (manifest_path(tmp_path / sub, 0, 0).read_bytes() for sub in ("names", "members"))
    assert m_members == m_names
    entries = json.loads(m_members)["entries"]
    assert [(e["phase"], e["key"]) for e in entries] == [("fwd", "fwd/t0/mb0/i0"), ("bwd", "bwd/t1/mb1/i1"),
                                                         ("grad_norm", "grad_norm/t2/mb0/i2")]
    assert all(type(e["phase"]) is str for e in entries) and b"Phase" not in m_members
    if mode == "full":
        assert tensor_path(tmp_path / "members", 0, 0).read_bytes() == tensor_path(tmp_path / "names", 0, 0).read_bytes()
    assert TraceReader(tmp_path / "members").entries(0, 0)[2].phase == Phase.GRAD_NORM


def test_duplicate_index_and_reflush_refused(tmp_path):
    w = TraceWriter(tmp_path, 0, 1, LAYOUT, SIG)
    w.add("a", torch.ones(1), phase="fwd", step=0, index=4)
    with pytest.raises(TraceError, match="index 4 is already used by 'a'"):
        w.add("b", torch.ones(1), phase="fwd", step=0, index=4)
    assert w.add("c", torch.ones(1), phase="fwd", step=0).endswith("/i5")
    with pytest.raises(TraceError, match="JSON-serialisable.*tensor c"):
        w.add("c", torch.ones(1), phase="fwd", step=0, meta={"x": object()})
    w.flush_step(0)
    with pytest.raises(TraceError, match="already flushed.*step 0"):
        w.add("d", torch.ones(1), phase="fwd", step=0)


@pytest.mark.parametrize("fail_at", ["save", "replace"])
def test_disk_full_leaves_no_partial_file(tmp_path, monkeypatch, fail_at):
    w = TraceWriter(tmp_path, 1, 2, LAYOUT, SIG)
    w.add("w", torch.randn(64), phase="grad", step=7)

    def enospc(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if fail_at == "save":  # the tensor file's write fails half-way
        real_write = store.write_safetensors

        def write_then_fail(f, tensors, metadata):
            real_write(f, tensors, metadata)
            enospc()
        monkeypatch.setattr(store, "write_safetensors", write_then_fail)
    else:  # the tensor file is renamed in, then the manifest's rename fails
        real = os.replace
        monkeypatch.setattr(os, "replace", lambda s, d: enospc() if str(d).endswith(".json") else real(s, d))
    with pytest.raises(TraceWriteError) as ei:
        w.flush_step(7)
    msg = str(ei.value)
    assert "No space left on device" in msg and "step 7" in msg and "rank 1" in msg
    assert "free disk space" in msg and "mode='stats'" in msg
    assert ei.value.step == 7 and ei.value.path.startswith(str(tmp_path / "step_000007"))
    assert sorted(os.listdir(tmp_path / "step_000007")) == []  # no final file, no temp file
    monkeypatch.undo()
    assert w.pending_steps() == [7]  # nothing lost: retry after freeing space
    w.flush_step(7)
    assert sorted(os.listdir(tmp_path / "step_000007")) == ["rank_00001.json", "rank_00001.safetensors"]


def test_tensor_file_pages_dropped_after_fsync(tmp_path, monkeypatch):
    """The tensor file's pages leave the page cache only once they are on disk (after its
    fsync, on the same file), and a filesystem that refuses the advice fails nothing."""
    calls = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(("fsync", os.fstat(fd).st_ino)), real_fsync(fd)))

    def refused(fd, offset, length, advice):
        calls.append(("fadvise", os.fstat(fd).st_ino, offset, length, advice))
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    monkeypatch.setattr(os, "posix_fadvise", refused, raising=False)
    w = TraceWriter(tmp_path, 0, 1, LAYOUT, SIG)
    x = torch.randn(64)
    key = w.add("w", x, phase="grad", step=0)
    w.flush_step(0)
    ino = os.stat(tensor_path(tmp_path, 0, 0)).st_ino
    advice = [c for c in calls if c[0] == "fadvise"]
    assert advice == [("fadvise", ino, 0, 0, os.POSIX_FADV_DONTNEED)]  # the tensor file only
    assert calls.index(("fsync", ino)) < calls.index(advice[0])
    assert torch.equal(TraceReader(tmp_path).load(0, 0, key), x)


def _trace_of(root, step, rank=0):
    """A flushed step as plain data: its manifest entries and tensors, for comparing writers."""
    r = TraceReader(root)
    entries = r.entries(step, rank)
    return entries, {e.key: r.load(step, rank, e.key) for e in entries}


def test_background_writer_writes_what_a_synchronous_one_does(tmp_path):
    for sub, background in (("sync", False), ("bg", True)):
        with TraceWriter(tmp_path / sub, 0, 1, LAYOUT, SIG, background=background) as w:
            for step in (0, 1, 2):
                for name, t in _tensors(seed=step).items():
                    w.add(name, t, phase="fwd", step=step)
                big = torch.randn(store.STATS_CHUNK + 1, generator=torch.Generator().manual_seed(step))
                w.add("big", big.to(torch.bfloat16), phase="fwd", step=step)  # statistics on the thread
                assert w.flush_step(step) == manifest_path(tmp_path / sub, step, 0)
                with pytest.raises(TraceError, match="already flushed"):  # in flight counts as flushed
                    w.add("late", torch.ones(1), phase="fwd", step=step)
    for step in (0, 1, 2):
        (e_sync, t_sync), (e_bg, t_bg) = _trace_of(tmp_path / "sync", step), _trace_of(tmp_path / "bg", step)
        assert e_sync == e_bg and t_sync.keys() == t_bg.keys()
        assert all(torch.equal(t_sync[k].view(torch.uint8), t_bg[k].view(torch.uint8)) for k in t_sync)


def test_background_writer_error_is_raised_later_and_the_step_kept(tmp_path, monkeypatch):
    w = TraceWriter(tmp_path, 1, 2, LAYOUT, SIG, background=True)
    w.add("w", torch.randn(64), phase="grad", step=7)

    def enospc(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(store, "write_safetensors", enospc)
    w.flush_step(7)  # returns: the write fails on the writing thread
    w.add("w", torch.randn(64), phase="grad", step=8)
    with pytest.raises(TraceWriteError, match="No space left on device.*step 7"):
        w.flush_step(8)  # the error of step 7 comes first; step 8 is not handed over
    assert w.pending_steps() == [7, 8]  # nothing lost
    assert sorted(os.listdir(tmp_path / "step_000007")) == []
    monkeypatch.undo()
    w.close()
    for step in (7, 8):
        assert sorted(os.listdir(tmp_path / f"step_{step:06d}")) == ["rank_00001.json", "rank_00001.safetensors"]
    assert w.pending_steps() == []


def test_background_writer_lands_the_step_in_flight_when_the_run_fails(tmp_path):
    with pytest.raises(RuntimeError, match="training failed"):
        with TraceWriter(tmp_path, 0, 1, LAYOUT, SIG, background=True) as w:
            w.add("x", torch.randn(1 << 16), phase="fwd", step=0)
            w.flush_step(0)
            w.add("x", torch.randn(8), phase="fwd", step=1)  # never flushed: the run failed
            raise RuntimeError("training failed")
    assert TraceReader(tmp_path).steps() == [0]


def test_background_write_error_during_a_failed_run_is_warned_not_raised(tmp_path, monkeypatch):
    def enospc(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(store, "write_safetensors", enospc)
    with pytest.warns(RuntimeWarning, match="rank 0 could not write a step.*No space left"):
        with pytest.raises(RuntimeError, match="training failed"):  # the run's error, not the writer's
            with TraceWriter(tmp_path, 0, 1, LAYOUT, SIG, background=True) as w:
                w.add("x", torch.randn(8), phase="fwd", step=0)
                w.flush_step(0)
                raise RuntimeError("training failed")
    assert w.pending_steps() == [0]  # still buffered


def test_missing_rank(tmp_path):
    r = _write_run(tmp_path, world_size=3, skip={(1, 2)})
    assert r.missing_ranks(1) == [2] and r.missing_ranks(0) == []
    with pytest.raises(MissingRankError, match=r"ranks \[2\] of world size 3.*rank 2, step 1"):
        r.validate()
    with pytest.raises(MissingRankError, match=r"ranks present for this step: \[0, 1\].*rank_00002.json"):
        r.manifest(1, 2)
    r.validate(steps=[0])


def test_truncated_tensor_file(tmp_path):
    r = _write_run(tmp_path, steps=(0,))
    path = tensor_path(tmp_path, 0, 1)
    key = r.entries(0, 1)[0].key
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 10)
    with pytest.raises(CorruptTraceError, match=r"rank 1 step 0 is truncated or corrupt.*re-run the trace "
                       r"or drop this step.*rank_00001.safetensors.*tensor fwd/layer.fp32"):
        r.load(0, 1, key)
    with pytest.raises(CorruptTraceError, match="rank 1 step 0 is truncated or corrupt"):
        r.validate()


def test_corrupt_header_same_size(tmp_path):
    """A damaged header of unchanged size is caught by safetensors' own parsing."""
    r = _write_run(tmp_path, steps=(0,))
    path = tensor_path(tmp_path, 0, 0)
    data = bytearray(path.read_bytes())
    data[8:20] = b"\x00" * 12
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptTraceError, match="rank 0 step 0 is truncated or corrupt"):
        r.verify(0, 0)


@pytest.mark.parametrize("damage", ["truncated", "nan", "not_utf8"])
def test_corrupt_manifest_json(tmp_path, damage):
    _write_run(tmp_path, steps=(0,))
    path = manifest_path(tmp_path, 0, 1)
    text = path.read_bytes()
    if damage == "truncated":
        text = text[:100]
    elif damage == "nan":  # what a non-strict JSON writer would have written for a statistic
        text = text.replace(b'"norm":', b'"norm":NaN,"x":', 1)
    else:
        text = text.replace(b'"entries"', b'"\xff\xfeentries"', 1)
    path.write_bytes(text)
    with pytest.raises(CorruptTraceError, match=r"not valid JSON.*truncated or corrupt.*rank_00001.json, "
                       r"rank 1, step 0"):
        TraceReader(tmp_path).manifest(0, 1)
    assert gc.isenabled()  # the parse pauses the garbage collector, and a failed parse restores it


def test_manifest_parse_leaves_the_garbage_collector_as_it_was(tmp_path):
    _write_run(tmp_path, steps=(0,))
    gc.disable()
    try:
        assert TraceReader(tmp_path).manifest(0, 0)["entries"]
        assert not gc.isenabled()  # a caller's own pause outlives the parse
    finally:
        gc.enable()
    assert TraceReader(tmp_path).manifest(0, 0)["entries"] and gc.isenabled()


def test_manifest_key_mismatch(tmp_path):
    _write_run(tmp_path, steps=(0,))
    path = manifest_path(tmp_path, 0, 0)
    m = json.loads(path.read_text())
    m["entries"][2]["key"] = "fwd/layer.renamed/mb0/i2"
    path.write_text(json.dumps(m))
    r = TraceReader(tmp_path)
    with pytest.raises(ManifestMismatchError, match="manifest lists it but the file lacks it.*tensor "
                       "fwd/layer.fp8/mb0/i2|file holds it but the manifest does not list it.*"
                       "tensor fwd/layer.fp8/mb0/i2"):
        r.verify(0, 0)
    with pytest.raises(ManifestMismatchError, match="file lacks it.*tensor fwd/layer.renamed"):
        r.load(0, 0, "fwd/layer.renamed/mb0/i2")


def test_manifest_from_another_model_in_same_dir(tmp_path):
    _write_run(tmp_path, steps=(0,))
    # a stale rank-1 manifest of another model/layout left in the directory
    w = TraceWriter(tmp_path / "other", 1, 2, {"tp": 1, "pp": 2}, "llama-7b", run_id="r1")
    w.add("x", torch.ones(1), phase="fwd", step=0)
    w.flush_step(0)
    os.replace(manifest_path(tmp_path / "other", 0, 1), manifest_path(tmp_path, 0, 1))
    with pytest.raises(ManifestMismatchError, match="'model_signature' is 'llama-7b'.*another model, "
                       "layout or run.*rank 1, step 0"):
        TraceReader(tmp_path).manifest(0, 1)


def test_signature_mismatch_between_runs(tmp_path):
    ref = _write_run(tmp_path / "ref", world_size=1)
    cand = _write_run(tmp_path / "cand", world_size=2, sig="gpt-tiny:cfg=OTHER")
    with pytest.raises(IncomparableRunsError, match="model signature: reference 'gpt-tiny:cfg=abc123'") as ei:
        check_comparable(ref, cand)
    assert len(ei.value.differences) == 1  # world size / layout may differ


def test_step_and_name_mismatch_between_runs(tmp_path):
    ref = _write_run(tmp_path / "ref", world_size=1, steps=(0, 1, 2))
    cand = _write_run(tmp_path / "cand", world_size=2, steps=(0, 1, 3), names={"fp32", "bf16"})
    with pytest.raises(IncomparableRunsError) as ei:
        check_comparable(ref, cand)
    d = ei.value.differences
    assert d[0] == "steps present: only in reference [2], only in candidate [3]"
    assert d[1].startswith("names present at step 0: only in reference ['fwd:layer.fp64:mb0'")
    with pytest.raises(IncomparableRunsError) as ei:
        check_comparable(ref, cand, require_same_names=False)
    assert len(ei.value.differences) == 1
    same = _write_run(tmp_path / "same", world_size=2, steps=(0, 1, 2))
    check_comparable(ref, same)  # comparable: no exception


def test_no_pickle_in_store():
    import inspect
    src = inspect.getsource(store)
    assert "pickle" not in src.replace("never pickle", "") and "torch.load" not in src


def test_file_swapped_between_ranks_is_caught(tmp_path):
    r = _write_run(tmp_path, steps=(0,), names={"fp32"})
    src, dst = tensor_path(tmp_path, 0, 0), tensor_path(tmp_path, 0, 1)
    assert src.stat().st_size == dst.stat().st_size
    dst.write_bytes(src.read_bytes())
    with pytest.raises(ManifestMismatchError, match="file header says rank 0, step 0.*moved.*rank 1, step 0"):
        r.verify(0, 1)


def test_manifest_lacking_fields_and_missing_run_file(tmp_path):
    _write_run(tmp_path, steps=(0,), mode="stats")
    path = manifest_path(tmp_path, 0, 0)
    m = json.loads(path.read_text())
    del m["entries"][1]["stats"]
    path.write_text(json.dumps(m))
    with pytest.raises(CorruptTraceError, match=r"entry 1 lacks fields \['stats'\].*tensor layer.bf16"):
        TraceReader(tmp_path).manifest(0, 0)
    with pytest.raises(MissingRankError, match="no run.json: not a trace directory"):
        TraceReader(tmp_path / "step_000000")


def test_fp8_e5m2_and_bool_round_trip(tmp_path):
    t = {"e5m2": (torch.randn(16) * 100).to(torch.float8_e5m2), "mask": torch.rand(7) > 0.5,
         "empty": torch.empty(0, 3, dtype=torch.bfloat16)}
    with TraceWriter(tmp_path, 0, 1, LAYOUT, SIG) as w:
        keys = {n: w.add(n, x, phase="param", step=2) for n, x in t.items()}
    r = TraceReader(tmp_path)
    r.validate()
    for n, x in t.items():
        got = r.load(2, 0, keys[n])
        assert got.dtype == x.dtype and got.shape == x.shape
        assert torch.equal(_bits(got), _bits(x))


def test_entry_of_another_step_and_sparse_tensor(tmp_path):
    _write_run(tmp_path, steps=(0,), mode="stats", world_size=1)
    path = manifest_path(tmp_path, 0, 0)
    m = json.loads(path.read_text())
    m["entries"][3]["step"] = 5
    path.write_text(json.dumps(m))
    with pytest.raises(ManifestMismatchError, match="entry 3 is of step 5 but sits in the manifest of step 0"):
        TraceReader(tmp_path).manifest(0, 0)
    w = TraceWriter(tmp_path / "new", 0, 1, LAYOUT, SIG)  # tmp_path holds another run's trace
    with pytest.raises(TraceError, match="only dense.*tensor s"):
        w.add("s", torch.eye(3).to_sparse(), phase="fwd", step=1)


def test_numpy_integer_step_and_non_oserror_cleanup(tmp_path, monkeypatch):
    import numpy as np
    w = TraceWriter(tmp_path, 0, 1, LAYOUT, SIG)
    w.add("a", torch.ones(2), phase="loss", step=np.int64(1), microbatch=np.int32(2))

    def boom(*a, **k):
        raise RuntimeError("bug while writing the manifest")

    monkeypatch.setattr(store, "_write_json_atomic", boom)
    with pytest.raises(RuntimeError, match="bug while writing"):
        w.flush_step(1)
    assert os.listdir(tmp_path / "step_000001") == []  # the tensor file was taken back
    monkeypatch.undo()
    w.flush_step(np.int64(1))
    assert TraceReader(tmp_path).entries(1, 0)[0].key == "loss/a/mb2/i0"


@pytest.mark.parametrize("value", [
    {"a": [1, 2.5, None, True, "s"], "b": {"c": (3, 4)}}, [], {}, 7, "x", None, -0.0,
    {1: "int key", 2.5: "float key", True: "bool key", None: "none key"},
])
def test_meta_is_copied_as_json_reads_it_back(value):
    assert _jsonable(value, "meta") == json.loads(json.dumps(value, allow_nan=False))


@pytest.mark.parametrize("value", [{"x": float("nan")}, {"x": [float("inf")]}, {(1, 2): "tuple key"},
                                   {"x": object()}, {"x": torch.ones(1)}, {"x": {1, 2}}])
def test_meta_that_json_refuses_is_refused(value):
    with pytest.raises((TypeError, ValueError)):
        json.dumps(value, allow_nan=False)
    with pytest.raises(TraceError, match="meta must be JSON-serialisable"):
        _jsonable(value, "meta")
