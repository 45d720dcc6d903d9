"""Canonical mapping: shards of a distributed run <-> full (single-device) tensors.

A traced tensor of a parallel run is one rank's *piece* of the tensor a single device
would hold.  A :class:`Placement` says how: an ordered list of :class:`ShardDim` s, each
``(dim, group, rank, size, kind)`` -- the unsharding spec of SGLang's comparator dims
annotations (``h[tp]``, ``t[cp:zigzag]``, ``partial``, replicated axes), written as
data.  Kinds:

``contiguous``
    ``dim`` is split into ``size`` consecutive blocks, block ``rank`` held here
    (TP column-parallel weight dim 0, row-parallel weight dim 1, vocab-parallel
    embedding/logits, SP sequence shards, EP expert shards).
``zigzag``
    context-parallel load balancing: ``dim`` is cut into ``2*size`` chunks and rank
    ``r`` holds chunks ``r`` and ``2*size-1-r``, concatenated in that order.
``partial``
    pending sum: the full tensor is the SUM over the group (row-parallel linear output
    before its all-reduce, a reduce-scatter input).  ``dim`` is ``None``.
``replicated``
    every rank of the group holds the full tensor (DP replicas, TP-replicated
    layernorm weights); the copies are *compared*, never silently merged.
``flat_shard``
    distributed optimizer: this rank holds the range ``[start, end)`` of the flattened
    tensor of shape ``shape`` (which is the tensor at this level, e.g. the TP-local
    parameter); ``dim`` is ``None``.  Ranks that own no part may be absent.

Order: ``shard`` applies the dims in list order (outermost first) and :func:`assemble`
undoes them in reverse, so a ``flat_shard`` of a TP-local parameter is listed *after*
the TP dim.  Dims on different tensor axes commute.

Numerics.  Contiguous, zigzag, replicated and flat_shard assembly is pure data
movement: ``assemble(shard(x))`` is bitwise ``x``.  A partial group is summed in
float64 (any order; exact while every partial sum of integers stays below 2**53;
otherwise, for ``k`` bf16/fp16/fp32 partials, |error| <= gamma_{k-1}(fp64) sum_i |x_i|
with gamma_n = n 2**-53 / (1 - n 2**-53), far below the storage format's unit
roundoff: Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., §4.2), so
the assembled tensor is float64 and :class:`AssemblyReport` also carries it rounded once
to the original dtype.  The
candidate's real all-reduce rounded at every hop in its own order: that difference is
the collective bound's job (``ttrace_num.bounds.collectives``), applied by the checker,
not here.

Pipeline parallel: module names are local to a stage (``decoder.layers.0`` on every
stage); :func:`global_layer_name` renumbers them with Megatron's offset,
:func:`layer_offset` (mirrors megatron-core 0.16.1
``megatron/core/transformer/transformer_layer.py::get_transformer_layer_offset``,
which ``TransformerBlock`` uses to set ``layer_number``), and
:func:`global_expert_name` does the same for EP-local experts.
"""
from __future__ import annotations

import itertools
import re
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

