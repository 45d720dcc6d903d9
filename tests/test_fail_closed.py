"""Fail closed (issue 31, item 3): ``compare`` refuses -- a ``TraceError`` naming files, what was
found and what to do -- rather than report a verdict over less than asked for; every stored
tensor's bytes are checksummed; every run has a run id, shared by its ranks, and a directory or
rank written by two runs is refused. One test per refusal, then a property test: no mutation of a
valid candidate trace is ever called consistent."""
from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from tracer.compare.check import compare, strip_wrappers
from tracer.errors import (
    CorruptTraceError,
    EmptyTraceError,
    ManifestMismatchError,
    MissingStepError,
    NoiseSampleError,
    NoNoiseError,
    SameRunError,
    SwappedTracesError,
    TraceDirectoryInUseError,
    TraceError,
    UnmatchedRecordsError,
)
from tracer.trace.canonical import Placement, ShardDim
from tracer.trace.store import TraceReader, TraceWriter, lock_path, manifest_path, tensor_path

SIG = "fail-closed"
NAMES = ("layers.0.attn.output", "layers.0.mlp.output")
STEPS = (0, 1)


def _value(name: str, step: int) -> torch.Tensor:
    seed = 1000 * step + sum(map(ord, name))
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(seed))


def _write(root: Path, *, world: int = 1, offset: float = 0.0, seed: int = 0, names=NAMES,
           rename: dict[str, str] | None = None, nan_in: str | None = None, empty: bool = False,
           run_id: str = "") -> None:
    """A two-step trace of ``names`` (fwd), TP-split on dim 1 over ``world`` ranks, ``offset`` times
    seeded noise away from the reference's values; ``rename`` maps a traced name to the one written."""
    rename = rename or {}
    for rank in range(world):
        w = TraceWriter(root, rank, world, {"tp": world}, SIG, run_id=run_id)
        for step in STEPS:
            if not empty:
                for name in names:
                    full = _value(name, step)
                    full = full + offset * torch.randn(full.shape, generator=torch.Generator().manual_seed(seed))
                    if name == nan_in and step == 0:
                        full[1, 2] = float("nan")
                    part = full.chunk(world, dim=1)[rank]
                    placement = Placement((ShardDim(1, "tp", rank, world),)) if world > 1 else None
                    w.add(rename.get(name, name), part, phase="fwd", step=step, placement=placement)
            w.flush_step(step)
        w.close()


def _reference(root: Path, samples: int = 2, **kw) -> Path:
    _write(root, **kw)
    for i in range(samples):
        _write(root / "noise" / f"sample_{i}", offset=1e-4, seed=i + 1)
    return root


def _flip(path: Path, offset: int, mask: int = 0x01) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def _data_start(path: Path) -> int:
    """Where a safetensors file's tensor bytes begin (after its 8-byte length and JSON header)."""
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    return 8 + n


@pytest.fixture(scope="module")
def t(tmp_path_factory) -> Path:
    t = tmp_path_factory.mktemp("fc")
    _reference(t / "ref")
    _write(t / "cand", world=2, offset=1e-6, seed=9)
    return t


def test_a_valid_candidate_is_consistent(t):
    c = compare(t / "ref", t / "cand")
    assert c.verdict == "consistent" and len(c.rows) == 4 and c.stripped_prefixes == {} and c.skipped == []


def test_a_comparison_that_judged_no_tensor_is_unverified(t, tmp_path):
    """Noise samples that traced none of the compared tensors leave every one unchecked: no verdict
    of consistency over nothing (the summary and the CLI's exit 2 say why)."""
    from tracer.cli import unverified_message
    from tracer.report.summary import summary
    ref = tmp_path / "ref"
    _write(ref)
    for i in range(2):  # samples of other tensors only
        _write(ref / "noise" / f"sample_{i}", offset=1e-4, seed=i + 1, names=("elsewhere.output",))
    c = compare(ref, t / "cand")
    assert c.first is None and {str(r.status) for r in c.rows} == {"unchecked"}
    assert c.nothing_judged and c.verdict == "unverified"
    assert "no tensor could be judged" in summary(c) and "none of the 4" in unverified_message(c)


def test_trace_errors_exit_with_code_2():
    assert TraceError("x").exit_code == 2 and UnmatchedRecordsError("x").exit_code == 2


# --- names -----------------------------------------------------------------------------------------

