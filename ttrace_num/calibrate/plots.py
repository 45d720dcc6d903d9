"""Plots of a calibration: one PNG per op (matplotlib, Agg backend)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import torch

if TYPE_CHECKING:
    from . import Calibration

__all__ = ["plot"]


def plot(cal: "Calibration", ratios: Mapping[str, torch.Tensor], out_dir: str | Path) -> list[Path]:
    """One PNG per op: the empirical distribution (1 - CDF) of the per-instance max error in
    units of the analytic bound, with the analytic bound (1), the calibrated threshold
    (kappa) and the target level p. Returns the written paths."""
    from matplotlib.figure import Figure  # no pyplot: no global state, Agg canvas for PNG
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for op, entry in cal.ops.items():
        r = torch.sort(ratios[op]).values.numpy()
        surv = 1.0 - (torch.arange(1, r.size + 1, dtype=torch.float64) / r.size).numpy()
        fig = Figure(figsize=(6, 4))
        ax = fig.subplots()
        fig.subplots_adjust(left=0.12, right=0.97, bottom=0.12, top=0.92)
        ax.step(r[:-1], surv[:-1], where="post", label="measured: P(max |err|/B > r) per instance")
        ax.axvline(1.0, color="k", ls="--", label="analytic probabilistic bound (r = 1)")
        ax.axvline(entry.kappa, color="r", label=f"calibrated threshold kappa = {entry.kappa:.3g}")
        ax.axhline(entry.p, color="g", ls=":", label=f"target p = {entry.p:g}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(0.5 / r.size, 1.0)
        ax.set_xlabel("r = max_i |err_i| / B_i")
        ax.set_ylabel("fraction of instances above r")
        ax.set_title(f"{op}: {cal.format['name']}" + (f" ({cal.recipe})" if cal.recipe else "") + f", compute {cal.compute_fmt}",
                     fontsize=9)
        ax.legend(fontsize=7)
        path = out / f"calibration_{op}.png"
        fig.savefig(path, dpi=80)
        paths.append(path)
    return paths
