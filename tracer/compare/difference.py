"""The norms of a candidate's difference from the reference, one cache-sized chunk at a time.

:func:`difference_norms` gives what :func:`tracer.compare.check.compare` reports for every tensor,
``||cand - ref||_2``, ``||ref||_2`` and ``max |cand - ref|``, in the working dtype
(:func:`tracer.compare.deviation.work_dtype`). Whole-tensor arithmetic converts both tensors, forms the
difference and reduces it, each step through a fresh tensor as large as the traced one, which
the allocator maps anew and the kernel page-faults in on every call. Chunks of ``CHUNK``
elements (512 KiB of float32) stay in the core's cache and reuse the same few allocations.

The chunks' norms are combined in float64 (``sqrt(sum_k n_k^2)``); each chunk's reduction is
torch's own, so the values differ from the whole-tensor ones by the rounding of the float32
sums only (relative ~1e-7, far below any threshold's meaning).
"""
from __future__ import annotations


import torch

__all__ = ["CHUNK", "chunk_norms", "combine_chunk_norms", "difference_norms"]

#: elements per chunk
CHUNK = 1 << 17


def difference_norms(ref: torch.Tensor, cand: torch.Tensor, work: torch.dtype, chunk: int = CHUNK
                     ) -> tuple[float, float, float] | None:
    """``(||cand - ref||_2, ||ref||_2, max |cand - ref|)`` computed in ``work``, or ``None``
    when one of them is not finite (a NaN or Inf in either tensor, or an overflow of ``work``):
    the caller then takes the elementwise path that locates them. Same shapes required."""
    r, c = ref.detach().reshape(-1), cand.detach().reshape(-1)
    if r.numel() != c.numel():
        raise ValueError(f"difference_norms: {r.numel()} reference elements vs {c.numel()} candidate elements")
    rows = []
    for start in range(0, r.numel(), chunk):
        rk = r[start:start + chunk].to(work)
        rows.append(chunk_norms(torch.linalg.vector_norm(rk), torch.sub(c[start:start + chunk].to(work), rk)))
    return combine_chunk_norms(rows)


def chunk_norms(ref_norm: torch.Tensor, diff_chunk: torch.Tensor) -> torch.Tensor:
    """``[||d||, ||r||, -min d, max d]`` of one chunk from the difference and the reference's
    norm over the chunk, in their dtype (for :func:`combine_chunk_norms`)."""
    lo, hi = torch.aminmax(diff_chunk)
    return torch.stack([torch.linalg.vector_norm(diff_chunk), ref_norm, -lo, hi])


def combine_chunk_norms(rows: list[torch.Tensor]) -> tuple[float, float, float] | None:
    """``(||cand - ref||, ||ref||, max |cand - ref|)`` from the chunks' :func:`chunk_norms`,
    combined in float64; ``None`` when any is not finite (see :func:`difference_norms`)."""
    if not rows:
        return 0.0, 0.0, 0.0
    stats = torch.stack(rows).double()
    if not bool(torch.isfinite(stats).all()):
        return None
    error, ref_norm = stats[:, :2].square().sum(0).sqrt().tolist()
    return error, ref_norm, max(float(stats[:, 2:].max()), 0.0)
