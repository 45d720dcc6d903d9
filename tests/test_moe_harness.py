"""MoE layer of the harness (``examples/torch_parallel/moe.py``): expert parallelism EP=2 with
the sequence split over the same 2 ranks (``stat_group`` of size 2) against the single-device
layer on the same data and weights, fp32 and bf16, and the injected MoE bugs.

One gloo launch (2 ranks) for the whole module; the single-device references run in the
test process.

Tolerances (all from ``ttrace_num`` deterministic bounds, i.e. worst case for ANY summation
order, plus the exact propagation of any difference in the inputs of the last op):

* router-weight grad ``dW = G^T X`` (fp32: ``G`` = grad of the fp32 logits, ``X = x.float()``;
  EP = two half-sequence GEMMs summed over the ranks, still a sum of the same ``T`` terms):
  ``B(G_ref, X) + B(G_ep, X) + |G_ep - G_ref|^T |X|`` with ``B`` =
  ``tolerance("linear_backward_weight")`` (each run is within ``B`` of the exact product of
  its own stored inputs; triangle inequality through the exact values);
* expert grads ``dfc1_e = dh_e^T x_e``, ``dfc2_e = dy_e^T a_e`` (model dtype; the same
  rows in the same order on both layouts): the same construction per expert;
* aux loss ``s * sum_e c_e S_e``: ``S_e`` by ``tolerance("sum")`` per run plus
  ``sum_t |dp|``; the counts ``c_e`` must agree exactly; the fp32 dot over ``E`` experts and
  the two scalings add ``gamma_{E+3} |aux|`` per run;
* output ``out[t] = sum_j c_j`` (``k`` contributions, added in the model dtype in a
  different order): ``2 gamma_{k-1} sum_j |c_j| + sum_j |c_j,ep - c_j,ref|``.

Each test asserts ``max |diff| / tol <= 1``; the bug tests assert that an injected bug moves
the same quantity by more than 100 tolerances (so every test fails if the layer, the
dispatcher's collectives or the patch points stop doing what they state).
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import ttrace_num as tn
from examples.gloo import run_gloo
from examples.torch_parallel.bugs import UNIT_PATCHES
from examples.torch_parallel import moe as M

HIDDEN, FFN, E, K, T, SEED, COEFF = 32, 64, 4, 2, 64, 1234, 1e-2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
U = {"fp32": 2.0 ** -24, "bf16": 2.0 ** -8}
WORLD = 2


def _gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u)


def data(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence ``x [T, hidden]`` and the fixed cotangent ``R`` of the main loss
    ``sum(out.float() * R)``."""
    g = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(T, HIDDEN, generator=g).to(dtype)
    r = torch.randn(T, HIDDEN, generator=g)
    return x, r


BUGS = {  # name -> (patch point, replacement)
    "B30_local_token_count": ("_aux_token_count", UNIT_PATCHES["B30"][2]),
    "B04_router_grad_not_reduced": ("_replicated_params", lambda moe: []),
    "B17_gather_backward_no_sum": (
        "_all_gather_backward",
        lambda grad, group: grad.chunk(dist.get_world_size(group), 0)[dist.get_rank(group)].contiguous()),
}


@contextlib.contextmanager
def patched(name: str | None):
    if name is None:
        yield
        return
    attr, fn = BUGS[name]
    old = getattr(M, attr)
    setattr(M, attr, fn)
    try:
        yield
    finally:
        setattr(M, attr, old)


def run_layer(dtype_name: str, ep_group=None, stat_group=None, rank: int = 0, world: int = 1) -> dict:
    """Forward + backward of ``sum(out.float() * R) + aux`` on this rank's block of the
    sequence; router grads reduced over ``stat_group`` as a harness does."""
    dtype = DTYPES[dtype_name]
    x_full, r_full = data(dtype)
    n = T // world
    x = x_full[rank * n:(rank + 1) * n].clone().requires_grad_(True)
    r = r_full[rank * n:(rank + 1) * n]
    layer = M.MoE(HIDDEN, FFN, E, K, dtype, SEED, ep_group=ep_group, stat_group=stat_group, aux_loss_coeff=COEFF)
    layer.capture = {}
    out, aux = layer(x)
    cap = layer.capture
    # the aux loss's own part of the router grad (where B30 shows first), summed over stat_group
    G_aux, router_grad_aux = torch.autograd.grad(aux, [cap["logits"], layer.router.weight], retain_graph=True)
    if stat_group is not None:
        dist.all_reduce(router_grad_aux, group=stat_group)
    ((out.float() * r).sum() + aux).backward()
    M.reduce_replicated_grads(layer)
    experts = {e: {"x": d["x"].detach(), "a": d["a"].detach(), "c": d["c"].detach(), "tokens": d["tokens"],
                   "dh": d["h"].grad, "dy": d["y"].grad} for e, d in cap["experts"].items()}
    return {"out": out.detach(), "aux": aux.detach(), "router_grad": layer.router.weight.grad.clone(),
            "router_grad_aux": router_grad_aux, "G_aux": G_aux,
            "G": cap["logits"].grad, "X": x.detach().float(), "probs": cap["probs"].detach(), "idx": cap["idx"],
            "fc1": layer.experts.fc1.detach(), "fc2": layer.experts.fc2.detach(),
            "fc1_grad": layer.experts.fc1.grad, "fc2_grad": layer.experts.fc2.grad, "experts": experts}


