"""A distributed reference (issue 32, part 3; docs/distributed-reference.md).

One gloo launch (world 2) for the megatron-core part: a TP=2 reference (bf16, 1 step) with 3
noise samples taken on both ranks in lockstep, a clean TP=2+SP candidate, and the same candidate
with the catalogue bug ``sp_norm_grad_not_reduced``. ``compare`` must accept the 2-rank
reference, call the clean candidate consistent and find the bug at its declared first
divergence; the noise samples' replicated records (a layer norm computed on both TP ranks) must
be bitwise equal across the ranks and perturbed. The refusals are tested on small synthetic
traces written in this process (no launch).
"""
from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import pytest
import torch

from tracer.compare.check import compare
from tracer.errors import NoiseSampleError, ReferenceReplicasError, SameRunError, SwappedTracesError
from tracer.trace.canonical import Placement, ShardDim
from tracer.trace.store import TraceReader, TraceWriter

SIG = "distributed-reference"
STEPS = 1
SAMPLES = 3
BUG = "sp_norm_grad_not_reduced"
REF_LAYOUT = {"tp": 2, "pp": 1, "dp": 1, "sp": False, "distopt": False}
CAND_LAYOUT = {"tp": 2, "pp": 1, "dp": 1, "sp": True, "distopt": False}


# --- synthetic traces: the refusals ----------------------------------------------------------------

def _write(root: Path, world: int, *, run_id: str = "", meta: dict | None = None, offset: float = 0.0,
           seed: int = 0, disagree: bool = False) -> str:
    """A one-step trace over ``world`` ranks: ``a`` split on dim 1 over tp, ``b`` replicated over tp
    (rank 1's copy off by ``1e-3`` when ``disagree``); returns its run id."""
    rid = run_id
    for rank in range(world):
        w = TraceWriter(root, rank, world, {"tp": world}, SIG, run_id=rid, run_meta=meta)
        rid = w.run_id
        g = torch.Generator().manual_seed(seed)
        for i, name in enumerate(("a", "b")):
            full = torch.randn(4, 6, generator=torch.Generator().manual_seed(i)) + offset * torch.randn(4, 6, generator=g)
            if name == "a":
                part = full.chunk(world, dim=1)[rank]
                pl = Placement((ShardDim(1, "tp", rank, world),)) if world > 1 else None
            else:
                part = full + (1e-3 if disagree and rank == 1 else 0.0)
                pl = Placement((ShardDim(None, "tp", rank, world, kind="replicated"),)) if world > 1 else None
            w.add(name, part, phase="fwd", step=0, placement=pl)
        w.flush_step(0)
        w.close()
    return rid


def _reference(root: Path, world: int = 2, samples: int = 2, *, own: bool = True, sample_world: int | None = None,
               disagree: bool = False, sample_disagree: bool = False) -> Path:
    rid = _write(root, world, disagree=disagree)
    for i in range(samples):
        of = rid if own else "another-run"
        _write(root / "noise" / f"sample_{i}", sample_world or world, run_id=f"{of}.noise{i}",
               meta={"noise_sample": i, "noise_sample_of": of}, offset=1e-4, seed=i + 1,
               disagree=sample_disagree)
    return root


def test_a_two_rank_reference_with_its_own_two_rank_samples_is_accepted(tmp_path):
    ref = _reference(tmp_path / "ref")
    _write(tmp_path / "cand", 1)
    c = compare(ref, tmp_path / "cand")
    assert c.verdict == "consistent" and c.distributed_reference and c.reference_world_size == 2
    d = c.to_dict()
    assert d["distributed_reference"] is True and d["reference_layout"] == {"tp": 2}
    assert [r.shape for r in c.rows] == [[4, 6], [4, 6]]  # assembled, not rank 0's shard


@pytest.mark.parametrize("case", ["none", "foreign", "single-rank samples"])
def test_a_multi_rank_reference_without_its_own_samples_is_refused(tmp_path, case):
    if case == "none":
        ref = _reference(tmp_path / "ref", samples=0)
    elif case == "foreign":
        ref = _reference(tmp_path / "ref", own=False)
    else:
        ref = _reference(tmp_path / "ref", sample_world=1)
    _write(tmp_path / "cand", 2)
    with pytest.raises(SwappedTracesError) as e:
        compare(ref, tmp_path / "cand")
    msg = str(e.value)
    assert "traced on 2 ranks" in msg and "distributed reference" in msg and "swapped" in msg