def test_wrapped_module_names_match_with_the_prefix_reported(t, tmp_path):
    _write(tmp_path / "cand", world=2, offset=1e-6, seed=9, rename={n: "module." + n for n in NAMES})
    c = compare(t / "ref", tmp_path / "cand")
    assert c.verdict == "consistent" and len(c.rows) == 4
    assert c.stripped_prefixes == {"candidate": ["module."]}
    assert c.to_dict()["stripped_prefixes"] == {"candidate": ["module."]}


def test_nested_wrapper_segments_are_stripped(t, tmp_path):
    assert strip_wrappers("module._orig_mod.layers.0._checkpoint_wrapped_module.attn.output") == \
        ("layers.0.attn.output", ("module.", "_orig_mod.", "_checkpoint_wrapped_module."))
    assert strip_wrappers("encoder.module.output") == ("encoder.module.output", ())  # `module` inside: a name
    _write(tmp_path / "cand", world=2, offset=1e-6, seed=9,
           rename={n: n.replace("layers.0.", "layers.0._checkpoint_wrapped_module.") for n in NAMES})
    c = compare(t / "ref", tmp_path / "cand")
    assert c.verdict == "consistent" and c.stripped_prefixes == {"candidate": ["_checkpoint_wrapped_module."]}


def test_a_renamed_module_is_refused_with_the_closest_names(t, tmp_path):
    _write(tmp_path / "cand", world=2, offset=1e-6, seed=9, rename={"layers.0.mlp.output": "layers.0.ffn.output"})
    with pytest.raises(UnmatchedRecordsError, match="do not trace the same tensors at step 0") as e:
        compare(t / "ref", tmp_path / "cand")
    msg = str(e.value)
    assert "only in the reference ('fwd layers.0.mlp.output mb 0')" in msg
    assert "closest names: 'layers.0.mlp.output' ~ 'layers.0.ffn.output'" in msg
    assert "skip=" in msg and "\n" not in msg


def test_a_record_the_candidate_lacks_is_refused_unless_skipped(t, tmp_path):
    _write(tmp_path / "cand", world=2, offset=1e-6, seed=9, names=NAMES[:1])
    with pytest.raises(UnmatchedRecordsError, match="1 records only in the reference"):
        compare(t / "ref", tmp_path / "cand")
    c = compare(t / "ref", tmp_path / "cand", skip=["fwd *.mlp.*"])
    assert c.verdict == "consistent" and len(c.rows) == 2
    assert c.skipped == ["step 0 fwd layers.0.mlp.output mb 0 (reference)",
                         "step 1 fwd layers.0.mlp.output mb 0 (reference)"]


def test_an_empty_candidate_is_refused(t, tmp_path):
    _write(tmp_path / "cand", world=2, empty=True)
    with pytest.raises(EmptyTraceError, match="holds no tensors"):
        compare(t / "ref", tmp_path / "cand")


def test_a_missing_step_is_refused_naming_both_step_lists(t):
    with pytest.raises(MissingStepError, match=r"step\(s\) \[5\] requested.*has steps \[0, 1\].*has steps \[0, 1\]"):
        compare(t / "ref", t / "cand", steps=[0, 5])


# --- which traces ----------------------------------------------------------------------------------

def test_a_reference_without_noise_samples_is_refused(t, tmp_path):
    _write(tmp_path / "ref")
    with pytest.raises(NoNoiseError, match="has no noise samples"):
        compare(tmp_path / "ref", t / "cand")
    with pytest.raises(NoNoiseError, match="has no noise samples"):
        compare(t / "ref", t / "cand", noise=[])


def test_swapped_reference_and_candidate_are_refused(t):
    with pytest.raises(SwappedTracesError, match="traced on 2 ranks.*swapped"):
        compare(t / "cand", t / "ref")


def test_the_candidate_as_its_own_reference_is_refused(t, tmp_path):
    with pytest.raises(SameRunError, match="are the same directory"):
        compare(t / "ref", t / "ref")
    shutil.copytree(t / "ref", tmp_path / "copy")
    with pytest.raises(SameRunError, match="are of the same run"):
        compare(t / "ref", tmp_path / "copy")


def test_the_reference_as_a_noise_sample_is_refused(t, tmp_path):
    with pytest.raises(SameRunError, match="noise sample .* is the reference"):
        compare(t / "ref", t / "cand", noise=[t / "ref" / "noise" / "sample_0", t / "ref"])
    shutil.copytree(t / "cand", tmp_path / "cand_copy")
    with pytest.raises(SameRunError, match="has the run id .* of the candidate"):
        compare(t / "ref", t / "cand", noise=[tmp_path / "cand_copy"])


