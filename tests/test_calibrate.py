"""Tests of :mod:`ttrace_num.calibrate` (Monte Carlo calibration of the probabilistic models)."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from scipy import stats

import ttrace_num as tn
from ttrace_num import calibrate as C
from ttrace_num.cli import main
from ttrace_num.emulate.softmax import emulate_softmax
from ttrace_num.reference import ops as ref

# small, fast settings: p = 0.05 at confidence 0.9 needs 45 fit samples
FAST = dict(samples=120, p=0.05, confidence=0.9)


@pytest.fixture(scope="module")
def e4m3_cal() -> C.Calibration:
    return C.calibrate("e4m3", ["softmax", "quantized_matmul"], seed=3, **FAST)


def test_reproducible_bitwise(e4m3_cal, tmp_path):
    again = C.calibrate("e4m3", ["softmax", "quantized_matmul"], seed=3, **FAST)
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
    with pytest.raises(C.CalibrationError, match="op matmul: cannot emulate"):
        C.calibrate("e4m3", ["matmul"], compute_fmt="custom(e=8, m=30)", **FAST)
    with pytest.raises(C.CalibrationError, match="cannot calibrate layer_norm"):
        C.calibrate("e4m3", ["layer_norm"], **FAST)
    bad = torch.zeros(3, 4)
    bad[1, 2] = float("nan")
    with pytest.raises(C.CalibrationError, match=r"tensor 'acts' holds nan at index \(1, 2\)"):
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
    assert "calibrated constants in use" in capsys.readouterr().out
    assert main(["tolerance", "gelu", "--shape", "4x64", "--fmt", "custom(e=3, m=2)", "--mode", "probabilistic",
                 "--calibration", str(out), "--kw", "out_fmt='custom(e=3, m=2)'"]) == 0
    assert "calibrated: kappa=" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="too few"):
        main(["calibrate", "--format", "e4m3", "--ops", "gelu", "--samples", "10", "--out", str(tmp_path / "x.json")])


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
    with pytest.raises(SystemExit, match=r"tensor 'y' holds inf at index \(3, 5\)"):
        main(["calibrate", "--format", "e4m3", "--ops", "silu", "--file", str(bad), "--samples", "120", "--p", "0.05"])


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
