r"""Monte Carlo calibration of the probabilistic error models for a (new) number format.

The analytic probabilistic bounds ``B`` (``tolerance(op, ..., mode="probabilistic")``) are
derived from worst-case-friendly tail inequalities (Azuma-Hoeffding with ``lambda`` for a
per-element failure probability of ``1e-6``) and are often several times larger than the
errors a given format actually makes. A team adopting a new format measures the real error
distribution and fits one constant per operator:

**Model.** For one *instance* (one independent draw of the op's inputs: a tensor of
elements) let ``r = max_i |computed_i - exact_i| / B_i``, the largest error of the instance
in units of the analytic bound. The fitted constant is ``kappa``, an upper confidence bound
on the ``(1 - p)`` quantile of ``r``: the calibrated threshold ``kappa * B`` (an effective
``lambda' = kappa * lambda``) is exceeded *anywhere in an instance* with probability at
most ``p``, with confidence ``confidence``. Taking the per-instance maximum makes the
samples independent (instances are independent draws; the elements of one instance are
not: they share inputs and roundings), and the claim is per instance, which implies the
same per-element claim.

**Upper confidence bound (distribution-free, from order statistics).** Sort the ``n`` fit
samples ``r_(1) <= ... <= r_(n)`` and let ``q`` be the true ``(1 - p)`` quantile. The
number of samples below ``q`` is ``Binomial(n, F(q-))`` with ``F(q-) <= 1 - p``, so
``P(r_(k) >= q) = P(#{r_i < q} < k) >= P(Binomial(n, 1 - p) < k)``. ``kappa = r_(k)`` with
the smallest ``k`` such that ``P(Binomial(n, 1 - p) < k) >= confidence`` is therefore
``>= q`` with probability ``>= confidence`` whatever the distribution of ``r`` (exact
binomial argument, e.g. Conover, *Practical Nonparametric Statistics*, 3rd ed., sec. 3.2;
Hahn & Meeker, *Statistical Intervals*, sec. 5.3). Such a ``k <= n`` exists iff
``1 - (1 - p)^n >= confidence``, i.e. ``n >= ln(1 - confidence) / ln(1 - p)``; fewer fit
samples are refused.

**Validation.** The samples are split at random into a fit half and a held-out half. On
the held-out half the number of violations ``#{r > kappa}`` is tested against ``p`` with a
one-sided binomial test (``scipy.stats.binomtest(..., alternative="greater")``); a small
p-value means the calibration does not hold on fresh data.

**Instances.** What one instance of each op is (its inputs, emulation in the format,
exact reference and analytic bound), how ``--shape`` changes it and how instances are cut
from supplied tensors is stated in :mod:`ttrace_num.calibrate.ops`; the plots are
:mod:`ttrace_num.calibrate.plots`.

The result is a versioned JSON file (:class:`Calibration`) consumed by
``ttrace_num.tolerance(op, ..., mode="probabilistic", calibration=FILE)``, which returns
``min(kappa * B, deterministic bound)``.
"""
from __future__ import annotations

import json
import math
import warnings
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from .. import scaling
from ..bounds.base import Bound, Explanation
from ..bounds.common import lookup, resolve_precision
from ..bounds.fp8 import ScaledGemm
from ..formats import FORMATS, FloatFormat, get_format
from .distributions import DISTRIBUTIONS, Draw
from .ops import (ALL_OPS, QUANT_OPS, SPECS, CalibrationError, Setup, Shape, Supplied, op_shapes,
                  shape_error, unsupported)
from .plots import plot

__all__ = ["SCHEMA_VERSION", "ALL_OPS", "CalibrationError", "CalibrationDomainWarning", "OpCalibration", "Calibration",
           "calibrate", "domain_problems", "row_peak_to_rms", "row_rms_ratio", "ROW_STATISTICS", "DISTRIBUTIONS",
           "kappa_upper_bound", "min_samples", "heldout_check", "load", "apply_calibration", "plot",
           "same_format"]

SCHEMA_VERSION = 2
#: failure probability of the analytic bound ``B`` that ``kappa`` rescales
ANALYTIC_FAILURE_PROBABILITY = 1e-6


