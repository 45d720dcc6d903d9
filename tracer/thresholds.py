r"""Per-tensor thresholds of a traced comparison, from the reference's noise samples.

The difference between a correct candidate and the reference at a traced tensor is the
local rounding of the op that produced it plus every earlier difference propagated to it
(``../shared/design.md``, "Thresholds in a traced comparison"). We measure both at once,
as TTrace does (arXiv 2506.09280, §4): the reference step is re-run ``S`` times under
:class:`ttrace_num.propagate.noise.NoiseInjector`, which perturbs every modelled op's result
by ``U * b`` (``U ~ Uniform[-1, 1]`` elementwise), ``b`` the op's probabilistic local bound
from ``ttrace_num`` for the difference between the two runs' computation models (e.g. a
GEMM whose reduction the candidate splits over TP ranks and sums in bf16). The deviation
``d_s = noisy_s - reference`` of a tensor is then a sample of "a legitimate difference,
propagated through the real network on the real data".

Statistic. Per tensor we compare Euclidean norms: the candidate's error
``e = ||cand - ref||_2`` against ``T = F * sqrt(mean_s ||d_s||_2^2)``.

* Why the noise dominates a legitimate difference: ``b`` is a bound that a single
  rounding-error sum exceeds with probability <= 1e-6 (Azuma–Hoeffding), i.e. ``b >=
  sqrt(2 ln(2e6)) sigma = 5.4 sigma`` for the standard deviation ``sigma`` of the legitimate
  local difference, while ``U b`` has standard deviation ``b / sqrt 3 >= 3.1 sigma``.
  Propagation is linear to first order, so the injected deviation of every tensor has at
  least the variance of a legitimate one, elementwise, with the same correlation
  structure.
* The factor ``F``: under the conservative assumption that both have *equal* variance and
  are Gaussian with ``n_eff`` effective degrees of freedom, ``e^2 / mean_s ||d_s||^2``
  follows an ``F(n_eff, S n_eff)`` distribution; ``F = sqrt(F^{-1}(1 - q; n_eff, S n_eff))``
  makes the per-tensor false-alarm probability ``q`` (default ``1e-3``). ``n_eff =
  (sum_i m_i)^2 / sum_i m_i^2`` with ``m_i = mean_s d_{s,i}^2`` is the participation ratio
  of the deviation (1 for a scalar or a single dominant element, ``numel`` for i.i.d.).
  A scalar with ``S = 2`` gets ``F = 31.6``; a tensor with ``n_eff = 10^3``, ``F = 1.10``.
  With the 3x margin above the actual false-alarm rate is far below ``q``.
* A tensor no sample moved (``d_s = 0``: integer inputs, exact ops) gets ``T = 0``: the
  candidate must be bitwise equal there.

What it does not cover (stated, not hidden): ops the injector does not model (see
:func:`ttrace_num.propagate.calls.classify`: exp/log/sum inside fused losses are not
perturbed), and discontinuities (argmax, clipping thresholds) that noise of this size may
not cross in ``S`` samples.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["NoiseThreshold", "noise_threshold", "DEFAULT_FALSE_ALARM"]

#: Per-tensor false-alarm probability under the equal-variance assumption.
DEFAULT_FALSE_ALARM = 1e-3


@dataclass(frozen=True)
class NoiseThreshold:
    """Threshold on ``||cand - ref||_2`` for one tensor, with how it was derived."""

    threshold: float       # T = factor * rms_deviation
    rms_deviation: float   # sqrt(mean_s ||d_s||^2)
    n_eff: float           # effective degrees of freedom of the deviation
    factor: float          # F
    samples: int


def _f_quantile(q: float, d1: float, d2: float) -> float:
    from scipy.stats import f
    return float(f.ppf(1.0 - q, d1, d2))


def noise_threshold(ref: torch.Tensor, noisy: list[torch.Tensor], false_alarm: float = DEFAULT_FALSE_ALARM
                    ) -> NoiseThreshold:
    """Threshold for one tensor from the reference and its noise samples (see module doc)."""
    if not noisy:
        raise ValueError("need at least one noise sample")
    r = ref.detach().double()
    sq = torch.stack([(n.detach().double() - r).reshape(-1) ** 2 for n in noisy])
    m = sq.mean(0)
    total = float(m.sum())
    if not math.isfinite(total):
        raise ValueError("a noise sample is not finite: the reference run is numerically unstable there")
    if total == 0.0:
        return NoiseThreshold(0.0, 0.0, 0.0, 0.0, len(noisy))
    n_eff = total ** 2 / float((m ** 2).sum())
    factor = math.sqrt(_f_quantile(false_alarm, n_eff, len(noisy) * n_eff))
    rms = math.sqrt(total)
    return NoiseThreshold(factor * rms, rms, n_eff, factor, len(noisy))
