"""A plain-PyTorch transformer LM, traced on one device and on 2-rank DDP, then compared.

    python -m examples.torch_lm [--steps 2] [--samples 3] [--out DIR]

The model is written as a user would write it, with nothing of the tracer in it: token and
position embeddings (``nn.Embedding``), pre-norm blocks (``nn.LayerNorm``; causal
self-attention through ``F.scaled_dot_product_attention(is_causal=True)``; a GELU MLP), a final
norm, an untied LM head and ``F.cross_entropy``; ``model.to(torch.bfloat16)`` (parameters and
compute in bf16) and ``torch.optim.Adam``. A global batch of ``GLOBAL_MICROBATCHES``
microbatches of ``MICRO_BATCH`` sequences per step:

* reference: one process runs every microbatch with gradient accumulation, traced with
  :class:`tracer.adapters.ddp.DDPTracer`; each step is re-run ``--samples`` times under the noise
  injector (:class:`tracer.capture.noise_sampler.NoiseSampler`), which perturbs every op
  ``ttrace_num`` has a model for (the GEMMs, norms, GELU, residual adds, attention, cross
  entropy, the embedding's gradient) and counts what it saw (the op census);
* candidate: ``DistributedDataParallel`` over ``DP`` gloo ranks, two microbatches each (``no_sync``
  on the first), traced the same way; once clean and once with the bug below.

``--bug`` (always run by :func:`main`): rank 1 multiplies its loss by 2 before ``backward()``
(a loss scaled twice, e.g. a loss-scale or ``1/dp`` applied on one rank only). The loss itself
is recorded before the scaling, so it agrees; the first divergence is the first gradient that
rank computes: step 0, phase ``bwd``, rank 1's first microbatch (global microbatch 2,
:data:`EXPECTED_BUG`).

The clean candidate is not bitwise equal to the reference: the reference accumulates the
parameter gradients of its 4 microbatches as ``((g0 + g1) + g2) + g3``, DDP as ``(g0 + g1) + (g2
+ g3)`` (each rank's two, then the all-reduce), in bf16; that difference propagates through
Adam into step 1, where every tensor differs by round-off that the thresholds must cover.

:func:`train_step` is the whole integration, the 5 lines marked ``# trace`` (as
``examples/torch_ddp.py``).
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

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from examples.gloo import run_gloo
from tracer.adapters.ddp import DDPTracer
from tracer.capture.noise_sampler import NoiseSampler
from tracer.trace.store import TraceWriter

__all__ = ["DP", "EXPECTED_BUG", "LM", "candidate_worker", "global_batch", "reference_worker", "run", "train_step"]

VOCAB, HIDDEN, HEADS, LAYERS, SEQ = 64, 64, 4, 2, 32
DP = 2
GLOBAL_MICROBATCHES = 4  # two per DP rank; powers of two: the 1/n loss and 1/dp grad scalings are exact
MICRO_BATCH = 1          # sequences per microbatch: a global batch of 4 sequences
LR = 3e-3
NOISE_SAMPLES = 3
EXPECTED_BUG = {"step": 0, "phase": "bwd", "microbatch": GLOBAL_MICROBATCHES // DP}  # rank 1's first


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP, each with a residual."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class LM(nn.Module):
    """Token + position embeddings, ``LAYERS`` blocks, final norm, untied head: logits ``(b, t, VOCAB)``."""

    def __init__(self, vocab: int = VOCAB, d: int = HIDDEN, heads: int = HEADS, layers: int = LAYERS,
                 seq: int = SEQ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build(seed: int = 0) -> tuple[LM, torch.optim.Optimizer]:
    """The model (bf16 parameters, as ``model.to(torch.bfloat16)`` gives) and its Adam."""
    torch.manual_seed(seed)
    model = LM().to(torch.bfloat16)
    return model, torch.optim.Adam(model.parameters(), lr=LR)


def global_batch(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The step's ``GLOBAL_MICROBATCHES`` (tokens, next-token targets), the same in every run."""
    g = torch.Generator().manual_seed(1000 + step)
    seqs = torch.randint(0, VOCAB, (GLOBAL_MICROBATCHES, MICRO_BATCH, SEQ + 1), generator=g)
    return [(s[:, :-1], s[:, 1:]) for s in seqs]


def train_step(model: nn.Module, opt: torch.optim.Optimizer, mbs: list, tr: DDPTracer, step: int,
               writer: TraceWriter | None = None, loss_factor: float = 1.0) -> list[float]:
    """One training step over this rank's microbatches ``mbs`` (``loss_factor``: the bug)."""
    n, losses = len(mbs), []
    with tr.step(step, writer):                                                # trace
        for i, (tokens, targets) in enumerate(mbs):
            tr.microbatch(i)                                                   # trace
            sync = model.no_sync() if isinstance(model, DDP) and i < n - 1 else contextlib.nullcontext()
            with sync:
                logits = model(tokens)
                loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
                tr.record_loss(loss)                                           # trace
                (loss * loss_factor / n).backward()
                losses.append(loss.item())
        tr.after_backward()                                                    # trace
        opt.step()
        opt.zero_grad(set_to_none=True)
        tr.after_optimizer_step()                                              # trace
    return losses


def signature() -> str:
    return (f"torch_lm example: LM(vocab {VOCAB}, hidden {HIDDEN}, heads {HEADS}, layers {LAYERS}, seq {SEQ}), "
            f"bf16, Adam lr {LR}")


