"""Local or propagated? Re-run the first divergent module on the candidate's own inputs.

A forward output ``y_c = f_c(x_c)`` of the candidate differs from the reference's
``y_r = f_r(x_r)`` by the module's own difference plus the propagated one:
``y_c - y_r = [f_c(x_c) - f_r(x_c)] + [f_r(x_c) - f_r(x_r)]``. Running the *reference's*
module on the *candidate's* traced inputs gives ``f_r(x_c)``, so the first bracket, the
module's own contribution, is measured alone: if it exceeds what two correct computations
of this module may differ by on these inputs, the module itself is wrong; otherwise the
divergence was carried in by its inputs (a difference too small to flag at the inputs, or
one in an untraced input).

The threshold of the local difference is derived like every other threshold
(:mod:`tracer.thresholds`): the module is re-run ``samples`` times on the same inputs under
:class:`ttrace_num.propagate.noise.NoiseInjector` (forward only), and the F-test factor is
applied to the samples' deviations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tracer.thresholds import DEFAULT_FALSE_ALARM, noise_threshold, unmodelled_threshold

__all__ = ["LocalVerdict", "rerun_module", "split_inputs"]


@dataclass(frozen=True)
class LocalVerdict:
    """Result of re-running one module on the candidate's inputs."""

    module: str
    local_error: float      # ||f_c(x_c) - f_r(x_c)||_2
    threshold: float
    ratio: float
    module_is_wrong: bool

    def __str__(self) -> str:
        what = ("the module itself is wrong" if self.module_is_wrong else
                "the module is right on the candidate's inputs: the divergence is propagated")
        return (f"re-run of {self.module} on the candidate's inputs: local difference {self.local_error:.4g} "
                f"vs threshold {self.threshold:.4g} ({self.ratio:.3g}x): {what}")


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
                 false_alarm: float = DEFAULT_FALSE_ALARM, **injector_kwargs: Any) -> LocalVerdict:
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
    th = noise_threshold(clean, noisy, false_alarm)
    if th.threshold == 0.0:
        th = unmodelled_threshold(clean, candidate_output.dtype)
    err = float(torch.linalg.vector_norm(candidate_output.double() - clean))
    ratio = err / th.threshold if th.threshold > 0 else (0.0 if err == 0 else float("inf"))
    return LocalVerdict(name, err, th.threshold, ratio, ratio > 1)
