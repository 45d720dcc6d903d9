"""The gloo launcher retries on a fresh port when the rendezvous port was taken meanwhile."""
import socket

import torch
import torch.distributed as dist

from examples import gloo


def _sum_ranks(rank: int, world: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return float(t)


def test_taken_port_is_retried(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        ports = iter([taken])
        real = gloo.free_port
        monkeypatch.setattr(gloo, "free_port", lambda: next(ports, None) or real())
        assert gloo.run_gloo(_sum_ranks, 2) == [1.0, 1.0]


def _threads_after_jobs(rank: int, world: int, jobs: int, release: bool) -> list[int]:
    """Thread count of this rank after each of ``jobs`` jobs that each build 3 groups."""
    import contextlib
    import os
    counts = []
    for _ in range(jobs):
        with gloo.released_groups() if release else contextlib.nullcontext():
            for _ in range(3):
                g = dist.new_group(list(range(world)))
                t = torch.ones(2)
                dist.all_reduce(t, group=g)
        counts.append(len(os.listdir("/proc/self/task")))
    return counts


def test_released_groups_keep_the_thread_count_flat_across_jobs():
    unreleased, released = gloo.run_gloo(_threads_after_jobs, 2, 5, False)[0], \
        gloo.run_gloo(_threads_after_jobs, 2, 5, True)[0]
    assert unreleased[-1] - unreleased[0] >= 4 * 3, unreleased  # each gloo group keeps its threads
    assert released[-1] - released[0] <= 2, released
