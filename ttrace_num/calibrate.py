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

**Computation model per op** (inputs drawn from ``distributions``, or sampled from the
values of supplied tensors, rounded to ``fmt`` with :func:`~ttrace_num.rounding.round_to`;
compute format ``c``, default fp32):

* ``matmul``: ``(m, K) @ (K, n)`` per instance, products and a recursive chain in ``c``,
  output in ``c`` (:func:`~ttrace_num.emulate.summation.emulate_matmul`); exact:
  :func:`~ttrace_num.reference.dot.exact_matmul`.
* ``sum``: sum of a row in ``c``, output in ``c`` (``emulate_sum``); exact: ``exact_sum``.
* ``softmax``: :func:`~ttrace_num.emulate.softmax.emulate_softmax`, output in ``fmt``;
  exact: :func:`ttrace_num.reference.ops.softmax`.
* ``gelu`` / ``silu``: :mod:`ttrace_num.emulate.activations`, output in ``fmt``; exact:
  ``reference.ops.gelu`` / ``silu``.
* ``quantize``: ``dequantize(quantize(x))`` of fp32 data with ``recipe``
  (:func:`~ttrace_num.emulate.fp8.emulate_fake_quant`), exact: ``x``.
* ``quantized_matmul``: both fp32 operands quantized with ``recipe``, scaled GEMM in ``c``
  (:func:`~ttrace_num.emulate.fp8.emulate_quantized_matmul`); exact: ``exact_matmul`` of
  the fp32 operands.