# ----------------------------------------------------------------------------- statistics
def min_samples(p: float, confidence: float) -> int:
    """Fewest fit samples for which an order statistic is a ``confidence`` upper bound of
    the ``(1 - p)`` quantile: ``ceil(ln(1 - confidence) / ln(1 - p))``."""
    return math.ceil(math.log1p(-confidence) / math.log1p(-p) - 1e-12)


def kappa_upper_bound(r: torch.Tensor, p: float, confidence: float) -> float:
    """``r_(k)`` with the smallest ``k`` such that ``P(Binomial(n, 1-p) < k) >= confidence``
    (module docstring); raises :class:`CalibrationError` when ``n`` is too small."""
    n = int(r.numel())
    need = min_samples(p, confidence)
    if n < need:
        raise CalibrationError(f"{n} fit samples are too few for a {confidence:g}-confidence bound on the "
                               f"{1 - p:g} quantile: need n >= ln(1-confidence)/ln(1-p) = {need} "
                               f"(raise --samples to at least {2 * need})")
    from scipy import stats  # lazy: scipy.stats takes ~1 s to import, the CLI parser imports this package
    k = int(stats.binom.ppf(confidence, n, 1 - p)) + 1  # smallest k with cdf(k - 1) >= confidence
    while k > 1 and stats.binom.cdf(k - 2, n, 1 - p) >= confidence:
        k -= 1
    while stats.binom.cdf(k - 1, n, 1 - p) < confidence:
        k += 1
    return float(torch.sort(r.flatten()).values[k - 1])


def heldout_check(r: torch.Tensor, kappa: float, p: float) -> tuple[int, float]:
    """Violations ``#{r > kappa}`` on held-out samples and the one-sided binomial p-value of
    observing that many or more if the violation probability were ``p``."""
    from scipy import stats
    v = int((r > kappa).sum())
    return v, float(stats.binomtest(v, int(r.numel()), p, alternative="greater").pvalue)


# ----------------------------------------------------------------------------- results
@dataclass(frozen=True)
class OpCalibration:
    """Calibrated constant of one op (see the module docstring for the claim)."""

    op: str
    kappa: float
    kappa_point: float
    p: float
    confidence: float
    n_fit: int
    n_heldout: int
    heldout_violations: int
    heldout_pvalue: float
    analytic_failure_probability: float
    out_fmt: str
    shape: list[list[int]]
    distributions: list[str]
    quantiles: dict[str, float] = field(default_factory=dict)
    #: per source (distribution name or ``tensors:...``): its own ``kappa`` (upper bound of its
    #: ``(1 - p)`` quantile), point estimate, and held-out check against the op's ``kappa``
    per_distribution: dict[str, dict[str, float]] = field(default_factory=dict)
    #: where the claim was measured: per tensor argument, ``units`` (the trailing dims one
    #: instance's rows have: the reduction length, a row, an attention head; None for a weight)
    #: and per row statistic of :data:`ROW_STATISTICS` the ``[min, max]`` over every calibrated
    #: row (None for a weight). :func:`apply_calibration` warns outside it.
    domain: dict[str, list] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """calibrated / analytic threshold (``kappa``; < 1 means tighter)."""
        return self.kappa


