"""tracer.capture.hooks: the tracer never changes the numerics, records exactly what it should,
in execution order, and round-trips through the store."""
import copy

import pytest
import torch
from torch import nn

from examples.transformer_block import Block
from tracer.trace.canonical import Placement
from tracer.errors import TraceError
from tracer.capture.hooks import Tracer
from tracer.trace.stats import STATS_CHUNK
from tracer.trace.store import TraceReader, TraceWriter


def _mlp(inplace=False, seed=0, hidden=8):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, hidden), nn.ReLU(inplace=inplace), nn.Linear(hidden, 2))


def _writer(root, **kwargs):
    return TraceWriter(root, 0, 1, {}, "test-model", **kwargs)


def _train(model, make_x, opt_cls, steps=3, tracer=None, microbatches=1):
    """A few steps; returns the losses. Traces when ``tracer`` is given."""
    opt = opt_cls(model.parameters(), lr=1e-2)
    losses = []
    for s in range(steps):
        if tracer:
            tracer.begin_step(s)
        opt.zero_grad()
        for mb in range(microbatches):
            if tracer and mb:
                tracer.next_microbatch()
            loss = (model(make_x(s, mb)).float() ** 2).mean()
            if tracer:
                tracer.record("loss", loss, phase="loss")
            loss.backward()
            losses.append(loss.detach().clone())
        opt.step()
        if tracer:
            tracer.record_params()
            tracer.end_step()
    return losses


def _inputs(shape, dtype, requires_grad=False):
    def make(s, mb):
        g = torch.Generator().manual_seed(100 * s + mb)
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_(requires_grad)
    return make