The result is a versioned JSON file (:class:`Calibration`) consumed by
``ttrace_num.tolerance(op, ..., mode="probabilistic", calibration=FILE)``, which returns
``min(kappa * B, deterministic bound)``.
"""
from __future__ import annotations

import json
import math
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from scipy import stats

from . import scaling
from .bounds.base import Bound, Explanation
from .bounds.common import lookup
from .bounds.fp8 import ScaledGemm
from .bounds.summation import Summation
from .formats import FORMATS, FloatFormat, get_format
from .rounding import round_to

__all__ = ["SCHEMA_VERSION", "ALL_OPS", "CalibrationError", "OpCalibration", "Calibration", "calibrate",
           "kappa_upper_bound", "min_samples", "heldout_check", "load", "apply_calibration"]

SCHEMA_VERSION = 1
#: ops calibrated by ``ops="all"``: those whose computation in any format the emulators model
ALL_OPS = ("matmul", "sum", "softmax", "gelu", "silu", "quantize", "quantized_matmul")
_QUANT_OPS = ("quantize", "quantized_matmul")
#: failure probability of the analytic bound ``B`` that ``kappa`` rescales
ANALYTIC_FAILURE_PROBABILITY = 1e-6


class CalibrationError(ValueError):
    """A calibration that cannot be trusted or cannot be built (the message says why)."""


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
    k = int(stats.binom.ppf(confidence, n, 1 - p)) + 1  # smallest k with cdf(k - 1) >= confidence
    while k > 1 and stats.binom.cdf(k - 2, n, 1 - p) >= confidence:
        k -= 1
    while stats.binom.cdf(k - 1, n, 1 - p) < confidence:
        k += 1
    return float(torch.sort(r.flatten()).values[k - 1])


def heldout_check(r: torch.Tensor, kappa: float, p: float) -> tuple[int, float]:
    """Violations ``#{r > kappa}`` on held-out samples and the one-sided binomial p-value of
    observing that many or more if the violation probability were ``p``."""
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


def load(path: str | Path) -> Calibration:
    """Read a calibration file written by :func:`calibrate` / ``ttrace calibrate``."""
    try:
        d = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CalibrationError(f"calibration file {str(path)!r} not found") from None
    except json.JSONDecodeError as e:
        raise CalibrationError(f"calibration file {str(path)!r} is not JSON ({e})") from None
    if d.get("schema_version") != SCHEMA_VERSION:
        raise CalibrationError(f"{path}: schema_version {d.get('schema_version')!r}, this ttrace_num reads "
                               f"{SCHEMA_VERSION}")
    ops = {k: OpCalibration(**{f: v[f] for f in OpCalibration.__dataclass_fields__}) for k, v in d["ops"].items()}
    return Calibration(format=d["format"], fmt_spec=d["fmt_spec"], recipe=d["recipe"], compute_fmt=d["compute_fmt"],
                       version=d["ttrace_num_version"], seed=d["seed"], ops=ops, skipped=d.get("skipped", {}),
                       source=str(path))


# ----------------------------------------------------------------------------- op specs
Draw = Callable[[tuple[int, ...], torch.Generator], torch.Tensor]


@dataclass(frozen=True)
class _Setup:
    fmt: FloatFormat
    compute: FloatFormat
    recipe: scaling.ScalingRecipe


def _on_grid(t: torch.Tensor, fmt: FloatFormat, what: str) -> torch.Tensor:
    r = round_to(t, fmt)
    if not torch.isfinite(r).all():
        raise CalibrationError(f"{what}: the data overflow {fmt} (max {fmt.max:g}); use a narrower distribution, "
                               "scaled tensors, or a --recipe for the quantize ops")
    return r


@dataclass(frozen=True)
class _OpSpec:
    """How to draw, emulate, reference and bound one op. ``batched``: one call handles all
    instances (leading dim); otherwise instances are processed one at a time."""

    shapes: Callable[[_Setup], list[tuple[int, ...]]]
    batched: bool
    out: Callable[[_Setup], FloatFormat]
    prepare: Callable[[list[torch.Tensor], _Setup], list[torch.Tensor]]
    emulate: Callable[[list[torch.Tensor], _Setup], torch.Tensor]
    exact: Callable[[list[torch.Tensor], _Setup], torch.Tensor]
    kwargs: Callable[[_Setup], dict[str, Any]]


def _round_all(xs: list[torch.Tensor], s: _Setup) -> list[torch.Tensor]:
    return [_on_grid(x, s.fmt, "inputs") for x in xs]


def _fp32_all(xs: list[torch.Tensor], s: _Setup) -> list[torch.Tensor]:
    return [x.float() for x in xs]


def _mm_emulate(xs, s):
    from .emulate.summation import emulate_matmul
    return emulate_matmul(xs[0], xs[1], Summation(accum=s.compute), s.compute)


def _exact_mm(xs, s):
    from .reference.dot import exact_matmul
    return exact_matmul(xs[0], xs[1])


def _sum_emulate(xs, s):
    from .emulate.summation import emulate_sum
    return emulate_sum(xs[0], -1, Summation(accum=s.compute), s.compute)


def _exact_sum(xs, s):
    from .reference.dot import exact_sum
    return exact_sum(xs[0], -1)


def _softmax_emulate(xs, s):
    from .emulate.softmax import emulate_softmax
    return emulate_softmax(xs[0], -1, fmt=s.fmt, compute_fmt=s.compute, out_fmt=s.fmt)


def _exact_softmax(xs, s):
    from .reference.ops import softmax
    return softmax(xs[0], -1)


def _act(name: str):
    def emulate(xs, s):
        from .emulate import activations
        return getattr(activations, name)(xs[0], compute_fmt=s.compute, out_fmt=s.fmt)

    def exact(xs, s):
        from .reference import ops
        return getattr(ops, name)(xs[0])
    return emulate, exact


def _quant_emulate(xs, s):
    from .emulate.fp8 import emulate_fake_quant
    return emulate_fake_quant(xs[0], s.fmt, s.recipe, compute_fmt=s.compute)


def _qmm_emulate(xs, s):
    from .emulate.fp8 import emulate_quantized_matmul
    return emulate_quantized_matmul(xs[0], xs[1], fmt_a=s.fmt, fmt_b=s.fmt, recipe_a=s.recipe, recipe_b=s.recipe,
                                    model=ScaledGemm(accum=s.compute, out=s.compute))


def _tile(s: _Setup) -> int:
    """Rows per instance of the quantize ops: 128 for 128x128 tiles, else 8."""
    return 128 if s.recipe.name == "128x128" else 8


_GELU, _SILU = _act("gelu"), _act("silu")
_SPECS: dict[str, _OpSpec] = {
    "matmul": _OpSpec(lambda s: [(4, 1024), (1024, 4)], True, lambda s: s.compute, _round_all, _mm_emulate, _exact_mm,
                      lambda s: {"fmt": s.fmt, "compute_fmt": s.compute, "out_fmt": s.compute}),
    "sum": _OpSpec(lambda s: [(4096,)], True, lambda s: s.compute, _round_all, _sum_emulate, _exact_sum,
                   lambda s: {"dim": -1, "fmt": s.fmt, "compute_fmt": s.compute, "out_fmt": s.compute}),
    "softmax": _OpSpec(lambda s: [(64,)], True, lambda s: s.fmt, _round_all, _softmax_emulate,
                       _exact_softmax,
                       lambda s: {"dim": -1, "fmt": s.fmt, "compute_fmt": s.compute, "out_fmt": s.fmt}),
    "gelu": _OpSpec(lambda s: [(64,)], True, lambda s: s.fmt, _round_all, _GELU[0], _GELU[1],
                    lambda s: {"fmt": s.fmt, "compute_fmt": s.compute, "out_fmt": s.fmt}),
    "silu": _OpSpec(lambda s: [(64,)], True, lambda s: s.fmt, _round_all, _SILU[0], _SILU[1],
                    lambda s: {"fmt": s.fmt, "compute_fmt": s.compute, "out_fmt": s.fmt}),
    "quantize": _OpSpec(lambda s: [(_tile(s), 128)], False, lambda s: s.compute, _fp32_all, _quant_emulate,
                        lambda xs, s: xs[0].double(),
                        lambda s: {"fmt": s.fmt, "recipe": s.recipe, "compute_fmt": s.compute}),
    "quantized_matmul": _OpSpec(lambda s: [(_tile(s), 128), (128, _tile(s))], False, lambda s: s.compute, _fp32_all,
                                _qmm_emulate, _exact_mm,
                                lambda s: {"fmt": s.fmt, "recipe": s.recipe, "compute_fmt": s.compute,
                                           "out_fmt": s.compute}),
}


# ----------------------------------------------------------------------------- data
def empirical(tensors: Mapping[str, torch.Tensor]) -> Draw:
    """A draw function sampling (with replacement) from the values of ``tensors``; refuses
    NaN/Inf, naming the tensor and the first bad index. Within-row structure of the supplied
    tensors is not kept: instances are i.i.d. draws from their value distribution."""
    pools = []
    for name, t in tensors.items():
        if not t.is_floating_point():
            continue
        t64 = t.detach().to(torch.float64)
        bad = ~torch.isfinite(t64)
        if bad.any():
            idx = tuple(int(i) for i in torch.nonzero(bad)[0])
            raise CalibrationError(f"tensor {name!r} holds {float(t64[idx])} at index {idx}; calibration needs finite data")
        pools.append(t64.flatten())
    if not pools:
        raise CalibrationError("no floating-point tensor supplied")
    pool = torch.cat(pools)

    def draw(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
        return pool[torch.randint(0, pool.numel(), shape, generator=g)]
    return draw


def _spec(f: FloatFormat) -> str:
    """A spec :func:`~ttrace_num.formats.get_format` parses back to ``f`` (names of custom
    formats are not parseable)."""
    if f.name in FORMATS and _same(FORMATS[f.name], f):
        return f.name
    return (f"custom(e={f.exponent_bits},m={f.mantissa_bits},bias={f.bias},nan={f.nan_encoding},"
            f"subnormals={f.subnormals},overflow={f.default_overflow})")


def _same(a: FloatFormat, b: FloatFormat) -> bool:
    """Same values and special-value behaviour (names aside)."""
    key = ("exponent_bits", "mantissa_bits", "bias", "nan_encoding", "signed", "subnormals", "default_overflow")
    return all(getattr(a, k) == getattr(b, k) for k in key)


def _check_format(fmt: FloatFormat, compute: FloatFormat) -> None:
    for f, what in ((fmt, "format"), (compute, "compute format")):
        if f.precision >= 53 or f.exponent_bits > 11:
            raise CalibrationError(f"{what} {f} is not narrower than fp64: the exact references are float64 "
                                   "results, so its errors cannot be measured against them")


# ----------------------------------------------------------------------------- driver
def _ratios(op: str, s: _Setup, xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-instance max of ``|err| / B`` and the elementwise ratios of one (batched) call."""
    spec = _SPECS[op]
    try:
        computed = spec.emulate(xs, s)
    except ValueError as e:
        raise CalibrationError(f"op {op}: cannot emulate {s.fmt} with compute format {s.compute}: {e}") from None
    exact = spec.exact(xs, s)
    b = lookup(op)(*xs, mode="probabilistic", failure_probability=ANALYTIC_FAILURE_PROBABILITY,
                   **spec.kwargs(s)).abs
    err = (computed.double() - exact.double()).abs()
    r = torch.where(err == 0, torch.zeros_like(err), err / torch.broadcast_to(b, err.shape))
    if not spec.batched:
        r = r.unsqueeze(0)
    return r.reshape(r.shape[0], -1).amax(1), r.flatten()


