"""Top-k choices in a comparison (tracer.compare.decisions): a near-tie that a correct candidate routes
the other way is left out of the router's gradient; a wrong selection is still caught."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tracer.compare.check import compare
from tracer.compare.decisions import changed_choices, choice_changes, gap_at, topk_consumer_meta, topk_meta, without_choices
from tracer.trace.store import TraceWriter

T, E, K, TIE = 16, 4, 2, 7  # tokens, experts, top-k, the near-tie token


def test_changed_choices_compares_sets_not_order():
    ref = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    swapped_order = torch.tensor([[2.0, 3.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])  # same set {0, 1}
    other_set = torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.0, 1.0, 2.0, 3.0]])      # {0, 2}
    assert changed_choices(ref, swapped_order, 2).tolist() == [[False], [False]]
    assert changed_choices(ref, other_set, 2).tolist() == [[True], [False]]
    assert gap_at(ref, changed_choices(ref, other_set, 2), 2) == [1.0]
    masked = without_choices(torch.ones(2, 4), changed_choices(ref, other_set, 2))
    assert masked.tolist() == [[0.0] * 4, [1.0] * 4]


def test_changed_choices_rejects_bad_input():
    with pytest.raises(ValueError, match="top-5"):
        changed_choices(torch.zeros(2, 4), torch.zeros(2, 4), 5)
    with pytest.raises(ValueError, match="shape"):
        changed_choices(torch.zeros(2, 4), torch.zeros(3, 4), 2)
    with pytest.raises(ValueError, match="k >= 1"):
        topk_meta(0)


def test_choice_changes_unites_candidate_and_noise_samples():
    ref = torch.tensor([[3.0, 2.0, 1.9, 0.0], [3.0, 2.0, 1.0, 1.95]])
    cand = torch.tensor([[3.0, 1.8, 1.9, 0.0], [3.0, 2.0, 1.0, 1.95]])
    noise = torch.tensor([[3.0, 2.0, 1.9, 0.0], [3.0, 1.9, 1.0, 1.95]])
    change = choice_changes(ref, cand, [noise], 2)
    assert change.left_out.squeeze(-1).tolist() == [True, True] and change.in_candidate == 1
    assert change.unsampled == 1  # token 0: the candidate's change, which no sample made
    assert choice_changes(ref, cand, [noise, cand], 2).unsampled == 0
    assert "differs on 1 token(s) [0]" in change.note and "noise samples' differs on 1" in change.note
    none = choice_changes(ref, ref.clone(), [ref.clone()], 2)
    assert none.note == "" and not bool(none.left_out.any()) and none.in_candidate == 0


def _scores_and_grad() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(T, E, generator=g)
    scores[TIE] = torch.tensor([1.0, 0.3002, 0.2998, -1.0])  # top-2 {0, 1}, gap 4e-4 to expert 2
    return scores, torch.randn(T, E, generator=g)


def _write(root: Path, scores: torch.Tensor, grad: torch.Tensor, meta: dict, run_id: str) -> None:
    """The router's scores and their gradient, the layer's outputs that consume the choice:
    per-token rows (the scores' row sums) and a scalar (their total), and a tensor further
    downstream (the same rows, without a consumer's meta)."""
    w = TraceWriter(root, 0, 1, {"layout": "test"}, "router-test", run_id=run_id)
    m = {"module": "moe.router", **meta}
    consumer = {"module": "moe", **(topk_consumer_meta("router") if meta else {})}
    w.add("moe.router.output", scores, phase="fwd", step=0, index=0, meta=m)
    w.add("moe.output.0", grad.sum(-1, keepdim=True), phase="fwd", step=0, index=1, meta=consumer)
    w.add("moe.output.1", grad.sum(), phase="fwd", step=0, index=2, meta=consumer)
    w.add("next.output", grad.sum(-1, keepdim=True), phase="fwd", step=0, index=3, meta={"module": "next"})
    w.add("moe.router.output_grad", grad, phase="bwd", step=0, index=4, meta=m)
    w.flush_step(0)


def _traces(root: Path, cand_scores_shift: float, swap_grad_row: bool, meta: dict) -> tuple[Path, Path]:
    """Reference with 4 noise samples (1e-4 noise, none on the tie token) and a candidate with
    its own 1e-4 noise, the tie token's scores moved by +-``cand_scores_shift`` and, if asked,
    that token's gradient entries for experts 1 and 2 swapped (what a changed choice does)."""
    scores, grad = _scores_and_grad()
    ref, cand = root / "ref", root / "cand"
    _write(ref, scores, grad, meta, "ref")
    g = torch.Generator().manual_seed(1)

    def noisy(t: torch.Tensor) -> torch.Tensor:
        d = 1e-4 * torch.randn(t.shape, generator=g)
        d[TIE] = 0.0
        return t + d

    for i in range(4):
        _write(ref / "noise" / f"sample_{i}", noisy(scores), noisy(grad), meta, f"noise{i}")
    c_scores, c_grad = noisy(scores), noisy(grad)
    c_scores[TIE, 1] -= cand_scores_shift
    c_scores[TIE, 2] += cand_scores_shift
    if swap_grad_row:  # and move the tie token's row sum, as a changed expert does to the layer's output
        c_grad[TIE, 1], c_grad[TIE, 2] = grad[TIE, 2].item() + 1.0, grad[TIE, 1].item()
    _write(cand, c_scores, c_grad, meta, "cand")
    return ref, cand


def _row(c, name):
    return next(r for r in c.rows if r.name == name)


def test_legitimate_flip_is_left_out_of_the_gradient(tmp_path):
    ref, cand = _traces(tmp_path, 3e-4, swap_grad_row=True, meta=topk_meta(K))
    c = compare(ref, cand)
    assert c.verdict == "consistent", [(r.label, r.status, r.ratio, r.note) for r in c.rows]
    assert f"differs on 1 token(s) [{TIE}]" in _row(c, "moe.router.output").note
    assert "1 token(s) left out" in _row(c, "moe.router.output_grad").note
    assert "1 token(s) left out" in _row(c, "moe.output.0").note  # a consumer with token rows
    scalar = _row(c, "moe.output.1")  # a consumer without: not compared, and says why
    assert scalar.status == "unchecked" and "moe.router" in scalar.note and scalar.ratio > 1
    after = _row(c, "next.output")  # downstream of a change no sample made: not compared, says why
    assert after.status == "unchecked" and after.ratio > 1 and "no noise sample did (moe.router: 1 token(s))" in after.note


def test_same_flip_without_the_topk_meta_is_a_false_positive(tmp_path):
    """The failure the mechanism removes: the changed row alone puts the gradient over (norm and
    block statistics). The element statistic goes further back: no noise sample moved the tie
    token's scores at all (this test's samples leave that row alone), so the candidate's 3e-4
    there is itself unexplained, without the top-k meta that makes the step's choices discrete."""
    ref, cand = _traces(tmp_path, 3e-4, swap_grad_row=True, meta={})
    c = compare(ref, cand, elementwise=False)
    assert c.first is not None and c.first.name == "moe.output.0"
    assert {r.name for r in c.rows if r.status == "over"} == {"moe.output.0", "moe.output.1", "next.output",
                                                              "moe.router.output_grad"}
    e = compare(ref, cand)
    assert e.first is not None and e.first.name == "moe.router.output" and e.first.element_ratio == float("inf")


def test_wrong_selection_with_agreeing_scores_is_caught(tmp_path):
    """The candidate's scores imply the reference's choice but its gradient row is that of
    another choice: a selection bug, not a near-tie; nothing is left out."""
    ref, cand = _traces(tmp_path, 0.0, swap_grad_row=True, meta=topk_meta(K))
    c = compare(ref, cand)
    assert c.first is not None and c.first.name == "moe.output.0"
    assert all("left out" not in r.note and r.status != "unchecked" for r in c.rows)
    assert _row(c, "next.output").status == "over"  # no legitimate change: downstream is compared


def test_scores_over_threshold_leave_nothing_out(tmp_path):
    """A flip caused by scores that are themselves wrong is no near-tie: the scores are the
    divergence and the gradient is compared on every token."""
    ref, cand = _traces(tmp_path, 0.05, swap_grad_row=True, meta=topk_meta(K))
    c = compare(ref, cand)
    assert c.first is not None and c.first.name == "moe.router.output"
    assert _row(c, "moe.router.output_grad").status == "over"
    assert all("left out" not in r.note and r.status != "unchecked" for r in c.rows)
