"""What a :class:`~.noise.NoiseInjector` saw: every torch function call, by coverage.

Each call the injector's ``TorchFunctionMode`` receives is counted, by its torch name
(``torch.nn.functional.scaled_dot_product_attention``, ``torch.Tensor.add_``), in one of three
categories:

``perturbed``
    an op with an error model (:func:`~.calls.classify`): its result got noise of its local
    bound (and, in backward, its input gradients got theirs: :mod:`.noise`);
``identical``
    an op with an error model that the candidate, by the layout the injector was given
    (:mod:`.layout`), computes with the same arithmetic as the reference: not perturbed (its
    result in a sample differs from the clean one by what its perturbed inputs carry);
``exact``
    an op that cannot round, so that a correct candidate computes it bitwise like the
    reference from the same inputs: views, reshapes, indexing and gathers (``F.embedding``'s
    forward), copies and widening casts, scalings by a power of two, comparisons, selections
    (``where``, ``max``, ``relu``, ``abs``), tensor factories, and any call whose result holds no
    floating-point tensor (integer and boolean ops, shapes, metadata);
``unmodelled``
    an op that produces a floating-point tensor by arithmetic that can round and that no
    error model covers (``torch.exp``, a tensor-by-tensor division, ``F.mse_loss``, ...): the
    noise samples carry no legitimate difference for it, so the thresholds of every tensor
    that depends on it may be too small. The comparison reports these ops and does not call
    such tensors ``ok`` (:mod:`tracer.compare.coverage`);
``optimizer``
    such an op inside the optimizer's ``step()`` (``NoiseInjector.optimizer_step``; Adam's
    ``lerp_``, ``addcmul_``, ``sqrt``, ``addcdiv_``): not perturbed, on the stated assumption
    that the candidate runs the same optimizer, whose update is elementwise, so that it
    computes each element bitwise as the reference does from the same inputs (its inputs'
    differences are the samples' own). A candidate with another optimizer implementation
    (fused vs. per-tensor kernels) breaks the assumption: its roundings are not covered;
``accepted``
    an unmodelled op the integration names, with its reason, in the injector's ``accepted``
    (e.g. a harness whose clean runs were measured within their thresholds without it): not
    perturbed, listed, and not counted as unmodelled.

The ``exact`` list is a list of names (:data:`EXACT_FUNCTIONS`): an op not on it whose result
is floating point is ``unmodelled``, never silently exact.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Any, Callable

import torch

__all__ = ["CATEGORIES", "Census", "EXACT_FUNCTIONS", "op_name", "unclassified_category"]

CATEGORIES = ("perturbed", "identical", "exact", "unmodelled", "optimizer", "accepted")

#: torch functions (by :func:`op_name`) that cannot round: their floating-point result is a
#: selection, rearrangement, copy or constant of their inputs' values
EXACT_FUNCTIONS = frozenset(
    [f"torch.Tensor.{m}" for m in (
        "__setitem__", "copy_", "zero_", "fill_", "detach_", "requires_grad_", "index_select", "gather",
        "take", "take_along_dim", "masked_fill_", "masked_select", "masked_scatter", "masked_scatter_",
        "index_put", "index_put_", "scatter", "scatter_", "index_copy", "index_copy_", "index_fill",
        "index_fill_", "abs", "abs_", "neg", "neg_", "__neg__", "__abs__", "relu", "relu_", "clamp",
        "clamp_", "clip", "clip_", "clamp_min", "clamp_min_", "clamp_max", "clamp_max_", "max", "min",
        "amax", "amin", "maximum", "minimum", "sign", "tril", "tril_", "triu", "triu_", "flip", "roll",
        "view_as", "as_strided", "movedim", "moveaxis", "swapaxes", "swapdims", "split_with_sizes",
        "new_zeros", "new_ones", "new_full", "new_empty", "new_tensor", "topk", "sort", "unfold",
        "expand", "diagonal", "diag_embed", "select", "slice_scatter", "select_scatter", "type", "cpu",
        "cuda", "pin_memory", "share_memory_", "squeeze_", "unsqueeze_", "t_", "transpose_", "resize_",
        "set_", "float", "double", "cummax", "cummin", "nan_to_num", "nan_to_num_", "where",
        "__deepcopy__", "__reduce_ex__", "__setstate__", "data_ptr", "untyped_storage", "grad.__get__")]
    + [f"torch.{f}" for f in (
        "where", "zeros", "ones", "full", "empty", "zeros_like", "ones_like", "full_like", "empty_like",
        "empty_strided", "tensor", "as_tensor", "from_numpy", "abs", "neg", "relu", "clamp", "clip",
        "max", "min", "amax", "amin", "maximum", "minimum", "sign", "tril", "triu", "flip", "roll",
        "gather", "index_select", "take", "take_along_dim", "masked_select", "scatter", "index_put",
        "movedim", "moveaxis", "swapaxes", "topk", "sort", "diagonal", "diag_embed", "select",
        "eye", "nan_to_num", "cummax", "cummin", "embedding", "dsplit", "hsplit", "vsplit",
        "tensor_split", "atleast_1d", "atleast_2d", "atleast_3d", "broadcast_to", "broadcast_tensors",
        "hstack", "vstack", "column_stack", "row_stack", "dstack", "squeeze", "unsqueeze")]
    + [f"torch.nn.functional.{f}" for f in (
        "relu", "relu_", "pad", "one_hot", "embedding", "max_pool1d", "max_pool2d", "max_pool3d")]
    + ["torch.nn.functional.dropout"]  # exact only when it is the identity: see unclassified_category
    # drawn, not computed from the run's data: a generator seeded alike draws the same values
    + [f"torch.{f}" for f in ("randn", "rand", "randint", "randn_like", "rand_like", "randint_like", "randperm",
                              "normal", "bernoulli")]
    + ["torch.Tensor.normal_", "torch.Tensor.uniform_", "torch.Tensor.random_"]
    + ["torch.arange"]  # exact only for integer values the format holds: see unclassified_category
)

_NAMES: dict[Any, str] = {}


def op_name(func: Callable) -> str:
    """A torch function's public name, e.g. ``torch.Tensor.add_`` (cached)."""
    try:
        return _NAMES[func]
    except (KeyError, TypeError):
        pass
    name = None
    try:
        name = torch.overrides.resolve_name(func)
    except Exception:  # noqa: BLE001 -- any failure: fall back to the qualified name
        name = None
    if not name:
        qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
        if qual.startswith("_VariableFunctionsClass.") or qual.startswith("_VariableFunctions."):
            name = "torch." + qual.split(".", 1)[1]
        elif qual.startswith("TensorBase.") or qual.startswith("_TensorBase."):
            name = "torch.Tensor." + qual.split(".", 1)[1]
        else:
            mod = getattr(func, "__module__", None)
            name = f"{mod}.{qual}" if mod else qual
    try:
        _NAMES[func] = name
    except TypeError:
        pass
    return name