def _draw_instances(op: str, s: _Setup, n: int, draws: Sequence[tuple[str, Draw]],
                    g: torch.Generator, progress: Callable[[int], None]) -> tuple[torch.Tensor, torch.Tensor]:
    spec = _SPECS[op]
    shapes = spec.shapes(s)
    per_inst, elems = [], []
    for j, (_, draw) in enumerate(draws):
        m = n // len(draws) + (1 if j < n % len(draws) else 0)
        if spec.batched:
            chunk = 200
            for c0 in range(0, m, chunk):
                k = min(chunk, m - c0)
                xs = spec.prepare([draw((k, *sh), g) for sh in shapes], s)
                pi, el = _ratios(op, s, xs)
                per_inst.append(pi)
                elems.append(el)
                progress(k)
        else:
            for _ in range(m):
                xs = spec.prepare([draw(sh, g) for sh in shapes], s)
                pi, el = _ratios(op, s, xs)
                per_inst.append(pi)
                elems.append(el)
                progress(1)
    return torch.cat(per_inst), torch.cat(elems)


def calibrate(fmt: "str | FloatFormat", ops: Iterable[str] | str = "all", *, recipe: str | None = None,
              compute_fmt: "str | FloatFormat" = "fp32", samples: int = 300, seed: int = 0,
              distributions: Sequence[str] = ("normal",), tensors: Mapping[str, torch.Tensor] | None = None,
              p: float = 0.02, confidence: float = 0.9,
              progress: Callable[[int], None] | None = None,
              keep: dict[str, torch.Tensor] | None = None) -> Calibration:
    """Fit ``kappa`` per op (module docstring) and return the :class:`Calibration`.

    Args:
        fmt: the format to calibrate (any :func:`~ttrace_num.formats.get_format` spec,
            e.g. ``"e4m3"``, ``"custom(e=3, m=2)"``).
        ops: ``"all"`` (:data:`ALL_OPS`) or op names from it.
        recipe: scaling recipe of the quantize ops (``"tensor"`` default, ``"row"``,
            ``"1x128"``, ``"128x128"``, ``"mx32"``).
        compute_fmt: accumulation / intermediate format (fp32).
        samples: instances per op, split in halves: fit and held-out.
        seed: the only source of randomness (same arguments => identical result).
        distributions: names from :data:`ttrace_num.cli.DISTRIBUTIONS`, used in turn.
        tensors: instead of ``distributions``, sample values from these tensors.
        p, confidence: ``kappa`` bounds the per-instance ``(1 - p)`` quantile with this
            confidence.
        progress: called with the number of instances just finished.
        keep: if given, filled with ``op -> per-instance ratios`` (for plots).
    """
    from .cli import DISTRIBUTIONS
    try:
        f, c = get_format(fmt), get_format(compute_fmt)
    except (KeyError, ValueError) as e:
        raise CalibrationError(f"unknown format: {e}") from None
    _check_format(f, c)
    if not (0 < p < 1 and 0 < confidence < 1):
        raise CalibrationError(f"p and confidence must lie in (0, 1), got p={p}, confidence={confidence}")
    need = min_samples(p, confidence)
    if samples // 2 < need:
        raise CalibrationError(f"{samples} samples give {samples // 2} fit samples, too few for a {confidence:g}-confidence "
                               f"bound on the {1 - p:g} quantile: need n_fit >= ln(1-confidence)/ln(1-p) = {need}, "
                               f"i.e. --samples >= {2 * need}")
    op_list = list(ALL_OPS) if ops == "all" else list(ops)
    unknown = [o for o in op_list if o not in _SPECS]
    if unknown:
        raise CalibrationError(f"cannot calibrate {', '.join(unknown)}: emulated ops are {', '.join(ALL_OPS)}")
    if tensors is not None:
        draws: list[tuple[str, Draw]] = [("tensors:" + ",".join(tensors), empirical(tensors))]
    else:
        bad = [d for d in distributions if d not in DISTRIBUTIONS]
        if bad:
            raise CalibrationError(f"unknown distribution {', '.join(bad)}; choose from {', '.join(DISTRIBUTIONS)}")
        draws = [(d, DISTRIBUTIONS[d]) for d in distributions]
    s = _Setup(f, c, scaling.get_recipe(recipe or "tensor"))
    progress = progress or (lambda k: None)
    results: dict[str, OpCalibration] = {}
    skipped: dict[str, str] = {}
    for op in op_list:  # each op's stream depends on (seed, op) only, not on the other ops asked for
        g = torch.Generator().manual_seed(seed * 1000003 + zlib.crc32(op.encode()))
        r, elems = _draw_instances(op, s, samples, draws, g, progress)
        if not torch.isfinite(r).all():
            raise CalibrationError(f"op {op}: the analytic bound is 0 where the emulated error is not; "
                                   f"the model does not cover {f} (check the format's subnormals/overflow)")
        perm = torch.randperm(samples, generator=g)
        fit, held = r[perm[:samples // 2]], r[perm[samples // 2:]]
        kappa = kappa_upper_bound(fit, p, confidence)
        if kappa == 0:
            skipped[op] = (f"{int((r == 0).sum())} of {samples} instances of shape {_SPECS[op].shapes(s)} are computed "
                           f"exactly in {c}: no error to calibrate the model's constant from (longer reductions or "
                           "other data would round)")
            continue
        v, pval = heldout_check(held, kappa, p)
        qs = {f"elem_q{q}": float(torch.quantile(elems[:1 << 24].float(), q)) for q in (0.5, 0.9, 0.99)}
        qs["elem_max"] = float(elems.max())
        results[op] = OpCalibration(
            op=op, kappa=kappa, kappa_point=float(torch.quantile(fit, 1 - p)), p=p, confidence=confidence,
            n_fit=int(fit.numel()), n_heldout=int(held.numel()), heldout_violations=v, heldout_pvalue=pval,
            analytic_failure_probability=ANALYTIC_FAILURE_PROBABILITY, out_fmt=_spec(_SPECS[op].out(s)),
            shape=[list(sh) for sh in _SPECS[op].shapes(s)], distributions=[d for d, _ in draws], quantiles=qs)
        if keep is not None:
            keep[op] = r
    from . import __version__
    return Calibration(format=f.constants(), fmt_spec=_spec(f), recipe=s.recipe.name if recipe else None,
                       compute_fmt=_spec(c), version=__version__, seed=seed, ops=results, skipped=skipped)


# ----------------------------------------------------------------------------- consumption
def apply_calibration(op: str, inputs: Sequence[torch.Tensor], calibration: "Calibration | str | Path", *,
                      fmt=None, compute_fmt=None, mode: str = "probabilistic", **op_kwargs: Any) -> Bound:
    """``min(kappa * B, deterministic bound)`` for ``op`` with ``kappa`` from ``calibration``
    (probabilistic mode only; the format, compute format, recipe and output format must be
    those the calibration measured)."""
    from .bounds.common import _CANONICAL
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
    f = get_format(fmt) if fmt is not None else cal.fmt
    if not _same(f, cal.fmt):
        raise ValueError(f"{src} calibrates {cal.fmt_spec}, not {f}")
    c = get_format(compute_fmt) if compute_fmt is not None else get_format(cal.compute_fmt)
    if not _same(c, get_format(cal.compute_fmt)):
        raise ValueError(f"{src} was measured with compute format {cal.compute_fmt}, not {c}")
    out = op_kwargs.pop("out_fmt", None)
    if out is not None and not _same(get_format(out), get_format(entry.out_fmt)):
        raise ValueError(f"{src}: op {name} was measured with output format {entry.out_fmt}, not {get_format(out)}")
    fp = op_kwargs.pop("failure_probability", None)
    if fp is not None and fp != entry.p:
        raise ValueError(f"{src}: op {name} was calibrated for failure probability {entry.p:g} per instance, "
                         f"not {fp:g}")
    if name in _QUANT_OPS:
        rec = scaling.get_recipe(op_kwargs.get("recipe", "tensor")).name
        if rec != (cal.recipe or "tensor"):
            raise ValueError(f"{src} was measured with recipe {cal.recipe or 'tensor'}, not {rec}")
        kw = {"fmt": f, "compute_fmt": c, **op_kwargs}
        if name == "quantized_matmul":
            kw["out_fmt"] = entry.out_fmt
    else:
        kw = {"fmt": f, "compute_fmt": c, "out_fmt": entry.out_fmt, **op_kwargs}
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


# ----------------------------------------------------------------------------- plots
def plot(cal: Calibration, ratios: Mapping[str, torch.Tensor], out_dir: str | Path) -> list[Path]:
    """One PNG per op: the empirical distribution (1 - CDF) of the per-instance max error in
    units of the analytic bound, with the analytic bound (1), the calibrated threshold
    (kappa) and the target level p. Returns the written paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for op, entry in cal.ops.items():
        r = torch.sort(ratios[op]).values.numpy()
        surv = 1.0 - (torch.arange(1, r.size + 1, dtype=torch.float64) / r.size).numpy()
        fig, ax = plt.subplots(figsize=(6, 4))
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
        fig.tight_layout()
        path = out / f"calibration_{op}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths
