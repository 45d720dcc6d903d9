"""On-disk storage of traced tensors: safetensors per rank per step + a JSON manifest.

Layout (see docs/tracing-storage.md for the full schema)::

    root/run.json                              written by rank 0: world size, layout,
                                               model signature, run id, mode, versions
    root/step_000003/rank_00001.safetensors    the rank's tensors of step 3 (full mode)
    root/step_000003/rank_00001.json           the manifest: one entry per tensor

The manifest is the commit marker: it is written *after* the tensor file, so a
rank/step is present exactly when its manifest is. Every file is written to a
temporary name in the same directory, fsync'ed and moved in place with
``os.replace``, so a crash or a full disk never leaves a partial file under a final
name; a tensor file's pages are then dropped from the page cache
(``_drop_cached_pages``). Only JSON and safetensors are read back -- never pickle -- and
safetensors keeps the dtype, so bf16 and fp8 tensors round-trip bit-exactly.

Each entry carries statistics (norm, absmax, mean, quantiles over the finite
values, NaN and Inf counts). In ``mode="stats"`` only the manifests are written,
which is what a long run can afford. NaN/Inf are findings, never exceptions.
"""
from __future__ import annotations

import contextlib
import gc
import json
import math
import operator
import os
import re
import socket
import tempfile
import uuid
import warnings
import weakref
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import orjson
import torch
import xxhash
from safetensors import SafetensorError, safe_open

from tracer.errors import (
    CorruptTraceError,
    IncomparableRunsError,
    ManifestMismatchError,
    MissingRankError,
    TraceDirectoryInUseError,
    TraceError,
    TraceWriteError,
)
from tracer.trace.canonical import Placement
from tracer.trace.dtensor import is_dtensor
from tracer.trace.safetensors_writer import write_safetensors
from tracer.trace.schema import ENTRY_FIELDS, Entry
from tracer.trace.stats import STATS_CHUNK, PendingStats, tensor_stats, tensor_stats_many

SCHEMA_VERSION = 1
MODES = ("full", "stats")
RUN_FILE = "run.json"
MAX_OPEN_FILES = 64  # safetensors handles a TraceReader keeps open
_STEP_RE = re.compile(r"^step_(\d{6,})$")
_RANK_RE = re.compile(r"^rank_(\d{5,})\.json$")
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
_MANIFEST_FIELDS = ("schema_version", "model_signature", "run_id", "world_size", "rank", "step",
                    "mode", "file", "entries")


def kernel_settings() -> dict[str, Any]:
    """What decides whether two runs compute an op bitwise alike (``run.json`` ``kernels``;
    :mod:`tracer.compare.exactness`): torch's CPU dispatch (``ATEN_CPU_CAPABILITY``), whether CUDA
    is in use and deterministic algorithms are enabled, and the cuBLAS workspace setting."""
    from ttrace_num.cpu_kernels import dispatch
    return {"cpu_capability": dispatch(),
            "cuda": torch.version.cuda if torch.cuda.is_available() else None,
            "deterministic": bool(torch.are_deterministic_algorithms_enabled()),
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}


def _library_version() -> str:
    try:
        from importlib.metadata import version
        return version("ttrace-num")
    except Exception:  # not installed as a distribution (e.g. run from a source tree)
        return "unknown"


def step_dir(root: str | Path, step: int) -> Path:
    """Directory of one step: ``root/step_{step:06d}``."""
    return Path(root) / f"step_{step:06d}"


def tensor_path(root: str | Path, step: int, rank: int) -> Path:
    """Safetensors file of one rank and step."""
    return step_dir(root, step) / f"rank_{rank:05d}.safetensors"


def manifest_path(root: str | Path, step: int, rank: int) -> Path:
    """Manifest of one rank and step."""
    return step_dir(root, step) / f"rank_{rank:05d}.json"


def lock_path(root: str | Path, rank: int) -> Path:
    """The lock file a writer of ``rank`` holds while it writes ``root``: ``root/.rank_{rank:05d}.lock``."""
    return Path(root) / f".rank_{rank:05d}.lock"


def checksum(t: torch.Tensor) -> str:
    """The 64-bit xxh3 hash (16 hex digits) of the bytes a safetensors file stores for ``t``: its
    elements in C order, as in memory (little-endian). ``t`` is a contiguous CPU tensor (what the
    writer stores, what ``safe_open`` returns); hashed through a byte view, without a copy."""
    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.to("cpu").contiguous()
    if t.numel() == 0:
        return xxhash.xxh3_64_hexdigest(b"")
    data = t.reshape(-1).view(torch.uint8).numpy()
    return xxhash.xxh3_64_hexdigest(data)


def _new_run_id(world_size: int, rank: int, root: Path) -> str:
    """A run id shared by every rank of one run: with ``torch.distributed`` initialised on a world of
    ``world_size`` processes, rank 0's fresh uuid4, broadcast to the others (a collective: every rank
    creates its writer); else a fresh uuid4, except that a rank > 0 of a multi-rank trace written
    without ``torch.distributed`` (ranks written one after another, e.g. in one process) takes the id
    rank 0 wrote to ``run.json``."""
    dist = torch.distributed
    if world_size > 1 and dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size:
        box = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return str(box[0])
    if rank > 0:
        run = existing_run(root) or {}
        if run.get("run_id") and run.get("world_size") == world_size:
            return str(run["run_id"])
    return uuid.uuid4().hex


