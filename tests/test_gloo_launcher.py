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
