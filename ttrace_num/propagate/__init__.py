"""Compose per-op bounds through a layer or model: analytic (:mod:`.shadow`, :mod:`.layer`)
and empirical (:mod:`.noise`)."""
from .layer import LayerBound, layer_tolerance, tensor_parallel_policy  # noqa: F401
from .shadow import ErrorShadow, OpRecord  # noqa: F401
