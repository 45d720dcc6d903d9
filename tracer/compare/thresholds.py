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
``e = ||cand - ref||_2`` against ``T = F * sqrt(mean_s ||d_s||_2^2)``. On most tensors the
checker also applies the same construction to a second, linear statistic of the deviation, its block
coordinates along the reference (:mod:`tracer.compare.blockscale`), with the samples' coordinates in
place of ``d_s``; everything below holds for it unchanged.

* Why the noise dominates a legitimate difference: ``b`` is a bound that a single
  rounding-error sum exceeds with probability <= 1e-6 (Azuma–Hoeffding), i.e. ``b >=
  sqrt(2 ln(2e6)) sigma = 5.4 sigma`` for the standard deviation ``sigma`` of the legitimate
  local difference, while ``U b`` has standard deviation ``b / sqrt 3 >= 3.1 sigma``.
  Propagation is linear to first order, so the injected deviation of every tensor has at
  least the variance of a legitimate one, elementwise, with the same correlation
  structure.
* Except for GEMMs and fp32 sums, where that margin is too generous. An order-free fp32 GEMM
  bound is 100-1000x the error a kernel commits (:mod:`ttrace_num.bounds.matmul`,
  "Tightness"), and noise of that size made fp32 thresholds ~5e4x the smallest detectable
  corruption; in bf16, noise from the bound of an unsplit-vs-split GEMM has 1.9-4.1x the
  standard deviation of the difference. The references therefore use variance-matched noise
  (``variance_model`` of :class:`~ttrace_num.propagate.noise.NoiseInjector`, from
  :func:`tracer.adapters.megatron.injector_models`) for the GEMMs in forward and backward, fp32 or
  bf16, and for fp32 parameter-gradient sums: noise with the *variance* of the difference
  between an unsplit and a split random-order run, the rounding of a bf16 result included
  (:mod:`ttrace_num.bounds.summation_variance`). That is the equal-variance case the factor
  ``F`` below is built for. The model is the largest of the usual orders: this machine's split
  fp32 GEMMs differ by 0.13-0.7x its standard deviation, its split bf16 GEMMs by 0.73-0.78x,
  and emulated random-order fp32 chains by 0.72-0.79x (``tests/test_summation_variance.py``).
  Ops outside the model (norms, softmax, elementwise, bf16 sums over tokens, GEMMs of mixed
  operand dtypes) keep their bound-sized noise, and so do the bf16 GEMMs of a model with
  top-k routing (``injector_models(routed=True)``: discrete choices, below).
* The factor ``F``: under the conservative assumption that both have *equal* variance and
  are Gaussian with ``n_eff`` effective degrees of freedom, ``e^2 / mean_s ||d_s||^2``
  follows an ``F(n_eff, S n_eff)`` distribution; ``F = sqrt(F^{-1}(1 - q; n_eff, S n_eff))``
  makes the per-tensor false-alarm probability ``q``. The participation ratio counts
  degrees of freedom correctly only when the deviation's elements are independent; when a
  few sources drive it (a handful of Adam sign flips, below, spread over a whole activation
  by the next step's GEMMs) the samples' squared norms ``z_s = ||d_s||^2`` vary from sample
  to sample like ``chi^2_k`` with few ``k``, and ``k = 2 mean(z)^2 / var(z)`` (the moment
  estimate; ``var`` with ``S - 1`` degrees of freedom) is the better count: ``n_eff`` is the
  smaller of the two (at least 1); the checker uses ``q = 0.01 / N`` for
  a comparison of ``N`` tensors, so that a correct candidate passes the whole comparison
  with probability >= 0.99 under this model (Bonferroni). ``n_eff =
  (sum_i m_i)^2 / sum_i m_i^2`` with ``m_i = mean_s d_{s,i}^2`` is the participation ratio
  of the deviation (1 for a scalar or a single dominant element, ``numel`` for i.i.d.).
  At ``q = 10^-5`` with ``S = 4`` samples: ``F = 1.11`` for ``n_eff = 10^3``, 1.8 for 30,
  and about 40 for a scalar. The margins above (3x the standard deviation for bound-sized
  noise, 1.3-8x for the variance model) hold for the local rounding of every op; they do
  not hold for discontinuities (below), which is why the factor is not dropped.
* A tensor no sample moved is either computed only by ops outside the injector's model
  (integer inputs, index arithmetic, positional tables such as RoPE's ``outer``/``cos``/``sin``)
  or by exact ops, where two faithful implementations (error < 1 ulp) differ by less than one
  ulp of the stored format per element; or it *is* downstream of modelled noise, but its
  legitimate difference is below the stored format's resolution and every sample happened to
  round to the reference's value (an fp32 loss whose samples differ from it by 0 or 1 ulp: all
  four at 0 in one of ~30 references of the detection matrix). There the candidate's value is
  one rounding of a real value within the same ulp (1 ulp for a flip at a rounding boundary),
  or, for a partial placement, the float64 sum of partial results rounded once each, whose
  roundings add up to about another ulp of the total (4 context-parallel loss partials of
  ~1/4 of the loss: 4 half-ulps of a quarter). :func:`unmodelled_threshold` therefore gives
  ``T = 2 ||ulp(ref)||_2`` (measured: 1.125 ulp for that CP=4 loss, 1 ulp elsewhere);
  integer tensors get ``T = 0`` (bitwise equality).

What it does not cover (stated, not hidden): ops the injector does not model (see
:func:`ttrace_num.propagate.calls.classify`: exp/log are not perturbed), and
discontinuities that noise of this size crosses at random: Adam's first update is
``lr * sign(g)``, so every gradient element smaller than its legitimate difference may flip
sign in the candidate and in each noise sample independently; from the second step on, the
deviations of both are dominated by these few discrete flips, and the equal-variance model
is only as good as ``S`` samples' estimate of their spread (measured: largest
error/threshold of clean runs 0.6-1.0 from step 1 on, vs 0.2-0.8 at step 0).