@dataclass(frozen=True)
class Calibration:
    """A loaded or freshly computed calibration (serialised by :meth:`to_json`)."""

    format: dict[str, Any]
    fmt_spec: str
    recipe: str | None
    compute_fmt: str
    version: str
    seed: int
    ops: dict[str, OpCalibration]
    skipped: dict[str, str] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": self.schema_version, "format": self.format, "fmt_spec": self.fmt_spec,
                "recipe": self.recipe, "compute_fmt": self.compute_fmt, "ttrace_num_version": self.version,
                "seed": self.seed, "skipped": self.skipped,
                "ops": {k: {**asdict(v), "ratio_calibrated_to_analytic": v.ratio} for k, v in self.ops.items()}}

    def to_json(self) -> str:
        """Deterministic JSON text (sorted keys): same inputs and seed => identical bytes."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @property
    def fmt(self) -> FloatFormat:
        return get_format(self.fmt_spec)

    def covers(self, op: str) -> bool:
        """Whether this calibration holds a constant for ``op`` (or an alias of it)."""
        from ..bounds.common import _CANONICAL
        return _CANONICAL.get(op, op) in self.ops


def load(path: str | Path) -> Calibration:
    """Read a calibration file written by :func:`calibrate` / ``ttrace calibrate``."""
    try:
        d = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CalibrationError(f"calibration file {str(path)!r} not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CalibrationError(f"calibration file {str(path)!r} is not JSON ({e})") from None
    except OSError as e:
        raise CalibrationError(f"cannot read calibration file {str(path)!r}: {e.strerror or e}") from None
    if not isinstance(d, dict) or d.get("schema_version") != SCHEMA_VERSION:
        raise CalibrationError(f"{path}: schema_version {d.get('schema_version') if isinstance(d, dict) else None!r}, "
                               f"this ttrace_num reads {SCHEMA_VERSION}: not a calibration file of this version")
    try:
        ops = {k: OpCalibration(**{f: v[f] for f in OpCalibration.__dataclass_fields__}) for k, v in d["ops"].items()}
        return Calibration(format=d["format"], fmt_spec=d["fmt_spec"], recipe=d["recipe"], compute_fmt=d["compute_fmt"],
                           version=d["ttrace_num_version"], seed=d["seed"], ops=ops, skipped=d.get("skipped", {}),
                           source=str(path))
    except (KeyError, TypeError, AttributeError) as e:
        raise CalibrationError(f"{path}: not a complete calibration file (bad or missing field {e})") from None


# ----------------------------------------------------------------------------- formats
def _spec(f: FloatFormat) -> str:
    """A spec :func:`~ttrace_num.formats.get_format` parses back to ``f`` (names of custom
    formats are not parseable)."""
    if f.name in FORMATS and same_format(FORMATS[f.name], f):
        return f.name
    return (f"custom(e={f.exponent_bits},m={f.mantissa_bits},bias={f.bias},nan={f.nan_encoding},"
            f"subnormals={f.subnormals},overflow={f.default_overflow})")


def same_format(a: FloatFormat, b: FloatFormat) -> bool:
    """Same values and special-value behaviour (names aside)."""
    key = ("exponent_bits", "mantissa_bits", "bias", "nan_encoding", "signed", "subnormals", "default_overflow")
    return all(getattr(a, k) == getattr(b, k) for k in key)


def _check_format(fmt: FloatFormat, compute: FloatFormat, out: FloatFormat) -> None:
    for f, what in ((fmt, "format"), (compute, "compute format"), (out, "output format")):
        if f.precision >= 53 or f.exponent_bits > 11:
            raise CalibrationError(f"{what} {f} is not narrower than fp64: the exact references are float64 "
                                   "results, so its errors cannot be measured against them")


# ----------------------------------------------------------------------------- driver
class _NotCovered(Exception):
    """The op cannot be emulated in the format, or the analytic model does not cover what
    the emulation does (the op is skipped with this message)."""


def _ratios(op: str, s: Setup, xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-instance max of ``|err| / B`` and the elementwise ratios of one (batched) call."""
    spec = SPECS[op]
    try:
        computed = spec.emulate(xs, s)
    except ValueError as e:
        raise _NotCovered(f"cannot emulate {s.fmt} with compute format {s.compute}: {e}") from None
    exact = spec.exact(xs, s).double()
    b = lookup(op)(*xs, mode="probabilistic", failure_probability=ANALYTIC_FAILURE_PROBABILITY,
                   **spec.kwargs(s)).abs
    overflow = int((~torch.isfinite(computed) & torch.isfinite(exact)).sum())
    if overflow:
        raise _NotCovered(f"{overflow} emulated results are +-inf where the exact ones are finite: an intermediate "
                          f"or the output overflows (fmt {s.fmt}, max {s.fmt.max:g}; compute {s.compute}), "
                          "which the analytic model does not cover")
    err = (computed.double() - exact).abs()
    b = torch.broadcast_to(b, err.shape)
    uncovered = int(((b == 0) & (err > 0)).sum())
    if uncovered:
        raise _NotCovered(f"the analytic bound is 0 where the emulated error is not ({uncovered} elements): the "
                          f"model does not cover {s.fmt} (check the format's subnormals/overflow)")
    r = torch.where(err == 0, torch.zeros_like(err), err / b)
    if not spec.batched:
        r = r.unsqueeze(0)
    return r.reshape(r.shape[0], -1).amax(1), r.flatten()


