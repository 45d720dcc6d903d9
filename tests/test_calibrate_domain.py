"""A calibration records its domain and holds per distribution (issue 33):

* ``kappa`` is the largest of the per-distribution upper bounds (each source gets its own
  fit and held-out halves), so the claim holds for each distribution fitted;
* the file records the domain (per tensor argument: the rows'/units' trailing dims and the
  range of the rows' peak-to-RMS ratio) and ``tolerance(..., calibration=)`` warns
  (``CalibrationDomainWarning``: what differs, what to do) for inputs outside it: another
  reduction/row length, or heavier-tailed rows than calibrated."""
import json
import warnings

import pytest
import torch

import ttrace_num as tn
from ttrace_num import calibrate as C


@pytest.fixture(scope="module")
def cal():
    return C.calibrate("e4m3", ["softmax", "gelu", "matmul"], samples=120, p=0.05, seed=0,
                       distributions=("normal", "activations"))


@pytest.fixture(scope="module")
def cal_normal():
    return C.calibrate("e4m3", ["softmax"], samples=120, p=0.05, seed=0)


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return tn.round_to(x.double(), "e4m3").to(torch.float8_e4m3fn)


def _apply(cal, op, x):
    return tn.tolerance(op, x, dim=-1, mode="probabilistic", calibration=cal) if op == "softmax" else \
        tn.tolerance(op, x, mode="probabilistic", calibration=cal)


def test_kappa_covers_each_distribution_and_the_file_keeps_the_domain(cal, tmp_path):
    e = cal.ops["softmax"]
    assert set(e.per_distribution) == {"normal", "activations"}
    assert e.kappa == max(d["kappa"] for d in e.per_distribution.values())
    assert all(d["n_heldout"] == 60 for d in e.per_distribution.values()) and e.n_fit == 120 and e.n_heldout == 120
    assert e.domain["units"] == [[64]]
    lo, hi = e.domain["row_peak_to_rms"][0]
    assert 1 <= lo < 3 < hi <= 8.0 + 1e-9  # sqrt(64) = 8: at most one large value per row
    assert e.domain["row_rms_ratio"] == [None]  # one row per instance: no spread measured
    lo, hi = cal.ops["matmul"].domain["row_rms_ratio"][0]  # 4 rows of a per instance; b is a weight
    assert 0 < lo < 1 < hi <= 4 ** 0.5 + 1e-9 and cal.ops["matmul"].domain["row_rms_ratio"][1] is None
    path = tmp_path / "c.json"
    cal.save(path)
    assert json.loads(path.read_text())["schema_version"] == C.SCHEMA_VERSION == 2
    assert C.load(path).ops["softmax"].domain == e.domain


def test_inside_the_domain_no_warning(cal):
    x = _e4m3(torch.randn(16, 64, generator=torch.Generator().manual_seed(1)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", C.CalibrationDomainWarning)
        _apply(cal, "softmax", x)
        _apply(cal, "gelu", _e4m3(torch.randn(4, 1000)))  # elementwise: the row length is no part of the domain
        a = _e4m3(torch.randn(32, 1024, generator=torch.Generator().manual_seed(5))).double()
        tn.tolerance("matmul", a, _e4m3(torch.randn(1024, 4)).double(), fmt="e4m3", mode="probabilistic",
                     calibration=cal, out_fmt="fp32")


def test_another_row_length_warns(cal):
    x = _e4m3(torch.randn(16, 256, generator=torch.Generator().manual_seed(2)))
    with pytest.warns(C.CalibrationDomainWarning, match=r"input 0 has units \[256\].*calibrated at \[64\].*--shape softmax"):
        _apply(cal, "softmax", x)


def test_heavier_tailed_data_than_calibrated_warn(cal_normal):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 64, generator=g, dtype=torch.float64) * torch.exp(2 * torch.randn(32, 64, generator=g))
    x = _e4m3(x / x.abs().max() * 400)  # log-normal-scaled, in e4m3's range
    with pytest.warns(C.CalibrationDomainWarning, match=r"outside the calibrated range .* not distributed like those calibrated \(normal\)"):
        _apply(cal_normal, "softmax", x)


def test_rows_of_spread_scales_warn_even_where_each_row_looks_calibrated(cal):
    """Log-normal row scales (each row normal): the rows' tail weight is like the calibrated
    one, their scales spread far more than in any calibrated instance."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(32, 1024, generator=g, dtype=torch.float64) * torch.exp(2 * torch.randn(32, 1, generator=g))
    a = _e4m3(x / x.abs().max() * 400).double()
    with pytest.warns(C.CalibrationDomainWarning, match=r"RMS relative to the tensor's .* outside the calibrated range"):
        tn.tolerance("matmul", a, _e4m3(torch.randn(1024, 4)).double(), fmt="e4m3", mode="probabilistic",
                     calibration=cal, out_fmt="fp32")
