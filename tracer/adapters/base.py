"""The adapter protocol: what a framework integration gives the checker (docs/adapters.md).

An *adapter* traces one rank of a training run of one framework (megatron-core:
:class:`tracer.adapters.megatron.MegatronTracer`; plain PyTorch DDP:
:class:`tracer.adapters.ddp.DDPTracer`). Whatever the framework, the checker
(:mod:`tracer.compare.check`) relies on the same few things, and :class:`Adapter` names
them. Everything an adapter says about a tensor must come from the framework's own state
(module attributes, parameter flags, the process groups): an adapter that *assumes* a
placement reports a correct run as wrong the day the model is configured otherwise.

The members, and what the checker relies on:

* :attr:`Adapter.role` -- ``"reference"`` (the trusted run, usually one device, that also
  writes the noise samples) or ``"candidate"`` (the run under test). Informational: the
  checker takes the roles from the order of its arguments, but a tool that sets up runs
  (a harness, a benchmark) reads it.
* :attr:`Adapter.layout` -- the run's layout, the *same dict on every rank*: parallel sizes
  (``{"tp": 2, "pp": 2, "dp": 1, "sp": True}``), never a rank's coordinates. A writer records it
  in every manifest and rank 0 in ``run.json``; the reader refuses a rank whose layout differs
  from ``run.json``'s ("another model, layout or run").
* :attr:`Adapter.capture` and :attr:`Adapter.phases` -- the capture options the adapter was
  built with (framework-specific names such as ``fwd_out``, ``grad``, ``optim``) and the
  :class:`~tracer.trace.schema.Phase` values they make it record, in a step's order. Every
  record of a declared phase is recorded at the point of the step its phase names
  (:mod:`tracer.trace.schema`): the checker matches records across runs by
  ``(phase, name, microbatch, call)`` and orders them by execution index, so a record taken
  at another point of the step would be compared with the wrong tensor.
* :meth:`Adapter.canonical_name` -- the single-device name of a local module or parameter
  name (pipeline stages renumber their layers, virtual chunks prefix theirs, a tied weight
  is named once). Two runs' records match only if their canonical names do.
* :meth:`Adapter.record_placement`, :meth:`Adapter.parameter_placement` -- how this rank's
  tensor relates to the full tensor (:class:`~tracer.trace.canonical.Placement`: which dims
  are split over which group, which copies are replicated or partial sums), read from the
  module's real configuration. The checker assembles the full tensor from the placements
  alone and checks replicated copies bitwise, so a wrong placement is a reported divergence.
* the hooks' lifecycle -- :meth:`Adapter.step` (a context manager: the step's records go to
  ``writer`` or the adapter's own, flushed at its end), :meth:`Adapter.microbatch` (the local
  microbatch that starts; records carry its *global* number, so that a microbatch has the
  same number in every layout), :meth:`Adapter.after_optimizer_step` (the records taken after
  the update: ``param``, ``options``, ...; the arguments are the framework's, e.g. megatron's
  grad norm) and :meth:`Adapter.close` (removes every hook and restores what the adapter
  patched; the model then runs as if never traced).
"""
from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from tracer.trace.canonical import Placement
from tracer.trace.schema import Phase

__all__ = ["Adapter", "CAPTURE_PHASES", "Role", "phases_of"]

Role = Literal["reference", "candidate"]

#: capture option -> the phases it records (options an adapter does not know are ignored)
CAPTURE_PHASES: dict[str, tuple[Phase, ...]] = {
    "fwd_in": (Phase.FWD,), "fwd_out": (Phase.FWD,), "bwd_out": (Phase.BWD,), "bwd_in": (Phase.BWD,),
    "loss": (Phase.LOSS,), "grad_local": (Phase.GRAD_LOCAL,), "grad": (Phase.GRAD,),
    "main_grad": (Phase.MAIN_GRAD,), "grad_norm": (Phase.GRAD_NORM,), "options": (Phase.OPTIONS,),
    "cast": (Phase.CAST,), "param": (Phase.PARAM,),
    "optim": (Phase.MAIN_PARAM, Phase.EXP_AVG, Phase.EXP_AVG_SQ),
}


def phases_of(capture: Iterable[str], *, loss: bool = True, grad_norm: bool = False) -> tuple[Phase, ...]:
    """The phases that capture options ``capture`` record, in a step's order (the order of
    :class:`~tracer.trace.schema.Phase`); ``loss``/``grad_norm``: the adapter records the loss /
    the grad norm whatever the capture options say."""
    found = {ph for c in capture for ph in CAPTURE_PHASES.get(c, ())}
    if loss:
        found.add(Phase.LOSS)
    if grad_norm:
        found.add(Phase.GRAD_NORM)
    return tuple(ph for ph in Phase if ph in found)


@runtime_checkable
class Adapter(Protocol):
    """A framework integration that traces one rank (module docstring: what each member guarantees)."""

    #: ``"reference"`` or ``"candidate"``
    role: str
    #: the capture options the adapter was built with
    capture: set[str]

    @property
    def layout(self) -> dict[str, Any]:
        """The run's layout: parallel sizes, identical on every rank (no rank coordinates)."""
        ...

    @property
    def phases(self) -> tuple[Phase, ...]:
        """The phases this adapter records, in a step's order."""
        ...

    def canonical_name(self, local: str) -> str:
        """Single-device name of a local module or parameter name."""
        ...

    def record_placement(self, local: str, name: str, t: torch.Tensor) -> Placement:
        """Placement of module record ``name`` (canonical) of local module ``local``, tensor ``t``."""
        ...

    def parameter_placement(self, local: str, phase: str) -> Placement:
        """Placement of the record of parameter ``local`` (local name) in ``phase``."""
        ...

    def step(self, step: int, writer: Any = None) -> AbstractContextManager[Any]:
        """Trace optimizer step ``step`` into ``writer`` (or the adapter's own); flush at the end."""
        ...

    def microbatch(self, i: int) -> None:
        """Local microbatch ``i`` starts (records get its global number)."""
        ...

    def after_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        """Record what is recorded after the optimizer's update (framework-specific arguments)."""
        ...

    def close(self) -> None:
        """Remove every hook and restore what the adapter patched."""
        ...
