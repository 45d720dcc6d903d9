"""The exactness rule (tracer.compare.exactness): a module whose inputs matched bitwise and whose layout
does not change its arithmetic must match bitwise."""
from __future__ import annotations

import math

import pytest

from tracer.compare.exactness import apply_exactness, io_role
from tracer.compare.judge import TensorCheck

M = "decoder.layers.0.input_layernorm"


def _row(name: str, error: float, *, step: int = 0, phase: str = "fwd", status: str = "ok", max_abs: float | None = None,
         module: str = M) -> TensorCheck:
    return TensorCheck(step=step, phase=phase, name=name, microbatch=0, call=0, index=0, module=module, shape=[4],
                       dtype="torch.bfloat16", status=status, error=error, threshold=1.0, ratio=error,
                       max_abs=error if max_abs is None else max_abs, ref_norm=1.0)


SAME = {(0, f"{M}.output", 0, 0), (1, f"{M}.output", 0, 0)}


def test_io_role_from_the_canonical_name():
    assert io_role("decoder.layers.0.input.hidden_states") == ("decoder.layers.0", "input")
    assert io_role("decoder.layers.0.self_attention.output.0") == ("decoder.layers.0.self_attention", "output")
    assert io_role("output_layer.output.0") == ("output_layer", "output")
    assert io_role("decoder.layers.0.mlp.linear_fc1.weight") is None


def test_a_difference_within_the_noise_threshold_is_over_when_inputs_matched():
    rows = [_row(f"{M}.input", 0.0), _row(f"{M}.output", 1e-3)]
    assert apply_exactness(rows, SAME, {0}) == 1
    assert rows[1].status == "over" and math.isinf(rows[1].ratio) and rows[1].threshold == 0
    assert "must match bitwise" in rows[1].note


def test_equal_output_passes_with_the_rule_noted():
    rows = [_row(f"{M}.input", 0.0), _row(f"{M}.output", 0.0)]
    apply_exactness(rows, SAME, {0})
    assert rows[1].status == "ok" and "bitwise equal, as required" in rows[1].note


@pytest.mark.parametrize("why,rows,same,shared", [
    ("an input differed", [_row(f"{M}.input", 1e-9), _row(f"{M}.output", 1e-3)], SAME, {0}),
    ("the adapter did not mark the module", [_row(f"{M}.input", 0.0), _row(f"{M}.output", 1e-3)], set(), {0}),
    ("the step did not start from shared parameters",
     [_row(f"{M}.input", 0.0, step=1), _row(f"{M}.output", 1e-3, step=1)], SAME, {0}),
    ("no input record", [_row(f"{M}.output", 1e-3)], SAME, {0}),
    ("a statistics-only input proves nothing",
     [_row(f"{M}.input", 0.0, max_abs=math.nan), _row(f"{M}.output", 1e-3)], SAME, {0}),
    ("backward records", [_row(f"{M}.input", 0.0, phase="bwd"), _row(f"{M}.output", 1e-3, phase="bwd")], SAME, {0}),
])
def test_not_applied(why, rows, same, shared):
    apply_exactness(rows, same, shared)
    assert rows[-1].status == "ok", why


def test_every_input_must_match():
    rows = [_row(f"{M}.input.0", 0.0), _row(f"{M}.input.1", 2e-9), _row(f"{M}.output", 1e-3)]
    apply_exactness(rows, SAME, {0})
    assert rows[-1].status == "ok"
