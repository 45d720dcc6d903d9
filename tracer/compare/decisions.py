r"""Discrete decisions in a traced comparison: top-k routing.

An MoE router scores every token against every expert and keeps the ``k`` best
(``idx = topk(scores, k)``). The choice is a step function of the scores: where the
reference's ``k``-th and ``(k+1)``-th scores of a token are closer than the legitimate
difference between two runs, a *correct* candidate may pick the other expert. From then
on that token's values are those of a different computation, not a rounding of the
reference's, and no round-off threshold covers them. The most visible case is the
gradient of the scores themselves: ``d loss / d scores[t]`` of a token is non-zero on
exactly its chosen experts, so a changed choice moves whole entries of that row (measured
on the plain-PyTorch MoE harness: a top-2 change at a score gap of 0.005 moved the row by
3e-3, 30x more than any other row moved, and put the tensor at 1.13x its threshold).

What the checker does (:func:`tracer.compare.check.compare`), for a module whose records carry the
meta :func:`topk_meta` (``{"topk": {"k": k, "dim": d}}``, set by the tracer's
``module_meta``):

1. its forward output (the scores) is checked like any tensor. If it is within its
   threshold, the tokens whose top-k *set* differs from the reference's
   (:func:`changed_choices`) in the candidate or in any noise sample are *changed
   choices*: a difference within the threshold flipped them, so the flip is legitimate.
   (A flip needs the reference's gap to be at most the two scores' difference, so these are
   near-ties by construction.) The scores' row notes how many, and their gaps.
2. its output gradient is compared on the other tokens only: the changed tokens' slices
   are zeroed in the reference, the candidate and every noise sample alike
   (:func:`without_choices`), so the error and the threshold are both measured on tokens
   whose choice agrees everywhere.

3. tensors that *consume* the choice inside the same module (meta :func:`topk_consumer_meta`,
   e.g. the MoE layer's output and its load-balancing loss) are compared the same way: rows
   of the changed tokens left out when the tensor has one row per token; a tensor without
   token rows (the auxiliary loss, a scalar that counts assignments per expert) cannot leave a
   token out, so when the *candidate's* choice changed in that microbatch it is reported
   ``unchecked`` (a discrete jump, not round-off) instead of compared; changes in the noise
   samples alone only widen its threshold.

A wrong top-k selection (a bug in the choice itself, not in the scores) is still caught:
the changed choices are computed here from the recorded scores, so a candidate that routes
differently from what its scores imply keeps those tokens in the gradient's comparison.
Scores over their threshold mask nothing: the scores are then the divergence reported.

4. the tensors further *downstream* of a changed choice (the residual stream and the next
   layers of that microbatch, through attention every token a little, and its backward) move
   by about the chosen experts' weight times the difference of their outputs. The noise
   thresholds cover that only where the samples make such a change themselves. When the
   candidate changed the choice of a token that no sample changed (:attr:`ChoiceChange.unsampled`),
   a forward, backward or loss tensor of the same step and microbatch that comes after the
   scores and is over its threshold is reported ``unchecked``, with the ratio and the reason,
   instead of ``over``: a legitimate discrete change that the thresholds do not describe, not
   round-off. Seen in the detection matrix: one MoE reference (bf16, seed 0) whose 4 samples
   did not flip a near-tie that every MoE candidate flipped at step 2, microbatch 2, put the
   layer's residual output and the next layer's forward at 1.05-1.8x their thresholds; another
   reference of the same model, whose sample did flip a token there, had the same tensors at
   0.05x. Tensors within their thresholds stay ``ok``, the scores and their consumers are
   compared as in 1-3, the parameter gradients (sums over all microbatches) and every later
   step are compared as usual, so a bug still shows in the other microbatches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TOPK_CONSUMER_META", "TOPK_META", "ChoiceChange", "changed_choices", "choice_changes", "gap_at",
           "topk_consumer_meta", "topk_meta", "without_choices"]

#: meta key of a record whose module's output scores a top-k choice
TOPK_META = "topk"
#: meta key of a record that depends on the top-k choice of a submodule (its name relative to the record's module)
TOPK_CONSUMER_META = "topk_of"


@dataclass(frozen=True)
class ChoiceChange:
    """The tokens whose choice differs at one call of a scores module (:func:`choice_changes`)."""

    left_out: torch.Tensor   # changed in the candidate or in any noise sample (token mask, dim kept)
    in_candidate: int        # how many changed in the candidate
    note: str
    unsampled: int = 0       # how many changed in the candidate and in no noise sample


def topk_meta(k: int, dim: int = -1) -> dict[str, Any]:
    """Meta for a module whose output scores a top-``k`` choice along ``dim`` (e.g. an MoE
    router's gate linear: ``{"*.router.linear": topk_meta(2)}`` as the tracer's ``module_meta``)."""
    if int(k) < 1:
        raise ValueError(f"top-k needs k >= 1, got {k}")
    return {TOPK_META: {"k": int(k), "dim": int(dim)}}


def topk_consumer_meta(scores_module: str) -> dict[str, Any]:
    """Meta for a module whose outputs depend on the top-k choice scored by its submodule
    ``scores_module`` (relative name), e.g. an MoE layer: ``{"*.moe":
    topk_consumer_meta("router.linear")}`` (step 3 of the module docstring)."""
    return {TOPK_CONSUMER_META: str(scores_module)}


def _chosen(scores: torch.Tensor, k: int, dim: int) -> torch.Tensor:
    """Indices of the ``k`` largest scores along ``dim``, sorted (the chosen *set*)."""
    return torch.topk(scores.double(), k, dim=dim).indices.sort(dim=dim).values


def changed_choices(ref: torch.Tensor, other: torch.Tensor, k: int, dim: int = -1) -> torch.Tensor:
    """Boolean mask over the tokens (every dim but ``dim``, kept with size 1) that is True
    where the top-``k`` set of ``other`` differs from that of ``ref``."""
    if ref.shape != other.shape:
        raise ValueError(f"scores of shape {list(other.shape)} vs {list(ref.shape)} in the reference")
    if not 1 <= k <= ref.shape[dim]:
        raise ValueError(f"top-{k} over a dim of size {ref.shape[dim]}")
    return (_chosen(ref, k, dim) != _chosen(other, k, dim)).any(dim=dim, keepdim=True)


def gap_at(ref: torch.Tensor, changed: torch.Tensor, k: int, dim: int = -1) -> list[float]:
    """The reference's gap between its ``k``-th and ``(k+1)``-th score at each changed token
    (how near the tie was), in token order; empty when ``k`` is the whole dim."""
    if k >= ref.shape[dim]:
        return []
    top = torch.topk(ref.double(), k + 1, dim=dim).values
    gap = top.narrow(dim, k - 1, 1) - top.narrow(dim, k, 1)
    return [float(g) for g in gap[changed]]


def without_choices(t: torch.Tensor, changed: torch.Tensor) -> torch.Tensor:
    """``t`` with the slices of the changed tokens zeroed (a copy); ``changed`` as returned by
    :func:`changed_choices` for scores of ``t``'s shape."""
    return t.masked_fill(changed.expand_as(t), 0)


