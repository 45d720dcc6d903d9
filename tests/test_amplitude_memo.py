"""Noise amplitudes shared by the samples of one step (ttrace_num.propagate.memo).

The memo may hand a sample the amplitude the first sample computed only for a call on the
same kind of data: operands whose rows moved by noise (reused), not operands whose rows were
replaced (a routing change), reshaped, or renamed (recomputed). And the noise drawn with
reused amplitudes must be as large as the noise drawn with fresh ones.
"""
import math

import torch
import torch.nn.functional as F

from examples.transformer_block import Block
from ttrace_num.propagate.memo import AmplitudeMemo, _far_rows, row_fingerprint
from ttrace_num.propagate.noise import NoiseInjector


def _rows(n: int = 64, width: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


def _memo_after_first_sample(x: torch.Tensor, w: torch.Tensor) -> tuple[AmplitudeMemo, list[int]]:
    memo, calls = AmplitudeMemo(), []
    memo.get("matmul@fc", (x, w), lambda: calls.append(1) or torch.ones(1))
    memo.rewind()
    return memo, calls


def test_noise_sized_changes_reuse_the_amplitude():
    x, w = _rows(), _rows(32, 256, seed=1)
    memo, calls = _memo_after_first_sample(x, w)
    noisy = x * (1 + 0.02 * torch.randn(x.shape, generator=torch.Generator().manual_seed(2)))
    out = memo.get("matmul@fc", (noisy, w), lambda: calls.append(2) or torch.zeros(1))
    assert calls == [1] and out.item() == 1.0 and (memo.hits, memo.misses) == (1, 1)


def test_a_replaced_row_is_recomputed_though_its_norm_is_the_same():
    x, w = _rows(), _rows(32, 256, seed=1)
    memo, calls = _memo_after_first_sample(x, w)
    swapped = x.clone()
    other = _rows(1, 256, seed=3)[0]
    swapped[17] = other * (x[17].norm() / other.norm())  # another token, same norm
    assert torch.allclose(row_fingerprint(swapped)[-1], row_fingerprint(x)[-1])
    memo.get("matmul@fc", (swapped, w), lambda: calls.append(2) or torch.zeros(1))
    assert calls == [1, 2] and memo.misses == 2


def test_other_shape_name_or_position_is_recomputed():
    x, w = _rows(), _rows(32, 256, seed=1)
    for what, operands in (("matmul@fc", (x[:63], w)), ("matmul@other", (x, w)), ("matmul@fc", (x, w, 0.5))):
        memo, calls = _memo_after_first_sample(x, w)
        memo.get(what, operands, lambda: calls.append(2) or torch.zeros(1))
        assert calls == [1, 2], what
    memo, calls = _memo_after_first_sample(x, w)
    memo.get("matmul@fc", (x, w), lambda: torch.zeros(1))  # position 0: a hit
    memo.get("matmul@fc", (x, w), lambda: calls.append(3) or torch.zeros(1))  # position 1: nothing stored
    assert calls == [1, 3]


def test_a_broadcast_parameter_is_matched_through_the_output():
    """A bias near 0 differs by O(1) of itself between the samples' trajectories; it is
    matched through the result it is added to, which a replaced row still changes."""
    x, bias = _rows(), torch.full((256,), 1e-3)
    memo, calls = AmplitudeMemo(), []
    memo.get("add@fc", (x, bias), lambda: calls.append(1) or torch.ones(1), output=x + bias)
    memo.rewind()
    memo.get("add@fc", (x, -bias), lambda: calls.append(2) or torch.ones(1), output=x - bias)
    assert calls == [1]
    memo.rewind()
    y = x.clone()
    y[3] = _rows(1, 256, seed=5)[0]
    memo.get("add@fc", (y, bias), lambda: calls.append(3) or torch.ones(1), output=y + bias)
    assert calls == [1, 3]


def _block_deviation(memo: AmplitudeMemo | None, samples: int = 3) -> tuple[list[float], torch.Tensor]:
    """Each sample's deviation of a transformer block's output and input gradient (bf16) from the clean run."""
    block = Block(64, 4, seed=3)
    x0 = torch.randn(48, 64, generator=torch.Generator().manual_seed(7)).bfloat16()

    def run():
        x = x0.clone().requires_grad_(True)
        y = block(x)
        F.mse_loss(y.float(), torch.zeros_like(y, dtype=torch.float32)).backward()
        return torch.cat([y.detach().double().reshape(-1), x.grad.double().reshape(-1)])

    clean = run()
    gen = torch.Generator().manual_seed(11)
    devs = []
    for _ in range(samples):
        if memo is not None:
            memo.rewind()
        with NoiseInjector(gen, mode="probabilistic", memo=memo):
            devs.append(float((run() - clean).norm()))
    return devs, clean


def test_reused_amplitudes_give_noise_of_the_same_size():
    memo = AmplitudeMemo()
    with_memo, _ = _block_deviation(memo)
    without, _ = _block_deviation(None)
    assert memo.hits > 0 and memo.hits >= memo.misses  # the 2nd and 3rd samples reuse
    # the samples' deviation sizes agree within their own sample-to-sample spread
    lo, hi = min(without), max(without)
    assert all(0.7 * lo <= d <= 1.3 * hi for d in with_memo), (with_memo, without)


def test_a_wrong_reused_amplitude_would_be_caught_by_the_size_check():
    """Negative control of the test above: reusing zero amplitudes shrinks the later samples' deviations."""
    memo = AmplitudeMemo()
    real_get = memo.get

    def zeroed(what, operands, compute, output=None, rows=None):
        reused = memo.hits + memo.patched
        out = real_get(what, operands, compute, output, rows)
        return torch.zeros_like(out) if memo.hits + memo.patched > reused else out
    memo.get = zeroed
    with_memo, _ = _block_deviation(memo)
    without, _ = _block_deviation(None)
    assert with_memo[0] >= 0.7 * min(without)  # the first sample computes its own
    assert max(with_memo[1:]) < 0.7 * min(without)


def _row_amplitude(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A stand-in amplitude computed row by row from ``x`` and the whole of ``w``."""
    return x.abs().double() @ w.abs().double().T


def _memo_with_rows(x: torch.Tensor, w: torch.Tensor) -> AmplitudeMemo:
    memo = AmplitudeMemo()
    memo.get("linear@fc", (x, w), lambda: _row_amplitude(x, w), rows=lambda i: _row_amplitude(x[i], w))
    memo.rewind()
    return memo


def test_only_the_far_rows_of_a_gemm_are_recomputed():
    x, w = _rows(), _rows(32, 256, seed=1)
    memo = _memo_with_rows(x, w)
    moved = x * (1 + 0.02 * torch.randn(x.shape, generator=torch.Generator().manual_seed(2)))
    moved[17] = _rows(1, 256, seed=3)[0]  # one row replaced
    asked = []
    out = memo.get("linear@fc", (moved, w), lambda: asked.append("all") or _row_amplitude(moved, w),
                   rows=lambda i: asked.append(i.tolist()) or _row_amplitude(moved[i], w))
    assert asked == [[17]] and (memo.patched, memo.rows_recomputed, memo.misses) == (1, 1, 1)
    first = _row_amplitude(x, w)
    assert torch.equal(out[17], _row_amplitude(moved[[17]], w)[0])
    assert torch.equal(torch.cat([out[:17], out[18:]]), torch.cat([first[:17], first[18:]]))
    # the patched row is now matched against the operand it was computed from
    memo.rewind()
    asked.clear()
    memo.get("linear@fc", (moved, w), lambda: asked.append("all"), rows=lambda i: asked.append(i.tolist()))
    assert asked == [] and memo.hits == 1
    memo.rewind()
    memo.get("linear@fc", (x, w), lambda: asked.append("all"),
             rows=lambda i: asked.append(i.tolist()) or _row_amplitude(x[i], w))
    assert asked == [[17]]


def test_a_moved_right_operand_or_many_far_rows_recompute_the_whole_gemm():
    x, w = _rows(), _rows(32, 256, seed=1)
    other_w = w.clone()
    other_w[5] = _rows(1, 256, seed=4)[0]
    many = x.clone()
    many[:20] = _rows(20, 256, seed=6)  # 20 of 64 rows: above MAX_PATCHED_FRACTION
    for operands in ((x, other_w), (many, w)):
        memo, asked = _memo_with_rows(x, w), []
        memo.get("linear@fc", operands, lambda: asked.append("all") or torch.zeros(64, 32),
                 rows=lambda i: asked.append(i.tolist()) or torch.zeros(len(i), 32))
        assert asked == ["all"] and memo.patched == 0


def test_gemm_bounds_are_row_separable():
    """What patching relies on: the local bound of some rows of a GEMM, computed from those
    rows alone, is the full call's bound on those rows (up to the working-precision GEMMs'
    own rounding, which the bound covers either way)."""
    from ttrace_num.bounds.summation import Summation
    from ttrace_num.propagate.calls import classify
    from ttrace_num.propagate.local import LocalBounds
    from ttrace_num.propagate.noise import _gemm_rows
    g = torch.Generator().manual_seed(8)
    x = torch.randn(4, 24, 256, generator=g).bfloat16()
    w, bias = torch.randn(48, 256, generator=g).bfloat16(), torch.randn(48, generator=g).bfloat16()
    split = {"summation": Summation(split=2, reduce_fmt="bf16")}
    local = LocalBounds("probabilistic", policy=lambda path, op: ({"summation": Summation()}, split, False))
    index = torch.tensor([0, 5, 50, 95])
    for func, args in ((F.linear, (x, w, bias)), (torch.matmul, (x, w.T.contiguous()))):
        call = classify(func, args, {})
        out = func(*args)
        full = local.of(call, out, "fc").reshape(-1, out.shape[-1])
        part = _gemm_rows(call, out, lambda c: local.of(c, None, "fc"))(index)
        assert part.shape == (4, 48) and full[index].min() > 0
        torch.testing.assert_close(part, full[index], rtol=1e-5, atol=0)
    assert _gemm_rows(classify(torch.matmul, (x, x.transpose(-1, -2)), {}), x @ x.transpose(-1, -2), None) is None


def test_a_nan_fingerprint_is_far():
    """A row whose fingerprint is NaN (a NaN operand) is never matched: its amplitude is recomputed."""
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    b = a.clone()
    b[0, 1] = math.nan
    assert _far_rows(a, b, 0.25).tolist() == [False, True]
    assert _far_rows(a, a.clone(), 0.25).tolist() == [False, False]
