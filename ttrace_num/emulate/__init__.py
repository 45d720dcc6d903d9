"""Emulators of the computation models stated by the error models of :mod:`ttrace_num.bounds`.

Each module emulates one operator family with every intermediate rounded to its stated
format (via :func:`ttrace_num.rounding.round_to`), vectorised over the outputs. They are
the ground truth the bounds are tested against besides the real torch kernels: an
emulated computation is one that the bound claims to cover.

* :mod:`.summation`: sums, means, dot products and matmuls under a
  :class:`~ttrace_num.bounds.summation.Summation` model (order, accumulation format,
  split-K and the reduction of the partials).
"""
from .summation import emulate_matmul, emulate_mean, emulate_sum, emulate_terms

__all__ = ["emulate_sum", "emulate_mean", "emulate_matmul", "emulate_terms"]
