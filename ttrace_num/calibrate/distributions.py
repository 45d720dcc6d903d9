"""Named input distributions for calibration instances and generated data.

Each entry maps a name to ``draw(shape, generator) -> float64 tensor`` of i.i.d. samples.
They live here, in the calibration package, because :func:`ttrace_num.calibrate.calibrate`
draws its instances from them; the ``ttrace`` command line imports them from here (for
``ttrace tolerance --dist`` and ``ttrace calibrate --dist``), never the other way round.

* ``normal``: N(0, 1).
* ``uniform``: U(-1, 1).
* ``positive``: |N(0, 1)| (no cancellation in sums).
* ``heavy``: Student t with 3 degrees of freedom, ``z / sqrt(chi2_3 / 3)`` (finite mean,
  infinite fourth moment).
* ``activations``: N(0, 1) with 0.1% outliers 100x larger (LLM outlier features).
* ``lognormal``: log-normal-scaled normal, ``z * exp(2 w)`` with ``z, w ~ N(0, 1)``
  independent: each element's magnitude spans many binades (``exp(2 w)`` covers
  ``e^{-6}..e^{6}``, 17 binades, at +-3 sigma), so a few terms dominate every sum.
"""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["Draw", "DISTRIBUTIONS"]

#: ``draw(shape, generator)``: float64 samples of a distribution
Draw = Callable[[tuple[int, ...], torch.Generator], torch.Tensor]


def _normal(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _uniform(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    return torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1


def _positive(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=g, dtype=torch.float64).abs()


def _heavy(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    # Student t with 3 degrees of freedom: normal / sqrt(chi2_3 / 3)
    z = torch.randn(shape, generator=g, dtype=torch.float64)
    c = (torch.randn((3, *shape), generator=g, dtype=torch.float64) ** 2).sum(0) / 3
    return z / c.sqrt()


def _activations(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    # activation-like: normal body with 0.1% outliers 100x larger (LLM outlier features)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    mask = torch.rand(shape, generator=g) < 1e-3
    return torch.where(mask, x * 100, x)


def _lognormal(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    z = torch.randn(shape, generator=g, dtype=torch.float64)
    return z * torch.exp(2.0 * torch.randn(shape, generator=g, dtype=torch.float64))


DISTRIBUTIONS: dict[str, Draw] = {
    "normal": _normal, "uniform": _uniform, "positive": _positive,
    "heavy": _heavy, "activations": _activations, "lognormal": _lognormal,
}
