"""``ttrace`` command line: the numerics commands of :mod:`ttrace_num.cli` plus

``ttrace compare REF_DIR CAND_DIR``   compare two traces; print the verdict and the first
                                     divergence, write a JSON report and a PNG plot beside the
                                     candidate (``CAND.ttrace_report.json`` / ``.png``) or at
                                     ``--report PATH``
``ttrace demo``                      the megatron-core demo (needs a source checkout: the
                                     CPU harness lives in ``examples/``, not in the package)

Exit status of every command (:func:`ttrace_num.cli.run_cli`): 0 consistent / success,
1 divergent, 2 bad input (a one-line message names the option, file, rank, step or tensor),
3 internal error. docs/tracing.md, "Exit codes and error messages".
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from tracer.errors import TraceError
from tracer.trace.store import RUN_FILE
from ttrace_num.cli import UsageError, build_parser as numerics_parser, int_at_least, probability, run_cli

REPORT_SUFFIX = ".ttrace_report"


def default_report(candidate: str | Path) -> Path:
    """The default report prefix: beside the candidate directory, never inside it
    (``runs/cand`` -> ``runs/cand.ttrace_report``, written as ``.json`` and ``.png``)."""
    cand = Path(os.path.abspath(candidate))  # abspath: no trailing slash, symlinks not followed
    return cand.with_name(cand.name + REPORT_SUFFIX)


def _trace_dir(path: str, what: str) -> Path:
    """``path`` as a trace directory (it holds ``run.json``), or a :class:`UsageError` naming ``what``."""
    p = Path(path)
    if not (p / RUN_FILE).is_file():
        why = "; the path does not exist" if not p.exists() else "; it is a file" if not p.is_dir() else ""
        raise UsageError(f"{what} {path!r} is not a trace directory (no {RUN_FILE}{why})")
    return p


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_compare_inputs(args: argparse.Namespace) -> None:
    """Everything about the traces that the command line can get wrong, checked before the
    comparison (which reads them all): reference and candidate are traces and not the same
    directory, the reference is single-device (else: swapped?), every ``--noise`` is a trace and
    neither of them, the reference has noise samples, ``--step`` is in both traces.
    Raises :class:`UsageError`."""
    from tracer.compare.check import noise_dirs
    from tracer.trace.store import TraceReader
    ref, cand = _trace_dir(args.reference, "reference"), _trace_dir(args.candidate, "candidate")
    if _same(ref, cand):
        raise UsageError(f"reference and candidate are the same directory ({args.reference}); give the reference "
                         "(the single-device run with noise samples) first, then the candidate")
    ref_reader, cand_reader = TraceReader(ref), TraceReader(cand)
    if ref_reader.world_size > 1:
        raise UsageError(f"reference {args.reference!r} was traced on {ref_reader.world_size} ranks; the reference "
                         "is the single-device run with noise samples (are reference and candidate swapped?)")
    samples = f"noise samples are the reference's {Path(args.reference) / 'noise' / 'sample_K'}; or leave --noise out"
    seen: list[Path] = []
    for n in args.noise or []:
        p = Path(n)
        if _same(p, ref) or _same(p, cand):
            raise UsageError(f"--noise {n!r} is the {'reference' if _same(p, ref) else 'candidate'} itself, not a "
                             f"noise sample; {samples}")
        if any(_same(p, s) for s in seen):
            raise UsageError(f"--noise {n!r} is given twice")
        if not (p / RUN_FILE).is_file():
            raise UsageError(f"--noise {n!r} is not a noise sample (no {RUN_FILE}); {samples}")
        if TraceReader(p).world_size > 1:
            raise UsageError(f"--noise {n!r} was traced on several ranks; a noise sample is a single-device trace")
        seen.append(p)
    if not args.noise and not noise_dirs(ref):
        swapped = " (the candidate has them: are reference and candidate swapped?)" if noise_dirs(cand) else ""
        raise UsageError(f"reference {args.reference!r} has no noise samples (noise/sample_*/run.json){swapped}; "
                         "the thresholds need them: trace the reference with noise samples or pass --noise DIR")
    common = sorted(set(ref_reader.steps()) & set(cand_reader.steps()))
    missing = [s for s in args.step or [] if s not in common]
    if missing:
        raise UsageError(f"--step {missing[0]}: not a step of both traces (common steps: {common})")


def cmd_compare(args: argparse.Namespace) -> int:
    from tracer.compare.check import compare
    from tracer.report.summary import check_report_path, plot, report_paths, summary, write_json
    check_compare_inputs(args)
    json_path, png_path = report_paths(args.report or default_report(args.candidate))
    for p in (json_path,) if args.no_plot else (json_path, png_path):
        check_report_path(p)  # before the comparison, which can take minutes
    c = compare(args.reference, args.candidate, noise=args.noise or None, false_alarm=args.false_alarm,
                steps=sorted(set(args.step)) if args.step else None, progress=sys.stderr.isatty(),
                block_scale=args.block_scale)
    print(summary(c, top=args.top))
    print(f"report: {write_json(c, json_path)}")
    if not args.no_plot:
        print(f"plot: {plot(c, png_path)}")
    return 0 if c.first is None else 1


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the demo harness in its own interpreter: the CPU shim it installs never enters
    this (library) process. Its exit status is the demo's (the same codes)."""
    import subprocess
    root = Path(__file__).resolve().parents[1]
    if not (root / "examples" / "megatron_cpu" / "demo.py").is_file():
        raise UsageError("the demo harness (examples/megatron_cpu) is not here; run it from a source checkout: "
                         "`make demo`")
    return subprocess.call([sys.executable, "-m", "examples.megatron_cpu.demo", *args.demo_args], cwd=root)


def build_parser() -> argparse.ArgumentParser:
    parser, sub = numerics_parser()
    c = sub.add_parser("compare", help="compare a candidate trace with its reference (first divergence)")
    c.add_argument("reference", help="reference trace directory (with noise/sample_* for the thresholds)")
    c.add_argument("candidate", help="candidate trace directory")
    c.add_argument("--noise", action="append", metavar="DIR", help="noise-sample trace (default: REF/noise/sample_*)")
    c.add_argument("--step", action="append", type=int_at_least(0), help="compare only this step (repeatable)")
    c.add_argument("--false-alarm", type=probability, default=1e-2,
                   help="false-alarm probability of the whole comparison, split over its tensors, in (0, 1) "
                        "(default 0.01)")
    c.add_argument("--block-scale", action=argparse.BooleanOptionalAction, default=True,
                   help="also test the block-scale statistic (tracer/compare/blockscale.py; default on): several times "
                        "more sensitive to a wrongly scaled shard; --no-block-scale: the norm statistic alone")
    c.add_argument("--report", metavar="PATH", help=f"report path without suffix, written as PATH.json and PATH.png "
                   f"(default: beside the candidate, CAND{REPORT_SUFFIX}); never through a symbolic link, never over "
                   "a file ttrace did not write")
    c.add_argument("--top", type=int_at_least(0), default=5, help="how many of the worst tensors to list")
    c.add_argument("--no-plot", action="store_true")
    c.set_defaults(func=cmd_compare)
    d = sub.add_parser("demo", help="traced megatron-core demo on CPU/gloo (from a source checkout)")
    d.add_argument("demo_args", nargs=argparse.REMAINDER, help="arguments of examples/megatron_cpu/demo.py")
    d.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The ``ttrace`` console script; exit status as in :func:`ttrace_num.cli.run_cli`."""
    return run_cli(build_parser(), argv, bad_input=(TraceError,))


if __name__ == "__main__":
    sys.exit(main())
