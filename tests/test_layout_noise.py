"""Noise from what the candidate's layout changes (ttrace_num.propagate.layout): ops the layout
leaves identical get no noise, split reductions get their model's, the rest the default."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import ttrace_num as tn
from ttrace_num.bounds.summation import Summation
from ttrace_num.propagate.layout import IDENTICAL, ModuleScope, gemm_computation
from ttrace_num.propagate.noise import NoiseInjector, perturb_custom_backward

SPLIT = Summation(split=2, reduce_fmt="bf16")


class _Linear(torch.autograd.Function):
    """A linear whose backward is a custom Function's, as megatron-core's tensor-parallel ones."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.matmul(x, w.t())

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g.matmul(w), g.reshape(-1, g.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))


class _CustomLinear(torch.nn.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n_out, n_in, dtype=torch.bfloat16) / n_in ** 0.5)

    def forward(self, x):
        return _Linear.apply(x, self.weight)


class _Block(torch.nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d, dtype=torch.bfloat16)
        self.up = torch.nn.Linear(d, 2 * d, dtype=torch.bfloat16)
        self.down = _CustomLinear(2 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def _run(model: torch.nn.Module, x: torch.Tensor, injector: NoiseInjector | None) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    records = {}

    def keep(name):
        def hook(m, a, out):
            records[name] = out.detach().clone()
        return hook
    handles = [m.register_forward_hook(keep(n)) for n, m in model.named_modules() if n]
    try:
        if injector is None:
            (model(xi).float().square().mean()).backward()
        else:
            with injector, perturb_custom_backward(injector, _Linear):
                (model(xi).float().square().mean()).backward()
    finally:
        for h in handles:
            h.remove()
    records.update({f"grad.{n}": p.grad.detach().clone() for n, p in model.named_parameters()})
    records["grad.input"] = xi.grad.detach().clone()
    return records


def _sample(model: torch.nn.Module, x: torch.Tensor, rule) -> tuple[dict[str, torch.Tensor], NoiseInjector]:
    """One noise sample under the layout ``rule`` (a ModuleScope on ``model`` for the module names)."""
    scope = ModuleScope(model)
    inj = NoiseInjector(torch.Generator().manual_seed(1), mode="probabilistic", module_of=scope, layout=rule)
    try:
        return _run(model, x, inj), inj
    finally:
        scope.remove()


def _setup():
    torch.manual_seed(0)
    model = _Block()
    x = torch.randn(4, 16, 64, dtype=torch.bfloat16)
    return model, x, _run(model, x, None)


def test_module_scope_names_the_innermost_running_module():
    model = _Block()
    scope = ModuleScope(model)
    seen = []
    h = model.up.register_forward_pre_hook(lambda m, a: seen.append(scope()))  # after the scope's own
    model(torch.randn(2, 64, dtype=torch.bfloat16))
    assert seen == ["up"] and scope() == ""
    scope.remove()
    h.remove()
    seen_after = []
    h = model.up.register_forward_pre_hook(lambda m, a: seen_after.append(scope()))
    model(torch.randn(2, 64, dtype=torch.bfloat16))
    h.remove()
    assert seen_after == [""], "remove() takes the scope's hooks off"


def test_gemm_computation_tells_dgrad_from_wgrad_by_the_parameter_operand():
    w = torch.nn.Parameter(torch.ones(2, 2))
    g = torch.ones(3, 2)
    assert gemm_computation((g, w), in_backward=False) == "forward_gemm"
    assert gemm_computation((g, w), in_backward=True) == "dgrad"
    assert gemm_computation((g.t(), g), in_backward=True) == "wgrad"


def test_everything_identical_gives_a_bitwise_clean_sample():
    """A layout that changes nothing: the sample is the clean run bit for bit, forward and backward
    (built-in and custom backward), and the census counts the modelled ops as identical."""
    model, x, clean = _setup()
    noisy, inj = _sample(model, x, lambda module, computation: IDENTICAL)
    assert noisy.keys() == clean.keys()
    for k in clean:
        assert torch.equal(noisy[k], clean[k]), k
    census = inj.census()
    assert census["identical"] and not census["perturbed"], census


def test_default_noise_moves_every_record():
    """Without a layout every op is perturbed (the contrast to the test above)."""
    model, x, clean = _setup()
    noisy = _run(model, x, NoiseInjector(torch.Generator().manual_seed(1), mode="probabilistic"))
    assert all(not torch.equal(noisy[k], clean[k]) for k in ("norm", "up", "grad.norm.weight", "grad.up.weight"))


def _split_down_rule(module: str, computation: str):
    """A row-parallel ``down``: its forward GEMM split; everything else identical."""
    return SPLIT if (module, computation) == ("down", "forward_gemm") else IDENTICAL


def test_a_split_forward_gemm_moves_only_what_depends_on_it():
    model, x, clean = _setup()
    noisy, inj = _sample(model, x, _split_down_rule)
    for k in ("norm", "up"):  # before the split GEMM
        assert torch.equal(noisy[k], clean[k]), k
    # after it, and the whole backward (the loss depends on the GEMM's result)
    for k in ("down", "grad.down.weight", "grad.up.weight", "grad.norm.weight", "grad.input"):
        assert not torch.equal(noisy[k], clean[k]), k
    # its noise is of the split model's size: its rms within a factor 10 below the rms of the
    # deterministic difference bound plus the result's rounding (measured 0.25x)
    with torch.no_grad():
        h = F.gelu(model.up(model.norm(x)))
    bound = tn.difference("matmul", h, model.down.weight.t(), model_a={"summation": Summation()},
                          model_b={"summation": SPLIT}, mode="deterministic").abs
    dev = (noisy["down"].double() - clean["down"].double()).abs()
    ulp = tn.formats.half_ulp(clean["down"].double().abs(), tn.formats.get_format(torch.bfloat16)) * 2
    rms = float(dev.square().mean().sqrt()) / float((bound + ulp).square().mean().sqrt())
    assert 0.1 < rms <= 1.0, rms
    assert inj.census()["perturbed"] == {"torch.matmul": 1}, inj.census()["perturbed"]


def test_a_split_dgrad_in_a_custom_backward_perturbs_the_input_gradient_only():
    """``dgrad`` inside a custom Function's backward (the module noted by its forward): the input
    gradient moves, the weight gradient (``wgrad``, identical) does not."""
    model, x, clean = _setup()
    rule = lambda module, computation: SPLIT if (module, computation) == ("down", "dgrad") else IDENTICAL  # noqa: E731
    noisy, inj = _sample(model, x, rule)
    for k in ("norm", "up", "down", "grad.down.weight"):
        assert torch.equal(noisy[k], clean[k]), k
    for k in ("grad.up.weight", "grad.norm.weight", "grad.input"):
        assert not torch.equal(noisy[k], clean[k]), k


def test_a_split_token_sum_perturbs_the_norm_weight_gradient_only():
    model, x, clean = _setup()
    rule = lambda module, computation: SPLIT if computation == "token_sum" else IDENTICAL  # noqa: E731
    noisy, inj = _sample(model, x, rule)
    moved = {k for k in clean if not torch.equal(noisy[k], clean[k])}
    assert moved == {"grad.norm.weight", "grad.norm.bias", "grad.up.bias"}, moved


def test_unknown_modules_keep_the_default_model():
    """The rule's None: the op is perturbed as without a layout."""
    model, x, clean = _setup()
    rule = lambda module, computation: None if module == "norm" else IDENTICAL  # noqa: E731
    noisy, inj = _sample(model, x, rule)
    assert not torch.equal(noisy["norm"], clean["norm"])
    assert inj.census()["perturbed"] == {"torch.nn.functional.layer_norm": 1}, inj.census()["perturbed"]