Source = tuple[str, Draw] | Supplied


def _draw(op: str, shapes: list[Shape], src: Source, k: int | None, g: torch.Generator) -> list[torch.Tensor]:
    """Inputs of ``k`` instances (leading dim), or of one instance if ``k`` is None."""
    if isinstance(src, Supplied):
        return src.draw(op, shapes, k, g)
    return [src[1]((*((k,) if k else ()), *sh), g) for sh in shapes]


def row_peak_to_rms(t: torch.Tensor) -> torch.Tensor:
    """``max_j |x_j| / sqrt(mean_j x_j^2)`` of every row (last dim) of ``t`` with a nonzero
    row, in float64: a scale-free measure of a row's tail weight (``1`` for constant
    magnitudes, ``~3.5`` for 128 normal values, ``sqrt(n)`` for one nonzero value in ``n``)."""
    rows = t.detach().to(torch.float64).reshape(-1, t.shape[-1]) if t.dim() else t.detach().double().reshape(1, 1)
    rms = rows.square().mean(-1).sqrt()
    keep = rms > 0
    return rows[keep].abs().amax(-1) / rms[keep]


def row_rms_ratio(t: torch.Tensor, instances: int = 1) -> torch.Tensor:
    """``rms(row) / rms(instance)`` of every row (last dim) of ``t``, ``t`` holding
    ``instances`` instances stacked on its leading dim (1: ``t`` is one instance), in float64:
    how far the rows' scales spread within an instance (``~1 +- 0.1`` for i.i.d. normal rows of
    128; a log-normal-scaled tensor has rows ``100x`` below its RMS). Rows of an all-zero
    instance are left out; instances of one row give nothing (the range is then None and
    not checked)."""
    rows = t.detach().to(torch.float64).reshape(instances, -1, t.shape[-1] if t.dim() else 1)
    if rows.shape[1] < 2:  # one row per instance: no spread to measure
        return rows.new_empty(0)
    ms = rows.square().mean(-1)
    ratio = (ms / ms.mean(-1, keepdim=True)).sqrt()
    return ratio[torch.isfinite(ratio)]


#: the row statistics a calibration records the range of (its domain), by name:
#: ``stat(tensor, instances stacked on its leading dim) -> one value per row``
ROW_STATISTICS: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
    "row_peak_to_rms": lambda t, instances: row_peak_to_rms(t),
    "row_rms_ratio": row_rms_ratio,
}


def _draw_instances(op: str, s: Setup, n: int, shapes: list[Shape], src: Source, g: torch.Generator,
                    progress: Callable[[int], None]
                    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, list[tuple[float, float] | None]]]:
    """Per-instance and elementwise ratios of ``n`` instances drawn from ``src``, and per
    row statistic (:data:`ROW_STATISTICS`) per tensor argument the range ``(min, max)`` over
    the instances' rows (None for a weight argument, the same tensor in every instance)."""
    spec = SPECS[op]
    per_inst, elems = [], []
    lo = {k: [math.inf] * len(spec.args) for k in ROW_STATISTICS}
    hi = {k: [-math.inf] * len(spec.args) for k in ROW_STATISTICS}
    step = 200 if spec.batched else 1
    for c0 in range(0, n, step):
        k = min(step, n - c0)
        xs = spec.prepare(_draw(op, shapes, src, k if spec.batched else None, g), s)
        for i, (x, u) in enumerate(zip(xs, spec.units)):
            if not u:
                continue
            for key, stat in ROW_STATISTICS.items():
                st = stat(x, k if spec.batched else 1)
                if st.numel():
                    lo[key][i], hi[key][i] = min(lo[key][i], float(st.min())), max(hi[key][i], float(st.max()))
        pi, el = _ratios(op, s, xs)
        per_inst.append(pi)
        elems.append(el)
        progress(k)
    ranges = {key: [(a, b) if u and a <= b else None for a, b, u in zip(lo[key], hi[key], spec.units)]
              for key in ROW_STATISTICS}
    return torch.cat(per_inst), torch.cat(elems), ranges


