"""Capture ``cast``: the model parameters must be the round-to-nearest cast of their fp32 main
copies, an invariant checked exactly (the noise samples do not apply), which catches a copy
that rounds otherwise although each element moves by one ulp, below the ``param`` threshold."""
from __future__ import annotations

import math

import torch

from tracer.compare.check import compare
from tracer.capture.optim_state import cast_mismatches
from tracer.trace.schema import INVARIANT_PHASES
from tracer.trace.store import TraceWriter


def _truncated(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) rounded toward zero to bf16, exactly (the low 16 bits cleared)."""
    return (x.view(torch.int32) & -65536).view(torch.float32).bfloat16()


def _mixed_precision(model_values: torch.Tensor, main: torch.Tensor) -> tuple[torch.optim.Optimizer, torch.Tensor]:
    """A bf16 model parameter with an fp32 main copy stepped by Adam (megatron's
    ``Float16OptimizerWithFloat16Params`` layout: ``p.main_param``)."""
    main = torch.nn.Parameter(main)
    p = torch.nn.Parameter(model_values)
    p.main_param = main
    return torch.optim.Adam([main], lr=1e-3), p


def test_a_round_to_nearest_copy_has_no_mismatch_and_a_truncating_one_is_counted():
    main = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    opt, p = _mixed_precision(main.bfloat16(), main.clone())
    assert cast_mismatches(opt, p) == (0, 4096)
    opt, p = _mixed_precision(_truncated(main), main.clone())
    expected = int((_truncated(main) != main.bfloat16()).sum())  # where round-to-nearest rounds up in magnitude
    assert 1500 < expected < 2600  # about half the elements
    assert cast_mismatches(opt, p) == (expected, 4096)
    assert cast_mismatches(opt, p, chunk=1000) == (expected, 4096)  # five chunks, the last one short
    with torch.no_grad():
        p[1000:2000] = main[1000:2000].bfloat16()  # one chunk right: the others' counts only
    assert cast_mismatches(opt, p, chunk=1000) == (expected - int((_truncated(main[1000:2000]) != main[1000:2000]
                                                                   .bfloat16()).sum()), 4096)


def test_nans_at_the_same_place_are_equal_and_a_parameter_stepping_itself_has_nothing_to_check():
    main = torch.tensor([1.0, math.nan, 3.0])
    opt, p = _mixed_precision(main.bfloat16(), main.clone())
    assert cast_mismatches(opt, p) == (0, 3)
    q = torch.nn.Parameter(torch.randn(5))
    assert cast_mismatches(torch.optim.Adam([q]), q) == (0, 5)  # its own main copy
    frozen = torch.nn.Parameter(torch.randn(3), requires_grad=False)  # in no param group: nothing to check
    assert cast_mismatches(torch.optim.Adam([q]), frozen) is None


def _trace(root, counts: list[int], samples: list[int] = ()) -> None:
    """One step's ``cast`` record (a reference with noise samples, or a candidate)."""
    for i, (sub, n) in enumerate([(root, counts)] + [(root / "noise" / f"sample_{j}", [s])
                                                     for j, s in enumerate(samples)]):
        w = TraceWriter(sub, 0, 1, {"tp": 1}, "sig", run_id=f"{root.name}{i}")
        w.add("optimizer.main_param_cast", torch.tensor(n[0], dtype=torch.int64), phase="cast", step=0,
              meta={"checked": 10, "differing": [["w", n[0], 10]] if n[0] else []})
        w.add("w", torch.ones(10), phase="param", step=0)
        w.flush_step(0)
        w.close()


def test_the_cast_record_is_compared_exactly_whatever_the_noise_samples_did(tmp_path):
    assert INVARIANT_PHASES == {"cast"}
    # the samples perturb the model parameters' rounding by design, so their counts are not 0
    _trace(tmp_path / "ref", [0], samples=[5, 6])
    _trace(tmp_path / "same", [0])
    _trace(tmp_path / "off", [1])
    assert compare(tmp_path / "ref", tmp_path / "same").first is None
    c = compare(tmp_path / "ref", tmp_path / "off")
    assert (c.first.phase, c.first.status, c.first.threshold, c.first.ratio) == ("cast", "over", 0.0, math.inf)
    assert "round-to-nearest cast" in c.localisation and "w (1 of 10 elements)" in c.localisation
