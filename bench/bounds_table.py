"""Violations and tightness of every error model, per op x format x implementation x mode.

    python bench/bounds_table.py [--trials N] [--only OP] [--modes M,...] [--write docs/bounds.md]

Loads the ``CASES`` of every module in ``bench/cases/``, evaluates each case in each of its
modes (``Case.modes``: deterministic and probabilistic by default, the statistical rows of
``bench/cases/statistical.py`` declare theirs; ``--modes`` keeps a subset) (:func:`bench.harness.evaluate`), prints a table (a statistical
row's violations come with the number of elements and the one-sided binomial p-value at the
claimed rate), and with ``--write`` replaces the table
between the ``<!-- BEGIN BOUNDS TABLE -->`` / ``<!-- END BOUNDS TABLE -->`` markers of the
given markdown file (the derivations around it are hand-written and kept). Rows of ops (and
modes) that were not run this time are kept, so families can be benchmarked separately (``--only``).
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
from ttrace_num.bounds.base import MODES  # noqa: E402

BEGIN, END = "<!-- BEGIN BOUNDS TABLE -->", "<!-- END BOUNDS TABLE -->"
HEADERS = ["op", "data", "fmt", "impl", "mode", "cases", "violations", "tight median", "tight max"]


def load_cases(only: str | None) -> list[Case]:
    out: list[Case] = []
    for info in pkgutil.iter_modules(cases_pkg.__path__):
        mod = importlib.import_module(f"bench.cases.{info.name}")
        out += [c for c in getattr(mod, "CASES", []) if only is None or c.op in only.split(",")]
    return out


def markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _existing_rows(section: str) -> list[list[str]]:
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == len(HEADERS) and cells[0] not in ("op", "---", "") and not cells[0].startswith("-"):
            rows.append(cells)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=200, help="random instances per case and mode")
    ap.add_argument("--only", help="only these ops (comma-separated)")
    ap.add_argument("--write", help="markdown file whose table section to replace")
    ap.add_argument("--max-trials", type=int, help="cap every case's instances (a quick run; the rows say how many ran)")
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"comma-separated subset of {','.join(MODES)} (default: all, where the op supports it)")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes takes a comma-separated subset of {','.join(MODES)}, got {args.modes!r}")
    cases = [c for c in load_cases(args.only) if any(m in modes for m in c.modes)]
    if not cases:
        print("no cases found", file=sys.stderr)
        return 2
    results: list[Result] = []
    t0 = time.time()
    for i, case in enumerate(cases, 1):
        for mode in (m for m in case.modes if m in modes):
            trials = case.trials or args.trials
            r = evaluate(case, mode, min(trials, args.max_trials) if args.max_trials else trials, seed=i)
            results.append(r)
            print(f"[{i}/{len(cases)} {time.time() - t0:6.0f}s] " + "  ".join(r.row()), flush=True)
    new_rows = [r.row() for r in results]
    total_viol = sum(r.violations for r in results if r.mode == "deterministic")
    print("\n" + markdown(new_rows))
    over = [r for r in results if r.mode != "deterministic" and r.p_value < 0.01]
    print(f"\n{len(cases)} cases, modes {','.join(modes)}, {args.trials} instances (or the case's own), "
          f"{time.time() - t0:.0f} s; deterministic violations: {total_viol}; probabilistic/statistical rows "
          f"over their claim (binomial p < 0.01): {len(over)}")
    if args.write:
        path = Path(args.write)
        text = path.read_text() if path.exists() else f"{BEGIN}\n{END}\n"
        if BEGIN not in text or END not in text:
            text += f"\n{BEGIN}\n{END}\n"
        head, rest = text.split(BEGIN, 1)
        section, tail = rest.split(END, 1)
        ran = {(r[0], r[4]) for r in new_rows}  # (op, mode): a --modes subset keeps the other modes' rows
        rows = [r for r in _existing_rows(section) if (r[0], r[4]) not in ran] + new_rows
        rows.sort(key=lambda r: r[0])
        summary = (f"\nDeterministic violations in this table: {sum(int(r[6]) for r in rows if r[4] == 'deterministic')}. "
                   f"Regenerate: `python bench/bounds_table.py --trials {args.trials} --write {args.write}` "
                   f"(`--only OP` for one op).\n")
        path.write_text(head + BEGIN + "\n" + markdown(rows) + "\n" + summary + END + tail)
        print(f"wrote {path}")
    return 1 if total_viol else 0


if __name__ == "__main__":
    sys.exit(main())
