"""Attention bounds (ttrace_num.bounds.attention), its emulator and exact references
(ttrace_num.emulate.attention).

Checked against the exact references (mpmath softmax on double-double scores, products
with P and dS taken exactly), for the emulated computation models (standard; online with
key blocks 8/16/32; P rounded to bf16/fp16; bf16 compute; bf16 scores) and for the real
torch CPU ops (``scaled_dot_product_attention``, i.e. the flash kernel, with
``torch_cpu_sdpa_model``; the math backend; manual standard attention with torch ops),
forward and backward (torch autograd), on random and adversarial data (peaked / flat
rows, large scores, near-constant values, heavy tails, causal + padding masks, additive
masks, grouped-query heads, fully masked rows), one 2048-long sequence, and with
deliberately wrong models that must be caught.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from scipy.stats import binomtest
from torch.nn.attention import SDPBackend, sdpa_kernel

import ttrace_num as tn
from bench.cases.attention import (
    KINDS,
    make_inputs,
    manual,
    manual_model,
    sdpa,
    sdpa_grads,
)
from ttrace_num.bounds.attention import (
    EXP_U20_ULPS,
    attention,
    attention_backward,
    torch_cpu_sdpa_model,
)
from ttrace_num.emulate.attention import (
    emulate_attention,
    emulate_attention_backward,
    exact_attention,
    exact_attention_backward,
    exp_u20,
    reference_attention_f64,
)

DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MODES = ("deterministic", "probabilistic")
_EXACT: dict = {}


def _case(kind: str, fmt: str, seed: int, **shape):
    """Inputs and their exact forward output (cached)."""
    key = (kind, fmt, seed, tuple(sorted(shape.items())))
    if key not in _EXACT:
        (q, k, v), kw = make_inputs(kind, DT[fmt], torch.Generator().manual_seed(seed), **shape)
        _EXACT[key] = ((q, k, v), kw, exact_attention(q, k, v, **kw))
    return _EXACT[key]


def _check(bound, computed: torch.Tensor, exact: torch.Tensor) -> tuple[int, float]:
    """(violations, tightness = min bound/err over the elements with an error)."""
    err = (computed.to(torch.float64) - exact).abs()
    assert not torch.isnan(err).any()
    b = torch.broadcast_to(bound.abs, err.shape)
    nz = err > 0
    tight = float((b[nz] / err[nz]).min()) if nz.any() else math.inf
    return int((err > b).sum()), tight


# ------------------------------------------------------------------ references
def test_exact_reference_agrees_with_float64_and_mp_precision():
    (q, k, v), kw, ex = _case("additive", "fp32", 0)
    f = reference_attention_f64(q, k, v, **kw)
    assert float(((f - ex).abs() / (ex.abs() + 1e-3)).max()) < 1e-12
    ex80 = exact_attention(q, k, v, dps=80, **kw)
    assert torch.equal(ex, ex80)
    (q, k, v), kw = make_inputs("gqa", torch.float32, torch.Generator().manual_seed(1), Lq=8, Lk=8, d=8)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    qq, kk, vv = (t.double().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(qq, kk, vv, **kw).backward(do.double())
    for g64, g in zip((qq.grad, kk.grad, vv.grad), exact_attention_backward(q, k, v, do, **kw)):
        assert float((g64 - g).abs().max()) < 1e-12


def test_exp_u20_error_model():
    """EXP_U20_ULPS covers torch's exp_u20 (emulated bit for bit from its source): every float32 in
    [-87.5, -84] (where the error peaks: the single-float ln 2 of the argument reduction) plus
    random arguments; results below 2^-125 are flushed with an absolute error < 2 min_normal.
    A 1-ulp model would be wrong."""
    lo, hi = (torch.tensor([v], dtype=torch.float32).view(torch.int32)[0] for v in (84.0, 87.5))
    dense = -torch.arange(int(lo), int(hi), dtype=torch.int32).view(torch.float32)
    x = torch.cat([dense, -88 * torch.rand(200_000, generator=torch.Generator().manual_seed(0)),
                   -torch.logspace(-30, 0, 10_000), torch.tensor([0.0, -86.352294921875])])
    y, e = exp_u20(x).double(), torch.exp(x.double())
    norm = e >= 2.0 ** -125
    rel = ((y - e).abs() / e)[norm] / 2.0 ** -24
    assert float(rel.max()) <= 2 * EXP_U20_ULPS and float(rel.max()) > 6.4
    assert float((y - e).abs()[~norm].max()) < 2 * 2.0 ** -126
    assert exp_u20(torch.tensor([0.0, -math.inf])).tolist() == [1.0, 0.0]


def test_fully_masked_rows_are_zero_everywhere():
    (q, k, v), kw, ex = _case("masked_rows", "bf16", 3)
    empty = ~kw["attn_mask"].any(-1)
    assert empty.any()
    out = sdpa(q, k, v, **kw)
    assert (out[..., empty, :] == 0).all() and (ex[..., empty, :] == 0).all()
    assert (emulate_attention(q, k, v, **kw)[..., empty, :] == 0).all()
    b = attention(q, k, v, **kw)
    assert (b.abs[..., empty, :] == 0).all() and (b.abs[..., ~empty, :] > 0).all()


# ------------------------------------------------------------------ forward, emulated
EMU_MODELS = {
    "standard": {},
    "standard_pf": {"p_fmt": "storage"},
    "online16_pf": {"algorithm": "online", "block_size": 16, "p_fmt": "storage"},
    "online8": {"algorithm": "online", "block_size": 8},
    "online32_pf": {"algorithm": "online", "block_size": 32, "p_fmt": "storage"},
    "bf16_scores": {"score_fmt": "bf16", "p_fmt": "bf16"},
}


def _model(name: str, fmt: str) -> dict:
    return {k: (DT[fmt] if v == "storage" else v) for k, v in EMU_MODELS[name].items()}


@pytest.mark.parametrize("fmt", list(DT))
def test_forward_emulated_no_violations(fmt):
    kinds = ("normal", "peaked", "flat", "large", "const_v", "heavy", "causal_padding", "additive", "gqa",
             "masked_rows")
    worst = {}
    for i, kind in enumerate(kinds):
        (q, k, v), kw, ex = _case(kind, fmt, 10 + i)
        for name in EMU_MODELS:
            m = _model(name, fmt)
            out = emulate_attention(q, k, v, **kw, **m)
            for mode in MODES:
                viol, tight = _check(attention(q, k, v, mode=mode, **kw, **m), out, ex)
                assert viol == 0, (kind, name, mode)
                worst[(name, mode)] = min(worst.get((name, mode), math.inf), tight)
    # the bounds are not vacuous: some instance comes within a factor 40 (fp32) / 3 (bf16, fp16)
    assert min(worst.values()) < (40 if fmt == "fp32" else 3)


@pytest.mark.parametrize("compute", ["bf16", "fp16"])
def test_forward_low_precision_compute_emulated(compute):
    """Everything (scores, softmax, sums, rescaling) in bf16/fp16 ("compute emulation")."""
    for seed, kind in enumerate(("normal", "peaked", "causal_padding")):
        (q, k, v), kw, ex = _case(kind, "fp32", 30 + seed, Lk=24)
        for alg in ({}, {"algorithm": "online", "block_size": 8}):
            m = {"compute_fmt": compute, **alg}
            out = emulate_attention(q, k, v, **kw, **m)
            for mode in MODES:
                viol, tight = _check(attention(q, k, v, mode=mode, **kw, **m), out, ex)
                assert viol == 0 and tight < 100  # worst-case score errors in bf16 dominate (docstring)


def test_forward_randomized_sweep():
    """Random shapes (including Lq = 1, Lk = 1), data kinds, formats and models, both modes."""
    g = torch.Generator().manual_seed(2024)
    pick = lambda seq: seq[int(torch.randint(len(seq), (1,), generator=g))]
    for t in range(60):
        fmt = pick(list(DT))
        kind = pick(("normal", "peaked", "large", "heavy", "causal_padding", "additive", "gqa"))
        shape = {"Lq": pick((1, 5, 16)), "Lk": pick((1, 7, 33)), "d": pick((8, 16, 32))}
        if kind == "causal_padding":
            shape["Lk"] = max(shape["Lk"], 6)
        (q, k, v), kw, ex = _case(kind, fmt, 900 + t, **shape)
        m = _model(pick(list(EMU_MODELS)), fmt)
        if "block_size" in m:
            m["block_size"] = pick((1, 4, 16))
        out = emulate_attention(q, k, v, **kw, **m)
        flash = sdpa(q, k, v, **kw)
        for mode in MODES:
            assert _check(attention(q, k, v, mode=mode, **kw, **m), out, ex)[0] == 0, (t, kind, fmt, m, mode)
            assert _check(attention(q, k, v, mode=mode, **kw, **torch_cpu_sdpa_model(q)), flash, ex)[0] == 0


# ------------------------------------------------------------------ forward, torch
@pytest.mark.parametrize("fmt", list(DT))
def test_forward_torch_sdpa_flash(fmt):
    worst = math.inf
    for i, kind in enumerate(KINDS):
        (q, k, v), kw, ex = _case(kind, fmt, 50 + i)
        out = sdpa(q, k, v, **kw)
        for mode in MODES:
            viol, tight = _check(attention(q, k, v, mode=mode, **kw, **torch_cpu_sdpa_model(q)), out, ex)
            assert viol == 0, (kind, mode)
            worst = min(worst, tight)
    assert worst < (30 if fmt == "fp32" else 3)


@pytest.mark.parametrize("fmt", list(DT))
def test_forward_torch_manual_and_math_backend(fmt):
    for i, kind in enumerate(("normal", "peaked", "flat", "const_v", "heavy", "additive", "gqa")):
        (q, k, v), kw, ex = _case(kind, fmt, 70 + i)
        out = manual(q, k, v, **kw)
        with sdpa_kernel(SDPBackend.MATH):
            out_math = sdpa(q, k, v, **kw)
        for mode in MODES:
            viol, _ = _check(attention(q, k, v, mode=mode, **kw, **manual_model(q.dtype)), out, ex)
            assert viol == 0, (kind, mode, "manual")
            # the math backend computes in fp32 (inputs upcast) and rounds the output once
            viol, _ = _check(attention(q, k, v, mode=mode, **kw), out_math, ex)
            assert viol == 0, (kind, mode, "math")


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_forward_long_sequence_float64_reference(fmt):
    """Lk = 2048 keys (4 blocks of 512 in torch's kernel), 256 queries, d = 64, with a padding
    mask. The mpmath reference is too slow here (half a million exps); the float64
    reference's error is bounded by ``(|s|_max + Lk + d + 10) 2^-52 sum_j p_j |v_j|`` (scores,
    exp arguments, sums), which is added to the observed error: the check is conservative
    (the references agree to 1e-12 relative on the small cases above)."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 1, 256, 64, generator=g).to(DT[fmt])
    k, v = (torch.randn(1, 1, 2048, 64, generator=g).to(DT[fmt]) for _ in range(2))
    m = torch.ones(256, 2048, dtype=torch.bool)
    m[::2, 1500:] = False
    out = sdpa(q, k, v, attn_mask=m).double()
    ref = reference_attention_f64(q, k, v, attn_mask=m)
    s = (q.double() @ k.double().transpose(-1, -2)) / 8
    pv = torch.softmax(s.masked_fill(~m, -math.inf), -1) @ v.double().abs()
    ref_err = (float(s.abs().max()) + 2048 + 64 + 10) * 2.0 ** -52 * pv
    # not vacuous; fp32 is loose here: the order-agnostic P V accumulation bound charges every
    # level at sum_j p_j |v_j| ~ sqrt(Lk) |O| (module docstring, "Tightness")
    limit = {("fp32", "deterministic"): 3000, ("fp32", "probabilistic"): 300,
             ("bf16", "deterministic"): 10, ("bf16", "probabilistic"): 3}
    for mode in MODES:
        b = attention(q, k, v, attn_mask=m, mode=mode, **torch_cpu_sdpa_model(q))
        err = (out - ref).abs() + ref_err
        assert int((err > b.abs).sum()) == 0
        assert float((b.abs / err).min()) < limit[fmt, mode]


