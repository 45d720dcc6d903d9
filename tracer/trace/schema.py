"""The trace schema: phases, record keys, manifest entries and verdict statuses, as types.

A trace is, per rank and step, a list of *records*: one traced tensor each. A record is
identified across traces (reference, candidate, noise samples) by its :class:`RecordKey`
``(phase, name, microbatch, call)``: the same canonical name, traced at the same point of
the step, for the same microbatch and the ``call``-th call of its module. Where it sits in
one rank's execution is its ``index``; how the rank's tensor relates to the full tensor is
its :class:`~tracer.trace.canonical.Placement`.

:class:`Entry` is a manifest entry parsed once (:meth:`Entry.from_dict`, the JSON written by
:class:`~tracer.trace.store.TraceWriter`); :class:`Phase` and the phase groups say what the
checker does with a record; :class:`Status` is the verdict on one compared tensor.

Phases, in a step's order (docs/tracing-storage.md):

==============  ==============================================================================
``input``       a model input (token ids, positions, labels), before the forward
``fwd``         a module's inputs and output in the forward (``<module>.input<i>``, ``.output``)
``bwd``         a module's output gradient in the backward (``<module>.output_grad``)
``loss``        the loss and per-token losses
``grad_local``  a parameter's gradient on one rank before the cross-rank reduction
``grad``        a parameter's reduced gradient (what the optimizer consumes)
``main_grad``   Megatron's fp32 ``main_grad`` buffer
``grad_norm``   the global gradient norm (clipping)
``options``     the optimizer's numeric options, compared exactly
``cast``        the model parameters as the cast of their fp32 main copies (an invariant)
``param``       a parameter after the optimizer step
``main_param``, ``exp_avg``, ``exp_avg_sq``, ``state``
                optimizer and run state, recorded for re-synchronisation only (never compared)
==============  ==============================================================================
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import orjson

from tracer.trace.canonical import Placement

__all__ = ["CARRIED_PHASES", "CHECKED_PHASES", "Entry", "INVARIANT_PHASES", "OPTIMIZER_STATE_PHASES",
           "PRE_UPDATE_PHASES", "Phase", "RecordKey", "SAME_ARITHMETIC_META", "Status"]


class Phase(str, enum.Enum):
    """Where in a training step a record was taken (module docstring). A ``str``: a phase equals,
    and hashes as, its name in a manifest (``Phase.FWD == "fwd"``)."""

    INPUT = "input"
    FWD = "fwd"
    BWD = "bwd"
    LOSS = "loss"
    GRAD_LOCAL = "grad_local"
    GRAD = "grad"
    MAIN_GRAD = "main_grad"
    GRAD_NORM = "grad_norm"
    OPTIONS = "options"
    CAST = "cast"
    PARAM = "param"
    MAIN_PARAM = "main_param"
    EXP_AVG = "exp_avg"
    EXP_AVG_SQ = "exp_avg_sq"
    STATE = "state"

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value


#: an optimizer's per-parameter state (capture ``optim``)
OPTIMIZER_STATE_PHASES = frozenset({Phase.MAIN_PARAM, Phase.EXP_AVG, Phase.EXP_AVG_SQ})
#: what a candidate records for a reference that re-synchronises to it (:mod:`tracer.capture.resync`),
#: never compared (:mod:`tracer.compare.check`): the optimizer's state and a run's own (phase
#: ``state``, e.g. FP8 amax histories)
CARRIED_PHASES = OPTIMIZER_STATE_PHASES | {Phase.STATE}
#: record meta an adapter sets on the records of a module whose *forward* computes each output
#: element as a single-device run of the same model does: its layout splits no reduction inside it
#: (:mod:`tracer.compare.exactness`)
SAME_ARITHMETIC_META = "same_forward_arithmetic"

#: records of an invariant that every correct run, reference or candidate, satisfies exactly
#: (capture ``cast``: the model parameters are the cast of their fp32 main copies): compared
#: bitwise, the noise samples left out (they perturb the very values the invariant relates)
INVARIANT_PHASES = frozenset({Phase.CAST})
#: phases a step records before its optimizer update (everything else: the parameters and
#: optimizer state after it)
PRE_UPDATE_PHASES = frozenset({Phase.INPUT, Phase.FWD, Phase.BWD, Phase.LOSS, Phase.GRAD_LOCAL, Phase.GRAD,
                               Phase.MAIN_GRAD, Phase.GRAD_NORM})
#: phases a comparison checks (every phase but the carried state)
CHECKED_PHASES = frozenset(Phase) - CARRIED_PHASES


class Status(str, enum.Enum):
    """The verdict on one compared tensor."""

    OK = "ok"                  # within its threshold
    OVER = "over"              # a statistic over its threshold
    NONFINITE = "nonfinite"    # NaN/Inf in the candidate where the reference has none
    REPLICAS = "replicas"      # copies the candidate's metadata marks as replicated differ
    UNCHECKED = "unchecked"    # compared, but no threshold applies (said why in the note)
    UNMODELLED = "unmodelled"  # downstream of an op no error model covers (not accepted by the user)

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value


class RecordKey(NamedTuple):
    """What matches a record across traces: phase, canonical name, microbatch, module call."""

    phase: str
    name: str
    microbatch: int
    call: int

    def __str__(self) -> str:
        return f"{self.phase} {self.name} mb {self.microbatch}" + (f" call {self.call}" if self.call else "")

    @classmethod
    def of(cls, entry: Entry | dict[str, Any]) -> RecordKey:
        """The key of a parsed entry, or of an entry a writer is building (its manifest dict)."""
        if isinstance(entry, Entry):
            return cls(str(entry.phase), entry.name, entry.microbatch, int(entry.meta.get("call", 0)))
        return cls(str(entry["phase"]), entry["name"], int(entry["microbatch"]), int(entry["meta"].get("call", 0)))


#: manifest fields every entry has
ENTRY_FIELDS = ("key", "name", "phase", "step", "microbatch", "index", "dtype", "shape", "placement", "meta",
                "stats")


@dataclass(frozen=True)
class Entry:
    """One manifest entry: a traced tensor of one rank and step, parsed once.

    ``key`` is the tensor's name in the rank's safetensors file; ``index`` its place in the
    rank's execution order within the step; ``placement`` how this rank's tensor maps to the
    full tensor; ``meta`` what the integration recorded about it (``module``, ``call``, ``param``,
    top-k markers, ...); ``stats`` its statistics (:mod:`tracer.trace.stats`); ``checksum`` the
    64-bit hash of its stored bytes (None in stats mode and in traces written before checksums);
    ``extra`` any other field (e.g. the moments of a noise sample, :mod:`tracer.compare.deviation`).
    """

    key: str
    name: str
    phase: str
    step: int
    microbatch: int
    index: int
    dtype: str
    shape: tuple[int, ...]
    placement: Placement
    meta: dict[str, Any]
    stats: dict[str, Any] | None
    checksum: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def record_key(self) -> RecordKey:
        return RecordKey.of(self)

    @property
    def module(self) -> str:
        """The module (or the parameter) the record belongs to, as the integration named it."""
        return str(self.meta.get("module", self.meta.get("param", "")))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Entry:
        """Parse a manifest entry (a dict with :data:`ENTRY_FIELDS`; the caller checked they are there)."""
        phase = d["phase"]
        return cls(key=d["key"], name=d["name"], phase=Phase(phase) if phase in _PHASE_NAMES else phase,
                   step=int(d["step"]), microbatch=int(d["microbatch"]), index=int(d["index"]), dtype=d["dtype"],
                   shape=tuple(int(n) for n in d["shape"]),
                   placement=_placement(d["placement"]), meta=dict(d["meta"] or {}),
                   stats=d["stats"], checksum=d.get("checksum"),
                   extra={k: v for k, v in d.items() if k not in _KNOWN_FIELDS})

    def to_dict(self) -> dict[str, Any]:
        """The manifest form (JSON-ready)."""
        out = {"key": self.key, "name": self.name, "phase": str(self.phase), "step": self.step,
               "microbatch": self.microbatch, "index": self.index, "dtype": self.dtype, "shape": list(self.shape),
               "placement": self.placement.to_dict(), "meta": self.meta, "stats": self.stats}
        if self.checksum is not None:
            out["checksum"] = self.checksum
        return {**out, **self.extra}


_PHASE_NAMES = frozenset(p.value for p in Phase)
_KNOWN_FIELDS = frozenset(ENTRY_FIELDS) | {"checksum"}
#: placements parsed so far, by their canonical JSON: a trace repeats a few placements thousands of
#: times (every replicated activation of a rank has the same one), and a Placement is immutable
_PLACEMENTS: dict[bytes, Placement] = {}


def _placement(d: dict[str, Any] | None) -> Placement:
    """:meth:`Placement.from_dict` of a manifest's placement, parsed once per distinct value."""
    key = orjson.dumps(d or {}, option=orjson.OPT_SORT_KEYS)
    p = _PLACEMENTS.get(key)
    if p is None:
        p = _PLACEMENTS[key] = Placement.from_dict(d or {})
    return p
