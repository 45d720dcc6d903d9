"""Emulators of the computation models stated by the error models of :mod:`ttrace_num.bounds`.

Each module emulates one operator family with every intermediate rounded to its stated
format (via :func:`ttrace_num.rounding.round_to`), vectorised over the outputs. They are
the ground truth the bounds are tested against besides the real torch kernels: an
emulated computation is one that the bound claims to cover.

* :mod:`.summation`: sums, means, dot products and matmuls under a
  :class:`~ttrace_num.bounds.summation.Summation` model (order, accumulation format,
  split-K and the reduction of the partials).

:data:`EMULATIONS` names the emulation of every registered op (``ttrace_num.ops()``) that has
one (the op-coverage test, ``tests/test_op_coverage.py``, checks that every op is in it or
exempt with a reason).
"""
from .summation import emulate_matmul, emulate_mean, emulate_sum, emulate_terms

__all__ = ["emulate_sum", "emulate_mean", "emulate_matmul", "emulate_terms", "EMULATIONS"]

_G = "ttrace_num.emulate.grads:"
#: op name (``ttrace_num.ops()``) -> ``"module:function"`` of the emulation of its computation
#: model (resolve with :func:`pkgutil.resolve_name`; strings, so that importing this package
#: does not import every emulation module). ``linear`` is ``emulate_matmul`` of ``x`` and
#: ``weight^T`` (with ``bias=``); the attention and norm gradients share one emulation each,
#: which returns all their gradients.
EMULATIONS: dict[str, str] = {
    "matmul": "ttrace_num.emulate.summation:emulate_matmul",
    "linear": "ttrace_num.emulate.summation:emulate_matmul",
    "sum": "ttrace_num.emulate.summation:emulate_sum",
    "mean": "ttrace_num.emulate.summation:emulate_mean",
    "add": "ttrace_num.emulate.activations:add",
    "gelu": "ttrace_num.emulate.activations:gelu",
    "silu": "ttrace_num.emulate.activations:silu",
    "swiglu": "ttrace_num.emulate.activations:swiglu",
    "softmax": "ttrace_num.emulate.softmax:emulate_softmax",
    "log_softmax": "ttrace_num.emulate.softmax:emulate_log_softmax",
    "cross_entropy": "ttrace_num.emulate.softmax:emulate_cross_entropy",
    "vocab_parallel_cross_entropy": "ttrace_num.emulate.softmax:emulate_vocab_parallel_cross_entropy",
    "layer_norm": "ttrace_num.emulate.norms:layer_norm",
    "rms_norm": "ttrace_num.emulate.norms:rms_norm",
    "attention": "ttrace_num.emulate.attention:emulate_attention",
    "attention_dq": "ttrace_num.emulate.attention:emulate_attention_backward",
    "attention_dk": "ttrace_num.emulate.attention:emulate_attention_backward",
    "attention_dv": "ttrace_num.emulate.attention:emulate_attention_backward",
    "all_reduce": "ttrace_num.emulate.collectives:emulate_all_reduce",
    "reduce_scatter": "ttrace_num.emulate.collectives:emulate_reduce_scatter",
    "quantize": "ttrace_num.emulate.fp8:emulate_fake_quant",
    "scaled_matmul": "ttrace_num.emulate.fp8:emulate_scaled_matmul",
    "quantized_matmul": "ttrace_num.emulate.fp8:emulate_quantized_matmul",
    "linear_backward_input": _G + "emulate_linear_backward_input",
    "linear_backward_weight": _G + "emulate_linear_backward_weight",
    "linear_backward_bias": _G + "emulate_linear_backward_bias",
    "matmul_backward_a": _G + "emulate_matmul_backward_a",
    "matmul_backward_b": _G + "emulate_matmul_backward_b",
    "softmax_backward": _G + "emulate_softmax_backward",
    "log_softmax_backward": _G + "emulate_log_softmax_backward",
    "cross_entropy_backward": _G + "emulate_cross_entropy_backward",
    "layer_norm_backward_input": _G + "emulate_layer_norm_backward",
    "layer_norm_backward_weight": _G + "emulate_layer_norm_backward",
    "layer_norm_backward_bias": _G + "emulate_layer_norm_backward",
    "rms_norm_backward_input": _G + "emulate_rms_norm_backward",
    "rms_norm_backward_weight": _G + "emulate_rms_norm_backward",
    "gelu_backward": _G + "emulate_gelu_backward",
    "silu_backward": _G + "emulate_silu_backward",
}
