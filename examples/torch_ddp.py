"""Traced comparison of a plain PyTorch DDP run against its single-device reference.

    python examples/torch_ddp.py [--steps 3] [--dtype fp32 bf16] [--bug] [--out DIR]

Model: a pre-norm transformer :class:`examples.transformer_block.Block` (hidden 32, 2 heads)
and a linear head, MSE loss, Adam. A fixed global batch of ``GLOBAL_MICROBATCHES`` sequences
per step is split into microbatches of one sequence:

* reference: 1 process runs all of them with gradient accumulation, traced with
  :class:`tracer.adapters.ddp.DDPTracer` (``dp=1``); every step is first re-run 3 times under
  the noise injector (:class:`tracer.capture.noise_sampler.NoiseSampler`, probabilistic mode), which
  gives the thresholds;
* candidate: ``torch.nn.parallel.DistributedDataParallel`` over 2 gloo ranks, each running
  half of the microbatches (``no_sync`` for all but the last), traced with ``DDPTracer``.

:func:`train_step` is the whole integration: a plain DDP training step plus the lines marked
``# trace`` (docs/tracing-pytorch.md). Both runs call it.

``--bug``: the candidate's rank 1 keeps its *local* gradient of ``BUG_PARAM`` instead of the
all-reduced one (a DDP communication hook that restores that parameter's slice of the bucket
after the all-reduce). Expected first divergence: step 0, phase ``grad``, tensor
``BUG_PARAM``, status ``replicas`` (the DP copies of a replicated tensor differ).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from examples.gloo import run_gloo
from examples.transformer_block import Block
from tracer.adapters.ddp import DDPTracer
from tracer.capture.noise_sampler import NoiseSampler
from tracer.trace.store import TraceWriter

__all__ = ["BUG_PARAM", "EXPECTED_BUG", "Net", "candidate_worker", "reference_worker", "train_step"]

DP = 2
GLOBAL_MICROBATCHES = 4  # a power of two: the 1/n loss scaling and 1/dp grad scaling are exact
SEQ, HIDDEN, HEADS, OUT = 16, 32, 2, 8
NOISE_SAMPLES = 3
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BUG_PARAM = "block.ln1.weight"
EXPECTED_BUG = {"step": 0, "phase": "grad", "name": BUG_PARAM, "status": "replicas"}


class Net(nn.Module):
    """``head(Block(x))`` for one sequence ``x`` of shape ``[SEQ, HIDDEN]``."""

    def __init__(self, dtype: torch.dtype, seed: int = 0) -> None:
        super().__init__()
        self.block = Block(HIDDEN, HEADS, dtype=dtype, seed=seed)
        self.head = nn.Linear(HIDDEN, OUT, dtype=dtype)
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(OUT, HIDDEN, generator=g) / HIDDEN ** 0.5)
            self.head.bias.copy_(0.1 * torch.randn(OUT, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def global_batch(step: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The step's ``GLOBAL_MICROBATCHES`` (input, target) pairs, the same in every run."""
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(SEQ, HIDDEN, generator=g).to(dtype), torch.randn(SEQ, OUT, generator=g).to(dtype))
            for _ in range(GLOBAL_MICROBATCHES)]


def train_step(model: nn.Module, opt: torch.optim.Optimizer, mbs: list, tr: DDPTracer, step: int,
               writer: TraceWriter | None = None) -> None:
    """One training step over this rank's microbatches ``mbs``: the integration snippet."""
    n = len(mbs)
    with tr.step(step, writer):                                              # trace
        for i, (x, y) in enumerate(mbs):
            tr.microbatch(i)                                                 # trace
            sync = model.no_sync() if isinstance(model, DDP) and i < n - 1 else contextlib.nullcontext()
            with sync:
                loss = F.mse_loss(model(x), y)
                tr.record_loss(loss)                                         # trace
                (loss / n).backward()
        tr.after_backward()                                                  # trace
        opt.step()
        opt.zero_grad(set_to_none=True)
        tr.after_optimizer_step()                                            # trace


def _build(dtype: str) -> tuple[Net, torch.optim.Optimizer]:
    model = Net(DTYPES[dtype])
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _signature(dtype: str) -> str:
    return f"torch_ddp example: Block({HIDDEN}, {HEADS}) + Linear({OUT}), {dtype}, Adam"


def noise_kwargs(dtype: str, dp: int = DP) -> dict[str, Any]:
    """The injector's model of what the candidate does differently: its parameter gradients
    are partial sums over ``dp`` ranks' microbatches, all-reduced in the parameter dtype."""
    from ttrace_num.bounds.summation import Summation
    return {"grad_summation": Summation(split=dp, reduce_fmt=dtype)}