_DIM_TOKEN = re.compile(r"^([A-Za-z_]\w*)(?:\(([^)]+)\))?$")
KINDS = ("contiguous", "zigzag", "partial", "replicated", "flat_shard")
_DIM_KINDS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class ShardDim:
    """One level of sharding: how this rank's tensor relates to the next-outer one."""

    dim: int | None
    group: str
    rank: int
    size: int
    kind: str = "contiguous"
    start: int | None = None       # flat_shard only
    end: int | None = None         # flat_shard only
    shape: tuple[int, ...] | None = None  # flat_shard only: shape before flattening

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown shard kind {self.kind!r}; expected one of {KINDS}")
        if not (isinstance(self.size, int) and self.size >= 1 and 0 <= self.rank < self.size):
            raise ValueError(f"{self.group}: need 0 <= rank < size, got rank {self.rank}, size {self.size}")
        if self.kind in _DIM_KINDS and not isinstance(self.dim, int):
            raise ValueError(f"{self.kind} shard over {self.group} needs an integer dim")
        if self.kind not in _DIM_KINDS and self.dim is not None:
            raise ValueError(f"{self.kind} shard over {self.group} takes dim=None, got {self.dim}")
        if self.kind == "flat_shard":
            if self.start is None or self.end is None or self.shape is None:
                raise ValueError(f"flat_shard over {self.group} needs start, end and shape")
            object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
            if not 0 <= self.start <= self.end <= _numel(self.shape):
                raise ValueError(f"flat_shard over {self.group}: range [{self.start}, {self.end}) "
                                 f"outside [0, {_numel(self.shape)}) of shape {self.shape}")
        elif (self.start, self.end, self.shape) != (None, None, None):
            raise ValueError(f"start/end/shape apply to flat_shard only, not {self.kind}")

    def signature(self) -> tuple:
        """What every rank of one tensor must agree on at this level (not rank, range)."""
        return (self.dim, self.group, self.size, self.kind, self.shape)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"dim": self.dim, "group": self.group, "rank": self.rank,
                             "size": self.size, "kind": self.kind}
        if self.kind == "flat_shard":
            d.update(start=self.start, end=self.end, shape=list(self.shape))
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShardDim:
        try:
            shape = d.get("shape")
            return cls(dim=d.get("dim"), group=d["group"], rank=int(d["rank"]), size=int(d["size"]),
                       kind=d.get("kind", "contiguous"), start=d.get("start"), end=d.get("end"),
                       shape=None if shape is None else tuple(shape))
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a shard-dim dict ({e!r}): {d!r}") from e


