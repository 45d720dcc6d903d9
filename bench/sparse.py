"""Sparse corruption and single bit flips: the smallest change of a few elements each method flags.

    python -m bench.sparse [--out out/sensitivity] [--dtypes bf16,fp32] [--resync] [--write docs/sensitivity-sparse.md]

The traces and the ten targets are those of :mod:`bench.sensitivity` (the demo's megatron-core
GPT, a single-device reference with 4 noise samples against a clean TP=2 + SP + PP=2 candidate
with the distributed optimizer; ``--resync``: the reference re-synchronised to the candidate at
every step). On each target the shard of the candidate's lowest rank holding it is corrupted:

* **sparse** (``k`` = 1, 8, 64): ``k`` entries drawn at random (fixed seed) among the larger half
  by magnitude of that shard are multiplied by ``1 + delta`` (float64, cast back to the stored
  dtype); the smallest flagged ``delta`` in ``[1e-8, 1]`` is found by bisection on a log scale
  (:func:`bench.sensitivity.smallest_delta`) for every method of :data:`METHODS`;
* **bit flips**: one bit of one entry (:data:`FLIPS_PER_BIT` entries per target, drawn as above)
  is flipped in the stored dtype, for every bit position; a flip is *large* when it changes the
  element by more than 2^-4 (bf16 run) / 2^-12 (fp32 run) of its value (or to NaN/Inf), and the table
  gives, per bit position, the fraction of flips and of large flips that our checker flags.

A peer's delta counts against ours only where the peer raises no false positive over the clean
comparison's tensors of the target's phase (:func:`bench.sensitivity.clean_census`): a rule that
flags correct tensors of that phase cannot be run without a calibration of its own.
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.sensitivity import FIXED_PEERS, TARGETS, Case, Target, clean_cases, ensure_traces, smallest_delta

__all__ = ["FLIPS_PER_BIT", "KS", "METHODS", "SparseResult", "flip_bit", "large_flip", "main", "pick_entries", "scale_entries"]

KS = (1, 8, 64)
#: ours, ours with the norm statistic alone, and the peers as published (depth_k0's k is fitted to whole-shard
#: scalings in bench.sensitivity)
METHODS = ("ours", "ours_norm") + FIXED_PEERS
FLIPS_PER_BIT = 8
#: a flip is large when it changes the element by more than this fraction of its value, by the run's
#: compute dtype (a bf16 run's fp32 gradients differ legitimately at bf16's scale)
LARGE_FLIP = {"bf16": 2.0 ** -4, "fp32": 2.0 ** -12, "fp16": 2.0 ** -6}
_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def pick_entries(shard: torch.Tensor, k: int, seed: int) -> torch.Tensor:
    """Flat indices of ``k`` entries of ``shard`` drawn at random among its larger half by magnitude."""
    mag = shard.detach().double().abs().reshape(-1)
    order = torch.argsort(mag, descending=True, stable=True)
    pool = order[: max(1, (mag.numel() + 1) // 2)].tolist()
    return torch.tensor(sorted(random.Random(seed).sample(pool, min(k, len(pool)))), dtype=torch.int64)


def scale_entries(shard: torch.Tensor, idx: torch.Tensor, delta: float) -> torch.Tensor:
    """``shard`` with the entries ``idx`` multiplied by ``1 + delta`` (float64, cast back)."""
    flat = shard.detach().reshape(-1).clone()
    flat[idx] = (flat[idx].double() * (1.0 + delta)).to(shard.dtype)
    return flat.reshape(shard.shape)


def flip_bit(shard: torch.Tensor, i: int, bit: int) -> torch.Tensor:
    """``shard`` with bit ``bit`` (0: the lowest mantissa bit) of entry ``i`` flipped in its stored dtype."""
    ints = shard.detach().reshape(-1).clone().view(_INT_VIEW[shard.dtype])
    width = ints.element_size() * 8
    mask = torch.tensor(1 << bit if bit < width - 1 else -(1 << (width - 1)), dtype=ints.dtype)
    ints[i] = ints[i] ^ mask
    return ints.view(shard.dtype).reshape(shard.shape)


def large_flip(before: float, after: float, run_dtype: str) -> bool:
    """Does a flip change the element by more than :data:`LARGE_FLIP` of its value (or to NaN/Inf)?"""
    if not math.isfinite(after):
        return True
    return abs(after - before) > LARGE_FLIP[run_dtype] * abs(before)


@dataclass
class SparseResult:
    """Smallest flagged delta per method and k, and the bit-flip verdicts, on one target."""

    dtype: str
    target: Target
    shape: list[int]
    stored: str
    elementwise: bool
    delta: dict[int, dict[str, float]] = field(default_factory=dict)          # k -> method -> delta
    clean: dict[str, bool] = field(default_factory=dict)                      # method flags the clean tensor
    flips: list[tuple[int, bool, bool]] = field(default_factory=list)         # (bit, large, flagged)


def measure_sparse(case: Case, dtype: str, seed: int) -> SparseResult:
    """Every method's smallest flagged delta for k = :data:`KS` entries, and the bit flips."""
    shard = case.shards[case.rank]
    res = SparseResult(dtype, case.target, list(case.ref_t.shape), str(case.ref_e.dtype).replace("torch.", ""),
                       case.elementwise)
    clean_full, clean_notes = case.assembled()
    res.clean = {m: case.flags_tensor(m, clean_full, clean_notes) for m in METHODS}
    for k in KS:
        idx = pick_entries(shard, k, seed + k)
        res.delta[k] = {m: smallest_delta(lambda d, m=m: case.flags_tensor(m, *case.assembled(scale_entries(shard, idx, d))))
                        for m in METHODS}
    width = shard.element_size() * 8
    for j, i in enumerate(pick_entries(shard, FLIPS_PER_BIT, seed + 1000).tolist()):
        before = float(shard.reshape(-1)[i])
        for bit in range(width):
            flipped = flip_bit(shard, i, bit)
            after = float(flipped.reshape(-1)[i])
            res.flips.append((bit, large_flip(before, after, dtype),
                              case.flags_tensor("ours", *case.assembled(flipped))))
    return res


