"""Injected bugs of the torchtitan-style harness (FSDP2, HSDP, DTensor TP/SP)."""
from __future__ import annotations

from examples.bug_registry import Registry

__all__ = ["BUGS", "bug"]

BUGS = Registry()
bug = BUGS.bug
