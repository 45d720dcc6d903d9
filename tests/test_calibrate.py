"""Tests of :mod:`ttrace_num.calibrate` (Monte Carlo calibration of the probabilistic models)."""
from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch
from scipy import stats

import ttrace_num as tn
from ttrace_num import calibrate as C
from ttrace_num.bounds.common import lookup
from ttrace_num.calibrate import ops as O
from ttrace_num.cli import main
from ttrace_num.emulate.softmax import emulate_softmax
from ttrace_num.reference import ops as ref

# small, fast settings: p = 0.05 at confidence 0.9 needs 45 fit samples
FAST = dict(samples=120, p=0.05, confidence=0.9)


@pytest.fixture(scope="module")
def e4m3_cal() -> C.Calibration:
    return C.calibrate("e4m3", ["softmax", "quantized_matmul"], seed=3, **FAST)


def test_reproducible_bitwise(e4m3_cal, tmp_path):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:  # the calibration runs with one intra-op thread and restores the caller's setting
        again = C.calibrate("e4m3", ["softmax", "quantized_matmul"], seed=3, **FAST)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert again.to_json() == e4m3_cal.to_json()
    alone = C.calibrate("e4m3", ["softmax"], seed=3, **FAST)  # an op's data do not depend on the other ops
    assert alone.ops["softmax"] == e4m3_cal.ops["softmax"]
    other = C.calibrate("e4m3", ["softmax"], seed=4, **FAST)
    assert other.ops["softmax"] != e4m3_cal.ops["softmax"]
    e4m3_cal.save(tmp_path / "c.json")
    loaded = C.load(tmp_path / "c.json")
    assert loaded.to_json() == e4m3_cal.to_json()
    d = json.loads((tmp_path / "c.json").read_text())
    assert d["schema_version"] == C.SCHEMA_VERSION and d["format"] == tn.get_format("e4m3").constants()
    assert d["ttrace_num_version"] == tn.__version__ and d["seed"] == 3


def test_kappa_upper_bound_order_statistic():
    # k is the smallest index with P(Bin(n, 1-p) < k) >= confidence
    n, p, conf = 100, 0.05, 0.9
    r = torch.arange(1, n + 1, dtype=torch.float64)
    kappa = C.kappa_upper_bound(r, p, conf)
    k = int(kappa)
    assert stats.binom.cdf(k - 1, n, 1 - p) >= conf > stats.binom.cdf(k - 2, n, 1 - p)
    assert C.min_samples(p, conf) == math.ceil(math.log(1 - conf) / math.log(1 - p))
    # coverage: over many uniform samples the bound is below the true quantile in <= 1-conf of the cases
    g = torch.Generator().manual_seed(0)
    below = sum(C.kappa_upper_bound(torch.rand(n, generator=g, dtype=torch.float64), p, conf) < 1 - p
                for _ in range(400))
    assert stats.binomtest(below, 400, 1 - conf, alternative="greater").pvalue > 1e-3


def test_heldout_consistent_and_tighter(e4m3_cal):
    for op, e in e4m3_cal.ops.items():
        assert e.n_fit == 60 and e.n_heldout == 60
        assert e.heldout_pvalue > 1e-3, op  # held-out violation rate consistent with p
        assert 0 < e.kappa <= 1.0 + 1e-12, op  # never looser than the analytic bound on these data
    assert e4m3_cal.ops["quantized_matmul"].kappa < 0.7  # strictly tighter where the model has slack


def test_wrong_kappa_is_caught():
    """A calibration that claims a quarter of the fitted kappa fails the held-out check."""
    keep: dict[str, torch.Tensor] = {}
    cal = C.calibrate("e4m3", ["quantized_matmul"], seed=1, keep=keep, **FAST)
    e = cal.ops["quantized_matmul"]
    v, pval = C.heldout_check(keep["quantized_matmul"], e.kappa / 4, e.p)
    assert v > 50 and pval < 1e-6
    v_ok, pval_ok = C.heldout_check(keep["quantized_matmul"], e.kappa, e.p)
    assert pval_ok > 1e-3 and v_ok < v


