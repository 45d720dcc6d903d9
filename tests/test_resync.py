"""A reference re-synchronised to its candidate at every step (tracer.capture.resync).

Unit tests (no megatron): the candidate's main params and Adam moments, written as TP shards
by two ranks, are assembled and loaded bitwise into a reference optimizer of each kind
megatron-core has (fp32 params stepped directly; fp32 main copies of bf16 params), and bad
input gives errors that say what to do.

Integration (real megatron-core, two gloo launches for the module): a TP2 + DP2 + SP candidate
with the distributed optimizer (moments as flat DP shards) traces its optimizer state; a
re-synchronised reference starts step 1 from exactly the candidate's parameters (the
embedding lookup of step 1 agrees bitwise, against a reference on its own trajectory that
does not), and the comparison is clean, with the optimizer state itself not compared.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tracer.trace.canonical import Placement, ShardDim, shard
from tracer.errors import MissingRankError, TraceError
from tracer.capture.optim_state import main_param_and_state
from tracer.capture.resync import STATE_PHASES, ResyncWarning, candidate_state, load_state
from tracer.trace.schema import PRE_UPDATE_PHASES
from tracer.trace.store import TraceWriter

SHAPES = {"w": (4, 6), "b": (6,)}
TP_SPLIT = {"w": 0, "b": None}  # w column-split over 2 TP ranks along dim 0, b replicated


def _placement(name: str, rank: int) -> Placement:
    dim = TP_SPLIT[name]
    kind = "replicated" if dim is None else "contiguous"
    return Placement((ShardDim(dim, "tp", rank, 2, kind),))


def _adam_state(seed: int, params_dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], SimpleNamespace]:
    """Model params and a megatron-like optimizer stepped twice on random grads: fp32 params
    stepped directly (``FP32Optimizer``) or bf16 params with fp32 main copies
    (``Float16OptimizerWithFloat16Params``: ``p.main_param``)."""
    g = torch.Generator().manual_seed(seed)
    params = {n: torch.nn.Parameter(torch.randn(s, generator=g).to(params_dtype)) for n, s in SHAPES.items()}
    mains = {}
    for n, p in params.items():
        mains[n] = p if params_dtype == torch.float32 else p.detach().float().requires_grad_()
        if mains[n] is not p:
            p.main_param = mains[n]
    adam = torch.optim.Adam(list(mains.values()), lr=1e-2)
    for _ in range(2):
        for m in mains.values():
            m.grad = torch.randn(m.shape, generator=g)
        adam.step()
    opt = SimpleNamespace(optimizer=adam)
    if params_dtype != torch.float32:
        def cast():  # as megatron's Float16 optimizer after a step
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(mains[n])
        opt._copy_main_params_to_model_params = cast
        cast()
    return params, opt


def _write_candidate(root: Path, params: dict[str, torch.Tensor], optimizer, phases=STATE_PHASES,
                     ranks=(0, 1), step: int = 0) -> None:
    """The candidate's state as two TP ranks trace it (capture ``optim``)."""
    for rank in ranks:
        with TraceWriter(root, rank, 2, {"tp": 2}, "toy") as w:
            for name, p in params.items():
                tensors, _ = main_param_and_state(optimizer, p)
                tensors["param"] = p.detach()
                pl = _placement(name, rank)
                for phase in phases:
                    w.add(name, shard(tensors[phase], pl), phase=phase, step=step, placement=pl.to_dict())
            w.flush_step(step)


@pytest.mark.parametrize("params_dtype", [torch.float32, torch.bfloat16])
def test_candidate_state_loads_bitwise(tmp_path, params_dtype):
    cand_params, cand_opt = _adam_state(0, params_dtype)
    _write_candidate(tmp_path / "cand", cand_params, cand_opt)
    ref_params, ref_opt = _adam_state(1, params_dtype)  # another trajectory: every value differs
    assert not torch.equal(ref_params["w"], cand_params["w"])
    load_state(ref_opt, list(ref_params.items()), candidate_state(tmp_path / "cand", 0))
    for name, p in ref_params.items():
        got, _ = main_param_and_state(ref_opt, p)
        want, _ = main_param_and_state(cand_opt, cand_params[name])
        assert set(got) == {"main_param", "exp_avg", "exp_avg_sq"}
        for phase in got:
            assert torch.equal(got[phase], want[phase]), (name, phase)
        assert torch.equal(p, cand_params[name]), name


