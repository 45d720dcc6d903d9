"""``assert_close`` for kernel tests, with a derived bound instead of a guessed tolerance.

Example::

    import torch, ttrace_num as tn
    from ttrace_num.testing import assert_close
    a = torch.randn(128, 512, dtype=torch.bfloat16); b = torch.randn(512, 64, dtype=torch.bfloat16)
    expected = a.double() @ b.double()                 # (near-)exact reference
    assert_close(my_kernel(a, b), expected, bound=tn.tolerance("matmul", a, b))
"""
from __future__ import annotations

import torch

from .bounds.base import Bound

__all__ = ["assert_close", "BoundViolation"]


class BoundViolation(AssertionError):
    """Raised by :func:`assert_close`; ``.mask`` marks the violating elements."""

    def __init__(self, message: str, mask: torch.Tensor) -> None:
        super().__init__(message)
        self.mask = mask


def _index(flat: int, shape: torch.Size) -> tuple[int, ...]:
    idx = []
    for s in reversed(shape):
        idx.append(flat % s)
        flat //= s
    return tuple(reversed(idx))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, bound: Bound | torch.Tensor | float,
                 msg: str | None = None, equal_nan: bool = True, show: int = 5) -> None:
    """Assert ``|actual - expected| <= bound`` elementwise.

    Args:
        actual: the computed tensor (any float dtype).
        expected: the exact (or reference) result; broadcastable to ``actual``.
        bound: a :class:`~ttrace_num.Bound` (from :func:`ttrace_num.tolerance`, or a
            :class:`~ttrace_num.propagate.LayerBound` from ``layer_tolerance`` for a whole
            module's output), or an elementwise tensor/scalar bound.
        msg: prefix of the failure message.
        equal_nan: NaN in both at the same place counts as equal.
        show: how many of the worst elements to list.

    On failure raises :class:`BoundViolation` (an ``AssertionError``) that says how many
    elements fail, and for the worst ones (largest ``err/bound``) the index, the actual
    and expected values, the error, the bound there and how far over it is, plus the
    bound's formula.
    """
    if actual.shape != torch.broadcast_shapes(actual.shape, expected.shape):
        raise ValueError(f"shape mismatch: actual {tuple(actual.shape)} vs expected {tuple(expected.shape)}")
    b = bound.abs if isinstance(bound, Bound) else torch.as_tensor(bound, dtype=torch.float64)
    a64 = actual.detach().to(torch.float64)
    e64 = torch.broadcast_to(expected.detach().to(torch.float64), a64.shape)
    b64 = torch.broadcast_to(b, a64.shape)
    err = (a64 - e64).abs()
    nan_a, nan_e = torch.isnan(a64), torch.isnan(e64)
    same_nan = nan_a & nan_e if equal_nan else torch.zeros_like(nan_a)
    same_inf = torch.isinf(a64) & (a64 == e64)
    err = torch.where(same_nan | same_inf, torch.zeros_like(err), err)
    bad = (err > b64) | ((nan_a | nan_e) & ~same_nan)
    nbad = int(bad.sum())
    if nbad == 0:
        return
    with torch.no_grad():
        ratio = torch.where(bad, err / b64, torch.zeros_like(err))
        ratio = torch.where(torch.isnan(ratio) | (bad & torch.isnan(err)), torch.full_like(ratio, float("inf")), ratio)
        worst = torch.topk(ratio.flatten(), min(show, nbad)).indices.tolist()
    lines = [f"{msg + ': ' if msg else ''}{nbad} of {a64.numel()} elements ({100.0 * nbad / max(1, a64.numel()):.3g}%) "
             f"exceed the bound" + (f" ({bound.mode}, {bound.explanation.op})" if isinstance(bound, Bound) else "")]
    for flat in worst:
        i = _index(flat, a64.shape)
        a_, e_, er, bb = float(a64.flatten()[flat]), float(e64.flatten()[flat]), float(err.flatten()[flat]), float(b64.flatten()[flat])
        over = er / bb if bb > 0 else float("inf")
        lines.append(f"  at index {i}: actual {a_:.9g}, expected {e_:.9g}, |diff| {er:.3g} > bound {bb:.3g} ({over:.3g}x the bound)")
    if isinstance(bound, Bound):
        lines.append("bound: " + bound.explanation.formula)
    raise BoundViolation("\n".join(lines), bad)
