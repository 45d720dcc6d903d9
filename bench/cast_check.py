"""Cost of the ``cast`` check (``tracer.capture.optim_state.cast_mismatches``) against the Adam update
it follows, on parameters of a given total size.

    python -m bench.cast_check                 # 54M parameters (the xl model's), ~30 s
    python -m bench.cast_check --params 1e6

Builds bf16 model parameters with fp32 main copies (``p.main_param``, megatron's
``Float16OptimizerWithFloat16Params`` layout: 12 matrices of 4M, 40 vectors of 1024, the rest
in one tensor), steps them with ``torch.optim.Adam`` and prints the median of 5 timed calls
(after 2 warm-up calls) of (a) the cast check over every parameter and (b) the Adam update
plus the main-to-model copy. Wall times on a shared machine move with its load: compare runs.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tracer.capture.optim_state import cast_mismatches  # noqa: E402


def _median_seconds(fn, reps: int = 5, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=54e6, help="total number of parameters")
    n = int(ap.parse_args(argv).params)
    sizes: list[int] = []
    for s in [1 << 22] * 12 + [1024] * 40:
        if sum(sizes) + s <= n:
            sizes.append(s)
    if n > sum(sizes):
        sizes.append(n - sum(sizes))
    g = torch.Generator().manual_seed(0)
    mains = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in sizes]
    models = [m.detach().bfloat16() for m in mains]
    for m, p in zip(mains, models):
        m.grad = torch.randn(m.shape, generator=g) * 1e-3
        p.main_param = m
    opt = torch.optim.Adam(mains, lr=1e-3)

    def update() -> None:
        opt.step()
        for m, p in zip(mains, models):
            p.copy_(m.detach())

    def check() -> int:
        return sum(cast_mismatches(opt, p)[0] for p in models)

    update()
    assert check() == 0
    t_check, t_update = _median_seconds(check), _median_seconds(update)
    print(f"{sum(sizes) / 1e6:.1f}M parameters in {len(sizes)} tensors: cast check {t_check * 1e3:.1f} ms, "
          f"Adam update + copy {t_update * 1e3:.1f} ms, ratio {t_check / t_update:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
