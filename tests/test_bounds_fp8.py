"""FP8 / MX / FP6 / FP4 error models (ttrace_num.bounds.fp8): quantize, scaled_matmul,
quantized_matmul against exact references, the real torch CPU ops (fp8 casts,
torch._scaled_mm, fp32 GEMM on fake-quantized operands), ml_dtypes casts for the formats
torch lacks, and the emulators of ttrace_num.emulate.fp8.

Every check: 0 deterministic violations; probabilistic violations no more frequent than
claimed (one-sided binomial test); tightness (per instance: min over elements of
bound/error) reported and bounded; deliberately wrong models are caught.
"""
from __future__ import annotations

import math
import statistics

import pytest
import torch
from scipy.stats import binomtest

import ttrace_num as tn
from ttrace_num import scaling
from ttrace_num.bounds.fp8 import TENSOR_CORE_ACCUM, ScaledGemm  # importing it registers the fp8 ops
from ttrace_num.emulate.fp8 import (cast_fake_quant, cast_quantized_matmul, emulate_fake_quant, emulate_quantize,
                                    emulate_quantized_matmul, emulate_scaled_matmul)
from ttrace_num.formats import get_format
from ttrace_num.reference import exact_matmul

FORMATS = ["e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz", "e2m3", "e3m2", "e2m1"]
DATA = ["normal", "heavy", "near_sat", "tiny"]
RECIPES = ["tensor", "delayed", "spike", "row", "1x128", "128x128", "mx32"]
#: (recipe of A, recipe of B^T): per tensor, per row / output column, 1x128 blocks along K,
#: DeepSeek-V3's 1x128 activations with 128x128 weights, MX blocks of 32 with E8M0 scales
QM_RECIPES = [("tensor", "tensor"), ("row", "row"), ("1x128", "1x128"), ("1x128", "128x128"), ("mx32", "mx32")]
P_TEST = 0.1  # failure probability of the probabilistic bounds in the tests (gives the binomial test power)
TIGHT: dict[str, list[float]] = {}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: these are many small ops, and the suite runs one process per core."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _data(kind: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """fp32 test data: normal; heavy-tailed (normal / uniform^1.5: power-law tail); near
    saturation (|x| in [0.8, 1], so most of a block lands near fmt.max after scaling); tiny
    (one element in 32 is 100, the rest 10^-7..10^-2: subnormal or zero after scaling)."""
    x = torch.randn(shape, generator=g)
    if kind == "heavy":
        x = x / torch.rand(shape, generator=g).clamp_min(1e-4) ** 1.5
    elif kind == "near_sat":
        x = torch.sign(x) * (0.8 + 0.2 * torch.rand(shape, generator=g))
    elif kind == "tiny":
        x = x * 10.0 ** (-7 + 5 * torch.rand(shape, generator=g))
        x[..., ::32] = 100.0
    return x.float()


def _recipe(name: str, x: torch.Tensor, g: torch.Generator, kind: str) -> tuple[str, torch.Tensor | None]:
    """(recipe, amax): current scaling, delayed scaling (amax = max of the last 16 steps'
    amax, the steps drawn like x: the current amax can exceed it), an amax spike (current
    amax 10x the history: saturation), or a block recipe with current scaling."""
    if name == "delayed":
        return "tensor", torch.stack([_data(kind, x.shape, g).abs().max() for _ in range(16)]).max()
    if name == "spike":
        return "tensor", x.abs().max() / 10
    return name, None


def _tightness(bound: torch.Tensor, err: torch.Tensor) -> float:
    nz = err > 0
    return float((bound[nz] / err[nz]).min()) if nz.any() else math.inf


def _check(bound: tn.Bound, computed: torch.Tensor, exact: torch.Tensor, key: str | None = None) -> int:
    """Violations of ``bound``; records the instance's tightness under ``key``."""
    err = (computed.double() - exact.double()).abs()
    b = torch.broadcast_to(bound.abs, err.shape)
    if key is not None:
        TIGHT.setdefault(key, []).append(_tightness(b, err))
    return int((err > b).sum())


def _median(key: str) -> float:
    vals = [t for t in TIGHT[key] if math.isfinite(t)]
    return statistics.median(vals)


