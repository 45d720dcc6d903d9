"""Smoke test of ``bench/gpu_validate.py`` (issue 33): its CPU run (``--device cpu --small``) goes
through every family's data, exact reference, bounds and table, skips the CUDA kernels with the
reason, keeps a failing kernel in its row, and counts violations of a wrong model."""
from __future__ import annotations

import json

import pytest
import torch

from bench import gpu_validate as gv


def test_cpu_smoke_run_writes_the_table_and_the_json(tmp_path, capsys):
    doc = tmp_path / "bounds.md"
    doc.write_text(f"# intro\n\n{gv.BEGIN}\nno GPU run yet\n{gv.END}\n\n# after\n")
    out = tmp_path / "raw.json"
    # --budget-s 0: every spec gets its first instance, none a second
    assert gv.main(["--device", "cpu", "--small", "--trials", "2", "--budget-s", "0", "--json", str(out),
                    "--write", str(doc)]) == 0
    printed = capsys.readouterr().out
    assert "gemm cuBLAS: skipped: a CUDA kernel" in printed and "[instance 1/2" in printed
    assert "[instance 2/2" not in printed and "5 of 5 specs got fewer than 2 instances" in printed
    raw = json.loads(out.read_text())
    ran = [r for r in raw["rows"] if r["error"] is None]
    assert {r["family"] for r in ran} == {"gemm", "fp8", "sdpa"}
    assert {r["kernel"] for r in ran} == {"emulated", "flash", "math"}  # the CPU's own SDPA kernels run too
    assert all(r["instances"] == 1 and r["violations"]["deterministic"] == 0 for r in ran)
    skipped = {(r["family"], r["kernel"]) for r in raw["rows"] if r["error"]}
    assert skipped == {("gemm", "cuBLAS"), ("fp8", "_scaled_mm"), ("sdpa", "efficient"), ("sdpa", "cudnn")}
    text = doc.read_text()
    assert text.startswith("# intro\n\n" + gv.BEGIN) and text.endswith(gv.END + "\n\n# after\n")
    assert "no GPU run yet" not in text and "| sdpa | flash |" in text and "Skipped (CUDA kernels" in text


def test_a_failing_kernel_is_reported_in_its_row_and_a_wrong_model_is_caught():
    spec = gv._gemm_spec("bf16", 4, 64, 4, (1, 2))

    def broken(inst, device):
        raise RuntimeError("no kernel image is available for execution on the device\nmore")
    spec.impls = [gv.Impl("broken", "", broken, False), gv.Impl("emulated", "fp32 chain", spec.impls[-1].run, False)]
    # a model without the bf16 output rounding: the emulated bf16 results must violate it
    spec.models = {"default": {}, "no output rounding": {"out_fmt": "fp32"}}
    run = gv.SpecRun(spec, "cpu", seed=0)
    run.step()
    run.step()
    rows = {(r.impl.kernel, r.model): r for r in run.rows.values()}
    assert rows["broken", "default"].error == "kernel failed: RuntimeError: no kernel image is available for " \
                                              "execution on the device"
    assert rows["emulated", "default"].tally.instances == 2
    assert rows["emulated", "default"].tally.violations["deterministic"] == 0
    assert rows["emulated", "no output rounding"].tally.violations["deterministic"] > 0
    assert "kernel failed" in gv.markdown(list(run.rows.values()), "header")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_bad_invocations_exit_2_with_a_message(capsys):
    assert gv.main(["--device", "cuda"]) == 2
    assert "--device cpu --small" in capsys.readouterr().err
    assert gv.main(["--device", "cpu", "--only", "gemm,conv"]) == 2
    assert "--only takes fp8, gemm, sdpa" in capsys.readouterr().err


def test_the_split_k_probe_runs_every_setting_and_restores_it(monkeypatch):
    """The cuBLAS settings are set inside and restored after; the probe (CUDA profiler replaced by
    a stub here) reports, per setting, its kernels and whether its output differs."""
    m = torch.backends.cuda.matmul
    before = (m.allow_bf16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction_split_k)
    with gv._matmul_reduction(torch.bfloat16, (False, False)):
        assert (m.allow_bf16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction_split_k) == (
            False, False)
    assert (m.allow_bf16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction_split_k) == before
    monkeypatch.setattr(gv, "_kernel_names", lambda fn: (fn(), ["gemm_kernel"])[1])
    spec = gv._gemm_spec("bf16", 4, 64, 4, (1,))
    run = gv.SpecRun(spec, "cpu", seed=0)
    run._probe(spec.make(run.g))
    notes = {r.impl.setting: r.notes for r in run.rows.values() if r.impl.kernel == "cuBLAS"}
    assert set(notes) == set(gv.GEMM_SETTINGS)
    assert notes["reduced, splitK"][:2] == ["same bits as fp32-reduce, no splitK", "kernels: gemm_kernel"]
    assert notes["fp32-reduce, no splitK"][:1] == ["kernels: gemm_kernel"]