def _worker(rank: int, world: int, jobs: list[tuple[str, str | None]]) -> dict:
    group = dist.group.WORLD
    res = {}
    for dtype_name, bug in jobs:
        with patched(bug):
            res[(dtype_name, bug)] = run_layer(dtype_name, group, group, rank, world)
    return res


JOBS = [("fp32", None), ("bf16", None)] + [("fp32", b) for b in BUGS]


def _combine(per_rank: list[dict]) -> dict:
    """The EP run in single-device layout: tokens concatenated in rank order, expert shards
    concatenated along dim 0, the (already reduced) router grad of rank 0."""
    r0 = per_rank[0]
    cat = lambda k: torch.cat([p[k] for p in per_rank], 0)
    experts = {}
    for p in per_rank:
        experts.update(p["experts"])
    return {"out": cat("out"), "aux": r0["aux"], "aux_all": [p["aux"] for p in per_rank],
            "router_grad": r0["router_grad"], "router_grad_all": [p["router_grad"] for p in per_rank],
            "router_grad_aux": r0["router_grad_aux"], "G_aux": cat("G_aux"), "G": cat("G"), "X": cat("X"), "probs": cat("probs"), "idx": cat("idx"),
            "fc1": cat("fc1"), "fc2": cat("fc2"), "fc1_grad": cat("fc1_grad"), "fc2_grad": cat("fc2_grad"),
            "experts": experts}


@pytest.fixture(scope="module")
def runs() -> dict:
    per_rank = run_gloo(_worker, WORLD, JOBS)
    ep = {job: _combine([per_rank[r][job] for r in range(WORLD)]) for job in JOBS}
    ref = {d: run_layer(d) for d in DTYPES}
    with patched("B30_local_token_count"):
        ref_bug30 = run_layer("fp32")
    return {"ep": ep, "ref": ref, "ref_bug30": ref_bug30}


# ---------------------------------------------------------------------------- tolerances
def _gemm_diff_tol(a_ref: torch.Tensor, b_ref: torch.Tensor, a_ep: torch.Tensor, b_ep: torch.Tensor) -> torch.Tensor:
    """Bound on ``|fl(a_ep^T b_ep) - fl(a_ref^T b_ref)|`` (``a [n, p]``, ``b [n, q]``): each
    within ``tolerance("linear_backward_weight")`` of its exact value, plus the exact
    difference of the exact values."""
    d = lambda t: t.double()
    da, db = (d(a_ep) - d(a_ref)).abs(), (d(b_ep) - d(b_ref)).abs()
    prop = da.t() @ d(b_ep).abs() + d(a_ref).abs().t() @ db
    return (tn.tolerance("linear_backward_weight", a_ref, b_ref).abs
            + tn.tolerance("linear_backward_weight", a_ep, b_ep).abs + prop * (1 + 1e-12))


def router_grad_tol(ref: dict, ep: dict, part: str = "G") -> torch.Tensor:
    """``part="G"``: the whole router grad; ``"G_aux"``: the aux loss's part of it."""
    return _gemm_diff_tol(ref[part], ref["X"], ep[part], ep["X"])


def aux_tol(ref: dict, ep: dict) -> float:
    counts = torch.bincount(ref["idx"].reshape(-1), minlength=E).double()
    dS = (tn.tolerance("sum", ref["probs"], dim=0).abs + tn.tolerance("sum", ep["probs"], dim=0).abs
          + (ep["probs"].double() - ref["probs"].double()).abs().sum(0))
    s = COEFF * E / (K * T * T)
    return float(s * (counts * dS).sum() * (1 + _gamma(E + 3, U["fp32"]))
                 + 2 * _gamma(E + 3, U["fp32"]) * abs(float(ref["aux"])) * 1.01)


