"""Error models, one module per operator family. Importing this package registers every
model with :func:`ttrace_num.tolerance` (see :mod:`.common` for the registry)."""
from importlib import import_module

from .base import Bound, Explanation  # noqa: F401
from .summation import Summation  # noqa: F401

#: one module per operator family; each registers its ops on import
FAMILIES = ("reduction", "matmul", "softmax", "norms", "activations", "attention", "fp8", "collectives", "grads", "losses")
for _name in FAMILIES:
    import_module(f"{__name__}.{_name}")
