"""Localisation: from the first divergent tensor to the cause.

Two tools, one question (local or propagated?):

* :func:`localise` reads the comparison's rows: what fed the first divergent tensor, and did
  it agree with the reference? A forward output whose module's inputs all agree is a wrong
  module -- unless the module's own parameters, the inputs its call does not show, already
  differ after the previous step's update (a wrong optimizer update, see :func:`localise`); a
  reduced grad whose per-rank contributions agree is a wrong reduction; an updated parameter
  whose reduced grad agrees is a wrong optimizer step; a backward that starts off by a uniform
  factor from an agreeing forward is a wrongly scaled loss.
* :func:`rerun_module` re-runs the first divergent module on the candidate's own inputs.

Re-running a module. A forward output ``y_c = f_c(x_c)`` of the candidate differs from the reference's
``y_r = f_r(x_r)`` by the module's own difference plus the propagated one:
``y_c - y_r = [f_c(x_c) - f_r(x_c)] + [f_r(x_c) - f_r(x_r)]``. Running the *reference's*
module on the *candidate's* traced inputs gives ``f_r(x_c)``, so the first bracket, the
module's own contribution, is measured alone: if it exceeds what two correct computations
of this module may differ by on these inputs, the module itself is wrong; otherwise the
divergence was carried in by its inputs (a difference too small to flag at the inputs, or
one in an untraced input).

The threshold of the local difference is derived like every other threshold
(:mod:`tracer.compare.thresholds`): the module is re-run ``samples`` times on the same inputs under
:class:`ttrace_num.propagate.noise.NoiseInjector` (forward only), and the F-test factor is
applied to the samples' deviations. With ``block_scale`` (the default), as in
:func:`tracer.compare.check.compare`, the block-scale statistic (:mod:`tracer.compare.blockscale`) is tested beside the norm, each at half
the false-alarm probability, so that a module a comparison flagged for a rescaled output is
judged by the same statistic here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tracer.capture.optim_state import STEP_COUNT_OPTION
from tracer.compare.blockscale import block_scales, verdict_ratio
from tracer.compare.deviation import block_scale_applies
from tracer.compare.judge import TensorCheck
from tracer.compare.thresholds import DEFAULT_FALSE_ALARM, noise_threshold, unmodelled_threshold
from tracer.trace.schema import Phase, Status

__all__ = ["LocalVerdict", "localise", "rerun_module", "split_inputs"]


@dataclass(frozen=True)
class LocalVerdict:
    """Result of re-running one module on the candidate's inputs."""

    module: str
    local_error: float      # ||f_c(x_c) - f_r(x_c)||_2
    threshold: float
    ratio: float            # the larger of local_error / threshold and scale_error / scale_threshold
    module_is_wrong: bool
    scale_error: float = math.nan       # block-scale statistic of the local difference (NaN: not tested)
    scale_threshold: float = math.nan

    def __str__(self) -> str:
        what = ("the module itself is wrong" if self.module_is_wrong else
                "the module is right on the candidate's inputs: the divergence is propagated")
        scale = (f"; block-scale statistic {self.scale_error:.4g} vs {self.scale_threshold:.4g}"
                 if self.scale_threshold > 0 else "")
        return (f"re-run of {self.module} on the candidate's inputs: local difference {self.local_error:.4g} "
                f"vs threshold {self.threshold:.4g}{scale} ({self.ratio:.3g}x): {what}")


