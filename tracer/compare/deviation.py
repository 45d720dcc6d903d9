r"""Deviations from the reference, and noise samples stored as the moments a threshold needs.

:class:`DeviationOf` forms the difference ``x - ref`` of one traced tensor as the comparison
counts it, for the candidate and for the noise samples alike: the reference's non-finite
positions are zeroed in both, and parameters stored narrower than fp32 count only the part
beyond one ulp (:func:`storage_rounding_excess`).

**Moments instead of samples.** Of ``S`` noise samples ``n_s`` of a tensor, the threshold
(:mod:`tracer.compare.thresholds`) uses two statistics of the deviations ``d_s = n_s - ref``:
``z_s = ||d_s||^2`` per sample and ``||m||^2`` with ``m = sum_s d_s^2`` elementwise
(:func:`~tracer.compare.thresholds.moments_threshold`). A reference traced with
``NoiseSampler(store="moments")`` computes them while its samples run, and sample ``s``'s
trace stores, per tensor, the float64 triple

.. math::

    z_s = \sum_i d_{s,i}^2, \qquad q_s = \sum_i d_{s,i}^4, \qquad
    c_s = \sum_i d_{s,i}^2 a_{s,i}, \quad a_s = \sum_{t<s} d_t^2

(``a`` is held in memory across the samples of a step, :class:`MomentAccumulator`), so that

.. math::

    \|m\|^2 = \sum_i \Big(\sum_s d_{s,i}^2\Big)^2 = \sum_s q_s + 2 \sum_s c_s .

After the triple come, where the block-scale statistic applies (:func:`block_scale_applies`),
the sample's block coordinates ``y_s`` (:func:`tracer.compare.blockscale.block_scales`, at most 16 values),
from which that statistic's threshold is computed as from whole samples; then, for the tensors
recorded before the optimizer update, the sample's
:class:`~tracer.compare.elementwise.ElementSummary` (``2 + R + C`` values: its largest
standardised excess, its largest rounding flip in storage allowances and the margins of ``d_s^2``), from which the element statistic is computed
as from whole samples. The entry's :data:`DEVIATION_FIELD` says how many of each follow. The thresholds are
those of the whole samples up to rounding (the sums are float64), each sample's trace stays
self-contained, and a comparison reads at most ``152 S`` bytes per tensor instead of ``S``
tensors. :class:`MomentWriter` is that sample's writer.

Stored whole, as before: the tensors the comparison needs elementwise, i.e. a module's top-k
scores and the tensors that consume its choice (:mod:`tracer.compare.decisions`), and the tensors the
clean step did not trace with the same shape (nothing to subtract).

Cost: the clean step's tensor is read back from the reference's trace once per sample, and the
accumulators hold one float64 copy of every traced tensor of a step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tracer.compare.blockscale import block_grid, block_scales
from tracer.compare.decisions import TOPK_CONSUMER_META, TOPK_META
from tracer.compare.elementwise import ElementSummary, summarize, view_rows
from tracer.errors import TraceError
from tracer.trace.schema import PRE_UPDATE_PHASES, Entry, Phase, RecordKey
from tracer.trace.store import TraceReader, TraceWriter

__all__ = ["BLOCKS_FIELD", "DEVIATION_FIELD", "ELEMENT_FLIPS_FIELD", "ELEMENT_ROWS_FIELD", "DeviationOf", "MomentAccumulator", "MomentWriter",
           "SampleMoments", "StorageRoundingExcess", "block_scale_applies", "combined_moments", "storage_rounding_allowance",
           "storage_rounding_excess", "stored_rounded", "work_dtype"]

#: manifest entry field of a tensor stored as moments: ``{"dtype", "shape"}`` of the traced tensor and
#: the ``sample`` index (``c`` sums over the samples before it); the entry's own ``dtype``/``shape``
#: describe what the file holds: float64 ``[3]`` = z, q, c
DEVIATION_FIELD = "deviation_moments_of"

#: fields of :data:`DEVIATION_FIELD`: how many block coordinates follow the moments, and the rows of the
#: :class:`~tracer.compare.elementwise.ElementSummary` after them (absent: none stored)
BLOCKS_FIELD = "blocks"
ELEMENT_ROWS_FIELD = "element_rows"
#: present (True) where the element summary holds ``K_s`` (:class:`~tracer.compare.elementwise.ElementSummary`);
#: a trace written before it holds ``[L_s, rho..., kappa...]``
ELEMENT_FLIPS_FIELD = "element_flips"

#: stored dtypes whose comparison arithmetic runs in float32 (:func:`work_dtype`)
_FLOAT32_WORK = (torch.float32, torch.bfloat16, torch.float16)



def work_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """float32 when every stored dtype is fp32/bf16/fp16 (differences of two such values are
    exact in float32 unless more than 2x apart; norms carry a relative error ~1e-6), else
    float64."""
    return torch.float32 if all(d in _FLOAT32_WORK for d in dtypes) else torch.float64


def stored_rounded(phase: str, dtype: torch.dtype) -> bool:
    """A parameter after the update stored narrower than fp32: the rounding of an fp32 main
    parameter (where :func:`storage_rounding_excess` and its allowance apply)."""
    return phase == Phase.PARAM and dtype in (torch.bfloat16, torch.float16)


#: phases whose tensors are parameter gradients: a 1-D one is a sum over every token
_PARAMETER_GRADIENT_PHASES = (Phase.GRAD_LOCAL, Phase.GRAD, Phase.MAIN_GRAD)


def block_scale_applies(phase: str, ref: torch.Tensor) -> bool:
    """Is the block-scale statistic (:mod:`tracer.compare.blockscale`) tested on this tensor? Floating
    point, at least two blocks, not compared by its storage-rounding excess (which is not
    linear in the deviation), and not the gradient of a 1-D parameter (a norm's weight or bias,
    a linear bias): a sum over every token, which kernels may accumulate in low precision with
    a systematic bias that a TP/SP split changes and zero-mean noise does not sample
    (:mod:`tracer.compare.blockscale`, "Where it is not tested")."""
    b0, b1 = block_grid(tuple(ref.shape))
    return (ref.is_floating_point() and b0 * b1 >= 2 and not stored_rounded(phase, ref.dtype)
            and not (phase in _PARAMETER_GRADIENT_PHASES and ref.dim() == 1))


def storage_rounding_excess(phase: str, dtype: torch.dtype, ref: torch.Tensor) -> StorageRoundingExcess | None:
    """``x -> |x - ref|`` elementwise, less one unit in the last place of the stored format,
    for parameters after the update (phase ``param``) stored in a format narrower than fp32;
    ``None`` otherwise (the error is then ``|x - ref|`` itself).

    Such a parameter is the rounding of an fp32 main parameter; two runs whose main
    parameters differ legitimately by far less than an ulp of the stored format still store
    values one ulp apart when they straddle a rounding boundary. That flip is legitimate and
    is at most one ulp of the larger magnitude (round to nearest of two values that differ by
    less than an ulp), so only the part of a difference beyond it is counted, in the
    candidate's error and in the noise samples' deviations alike.
    """
    if not stored_rounded(phase, dtype):
        return None
    from ttrace_num.formats import get_format
    return StorageRoundingExcess(ref, get_format(dtype))


class StorageRoundingExcess:
    r"""``excess(x) = max(0, |x - ref| - 2 half_ulp(max(|x|, |ref|)))`` elementwise
    (:func:`storage_rounding_excess`), evaluated only where ``x != ref``.

    Equal values have no excess (the formula gives ``max(0, -2 half_ulp) = 0``), and in a
    correct run most elements of a parameter stored in bf16 are equal: the test is one pass
    over the stored values, in their own dtype, and only the unequal elements (one-ulp flips
    and larger differences, NaN included) are converted to the working dtype
    (:func:`work_dtype`) and go through the formula. The values are the formula's, bit for
    bit (``tests/test_deviation.py``). ``ref`` and ``x`` are finite where they are equal (a
    non-finite reference position is zeroed in both before, :class:`DeviationOf`)."""

    def __init__(self, ref: torch.Tensor, fmt: Any) -> None:
        self.ref, self.fmt = ref.detach(), fmt

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The excess of ``x``, elementwise, in the working dtype."""
        far, values = self._far(x)
        out = torch.zeros(x.numel(), dtype=values.dtype)
        out[far] = values
        return out.reshape(x.shape)

    def norm(self, x: torch.Tensor) -> float:
        """``||excess(x)||_2``, without the tensor of zeros."""
        return float(torch.linalg.vector_norm(self._far(x)[1]))

    def _far(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat indices of the elements unequal to the reference, and their excess."""
        from ttrace_num.formats import half_ulp
        work = work_dtype(x.dtype, self.ref.dtype)
        far = torch.ne(x.detach(), self.ref).reshape(-1).nonzero().squeeze(1)
        xf, rf = x.detach().reshape(-1)[far].to(work), self.ref.reshape(-1)[far].to(work)
        return far, ((xf - rf).abs_() - 2 * half_ulp(torch.maximum(xf.abs(), rf.abs()), self.fmt, work)).clamp_min(0.0)


def storage_rounding_allowance(phase: str, dtype: torch.dtype, norm_x: float, norm_ref: float, numel: int) -> float:
    """An upper bound on ``||x - ref||_2 - ||excess(x)||_2`` from norms alone, for
    :func:`storage_rounding_excess` (0 where it does not apply): what a statistics-only
    comparison subtracts from its lower bound ``| ||x|| - ||ref|| |`` of ``||x - ref||`` before
    comparing it with a threshold of excesses.

    Derivation: elementwise ``|x_i - ref_i| <= excess_i + 2 h_i`` with ``h_i`` the half-ulp of
    ``max(|x_i|, |ref_i|)``, so ``||x - ref|| <= ||excess|| + 2 ||h||`` (triangle inequality);
    ``h_i <= u max(|x_i|, |ref_i|) + s`` (``u`` the unit roundoff, ``s`` the format's absolute
    bound below its normal range), ``||max(|x|, |ref|)|| <= sqrt(||x||^2 + ||ref||^2)``, hence
    ``2 ||h|| <= 2 (u sqrt(||x||^2 + ||ref||^2) + s sqrt(n))``. Attained within ~1.4x by one-ulp
    flips of values just above a power of two (``tests/test_deviation.py``)."""
    if not stored_rounded(phase, dtype):
        return 0.0
    from ttrace_num.formats import get_format
    fmt = get_format(dtype)
    return 2 * (fmt.u * math.hypot(norm_x, norm_ref) + fmt.subnormal_abs_error * math.sqrt(numel))


class DeviationOf:
    """Deviations from one reference tensor, as the comparison counts them (module doc).

    ``ref`` is already in the working dtype; ``stored`` is the dtype it was traced in;
    ``finite``: the mask of the reference's finite elements, True when all are known to be
    finite, ``None`` to test it here (one sum when all are finite)."""

    def __init__(self, ref: torch.Tensor, stored: torch.dtype, phase: str, finite: torch.Tensor | bool | None = None):
        if finite is None:
            finite = True if math.isfinite(float(ref.sum())) else torch.isfinite(ref)
        self.finite = None if finite is True or bool(finite.all()) else finite
        self.work = ref.dtype
        self.ref = self.part(ref)
        self.excess = storage_rounding_excess(phase, stored, self.ref)

    def part(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` in the working dtype with the reference's non-finite positions zeroed."""
        x = x.detach().to(self.work)
        return x if self.finite is None else x.masked_fill(~self.finite, 0.0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The deviation of ``x``: ``x - ref``, or its storage-rounding excess (elementwise)."""
        x = self.part(x)
        return x - self.ref if self.excess is None else self.excess(x)


#: elements per chunk of a later sample's moments (:meth:`MomentAccumulator.moments`)
MOMENT_CHUNK = 1 << 17


class MomentAccumulator:
    """``a = sum_{t<s} d_t^2`` per tensor over the samples of one step (module doc)."""

    def __init__(self) -> None:
        self.sums: dict[RecordKey, torch.Tensor] = {}

    def reset(self) -> None:
        """Forget the sums: before the first sample of a step, and after its last (memory)."""
        self.sums = {}

    def moments(self, key: RecordKey, d: torch.Tensor) -> torch.Tensor:
        """``[z, q, c]`` of one sample's deviation ``d`` (float64), and ``d^2`` added to ``a``.

        The first sample's ``d^2`` becomes ``a``; a later one's is taken chunk by chunk
        (:data:`MOMENT_CHUNK` elements, float64 scratch that stays in cache and is reused
        instead of a fresh tensor as large as ``d``, which the allocator maps anew and the
        kernel page-faults in: 2M elements, 4.0 ms instead of 5.9)."""
        flat = d.detach().reshape(-1)
        acc = self.sums.get(key)
        if acc is None:
            sq = flat.to(torch.float64, copy=True).square_()
            self.sums[key] = sq
            return torch.stack([sq.sum(), torch.dot(sq, sq), sq.new_zeros(())])
        parts = [torch.zeros(3, dtype=torch.float64)]
        for i in range(0, flat.numel(), MOMENT_CHUNK):
            sq = flat[i:i + MOMENT_CHUNK].to(torch.float64, copy=True).square_()
            a = acc[i:i + MOMENT_CHUNK]
            parts.append(torch.stack([sq.sum(), torch.dot(sq, sq), torch.dot(sq, a)]))
            a.add_(sq)
        return torch.stack(parts).sum(0)


class MomentWriter(TraceWriter):
    """A noise sample's trace (rank 0 of a single-process reference) that stores each tensor
    as its deviation moments from the clean step's trace under ``reference`` (module doc).

    The clean step must be flushed (full mode) before the sample traces it, and ``moments``
    reset before the first sample of each step (:meth:`MomentAccumulator.reset`)."""

    def __init__(self, root: str | Path, reference: str | Path, sample: int, moments: MomentAccumulator,
                 layout: dict[str, Any], model_signature: str, *, run_id: str = "",
                 run_meta: dict[str, Any] | None = None) -> None:
        super().__init__(root, 0, 1, layout, model_signature, run_id=run_id, mode="full", run_meta=run_meta)
        self.reference = Path(reference)
        self.sample = int(sample)
        self.acc = moments
        self._clean: tuple[int, TraceReader, dict[RecordKey, Entry]] | None = None

    def _clean_entry(self, step: int, key: RecordKey) -> tuple[TraceReader, Entry | None]:
        if self._clean is None or self._clean[0] != step:
            reader = TraceReader(self.reference)
            if step not in reader.steps():
                raise TraceError("the clean step is not in the reference's trace: a noise sample stored as moments "
                                 "needs it flushed first (full mode; a background writer: pass it to NoiseSampler as "
                                 "clean_writer)", path=self.reference, rank=0, step=step)
            if reader.manifest(step, 0)["mode"] != "full":
                raise TraceError("the reference traced this step in stats mode: noise samples stored as moments "
                                 "need its tensors (trace the reference in full mode)", path=self.reference,
                                 rank=0, step=step)
            self._clean = (step, reader, {e.record_key: e for e in reader.entries(step, 0)})
        return self._clean[1], self._clean[2].get(key)

    def _kept(self, entry: dict[str, Any], tensor: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
        """The moments (and block coordinates) of ``tensor``'s deviation from the clean step,
        read from the traced tensor itself (no copy of it is kept); ``tensor`` itself where it is
        stored whole. The entry's statistics are those of what is stored."""
        meta = entry["meta"]
        if TOPK_META in meta or TOPK_CONSUMER_META in meta or not tensor.is_floating_point():
            return entry, tensor  # compared elementwise (tracer.compare.decisions), or exactly (integers)
        step, key = entry["step"], RecordKey.of(entry)
        reader, clean = self._clean_entry(step, key)
        if clean is None or list(clean.shape) != entry["shape"]:
            return entry, tensor  # nothing to subtract: stored whole
        ref = reader.load(step, 0, clean.key)
        work = work_dtype(ref.dtype, tensor.dtype)
        dev = DeviationOf(ref.to(work), ref.dtype, entry["phase"])
        d = dev(tensor.to("cpu"))
        parts = [self.acc.moments(key, d)]
        of = {"dtype": entry["dtype"], "shape": entry["shape"], "sample": self.sample}
        if block_scale_applies(entry["phase"], ref):
            parts.append(block_scales(dev.ref, d, work, deviation=True))
            of[BLOCKS_FIELD] = int(parts[-1].numel())
        if entry["phase"] in PRE_UPDATE_PHASES and d.numel():
            parts.append(summarize(d, dev.ref, ref.dtype).flat())
            of[ELEMENT_ROWS_FIELD] = view_rows(d.shape)[0]
            of[ELEMENT_FLIPS_FIELD] = True
        values = torch.cat(parts)
        stored = dict(entry, dtype="float64", shape=[values.numel()], **{DEVIATION_FIELD: of})
        return stored, values


@dataclass(frozen=True)
class SampleMoments:
    """The moments of a tensor's noise samples that its threshold needs (module doc)."""

    z: list[float]   # ||d_s||^2 per sample
    m_sq: float      # ||sum_s d_s^2||^2
    blocks: list[torch.Tensor] | None = None  # block coordinates y_s per sample (tracer.compare.blockscale), if stored
    elements: list[ElementSummary] | None = None  # per sample, for the element statistic (tracer.compare.elementwise)


def combined_moments(entries: list[Entry], stored: list[torch.Tensor], ref_entry: Entry,
                     where: Path, step: int) -> SampleMoments:
    """:class:`SampleMoments` from the ``[z, q, c]`` of samples ``0 .. S-1`` of one tensor;
    a :class:`~tracer.errors.TraceError` when they are of another tensor or not that set (``c``
    sums over the samples before each: a subset other than a prefix gives a wrong ``||m||^2``)."""
    of = [e.extra[DEVIATION_FIELD] for e in entries]
    name = ref_entry.name
    if any(o.get("shape") != list(ref_entry.shape) for o in of):
        raise TraceError(f"noise samples stored as moments are of shapes {[o.get('shape') for o in of]}, the "
                         f"reference tensor is {list(ref_entry.shape)}: they belong to another run", path=where,
                         step=step, tensor=name)
    order = sorted(range(len(of)), key=lambda i: int(of[i].get("sample", -1)))
    if [int(of[i].get("sample", -1)) for i in order] != list(range(len(of))):
        raise TraceError(f"noise samples stored as moments must be used as a whole set 0..S-1, got samples "
                         f"{sorted(int(o.get('sample', -1)) for o in of)}: pass all of them (or none)",
                         path=where, step=step, tensor=name)
    if len({int(t.numel()) for t in stored}) != 1 or int(stored[0].numel()) < 3:
        raise TraceError(f"noise samples stored as moments hold {[int(t.numel()) for t in stored]} values: expected "
                         "3 moments and the same block coordinates in every sample (a corrupt or mixed set)",
                         path=where, step=step, tensor=name)
    zqc = [stored[i][:3].tolist() for i in order]
    layout = of[order[0]]
    # a trace from before the element summaries holds the block coordinates alone after the moments
    nb = int(layout.get(BLOCKS_FIELD, 0 if ELEMENT_ROWS_FIELD in layout else stored[0].numel() - 3))
    blocks = [stored[i][3:3 + nb] for i in order] if nb > 0 else None
    rows = layout.get(ELEMENT_ROWS_FIELD)
    flips = bool(layout.get(ELEMENT_FLIPS_FIELD, False))
    elements = ([ElementSummary.from_flat(stored[i][3 + nb:], int(rows), flips) for i in order]
                if rows is not None else None)
    return SampleMoments([z for z, _, _ in zqc], math.fsum(q for _, q, _ in zqc) + 2 * math.fsum(c for _, _, c in zqc),
                         blocks, elements)