def test_a_trace_without_optimizer_state_says_what_to_capture(tmp_path):
    params, opt = _adam_state(0, torch.float32)
    _write_candidate(tmp_path / "cand", params, opt, phases=("param",))
    with pytest.raises(TraceError, match="capture 'optim'"):
        candidate_state(tmp_path / "cand", 0)


def test_a_missing_rank_is_named(tmp_path):
    params, opt = _adam_state(0, torch.float32)
    _write_candidate(tmp_path / "cand", params, opt, ranks=(0,))
    with pytest.raises(MissingRankError, match=r"ranks \[1\] have no trace of step 0"):
        candidate_state(tmp_path / "cand", 0)


def test_a_reference_that_has_not_stepped_is_refused(tmp_path):
    params, opt = _adam_state(0, torch.float32)
    _write_candidate(tmp_path / "cand", params, opt)
    fresh = {n: torch.nn.Parameter(torch.zeros(s)) for n, s in SHAPES.items()}
    with pytest.raises(ValueError, match="no Adam moments yet"):
        load_state(SimpleNamespace(optimizer=torch.optim.Adam(list(fresh.values()))), list(fresh.items()),
                   candidate_state(tmp_path / "cand", 0))


def test_a_cast_that_disagrees_with_the_candidates_parameter_is_named_and_adopted(tmp_path):
    """A candidate whose model copy is not the cast of its main copy (a skipped parameter
    all-gather) is still re-synchronised to: the reference takes the candidate's model copy,
    and a ResyncWarning names the parameter."""
    params, opt = _adam_state(0, torch.bfloat16)
    _write_candidate(tmp_path / "cand", params, opt)
    state = candidate_state(tmp_path / "cand", 0)
    state["b"]["param"][0] += 1.0  # the candidate's model copy is not the cast of its main copy
    ref_params, ref_opt = _adam_state(1, torch.bfloat16)
    with pytest.warns(ResyncWarning, match=r"1 of the candidate's model parameters .*\(b\)"):
        differ = load_state(ref_opt, list(ref_params.items()), state)
    assert differ == ["b"]
    for name, p in ref_params.items():
        assert torch.equal(p.detach(), state[name]["param"]), name


def test_missing_parameters_are_named(tmp_path):
    params, opt = _adam_state(0, torch.float32)
    _write_candidate(tmp_path / "cand", {"w": params["w"]}, opt)
    ref_params, ref_opt = _adam_state(1, torch.float32)
    with pytest.raises(ValueError, match=r"lacks parameters \['b'\]"):
        load_state(ref_opt, list(ref_params.items()), candidate_state(tmp_path / "cand", 0))


# --------------------------------------------------------------------------- real megatron-core
CANDIDATE = {"tp": 2, "pp": 1, "dp": 2, "sp": True, "distopt": True}
STEPS = 3


#: plain-PyTorch harness layouts (world 4): FP8 delayed scaling (its amax histories are loaded
#: too) and a mixture of experts
TORCH_LAYOUTS = {"fp8": ("tp2.cp2.dp1+fp8", "bf16"), "moe": ("tp1.cp2.dp2+moe", "bf16")}


def _worker(rank: int, world: int, jobs: list[dict]) -> None:
    import warnings
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    from examples.megatron_cpu.gpt import build_and_train
    from examples.torch_parallel.run import trace_job
    for j in jobs:
        if "harness" in j:
            trace_job(j)
        else:
            build_and_train(j["layout"], steps=STEPS, seed=0, dtype=j["dtype"], global_batch=2, trace=j["trace"])


