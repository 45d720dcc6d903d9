"""Localisation that names the cause (tracer.compare.localise.localise), on synthetic rows.

One test per rule: a forward output whose module's inputs agree but whose parameters already
differed after the previous step is a wrong optimizer update; a backward that starts off by a
uniform factor after an agreeing forward is a wrongly scaled loss; the other cases keep their
messages (a wrong module, a wrong backward, a wrong reduction).
"""
from __future__ import annotations

import math

from tracer.compare.judge import TensorCheck
from tracer.compare.localise import localise


def row(name: str, phase: str = "fwd", *, step: int = 1, ratio: float = 0.1, index: int = 0, mb: int = 0,
        error: float = 0.0, ref_norm: float = 1.0, cand_norm: float = math.nan,
        scale: tuple[float, float] = (math.nan, math.nan)) -> TensorCheck:
    return TensorCheck(step=step, phase=phase, name=name, microbatch=mb, call=0, index=index, module="",
                       shape=[4], dtype="fp32", status="over" if ratio > 1 else "ok", error=error, threshold=1.0,
                       ratio=ratio, max_abs=error, ref_norm=ref_norm, cand_norm=cand_norm,
                       scale_error=scale[0], scale_threshold=scale[1])


def _step1_forward(emb_ratio: float = 3.0) -> list[TensorCheck]:
    return [row("emb.input.0", ratio=0.0, index=0), row("emb.output.0", ratio=emb_ratio, index=1),
            row("layer.output.0", ratio=5.0, index=2)]


def test_a_wrong_update_is_named_from_the_modules_parameters():
    """emb.weight was updated wrongly at step 0: its param record passed (0.3x, the worst
    parameter of that step), and emb's output at step 1 is the first divergence."""
    rows = [row("emb.weight", "param", step=0, ratio=0.3, index=10), row("layer.weight", "param", step=0, ratio=0.2,
                                                                        index=11)]
    rows += _step1_forward()
    first = rows[3]
    msg = localise(rows, first)
    assert msg.startswith("the parameters of emb differ from the reference's (worst emb.weight at 0.3x its "
                          "threshold after step 0): the optimizer update of step 0 is wrong"), msg


def test_a_parameter_near_its_threshold_is_suspect_even_when_not_the_worst():
    rows = [row("emb.weight", "param", step=0, ratio=0.6), row("layer.weight", "param", step=0, ratio=0.9)]
    rows += _step1_forward()
    assert "the optimizer update of step 0 is wrong" in localise(rows, rows[3])


def test_agreeing_parameters_keep_the_wrong_module_verdict():
    rows = [row("emb.weight", "param", step=0, ratio=0.1), row("layer.weight", "param", step=0, ratio=0.4)]
    rows += _step1_forward()
    msg = localise(rows, rows[3])
    assert msg.startswith("module emb is wrong: its inputs agree with the reference"), msg
    # step 0 has no previous update: the module is blamed
    rows0 = [row("emb.input.0", step=0, ratio=0.0), row("emb.output.0", step=0, ratio=3.0, index=1)]
    assert localise(rows0, rows0[1]).startswith("module emb is wrong")


def _agreeing_forward(step: int = 0) -> list[TensorCheck]:
    return [row("emb.output.0", step=step, index=0), row("head.output.0", step=step, index=1),
            row("loss", "loss", step=step, index=2)]


def test_a_rescaled_first_backward_tensor_is_a_wrongly_scaled_loss():
    first = row("head.output_grad.0", "bwd", step=0, ratio=40.0, index=3, error=1.0, ref_norm=1.0, cand_norm=2.0)
    rows = _agreeing_forward() + [first, row("emb.output_grad.0", "bwd", step=0, ratio=40.0, index=4)]
    msg = localise(rows, first)
    assert msg == ("the loss (or its gradient) is scaled wrongly: the forward agrees with the reference, the first "
                   "backward tensor (head.output_grad.0) is the reference's times ~2"), msg


def test_a_rescaled_loss_is_named_as_the_loss():
    fwd = _agreeing_forward()[:2]
    first = row("loss", "loss", step=0, ratio=1e3, index=2, error=0.25, ref_norm=2.0, cand_norm=1.75)
    msg = localise(fwd + [first], first)
    assert msg.startswith("the loss (or its gradient) is scaled wrongly") and "the loss (loss)" in msg
    assert "times ~0.875" in msg and "a single number" not in msg, msg
    scalar = TensorCheck(**{**first.__dict__, "shape": []})
    assert "a single number: a loss computed wrongly reads the same" in localise(fwd + [scalar], scalar)


def test_the_block_scale_statistic_also_names_a_scaled_loss():
    first = row("head.output_grad.0", "bwd", step=0, ratio=8.0, index=3, error=1.0, scale=(8.0, 1.0))
    assert localise(_agreeing_forward() + [first], first).startswith("the loss (or its gradient) is scaled wrongly")


def test_a_non_uniform_backward_difference_keeps_the_wrong_backward_verdict():
    # ||c|| - ||r|| explains a tenth of the error: not a rescaling
    first = row("head.output_grad.0", "bwd", step=0, ratio=40.0, index=3, error=1.0, ref_norm=1.0, cand_norm=1.1)
    msg = localise(_agreeing_forward() + [first], first)
    assert msg.startswith("the gradient flowing into head diverges first: the module that consumes this tensor "
                          "computes a wrong backward"), msg
    # not the earliest backward tensor of the microbatch: a module's backward, not the loss
    later = row("emb.output_grad.0", "bwd", step=0, ratio=40.0, index=4, error=1.0, ref_norm=1.0, cand_norm=2.0)
    rows = _agreeing_forward() + [row("head.output_grad.0", "bwd", step=0, ratio=0.1, index=3), later]
    assert "computes a wrong backward" in localise(rows, later)
    # a forward that disagrees: not the loss's fault
    rows = _agreeing_forward()[:1] + [row("head.output.0", step=0, ratio=0.1, index=1),
                                      row("x.output.0", step=0, ratio=0.1, index=1, mb=0)]
    rows[1] = row("head.output.0", step=0, ratio=2.0, index=1)
    first = row("head.output_grad.0", "bwd", step=0, ratio=40.0, index=3, error=1.0, ref_norm=1.0, cand_norm=2.0)
    assert "scaled wrongly" not in localise(rows + [first], first)


def test_other_rules_keep_their_messages():
    rows = [row("w", "grad_local", step=0, ratio=0.2), row("w", "grad", step=0, ratio=5.0, index=1)]
    assert localise(rows, rows[1]).startswith("the cross-rank reduction of w's gradient is wrong")
    rows = [row("w", "grad", step=0, ratio=0.2), row("w", "param", step=0, ratio=5.0, index=1)]
    assert localise(rows, rows[1]).startswith("the optimizer update of w is wrong")
