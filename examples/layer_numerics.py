"""The numerics demo: every op of one pre-norm transformer layer in bf16, bound vs observed error.

Runs the layer op by op on the real torch CPU kernels (bf16 storage, fp32 compute as torch
does), computes each op's exact result from the *same stored inputs* with the exact
references (fsum/Dot2 for matmuls, mpmath for the rest), and prints, per op: the largest
observed error, the largest bound, violations, and tightness (``min_i bound_i / err_i``:
how close the worst element comes to its bound) in both modes.

    python examples/layer_numerics.py [--hidden 256] [--heads 4] [--seq 128] [--seed 0]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

import ttrace_num as tn
from ttrace_num.reference import dot, ops


def _row(name, shape, computed, exact, inputs, op, kw):
    err = (computed.double() - exact).abs()
    out = [name, "x".join(map(str, shape)), f"{float(err.max()):.3g}"]
    for mode in ("deterministic", "probabilistic"):
        b = torch.broadcast_to(tn.tolerance(op, *inputs, mode=mode, **kw).abs, err.shape)
        nz = err > 0
        tight = float((b[nz] / err[nz]).min()) if nz.any() else float("inf")
        out += [f"{float(b.max()):.3g}", str(int((err > b).sum())), f"{tight:.2f}"]
    return out


def run(hidden: int, heads: int, seq: int, seed: int) -> list[list[str]]:
    torch.manual_seed(seed)
    bf = torch.bfloat16
    ffn = 4 * hidden
    dh = hidden // heads
    x = torch.randn(seq, hidden).to(bf)
    w_ln = (1 + 0.1 * torch.randn(hidden)).to(bf)
    b_ln = (0.1 * torch.randn(hidden)).to(bf)
    w_qkv = (torch.randn(3 * hidden, hidden) / hidden**0.5).to(bf)
    w_proj = (torch.randn(hidden, hidden) / hidden**0.5).to(bf)
    w_fc1 = (torch.randn(ffn, hidden) / hidden**0.5).to(bf)
    w_fc2 = (torch.randn(hidden, ffn) / ffn**0.5).to(bf)
    rows = []
    # 1. input layer norm
    h = F.layer_norm(x, (hidden,), w_ln, b_ln)
    rows.append(_row("layer_norm (input)", h.shape, h, ops.layer_norm(x, (hidden,), w_ln, b_ln, 1e-5),
                     (x,), "layer_norm", dict(normalized_shape=(hidden,), weight=w_ln, bias=b_ln)))
    # 2. QKV projection
    qkv = F.linear(h, w_qkv)
    rows.append(_row("linear qkv", qkv.shape, qkv, dot.exact_matmul(h, w_qkv.T), (h, w_qkv), "linear", {}))
    q, k, v = (t.reshape(seq, heads, dh).transpose(0, 1) for t in qkv.split(hidden, dim=-1))
    # 3. scores = q k^T / sqrt(dh) (scale folded into q: exact power of two only when dh is a power of 4)
    kt = k.transpose(-1, -2).contiguous()
    scores = torch.matmul(q, kt)
    rows.append(_row("matmul q k^T", scores.shape, scores, dot.exact_matmul(q, kt), (q, kt), "matmul", {}))
    # 4. causal softmax (mask = -inf above the diagonal)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)
    logits = (scores.float() / dh**0.5).masked_fill(mask, float("-inf")).to(bf)
    p = torch.softmax(logits, dim=-1)
    rows.append(_row("softmax (causal)", p.shape, p, ops.softmax(logits, -1), (logits,), "softmax", dict(dim=-1)))
    # 5. context = p v
    ctx = torch.matmul(p, v)
    rows.append(_row("matmul p v", ctx.shape, ctx, dot.exact_matmul(p, v), (p, v), "matmul", {}))
    ctx2 = ctx.transpose(0, 1).reshape(seq, hidden)
    # 6. output projection
    o = F.linear(ctx2, w_proj)
    rows.append(_row("linear proj", o.shape, o, dot.exact_matmul(ctx2, w_proj.T), (ctx2, w_proj), "linear", {}))
    # 7. residual add
    r1 = x + o
    rows.append(_row("residual add", r1.shape, r1, x.double() + o.double(), (x, o), "add", {}))
    # 8. MLP
    h2 = F.layer_norm(r1, (hidden,), w_ln, b_ln)
    rows.append(_row("layer_norm (mlp)", h2.shape, h2, ops.layer_norm(r1, (hidden,), w_ln, b_ln, 1e-5),
                     (r1,), "layer_norm", dict(normalized_shape=(hidden,), weight=w_ln, bias=b_ln)))
    f1 = F.linear(h2, w_fc1)
    rows.append(_row("linear fc1", f1.shape, f1, dot.exact_matmul(h2, w_fc1.T), (h2, w_fc1), "linear", {}))
    g = F.gelu(f1)
    rows.append(_row("gelu", g.shape, g, ops.gelu(f1), (f1,), "gelu", {}))
    f2 = F.linear(g, w_fc2)
    rows.append(_row("linear fc2", f2.shape, f2, dot.exact_matmul(g, w_fc2.T), (g, w_fc2), "linear", {}))
    r2 = r1 + f2
    rows.append(_row("residual add", r2.shape, r2, r1.double() + f2.double(), (r1, f2), "add", {}))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.time()
    print(f"One pre-norm transformer layer in bf16 (hidden {args.hidden}, {args.heads} heads, seq {args.seq}), "
          "real torch CPU kernels vs exact references (fsum/Dot2, mpmath)\n", flush=True)
    rows = run(args.hidden, args.heads, args.seq, args.seed)
    headers = ["op", "output", "max err", "det bound", "viol", "tight", "prob bound", "viol", "tight"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    total = sum(int(r[4]) + int(r[7]) for r in rows)
    print(f"\n'tight' = min over elements of bound/|error| (1 = attained). Probabilistic: per-element "
          f"failure probability 1e-6. Violations: {total}. ({time.time() - t0:.1f} s)")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