def out_tol(ref: dict, ep: dict, dtype_name: str) -> torch.Tensor:
    mag = torch.zeros(T, HIDDEN, dtype=torch.float64)
    dc = torch.zeros(T, HIDDEN, dtype=torch.float64)
    for e, d in ref["experts"].items():
        mag.index_add_(0, d["tokens"], d["c"].double().abs())
        dc.index_add_(0, d["tokens"], (ep["experts"][e]["c"].double() - d["c"].double()).abs())
    return 2 * _gamma(K - 1, U[dtype_name]) * mag + dc


#: allowed difference of an UPSTREAM tensor (the stored inputs of the compared op): each is a
#: per-token chain of at most a few dozen roundings in its format on the same values in both
#: layouts, so C_UP * u * (largest |value| of its row); without this check the propagation
#: terms of the tolerances would absorb any upstream bug (measured: all are bitwise equal)
C_UP = 32


def upstream_ratio(a_ref: torch.Tensor, a_ep: torch.Tensor, u: float) -> float:
    """``max |a_ep - a_ref| / (C_UP u rowmax|a_ref|)`` (rows = tokens); 0 for equal tensors."""
    d = (a_ep.double() - a_ref.double()).abs()
    if not bool((d > 0).any()):
        return 0.0
    scale = a_ref.double().abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    return float((d / (C_UP * u * scale)).max())


def check_upstream(ref: dict, ep: dict, dt: str) -> None:
    """The inputs of every compared op agree (so the propagation terms stay rounding-sized)."""
    assert torch.equal(ep["X"], ref["X"]), "tokens moved wrongly"
    for k in ("G", "G_aux", "probs"):
        assert upstream_ratio(ref[k], ep[k], U["fp32"]) <= 1.0, k
    for e, d in ref["experts"].items():
        o = ep["experts"][e]
        assert torch.equal(o["x"], d["x"]), f"expert {e} input tokens"
        for k in ("dh", "dy", "a", "c"):
            assert upstream_ratio(d[k], o[k], U[dt]) <= 1.0, f"expert {e} {k}"


def ratio(a: torch.Tensor, b: torch.Tensor, tol) -> float:
    """``max |a - b| / tol`` (elementwise)."""
    return float(((a.double() - b.double()).abs() / torch.as_tensor(tol, dtype=torch.float64)).max())


# ---------------------------------------------------------------------------- tests
@pytest.mark.parametrize("dt", list(DTYPES))
def test_routing_and_shards_match_single_device(runs, dt):
    ref, ep = runs["ref"][dt], runs["ep"][(dt, None)]
    assert torch.equal(ep["idx"], ref["idx"]), "top-k routing differs (near-tie flip or a layout bug)"
    assert torch.equal(ep["fc1"], ref["fc1"]) and torch.equal(ep["fc2"], ref["fc2"]), "EP shards != full tensors"
    assert set(ep["experts"]) == set(range(E))
    for e, d in ref["experts"].items():
        assert torch.equal(ep["experts"][e]["tokens"], d["tokens"]), f"expert {e} got other tokens"
    check_upstream(ref, ep, dt)


@pytest.mark.parametrize("dt", list(DTYPES))
def test_output_matches_single_device(runs, dt):
    ref, ep = runs["ref"][dt], runs["ep"][(dt, None)]
    check_upstream(ref, ep, dt)
    assert ep["out"].dtype == DTYPES[dt]
    assert ratio(ep["out"], ref["out"], out_tol(ref, ep, dt)) <= 1.0


@pytest.mark.parametrize("dt", list(DTYPES))
def test_aux_loss_matches_single_device(runs, dt):
    ref, ep = runs["ref"][dt], runs["ep"][(dt, None)]
    check_upstream(ref, ep, dt)
    tol = aux_tol(ref, ep)
    for a in ep["aux_all"]:  # every rank holds the whole-sequence value
        assert abs(float(a) - float(ref["aux"])) <= tol, (float(a), float(ref["aux"]), tol)


@pytest.mark.parametrize("dt", list(DTYPES))
def test_router_grad_matches_single_device(runs, dt):
    ref, ep = runs["ref"][dt], runs["ep"][(dt, None)]
    check_upstream(ref, ep, dt)
    assert ep["router_grad"].dtype == torch.float32
    tol = router_grad_tol(ref, ep)
    assert ratio(ep["router_grad"], ref["router_grad"], tol) <= 1.0
    assert ratio(ep["router_grad_aux"], ref["router_grad_aux"], router_grad_tol(ref, ep, "G_aux")) <= 1.0
    assert torch.equal(ep["router_grad_all"][0], ep["router_grad_all"][1]), "replicated router grads differ"