# ------------------------------------------------------------------ backward
def _bw_case(kind: str, fmt: str, seed: int, **shape):
    (q, k, v), kw = make_inputs(kind, DT[fmt], torch.Generator().manual_seed(seed), H=1, **shape)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1000)).to(q.dtype)
    return (q, k, v, do), kw, exact_attention_backward(q, k, v, do, **kw)


BW_MODELS = {
    "standard": {},
    "standard_output": {"delta": "output"},
    "online8_pf": {"algorithm": "online", "block_size": 8, "p_fmt": "storage", "ds_fmt": "storage"},
    "online8_accum": {"algorithm": "online", "block_size": 8, "p_fmt": "storage", "ds_fmt": "storage",
                      "grad_accum_fmt": "storage", "q_block_size": 8},
}


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_backward_emulated_no_violations(fmt):
    for i, kind in enumerate(("normal", "peaked", "causal_padding", "gqa", "masked_rows")):
        (q, k, v, do), kw, ex = _bw_case(kind, fmt, 100 + i)
        for name, m0 in BW_MODELS.items():
            m = {a: (DT[fmt] if b == "storage" else b) for a, b in m0.items()}
            grads = emulate_attention_backward(q, k, v, do, **kw, **m)
            for mode in MODES:
                bounds = attention_backward(q, k, v, do, mode=mode, **kw, **m)
                for which, b, g, e in zip("qkv", bounds, grads, ex):
                    viol, _ = _check(b, g, e)
                    assert viol == 0, (kind, name, mode, which)


