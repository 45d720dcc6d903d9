"""Where an optimizer keeps a parameter's fp32 main copy and Adam moments, and its options.

What capture ``optim`` records after each step (:class:`tracer.adapters.megatron.MegatronTracer`,
:class:`tracer.adapters.ddp.DDPTracer`) and what :func:`tracer.capture.resync.load_state` writes back into a
reference re-synchronised to its candidate; :func:`optimizer_options`, what capture ``options``
records (the learning rate, eps, weight decay... every rank must apply the reference's; and
the range of the per-parameter step counts, :func:`state_step_range`);
:func:`cast_mismatches`, what capture ``cast`` counts (the model parameters must be the cast of
the main parameters).
"""
from __future__ import annotations

from typing import Any

import torch

from tracer.trace.schema import Phase

__all__ = ["ADAM_MOMENTS", "STEP_COUNT_OPTION", "cast_mismatches", "chained", "main_param_and_state", "optimizer_options", "param_groups",
           "state_step_range"]

#: the option (:func:`optimizer_options`) that holds the range of the per-parameter step counts
STEP_COUNT_OPTION = "state.step"
#: Adam's per-parameter state tensors (torch's names) traced by capture ``optim``
ADAM_MOMENTS = (Phase.EXP_AVG.value, Phase.EXP_AVG_SQ.value)


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
            return ({Phase.MAIN_PARAM: state["param"], **{k: state[k] for k in ADAM_MOMENTS if k in state}},
                    (r.start, r.end))
        main = getattr(p, "main_param", None)
        main = p if main is None else main
        inner = getattr(opt, "optimizer", opt)
        if any(q is main for g in inner.param_groups for q in g["params"]):
            state = inner.state.get(main, {})
            return {Phase.MAIN_PARAM: main, **{k: state[k] for k in ADAM_MOMENTS if k in state}}, None
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

    Also ``state.step`` (:data:`STEP_COUNT_OPTION`): the ``[min, max]`` of the per-parameter step counts the optimizer keeps
    (torch's Adam and AdamW: ``state[p]["step"]``, which sets the bias correction ``1 - beta^t``),
    when it keeps any. Every parameter of a correct run has been updated as often as its
    reference's, on every rank, so a count restarted on one rank (a resume that restores the
    moments but not the count) or an update skipped or repeated on one rank shows here exactly;
    such a bug moves the parameters by a fraction of an update, which Adam's legitimate sign flips
    on near-zero gradients can hide in the ``param`` comparison (docs/detection.md, close calls).

    Covers megatron-core's optimizers (a ``ChainedOptimizer`` of them; the wrapped
    ``torch.optim`` optimizer's groups and state) and a plain ``torch.optim`` optimizer."""
    values: dict[str, list[float]] = {}
    for group in param_groups(optimizer):
        for key, v in group.items():
            if key == "params":
                continue
            items = [(f"{key}.{i}", x) for i, x in enumerate(v)] if isinstance(v, (tuple, list)) else [(key, v)]
            for name, x in items:
                if isinstance(x, (int, float)) and not isinstance(x, bool):
                    values.setdefault(name, []).append(float(x))
    options = {name: torch.tensor([min(v), max(v)], dtype=torch.float64) for name, v in sorted(values.items())}
    steps = state_step_range(optimizer)
    if steps is not None:
        options[STEP_COUNT_OPTION] = steps
    return options


def state_step_range(optimizer: Any) -> torch.Tensor | None:
    """float64 ``[min, max]`` of the ``"step"`` entries of the per-parameter state of
    ``optimizer`` (every chained and wrapped ``torch.optim`` optimizer, :func:`chained`); None
    when no parameter has one (before the first update, or an optimizer without step counts).

    torch keeps a count as a 0-d tensor on the parameter's device (or a number in older
    versions); the counts of one device are stacked and reduced there, so a GPU run pays one
    transfer per device, not one per parameter."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for opt in chained(optimizer):
        for state in getattr(opt, "optimizer", opt).state.values():
            count = state.get("step") if isinstance(state, dict) else None
            if count is None:
                continue
            t = count.detach() if isinstance(count, torch.Tensor) else torch.tensor(float(count))
            by_device.setdefault(t.device, []).append(t.reshape(()).to(torch.float64))
    if not by_device:
        return None
    ranges = [torch.stack(ts).aminmax() for ts in by_device.values()]
    return torch.tensor([min(float(r.min) for r in ranges), max(float(r.max) for r in ranges)], dtype=torch.float64)


def cast_mismatches(optimizer: Any, p: torch.Tensor, chunk: int = 1 << 20) -> tuple[int, int] | None:
    """``(differing, checked)``: how many elements of model parameter ``p`` on this rank are not,
    bit for bit, the round-to-nearest-even cast of their fp32 main copy in ``optimizer``, out of
    how many.

    Mixed-precision training keeps an fp32 main copy of each bf16/fp16 parameter and, after
    every update, copies it into the model parameter with the format's own rounding (torch's
    ``copy_``/``to``: round to nearest, ties to even). So in a correct run of either layout,
    reference or candidate, ``p == cast(main)`` holds exactly, element by element, whatever
    round-off the update had: an invariant, not a tolerance. It fails when the copy rounds
    otherwise (truncation, stochastic rounding), copies a stale or misaligned range, or when
    something writes to the model parameters after the copy; a one-ulp difference per element
    is invisible to the ``param`` comparison, whose threshold admits a rounding flip per element.

    Under the distributed optimizer only this rank's range of ``p`` is checked (the range it
    updates; the others come from the all-gather, which the ``param`` replica check covers). The
    comparison is bitwise (a NaN is its cast's NaN). A ``p`` that is its own main copy (an fp32
    parameter) is equal without a look. Cost: the cast goes ``chunk`` elements at a time into
    one reused buffer, then ``torch.equal`` (early exit, no boolean tensor); elements are
    counted only in a chunk that differs. None where ``p`` has no main copy on this rank: a
    frozen parameter (``requires_grad`` false: in no param group, nothing steps it), or none
    of its elements in this rank's shard of a distributed optimizer."""
    if not p.requires_grad:
        return None
    found = main_param_and_state(optimizer, p)
    if found is None:
        return None
    tensors, rng = found
    model = p.detach().reshape(-1)
    if rng is not None:
        model = model[rng[0]:rng[1]]
    main = tensors[Phase.MAIN_PARAM].detach().reshape(-1)
    if main.shape != model.shape:
        raise ValueError(f"parameter of shape {tuple(p.shape)}: {model.numel()} model elements on this rank against "
                         f"{main.numel()} in its main copy")
    if main.dtype == model.dtype and main.data_ptr() == model.data_ptr():
        return 0, model.numel()
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[model.element_size()]
    buf = torch.empty(min(chunk, model.numel()), dtype=model.dtype)
    differing = 0
    for start in range(0, model.numel(), chunk):
        m = model[start:start + chunk]
        cast = buf[:m.numel()].copy_(main[start:start + m.numel()])
        if not torch.equal(cast.view(bits), m.view(bits)):
            differing += int(cast.view(bits).ne(m.view(bits)).sum())
    return differing, model.numel()
