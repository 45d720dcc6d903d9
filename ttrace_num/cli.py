"""``ttrace`` command line: numerics subcommands.

``ttrace formats``                      table of every known format and its constants
``ttrace tolerance OP [inputs] [opts]``  the bound of an op on tensors from a safetensors
                                        file or on generated data; ``--json`` for machines
``ttrace calibrate --format F [opts]``   Monte Carlo calibration of the probabilistic models
                                        for a format (:mod:`ttrace_num.calibrate`)

The parser is built by :func:`build_parser` so that other packages (the tracer) can add
subcommands without this package importing them.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Callable, Sequence

import torch

import ttrace_num as tn
from .calibrate.distributions import DISTRIBUTIONS
from .bounds.base import MODES
from .formats import FORMATS, get_format

__all__ = ["main", "build_parser", "generate", "run_cli", "UsageError", "DISTRIBUTIONS", "EXIT_OK", "EXIT_DIVERGENT",
           "EXIT_BAD_INPUT", "EXIT_INTERNAL"]

EXIT_OK, EXIT_DIVERGENT, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3


class UsageError(Exception):
    """Bad input on the command line (a value, a path, a combination of options): :func:`run_cli`
    prints the message on one line and exits 2."""


def run_cli(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
            bad_input: tuple[type[BaseException], ...] = ()) -> int:
    """Parse ``argv`` and run the chosen command (``args.func``); the one place that turns an
    outcome into an exit status (docs/tracing.md, "Exit codes and error messages"):

    * the command's return value: 0 success / consistent, 1 DIVERGENT;
    * 2, bad input: argparse's usage errors (their own message), :class:`UsageError`, the
      exception types in ``bad_input`` (the tracer's ``TraceError``; an ``exit_code`` attribute
      of the exception overrides the 2), and ``OSError`` (a path that cannot be read or written);
    * 3, an internal error: any other exception, reported in one paragraph; the traceback only
      with ``TTRACE_DEBUG=1``.
    """
    prog = parser.prog
    try:
        args = parser.parse_args(argv)
        prog = f"{parser.prog} {getattr(args, 'command', '') or ''}".strip()
        return int(args.func(args) or 0)
    except SystemExit as e:  # argparse: usage error (2), --help / --version (0)
        if e.code is None or isinstance(e.code, int):
            return int(e.code or 0)
        print(f"{prog}: {e.code}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except (UsageError, OSError, *bad_input) as e:
        if isinstance(e, OSError) and e.filename is not None:
            msg = f"cannot access {e.filename}: {e.strerror or e}"
        else:
            msg = str(e)
        print(f"{prog}: {msg}", file=sys.stderr)
        code = getattr(e, "exit_code", EXIT_BAD_INPUT)
        return code if isinstance(code, int) else EXIT_BAD_INPUT
    except Exception as e:
        print(f"{prog}: internal error, please report it with the command line that caused it: "
              f"{type(e).__name__}: {e}"
              + ("" if os.environ.get("TTRACE_DEBUG") else " (set TTRACE_DEBUG=1 to print the traceback)"),
              file=sys.stderr)
        if os.environ.get("TTRACE_DEBUG"):
            traceback.print_exc()
        return EXIT_INTERNAL


# ------------------------------------------------- argparse types: one-line errors
def _number(s: str, kind: type) -> float | int:
    try:
        return kind(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {s!r}") from None


def probability(s: str) -> float:
    """argparse type: a finite float strictly between 0 and 1."""
    v = _number(s, float)
    if not 0 < v < 1:  # NaN fails too
        raise argparse.ArgumentTypeError(f"expected a probability strictly between 0 and 1, got {s!r}")
    return v


def int_at_least(lo: int) -> Callable[[str], int]:
    """argparse type: an integer ``>= lo``."""
    def parse(s: str) -> int:
        v = _number(s, int)
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {s!r}")
        return v
    parse.__name__ = f"integer >= {lo}"
    return parse


def readable_file(s: str) -> str:
    """argparse type: an existing regular file."""
    if not os.path.isfile(s):
        raise argparse.ArgumentTypeError(f"file {s!r} not found" if not os.path.exists(s) else f"{s!r} is not a file")
    return s


def writable_file(s: str) -> str:
    """argparse type: a path a file can be written to (not a directory; its directory exists and is writable)."""
    d = os.path.dirname(os.path.abspath(s))
    if os.path.isdir(s):
        raise argparse.ArgumentTypeError(f"{s!r} is a directory; expected a file name")
    if not os.path.isdir(d) or not os.access(d, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {s!r}: directory {d!r} "
                                         + ("does not exist" if not os.path.isdir(d) else "is not writable"))
    return s


def writable_dir(s: str) -> str:
    """argparse type: a directory that exists and is writable, or can be created."""
    p = Path(os.path.abspath(s))
    existing = next(q for q in (p, *p.parents) if q.exists())
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"cannot use {s!r} as a directory: {str(existing)!r} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write into {s!r}: {str(existing)!r} is not writable")
    return s


def format_spec(s: str) -> str:
    """argparse type: a format name or ``custom(e=.., m=..)`` spec (:func:`ttrace_num.formats.get_format`)."""
    try:
        get_format(s).constants()
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    except OverflowError:
        raise argparse.ArgumentTypeError(f"format {s!r}: its range exceeds float64's; use fewer exponent bits "
                                         "or a bias nearer 2**(e-1) - 1") from None
    return s


def _torch_format(s: str) -> str:
    """argparse type of ``--dtype``: a format with a torch dtype (data is generated in it)."""
    if get_format(format_spec(s)).torch_dtype is None:
        have = ", ".join(f.name for f in FORMATS.values() if f.torch_dtype is not None)
        raise argparse.ArgumentTypeError(f"format {s!r} has no torch dtype to generate data in; use one of {have}")
    return s


def comma_list(choices: Sequence[str], what: str, all_ok: bool = False) -> Callable[[str], list[str]]:
    """argparse type: a comma-separated list of names from ``choices`` (``"all"``: all of them)."""
    def parse(s: str) -> list[str]:
        if all_ok and s.strip() == "all":
            return list(choices)
        names = [x.strip() for x in s.split(",") if x.strip()]
        bad = [x for x in names if x not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError((f"unknown {what} {', '.join(map(repr, bad))}" if bad else
                                              f"expected a comma-separated list of {what}s, got {s!r}")
                                             + f"; choose from {', '.join(choices)}" + (" or 'all'" if all_ok else ""))
        return names
    parse.__name__ = f"{what} list"
    return parse


def _fmt_num(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


# ------------------------------------------------------------------- formats
def cmd_formats(args: argparse.Namespace) -> int:
    fmts = list(FORMATS.values()) + [get_format(c) for c in args.custom or []]
    cal = None
    if args.calibration:
        from .calibrate import CalibrationError, load, same_format
        try:
            cal = load(args.calibration)
        except CalibrationError as e:
            raise UsageError(f"--calibration: {e}") from None
        if not any(same_format(f, cal.fmt) for f in fmts):
            fmts.append(cal.fmt)
    consts = [f.constants() for f in fmts]
    if cal is not None:  # the calibrated format's entry says which constants are in use
        for f, c in zip(fmts, consts):
            if same_format(f, cal.fmt):
                c["calibration"] = {"file": args.calibration, "compute_fmt": cal.compute_fmt, "recipe": cal.recipe,
                                    "kappa": {op: e.kappa for op, e in cal.ops.items()}}
    if args.json:
        print(json.dumps(consts, indent=2))
        return 0
    cols = ["name", "bits", "exponent_bits", "mantissa_bits", "bias", "u", "max", "min_normal", "min_subnormal", "inf", "nan", "overflow"]
    print(_table(["format", "bits", "e", "m", "bias", "u", "max", "min normal", "min subnormal", "inf", "NaN", "overflow"],
                 [[_fmt_num(c[k]) + ("*" if k == "name" and "calibration" in c else "") for k in cols] for c in consts]))
    if cal is not None:
        print(f"\n* calibrated constants in use for {cal.fmt_spec} (compute {cal.compute_fmt}"
              + (f", recipe {cal.recipe}" if cal.recipe else "") + f") from {args.calibration}:")
        for op, e in cal.ops.items():
            print(f"  {op}: kappa={e.kappa:.4g} (threshold = kappa * probabilistic bound, per-instance p={e.p:g})")
    return 0


# ----------------------------------------------------------------- tolerance
_INT_TARGET_OPS = {"cross_entropy", "vocab_parallel_cross_entropy"}


def generate(op: str, shapes: Sequence[tuple[int, ...]], dist: str, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Inputs for ``op``: one tensor per shape from ``dist`` in ``dtype``; for cross-entropy ops
    a second shape-less input is the int64 target vector drawn uniformly over the vocab."""
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {dist!r}; choose from {', '.join(DISTRIBUTIONS)}")
    g = torch.Generator().manual_seed(seed)
    tensors = [DISTRIBUTIONS[dist](tuple(s), g).to(dtype) for s in shapes]
    if op in _INT_TARGET_OPS and len(tensors) == 1:
        n, v = shapes[0][0], shapes[0][-1]
        tensors.append(torch.randint(0, v, (n,), generator=g))
    return tensors