def test_a_noise_sample_of_another_reference_run_is_refused(t, tmp_path):
    """A sample names the reference run it perturbs (NoiseSampler: run.json meta noise_sample_of)."""
    other = tmp_path / "other_sample"
    w = TraceWriter(other, 0, 1, {"tp": 1}, SIG, run_meta={"noise_sample": 0, "noise_sample_of": "another-run"})
    for step in STEPS:
        for name in NAMES:
            w.add(name, _value(name, step), phase="fwd", step=step)
        w.flush_step(step)
    w.close()
    with pytest.raises(NoiseSampleError, match="perturbs the reference run 'another-run', not this reference"):
        compare(t / "ref", t / "cand", noise=[t / "ref" / "noise" / "sample_0", other])


def test_nan_in_a_noise_sample_is_refused(t, tmp_path):
    _reference(tmp_path / "ref")
    shutil.rmtree(tmp_path / "ref" / "noise" / "sample_1")
    _write(tmp_path / "ref" / "noise" / "sample_1", offset=1e-4, seed=5, nan_in="layers.0.mlp.output")
    with pytest.raises(NoiseSampleError, match="sample_1.*NaN/Inf in tensor 'layers.0.mlp.output'.*at step 0") as e:
        compare(tmp_path / "ref", t / "cand")
    assert e.value.step == 0 and e.value.path.endswith("rank_00000.json")


# --- checksums -------------------------------------------------------------------------------------

def test_every_stored_tensor_has_a_checksum(t):
    r = TraceReader(t / "cand")
    entries = r.entries(0, 1)
    assert entries and all(isinstance(e.checksum, str) and len(e.checksum) == 16 for e in entries)


def test_a_flipped_bit_in_a_candidate_tensor_is_a_corrupt_trace(t, tmp_path):
    shutil.copytree(t / "cand", tmp_path / "cand")
    f = tensor_path(tmp_path / "cand", 1, 1)
    _flip(f, f.stat().st_size - 1)  # the last tensor's last byte: a mantissa bit, within any threshold
    with pytest.raises(CorruptTraceError, match="do not match their checksum: the manifest says xxh3_64 [0-9a-f]{16}, "
                                                "the file's bytes hash to [0-9a-f]{16}") as e:
        compare(t / "ref", tmp_path / "cand")
    assert (e.value.rank, e.value.step) == (1, 1) and e.value.tensor.startswith("fwd/layers.0.")


def test_a_flipped_bit_in_a_noise_sample_is_a_corrupt_trace(t, tmp_path):
    shutil.copytree(t / "ref", tmp_path / "ref")
    f = tensor_path(tmp_path / "ref" / "noise" / "sample_1", 0, 0)
    _flip(f, _data_start(f) + 5)
    with pytest.raises(CorruptTraceError, match="checksum") as e:
        compare(tmp_path / "ref", t / "cand")
    assert "sample_1" in e.value.path


def test_a_trace_without_checksums_still_reads(t, tmp_path):
    shutil.copytree(t / "cand", tmp_path / "cand")
    for step in STEPS:
        for rank in (0, 1):
            p = manifest_path(tmp_path / "cand", step, rank)
            m = json.loads(p.read_text())
            for e in m["entries"]:
                del e["checksum"]
            p.write_text(json.dumps(m))
    assert compare(t / "ref", tmp_path / "cand").verdict == "consistent"


# --- run ids and writers ---------------------------------------------------------------------------

def test_every_run_gets_an_id_its_ranks_share(t):
    r = TraceReader(t / "cand")
    assert len(r.run_id) == 32
    assert {r.manifest(s, k)["run_id"] for s in STEPS for k in (0, 1)} == {r.run_id}
    assert TraceReader(t / "ref").run_id not in ("", r.run_id)


def test_a_manifest_of_another_run_is_refused(t, tmp_path):
    _write(tmp_path / "a", world=2, offset=1e-6, seed=9)
    _write(tmp_path / "b", world=2, offset=1e-6, seed=9)
    for path in (manifest_path, tensor_path):
        shutil.copy(path(tmp_path / "b", 1, 1), path(tmp_path / "a", 1, 1))
    with pytest.raises(ManifestMismatchError, match="ranks or steps of different runs are mixed") as e:
        compare(t / "ref", tmp_path / "a")
    assert (e.value.rank, e.value.step) == (1, 1)


