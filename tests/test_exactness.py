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


CPU = {"cpu_capability": "avx2", "cuda": None, "deterministic": False, "cublas_workspace_config": None}
GPU = {"cpu_capability": "avx2", "cuda": "12.8", "deterministic": True, "cublas_workspace_config": ":4096:8"}


@pytest.mark.parametrize("ref,cand,reason", [
    ({"torch_version": "2.13.0", "kernels": CPU}, {"torch_version": "2.13.0", "kernels": CPU}, None),
    ({"torch_version": "2.13.0", "kernels": GPU}, {"torch_version": "2.13.0", "kernels": GPU}, None),
    ({"torch_version": "2.13.0"}, {"torch_version": "2.13.0", "kernels": CPU}, "older version"),
    ({"torch_version": "2.12.0", "kernels": CPU}, {"torch_version": "2.13.0", "kernels": CPU}, "torch 2.12.0"),
    ({"torch_version": "2.13.0", "kernels": CPU}, {"torch_version": "2.13.0", "kernels": {**CPU, "cpu_capability": "avx512"}},
     "CPU dispatch"),
    ({"torch_version": "2.13.0", "kernels": CPU}, {"torch_version": "2.13.0", "kernels": GPU}, "CUDA None"),
    ({"torch_version": "2.13.0", "kernels": GPU}, {"torch_version": "2.13.0", "kernels": {**GPU, "deterministic": False}},
     "use_deterministic_algorithms"),
])
def test_kernels_differ(ref, cand, reason):
    from tracer.compare.exactness import kernels_differ
    got = kernels_differ(ref, cand)
    assert (got is None) if reason is None else (reason in got), got


def test_run_file_records_the_kernel_settings(tmp_path):
    import torch

    from tracer.trace.store import TraceReader, TraceWriter
    w = TraceWriter(tmp_path, 0, 1, {"tp": 1}, "sig")
    w.add("x", torch.ones(2), phase="fwd", step=0)
    w.flush_step(0)
    k = TraceReader(tmp_path).run["kernels"]
    assert k["cpu_capability"] == torch.backends.cpu.get_cpu_capability().lower() and k["cuda"] is None