def existing_run(root: str | Path) -> dict[str, Any] | None:
    """The ``run.json`` a directory already holds, for a writer deciding what it may write there
    (:class:`TraceReader` is the strict reader): None when there is none or it is not JSON, ``{}``
    when it is JSON but not an object."""
    try:
        run = orjson.loads((Path(root) / RUN_FILE).read_bytes())
    except (OSError, ValueError):
        return None
    return run if isinstance(run, dict) else {}


def _release_lock(path: Path, token: str) -> None:
    """Remove a writer's lock file if it is still the one it created (its token inside)."""
    try:
        if token in path.read_text():
            path.unlink()
    except OSError:
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _jsonable(value: Any, what: str, name: str | None = None) -> Any:
    """Check that ``value`` survives strict JSON (no NaN, no objects) and return a copy of it
    as JSON would read it back (tuples become lists)."""
    try:
        return _json_copy(value)
    except (TypeError, ValueError) as exc:
        raise TraceError(f"{what} must be JSON-serialisable (plain dicts, lists, str, int, finite "
                         f"float): {exc}", tensor=name) from exc


def _json_copy(value: Any) -> Any:
    """``json.loads(json.dumps(value, allow_nan=False))`` for the plain values a trace's
    placement and meta hold, without the encoder's per-call cost (it was ~10% of stats-only
    tracing): numbers finite, dict keys strings (numbers, bools and None become strings)."""
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"out of range float value {value!r}")
        return float(value)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                if not (k is None or isinstance(k, (int, float))):
                    raise TypeError(f"keys must be str, int, float, bool or None, not {type(k).__name__}")
                k = json.dumps(k, allow_nan=False)  # as the encoder writes such a key
            out[k] = _json_copy(v)
        return out
    if isinstance(value, (list, tuple)):
        return [_json_copy(v) for v in value]
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _fsync_dir(path: Path) -> None:
    """Make a rename durable; best effort (some filesystems refuse directory fsync)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the block (restored after it, also on an error)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON to a temp file in ``path``'s directory, fsync, ``os.replace``.

    Compact, through ``orjson`` (the same text as ``json.dumps(obj, separators=(",", ":"))``,
    read back to equal values): the standard library's encoder formats floats at ~0.7 us
    each, 3.3 ms of a demo step's 462 statistics entries against 0.25 ms, and a pure-Python
    encoder (``json.dump`` with an indent) was ~40% of the stats-only tracer's per-step
    overhead. ``orjson`` writes NaN and Inf as ``null`` where ``json`` raises: everything
    written here is finite by construction (statistics, :func:`_jsonable` placements and
    metas). Raises OSError with no temp file left behind.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(orjson.dumps(obj))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(Path(tmp))
        raise


def _write_safetensors_atomic(path: Path, tensors: dict[str, torch.Tensor],
                              metadata: dict[str, str]) -> int:
    """Write a safetensors file atomically; returns its size in bytes."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            size = write_safetensors(f, tensors, metadata)
            f.flush()
            os.fsync(f.fileno())
            _drop_cached_pages(f.fileno())
        os.replace(tmp, path)
        return size
    except BaseException:
        _unlink_quietly(Path(tmp))
        raise


def _host_copy(t: torch.Tensor, staged: bool) -> tuple[torch.Tensor, torch.Event | None]:
    """A contiguous CPU copy of ``t`` and, when it is still in flight, the event that marks it
    done: a staged accelerator tensor is copied into pinned memory with ``non_blocking=True``
    (the step goes on; :meth:`TraceWriter._write_step` waits for the event), anything else at once."""
    if not staged or t.device.type == "cpu":
        return t.to("cpu", copy=True).contiguous(), None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.Event(t.device)
    done.record()
    return host, done


def _drop_cached_pages(fd: int) -> None:
    """Evict a written, fsync'ed file's pages from the page cache (best effort).

    A trace file is written once per step and read later, often elsewhere; kept cached it
    grows the page cache by the trace's size every step, and the pages its writes need are
    then fresh memory rather than the ones the last step's file just released. Measured
    on this project's machines (a microVM whose fresh memory is first touched at
    ~0.47 GB/s): writing 800 MB took 1.7-2.3 s with the previous files cached and 0.17 s
    after ``POSIX_FADV_DONTNEED``, fsync 0.35 s either way. The price is paid by a
    comparison that reads the file at once on the same machine: from the disk instead of
    memory (800 MB: 0.81 s instead of 0.11 s here). The pages are clean after the fsync,
    so they are dropped, not written again. No-op where ``posix_fadvise`` is missing
    (macOS, Windows) or refused.
    """
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


class _Buffered(NamedTuple):
    """A traced tensor waiting for its step's flush: its manifest entry, what the tensor file
    stores for it (None in stats mode), what the flush takes its statistics of (a copy, or the
    :class:`~tracer.trace.stats.PendingStats` of a staged large tensor; None once they are in the
    entry), and the event that marks a staged copy to the host done (None: nothing to wait for)."""

    entry: dict[str, Any]
    stored: torch.Tensor | None
    stats_of: torch.Tensor | PendingStats | None
    ready: torch.Event | None = None


@dataclass(frozen=True)
class Finding:
    """A traced tensor holding NaN or Inf values."""

    step: int
    rank: int
    tensor: str
    phase: str
    key: str
    microbatch: int
    index: int
    nan_count: int
    inf_count: int

    def __str__(self) -> str:
        return (f"step {self.step} rank {self.rank} {self.phase} {self.tensor} (mb {self.microbatch}, "
                f"index {self.index}): {self.nan_count} NaN, {self.inf_count} Inf")


