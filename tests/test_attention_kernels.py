"""Attention defaults that match what torch runs (issue 33): the default model covers torch's
own ``scaled_dot_product_attention`` (CPU flash kernel, math backend) and the GPU online
kernels; dead keys of ``-1e9`` / ``finfo.min`` additive masks give finite, tight bounds;
argument validation (the layering rule, ``bounds`` does not import ``propagate``, is
checked by ``tests/test_layering.py``).

Every check compares torch's output with an exact reference (mpmath for short rows; for
the long rows the float64 reference with its error bound added, as in
``tests/test_bounds_attention.py``)."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ttrace_num.bounds.attention import attention, torch_cpu_sdpa_model
from ttrace_num.emulate.attention import exact_attention, reference_attention_f64

DT = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _f64_reference(q, k, v, **kw):
    """Float64 output and a bound on its own error: ``(|s|_max + Lk + d + 10) 2^-52 sum_j p_j |v_j|``
    (scores, exp arguments, sums), added to the observed error (conservative)."""
    ref = reference_attention_f64(q, k, v, **kw)
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if kw.get("is_causal"):
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    p = torch.softmax(s, -1)
    return ref, (float(s[torch.isfinite(s)].abs().max()) + s.shape[-1] + q.shape[-1] + 10) * 2.0 ** -52 * (
        p @ v.double().abs())


def _sdpa_case(fmt: str, L: int, causal: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 1, L, 32, generator=g).to(DT[fmt]) for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal).double()
    ref, ref_err = _f64_reference(q, k, v, is_causal=causal)
    return (q, k, v), out, (out - ref).abs() + ref_err


# ------------------------------------------------------------------ 1. default = the kernels torch runs
@pytest.mark.parametrize("fmt", list(DT))
def test_default_bound_holds_on_torch_sdpa(fmt):
    """torch's CPU SDPA (flash kernel: P rounded to the input dtype before P V, key blocks of 512)
    violated the old default (standard model, P in fp32) on 0.3-28% of the outputs; the default
    (union of the kernels) must have none, and stay as tight as the exact CPU-flash model."""
    old_viol = 0
    for i, (L, causal) in enumerate(((96, False), (96, True), (600, fmt == "fp16"))):  # 600: two 512-blocks
        (q, k, v), out, err = _sdpa_case(fmt, L, causal, 10 * i + (fmt == "fp16"))
        b = attention(q, k, v, is_causal=causal).abs
        assert int((err > b).sum()) == 0, (L, causal)
        exact_model = attention(q, k, v, is_causal=causal, **torch_cpu_sdpa_model(q)).abs
        assert float((b / exact_model).median()) < 1.05  # the union costs little over the exact kernel model
        assert float((b / err).min()) < 5  # not vacuous
        old_viol += int((err > attention(q, k, v, is_causal=causal, algorithm="standard").abs).sum())
    assert old_viol > 0  # the previous default (stated explicitly) is caught by this data


def test_default_bound_holds_on_math_backend_and_states_its_kernels():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g).to(torch.bfloat16) for _ in range(3))
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q, k, v).double()
    ex = exact_attention(q, k, v)
    b = attention(q, k, v)
    assert int(((out - ex).abs() > b.abs).sum()) == 0
    text = b.explain()
    assert "any of" in text and "exp2" in text and "key blocks of 512" in text


def test_default_bound_holds_on_emulated_gpu_exp2_kernels():
    """FlashAttention-2 / memory-efficient style (emulated, every step rounded): exp2 of
    fl(fl(S c2) - fl(m c2)) with unscaled S, key blocks 32/64/128, P rounded to the input dtype;
    large scores (|m| ~ 30) make the max's own rounding count. fp32 output, so the fp32-level
    terms are visible; against mpmath."""
    from bench.cases.attention import make_inputs

    from ttrace_num.emulate.attention import emulate_attention
    viol = 0
    for i, kind in enumerate(("normal", "large", "peaked", "causal_padding")):
        (q, k, v), kw = make_inputs(kind, torch.bfloat16, torch.Generator().manual_seed(40 + i), Lk=80)
        ex = exact_attention(q, k, v, **kw)
        b = attention(q, k, v, out_fmt="fp32", **kw).abs
        for block in (32, 64, 128):
            out = emulate_attention(q, k, v, algorithm="online", block_size=block, p_fmt="bf16", out_fmt="fp32",
                                    exp2=True, **kw)
            viol += int(((out - ex).abs() > b).sum())
    assert viol == 0


# ------------------------------------------------------------------ 2. dead keys
def _mask_cases(dt: torch.dtype, L: int):
    keep = torch.ones(L, L, dtype=torch.bool).tril()
    keep[L // 2:, : L // 4] = False  # some padding too
    yield "bool", keep
    for val in (-1e9, torch.finfo(dt).min):
        yield f"{val:g}", torch.zeros(L, L, dtype=dt).masked_fill(~keep, val)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_dead_keys_of_huge_negative_masks_give_finite_tight_bounds(dt):
    """Additive masks of -1e9 / finfo(dtype).min: the masked keys' weights are exactly 0 in every
    correct computation; the bound was inf on every output row but the first (rounding charged
    to keys of weight 0). Now: finite everywhere, no violation against the exact (mpmath)
    reference, within a few percent of the boolean-mask bound."""
    g = torch.Generator().manual_seed(5)
    L = 24
    q, k, v = (torch.randn(1, 2, L, 16, generator=g).to(dt) for _ in range(3))
    bounds = {}
    for name, m in _mask_cases(dt, L):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=m).double()
        ex = exact_attention(q, k, v, attn_mask=m)
        for model in ({}, torch_cpu_sdpa_model(q)):
            b = attention(q, k, v, attn_mask=m, **model).abs
            assert bool(torch.isfinite(b).all()), (name, model)
            assert int(((out - ex).abs() > b).sum()) == 0, (name, model)
        bounds[name] = attention(q, k, v, attn_mask=m, **torch_cpu_sdpa_model(q)).abs
    for name, b in bounds.items():
        assert float((b / bounds["bool"]).max()) < 1.1, name


def test_mask_whose_rounding_may_overflow_on_a_live_key_gives_no_claim():
    """A row whose every key is at finfo.min: the scores' roundings may overflow to -inf on the
    keys that decide the row: no finite claim (inf), never a wrong finite bound."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 1, 4, 8, generator=g) for _ in range(3))
    m = torch.zeros(4, 4)
    m[1] = torch.finfo(torch.float32).min
    b = attention(q, k, v, attn_mask=m).abs
    assert bool(torch.isinf(b[..., 1, :]).all()) and bool(torch.isfinite(b[..., 0, :]).all())