@dataclass(frozen=True)
class Placement:
    """How one rank's tensor relates to the canonical full tensor.

    ``dims`` outermost first; ``full_shape`` (optional) is checked after assembly.
    ``valid_shape`` (optional, needs ``full_shape``) crops padding off the assembled
    tensor, e.g. Megatron's vocab padded to a multiple of ``make_vocab_size_divisible_by
    * tp`` (which differs between a TP=1 reference and a TP=8 candidate): entries are
    the true extents, ``None`` keeps an axis whole.
    ``to_dict``/``from_dict`` give the JSON dict the trace store keeps per tensor.
    """

    dims: tuple[ShardDim, ...] = ()
    full_shape: tuple[int, ...] | None = None
    valid_shape: tuple[int | None, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dims", tuple(self.dims))
        if self.full_shape is not None:
            object.__setattr__(self, "full_shape", tuple(int(s) for s in self.full_shape))
        if self.valid_shape is not None:
            v = tuple(None if x is None else int(x) for x in self.valid_shape)
            object.__setattr__(self, "valid_shape", v)
            fs = self.full_shape
            if fs is None or len(v) != len(fs) or any(x is not None and not 0 <= x <= f
                                                       for x, f in zip(v, fs)):
                raise ValueError(f"valid_shape {v} must lie within full_shape {fs}")

    @classmethod
    def from_dims(cls, spec: str, ranks: dict[str, int], sizes: dict[str, int],
                  replicated: tuple[str, ...] = (), full_shape: tuple[int, ...] | None = None) -> Placement:
        """Placement from an SGLang-comparator-style dims annotation.

        ``spec`` names each tensor axis in order, e.g. ``"b s(cp,zigzag) h(tp) d"``
        (as ``sglang/srt/debug_utils/comparator/dims.py``): ``name(group)`` is a
        contiguous shard over ``group``, ``name(group,zigzag)`` a zigzag shard,
        ``name(group,partial)`` a pending sum over ``group`` (the axis itself unsplit).
        Group names are free identifiers looked up in ``ranks``/``sizes``; groups of size
        1 are dropped.  ``replicated`` groups become innermost replicated levels, so each
        shard is compared with its replicas rank by rank.
        """
        tokens = spec.split()
        if not tokens:
            raise ValueError("dims annotation must not be empty")
        dims: list[ShardDim] = []
        names: list[str] = []
        for axis, tok in enumerate(tokens):
            m = _DIM_TOKEN.match(tok)
            if m is None:
                raise ValueError(f"invalid dims token {tok!r} in {spec!r}")
            names.append(m.group(1))
            if m.group(2) is None:
                continue
            mods = [x.strip() for x in m.group(2).split(",")]
            kind = "contiguous"
            for flag in ("zigzag", "partial"):
                if flag in mods:
                    mods.remove(flag)
                    kind = flag
            if len(mods) != 1:
                raise ValueError(f"dims token {tok!r} needs exactly one group (and at most one of "
                                 f"zigzag/partial)")
            g = mods[0]
            if g not in ranks or g not in sizes:
                raise ValueError(f"dims token {tok!r}: group {g!r} has no rank/size given")
            if sizes[g] > 1:
                dims.append(ShardDim(None if kind == "partial" else axis, g, ranks[g], sizes[g], kind))
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate axis names in {spec!r}")
        for g in replicated:
            if sizes[g] > 1:
                dims.append(ShardDim(None, g, ranks[g], sizes[g], "replicated"))
        return cls(tuple(dims), full_shape)

    def coords(self) -> tuple[int, ...]:
        return tuple(d.rank for d in self.dims)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"dims": [d.to_dict() for d in self.dims],
                             "full_shape": None if self.full_shape is None else list(self.full_shape)}
        if self.valid_shape is not None:
            d["valid_shape"] = list(self.valid_shape)
        return d

    @classmethod
    def of(cls, p: Placement | dict[str, Any] | None) -> Placement:
        """``p`` itself, or the placement its dict describes (:meth:`from_dict`; None: held whole)."""
        return p if isinstance(p, Placement) else cls.from_dict(p or {})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Placement:
        """The placement a manifest stores (:meth:`to_dict`); ``{}`` is the placement of a tensor
        held whole. A ValueError for anything else (an unknown field would otherwise be ignored
        and the tensor taken as whole)."""
        if not isinstance(d, dict):
            raise ValueError(f"a placement is a dict with 'dims' (and 'full_shape', 'valid_shape'), not {d!r}")
        unknown = set(d) - {"dims", "full_shape", "valid_shape"}
        if unknown:
            raise ValueError(f"a placement has the fields 'dims', 'full_shape', 'valid_shape', not {sorted(unknown)} "
                             f"in {d!r}: build it with tracer.trace.canonical.Placement")
        fs, vs = d.get("full_shape"), d.get("valid_shape")
        return cls(dims=tuple(ShardDim.from_dict(x) for x in d.get("dims", [])),
                   full_shape=None if fs is None else tuple(fs),
                   valid_shape=None if vs is None else tuple(vs))


@dataclass(frozen=True)
class ReplicaDiff:
    """Comparison of one replica with the group's first (lowest-rank) replica."""

    group: str
    reference: tuple[Hashable, ...]  # keys of the ranks that make up the kept replica
    other: tuple[Hashable, ...]      # keys of the ranks that make up the compared one
    max_abs_diff: float   # inf where NaN/Inf positions differ
    equal: bool           # bitwise equal (NaNs in the same places count as equal)


@dataclass
class AssemblyReport:
    """What :func:`assemble` saw besides the tensor itself."""

    name: str
    replicas: list[ReplicaDiff] = field(default_factory=list)
    original_dtype: torch.dtype | None = None
    partial_groups: list[str] = field(default_factory=list)
    full_original_dtype: torch.Tensor | None = None  # set when partials were summed

    @property
    def replicas_agree(self) -> bool:
        return all(r.equal for r in self.replicas)

    @property
    def max_replica_diff(self) -> float:
        return max((r.max_abs_diff for r in self.replicas), default=0.0)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _zigzag_chunks(length: int, size: int, name: str) -> int:
    if length % (2 * size):
        raise ValueError(f"{name}: zigzag dim of length {length} is not divisible by 2*size = {2 * size}")
    return length // (2 * size)