def calibrate(fmt: "str | FloatFormat", ops: Iterable[str] | str = "all", *, recipe: str | None = None,
              compute_fmt: "str | FloatFormat" = "fp32", out_fmt: "str | FloatFormat | None" = None,
              samples: int = 300, seed: int = 0,
              distributions: Sequence[str] = ("normal",), tensors: Mapping[str, torch.Tensor] | None = None,
              shapes: Mapping[str, Sequence[int]] | None = None, p: float = 0.02, confidence: float = 0.9,
              progress: Callable[[int], None] | None = None, keep: dict[str, torch.Tensor] | None = None,
              origin: str = "the supplied tensors") -> Calibration:
    """Fit ``kappa`` per op (module docstring) and return the :class:`Calibration`.

    Args:
        fmt: the format to calibrate (any :func:`~ttrace_num.formats.get_format` spec,
            e.g. ``"e4m3"``, ``"custom(e=3, m=2)"``).
        ops: ``"all"`` (:data:`ALL_OPS`) or op names from it.
        recipe: scaling recipe of the quantize ops (``"tensor"`` default, ``"row"``,
            ``"1x128"``, ``"128x128"``, ``"mx32"``).
        compute_fmt: accumulation / intermediate format (fp32).
        out_fmt: output format of the GEMMs and reductions (default ``compute_fmt``; e.g.
            bf16 for a bf16 model whose matmuls store bf16).
        samples: instances per op and source (each distribution, or the tensors), split in
            halves: fit and held-out. ``kappa`` is the largest of the sources' own upper bounds,
            so the claim holds for each distribution (each with confidence ``confidence``).
        seed: the only source of randomness (same arguments => identical result).
        distributions: names from :data:`ttrace_num.calibrate.distributions.DISTRIBUTIONS`, used in turn.
        tensors: instead of ``distributions``, instances cut from these tensors (the op's
            tensor arguments in order; see :mod:`ttrace_num.calibrate.ops`).
        shapes: op shape per op (``{"matmul": (64, 256, 64)}``), overriding the defaults.
        p, confidence: ``kappa`` bounds the per-instance ``(1 - p)`` quantile with this
            confidence.
        progress: called with the number of instances just finished (or skipped).
        keep: if given, filled with ``op -> per-instance ratios`` (for plots).
        origin: where ``tensors`` come from, for messages (e.g. the file name).
    """
    try:
        f, c = get_format(fmt), get_format(compute_fmt)
        o = get_format(out_fmt) if out_fmt is not None else c
    except (KeyError, ValueError) as e:
        raise CalibrationError(f"unknown format: {e}") from None
    _check_format(f, c, o)
    if not (0 < p < 1 and 0 < confidence < 1):
        raise CalibrationError(f"p and confidence must lie in (0, 1), got p={p}, confidence={confidence}")
    need = min_samples(p, confidence)
    if samples // 2 < need:
        raise CalibrationError(f"{samples} samples give {samples // 2} fit samples, too few for a {confidence:g}-confidence "
                               f"bound on the {1 - p:g} quantile: need n_fit >= ln(1-confidence)/ln(1-p) = {need}, "
                               f"i.e. --samples >= {2 * need}")
    op_list = list(ALL_OPS) if ops == "all" else list(ops)
    unknown = [o for o in [*op_list, *(shapes or {})] if o not in SPECS]
    if unknown:
        raise CalibrationError(f"cannot calibrate {', '.join(unknown)}: emulated ops are {', '.join(ALL_OPS)}")
    sources: list[Source]
    if tensors is not None:
        sources = [Supplied(tensors, origin)]
    else:
        bad = [d for d in distributions if d not in DISTRIBUTIONS]
        if bad:
            raise CalibrationError(f"unknown distribution {', '.join(bad)}; choose from {', '.join(DISTRIBUTIONS)}")
        sources = [(d, DISTRIBUTIONS[d]) for d in distributions]
    labels = [src.label if isinstance(src, Supplied) else src[0] for src in sources]
    s = Setup(f, c, scaling.get_recipe(recipe or "tensor"), o)
    arg_shapes = {op: op_shapes(op, s, (shapes or {}).get(op)) for op in op_list}
    if not isinstance(sources[0], Supplied):
        for op in op_list:
            why = shape_error(op, arg_shapes[op], s)
            if why is not None:
                raise CalibrationError(f"--shape {op}: {why}")
    # one intra-op thread: the work is many small tensor ops, where torch's thread pool only adds
    # synchronisation (e4m3 --ops all: 14 s with 1 thread, 66 s with 2 on a loaded 2-core machine)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _calibrate(f, c, s, s.recipe.name if recipe else None, op_list, arg_shapes, sources, labels, samples,
                          seed, p, confidence, progress or (lambda k: None), keep)
    finally:
        torch.set_num_threads(threads)


