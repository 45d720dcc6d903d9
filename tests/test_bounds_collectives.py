"""Collective error models (ttrace_num.bounds.collectives) against real gloo and the emulator.

One gloo launch (4 ranks; the 2-rank measurements run on the subgroup of ranks 0 and 1)
runs every measurement of this module (module-scoped fixture): all_reduce (SUM and AVG),
reduce_scatter_tensor and all_gather_into_tensor for fp32/bf16/fp16 and fp32 partials
reduced in bf16, on random normal, all-positive, cancellation-heavy, wide-range (17
binades) and subnormal data, at sizes that are and are not multiples of the world size, up
to 1e6 elements (gloo's ring then cuts every chunk into 1 MiB-bounded segments). Results
are compared with the correctly rounded exact sum (``ttrace_num.reference.dot.exact_sum``)
and with the emulated ring.

Findings (asserted below), torch 2.13 gloo on CPU:

* the all-reduce on k ranks is a ring: chunk ``c`` of the flattened tensor (gloo's segment
  layout, ``gloo_ring_chunks``) is summed as the chain ``x_{c-1} + x_{c-2} + ... + x_c``
  (ranks mod k), every hop rounded to the tensor's dtype: bitwise on 100% of the elements
  for fp32/bf16/fp16 at 2 and 4 ranks (at 4 ranks the textbook ring, the rank-order chain
  and the pairwise tree each disagree on a large fraction of wide-range elements);
* ``ReduceOp.AVG`` all-reduce = that sum, then one rounded division by k;
* ``reduce_scatter_tensor`` returns the shard of the all-reduce of the whole input, bitwise;
* every rank receives identical bits; a torchrun-like ``LOCAL_WORLD_SIZE`` changes nothing.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist

import ttrace_num as tn
from ttrace_num.bounds import collectives as C
from ttrace_num.bounds.collectives import gloo_ring_chunks
from ttrace_num.emulate.collectives import emulate_all_reduce, emulate_reduce_scatter
from ttrace_num.reference.dot import exact_sum
from ttrace_num.rounding import round_to

from examples.gloo import run_gloo

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KINDS = ("normal", "positive", "cancel", "wide", "tiny")
WORLDS = (2, 4)
P_TEST = 0.1  # failure probability used by the binomial tests (power needs a large one)


def make_partials(kind: str, k: int, n: int, stored: str, reduced: str, seed: int) -> torch.Tensor:
    """``(k, n)`` partials in the ``stored`` dtype; ``reduced`` (the all-reduce's format) sets the
    scale of the subnormal kind and the format in which the cancellation is arranged."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(k, n, generator=g, dtype=torch.float64)
    dt = DTYPES[stored]
    if kind == "normal":
        x = z
    elif kind == "positive":
        x = z.abs()
    elif kind == "wide":
        x = z * 2.0 ** torch.randint(-8, 9, (k, n), generator=g)
    elif kind == "tiny":  # around and below the reduced format's smallest normal number
        x = z * 4 * torch.finfo(DTYPES[reduced]).tiny
    elif kind == "cancel":  # the last rank nearly cancels the others: |sum| << sum|x|
        head = z[:-1].to(dt).to(torch.float64)
        last = -head.sum(0) + 2.0**-9 * torch.randn(n, generator=g, dtype=torch.float64)
        x = torch.cat([head, last[None]])
    else:
        raise ValueError(kind)
    return x.to(dt)


def _plan() -> list[tuple[str, str, int, str, str, int]]:
    """(name, kind, n, stored, reduced, seed) of every gloo measurement."""
    plan = []
    for red in DTYPES:
        for i, kind in enumerate(KINDS):
            plan.append((f"{red}-{kind}-1000", kind, 1000, red, red, 10 + i))
        plan.append((f"{red}-normal-13", "normal", 13, red, red, 20))
    for kind in ("normal", "cancel", "tiny"):
        plan.append((f"fp32->bf16-{kind}-1000", kind, 1000, "fp32", "bf16", 30))
    # large: 2 (bf16) and 4 MB (fp32), two 1 MiB-bounded segments per chunk in gloo's ring
    plan.append(("bf16-normal-1e6", "normal", 1_000_000, "bf16", "bf16", 21))
    plan.append(("fp32-normal-1e6+1", "normal", 1_000_001, "fp32", "fp32", 22))
    return plan


PLAN = _plan()
TORCHRUN_CASE = next(c for c in PLAN if c[0] == "bf16-wide-1000")


def _measure(rank: int, world_size: int, plan: list, worlds: tuple[int, ...]) -> dict:
    """Worker: every collective of every planned case, for each world size ``w`` in ``worlds``
    on the group of ranks ``0..w-1`` (a gloo subgroup runs the same algorithm as a world of
    that size, and one launch is much cheaper than two)."""
    out = {}
    for w in worlds:
        group = dist.new_group(list(range(w))) if w < world_size else None  # called by every rank
        if rank >= w:
            continue
        res = {}
        for name, kind, n, stored, reduced, seed in plan:
            x = make_partials(kind, w, n, stored, reduced, seed)[rank].to(DTYPES[reduced])
            ar = x.clone()
            dist.all_reduce(ar, group=group)
            avg = x.clone()
            dist.all_reduce(avg, op=dist.ReduceOp.AVG, group=group)
            m = n // w
            rs = torch.empty(m, dtype=x.dtype)
            dist.reduce_scatter_tensor(rs, x[:m * w].clone(), group=group)
            ag = torch.empty(m * w, dtype=x.dtype)
            dist.all_gather_into_tensor(ag, x[:m].clone(), group=group)
            res[name] = {"ar": ar, "avg": avg, "rs": rs, "ag": ag}
        # torchrun sets LOCAL_WORLD_SIZE; gloo builds with a shared-memory all-reduce switch to
        # it (a rank-order sum) when it equals the group size: check this build does not
        kind, n, stored, reduced, seed = TORCHRUN_CASE[1:]
        x = make_partials(kind, w, n, stored, reduced, seed)[rank]
        os.environ["LOCAL_WORLD_SIZE"] = str(w)
        dist.all_reduce(x, group=group)
        del os.environ["LOCAL_WORLD_SIZE"]
        res["torchrun-env"] = {"ar": x}
        out[w] = res
    return out


class Measured:
    """Gloo results of one world size (``results[rank][case][collective]``), the partials, and
    cached exact sums and emulations."""

    def __init__(self, world: int, results: list[dict]):
        self.world = world
        self.results = results
        self.cases = {}
        for name, kind, n, stored, reduced, seed in PLAN:
            p = make_partials(kind, world, n, stored, reduced, seed)
            self.cases[name] = (p, reduced, kind, n)
        self._exact: dict[str, torch.Tensor] = {}
        self._emulated: dict[tuple, torch.Tensor] = {}

    def exact(self, name: str) -> torch.Tensor:
        """Correctly rounded exact sum of the case's partials."""
        if name not in self._exact:
            self._exact[name] = exact_sum(self.cases[name][0].T, dim=-1)
        return self._exact[name]

    def emulated(self, name: str, n: int | None = None, **kwargs) -> torch.Tensor:
        """The emulated all-reduce (gloo ring by default) of the case's first ``n`` elements."""
        key = (name, n, tuple(sorted(kwargs.items())))
        if key not in self._emulated:
            p, red = self.cases[name][:2]
            self._emulated[key] = emulate_all_reduce(p[:, :n], red, **kwargs)
        return self._emulated[key]

    def get(self, name: str, what: str, rank: int = 0) -> torch.Tensor:
        return self.results[rank][name][what]


_MEASURED: dict[int, Measured] = {}


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def gloo(request) -> Measured:
    if not _MEASURED:
        per_rank = run_gloo(_measure, max(WORLDS), PLAN, WORLDS)
        for w in WORLDS:
            _MEASURED[w] = Measured(w, [per_rank[r][w] for r in range(w)])
    return _MEASURED[request.param]


def _binomial_pvalue(violations: int, elements: int) -> float:
    """One-sided binomial test of ``violations`` against the claimed rate ``P_TEST`` (scipy is
    imported here, not at module level: the gloo workers import this module)."""
    from scipy.stats import binomtest
    return binomtest(violations, elements, P_TEST, alternative="greater").pvalue


def _tightness(bound: torch.Tensor, err: torch.Tensor) -> float:
    nz = err > 0
    return float((bound[nz] / err[nz]).min()) if nz.any() else math.inf


# ----------------------------------------------------------------------------- gloo: all_reduce


def test_all_ranks_receive_identical_bits(gloo):
    for name in gloo.cases:
        for what in ("ar", "avg"):
            ref = gloo.get(name, what, 0)
            for r in range(1, gloo.world):
                assert torch.equal(gloo.get(name, what, r), ref), (name, what, r)


def test_torchrun_environment_keeps_the_ring(gloo):
    assert torch.equal(gloo.get("torchrun-env", "ar"), gloo.get(TORCHRUN_CASE[0], "ar"))


@pytest.mark.parametrize("algorithm", ["any", "ring", "gloo"])
def test_all_reduce_gloo_deterministic_never_violated(gloo, algorithm):
    rows = []
    for name, (p, red, kind, n) in gloo.cases.items():
        y = gloo.get(name, "ar").to(torch.float64)
        b = tn.tolerance("all_reduce", p, fmt=red, algorithm=algorithm)
        err = (y - gloo.exact(name)).abs()
        viol = int((err > b.abs).sum())
        rows.append((name, viol, _tightness(b.abs, err)))
        assert viol == 0, f"{name}: {viol} violations, worst ratio {float((err / b.abs).max())}"
    print(f"\nworld {gloo.world} all_reduce deterministic ({algorithm}): name, violations, tightness")
    for r in rows:
        print("  %-26s %d %.3g" % r)


@pytest.mark.parametrize("algorithm", ["any", "gloo"])
def test_all_reduce_gloo_probabilistic_binomial(gloo, algorithm):
    viol = total = 0
    tights = {}
    for name, (p, red, kind, n) in gloo.cases.items():
        y = gloo.get(name, "ar").to(torch.float64)
        b = tn.tolerance("all_reduce", p, fmt=red, algorithm=algorithm, mode="probabilistic",
                         failure_probability=P_TEST)
        err = (y - gloo.exact(name)).abs()
        viol += int((err > b.abs).sum())
        total += err.numel()
        tights[name] = _tightness(b.abs, err)
    assert _binomial_pvalue(viol, total) > 1e-3, (viol, total)
    # tight on random normal data: the worst element of each tensor uses most of its bound
    normal = sorted(t for name, t in tights.items() if "-normal-" in name)
    assert normal[len(normal) // 2] <= (4.0 if algorithm == "any" else 1.5), tights


def test_gloo_all_reduce_is_the_gloo_ring_bitwise(gloo):
    """The emulated gloo ring (chunk c: x_{c-1} + x_{c-2} + ... + x_c) matches every element;
    other orders do not (at 4 ranks) on wide-range data, so the match identifies the order."""
    for name, (p, red, kind, n) in gloo.cases.items():
        y = gloo.get(name, "ar").to(torch.float64)
        assert torch.equal(gloo.emulated(name), y), name
    if gloo.world == 4:
        for red in DTYPES:
            name = f"{red}-wide-1000"
            p, y = gloo.cases[name][0], gloo.get(name, "ar").to(torch.float64)
            others = {"ring start c+1 ascending": emulate_all_reduce(p, red, start=1, step=1),
                      "chain 0..k-1": emulate_all_reduce(p, red, "chain"),
                      "tree": emulate_all_reduce(p, red, "tree")}
            for label, e in others.items():
                frac = float((e == y).double().mean())
                assert frac < 0.99, f"{name}: {label} also matches {frac:.3f} of the elements"


def test_gloo_ring_layout_for_multi_segment_tensors():
    """Beyond 2 k MiB gloo uses more than two segments per chunk: the chunk layout follows."""
    c = gloo_ring_chunks(3_000_001, 4, 4)  # 12 MB of fp32: 12 segments of 250001 elements
    assert int(c[750_002]) == 0 and int(c[750_003]) == 1 and int(c[-1]) == 3
    assert torch.equal(torch.bincount(c), torch.tensor([750_003, 750_003, 750_003, 749_992]))
    c13 = gloo_ring_chunks(13, 4, 2)
    assert c13.tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3]


def test_all_reduce_avg_gloo(gloo):
    for name, (p, red, kind, n) in gloo.cases.items():
        y = gloo.get(name, "avg").to(torch.float64)
        assert torch.equal(gloo.emulated(name, reduce_op="avg"), y), name
        b = tn.tolerance("all_reduce", p, fmt=red, reduce_op="avg")
        err = (y - gloo.exact(name) / gloo.world).abs()  # division by a power of two: exact
        assert int((err > b.abs).sum()) == 0, name


def test_wrong_model_fp32_reduction_claimed_for_bf16_is_caught(gloo):
    """A model claiming the bf16 all-reduce accumulates in fp32 (rounding once at the end) is
    violated by real gloo, which rounds every hop to bf16 (at 2 ranks: one hop, so the
    claim fp32 + output rounding happens to be right; the conversion-free claim is tested
    with fp32 partials)."""
    for kind in ("normal", "wide", "positive"):
        name = f"bf16-{kind}-1000"
        p = gloo.cases[name][0]
        y = gloo.get(name, "ar").to(torch.float64)
        err = (y - gloo.exact(name)).abs()
        wrong = tn.tolerance("all_reduce", p, fmt="fp32", out_fmt="bf16")
        if gloo.world == 4:
            assert int((err > wrong.abs).sum()) > 0, name
        assert int((err > tn.tolerance("all_reduce", p, fmt="bf16").abs).sum()) == 0
    # fp32 partials reduced in bf16: forgetting their conversion to bf16 is caught at 2 ranks
    # (at 4 the two non-root levels, u S each, absorb the missing level's sum_r u |x_r|)
    name = "fp32->bf16-normal-1000"
    p = gloo.cases[name][0]
    err = (gloo.get(name, "ar").to(torch.float64) - gloo.exact(name)).abs()
    wrong = tn.tolerance("all_reduce", p.to(torch.bfloat16), fmt="bf16")  # partials taken as exact
    if gloo.world == 2:
        assert int((err > wrong.abs).sum()) > 0


def test_all_reduce_difference_gloo_vs_one_device_fp32(gloo):
    """|gloo bf16/fp16/fp32 all-reduce - fp32 sum on one device rounded to the format|."""
    for name, (p, red, kind, n) in gloo.cases.items():
        y = gloo.get(name, "ar").to(torch.float64)
        ref = p.to(torch.float32).sum(0).to(DTYPES[red]).to(torch.float64)
        d = (y - ref).abs()
        for algorithm in ("any", "gloo"):
            b = C.all_reduce_difference(p, fmt=red, algorithm=algorithm)
            assert int((d > b.abs).sum()) == 0, (name, algorithm)
        if red != "fp32" and gloo.world == 4 and kind == "normal":
            assert int((d > 0).sum()) > 0  # the two computations really differ


# ----------------------------------------------------------------------------- gloo: reduce_scatter / all_gather


def test_reduce_scatter_gloo(gloo):
    k = gloo.world
    for name, (p, red, kind, n) in gloo.cases.items():
        m = n // k
        pp = p[:, :m * k]
        exact = gloo.exact(name)
        full = gloo.emulated(name, m * k)  # all-reduce of the (truncated) input tensors
        bounds = {a: tn.tolerance("reduce_scatter", pp, fmt=red, algorithm=a).abs for a in ("any", "gloo")}
        for r in range(k):
            shard = slice(r * m, (r + 1) * m)
            y = gloo.get(name, "rs", r).to(torch.float64)
            for algorithm, b in bounds.items():
                assert int(((y - exact[shard]).abs() > b[shard]).sum()) == 0, (name, r, algorithm)
            # gloo's reduce-scatter is its all-reduce of the whole tensor, then the shard
            assert torch.equal(y, full[shard]), (name, r)
            if n <= 1000:
                assert torch.equal(y, emulate_reduce_scatter(pp, r, red)), (name, r)
                b_r = tn.tolerance("reduce_scatter", pp, r, fmt=red, algorithm="gloo").abs
                assert b_r.shape == y.shape and torch.equal(b_r, bounds["gloo"][shard])


def test_all_gather_gloo_is_exact(gloo):
    k = gloo.world
    for name, (p, red, kind, n) in gloo.cases.items():
        m = n // k
        shards = p[:, :m].to(DTYPES[red])
        b = tn.tolerance("all_gather", shards)
        assert b.abs.shape == (k * m,) and not b.abs.any()
        assert "copy" in b.explain()
        for r in range(k):
            assert torch.equal(gloo.get(name, "ag", r), shards.reshape(-1)), (name, r)


@pytest.mark.parametrize("k", [3, 8])
def test_in_process_gloo_groups_of_3_and_8_ranks(k):
    """A non-power-of-two and a larger ring on real gloo (one ProcessGroupGloo per rank in this
    process, bench/cases/collectives.py): the emulated gloo ring is bitwise, AVG is the sum then
    one rounded division by k, and the bounds hold."""
    from bench.cases.collectives import gloo_all_reduce
    for fmt in DTYPES:
        for i, kind in enumerate(("normal", "wide", "cancel", "tiny")):
            p = make_partials(kind, k, 1001, fmt, fmt, 60 + i)
            exact = exact_sum(p.T, dim=-1)
            y = gloo_all_reduce(p, fmt).to(torch.float64)
            avg = gloo_all_reduce(p, fmt, "avg").to(torch.float64)
            assert torch.equal(y, emulate_all_reduce(p, fmt)), (k, fmt, kind)
            assert torch.equal(avg, emulate_all_reduce(p, fmt, reduce_op="avg")), (k, fmt, kind)
            ref = exact / k  # within 2^-52 |ref| of s/k (two float64 roundings)
            for algorithm in ("any", "gloo"):
                b = tn.tolerance("all_reduce", p, algorithm=algorithm).abs
                assert int(((y - exact).abs() > b).sum()) == 0, (k, fmt, kind, algorithm)
                b = tn.tolerance("all_reduce", p, algorithm=algorithm, reduce_op="avg").abs
                assert int(((avg - ref).abs() > b + 2.0**-52 * ref.abs()).sum()) == 0, (k, fmt, kind, algorithm)


def test_in_process_gloo_multi_segment_chunks():
    """12 MB of fp32 on 4 ranks: 12 segments, three per chunk; the layout still matches."""
    from bench.cases.collectives import gloo_all_reduce
    p = make_partials("wide", 4, 3_000_001, "fp32", "fp32", 70)
    assert torch.equal(gloo_all_reduce(p, "fp32").to(torch.float64), emulate_all_reduce(p, "fp32"))


# ----------------------------------------------------------------------------- emulation


def _emulated_cases():
    for k in (2, 3, 5, 8, 16, 64):
        for fmt in ("fp32", "bf16", "fp16"):
            for kind in ("normal", "positive", "cancel", "wide", "tiny"):
                yield k, fmt, kind


@pytest.mark.parametrize("k", [2, 3, 5, 8, 16, 64])
def test_emulated_orders_deterministic(k):
    """Every order (gloo ring, textbook ring, chain, tree) within the 'any' bound; the tree
    within the tighter 'tree' bound; for formats also narrower than the partials."""
    n = 2048
    for fmt in ("fp32", "bf16", "fp16"):
        for i, kind in enumerate(("normal", "positive", "cancel", "wide", "tiny")):
            for stored in sorted({fmt, "fp32"}):
                p = make_partials(kind, k, n, stored, fmt, 100 * k + i)
                exact = exact_sum(p.T, dim=-1)
                b_any = tn.tolerance("all_reduce", p, fmt=fmt).abs
                b_tree = tn.tolerance("all_reduce", p, fmt=fmt, algorithm="tree").abs
                runs = {"gloo ring": emulate_all_reduce(p, fmt), "chain": emulate_all_reduce(p, fmt, "chain"),
                        "ring c+1 up": emulate_all_reduce(p, fmt, start=1, step=1)}
                for label, y in runs.items():
                    assert int(((y - exact).abs() > b_any).sum()) == 0, (k, fmt, kind, stored, label)
                b_gloo = tn.tolerance("all_reduce", p, fmt=fmt, algorithm="gloo").abs
                assert int(((runs["gloo ring"] - exact).abs() > b_gloo).sum()) == 0, (k, fmt, kind, stored)
                y = emulate_all_reduce(p, fmt, "tree")
                assert int(((y - exact).abs() > b_tree).sum()) == 0, (k, fmt, kind, stored, "tree")


@pytest.mark.parametrize("algorithm", ["any", "gloo"])
def test_emulated_probabilistic_binomial_large_k(algorithm):
    """At k = 32, 64 the Azuma bound is below the deterministic one: test its claim."""
    viol = total = 0
    for k in (32, 64):
        for fmt in ("bf16", "fp16", "fp32"):
            for i, kind in enumerate(("normal", "positive", "wide")):
                p = make_partials(kind, k, 4096, fmt, fmt, 7 * k + i)
                det = tn.tolerance("all_reduce", p, fmt=fmt, algorithm=algorithm)
                b = tn.tolerance("all_reduce", p, fmt=fmt, algorithm=algorithm, mode="probabilistic",
                                 failure_probability=P_TEST)
                assert (b.abs <= det.abs).all() and (b.abs < det.abs).any()
                err = (emulate_all_reduce(p, fmt) - exact_sum(p.T, dim=-1)).abs()
                viol += int((err > b.abs).sum())
                total += err.numel()
    assert _binomial_pvalue(viol, total) > 1e-3, (viol, total)


def test_wrong_model_gloo_order_claimed_for_another_order_is_caught():
    """The known-order bound is specific to gloo's order: a textbook ring (chunk c starting at
    rank c+1, ascending) or a rank-order chain computed on the same data violates it."""
    p = make_partials("normal", 4, 4096, "bf16", "bf16", 1)
    exact = exact_sum(p.T, dim=-1)
    b = tn.tolerance("all_reduce", p, algorithm="gloo").abs
    assert int(((emulate_all_reduce(p) - exact).abs() > b).sum()) == 0
    for y in (emulate_all_reduce(p, start=1, step=1), emulate_all_reduce(p, None, "chain")):
        assert int(((y - exact).abs() > b).sum()) > 0


def test_wrong_model_tree_height_for_a_chain_is_caught():
    """Claiming a tree (height 6) for a 64-rank ring (height 63) is violated on positive data."""
    p = make_partials("positive", 64, 4096, "bf16", "bf16", 3)
    err = (emulate_all_reduce(p, "bf16") - exact_sum(p.T, dim=-1)).abs()
    assert int((err > tn.tolerance("all_reduce", p, algorithm="tree").abs).sum()) > 0
    assert int((err > tn.tolerance("all_reduce", p, algorithm="ring").abs).sum()) == 0


@pytest.mark.parametrize("k", [3, 5, 6])
def test_emulated_avg_not_power_of_two(k):
    for fmt in ("bf16", "fp16", "fp32"):
        for i, kind in enumerate(("normal", "cancel", "tiny")):
            p = make_partials(kind, k, 2048, fmt, fmt, 50 + i)
            y = emulate_all_reduce(p, fmt, reduce_op="avg")
            ref = exact_sum(p.T, dim=-1) / k  # within 2^-52 |ref| of s/k (two float64 roundings)
            b = tn.tolerance("all_reduce", p, reduce_op="avg").abs
            assert int(((y - ref).abs() > b + 2.0**-52 * ref.abs()).sum()) == 0, (k, fmt, kind)


def test_emulated_difference_bound():
    for k in (2, 4, 8, 64):
        for fmt in ("bf16", "fp16", "fp32"):
            p = make_partials("normal", k, 4096, "fp32", fmt, k)
            ref = p.sum(0).to(DTYPES[fmt]).to(torch.float64)  # one device: fp32 sum, then the format
            y = emulate_all_reduce(p, fmt)
            for mode in ("deterministic", "probabilistic"):
                b = C.all_reduce_difference(p, fmt=fmt, mode=mode)
                assert int(((y - ref).abs() > b.abs).sum()) == 0, (k, fmt, mode)


# ----------------------------------------------------------------------------- model structure and API


def test_levels_count_the_conversion_only_when_inexact():
    g = torch.Generator().manual_seed(0)
    p32 = torch.randn(4, 64, generator=g)
    on_grid = p32.to(torch.bfloat16).to(torch.float32)
    assert C.all_reduce(p32, fmt="bf16").explanation.values["levels"] == 4  # 3 hops + conversion
    assert C.all_reduce(on_grid, fmt="bf16").explanation.values["levels"] == 3
    assert C.all_reduce(p32, fmt="bf16", algorithm="tree").explanation.values["levels"] == 3
    assert C.all_reduce(p32[:1], fmt="bf16").explanation.values["levels"] == 1
    assert not C.all_reduce(on_grid[:1].to(torch.bfloat16)).abs.any()  # k = 1: nothing happens
    # k = 2: one addition, the bound is the half-ulp of its result
    two = torch.tensor([[1.0, 3.0], [2.0**-8, 2.0**-7]], dtype=torch.bfloat16)
    assert C.all_reduce(two).abs.tolist() == [2.0**-8, 2.0**-7]


def test_api_registration_and_errors():
    p = torch.randn(4, 8, dtype=torch.bfloat16)
    for name in ("all_reduce", "allreduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather",
                 "all_gather_into_tensor"):
        assert name in tn.bounds.common.OPS
    assert "all_reduce" in tn.ops()
    assert torch.equal(tn.tolerance("reduce_scatter", p).abs, tn.tolerance("all_reduce", p).abs)
    assert torch.equal(tn.tolerance("reduce_scatter", p, 3).abs, tn.tolerance("all_reduce", p[:, 6:]).abs)
    assert torch.equal(tn.tolerance("all_reduce", p, compute_fmt="bf16").abs, tn.tolerance("all_reduce", p).abs)
    with pytest.raises(ValueError, match="divisible"):
        tn.tolerance("reduce_scatter", p[:, :7])
    with pytest.raises(ValueError, match="rank"):
        tn.tolerance("reduce_scatter", p, 4)
    with pytest.raises(ValueError, match="cannot differ"):
        tn.tolerance("all_reduce", p, fmt="bf16", compute_fmt="fp32")
    with pytest.raises(ValueError, match="algorithm"):
        tn.tolerance("all_reduce", p, algorithm="butterfly")
    with pytest.raises(ValueError, match="algorithm"):
        emulate_all_reduce(p, None, "butterfly")
    with pytest.raises(ValueError, match="reduce_op must be"):
        tn.tolerance("all_reduce", p, reduce_op="max")
    assert tn.tolerance("all_reduce", p, out_fmt="fp32").max() == tn.tolerance("all_reduce", p).max()
    assert tn.tolerance("all_reduce", p.float(), out_fmt="bf16").max() > tn.tolerance("all_reduce", p.float()).max()


def test_all_gather_into_a_narrower_format():
    x = torch.randn(4, 100, dtype=torch.float32)
    b = tn.tolerance("all_gather", x, fmt="bf16")
    err = (round_to(x.reshape(-1), "bf16") - x.reshape(-1).double()).abs()
    assert (err <= b.abs).all() and (err > 0).any() and b.abs.any()