@pytest.mark.parametrize("fmt", list(DT))
def test_backward_torch_autograd(fmt):
    """torch SDPA autograd (CPU flash backward: P from the log-sum-exp, dS in the input dtype,
    grad_k/grad_v accumulated in the input dtype over query blocks of 32: Lq = 40 gives two)."""
    worst = math.inf
    for i, kind in enumerate(("normal", "large", "causal_padding", "additive", "masked_rows", "gqa")):
        (q, k, v, do), kw, ex = _bw_case(kind, fmt, 200 + i, Lq=40, Lk=24)
        grads = sdpa_grads(q, k, v, do, **kw)
        for mode in MODES:
            bounds = attention_backward(q, k, v, do, mode=mode, **kw, **torch_cpu_sdpa_model(q, backward=True))
            for which, b, g, e in zip("qkv", bounds, grads, ex):
                viol, tight = _check(b, g, e)
                assert viol == 0, (kind, mode, which)
                worst = min(worst, tight)
    assert worst < (100 if fmt == "fp32" else 6)


def test_backward_torch_manual_and_math_fp32():
    """Autograd of the standard algorithm in fp32 (manual ops; the math backend): P is the
    stored softmax output, D = rowsum(P * dP) (softmax backward)."""
    for i, kind in enumerate(("normal", "peaked", "additive", "gqa")):
        (q, k, v, do), kw, ex = _bw_case(kind, "fp32", 300 + i)
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        manual(qq, kk, vv, **kw).backward(do)
        with sdpa_kernel(SDPBackend.MATH):
            g_math = sdpa_grads(q, k, v, do, **kw)
        for mode in MODES:
            bounds = attention_backward(q, k, v, do, mode=mode, **kw)
            for b, g1, g2, e in zip(bounds, (qq.grad, kk.grad, vv.grad), g_math, ex):
                assert _check(b, g1, e)[0] == 0 and _check(b, g2, e)[0] == 0, (kind, mode)