def _binomial_ok(violations: int, n: int, p: float) -> bool:
    """Violations consistent with a per-element failure probability <= p (one-sided, 0.1%)."""
    return binomtest(violations, n, p, alternative="greater").pvalue > 1e-3


# ============================================================================ quantize
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_every_recipe_and_data_kind(fmt):
    g = torch.Generator().manual_seed(FORMATS.index(fmt))
    tights = []
    for kind in DATA:
        x = _data(kind, (128, 128), g)
        for rname in RECIPES:
            recipe, amax = _recipe(rname, x, g, kind)
            bound = tn.tolerance("quantize", x, fmt=fmt, recipe=recipe, amax=amax, saturate=True)  # all three clamp
            exact = x.double()
            key = f"quantize/{fmt}"
            for computed in (scaling.fake_quant(x, fmt, recipe, amax),  # x*s exact, q*s_inv exact
                             emulate_fake_quant(x, fmt, recipe, amax),  # fp32 model, every step rounded
                             cast_fake_quant(x, fmt, recipe, amax)):  # torch / ml_dtypes casts in fp32
                assert _check(bound, computed, exact, key) == 0, (fmt, kind, rname)
            tights.append(TIGHT[key][-1])
            if rname == "spike":  # saturation really happened and is covered
                assert scaling.quantize(x, fmt, recipe, amax).saturated.any()
    # half-ulp of the actual scaled magnitude: the worst element of an instance comes within 2x
    assert statistics.median(t for t in tights if math.isfinite(t)) <= 2.0


def test_quantize_saturation_with_mx_and_delayed_scaling_is_tight():
    """MX E2M1: |V|/X in (7, 8) clamps to 6 (OCP MX v1.0 §6.3): up to 25% error, bounded exactly."""
    g = torch.Generator().manual_seed(1)
    x = _data("near_sat", (64, 256), g)
    bound = tn.tolerance("quantize", x, fmt="e2m1", recipe="mx32")
    y = scaling.fake_quant(x, "e2m1", "mx32")
    err = (y - x.double()).abs()
    assert (err <= bound.abs).all()
    sat = scaling.quantize(x, "e2m1", "mx32").saturated
    assert sat.any() and float((err[sat] / x.double().abs()[sat]).max()) > 0.1
    assert torch.allclose(bound.abs[sat], err[sat], rtol=1e-12)  # saturation error is bounded exactly
    spike = tn.tolerance("quantize", x, fmt="e4m3", amax=x.abs().max() / 10)
    assert spike.explanation.values["possibly_saturating"] > 0


@pytest.mark.parametrize("dequant", ["scale_inv", "divide"])
@pytest.mark.parametrize("out_fmt", ["fp32", "bf16", "fp16"])
def test_quantize_dequant_conventions_and_output_formats(dequant, out_fmt):
    g = torch.Generator().manual_seed(2)
    for storage in (torch.float32, torch.bfloat16, torch.float16):
        for kind in ("normal", "heavy", "tiny"):
            x = _data(kind, (64, 256), g).to(storage)
            if kind == "heavy" and storage == torch.float16:
                x = x.clamp(-6e4, 6e4)
            for recipe in ("tensor", "1x128", "mx32"):
                bound = tn.tolerance("quantize", x, fmt="e4m3", recipe=recipe, dequant=dequant, out_fmt=out_fmt)
                y = emulate_fake_quant(x, "e4m3", recipe, dequant=dequant, out_fmt=out_fmt)
                assert _check(bound, y, x, f"quantize/dequant={dequant}/{out_fmt}") == 0


def test_quantize_probabilistic_equals_deterministic():
    x = _data("normal", (32, 128), torch.Generator().manual_seed(3))
    det = tn.tolerance("quantize", x, fmt="e5m2", recipe="row")
    prob = tn.tolerance("quantize", x, fmt="e5m2", recipe="row", mode="probabilistic", failure_probability=P_TEST)
    assert torch.equal(det.abs, prob.abs) and prob.failure_probability == P_TEST
    assert "probability 1" in prob.explain()


