"""Layer tolerance: analytic composition (error shadow) and empirical noise injection.

The two-implementation check runs the reference block on one device and its tensor-parallel
split (TP=2, row-parallel partial outputs summed by a real gloo all-reduce in bf16) over
many seeds in ONE spawn of the gloo workers.
"""
import torch
import torch.distributed as dist
import pytest

from examples.transformer_block import Block, TensorParallelBlock, _attention
from ttrace_num.propagate import layer_tolerance, tensor_parallel_policy
from ttrace_num.propagate.noise import measure_propagation

from _gloo import run_gloo

HIDDEN, HEADS, SEQ, SEEDS = 256, 4, 128, 100
U_BF16 = 2.0 ** -8
TP_POLICY = tensor_parallel_policy(["proj", "fc2"], tp=2, reduce_fmt="bf16")


def _input(seed: int) -> torch.Tensor:
    return torch.randn(SEQ, HIDDEN, generator=torch.Generator().manual_seed(10_000 + seed)).bfloat16()


def _mlp_hidden(block: Block, x: torch.Tensor) -> torch.Tensor:
    """The reference's input to fc2 (single device)."""
    with torch.no_grad():
        r1 = x + block.proj(_attention(block.qkv(block.ln1(x)), block.heads, block.dh))
        return torch.nn.functional.gelu(block.fc1(block.ln2(r1)))


def _tp_worker(rank: int, world: int, seeds: int, corrupt_seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per seed: this rank's TP=2 block output, and fc2 alone run tensor-parallel on the
    reference's fc2 input (the localisation check). For ``corrupt_seed`` rank 0 scales its
    fc2 partial sum by (1 + 8u) before the all-reduce (the negative control)."""
    outs = []
    for s in range(seeds + 1):
        block = Block(HIDDEN, HEADS, seed=s)
        tp = TensorParallelBlock(block, world, rank)
        corrupt = 1 + 8 * U_BF16 if (s == corrupt_seed and rank == 0) else 1.0
        if corrupt != 1.0:
            orig = tp.fc2.forward
            tp.fc2.forward = lambda t: orig(t) * corrupt
        with torch.no_grad():
            y = tp(_input(s))
            g = _mlp_hidden(block, _input(s)).chunk(world, dim=-1)[rank]
            fc2 = tp.all_reduce(tp.fc2(g))
        outs.append((y, fc2))
    return outs


@pytest.fixture(scope="module")
def tp_runs():
    outs = run_gloo(_tp_worker, 2, SEEDS, SEEDS)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(outs[0], outs[1])), "TP ranks disagree after the all-reduce"
    return outs[0]


@pytest.fixture(scope="module")
def figures(tp_runs):
    viol, ratios, obs_max, tol_max = 0, [], 0.0, 0.0
    for s in range(SEEDS):
        block = Block(HIDDEN, HEADS, seed=s)
        x = _input(s)
        lb = layer_tolerance(block, x, policy=TP_POLICY)
        diff = (lb.outputs[0].double() - tp_runs[s][0].double()).abs()
        viol += int((diff > lb.bound).sum())
        # every submodule output inside the block holds too (fc2 is checked by localisation below)
        local = _local_fc2(block, x)
        viol += int(((local.outputs[0].double() - tp_runs[s][1].double()).abs() > local.bound).sum())
        ratios.append(float(lb.bound.max()) / max(float(diff.max()), 1e-300))
        obs_max, tol_max = max(obs_max, float(diff.max())), max(tol_max, float(lb.bound.max()))
    return dict(violations=viol, ratios=ratios, obs_max=obs_max, tol_max=tol_max)


def test_tp_block_never_exceeds_the_layer_tolerance(figures):
    assert figures["violations"] == 0


def test_tp_block_tolerance_is_tight(figures):
    # the tolerance is at most 10x the largest observed difference (issue 5)
    assert max(figures["ratios"]) <= 10.0, figures["ratios"]


def _local_fc2(block: Block, x: torch.Tensor):
    """Tolerance of fc2 alone on the reference's fc2 input, TP=2 row-parallel vs single device."""
    return layer_tolerance(block.fc2, _mlp_hidden(block, x), policy=tensor_parallel_policy(["*"], tp=2))


def test_scaled_partial_sum_is_flagged(tp_runs):
    """Rank 0's fc2 partial scaled by (1 + 8u) is flagged when fc2 is re-run on the reference's
    input (localisation: only fc2's own rounding is legitimate there). At the block output it
    is not: the legitimate differences carried from upstream are as large as 3% of one partial."""
    s = SEEDS
    block = Block(HIDDEN, HEADS, seed=s)
    local = _local_fc2(block, _input(s))
    over = (local.outputs[0].double() - tp_runs[s][1].double()).abs() > local.bound
    assert over.float().mean() > 0.01


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
