r"""Rigorous perturbation bound of the softmax (used by the attention bound and by
:mod:`ttrace_num.propagate.jacobian`).

For ``p = softmax(x)`` and a perturbation ``|d_j| <= v_j``::

    p_i(x + d) / p_i(x) = e^{d_i} / sum_j p_j e^{d_j}

and, by Jensen, ``sum_j p_j e^{d_j} >= e^{sum_j p_j d_j} >= e^{-p.v}``, while
``sum_j p_j e^{d_j} <= sum_j p_j e^{v_j}``; hence (exact, not first order)::

    |p_i(x + d) - p_i(x)| <= p_i max(e^{v_i + p.v} - 1, 1 - e^{-v_i} / sum_j p_j e^{v_j}).

Source: the standard softmax identity; Higham (2002) §1.7 (perturbation of a function).
"""
from __future__ import annotations

import torch

__all__ = ["softmax_perturbation"]


def softmax_perturbation(p: torch.Tensor, v: torch.Tensor, dim: int) -> torch.Tensor:
    """Elementwise bound on ``|softmax(x + d) - softmax(x)|`` for ``|d| <= v`` (module docstring).

    Args:
        p: ``softmax(x)`` (or an elementwise upper bound on it), any float dtype.
        v: non-negative perturbation bounds, broadcastable to ``p`` (float64).
        dim: the softmax dimension.

    Entries with ``p = 0`` (masked keys) get 0.
    """
    p64 = p.double()
    pv = (p64 * v).sum(dim, keepdim=True)
    pev = (p64 * torch.expm1(v)).sum(dim, keepdim=True) + 1.0  # sum_j p_j e^{v_j}
    up = torch.expm1(v + pv)
    down = 1.0 - torch.exp(-v) / pev
    out = p64 * torch.maximum(up, down)
    return torch.nan_to_num(out, nan=0.0)  # masked entries (p = 0, v finite) stay 0
