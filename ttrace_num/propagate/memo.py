r"""Reuse the noise amplitudes of one training step across its noise samples.

A noise sample re-runs a training step under :class:`~.noise.NoiseInjector`, which perturbs
every modelled op by ``U * b``: a fresh uniform draw ``U`` times an amplitude ``b``, the op's
local bound (or, for fp32 sums, the standard deviation of the legitimate difference times
``sqrt 3``). Computing ``b`` is most of a sample's cost: bounds that follow a kernel's
accumulation schedule (layer norm's Welford tree, a GEMM's split reduction) take tens of
tensor passes each, where the op itself takes one.

The ``S`` samples of a step run the same program on operands that differ only by the
propagated noise, so their amplitudes differ only as much as those operands do. A
:class:`AmplitudeMemo` keeps the amplitudes the first sample computes, in call order, and
hands them to the next samples:

* a call is matched to the first sample's call at the same position in the sequence when
  its *signature* is the same (op, module, shapes and dtypes of the operands, the non-tensor
  arguments) and the *row fingerprints* of its operands and of its result (forward calls)
  match the first sample's: for each row ``x`` (last dimension), its norm ``||x||_2`` and
  its projections ``x . r_k`` on :data:`PROJECTIONS` fixed random sign vectors ``r_k``, all
  within ``tolerance * max ||x||_2`` (default ``tolerance = 0.25``); otherwise the amplitude
  is computed afresh and replaces the stored one. A 0-d or 1-d operand of an op whose result has
  rows (a bias, a norm's weight, broadcast over the tokens) is matched through the result:
  such parameters start at 0 and move by Adam's ``lr sign(g)``, so in the samples' own
  trajectories (:class:`~tracer.capture.noise_sampler.NoiseSampler`) they differ by O(1) of themselves
  from the second step on, while what they add to the result, and to its amplitude, is what
  the result's fingerprint sees;
* why that is sound: every amplitude is a sum or max of products of operand magnitudes
  (and their roundings), Lipschitz in the operands, so operands whose rows differ by a
  relative ``delta`` move it by at most about ``delta`` (less: a sum of magnitudes averages
  the changes of its terms). The noise ``U b`` has a standard deviation ``b / sqrt 3 >= 3.1x``
  that of the legitimate difference (:mod:`tracer.compare.thresholds`), so ``delta <= 0.25`` leaves
  it above ``2.3x``. Measured on the bf16 demo: at step 0 the samples' rows differ by 1-3%;
  from step 1 on the weights differ by up to 10-20% of a row, as each sample has its own
  trajectory and Adam's first updates are ``lr sign(g)``, whose sign noise flips for every
  gradient element below its legitimate difference. On the larger model of docs/cost.md (3
  bf16 steps, 4 samples), 102 of the 1332 later samples' calls are recomputed at ``0.25``;
  an earlier ``0.1`` tolerance on the rows' ``sum |x|`` recomputed 356. Amplitudes that are
  step functions of the values (a half-ulp of the result) change by 2x on the elements that
  cross a binade, a fraction ``~delta / ln 2`` of them;
* a GEMM whose amplitude is computed row by row (``A @ B`` or ``F.linear`` with a 2-D ``B``:
  each output row's bound depends on that row of ``A`` and on the whole of ``B``) gets only its
  far rows recomputed when ``B`` matches and at most :data:`MAX_PATCHED_FRACTION` of the rows
  of ``A`` or of the result moved out of tolerance (``rows=`` of :meth:`AmplitudeMemo.get`);
  the stored fingerprints of those rows are replaced, the others keep the first sample's, so
  every row's amplitude is always matched against the operands it was computed from. Why:
  the far rows are few and the whole GEMM bound costs 3 GEMMs and ~100 passes over the
  result. Measured on the xl model of docs/cost-xl.md (weight-gradient GEMMs, whose
  gradient rows move most): 1-3 of 256-4096 rows out of tolerance, ~10 of a later sample's
  ~50 GEMM amplitudes, which were ~half of its time;
* what the projections are for: a discrete decision that changes which data an op sees
  without changing its shape (top-k routing sending other tokens to an expert) replaces
  whole rows. A row's norm may barely change (rows after a norm layer have similar norms),
  but each projection of the difference of two rows is ``~ N(0, ||x - y||_2^2)``, with
  ``||x - y||_2 ~ sqrt 2 ||x||_2`` for uncorrelated rows, where noise moves it by ``delta
  ||x||_2``: a replaced row stays within the tolerance on all four projections with
  probability ``~(2 Phi(0.25 / sqrt 2) - 1)^4 ~ 4e-4`` (rows correlated with cosine 0.5:
  ``~1.5e-3``); the call then gets its own amplitude.

Memory: the amplitudes of every modelled op call of one step (float64), about four times the
step's activations and gradients in bf16; :class:`~tracer.capture.noise_sampler.NoiseSampler` drops them
after the step. ``reuse_amplitudes=False`` there computes every sample's own.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["AmplitudeMemo", "DEFAULT_TOLERANCE", "row_fingerprint"]

#: largest difference of a row's norm and projections, relative to its norm, for a stored
#: amplitude to be reused
DEFAULT_TOLERANCE = 0.25
#: random sign vectors a row is projected on
PROJECTIONS = 4
#: largest fraction of a row-wise amplitude's rows recomputed alone (more: the whole call)
MAX_PATCHED_FRACTION = 0.25

_SIGNS: dict[tuple, torch.Tensor] = {}


def _signs(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """:data:`PROJECTIONS` fixed random +-1 vectors of length ``n``, as the columns of an
    ``(n, PROJECTIONS)`` matrix (the same in every sample and run)."""
    key = (n, dtype, device)
    if key not in _SIGNS:
        gen = torch.Generator().manual_seed(n)
        signs = torch.randint(0, 2, (n, PROJECTIONS), generator=gen) * 2 - 1
        _SIGNS[key] = signs.to(dtype=dtype, device=device)
    return _SIGNS[key]


def row_fingerprint(x: torch.Tensor) -> torch.Tensor:
    """Per row of ``x`` (its last dimension; a 0-d tensor is one row of one): its projections
    on :func:`_signs` and its norm (float64, shape ``(PROJECTIONS + 1, *rows)``)."""
    x = x.detach()
    x = x.reshape(1) if x.dim() == 0 else x
    if not x.is_floating_point():
        x = x.double()
    projections = (x @ _signs(x.shape[-1], x.dtype, x.device)).movedim(-1, 0)
    return torch.cat([projections, torch.linalg.vector_norm(x, dim=-1).unsqueeze(0)]).double()


def _fingerprinted(operands: Sequence[Any], output: torch.Tensor | None) -> list[torch.Tensor]:
    """The tensors whose rows a call is matched on (module doc)."""
    rows = output is not None and output.dim() >= 2
    tensors = [t for t in operands if isinstance(t, torch.Tensor) and not (rows and t.dim() <= 1)]
    return tensors + ([output] if output is not None else [])


def _signature(what: str, operands: Sequence[Any]) -> tuple:
    return (what,) + tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else repr(t)
                           for t in operands)


@dataclass
class AmplitudeMemo:
    """Amplitudes of one step's op calls, by position in the call sequence (module doc).

    Counts over its life: ``hits`` (reused whole), ``patched`` (some rows recomputed,
    ``rows_recomputed`` of them in all) and ``misses`` (computed whole)."""

    tolerance: float = DEFAULT_TOLERANCE
    hits: int = 0
    misses: int = 0
    patched: int = 0
    rows_recomputed: int = 0
    _entries: list[tuple[tuple, list[torch.Tensor], torch.Tensor]] = field(default_factory=list, repr=False)
    _position: int = 0

    def rewind(self) -> None:
        """Start a sample: the next call is matched with the first one stored."""
        self._position = 0

    def get(self, what: str, operands: Sequence[Any], compute: Callable[[], torch.Tensor],
            output: torch.Tensor | None = None,
            rows: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """The amplitude of the next call (``what`` names it, e.g. ``"layer_norm@decoder.layers.0"``;
        ``operands`` and, for a forward call, its ``output``: what the amplitude depends on):
        the stored one when the call matches the stored call at this position, else ``compute()``.

        ``rows``: for an amplitude computed row by row from the rows of ``operands[0]`` and the
        whole of the other operands (a GEMM with a 2-D right operand), ``rows(index)`` gives
        the amplitude of the result's rows ``index`` (flat over the leading dimensions, shape
        ``(len(index), last)``); a call whose other operands match and only a few rows moved
        is then patched, not recomputed (module doc)."""
        i = self._position
        self._position += 1
        sig = _signature(what, operands)
        fingerprinted = _fingerprinted(operands, output)
        prints = [row_fingerprint(t) for t in fingerprinted]
        if i < len(self._entries):
            stored_sig, stored_prints, amplitude = self._entries[i]
            if stored_sig == sig:
                far = [_far_rows(a, b, self.tolerance) for a, b in zip(stored_prints, prints)]
                if not any(bool(f.any()) for f in far):
                    self.hits += 1
                    return amplitude
                if rows is not None and fingerprinted and fingerprinted[0] is operands[0]:
                    patched = self._patched(i, amplitude, far, prints, operands[0], output, rows)
                    if patched is not None:
                        return patched
        amplitude = compute()
        entry = (sig, prints, amplitude)
        if i < len(self._entries):
            self._entries[i] = entry
        else:
            self._entries.append(entry)
        self.misses += 1
        return amplitude

    def _patched(self, i: int, amplitude: torch.Tensor, far: list[torch.Tensor], prints: list[torch.Tensor],
                 row_operand: torch.Tensor, output: torch.Tensor | None,
                 rows: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
        """The stored amplitude of entry ``i`` with the far rows of the row operand (the first
        fingerprint) and of the result (the last, when there is one) recomputed, and those
        rows' stored fingerprints replaced; None when the call does not qualify (another
        operand moved, rows not aligned with the amplitude's, too many far rows)."""
        row_prints = [0] + ([len(prints) - 1] if output is not None else [])
        if any(bool(f.any()) for k, f in enumerate(far) if k not in row_prints):
            return None
        lead = tuple(row_operand.shape[:-1])
        if amplitude.dim() < 2 or tuple(amplitude.shape[:-1]) != lead or any(
                tuple(far[k].shape) != lead for k in row_prints):
            return None
        moved = torch.zeros(lead, dtype=torch.bool)
        for k in row_prints:
            moved |= far[k]
        index = moved.reshape(-1).nonzero().reshape(-1)
        if index.numel() > MAX_PATCHED_FRACTION * moved.numel():
            return None
        patched = amplitude.clone()
        patched.view(-1, patched.shape[-1])[index] = rows(index).reshape(index.numel(), -1).to(patched.dtype)
        stored_prints = [p.clone() for p in self._entries[i][1]]
        for k in row_prints:
            flat = stored_prints[k].view(stored_prints[k].shape[0], -1)
            flat[:, index] = prints[k].reshape(flat.shape[0], -1)[:, index]
        self._entries[i] = (self._entries[i][0], stored_prints, patched)
        self.patched += 1
        self.rows_recomputed += index.numel()
        return patched


def _far_rows(a: torch.Tensor, b: torch.Tensor, tolerance: float) -> torch.Tensor:
    """Per row, whether two row fingerprints (:func:`row_fingerprint`) are not within
    ``tolerance`` times the larger norm (shape: the rows'); a NaN fingerprint is far."""
    return (~((a - b).abs() <= tolerance * torch.maximum(a[-1], b[-1]))).any(0)
