"""Reports of a comparison: terminal summary, JSON file, PNG plot of error/threshold.

The plot shows every compared tensor in the reference's execution order (x) against its
error/threshold ratio (y, log scale), coloured by phase, with the threshold line at 1, the
tensors with status ``unmodelled`` ringed and the first divergence marked: the picture of where a run starts to go wrong.

Report files are written safely (docs/tracing.md, "Exit codes and error messages"): never
through a symbolic link, never over a file this tool did not write (a JSON report carries
``"generator": "ttrace compare"``, a PNG the same ``Software`` text chunk), atomically (a
temporary file in the same directory, then ``os.replace``). :func:`check_report_path` says
before a long comparison whether a path may be written; :class:`ReportPathError` says why not.
"""
from __future__ import annotations

import io
import json
import math
import os
import tempfile
from pathlib import Path

from tracer.compare.check import Comparison
from tracer.errors import TraceError
from tracer.trace.schema import Phase, Status

__all__ = ["GENERATOR", "ReportPathError", "check_report_path", "plot", "report_paths", "summary", "write_json"]

GENERATOR = "ttrace compare"
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class ReportPathError(TraceError):
    """A report cannot be written where asked: a symbolic link, a directory, a file this tool did
    not write, or a directory that does not exist or is not writable."""

_PHASE_COLOURS = {Phase.FWD: "tab:blue", Phase.LOSS: "tab:purple", Phase.BWD: "tab:orange",
                  Phase.GRAD_LOCAL: "tab:olive", Phase.GRAD: "tab:green", Phase.GRAD_NORM: "tab:brown",
                  Phase.OPTIONS: "tab:gray", Phase.PARAM: "tab:red"}


def _fmt_ratio(r: float) -> str:
    return "inf" if math.isinf(r) else ("n/a" if math.isnan(r) else f"{r:.3g}")


#: statuses of a tensor that diverges (the first divergence is the first of them)
DIVERGED = (Status.OVER, Status.NONFINITE, Status.REPLICAS)
#: statuses of a tensor that is neither within its threshold nor a divergence
NOT_JUDGED = (Status.UNMODELLED, Status.UNCHECKED)


def _few(items: list[str], shown: int = 3) -> str:
    return "; ".join(items[:shown]) + (f"; and {len(items) - shown} more" if len(items) > shown else "")


def _coverage_lines(c: Comparison) -> list[str]:
    """The op coverage of the noise samples (:class:`tracer.compare.coverage.Coverage`): its
    summary line, the ops accepted unperturbed with their reasons, the optimizer's ops."""
    cov = c.coverage
    if cov is None:
        return []
    lines = [f"  {cov.summary()}"]
    if cov.recorded and cov.accepted:
        lines.append("  accepted unperturbed by the integration:")
        lines += [f"    {op}: {why}" for op, why in sorted(cov.accepted.items())]
    if cov.recorded and cov.optimizer:
        lines.append("  not perturbed inside the optimizer's step (assumed the same elementwise update in the "
                     "candidate): " + ", ".join(f"{op} x{n}" for op, n in cov.optimizer.items()))
    return lines