def run_dtype(root: Path, dtype: str, seed: int, log=print) -> tuple[list[SparseResult], dict]:
    """The clean comparison, the peers' clean census, and every target's sparse and bit-flip results."""
    _, (census, _), cases = clean_cases(root, dtype, TARGETS, log)
    out = []
    for n, (tg, case) in enumerate(zip(TARGETS, cases)):
        t = time.perf_counter()
        case = case()
        res = measure_sparse(case, dtype, seed)
        out.append(res)
        large = [f for f in res.flips if f[1]]
        log(f"  [{n + 1}/{len(TARGETS)}] {dtype} step {tg.step} {tg.phase} {tg.name} (element statistic "
            f"{'on' if res.elementwise else 'off'}): k=1 ours {res.delta[1]['ours']:.3g}, "
            + ", ".join(f"{m} {res.delta[1][m]:.3g}" for m in FIXED_PEERS)
            + f"; large flips flagged {sum(f[2] for f in large)}/{len(large)} ({time.perf_counter() - t:.1f} s)")
    return out, census


def _fmt(x: float) -> str:
    return "> 1" if math.isinf(x) else f"{x:.3g}"


def _peer_ok(res: SparseResult, peer: str, census: dict) -> bool:
    """The peer raises no false positive over the clean tensors of the target's phase."""
    return not res.clean.get(peer) and census.get(res.target.phase, {}).get(peer, 1) == 0


def delta_table(results: list[SparseResult], census: dict[str, dict], k: int) -> str:
    """Markdown: smallest flagged delta per target and method for ``k`` entries."""
    peers = FIXED_PEERS
    lines = ["| dtype | step | phase | tensor | element stat. | ours | ours_norm | " + " | ".join(peers) + " | peer below ours |",
             "|" + "---|" * (8 + len(peers))]
    for r in results:
        d = r.delta[k]
        below = [p for p in peers if _peer_ok(r, p, census[r.dtype]) and d[p] < d["ours"]]
        cells = [("FP" if r.clean[p] else _fmt(d[p])) + ("" if _peer_ok(r, p, census[r.dtype]) or r.clean[p] else " (FP phase)")
                 for p in peers]
        lines.append(f"| {r.dtype} | {r.target.step} | {r.target.phase} | `{r.target.name}` | "
                     f"{'yes' if r.elementwise else 'no'} | {_fmt(d['ours'])} | {_fmt(d['ours_norm'])} | "
                     + " | ".join(cells) + f" | {', '.join(below) or 'none'} |")
    return "\n".join(lines)