def _calibrate(f: FloatFormat, c: FloatFormat, s: Setup, recipe: str | None, op_list: list[str],
               arg_shapes: dict[str, list[Shape]],
               sources: list[Source], labels: list[str], samples: int, seed: int, p: float, confidence: float,
               progress: Callable[[int], None], keep: dict[str, torch.Tensor] | None) -> Calibration:
    """The loop of :func:`calibrate` over the ops (arguments checked)."""
    results: dict[str, OpCalibration] = {}
    skipped: dict[str, str] = {}
    for op in op_list:  # each op's stream depends on (seed, op) only, not on the other ops asked for
        why = unsupported(op, s)
        if why is None and isinstance(sources[0], Supplied):
            why = sources[0].unfit(op, arg_shapes[op], s)
        if why is not None:
            skipped[op] = why
            progress(samples * len(sources))
            continue
        g = torch.Generator().manual_seed(seed * 1000003 + zlib.crc32(op.encode()))
        inst_shapes = (sources[0].shapes(op, arg_shapes[op]) if isinstance(sources[0], Supplied)
                       else [list(sh) for sh in arg_shapes[op]])
        try:
            fits, helds, rs, elems, ranges = [], [], [], [], []
            for src in sources:  # samples instances per source, each split into fit and held-out halves
                r, el, rng = _draw_instances(op, s, samples, arg_shapes[op], src, g, progress)
                perm = torch.randperm(samples, generator=g)
                fits.append(r[perm[:samples // 2]])
                helds.append(r[perm[samples // 2:]])
                rs.append(r)
                elems.append(el)
                ranges.append(rng)
        except _NotCovered as e:
            skipped[op] = str(e)
            continue
        r, elems_all = torch.cat(rs), torch.cat(elems)
        kappas = [kappa_upper_bound(fit, p, confidence) for fit in fits]
        kappa = max(kappas)  # covers each source's (1 - p) quantile, each with confidence `confidence`
        if kappa == 0:
            skipped[op] = (f"{int((r == 0).sum())} of {r.numel()} instances of shapes {inst_shapes} are computed "
                           f"exactly in {c}: no error to calibrate the model's constant from (longer reductions or "
                           "other data would round)")
            continue
        per_source = {}
        for label, kd, fit, held in zip(labels, kappas, fits, helds):
            vd, pd = heldout_check(held, kappa, p)
            per_source[label] = {"kappa": kd, "kappa_point": float(torch.quantile(fit, 1 - p)),
                                 "heldout_violations": vd, "n_heldout": int(held.numel()), "heldout_pvalue": pd}
        held_all = torch.cat(helds)
        v, pval = heldout_check(held_all, kappa, p)
        qs = {f"elem_q{q}": float(torch.quantile(elems_all[:1 << 24].float(), q)) for q in (0.5, 0.9, 0.99)}
        qs["elem_max"] = float(elems_all.max())
        spec = SPECS[op]
        domain: dict[str, list] = {"units": [sh[len(sh) - u:] if u else None for sh, u in zip(inst_shapes, spec.units)]}
        for key in ROW_STATISTICS:  # the range over every source
            domain[key] = [None if any(rg[key][i] is None for rg in ranges) else
                           [min(rg[key][i][0] for rg in ranges), max(rg[key][i][1] for rg in ranges)]
                           for i in range(len(spec.args))]
        results[op] = OpCalibration(
            op=op, kappa=kappa, kappa_point=max(d["kappa_point"] for d in per_source.values()), p=p,
            confidence=confidence, n_fit=sum(int(fit.numel()) for fit in fits), n_heldout=int(held_all.numel()),
            heldout_violations=v, heldout_pvalue=pval,
            analytic_failure_probability=ANALYTIC_FAILURE_PROBABILITY, out_fmt=_spec(spec.out(s)),
            shape=inst_shapes, distributions=labels, quantiles=qs, per_distribution=per_source, domain=domain)
        if keep is not None:
            keep[op] = r
    from .. import __version__
    return Calibration(format=f.constants(), fmt_spec=_spec(f), recipe=recipe,
                       compute_fmt=_spec(c), version=__version__, seed=seed, ops=results, skipped=skipped)


# ----------------------------------------------------------------------------- consumption
class CalibrationDomainWarning(UserWarning):
    """A calibrated constant applied to inputs unlike those it was measured on."""


#: elementwise ops: an output element depends on its own input element(s) only, so the row
#: length is no part of their domain (their per-element claim holds at any length)
_LENGTH_FREE = ("gelu", "silu", "swiglu", "add")


def domain_problems(name: str, entry: OpCalibration, inputs: Sequence[torch.Tensor]) -> list[str]:
    """Why ``inputs`` lie outside the domain ``entry`` was calibrated on (empty if they do
    not): a tensor argument whose rows/units (the trailing dims) differ from the calibrated
    ones (the ratio of error to analytic bound depends on the reduction length: the bound
    grows like ``sqrt(n)``, the observed error may not), or one with more than a fraction
    ``p`` of rows whose :func:`row_peak_to_rms` or :func:`row_rms_ratio` (the whole tensor
    taken as one instance) lies outside the calibrated range (heavier-tailed rows, or rows of
    more spread scales, than calibrated: the claim was not measured there). A detector of a
    shift, not a proof of sameness: data inside the domain may still differ."""
    out = []
    what = {"row_peak_to_rms": "peak-to-RMS ratio (tail weight within a row)",
            "row_rms_ratio": "RMS relative to the tensor's (spread of scales across rows)"}
    for i, (t, u) in enumerate(zip(inputs, entry.domain.get("units", []))):
        if u is None or not isinstance(t, torch.Tensor):
            continue
        have = list(t.shape[max(0, t.dim() - len(u)):])
        if have != list(u):
            if name not in _LENGTH_FREE:
                out.append(f"input {i} has units {have} (trailing dims), calibrated at {list(u)}")
            continue
        for key, stat in ROW_STATISTICS.items():
            rg = entry.domain.get(key, [None] * (i + 1))[i]
            st = stat(t, 1) if rg is not None else None
            frac = float(((st < rg[0]) | (st > rg[1])).double().mean()) if st is not None and st.numel() else 0.0
            if frac > entry.p:
                out.append(f"{100 * frac:.3g}% of input {i}'s rows have a {what[key]} outside the calibrated range "
                           f"[{rg[0]:.3g}, {rg[1]:.3g}] (more than p = {entry.p:g}): its values are not distributed "
                           f"like those calibrated ({', '.join(entry.distributions)})")
    return out


def apply_calibration(op: str, inputs: Sequence[torch.Tensor], calibration: "Calibration | str | Path", *,
                      fmt=None, compute_fmt=None, mode: str = "probabilistic", **op_kwargs: Any) -> Bound:
    """``min(kappa * B, deterministic bound)`` for ``op`` with ``kappa`` from ``calibration``
    (probabilistic mode only; the format, compute format, recipe and output format must be
    those the calibration measured). ``fmt=None``: the inputs' format, as
    :func:`ttrace_num.tolerance` infers it (the calibrated format for the quantize ops)."""
    from ..bounds.common import _CANONICAL
    cal = calibration if isinstance(calibration, Calibration) else load(calibration)
    src = cal.source or "an in-memory calibration"
    if mode != "probabilistic":
        raise ValueError("a calibration rescales the probabilistic bound; use mode='probabilistic'")
    name = _CANONICAL.get(op, op)
    if name in cal.skipped:
        raise ValueError(f"{src} holds no constant for op {name}: {cal.skipped[name]}")
    if name not in cal.ops:
        raise ValueError(f"{src} has no calibration for op {op!r} (it holds {', '.join(cal.ops)})")
    entry = cal.ops[name]
    if fmt is not None:
        f = get_format(fmt)
    elif name in QUANT_OPS:  # their fmt is the target of the quantization, not the inputs' dtype
        f = cal.fmt
    else:  # the storage format tolerance() would infer from the inputs
        f = resolve_precision(tuple(inputs)).storage
    if not same_format(f, cal.fmt):
        raise ValueError(f"{src} calibrates {cal.fmt_spec}, not {f}")
    c = get_format(compute_fmt) if compute_fmt is not None else get_format(cal.compute_fmt)
    if not same_format(c, get_format(cal.compute_fmt)):
        raise ValueError(f"{src} was measured with compute format {cal.compute_fmt}, not {c}")
    out = op_kwargs.pop("out_fmt", None)
    if name != "quantize":  # (quantize has no output format argument: its result is in the compute format)
        # without out_fmt=, the output format tolerance() would use: the inputs' (ScaledGemm's for quantized_matmul)
        o = get_format(out) if out is not None else (ScaledGemm().out if name == "quantized_matmul" else f)
        if not same_format(o, get_format(entry.out_fmt)):
            raise ValueError(f"{src}: op {name} was measured with output format {entry.out_fmt}, not {o}"
                             + ("" if out is not None else f" (the default; pass out_fmt='{entry.out_fmt}' if the "
                                                           f"result is stored in {entry.out_fmt})"))
    fp = op_kwargs.pop("failure_probability", None)
    if fp is not None and fp != entry.p:
        raise ValueError(f"{src}: op {name} was calibrated for failure probability {entry.p:g} per instance, "
                         f"not {fp:g}")
    if name in QUANT_OPS:
        rec = scaling.get_recipe(op_kwargs.get("recipe", "tensor")).name
        if rec != (cal.recipe or "tensor"):
            raise ValueError(f"{src} was measured with recipe {cal.recipe or 'tensor'}, not {rec}")
    kw = {"fmt": f, "compute_fmt": c, **op_kwargs}
    if name != "quantize":
        kw["out_fmt"] = entry.out_fmt
    problems = domain_problems(name, entry, inputs)
    if problems:
        warnings.warn(f"{src}: the constant of op {name} (kappa={entry.kappa:.4g}) was measured on instances of shapes "
                      f"{entry.shape} drawn like {', '.join(entry.distributions)}, and these inputs are outside that: "
                      f"{'; '.join(problems)}. Its claim (P(exceed) <= {entry.p:g}) may not hold here: calibrate at "
                      f"these shapes and on such data (ttrace calibrate --shape {name}=..., --dist with heavy-tailed "
                      "distributions, or --file with your tensors), or use the analytic bound (no calibration=)",
                      CalibrationDomainWarning, stacklevel=3)
    fn = lookup(name)
    b = fn(*inputs, mode="probabilistic", failure_probability=entry.analytic_failure_probability, **kw)
    det = fn(*inputs, mode="deterministic", **kw)
    return Bound(abs=torch.minimum(entry.kappa * b.abs, det.abs), mode="probabilistic", failure_probability=entry.p,
                 explanation=Explanation(
                     op=name, formula="min(kappa * B_probabilistic, B_deterministic)",
                     source=f"calibrated: kappa={entry.kappa:.4g} from {src}",
                     assumptions=(f"per instance of shape {entry.shape} drawn like {', '.join(entry.distributions)}: "
                                  f"P(any element exceeds) <= {entry.p:g} with confidence {entry.confidence:g} "
                                  f"(held-out {entry.heldout_violations}/{entry.n_heldout}, "
                                  f"binomial p-value {entry.heldout_pvalue:.3g})",),
                     values={"kappa": entry.kappa, "p": entry.p, "analytic_failure_probability":
                             entry.analytic_failure_probability},
                     terms=(b.explanation, det.explanation)),
                 magnitude=b.magnitude)
