"""Where an optimizer keeps a parameter's fp32 main copy and Adam moments.

What capture ``optim`` records after each step (:class:`tracer.megatron.MegatronTracer`,
:class:`tracer.pytorch.DDPTracer`) and what :func:`tracer.resync.load_state` writes back into a
reference re-synchronised to its candidate.
"""
from __future__ import annotations

from typing import Any

import torch

from tracer.store import OPTIMIZER_STATE_PHASES

__all__ = ["ADAM_MOMENTS", "main_param_and_state"]

#: Adam's per-parameter state tensors (torch's names) traced by capture ``optim``
ADAM_MOMENTS = OPTIMIZER_STATE_PHASES[1:]


def main_param_and_state(optimizer: Any, p: torch.Tensor
                         ) -> tuple[dict[str, torch.Tensor], tuple[int, int] | None] | None:
    """The fp32 main copy of model parameter ``p`` and its Adam moments in ``optimizer``:
    ``({"main_param": t, "exp_avg": m, "exp_avg_sq": v}, rng)`` with the live tensors (the
    moments only once the optimizer has stepped). ``rng``: under the distributed
    optimizer, the range ``[start, end)`` of ``p``'s flattened elements this rank holds (the
    tensors are that flat range); None otherwise (the tensors have ``p``'s elements).
    None when a distributed optimizer holds none of ``p`` on this rank (it knows only its own
    ranges, so a param of none of its groups is None too).

    Covers megatron-core's ``DistributedOptimizer`` (its own
    ``_get_main_param_and_optimizer_states``), ``Float16OptimizerWithFloat16Params``
    (``p.main_param``), ``FP32Optimizer`` (``p`` itself), a ``ChainedOptimizer`` of them, and a
    plain ``torch.optim`` optimizer stepping ``p`` itself."""
    distributed = False
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if hasattr(opt, "_get_main_param_and_optimizer_states"):  # the distributed optimizer
            distributed = True
            if p not in opt.model_param_group_index_map:  # this rank's ranges only
                continue
            state = dict(opt._get_main_param_and_optimizer_states(p))
            r = opt._get_model_param_range_map(p)["param"]
            return {"main_param": state["param"], **{k: state[k] for k in ADAM_MOMENTS if k in state}}, (r.start, r.end)
        main = getattr(p, "main_param", None)
        main = p if main is None else main
        inner = getattr(opt, "optimizer", opt)
        if any(q is main for g in inner.param_groups for q in g["params"]):
            state = inner.state.get(main, {})
            return {"main_param": main, **{k: state[k] for k in ADAM_MOMENTS if k in state}}, None
    if distributed:
        return None
    raise ValueError(f"parameter of shape {tuple(p.shape)} is in none of the optimizer's param groups")
