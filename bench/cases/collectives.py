"""Bench cases of the collectives: all_reduce (SUM and AVG), reduce_scatter and all_gather, per
format (fp32, bf16, fp16, and fp32 partials reduced in bf16), data (random normal,
all-positive, cancellation-heavy, 17 binades wide) and implementation.

``torch``: the real gloo collectives of ``torch.distributed``, run in this process: one
``ProcessGroupGloo`` per rank on a shared ``HashStore`` (created once per world size, in
threads, because every rank's constructor waits for its peers); each collective is issued
on every rank's group (gloo runs it on its own threads) and then awaited. This is gloo's
TCP transport and algorithms, as in a multi-process job, without a process launch per trial
(tests/test_bounds_collectives.py checks multi-process gloo against the same emulation).
``emulated``: :mod:`ttrace_num.emulate.collectives` (gloo's ring order) at world sizes gloo
cannot reach cheaply here (16, 64) and at a non-power-of-two size for AVG (3).
Each all-reduce / reduce-scatter case is bounded twice: order-free (``algorithm="any"``)
and with gloo's known order (``algorithm="gloo"``, label suffix ``gloo-order``).
"""
from __future__ import annotations

import datetime
import threading
from typing import Callable

import torch
import torch.distributed as dist

import ttrace_num.bounds.collectives  # noqa: F401  (registers all_reduce, reduce_scatter, all_gather)
from bench.harness import Case
from ttrace_num.emulate.collectives import emulate_all_reduce, emulate_reduce_scatter
from ttrace_num.reference.dot import exact_sum

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
N = 4096
KINDS = ("normal", "positive", "cancel", "wide")

_GROUPS: dict[int, list] = {}