def summary(c: Comparison, top: int = 5) -> str:
    """Human-readable verdict: counts, the safety margin, what was matched, left out and not
    modelled, the first divergence and where it is."""
    counts = c.counts()
    lines = [f"verdict: {c.verdict}   ({len(c.rows)} tensors compared: "
             + ", ".join(f"{v} {k}" for k, v in sorted((str(k), v) for k, v in counts.items())) + ")",
             f"  reference {c.reference}"
             + (f" (distributed reference: {c.reference_world_size} ranks, layout {c.reference_layout})"
                if c.distributed_reference else "")
             + f"  vs  candidate {c.candidate} (layout {c.candidate_layout})",
             f"  thresholds: {c.noise_samples} noise samples, false-alarm probability {c.false_alarm:g} per "
             f"comparison; largest error/threshold within threshold: {c.max_ratio_ok:.3g}"]
    if c.exactness:
        lines.append(f"  bitwise where the layout leaves the arithmetic unchanged (tracer.compare.exactness): {c.exactness}")
    for side, prefixes in sorted(c.stripped_prefixes.items()):
        lines.append(f"  names matched after stripping {', '.join(repr(p) for p in prefixes)} from the {side}")
    if c.skipped:
        lines.append(f"  {len(c.skipped)} records left out by --skip/skip= (either side): {_few(c.skipped)}")
    if c.unmatched:
        lines.append(f"  {len(c.unmatched)} tensors traced by one run only (not compared), e.g. {c.unmatched[0]}")
    lines += _coverage_lines(c)
    not_judged = [r for r in c.rows if str(r.status) in NOT_JUDGED]
    f = c.first
    if f is None:
        if c.nothing_judged:
            lines.append(f"  no tensor could be judged: all {len(c.rows)} unchecked, so nothing is verified")
        elif c.verdict == "unverified":
            lines.append(f"  no tensor over its threshold, but {counts.get(Status.UNMODELLED, 0)} tensor(s) come after "
                         "ops without an error model: not verified (accept the ops with --accept-unmodelled / "
                         "compare(accept_unmodelled=True), or model them)")
        else:
            lines.append("  no tensor over its threshold")
    else:
        where = f"candidate rank(s) {f.worst_ranks}" if f.worst_ranks else "all ranks"
        lines += [f"first divergence: step {f.step}, phase {f.phase}, tensor {f.name}"
                  + (f" (microbatch {f.microbatch})" if f.phase in (Phase.FWD, Phase.BWD, Phase.LOSS) else ""),
                  f"  module {f.module or '-'}; " + (
                      f"element statistic: element {f.element_index} (flat index) is {f.element_ratio:.4g}x its own "
                      f"legitimate threshold (a few wrong elements; norm of the difference {f.error:.4g} vs "
                      f"{f.threshold:.4g})" if f.by_element and math.isfinite(f.element_ratio) else
                      f"block-scale statistic {f.scale_error:.4g} vs threshold {f.scale_threshold:.4g} (a difference "
                      f"that rescales the reference; norm of the difference {f.error:.4g} vs {f.threshold:.4g})"
                      if f.by_scale else f"error {f.error:.4g} vs threshold {f.threshold:.4g}")
                  + f" = {_fmt_ratio(f.ratio)}x over ({f.status}); max |diff| {f.max_abs:.3g} on {where}",
                  f"  {f.note}" if f.note else "",
                  f"localisation: {c.localisation}"]
        over = [r for r in c.rows if str(r.status) in DIVERGED]
        worst = sorted(over, key=lambda r: -r.ratio if not math.isnan(r.ratio) else 0)
        lines.append(f"  {len(over)} tensors over threshold; largest:")
        lines += [f"    {_fmt_ratio(r.ratio):>8}x  {r.label}" for r in worst[:top]]
    if not_judged:
        by = {st: sum(str(r.status) == st for r in not_judged) for st in NOT_JUDGED}
        lines.append("  not judged: " + ", ".join(f"{n} {st}" for st, n in by.items() if n) + "; first: "
                     + _few([f"{r.label}: {r.status}" for r in not_judged], shown=min(top, 3) or 1))
    return "\n".join(x for x in lines if x)


def report_paths(prefix: str | Path) -> tuple[Path, Path]:
    """The JSON and PNG paths of a report prefix (``out/r`` or ``out/r.json`` -> ``out/r.json``, ``out/r.png``)."""
    p = str(prefix)
    for suffix in (".json", ".png"):
        p = p[:-len(suffix)] if p.endswith(suffix) else p
    return Path(p + ".json"), Path(p + ".png")