@pytest.fixture(scope="module")
def synced(tmp_path_factory) -> Path:
    """Per dtype: the megatron candidate (capture ``optim``), a re-synchronised reference (2 noise
    samples) and a reference on its own trajectory (no samples); per :data:`TORCH_LAYOUTS`, the
    plain-PyTorch candidate and its re-synchronised reference (4 noise samples)."""
    pytest.importorskip("megatron.core")
    from examples.gloo import run_gloo
    from tracer.adapters.megatron import DEFAULT_CAPTURE
    root = tmp_path_factory.mktemp("resync")
    dtypes = ("fp32", "bf16")
    from examples.torch_parallel.layout import Layout
    torch_job = {"harness": "torch", "seed": 0, "steps": STEPS}
    run_gloo(_worker, 4, [{"layout": CANDIDATE, "dtype": d,
                           "trace": {"root": str(root / f"cand_{d}"), "capture": DEFAULT_CAPTURE + ("optim",)}}
                          for d in dtypes]
             + [{**torch_job, "layout": lay, "dtype": d, "root": str(root / f"cand_{k}"), "optim": True}
                for k, (lay, d) in TORCH_LAYOUTS.items()], timeout_s=600)
    ref = {"tp": 1, "pp": 1, "dp": 1}
    run_gloo(_worker, 1, [job for d in dtypes for job in (
        {"layout": ref, "dtype": d, "trace": {"root": str(root / f"ref_{d}"), "noise_samples": 2, "noise_tp": 2,
                                              "resync_from": str(root / f"cand_{d}")}},
        {"layout": ref, "dtype": d, "trace": {"root": str(root / f"own_{d}")}})]
             + [{**torch_job, "layout": Layout.parse(lay).reference().name, "dtype": d, "root": str(root / f"ref_{k}"),
                 "noise_samples": 4, "noise_split": 2, "resync_from": str(root / f"cand_{k}")}
                for k, (lay, d) in TORCH_LAYOUTS.items()], timeout_s=600)
    return root


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_candidate_traces_its_optimizer_state_as_flat_shards(synced, dtype):
    from tracer.compare.check import assembled_records
    from tracer.trace.store import TraceReader
    reader = TraceReader(synced / f"cand_{dtype}")
    entries = [e for r in reader.ranks(0) for e in reader.entries(0, r) if e.phase == "exp_avg"]
    kinds = {d.kind for e in entries for d in e.placement.dims if d.group == "dp"}
    assert kinds == {"flat_shard"}  # the distributed optimizer's moments: each DP rank its range
    params = assembled_records(synced / f"cand_{dtype}", 0, "param", 0, "")
    for phase in ("main_param", "exp_avg", "exp_avg_sq"):
        full = assembled_records(synced / f"cand_{dtype}", 0, phase, 0, "")
        assert set(full) == set(params) and all(full[n].shape == params[n].shape for n in params), phase
        assert all(t.dtype == torch.float32 for t in full.values())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_resynchronised_reference_starts_each_step_from_the_candidates_parameters(synced, dtype):
    """The embedding lookup copies parameters exactly (TP: a sum of one row and zeros): after
    step 0 it agrees bitwise with the candidate's only on the re-synchronised reference."""
    from tracer.compare.check import assembled_records
    for step in (1, 2):
        cand = assembled_records(synced / f"cand_{dtype}", step, "fwd", 0, "embedding.output")["embedding.output"]
        ref = assembled_records(synced / f"ref_{dtype}", step, "fwd", 0, "embedding.output")["embedding.output"]
        own = assembled_records(synced / f"own_{dtype}", step, "fwd", 0, "embedding.output")["embedding.output"]
        assert torch.equal(ref, cand), step
        assert not torch.equal(own, cand), step  # Adam's drift: the negative control


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_resynchronised_comparison_is_clean(synced, dtype):
    from tracer.compare.check import compare
    c = compare(synced / f"ref_{dtype}", synced / f"cand_{dtype}")
    print(f"\n{dtype}: {len(c.rows)} tensors, max error/threshold {c.max_ratio_ok:.3f}")
    assert not c.unmatched, c.unmatched[:5]  # the candidate's optimizer state is not compared
    assert {r.phase for r in c.rows} >= {"fwd", "bwd", "grad", "param"}
    assert not {r.phase for r in c.rows} & {"main_param", "exp_avg", "exp_avg_sq"}
    assert c.first is None, (c.first, c.localisation)


