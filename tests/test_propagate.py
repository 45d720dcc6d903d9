"""Layer tolerance: analytic composition (error shadow) and empirical noise injection.

The two-implementation check runs the reference block on one device and its tensor-parallel
split (TP=2, row-parallel partial outputs summed by a real gloo all-reduce in bf16) over
many seeds in ONE spawn of the gloo workers.
"""
import pytest
import torch

from examples import tp_layer_check
from examples.transformer_block import Block
from ttrace_num.propagate import layer_tolerance
from ttrace_num.propagate.noise import measure_propagation

SEEDS = 100


@pytest.fixture(scope="module")
def figures():
    return tp_layer_check.run(SEEDS)


def test_tp_block_never_exceeds_the_layer_tolerance(figures):
    assert figures.violations == 0


def test_tp_block_tolerance_is_tight(figures):
    # the tolerance is at most 10x the largest observed difference, in every seed (issue 5)
    assert max(figures.ratios) <= 10.0, figures.summary()


def test_scaled_partial_sum_is_flagged(figures):
    """Rank 0's fc2 partial scaled by (1 + 8u) is flagged when fc2 is re-run on the reference's
    input (localisation: only fc2's own rounding is legitimate there). At the block output it
    is not: the legitimate differences carried from upstream are as large as 3% of one partial."""
    assert figures.corrupt_flagged_fraction > 0.01, figures.summary()


def _input(seed: int) -> torch.Tensor:
    return tp_layer_check.block_input(seed)


def _exact_block_output(block: Block, x: torch.Tensor) -> torch.Tensor:
    """The block on the same stored (bf16) weights in float64: exact to ~1e-16 relative, 10^13
    below the bf16 bounds checked here (a float64 reference is accurate enough for a composed
    layer; the per-op bounds are checked against mpmath/fsum references in their own tests)."""
    exact = Block(block.hidden, block.heads, seed=0, dtype=torch.float64)
    exact.load_state_dict({k: v.double() for k, v in block.state_dict().items()})
    with torch.no_grad():
        return exact(x.double())


@pytest.mark.parametrize("mode", ["deterministic", "probabilistic"])
def test_against_exact_composition_holds(mode):
    block = Block(64, 4, seed=3)
    x = _input(0)[:32, :64].contiguous()
    lb = layer_tolerance(block, x, against_exact=True, mode=mode)
    err = (lb.outputs[0].double() - _exact_block_output(block, x)).abs()
    assert (err <= lb.bound).all()
    if mode == "probabilistic":
        # quadrature composition is tight: the worst element uses > 1/10 of its bound
        assert float((lb.bound / err.clamp_min(1e-300)).min()) < 10.0


def test_unsupported_op_is_named_with_its_module():
    class Weird(torch.nn.Module):
        def forward(self, x):
            return torch.exp(x)
    with pytest.raises(NotImplementedError, match="exp"):
        layer_tolerance(Weird(), torch.randn(4, 4))


def test_empirical_propagation_stays_within_the_analytic_bound():
    block = Block(64, 4, seed=5)
    x = _input(1)[:32, :64].contiguous()
    lb = layer_tolerance(block, x, against_exact=True, mode="deterministic")
    prop = measure_propagation(lambda: {"out": block(x)}, samples=4, against_exact=True)
    dev = prop.deviation["out"]
    assert prop.perturbed_ops > 10
    assert (dev <= 2 * lb.bound).all()  # a noisy run and the clean run are each within the bound of exact
    assert dev.max() > 0


@pytest.mark.parametrize("which", ["layer_norm", "rms_norm", "softmax"])
def test_quadrature_rules_equal_the_squared_jacobian(which):
    """The *_sq rules compute sum_j J_ij^2 w_j exactly: compare with autograd's Jacobian."""
    import ttrace_num.propagate.jacobian as J
    g = torch.Generator().manual_seed(0)
    n = 16
    x = torch.randn(3, n, generator=g, dtype=torch.float64)
    w = torch.rand(3, n, generator=g, dtype=torch.float64)
    gamma = torch.randn(n, generator=g, dtype=torch.float64)
    fns = {
        "layer_norm": (lambda v: torch.nn.functional.layer_norm(v, (n,), gamma, None, 1e-5),
                       lambda: J.layer_norm_sq(x, (n,), gamma, w, None, None, 1e-5)),
        "rms_norm": (lambda v: torch.nn.functional.rms_norm(v, (n,), gamma, 1e-6),
                     lambda: J.rms_norm_sq(x, (n,), gamma, w, None, 1e-6)),
        "softmax": (lambda v: torch.softmax(v, -1), lambda: J.softmax_sq(torch.softmax(x, -1), w, -1)),
    }
    f, sq = fns[which]
    ref = torch.stack([(torch.autograd.functional.jacobian(f, x[r]) ** 2) @ w[r] for r in range(3)])
    assert torch.allclose(sq(), ref, rtol=1e-12, atol=1e-15)


# ------------------------------------------------------------ LayerBound as a first-class bound
def _small_block():
    block = Block(hidden=32, heads=2, seed=3)
    return block, torch.randn(8, 32, generator=torch.Generator().manual_seed(3)).bfloat16()


def test_layer_bound_is_a_bound_for_assert_close_explain_and_atol_rtol():
    import copy

    import ttrace_num as tn
    from ttrace_num.testing import BoundViolation, assert_close
    block, x = _small_block()
    lb = layer_tolerance(block, x)
    assert isinstance(lb, tn.Bound) and lb.against_exact and lb.abs is lb.bound
    y, exact = block(x), copy.deepcopy(block).double()(x.double())
    assert_close(y, exact, bound=lb)  # was: TypeError: must be real number, not LayerBound
    text = lb.explain()
    assert "bounds one run against the exact result" in text and "local max" in text and "fc2" in text
    assert lb.max() == float(lb.abs.max())
    atol, rtol = lb.atol_rtol()
    assert (lb.abs <= atol + rtol * exact.abs() * (1 + 2.0 ** -7) + 1e-300).all()
    with pytest.raises(BoundViolation, match="exceed the bound .*layer"):
        assert_close(y.double() + 2 * lb.abs, exact, bound=lb)


def test_against_exact_defaults_to_one_run_and_a_policy_needs_two_runs():
    from ttrace_num.propagate import tensor_parallel_policy
    block, x = _small_block()
    one = layer_tolerance(block, x, mode="deterministic")
    assert torch.equal(one.abs, layer_tolerance(block, x, mode="deterministic", against_exact=True).abs)
    two = layer_tolerance(block, x, mode="deterministic", against_exact=False)
    assert (two.abs >= one.abs).all() and (two.abs > one.abs).any()
    assert "two correct runs" in two.explain()
    policy = tensor_parallel_policy(["proj"], tp=2)
    with pytest.raises(ValueError, match="pass against_exact=False"):
        layer_tolerance(block, x, policy=policy, against_exact=True)
    assert not layer_tolerance(block, x, policy=policy).against_exact
    with pytest.raises(TypeError, match="against_exact must be True"):
        layer_tolerance(block, x, against_exact="yes")
