"""Bench cases of the backward (gradient) bounds (:mod:`ttrace_num.bounds.grads`): linear/matmul
gradients, softmax/log_softmax/cross-entropy backward, layer/rms norm backward, gelu/silu
backward, per format (fp32, bf16, fp16), data (random normal and adversarial: cancelling row
sums, long rows, heavy tails, peaked rows, near-constant or offset layer-norm rows, the tails
and zeros of gelu'/silu') and implementation (torch CPU autograd kernels, or the emulated
computation model of :mod:`ttrace_num.emulate.grads`). References: exact_matmul/exact_sum or
mpmath (``ttrace_num.emulate.grads.exact_*``). Shapes are small so that a trial costs < 0.2 s.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.harness import Case
from ttrace_num.emulate import grads as E

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

Maker = Callable[[torch.Generator], tuple[tuple, dict]]


def _heavy(shape, g: torch.Generator) -> torch.Tensor:
    """Cauchy entries clipped to +-1e3."""
    return torch.tan(math.pi * (torch.rand(*shape, generator=g) - 0.5)).clamp(-1e3, 1e3)


# ----------------------------------------------------------------------------- linear / matmul
def _linear_maker(fmt: str, kind: str, which: str) -> Maker:
    dt = DTYPES[fmt]

    def make(g: torch.Generator) -> tuple[tuple, dict]:
        tokens = (4, 64) if kind == "long" else (2, 16)
        scale = 1 / 32 if fmt == "fp16" else 1.0  # keep the Cauchy products' sums below fp16's max
        rnd = (lambda s, gen: scale * _heavy(s, gen)) if kind == "heavy" else (lambda s, gen: torch.randn(*s, generator=gen))
        gr = rnd((*tokens, 16), g).to(dt)
        if which == "input":
            return (gr, rnd((16, 24), g).to(dt)), {}
        if which == "weight":
            return (gr, rnd((*tokens, 24), g).to(dt)), {}
        return (gr,), {}

    return make


def _linear_cases() -> list[Case]:
    out: list[Case] = []
    ops = {"input": ("linear_backward_input", lambda g, w: g @ w, E.emulate_linear_backward_input,
                     E.exact_linear_backward_input),
           "weight": ("linear_backward_weight", lambda g, x: g.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1]),
                      E.emulate_linear_backward_weight, E.exact_linear_backward_weight),
           "bias": ("linear_backward_bias", lambda g: g.reshape(-1, g.shape[-1]).sum(0), E.emulate_linear_backward_bias,
                    E.exact_linear_backward_bias)}
    for which, (op, run, emu, exact) in ops.items():
        for fmt in DTYPES:
            for kind in ("normal", "heavy", "long"):
                out.append(Case(op, kind, fmt, _linear_maker(fmt, kind, which), run, exact))
            out.append(Case(op, "normal", fmt, _linear_maker(fmt, "normal", which), emu, exact,
                            implementation="emulated"))
    for fmt, dt in DTYPES.items():

        def make_a(g: torch.Generator, dt=dt) -> tuple[tuple, dict]:
            return (torch.randn(2, 8, 16, generator=g).to(dt), torch.randn(2, 32, 16, generator=g).to(dt)), {}

        def make_b(g: torch.Generator, dt=dt) -> tuple[tuple, dict]:
            return (torch.randn(2, 32, 8, generator=g).to(dt), torch.randn(2, 32, 16, generator=g).to(dt)), {}

        out.append(Case("matmul_backward_a", "normal", fmt, make_a, lambda g, b: g @ b.transpose(-1, -2),
                         E.exact_matmul_backward_a))
        out.append(Case("matmul_backward_b", "normal", fmt, make_b, lambda a, g: a.transpose(-1, -2) @ g,
                         E.exact_matmul_backward_b))
    return out


# ----------------------------------------------------------------------------- softmax family
def _softmax_maker(fmt: str, kind: str, log: bool) -> Maker:
    dt = DTYPES[fmt]

    def make(g: torch.Generator) -> tuple[tuple, dict]:
        rows, n = (1, 2048) if kind == "long" else (8, 64)
        x = torch.randn(rows, n, generator=g) * 2
        if kind == "peaked":
            x[:, 0] += 12.0
        gr = _heavy((rows, n), g) if kind == "heavy" else torch.randn(rows, n, generator=g)
        if kind == "cancel":  # g nearly constant along the row: sum(g y) cancels g_i
            gr = 3.0 + 2.0 ** -12 * torch.randn(rows, n, generator=g)
        xd = x.to(dt)
        y = (torch.log_softmax if log else torch.softmax)(xd, -1)
        return (y, gr.to(dt)), {}

    return make


def _aten_softmax_backward(aten, y: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return aten(g, y, -1, y.dtype)


def _softmax_cases() -> list[Case]:
    out: list[Case] = []
    for log in (False, True):
        op = "log_softmax_backward" if log else "softmax_backward"
        aten = torch.ops.aten._log_softmax_backward_data if log else torch.ops.aten._softmax_backward_data
        run = functools.partial(_aten_softmax_backward, aten)
        emu = E.emulate_log_softmax_backward if log else E.emulate_softmax_backward
        exact = E.exact_log_softmax_backward if log else E.exact_softmax_backward
        for fmt in DTYPES:
            for kind in ("normal", "cancel", "heavy", "peaked", "long"):
                out.append(Case(op, kind, fmt, _softmax_maker(fmt, kind, log), run, exact))
            out.append(Case(op, "normal", fmt, _softmax_maker(fmt, "normal", log), emu, exact,
                            implementation="emulated"))
    return out


def _ce_maker(fmt: str, kind: str, reduction: str, ls: float) -> Maker:
    def make(g: torch.Generator) -> tuple[tuple, dict]:
        x = torch.randn(8, 64, generator=g) * 2
        if kind == "peaked":  # p_target ~ 1: (p - 1) cancels
            x[:, 0] += 15.0
        t = torch.randint(0, 64, (8,), generator=g)
        if kind == "peaked":
            t[:4] = 0
        t[-1] = -100  # one ignored row
        return (x.to(DTYPES[fmt]), t), {"reduction": reduction, "label_smoothing": ls}

    return make


def _ce_run(x: torch.Tensor, t: torch.Tensor, reduction: str, label_smoothing: float) -> torch.Tensor:
    xr = x.detach().clone().requires_grad_()
    F.cross_entropy(xr, t, reduction=reduction, label_smoothing=label_smoothing).backward()
    return xr.grad


def _ce_cases() -> list[Case]:
    out: list[Case] = []
    for fmt in DTYPES:
        for red, ls in (("mean", 0.0), ("mean", 0.1), ("sum", 0.0)):
            out.append(Case("cross_entropy_backward", f"normal {red} ls={ls}", fmt, _ce_maker(fmt, "normal", red, ls),
                            _ce_run, E.exact_cross_entropy_backward))
        out.append(Case("cross_entropy_backward", "peaked mean ls=0.1", fmt, _ce_maker(fmt, "peaked", "mean", 0.1),
                        _ce_run, E.exact_cross_entropy_backward))
        out.append(Case("cross_entropy_backward", "normal mean ls=0.1", fmt, _ce_maker(fmt, "normal", "mean", 0.1),
                        E.emulate_cross_entropy_backward, E.exact_cross_entropy_backward, implementation="emulated"))
    return out


# ----------------------------------------------------------------------------- norms
def _norm_maker(fmt: str, kind: str, wdt: torch.dtype | None = None) -> Maker:
    dt = DTYPES[fmt]

    def make(g: torch.Generator) -> tuple[tuple, dict]:
        rows, n = (1, 2048) if kind == "long" else (8, 64)
        x = torch.randn(rows, n, generator=g)
        if kind == "offset":  # mean >> sigma: condition number ~ 100
            x = 100.0 + x
        elif kind == "constant":  # near-constant rows, a few ulps of 3 apart: r = 1/sqrt(var + eps) large
            spacing = {"fp32": 2.0 ** -22, "bf16": 2.0 ** -6, "fp16": 2.0 ** -9}[fmt]
            x = 3.0 + spacing * torch.randint(-2, 3, (rows, n), generator=g).to(torch.float32)
        gr = _heavy((rows, n), g) if kind == "heavy" else torch.randn(rows, n, generator=g)
        w = (1.0 + 0.5 * torch.randn(n, generator=g)).to(wdt or dt)
        return (gr.to(dt), x.to(dt), w), {"eps": 1e-5}

    return make


def _ln_run(which: int) -> Callable[..., torch.Tensor]:
    def run(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        br = torch.zeros_like(w, requires_grad=True)
        F.layer_norm(xr, (x.shape[-1],), wr, br, eps).backward(g)
        return (xr.grad, wr.grad, br.grad)[which]
    return run


def _rms_run(which: int) -> Callable[..., torch.Tensor]:
    def run(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        torch.rms_norm(xr, (x.shape[-1],), wr, eps).backward(g)
        return (xr.grad, wr.grad)[which]
    return run


def _pick(fn: Callable[..., tuple], which: int) -> Callable[..., torch.Tensor]:
    return lambda *a, **k: fn(*a, **k)[which]


def _norm_cases() -> list[Case]:
    out: list[Case] = []
    specs = [("layer_norm_backward_input", 0, _ln_run, E.emulate_layer_norm_backward, E.exact_layer_norm_backward),
             ("layer_norm_backward_weight", 1, _ln_run, E.emulate_layer_norm_backward, E.exact_layer_norm_backward),
             ("layer_norm_backward_bias", 2, _ln_run, E.emulate_layer_norm_backward, E.exact_layer_norm_backward),
             ("rms_norm_backward_input", 0, _rms_run, E.emulate_rms_norm_backward, E.exact_rms_norm_backward),
             ("rms_norm_backward_weight", 1, _rms_run, E.emulate_rms_norm_backward, E.exact_rms_norm_backward)]
    for op, which, run, emu, exact in specs:
        for fmt in DTYPES:
            for kind in ("normal", "offset", "constant", "heavy", "long"):
                out.append(Case(op, kind, fmt, _norm_maker(fmt, kind), run(which), _pick(exact, which)))
            out.append(Case(op, "normal", fmt, _norm_maker(fmt, "normal"), _pick(emu, which), _pick(exact, which),
                            implementation="emulated"))
            if fmt != "fp32" and op.startswith("layer_norm"):
                out.append(Case(op, "fp32 weight (mixed)", fmt, _norm_maker(fmt, "normal", torch.float32),
                                run(which), _pick(exact, which)))
    return out


# ----------------------------------------------------------------------------- gelu / silu
def _act_maker(fmt: str, kind: str, op: str) -> Maker:
    dt = DTYPES[fmt]
    zero = {"gelu": -0.7518, "silu": -1.2785}[op]

    def make(g: torch.Generator) -> tuple[tuple, dict]:
        n = 512
        if kind == "normal":
            x = torch.randn(n, generator=g) * 3
        elif kind == "tails":
            x = (torch.rand(n, generator=g) * 2 - 1) * 12
        else:  # "zero": around the zero of the derivative (cancellation)
            x = zero + 0.01 * torch.randn(n, generator=g)
        return (torch.randn(n, generator=g).to(dt), x.to(dt)), {}

    return make


def _act_cases() -> list[Case]:
    out: list[Case] = []
    for fmt in DTYPES:
        for ap in ("none", "tanh"):
            run = functools.partial(torch.ops.aten.gelu_backward, approximate=ap)
            emu = functools.partial(E.emulate_gelu_backward, approximate=ap)
            exact = functools.partial(E.exact_gelu_backward, approximate=ap)
            for kind in ("normal", "tails", "zero"):
                out.append(Case("gelu_backward", f"{kind} ({ap})", fmt, _act_maker(fmt, kind, "gelu"), run, exact,
                                bound_kwargs={"approximate": ap}))
            out.append(Case("gelu_backward", f"normal ({ap})", fmt, _act_maker(fmt, "normal", "gelu"), emu, exact,
                            bound_kwargs={"approximate": ap}, implementation="emulated"))
        for kind in ("normal", "tails", "zero"):
            out.append(Case("silu_backward", kind, fmt, _act_maker(fmt, kind, "silu"), torch.ops.aten.silu_backward,
                            E.exact_silu_backward))
        out.append(Case("silu_backward", "normal", fmt, _act_maker(fmt, "normal", "silu"), E.emulate_silu_backward,
                        E.exact_silu_backward, implementation="emulated"))
    return out


CASES: list[Case] = _linear_cases() + _softmax_cases() + _ce_cases() + _norm_cases() + _act_cases()