def shard(full: torch.Tensor, placement: Placement) -> torch.Tensor:
    """This rank's piece of ``full`` under ``placement`` (inverse of :func:`assemble`).

    Contiguous dims use ``torch.tensor_split`` (the first ``length % size`` ranks hold one
    more row); a ``partial`` level returns ``full`` on rank 0 and zeros elsewhere (one
    valid preimage: the sum is exact).
    """
    t = full
    if placement.valid_shape is not None:  # pad the true extents back to full_shape with zeros
        pad = [p for v, n, f in reversed(list(zip(placement.valid_shape, t.shape, placement.full_shape)))
               for p in (0, 0 if v is None else f - n)]
        t = torch.nn.functional.pad(t, pad)
    for d in placement.dims:
        if d.kind == "contiguous":
            t = torch.tensor_split(t, d.size, dim=d.dim)[d.rank]
        elif d.kind == "zigzag":
            c = _zigzag_chunks(t.shape[d.dim], d.size, "shard")
            a = t.narrow(d.dim, d.rank * c, c)
            b = t.narrow(d.dim, (2 * d.size - 1 - d.rank) * c, c)
            t = torch.cat([a, b], dim=d.dim)
        elif d.kind == "partial":
            t = t.clone() if d.rank == 0 else torch.zeros_like(t)
        elif d.kind == "replicated":
            t = t.clone()
        else:  # flat_shard
            if tuple(t.shape) != d.shape:
                raise ValueError(f"flat_shard expects shape {d.shape}, tensor has {tuple(t.shape)}")
            t = t.reshape(-1)[d.start:d.end].clone()
    return t.contiguous()


def _combine(name: str, level: ShardDim, members: dict[Hashable, tuple[torch.Tensor, ShardDim]],
             report: AssemblyReport, origin: dict[Hashable, tuple[Hashable, ...]]) -> torch.Tensor:
    """Undo one sharding level over one group's members (key -> (tensor, its ShardDim)).

    ``origin[key]`` lists the original ranks a member was assembled from (for reports).
    """
    if level.kind == "flat_shard":
        ranges = sorted((d.start, d.end, k) for k, (_, d) in members.items())
        for (_, e0, k0), (s1, _, k1) in itertools.pairwise(ranges):
            if s1 < e0:
                raise ValueError(f"{name}: flat_shard ranges overlap over {level.group}: "
                                 f"rank {k0} ends at {e0}, rank {k1} starts at {s1}")
            if s1 > e0:
                raise ValueError(f"{name}: flat_shard ranges leave a gap [{e0}, {s1}) over "
                                 f"{level.group} between rank {k0} and rank {k1}")
        n = _numel(level.shape)
        if ranges[0][0] != 0 or ranges[-1][1] != n:
            raise ValueError(f"{name}: flat_shard ranges over {level.group} cover "
                             f"[{ranges[0][0]}, {ranges[-1][1]}) not [0, {n}) of shape {level.shape}")
        for s, e, k in ranges:
            if members[k][0].numel() != e - s:
                raise ValueError(f"{name}: rank {k} holds {members[k][0].numel()} elements "
                                 f"for flat range [{s}, {e}) over {level.group}")
        return torch.cat([members[k][0].reshape(-1) for _, _, k in ranges]).reshape(level.shape)

    by_rank: dict[int, Hashable] = {}
    for k, (_, d) in members.items():
        if d.rank in by_rank:
            raise ValueError(f"{name}: ranks {by_rank[d.rank]} and {k} both claim {level.group} "
                             f"rank {d.rank}; annotate the group that tells them apart")
        by_rank[d.rank] = k
    missing = [r for r in range(level.size) if r not in by_rank]
    if missing:
        raise ValueError(f"{name}: missing {level.group} rank(s) {missing} of {level.size} "
                         f"(have {sorted(map(str, members))})")
    keys = [by_rank[r] for r in range(level.size)]
    ts = [members[k][0] for k in keys]

    if level.kind in _DIM_KINDS:
        nd = ts[0].dim()
        if not -nd <= level.dim < nd:
            raise ValueError(f"{name}: rank {keys[0]}'s {nd}-d tensor has no dim {level.dim} "
                             f"to concatenate over {level.group}")
        ax = level.dim % nd
        for k, t in zip(keys, ts):
            if t.dim() != ts[0].dim() or any(a != b for i, (a, b) in enumerate(zip(t.shape, ts[0].shape))
                                             if i != ax):
                raise ValueError(f"{name}: rank {k} has shape {tuple(t.shape)}, incompatible with "
                                 f"rank {keys[0]}'s {tuple(ts[0].shape)} when concatenating dim "
                                 f"{level.dim} over {level.group}")
        if level.kind == "contiguous":
            return torch.cat(ts, dim=ax)
        halves = []
        for k, t in zip(keys, ts):
            if t.shape[ax] % 2:
                raise ValueError(f"{name}: rank {k} holds an odd length {t.shape[ax]} on zigzag dim "
                                 f"{level.dim} over {level.group}")
            halves.append(t.chunk(2, dim=ax))
        order = [h[0] for h in halves] + [h[1] for h in reversed(halves)]
        return torch.cat(order, dim=ax)

    for k, t in zip(keys, ts):
        if t.shape != ts[0].shape:
            raise ValueError(f"{name}: rank {k} has shape {tuple(t.shape)}, rank {keys[0]} has "
                             f"{tuple(ts[0].shape)} in {level.kind} group {level.group}")
    if level.kind == "partial":
        if report.original_dtype is None:
            report.original_dtype = ts[0].dtype
        if level.group not in report.partial_groups:
            report.partial_groups.append(level.group)
        acc = torch.float64 if ts[0].is_floating_point() else torch.int64
        return torch.stack([t.to(acc) for t in ts]).sum(dim=0)
    ref = ts[0]
    for k, t in zip(keys[1:], ts[1:]):
        same = (t == ref) | (t.isnan() & ref.isnan())  # equal values, infinities, NaN positions
        equal = bool(same.all())
        diff = 0.0
        if not equal:
            d = torch.where(same, 0.0, (t.to(torch.float64) - ref.to(torch.float64)).abs())
            diff = float(torch.where(d.isnan(), float("inf"), d).max())
        report.replicas.append(ReplicaDiff(level.group, origin[keys[0]], origin[k], diff, equal))
    return ref


