"""Noise for every modelled op, the injector's op census, and the ``unmodelled`` status (issue 31, item 4).

* ``F.scaled_dot_product_attention``, ``F.cross_entropy`` and ``F.mse_loss`` are perturbed by
  their models' bounds, forward and backward: the deviation a sample causes is nonzero and
  within twice the deterministic bound (two runs) plus the rounding of the perturbed result;
* ``F.embedding`` is exact in forward (counted ``exact``) and its weight gradient gets the
  bound of the token sums;
* the census lists an op without a model as ``unmodelled`` (inside the optimizer's step as
  ``optimizer``; named in ``accepted`` as ``accepted``);
* the comparison marks the tensors recorded after an unmodelled op ``unmodelled`` and calls the
  run ``unverified``, unless ``accept_unmodelled=True``.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ttrace_num as tn
from ttrace_num.bounds.attention import attention_backward, torch_cpu_sdpa_model
from ttrace_num.formats import get_format, half_ulp
from ttrace_num.propagate.noise import NoiseInjector


def _injector(seed: int = 1, **kw) -> NoiseInjector:
    return NoiseInjector(torch.Generator().manual_seed(seed), mode="probabilistic", **kw)


def _within(dev: torch.Tensor, bound: torch.Tensor, result: torch.Tensor) -> bool:
    """``dev <= 2 bound + hu(|result| + 2 bound)``: two runs' noise, then the rounding of the
    perturbed result back to its dtype."""
    b2 = 2 * bound.double()
    return bool((dev <= b2 + half_ulp(result.double().abs() + b2, get_format(result.dtype)) * (1 + 2 ** -20)).all())


def _leaves(*shapes, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(dtype).requires_grad_() for s in shapes]


def test_sdpa_forward_and_backward_are_perturbed_within_their_bounds():
    q, k, v = _leaves((2, 4, 32, 16), (2, 4, 32, 16), (2, 4, 32, 16))
    w = torch.randn(2, 4, 32, 16, generator=torch.Generator().manual_seed(9)).bfloat16()

    def run():
        for t in (q, k, v):
            t.grad = None
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o.backward(w)  # dO = w in both runs: the gradients differ by their own noise only
        return o.detach(), [t.grad.clone() for t in (q, k, v)]
    o0, g0 = run()
    inj = _injector()
    with inj:
        o1, g1 = run()
    assert inj.census()["perturbed"] == {"torch.nn.functional.scaled_dot_product_attention": 1}
    bound = tn.tolerance("attention", q, k, v, is_causal=True, **torch_cpu_sdpa_model(q)).abs
    dev = (o1.double() - o0.double()).abs()
    assert dev.max() > 0 and _within(dev, bound, o0)
    grads = attention_backward(q.detach(), k.detach(), v.detach(), w, is_causal=True,
                               **torch_cpu_sdpa_model(q, backward=True))
    for a, b, gb in zip(g0, g1, grads):
        d = (a.double() - b.double()).abs()
        assert d.max() > 0 and _within(d, gb.abs, a)


def test_cross_entropy_and_mse_are_perturbed_within_their_bounds():
    (x,) = _leaves((64, 32))
    tgt = torch.randint(0, 32, (64,), generator=torch.Generator().manual_seed(3))
    (y,) = _leaves((64, 32), seed=5)

    def run(loss_fn):
        x.grad = None
        loss = loss_fn()
        (loss / 4).backward()  # an exact scaling: the upstream gradient 1/4 reaches the loss
        return loss.detach(), x.grad.clone()
    for name, fn, fwd, bwd in (
            ("cross_entropy", lambda: F.cross_entropy(x, tgt),
             lambda: tn.tolerance("cross_entropy", x, tgt).abs,
             lambda: tn.tolerance("cross_entropy_backward", x, tgt, grad_output=0.25).abs),
            ("mse_loss", lambda: F.mse_loss(x, y.detach()),
             lambda: tn.tolerance("mse_loss", x, y.detach()).abs,
             lambda: tn.tolerance("mse_loss_backward", x, y.detach(), torch.tensor(0.25)).abs)):
        l0, g0 = run(fn)
        inj = _injector()
        with inj:
            l1, g1 = run(fn)
        assert f"torch.nn.functional.{name}" in inj.census()["perturbed"], inj.census()
        d = (l1.double() - l0.double()).abs()
        assert d > 0 and _within(d, fwd(), l0), name
        dg = (g1.double() - g0.double()).abs()
        assert dg.max() > 0 and _within(dg, bwd(), g0), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_mse_loss_bounds_hold(dtype, reduction):
    for seed in range(10):
        g = torch.Generator().manual_seed(seed)
        x, y = (torch.randn(16, 8, generator=g) * 3).to(dtype), torch.randn(16, 8, generator=g).to(dtype)
        d2 = (x.double() - y.double()) ** 2
        exact = {"mean": d2.mean(), "sum": d2.sum(), "none": d2}[reduction]
        assert ((F.mse_loss(x, y, reduction=reduction).double() - exact).abs()
                <= tn.tolerance("mse_loss", x, y, reduction=reduction).abs).all()
        xr = x.clone().requires_grad_()
        go = torch.randn(16, 8, generator=g).to(dtype) if reduction == "none" else torch.tensor(0.37).to(dtype)
        F.mse_loss(xr, y, reduction=reduction).backward(go)
        norm = 2 / x.numel() if reduction == "mean" else 2
        exact_g = norm * (x.double() - y.double()) * go.double()
        assert ((xr.grad.double() - exact_g).abs()
                <= tn.tolerance("mse_loss_backward", x, y, go, reduction=reduction).abs).all()


def test_embedding_forward_exact_weight_gradient_perturbed():
    (w,) = _leaves((16, 8))
    idx = torch.randint(0, 16, (4, 12), generator=torch.Generator().manual_seed(2))  # repeated tokens
    gout = torch.randn(4, 12, 8, generator=torch.Generator().manual_seed(4)).bfloat16()

    def run():
        w.grad = None
        e = F.embedding(idx, w)
        e.backward(gout)
        return e.detach(), w.grad.clone()
    e0, g0 = run()
    inj = _injector()
    with inj:
        e1, g1 = run()
    census = inj.census()
    assert census["exact"].get("torch.nn.functional.embedding") == 1 and not census["unmodelled"]
    assert torch.equal(e0, e1)  # a gather: no noise
    counts = torch.bincount(idx.reshape(-1), minlength=16)
    dev = (g1.double() - g0.double()).abs()
    assert dev[counts > 1].max() > 0 and dev[counts <= 1].max() == 0  # one term per row: exact
    # the bound of each row's sum of its tokens' gradients, recursive in bf16 (the CPU kernel's chain)
    bound = torch.zeros(16, 8, dtype=torch.float64)
    for r in range(16):
        terms = gout.reshape(-1, 8)[idx.reshape(-1) == r]
        if len(terms) > 1:
            bound[r] = tn.tolerance("sum", terms, dim=0, summation=tn.Summation(accum="bf16")).abs
    assert _within(dev, bound, g0)


def test_census_categories():
    x = torch.randn(8, 8).bfloat16().requires_grad_()
    p = torch.zeros(8)
    inj = _injector(accepted={"torch.tanh": "a test's reason"})
    with inj:
        y = torch.exp(x) * 0.5          # exp: no model; * 0.5: an exact scaling
        z = torch.tanh(y)               # accepted
        z.float().sum().backward()      # a full sum: modelled (dim=None, torch's default)
        with torch.no_grad():
            p.mul_(4)                   # in-place power-of-two scaling: exact
            p.add_(1.0)                 # in-place arithmetic outside the optimizer: no model
            with inj.optimizer_step():
                p.addcmul_(p, p, value=0.1)  # the optimizer's update: counted apart
        torch.arange(8, dtype=torch.bfloat16)  # integers the format holds: exact
        F.relu(x).view(-1)
    c = inj.census()
    assert c["unmodelled"] == {"torch.exp": 1, "torch.Tensor.add_": 1}
    assert c["accepted"] == {"torch.tanh": 1} and c["optimizer"] == {"torch.Tensor.addcmul_": 1}
    assert c["perturbed"] == {"torch.Tensor.sum": 1}  # the full sum, modelled since dim=None is
    for name in ("torch.Tensor.mul", "torch.Tensor.mul_", "torch.arange", "torch.nn.functional.relu",
                 "torch.Tensor.view", "torch.Tensor.float"):
        assert name in c["exact"], name
    assert inj.unmodelled_calls == 2


# --------------------------------------------------------------------- the comparison
class _Net(nn.Module):
    def __init__(self, unmodelled: bool) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        self.unmodelled = unmodelled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = torch.exp(-h * h) if self.unmodelled else F.gelu(h)
        return self.b(h)


def _trace(root, unmodelled: bool, samples: int) -> None:
    from tracer.adapters.ddp import DDPTracer
    from tracer.capture.noise_sampler import NoiseSampler
    from tracer.trace.store import TraceWriter
    torch.manual_seed(0)
    model = _Net(unmodelled)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    lay, sig = {"dp": 1}, f"coverage test net {unmodelled}"
    tr = DDPTracer(model, TraceWriter(root, 0, 1, lay, sig), num_microbatches=1)
    ns = NoiseSampler(model, opt, root, layout=lay, signature=sig, samples=samples) if samples else None
    g = torch.Generator().manual_seed(7)
    for step in range(2):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)

        def train_step(writer=None):
            with tr.step(step, writer):
                tr.microbatch(0)
                loss = F.mse_loss(model(x), y)
                tr.record_loss(loss)
                loss.backward()
                tr.after_backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                tr.after_optimizer_step()
        ns.step(step, train_step) if ns else train_step()
    tr.remove()


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("coverage")
    for unmodelled in (True, False):
        _trace(root / f"ref_{unmodelled}", unmodelled, samples=2)
        _trace(root / f"cand_{unmodelled}", unmodelled, samples=0)  # the same run: bitwise equal
    return root


def test_tensors_after_an_unmodelled_op_are_not_ok(traces):
    from tracer.compare.check import compare
    meta = json.loads((traces / "ref_True" / "noise" / "sample_0" / "run.json").read_text())["meta"]
    assert meta["ops"]["unmodelled"] == {"torch.exp": 2}  # one call a step
    assert "torch.nn.functional.mse_loss" in meta["ops"]["perturbed"]
    assert set(meta["ops"]["optimizer"]) >= {"torch.Tensor.addcdiv_", "torch.Tensor.lerp_"}
    c = compare(traces / "ref_True", traces / "cand_True")
    assert c.first is None and c.verdict == "unverified"
    status = {(r.step, r.phase, r.name): str(r.status) for r in c.rows}
    # before the first exp: the first linear's input and output; from there on everything
    assert status[(0, "fwd", "a.input")] == "ok" and status[(0, "fwd", "a.output")] == "ok"
    for key in ((0, "fwd", "b.input"), (0, "fwd", "output"), (0, "loss", "loss"), (0, "bwd", "a.output_grad"),
                (0, "grad", "a.weight"), (1, "fwd", "a.output"), (1, "param", "b.bias")):
        assert status[key] == "unmodelled", key
    d = c.to_dict()
    assert d["verdict"] == "unverified" and d["coverage"]["unmodelled"] == {"torch.exp": 2}
    assert d["coverage"]["downstream_tensors"] == sum(s == "unmodelled" for s in status.values()) > 0
    accepted = compare(traces / "ref_True", traces / "cand_True", accept_unmodelled=True)
    assert accepted.verdict == "consistent" and set(accepted.counts()) == {"ok"}
    assert accepted.coverage.accepted_by_user and "unmodelled" in accepted.rows[-1].note


def test_fully_modelled_run_is_consistent(traces):
    from tracer.compare.check import compare
    c = compare(traces / "ref_False", traces / "cand_False")
    assert c.verdict == "consistent" and set(c.counts()) == {"ok"}
    assert c.coverage.recorded and c.coverage.unmodelled == {} and c.coverage.downstream == 0
