"""Violations and tightness of every error model, per op x format x implementation x mode.

    python bench/bounds_table.py [--trials N] [--only OP] [--write docs/bounds.md]

Loads the ``CASES`` of every module in ``bench/cases/``, evaluates each case in both modes
(:func:`bench.harness.evaluate`), prints a table, and with ``--write`` replaces the table
between the ``<!-- BEGIN BOUNDS TABLE -->`` / ``<!-- END BOUNDS TABLE -->`` markers of the
given markdown file (the derivations around it are hand-written and kept).
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import cases as cases_pkg  # noqa: E402
from bench.harness import Case, Result, evaluate  # noqa: E402

BEGIN, END = "<!-- BEGIN BOUNDS TABLE -->", "<!-- END BOUNDS TABLE -->"
HEADERS = ["op", "data", "fmt", "impl", "mode", "cases", "violations", "tight median", "tight max"]


def load_cases(only: str | None) -> list[Case]:
    out: list[Case] = []
    for info in pkgutil.iter_modules(cases_pkg.__path__):
        mod = importlib.import_module(f"bench.cases.{info.name}")
        out += [c for c in getattr(mod, "CASES", []) if only is None or c.op == only]
    return out


def markdown(results: list[Result]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(r.row()) + " |" for r in results]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=200, help="random instances per case and mode")
    ap.add_argument("--only", help="only this op")
    ap.add_argument("--write", help="markdown file whose table section to replace")
    args = ap.parse_args(argv)
    cases = load_cases(args.only)
    if not cases:
        print("no cases found", file=sys.stderr)
        return 2
    results: list[Result] = []
    t0 = time.time()
    for i, case in enumerate(cases, 1):
        for mode in ("deterministic", "probabilistic"):
            r = evaluate(case, mode, args.trials, seed=i)
            results.append(r)
            print(f"[{i}/{len(cases)} {time.time() - t0:6.0f}s] " + "  ".join(r.row()), flush=True)
    table = markdown(results)
    total_viol = sum(r.violations for r in results if r.mode == "deterministic")
    summary = (f"\n{len(cases)} cases x 2 modes x {args.trials} instances; deterministic violations: {total_viol}; "
               f"command: `python bench/bounds_table.py --trials {args.trials}`\n")
    print("\n" + table + summary)
    if args.write:
        path = Path(args.write)
        text = path.read_text() if path.exists() else f"{BEGIN}\n{END}\n"
        if BEGIN not in text or END not in text:
            text += f"\n{BEGIN}\n{END}\n"
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        path.write_text(head + BEGIN + "\n" + table + "\n" + summary + END + tail)
        print(f"wrote {path}")
    return 1 if total_viol else 0


if __name__ == "__main__":
    sys.exit(main())