# ------------------------------------------------------------------ 3. argument validation
def test_argument_errors_are_clear():
    q = torch.randn(1, 4, 8, 16)
    kv = torch.randn(1, 4, 8, 16)
    m = torch.ones(8, 8, dtype=torch.bool)
    cases = [
        (dict(attn_mask=m, is_causal=True), ValueError, "is_causal"),
        (dict(attn_mask=m, causal=True), ValueError, "is_causal"),
        (dict(attn_mask=torch.ones(7, 8, dtype=torch.bool)), ValueError, "attn_mask"),
        (dict(attn_mask=torch.ones(8, 8, dtype=torch.int32)), TypeError, "attn_mask"),
        (dict(scale=float("nan")), ValueError, "scale"),
        (dict(scale="a"), TypeError, "scale"),
    ]
    for kw, exc, word in cases:
        with pytest.raises(exc, match=word):
            attention(q, kv, kv, **kw)
    with pytest.raises(ValueError, match="dtype"):
        attention(q, kv.double(), kv)
    with pytest.raises(ValueError, match="2-D"):
        attention(q[0, 0, 0], kv[0, 0, 0], kv[0, 0, 0])
    with pytest.raises(ValueError, match="same batch and head"):
        attention(q, kv, kv[:, :2])
    with pytest.raises(ValueError, match="divisible"):
        attention(q[:, :3], kv[:, :2], kv[:, :2], enable_gqa=True)
    with pytest.raises(TypeError, match="torch.Tensor"):
        attention(q.tolist(), kv, kv)
    # the library's own combination (mask: True = masked out) with causal stays available
    b = attention(q, kv, kv, mask=~m, causal=True)
    assert torch.equal(b.abs, attention(q, kv, kv, is_causal=True).abs)