CASES = {
    "mlp-sgd": (lambda: _mlp(), (5, 4), torch.float32, torch.optim.SGD, 1),
    "mlp-inplace-adam-2mb": (lambda: _mlp(inplace=True), (5, 4), torch.float32, torch.optim.Adam, 2),
    "block-fp32-adam": (lambda: Block(hidden=32, heads=4, dtype=torch.float32), (6, 32), torch.float32,
                        torch.optim.Adam, 1),
    "block-bf16-sgd": (lambda: Block(hidden=32, heads=4, dtype=torch.bfloat16), (6, 32), torch.bfloat16,
                       torch.optim.SGD, 2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tracing_is_bitwise_neutral(case, tmp_path):
    make_model, shape, dtype, opt_cls, mbs = CASES[case]
    make_x = _inputs(shape, dtype, requires_grad=True)  # so that input grads are traced too
    ref = make_model()
    ref_losses = _train(ref, make_x, opt_cls, microbatches=mbs)
    model = make_model()
    tracer = Tracer(model, _writer(tmp_path, stage="bf16" in case))  # both copy paths
    losses = _train(model, make_x, opt_cls, tracer=tracer, microbatches=mbs)
    tracer.remove()
    assert len(losses) == len(ref_losses) == 3 * mbs
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.dtype == dtype and torch.equal(p, q), n
    reader = TraceReader(tmp_path)
    assert reader.steps() == [0, 1, 2]
    phases = {e.phase for e in reader.entries(2, 0)}
    assert phases == {"fwd", "bwd", "grad", "param", "loss"}


MLP_FWD = ["input", "0.input", "0.output", "1.input", "1.output", "2.input", "2.output", "output"]
MLP_BWD = ["output_grad", "2.output_grad", "2.input_grad", "1.output_grad", "1.input_grad",
           "0.output_grad"]
MLP_PARAMS = ["0.weight", "0.bias", "2.weight", "2.bias"]


def _trace_mlp(root, **kw):
    model = _mlp()
    tracer = Tracer(model, _writer(root), **kw)
    _train(model, _inputs((5, 4), torch.float32), torch.optim.SGD, steps=1, tracer=tracer)
    tracer.remove()
    return model, TraceReader(root).entries(0, 0)


def test_mlp_records_exactly_the_expected_names(tmp_path):
    _, entries = _trace_mlp(tmp_path)
    got = sorted((e.phase, e.name) for e in entries)
    want = sorted([("fwd", n) for n in MLP_FWD] + [("bwd", n) for n in MLP_BWD]
                  + [("grad", n) for n in MLP_PARAMS] + [("param", n) for n in MLP_PARAMS]
                  + [("loss", "loss")])
    assert got == want  # x needs no grad: no input_grad for the root and layer 0
    assert all(e.microbatch == 0 and e.meta["call"] == 0 for e in entries)


def test_execution_indices_follow_forward_then_backward(tmp_path):
    _, entries = _trace_mlp(tmp_path)
    assert [e.index for e in entries] == list(range(len(entries)))
    order = [(e.phase, e.name) for e in entries]
    assert order[:len(MLP_FWD)] == [("fwd", n) for n in MLP_FWD]  # pre/post hooks in call order
    assert order[len(MLP_FWD)] == ("loss", "loss")
    assert order[-len(MLP_PARAMS):] == [("param", n) for n in MLP_PARAMS]
    back = order[len(MLP_FWD) + 1:-len(MLP_PARAMS)]
    assert {p for p, _ in back} == {"bwd", "grad"}
    pos = {n: i for i, (_, n) in enumerate(back)}
    # backward runs from the last layer to the first
    assert pos["2.output_grad"] < pos["1.output_grad"] < pos["0.output_grad"]
    assert pos["2.weight"] < pos["0.weight"] and pos["2.output_grad"] < pos["2.weight"]


def test_include_exclude_patterns(tmp_path):
    _, entries = _trace_mlp(tmp_path / "a", include=["0", "2"], capture=("fwd_out", "grad"))
    assert sorted(e.name for e in entries if e.phase != "loss") == \
        sorted(["0.output", "2.output"] + MLP_PARAMS)
    _, entries = _trace_mlp(tmp_path / "b", exclude=["", "2", "1"])
    names = {e.name for e in entries}
    assert names == {"loss", "0.input", "0.output", "0.output_grad", "0.weight", "0.bias"}
    _, entries = _trace_mlp(tmp_path / "c", include=["*.weight"])  # a parameter pattern
    assert {(e.phase, e.name) for e in entries} == \
        {("loss", "loss"), ("grad", "0.weight"), ("grad", "2.weight"), ("param", "0.weight"),
         ("param", "2.weight")}
    with pytest.raises(ValueError, match="unknown capture"):
        Tracer(_mlp(), _writer(tmp_path / "d"), capture=("fwd",))


def test_name_and_placement_functions(tmp_path):
    _, entries = _trace_mlp(tmp_path, name_fn=lambda n: f"decoder.{n}" if n else "decoder",
                            placement_fn=lambda n, name, t: Placement((), full_shape=(len(n),)),
                            capture=("fwd_out", "grad"))
    by = {(e.phase, e.name): e for e in entries}
    assert ("fwd", "decoder.output") in by and ("fwd", "decoder.2.output") in by
    assert by[("grad", "decoder.0.weight")].placement.full_shape == (len("0.weight"),)  # from the local name
    assert by[("fwd", "decoder.1.output")].placement.full_shape == (len("1"),)
    assert by[("fwd", "decoder.1.output")].meta["module"] == "1"


def test_round_trip_equals_manual_capture(tmp_path):
    model = _mlp()
    twin = copy.deepcopy(model)
    x = _inputs((5, 4), torch.float32)(0, 0)
    tracer = Tracer(model, _writer(tmp_path))
    _train(model, lambda s, mb: x, torch.optim.SGD, steps=1, tracer=tracer)
    tracer.remove()
    # the same step by hand
    h0 = twin[0](x)
    h1 = twin[1](h0)
    out = twin[2](h1)
    for t in (h0, h1, out):
        t.retain_grad()
    loss = (out ** 2).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in twin.named_parameters()}
    torch.optim.SGD(twin.parameters(), lr=1e-2).step()
    want = {("fwd", "input"): x, ("fwd", "0.output"): h0, ("fwd", "1.output"): h1,
            ("fwd", "2.output"): out, ("fwd", "output"): out, ("loss", "loss"): loss,
            ("bwd", "0.output_grad"): h0.grad, ("bwd", "1.output_grad"): h1.grad,
            ("bwd", "1.input_grad"): h0.grad, ("bwd", "2.output_grad"): out.grad,
            **{("grad", n): g for n, g in grads.items()},
            **{("param", n): p for n, p in twin.named_parameters()}}
    reader = TraceReader(tmp_path)
    reader.validate()
    got = {(e.phase, e.name): reader.load(0, 0, e.key) for e in reader.entries(0, 0)}
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v.detach()), k


def test_microbatches_and_repeated_calls(tmp_path):
    model = _mlp()
    tracer = Tracer(model, _writer(tmp_path), capture=("fwd_out", "grad"))
    with tracer.step(0):
        for mb in range(2):
            if mb:
                assert tracer.next_microbatch() == 1
            x = _inputs((5, 4), torch.float32)(0, mb)
            model(model[2].weight.new_zeros(5, 4))  # a second call in the same microbatch
            model(x).sum().backward()
    entries = TraceReader(tmp_path).entries(0, 0)
    outs = [(e.microbatch, e.meta["call"]) for e in entries if e.name == "2.output"]
    assert outs == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [e.microbatch for e in entries if e.name == "0.weight"] == [0, 1]
    # the grad of microbatch 1 is the accumulated one
    last = TraceReader(tmp_path).load(0, 0, [e for e in entries if e.name == "0.weight"][-1].key)
    assert torch.equal(last, model[0].weight.grad)


def test_remove_leaves_no_hooks_and_records_nothing(tmp_path):
    model = _mlp(inplace=True)
    writer = _writer(tmp_path)
    tracer = Tracer(model, writer)
    assert any(m._forward_hooks for m in model.modules())
    x = _inputs((5, 4), torch.float32, requires_grad=True)(0, 0)
    tracer.begin_step(0)
    y = model(x)  # tensor hooks on a live graph, removed too
    tracer.remove()
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks
        assert not m._forward_hooks_with_kwargs and not m._forward_pre_hooks_with_kwargs
    for p in model.parameters():
        assert not p._post_accumulate_grad_hooks
    for t in (x, y):
        assert not t._backward_hooks
    before = {k: len(v) for k, v in writer._pending.items()}
    y.sum().backward()
    model(x).sum().backward()
    assert {k: len(v) for k, v in writer._pending.items()} == before


