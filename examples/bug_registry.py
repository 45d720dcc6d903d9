"""Registry of injected bugs, shared by the megatron-core and the plain-PyTorch harnesses.

A bug is a small function that patches the harness (or megatron-core) for one run and
returns ``undo``; it is registered with the catalogue entry it reproduces, its class, the
layout it needs and the first divergence it must produce (``expected_phase`` and
``expected_name``, an ``fnmatch`` pattern on the canonical name). Each harness keeps one
:class:`Registry` and decides what its patch functions receive (see
``examples/megatron_cpu/bugs.py`` and ``examples/torch_parallel/bugs.py``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Bug", "Registry", "replace"]


@dataclass(frozen=True)
class Bug:
    name: str
    catalogue: str
    bug_class: str
    doc: str
    needs: dict[str, Any]
    expected_phase: str
    expected_name: str
    patch: Callable[..., Callable[[], None]] = field(repr=False)
    expected_step: int | None = None    # None: any step (most bugs show at step 0)


class Registry(dict):
    """``name -> Bug``; :meth:`bug` registers, :meth:`inject` applies one."""

    def bug(self, name: str, *, catalogue: str, bug_class: str, doc: str, needs: dict[str, Any],
            expected_phase: str, expected_name: str, expected_step: int | None = None) -> Callable:
        """Decorator: register the decorated ``patch(...) -> undo`` as bug ``name``."""
        if name in self:
            raise ValueError(f"bug {name!r} is already registered")

        def deco(fn: Callable) -> Callable:
            self[name] = Bug(name, catalogue, bug_class, doc, needs, expected_phase, expected_name, fn,
                             expected_step)
            return fn
        return deco

    def inject(self, name: str, *args: Any, **kwargs: Any) -> Callable[[], None]:
        """Apply bug ``name`` (its patch gets ``args``/``kwargs``); returns its ``undo``."""
        if name not in self:
            raise ValueError(f"unknown bug {name!r}; known: {sorted(self)}")
        return self[name].patch(*args, **kwargs)


def replace(owner: Any, name: str, new: Any) -> Callable[[], None]:
    """Set ``owner.name = new``; returns the undo that restores the attribute exactly as it was
    (the raw class-dict entry, so a staticmethod stays one)."""
    old = vars(owner)[name] if name in vars(owner) else getattr(owner, name)
    setattr(owner, name, new)
    return lambda: setattr(owner, name, old)