def choice_changes(ref: torch.Tensor, cand: torch.Tensor, noisy: list[torch.Tensor], k: int, dim: int = -1
                   ) -> ChoiceChange:
    """The tokens whose top-``k`` choice differs from the reference's in the candidate or in
    any noise sample (step 1 of the module docstring), with a note for the scores' row
    (empty when none changed)."""
    in_cand = changed_choices(ref, cand, k, dim)
    in_noise = torch.zeros_like(in_cand)
    for n in noisy:
        in_noise |= changed_choices(ref, n, k, dim)
    changed = in_cand | in_noise
    n_cand, n_noise = int(in_cand.sum()), int(in_noise.sum())
    if not bool(changed.any()):
        return ChoiceChange(changed, 0, "")
    if n_cand:
        where = in_cand.squeeze(dim).nonzero()
        tokens = (where.flatten() if where.shape[1] == 1 else where).tolist()[:10]
        gaps = ", ".join(f"{g:.3g}" for g in gap_at(ref, in_cand, k, dim)[:10])
        cand_part = (f"the candidate's top-{k} choice differs on {n_cand} token(s) {tokens} (the reference's "
                     f"gap between its top-{k} and the next score there: {gaps})")
    else:
        cand_part = f"the candidate's top-{k} choice is the reference's"
    return ChoiceChange(changed, n_cand, unsampled=int((in_cand & ~in_noise).sum()), note=(
        f"{cand_part}; the noise samples' differs on {n_noise} token(s); the scores are within threshold, so "
        f"these near-ties are legitimate: {int(changed.sum())} token(s) are left out of this module's output "
        "gradient and of the tensors that consume the choice (tracer.compare.decisions)"))
