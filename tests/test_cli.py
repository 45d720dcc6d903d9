"""The ttrace command line (run in-process through ttrace_num.cli.main)."""
import json

import pytest
import torch
from safetensors.torch import save_file

from ttrace_num.cli import main


def test_formats_table_lists_every_format(capsys):
    assert main(["formats", "--custom", "custom(e=3, m=2)"]) == 0
    out = capsys.readouterr().out
    for name in ("fp64", "tf32", "bf16", "e4m3", "e5m2fnuz", "e8m0", "e2m1", "custom(e=3,m=2"):
        assert name in out
    assert "448" in out and "57344" in out


def test_formats_json_constants(capsys):
    main(["formats", "--json"])
    data = {d["name"]: d for d in json.loads(capsys.readouterr().out)}
    assert data["bf16"]["u"] == 2**-8 and data["e4m3"]["max"] == 448.0


def test_tolerance_on_generated_data_json(capsys):
    assert main(["tolerance", "matmul", "--shape", "8x64", "--shape", "64x4", "--dtype", "bf16", "--mode", "probabilistic", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["op"] == "matmul" and d["mode"] == "probabilistic" and d["dtypes"] == ["bfloat16", "bfloat16"]
    assert 0 < d["median_abs"] <= d["max_abs"] and d["explanation"]["op"] == "matmul"


def test_tolerance_on_safetensors_file(tmp_path, capsys):
    f = tmp_path / "x.safetensors"
    save_file({"x": torch.randn(4, 100), "unused": torch.zeros(1)}, str(f))
    out_f = tmp_path / "bound.safetensors"
    assert main(["tolerance", "sum", "--file", str(f), "--inputs", "x", "--kw", "dim=-1", "--save", str(out_f)]) == 0
    assert "max |err| bound" in capsys.readouterr().out
    from safetensors.torch import load_file
    assert load_file(str(out_f))["bound"].shape == (4,)


@pytest.mark.parametrize("argv, needle", [
    (["tolerance", "sum", "--file", "/nonexistent.safetensors"], "not found"),
    (["tolerance", "sum"], "--shape"),
    (["tolerance", "nosuchop", "--shape", "4x4"], "unknown op"),
])
def test_tolerance_errors_are_clear(argv, needle, capsys):
    assert main(argv) == 2  # bad input (tests/test_cli_bad_input.py has every case)
    assert needle in capsys.readouterr().err


def test_tolerance_names_missing_tensor_and_corrupt_file(tmp_path, capsys):
    f = tmp_path / "x.safetensors"
    save_file({"x": torch.randn(4)}, str(f))
    assert main(["tolerance", "sum", "--file", str(f), "--inputs", "y"]) == 2
    assert "no tensor named y; the file holds x" in capsys.readouterr().err
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(f.read_bytes()[:20])
    assert main(["tolerance", "sum", "--file", str(bad)]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_tolerance_rejects_nan_inputs(tmp_path, capsys):
    f = tmp_path / "x.safetensors"
    save_file({"x": torch.tensor([1.0, float("nan")])}, str(f))
    assert main(["tolerance", "sum", "--file", str(f)]) == 2
    assert "NaN" in capsys.readouterr().err