def reference_worker(rank: int, world: int, jobs: list[dict]) -> list[float]:
    """Single-device references with noise samples; ``jobs``: ``{"root", "dtype", "steps"}``."""
    times = []
    for job in jobs:
        t0 = time.perf_counter()
        torch.manual_seed(0)
        model, opt = _build(job["dtype"])
        lay, sig = {"dp": 1, "dtype": job["dtype"]}, _signature(job["dtype"])
        tr = DDPTracer(model, TraceWriter(job["root"], 0, 1, lay, sig), num_microbatches=GLOBAL_MICROBATCHES)
        ns = NoiseSampler(model, opt, job["root"], layout=lay, signature=sig, samples=NOISE_SAMPLES,
                          injector_kwargs=noise_kwargs(job["dtype"]))
        for step in range(job["steps"]):
            mbs = global_batch(step, DTYPES[job["dtype"]])
            ns.step(step, partial(train_step, model, opt, mbs, tr, step))
        tr.remove()
        times.append(time.perf_counter() - t0)
    return times


def _skip_allreduce_hook(state, bucket):  # no annotations: DDP checks them, and they are strings here
    """The bug: DDP's default all-reduce (mean), except that rank 1 puts its local gradient of
    ``state["param"]`` back afterwards, as if that parameter's all-reduce were skipped."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    buf, keep, off = bucket.buffer(), None, 0
    if dist.get_rank() == 1:
        for p in bucket.parameters():
            if p is state["param"]:
                keep = (off, buf[off:off + p.numel()].clone())
            off += p.numel()

    def restore(fut: torch.futures.Future) -> torch.Tensor:
        out = fut.value()
        if keep is not None:
            out[keep[0]:keep[0] + keep[1].numel()].copy_(keep[1])
        return out
    return allreduce_hook(None, bucket).then(restore)


def candidate_worker(rank: int, world: int, jobs: list[dict]) -> list[float]:
    """DDP candidates; ``jobs``: ``{"root", "dtype", "steps", "bug": bool}``."""
    times = []
    n = GLOBAL_MICROBATCHES // world
    for job in jobs:
        t0 = time.perf_counter()
        torch.manual_seed(0)
        model, opt = _build(job["dtype"])
        ddp = DDP(model)
        if job.get("bug"):
            ddp.register_comm_hook({"param": model.get_parameter(BUG_PARAM)}, _skip_allreduce_hook)
        lay, sig = {"dp": world, "dtype": job["dtype"]}, _signature(job["dtype"])
        tr = DDPTracer(ddp, TraceWriter(job["root"], rank, world, lay, sig), num_microbatches=n)
        for step in range(job["steps"]):
            mbs = global_batch(step, DTYPES[job["dtype"]])[rank * n:(rank + 1) * n]
            train_step(ddp, opt, mbs, tr, step)
        tr.remove()
        times.append(time.perf_counter() - t0)
    return times


def run(out: Path, dtypes: list[str], steps: int, bug: bool) -> dict[str, Any]:
    """Trace references and candidates under ``out`` and compare them; returns the comparisons."""
    from tracer.compare.check import compare
    refs = [{"root": str(out / f"ref_{d}"), "dtype": d, "steps": steps} for d in dtypes]
    cands = [{"root": str(out / f"ddp_{d}"), "dtype": d, "steps": steps} for d in dtypes]
    if bug:
        cands.append({"root": str(out / f"bug_{dtypes[-1]}"), "dtype": dtypes[-1], "steps": steps, "bug": True})
    t0 = time.perf_counter()
    run_gloo(reference_worker, 1, refs)
    t1 = time.perf_counter()
    run_gloo(candidate_worker, DP, cands)
    t2 = time.perf_counter()
    print(f"traced references in {t1 - t0:.1f} s, DDP candidates (world {DP}) in {t2 - t1:.1f} s")
    results = {}
    for c in cands:
        name = Path(c["root"]).name
        results[name] = compare(out / f"ref_{c['dtype']}", c["root"])
    return results


def main(argv: list[str] | None = None) -> int:
    from tracer.report.summary import summary
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    ap.add_argument("--bug", action="store_true", help=f"rank 1 skips the all-reduce of {BUG_PARAM}'s grad")
    ap.add_argument("--out", type=Path, default=None, help="trace directory (default: a temporary one)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        results = run(out, args.dtype, args.steps, args.bug)
        ok = True
        for name, c in results.items():
            print(f"\n== {name} ==\n{summary(c)}")
            if name.startswith("bug_"):
                f = c.first
                got = None if f is None else {"step": f.step, "phase": f.phase, "name": f.name, "status": f.status}
                print(f"expected first divergence: {EXPECTED_BUG}\n     found first divergence: {got}")
                ok &= got == EXPECTED_BUG
            else:
                ok &= c.first is None
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
