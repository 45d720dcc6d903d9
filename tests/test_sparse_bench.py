"""bench.sparse's corruptions: the entries it picks, the bits it flips, and which flips count as large."""
from __future__ import annotations

import math

import torch

from bench.sparse import flip_bit, large_flip, pick_entries, scale_entries


def test_picks_k_entries_of_the_larger_half_reproducibly():
    x = torch.arange(-10, 10, dtype=torch.float32)
    idx = pick_entries(x, 4, seed=7)
    assert len(set(idx.tolist())) == 4 and torch.equal(idx, pick_entries(x, 4, seed=7))
    assert all(abs(float(x[i])) >= 5 for i in idx)          # |x| in the larger half
    assert len(pick_entries(x, 64, seed=1)) == 10            # k capped by the pool


def test_scale_entries_changes_only_them_and_casts_back():
    x = torch.ones(6, dtype=torch.bfloat16)
    y = scale_entries(x, torch.tensor([1, 4]), 0.5)
    assert y.dtype == torch.bfloat16 and y.tolist() == [1, 1.5, 1, 1, 1.5, 1] and x.tolist() == [1.0] * 6


def test_flip_bit_in_the_stored_format():
    x = torch.tensor([1.0, 2.0], dtype=torch.float32)
    assert flip_bit(x, 0, 31).tolist() == [-1.0, 2.0]                      # sign
    assert flip_bit(x, 1, 22).tolist() == [1.0, 3.0]                       # top mantissa bit: +1/2
    b = torch.tensor([1.0], dtype=torch.bfloat16)
    assert flip_bit(b, 0, 15).tolist() == [-1.0] and flip_bit(b, 0, 6).tolist() == [1.5]
    assert x.tolist() == [1.0, 2.0]                                         # the input is not modified


def test_large_flip_by_run_dtype():
    assert large_flip(1.0, 1.0 + 2 ** -3, "bf16") and not large_flip(1.0, 1.0 + 2 ** -5, "bf16")
    assert large_flip(1.0, 1.0 + 2 ** -11, "fp32") and not large_flip(1.0, 1.0 + 2 ** -13, "fp32")
    assert large_flip(1.0, math.inf, "fp32")
