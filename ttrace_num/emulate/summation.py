r"""Emulation of a :class:`~ttrace_num.bounds.summation.Summation` model, rounding every
intermediate result to its stated format.

This is the ground truth for the *computation model* of the summation, dot-product,
matmul and reduction bounds: an emulated computation is one of the computations the
bound claims to cover, so a deterministic bound must never be violated by it, and the
emulator lets the tests explore models no CPU kernel implements (bf16 or fp16
accumulation, split-K with bf16 partials, pairwise or blocked orders, FP8 storage).

What is emulated (``n`` terms per output, all outputs vectorised):

1. every term is converted to the accumulation format ``summation.accum``
   (for a dot product the terms are the products ``a_ik b_kj``, exact in float64 for
   every input format up to fp32, so this is the single correct rounding of each
   product, i.e. the "products rounded to accum when not exact" of the bound; a
   fused multiply-add, which does not round the product, is the special case
   ``delta = 0`` of the same model);
2. the terms are split into ``split`` contiguous parts of ``ceil(n / split)`` terms (the
   last part may be shorter), and each part is summed in ``accum`` by

   * ``recursive``: a left-to-right chain ``((t_1 + t_2) + t_3) + ...``;
   * ``pairwise``: level by level, ``(t_1 + t_2), (t_3 + t_4), ...``, an odd last term
     carried to the next level (height ``ceil(log2 n)``);
   * ``blocked``: a chain inside each block of ``block`` terms, then a chain over the
     block sums;

3. when ``split > 1``, the partial sums are rounded to ``reduce_fmt`` (when it differs
   from ``accum``) and reduced in ``reduce_fmt`` by a chain in part order (``recursive``:
   a sequential or ring all-reduce as seen by one element) or pairwise (a tree);
4. the result is rounded to ``out_fmt``.

With ``summation.ftz`` every rounded product, partial sum, conversion and the result whose
magnitude lies below the normal range of its format is replaced by zero (flush to zero, as
AVX512-BF16 ``vdpbf16ps`` or a GPU tensor core may do), and :func:`emulate_matmul` reads
inputs below the normal range of their dtype as zero (DAZ).

A matmul's bias (``F.linear``) is the ``K+1``-th term of each output's sum, as in the
bound (:func:`ttrace_num.bounds.matmul.matmul`).

Zero padding (parts or blocks of unequal length) adds ``+0`` to a value already on the
format's grid, which is exact, so it does not change the computation.

Arithmetic: a rounded addition ``fl_f(a + b)`` of two numbers of format ``f`` is
computed natively when ``f`` is fp64 or fp32 (IEEE 754 correctly rounded addition on
the CPU, gradual underflow, overflow to Inf), or bf16/fp16 (torch adds in fp32 and
rounds once to the 16-bit format; the fp32 rounding is innocuous because
``24 >= 2p + 2`` for ``p = 8, 11``: Figueroa, "When is double rounding innocuous?",
SIGNUM 1995), and otherwise by :func:`~ttrace_num.rounding.round_to` of the float64 sum
(again innocuous double rounding when ``p <= 25``). Conversions between formats and the
rounding of the products use :func:`~ttrace_num.rounding.round_to`, except to fp32 and
fp64 where the float64 -> float32 cast is itself the single IEEE rounding. The tests
check the native paths against ``round_to`` bit for bit.
"""
from __future__ import annotations

import math

import torch

from ..bounds.summation import Summation
from ..formats import FloatFormat, get_format
from ..rounding import round_to

__all__ = ["emulate_sum", "emulate_mean", "emulate_matmul", "emulate_terms"]

_NATIVE = ("fp64", "fp32", "bf16", "fp16")

#: largest number of float64 products materialised at once by :func:`emulate_matmul`
_MAX_TERMS = 1 << 24


def _native_dtype(fmt: FloatFormat) -> torch.dtype | None:
    return fmt.torch_dtype if fmt.name in _NATIVE else None