@pytest.mark.parametrize("dt", list(DTYPES))
def test_expert_grads_match_single_device(runs, dt):
    ref, ep = runs["ref"][dt], runs["ep"][(dt, None)]
    check_upstream(ref, ep, dt)
    for e, d in ref["experts"].items():
        o = ep["experts"][e]
        tol1 = _gemm_diff_tol(d["dh"], d["x"], o["dh"], o["x"])
        tol2 = _gemm_diff_tol(d["dy"], d["a"], o["dy"], o["a"])
        assert ratio(ep["fc1_grad"][e], ref["fc1_grad"][e], tol1) <= 1.0, f"fc1 grad of expert {e}"
        assert ratio(ep["fc2_grad"][e], ref["fc2_grad"][e], tol2) <= 1.0, f"fc2 grad of expert {e}"


def test_b30_local_token_count_detected(runs):
    """B30: the aux-loss normaliser T is the per-rank count (T/2): aux and its gradient x4."""
    ref, bug = runs["ref"]["fp32"], runs["ep"][("fp32", "B30_local_token_count")]
    clean = runs["ep"][("fp32", None)]  # tolerances are those of the correct run
    assert abs(float(bug["aux"]) - float(ref["aux"])) > 100 * aux_tol(ref, clean)
    # x4 on the aux part of the router grad; in the whole router grad the aux part is ~1e-4 of
    # the main part at coeff 1e-2, so there it is only a few tolerances: compare the aux part
    assert ratio(bug["router_grad_aux"], ref["router_grad_aux"], router_grad_tol(ref, clean, "G_aux")) > 100
    assert ratio(bug["router_grad"], ref["router_grad"], router_grad_tol(ref, clean)) > 1
    assert torch.equal(bug["out"], runs["ep"][("fp32", None)]["out"]), "B30 must not touch the output"
    # on one device the local count is the global count: the patch is a no-op there
    assert float(runs["ref_bug30"]["aux"]) == float(ref["aux"])


@pytest.mark.parametrize("bug", ["B04_router_grad_not_reduced", "B17_gather_backward_no_sum"])
def test_router_grad_bugs_detected(runs, bug):
    ref, b, clean = runs["ref"]["fp32"], runs["ep"][("fp32", bug)], runs["ep"][("fp32", None)]
    assert ratio(b["router_grad"], ref["router_grad"], router_grad_tol(ref, clean)) > 100


def dense_reference(layer: M.MoE, x: torch.Tensor, r: torch.Tensor):
    """The layer's math written out densely in float64 (every expert on every token, gated
    by the renormalised top-k probabilities; aux from its formula): output, aux and the grads
    of router, fc1, fc2 of ``sum(out * R) + aux``."""
    W = layer.router.weight.detach().double().requires_grad_(True)
    fc1 = layer.experts.fc1.detach().double().requires_grad_(True)
    fc2 = layer.experts.fc2.detach().double().requires_grad_(True)
    xd = x.double()
    probs = torch.softmax(xd @ W.t(), dim=-1)
    top, idx = torch.topk(probs, K, dim=-1)
    gate = torch.zeros_like(probs).scatter(1, idx, top / top.sum(-1, keepdim=True))   # [T, E]
    ys = torch.stack([torch.nn.functional.gelu(xd @ fc1[e].t()) @ fc2[e].t() for e in range(E)], 1)
    out = (gate.unsqueeze(-1) * ys).sum(1)
    f = torch.bincount(idx.reshape(-1), minlength=E).double() / (K * T)
    aux = COEFF * E * (f * probs.mean(0)).sum()
    ((out * r.double()).sum() + aux).backward()
    return idx, out.detach(), aux.detach(), W.grad, fc1.grad, fc2.grad


def test_single_device_layer_matches_dense_float64():
    """Structure check of the single-device (fp32) layer itself, which the EP comparisons take
    as their reference: against the dense float64 formulas. Allowed: 1e-4 of the largest
    |value| of each tensor (fp32 with sums of <= 64 terms is ~1e-6 there; a wrong factor, a
    detached path or a wrong expert is >= 1e-2)."""
    x, r = data(torch.float32)
    layer = M.MoE(HIDDEN, FFN, E, K, torch.float32, SEED, aux_loss_coeff=COEFF)
    out, aux = layer(x)
    ((out * r).sum() + aux).backward()
    idx, out_d, aux_d, gW, g1, g2 = dense_reference(layer, x, r)
    idx_l = layer.router(x)[0]
    assert torch.equal(idx_l.sort(-1).values, idx.sort(-1).values)
    for got, want in ((out, out_d), (aux, aux_d), (layer.router.weight.grad, gW),
                      (layer.experts.fc1.grad, g1), (layer.experts.fc2.grad, g2)):
        err = float((got.detach().double() - want).abs().max())
        assert err <= 1e-4 * float(want.abs().max()), (err, float(want.abs().max()))