def test_refusals(tmp_path):
    with pytest.raises(C.CalibrationError, match=r"need n_fit >= .* = 45"):
        C.calibrate("e4m3", ["softmax"], samples=60, p=0.05, confidence=0.9)
    with pytest.raises(C.CalibrationError, match="not narrower than fp64"):
        C.calibrate("custom(e=12, m=40)", ["softmax"], **FAST)
    with pytest.raises(C.CalibrationError, match="format fp64 is not narrower"):
        C.calibrate("fp64", ["gelu"], **FAST)
    with pytest.raises(C.CalibrationError, match="unknown format"):
        C.calibrate("e9m9x", ["gelu"], **FAST)
    with pytest.raises(C.CalibrationError, match="cannot calibrate cross_entropy"):
        C.calibrate("e4m3", ["cross_entropy"], **FAST)
    with pytest.raises(C.CalibrationError, match=r"--shape matmul=4x4: matmul takes 3 positive sizes"):
        C.calibrate("e4m3", ["matmul"], shapes={"matmul": (4, 4)}, **FAST)
    with pytest.raises(C.CalibrationError, match=r"--shape swiglu: .*even"):
        C.calibrate("e4m3", ["swiglu"], shapes={"swiglu": (63,)}, **FAST)
    bad = torch.zeros(3, 4)
    bad[1, 2] = float("nan")
    with pytest.raises(C.CalibrationError, match=r"tensor 'acts' of the supplied tensors holds nan at index \(1, 2\)"):
        C.calibrate("e4m3", ["softmax"], tensors={"w": torch.ones(5), "acts": bad}, **FAST)
    with pytest.raises(C.CalibrationError, match="overflow"):
        C.calibrate("custom(e=3, m=2)", ["softmax"], distributions=["activations"], **FAST)


def test_exact_ops_are_skipped():
    cal = C.calibrate("e2m1", ["sum"], **FAST)
    assert "sum" in cal.skipped and "exactly" in cal.skipped["sum"] and not cal.ops
    with pytest.raises(ValueError, match="no constant for op sum"):
        tn.tolerance("sum", torch.ones(4, 8), fmt="e2m1", mode="probabilistic", calibration=cal)


def test_tolerance_consumes_calibration(e4m3_cal, tmp_path):
    path = tmp_path / "e4m3.json"
    e4m3_cal.save(path)
    x = tn.round_to(torch.randn(50, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(9)), "e4m3")
    kw = dict(fmt="e4m3", compute_fmt="fp32", out_fmt="e4m3")
    b = tn.tolerance("softmax", x, mode="probabilistic", calibration=str(path), **kw)
    ana = tn.tolerance("softmax", x, mode="probabilistic", **kw)
    det = tn.tolerance("softmax", x, **kw)
    kappa = e4m3_cal.ops["softmax"].kappa
    assert torch.equal(b.abs, torch.minimum(kappa * ana.abs, det.abs))
    assert (b.abs <= det.abs).all() and f"calibrated: kappa={kappa:.4g} from {path}" in b.explain()
    assert b.failure_probability == e4m3_cal.ops["softmax"].p
    # the calibrated bound holds on fresh data (per instance = per row)
    err = (emulate_softmax(x, -1, fmt="e4m3", compute_fmt="fp32", out_fmt="e4m3") - ref.softmax(x, -1)).abs()
    rows_violated = int((err > b.abs).any(-1).sum())
    assert stats.binomtest(rows_violated, 50, e4m3_cal.ops["softmax"].p, alternative="greater").pvalue > 1e-3
    # in-memory object, and the mismatches are refused
    assert torch.equal(tn.tolerance("softmax", x, mode="probabilistic", calibration=e4m3_cal, **kw).abs, b.abs)
    with pytest.raises(ValueError, match="mode='probabilistic'"):
        tn.tolerance("softmax", x, calibration=e4m3_cal, **kw)
    with pytest.raises(ValueError, match="calibrates e4m3, not e5m2"):
        tn.tolerance("softmax", x, mode="probabilistic", calibration=e4m3_cal, fmt="e5m2")
    with pytest.raises(ValueError, match="no calibration for op 'gelu'"):
        tn.tolerance("gelu", x, mode="probabilistic", calibration=e4m3_cal, fmt="e4m3")
    with pytest.raises(ValueError, match="failure probability"):
        tn.tolerance("softmax", x, mode="probabilistic", calibration=e4m3_cal, failure_probability=1e-6, **kw)
    broken = dataclasses.replace(e4m3_cal, schema_version=99)
    (tmp_path / "old.json").write_text(broken.to_json())
    with pytest.raises(C.CalibrationError, match="schema_version 99"):
        C.load(tmp_path / "old.json")