def _check_emulable(fmt: FloatFormat) -> None:
    if _native_dtype(fmt) is None and fmt.precision > 25:
        raise ValueError(f"cannot emulate additions in {fmt}: the float64 sum followed by round_to is "
                         "a correct rounding only for precisions <= 25 bits")


def _flush(x: torch.Tensor, fmt: FloatFormat, ftz: bool) -> torch.Tensor:
    """``x`` with the values below ``fmt``'s normal range replaced by zero when ``ftz``."""
    return x.masked_fill(x.abs() < fmt.min_normal, 0.0) if ftz else x


def _convert(x: torch.Tensor, fmt: FloatFormat, ftz: bool = False) -> torch.Tensor:
    """``x`` rounded once to ``fmt``, held in ``fmt``'s torch dtype when it has a native one,
    else in float64. To fp32/fp64 the cast itself is the single IEEE rounding; to the other
    formats ``round_to`` rounds (torch would cast float64 to bf16/fp16 through fp32, twice)."""
    dt = _native_dtype(fmt)
    if fmt.name in ("fp64", "fp32"):
        return _flush(x.to(dt), fmt, ftz)
    r = _flush(round_to(x.to(torch.float64), fmt), fmt, ftz)
    return r if dt is None else r.to(dt)


def _add(a: torch.Tensor, b: torch.Tensor, fmt: FloatFormat, ftz: bool = False) -> torch.Tensor:
    """``fl_fmt(a + b)`` for ``a``, ``b`` on ``fmt``'s grid (see the module docstring)."""
    if _native_dtype(fmt) is not None:
        return _flush(a + b, fmt, ftz)
    return _flush(round_to(a + b, fmt), fmt, ftz)


def _chain(t: torch.Tensor, fmt: FloatFormat, ftz: bool = False) -> torch.Tensor:
    """Left-to-right chain over the last dim."""
    ts = t.movedim(-1, 0).contiguous()
    acc = ts[0]
    for i in range(1, ts.shape[0]):
        acc = _add(acc, ts[i], fmt, ftz)
    return acc


def _pairwise(t: torch.Tensor, fmt: FloatFormat, ftz: bool = False) -> torch.Tensor:
    while t.shape[-1] > 1:
        m = t.shape[-1]
        h = m // 2
        s = _add(t[..., 0:2 * h:2], t[..., 1:2 * h:2], fmt, ftz)
        t = torch.cat([s, t[..., 2 * h:]], dim=-1) if m % 2 else s
    return t[..., 0]


def _pad_to(t: torch.Tensor, length: int) -> torch.Tensor:
    extra = length - t.shape[-1]
    if extra == 0:
        return t
    return torch.cat([t, t.new_zeros(*t.shape[:-1], extra)], dim=-1)


def _tree(t: torch.Tensor, fmt: FloatFormat, algorithm: str, block: int, ftz: bool = False) -> torch.Tensor:
    """Sum over the last dim of ``t`` (values on ``fmt``'s grid) with one algorithm."""
    if algorithm == "recursive":
        return _chain(t, fmt, ftz)
    if algorithm == "pairwise":
        return _pairwise(t, fmt, ftz)
    if algorithm == "blocked":
        n = t.shape[-1]
        b = max(1, min(block, n))
        nb = math.ceil(n / b)
        blocks = _pad_to(t, nb * b).reshape(*t.shape[:-1], nb, b)
        return _chain(_chain(blocks, fmt, ftz), fmt, ftz)
    raise ValueError(f"unknown summation algorithm {algorithm!r}")


