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


def test_tolerance_statistical_mode_matches_the_api(capsys):
    """``--mode statistical`` is offered and is the API's bound at the same false-alarm rate."""
    import ttrace_num as tn
    from ttrace_num.cli import generate
    argv = ["tolerance", "matmul", "--shape", "8x256", "--shape", "256x4", "--mode", "statistical",
            "--failure-probability", "1e-4", "--json"]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["mode"] == "statistical"
    a, b = generate("matmul", [(8, 256), (256, 4)], "normal", torch.float32, 0)
    assert d["max_abs"] == pytest.approx(tn.tolerance("matmul", a, b, mode="statistical", false_alarm=1e-4).max(), rel=1e-12)


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


# ------------------------------------------------ ttrace compare: --skip, --accept-unmodelled, unverified
UNMODELLED = {"torch.foo": 3}


def _trace(root, *, prefix="", offset=0.0, seed=0, census=False, extra=(), bug=1.0):
    """Two steps of two forward records (``prefix`` before their names, ``extra`` names added),
    ``offset`` times seeded noise away from the reference's, step 0's ``b.output`` times ``bug``. ``census``: a noise sample's op census
    in run.json (``torch.foo`` unmodelled, 3 calls a trajectory, all before step 1's records)."""
    from tracer.trace.store import TraceWriter
    meta = {"ops": {"unmodelled": UNMODELLED, "perturbed": {"torch.matmul": 4}, "exact": {}, "optimizer": {},
                    "accepted": {"torch.bar": 2}},
            "accepted_ops": {"torch.bar": "a copy: exact"}} if census else None
    w = TraceWriter(root, 0, 1, {}, "tiny", run_id=f"{root.name}-{seed}", run_meta=meta)
    for step in (0, 1):
        for i, name in enumerate(("a.output", "b.output", *extra)):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 + 10 * step + i))
            x = x + offset * torch.randn(8, 16, generator=torch.Generator().manual_seed(seed + i))
            x = x * bug if (step, name) == (0, "b.output") else x
            w.add(prefix + name, x, phase="fwd", step=step,
                  meta={"unmodelled_before": 3 * step} if census else None)
        w.flush_step(step)
    w.close()


@pytest.fixture(scope="module")
def ct(tmp_path_factory):
    t = tmp_path_factory.mktemp("cov")
    for ref, census in (("ref", False), ("ref_unmodelled", True)):
        _trace(t / ref)
        for i in range(2):
            _trace(t / ref / "noise" / f"sample_{i}", offset=1e-6, seed=i + 1, census=census)
    _trace(t / "cand", prefix="module.", offset=1e-7, seed=9)  # DDP's prefix
    _trace(t / "cand_dropout", offset=1e-7, seed=9, extra=("drop.dropout",))
    return t


def _compare(argv, capsys):
    from tracer.cli import main as ttrace
    code = ttrace(["compare", *map(str, argv), "--no-plot"])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def test_compare_strips_wrapper_prefixes_and_says_so(ct, tmp_path, capsys):
    from tracer.compare.check import compare
    from tracer.report.summary import summary
    code, out, _ = _compare([ct / "ref", ct / "cand", "--report", tmp_path / "r"], capsys)
    assert code == 0 and "verdict: consistent" in out
    assert "names matched after stripping 'module.' from the candidate" in out
    assert "op coverage: not recorded by the noise samples" in out  # samples without a census
    assert json.loads((tmp_path / "r.json").read_text())["stripped_prefixes"] == {"candidate": ["module."]}
    assert "stripping" not in summary(compare(ct / "ref", ct / "ref" / "noise" / "sample_0",
                                              noise=[ct / "ref" / "noise" / "sample_1"]))


def test_compare_skip(ct, tmp_path, capsys):
    code, _, err = _compare([ct / "ref", ct / "cand_dropout", "--report", tmp_path / "r"], capsys)
    assert code == 2 and "only in the candidate ('fwd drop.dropout mb 0')" in err.strip().splitlines()[-1]
    code, out, _ = _compare([ct / "ref", ct / "cand_dropout", "--report", tmp_path / "r", "--skip", "fwd *.dropout",
                             "--skip", "nothing.matches"], capsys)
    assert code == 0 and "verdict: consistent   (4 tensors compared: 4 ok)" in out
    assert "2 records left out by --skip/skip= (either side): step 0 fwd drop.dropout mb 0 (candidate); " \
           "step 1 fwd drop.dropout mb 0 (candidate)" in out
    assert len(json.loads((tmp_path / "r.json").read_text())["skipped"]) == 2


def test_unverified_exits_2_and_names_the_ops(ct, tmp_path, capsys):
    code, out, err = _compare([ct / "ref_unmodelled", ct / "cand", "--report", tmp_path / "r"], capsys)
    assert code == 2
    assert "verdict: unverified   (4 tensors compared: 2 ok, 2 unmodelled)" in out
    assert "op coverage: unmodelled ops torch.foo x3: 2 tensor(s) after them not verified (status unmodelled)" in out
    assert "accepted unperturbed by the integration:\n    torch.bar: a copy: exact" in out
    assert "no tensor over its threshold, but 2 tensor(s) come after ops without an error model" in out
    assert "not judged: 2 unmodelled; first: step 1 fwd a.output" in out
    last = err.strip().splitlines()[-1]
    assert last.startswith("ttrace compare: unverified: 2 compared tensor(s) come after ops without an error "
                           "model (torch.foo x3 calls in a noise sample)") and "--accept-unmodelled" in last
    report = json.loads((tmp_path / "r.json").read_text())  # the report is written all the same
    assert report["verdict"] == "unverified" and report["coverage"]["unmodelled"] == UNMODELLED


def test_accept_unmodelled(ct, tmp_path, capsys):
    code, out, err = _compare([ct / "ref_unmodelled", ct / "cand", "--report", tmp_path / "r",
                               "--accept-unmodelled"], capsys)
    assert code == 0 and err == ""
    assert "verdict: consistent   (4 tensors compared: 4 ok)" in out
    assert "op coverage: unmodelled ops torch.foo x3: accepted by the user (accept_unmodelled=True)" in out
    assert "not judged" not in out


def test_divergent_listing_counts_only_divergences(ct, tmp_path, capsys):
    _trace(tmp_path / "bug", offset=1e-7, seed=9, bug=1.01)
    code, out, err = _compare([ct / "ref_unmodelled", tmp_path / "bug", "--report", tmp_path / "r"], capsys)
    assert code == 1 and err == "" and "verdict: DIVERGENT   (4 tensors compared: 1 ok, 1 over, 2 unmodelled)" in out
    assert "first divergence: step 0, phase fwd, tensor b.output" in out
    assert "  1 tensors over threshold; largest:" in out
    assert "not judged: 2 unmodelled; first: step 1 fwd a.output (mb 0): unmodelled" in out