def test_multi_rank_samples_of_a_single_device_reference_are_refused(tmp_path):
    ref = tmp_path / "ref"
    rid = _write(ref, 1)
    _write(ref / "noise" / "sample_0", 2, run_id=f"{rid}.noise0", meta={"noise_sample": 0, "noise_sample_of": rid})
    _write(tmp_path / "cand", 2)
    with pytest.raises(SameRunError, match="traced on 2 ranks"):
        compare(ref, tmp_path / "cand")


def test_a_reference_whose_replicas_differ_is_refused(tmp_path):
    ref = _reference(tmp_path / "ref", disagree=True)
    _write(tmp_path / "cand", 1)
    with pytest.raises(ReferenceReplicasError, match="disagrees with itself.*'b'.*replicas over tp differ"):
        compare(ref, tmp_path / "cand")


def test_a_sample_whose_replicas_differ_is_refused(tmp_path):
    ref = _reference(tmp_path / "ref", sample_disagree=True)
    _write(tmp_path / "cand", 1)
    with pytest.raises(NoiseSampleError, match="not perturb the replicated computation alike"):
        compare(ref, tmp_path / "cand")


# --- megatron-core TP=2 reference: one launch -------------------------------------------------------

def _worker(rank: int, world: int, root: str) -> dict:
    from examples.megatron_cpu.demo import _trace_worker
    root_p = Path(root)
    jobs = [{"layout": REF_LAYOUT, "steps": STEPS, "seed": 0, "dtype": "bf16",
             "trace": {"root": str(root_p / "ref"), "noise_samples": SAMPLES, "noise_tp": 2}},
            {"layout": CAND_LAYOUT, "steps": STEPS, "seed": 0, "dtype": "bf16",
             "trace": {"root": str(root_p / "cand_clean")}},
            {"layout": CAND_LAYOUT, "steps": STEPS, "seed": 0, "dtype": "bf16",
             "trace": {"root": str(root_p / "cand_bug")}, "bug": BUG}]
    return {"runs": _trace_worker(rank, world, jobs)}


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> Path:
    pytest.importorskip("megatron.core")
    from examples.gloo import run_gloo
    root = tmp_path_factory.mktemp("dref")
    run_gloo(_worker, 2, str(root))
    return root


def test_megatron_tp2_reference_clean_candidate_consistent(traced):
    c = compare(traced / "ref", traced / "cand_clean")
    assert c.distributed_reference and c.reference_layout["tp"] == 2
    assert c.verdict == "consistent", c.first
    assert c.noise_samples == SAMPLES and len(c.rows) > 50
    assert json.loads(json.dumps(c.to_dict()))["reference_world_size"] == 2


def test_megatron_tp2_reference_finds_the_bug_at_its_declared_first_divergence(traced):
    from examples.megatron_cpu.bugs import BUGS
    b = BUGS[BUG]
    c = compare(traced / "ref", traced / "cand_bug")
    assert c.verdict == "DIVERGENT"
    assert c.first.phase == b.expected_phase and fnmatch.fnmatchcase(c.first.name, b.expected_name), c.first


def test_replicated_records_of_the_noise_samples_are_perturbed_identically_on_every_rank(traced):
    """The claim of tracer.capture.noise_sampler ("Distributed reference"), checked on every record
    its placements mark replicated over TP: bitwise equal on both ranks in every sample, and
    perturbed (different from the clean reference) in most of them."""
    clean = TraceReader(traced / "ref")
    checked = perturbed = 0
    for i in range(SAMPLES):
        n = TraceReader(traced / "ref" / "noise" / f"sample_{i}")
        assert n.world_size == 2 and n.run["meta"]["noise_sample_of"] == clean.run_id
        for step in range(STEPS):
            r0 = {e.record_key: e for e in n.entries(step, 0)}
            r1 = {e.record_key: e for e in n.entries(step, 1)}
            c0 = {e.record_key: e for e in clean.entries(step, 0)}
            for k, e in r0.items():
                if not all(d.kind == "replicated" for d in e.placement.dims) or k not in r1:
                    continue
                a, b = n.load(step, 0, e.key), n.load(step, 1, r1[k].key)
                assert torch.equal(a, b), f"sample {i} step {step} {k}: replicas differ"
                checked += 1
                if k in c0 and e.phase == "fwd" and a.is_floating_point():
                    perturbed += not torch.equal(a, clean.load(step, 0, c0[k].key))
    assert checked > 20 and perturbed > 10, (checked, perturbed)


