r"""A discrete decision of the optimizer: Adam's first update is the sign of the gradient.

Adam's update of element ``i`` is ``lr * m_i / (sqrt(v_i) + eps)``; at a parameter's first step
``m = (1 - beta1) g`` and ``v = (1 - beta2) g^2``, bias-corrected to ``g`` and ``g^2``, so the update
is ``lr * g_i / (|g_i| + eps)``: ``lr * sign(g_i)`` wherever ``|g_i| >> eps``. A gradient element
that is a near-cancelling sum (a norm weight's gradient over many tokens, ``|g_i|`` a few
roundings of its terms) can change sign between two *correct* runs, and its parameter then moves
by ``2 lr`` the other way: a discrete change, like a flipped top-k choice
(:mod:`tracer.compare.decisions`), that no round-off threshold describes unless the noise samples
happen to flip the same element. Measured on the torchtitan-style harness (FSDP2 x TP with
sequence parallelism, bf16, ``layers.1.attention_norm.weight`` element 11): the reference's
gradient -3.7e-6, a sum of four microbatch gradients of 1.6e-5 .. 2.1e-4; the candidate's
+1.2e-7; the parameter moved by 2.9e-3 = 1.92 lr, 5.6-39x its threshold, while the gradient
tensor was at 0.17x; 2 of 8 noise samples flipped that element, 0 of the 4 the reference had.

What the checker does (:func:`tracer.compare.check.compare`): a ``param`` or ``main_param`` record
over its threshold is compared again with the elements whose gradient (the ``grad`` record of the
same name and step, in both traces) has a different sign in the candidate than in the reference
taken from the reference; if it is then within its threshold it is ``ok`` with a note saying how
many elements were left out and the largest reference ``|g|`` among them. The gradients themselves
are compared as usual (a gradient bug is reported there, earlier in the step), so what is left out
is the sign decision of elements whose gradient is within round-off of zero: a wrong update of
*other* elements, or of many elements, still shows.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from tracer.compare.judge import TensorCheck
from tracer.trace.schema import Phase, Status

__all__ = ["UPDATE_PHASES", "flipped_signs", "without_sign_flips"]

#: records taken after an optimizer update (their elements follow the gradient's sign at Adam's first step)
UPDATE_PHASES = (Phase.PARAM, Phase.MAIN_PARAM)


def flipped_signs(ref_grad: torch.Tensor, cand_grad: torch.Tensor) -> torch.Tensor:
    """Elements whose gradient sign (-1, 0, +1) differs between the reference and the candidate."""
    return torch.sign(ref_grad.double()) != torch.sign(cand_grad.double())


def without_sign_flips(row: TensorCheck, ref_t: torch.Tensor, cand_t: torch.Tensor,
                       grads: Callable[[], tuple[torch.Tensor, torch.Tensor] | None],
                       judge: Callable[[torch.Tensor], TensorCheck]) -> TensorCheck:
    """``row`` (an update-phase record over its threshold) judged again by ``judge`` on the
    candidate with the elements of flipped gradient sign taken from the reference; ``grads()`` gives
    the (reference, candidate) gradients of the same name and step, or None when not traced."""
    if row.status != Status.OVER or row.phase not in UPDATE_PHASES:
        return row
    g = grads()
    if g is None or g[0].shape != ref_t.shape or g[1].shape != ref_t.shape or cand_t.shape != ref_t.shape:
        return row
    flips = flipped_signs(*g)
    n = int(flips.sum())
    if n == 0 or n == flips.numel():
        return row
    again = judge(torch.where(flips, ref_t, cand_t))
    largest = float(g[0].double()[flips].abs().max())
    note = (f"{n} element(s) whose gradient changed sign between the runs (reference |g| <= {largest:.3g}) left "
            "out: Adam's first update is the gradient's sign (tracer.compare.sign_flips)")
    if again.status == Status.OK:
        again.note = "; ".join(x for x in (again.note, note) if x)
        return again
    row.note = "; ".join(x for x in (row.note, f"{note}, still over ({again.ratio:.3g}x) without them") if x)
    return row