def _floating_results(out: Any) -> bool:
    """Whether ``out`` holds a floating-point tensor (a tensor, or one in a tuple/list)."""
    if isinstance(out, torch.Tensor):
        return out.is_floating_point() or out.is_complex()
    if isinstance(out, (tuple, list)):
        return any(_floating_results(o) for o in out)
    return False


def unclassified_category(func: Callable, args: tuple, kwargs: dict, out: Any) -> str:
    """``"exact"`` or ``"unmodelled"`` for a call :func:`~.calls.classify` does not recognise
    (module doc): exact when its result holds no floating-point tensor or it is on
    :data:`EXACT_FUNCTIONS` (dropout only as the identity: ``p == 0`` or ``training=False``;
    ``copy_`` only into a format that holds the source exactly)."""
    if not _floating_results(out):
        return "exact"
    name = op_name(func)
    if name in _SCALINGS and len(args) > 1 and _power_of_two(args[1]):
        return "exact"  # an in-place scaling by 2^k: exact (barring overflow and underflow)
    if name not in EXACT_FUNCTIONS:
        return "unmodelled"
    if name == "torch.nn.functional.dropout":
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        training = args[2] if len(args) > 2 else kwargs.get("training", True)
        return "exact" if (not training or float(p) == 0.0) else "unmodelled"
    if name == "torch.Tensor.copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor):
        return "exact" if _widening(args[1].dtype, args[0].dtype) else "unmodelled"
    if name == "torch.arange":
        return "exact" if _integer_range(args, kwargs, out) else "unmodelled"
    return "exact"


def _integer_range(args: tuple, kwargs: dict, out: torch.Tensor) -> bool:
    """``torch.arange`` with integer start, end and step into a float format that holds every
    value (at most ``2^precision`` in magnitude): the values are exact."""
    bounds = [a for a in args if not isinstance(a, torch.Tensor)] + [
        kwargs[k] for k in ("start", "end", "step") if k in kwargs]
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds) or not isinstance(out, torch.Tensor):
        return False
    from ..formats import get_format
    try:
        limit = 2.0 ** get_format(out.dtype).precision
    except (KeyError, ValueError, TypeError):
        return False
    return all(abs(b) <= limit for b in bounds)


#: in-place scalings (the out-of-place ones are :func:`~.calls.classify`'s ``scale``)
_SCALINGS = frozenset({"torch.Tensor.mul_", "torch.Tensor.div_", "torch.Tensor.__imul__", "torch.Tensor.__itruediv__"})


def _power_of_two(c: Any) -> bool:
    if isinstance(c, bool) or not isinstance(c, (int, float)):
        return False
    c = float(c)
    return c != 0 and math.isfinite(c) and math.frexp(abs(c))[0] == 0.5


def _widening(src: torch.dtype, dst: torch.dtype) -> bool:
    """Does ``dst`` hold every value of ``src`` exactly (same or wider format)?"""
    if src == dst:
        return True
    if not (src.is_floating_point and dst.is_floating_point):
        return False  # an integer source may be too wide for the float format: not claimed exact
    from ..bounds.summation import conversion_exact
    from ..formats import get_format
    try:
        return conversion_exact(get_format(src), get_format(dst))
    except (KeyError, ValueError, TypeError):
        return False


class Census:
    """Call counts per category and op name, and the running count of unmodelled calls."""

    def __init__(self) -> None:
        self.counts: dict[str, Counter] = {c: Counter() for c in CATEGORIES}
        self.unmodelled_calls = 0

    def add(self, category: str, name: str) -> None:
        self.counts[category][name] += 1
        if category == "unmodelled":
            self.unmodelled_calls += 1

    def as_dict(self) -> dict[str, dict[str, int]]:
        """``{"perturbed": {op: calls}, "exact": {...}, "unmodelled": {...}, "optimizer": {...}}``
        (names sorted)."""
        return {c: dict(sorted(self.counts[c].items())) for c in CATEGORIES}

    @staticmethod
    def merged(censuses: "list[dict[str, dict[str, int]]]") -> dict[str, dict[str, int]]:
        """The sum of several :meth:`as_dict` results (e.g. the steps of one noise sample)."""
        out: dict[str, Counter] = {c: Counter() for c in CATEGORIES}
        for cen in censuses:
            for c in CATEGORIES:
                out[c].update(cen.get(c, {}))
        return {c: dict(sorted(out[c].items())) for c in CATEGORIES}
