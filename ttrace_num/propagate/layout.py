r"""Noise from what the candidate's layout changes: which computations differ, and how.

A distributed candidate computes most ops exactly as the single-device reference does: a
column-parallel GEMM computes each output element from the whole reduction dimension, a norm
or an attention head sees the same values on one rank as on one device, an elementwise op is
the same kernel on the same inputs. Its arithmetic differs only in the reductions the layout
splits: the forward GEMM of a row-parallel linear (its ``K`` split over ``tp`` ranks, the
partials summed by an all-reduce or reduce-scatter in the activation dtype), the input-gradient
GEMM of a column-parallel one, the sums over tokens that sequence parallelism splits (norm
weights, biases), the data-parallel reduction, a vocabulary-parallel loss. Perturbing every op
by two runs' bounds (:class:`~.noise.NoiseInjector` without a layout) models a candidate that
rounds everywhere independently of the reference: safe, but the spread of every tensor is
then several times what the candidate can produce, and an element changed by a few percent
hides in it (issue 34: the clean TP=2 candidate is bitwise equal to its reference up to the
first row-parallel GEMM, yet the thresholds there allowed 0.8%).

A :data:`LayoutRule` tells the injector, per module and kind of computation, what the candidate
does:

* :data:`IDENTICAL`: the same arithmetic on the same inputs, hence a bitwise-equal result (given
  the same kernels: the comparison checks the kernel settings, :mod:`tracer.compare.exactness`).
  The op gets **no noise**; its result in a sample still differs from the clean one by what its
  perturbed inputs carry, rounded by the op itself, as the candidate's does.
* a :class:`~ttrace_num.bounds.summation.Summation`: the candidate computes this reduction under
  that model (e.g. ``Summation(split=2, reduce_fmt="bf16")``). The op gets noise of the
  difference between the reference's model and that one (variance-matched where it applies,
  :mod:`ttrace_num.bounds.summation_variance`, else the deterministic difference bound).
* ``None``: not known. The injector's default model (two independent runs' bounds, or its
  ``policy`` / ``variance_model`` / ``grad_summation``): what an op outside the described modules
  (a loss, the optimizer, a gradient hook) always gets.

The kinds of computation (:data:`COMPUTATIONS`): ``forward_gemm`` (a ``linear``/``matmul`` in the
module's forward), ``dgrad`` and ``wgrad`` (the input- and weight-gradient GEMMs of a linear;
a GEMM run inside a custom autograd ``backward`` is a ``dgrad`` when an operand is a
``torch.nn.Parameter``, the weight it multiplies, else a ``wgrad``), ``token_sum`` (a
parameter-like gradient summed over tokens: a norm's weight and bias, a broadcast bias, an
embedding row) and ``op`` (every other op and its backward rounding).

Which module an op belongs to: :class:`ModuleScope` keeps the stack of the modules whose forward
is running (forward hooks), the injector's ``module_of``. Gradient noise of built-in ops is set
up in forward, where the module is known; a custom ``autograd.Function``'s backward (megatron's
linears) gets the module its forward ran in (:func:`~.noise.perturb_custom_backward`).

The rule is the integration's statement about its candidates (e.g.
:func:`tracer.adapters.megatron.layout_rule`); a wrong ``IDENTICAL`` makes thresholds too tight
downstream of that op, which the clean comparisons of the detection benchmark would show as
false positives.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Union

import torch

if TYPE_CHECKING:
    from ..bounds.summation import Summation

__all__ = ["COMPUTATIONS", "IDENTICAL", "LayoutRule", "ModuleScope", "gemm_computation"]

#: the candidate computes this bitwise like the reference from the same inputs
IDENTICAL = "identical"
COMPUTATIONS = ("forward_gemm", "dgrad", "wgrad", "token_sum", "op")

#: ``rule(module_path, computation) -> IDENTICAL | Summation | None`` (module doc)
LayoutRule = Callable[[str, str], Union[str, "Summation", None]]


def gemm_computation(inputs: tuple, in_backward: bool) -> str:
    """The kind of a GEMM call: ``forward_gemm`` outside a custom backward; inside one, ``dgrad``
    when an operand is a ``torch.nn.Parameter`` (the weight the output gradient multiplies),
    else ``wgrad`` (module doc)."""
    if not in_backward:
        return "forward_gemm"
    return "dgrad" if any(isinstance(t, torch.nn.Parameter) for t in inputs) else "wgrad"


class ModuleScope:
    """The qualified name of the innermost module whose forward is running (``""`` outside every
    module, and for the root): call the instance. Installs a forward pre-hook and a forward hook
    (run also when the forward raises) on every submodule of ``model``; :meth:`remove` takes them
    off. Names are ``model.named_modules()``'s."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._stack: list[str] = []
        self._handles = []
        for name, module in model.named_modules():
            if not name:
                continue
            self._handles.append(module.register_forward_pre_hook(self._enter(name)))
            self._handles.append(module.register_forward_hook(self._leave(name), always_call=True))

    def _enter(self, name: str):
        def hook(module, args):
            self._stack.append(name)
        return hook

    def _leave(self, name: str):
        def hook(module, args, output):
            if self._stack and self._stack[-1] == name:
                self._stack.pop()
        return hook

    def __call__(self) -> str:
        return self._stack[-1] if self._stack else ""

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._stack.clear()
