"""Which compared tensors the noise samples' thresholds do not cover: ops without a model.

The thresholds come from noise samples (:class:`tracer.capture.noise_sampler.NoiseSampler`): the
reference re-run with every modelled op perturbed by its legitimate error. An op that can round
but has no error model (:mod:`ttrace_num.propagate.census`, category ``unmodelled``: e.g.
``torch.exp``, a tensor-by-tensor division) is run unperturbed, so the samples carry no
legitimate difference for it, and every tensor that depends on it may get a threshold too small
for a correct candidate. Such a tensor within its threshold is therefore not ``ok``: it gets the
status ``unmodelled``, and a comparison with such tensors and no divergence is ``unverified``,
not ``consistent`` (:func:`verdict`), unless the user accepts the ops (``compare(...,
accept_unmodelled=True)``), which keeps them ``ok`` and lists the ops.

"Depends on" is approximated conservatively by "recorded after": each noise sample's
records carry, in their meta, the number of unmodelled calls its trajectory made before them
(``unmodelled_before``, written by the sampler: counted from the sample's first step, so a
later step's tensors, which depend on the earlier steps through the parameters, count them;
from the step's start when the samples restart every step). A tensor is downstream when that
number is positive in any sample. Everything computed after the first unmodelled call is marked,
including tensors that do not depend on it (sound, not tight: the forward records of a layer
before the op are not marked, everything after it is).

What the samples' ``run.json`` meta says (``ops``): the op census summed over the sample's
steps, per category (``perturbed``, ``exact``, ``unmodelled``, ``optimizer``, ``accepted``); and
``accepted_ops``, the reasons the integration gave for the ops it accepted. Noise samples
written without a census (by other writers, or before it existed) leave coverage unknown:
nothing is marked and :attr:`Coverage.recorded` is False.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tracer.trace.schema import Status

__all__ = ["Coverage", "OPS_META", "UNMODELLED_META", "UNMODELLED_STATUS", "coverage_of", "mark_unmodelled",
           "verdict"]

#: run.json meta key of a sample's op census; record meta key of its unmodelled calls so far
#: (the names :class:`tracer.capture.noise_sampler.NoiseSampler` writes)
OPS_META = "ops"
UNMODELLED_META = "unmodelled_before"
#: status of a tensor within its threshold but downstream of an unmodelled op (not accepted)
UNMODELLED_STATUS = Status.UNMODELLED
#: run.json meta key of the reasons for the ops an integration accepted unperturbed
ACCEPTED_META = "accepted_ops"


@dataclass
class Coverage:
    """What the noise samples modelled, and what that means for this comparison.

    ``recorded``: the samples carry an op census. ``unmodelled``: ops without a model
    (name -> calls in one sample's trajectory, the most of any sample). ``optimizer``:
    unmodelled ops inside the optimizer's ``step()``, not perturbed on the stated assumption that
    the candidate runs the same elementwise update. ``accepted``: ops the integration accepted
    unperturbed, with its reasons. ``accepted_by_user``: ``compare(accept_unmodelled=True)``.
    ``downstream``: compared tensors recorded after an unmodelled call (status ``unmodelled``
    unless accepted). ``perturbed``/``exact``: the other categories' call counts."""

    recorded: bool = False
    unmodelled: dict[str, int] = field(default_factory=dict)
    optimizer: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, str] = field(default_factory=dict)
    perturbed: dict[str, int] = field(default_factory=dict)
    exact: dict[str, int] = field(default_factory=dict)
    accepted_by_user: bool = False
    downstream: int = 0

    @property
    def verified(self) -> bool:
        """No compared tensor depends on an unmodelled op the user did not accept."""
        return self.downstream == 0 or self.accepted_by_user

    def to_dict(self) -> dict[str, Any]:
        return {"recorded": self.recorded, "unmodelled": self.unmodelled, "optimizer": self.optimizer,
                "accepted": self.accepted, "accepted_by_user": self.accepted_by_user,
                "downstream_tensors": self.downstream, "perturbed": self.perturbed, "exact": self.exact}

    def summary(self) -> str:
        """One line for a report: the unmodelled ops and what became of the tensors after them."""
        if not self.recorded:
            return "op coverage: not recorded by the noise samples"
        if not self.unmodelled:
            extra = f", or accepted unperturbed by the integration ({len(self.accepted)} ops)" if self.accepted else ""
            return f"op coverage: every rounding op perturbed or exact{extra}"
        ops = ", ".join(f"{n} x{c}" for n, c in sorted(self.unmodelled.items()))
        what = ("accepted by the user (accept_unmodelled=True)" if self.accepted_by_user
                else f"{self.downstream} tensor(s) after them not verified (status unmodelled)")
        return f"op coverage: unmodelled ops {ops}: {what}"


def _meta(obj: Any) -> dict[str, Any]:
    meta = obj.get("meta") if isinstance(obj, dict) else getattr(obj, "meta", None)
    return meta or {}


def coverage_of(noise_readers: Sequence[Any], accept_unmodelled: bool = False) -> Coverage:
    """The census the samples' ``run.json`` meta holds (readers with a ``run`` dict)."""
    metas = [(r.run.get("meta") or {}) for r in noise_readers]
    cens = [m.get(OPS_META) for m in metas]
    if not cens or any(not isinstance(c, dict) for c in cens):
        return Coverage(accepted_by_user=accept_unmodelled)

    def most(category: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in cens:
            for name, n in (c.get(category) or {}).items():
                out[name] = max(out.get(name, 0), int(n))
        return dict(sorted(out.items()))
    accepted: dict[str, str] = {}
    for m in metas:
        accepted.update(m.get(ACCEPTED_META) or {})
    return Coverage(True, most("unmodelled"), most("optimizer"), dict(sorted(accepted.items())), most("perturbed"),
                    most("exact"), accept_unmodelled)


def mark_unmodelled(rows: Sequence[Any], noise_entries: Sequence[Sequence[Any]], noise_readers: Sequence[Any],
                    accept_unmodelled: bool = False) -> Coverage:
    """Mark the compared tensors downstream of an unmodelled op (module doc) and return the
    :class:`Coverage`. ``rows[i]`` (a :class:`~tracer.compare.judge.TensorCheck`) was judged
    with the noise samples' entries ``noise_entries[i]`` (one per sample, None where a sample
    lacks it). A downstream row within its threshold gets status ``unmodelled`` (``ok`` with a
    note when ``accept_unmodelled``); one over its threshold keeps its status, with a note that
    its threshold may be too small."""
    cov = coverage_of(noise_readers, accept_unmodelled)
    if not cov.recorded or not cov.unmodelled:
        return cov
    for row, entries in zip(rows, noise_entries):
        before = max((int(_meta(e).get(UNMODELLED_META, 0) or 0) for e in entries if e is not None), default=0)
        if before <= 0:
            continue
        cov.downstream += 1
        note = f"after {before} unmodelled op call(s) in the noise samples: its threshold does not cover them"
        if str(row.status) == Status.OK and not accept_unmodelled:
            row.status = UNMODELLED_STATUS
        row.note = f"{row.note}; {note}" if row.note else note
    return cov


def verdict(first: Any, coverage: Coverage | None) -> str:
    """``DIVERGENT`` with a first divergence; else ``unverified`` when compared tensors depend on
    unmodelled ops the user did not accept; else ``consistent``."""
    if first is not None:
        return "DIVERGENT"
    return "unverified" if coverage is not None and not coverage.verified else "consistent"
