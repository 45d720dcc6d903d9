"""Reports of a comparison: terminal summary, JSON file, PNG plot of error/threshold.

The plot shows every compared tensor in the reference's execution order (x) against its
error/threshold ratio (y, log scale), coloured by phase, with the threshold line at 1 and
the first divergence marked: the picture of where a run starts to go wrong.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from tracer.compare.check import Comparison

__all__ = ["plot", "summary", "write_json"]

_PHASE_COLOURS = {"fwd": "tab:blue", "loss": "tab:purple", "bwd": "tab:orange", "grad_local": "tab:olive",
                  "grad": "tab:green", "grad_norm": "tab:brown", "options": "tab:gray", "param": "tab:red"}


def _fmt_ratio(r: float) -> str:
    return "inf" if math.isinf(r) else ("n/a" if math.isnan(r) else f"{r:.3g}")


def summary(c: Comparison, top: int = 5) -> str:
    """Human-readable verdict: counts, the safety margin, the first divergence and where it is."""
    counts = c.counts()
    lines = [f"verdict: {c.verdict}   ({len(c.rows)} tensors compared: "
             + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + ")",
             f"  reference {c.reference}  vs  candidate {c.candidate} (layout {c.candidate_layout})",
             f"  thresholds: {c.noise_samples} noise samples, false-alarm probability {c.false_alarm:g} per "
             f"comparison; largest error/threshold within threshold: {c.max_ratio_ok:.3g}"]
    if c.unmatched:
        lines.append(f"  {len(c.unmatched)} tensors traced by one run only (not compared), e.g. {c.unmatched[0]}")
    f = c.first
    if f is None:
        lines.append("  no tensor over its threshold")
    else:
        where = f"candidate rank(s) {f.worst_ranks}" if f.worst_ranks else "all ranks"
        lines += [f"first divergence: step {f.step}, phase {f.phase}, tensor {f.name}"
                  + (f" (microbatch {f.microbatch})" if f.phase in ("fwd", "bwd", "loss") else ""),
                  f"  module {f.module or '-'}; " + (
                      f"block-scale statistic {f.scale_error:.4g} vs threshold {f.scale_threshold:.4g} (a difference "
                      f"that rescales the reference; norm of the difference {f.error:.4g} vs {f.threshold:.4g})"
                      if f.by_scale else f"error {f.error:.4g} vs threshold {f.threshold:.4g}")
                  + f" = {_fmt_ratio(f.ratio)}x over ({f.status}); max |diff| {f.max_abs:.3g} on {where}",
                  f"  {f.note}" if f.note else "",
                  f"localisation: {c.localisation}"]
        worst = sorted((r for r in c.rows if r.status != "ok"), key=lambda r: -r.ratio if not math.isnan(r.ratio) else 0)
        lines.append(f"  {sum(r.status != 'ok' for r in c.rows)} tensors over threshold; largest:")
        lines += [f"    {_fmt_ratio(r.ratio):>8}x  {r.label}" for r in worst[:top]]
    return "\n".join(x for x in lines if x)


def write_json(c: Comparison, path: str | Path) -> Path:
    """The whole comparison (every tensor's row) as JSON; infinities are written as strings."""
    def clean(o):
        if isinstance(o, float) and not math.isfinite(o):
            return str(o)
        if isinstance(o, dict):
            return {k: clean(v) for k, v in o.items()}
        if isinstance(o, list):
            return [clean(v) for v in o]
        return o
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean(c.to_dict()), indent=1))
    return path


def plot(c: Comparison, path: str | Path, title: str | None = None) -> Path:
    """PNG of error/threshold along the execution order (see module docstring)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(11, 4))
    xs = range(len(c.rows))
    floor = 1e-4
    ys = [min(max(r.ratio, floor), 1e4) if not math.isnan(r.ratio) else floor for r in c.rows]
    for phase, colour in _PHASE_COLOURS.items():
        pts = [(x, y) for x, y, r in zip(xs, ys, c.rows) if r.phase == phase]
        if pts:
            ax.scatter(*zip(*pts), s=6, c=colour, label=phase)
    ax.axhline(1.0, color="k", lw=1, ls="--", label="threshold")
    if c.first is not None:
        i = c.rows.index(c.first)
        ax.scatter([i], [ys[i]], s=120, facecolors="none", edgecolors="red", lw=2, label="first divergence")
    steps = sorted({r.step for r in c.rows})
    for s in steps[1:]:
        ax.axvline(next(i for i, r in enumerate(c.rows) if r.step == s), color="grey", lw=0.5)
    ax.set_yscale("log")
    ax.set_xlabel("tensor, in the reference's execution order (grey lines: step boundaries)")
    ax.set_ylabel("||cand - ref|| / threshold")
    ax.set_title(title or f"{c.verdict}: {Path(c.candidate).name} vs {Path(c.reference).name}")
    ax.legend(fontsize=7, ncol=4, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
