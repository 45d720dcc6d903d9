"""Localisation by re-running a module on the candidate's inputs (tracer.compare.localise).

A bf16 transformer block is the reference module. Three candidates:
* a wrong module (fc2 weight off by 2^-5) on the reference's inputs -> "module is wrong";
* the correct module on inputs that already differ (a propagated difference) -> "right";
* a legitimately different computation (fc2's reduction split in two bf16 partials, as a
  TP=2 row-parallel linear computes it) -> "right", with the TP noise policy;
* half of the output rescaled by 1 + 2^-7 -> "right" by the norm alone
  (``block_scale=False``), "wrong" with the block-scale statistic (the default).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from examples.transformer_block import Block
from tracer.compare.localise import rerun_module, split_inputs
from tracer.adapters.megatron import noise_policy


def _block():
    torch.manual_seed(0)
    return Block(hidden=64, heads=4, dtype=torch.bfloat16, seed=3), torch.randn(32, 64).bfloat16()


def _split_fc2_forward(block: Block, x: torch.Tensor) -> torch.Tensor:
    """The block with fc2 computed as two K-halves rounded to bf16 and summed in bf16."""
    from examples.transformer_block import _attention
    x = x + block.proj(_attention(block.qkv(block.ln1(x)), block.heads, block.dh))
    h = F.gelu(block.fc1(block.ln2(x)))
    w, k = block.fc2.weight, h.shape[-1] // 2
    return x + (F.linear(h[:, :k], w[:, :k]) + F.linear(h[:, k:], w[:, k:]))


def test_wrong_module_is_blamed():
    block, x = _block()
    bad = Block(hidden=64, heads=4, dtype=torch.bfloat16, seed=3)
    with torch.no_grad():
        bad.fc2.weight.mul_(1 + 2 ** -5)
        y_c = bad(x)
    v = rerun_module(block, "block", [x], {}, y_c, policy=noise_policy(2, "bf16"))
    assert v.module_is_wrong, v
    assert "itself is wrong" in str(v)


def test_propagated_difference_is_not_blamed_on_the_module():
    block, x = _block()
    x_c = (x.double() * (1 + 1e-2 * torch.randn_like(x.double()))).bfloat16()
    with torch.no_grad():
        y_c = block(x_c)
    v = rerun_module(block, "block", [x_c], {}, y_c, policy=noise_policy(2, "bf16"))
    assert not v.module_is_wrong and v.local_error == 0.0, v


def test_legitimate_split_reduction_is_within_threshold():
    block, x = _block()
    with torch.no_grad():
        y_c = _split_fc2_forward(block, x)
        assert not torch.equal(y_c, block(x))  # a real (legitimate) difference
    v = rerun_module(block, "block", [x], {}, y_c, policy=noise_policy(2, "bf16"))
    assert not v.module_is_wrong, v
    assert 0 < v.ratio < 1


def test_a_rescaled_half_of_the_output_is_blamed_by_the_block_scale_statistic():
    """Half the output's columns scaled by 1 + 2^-7: inside the norm's threshold, over the
    block-scale statistic's (as tracer.compare.check would have flagged it)."""
    block, x = _block()
    with torch.no_grad():
        y_c = block(x)
        y_c[:, :32] = (y_c[:, :32].double() * (1 + 2.0 ** -7)).bfloat16()
    assert not rerun_module(block, "block", [x], {}, y_c, policy=noise_policy(2, "bf16"),
                            block_scale=False).module_is_wrong
    v = rerun_module(block, "block", [x], {}, y_c, policy=noise_policy(2, "bf16"))
    assert v.local_error < v.threshold and v.scale_error > 1.5 * v.scale_threshold, v
    assert v.module_is_wrong and "block-scale statistic" in str(v)


def test_split_inputs_rebuilds_the_call():
    a, b, m = torch.ones(2), torch.zeros(2), torch.ones(1)
    args, kwargs = split_inputs({"L.input.0": a, "L.input.1": b, "L.input.attention_mask": m}, "L")
    assert args == [a, b] and kwargs == {"attention_mask": m}
    args, kwargs = split_inputs({"L.input": a}, "L")
    assert args == [a] and not kwargs
    try:
        split_inputs({"L.input.0": a, "L.input.2": b}, "L")
    except ValueError as e:
        assert "not contiguous" in str(e)
    else:
        raise AssertionError("a gap in the positional inputs must be refused")