def test_outside_a_step(tmp_path):
    model = _mlp()
    writer = _writer(tmp_path)
    tracer = Tracer(model, writer)
    model(torch.ones(2, 4)).sum().backward()  # hooks are silent outside a step
    assert writer.pending_steps() == []
    with pytest.raises(TraceError, match="no step is active"):
        tracer.record("loss", torch.ones(()), phase="loss")
    tracer.begin_step(0)
    with pytest.raises(TraceError, match="still active"):
        tracer.begin_step(1)
    tracer.end_step()
    with pytest.raises(RuntimeError), tracer.step(1):
        raise RuntimeError("boom")
    tracer.begin_step(2)  # the failed step was abandoned, a new one can start
    tracer.end_step()


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_recomputation_is_not_traced_twice(tmp_path, reentrant):
    from torch.utils.checkpoint import checkpoint
    traces = []
    for i, ckpt in enumerate((False, True)):
        model = _mlp()
        tracer = Tracer(model, _writer(tmp_path / str(i)))
        x = _inputs((5, 4), torch.float32, requires_grad=True)(0, 0)
        with tracer.step(0):
            y = checkpoint(model, x, use_reentrant=reentrant) if ckpt else model(x)
            y.pow(2).sum().backward()
        tracer.remove()
        traces.append(_all_tensors(tmp_path / str(i)))
    plain, ckpt = traces
    by_name = lambda t: {k.rsplit("/", 1)[0]: v for (_, k), v in t.items()}
    a, b = by_name(plain), by_name(ckpt)
    assert len(plain) == len(ckpt) == len(a) == 20  # 8 fwd, 8 bwd, 4 grad: each once
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _all_tensors(root):
    reader = TraceReader(root)
    return {(s, e.key): reader.load(s, 0, e.key) for s in reader.steps() for e in reader.entries(s, 0)}


@pytest.mark.parametrize("mode", ["full", "stats"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_staged_records_equal_eager_ones(tmp_path, device, mode):
    """Staged records (the accelerator path: asynchronous host copies, or in stats mode the
    reductions of large tensors launched in the hook) trace what eager copies trace, also for
    outputs overwritten in place later (ReLU(inplace=True) after a Linear)."""
    traces = []
    for i, stage in enumerate((False, True)):
        model = _mlp(inplace=True, hidden=512).to(device)
        tracer = Tracer(model, _writer(tmp_path / str(i), stage=stage, mode=mode))
        make = _inputs((300, 4), torch.float32, requires_grad=True)  # 300 x 512 activations: over STATS_CHUNK
        _train(model, lambda s, mb, make=make: make(s, mb).detach().to(device).requires_grad_(),
               torch.optim.Adam, steps=2, tracer=tracer, microbatches=2)
        tracer.remove()
        traces.append(TraceReader(tmp_path / str(i)))
    eager, staged = traces
    entries = {s: ({e.key: e for e in eager.entries(s, 0)}, {e.key: e for e in staged.entries(s, 0)})
               for s in eager.steps()}
    assert eager.steps() == staged.steps() == [0, 1]
    large = 0
    for s, (a, b) in entries.items():
        assert a.keys() == b.keys() and len(a) > 40
        for key, e in a.items():
            large += e.stats["numel"] >= STATS_CHUNK
            if mode == "full":
                assert torch.equal(eager.load(s, 0, key), staged.load(s, 0, key)), key
                assert e.stats == b[key].stats, key
            else:  # PendingStats: the norm and mean in float64 in another order
                sa, sb = e.stats, b[key].stats
                assert {k: v for k, v in sa.items() if k not in ("norm", "mean")} == \
                       {k: v for k, v in sb.items() if k not in ("norm", "mean")}, key
                assert sb["norm"] == pytest.approx(sa["norm"], rel=1e-12, abs=1e-300), key
                assert sb["mean"] == pytest.approx(sa["mean"], rel=1e-9, abs=1e-15 * sa["absmax"]), key
    assert large >= 8
    pre_relu = [e for s, (a, _) in entries.items() for k, e in a.items() if k.startswith("fwd/0.output/")]
    assert pre_relu and all(e.stats["quantiles"]["0"] < 0 for e in pre_relu)  # taken before the ReLU


def test_module_meta_reaches_the_records_of_matching_modules(tmp_path):
    model = _mlp()
    tracer = Tracer(model, _writer(tmp_path), capture=("fwd_out", "bwd_out"), module_meta={"2": {"topk": {"k": 1}}})
    _train(model, _inputs((5, 4), torch.float32, requires_grad=True), torch.optim.SGD, steps=1, tracer=tracer)
    tracer.remove()
    entries = TraceReader(tmp_path).entries(0, 0)
    tagged = sorted((e.phase, e.name) for e in entries if "topk" in e.meta)
    assert tagged == [("bwd", "2.output_grad"), ("fwd", "2.output")]