def noise_kwargs(dp: int = DP) -> dict[str, Any]:
    """What the candidate does differently: its parameter gradients are partial sums over
    ``dp`` ranks' microbatches, all-reduced in bf16 (as ``examples/torch_ddp.py``)."""
    from ttrace_num.bounds.summation import Summation
    return {"grad_summation": Summation(split=dp, reduce_fmt="bf16")}


def reference_worker(rank: int, world: int, job: dict) -> dict[str, Any]:
    """Single-device reference with noise samples (``job``: ``root``, ``steps``, ``samples``);
    returns the wall time and the op census of the first sample (every sample's is the same)."""
    t0 = time.perf_counter()
    model, opt = build()
    lay = {"dp": 1, "dtype": "bf16"}
    tr = DDPTracer(model, TraceWriter(job["root"], 0, 1, lay, signature()), num_microbatches=GLOBAL_MICROBATCHES)
    ns = NoiseSampler(model, opt, job["root"], layout=lay, signature=signature(), samples=job["samples"],
                      injector_kwargs=noise_kwargs())
    for step in range(job["steps"]):
        ns.step(step, partial(train_step, model, opt, global_batch(step), tr, step))
    tr.remove()
    return {"seconds": time.perf_counter() - t0, "census": ns.census[0], "unmodelled": ns.unmodelled()}


def candidate_worker(rank: int, world: int, jobs: list[dict]) -> list[float]:
    """DDP candidates (``jobs``: ``root``, ``steps``, ``bug``); returns each job's wall time."""
    times = []
    n = GLOBAL_MICROBATCHES // world
    for job in jobs:
        t0 = time.perf_counter()
        model, opt = build()
        ddp = DDP(model)
        lay = {"dp": world, "dtype": "bf16"}
        tr = DDPTracer(ddp, TraceWriter(job["root"], rank, world, lay, signature()), num_microbatches=n)
        factor = 2.0 if job.get("bug") and rank == 1 else 1.0
        for step in range(job["steps"]):
            train_step(ddp, opt, global_batch(step)[rank * n:(rank + 1) * n], tr, step, loss_factor=factor)
        tr.remove()
        times.append(time.perf_counter() - t0)
    return times


def trace(out: Path, steps: int = 2, samples: int = NOISE_SAMPLES, in_process_reference: bool = False
          ) -> dict[str, Any]:
    """Trace the reference (``out/ref``) and the candidates (``out/ddp``, ``out/bug``)."""
    job = {"root": str(out / "ref"), "steps": steps, "samples": samples}
    t0 = time.perf_counter()
    ref = reference_worker(0, 1, job) if in_process_reference else run_gloo(reference_worker, 1, job)[0]
    t1 = time.perf_counter()
    run_gloo(candidate_worker, DP, [{"root": str(out / "ddp"), "steps": steps},
                                    {"root": str(out / "bug"), "steps": steps, "bug": True}])
    return {**ref, "reference_s": t1 - t0, "candidates_s": time.perf_counter() - t1}


def run(out: Path, steps: int = 2, samples: int = NOISE_SAMPLES) -> dict[str, Any]:
    """Trace and compare; returns ``{"census", "unmodelled", "clean", "bug", ...}``."""
    from tracer.compare.check import compare
    info = trace(out, steps, samples)
    return {**info, "clean": compare(out / "ref", out / "ddp"), "bug": compare(out / "ref", out / "bug")}


def census_lines(census: dict[str, dict[str, int]]) -> list[str]:
    """The op census, one line per category (exact ops as a count: they are many)."""
    lines = []
    for cat in ("perturbed", "unmodelled", "optimizer", "accepted"):
        ops = census.get(cat, {})
        lines.append(f"  {cat:10s} " + (", ".join(f"{k.replace('torch.nn.functional.', 'F.')} x{v}"
                                                for k, v in ops.items()) or "{}"))
    exact = census.get("exact", {})
    lines.append(f"  {'exact':10s} {len(exact)} ops, {sum(exact.values())} calls (views, indexing, F.embedding, "
                 "exact scalings, metadata)")
    return lines


def main(argv: list[str] | None = None) -> int:
    from tracer.report.summary import summary
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--samples", type=int, default=NOISE_SAMPLES)
    ap.add_argument("--out", type=Path, default=None, help="trace directory (default: a temporary one)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        r = run(args.out or Path(tmp), args.steps, args.samples)
    print(f"reference traced in {r['reference_s']:.1f} s ({args.samples} noise samples), "
          f"DDP candidates (world {DP}) in {r['candidates_s']:.1f} s")
    print("op census of a noise sample (calls over its steps):")
    print("\n".join(census_lines(r["census"])))
    ok = not r["unmodelled"]
    for name in ("clean", "bug"):
        c = r[name]
        print(f"\n== {name} ==\n{summary(c)}\n  {c.coverage.summary() if c.coverage else ''}")
    clean, bug = r["clean"], r["bug"]
    ok &= clean.verdict == "consistent"
    f = bug.first
    got = None if f is None else {"step": f.step, "phase": f.phase, "microbatch": f.microbatch}
    print(f"\nclean: {clean.verdict}, largest error/threshold {clean.max_ratio_ok:.3g}")
    print(f"bug (rank 1's loss x2): {bug.verdict}; expected first divergence {EXPECTED_BUG}, found {got}"
          + (f" at {f.name}, {f.ratio:.3g}x" if f is not None else ""))
    ok &= got == EXPECTED_BUG
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
