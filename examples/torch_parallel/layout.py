"""Parallel layout of the plain-PyTorch harness: sizes, this rank's coordinates, process groups.

A :class:`Layout` names the parallel sizes and features of one run (``tp.cp.dp`` plus
``+sp``, ``+fp8``, ``+moe``, ``+recompute``); the world is ``tp * cp * dp`` ranks, ordered
like megatron-core (tensor-parallel rank fastest, then context-parallel, then data-parallel):

    rank = tp_rank + tp * (cp_rank + cp * dp_rank)

:class:`Groups` creates every process group the model needs, collectively on all ranks
(``torch.distributed.new_group`` must be called by every rank for every group, in the same
order): ``tp``, ``cp``, ``dp`` (also the expert-parallel group: experts are sharded over the
data-parallel ranks), ``dp_cp`` (the gradient all-reduce of dense parameters), ``tp_cp``
(the ranks that share one sequence: the MoE auxiliary-loss statistics) and ``world`` (the
FP8 amax reduction group, like Transformer Engine's amax reduction over TP x CP x DP).
A group of size 1 is ``None``: the model skips its collectives.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = ["Layout", "Groups"]

_FLAGS = ("sp", "fp8", "moe", "recompute")


@dataclass(frozen=True)
class Layout:
    """Sizes and features of one run; ``Layout()`` is the single-device reference."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    sp: bool = False
    fp8: bool = False
    moe: bool = False
    recompute: bool = False

    def __post_init__(self) -> None:
        for k in ("tp", "cp", "dp"):
            if getattr(self, k) < 1:
                raise ValueError(f"layout {k} must be >= 1, got {getattr(self, k)}")
        if self.sp and self.tp == 1:
            raise ValueError("sequence parallelism needs tp > 1")

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp

    @property
    def name(self) -> str:
        return f"tp{self.tp}.cp{self.cp}.dp{self.dp}" + "".join(f"+{f}" for f in _FLAGS if getattr(self, f))

    @classmethod
    def parse(cls, name: str) -> Layout:
        """Inverse of :attr:`name`, e.g. ``"tp2.cp2.dp1+sp+fp8"``."""
        sizes, *flags = name.split("+")
        unknown = set(flags) - set(_FLAGS)
        if unknown:
            raise ValueError(f"layout {name!r}: unknown feature(s) {sorted(unknown)}; known: {_FLAGS}")
        kw: dict[str, Any] = {f: True for f in flags}
        try:
            for part in sizes.split("."):
                kw[part.rstrip("0123456789")] = int(part[len(part.rstrip("0123456789")):])
            return cls(**kw)
        except (TypeError, ValueError) as e:
            raise ValueError(f"layout {name!r} is not of the form tpT.cpC.dpD[+feature...]: {e}") from e

    def with_features(self, **kw: bool) -> Layout:
        return Layout(**{**self.__dict__, **kw})

    def reference(self) -> Layout:
        """The single-device layout with the same model features (fp8, moe, recompute)."""
        return Layout(fp8=self.fp8, moe=self.moe, recompute=self.recompute)


class Groups:
    """This rank's coordinates in ``layout`` and the process groups (``None`` for size 1)."""

    def __init__(self, layout: Layout, rank: int | None = None) -> None:
        self.layout = layout
        on = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if on else 1
        if world != layout.world:
            raise ValueError(f"layout {layout.name} needs {layout.world} ranks, the process group has {world}")
        self.rank = int(rank if rank is not None else (dist.get_rank() if on else 0))
        tp, cp = layout.tp, layout.cp
        self.tp_rank, self.cp_rank, self.dp_rank = self.rank % tp, (self.rank // tp) % cp, self.rank // (tp * cp)
        self.tp = self._group(lambda r: (r // tp), "tp")
        self.cp = self._group(lambda r: (r % tp, r // (tp * cp)), "cp")
        self.dp = self._group(lambda r: r % (tp * cp), "dp")
        self.dp_cp = self._group(lambda r: r % tp, "dp_cp")
        self.tp_cp = self._group(lambda r: r // (tp * cp), "tp_cp")
        self.world = self._group(lambda r: 0, "world")

    def _group(self, key, name: str) -> Any:
        """Partition the ranks by ``key``; create every part's group (collective), return ours."""
        n = self.layout.world
        parts: dict[Any, list[int]] = {}
        for r in range(n):
            parts.setdefault(key(r), []).append(r)
        mine = None
        for ranks in parts.values():
            if len(ranks) == 1:
                continue
            g = dist.new_group(ranks)
            if self.rank in ranks:
                mine = g
        return mine

    def size(self, group: Any) -> int:
        return 1 if group is None else dist.get_world_size(group)
