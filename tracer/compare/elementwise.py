r"""The element statistic: each element's difference against its own legitimate scale.

The norm statistic (:mod:`tracer.compare.thresholds`) and the block-scale statistic
(:mod:`tracer.compare.blockscale`) add a difference up over the whole tensor or over blocks of
it; one wrong element of ``N`` raises the norm by ``|delta x_j|^2`` against ``N`` elements'
worth of legitimate difference, so it must grow ~``sqrt(N)`` times the legitimate scale
before either sees it. This statistic looks at every element against a scale of its own.

**Definition.** View the tensor as ``R x C`` (the last dimension against all others; a 1-D
tensor as one row). Each noise sample ``s`` is summarised by the margins of its squared
deviation, ``rho_{s,r} = sum_c d_{s,rc}^2`` and ``kappa_{s,c} = sum_r d_{s,rc}^2``
(:class:`ElementSummary`, ``R + C`` numbers), and the element's legitimate scale is the rank-1
fit of the samples' mean square

.. math::

    w_{rc}^2 = \frac{\bar\rho_r\, \bar\kappa_c}{\bar\tau}, \qquad
    \bar\rho = \frac{1}{S C} \sum_s \rho_s,\;\; \bar\kappa = \frac{1}{S R} \sum_s \kappa_s,\;\;
    \bar\tau = \frac{1}{S R C} \sum_s \sum_r \rho_{s,r}

(one row or one column: the mean square of the whole tensor; row mean times column mean over
the total mean: the variance of a GEMM's result
``y_rc = sum_k a_rk b_kc`` has this product form when the rounding of every term scales with
``|a_rk||b_kc|``, and the same holds, to first order, for the difference propagated through
one). It pools ``S (R + C)`` values where one element's own mean square has ``S``. An element
whose spread is not of this form shows in the tail scale below.

**Storage allowance.** Two runs store ``fl(a)`` and ``fl(b)`` of the values they computed, and
``|fl(a) - fl(b)| <= |a - b| + a_i`` with ``a_i`` one unit in the last place of the larger of
the two in the stored format (half an ulp each): a bf16 activation of two correct runs is often
one ulp apart where their real values differ by far less. The statistic tests the excess
``(|e_i| - a_i)_+`` (the samples' ``(|d_{s,i}| - a_{s,i})_+`` alike), so the ulp is allowed once,
additively, rather than as a variance that the tail quantile multiplies.

**Tail scale.** Legitimate differences are not Gaussian element by element (storage roundings
are discrete, one element's error model differs from its row's), and ``S`` samples cannot
estimate an element's tail. Each sample does show how heavy the tail is at the ``1/N`` level:
its excess standardised by the rank-1 fit of its *own* margins with the element itself left
out (``rho_r - d_rc^2``, ``kappa_c - d_rc^2``, ``tau - d_rc^2``, so an outlier does not hide
in its own row and column; where the rest of its row or column is zero, the tensor's mean
square without it),
``L_s = max_i (|d_{s,i}| - a_{s,i})_+ / w^{(s,-i)}_i``, is a draw of the largest of ``N``
standardised legitimate differences, which for Gaussian elements has median ``z_med =
Phi^{-1}(1 - ln 2 / (2N))`` (a one-sample fit is noisier than the pooled one, which makes
``L_s`` larger: conservative). The tail scale is ``sigma = max(1, max_s L_s / z_med)``: 1 when the
samples' largest values are no heavier than Gaussian, larger in proportion when they are.

**Threshold.** Element ``i`` is over when ``|e_i| > k a_i + sigma z_q w_i`` (``k``: "Rounding
flips" below, 1 unless the samples show flips of several ulps), ``z_q = Phi^{-1}(1 -
q / (2N))``; the statistic is ``max_i (|e_i| - k a_i)_+ / (sigma z_q w_i)``. Under the model
(``(|e_i| - k a_i)_+ / (sigma w_i)`` no heavier-tailed than a standard normal's magnitude beyond the
level the samples show) each element exceeds its threshold with probability ``<= q / N``, the
tensor with probability ``<= q`` (Bonferroni over the elements, as the checker splits its
comparison's probability over tensors). The model is stated, not proven: it is checked by the
clean comparisons of the detection and sensitivity benchmarks (``docs/detection-statistics.md``),
where the largest clean ratio is reported.

**Rounding flips.** Where an element's legitimate difference is below one allowance (its real
value moves by a fraction of an ulp), the stored value moves by whole ulps or not at all: a
rounding flip, of one ulp per rounding of the chain from the last real-valued change to the
stored result (an fp32 softmax: the exponential, the division, up to 2 ulps), with a
probability in proportion to the real change. The Gaussian model on ``w_i`` does not describe
that: the pooled mean square of sparse one-ulp flips is a fraction of an ulp, against which a
legitimate two-ulp flip is a 10-sigma event (measured: an fp32 softmax output of the
re-synchronised sensitivity comparison, ratio 1.76, once the noise followed the layout). Each
sample therefore records ``K_s``, the largest number of allowances (``ceil(|d_i| / a_i)``) by
which it moved an element whose legitimate scale, its own leave-one-out fit, is below one
allowance, at most :data:`FLIP_ALLOWANCES_MAX` = 4 (a chain of up to four roundings: a norm's
mean, variance, reciprocal square root and scaling); the allowance is ``k a_i`` with ``k =
max_s K_s``, and ``L_s`` is taken beyond the sample's own ``K_s`` allowances. Larger moves in
that regime are left to the tail scale. The cost, measured: bf16 activations of the sensitivity
benchmark, whose elements move by 0 or 1 ulp at a scale of ~0.5 ulp and now and then by 2-4,
get 2-4 allowances, and one corrupted element must change by 40-100% more to be seen (0.027 to
0.050 of its value on one target). A narrower regime (a scale below a quarter allowance) kept
that sensitivity but let the fp32 softmax flip through again: the samples' flips fall in rows
they move elsewhere too, whose own fits are larger, while the candidate's fell in a row no sample
moved; the margins' rank-1 fit cannot see that a quiet row flips now and then.

**No spread.** Where no sample moved the tensor at all (a layout that leaves its arithmetic
unchanged predicts exactly that, :mod:`ttrace_num.propagate.layout`), the scale is 0 and an
element is over when it differs by more than *two* storage allowances: one for a rounding of a
value the candidate computed within the same ulp, one for a partial placement's sum of
partials rounded once each (the reasoning, and the measured 1.125 ulps of a CP=4 loss, of
:func:`tracer.compare.thresholds.unmodelled_threshold`, whose norm threshold is ``2 ||ulp||``);
its ratio is then infinite.

**Samples stored as moments.** A sample's summary is ``R + C + 1`` numbers, computed where
the sample is traced (:class:`tracer.compare.deviation.MomentWriter`) from its deviation, as
the comparison computes it from a sample stored whole: both modes give the same statistic.

**Where it applies** (:func:`element_statistic_applies`): on the tensors a step records before
its optimizer update when the candidate and every noise sample started that step from the
reference's parameters (the first step of a comparison, or every step of a re-synchronised
reference, :mod:`tracer.capture.resync`), and the step makes no top-k choice. After an update a
correct run differs from the reference by Adam's discrete sign flips (``lr sign(g)`` of the
elements whose gradient is within round-off of zero), a few large element differences that
four samples reproduce elementwise no better than chance: measured on the sensitivity
benchmark's own-trajectory steps 1-2 (bf16), the statistic would flag 6 clean activations
(embedding lookups of rows Adam moved in the candidate and in no sample: infinitely over) and 6
clean parameter gradients (up to 1.08x), where at step 0 the largest clean ratio is 0.39, and at
every step of the re-synchronised comparison 0.42 (``docs/detection-statistics.md``).

Cost: a few elementwise passes per sample (where it is traced, or at the comparison for samples
stored whole) and two for the candidate; ``R + C + 1`` numbers per sample and tensor on disk.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tracer.trace.schema import PRE_UPDATE_PHASES

__all__ = ["FLIP_ALLOWANCES_MAX", "ElementSummary", "ElementTest", "element_statistic_applies", "element_test", "pooled_scale",
           "storage_allowance", "summarize", "view_rows"]


_FLOAT64_MAX = torch.finfo(torch.float64).max


@dataclass(frozen=True)
class ElementTest:
    """The element statistic of one tensor (module doc)."""

    ratio: float        # max_i (|e_i| - k a_i)_+ / (sigma z w_i)
    index: int          # flat index of the element that sets it
    tail_scale: float   # sigma
    z: float            # z_q
    threshold: float    # k a_i + sigma z w_i at that element
    allowances: int = 1  # k: storage allowances per element (module doc, "Rounding flips")


@dataclass(frozen=True)
class ElementSummary:
    """What the element statistic keeps of one noise sample (module doc): the margins of its
    squared deviation over the ``R x C`` view and its largest standardised excess ``L_s``."""

    rows: torch.Tensor   # rho_r = sum_c d_rc^2, float64 [R]
    cols: torch.Tensor   # kappa_c = sum_r d_rc^2, float64 [C]
    largest: float       # L_s
    flips: int = 1       # K_s: the most storage allowances a rounding flip moved an element by

    def flat(self) -> torch.Tensor:
        """``[L_s, K_s, rho..., kappa...]`` (float64), as a sample stored as moments keeps it; an
        infinite ``L_s`` as the largest float64 (a trace's finite values are checked as such)."""
        largest = min(self.largest, _FLOAT64_MAX)
        return torch.cat([torch.tensor([largest, float(self.flips)], dtype=torch.float64), self.rows, self.cols])

    @staticmethod
    def from_flat(values: torch.Tensor, rows: int, flips: bool = True) -> "ElementSummary":
        """The inverse of :meth:`flat` for a tensor of ``rows`` rows; ``flips=False``: a summary
        written before ``K_s`` was kept (``[L_s, rho..., kappa...]``), read as ``K_s = 1``."""
        largest = float(values[0])
        largest = math.inf if largest >= _FLOAT64_MAX else largest
        if not flips:
            return ElementSummary(values[1:1 + rows].double(), values[1 + rows:].double(), largest)
        return ElementSummary(values[2:2 + rows].double(), values[2 + rows:].double(), largest,
                              max(1, int(values[1])))


def element_statistic_applies(phase: str, shared_start: bool, discrete: bool) -> bool:
    """Whether the element statistic tests a tensor of ``phase`` (module doc, "Where it applies"):
    recorded before the step's optimizer update, in a step that the candidate and the samples
    began from the reference's parameters (``shared_start``), without a top-k choice (``discrete``)."""
    return shared_start and not discrete and phase in PRE_UPDATE_PHASES


def view_rows(shape: tuple[int, ...] | list[int] | torch.Size) -> tuple[int, int]:
    """``(R, C)`` of a tensor's ``R x C`` view: the last dimension against all others (1-D: one
    row; 0-D: ``1 x 1``)."""
    shape = tuple(shape)
    if len(shape) <= 1:
        return 1, (shape[0] if shape else 1)
    c = shape[-1]
    return (math.prod(shape) // c if c else 0), c


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(view_rows(x.shape))


def storage_allowance(ref: torch.Tensor, diff: torch.Tensor, stored: torch.dtype) -> torch.Tensor:
    """``a_i``: one unit in the last place, in the stored format, of the larger of ``|r_i|`` and
    ``|x_i| = |r_i + diff_i|`` (bounded by ``|r_i| + |diff_i|``): two values stored by rounding
    differ by at most the difference of what was rounded plus half an ulp of each (float64)."""
    from ttrace_num.formats import get_format, half_ulp
    return 2 * half_ulp(ref.detach().double().abs() + diff.detach().double().abs(), get_format(stored))


def _excess(x: torch.Tensor, ref: torch.Tensor, stored: torch.dtype, allowances: int = 1) -> torch.Tensor:
    """``(|x_i| - k a_i)_+``: a difference beyond ``k = allowances`` storage allowances."""
    return (x.abs() - allowances * storage_allowance(ref, x, stored)).clamp_min_(0.0)


def _ratio_to(excess: torch.Tensor, scale_sq: torch.Tensor) -> torch.Tensor:
    """``excess / sqrt(scale_sq)``, infinite where the scale is 0 and the excess is not."""
    return torch.where(scale_sq > 0, excess / scale_sq.clamp_min(0.0).sqrt(), torch.where(excess == 0, 0.0, math.inf))


#: elements per chunk of rows: the float64 temporaries of a pass stay a few MB, whatever the tensor's size
_CHUNK = 1 << 17


def _row_chunks(rows: int, cols: int) -> list[tuple[int, int]]:
    """``(start, stop)`` row ranges of at most :data:`_CHUNK` elements (at least one row)."""
    step = max(1, _CHUNK // max(cols, 1))
    return [(i, min(i + step, rows)) for i in range(0, rows, step)]


def summarize(deviation: torch.Tensor, ref: torch.Tensor, stored: torch.dtype) -> ElementSummary:
    """A noise sample's :class:`ElementSummary` from its deviation ``d`` from the reference
    ``ref`` (stored in ``stored``): the margins of ``d^2``, ``K_s`` (module doc, "Rounding flips")
    and ``L_s`` against the rank-1 fit of its own margins with each element left out, beyond
    ``K_s`` allowances (module doc, "Tail scale"). Two passes over ``d`` by chunks of rows, in
    float64."""
    d = _as_rows(deviation.detach())
    r_all = _as_rows(ref.detach())
    r, c = d.shape
    rows = torch.zeros(r, dtype=torch.float64)
    cols = torch.zeros(c, dtype=torch.float64)
    chunks = _row_chunks(r, c)
    for i, j in chunks:
        sq = d[i:j].double().square()  # not in place: .double() of a float64 tensor is the tensor itself
        rows[i:j] = sq.sum(1)
        cols += sq.sum(0)
    total = float(rows.sum())
    largest = [0.0] * FLIP_ALLOWANCES_MAX  # L_s beyond k = 1..K_max allowances
    flips = 1
    for i, j in chunks:
        dd = d[i:j].double()
        sq = dd * dd
        # the fit at (r, c) without the element: (rho_r - d^2)/(C-1) * (kappa_c - d^2)/(R-1) / ((tau - d^2)/(N-1));
        # a dimension of length 1 pools nothing: the tensor's mean square without the element
        mean = (total - sq) / max(r * c - 1, 1)
        if r * c == 1:
            fit = torch.zeros_like(sq)  # one element: no other to pool
        elif r == 1 or c == 1:
            fit = mean
        else:  # where the rest of its row or column is 0 the product carries nothing: the tensor's mean square
            row_mean = (rows[i:j, None] - sq) / (c - 1)
            col_mean = (cols[None, :] - sq) / (r - 1)
            fit = torch.where((row_mean > 0) & (col_mean > 0),
                              row_mean * col_mean / mean.clamp_min(torch.finfo(torch.float64).tiny), mean)
        allowance = storage_allowance(r_all[i:j], dd, stored)
        flips = max(flips, _flips(dd, allowance, fit))
        for k in range(FLIP_ALLOWANCES_MAX):
            excess = (dd.abs() - (k + 1) * allowance).clamp_min_(0.0)
            largest[k] = max(largest[k], float(_ratio_to(excess, fit).max()))
    return ElementSummary(rows, cols, largest[flips - 1], flips)


#: the most storage allowances a rounding flip may move an element by (module doc, "Rounding flips")
FLIP_ALLOWANCES_MAX = 4


def _flips(d: torch.Tensor, allowance: torch.Tensor, fit: torch.Tensor) -> int:
    """``K_s`` over a chunk: the largest ``ceil(|d_i| / a_i)``, at most :data:`FLIP_ALLOWANCES_MAX`,
    over the elements whose legitimate scale (the sample's own leave-one-out fit) is below one
    allowance, where a move is a rounding flip (module doc, "Rounding flips"); 1 when none."""
    flip = (fit < allowance * allowance) & (allowance > 0)
    if not bool(flip.any()):
        return 1
    ulps = torch.ceil(d.abs()[flip] / allowance[flip] - 1e-9)
    return int(min(FLIP_ALLOWANCES_MAX, max(1.0, float(ulps.max()))))


def _pooled_factors(summaries: list[ElementSummary]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, b)``, ``R x 1`` and ``1 x C``, with ``w^2 = a b`` the rank-1 fit of the samples' mean
    square from their margins (one row or one column: the tensor's mean square)."""
    rows = torch.stack([s.rows for s in summaries]).mean(0)
    cols = torch.stack([s.cols for s in summaries]).mean(0)
    r, c = rows.numel(), cols.numel()
    total = float(rows.sum()) / max(r * c, 1)
    if total <= 0:
        return torch.zeros(r, 1, dtype=torch.float64), torch.zeros(1, c, dtype=torch.float64)
    if r == 1 or c == 1:
        return torch.full((r, 1), total, dtype=torch.float64), torch.ones(1, c, dtype=torch.float64)
    return (rows / (c * total))[:, None], (cols / r)[None, :]


def pooled_scale(summaries: list[ElementSummary]) -> torch.Tensor:
    """``w^2`` (``R x C``, float64): the rank-1 fit of the samples' mean square from their margins."""
    a, b = _pooled_factors(summaries)
    return a * b


def _normal_quantile(p: float) -> float:
    """``Phi^{-1}(1 - p)`` for small ``p``."""
    from scipy.special import ndtri
    return float(-ndtri(p))


def element_test(diff: torch.Tensor, summaries: list[ElementSummary], ref: torch.Tensor, stored: torch.dtype,
                 false_alarm: float) -> ElementTest:
    """The element statistic (module doc) of the difference ``diff = cand - ref`` given the noise
    samples' :class:`ElementSummary` (:func:`summarize`), the reference ``ref`` and the dtype it
    was stored in, at per-tensor probability ``false_alarm`` (one pass by chunks of rows)."""
    if not summaries:
        raise ValueError("the element statistic needs the summaries of the noise samples")
    e = _as_rows(diff.detach())
    r_all = _as_rows(ref.detach())
    n = max(e.numel(), 1)
    z_med = _normal_quantile(math.log(2) / (2 * n))
    tail = max(1.0, max(s.largest for s in summaries) / z_med)
    z = _normal_quantile(false_alarm / (2 * n))
    if math.isinf(tail):  # a sample moved an element none of its row and column did: no tail bound
        return ElementTest(0.0, 0, tail, z, math.inf)
    if not e.numel():
        return ElementTest(0.0, 0, tail, z, 0.0)
    a, b = _pooled_factors(summaries)
    # "Rounding flips" and "No spread" (module doc)
    allowances = max(s.flips for s in summaries) if bool((a > 0).any()) else 2
    best, at, threshold = -1.0, 0, 0.0
    for i, j in _row_chunks(*e.shape):
        ee, scale_sq = e[i:j].double(), a[i:j] * b
        stat = _ratio_to(_excess(ee, r_all[i:j], stored, allowances), scale_sq).reshape(-1)
        k = int(stat.argmax())
        if float(stat[k]) > best:
            best, at = float(stat[k]), i * e.shape[1] + k
            threshold = (allowances * float(storage_allowance(r_all[i:j], ee, stored).reshape(-1)[k])
                         + tail * z * float(scale_sq.reshape(-1)[k].sqrt()))
    return ElementTest(best / (tail * z), at, tail, z, threshold, allowances)