def assemble(shards: dict[Hashable, torch.Tensor], placements: dict[Hashable, Placement | dict],
             name: str = "tensor") -> tuple[torch.Tensor, AssemblyReport]:
    """Canonical full tensor from all ranks' pieces.

    ``shards`` and ``placements`` share their keys (a global rank or any hashable such
    as ``(tp, cp, dp)``); placements may be :class:`Placement` s or their dicts.  Levels
    are undone innermost first: the ranks that differ only in the innermost level's rank
    are combined (concatenated, un-zigzagged, summed in float64, compared as replicas,
    or joined from flat ranges), then the next level, and so on.

    Returns the full tensor (float64 if any partial level was summed, else the shards'
    dtype, bitwise) and an :class:`AssemblyReport`.  Raises ``ValueError`` naming the
    tensor and rank for missing ranks, disagreeing layouts, shape mismatches and
    overlapping, gapped or short flat ranges.
    """
    if not shards:
        raise ValueError(f"{name}: no shards")
    if set(shards) != set(placements):
        raise ValueError(f"{name}: shards and placements have different ranks: "
                         f"{sorted(map(str, set(shards) ^ set(placements)))}")
    pl = {k: Placement.of(p) for k, p in placements.items()}
    first = next(iter(pl))
    sig = [d.signature() for d in pl[first].dims]
    for k, p in pl.items():
        if [d.signature() for d in p.dims] != sig:
            raise ValueError(f"{name}: rank {k}'s placement {p.to_dict()['dims']} disagrees with "
                             f"rank {first}'s {pl[first].to_dict()['dims']}")
        if (p.full_shape, p.valid_shape) != (pl[first].full_shape, pl[first].valid_shape):
            raise ValueError(f"{name}: rank {k} says full/valid shape {p.full_shape}/{p.valid_shape}, "
                             f"rank {first} says {pl[first].full_shape}/{pl[first].valid_shape}")
    dtypes = {k: t.dtype for k, t in shards.items()}
    if len(set(dtypes.values())) > 1:
        by_rank = dict(sorted((str(k), str(v)) for k, v in dtypes.items()))
        raise ValueError(f"{name}: ranks hold different dtypes {by_rank}")
    report = AssemblyReport(name=name)
    # current: coords -> (tensor, dims still to undo, representative key for messages);
    # origin: representative key -> all original keys it was assembled from
    current: dict[tuple, tuple[torch.Tensor, tuple[ShardDim, ...], Hashable]] = {}
    origin: dict[Hashable, tuple[Hashable, ...]] = {k: (k,) for k in shards}
    for k, t in shards.items():
        c = pl[k].coords()
        if pl[k].dims and pl[k].dims[-1].kind == "flat_shard":
            c = c[:-1] + ((pl[k].dims[-1].start, pl[k].dims[-1].end, c[-1]),)
        if c in current:
            raise ValueError(f"{name}: ranks {current[c][2]} and {k} have the same placement "
                             f"{pl[k].to_dict()['dims']}; annotate the group that tells them apart")
        current[c] = (t, pl[k].dims, k)
    for _ in range(len(sig)):
        groups: dict[tuple, dict[Hashable, tuple[torch.Tensor, ShardDim]]] = {}
        rest: dict[tuple, tuple[ShardDim, ...]] = {}
        for c, (t, dims, k) in current.items():
            groups.setdefault(c[:-1], {})[k] = (t, dims[-1])
            rest[c[:-1]] = dims[:-1]
        level = next(iter(current.values()))[1][-1]
        new = {}
        for c, members in groups.items():
            ordered = sorted(members, key=lambda k: (members[k][1].start or 0, members[k][1].rank))
            rep_key = ordered[0]  # lowest rank: the kept replica, the name in messages
            new[c] = (_combine(name, level, members, report, origin), rest[c], rep_key)
            origin[rep_key] = tuple(x for k in ordered for x in origin[k])
        current = new  # an outer coordinate absent altogether is caught at its own level
    (full, _, _), = current.values()
    if report.partial_groups:
        report.full_original_dtype = full.to(report.original_dtype)
    fs = pl[first].full_shape
    if fs is not None and tuple(full.shape) != fs:
        raise ValueError(f"{name}: assembled shape {tuple(full.shape)} != declared full shape {fs}")
    full = _crop(full, pl[first].valid_shape)
    if report.full_original_dtype is not None:
        report.full_original_dtype = _crop(report.full_original_dtype, pl[first].valid_shape)
    return full, report


