"""Wall seconds of each noise sample of a traced reference, for A/B timing of the sampler.

    python -m bench.sample_seconds --model xl            # ~2.5 min: 2 steps, 4 samples
    python -m bench.sample_seconds --model demo --steps 3

Runs the reference of ``bench.tracer_cost`` (world 1, bf16 with fp32 main params, global
batch 1, full trace with a background writer, ``S`` noise samples stored as moments) and
prints, per step, the step's wall time and each sample's (``NoiseSampler.sample_seconds``:
state restore, the noisy traced step, the snapshot after it; the first sample computes the
amplitudes the later ones reuse). ``bench.tracer_cost`` reports the same cost as a ratio to
a clean step; this one prints raw times, to compare two versions of the code run one after
the other on the same machine (timings on a shared machine move by 10-25% between runs).
On this machine's own CPU kernels, as ``bench.tracer_cost``.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.tracer_cost import LAYOUTS, MODELS, _worker  # first: it undoes bench's kernel pin before torch is imported
from examples.gloo import run_gloo


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo", choices=sorted(MODELS))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--samples", type=int, default=4, help="S")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sample_seconds_") as tmp:
        trace = {"root": str(Path(tmp) / "ref"), "noise_samples": a.samples, "noise_tp": LAYOUTS[2]["tp"],
                 "background": True}
        job = {"model": a.model, "label": f"noise S={a.samples}", "layout": LAYOUTS[1], "steps": a.steps,
               "dtype": "bf16", "trace": trace, "sizes": dict(MODELS[a.model]), "global_batch": 1}
        rec = run_gloo(_worker, 1, [job], timeout_s=3600)[0][0]
    steps, samples = rec["step_s"], rec["sample_seconds"]
    for i, (step, secs) in enumerate(zip(steps, samples)):
        print(f"step {i}: {step:.2f} s; samples {' '.join(f'{s:.2f}' for s in secs)} s "
              f"(first {secs[0]:.2f}, later mean {sum(secs[1:]) / max(len(secs) - 1, 1):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