def test_a_second_writer_of_the_same_rank_is_refused(tmp_path):
    w = TraceWriter(tmp_path, 0, 1, {}, SIG, run_id="one")
    assert lock_path(tmp_path, 0).is_file()
    with pytest.raises(TraceDirectoryInUseError, match=f"another writer of rank 0 .* process {os.getpid()}"):
        TraceWriter(tmp_path, 0, 1, {}, SIG, run_id="one")
    w.close()
    assert not lock_path(tmp_path, 0).exists()
    TraceWriter(tmp_path, 0, 1, {}, SIG, run_id="one").close()  # the lock was released


def test_a_stale_lock_names_its_process_and_how_to_remove_it(tmp_path):
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    lock_path(tmp_path, 3).write_text(json.dumps({"pid": dead, "host": socket.gethostname(), "run_id": "old"}))
    with pytest.raises(TraceDirectoryInUseError, match=f"process {dead}.*the lock is stale.*delete the lock file"):
        TraceWriter(tmp_path, 3, 4, {}, SIG)
    assert lock_path(tmp_path, 3).is_file()  # not ours: never deleted


def test_a_directory_holding_another_runs_trace_is_refused(tmp_path):
    _write(tmp_path / "run", world=1)
    with pytest.raises(TraceDirectoryInUseError, match="a trace of another run is in this directory.*choose another"):
        TraceWriter(tmp_path / "run", 0, 1, {"tp": 1}, SIG)
    run_id = TraceReader(tmp_path / "run").run_id
    TraceWriter(tmp_path / "run", 0, 1, {"tp": 1}, SIG, run_id=run_id).close()  # the same run resumes


# --- property: no mutation of a valid candidate is consistent --------------------------------------

MUTATIONS = ("rename", "shape", "dtype", "flip", "run_id", "drop", "add", "truncate_tensor", "truncate_manifest")


def _mutate(root: Path, kind: str, step: int, rank: int, which: int, at: float, mask: int) -> None:
    mpath, tpath = manifest_path(root, step, rank), tensor_path(root, step, rank)
    m = json.loads(mpath.read_text())
    e = m["entries"][which % len(m["entries"])]
    if kind == "rename":
        e["name"] += "_x"
    elif kind == "shape":
        e["shape"][0] += 1
    elif kind == "dtype":
        e["dtype"] = "float16" if e["dtype"] != "float16" else "float32"
    elif kind == "run_id":
        m["run_id"] = m["run_id"][:-1] + ("0" if m["run_id"][-1] != "0" else "1")
    elif kind == "drop":
        m["entries"].remove(e)
    elif kind == "add":
        new = json.loads(json.dumps(e))
        new.update(key=e["key"] + "_copy", name=e["name"] + ".copy", index=max(x["index"] for x in m["entries"]) + 1)
        m["entries"].append(new)
    elif kind == "flip":
        size = tpath.stat().st_size
        _flip(tpath, min(int(at * size), size - 1), mask)
        return
    elif kind == "truncate_tensor":
        tpath.write_bytes(tpath.read_bytes()[:int(at * tpath.stat().st_size)])
        return
    elif kind == "truncate_manifest":
        mpath.write_bytes(mpath.read_bytes()[:int(at * mpath.stat().st_size)])
        return
    mpath.write_text(json.dumps(m))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("prop")
    _reference(base / "ref")
    _write(base / "cand", world=2, offset=1e-6, seed=9)
    assert compare(base / "ref", base / "cand").verdict == "consistent"
    return base


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(MUTATIONS), step=st.sampled_from(STEPS), rank=st.integers(0, 1),
       which=st.integers(0, 3), at=st.floats(0.0, 0.999), mask=st.sampled_from([0x01, 0x10, 0x80, 0xFF]))
def test_no_mutated_candidate_is_consistent(base, kind, step, rank, which, at, mask):
    with tempfile.TemporaryDirectory() as d:
        cand = Path(d) / "cand"
        shutil.copytree(base / "cand", cand)
        _mutate(cand, kind, step, rank, which, at, mask)
        try:
            c = compare(base / "ref", cand)
        except TraceError:
            return
        assert c.verdict == "DIVERGENT", (kind, step, rank, which, at, mask, c.verdict)
