"""Re-synchronising a reference to its candidate at every step (per-step comparison).

A reference that runs its own trajectory compares step ``t`` of the candidate against a run
whose parameters have drifted from the candidate's by ``t`` steps of legitimate round-off,
amplified by the optimizer: Adam's update ``m / (sqrt(v) + eps)`` is ``sign(g)`` times the
learning rate at the first step, so an element whose gradient is within round-off of zero
moves by ``2 lr`` in one run and not in the other. The thresholds must then cover that drift
(the noise samples follow their own trajectories to sample it), and a corruption at step 2
must stand out of three steps' worth of drift.

Re-synchronised, the reference starts every step ``t >= 1`` from the candidate's state at the
end of step ``t - 1``: its fp32 main parameters and Adam moments, as the candidate traced them
(capture ``optim`` of :class:`tracer.adapters.megatron.MegatronTracer` or
:class:`tracer.adapters.ddp.DDPTracer`, full mode), assembled to full
tensors (:mod:`tracer.trace.canonical`) and written into the reference's optimizer; the model's
parameters are then cast from the main parameters as the optimizer does after a step. The noise
samples of the step start from that same state
(:class:`tracer.capture.noise_sampler.NoiseSampler` with ``restart=True``), so each step's thresholds cover
one step of round-off, and each step's comparison tests one step of the candidate. A bug still
shows where it acts: the step's tensors it corrupts diverge; the next step starts from the
candidate's (corrupted) state and tests that step's own computation.

Cost: the reference runs once per candidate (it needs the candidate's trace first), and the
candidate stores three more tensors per parameter (12 bytes per fp32 element). State the
optimizer does not hold (e.g. FP8 amax histories) is the run's own to record (phase
``state``, never compared) and to load (``examples/torch_parallel``: ``Run.load_fp8_state``).

    state = candidate_state(candidate_root, step - 1)
    load_state(optimizer, tracer.canonical_params(), state)   # tracer: the reference's MegatronTracer
"""
from __future__ import annotations

import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from tracer.compare.check import assembled_phases
from tracer.errors import MissingRankError, TraceError
from tracer.capture.optim_state import chained, main_param_and_state
from tracer.trace.schema import OPTIMIZER_STATE_PHASES, Phase
from tracer.trace.store import TraceReader

__all__ = ["STATE_PHASES", "ResyncWarning", "candidate_state", "load_state"]

#: what a re-synchronised reference loads, per parameter: the main copy and Adam's moments;
#: ``param`` (the model's copy) is loaded to check the cast
STATE_PHASES = (*sorted(OPTIMIZER_STATE_PHASES), Phase.PARAM)


def candidate_state(trace: str | Path, step: int) -> dict[str, dict[str, torch.Tensor]]:
    """The candidate's optimizer state at the end of ``step``: canonical parameter name ->
    ``{"main_param", "exp_avg", "exp_avg_sq", "param"}`` full tensors (assembled over ranks).

    Raises :class:`~tracer.errors.TraceError` naming the trace and step when a rank is missing,
    the step was traced in stats mode, or the trace has no optimizer state (capture ``optim``)."""
    reader = TraceReader(trace)
    missing = reader.missing_ranks(step)
    if missing:
        raise MissingRankError(f"ranks {missing} have no trace of step {step}: the reference cannot start step "
                               f"{step + 1} from the candidate's state; re-run the candidate", path=trace, step=step)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for phase, records in assembled_phases(trace, step, STATE_PHASES).items():
        if not records:
            raise TraceError(f"no '{phase}' records: trace the candidate with capture 'optim' (its main params and "
                             "Adam moments) in full mode to re-synchronise a reference to it", path=trace, step=step)
        for name, t in records.items():
            out.setdefault(name, {})[phase] = t
    return out


class ResyncWarning(UserWarning):
    """A candidate's state that a re-synchronised reference could load only by adopting the
    candidate's own model parameters (:func:`load_state`)."""


def load_state(optimizer: Any, params: Iterable[tuple[str, torch.Tensor]],
               state: dict[str, dict[str, torch.Tensor]]) -> list[str]:
    """Write ``state`` (from :func:`candidate_state`) into ``optimizer`` (megatron-core's or a
    ``torch.optim`` one, :func:`tracer.capture.optim_state.main_param_and_state`) whose model
    parameters are ``params`` ((canonical name, parameter) pairs, e.g.
    :meth:`tracer.adapters.megatron.MegatronTracer.canonical_params`; a tied copy appears under its
    original's name), then cast the main parameters to the
    model's as the optimizer does after a step, and check the cast against the candidate's own
    model parameters (bitwise: the same rounding of the same fp32 values).

    Where the cast disagrees with the candidate's parameter, the reference's model parameter
    takes the candidate's value: the candidate's next step computes with that value, and a
    re-synchronised step compares one step from the same state. The mismatch itself is a
    finding (a parameter all-gather skipped after the optimizer, a different cast) that the
    ``param`` records of the step show; it is named in a :class:`ResyncWarning`. Returns the
    names of those parameters.

    Raises ``ValueError`` naming the parameter when the two runs' parameters differ in names or
    shapes, or when the optimizer has not stepped yet (no moments to overwrite)."""
    params = list(params)
    missing = sorted({name for name, _ in params} - set(state))
    if missing:
        raise ValueError(f"the candidate's state lacks parameters {missing[:5]}{'...' if len(missing) > 5 else ''}: "
                         "trace every parameter of the candidate (no include/exclude) to re-synchronise")
    for name, p in params:
        found = main_param_and_state(optimizer, p)
        if found is None:
            continue
        tensors, rng = found
        if set(tensors) != OPTIMIZER_STATE_PHASES:
            raise ValueError(f"{name}: the reference's optimizer has no Adam moments yet (it loads the state of a "
                             "step it has taken itself: re-synchronise from step 1 on)")
        for phase, dst in tensors.items():
            src = state[name][phase]
            if src.shape != p.shape:
                raise ValueError(f"{name}: the candidate's {phase} has shape {tuple(src.shape)}, the reference's "
                                 f"parameter {tuple(p.shape)}")
            src = src.reshape(-1)[rng[0]:rng[1]] if rng is not None else src
            with torch.no_grad():
                dst.copy_(src.reshape(dst.shape))
    for opt in chained(optimizer):
        if hasattr(opt, "_copy_main_params_to_model_params"):
            opt._copy_main_params_to_model_params()
    differ = []
    for name, p in params:
        own = state[name][Phase.PARAM].to(p.device)
        if not torch.equal(p.detach(), own):
            differ.append(name)
            with torch.no_grad():
                p.copy_(own)
    if differ:
        warnings.warn(f"re-synchronising: {len(differ)} of the candidate's model parameters are not the cast of its "
                      f"main parameters ({', '.join(differ[:5])}{', ...' if len(differ) > 5 else ''}): a bug between "
                      "its optimizer and its model (e.g. a skipped parameter all-gather) or a different cast. The "
                      "reference takes the candidate's model parameters as they are, so that the next step computes "
                      "from the same weights; the comparison's 'param' records show where they differ",
                      ResyncWarning, stacklevel=2)
    return differ