def test_cli_writes_file_and_plots(tmp_path, capsys):
    out, plots = tmp_path / "cal.json", tmp_path / "plots"
    args = ["calibrate", "--format", "custom(e=3, m=2)", "--ops", "gelu,quantize", "--recipe", "mx32",
            "--samples", "120", "--p", "0.05", "--out", str(out), "--plots", str(plots)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "kappa (UCB)" in text and "gelu" in text and "quantize" in text
    first = out.read_bytes()
    assert sorted(p.name for p in plots.iterdir()) == ["calibration_gelu.png", "calibration_quantize.png"]
    assert all(p.stat().st_size > 1000 for p in plots.iterdir())
    assert main(args) == 0 and out.read_bytes() == first  # same seed => identical file
    d = json.loads(first)
    assert d["recipe"] == "mx32" and set(d["ops"]) == {"gelu", "quantize"}
    # formats / tolerance say when a calibrated constant is in use
    assert main(["formats", "--calibration", str(out)]) == 0
    text = capsys.readouterr().out
    assert "custom(e=3,m=2,bias=3,ieee)*" in text and "calibrated constants in use" in text and "gelu: kappa=" in text
    assert main(["formats", "--json", "--calibration", str(out)]) == 0
    entry = [c for c in json.loads(capsys.readouterr().out) if "calibration" in c]
    assert len(entry) == 1 and entry[0]["exponent_bits"] == 3 and set(entry[0]["calibration"]["kappa"]) == set(d["ops"])
    assert main(["formats"]) == 0 and "*" not in capsys.readouterr().out
    assert main(["tolerance", "gelu", "--shape", "4x64", "--fmt", "custom(e=3, m=2)", "--mode", "probabilistic",
                 "--calibration", str(out), "--kw", "out_fmt='custom(e=3, m=2)'"]) == 0
    assert "calibrated: kappa=" in capsys.readouterr().out
    assert main(["tolerance", "gelu", "--shape", "4x64", "--fmt", "custom(e=3, m=2)", "--mode", "probabilistic",
                 "--calibration", str(out), "--kw", "out_fmt='custom(e=3, m=2)'", "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["explanation"]["source"].startswith("calibrated: kappa=") and j["failure_probability"] == 0.05
    assert main(["calibrate", "--format", "e4m3", "--ops", "gelu", "--samples", "10", "--out", str(tmp_path / "x.json")]) == 2
    assert "too few" in capsys.readouterr().err


def test_cli_safetensors_input(tmp_path, capsys):
    from safetensors.torch import save_file
    good, bad = tmp_path / "good.safetensors", tmp_path / "bad.safetensors"
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    save_file({"x": x}, str(good))
    y = x.clone()
    y[3, 5] = float("inf")
    save_file({"x": x, "y": y}, str(bad))
    out = tmp_path / "c.json"
    assert main(["calibrate", "--format", "e4m3", "--ops", "silu", "--file", str(good), "--samples", "120",
                 "--p", "0.05", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["ops"]["silu"]["distributions"] == ["tensors:x"]
    assert main(["calibrate", "--format", "e4m3", "--ops", "silu", "--file", str(bad), "--samples", "120",
                 "--p", "0.05"]) == 2
    assert re.search(r"tensor 'y' of file .*bad.safetensors holds inf at index \(3, 5\)", capsys.readouterr().err)


def test_docs_example_runs(monkeypatch, tmp_path):
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "docs" / "calibration.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    for code in blocks:
        exec(compile(code, "calibration.md", "exec"), ns)
    assert "calibrated: kappa=" in ns["bound"].explanation.source


NEW_OPS = ["linear", "mean", "log_softmax", "layer_norm", "rms_norm", "swiglu", "add", "attention"]


def test_all_ops_are_the_library_ops_the_emulators_model():
    assert set(NEW_OPS) | {"matmul", "sum", "softmax", "gelu", "silu", "quantize", "quantized_matmul"} == set(C.ALL_OPS)
    assert set(C.ALL_OPS) <= set(tn.ops())
    cal = C.calibrate("e4m3", NEW_OPS, seed=2, **FAST)
    assert set(cal.ops) == set(NEW_OPS) and not cal.skipped
    for op, e in cal.ops.items():
        assert e.heldout_pvalue > 1e-3, op
        assert 0 < e.kappa <= 1.0 + 1e-12, op
    assert cal.ops["linear"].shape == [[4, 1024], [4, 1024]] and cal.ops["attention"].shape == [[1, 8, 16]] * 3
    assert cal.ops["mean"].kappa < 0.1  # a mean of 1000 e4m3 values in fp32 is far inside its bound


def test_ops_that_cannot_be_emulated_are_skipped_with_a_reason():
    # log_softmax keeps its row statistics in the storage format: a sum of 64 exps overflows custom(e=3, m=2)
    cal = C.calibrate("custom(e=3, m=2)", ["log_softmax", "gelu"], **FAST)
    assert set(cal.ops) == {"gelu"} and "overflows" in cal.skipped["log_softmax"]
    cal = C.calibrate("e4m3", ["matmul", "gelu"], compute_fmt="custom(e=8, m=30)", **FAST)
    assert "cannot emulate" in cal.skipped["matmul"]
    # 16-bit format that neither bf16 nor fp16 holds: the layer-norm moments schedule cannot be reproduced
    cal = C.calibrate("custom(e=6, m=9)", ["layer_norm", "rms_norm"], **FAST)
    assert "vector width" in cal.skipped["layer_norm"] and "rms_norm" in cal.ops


def test_shape_override(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["calibrate", "--format", "e4m3", "--ops", "softmax,mean,matmul", "--shape", "softmax=4x32",
                 "--shape", "mean=2x100", "--shape", "matmul=2x64x3", "--samples", "120", "--p", "0.05",
                 "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["ops"]["softmax"]["shape"] == [[4, 32]] and d["ops"]["mean"]["shape"] == [[2, 100]]
    assert "shapes [[2, 64], [64, 3]] are computed exactly" in d["skipped"]["matmul"]
    capsys.readouterr()
    assert main(["calibrate", "--format", "e4m3", "--shape", "softmax"]) == 2
    assert "bad --shape 'softmax'; write OP=AxB" in capsys.readouterr().err
    assert main(["calibrate", "--format", "e4m3", "--ops", "gelu", "--shape", "nosuchop=4"]) == 2
    assert "cannot calibrate nosuchop" in capsys.readouterr().err
    assert "--shape OP=AxB" in _help(capsys)


def _help(capsys) -> str:
    assert main(["calibrate", "--help"]) == 0
    return capsys.readouterr().out


def test_supplied_tensors_keep_their_structure():
    g = torch.Generator().manual_seed(0)
    x = torch.arange(30 * 6, dtype=torch.float64).reshape(30, 6)  # row i holds 6i .. 6i+5
    y = -x
    w = torch.randn(5, 6, generator=g)
    q = torch.randn(2, 3, 5, 4, generator=g)  # 6 heads of (L=5, d=4)
    sup = O.Supplied({"x": x, "y": y, "w": w})
    from ttrace_num import scaling
    s = O.Setup(tn.get_format("e4m3"), tn.get_format("fp32"), scaling.get_recipe("tensor"), tn.get_format("fp32"))
    # softmax instance = one whole row (its length from the tensor, not the default 64)
    (rows,) = sup.draw("softmax", O.op_shapes("softmax", s, None), 50, g)
    assert rows.shape == (50, 6) and torch.equal(rows[:, 1:] - rows[:, :1], torch.arange(1.0, 6).expand(50, 5))
    assert (rows[:, 0] % 6 == 0).all()
    # an op shape of 4 rows: 4 consecutive rows of x; add's y uses the same rows
    a, b = sup.draw("add", O.op_shapes("add", s, (4, 99)), 20, g)
    assert a.shape == (20, 4, 6) and torch.equal(b, -a)
    assert torch.equal(a[:, 1:, 0] - a[:, :-1, 0], torch.full((20, 3), 6.0))
    # a weight is used whole in every instance
    xw = O.Supplied({"x": x, "w": w})
    xs, ws = xw.draw("linear", O.op_shapes("linear", s, None), 7, g)
    assert xs.shape == (7, 4, 6) and torch.equal(ws, w.double())
    assert xw.shapes("linear", O.op_shapes("linear", s, None)) == [[4, 6], [5, 6]]
    assert "does not take arguments of shapes [[4, 6], [5, 6]]" in xw.unfit("matmul", O.op_shapes("matmul", s, None), s)
    # attention: one (L, d) head per instance, q, k, v of the same head
    heads = O.Supplied({"q": q, "k": 2 * q, "v": 4 * q})
    qq, kk, vv = heads.draw("attention", O.op_shapes("attention", s, None), 9, g)
    assert qq.shape == (9, 1, 5, 4) and torch.equal(kk, 2 * qq) and torch.equal(vv, 4 * qq)
    assert all(any(torch.equal(h[0], u) for u in q.reshape(6, 5, 4)) for h in qq)
    assert "3 tensor arguments" in O.Supplied({"x": x}).unfit("attention", O.op_shapes("attention", s, None), s)
    assert "holds 30" in O.Supplied({"x": x}).unfit("softmax", O.op_shapes("softmax", s, (31, 6)), s)


def test_supplied_tensors_end_to_end(tmp_path, capsys):
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(1)
    f = tmp_path / "acts.safetensors"
    save_file({"x": torch.randn(256, 48, generator=g), "w": torch.randn(16, 48, generator=g)}, str(f))
    out = tmp_path / "c.json"
    assert main(["calibrate", "--format", "bf16", "--ops", "linear,matmul,silu,attention", "--file", str(f),
                 "--inputs", "x,w", "--samples", "120", "--p", "0.05", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    d = json.loads(out.read_text())
    assert d["ops"]["linear"]["shape"] == [[4, 48], [16, 48]] and d["ops"]["silu"]["shape"] == [[48]]
    assert d["ops"]["linear"]["distributions"] == ["tensors:x,w"]
    assert set(d["skipped"]) == {"matmul", "attention"}
    assert "skipped matmul: matmul(a, b) does not take" in text and "skipped attention: attention takes 3" in text


def test_calibrated_local_bounds_and_noise_injector(e4m3_cal, tmp_path):
    from ttrace_num.propagate.calls import OpCall
    from ttrace_num.propagate.local import LocalBounds
    from ttrace_num.propagate.noise import NoiseInjector, measure_propagation
    path = tmp_path / "e4m3.json"
    e4m3_cal.save(path)
    x = tn.round_to(torch.randn(16, 64, generator=torch.Generator().manual_seed(5), dtype=torch.float64), "e4m3")
    x8 = x.to(torch.float8_e4m3fn)
    call = OpCall("op", "softmax", (x8,), {"dim": -1})
    lb = LocalBounds(mode="probabilistic", against_exact=True, calibration=str(path))
    (b,) = lb.terms(call, x8, "")
    # the analytic bound kappa rescales: the model's own (as in the fit, calibrate._ratios), without the
    # repeated-addend charges tolerance() adds in probabilistic mode (bounds.validity)
    ana = lookup("softmax")(x8, dim=-1, mode="probabilistic", failure_probability=1e-6)
    det = tn.tolerance("softmax", x8, dim=-1)
    kappa = e4m3_cal.ops["softmax"].kappa
    assert torch.equal(b, torch.minimum(kappa * ana.abs, det.abs)) and (b < ana.abs).any()
    # an op the file does not calibrate keeps the analytic bound (with the shadow's failure probability)
    gelu = OpCall("op", "gelu", (x8,), {})
    lb_p = LocalBounds(mode="probabilistic", failure_probability=1e-3, against_exact=True, calibration=e4m3_cal)
    assert torch.equal(lb_p.terms(gelu, x8, "")[0],
                       tn.tolerance("gelu", x8, mode="probabilistic", failure_probability=1e-3).abs)
    # two runs of the same model: one term per run
    assert len(LocalBounds(mode="probabilistic", calibration=e4m3_cal).terms(call, x8, "")) == 2
    with pytest.raises(ValueError, match="mode='probabilistic'"):
        LocalBounds(calibration=e4m3_cal)
    with pytest.raises(ValueError, match="calibrates e4m3, not bf16"):
        lb.terms(OpCall("op", "softmax", (x.bfloat16(),), {"dim": -1}), x, "")
    # the noise injector and measure_propagation use the calibrated bound: a tiny kappa silences softmax's noise
    assert NoiseInjector(torch.Generator(), mode="probabilistic", calibration=str(path)).local.calibration.ops
    tiny = dataclasses.replace(e4m3_cal, ops={"softmax": dataclasses.replace(e4m3_cal.ops["softmax"], kappa=1e-30)})
    xb = x.bfloat16()
    bf_cal = dataclasses.replace(tiny, fmt_spec="bf16", format=tn.get_format("bf16").constants(),
                                 ops={"softmax": dataclasses.replace(tiny.ops["softmax"], out_fmt="bf16")})

    def run() -> dict[str, torch.Tensor]:
        return {"y": torch.softmax(xb, -1)}
    quiet = measure_propagation(run, samples=2, mode="probabilistic", calibration=bf_cal, backward=False)
    loud = measure_propagation(run, samples=2, mode="probabilistic", backward=False)
    assert float(quiet.deviation["y"].max()) == 0 < float(loud.deviation["y"].max())


def test_output_format_defaults_like_tolerance(tmp_path):
    """Without out_fmt= a calibrated bound assumes the output format tolerance() would (the
    inputs'), and refuses when the calibration measured another one."""
    cal = C.calibrate("bf16", ["linear", "softmax"], seed=0, **FAST)
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(4, 1024, generator=g).bfloat16(), torch.randn(4, 1024, generator=g).bfloat16()
    with pytest.raises(ValueError, match=r"measured with output format fp32, not bf16 \(the default; pass out_fmt='fp32'"):
        tn.tolerance("linear", x, w, mode="probabilistic", calibration=cal)
    b = tn.tolerance("linear", x, w, mode="probabilistic", calibration=cal, out_fmt="fp32")
    ana = tn.tolerance("linear", x, w, mode="probabilistic", failure_probability=1e-6, out_fmt="fp32")
    assert torch.equal(b.abs, torch.minimum(cal.ops["linear"].kappa * ana.abs,
                                            tn.tolerance("linear", x, w, out_fmt="fp32").abs))
    s = tn.tolerance("softmax", x, dim=-1, mode="probabilistic", calibration=cal)  # bf16 out: the default
    assert "calibrated: kappa=" in s.explanation.source
    # --out-fmt: the GEMMs store bf16, like a bf16 model's; then the default output format fits
    cal16 = C.calibrate("bf16", ["linear"], out_fmt="bf16", seed=0, **FAST)
    assert cal16.ops["linear"].out_fmt == "bf16"
    assert "calibrated" in tn.tolerance("linear", x, w, mode="probabilistic", calibration=cal16).explanation.source


def test_cli_file_errors_are_clear(tmp_path, capsys):
    assert main(["calibrate", "--format", "e4m3", "--file", str(tmp_path / "none.safetensors")]) == 2
    assert "not found" in capsys.readouterr().err
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    assert main(["calibrate", "--format", "e4m3", "--file", str(bad)]) == 2
    assert "cannot read" in capsys.readouterr().err
