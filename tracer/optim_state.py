"""Where an optimizer keeps a parameter's fp32 main copy and Adam moments, and its options.

What capture ``optim`` records after each step (:class:`tracer.megatron.MegatronTracer`,
:class:`tracer.pytorch.DDPTracer`) and what :func:`tracer.resync.load_state` writes back into a
reference re-synchronised to its candidate; :func:`optimizer_options`, what capture ``options``
records (the learning rate, eps, weight decay... every rank must apply the reference's).
"""
from __future__ import annotations

from typing import Any

import torch

from tracer.store import OPTIMIZER_STATE_PHASES

__all__ = ["ADAM_MOMENTS", "chained", "main_param_and_state", "optimizer_options", "param_groups"]

#: Adam's per-parameter state tensors (torch's names) traced by capture ``optim``
ADAM_MOMENTS = OPTIMIZER_STATE_PHASES[1:]


def chained(optimizer: Any) -> list[Any]:
    """The optimizers of a megatron-core ``ChainedOptimizer``, or ``[optimizer]``."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def param_groups(optimizer: Any) -> list[dict[str, Any]]:
    """Every param group of ``optimizer``: of each chained optimizer (:func:`chained`), the
    groups of the ``torch.optim`` optimizer it wraps (``.optimizer``), or its own."""
    return [g for opt in chained(optimizer) for g in getattr(opt, "optimizer", opt).param_groups]


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
    for opt in chained(optimizer):
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


def optimizer_options(optimizer: Any) -> dict[str, torch.Tensor]:
    """The numeric options of the optimizer's param groups on this rank: option name ->
    float64 ``[min, max]`` over the groups (``betas`` as ``betas.0`` and ``betas.1``).

    Every rank of a correct run applies the same options as its single-device reference (the
    learning rate, Adam's ``eps`` and betas, the weight decay, megatron's ``lr_mult`` /
    ``wd_mult``), so these few numbers are compared exactly (no noise sample moves them): a
    configuration that differs on one rank or from the reference shows here even where its
    effect on the parameters is below their storage precision (an eps of 1e-6 instead of 1e-8
    moves bf16 parameters by less than their rounding). Booleans and non-numbers are left out.

    Covers megatron-core's optimizers (a ``ChainedOptimizer`` of them; the wrapped
    ``torch.optim`` optimizer's groups) and a plain ``torch.optim`` optimizer."""
    values: dict[str, list[float]] = {}
    for group in param_groups(optimizer):
        for key, v in group.items():
            if key == "params":
                continue
            items = [(f"{key}.{i}", x) for i, x in enumerate(v)] if isinstance(v, (tuple, list)) else [(key, v)]
            for name, x in items:
                if isinstance(x, (int, float)) and not isinstance(x, bool):
                    values.setdefault(name, []).append(float(x))
    return {name: torch.tensor([min(v), max(v)], dtype=torch.float64) for name, v in sorted(values.items())}