def emulate_terms(terms: torch.Tensor, summation: Summation, out_fmt: "FloatFormat | str") -> torch.Tensor:
    """Sum the exact ``terms`` over their last dim as ``summation`` states, then round to
    ``out_fmt``. ``terms`` are float64 (exact values: inputs, or products exact in float64).

    Returns float64 values on ``out_fmt``'s grid, shape ``terms.shape[:-1]``.
    """
    out_fmt = get_format(out_fmt)
    s = summation
    rf = s.reduce_fmt or s.accum
    for f in (s.accum, rf):
        _check_emulable(f)
    n = terms.shape[-1]
    if n == 0:
        return round_to(terms.new_zeros(terms.shape[:-1], dtype=torch.float64), out_fmt)
    t = _convert(terms, s.accum, s.ftz)
    if s.split > 1:
        ps = s.part_size(n)
        parts = math.ceil(n / ps)
        t = _pad_to(t, parts * ps).reshape(*t.shape[:-1], parts, ps)
        partial = _tree(t, s.accum, s.algorithm, s.block, s.ftz)
        r = _tree(_convert(partial, rf, s.ftz), rf, s.reduce_algorithm, s.block, s.ftz)
    else:
        r = _tree(t, s.accum, s.algorithm, s.block, s.ftz)
    return _flush(round_to(r.to(torch.float64), out_fmt), out_fmt, s.ftz)


def emulate_sum(x: torch.Tensor, dim: int, summation: Summation, out_fmt: "FloatFormat | str") -> torch.Tensor:
    """``x.sum(dim)`` computed as ``summation`` states (terms in order of increasing index
    along ``dim``), rounded to ``out_fmt``; float64 result."""
    return emulate_terms(x.detach().to(torch.float64).movedim(dim, -1), summation, out_fmt)


def emulate_mean(x: torch.Tensor, dim: int, summation: Summation, out_fmt: "FloatFormat | str") -> torch.Tensor:
    """``x.mean(dim)`` as ``fl_out(fl_c(sum / n))``: the sum as :func:`emulate_sum` computes
    it (left in its final format ``c = summation.final_fmt``), divided by ``n`` with one
    rounding in ``c`` (what torch does on CPU: fp32 sum and division for bf16/fp16 inputs),
    then rounded to ``out_fmt``."""
    n = x.shape[dim]
    c = summation.final_fmt
    s = emulate_terms(x.detach().to(torch.float64).movedim(dim, -1), summation, c)
    dt = _native_dtype(c)
    q = (s.to(dt) / n).to(torch.float64) if dt is not None else round_to(s / n, c)
    return round_to(q, out_fmt)


def emulate_matmul(a: torch.Tensor, b: torch.Tensor, summation: Summation, out_fmt: "FloatFormat | str",
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b (+ bias)`` (``torch.matmul`` broadcasting of batch dims, ``a`` and ``b`` at
    least 2-D) with every output's ``K`` products (and the bias as term ``K+1``) summed as
    ``summation`` states, rounded to ``out_fmt``; float64 result.

    The inputs' values are taken as they are (round them to a storage format first, e.g.
    ``round_to(x, "e4m3")``, to emulate that storage). Products are formed exactly in
    float64 (exact for inputs up to fp32) and materialised for at most ``2**24`` outputs x
    terms at a time (rows of the output are processed in chunks).
    """
    if a.dim() < 2 or b.dim() < 2:
        raise ValueError("emulate_matmul needs inputs with at least 2 dims")
    a64, b64 = (_flush(t.detach().to(torch.float64), get_format(t.dtype), summation.ftz) for t in (a, b))
    batch = torch.broadcast_shapes(a64.shape[:-2], b64.shape[:-2])
    m, k = a64.shape[-2:]
    n_out = b64.shape[-1]
    a64 = a64.expand(*batch, m, k)
    bt = b64.expand(*batch, k, n_out).transpose(-1, -2)  # (..., N, K)
    bias64 = None if bias is None else \
        _flush(bias.detach().to(torch.float64), get_format(bias.dtype), summation.ftz).expand(*batch, m, n_out)
    rows = max(1, _MAX_TERMS // max(1, math.prod(batch) * n_out * (k + 1)))
    out = []
    for r0 in range(0, m, rows):
        terms = a64[..., r0:r0 + rows, None, :] * bt[..., None, :, :]  # (..., rows, N, K)
        if bias64 is not None:
            terms = torch.cat([terms, bias64[..., r0:r0 + rows, :, None]], dim=-1)
        out.append(emulate_terms(terms, summation, out_fmt))
    return torch.cat(out, dim=-2)
