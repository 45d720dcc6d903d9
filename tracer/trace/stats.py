"""Statistics of traced tensors: the ``stats`` of a manifest entry.

``tensor_stats(t)`` takes them for one tensor; ``tensor_stats_many(ts)`` for a step's worth
at once. A step traces hundreds of small tensors (norm weights, biases, a microbatch's
activations of a small model), and one tensor's statistics cost ~10 torch calls plus Python:
~110 us each, measured as 80% of stats-only tracing's overhead on the demo model. The
batched form stacks the tensors of equal size into one matrix and reduces its rows, a
constant number of calls per size, with the same float64 arithmetic per tensor (module
functions' docstrings). ``PendingStats(t)`` reduces a large tensor on an accelerator where it
lives without waiting for the result, so that a stats-only trace neither stalls the step on
a host sync nor keeps a copy of the tensor; its ``resolve()`` reads the result at the flush.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

QUANTILES = (0.0, 0.01, 0.25, 0.5, 0.75, 0.99, 1.0)
MAX_STAT_SAMPLES = 1 << 10
#: tensors smaller than this are the ones ``tensor_stats_many`` batches (and stats-only tracing
#: copies to reduce at the flush); larger ones are reduced one at a time, in chunks
STATS_CHUNK = 1 << 17
#: elements per chunk of ``tensor_stats``'s norm and sum: widened into one float64 buffer
#: (2 MiB) reused by every chunk, where one widened copy of a whole large tensor is mapped fresh
#: and page-faulted on every call (4M bf16 values: 21 ms in one piece). Per 4M bf16 values,
#: measured: chunks of 2^16 3.2-3.3 ms, 2^17 2.8 ms, 2^18 2.5 ms, 2^19 2.3 ms.
REDUCTION_CHUNK = 1 << 18
#: float64 elements of one batched matrix of ``tensor_stats_many`` (8 MiB of scratch)
BATCH_ELEMENTS = 1 << 20


#: dtypes whose finiteness test and float64-accumulated reductions torch computes in place
NATIVE_STATS_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


#: dtypes whose every value float32 holds exactly: ``tensor_stats_many`` widens them to float64
#: through float32 (a matrix of 1M bf16 values directly: 8x slower on CPU) and sorts their
#: subsample in float32 (2.3x faster than in float64 with numpy), same values and order
_EXACT_IN_FLOAT32 = {torch.float32, torch.bfloat16, torch.float16, torch.bool, torch.int8, torch.uint8,
                     torch.int16, *(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2",
                                                                      "float8_e4m3fnuz", "float8_e5m2fnuz")
                                    if hasattr(torch, name))}


def _exact_float(t: torch.Tensor) -> torch.Tensor:
    """``t`` as float32 where that is exact (:data:`_EXACT_IN_FLOAT32`), else as float64."""
    return t.float() if t.dtype in _EXACT_IN_FLOAT32 else t.double()


def tensor_stats(t: torch.Tensor, quantiles: tuple[float, ...] = QUANTILES,
                 max_samples: int = MAX_STAT_SAMPLES, chunk: int = REDUCTION_CHUNK) -> dict[str, Any]:
    """Statistics of a tensor, JSON-safe (no NaN/Inf values in the result).

    ``norm`` (L2), ``absmax``, ``mean`` and the quantiles are taken over the finite
    elements only, in float64; ``nan_count`` and ``inf_count`` count the others
    (complex tensors: over real and imaginary parts). ``norm``, ``absmax`` and
    ``mean`` use all elements: the norm and the sum ``chunk`` elements at a time
    (:func:`_chunk_sums`; the chunk norms combined with the overflow-safe ``math.hypot``
    and the chunk sums with ``math.fsum``), the extremes in one pass over the tensor. A
    chunk whose norm and sum are both finite has no NaN/Inf (a NaN reaches both, an Inf
    the norm; the float64 norm of values up to the fp32 range cannot overflow), so the
    elementwise finiteness test (slower than the reductions together on CPU) runs only on
    a chunk where one of them is not finite. The
    quantiles (linear interpolation, numpy's default) use the finite values of an evenly
    strided subsample of at most ``max_samples`` elements (``quantile_samples`` says how
    many), so they are approximate on large tensors (they describe a tensor for a reader;
    no check uses them). Values are ``None`` when no element is finite.
    """
    x = _flat_real(t)
    chunks = torch.split(x, chunk) if x.numel() else ()
    sums = _chunk_sums(chunks)
    nan_count = inf_count = 0
    if all(map(math.isfinite, (v for row in sums for v in row))):
        norms, totals = [n for n, _ in sums], [s for _, s in sums]
        absmax = max(map(abs, _min_max(x))) if chunks else 0.0
    else:  # the finite elements of a chunk holding NaN/Inf; the extremes chunk by chunk
        norms, totals, absmax = [], [], 0.0
        for c, (n, total) in zip(chunks, sums):
            if math.isfinite(n) and math.isfinite(total):
                lo, hi = _min_max(c)
            else:
                c = _reducible(c)
                finite = torch.isfinite(c)
                n_nan = int(torch.isnan(c).sum())
                nan_count += n_nan
                inf_count += c.numel() - int(finite.sum()) - n_nan
                c = c[finite]
                if not c.numel():
                    continue
                n, total, lo, hi = torch.stack([torch.linalg.vector_norm(c, dtype=torch.float64),
                                                c.sum(dtype=torch.float64), c.min().double(),
                                                c.max().double()]).tolist()
            norms.append(n)
            totals.append(total)
            absmax = max(absmax, -lo, hi)
    return _stats_entry(x.numel(), nan_count, inf_count, _subsample(x, max_samples), quantiles,
                        math.hypot(*norms), absmax, math.fsum(totals))


def _flat_real(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached as a 1-D view; a complex tensor as its real and imaginary parts."""
    x = t.detach().reshape(-1)
    return torch.view_as_real(x).reshape(-1) if x.is_complex() else x


def _subsample(x: torch.Tensor, max_samples: int) -> torch.Tensor:
    """The evenly strided subsample of a 1-D ``x`` the quantiles use: stride ceil(numel / max_samples)
    (1 for an empty ``x``)."""
    return x[::max(1, -(-x.numel() // max_samples))]


def _stats_entry(numel: int, nan_count: int, inf_count: int, sample: torch.Tensor, quantiles: tuple[float, ...],
                 norm: float | None, absmax: float | None, total: float | None) -> dict[str, Any]:
    """A ``stats`` entry (:func:`tensor_stats`) from the counts of non-finite values, the strided
    subsample (:func:`_subsample`, any device and dtype) and the finite values' ``norm``,
    ``absmax`` and sum ``total`` (``None`` where not known: :class:`PendingStats`)."""
    finite_count = numel - nan_count - inf_count
    stats: dict[str, Any] = {"numel": int(numel), "finite_count": int(finite_count),
                             "nan_count": int(nan_count), "inf_count": int(inf_count)}
    if finite_count == 0:
        stats.update(norm=None, absmax=None, mean=None, quantiles=None, quantile_samples=0)
        return stats
    sample = sample.to("cpu", torch.float64)
    if finite_count < numel:
        sample = sample[torch.isfinite(sample)]
    stats.update(norm=norm if norm is not None and math.isfinite(norm) else None,  # float64 overflow of |x|^2
                 absmax=absmax, mean=None if total is None else total / finite_count,
                 quantiles=dict(zip((f"{q:g}" for q in quantiles), _quantiles(sample, quantiles))),
                 quantile_samples=int(sample.numel()))
    return stats


class PendingStats:
    """:func:`tensor_stats` of a tensor of a :data:`NATIVE_STATS_DTYPES` dtype, launched where it
    lives without a host sync; :meth:`resolve` waits for and reads them.

    Each statistic is one reduction over the whole tensor (the norm and the sum accumulated
    in float64, as ``tensor_stats`` does chunk by chunk, so they agree to float64 rounding;
    the extremes, NaN and Inf counts exact), plus a device copy of the same strided subsample
    of at most ``max_samples`` elements for the quantiles: the tensor itself is not kept.
    What the kernels read is the tensor at the time of the call (stream order), as a copy
    would. One difference, stated: a tensor holding NaN or Inf gets exact counts and the
    quantiles of its subsample's finite values, but ``norm``, ``absmax`` and ``mean`` are
    ``None`` (over the finite values alone they would take a masked pass more on every
    tensor; a NaN or an Inf is the finding).
    """

    __slots__ = ("numel", "_values", "_sample", "_quantiles", "_done")

    @staticmethod
    def takes(t: torch.Tensor) -> bool:
        """Whether ``t`` can be reduced this way: a non-empty tensor of a native dtype (complex
        ones by their real and imaginary parts)."""
        return (t.dtype.to_real() if t.is_complex() else t.dtype) in NATIVE_STATS_DTYPES and t.numel() > 0

    def __init__(self, t: torch.Tensor, quantiles: tuple[float, ...] = QUANTILES,
                 max_samples: int = MAX_STAT_SAMPLES) -> None:
        x = _flat_real(t)
        if not self.takes(x):
            raise ValueError(f"PendingStats takes a non-empty tensor of {NATIVE_STATS_DTYPES}, got {x.dtype} "
                             f"of {x.numel()} elements: use tensor_stats")
        self.numel = x.numel()
        self._quantiles = quantiles
        lo, hi = torch.aminmax(x)
        self._values = torch.stack([torch.linalg.vector_norm(x, dtype=torch.float64), x.sum(dtype=torch.float64),
                                    lo.double(), hi.double(), torch.isnan(x).sum().double(),
                                    torch.isinf(x).sum().double()])
        self._sample = _subsample(x, max_samples).clone()
        self._done: torch.Event | None = None  # marks the kernels done, on whatever stream they ran
        if x.device.type != "cpu":
            self._done = torch.Event(x.device)
            self._done.record()

    def resolve(self) -> dict[str, Any]:
        """The statistics, as :func:`tensor_stats` gives them (class doc for NaN/Inf). Waits for
        the reductions first: the caller may be another thread, on another stream."""
        if self._done is not None:
            self._done.synchronize()
        norm, total, lo, hi, n_nan, n_inf = self._values.tolist()
        finite = n_nan == n_inf == 0
        return _stats_entry(self.numel, int(n_nan), int(n_inf), self._sample, self._quantiles,
                            norm if finite else None, max(-lo, hi) if finite else None, total if finite else None)


def _reducible(c: torch.Tensor) -> torch.Tensor:
    """``c``, or its float64 copy for dtypes torch has no reduction kernels for (FP8, integers, bool)."""
    return c if c.dtype in NATIVE_STATS_DTYPES else c.to(torch.float64)


def _min_max(x: torch.Tensor) -> tuple[float, float]:
    """Smallest and largest element of a non-empty 1-D ``x``, as floats, in one pass (NaN if
    ``x`` holds one). Dtypes without reduction kernels are widened chunk by chunk, never whole
    (an FP8 tensor of a billion elements would need 8 GB as float64)."""
    if x.dtype in NATIVE_STATS_DTYPES:
        return tuple(torch.stack(torch.aminmax(x)).double().tolist())  # type: ignore[return-value]
    parts = torch.stack([torch.stack(torch.aminmax(c.to(torch.float64))) for c in torch.split(x, REDUCTION_CHUNK)])
    return parts[:, 0].min().item(), parts[:, 1].max().item()


def _chunk_sums(chunks: Sequence[torch.Tensor]) -> list[list[float]]:
    """``[norm, sum]`` of each chunk, in float64, read back with one ``tolist``.

    Each chunk is widened into one reused float64 buffer (a float64 chunk is read in place)
    and reduced by ``torch.dot`` and ``torch.sum`` writing into a preallocated result, so a
    chunk costs three kernels and no allocation (4M bf16 values, chunks of 2^18: 2.5 ms; the
    previous code, a fresh widened copy, its own min/max and a stack of results per chunk of
    2^17: 3.5-3.6 ms). A chunk
    with NaN/Inf yields a non-finite entry (a NaN reaches both, an Inf the norm; the float64
    norm of values up to the fp32 range cannot overflow).
    """
    if not chunks:
        return []
    out = torch.empty(len(chunks), 2, dtype=torch.float64, device=chunks[0].device)
    buf = None if chunks[0].dtype == torch.float64 else torch.empty(
        chunks[0].numel(), dtype=torch.float64, device=chunks[0].device)
    for i, c in enumerate(chunks):
        wide = c if buf is None else buf[:c.numel()].copy_(c)
        torch.dot(wide, wide, out=out[i, 0])
        torch.sum(wide, 0, out=out[i, 1])
    out[:, 0].sqrt_()
    return out.tolist()


def _quantiles(sample: torch.Tensor, quantiles: tuple[float, ...]) -> list[float | None]:
    """Quantiles of a 1-D float64 sample by linear interpolation between order statistics
    (numpy's default, as ``torch.quantile``), from one sort: ``np.quantile`` costs 2.5x this
    on 1024 elements and ``torch.quantile`` more, in per-call overhead."""
    n = sample.numel()
    if n == 0:
        return [None] * len(quantiles)
    v = np.sort(sample.numpy())  # a few times faster than torch.sort on 1e3 elements
    out = []
    for q in quantiles:
        pos = q * (n - 1)
        i = min(int(pos), n - 1)
        lo, hi = float(v[i]), float(v[min(i + 1, n - 1)])
        out.append(lo + (hi - lo) * (pos - i))
    return out


def tensor_stats_many(tensors: Sequence[torch.Tensor], quantiles: tuple[float, ...] = QUANTILES,
                      max_samples: int = MAX_STAT_SAMPLES) -> list[dict[str, Any]]:
    """``[tensor_stats(t) for t in tensors]``, with a constant number of torch calls per
    distinct size instead of ~10 per tensor.

    Real tensors smaller than :data:`STATS_CHUNK` elements are grouped by (device, dtype,
    number of elements), and each group, in matrices of at most :data:`BATCH_ELEMENTS` float64 values,
    is reduced row by row: a row's ``norm`` is ``sqrt(sum x^2)`` and its ``mean``
    ``sum x / n``, each one float64 sum over the row (``tensor_stats`` takes a dot product
    and a sum over the same float64 values: the results agree to float64 rounding, a few
    units in the last place); ``absmax`` and the quantiles are identical (the same strided
    subsample, sorted, the same interpolation). A row whose norm, sum, minimum or maximum is
    not finite (NaN/Inf, or float64 overflow of ``x^2``), and every larger, empty or complex
    tensor, takes ``tensor_stats``. Results are in the order of ``tensors``.
    """
    out: list[dict[str, Any] | None] = [None] * len(tensors)
    groups: dict[tuple[torch.device, torch.dtype, int], list[int]] = {}
    for i, t in enumerate(tensors):
        n = t.numel()
        if 0 < n < STATS_CHUNK and not t.is_complex():
            groups.setdefault((t.device, t.dtype, n), []).append(i)
        else:
            out[i] = tensor_stats(t, quantiles, max_samples)
    for (_, _, n), members in groups.items():
        rows = max(1, BATCH_ELEMENTS // n)
        for at in range(0, len(members), rows):
            part = members[at:at + rows]
            for i, s in zip(part, _rows_stats([tensors[i] for i in part], quantiles, max_samples)):
                out[i] = s if s is not None else tensor_stats(tensors[i], quantiles, max_samples)
    return out  # type: ignore[return-value]


def _sorted_rows(sample: torch.Tensor) -> torch.Tensor:
    """Each row of ``sample`` sorted ascending: numpy's sort on CPU (4-9x faster than
    ``torch.sort`` on a few hundred rows of 1024), torch's elsewhere."""
    if sample.device.type == "cpu":
        return torch.from_numpy(np.sort(sample.numpy(), axis=1))
    return sample.sort(dim=1).values


def _rows_stats(tensors: list[torch.Tensor], quantiles: tuple[float, ...],
                max_samples: int) -> list[dict[str, Any] | None]:
    """Statistics of real tensors of one dtype and size from one float64 matrix, a row each; ``None``
    for a row whose reductions are not all finite (the caller takes ``tensor_stats``)."""
    n = tensors[0].numel()
    with torch.no_grad():
        narrow = _exact_float(torch.stack([t.detach().reshape(-1) for t in tensors]))
        m = narrow.double()
        red = torch.stack([torch.linalg.vector_norm(m, dim=1), m.sum(dim=1), narrow.amin(dim=1).double(),
                           narrow.amax(dim=1).double()], dim=1).tolist()  # aminmax(dim=1): 20x slower
        stride = -(-n // max_samples)  # ceil(n / max_samples), tensor_stats's subsample
        k = -(-n // stride)
        v = _sorted_rows(narrow[:, ::stride])
        pos = [q * (k - 1) for q in quantiles]
        at = [min(int(p), k - 1) for p in pos]
        a, b = v[:, at].double(), v[:, [min(j + 1, k - 1) for j in at]].double()
        w = torch.tensor([p - j for p, j in zip(pos, at)], dtype=torch.float64, device=a.device)
        qs = (a + (b - a) * w).tolist()
    names = [f"{q:g}" for q in quantiles]
    out: list[dict[str, Any] | None] = []
    for (norm, total, low, high), qrow in zip(red, qs):
        if not all(map(math.isfinite, (norm, total, low, high))):
            out.append(None)
            continue
        out.append({"numel": n, "finite_count": n, "nan_count": 0, "inf_count": 0,
                    "norm": norm, "absmax": max(-low, high), "mean": total / n,
                    "quantiles": dict(zip(names, qrow)), "quantile_samples": k})
    return out