def test_quantize_wrong_models_are_caught():
    g = torch.Generator().manual_seed(4)
    x = _data("normal", (128, 256), g)
    # e4m3's unit roundoff for data quantized to e5m2 (u twice as large)
    wrong_fmt = tn.tolerance("quantize", x, fmt="e4m3", recipe="row")
    assert _check(wrong_fmt, scaling.fake_quant(x, "e5m2", "row"), x) > 0
    # ignoring the amax history: the bound assumes current scaling, the data saturated
    amax = x.abs().max() / 10
    no_sat = tn.tolerance("quantize", x, fmt="e4m3")
    assert _check(no_sat, scaling.fake_quant(x, "e4m3", "tensor", amax), x) > 0
    # u*|x| alone (no subnormal term) misses the tiny elements
    t = _data("tiny", (128, 256), g)
    rel_only = get_format("e4m3").u * t.double().abs()
    err = (scaling.fake_quant(t, "e4m3", "tensor") - t.double()).abs()
    assert int((err > rel_only).sum()) > 0


# ============================================================================ scaled_matmul
def _operands(kind: str, m: int, k: int, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """High-precision A (m,k), B (k,n); ``cancel``: A = [X, X], B = [Y; -Y] (exact product 0)."""
    if kind == "cancel":
        x, y = _data("normal", (m, k // 2), g), _data("normal", (k // 2, n), g)
        return torch.cat([x, x], 1), torch.cat([y, -y], 0)
    return _data(kind, (m, k), g), _data(kind, (k, n), g)


def _quantized(a, b, fa, fb, recipe):
    """Q_a, Q_b (K,N) and the dequantization scales in _scaled_mm's layout; B through B^T."""
    qa, qbt = scaling.quantize(a, fa, recipe), scaling.quantize(b.T, fb, recipe)
    sa, sb = qa.scale_inv, qbt.scale_inv
    return qa.values, qbt.values.T, sa, (sb if sb.dim() == 0 else sb.T.contiguous())


@pytest.mark.parametrize("fa,fb", [("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e4m3fnuz", "e5m2fnuz")])
def test_scaled_matmul_vs_torch_scaled_mm(fa, fb):
    g = torch.Generator().manual_seed(5)
    viol = {"deterministic": 0, "probabilistic": 0}
    total = 0
    for k, kind in ((256, "normal"), (256, "heavy"), (256, "cancel"), (2048, "normal"), (2048, "heavy")):
        a, b = _operands(kind, 32, k, 24, g)
        for recipe in ("tensor", "row"):
            qa, qb, sa, sb = _quantized(a, b, fa, fb, recipe)
            a8 = qa.to(get_format(fa).torch_dtype)
            b8 = qb.T.contiguous().to(get_format(fb).torch_dtype).T  # column-major, as cuBLASLt wants
            exact = exact_matmul(qa * sa, qb * sb)
            for out in (torch.float32, torch.bfloat16, torch.float16):
                if out == torch.float16 and kind == "heavy":
                    continue  # overflows fp16
                y = torch._scaled_mm(a8, b8, sa.float(), sb.float(), out_dtype=out)
                for mode in viol:
                    bound = tn.tolerance("scaled_matmul", a8, b8, scale_a=sa, scale_b=sb, out_fmt=out,
                                         scale_application="inputs", mode=mode, failure_probability=P_TEST)
                    viol[mode] += _check(bound, y, exact, f"scaled_matmul/torch/{out}/{mode}")
                total += y.numel()
    assert viol["deterministic"] == 0
    assert _binomial_ok(viol["probabilistic"], total, P_TEST)
    assert _median("scaled_matmul/torch/torch.bfloat16/probabilistic") <= 4


@pytest.mark.parametrize("promotion", [None, 128])
def test_scaled_matmul_vs_emulation(promotion):
    """Epilogue model (GPU): exact fp8 products, 14-bit inner accumulator promoted every 128
    products into fp32 (DeepSeek-V3 §3.3.2), scales per tensor / row / 1x128 / 128x128 / MX."""
    g = torch.Generator().manual_seed(6)
    viol = {"deterministic": 0, "probabilistic": 0}
    total = 0
    for kind in ("normal", "heavy"):
        a, b = _operands(kind, 16, 512, 16 if promotion else 128, g)
        for ra, rb in QM_RECIPES:
            if (rb == "128x128" and b.shape[1] % 128) or (promotion and ra == "mx32"):
                continue  # 128x128 needs N % 128 == 0; MX blocks of 32 cannot hold promotion blocks of 128
            qa = scaling.quantize(a, "e4m3", ra)
            qbt = scaling.quantize(b.T, "e4m3", rb)
            sa, sb = qa.scale_inv, qbt.scale_inv if qbt.scale_inv.dim() == 0 else qbt.scale_inv.T
            qb = qbt.values.T
            exact = exact_matmul(qa.values * qa.expand(qa.scale_inv), (qbt.values * qbt.expand(qbt.scale_inv)).T)
            for out in ("fp32", "bf16"):
                model = ScaledGemm(promotion_interval=promotion, out=out)
                y = emulate_scaled_matmul(qa.values, qb, sa, sb, model)
                for mode in viol:
                    bound = tn.tolerance("scaled_matmul", qa.values, qb, scale_a=sa, scale_b=sb, fmt="e4m3",
                                         out_fmt=out, promotion_interval=promotion, mode=mode,
                                         failure_probability=P_TEST)
                    viol[mode] += _check(bound, y, exact, f"scaled_matmul/emulated/pi={promotion}/{out}/{mode}")
                total += y.numel()
    assert viol["deterministic"] == 0
    assert _binomial_ok(viol["probabilistic"], total, P_TEST)


def test_scaled_matmul_wrong_models_are_caught():
    g = torch.Generator().manual_seed(7)
    a, b = _operands("normal", 16, 512, 16, g)
    qa, qb, sa, sb = _quantized(a, b, "e4m3", "e4m3", "tensor")
    exact = exact_matmul(qa * sa, qb * sb)
    # a 14-bit tensor-core accumulator checked against a bound that assumes fp32 accumulation:
    # far more violations than the claimed 1e-6 per element
    y = emulate_scaled_matmul(qa, qb, sa, sb, ScaledGemm(promotion_interval=128))
    fp32_bound = tn.tolerance("scaled_matmul", qa, qb, scale_a=sa, scale_b=sb, mode="probabilistic")
    assert _check(fp32_bound, y, exact) > 0.01 * y.numel()
    for mode in ("deterministic", "probabilistic"):
        right = tn.tolerance("scaled_matmul", qa, qb, scale_a=sa, scale_b=sb, promotion_interval=128,
                             inner_accum_fmt=TENSOR_CORE_ACCUM, mode=mode)
        assert _check(right, y, exact) == 0


def test_scaled_matmul_rejects_misaligned_promotion():
    q = torch.zeros(4, 256)
    with pytest.raises(ValueError, match="must divide"):
        tn.tolerance("scaled_matmul", q, q.T.contiguous(), scale_a=torch.ones(4, 8), scale_b=1.0,
                     promotion_interval=64)
    with pytest.raises(ValueError, match="does not tile"):
        tn.tolerance("scaled_matmul", q, q.T.contiguous(), scale_a=torch.ones(3, 1), scale_b=1.0)


# ============================================================================ quantized_matmul


@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16])
def test_quantized_matmul_vs_torch_and_emulation(storage):
    g = torch.Generator().manual_seed(8)
    viol = {"deterministic": 0, "probabilistic": 0}
    total = 0
    for kind in ("normal", "heavy", "spike"):
        for ra, rb in QM_RECIPES:
            fb = "e5m2" if ra == "row" else "e4m3"
            for impl in ("torch", "emulated"):
                if impl == "emulated" and kind == "heavy" and storage == torch.bfloat16:
                    continue  # runtime: the emulated 14-bit chains are the slow part
                m, k, n = (32, 512, 128) if impl == "torch" else (8, 256, 128)
                a, b = _operands("normal" if kind == "spike" else kind, m, k, n, g)
                a, b = a.to(storage), b.to(storage)
                amax_a = a.float().abs().max() / 10 if kind == "spike" and ra == "tensor" else None
                exact = exact_matmul(a, b)
                if impl == "torch":
                    kw = dict(scale_application="inputs", out_fmt=storage)
                    y = cast_quantized_matmul(a, b, fmt_a="e4m3", fmt_b=fb, recipe_a=ra, recipe_b=rb, amax_a=amax_a,
                                              out_dtype=storage)
                else:
                    pi = 32 if ra == "mx32" else 128
                    model = ScaledGemm(promotion_interval=pi, out=storage)
                    kw = dict(promotion_interval=pi, out_fmt=storage)
                    y = emulate_quantized_matmul(a, b, fmt_a="e4m3", fmt_b=fb, recipe_a=ra, recipe_b=rb,
                                                 amax_a=amax_a, model=model)
                for mode in viol:
                    bound = tn.tolerance("quantized_matmul", a, b, fmt_a="e4m3", fmt_b=fb, recipe_a=ra, recipe_b=rb,
                                         amax_a=amax_a, mode=mode, failure_probability=P_TEST, **kw)
                    viol[mode] += _check(bound, y, exact, f"quantized_matmul/{impl}/{storage}/{kind}/{mode}")
                total += y.numel()
    assert viol["deterministic"] == 0
    assert _binomial_ok(viol["probabilistic"], total, P_TEST)
    # the probabilistic bound removes the sqrt(K) cancellation of the quantization errors
    assert _median(f"quantized_matmul/torch/{storage}/normal/probabilistic") <= 4


def test_quantized_matmul_default_failure_probability_and_explanation():
    g = torch.Generator().manual_seed(9)
    a, b = _operands("normal", 32, 256, 32, g)
    det = tn.tolerance("quantized_matmul", a, b, recipe="row")
    prob = tn.tolerance("quantized_matmul", a, b, recipe="row", mode="probabilistic")
    assert prob.failure_probability == 1e-6 and (prob.abs <= det.abs).all() and prob.max() < det.max()
    text = prob.explain()
    assert "quantized_matmul" in text and "scaled_matmul" in text and "lambda" in text
    y = emulate_quantized_matmul(a, b, recipe_a="row", recipe_b="row")
    assert _check(prob, y, exact_matmul(a, b)) == 0


def test_quantized_matmul_wrong_models_are_caught():
    g = torch.Generator().manual_seed(10)
    a, b = _operands("normal", 32, 512, 32, g)
    exact = exact_matmul(a, b)
    amax = a.abs().max() / 10  # an amax spike: A saturates
    y = cast_quantized_matmul(a, b, amax_a=amax)
    ignoring_saturation = tn.tolerance("quantized_matmul", a, b, scale_application="inputs")
    assert _check(ignoring_saturation, y, exact) > 0
    right = tn.tolerance("quantized_matmul", a, b, amax_a=amax, scale_application="inputs")
    assert _check(right, y, exact) == 0
    # E4M3's unit roundoff for FP4 (E2M1) operands, 4x too small: violated far more often than
    # the claimed 1e-6 per element (the deterministic bound's sqrt(K) slack hides it)
    y = cast_quantized_matmul(a, b, fmt_a="e2m1", fmt_b="e2m1", recipe_a="row", recipe_b="row")
    wrong_fmt = tn.tolerance("quantized_matmul", a, b, recipe="row", scale_application="inputs",
                             mode="probabilistic")
    assert _check(wrong_fmt, y, exact) > 0.01 * y.numel()
    right = tn.tolerance("quantized_matmul", a, b, recipe="row", fmt="e2m1", scale_application="inputs",
                         mode="probabilistic")
    assert _check(right, y, exact) == 0


def test_emulate_quantize_matches_torch_casts():
    """The emulator's fp32 model is what the real fp32 kernel computes, bit for bit."""
    g = torch.Generator().manual_seed(11)
    for fmt in ("e4m3", "e5m2", "e2m1"):
        for recipe in ("tensor", "1x128", "mx32"):
            x = _data("heavy", (16, 256), g)
            assert torch.equal(emulate_fake_quant(x, fmt, recipe), cast_fake_quant(x, fmt, recipe, None))
    x = _data("normal", (16, 256), g)
    q = emulate_quantize(x, "e4m3", "row", compute_fmt="fp64")
    assert torch.equal(q.values, scaling.quantize(x, "e4m3", "row").values)


def test_report_tightness(request, capsys):
    """Median tightness per key collected by the tests above (printed with ``pytest -s``); a
    deterministic tightness below 1 would be a violation."""
    if not TIGHT:
        pytest.skip("collects the tightness of the other tests of this module")
    show = request.config.getoption("capture") == "no"
    for key in sorted(TIGHT):
        vals = [t for t in TIGHT[key] if math.isfinite(t)]
        if vals and show:
            with capsys.disabled():
                print(f"{key:70s} median tightness {statistics.median(vals):8.3g}  (n={len(vals)})")
        if vals and "probabilistic" not in key:
            assert min(vals) >= 1.0, key