# ------------------------------------------------------------------ probabilistic claim
def test_probabilistic_violation_rate_binomial():
    """With failure_probability = 0.1 the per-element violation rate must not exceed 0.1
    significantly (one-sided binomial test). Output in fp32 so that the probabilistic
    (martingale) part, not the output rounding, decides; P and dS rounded to bf16."""
    p_claim = 0.1
    viol = n = 0
    for seed in range(4):
        (q, k, v), kw, ex = _case("normal", "bf16", 400 + seed)
        m = {"algorithm": "online", "block_size": 8, "p_fmt": "bf16", "out_fmt": "fp32"}
        out = emulate_attention(q, k, v, **kw, **m)
        b = attention(q, k, v, mode="probabilistic", failure_probability=p_claim, **kw, **m)
        viol += _check(b, out, ex)[0]
        n += out.numel()
    assert binomtest(viol, n, p_claim, alternative="greater").pvalue > 1e-3


# ------------------------------------------------------------------ wrong models are caught
def test_wrong_model_ignoring_p_rounding_is_caught():
    """The emulation rounds P to bf16 before P V (as flash kernels do); a bound that states
    P in fp32 must be violated (output kept in fp32 so the P rounding is visible)."""
    viol = 0
    for seed in range(3):
        (q, k, v), kw, ex = _case("normal", "bf16", 500 + seed)
        out = emulate_attention(q, k, v, algorithm="online", block_size=16, p_fmt="bf16", out_fmt="fp32", **kw)
        viol += _check(attention(q, k, v, algorithm="online", block_size=16, out_fmt="fp32", **kw), out, ex)[0]
        assert _check(attention(q, k, v, algorithm="online", block_size=16, p_fmt="bf16", out_fmt="fp32", **kw),
                      out, ex)[0] == 0
    assert viol > 0