def _crop(t: torch.Tensor, valid: tuple[int | None, ...] | None) -> torch.Tensor:
    for i, v in enumerate(valid or ()):
        if v is not None:
            t = t.narrow(i, 0, v)
    return t


# ----------------------------------------------------------------------------- pipeline / experts

def layer_offset(pp_rank: int, pp_size: int, num_layers: int, vpp_chunk: int | None = None,
                 vpp_size: int | None = None, *, num_layers_in_first_stage: int | None = None,
                 num_layers_in_last_stage: int | None = None) -> int:
    """Global index of a stage's (or virtual chunk's) first decoder layer.

    Mirrors megatron-core 0.16.1 ``get_transformer_layer_offset``
    (megatron/core/transformer/transformer_layer.py), without a custom
    ``pipeline_model_parallel_layout`` and without embedding/loss accounting:

    * even, non-interleaved: ``pp_rank * (num_layers // pp_size)``;
    * even, interleaved (VPP): ``vpp_chunk * (num_layers // vpp_size)
      + pp_rank * (num_layers // pp_size // vpp_size)``;
    * uneven first/last stage: the middle stages share the remaining layers; the
      formulas of the same function are followed verbatim.
    """
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} outside [0, {pp_size})")
    if (vpp_chunk is None) != (vpp_size is None):
        raise ValueError("give both vpp_chunk and vpp_size, or neither")
    if vpp_size is not None and not 0 <= vpp_chunk < vpp_size:
        raise ValueError(f"vpp_chunk {vpp_chunk} outside [0, {vpp_size})")
    if pp_size == 1:
        return 0
    first, last = num_layers_in_first_stage, num_layers_in_last_stage
    if first is None and last is None:
        per_rank = num_layers // pp_size
        if vpp_size is None:
            return pp_rank * per_rank
        return vpp_chunk * (num_layers // vpp_size) + pp_rank * (per_rank // vpp_size)
    middle_stages = pp_size - (first is not None) - (last is not None)
    f, l_ = first or 0, last or 0
    middle_layers = num_layers - f - l_
    middle_rank = pp_rank if first is None else pp_rank - 1
    if vpp_size is None:
        per_rank = middle_layers // middle_stages if middle_stages > 0 else 0
        return 0 if pp_rank == 0 else middle_rank * per_rank + f
    f_chunk, mid_chunk, l_chunk = f // vpp_size, middle_layers // vpp_size, l_ // vpp_size
    total = f_chunk + mid_chunk + l_chunk
    if pp_rank == 0:
        return vpp_chunk * total
    return vpp_chunk * total + f_chunk + middle_rank * (mid_chunk // middle_stages)


def renumber(name: str, key: str, offset: int) -> str:
    """Add ``offset`` to the index after the first ``.{key}.`` component of ``name``."""
    pat = re.compile(rf"(^|\.)({re.escape(key)})\.(\d+)(?=\.|$)")
    m = pat.search(name)
    if m is None:
        raise ValueError(f"{name!r} has no '{key}.<index>' component to renumber")
    return name[:m.start(3)] + str(int(m.group(3)) + offset) + name[m.end(3):]


def global_layer_name(local_name: str, pp_rank: int, layers_per_stage: int, vpp_chunk: int | None = None,
                      *, pp_size: int | None = None, vpp_size: int | None = None,
                      key: str = "layers") -> str:
    """``decoder.layers.{i}...`` of a stage -> the single-device name ``decoder.layers.{i+offset}...``.

    ``layers_per_stage`` is the number of decoder layers per pipeline rank (all its
    virtual chunks together).  Non-interleaved offset: ``pp_rank * layers_per_stage``.
    Interleaved (``vpp_chunk`` given, needs ``pp_size`` and ``vpp_size``):
    ``vpp_chunk * num_layers / vpp_size + pp_rank * layers_per_stage / vpp_size`` with
    ``num_layers = pp_size * layers_per_stage`` (see :func:`layer_offset`; uneven stages:
    call :func:`layer_offset` and :func:`renumber` directly).  Names without a
    ``layers.<i>`` component (embedding, final norm, output layer) are returned unchanged.
    """
    if vpp_chunk is None:
        offset = pp_rank * layers_per_stage
    else:
        if pp_size is None or vpp_size is None:
            raise ValueError("interleaved pipeline renumbering needs pp_size and vpp_size")
        if layers_per_stage % vpp_size:
            raise ValueError(f"{layers_per_stage} layers per stage do not split into {vpp_size} chunks")
        offset = layer_offset(pp_rank, pp_size, pp_size * layers_per_stage, vpp_chunk, vpp_size)
    try:
        return renumber(local_name, key, offset)
    except ValueError:
        return local_name


def global_expert_name(local_name: str, ep_rank: int, num_local_experts: int,
                       key: str = "local_experts") -> str:
    """EP-local expert ``...local_experts.{j}...`` -> global ``...local_experts.{ep_rank*E_local+j}...``

    (megatron-core 0.16.1 megatron/core/transformer/moe/moe_layer.py: ``local_expert_indices
    = [ep_rank * num_local_experts + i for i in range(num_local_experts)]``).
    Names without the key are returned unchanged.
    """
    try:
        return renumber(local_name, key, ep_rank * num_local_experts)
    except ValueError:
        return local_name