def _parse_shape(s: str) -> tuple[int, ...]:
    """``"64x512"`` (or ``"64,512"``) -> ``(64, 512)``: one or more positive sizes."""
    dims = s.strip().lower().replace(",", "x").split("x")
    if not all(d.strip().isdigit() and int(d) > 0 for d in dims):
        raise argparse.ArgumentTypeError(f"bad shape {s!r}; write positive sizes separated by x, e.g. 64x512")
    return tuple(int(d) for d in dims)


def _parse_kw(item: str) -> tuple[str, object]:
    """``--kw key=value``: the value as a Python literal where it parses as one, else a string."""
    k, sep, v = item.partition("=")
    if not sep or not k.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE with KEY a keyword name, e.g. dim=-1, got {item!r}")
    try:
        return k.strip(), ast.literal_eval(v)
    except (ValueError, SyntaxError):
        return k.strip(), v  # plain string, e.g. approximate=tanh


def _op_name(s: str) -> str:
    if s not in tn.ops():
        raise argparse.ArgumentTypeError(f"unknown op {s!r}; one of: {', '.join(tn.ops())}")
    return s


def _names(s: str) -> list[str]:
    names = [n.strip() for n in s.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated tensor names, got {s!r}")
    return names


def _recipe(s: str) -> str:
    from . import scaling
    try:
        scaling.get_recipe(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


def _load_inputs(path: str, names: Sequence[str]) -> list[torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        tensors = load_file(path)
    except FileNotFoundError:
        raise UsageError(f"input file {path!r} not found") from None
    except (SafetensorError, OSError) as e:
        raise UsageError(f"--file: cannot read {path!r} as safetensors ({e}); is the file complete?") from None
    if not names:
        names = list(tensors)
    missing = [n for n in names if n not in tensors]
    if missing:
        raise UsageError(f"--inputs: {path}: no tensor named {', '.join(missing)}; the file holds "
                         f"{', '.join(tensors) or 'nothing'}")
    return [tensors[n] for n in names]


def _check_file_options(args: argparse.Namespace) -> None:
    if args.inputs and not args.file:
        raise UsageError("--inputs names tensors of --file; give --file F.safetensors too")


def cmd_tolerance(args: argparse.Namespace) -> int:
    kw = dict(args.kw or [])
    _check_file_options(args)
    if args.file:
        if args.shape:
            raise UsageError("give either --file (the inputs from a safetensors file) or --shape (generated inputs), "
                             "not both")
        inputs = _load_inputs(args.file, args.inputs or [])
        source = f"{args.file}"
    else:
        if not args.shape:
            raise UsageError("give --file F.safetensors [--inputs a,b] or one --shape per input (e.g. --shape 64x512 --shape 512x32)")
        inputs = generate(args.op, args.shape, args.dist, get_format(args.dtype).torch_dtype, args.seed)
        source = f"generated {args.dist} data, seed {args.seed}"
        if args.fmt:  # generated data are stored in --fmt (the bound takes the inputs as values of it)
            inputs = [tn.round_to(t, args.fmt).to(t.dtype) if t.is_floating_point() else t for t in inputs]
            source += f", rounded to {args.fmt}"
    for t in inputs:
        if t.is_floating_point() and not torch.isfinite(t.to(torch.float64)).all():
            raise UsageError("input contains NaN/Inf; a tolerance is only defined for finite inputs")
    if args.calibration:
        kw["calibration"] = args.calibration
    try:
        fp = ({} if args.calibration else {"failure_probability": args.failure_probability} if args.mode == "probabilistic"
              else {"false_alarm": args.failure_probability} if args.mode == "statistical" else {})
        bound = tn.tolerance(args.op, *inputs, fmt=args.fmt, compute_fmt=args.compute_fmt, mode=args.mode, **fp, **kw)
    except (TypeError, ValueError, IndexError, RuntimeError) as e:  # from the user's inputs, shapes and --kw
        raise UsageError(f"{args.op} on these inputs and --kw: {e}") from None
    atol, rtol = bound.atol_rtol()
    summary = {
        "op": args.op, "inputs": source, "shapes": [list(t.shape) for t in inputs],
        "dtypes": [str(t.dtype).replace("torch.", "") for t in inputs], "mode": bound.mode,
        "failure_probability": bound.failure_probability, "max_abs": bound.max(),
        "median_abs": float(bound.abs.median()), "atol": atol, "rtol": rtol,
        "explanation": bound.explanation.to_dict(),
    }
    if args.save:
        from safetensors.torch import save_file
        save_file({"bound": bound.abs.contiguous()}, args.save)
        summary["saved"] = args.save
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"{args.op} on {source}: shapes {summary['shapes']} dtypes {summary['dtypes']}")
    print(f"  max |err| bound     {summary['max_abs']:.6g}")
    print(f"  median |err| bound  {summary['median_abs']:.6g}")
    print(f"  covering atol/rtol  atol={atol:.3g} rtol={rtol:.3g}")
    if args.calibration:
        print(f"  {bound.explanation.source}")
    print(bound.explain())
    return 0


# ----------------------------------------------------------------- calibrate
def _progress_bar(total: int) -> tuple[Callable[[int], None], Callable[[], None]]:
    try:
        from tqdm import tqdm
    except ImportError:
        return (lambda k: None), (lambda: None)
    bar = tqdm(total=total, unit="inst", file=sys.stderr)
    return bar.update, bar.close


def _parse_op_shape(s: str) -> tuple[str, tuple[int, ...]]:
    """``OP=AxB...`` -> ``(op, (A, B, ...))``."""
    op, sep, shape = s.partition("=")
    if not sep or not op.strip():
        raise argparse.ArgumentTypeError(f"bad --shape {s!r}; write OP=AxB..., e.g. matmul=64x256x64")
    if op.strip() not in _calibratable():
        raise argparse.ArgumentTypeError(f"cannot calibrate {op.strip()}: the calibratable ops are "
                                         f"{', '.join(_calibratable())}")
    return op.strip(), _parse_shape(shape)


def _calibratable() -> list[str]:
    from .calibrate import ALL_OPS
    return list(ALL_OPS)


def _default_op_shapes() -> dict[str, str]:
    """Default op shape per calibratable op (quantize ops: without a 128x128 recipe)."""
    from . import scaling
    from .calibrate.ops import SPECS, Setup
    s = Setup(get_format("e4m3"), get_format("fp32"), scaling.get_recipe("tensor"), get_format("fp32"))
    return {op: "x".join(map(str, spec.shape(s))) for op, spec in SPECS.items()}


def cmd_calibrate(args: argparse.Namespace) -> int:
    import re

    from .calibrate import CalibrationError, calibrate, plot
    ops = args.ops
    _check_file_options(args)
    tensors = None
    if args.file:
        names = args.inputs or []
        loaded = _load_inputs(args.file, names)  # clear errors for a missing/corrupt file or tensor
        if not names:  # all tensors, in the file's order (that of _load_inputs)
            from safetensors import safe_open
            with safe_open(args.file, "pt") as fh:
                names = list(fh.keys())
        tensors = dict(zip(names, loaded))
    update, close = _progress_bar(len(ops) * args.samples * (1 if args.file else len(args.dist)))
    ratios: dict[str, torch.Tensor] = {}
    try:
        cal = calibrate(args.format, ops, recipe=args.recipe, compute_fmt=args.compute_fmt, out_fmt=args.out_fmt,
                        samples=args.samples, seed=args.seed, distributions=args.dist, tensors=tensors,
                        shapes=dict(args.shape or []), p=args.p, confidence=args.confidence, progress=update,
                        keep=ratios, origin=f"file {args.file}")
    except CalibrationError as e:
        raise UsageError(str(e)) from None
    finally:
        close()
    tag = re.sub(r"[^A-Za-z0-9]+", "_", str(cal.format["name"])).strip("_") + (f"_{cal.recipe}" if cal.recipe else "")
    out = args.out or f"calibration_{tag}.json"
    cal.save(out)
    rows = [[op, f"{e.kappa:.4g}", f"{e.kappa_point:.4g}", f"{e.n_fit}", f"{e.heldout_violations}/{e.n_heldout}",
             f"{e.heldout_pvalue:.3g}", f"{e.ratio:.3g}"] for op, e in cal.ops.items()]
    print(f"calibration of {cal.format['name']}" + (f" (recipe {cal.recipe})" if cal.recipe else "")
          + f", compute {cal.compute_fmt}" + (f", GEMM/reduction output {args.out_fmt}" if args.out_fmt else "")
          + f", per-instance p={args.p:g}, confidence {args.confidence:g}, seed {args.seed}")
    print(_table(["op", "kappa (UCB)", "kappa (point)", "n_fit", "held-out viol.", "binom p-value",
                  "calibrated/analytic"], rows))
    for op, why in cal.skipped.items():
        print(f"skipped {op}: {why}")
    bad = [op for op, e in cal.ops.items() if e.heldout_pvalue < 0.01]
    if bad:
        print(f"WARNING: held-out violations too frequent for {', '.join(bad)} (binomial p < 0.01): do not use these")
    print(f"wrote {out}")
    if args.plots:
        for path in plot(cal, ratios, args.plots):
            print(f"wrote {path}")
    return 0


def build_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    p = argparse.ArgumentParser(prog="ttrace", description="Derived numerical tolerances and traced comparisons of training runs.")
    p.add_argument("--version", action="version", version=f"ttrace-num {tn.__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    f = sub.add_parser("formats", help="table of every known float format and its constants")
    f.add_argument("--custom", action="append", type=format_spec, metavar="SPEC", help="also show a custom format, e.g. 'custom(e=3, m=2)'")
    f.add_argument("--json", action="store_true")
    f.add_argument("--calibration", type=readable_file, metavar="CAL.json", help="also list the calibrated constants of this file")
    f.set_defaults(func=cmd_formats)

    t = sub.add_parser("tolerance", help="bound on |computed - exact| for an op on given or generated inputs",
                       epilog="examples:\n  ttrace tolerance matmul --shape 64x512 --shape 512x32 --dtype bf16\n"
                              "  ttrace tolerance softmax --shape 8x4096 --dtype bf16 --mode probabilistic --json\n"
                              "  ttrace tolerance layer_norm --file acts.safetensors --inputs x --kw eps=1e-5",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("op", type=_op_name, help=f"one of: {', '.join(tn.ops())}")
    t.add_argument("--file", type=readable_file, help="safetensors file holding the inputs")
    t.add_argument("--inputs", type=_names, help="comma-separated tensor names in --file, in the op's argument order")
    t.add_argument("--shape", action="append", type=_parse_shape, help="shape of one generated input (repeat per input)")
    t.add_argument("--dist", default="normal", choices=DISTRIBUTIONS, help=f"distribution of generated data: {', '.join(DISTRIBUTIONS)}")
    t.add_argument("--dtype", default="fp32", type=_torch_format,
                   help="dtype of generated data (fp32, bf16, fp16, fp64, e4m3, ...)")
    t.add_argument("--seed", type=int_at_least(0), default=0)
    t.add_argument("--fmt", type=format_spec, help="storage format (default: the inputs' dtype)")
    t.add_argument("--compute-fmt", dest="compute_fmt", type=format_spec, help="compute/accumulation format (default fp32 for narrower inputs)")
    t.add_argument("--mode", choices=MODES, default="deterministic",
                   help="deterministic (worst case), probabilistic (per-element failure probability), statistical "
                        "(z sigma of the expected error; per-element false-alarm rate --failure-probability)")
    t.add_argument("--failure-probability", dest="failure_probability", type=probability, default=1e-6)
    t.add_argument("--kw", action="append", type=_parse_kw, metavar="KEY=VALUE", help="op keyword argument, e.g. dim=-1, eps=1e-5 (repeatable)")
    t.add_argument("--save", type=writable_file, metavar="OUT.safetensors", help="save the elementwise bound tensor")
    t.add_argument("--json", action="store_true", help="machine-readable output")
    t.add_argument("--calibration", type=readable_file, metavar="CAL.json", help="scale the probabilistic bound by a calibrated constant "
                   "(file from `ttrace calibrate`)")
    t.set_defaults(func=cmd_tolerance)

    c = sub.add_parser("calibrate", help="Monte Carlo calibration of the probabilistic error models for a format",
                       epilog="examples:\n  ttrace calibrate --format e4m3 --ops all --out e4m3.json --plots plots/\n"
                              "  ttrace calibrate --format e2m1 --recipe mx32\n"
                              "  ttrace calibrate --format 'custom(e=3, m=2)' --ops softmax,gelu --samples 1000",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("--format", required=True, dest="format", type=format_spec, help="format to calibrate (e4m3, e2m1, 'custom(e=3, m=2)', ...)")
    c.add_argument("--ops", default="all", type=comma_list(_calibratable(), "calibratable op", all_ok=True), help="'all' or a comma-separated list of calibratable ops")
    c.add_argument("--recipe", type=_recipe, help="scaling recipe of the quantize ops: tensor, row, 1x128, 128x128, mx32")
    c.add_argument("--compute-fmt", dest="compute_fmt", default="fp32", type=format_spec, help="accumulation/intermediate format")
    c.add_argument("--out-fmt", dest="out_fmt", type=format_spec, help="output format of matmul, linear, sum, mean and quantized_matmul "
                   "(default: the compute format; the other ops output the calibrated format)")
    c.add_argument("--samples", type=int_at_least(2), default=300, help="instances per op and distribution (half fit, half held-out)")
    c.add_argument("--seed", type=int_at_least(0), default=0)
    c.add_argument("--p", type=probability, default=0.02, help="per-instance exceedance probability of the threshold")
    c.add_argument("--confidence", type=probability, default=0.9, help="confidence of the upper bound on the quantile")
    c.add_argument("--dist", default="normal", type=comma_list(list(DISTRIBUTIONS), "distribution"), help=f"comma-separated distributions: {', '.join(DISTRIBUTIONS)}")
    c.add_argument("--shape", action="append", type=_parse_op_shape, metavar="OP=AxB...",
                   help="op shape of one op's instances (repeatable), e.g. matmul=64x256x64 (m x K x n), "
                        "softmax=32x1024 (32 rows of 1024), attention=2x16x32 (heads x L x d); defaults: "
                        f"{', '.join(f'{op}={shape}' for op, shape in _default_op_shapes().items())}")
    c.add_argument("--file", type=readable_file, help="safetensors file whose tensors give the instances instead of --dist: the op's "
                                  "tensor arguments in order; instances are blocks of whole rows (attention: "
                                  "(L, d) heads), a matmul/linear weight is used whole (docs/calibration.md)")
    c.add_argument("--inputs", type=_names, help="comma-separated tensor names in --file, in the ops' argument order (default: all)")
    c.add_argument("--out", type=writable_file, help="output JSON (default calibration_<format>[_<recipe>].json)")
    c.add_argument("--plots", type=writable_dir, metavar="DIR", help="write one PNG per op into DIR")
    c.set_defaults(func=cmd_calibrate)

    return p, sub


def main(argv: Sequence[str] | None = None) -> int:
    """``ttrace`` without the tracer's commands; exit status as in :func:`run_cli`."""
    return run_cli(build_parser()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