class TraceWriter:
    """Writes one rank's trace: buffers a step's tensors, flushes them atomically.

    ``layout`` is the parallel layout (e.g. ``{"tp": 2, "pp": 1, "dp": 2}``), JSON-
    serialisable; ``model_signature`` identifies the model (architecture, config
    hash, ...) so that traces of different models are never compared; ``run_id``
    identifies the run, so that files of another run in the same directory are detected: when
    none is given, one is generated (a uuid4; with ``torch.distributed`` initialised on
    ``world_size`` processes rank 0's, broadcast to every rank, so that creating the writer is
    then a collective; without it a rank > 0 takes the id of the ``run.json`` rank 0 wrote).
    Rank 0 writes ``root/run.json``. A writer refuses a directory whose ``run.json`` names
    another run while step directories exist, and holds ``root/.rank_{rank:05d}.lock`` (created
    exclusively, removed by ``close``) so that a second writer of the same rank is refused
    (:class:`~tracer.errors.TraceDirectoryInUseError`). Every stored tensor's bytes get an xxh3-64
    checksum in its manifest entry, verified by :meth:`TraceReader.load`.

    Tensors are copied (``detach`` + copy to CPU) when added; the training tensors
    are never modified. In ``mode="stats"`` only their statistics are kept: a tensor of at
    least ``STATS_CHUNK`` elements is reduced when added, where it is; a smaller one is copied
    on its device and reduced at the flush with the rest of its step
    (``tracer.trace.stats.tensor_stats_many``: a few torch calls per distinct size, where one
    tensor at a time cost ~110 us each). Full mode takes every copy's statistics at the flush.

    ``run_meta``: JSON-serialisable facts about the run, written to ``run.json`` as ``meta``
    (e.g. a noise sample's ``{"restarts_each_step": true}``, :class:`tracer.capture.noise_sampler.NoiseSampler`).

    ``stage``: a tensor on an accelerator is *staged*, so that ``add`` never waits for the
    device: in full mode its copy goes to pinned host memory with ``non_blocking=True`` and an
    event marks it done; in stats mode a large one is reduced by
    :class:`~tracer.trace.stats.PendingStats` (no copy kept; FP8, integer and bool tensors, which
    torch has no reductions for, are reduced at once); the flush waits for both. The device
    thus holds no copy of the traced tensors: a stats-only trace of a step adds a few numbers
    and small tensors' copies per traced tensor to device memory, a full one nothing. CPU
    tensors are copied or reduced at once, which is the same cost. ``stage=True`` stages CPU
    tensors too (tests of the staged path on a machine without an accelerator), ``False``
    nothing.

    ``background=True`` writes each flushed step, after its copies' statistics,
    on a thread of its own while the run goes on (writing and torch's reductions release the
    GIL): a full trace of a large model then costs little more than its copies. At most one
    step is in flight (``flush_step`` first waits for the previous one), so the buffered
    copies are at most two steps' worth; ``wait()`` blocks until the step in flight is on
    disk, ``close()`` (or leaving the ``with`` block) until everything is.
    """

    def __init__(self, root: str | Path, rank: int, world_size: int, layout: dict[str, Any],
                 model_signature: str, *, run_id: str = "", mode: str = "full",
                 background: bool = False, stage: bool | None = None,
                 run_meta: dict[str, Any] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self.layout = _jsonable(dict(layout), "layout")
        self.run_meta = _jsonable(dict(run_meta or {}), "run_meta")
        self.model_signature = str(model_signature)
        self.mode = mode
        self.stage = stage
        self._pending: dict[int, dict[int, _Buffered]] = {}
        self._flushed: set[int] = set()
        self._in_flight: tuple[int, dict[int, _Buffered], Future] | None = None
        self._lock: tuple[Path, str] | None = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TraceWriteError(f"cannot create the trace directory: {exc.strerror or exc}",
                                  path=self.root, rank=rank) from exc
        self.run_id = str(run_id) or _new_run_id(world_size, rank, self.root)
        self._refuse_another_run()
        self._acquire_lock()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"trace-writer-rank{rank}") if background else None
        if rank == 0:
            self._write_run_file()

    def _refuse_another_run(self) -> None:
        """Refuse a directory whose ``run.json`` names another run while step directories exist (a
        trace of another run is there: its steps would mix with this run's)."""
        run = existing_run(self.root)
        if run is None:
            return
        other = run.get("run_id")
        if other == self.run_id:
            return
        steps = sorted(p.name for p in self.root.iterdir() if p.is_dir() and _STEP_RE.match(p.name))
        if steps:
            raise TraceDirectoryInUseError(
                f"a trace of another run is in this directory (run.json names run id {other!r}, this writer's "
                f"run id is {self.run_id!r}; {len(steps)} step directories, e.g. {steps[0]}): its steps would "
                "mix with this run's; choose another trace directory, or delete the old trace (the directory "
                "and everything in it) if it is no longer needed", path=self.root / RUN_FILE, rank=self.rank)

    def _acquire_lock(self) -> None:
        """Create ``root/.rank_{rank}.lock`` (``O_EXCL``): one writer per rank and directory. It holds
        this process's pid, host and run id, and is removed by :meth:`close` (or when the writer is
        garbage-collected)."""
        if self._lock is not None:
            return
        path = lock_path(self.root, self.rank)
        token = f"{uuid.uuid4().hex}"
        body = orjson.dumps({"pid": os.getpid(), "host": socket.gethostname(), "run_id": self.run_id,
                             "rank": self.rank, "token": token})
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                holder = orjson.loads(path.read_bytes())
            except (OSError, ValueError):
                holder = {}
            holder = holder if isinstance(holder, dict) else {}
            pid, host = holder.get("pid"), holder.get("host")
            stale = ""
            if host == socket.gethostname() and isinstance(pid, int) and not _pid_alive(pid):
                stale = f" (no process {pid} runs on this host now: the lock is stale, left by a writer that died)"
            raise TraceDirectoryInUseError(
                f"another writer of rank {self.rank} is writing this trace directory: its lock file is held by "
                f"process {pid} on host {host!r} (run id {holder.get('run_id')!r}){stale}; two writers of one "
                "rank would overwrite each other's steps: give this run another trace directory, or, if "
                f"that process is dead, delete the lock file {path}", path=path, rank=self.rank) from None
        except OSError as exc:
            raise TraceWriteError(f"cannot create the writer's lock file: {exc.strerror or exc}; fix permissions "
                                  "of the trace directory", path=path, rank=self.rank) from exc
        try:
            os.write(fd, body)
        finally:
            os.close(fd)
        self._lock = (path, token)
        self._lock_finalizer = weakref.finalize(self, _release_lock, path, token)

    def _release(self) -> None:
        if self._lock is not None:
            self._lock_finalizer()
            self._lock = None

    def run_info(self) -> dict[str, Any]:
        """The content of ``run.json``."""
        return {"schema_version": SCHEMA_VERSION, "library_version": _library_version(),
                "torch_version": torch.__version__, "model_signature": self.model_signature,
                "run_id": self.run_id, "world_size": self.world_size, "layout": self.layout,
                "mode": self.mode, "meta": self.run_meta, "kernels": kernel_settings()}

    def _write_run_file(self) -> None:
        path = self.root / RUN_FILE
        try:
            _write_json_atomic(path, self.run_info())
        except OSError as exc:
            raise TraceWriteError(f"could not write the run file: {exc.strerror or exc}; "
                                  "free space or fix permissions of the trace directory",
                                  path=path, rank=self.rank) from exc

    def add(self, name: str, tensor: torch.Tensor, *, phase: str, step: int, microbatch: int = 0,
            index: int | None = None, placement: Placement | dict[str, Any] | None = None,
            meta: dict[str, Any] | None = None) -> str:
        """Buffer a copy of ``tensor`` for ``step``; returns its key in the file.

        ``name`` is the canonical name, ``phase`` a :class:`~tracer.trace.schema.Phase` (others
        are accepted), ``index`` the execution order within the step on this rank
        (next free one if ``None``; must be unique), ``placement`` the shard metadata
        (e.g. ``{"kind": "tp_column", "dim": 0, "rank": r, "size": n}``), ``meta``
        anything else JSON-serialisable.
        """
        if not isinstance(tensor, torch.Tensor):
            raise TraceError(f"expected a torch.Tensor, got {type(tensor).__name__}",
                             rank=self.rank, step=step, tensor=name)
        if is_dtensor(tensor):
            raise TraceError("a DTensor is stored as its local shard with the placement its spec gives: pass "
                             "the pair tracer.trace.dtensor.local_shard(tensor) returns (the hooks of "
                             "tracer.capture.hooks.Tracer do this)", rank=self.rank, step=step, tensor=name)
        if tensor.layout != torch.strided:
            raise TraceError(f"only dense (strided) tensors can be traced, got {tensor.layout}; "
                             "trace tensor.to_dense()", rank=self.rank, step=step, tensor=name)
        if not name or not phase:
            raise TraceError("name and phase must be non-empty", rank=self.rank, step=step,
                             tensor=name)
        step, microbatch = operator.index(step), operator.index(microbatch)
        if step in self._flushed:
            raise TraceError("this step was already flushed; adding to it would overwrite its "
                             "file: trace each step once", rank=self.rank, step=step, tensor=name)
        try:
            placement = Placement.of(placement)
        except ValueError as exc:
            raise TraceError(f"invalid placement: {exc}", rank=self.rank, step=step, tensor=name) from exc
        placement = _jsonable(placement.to_dict(), "placement", name)
        meta = _jsonable(meta or {}, "meta", name)
        entries = self._pending.setdefault(step, {})
        if index is None:
            index = max(entries, default=-1) + 1
        index = operator.index(index)
        if index in entries:
            raise TraceError(f"execution index {index} is already used by "
                             f"{entries[index].entry['name']!r} in this step", rank=self.rank,
                             step=step, tensor=name)
        phase = str(phase)
        key = f"{phase}/{name}/mb{microbatch}/i{index}"
        with torch._C.DisableTorchFunction():  # plain copy and stats even under a TorchFunctionMode
            view = tensor.detach()
            entry = {"key": key, "name": name, "phase": phase, "step": step,
                     "microbatch": int(microbatch), "index": int(index),
                     "dtype": _dtype_name(view.dtype), "shape": list(view.shape),
                     "placement": placement, "meta": meta, "stats": None}
            # statistics are taken at the flush, a step's tensors at once (tensor_stats_many), from
            # what a full trace stores, or in stats mode from a copy of a small tensor on its device;
            # a large one's are taken now, reading it where it is (no copy, and its reductions dominate)
            staged = view.device.type != "cpu" if self.stage is None else self.stage
            if self.mode == "full":
                entry, stored = self._kept(entry, view)
                ready = None
                if stored is view:
                    stored, ready = _host_copy(view, staged)
                entries[index] = _Buffered(entry, stored, stored, ready)
            elif view.numel() < STATS_CHUNK:
                entries[index] = _Buffered(entry, None, view.clone())
            elif staged and PendingStats.takes(view):
                entries[index] = _Buffered(entry, None, PendingStats(view))
            else:
                entry["stats"] = tensor_stats(view)
                entries[index] = _Buffered(entry, None, None)
        return key

    def _kept(self, entry: dict[str, Any], tensor: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
        """What a full-mode trace stores for a traced tensor: its entry and ``tensor`` itself, the
        traced tensor (detached, where it lives), of which the writer then stores a CPU copy; a
        subclass may return something derived from it instead, a CPU tensor the writer stores as
        it is, described by the entry it returns (the entry's statistics are taken of what is
        stored). Runs with torch functions disabled, as the copy does: a mode of the traced run
        (e.g. a noise injector) must not see this arithmetic."""
        return entry, tensor

    def pending_steps(self) -> list[int]:
        """Steps with buffered tensors not yet flushed."""
        return sorted(self._pending)

    def flush_step(self, step: int) -> Path:
        """Write the buffered tensors of ``step`` and their manifest; returns the manifest path.

        On an OSError (disk full, ...) nothing is left under the final names, the
        buffer is kept (so the call can be retried) and a :class:`TraceWriteError`
        is raised. A ``background`` writer first waits for the step it is still writing
        (raising its error, if any), then hands ``step`` to its writing thread and returns at
        once: the step's error, if any, is raised by the next ``flush_step``, ``wait`` or
        ``close``, with the step buffered again.
        """
        step = operator.index(step)
        self._acquire_lock()  # again, after a close
        entries = [e for _, e in sorted(self._pending.get(step, {}).items())]
        if self._executor is None:
            path = self._write_step(step, entries)
            self._pending.pop(step, None)
            self._flushed.add(step)
            return path
        self.wait()
        self._in_flight = (step, self._pending.pop(step, {}), self._executor.submit(self._write_step, step, entries))
        self._flushed.add(step)
        return manifest_path(self.root, step, self.rank)

    def wait(self) -> None:
        """Block until the step a ``background`` writer is writing is on disk; raise its error
        (the step is then buffered again, so ``flush_step`` can retry it). No-op otherwise."""
        if self._in_flight is None:
            return
        step, buffered, future = self._in_flight
        self._in_flight = None
        try:
            future.result()
        except BaseException:
            self._pending[step] = buffered
            self._flushed.discard(step)
            raise

    def _write_step(self, step: int, entries: list[_Buffered]) -> Path:
        """Write ``entries`` as ``step``'s tensor file and manifest (tensors first: a manifest is
        the commit), after the statistics left to it; returns the manifest path. Touches no
        state of the writer, so that it can run on the writing thread."""
        for b in entries:
            if b.ready is not None:
                b.ready.synchronize()
        copies = []  # reduced together at the end
        with torch._C.DisableTorchFunction():
            for b in entries:
                if b.stats_of is None or b.entry["stats"] is not None:
                    continue
                if isinstance(b.stats_of, PendingStats):
                    b.entry["stats"] = b.stats_of.resolve()
                else:
                    copies.append(b)
            for b, stats in zip(copies, tensor_stats_many([b.stats_of for b in copies])):
                b.entry["stats"] = stats
        sdir = step_dir(self.root, step)
        tpath, mpath = tensor_path(self.root, step, self.rank), manifest_path(self.root, step, self.rank)
        manifest = {"schema_version": SCHEMA_VERSION, "model_signature": self.model_signature,
                    "run_id": self.run_id, "world_size": self.world_size, "layout": self.layout,
                    "rank": self.rank, "step": step, "mode": self.mode, "file": None,
                    "entries": [b.entry for b in entries]}
        wrote_tensors = False
        target = tpath
        try:
            sdir.mkdir(parents=True, exist_ok=True)
            if self.mode == "full":
                for b in entries:  # the stored bytes' hash, verified on every load
                    b.entry["checksum"] = checksum(b.stored)
                metadata = {"schema_version": str(SCHEMA_VERSION), "model_signature": self.model_signature,
                            "run_id": self.run_id, "rank": str(self.rank), "step": str(step)}
                size = _write_safetensors_atomic(tpath, {b.entry["key"]: b.stored for b in entries}, metadata)
                wrote_tensors = True
                manifest["file"] = {"name": tpath.name, "bytes": size}
            target = mpath
            _write_json_atomic(mpath, manifest)
        except BaseException as exc:
            if wrote_tensors:  # not committed without its manifest: do not leave it behind
                _unlink_quietly(tpath)
            if not isinstance(exc, OSError):
                raise
            hint = ("free disk space and call flush_step again (the step is still buffered), "
                    "or trace with mode='stats' (manifests only)")
            raise TraceWriteError(f"could not write the trace: {exc.strerror or exc}; no partial "
                                  f"file was left; {hint}", path=target, rank=self.rank,
                                  step=step) from exc
        _fsync_dir(sdir)
        return mpath

    def close(self) -> None:
        """Flush every pending step, wait until everything is on disk and release the writer's lock
        (kept while a step could not be written, so that it can be retried)."""
        for step in self.pending_steps():
            self.flush_step(step)
        self.wait()
        self._release()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        elif self._in_flight is not None:  # let the step being written land; the run's error propagates
            try:
                self.wait()
            except Exception as write_error:
                warnings.warn(f"the trace writer of rank {self.rank} could not write a step while the run "
                              f"failed: {write_error}", RuntimeWarning, stacklevel=2)
        self._release()


class TraceReader:
    """Reads and validates a trace directory written by :class:`TraceWriter` ranks.

    Errors are :class:`~tracer.errors.TraceError` subclasses naming the file, rank,
    step and tensor; NaN/Inf are reported by :meth:`findings`, never raised.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        path = self.root / RUN_FILE
        if not path.is_file():
            raise MissingRankError("no run.json: not a trace directory, or rank 0 never started "
                                   "tracing", path=path)
        self.run = self._read_json(path, rank=None, step=None)
        for field in ("schema_version", "model_signature", "world_size", "layout"):
            if field not in self.run:
                raise CorruptTraceError(f"run file lacks field {field!r}", path=path)
        if self.run["schema_version"] != SCHEMA_VERSION:
            raise ManifestMismatchError(f"schema version {self.run['schema_version']} is not the "
                                        f"supported {SCHEMA_VERSION}", path=path)
        self._manifests: dict[tuple[int, int], dict[str, Any]] = {}
        self._entries: dict[tuple[int, int], list[Entry]] = {}
        self._entry_index: dict[tuple[int, int], dict[str, Entry]] = {}
        self._handles: dict[tuple[int, int], tuple[Any, set[str], Path]] = {}

    @property
    def world_size(self) -> int:
        return int(self.run["world_size"])

    @property
    def model_signature(self) -> str:
        return str(self.run["model_signature"])

    @property
    def run_id(self) -> str:
        """The run's id (``""`` in a trace written before every run had one)."""
        return str(self.run.get("run_id", ""))

    @staticmethod
    def _read_json(path: Path, rank: int | None, step: int | None) -> dict[str, Any]:
        """The JSON object in ``path``, parsed by ``orjson`` (13% of a demo comparison's time
        went to the standard library's parser); strict: bytes that are not UTF-8, ``NaN``,
        ``Infinity`` and numbers beyond float64 are a corrupt file. The cyclic garbage collector
        is paused while it parses: a manifest is thousands of new containers, which trigger
        collections that traverse every object the comparison holds (on the demo's, 5 ms a
        manifest parsed vs 1.1 ms alone; a parse creates no cycles, so nothing is left for it)."""
        try:
            text = path.read_bytes()
        except OSError as exc:
            raise CorruptTraceError(f"cannot read: {exc.strerror or exc}", path=path, rank=rank,
                                    step=step) from exc
        try:
            with _gc_paused():
                obj = orjson.loads(text)
        except json.JSONDecodeError as exc:  # orjson's error is a subclass
            raise CorruptTraceError(f"not valid JSON ({exc.msg} at line {exc.lineno}): the file is "
                                    "truncated or corrupt; re-run the trace or drop this step",
                                    path=path, rank=rank, step=step) from exc
        if not isinstance(obj, dict):
            raise CorruptTraceError("expected a JSON object", path=path, rank=rank, step=step)
        return obj

    def steps(self) -> list[int]:
        """Steps that have a directory (with at least one rank's manifest or not)."""
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir()
                      if p.is_dir() and (m := _STEP_RE.match(p.name)))

    def ranks(self, step: int) -> list[int]:
        """Ranks whose manifest for ``step`` is present."""
        sdir = step_dir(self.root, step)
        if not sdir.is_dir():
            return []
        return sorted(int(m.group(1)) for p in sdir.iterdir() if (m := _RANK_RE.match(p.name)))

    def missing_ranks(self, step: int) -> list[int]:
        """Ranks of ``range(world_size)`` with no manifest for ``step``."""
        present = set(self.ranks(step))
        return [r for r in range(self.world_size) if r not in present]

    def manifest(self, step: int, rank: int) -> dict[str, Any]:
        """The validated manifest of one rank and step (cached)."""
        if (step, rank) in self._manifests:
            return self._manifests[(step, rank)]
        path = manifest_path(self.root, step, rank)
        if not 0 <= rank < self.world_size:
            raise MissingRankError(f"rank {rank} is outside the run's world size {self.world_size}",
                                   path=path, rank=rank, step=step)
        if not path.is_file():
            have = self.ranks(step)
            raise MissingRankError(f"manifest missing (ranks present for this step: {have or 'none'}); "
                                   "that rank died before flushing or wrote elsewhere: re-run the "
                                   "trace or drop this step", path=path, rank=rank, step=step)
        m = self._read_json(path, rank, step)
        lacking = [f for f in _MANIFEST_FIELDS if f not in m]
        if lacking:
            raise CorruptTraceError(f"manifest lacks fields {lacking}", path=path, rank=rank, step=step)
        for field, expected in (("rank", rank), ("step", step),
                                ("model_signature", self.model_signature),
                                ("run_id", self.run.get("run_id", "")),
                                ("world_size", self.world_size),
                                ("layout", self.run["layout"]),
                                ("schema_version", SCHEMA_VERSION)):
            if field == "run_id" and m[field] != expected:
                raise ManifestMismatchError(
                    f"this manifest was written by run {m[field]!r} but run.json names run {expected!r}: ranks or "
                    "steps of different runs are mixed in this trace directory (a copied file, or two runs writing "
                    "one directory); re-run the trace into an empty directory",
                    path=path, rank=rank, step=step)
            if m.get(field, expected) != expected:
                raise ManifestMismatchError(
                    f"manifest field {field!r} is {m[field]!r} but the run (run.json / file path) says "
                    f"{expected!r}: this manifest belongs to another model, layout or run",
                    path=path, rank=rank, step=step)
        if m["mode"] not in MODES:
            raise CorruptTraceError(f"unknown mode {m['mode']!r}", path=path, rank=rank, step=step)
        keys: set[str] = set()
        parsed: list[Entry] = []
        if not isinstance(m["entries"], list):
            raise CorruptTraceError("manifest field 'entries' is not a list", path=path, rank=rank, step=step)
        for i, e in enumerate(m["entries"]):
            lacking = [f for f in ENTRY_FIELDS if f not in e] if isinstance(e, dict) else list(ENTRY_FIELDS)
            if lacking:
                raise CorruptTraceError(f"entry {i} lacks fields {lacking}", path=path, rank=rank,
                                        step=step, tensor=e.get("name") if isinstance(e, dict) else None)
            if e["step"] != step:
                raise ManifestMismatchError(f"entry {i} is of step {e['step']} but sits in the manifest "
                                            f"of step {step}", path=path, rank=rank, step=step,
                                            tensor=e["key"])
            if not isinstance(e.get("checksum", ""), str) and e.get("checksum") is not None:
                raise CorruptTraceError(f"entry {i}'s checksum is not a string", path=path, rank=rank,
                                        step=step, tensor=e["key"])
            if e["key"] in keys:
                raise CorruptTraceError(f"entry {i} repeats a key", path=path, rank=rank, step=step,
                                        tensor=e["key"])
            keys.add(e["key"])
            try:
                parsed.append(Entry.from_dict(e))
            except (TypeError, ValueError, KeyError, AttributeError) as exc:
                raise CorruptTraceError(f"entry {i} is malformed ({type(exc).__name__}: {exc})", path=path,
                                        rank=rank, step=step, tensor=e["key"]) from exc
        self._manifests[(step, rank)] = m
        self._entries[(step, rank)] = sorted(parsed, key=lambda e: e.index)
        return m

    def entries(self, step: int, rank: int) -> list[Entry]:
        """Manifest entries of one rank and step, parsed, in execution order."""
        self.manifest(step, rank)
        return self._entries[(step, rank)]

    def entry(self, step: int, rank: int, key: str) -> Entry:
        """The manifest entry of ``key``."""
        if (step, rank) not in self._entry_index:
            self._entry_index[(step, rank)] = {e.key: e for e in self.entries(step, rank)}
        e = self._entry_index[(step, rank)].get(key)
        if e is None:
            raise ManifestMismatchError("no such key in the manifest", path=manifest_path(self.root, step, rank),
                                        rank=rank, step=step, tensor=key)
        return e

    def _open(self, step: int, rank: int, key: str) -> tuple[Any, set[str], Path]:
        """An open safetensors handle of a rank's step file, its keys and its path, kept for the
        next loads (the file is checked once, the header parsed once; a few handles are kept)."""
        if (step, rank) not in self._handles:
            path = self._tensor_file(step, rank, key)
            try:
                f = safe_open(path, framework="pt")
                handle = (f, set(f.keys()), path)
            except (SafetensorError, OSError) as exc:
                raise self._corrupt(path, rank, step, key, exc) from exc
            if len(self._handles) >= MAX_OPEN_FILES:
                self._handles.pop(next(iter(self._handles)))
            self._handles[(step, rank)] = handle
        return self._handles[(step, rank)]

    def _tensor_file(self, step: int, rank: int, tensor: str | None) -> Path:
        m = self.manifest(step, rank)
        path = tensor_path(self.root, step, rank)
        if m["mode"] != "full" or m["file"] is None:
            raise TraceError("this step was traced in stats mode: only statistics are stored, no "
                             "tensors", path=manifest_path(self.root, step, rank), rank=rank,
                             step=step, tensor=tensor)
        if not path.is_file():
            raise MissingRankError("tensor file missing although its manifest is present: re-run the "
                                   "trace or drop this step", path=path, rank=rank, step=step,
                                   tensor=tensor)
        size = path.stat().st_size
        if size != m["file"]["bytes"]:
            raise CorruptTraceError(f"file of rank {rank} step {step} is truncated or corrupt "
                                    f"({size} bytes, manifest says {m['file']['bytes']}): re-run "
                                    "the trace or drop this step", path=path, rank=rank, step=step,
                                    tensor=tensor)
        return path

    def _corrupt(self, path: Path, rank: int, step: int, tensor: str | None,
                 exc: Exception) -> CorruptTraceError:
        return CorruptTraceError(f"file of rank {rank} step {step} is truncated or corrupt ({exc}): "
                                 "re-run the trace or drop this step", path=path, rank=rank,
                                 step=step, tensor=tensor)

    def load(self, step: int, rank: int, key: str) -> torch.Tensor:
        """Load one tensor (lazily: only that tensor is read), checked against its entry."""
        entry = self.entry(step, rank, key)
        f, keys, path = self._open(step, rank, key)
        if key not in keys:
            raise ManifestMismatchError("the manifest lists this tensor but the file lacks it",
                                        path=path, rank=rank, step=step, tensor=key)
        try:
            t = f.get_tensor(key)
        except (SafetensorError, OSError) as exc:
            raise self._corrupt(path, rank, step, key, exc) from exc
        if _dtype_name(t.dtype) != entry.dtype or tuple(t.shape) != entry.shape:
            raise ManifestMismatchError(f"file holds {_dtype_name(t.dtype)}{list(t.shape)}, manifest "
                                        f"says {entry.dtype}{list(entry.shape)}", path=path, rank=rank,
                                        step=step, tensor=key)
        if entry.checksum is not None:
            actual = checksum(t)
            if actual != entry.checksum:
                raise CorruptTraceError(
                    f"the stored bytes of tensor {key!r} (rank {rank}, step {step}) do not match their checksum: "
                    f"the manifest says xxh3_64 {entry.checksum}, the file's bytes hash to {actual}; the file "
                    "was corrupted after it was written (storage or copy error): re-run the trace or drop this "
                    "step", path=path, rank=rank, step=step, tensor=key)
        return t

    def verify(self, step: int, rank: int) -> None:
        """Check a rank's step: manifest valid, and (full mode) file readable with the same keys,
        dtypes, shapes and header metadata. Reads headers only, not tensor data."""
        m = self.manifest(step, rank)
        if m["mode"] != "full":
            return
        path = self._tensor_file(step, rank, None)
        try:
            with safe_open(path, framework="pt") as f:
                keys, meta = set(f.keys()), f.metadata() or {}
                slices = {k: f.get_slice(k) for k in keys}
                info = {k: (s.get_dtype(), list(s.get_shape())) for k, s in slices.items()}
        except (SafetensorError, OSError) as exc:
            raise self._corrupt(path, rank, step, None, exc) from exc
        if meta.get("rank") != str(rank) or meta.get("step") != str(step) or \
                meta.get("model_signature") != self.model_signature or \
                meta.get("schema_version") != str(SCHEMA_VERSION) or \
                meta.get("run_id", "") != str(self.run.get("run_id", "")):
            raise ManifestMismatchError(f"file header says rank {meta.get('rank')}, step "
                                        f"{meta.get('step')}, model {meta.get('model_signature')!r}, run id "
                                        f"{meta.get('run_id')!r} (run.json: run id {self.run.get('run_id', '')!r}): "
                                        "the file was moved or belongs to another run",
                                        path=path, rank=rank, step=step)
        listed = {e.key for e in self.entries(step, rank)}
        for key in sorted(listed ^ keys):
            where = "the manifest lists it but the file lacks it" if key in listed else \
                "the file holds it but the manifest does not list it"
            raise ManifestMismatchError(where, path=path, rank=rank, step=step, tensor=key)
        for e in self.entries(step, rank):
            code, shape = info[e.key]
            dtype = _SAFETENSORS_DTYPES.get(code, e.dtype)  # unknown codes: load() checks them
            if tuple(shape) != e.shape or dtype != e.dtype:
                raise ManifestMismatchError(f"file holds {dtype}{shape}, manifest says "
                                            f"{e.dtype}{list(e.shape)}", path=path, rank=rank,
                                            step=step, tensor=e.key)

    def validate(self, steps: list[int] | None = None) -> None:
        """Every rank present and consistent for each of ``steps`` (default: all)."""
        for step in self.steps() if steps is None else steps:
            missing = self.missing_ranks(step)
            if missing:
                raise MissingRankError(f"ranks {missing} of world size {self.world_size} have no "
                                       "manifest: those ranks died before flushing or wrote "
                                       "elsewhere; re-run the trace or drop this step",
                                       path=manifest_path(self.root, step, missing[0]),
                                       rank=missing[0], step=step)
            for rank in range(self.world_size):
                self.verify(step, rank)

    def names(self, step: int) -> set[tuple[str, str, int]]:
        """(phase, canonical name, microbatch) traced by any present rank at ``step``."""
        return {(e.phase, e.name, e.microbatch) for rank in self.ranks(step) for e in self.entries(step, rank)}

    def findings(self) -> list[Finding]:
        """Every traced tensor with NaN or Inf values, over all present manifests, in
        (step, rank, execution index) order. Never raises for NaN/Inf."""
        out = []
        for step in self.steps():
            for rank in self.ranks(step):
                for e in self.entries(step, rank):
                    s = e.stats or {}
                    if s.get("nan_count") or s.get("inf_count"):
                        out.append(Finding(step=step, rank=rank, tensor=e.name, phase=str(e.phase),
                                           key=e.key, microbatch=e.microbatch, index=e.index,
                                           nan_count=s["nan_count"], inf_count=s["inf_count"]))
        return out


