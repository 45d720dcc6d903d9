"""``layer_tolerance``: the tolerance of a whole module's output, analytically.

Runs the module forward under :class:`~.shadow.ErrorShadow` and returns the composed
elementwise bound of its output(s), with the per-op breakdown (which op contributed how
much locally, and how much it inherited). See :mod:`.shadow` for the composition rule and
:mod:`.noise` for the empirical counterpart.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .shadow import ErrorShadow, ModelPolicy, OpRecord

__all__ = ["layer_tolerance", "LayerBound", "tensor_parallel_policy"]


@dataclass
class LayerBound:
    """Output(s) of the module, the elementwise bound(s) on them, and the per-op records."""

    outputs: tuple[torch.Tensor, ...]
    bounds: tuple[torch.Tensor, ...]
    records: list[OpRecord]
    mode: str
    failure_probability: float
    module_outputs: dict[str, torch.Tensor]
    module_bounds: dict[str, torch.Tensor]

    @property
    def bound(self) -> torch.Tensor:
        return self.bounds[0]

    def table(self) -> str:
        lines = [f"{'#':>3}  {'op':<11} {'module':<28} {'shape':<16} {'local max':>10} {'inherited':>10}"]
        for r in self.records:
            lines.append(f"{r.index:>3}  {r.op:<11} {r.module or '(root)':<28.28} {'x'.join(map(str, r.shape)):<16} "
                         f"{r.local_max:>10.3g} {r.propagated_max:>10.3g}")
        return "\n".join(lines)


def _install_name_hooks(module: nn.Module, shadow: ErrorShadow, outputs: dict, bounds: dict) -> list:
    """Track the module path of every op, and record each submodule's (first) output and its bound."""
    handles = []
    for name, sub in module.named_modules():
        def pre(_m, _a, name=name):
            shadow.module_stack.append(name)

        def post(_m, _a, out, name=name):
            shadow.module_stack.pop()
            first = out[0] if isinstance(out, tuple) else out
            if name and isinstance(first, torch.Tensor) and name not in outputs:
                outputs[name] = first
                bounds[name] = shadow.bound_of(first)
        handles.append(sub.register_forward_pre_hook(pre))
        handles.append(sub.register_forward_hook(post))
    return handles


def layer_tolerance(module: nn.Module, *inputs: torch.Tensor, mode: str = "probabilistic",
                    failure_probability: float = 1e-6, policy: ModelPolicy | None = None,
                    against_exact: bool = False, input_bounds: tuple[torch.Tensor | float, ...] | None = None,
                    **forward_kwargs: Any) -> LayerBound:
    """Elementwise bound on the output difference of two correct runs of ``module``
    (or, with ``against_exact=True``, on one run's distance to the exact result).

    Args:
        module: any ``nn.Module`` built from supported ops (linear, matmul, softmax,
            layer/RMS norm, GELU/SiLU, add, mul, casts, views).
        inputs: the module's inputs (the same stored values in both runs unless
            ``input_bounds`` says they already differ).
        mode: ``"probabilistic"`` (default) or ``"deterministic"``.
        failure_probability: per output element, as for every bound of the library (the
            probability that the bound fails anywhere in an output of ``N`` elements is at
            most ``N`` times that; pass ``p / N`` for a statement about the whole output).
        policy: computation models per (module path, op); see :func:`tensor_parallel_policy`.
        input_bounds: differences the inputs already carry (default 0).

    Returns :class:`LayerBound` with ``bound`` (first output), ``module_bounds`` (the bound of
    every submodule's output, by module path: what a tracer compares tensor by tensor) and
    the per-op records.
    """
    shadow = ErrorShadow(mode=mode, failure_probability=failure_probability if mode == "probabilistic" else None,
                         policy=policy, against_exact=against_exact)
    for i, x in enumerate(inputs):
        shadow.set(x, 0.0 if input_bounds is None else input_bounds[i])
    mod_out: dict[str, torch.Tensor] = {}
    mod_bound: dict[str, torch.Tensor] = {}
    handles = _install_name_hooks(module, shadow, mod_out, mod_bound)
    try:
        with torch.no_grad(), shadow:
            out = module(*inputs, **forward_kwargs)
    finally:
        for h in handles:
            h.remove()
    outs = out if isinstance(out, tuple) else (out,)
    bounds = tuple(shadow.bound_of(o) for o in outs if isinstance(o, torch.Tensor))
    return LayerBound(tuple(o for o in outs if isinstance(o, torch.Tensor)), bounds, shadow.records, mode,
                      failure_probability if mode == "probabilistic" else 0.0, mod_out, mod_bound)


def tensor_parallel_policy(row_parallel: list[str], tp: int, reduce_fmt: str = "bf16",
                           reduce_algorithm: str = "recursive") -> Callable[[str, str], Any]:
    """Policy for a reference run vs a tensor-parallel run of the same module.

    Linears whose module path matches a pattern in ``row_parallel`` (fnmatch, e.g.
    ``"*.proj"``) split their reduction dimension over ``tp`` ranks and sum the partial
    outputs with an all-reduce in ``reduce_fmt``. Every other op runs the same computation
    model on both sides (not assumed bitwise identical).
    """
    from ..bounds.summation import Summation

    split = {"summation": Summation(split=tp, reduce_fmt=reduce_fmt, reduce_algorithm=reduce_algorithm)}

    def policy(path: str, op: str):
        if op == "linear" and any(fnmatch.fnmatch(path, p) for p in row_parallel):
            return ({"summation": Summation()}, split, False)
        return None

    return policy
