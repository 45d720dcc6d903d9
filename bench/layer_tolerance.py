"""Layer tolerance figures: TP=2 validation on real gloo, analytic vs empirical, and cost.

    python bench/layer_tolerance.py [--seeds 100] [--samples 8]

1. ``examples.tp_layer_check.run``: a bf16 block (hidden 256, 4 heads, seq 128) on one device
   vs its TP=2 split with a real gloo bf16 all-reduce: violations, tolerance / observed.
2. Analytic (probabilistic error shadow) vs empirical (noise injection, ``--samples`` runs)
   on the same block and policy: per submodule output, the analytic bound over the largest
   empirical deviation (how much more the analytic bound allows than noise of local-bound
   size actually produces), and the empirical deviation of the weight gradients.
3. Cost: the analytic bound and one noisy sample, each over one plain forward (+backward).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from examples import tp_layer_check as tlc  # noqa: E402
from examples.transformer_block import Block  # noqa: E402
from ttrace_num.propagate import layer_tolerance  # noqa: E402
from ttrace_num.propagate.noise import measure_propagation  # noqa: E402


def analytic_vs_empirical(seed: int, samples: int) -> None:
    block, x = Block(tlc.HIDDEN, tlc.HEADS, seed=seed), tlc.block_input(seed)
    lb = layer_tolerance(block, x, policy=tlc.TP_POLICY, against_exact=False)
    captured: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda _m, _i, o, n=n: captured.__setitem__(n, o))
             for n, m in block.named_modules() if n]

    def run():
        captured.clear()
        block.zero_grad()
        y = block(x)
        y.float().sum().backward()
        out = {"out": y.detach(), **{f"{k}": v.detach() for k, v in captured.items()}}
        out.update({f"grad.{n}": p.grad.detach().clone() for n, p in block.named_parameters()})
        return out

    prop = measure_propagation(run, samples=samples, policy=tlc.TP_POLICY)
    for h in hooks:
        h.remove()
    print(f"\nseed {seed}: analytic bound / largest empirical deviation ({samples} noisy runs)")
    print(f"  {'tensor':<14} {'analytic max':>12} {'empirical max':>13} {'ratio':>7}")
    for name in ["ln1", "qkv", "proj", "ln2", "fc1", "fc2", "out"]:
        bound = lb.bound if name == "out" else lb.module_bounds[name]
        dev = prop.deviation[name]
        ratio = float(bound.max()) / max(float(dev.max()), 1e-300)
        print(f"  {name:<14} {float(bound.max()):>12.4g} {float(dev.max()):>13.4g} {ratio:>7.2f}")
    print("  weight gradients, largest empirical deviation (no analytic backward composition yet):")
    for n, _ in block.named_parameters():
        print(f"    grad.{n:<16} {float(prop.deviation['grad.' + n].max()):.4g}")
    hooks_cost(block, x)


def hooks_cost(block: Block, x: torch.Tensor) -> None:
    def timed(fn, reps=3):
        fn()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) / reps

    def fwd_bwd():
        block.zero_grad()
        block(x).float().sum().backward()
    plain = timed(fwd_bwd)
    analytic = timed(lambda: layer_tolerance(block, x, policy=tlc.TP_POLICY, against_exact=False))
    noisy = timed(lambda: measure_propagation(lambda: (fwd_bwd(), {"o": x})[1], samples=1))
    print(f"\ncost: forward+backward {plain * 1e3:.1f} ms; analytic bound {analytic / plain:.1f}x; "
          f"one empirical sample (clean + noisy run) {noisy / plain:.1f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=100)
    ap.add_argument("--samples", type=int, default=8)
    args = ap.parse_args(argv)
    t = time.time()
    figs = tlc.run(args.seeds)
    print(figs.summary())
    print(f"tolerance/observed quartiles: {statistics.quantiles(figs.ratios, n=4)} ({time.time() - t:.0f} s)")
    analytic_vs_empirical(0, args.samples)
    return 0 if figs.violations == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