``few_sources=False`` drops the moment estimate and keeps the participation ratio alone. From
4 samples the moment estimate is itself noisy (the variance of 4 squared norms), and the
smaller of the two counts then often cuts ``n_eff`` by chance: at 16 blocks, ``F`` is 2.18 at
``n_eff = 16`` and 2.93 at 8. The checker drops it only where discrete flips cannot drive the
deviation: in a comparison whose noise samples restart every step from the re-synchronised
state (:mod:`tracer.capture.resync`), the tensors computed before the step's optimizer update
(:data:`tracer.trace.store.PRE_UPDATE_PHASES`) share the candidate's parameters bitwise, and their
deviation is one step's round-off; the parameters after the update keep the estimate (an
element whose gradient is within round-off of zero moves by +-lr in Adam's first steps), and
so does every tensor of a step that makes top-k routing choices (a near-tied token routed
elsewhere by one sample is a flip inside the step; :func:`tracer.compare.check.few_sources`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["DEFAULT_FALSE_ALARM", "NoiseThreshold", "deviation_threshold", "moments_threshold", "noise_threshold",
           "unmodelled_threshold"]

#: False-alarm probability of a whole comparison under the equal-variance assumption; the
#: checker gives each of its N tensors ``DEFAULT_FALSE_ALARM / N`` (Bonferroni).
DEFAULT_FALSE_ALARM = 1e-2


@dataclass(frozen=True)
class NoiseThreshold:
    """Threshold on ``||cand - ref||_2`` for one tensor, with how it was derived."""

    threshold: float       # T = factor * rms_deviation
    rms_deviation: float   # sqrt(mean_s ||d_s||^2)
    n_eff: float           # effective degrees of freedom of the deviation
    factor: float          # F
    samples: int


def _f_quantile(q: float, d1: float, d2: float) -> float:
    """``F^{-1}(1 - q; d1, d2)`` (``scipy.special.fdtri``: the same value as
    ``scipy.stats.f.ppf``, without its per-call overhead)."""
    from scipy.special import fdtri
    return float(fdtri(d1, d2, 1.0 - q))


def noise_threshold(ref: torch.Tensor, noisy: list[torch.Tensor], false_alarm: float = DEFAULT_FALSE_ALARM, *,
                    few_sources: bool = True) -> NoiseThreshold:
    """Threshold for one tensor from the reference and its noise samples (see module doc)."""
    if not noisy:
        raise ValueError("need at least one noise sample")
    r = ref.detach().double()
    return deviation_threshold([n.detach().double() - r for n in noisy], false_alarm, few_sources=few_sources)


def deviation_threshold(deviations: list[torch.Tensor], false_alarm: float = DEFAULT_FALSE_ALARM, *,
                        few_sources: bool = True) -> NoiseThreshold:
    """:func:`noise_threshold` from the samples' deviations ``d_s`` (one pass each; float32 or
    float64, the sums of ``m^2`` in float64)."""
    if not deviations:
        raise ValueError("need at least one noise sample")
    m: torch.Tensor | None = None  # sum_s d_s^2, elementwise
    z = []                          # ||d_s||^2 per sample
    for d in deviations:
        sq = d * d
        z.append(float(sq.sum()))
        m = sq if m is None else m.add_(sq)
    return moments_threshold(z, float(torch.linalg.vector_norm(m, dtype=torch.float64)) ** 2, false_alarm,
                             few_sources=few_sources)


def moments_threshold(z: list[float], m_sq: float, false_alarm: float = DEFAULT_FALSE_ALARM, *,
                      few_sources: bool = True) -> NoiseThreshold:
    """The threshold from the two moments it depends on: ``z_s = ||d_s||^2`` per sample and
    ``m_sq = ||m||^2``, ``m = sum_s d_s^2`` elementwise (module doc; a noise sample traced
    as moments stores them instead of its tensor, :mod:`tracer.compare.deviation`). ``few_sources``:
    ``n_eff`` is also capped by the moment estimate of the samples' spread (module doc)."""
    if not z:
        raise ValueError("need at least one noise sample")
    samples = len(z)
    total = math.fsum(z) / samples
    if not math.isfinite(total) or not math.isfinite(m_sq):
        raise ValueError("a noise sample is not finite: the reference run is numerically unstable there")
    if total == 0.0:
        return NoiseThreshold(0.0, 0.0, 0.0, 0.0, samples)
    n_eff = total ** 2 / (m_sq / samples ** 2)
    zt = torch.tensor(z, dtype=torch.float64)
    if few_sources and samples >= 2 and float(zt.var()) > 0:
        n_eff = max(1.0, min(n_eff, 2 * float(zt.mean()) ** 2 / float(zt.var())))
    factor = math.sqrt(_f_quantile(false_alarm, n_eff, samples * n_eff))
    rms = math.sqrt(total)
    return NoiseThreshold(factor * rms, rms, n_eff, factor, samples)


def unmodelled_threshold(ref: torch.Tensor, dtype: torch.dtype) -> NoiseThreshold:
    """``T = 2 ||ulp(ref)||_2`` in ``dtype``'s format, for a tensor no noise sample moved (module doc)."""
    from ttrace_num.formats import get_format, half_ulp
    two_ulp = 4 * half_ulp(ref.detach().double().abs(), get_format(dtype))
    t = float(torch.linalg.vector_norm(two_ulp))
    return NoiseThreshold(t, 0.0, float(ref.numel()), 1.0, 0)