def split_inputs(records: dict[str, torch.Tensor], module: str) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Positional and keyword tensors of a module call from its traced ``M.input*`` records
    (``M.input`` or ``M.input.<i>`` positional, ``M.input.<name>`` keyword)."""
    args: dict[int, torch.Tensor] = {}
    kwargs: dict[str, torch.Tensor] = {}
    prefix = f"{module}.input" if module else "input"
    for name, t in records.items():
        suffix = name[len(prefix):].lstrip(".")
        if suffix == "":
            args[0] = t
        elif suffix.isdigit():
            args[int(suffix)] = t
        elif "." not in suffix:
            kwargs[suffix] = t
    if sorted(args) != list(range(len(args))):
        raise ValueError(f"{module}: positional inputs {sorted(args)} are not contiguous; a non-tensor "
                         "argument was not traced, so the call cannot be rebuilt")
    return [args[i] for i in sorted(args)], kwargs


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"module output of type {type(out).__name__} has no leading tensor")


def rerun_module(module: nn.Module, name: str, args: list[torch.Tensor], kwargs: dict[str, torch.Tensor],
                 candidate_output: torch.Tensor, *, samples: int = 4, seed: int = 0,
                 false_alarm: float = DEFAULT_FALSE_ALARM, block_scale: bool = True,
                 **injector_kwargs: Any) -> LocalVerdict:
    """Re-run the reference's ``module`` on the candidate's inputs and judge the candidate's
    output ``candidate_output`` (the module's first output, assembled); see the module doc.
    ``injector_kwargs`` describe the two runs' computation models (e.g. the TP policy)."""
    from ttrace_num.propagate.noise import NoiseInjector
    with torch.no_grad():
        clean = _first_tensor(module(*args, **kwargs)).detach().double()
        noisy = []
        for i in range(samples):
            inj = NoiseInjector(torch.Generator().manual_seed(seed * 7919 + i), backward=False,
                                **{"mode": "probabilistic", **injector_kwargs})
            with inj:
                noisy.append(_first_tensor(module(*args, **kwargs)).detach().double())
    blocks = block_scale and block_scale_applies(Phase.FWD, clean)
    q = false_alarm / 2 if blocks else false_alarm
    th = noise_threshold(clean, noisy, q)
    if th.threshold == 0.0:
        th, blocks = unmodelled_threshold(clean, candidate_output.dtype), False
    cand = candidate_output.double()
    err = float(torch.linalg.vector_norm(cand - clean))
    ratio, scale_error, scale_threshold = verdict_ratio(
        err, th.threshold, [block_scales(clean, n, torch.float64) for n in noisy] if blocks else None,
        lambda: block_scales(clean, cand, torch.float64), q)
    return LocalVerdict(name, err, th.threshold, ratio, ratio > 1, scale_error, scale_threshold)


#: phase of the first divergence -> (which rows feed it, verdict when they all agree, verdict
#: otherwise or None)
_UPSTREAM = {
    Phase.FWD: (lambda r, f: r.phase == Phase.FWD and r.microbatch == f.microbatch
                and r.name.startswith(f.name.split(".output")[0] + ".input"),
                "module {mod} is wrong: its inputs agree with the reference (worst {worst}) but its output does not",
                "the output of {mod} diverges; its inputs diverge too or were not traced"),
    Phase.GRAD: (lambda r, f: r.phase == Phase.GRAD_LOCAL and r.name == f.name,
                 "the cross-rank reduction of {name}'s gradient is wrong: every rank's contribution agrees with "
                 "the reference (worst {worst}) but the reduced gradient does not",
                 "the gradient of {name} is already wrong before the reduction"),
    Phase.PARAM: (lambda r, f: r.phase == Phase.GRAD and r.name == f.name,
                  "the optimizer update of {name} is wrong: its reduced gradient agrees with the reference "
                  "(worst {worst})", None),
    Phase.GRAD_NORM: (lambda r, f: r.phase == Phase.GRAD,
                      "the grad norm is wrong although every reduced gradient agrees with the reference (worst "
                      "{worst}): the norm computation (which shards are counted, over which group) is wrong", None),
}


#: a parameter record at this fraction of its threshold or more counts as diverged when its
#: module's output is the first divergence of the next step (module doc of :func:`localise`)
PARAM_SUSPECT_RATIO = 0.5
#: a divergence whose norm difference ``| ||c|| - ||r|| |`` is this fraction of ``||c - r||`` or
#: more is a uniform rescaling ``c = k r`` (equality exactly when ``c`` is parallel to ``r``)
UNIFORM_SCALE = 0.95


def _key(r: TensorCheck) -> float:
    return r.ratio if math.isfinite(r.ratio) else 1e300


def _wrong_parameters(rows: list[TensorCheck], first: TensorCheck, mod: str) -> str | None:
    """A forward output diverges while its module's traced inputs agree: did the module's
    parameters (its other inputs) already differ after the previous step's update? They do when
    one of them is at :data:`PARAM_SUSPECT_RATIO` of its threshold or more, or is the worst of
    all the previous step's parameters (a wrong update a parameter threshold absorbs: Adam's
    legitimate deviation is about ``lr`` per element whatever the gradient, docs/tracing.md
    "Why a wrong update can pass the param check")."""
    prev = [r for r in rows if r.phase == Phase.PARAM and r.step == first.step - 1 and math.isfinite(_key(r))]
    own = [r for r in prev if not mod or r.name.startswith(mod + ".")]
    if not own:
        return None
    top = max(own, key=_key)
    if top.ratio < PARAM_SUSPECT_RATIO and top is not max(prev, key=_key):
        return None
    return (f"the parameters of {mod or '(root)'} differ from the reference's (worst {top.name} at "
            f"{top.ratio:.2g}x its threshold after step {first.step - 1}): the optimizer update of step "
            f"{first.step - 1} is wrong (the module's inputs agree, worst {{worst}})")


def _scaled_loss(rows: list[TensorCheck], first: TensorCheck) -> str | None:
    """The first divergence is the loss, or the first backward tensor of its microbatch, every
    forward record of that microbatch agrees, and the divergence is a uniform factor: the loss
    (or its gradient) is scaled wrongly."""
    if first.phase not in (Phase.LOSS, Phase.BWD):
        return None
    mb = [r for r in rows if r.step == first.step and r.microbatch == first.microbatch]
    fwd = [r for r in mb if r.phase == Phase.FWD]
    if not fwd or any(r.status != Status.OK for r in fwd):
        return None
    if first.phase == Phase.BWD and any(r.index < first.index for r in mb if r.phase == Phase.BWD):
        return None  # not the earliest backward tensor
    factor = first.cand_norm / first.ref_norm if first.ref_norm > 0 and math.isfinite(first.cand_norm) else math.nan
    uniform = math.isfinite(factor) and abs(first.cand_norm - first.ref_norm) >= UNIFORM_SCALE * first.error > 0
    if not (uniform or first.by_scale):
        return None
    times = f"~{factor:.4g}" if math.isfinite(factor) else "a uniform factor"
    what = "the loss" if first.phase == Phase.LOSS else "the first backward tensor"
    scalar = math.prod(first.shape) == 1
    return (f"the loss (or its gradient) is scaled wrongly: the forward agrees with the reference, {what} "
            f"({first.name}) is the reference's times {times}"
            + (" (a single number: a loss computed wrongly reads the same)" if scalar else ""))


def localise(rows: list[TensorCheck], first: TensorCheck | None) -> str:
    """Local or propagated? Look at what fed the first divergent tensor (see module doc)."""
    if first is None:
        return ""
    same = [r for r in rows if r.step == first.step]

    def worst(cands: list[TensorCheck]) -> str:
        top = max(cands, key=_key)
        return f"{top.name} at {top.ratio:.2g}x its threshold"

    if first.phase == Phase.CAST:
        return ("the model parameters are not the round-to-nearest cast of the optimizer's fp32 main copies "
                f"({first.note or 'the candidate trace names the parameters'}): the copy from main to model "
                "parameters rounds otherwise or copies the wrong range, or something writes to the model "
                "parameters after it; not round-off")
    if first.phase == Phase.OPTIONS and first.name == f"optimizer.{STEP_COUNT_OPTION}":
        where = "across ranks" if first.status == Status.REPLICAS else "from the reference's"
        return (f"the optimizer's per-parameter step counts (min and max over a rank's parameters) differ {where}"
                f"{f' ({first.note})' if first.note else ''}: a rank restarted its count (a resume that restored "
                "the moments but not the step) or skipped or repeated an update, so its Adam bias correction "
                "differs; not round-off")
    if first.status == Status.REPLICAS or "replicas over" in first.note:
        return (f"the copies of {first.name} that the candidate's metadata marks as replicated differ across "
                f"ranks ({first.note}): a reduction over that group is missing, or a rank skipped or "
                "repeated a collective on this tensor")
    upstream = _UPSTREAM.get(first.phase if first.phase != Phase.FWD or ".output" in first.name else "")
    if upstream is not None:
        feeds, if_ok, otherwise = upstream
        ins = [r for r in same if feeds(r, first)]
        name, mod = first.name, first.name.split(".output")[0]
        agree = all(r.status == Status.OK for r in ins)
        wrong_params = _wrong_parameters(rows, first, mod) if first.phase == Phase.FWD and agree else None
        if wrong_params:
            return wrong_params.format(worst=worst(ins) if ins else "none traced")
        if ins and agree:
            return if_ok.format(name=name, mod=mod or "(root)", worst=worst(ins))
        if otherwise:
            return otherwise.format(name=name, mod=mod or "(root)")
    scaled = _scaled_loss(rows, first)
    if scaled:
        return scaled
    if first.phase == Phase.OPTIONS:
        return (f"the optimizer option {first.name.removeprefix('optimizer.')} (min and max over the param "
                "groups) differs from the reference's: a configuration error, not round-off")
    if first.phase == Phase.BWD:
        return (f"the gradient flowing into {first.name.split('.output_grad')[0]} diverges first: the "
                "module that consumes this tensor computes a wrong backward (the forward agreed)")
    return f"{first.name} is the first tensor over its threshold"
