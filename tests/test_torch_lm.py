"""The plain-PyTorch transformer LM of ``examples/torch_lm.py``: a bf16 reference (in this
process, 3 noise samples) and 2-rank gloo DDP candidates (one launch: clean, and rank 1's loss
scaled by 2), traced once for the module. Every op of the run must be perturbed, exact or
the optimizer's (no unmodelled op), the clean candidate consistent, the bug divergent at rank
1's first gradient."""
from __future__ import annotations

import pytest

from examples import torch_lm as ex
from tracer.compare.check import compare


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch_lm")
    info = ex.trace(out, steps=2, samples=3, in_process_reference=True)
    return out, info


def test_every_op_is_modelled(lm):
    _, info = lm
    census = info["census"]
    assert info["unmodelled"] == {} and census["unmodelled"] == {} and census["accepted"] == {}
    assert {"torch.nn.functional.scaled_dot_product_attention", "torch.nn.functional.cross_entropy",
            "torch.nn.functional.linear", "torch.nn.functional.layer_norm", "torch.nn.functional.gelu",
            "torch.Tensor.add"} <= set(census["perturbed"])
    assert "torch.nn.functional.embedding" in census["exact"]
    assert {"torch.Tensor.lerp_", "torch.Tensor.addcdiv_", "torch.Tensor.sqrt"} <= set(census["optimizer"])


def test_clean_candidate_is_consistent(lm):
    out, _ = lm
    c = compare(out / "ref", out / "ddp")
    assert c.verdict == "consistent", (c.first, c.localisation, c.coverage)
    assert set(c.counts()) == {"ok"} and not c.unmatched
    assert 0 < c.max_ratio_ok < 1  # step 1 differs by round-off (the grads' accumulation order)
    assert c.coverage.recorded and c.coverage.unmodelled == {} and c.coverage.downstream == 0
    print(f"\nclean: {len(c.rows)} tensors, largest error/threshold {c.max_ratio_ok:.3g}")


def test_loss_scaled_on_one_rank_is_detected(lm):
    out, _ = lm
    c = compare(out / "ref", out / "bug")
    f = c.first
    assert c.verdict == "DIVERGENT" and f is not None
    assert {"step": f.step, "phase": f.phase, "microbatch": f.microbatch} == ex.EXPECTED_BUG
    assert f.ratio > 10 and f.worst_ranks == [1]
    assert c.localisation.startswith("the loss (or its gradient) is scaled wrongly"), c.localisation
    assert "times ~2" in c.localisation  # rank 1's half of the batch carries twice its gradient
    print(f"\nbug: first divergence {f.label}, {f.ratio:.3g}x; localisation: {c.localisation}")
