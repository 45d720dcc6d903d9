"""Exact and high-precision references (ground truth for every bound).

* :mod:`.dot` -- correctly rounded sums, dot products and matmuls (fsum, certified Dot2),
  and float64 ``|A||B|`` / ``sum|x|`` for bounds.
* :mod:`.mp` -- mpmath working precision (``workdps``), exact tensor <-> mpf
  conversion, correctly rounded mpf -> float64.
* :mod:`.ops` -- mpmath references (>= 40 digits, default 50) for softmax, log_softmax,
  cross_entropy, layer_norm, rms_norm, gelu, silu, swiglu, sum and mean.

All functions take torch tensors of any real float dtype and return float64 tensors.
"""
from .dot import Dot2Result, abs_matmul, dot2_matmul, exact_dot, exact_matmul, exact_sum, sum_abs
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
]
