"""Command line: train the tiny megatron GPT for a few layouts and print losses/grad norms.

    python -m examples.megatron_cpu.run --steps 3 --world 4 --layout tp2.pp2.sp --layout tp2.dp2.distopt
"""
from __future__ import annotations

import argparse
import time

from examples.gloo import run_gloo
from examples.megatron_cpu.gpt import build_and_train


def parse_layout(s: str) -> dict:
    """``tp2.pp2.dp1.sp.distopt`` -> layout dict (missing sizes are 1)."""
    out = {"tp": 1, "pp": 1, "dp": 1, "sp": False, "distopt": False}
    for part in s.split("."):
        if part in ("sp", "distopt"):
            out[part] = True
        elif part[:2] in ("tp", "pp", "dp"):
            out[part[:2]] = int(part[2:])
        elif part:
            raise ValueError(f"bad layout part {part!r}")
    return out


def _work(rank, world, layouts, steps, seed, dtype):
    import warnings
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    return [build_and_train(lay, steps=steps, seed=seed, dtype=dtype) for lay in layouts]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--layout", action="append", default=None)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    a = ap.parse_args(argv)
    layouts = [parse_layout(s) for s in (a.layout or ["tp1"])]
    for lay in layouts:  # fill dp so that tp*pp*dp == world
        if lay["tp"] * lay["pp"] * lay["dp"] != a.world:
            lay["dp"] = a.world // (lay["tp"] * lay["pp"])
    t = time.perf_counter()
    res = run_gloo(_work, a.world, layouts, a.steps, a.seed, a.dtype)
    print(f"launch: {time.perf_counter() - t:.1f} s (world {a.world})")
    for i, lay in enumerate(layouts):
        r = res[0][i]
        print(f"{r['layout']['name']:24s} losses={[f'{float(x):.8f}' for x in r['losses']]} "
              f"grad_norms={[f'{g:.8f}' for g in r['grad_norms']]} "
              f"step_s={sum(r['step_s']) / len(r['step_s']):.3f}")


if __name__ == "__main__":
    main()