def comparability_problems(ref: TraceReader, cand: TraceReader, *,
                           require_same_names: bool = True) -> list[str]:
    """Reasons why a reference and a candidate trace cannot be compared (empty: comparable).

    World size and layout are expected to differ (that is the point of the
    comparison); model signature, steps and traced names must not.
    """
    problems = []
    if ref.model_signature != cand.model_signature:
        problems.append(f"model signature: reference {ref.model_signature!r} ({ref.root}), "
                        f"candidate {cand.model_signature!r} ({cand.root})")
    rs, cs = set(ref.steps()), set(cand.steps())
    if rs != cs:
        problems.append(f"steps present: only in reference {sorted(rs - cs)}, only in candidate "
                        f"{sorted(cs - rs)}")
    if require_same_names:
        for step in sorted(rs & cs):
            rn, cn = ref.names(step), cand.names(step)
            if rn != cn:
                fmt = lambda s: sorted(f"{p}:{n}:mb{mb}" for p, n, mb in s)[:5]
                problems.append(f"names present at step {step}: only in reference {fmt(rn - cn)} "
                                f"({len(rn - cn)}), only in candidate {fmt(cn - rn)} ({len(cn - rn)})")
    return problems


def check_comparable(ref: TraceReader, cand: TraceReader, *, require_same_names: bool = True) -> None:
    """Raise :class:`IncomparableRunsError` listing every differing field, if any."""
    problems = comparability_problems(ref, cand, require_same_names=require_same_names)
    if problems:
        raise IncomparableRunsError(problems)