def _groups(k: int) -> list:
    """``k`` in-process gloo process groups, ranks ``0..k-1`` of one world."""
    if k not in _GROUPS:
        store = dist.HashStore()
        pgs: list = [None] * k

        def make(r: int) -> None:
            pgs[r] = dist.ProcessGroupGloo(store, r, k, datetime.timedelta(seconds=120))

        threads = [threading.Thread(target=make, args=(r,)) for r in range(k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        _GROUPS[k] = pgs
    return _GROUPS[k]


def _issue(calls: list[Callable[[], object]]) -> None:
    for w in [c() for c in calls]:
        w.wait()


def gloo_all_reduce(partials: torch.Tensor, fmt: str, reduce_op: str = "sum") -> torch.Tensor:
    """Real gloo all-reduce of ``partials[r]`` (converted to ``fmt``) over ``k`` ranks; rank 0's result."""
    k = partials.shape[0]
    xs = [partials[r].to(DTYPES[fmt]).clone() for r in range(k)]
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.AVG if reduce_op == "avg" else dist.ReduceOp.SUM
    _issue([(lambda pg=pg, x=x: pg.allreduce([x], opts)) for pg, x in zip(_groups(k), xs)])
    return xs[0]


def gloo_reduce_scatter(partials: torch.Tensor, fmt: str, rank: int) -> torch.Tensor:
    k, n = partials.shape
    xs = [partials[r].to(DTYPES[fmt]).clone() for r in range(k)]
    outs = [torch.empty(n // k, dtype=DTYPES[fmt]) for _ in range(k)]
    _issue([(lambda pg=pg, o=o, x=x: pg._reduce_scatter_base(o, x)) for pg, o, x in zip(_groups(k), outs, xs)])
    return outs[rank]


def gloo_all_gather(shards: torch.Tensor) -> torch.Tensor:
    k, m = shards.shape
    outs = [torch.empty(k * m, dtype=shards.dtype) for _ in range(k)]
    _issue([(lambda pg=pg, o=o, r=r: pg._allgather_base(o, shards[r].clone()))
            for r, (pg, o) in enumerate(zip(_groups(k), outs))])
    return outs[0]


def _partials(kind: str, k: int, n: int, stored: str, g: torch.Generator) -> torch.Tensor:
    z = torch.randn(k, n, generator=g, dtype=torch.float64)
    dt = DTYPES[stored]
    if kind == "positive":
        z = z.abs()
    elif kind == "wide":
        z = z * 2.0 ** torch.randint(-8, 9, (k, n), generator=g)
    elif kind == "cancel":  # the last rank nearly cancels the others
        head = z[:-1].to(dt).to(torch.float64)
        z = torch.cat([head, (-head.sum(0) + 2.0**-9 * torch.randn(n, generator=g, dtype=torch.float64))[None]])
    return z.to(dt)


def _maker(kind: str, k: int, stored: str, kwargs: dict | None = None, n: int = N):
    def make(g: torch.Generator) -> tuple[tuple, dict]:
        return (_partials(kind, k, n, stored, g),), dict(kwargs or {})
    return make


def _exact_all_reduce(p: torch.Tensor, reduce_op: str = "sum") -> torch.Tensor:
    s = exact_sum(p.T, dim=-1)
    return s / p.shape[0] if reduce_op == "avg" else s


def _exact_shard(p: torch.Tensor, rank: int) -> torch.Tensor:
    m = p.shape[1] // p.shape[0]
    return exact_sum(p[:, rank * m:(rank + 1) * m].T, dim=-1)


def _cases() -> list[Case]:
    """Every all-reduce case twice: with the order-free bound (``algorithm="any"``) and with the
    known gloo order (``algorithm="gloo"``, labelled ``gloo-order``)."""
    out: list[Case] = []
    formats = [(f, f, f) for f in DTYPES] + [("fp32->bf16", "fp32", "bf16")]
    for label_fmt, stored, red in formats:
        for algorithm in ("any", "gloo"):
            bk = {"fmt": red, "algorithm": algorithm}
            tag = "" if algorithm == "any" else " gloo-order"
            kinds = KINDS if stored == red else ("normal", "cancel")
            for kind in kinds:
                out.append(Case("all_reduce", f"{kind} k=4{tag}", label_fmt, _maker(kind, 4, stored),
                                (lambda p, red=red: gloo_all_reduce(p, red)), _exact_all_reduce, bk))
            for kind in ("normal", "cancel"):
                out.append(Case("all_reduce", f"{kind} k=16{tag}", label_fmt, _maker(kind, 16, stored),
                                (lambda p, red=red: emulate_all_reduce(p, red)), _exact_all_reduce, bk,
                                implementation="emulated"))
            out.append(Case("all_reduce", f"normal k=64{tag}", label_fmt, _maker("normal", 64, stored, n=1024),
                            (lambda p, red=red: emulate_all_reduce(p, red)), _exact_all_reduce, bk,
                            implementation="emulated"))
            if stored != red:
                continue
            avg = {"reduce_op": "avg"}
            out.append(Case("all_reduce", f"normal k=4 avg{tag}", label_fmt, _maker("normal", 4, stored, avg),
                            (lambda p, reduce_op, red=red: gloo_all_reduce(p, red, reduce_op)),
                            _exact_all_reduce, bk))
            out.append(Case("all_reduce", f"normal k=3 avg{tag}", label_fmt, _maker("normal", 3, stored, avg),
                            (lambda p, reduce_op, red=red: emulate_all_reduce(p, red, reduce_op=reduce_op)),
                            _exact_all_reduce, bk, implementation="emulated"))
            shard = {"rank": 1}
            out.append(Case("reduce_scatter", f"normal k=4{tag}", label_fmt, _maker("normal", 4, stored, shard),
                            (lambda p, rank, red=red: gloo_reduce_scatter(p, red, rank)), _exact_shard, bk))
            out.append(Case("reduce_scatter", f"cancel k=16{tag}", label_fmt, _maker("cancel", 16, stored, shard),
                            (lambda p, rank, red=red: emulate_reduce_scatter(p, rank, red)), _exact_shard, bk,
                            implementation="emulated"))
        if stored == red:
            out.append(Case("all_gather", "normal k=4", label_fmt, _maker("normal", 4, stored),
                            gloo_all_gather, lambda p: p.reshape(-1).to(torch.float64)))
    return out


CASES = _cases()