def summary_table(results: list[SparseResult]) -> str:
    """Markdown: median smallest flagged delta of ours per dtype, k and kind."""
    lines = ["| dtype | k | ours: median over the 10 targets | gradients | activations | element statistic on (median) |",
             "|---|---|---|---|---|---|"]
    for dtype in sorted({r.dtype for r in results}):
        rs = [r for r in results if r.dtype == dtype]
        for k in KS:
            def med(sel: list[SparseResult]) -> str:
                return _fmt(statistics.median(r.delta[k]["ours"] for r in sel)) if sel else "n/a"
            lines.append(f"| {dtype} | {k} | {med(rs)} | {med([r for r in rs if r.target.kind == 'grad'])} | "
                         f"{med([r for r in rs if r.target.kind == 'activation'])} | "
                         f"{med([r for r in rs if r.elementwise])} ({sum(r.elementwise for r in rs)} targets) |")
    return "\n".join(lines)


def flip_table(results: list[SparseResult]) -> str:
    """Markdown: per run dtype, stored dtype and bit position, flagged / flips and flagged / large flips."""
    lines = ["| run | stored | bit | flips flagged | large flips flagged | large flips missed (element statistic on) |",
             "|---|---|---|---|---|---|"]
    for dtype, stored in sorted({(r.dtype, r.stored) for r in results}):
        rs = [r for r in results if (r.dtype, r.stored) == (dtype, stored)]
        width = max(b for r in rs for b, _, _ in r.flips) + 1
        for bit in range(width - 1, -1, -1):
            f = [(large, flagged, r.elementwise) for r in rs for b, large, flagged in r.flips if b == bit]
            lg = [x for x in f if x[0]]
            lines.append(f"| {dtype} | {stored} | {bit} | {sum(x[1] for x in f)}/{len(f)} | "
                         f"{sum(x[1] for x in lg)}/{len(lg)} | {sum(not x[1] and x[2] for x in lg)} |")
    return "\n".join(lines)


def write_doc(path: Path, results: list[SparseResult], census: dict, cmd: str, runtime: float, resync: bool) -> None:
    """The markdown page with the tables."""
    mode = ("the reference re-synchronised to the candidate at every step (`--resync`)" if resync
            else "the reference on its own trajectory")
    parts = [f"# Sparse corruption and bit flips{' (re-synchronised reference)' if resync else ''}\n",
             f"Produced by `{cmd}` ({runtime:.0f} s), with {mode}. Method and peers: "
             "`bench/sparse.py` and [sensitivity.md](sensitivity.md); the element statistic: "
             "`tracer/compare/elementwise.py` and [detection-statistics.md](detection-statistics.md).\n",
             "## Summary\n", summary_table(results), ""]
    for k in KS:
        parts += [f"## k = {k} entries\n",
                  "Smallest flagged delta; `FP`: the method flags the clean tensor; `(FP phase)`: it flags other clean "
                  "tensors of the same phase (it does not count against ours); last column: the peers without "
                  "false positives in that phase that flag a smaller delta than ours.\n",
                  delta_table(results, census, k), ""]
    parts += ["## Bit flips\n",
              f"{FLIPS_PER_BIT} entries per target (larger half by magnitude of the shard), every bit position "
              "(highest first: sign, exponent, mantissa). Large: the flip changes the element by more than "
              "2^-4 (bf16) / 2^-12 (fp32) of its value, or to NaN/Inf.\n", flip_table(results), ""]
    path.write_text("\n".join(parts) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/sensitivity", help="trace cache directory (shared with bench.sensitivity)")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--noise-samples", type=int, default=4)
    ap.add_argument("--resync", action="store_true", help="a reference re-synchronised to the candidate every step")
    ap.add_argument("--write", default=None, help="write the markdown report here")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    results, census = [], {}
    print(f"sparse: {len(TARGETS)} tensors, k = {KS}, bit flips, dtypes {a.dtypes}")
    for dtype in a.dtypes.split(","):
        root = ensure_traces(Path(a.out), dtype, steps=a.steps, seed=a.seed, noise_samples=a.noise_samples,
                             resync=a.resync)
        rs, census[dtype] = run_dtype(root, dtype, a.seed)
        results += rs
    print()
    print(summary_table(results))
    print()
    print(flip_table(results))
    runtime = time.perf_counter() - t0
    print(f"\nsparse finished in {runtime:.0f} s")
    if a.write:
        cmd = "python -m bench.sparse " + " ".join(argv if argv is not None else sys.argv[1:])
        write_doc(Path(a.write), results, census, cmd.strip(), runtime, a.resync)
        print(f"wrote {a.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
