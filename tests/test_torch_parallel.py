"""The plain-PyTorch harness's pieces that need no process group: layouts, placements,
the FP8 state snapshot, and the noise injector on a -inf attention mask.

The traced comparisons themselves (clean layouts and bugs under gloo) run in
tests/test_detection_quick.py through ``bench.detection --quick``."""
from __future__ import annotations

import pytest
import torch

from examples.torch_parallel import ring_attention as ra
from examples.torch_parallel.bugs import BUGS
from examples.torch_parallel.layout import Layout
from examples.torch_parallel.train import Run
from tracer.capture.noise_sampler import StateSnapshot
from ttrace_num.propagate.noise import NoiseInjector


@pytest.mark.parametrize("name", ["tp1.cp1.dp1", "tp2.cp2.dp1+sp", "tp1.cp1.dp2+fp8+recompute", "tp2.cp1.dp1+sp+moe"])
def test_layout_name_round_trip(name):
    assert Layout.parse(name).name == name


@pytest.mark.parametrize("bad, match", [("tp2.cp1.dp1+zz", "unknown feature"), ("tp1.cp1.dp1+sp", "needs tp > 1"),
                                        ("tpx.cp1", "not of the form"), ("tp0.cp1.dp1", ">= 1")])
def test_layout_errors_name_the_problem(bad, match):
    with pytest.raises(ValueError, match=match):
        Layout.parse(bad)


@pytest.mark.parametrize("argv, match", [
    (["--layout", "tp2.cp1.dp1+zz"], "unknown feature"),
    ([], "name a candidate --layout"),
    (["--bug", "cp_ring_backward_stale_kv", "--layout", "tp2.cp1.dp1+sp"], "runs on layout tp1.cp2.dp1"),
])
def test_command_line_rejects_bad_arguments_before_launching(argv, match, capsys):
    from examples.torch_parallel.run import main
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


def test_every_bug_runs_on_a_parseable_layout_with_its_feature():
    for b in BUGS.values():
        lay = Layout.parse(b.needs["layout"])
        assert lay.world <= 4, b.name
        if b.name.startswith("fp8"):
            assert lay.fp8, b.name
        if b.name.startswith("moe"):
            assert lay.moe, b.name
        if b.name.startswith("cp"):
            assert lay.cp > 1, b.name


def test_reference_layout_keeps_model_features_only():
    assert Layout.parse("tp2.cp2.dp1+sp+fp8+moe").reference() == Layout(fp8=True, moe=True)


def test_state_snapshot_restores_fp8_delayed_scaling_state():
    """A noise sample must start from the step's FP8 amax history and scales, not the ones the
    previous sample left (StateSnapshot uses the modules' get/set_extra_state)."""
    run = Run(Layout(fp8=True), "fp32")
    run.train_step(0)
    states = run.fp8_states()
    assert states, "the FP8 model has FP8 linears"
    before = {n: st.get_extra_state() for n, st in states.items()}
    snap = StateSnapshot(run.model, run.opt)
    run.train_step(1)
    changed = [n for n, st in states.items() if not torch.equal(st.meta.scale, before[n]["scale"])]
    assert changed, "a step changes some scale (else this test checks nothing)"
    snap.restore()
    for n, st in states.items():
        for k in ("amax_history", "amax", "scale", "scale_inv"):
            assert torch.equal(getattr(st.meta, k), before[n][k]), (n, k)


def test_noise_injector_keeps_masked_scores_finite_safe():
    """A -inf causal mask passed through a cast under the injector (the straight-through add
    of the noise) stays -inf instead of turning into NaN (inf - inf)."""
    q, k, v = (torch.randn(8, 2, 4, requires_grad=True) for _ in range(3))
    pos = torch.arange(8)
    with NoiseInjector(torch.Generator().manual_seed(0), mode="probabilistic"):
        out = ra.attention(q, k, v, pos, pos)
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
