"""Zigzag CP ring attention (examples/torch_parallel/ring_attention.py) against single-device attention.

One gloo launch (4 ranks) computes everything (module-scoped fixture): cp=2 runs on the
subgroups {0, 1} (fp32) and {2, 3} (bf16) at the same time, cp=4 on all ranks (fp32, then
bf16); each configuration runs the correct ring and two backward bug patches (B28: stale
step-0 K/V; B02-like: block-local log-sum-exp). The shards are put back in global order
with the zigzag positions and compared, in the parent, with

* the exact result: :func:`attention` in float64 on the stored (dtype-rounded) inputs, with
  autograd for dQ/dK/dV. Tolerance: ttrace_num's deterministic elementwise bound of the
  computation the ring performs (``ttrace_num.bounds.attention``, ``algorithm="online"``:
  per CP rank, that rank's query rows against all keys in its ring order, ``T = cp`` blocks
  of ``S / cp`` keys, ``P`` and ``dS`` rounded to the input dtype, ``D = rowsum(dO * O)``).
  ``dK``/``dV`` of a key are the fp32 sum over the ``cp`` ranks of per-rank partials: the
  bound is the sum of the per-rank partial bounds, plus ``(cp - 1) u_fp32`` times the summed
  partial magnitudes (the cross-rank additions), plus the final rounding to the dtype.
* the same-dtype single-device reference :func:`attention` with autograd (what a TTrace
  harness compares): tolerance ``max(ring bound) + max(reference bound)``, the reference
  bound from ttrace_num's ``"standard"`` model (scores and ``P`` stored in the dtype). In bf16
  the reference *backward* (autograd through bf16 GEMMs: ``dP`` and ``scale dS`` rounded to
  bf16) is outside that model; its bound there is the ring's bound plus
  ``4 u_bf16 max|exact|`` (stated, not derived).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from examples.gloo import run_gloo
from examples.torch_parallel.bugs import UNIT_PATCHES
from examples.torch_parallel import ring_attention as RA
from ttrace_num.bounds.attention import attention as attn_bound
from ttrace_num.bounds.attention import attention_backward as attn_bwd_bound
from ttrace_num.formats import get_format, half_ulp
from tracer.trace.canonical import Placement, ShardDim, shard

S, H, DH = 64, 2, 16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VARIANTS = ("correct", "stale_kv", "local_lse")
U32 = 2.0 ** -24


def make_inputs(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Full-sequence ``q, k, v, dO`` ``[S, H, DH]`` in ``dtype`` (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(S, H, DH, generator=g).to(dtype) for _ in range(4))


# bug patches (what a harness sets the hooks to)
PATCHES = {"correct": {}, "stale_kv": {"_backward_kv": UNIT_PATCHES["B28"][2]},
           "local_lse": {"_backward_lse": UNIT_PATCHES["B02"][2]}}


def _run_config(dt: str, group, cp: int, cp_rank: int) -> dict:
    q, k, v, do = make_inputs(DTYPES[dt])
    pos = RA.cp_positions(S, cp, cp_rank)
    res = {"pos": pos}
    for name in VARIANTS:
        saved = {a: getattr(RA, a) for a in PATCHES[name]}
        try:
            for a, f in PATCHES[name].items():
                setattr(RA, a, f)
            ql, kl, vl = (t[pos].clone().requires_grad_(True) for t in (q, k, v))
            out = RA.ring_attention(ql, kl, vl, pos, group)
            out.backward(do[pos])
            res[name] = {"out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
        finally:
            for a, f in saved.items():
                setattr(RA, a, f)
    return res


def _work(rank: int, world: int) -> dict:
    g01, g23 = dist.new_group([0, 1]), dist.new_group([2, 3])
    out = {}
    if rank < 2:
        out[(2, "fp32")] = _run_config("fp32", g01, 2, rank)
    else:
        out[(2, "bf16")] = _run_config("bf16", g23, 2, rank - 2)
    world_group = dist.new_group(list(range(world)))
    for dt in DTYPES:
        out[(4, dt)] = _run_config(dt, world_group, 4, rank)
    return out


def _gather(per_rank: list[dict], key, variant: str) -> dict[str, torch.Tensor]:
    """Full-sequence tensors of one configuration, put back in global order by positions."""
    full = {}
    for name in ("out", "dq", "dk", "dv"):
        t = None
        for res in per_rank:
            if key not in res:
                continue
            x = res[key][variant][name]
            if t is None:
                t = torch.empty((S,) + tuple(x.shape[1:]), dtype=x.dtype)
            t[res[key]["pos"]] = x
        full[name] = t
    return full


def _exact(dtype: torch.dtype, q_rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """fp64 attention on the stored inputs (rows ``q_rows`` of the queries, all keys)."""
    q, k, v, do = (t.double() for t in make_inputs(dtype))
    rows = torch.arange(S) if q_rows is None else q_rows
    ar = torch.arange(S)
    qd, kd, vd = q[rows].requires_grad_(True), k.clone().requires_grad_(True), v.clone().requires_grad_(True)
    out = RA.attention(qd, kd, vd, rows, ar)
    out.backward(do[rows])
    return {"out": out.detach(), "dq": qd.grad, "dk": kd.grad, "dv": vd.grad}


def _same_dtype_reference(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    q, k, v, do = make_inputs(dtype)
    ar = torch.arange(S)
    qd, kd, vd = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = RA.attention(qd, kd, vd, ar, ar)
    out.backward(do)
    return {"out": out.detach(), "dq": qd.grad, "dk": kd.grad, "dv": vd.grad}


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, 1).double()


def ring_bounds(cp: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Elementwise deterministic bounds ``[S, H, DH]`` on ``|ring - exact|`` (module docstring)."""
    q, k, v, do = make_inputs(dtype)
    fmt = get_format(dtype)
    kw = dict(algorithm="online", block_size=S // cp, fmt=dtype, p_fmt=dtype, mode="deterministic")
    b = {n: torch.zeros(S, H, DH, dtype=torch.float64) for n in ("out", "dq", "dk", "dv")}
    mag = {n: torch.zeros(S, H, DH, dtype=torch.float64) for n in ("dk", "dv")}
    for r in range(cp):
        rows = RA.zigzag_indices(S, cp, r)
        order = torch.cat([RA.zigzag_indices(S, cp, (r - i) % cp) for i in range(cp)])  # ring order
        mask = order[None, :] > rows[:, None]
        qr, kr, vr, dor = (_heads_first(t) for t in (q[rows], k[order], v[order], do[rows]))
        args = (qr.to(dtype), kr.to(dtype), vr.to(dtype))
        b["out"][rows] = attn_bound(*args, mask=mask, **kw).abs.transpose(0, 1)
        g = attn_bwd_bound(*args, dor.to(dtype), mask=mask, delta="output", ds_fmt=dtype, **kw)
        b["dq"][rows] = g.dq.abs.transpose(0, 1)
        part = _exact(dtype, rows)  # this rank's exact partial dK/dV (keys in global order)
        for n, bb in (("dk", g.dk.abs), ("dv", g.dv.abs)):
            pb = torch.empty(S, H, DH, dtype=torch.float64)
            pb[order] = bb.transpose(0, 1)
            b[n] += pb
            mag[n] += part[n].abs() + pb
    exact = _exact(dtype)
    for n in ("dk", "dv"):
        b[n] += (cp - 1) * U32 * 1.01 * mag[n]  # the fp32 additions of the cp partials
        b[n] += half_ulp(exact[n].abs() + b[n], fmt)  # final rounding to the dtype
    return b


def reference_bounds(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Bounds on ``|attention(dtype) - exact|`` (ttrace_num ``"standard"`` model)."""
    q, k, v, do = (_heads_first(t).to(dtype) for t in make_inputs(dtype))
    ar = torch.arange(S)
    mask = ar[None, :] > ar[:, None]
    kw = dict(algorithm="standard", fmt=dtype, score_fmt=dtype, p_fmt=dtype, mode="deterministic")
    out = {"out": attn_bound(q, k, v, mask=mask, **kw).abs.transpose(0, 1)}
    if dtype == torch.float32:
        g = attn_bwd_bound(q, k, v, do, mask=mask, delta="probs", **kw)
        out.update(dq=g.dq.abs.transpose(0, 1), dk=g.dk.abs.transpose(0, 1), dv=g.dv.abs.transpose(0, 1))
    return out


@pytest.fixture(scope="module")
def results():
    per_rank = run_gloo(_work, 4, timeout_s=240)
    data = {}
    for cp in (2, 4):
        for dt, dtype in DTYPES.items():
            key = (cp, dt)
            exact, ref = _exact(dtype), _same_dtype_reference(dtype)
            rb, refb = ring_bounds(cp, dtype), reference_bounds(dtype)
            data[key] = {"runs": {v: _gather(per_rank, key, v) for v in VARIANTS},
                         "exact": exact, "ref": ref, "ring_bound": rb, "ref_bound": refb}
    return data


def _err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.double() - b.double()).abs()


CONFIGS = [(cp, dt) for cp in (2, 4) for dt in DTYPES]
NAMES = ("out", "dq", "dk", "dv")


@pytest.mark.parametrize("cp,dt", CONFIGS)
def test_ring_within_bound_of_exact(results, cp, dt):
    d = results[(cp, dt)]
    run = d["runs"]["correct"]
    for n in NAMES:
        err, bound = _err(run[n], d["exact"][n]), d["ring_bound"][n]
        assert torch.isfinite(run[n]).all(), n
        assert (err <= bound).all(), (n, float(err.max()), float(bound.max()), float((err / bound).max()))


def _ref_tolerance(d: dict, n: str, dtype: torch.dtype) -> float:
    rb = float(d["ring_bound"][n].max())
    if n in d["ref_bound"]:
        return rb + float(d["ref_bound"][n].max())
    return 2 * rb + 4 * get_format(dtype).u * float(d["exact"][n].abs().max())


@pytest.mark.parametrize("cp,dt", CONFIGS)
def test_ring_matches_same_dtype_reference(results, cp, dt):
    d = results[(cp, dt)]
    run = d["runs"]["correct"]
    for n in NAMES:
        err, tol = float(_err(run[n], d["ref"][n]).max()), _ref_tolerance(d, n, DTYPES[dt])
        assert err <= tol, (n, err, tol)


@pytest.mark.parametrize("variant", ["stale_kv", "local_lse"])
@pytest.mark.parametrize("cp,dt", CONFIGS)
def test_backward_bug_patches_detected(results, cp, dt, variant):
    d = results[(cp, dt)]
    bug, good = d["runs"][variant], d["runs"]["correct"]
    assert torch.equal(bug["out"], good["out"])  # forward unaffected
    for n in ("dq", "dk", "dv"):
        assert torch.isfinite(bug[n]).all(), (variant, n)  # silently wrong: no NaN/inf
    for n in ("dq", "dk", "dv"):
        # the same-dtype comparison a harness makes flags it: max error > 5x the (max-based) tolerance
        err, tol = float(_err(bug[n], d["ref"][n]).max()), _ref_tolerance(d, n, DTYPES[dt])
        assert err > 5 * tol, (variant, n, err, tol)
        # elementwise against the exact result: some element is > 100x its own bound
        ratio = float((_err(bug[n], d["exact"][n]) / d["ring_bound"][n]).max())
        assert ratio > 100, (variant, n, ratio)


def test_no_group_runs_reference_attention():
    q, k, v, _ = make_inputs(torch.float32)
    pos = torch.arange(S)
    assert torch.equal(RA.ring_attention(q, k, v, pos, None), RA.attention(q, k, v, pos, pos))


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_zigzag_matches_canonical_shard(cp):
    x = torch.arange(S * 3).reshape(S, 3)
    parts = []
    for r in range(cp):
        idx = RA.zigzag_indices(S, cp, r)
        pl = Placement(dims=(ShardDim(0, "cp", r, cp, "zigzag"),))
        assert torch.equal(shard(x, pl), x[idx])
        parts.append(idx)
    assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(S))
    assert torch.equal(RA.cp_positions(S, cp, 0), RA.zigzag_indices(S, cp, 0))


def test_rope_positions_bug_changes_output(monkeypatch):
    x = torch.randn(S, H, DH)
    full = RA.rope(x, torch.arange(S))
    # rotation preserves the norm of every (x1_i, x2_i) pair; position 0 is the identity
    assert torch.allclose(full[0], x[0])
    assert torch.allclose(full.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
    for cp in (2, 4):
        for r in range(cp):
            pos = RA.cp_positions(S, cp, r)
            assert torch.equal(RA.rope(x[pos], pos), full[pos])
    def contiguous_positions(seq_len, cp, cp_rank):  # B29: a contiguous chunk per rank
        return torch.arange(cp_rank * seq_len // cp, (cp_rank + 1) * seq_len // cp)

    monkeypatch.setattr(RA, "cp_positions", contiguous_positions)
    for cp in (2, 4):
        for r in range(cp):
            idx = RA.zigzag_indices(S, cp, r)
            diff = float((RA.rope(x[idx], RA.cp_positions(S, cp, r)) - full[idx]).abs().max())
            assert diff > 0.1, (cp, r, diff)  # every rank: its second chunk is rotated wrongly
