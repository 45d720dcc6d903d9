"""Recognise a torch function call as one of the modelled ops.

:func:`classify` is the single table that maps torch functions to the library's op names,
their inputs and keyword arguments, and their propagation rule. Both the analytic error
shadow (:mod:`.shadow`) and the empirical noise injector (:mod:`.noise`) use it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..bounds.reduction import reduced_dims
from . import jacobian as J

__all__ = ["OpCall", "classify", "STRUCTURAL"]

Getter = Callable[[Any], "torch.Tensor | None"]

STRUCTURAL = {
    torch.Tensor.reshape, torch.reshape, torch.Tensor.view, torch.Tensor.transpose, torch.transpose,
    torch.Tensor.permute, torch.permute, torch.Tensor.contiguous, torch.Tensor.__getitem__,
    torch.Tensor.split, torch.split, torch.Tensor.chunk, torch.chunk, torch.Tensor.unbind, torch.unbind,
    torch.Tensor.flatten, torch.flatten, torch.Tensor.unflatten, torch.Tensor.squeeze, torch.squeeze,
    torch.Tensor.unsqueeze, torch.unsqueeze, torch.Tensor.expand, torch.Tensor.expand_as, torch.cat,
    torch.concat, torch.stack, torch.Tensor.narrow, torch.narrow, torch.Tensor.t, torch.t,
    torch.Tensor.clone, torch.clone, torch.Tensor.detach, torch.Tensor.repeat_interleave,
    torch.repeat_interleave, torch.Tensor.repeat,
}
_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.mm, torch.Tensor.bmm, torch.Tensor.mm}
_SOFTMAX = {torch.softmax, F.softmax, torch.Tensor.softmax}
_ADD = {torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__,
        torch.sub, torch.Tensor.sub, torch.Tensor.__sub__, torch.Tensor.__rsub__}
_MUL = {torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__}
_DIV = {torch.div, torch.Tensor.div, torch.Tensor.__truediv__}
_CASTS = {torch.Tensor.to, torch.Tensor.float, torch.Tensor.bfloat16, torch.Tensor.half, torch.Tensor.double,
          torch.Tensor.type_as}
_MASKED_FILL = {torch.Tensor.masked_fill, torch.masked_fill}
_SUM = {torch.sum, torch.Tensor.sum}  # over any dims: the library's ``sum`` model
_MEAN = {torch.mean, torch.Tensor.mean}  # over any dims: the library's ``mean`` model
_LOG_SOFTMAX = {torch.log_softmax, F.log_softmax, torch.Tensor.log_softmax}
_SDPA = getattr(F, "scaled_dot_product_attention", None)


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _reduction_dims(dim: Any) -> bool:
    """``dim`` of a ``torch.sum``/``torch.mean`` call the ``sum``/``mean`` models take: None
    (every dim), an int, or a tuple/list of ints."""
    return dim is None or isinstance(dim, int) or (isinstance(dim, (tuple, list)) and all(isinstance(d, int) for d in dim))


@dataclass
class OpCall:
    """A recognised call.

    ``kind``: ``"op"`` (a registered error model: ``op``, ``inputs``, ``kwargs`` go to
    :func:`ttrace_num.tolerance`), ``"rounding"`` (an elementwise result rounded once into
    the output format: scalar add/mul, elementwise mul, casts; ``exact`` when it cannot
    round), ``"structural"`` (exact; apply the same call to the shadows), ``"masked_fill"``
    or ``"index"`` (an exact gather of rows of ``inputs[0]``: ``F.embedding``; ``kwargs``
    hold the indices).
    ``propagate(get, out)`` returns ``|J| v`` given the shadow getter; ``propagate_sq(get, out)``
    returns ``sum_j J_ij^2 w_j`` for squared scales ``w`` (quadrature mode).
    """

    kind: str
    op: str
    inputs: tuple = ()
    kwargs: dict = field(default_factory=dict)
    propagate: Callable[[Getter, Any], Any] | None = None
    propagate_sq: Callable[[Getter, Any], Any] | None = None
    exact: bool = False


def _pow2(c: float) -> bool:
    return c != 0 and math.isfinite(c) and math.frexp(abs(c))[0] == 0.5


def classify(func: Callable, args: tuple, kwargs: dict) -> OpCall | None:
    """The :class:`OpCall` for ``func(*args, **kwargs)``, or None if it is not modelled."""
    if func in STRUCTURAL or getattr(func, "__name__", "") == "__get__":  # views; .T/.mT/.data
        return OpCall("structural", "view")
    if func in _MASKED_FILL:
        return OpCall("masked_fill", "masked_fill", kwargs={"mask": _arg(args, kwargs, 1, "mask")})
    if func is F.linear:
        x, w, b = args[0], args[1], _arg(args, kwargs, 2, "bias")
        return OpCall("op", "linear", (x, w) + ((b,) if b is not None else ()), {},
                      lambda g, out: J.linear(x, w, g(x), g(w), g(b)),
                      lambda g, out: J.linear_sq(x, w, g(x), g(w), g(b)))
    if func in _MATMUL:
        a, b = args[0], args[1]
        return OpCall("op", "matmul", (a, b), {}, lambda g, out: J.matmul(a, b, g(a), g(b)),
                      lambda g, out: J.matmul_sq(a, b, g(a), g(b)))
    if func in _SOFTMAX:
        x, dim = args[0], _arg(args, kwargs, 1, "dim", -1)
        return OpCall("op", "softmax", (x,), {"dim": dim}, lambda g, out: J.softmax(out, _z(g, x), dim),
                      lambda g, out: J.softmax_sq(out, _z(g, x), dim))
    if func is F.layer_norm:
        x, shape = args[0], tuple(args[1])
        w, b, eps = _arg(args, kwargs, 2, "weight"), _arg(args, kwargs, 3, "bias"), _arg(args, kwargs, 4, "eps", 1e-5)
        return OpCall("op", "layer_norm", (x,), dict(normalized_shape=shape, weight=w, bias=b, eps=eps),
                      lambda g, out: J.layer_norm(x, shape, w, g(x), g(w), g(b), eps),
                      lambda g, out: J.layer_norm_sq(x, shape, w, g(x), g(w), g(b), eps))
    if getattr(F, "rms_norm", None) is not None and func is F.rms_norm:
        x, shape = args[0], tuple(args[1])
        w, eps = _arg(args, kwargs, 2, "weight"), _arg(args, kwargs, 3, "eps")
        eps = torch.finfo(x.dtype).eps if eps is None else eps
        return OpCall("op", "rms_norm", (x,), dict(normalized_shape=shape, weight=w, eps=eps),
                      lambda g, out: J.rms_norm(x, shape, w, g(x), g(w), eps),
                      lambda g, out: J.rms_norm_sq(x, shape, w, g(x), g(w), eps))
    if func is F.gelu:
        x, approx = args[0], _arg(args, kwargs, 1, "approximate", "none")
        return OpCall("op", "gelu", (x,), {"approximate": approx}, lambda g, out: J.gelu(x, _z(g, x), approx),
                      lambda g, out: J.gelu_sq(x, _z(g, x), approx))
    if func is F.silu:
        x = args[0]
        return OpCall("op", "silu", (x,), {}, lambda g, out: J.silu(x, _z(g, x)),
                      lambda g, out: J.silu_sq(x, _z(g, x)))
    if func in _ADD or func in _MUL or func in _DIV:
        x, y = args[0], args[1]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if func in _ADD:
                return OpCall("op", "add", (x, y), {}, lambda g, out: J.add(g(x), g(y)),
                              lambda g, out: J.add_sq(g(x), g(y)))
            if func in _MUL:
                return OpCall("rounding", "mul", (x, y), {}, lambda g, out: J.mul(x, y, g(x), g(y)),
                              lambda g, out: J.mul_sq(x, y, g(x), g(y)))
            return None  # tensor / tensor: no model
        t, c = (x, y) if isinstance(x, torch.Tensor) else (y, x)
        if func in _ADD:
            return OpCall("rounding", "add_scalar", (t,), {}, lambda g, out: g(t), lambda g, out: g(t))
        factor = 1.0 / float(c) if func in _DIV else float(c)
        return OpCall("rounding", "scale", (t,), {}, lambda g, out: J.scale(_z(g, t), factor),
                      lambda g, out: J.scale_sq(_z(g, t), factor), exact=_pow2(factor))
    if func in _SUM:
        x, dim = args[0], _arg(args, kwargs, 1, "dim")
        keepdim = bool(_arg(args, kwargs, 2, "keepdim", False))
        if _reduction_dims(dim) and _arg(args, kwargs, 3, "dtype") is None and isinstance(x, torch.Tensor):
            return OpCall("op", "sum", (x,), {"dim": dim, "keepdim": keepdim},
                          lambda g, out: _z(g, x).sum(dim, keepdim=keepdim),
                          lambda g, out: _z(g, x).sum(dim, keepdim=keepdim))
        return None
    if func in _CASTS:
        x = args[0]
        return OpCall("rounding", "cast", (x,), {}, lambda g, out: g(x), lambda g, out: g(x))
    if func in _MEAN:
        x, dim = args[0], _arg(args, kwargs, 1, "dim")
        keepdim = bool(_arg(args, kwargs, 2, "keepdim", False))
        if _reduction_dims(dim) and _arg(args, kwargs, 3, "dtype") is None and isinstance(x, torch.Tensor):
            n = math.prod(x.shape[d] for d in reduced_dims("mean", x, dim))
            return OpCall("op", "mean", (x,), {"dim": dim, "keepdim": keepdim},
                          lambda g, out: _z(g, x).sum(dim, keepdim=keepdim) / n,
                          lambda g, out: _z(g, x).sum(dim, keepdim=keepdim) / (n * n))
        return None
    if func in _LOG_SOFTMAX:
        x, dim = args[0], _arg(args, kwargs, 1, "dim", -1)
        if _arg(args, kwargs, 3 if func is F.log_softmax else 2, "dtype") is not None or dim is None:
            return None
        return OpCall("op", "log_softmax", (x,), {"dim": dim}, _no_rule("log_softmax"), _no_rule("log_softmax"))
    if _SDPA is not None and func is _SDPA:
        return _sdpa(args, kwargs)
    if func is F.cross_entropy:
        return _cross_entropy(args, kwargs)
    if func is F.mse_loss:
        x, t = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "target")
        if (_arg(args, kwargs, 2, "size_average") is not None or _arg(args, kwargs, 3, "reduce") is not None
                or not (isinstance(x, torch.Tensor) and isinstance(t, torch.Tensor)) or x.shape != t.shape
                or x.dtype != t.dtype or kwargs.get("weight") is not None):
            return None  # legacy arguments, broadcasting, mixed dtypes, weights: not modelled
        return OpCall("op", "mse_loss", (x, t), {"reduction": _arg(args, kwargs, 4, "reduction", "mean")},
                      _no_rule("mse_loss"), _no_rule("mse_loss"))
    if func is F.embedding:
        idx, w = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight")
        if (_arg(args, kwargs, 3, "max_norm") is not None or _arg(args, kwargs, 5, "scale_grad_by_freq", False)
                or _arg(args, kwargs, 6, "sparse", False) or not isinstance(w, torch.Tensor)):
            return None  # renormalised rows, frequency-scaled or sparse gradients: not modelled
        return OpCall("index", "embedding", (w,), {"indices": idx, "padding_idx": _arg(args, kwargs, 2, "padding_idx")},
                      lambda g, out: F.embedding(idx, _z(g, w)), lambda g, out: F.embedding(idx, _z(g, w)),
                      exact=True)
    return None


def _no_rule(op: str) -> Callable[[Getter, Any], Any]:
    """Propagation rule of an op the noise injector models but the analytic shadow does not."""
    def rule(g: Getter, out: Any) -> Any:
        raise NotImplementedError(f"ErrorShadow: no propagation rule for {op}; its error model is used by the "
                                  "empirical noise injector (ttrace_num.propagate.noise)")
    return rule


def _sdpa(args: tuple, kwargs: dict) -> OpCall | None:
    """``F.scaled_dot_product_attention``: the ``attention`` model of the kernel torch runs on
    CPU (:func:`ttrace_num.bounds.attention.torch_cpu_sdpa_model`: online softmax over key blocks
    of 512, ``P`` stored in the input dtype, fp32 accumulation, ``exp_u20``). With dropout
    (random) the call is not modelled."""
    from ..bounds.attention import torch_cpu_sdpa_model
    q, k, v = (_arg(args, kwargs, i, n) for i, n in enumerate(("query", "key", "value")))
    if float(_arg(args, kwargs, 4, "dropout_p", 0.0) or 0.0) != 0.0 or not all(
            isinstance(t, torch.Tensor) and t.is_floating_point() for t in (q, k, v)):
        return None
    kw = dict(attn_mask=_arg(args, kwargs, 3, "attn_mask"), is_causal=bool(_arg(args, kwargs, 5, "is_causal", False)),
              scale=_arg(args, kwargs, 6, "scale"), enable_gqa=bool(kwargs.get("enable_gqa", False)))
    return OpCall("op", "attention", (q, k, v), {**kw, **torch_cpu_sdpa_model(q)},
                  _no_rule("attention"), _no_rule("attention"))


def _cross_entropy(args: tuple, kwargs: dict) -> OpCall | None:
    """``F.cross_entropy`` of ``(N, C)`` logits and class-index targets without class weights
    (the ``cross_entropy`` model); other forms are not modelled."""
    x, t = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "target")
    if (_arg(args, kwargs, 2, "weight") is not None or _arg(args, kwargs, 3, "size_average") is not None
            or _arg(args, kwargs, 5, "reduce") is not None or not isinstance(x, torch.Tensor) or x.dim() != 2
            or not isinstance(t, torch.Tensor) or t.is_floating_point()):
        return None
    kw = dict(reduction=_arg(args, kwargs, 6, "reduction", "mean"),
              label_smoothing=float(_arg(args, kwargs, 7, "label_smoothing", 0.0)),
              ignore_index=int(_arg(args, kwargs, 4, "ignore_index", -100)))
    return OpCall("op", "cross_entropy", (x, t), kw, _no_rule("cross_entropy"), _no_rule("cross_entropy"))


def _z(g: Getter, t: torch.Tensor) -> torch.Tensor:
    v = g(t)
    return torch.zeros(t.shape, dtype=torch.float64) if v is None else v