def test_the_noise_of_a_tp2_reference_models_its_own_split_and_the_candidates():
    """reference_noise(4, ..., reference_tp=2): the injector's variance is that of a 2-way split vs a
    4-way one, larger than an unsplit run's vs the 4-way split (the single-device reference's)."""
    from tracer.adapters.megatron import reference_noise
    from ttrace_num.propagate.noise import NoiseInjector
    q, c = torch.rand(8, 8, dtype=torch.float64) * 64, torch.randn(8, 8, dtype=torch.float64) * 4
    amp = {}
    for ref_tp in (1, 2):
        kw = reference_noise(4, "bf16", reference_tp=ref_tp)["injector_kwargs"]
        kw = {k: v for k, v in kw.items() if k != "accepted"}
        amp[ref_tp] = NoiseInjector(torch.Generator(), **kw)._variance_amplitude(q, c, 256, q.shape)
    assert bool((amp[2] >= amp[1]).all()) and bool((amp[2] > amp[1]).any())


# --- the PyTorch-native pair (torchtitan-style harness): registered and well-formed, no launch -------

def test_the_pytorch_native_pair_is_registered_and_well_formed():
    """FSDP2 over 2 ranks as the reference of FSDP2 x TP+SP and of HSDP (bench/distributed_reference.py):
    the reference has no TP or SP of its own (the code paths under test), the candidates are of one
    model, and every bug is injected into a candidate with the parallel dimensions its registry needs."""
    from bench.distributed_reference import HARNESSES, PAIRS, plan
    from examples.torchtitan_cpu.bugs import BUGS
    from examples.torchtitan_cpu.parallelize import Layout
    p = PAIRS["titan-fsdp2-vs-fsdp2xtp2"]
    h = HARNESSES[p.harness]
    ref = Layout.parse(p.reference)
    assert (ref.tp, ref.sp, ref.dp, h.world(p.reference)) == (1, False, 2, 2)
    cands = [Layout.parse(c) for c in p.candidates]
    assert any(c.tp == 2 and c.sp and c.dp_shard == 2 for c in cands)
    assert any(c.dp_replicate == 2 or c.dp_shard == 4 for c in cands)
    assert p.noise_split == max(c.tp for c in cands) and p.noise_dp == max(c.dp for c in cands)
    assert all(c.reference() == ref.reference() for c in cands)  # one model
    assert len(p.bugs) >= 3
    for name in p.bugs:
        lay, needs = Layout.parse(p.layout_of(name)), Layout.parse(BUGS[name].needs["layout"])
        assert p.layout_of(name) in p.candidates
        assert (lay.tp > 1) >= (needs.tp > 1) and lay.sp >= needs.sp and lay.dp_replicate >= needs.dp_replicate
        assert (lay.dp > 1) >= (needs.dp > 1)
    runs = plan(["titan-fsdp2-vs-fsdp2xtp2"], [0], Path("/nonexistent"))
    jobs = [r.job(p) for r in runs]
    assert all(j["noise_samples"] == (p.noise_samples if r.kind == "ref" else 0) for r, j in zip(runs, jobs))
    assert {r.layout for r in runs if r.kind == "bug"} <= set(p.candidates)


def test_the_noise_of_an_fsdp2_reference_models_the_candidates_split_only():
    """An FSDP2-only reference has no TP split of its own (its reduce-scatter is fp32, as the
    candidates'): its noise is the single-process reference's; a TP reference models its own split,
    a sequence-parallel one is refused."""
    from examples.torchtitan_cpu.parallelize import Layout
    from examples.torchtitan_cpu.run import reference_noise
    single = reference_noise(2, 4, "bf16")["injector_kwargs"]
    fsdp = reference_noise(2, 4, "bf16", Layout.parse("r1.s2.t1"))["injector_kwargs"]
    assert fsdp.keys() == single.keys() and "reference_model" not in fsdp
    assert fsdp["grad_summation"] == single["grad_summation"] and fsdp["variance_model"] == single["variance_model"]
    tp = reference_noise(4, 2, "bf16", Layout.parse("r1.s1.t2"))["injector_kwargs"]
    assert tp["reference_model"].split == 2
    with pytest.raises(ValueError, match="sequence parallelism"):
        reference_noise(4, 2, "bf16", Layout.parse("r1.s1.t2+sp"))
