"""Layer tolerance vs two real implementations: a bf16 block on one device and its
tensor-parallel split (TP=2) whose row-parallel partial outputs are summed by a real gloo
all-reduce in bf16. Shared by ``tests/test_propagate.py`` (which asserts on the figures) and
``bench/layer_tolerance.py`` (which prints them).

Per seed it checks the block output against ``layer_tolerance`` (analytic, probabilistic)
and fc2 re-run tensor-parallel on the reference's fc2 input (localisation) against the
tolerance of fc2 alone; for one extra seed rank 0 scales its fc2 partial by ``1 + 8u``
(the negative control).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from examples.gloo import run_gloo
from examples.transformer_block import Block, TensorParallelBlock, _attention
from ttrace_num.propagate import layer_tolerance, tensor_parallel_policy

HIDDEN, HEADS, SEQ = 256, 4, 128
U_BF16 = 2.0 ** -8
TP_POLICY = tensor_parallel_policy(["proj", "fc2"], tp=2, reduce_fmt="bf16")


def block_input(seed: int) -> torch.Tensor:
    return torch.randn(SEQ, HIDDEN, generator=torch.Generator().manual_seed(10_000 + seed)).bfloat16()


def mlp_hidden(block: Block, x: torch.Tensor) -> torch.Tensor:
    """The reference's input to fc2 (single device)."""
    with torch.no_grad():
        r1 = x + block.proj(_attention(block.qkv(block.ln1(x)), block.heads, block.dh))
        return F.gelu(block.fc1(block.ln2(r1)))


def tp_worker(rank: int, world: int, seeds: int, corrupt_seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per seed: this rank's TP block output, and fc2 alone run tensor-parallel on the
    reference's fc2 input. For ``corrupt_seed`` rank 0 scales its fc2 partial by (1 + 8u)."""
    outs = []
    for s in range(seeds + 1):
        block = Block(HIDDEN, HEADS, seed=s)
        tp = TensorParallelBlock(block, world, rank)
        if s == corrupt_seed and rank == 0:
            orig = tp.fc2.forward
            tp.fc2.forward = lambda t: orig(t) * (1 + 8 * U_BF16)
        with torch.no_grad():
            y = tp(block_input(s))
            g = mlp_hidden(block, block_input(s)).chunk(world, dim=-1)[rank]
            outs.append((y, tp.all_reduce(tp.fc2(g))))
    return outs


def fc2_tolerance(block: Block, x: torch.Tensor):
    """Tolerance of fc2 alone on the reference's fc2 input, TP=2 row-parallel vs one device."""
    return layer_tolerance(block.fc2, mlp_hidden(block, x), policy=tensor_parallel_policy(["*"], tp=2),
                           against_exact=False)


@dataclass
class Figures:
    seeds: int
    violations: int            # block outputs + localised fc2 outputs over their bounds
    ratios: list[float]        # per seed: max bound / max observed difference (block output)
    observed_max: float
    tolerance_max: float
    corrupt_flagged_fraction: float  # negative control: fc2 elements over the bound

    def summary(self) -> str:
        return (f"{self.seeds} seeds: violations {self.violations}; tolerance/observed (block output) "
                f"median {statistics.median(self.ratios):.2f}, max {max(self.ratios):.2f}; largest observed "
                f"difference {self.observed_max:.4g}, largest tolerance {self.tolerance_max:.4g}; "
                f"(1+8u) partial flagged at {100 * self.corrupt_flagged_fraction:.1f}% of fc2 elements")


def run(seeds: int = 100) -> Figures:
    outs = run_gloo(tp_worker, 2, seeds, seeds)
    if not all(torch.equal(a[0], b[0]) for a, b in zip(outs[0], outs[1])):
        raise AssertionError("TP ranks disagree after the all-reduce")
    runs = outs[0]
    viol, ratios, obs_max, tol_max = 0, [], 0.0, 0.0
    for s in range(seeds):
        block, x = Block(HIDDEN, HEADS, seed=s), block_input(s)
        lb = layer_tolerance(block, x, policy=TP_POLICY, against_exact=False)
        diff = (lb.outputs[0].double() - runs[s][0].double()).abs()
        viol += int((diff > lb.bound).sum())
        local = fc2_tolerance(block, x)
        viol += int(((local.outputs[0].double() - runs[s][1].double()).abs() > local.bound).sum())
        ratios.append(float(lb.bound.max()) / max(float(diff.max()), 1e-300))
        obs_max, tol_max = max(obs_max, float(diff.max())), max(tol_max, float(lb.bound.max()))
    block = Block(HIDDEN, HEADS, seed=seeds)
    local = fc2_tolerance(block, block_input(seeds))
    over = (local.outputs[0].double() - runs[seeds][1].double()).abs() > local.bound
    return Figures(seeds, viol, ratios, obs_max, tol_max, float(over.float().mean()))