def _written_by_us(path: Path) -> bool:
    """Whether ``path`` holds a report this tool wrote (its generator marker)."""
    try:
        data = path.read_bytes()
    except OSError:
        return False
    if data.startswith(_PNG_SIGNATURE):  # chunks: length, type, data, CRC; tEXt data is key NUL value
        i = len(_PNG_SIGNATURE)
        while i + 8 <= len(data):
            n, kind = int.from_bytes(data[i:i + 4], "big"), data[i + 4:i + 8]
            if kind == b"tEXt" and data[i + 8:i + 8 + n] == b"Software\0" + GENERATOR.encode():
                return True
            i += 12 + n
        return False
    try:
        obj = json.loads(data)
    except ValueError:
        return False
    return isinstance(obj, dict) and obj.get("generator") == GENERATOR


def check_report_path(path: str | Path) -> None:
    """Raise :class:`ReportPathError` unless a report may be written at ``path``: not a symbolic
    link, not a directory, absent or a report this tool wrote, in a directory that exists or can
    be created and is writable."""
    path = Path(path)
    if path.is_symlink():
        raise ReportPathError("the report path is a symbolic link; refusing to write through it: remove the link "
                              "or choose another --report", path=path)
    if path.exists():
        if not path.is_file():
            raise ReportPathError("the report path exists and is not a regular file; choose another --report", path=path)
        if not _written_by_us(path):
            raise ReportPathError(f"a file that {GENERATOR} did not write is in the way (it lacks the report's "
                                  f"generator marker); refusing to overwrite it: move it or choose another --report",
                                  path=path)
    parent = Path(os.path.abspath(path)).parent
    existing = next(d for d in (parent, *parent.parents) if d.exists() or d.is_symlink())
    if not existing.is_dir():
        raise ReportPathError(f"cannot create the report's directory: {existing} is not a directory", path=path)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ReportPathError(f"the directory {existing} is not writable; choose another --report", path=path)


def _write_report(path: Path, data: bytes) -> Path:
    """Write ``data`` at ``path`` if :func:`check_report_path` allows: a temporary file in the same
    directory, then ``os.replace`` (which replaces a name, never writes through a link)."""
    check_report_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # O_EXCL, never a link
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the report from its other readers
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        check_report_path(path)  # again: nothing may have appeared in the meantime
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def write_json(c: Comparison, path: str | Path) -> Path:
    """The whole comparison (every tensor's row) as JSON, with the ``"generator"`` marker;
    infinities are written as strings. Written safely (module docstring)."""
    def clean(o):
        if isinstance(o, float) and not math.isfinite(o):
            return str(o)
        if isinstance(o, dict):
            return {k: clean(v) for k, v in o.items()}
        if isinstance(o, list):
            return [clean(v) for v in o]
        return o
    return _write_report(Path(path), json.dumps({"generator": GENERATOR, **clean(c.to_dict())}, indent=1).encode())


def plot(c: Comparison, path: str | Path, title: str | None = None) -> Path:
    """PNG of error/threshold along the execution order, with the ``Software`` marker; written
    safely (see module docstring)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    path = Path(path)
    check_report_path(path)  # before the drawing
    fig, ax = plt.subplots(figsize=(11, 4))
    xs = range(len(c.rows))
    floor = 1e-4
    ys = [min(max(r.ratio, floor), 1e4) if not math.isnan(r.ratio) else floor for r in c.rows]
    for phase, colour in _PHASE_COLOURS.items():
        pts = [(x, y) for x, y, r in zip(xs, ys, c.rows) if r.phase == phase]
        if pts:
            ax.scatter(*zip(*pts), s=6, c=colour, label=phase)
    unmodelled = [(x, y) for x, y, r in zip(xs, ys, c.rows) if str(r.status) == Status.UNMODELLED]
    if unmodelled:  # ringed: within threshold, but the threshold does not cover an unmodelled op
        ax.scatter(*zip(*unmodelled), s=30, facecolors="none", edgecolors="black", lw=0.6,
                   label="unmodelled (not verified)")
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
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": GENERATOR})
    plt.close(fig)
    return _write_report(path, buf.getvalue())
