"""``ttrace`` command line: the numerics commands of :mod:`ttrace_num.cli` plus

``ttrace compare REF_DIR CAND_DIR``   compare two traces; print the verdict and the first
                                     divergence, write a JSON report and a PNG plot beside the
                                     candidate (``CAND.ttrace_report.json`` / ``.png``) or at
                                     ``--report PATH``
``ttrace demo``                      the megatron-core demo (needs a source checkout: the
                                     CPU harness lives in ``examples/``, not in the package)

Exit status of every command (:func:`ttrace_num.cli.run_cli`): 0 consistent / success,
1 divergent, 2 bad input (a one-line message names the option, file, rank, step or tensor;
``compare``: also an ``unverified`` verdict, tensors after ops without an error model),
3 internal error. docs/tracing.md, "Exit codes and error messages".
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from tracer.errors import EXIT_BAD_INPUT, EXIT_CONSISTENT, EXIT_DIVERGENT, TraceError
from ttrace_num.cli import UsageError, build_parser as numerics_parser, int_at_least, probability, run_cli

REPORT_SUFFIX = ".ttrace_report"
PROG = "ttrace"
#: ``ttrace compare``'s exit status for the verdict ``unverified`` (compared tensors after ops without an
#: error model, not accepted): the input does not let ttrace verify the candidate, as with bad input
EXIT_UNVERIFIED = EXIT_BAD_INPUT


def default_report(candidate: str | Path) -> Path:
    """The default report prefix: beside the candidate directory, never inside it
    (``runs/cand`` -> ``runs/cand.ttrace_report``, written as ``.json`` and ``.png``)."""
    cand = Path(os.path.abspath(candidate))  # abspath: no trailing slash, symlinks not followed
    return cand.with_name(cand.name + REPORT_SUFFIX)


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_compare_inputs(args: argparse.Namespace) -> None:
    """What only the command line can get wrong, checked before the comparison (which reads every
    trace): a ``--noise`` directory given twice. Everything about the traces themselves (a path
    without ``run.json``, the same directory twice, a multi-rank reference, a noise sample that is
    the reference or the candidate, no noise samples, a ``--step`` not traced by both) is
    :func:`tracer.compare.check.compare`'s to refuse (docs/tracing.md, "What a comparison
    refuses"). Raises :class:`UsageError`."""
    seen: list[str] = []
    for n in args.noise or []:
        if any(n == s or _same(Path(n), Path(s)) for s in seen):
            raise UsageError(f"--noise {n!r} is given twice")
        seen.append(n)


def unverified_message(c) -> str:
    """The one-line reason an ``unverified`` comparison exits :data:`EXIT_UNVERIFIED`."""
    if c.nothing_judged:
        return (f"unverified: none of the {len(c.rows)} compared tensor(s) could be judged (all unchecked: no noise "
                "sample traced them, or a top-k choice changed upstream); re-record the reference's noise samples "
                "with the same integration as the candidate")
    cov = c.coverage
    ops = ", ".join(f"{name} x{n}" for name, n in sorted(cov.unmodelled.items()))
    return (f"unverified: {cov.downstream} compared tensor(s) come after ops without an error model ({ops} "
            "calls in a noise sample), so their thresholds do not cover those ops' rounding and ttrace cannot "
            "verify the candidate there; model the ops (docs/tracing-pytorch.md, op coverage) or accept them "
            "unperturbed with --accept-unmodelled")


def cmd_compare(args: argparse.Namespace) -> int:
    from tracer.compare.check import compare
    from tracer.report.summary import check_report_path, plot, report_paths, summary, write_json
    check_compare_inputs(args)
    json_path, png_path = report_paths(args.report or default_report(args.candidate))
    for p in (json_path,) if args.no_plot else (json_path, png_path):
        check_report_path(p)  # before the comparison, which can take minutes
    c = compare(args.reference, args.candidate, noise=args.noise, false_alarm=args.false_alarm,
                steps=sorted(set(args.step)) if args.step else None, progress=sys.stderr.isatty(),
                block_scale=args.block_scale, accept_unmodelled=args.accept_unmodelled, skip=args.skip)
    print(summary(c, top=args.top))
    print(f"report: {write_json(c, json_path)}")
    if not args.no_plot:
        print(f"plot: {plot(c, png_path)}")
    if c.verdict == "DIVERGENT":
        return EXIT_DIVERGENT
    if c.verdict == "unverified":
        print(f"{PROG} compare: {unverified_message(c)}", file=sys.stderr)
        return EXIT_UNVERIFIED
    return EXIT_CONSISTENT


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
    c.add_argument("--skip", action="append", metavar="PATTERN",
                   help="leave out the records matching this fnmatch pattern over 'phase name' or the name, on both "
                        "sides (repeatable; e.g. 'fwd *.dropout.*'); they are listed in the report")
    c.add_argument("--accept-unmodelled", action="store_true",
                   help="accept the ops the noise samples did not model (their census): tensors after them are "
                        "judged as usual (else they are 'unmodelled' and the verdict 'unverified', exit 2)")
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
