"""The optimizer's options (capture ``options``): what is recorded, and that a difference is
caught where its effect on the parameters is below their storage precision."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tracer.trace.canonical import Placement, ShardDim
from tracer.compare.check import compare
from tracer.capture.optim_state import optimizer_options, state_step_range
from tracer.trace.store import TraceWriter


def _adamw(**group1) -> torch.optim.AdamW:
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    return torch.optim.AdamW([{"params": [a], "weight_decay": 0.0}, {"params": [b], "weight_decay": 0.1, **group1}],
                             lr=1e-3, eps=1e-8)


def test_options_are_the_min_and_max_over_the_groups_of_every_numeric_option():
    opts = optimizer_options(_adamw(lr=2e-3))
    assert sorted(opts) == ["betas.0", "betas.1", "eps", "lr", "weight_decay"]  # no bools, no params
    assert opts["lr"].tolist() == [1e-3, 2e-3]
    assert opts["weight_decay"].tolist() == [0.0, 0.1]
    assert opts["betas.1"].tolist() == [0.999, 0.999]
    assert all(t.dtype == torch.float64 for t in opts.values())


def test_a_wrapped_or_chained_optimizer_gives_its_inner_groups_options():
    inner = _adamw()
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=inner)])
    assert {k: v.tolist() for k, v in optimizer_options(chained).items()} == \
           {k: v.tolist() for k, v in optimizer_options(inner).items()}


def _trace(root, opt: torch.optim.Optimizer, samples: int = 0) -> None:
    """One step's options, as a reference (with ``samples`` noise samples, which record the same
    options) or a candidate would trace them."""
    for i, sub in [(None, root)] + [(i, root / "noise" / f"sample_{i}") for i in range(samples)]:
        w = TraceWriter(sub, 0, 1, {"tp": 1}, "sig", run_id=root.name if i is None else f"noise{i}")
        for name, t in optimizer_options(opt).items():
            w.add(f"optimizer.{name}", t, phase="options", step=0)
        w.flush_step(0)
        w.close()


def test_an_eps_that_differs_from_the_references_is_the_first_divergence(tmp_path):
    _trace(tmp_path / "ref", _adamw(), samples=2)
    _trace(tmp_path / "same", _adamw())
    _trace(tmp_path / "eps", _adamw(eps=1e-6))
    assert compare(tmp_path / "ref", tmp_path / "same").first is None
    c = compare(tmp_path / "ref", tmp_path / "eps")
    assert c.first is not None and (c.first.phase, c.first.name) == ("options", "optimizer.eps")
    assert "configuration error" in c.localisation


def test_the_plain_pytorch_tracer_records_the_options_and_needs_the_optimizer(tmp_path):
    from tracer.adapters.ddp import DDPTracer
    model = torch.nn.Linear(2, 2)
    w = TraceWriter(tmp_path / "t", 0, 1, {}, "sig")
    with pytest.raises(ValueError, match=r"capture 'options' .* pass DDPTracer\(\.\.\., optimizer=\.\.\.\)"):
        DDPTracer(model, w, capture=("options",))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    t = DDPTracer(model, w, capture=("options",), optimizer=opt)
    with t.step(0):
        t.after_optimizer_step()
    t.remove()
    w.close()
    from tracer.trace.store import TraceReader
    names = {e.name for e in TraceReader(tmp_path / "t").entries(0, 0) if e.phase == "options"}
    assert names == {f"optimizer.{k}" for k in optimizer_options(opt)}


def _stepped(steps: int, restart_before_last: bool = False) -> torch.optim.AdamW:
    """An AdamW over two parameters after ``steps`` updates; with ``restart_before_last``, the
    first parameter's count is set to 0 before the last update (a resume that lost it)."""
    opt = _adamw()
    for i in range(steps):
        for g in opt.param_groups:
            for p in g["params"]:
                p.grad = torch.ones_like(p)
        if restart_before_last and i == steps - 1:
            opt.state[opt.param_groups[0]["params"][0]]["step"].zero_()
        opt.step()
    return opt


def test_the_step_counts_are_recorded_as_their_range_once_the_optimizer_has_stepped():
    assert state_step_range(_adamw()) is None and "state.step" not in optimizer_options(_adamw())
    assert optimizer_options(_stepped(3))["state.step"].tolist() == [3.0, 3.0]
    assert state_step_range(_stepped(3, restart_before_last=True)).tolist() == [1.0, 3.0]
    counts = SimpleNamespace(state={"a": {"step": 2}, "b": {"step": torch.tensor(5.0)}, "c": {}})
    assert state_step_range(counts).tolist() == [2.0, 5.0]  # numbers and 0-d tensors; a state without a count


def _trace_ranks(root, opts: list[torch.optim.Optimizer], samples: int = 0) -> None:
    """One step's options on ``len(opts)`` ranks (rank r records ``opts[r]``'s), replicated over them."""
    world = len(opts)
    subs = [(None, root)] + [(i, root / "noise" / f"sample_{i}") for i in range(samples)]
    for i, sub in subs:
        for rank, opt in enumerate(opts):
            placement = Placement((ShardDim(None, "world", rank, world, "replicated"),) if world > 1 else ())
            w = TraceWriter(sub, rank, world, {"dp": world}, "sig", run_id=root.name if i is None else f"noise{i}")
            for name, t in optimizer_options(opt).items():
                w.add(f"optimizer.{name}", t, phase="options", step=0, placement=placement.to_dict())
            w.flush_step(0)
            w.close()


def test_a_step_count_restarted_on_one_rank_is_the_first_divergence(tmp_path):
    _trace_ranks(tmp_path / "ref", [_stepped(2)], samples=2)
    _trace_ranks(tmp_path / "same", [_stepped(2), _stepped(2)])
    _trace_ranks(tmp_path / "restarted", [_stepped(2), _stepped(2, restart_before_last=True)])
    assert compare(tmp_path / "ref", tmp_path / "same").first is None
    c = compare(tmp_path / "ref", tmp_path / "restarted")
    assert c.first is not None and (c.first.phase, c.first.name) == ("options", "optimizer.state.step")
    assert c.first.status == "replicas" and "step counts" in c.localisation and "across ranks" in c.localisation
    _trace_ranks(tmp_path / "all_restarted", [_stepped(2, restart_before_last=True)])
    c = compare(tmp_path / "ref", tmp_path / "all_restarted")
    assert c.first is not None and c.first.status == "over" and "from the reference's" in c.localisation
