"""``layer_tolerance``: the tolerance of a whole module's output, analytically.

Runs the module forward under :class:`~.shadow.ErrorShadow` and returns the composed
elementwise bound of its output(s), with the per-op breakdown (which op contributed how
much locally, and how much it inherited). See :mod:`.shadow` for the composition rule and
:mod:`.noise` for the empirical counterpart.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..bounds.base import Bound, Explanation
from .shadow import ErrorShadow, ModelPolicy, OpRecord

__all__ = ["layer_tolerance", "LayerBound", "tensor_parallel_policy"]

SOURCE = "ttrace_num.propagate.shadow: per-op local bounds composed through the ops' Jacobians (docs/propagation.md)"


@dataclass(eq=False)
class LayerBound(Bound):
    """The bound of a module's (first) output: a :class:`~ttrace_num.Bound` like an op's
    (``abs``, ``mode``, ``failure_probability``, ``explain()``, ``max()``, ``atol_rtol()``,
    ``violations()``...; accepted by :func:`ttrace_num.testing.assert_close`), whose
    ``magnitude`` is ``|output|`` (the computed output stands for the exact one in the
    relative views), plus the other outputs' bounds and the per-op records.

    ``against_exact``: whether ``abs`` bounds one run's distance to the exact result (True)
    or the difference of two correct runs (False)."""

    outputs: tuple[torch.Tensor, ...] = ()
    bounds: tuple[torch.Tensor, ...] = ()
    records: list[OpRecord] = field(default_factory=list)
    module_outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    module_bounds: dict[str, torch.Tensor] = field(default_factory=dict)
    against_exact: bool = True

    @property
    def bound(self) -> torch.Tensor:
        """The first output's elementwise bound (``abs``)."""
        return self.abs

    def table(self) -> str:
        """Per op: its own (local) bound and the bound it inherited from its inputs."""
        lines = [f"{'#':>3}  {'op':<11} {'module':<28} {'shape':<16} {'local max':>10} {'inherited':>10}"]
        for r in self.records:
            lines.append(f"{r.index:>3}  {r.op:<11} {r.module or '(root)':<28.28} {'x'.join(map(str, r.shape)):<16} "
                         f"{r.local_max:>10.3g} {r.propagated_max:>10.3g}")
        return "\n".join(lines)

    def explain(self) -> str:
        """:meth:`Bound.explain` (what is bounded, how, with which values) and the per-op table."""
        return super().explain() + "\n" + self.table()


def _explanation(n_ops: int, mode: str, against_exact: bool, policy: bool) -> Explanation:
    what = ("one run against the exact result" if against_exact else
            "the difference of two correct runs" + (" (models per op from the policy)" if policy else
                                                   " (same model, not known to be bitwise identical)"))
    formula = ("v(out) = local(op, inputs) + |J_op| v(inputs) at every op"
               + (", upstream terms in quadrature (Azuma): b_own + lambda sqrt(sum of squares)"
                  if mode == "probabilistic" else ""))
    return Explanation(op="layer", formula=formula, source=SOURCE,
                       assumptions=(f"bounds {what}",
                                    "every op touching a shadowed tensor is modelled (else NotImplementedError)"),
                       values={"ops": n_ops, "mode": mode})


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
                    against_exact: bool | None = None, input_bounds: tuple[torch.Tensor | float, ...] | None = None,
                    **forward_kwargs: Any) -> LayerBound:
    """Elementwise bound on one run's distance to the exact result of ``module`` (the
    default: what a test of the module against a float64 reference needs), or, with
    ``against_exact=False``, on the output difference of two correct runs.

    Args:
        module: any ``nn.Module`` built from supported ops (linear, matmul, softmax,
            layer/RMS norm, GELU/SiLU, add, mul, sum/mean, casts, views).
        inputs: the module's inputs (the same stored values in both runs unless
            ``input_bounds`` says they already differ).
        mode: ``"probabilistic"`` (default) or ``"deterministic"``.
        failure_probability: per output element, as for every bound of the library (the
            probability that the bound fails anywhere in an output of ``N`` elements is at
            most ``N`` times that; pass ``p / N`` for a statement about the whole output).
        policy: computation models of two runs per (module path, op); see
            :func:`tensor_parallel_policy`. A policy describes two runs: it needs
            ``against_exact=False`` (``against_exact`` left unset means False with a policy).
        against_exact: True (default without a policy): one run vs exact; False: two runs.
        input_bounds: differences the inputs already carry (default 0).

    Returns :class:`LayerBound`, a :class:`~ttrace_num.Bound` of the first output
    (``assert_close(y, y_exact, bound=lb)``, ``lb.explain()``, ``lb.atol_rtol()``), with
    ``bounds`` (every output), ``module_bounds`` (the bound of every submodule's output, by
    module path: what a tracer compares tensor by tensor) and the per-op ``records``.
    """
    if against_exact is None:
        against_exact = policy is None
    if not isinstance(against_exact, bool):
        raise TypeError(f"against_exact must be True (one run vs exact) or False (two runs), got {against_exact!r}")
    if against_exact and policy is not None:
        raise ValueError("a policy gives the computation models of two runs, but against_exact=True bounds one run "
                         "against the exact result: pass against_exact=False to bound the two runs' difference, "
                         "or drop the policy")
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
    outs = tuple(o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor))
    if not outs:
        raise TypeError(f"{type(module).__name__} returned no tensor ({type(out).__name__}); layer_tolerance bounds "
                        "tensor outputs")
    bounds = tuple(shadow.bound_of(o) for o in outs)
    return LayerBound(abs=bounds[0], mode=mode, failure_probability=failure_probability if mode == "probabilistic" else 0.0,
                      explanation=_explanation(len(shadow.records), mode, against_exact, policy is not None),
                      magnitude=outs[0].detach().to(torch.float64).abs(), outputs=outs, bounds=bounds,
                      records=shadow.records, module_outputs=mod_out, module_bounds=mod_bound,
                      against_exact=against_exact)


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
