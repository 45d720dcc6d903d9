"""Error models, one module per operator family. Importing this package registers every
model with :func:`ttrace_num.tolerance` (see :mod:`.common` for the registry)."""
from importlib import import_module

from .base import Bound, Explanation  # noqa: F401
from .summation import Summation  # noqa: F401

# one module per operator family; each registers its ops on import
_FAMILIES = ("reduction", "matmul", "softmax", "norms", "activations", "attention", "fp8", "collectives")
for _name in _FAMILIES:
    try:
        import_module(f"{__name__}.{_name}")
    except ModuleNotFoundError as e:  # a family not written yet
        if e.name != f"{__name__}.{_name}":
            raise
