"""Exact and high-precision references (ground truth for every bound).

* :mod:`.dot` -- correctly rounded sums, dot products and matmuls (fsum, certified Dot2),
  and float64 ``|A||B|`` / ``sum|x|`` for bounds.
* :mod:`.mp` -- mpmath working precision (``workdps``), exact tensor <-> mpf
  conversion, correctly rounded mpf -> float64.
* :mod:`.ops` -- mpmath references (>= 40 digits, default 50) for softmax, log_softmax,
  cross_entropy, layer_norm, rms_norm, gelu, silu, swiglu, sum and mean; exact rational
  references for mse_loss and its gradient.
* :data:`REFERENCES` -- the exact reference of every registered op (``ttrace_num.ops()``)
  that has one, by op name (the op-coverage test, ``tests/test_op_coverage.py``, checks
  that every op is in it or exempt with a reason).

All functions take torch tensors of any real float dtype and return float64 tensors.
"""
from .dot import (Dot2Result, abs_matmul, dot2_matmul, exact_dot, exact_linear, exact_matmul,
                  exact_scaled_matmul, exact_sum, sum_abs)
from .mp import (
    DEFAULT_DPS,
    from_mpf,
    from_raw,
    get_dps,
    mpf_to_float,
    raw_to_float,
    to_mpf,
    to_raw,
    workdps,
)
from .ops import (
    cross_entropy,
    gelu,
    layer_norm,
    log_softmax,
    mean_ref,
    mse_loss,
    mse_loss_backward,
    rms_norm,
    silu,
    softmax,
    sum_ref,
    swiglu,
)

__all__ = [
    "exact_sum",
    "exact_dot",
    "exact_matmul",
    "exact_linear",
    "exact_scaled_matmul",
    "dot2_matmul",
    "Dot2Result",
    "abs_matmul",
    "sum_abs",
    "DEFAULT_DPS",
    "get_dps",
    "workdps",
    "to_mpf",
    "to_raw",
    "from_mpf",
    "from_raw",
    "mpf_to_float",
    "raw_to_float",
    "softmax",
    "log_softmax",
    "cross_entropy",
    "layer_norm",
    "rms_norm",
    "gelu",
    "silu",
    "swiglu",
    "sum_ref",
    "mean_ref",
    "mse_loss",
    "mse_loss_backward",
    "REFERENCES",
]

_G = "ttrace_num.emulate.grads:"
#: op name (``ttrace_num.ops()``) -> ``"module:function"`` of its exact reference (resolve with
#: :func:`pkgutil.resolve_name`; a string, so that this package does not import the emulation
#: modules that hold the attention and gradient references). The function computes the op's
#: exact result in float64 from the op's inputs; the attention gradients share
#: ``exact_attention_backward`` (``(dQ, dK, dV)``), the norm gradients ``exact_*_norm_backward``
#: (``(grad_x, grad_weight[, grad_bias])``); a collective's exact result is the exact sum of the
#: partials over ranks (dim 0), ``quantized_matmul``'s the exact product of the unquantized
#: operands.
REFERENCES: dict[str, str] = {
    "matmul": "ttrace_num.reference.dot:exact_matmul",
    "linear": "ttrace_num.reference.dot:exact_linear",
    "sum": "ttrace_num.reference.ops:sum_ref",
    "mean": "ttrace_num.reference.ops:mean_ref",
    "add": "ttrace_num.reference.dot:exact_sum",
    "all_reduce": "ttrace_num.reference.dot:exact_sum",
    "reduce_scatter": "ttrace_num.reference.dot:exact_sum",
    "softmax": "ttrace_num.reference.ops:softmax",
    "log_softmax": "ttrace_num.reference.ops:log_softmax",
    "cross_entropy": "ttrace_num.reference.ops:cross_entropy",
    "vocab_parallel_cross_entropy": "ttrace_num.reference.ops:cross_entropy",
    "layer_norm": "ttrace_num.reference.ops:layer_norm",
    "rms_norm": "ttrace_num.reference.ops:rms_norm",
    "gelu": "ttrace_num.reference.ops:gelu",
    "silu": "ttrace_num.reference.ops:silu",
    "swiglu": "ttrace_num.reference.ops:swiglu",
    "attention": "ttrace_num.emulate.attention:exact_attention",
    "attention_dq": "ttrace_num.emulate.attention:exact_attention_backward",
    "attention_dk": "ttrace_num.emulate.attention:exact_attention_backward",
    "attention_dv": "ttrace_num.emulate.attention:exact_attention_backward",
    "scaled_matmul": "ttrace_num.reference.dot:exact_scaled_matmul",
    "quantized_matmul": "ttrace_num.reference.dot:exact_matmul",
    "mse_loss": "ttrace_num.reference.ops:mse_loss",
    "mse_loss_backward": "ttrace_num.reference.ops:mse_loss_backward",
    "linear_backward_input": _G + "exact_linear_backward_input",
    "linear_backward_weight": _G + "exact_linear_backward_weight",
    "linear_backward_bias": _G + "exact_linear_backward_bias",
    "matmul_backward_a": _G + "exact_matmul_backward_a",
    "matmul_backward_b": _G + "exact_matmul_backward_b",
    "softmax_backward": _G + "exact_softmax_backward",
    "log_softmax_backward": _G + "exact_log_softmax_backward",
    "cross_entropy_backward": _G + "exact_cross_entropy_backward",
    "layer_norm_backward_input": _G + "exact_layer_norm_backward",
    "layer_norm_backward_weight": _G + "exact_layer_norm_backward",
    "layer_norm_backward_bias": _G + "exact_layer_norm_backward",
    "rms_norm_backward_input": _G + "exact_rms_norm_backward",
    "rms_norm_backward_weight": _G + "exact_rms_norm_backward",
    "gelu_backward": _G + "exact_gelu_backward",
    "silu_backward": _G + "exact_silu_backward",
}