def _caps(monkeypatch, ref, cand) -> set[tuple[str, bool]]:
    """(phase, few_sources) of every tensor ``tracer.compare.check.compare`` checks; asserts it is clean."""
    import tracer.compare.check as check
    seen, routed = set(), check.check_routed
    monkeypatch.setattr(check, "check_routed", lambda *a, few_sources, **k: (
        seen.add((a[1][0], few_sources)), routed(*a, few_sources=few_sources, **k))[1])
    assert check.compare(ref, cand).first is None
    return seen


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_restarted_samples_lift_the_few_source_cap_before_the_update_only(synced, dtype, monkeypatch):
    """The re-synchronised reference's samples say they restart each step; the comparison then
    checks the tensors recorded before the optimizer update without the few-source cap on their
    degrees of freedom, and keeps it on the parameters after the update."""
    import tracer.compare.check as check
    from tracer.trace.store import TraceReader
    readers = [TraceReader(d) for d in check.noise_dirs(synced / f"ref_{dtype}")]
    assert len(readers) == 2 and check.samples_restart(readers)
    assert not check.samples_restart([TraceReader(synced / f"own_{dtype}")])  # a plain trace: no such meta
    seen = _caps(monkeypatch, synced / f"ref_{dtype}", synced / f"cand_{dtype}")
    assert {p for p, _ in seen} >= {"fwd", "bwd", "grad", "param"}
    # after the update: the parameters, the optimizer's options and the main-parameter cast check
    # (both exact, the cap is moot there)
    assert all(cap == (phase not in PRE_UPDATE_PHASES) for phase, cap in seen), sorted(seen)
    assert {p for p, cap in seen if cap} == {"options", "cast", "param"}


def test_a_step_with_topk_choices_keeps_the_cap(synced, monkeypatch):
    """The MoE's routers make discrete choices inside the step: the cap stays on every tensor."""
    from tracer.compare.check import makes_topk_choice
    from tracer.trace.store import TraceReader
    assert makes_topk_choice(TraceReader(synced / "ref_moe"), 1)
    assert not makes_topk_choice(TraceReader(synced / "ref_fp8"), 1)
    seen = _caps(monkeypatch, synced / "ref_moe", synced / "cand_moe")
    assert {p for p, _ in seen} >= {"fwd", "bwd", "grad"} and all(cap for _, cap in seen)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_localisation_rerun_starts_from_the_candidates_state(synced, dtype):
    """Re-running a module of step 2 on the candidate's inputs: re-synchronised, the module's
    weights are the candidate's, and the local difference is that of one computation; on the
    reference's own trajectory the weights have drifted and the local difference is larger."""
    from dataclasses import replace

    from examples.megatron_cpu.localise import rerun_first_divergence
    from tracer.compare.check import compare
    c = compare(synced / f"ref_{dtype}", synced / f"cand_{dtype}")
    row = next(r for r in c.rows if (r.step, r.phase, r.name) == (2, "fwd", "decoder.final_layernorm.output"))
    synced_v = rerun_first_divergence(replace(c, first=row), seed=0, dtype=dtype, global_batch=2, resync=True)
    own_v = rerun_first_divergence(replace(c, first=row), seed=0, dtype=dtype, global_batch=2)
    print(f"\n{dtype}: re-synchronised {synced_v}\n  own trajectory {own_v}")
    assert not synced_v.module_is_wrong
    assert synced_v.local_error < own_v.local_error / 10


@pytest.mark.parametrize("kind", sorted(TORCH_LAYOUTS))
def test_plain_pytorch_harness_resynchronises(synced, kind):
    """The plain-PyTorch harness: parameters, Adam moments and FP8 delayed-scaling state are
    loaded (without the FP8 amax histories the step-1 FP8 scales differ: 12 tensors over,
    the scales 5.7e4x their threshold, measured on this layout), and the comparison is clean."""
    from tracer.compare.check import compare
    c = compare(synced / f"ref_{kind}", synced / f"cand_{kind}")
    print(f"\n{TORCH_LAYOUTS[kind]}: {len(c.rows)} tensors, max error/threshold {c.max_ratio_ok:.3f}, {c.counts()}")
    assert not c.unmatched, c.unmatched[:5]
    assert c.first is None, (c.first, c.localisation)
    if kind == "fp8":
        assert any(r.phase == "fp8_scale" and r.step > 0 for r in c.rows)
