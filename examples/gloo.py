"""Run a function on ``world_size`` local processes joined by a gloo process group.

    from examples.gloo import run_gloo

    def work(rank: int, world_size: int, n: int) -> torch.Tensor:   # module level (picklable)
        t = torch.full((n,), float(rank))
        dist.all_reduce(t)
        return t

    results = run_gloo(work, 4, 10)        # [rank 0's return value, rank 1's, ...]

Each worker is a fresh ``spawn``-ed interpreter (no fork of the test process) that sets
``torch.set_num_threads(1)`` (``mp.spawn``, unlike ``torchrun``, leaves every rank with
all cores), joins ``dist.init_process_group("gloo")`` on a free localhost TCP port, calls
``fn(rank, world_size, *args)``, sends the return value back through a
``torch.multiprocessing`` queue and destroys the group. Return values travel as ordinary
multiprocessing messages (tensors through shared memory): nothing is written to or read
back from disk. A worker stays alive until the parent has received every result, because
a tensor sent through shared memory must outlive its receipt.

A launch costs several seconds (interpreter + torch import per rank): batch every
measurement of a test module into one call, e.g. from a module-scoped fixture.

A launch that runs many jobs (each building its own process groups) wraps each job in
:func:`released_groups`: a gloo process group keeps three threads alive until it is
destroyed, and megatron-core's ``destroy_model_parallel`` only drops its references, so 55
megatron-core runs in one world-4 launch left ~2,500 threads per rank, hundreds of them
runnable, and each run slower than the last (world-4 runs went from ~10 s to over 6 min).

A worker that raises makes :func:`run_gloo` raise ``RuntimeError`` with the worker's
traceback; the remaining workers (which may be blocked in a collective) are terminated.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import os
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Iterator
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_gloo", "free_port", "released_groups"]


@contextlib.contextmanager
def released_groups() -> Iterator[None]:
    """Destroy, on exit, every process group created inside the block (in creation order, the
    same on every rank), so that their gloo threads end with the job that made them.

    Destroying only unregisters a group; its threads stop when the last reference goes, and
    megatron's model and optimizer hold theirs in reference cycles: hence the ``gc.collect()``.
    Measured (megatron-core 0.16, tp=2, 3 runs in one launch): the first run leaves 17 groups
    alive and each later run one (referenced from megatron-core state this harness does not
    own), 3 sleeping threads each, instead of ~17 groups per run."""
    pg_map = dist.distributed_c10d._world.pg_map  # dict, insertion-ordered; private but stable
    before = set(pg_map)
    try:
        yield
    finally:
        for pg in [g for g in pg_map if g not in before]:
            dist.destroy_process_group(pg)
        _clear_dtensor_caches()
        gc.collect()


def _clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions: they hold the device meshes they were computed
    on, and a later job's mesh of the same shape is *equal* to an earlier one (meshes compare by
    their layout), so the cache would hand it the earlier mesh, whose process groups were just
    destroyed ("Could not resolve the process group registered under the name 3", seen on the
    second FSDP2 x TP job of one launch)."""
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._redistribute import _gen_transform_infos
    except ImportError:  # a torch without DTensor: nothing cached
        return
    prop = DTensor._op_dispatcher.sharding_propagator
    for cache in (prop.propagate_op_sharding, getattr(prop, "_propagate_tensor_meta_cached", None), _gen_transform_infos):
        if cache is not None and hasattr(cache, "cache_clear"):
            cache.cache_clear()
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ fast path's
    if clear_native is not None:
        clear_native()


def free_port() -> int:
    """A localhost TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple,
            env: dict[str, str], results: "mp.Queue", done: "mp.Event", timeout_s: float) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **env})
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:  # report every failure to the parent, then exit
        results.put((rank, False, traceback.format_exc()))
    done.wait(timeout_s)


class _PortTaken(RuntimeError):
    """The rendezvous port was taken between :func:`free_port` and the workers' bind."""


#: launches retried on a fresh port when the rendezvous port was taken meanwhile
PORT_RETRIES = 5


def run_gloo(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0,
             env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results by rank.

    Args:
        fn: a module-level function (it is pickled by reference into the spawned workers).
        world_size: number of processes.
        args: extra picklable arguments, the same for every rank.
        timeout_s: limit for the collectives (process-group timeout) and for the whole run.
        env: environment variables set in every worker before the group is created.
    """
    for _ in range(PORT_RETRIES - 1):
        try:
            return _launch(fn, world_size, args, timeout_s, env)
        except _PortTaken:
            continue  # another process took the port: launch again on a fresh one
    return _launch(fn, world_size, args, timeout_s, env)


def _launch(fn: Callable[..., Any], world_size: int, args: tuple, timeout_s: float,
            env: dict[str, str] | None) -> list[Any]:
    """One launch on a fresh port; :class:`_PortTaken` if another process took the port first
    (``free_port`` must release the port before the workers bind it, so this race exists
    whenever launches run concurrently, e.g. two pytest workers)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    done = ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, dict(env or {}), results, done,
                                              timeout_s), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:
                    raise RuntimeError(f"gloo worker(s) {dead} died (exit codes "
                                       f"{[procs[r].exitcode for r in dead]}) without a result") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"gloo run of {fn.__name__} exceeded {timeout_s} s") from None
                continue
            if not ok:
                if "EADDRINUSE" in value or "address already in use" in value.lower():
                    raise _PortTaken(f"rendezvous port taken:\n{value}")
                raise RuntimeError(f"gloo worker {rank} of {world_size} failed:\n{value}")
            out[rank] = value
    finally:
        done.set()
        grace = time.monotonic() + 10.0  # then terminate a worker stuck in a collective
        for p in procs:
            p.join(timeout=max(0.0, grace - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join()
    return [out[r] for r in range(world_size)]