def test_wrong_model_ignoring_ds_rounding_is_caught():
    viol = 0
    for seed in range(2):
        (q, k, v, do), kw, ex = _bw_case("normal", "bf16", 600 + seed)
        m = {"algorithm": "online", "block_size": 8, "out_fmt": "fp32"}
        grads = emulate_attention_backward(q, k, v, do, ds_fmt="bf16", **m, **kw)
        wrong = attention_backward(q, k, v, do, **m, **kw)
        right = attention_backward(q, k, v, do, ds_fmt="bf16", **m, **kw)
        viol += _check(wrong.dq, grads[0], ex[0])[0]
        assert _check(right.dq, grads[0], ex[0])[0] == 0
    assert viol > 0


# ------------------------------------------------------------------ API
def test_api_dispatch_masks_and_errors():
    (q, k, v), kw, _ = _case("causal_padding", "fp32", 0)
    m = kw["attn_mask"]
    b1 = tn.tolerance("attention", q, k, v, attn_mask=m)
    b2 = tn.tolerance("sdpa", q, k, v, mask=~m)  # the opposite boolean convention
    assert torch.equal(b1.abs, b2.abs)
    b3 = attention(q[..., :8, :], k[..., :8, :], v[..., :8, :], is_causal=True)
    b4 = attention(q[..., :8, :], k[..., :8, :], v[..., :8, :], causal=True)
    assert torch.equal(b3.abs, b4.abs)
    assert "attention" in b1.explain() and "P rounded" in b1.explain()
    with pytest.raises(ValueError):
        attention(q, k, v, attn_mask=m, mask=~m)
    with pytest.raises(ValueError):
        attention(q, k, v, algorithm="flash")
    qg, kg = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError):
        attention(qg, kg, kg)
    do = torch.randn(1, 2, 16, 16)
    grads = attention_backward(q, k, v, do, attn_mask=m)
    for name, b in zip(("attention_dq", "attention_dk", "attention_dv"), grads):
        assert torch.equal(tn.tolerance(name, q, k, v, do, attn_mask=m).abs, b.abs)
    assert torch_cpu_sdpa_model(q)["exp_ulps"] == EXP_U20_ULPS
    assert torch_cpu_sdpa_model(torch.empty(1, 1, 800, 8, dtype=torch.bfloat16), backward=True)["q_block_size"] == 256
