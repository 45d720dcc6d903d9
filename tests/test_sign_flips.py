"""Adam's first update is the gradient's sign (tracer.compare.sign_flips): a parameter element whose
gradient changed sign between two correct runs moves by 2 lr, and is left out of the parameter's
comparison; the same jump anywhere else is a divergence."""
from __future__ import annotations

from pathlib import Path

import torch

from tracer.compare.check import compare
from tracer.compare.sign_flips import flipped_signs
from tracer.trace.store import TraceWriter

LR = 1e-3


def _grad_and_param(flip: bool, jump_at: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.linspace(-1e-2, 1e-2, 16)
    g[5] = -3e-7  # a near-cancelled sum: its sign is round-off
    if flip:
        g[5] = 1e-7
    p = 1.0 - LR * torch.sign(g)  # Adam's first step
    if jump_at is not None:
        p[jump_at] += 2 * LR
    return g, p


def _write(root: Path, g: torch.Tensor, p: torch.Tensor, noise: float = 0.0, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    w = TraceWriter(root, 0, 1, {"dp": 1}, "sign-flips")
    w.add("w", g + noise * torch.randn(g.shape, generator=gen) * 1e-6, phase="grad", step=0)
    w.add("w", p + noise * torch.randn(p.shape, generator=gen) * 1e-7, phase="param", step=0)
    w.flush_step(0)
    w.close()


def _reference(root: Path) -> Path:
    g, p = _grad_and_param(False, None)
    _write(root, g, p)
    for i in range(3):
        _write(root / "noise" / f"sample_{i}", g, p, noise=1.0, seed=i + 1)
    return root


def test_flipped_signs_include_zero():
    assert flipped_signs(torch.tensor([1.0, -1.0, 0.0, 2.0]), torch.tensor([1.0, 1.0, 1.0, 3.0])).tolist() == [
        False, True, True, False]


def test_a_parameter_moved_by_a_flipped_gradient_sign_is_left_out(tmp_path):
    ref = _reference(tmp_path / "ref")
    g, p = _grad_and_param(True, None)  # element 5's gradient changed sign: its update too
    _write(tmp_path / "cand", g, p)
    c = compare(ref, tmp_path / "cand")
    assert c.verdict == "consistent"
    row = next(r for r in c.rows if r.phase == "param")
    assert "1 element(s) whose gradient changed sign" in row.note and row.status == "ok"


def test_the_same_jump_without_a_sign_flip_is_a_divergence(tmp_path):
    ref = _reference(tmp_path / "ref")
    g, p = _grad_and_param(True, 9)  # element 9 jumps too, its gradient did not flip
    _write(tmp_path / "cand", g, p)
    c = compare(ref, tmp_path / "cand")
    assert c.verdict == "DIVERGENT" and c.first.phase == "param"
    assert "still over" in c.first.note
