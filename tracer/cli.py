"""``ttrace`` command line: the numerics commands of :mod:`ttrace_num.cli` plus

``ttrace compare REF_DIR CAND_DIR``   compare two traces; print the verdict and the first
                                     divergence, write a JSON report and a PNG plot
``ttrace demo``                      the megatron-core demo (needs a source checkout: the
                                     CPU harness lives in ``examples/``, not in the package)

Exit status of ``compare``: 0 consistent, 1 divergent, 2 bad input (the message names the
file, rank, step and tensor).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from tracer.errors import TraceError
from ttrace_num.cli import build_parser as numerics_parser


def cmd_compare(args: argparse.Namespace) -> int:
    from tracer.compare.check import compare
    from tracer.report.summary import plot, summary, write_json
    try:
        c = compare(args.reference, args.candidate, noise=args.noise or None, false_alarm=args.false_alarm,
                    steps=args.step or None, progress=sys.stderr.isatty(), block_scale=args.block_scale)
    except TraceError as e:
        print(f"ttrace compare: {e}", file=sys.stderr)
        return 2
    print(summary(c, top=args.top))
    out = Path(args.report or Path(args.candidate) / "ttrace_report")
    print(f"report: {write_json(c, out.with_suffix('.json'))}")
    if not args.no_plot:
        print(f"plot: {plot(c, out.with_suffix('.png'))}")
    return 0 if c.first is None else 1


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the demo harness in its own interpreter: the CPU shim it installs never enters
    this (library) process."""
    import subprocess
    root = Path(__file__).resolve().parents[1]
    if not (root / "examples" / "megatron_cpu" / "demo.py").is_file():
        print("ttrace demo: the demo harness (examples/megatron_cpu) is not here; run it from a source "
              "checkout: `make demo`", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, "-m", "examples.megatron_cpu.demo", *args.demo_args], cwd=root)


def build_parser() -> argparse.ArgumentParser:
    parser, sub = numerics_parser()
    c = sub.add_parser("compare", help="compare a candidate trace with its reference (first divergence)")
    c.add_argument("reference", help="reference trace directory (with noise/sample_* for the thresholds)")
    c.add_argument("candidate", help="candidate trace directory")
    c.add_argument("--noise", action="append", metavar="DIR", help="noise-sample trace (default: REF/noise/sample_*)")
    c.add_argument("--step", action="append", type=int, help="compare only this step (repeatable)")
    c.add_argument("--false-alarm", type=float, default=1e-2,
                   help="false-alarm probability of the whole comparison, split over its tensors (default 0.01)")
    c.add_argument("--block-scale", action=argparse.BooleanOptionalAction, default=True,
                   help="also test the block-scale statistic (tracer/compare/blockscale.py; default on): several times "
                        "more sensitive to a wrongly scaled shard; --no-block-scale: the norm statistic alone")
    c.add_argument("--report", metavar="PATH", help="report path without suffix (default CAND/ttrace_report)")
    c.add_argument("--top", type=int, default=5, help="how many of the worst tensors to list")
    c.add_argument("--no-plot", action="store_true")
    c.set_defaults(func=cmd_compare)
    d = sub.add_parser("demo", help="traced megatron-core demo on CPU/gloo (from a source checkout)")
    d.add_argument("demo_args", nargs=argparse.REMAINDER, help="arguments of examples/megatron_cpu/demo.py")
    d.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
