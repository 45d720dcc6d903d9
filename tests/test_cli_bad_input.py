"""Bad command-line input (issue 31): every case exits 2 with a one-line message naming the option
or path, never a traceback; an unexpected exception exits 3; ``ttrace compare`` writes its report
beside the candidate, never through a symbolic link or over a file it did not write; the demo
deletes only a directory it created. In-process through ``main(argv)``, one case in a subprocess
for the real exit status."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tracer.cli import main
from tracer.trace.store import TraceWriter

ROOT = Path(__file__).resolve().parents[1]


def _write(root: Path, *, world: int = 1, offset: float = 0.0, seed: int = 0, sig: str = "tiny") -> None:
    """A two-step trace of one forward tensor, ``offset`` times seeded noise away from the reference's."""
    for rank in range(world):
        w = TraceWriter(root, rank, world, {"tp": world}, sig, run_id=f"{root.name}-{seed}")  # one run id a trace
        for step in (0, 1):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 + step))
            x = x + offset * torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))
            w.add("m.output", x, phase="fwd", step=step)
            w.flush_step(step)
        w.close()


@pytest.fixture(scope="module")
def t(tmp_path_factory) -> Path:
    """Traces and files the cases refer to as ``{t}/...``."""
    t = tmp_path_factory.mktemp("cli")
    _write(t / "ref")
    for i in range(2):
        _write(t / "ref" / "noise" / f"sample_{i}", offset=1e-6, seed=i + 1)
    _write(t / "cand", offset=1e-7, seed=9)
    _write(t / "bug", offset=0.1, seed=9)
    _write(t / "multi", world=2)  # a two-rank trace
    _write(t / "nonoise")  # a single-device trace without noise samples
    _write(t / "other", sig="another model")
    (t / "corrupt").mkdir()
    (t / "corrupt" / "run.json").write_text("{")
    (t / "empty").mkdir()
    (t / "afile").write_text("not a directory")
    (t / "adir.json").mkdir()
    (t / "foreign.json").write_text('{"mine": true}')
    (t / "victim.txt").write_text("precious")
    (t / "link.json").symlink_to(t / "victim.txt")
    (t / "ref_link").symlink_to(t / "ref")
    save_file({"x": torch.randn(4, 4)}, str(t / "x.safetensors"))
    (t / "text.safetensors").write_text("hello")
    (t / "list.json").write_text("[1, 2]")
    return t


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _assert_clean_failure(code: int, err: str, out: str, want_code: int, fragment: str) -> None:
    assert code == want_code, err
    assert "Traceback" not in err + out
    last = err.strip().splitlines()[-1]  # the message is one line (after argparse's usage line)
    assert fragment in last, err


NUMERICS = [
    # ttrace formats
    ("custom-int", ["formats", "--custom", "custom(e=x, m=2)"], "e must be an integer, got 'x'"),
    ("custom-needs-m", ["formats", "--custom", "custom(e=3)"], "custom format needs e and m"),
    ("custom-field", ["formats", "--custom", "custom(e=3, m=2, q=1)"], "unknown custom-format field 'q'"),
    ("custom-range", ["formats", "--custom", "custom(e=20, m=3)"], "its range exceeds float64's"),
    ("custom-nan", ["formats", "--custom", "custom(e=3, m=2, nan=foo)"], "nan_encoding must be one of"),
    ("custom-positional", ["formats", "--custom", "custom(3, 2, 3, 4)"], "at most 3 positional fields"),
    ("custom-twice", ["formats", "--custom", "custom(3, 2, e=4)"], "given both by position and by name"),
    ("custom-unclosed", ["formats", "--custom", "custom(e=3, m=2"], "unknown format 'custom(e=3, m=2'"),
    ("formats-calibration-missing", ["formats", "--calibration", "{t}/nope.json"], "argument --calibration: file"),
    ("formats-calibration-not-one", ["formats", "--calibration", "{t}/list.json"], "not a calibration file"),
    # ttrace tolerance
    ("op-unknown", ["tolerance", "nosuchop", "--shape", "4x4"], "unknown op 'nosuchop'"),
    ("shape-xx", ["tolerance", "sum", "--shape", "64xx"], "argument --shape: bad shape '64xx'"),
    ("shape-zero", ["tolerance", "sum", "--shape", "0x4"], "argument --shape: bad shape '0x4'"),
    ("shape-negative", ["tolerance", "sum", "--shape", "4x-1"], "argument --shape: bad shape '4x-1'"),
    ("shape-missing", ["tolerance", "sum"], "give --file F.safetensors [--inputs a,b] or one --shape"),
    ("shape-mismatch", ["tolerance", "matmul", "--shape", "8x64", "--shape", "65x4"], "cannot be multiplied"),
    ("dtype-unknown", ["tolerance", "sum", "--shape", "4x4", "--dtype", "fp12"], "argument --dtype: unknown format"),
    ("dtype-no-torch", ["tolerance", "sum", "--shape", "4x4", "--dtype", "custom(e=3, m=2)"], "has no torch dtype"),
    ("fmt-unknown", ["tolerance", "sum", "--shape", "4x4", "--fmt", "fp7"], "argument --fmt: unknown format 'fp7'"),
    ("compute-fmt-bad", ["tolerance", "sum", "--shape", "4x4", "--compute-fmt", "custom(m=2)"],
     "argument --compute-fmt: custom format needs e and m"),
    ("kw-no-equals", ["tolerance", "sum", "--shape", "4x4", "--kw", "dim"], "argument --kw: expected KEY=VALUE"),
    ("kw-no-key", ["tolerance", "sum", "--shape", "4x4", "--kw", "=3"], "argument --kw: expected KEY=VALUE"),
    ("kw-unknown", ["tolerance", "sum", "--shape", "4x4", "--kw", "foo=1"], "unexpected keyword argument 'foo'"),
    ("failure-probability-nan", ["tolerance", "sum", "--shape", "4x4", "--mode", "probabilistic",
                                 "--failure-probability", "nan"], "argument --failure-probability: expected a probability"),
    ("failure-probability-range", ["tolerance", "sum", "--shape", "4x4", "--failure-probability", "1.5"],
     "strictly between 0 and 1, got '1.5'"),
    ("failure-probability-word", ["tolerance", "sum", "--shape", "4x4", "--failure-probability", "tiny"],
     "expected a number, got 'tiny'"),
    ("seed-negative", ["tolerance", "sum", "--shape", "4x4", "--seed", "-1"], "argument --seed: expected an integer >= 0"),
    ("seed-float", ["tolerance", "sum", "--shape", "4x4", "--seed", "1.5"], "expected an integer, got '1.5'"),
    ("dist-unknown", ["tolerance", "sum", "--shape", "4x4", "--dist", "cauchy"], "argument --dist: invalid choice"),
    ("file-missing", ["tolerance", "sum", "--file", "{t}/nope.safetensors"], "argument --file: file"),
    ("file-not-safetensors", ["tolerance", "sum", "--file", "{t}/text.safetensors"], "cannot read"),
    ("file-a-directory", ["tolerance", "sum", "--file", "{t}/empty"], "is not a file"),
    ("inputs-not-in-file", ["tolerance", "sum", "--file", "{t}/x.safetensors", "--inputs", "y"],
     "no tensor named y; the file holds x"),
    ("inputs-empty", ["tolerance", "sum", "--file", "{t}/x.safetensors", "--inputs", ","],
     "argument --inputs: expected comma-separated tensor names"),
    ("inputs-without-file", ["tolerance", "sum", "--shape", "4x4", "--inputs", "x"], "give --file F.safetensors too"),
    ("file-and-shape", ["tolerance", "sum", "--file", "{t}/x.safetensors", "--shape", "4x4"], "not both"),
    ("save-no-dir", ["tolerance", "sum", "--shape", "4x4", "--save", "{t}/nodir/b.safetensors"], "does not exist"),
    ("save-a-directory", ["tolerance", "sum", "--shape", "4x4", "--save", "{t}/empty"], "is a directory"),
    ("tolerance-calibration-missing", ["tolerance", "sum", "--shape", "4x4", "--calibration", "{t}/nope.json"],
     "argument --calibration: file"),
    # ttrace calibrate
    ("format-unknown", ["calibrate", "--format", "e9m9"], "argument --format: unknown format 'e9m9'"),
    ("ops-unknown", ["calibrate", "--format", "e4m3", "--ops", "gelu,nosuch"], "unknown calibratable op 'nosuch'"),
    ("ops-empty", ["calibrate", "--format", "e4m3", "--ops", ","], "expected a comma-separated list"),
    ("recipe-unknown", ["calibrate", "--format", "e4m3", "--recipe", "3x"], "unknown scaling recipe"),
    ("out-fmt-unknown", ["calibrate", "--format", "e4m3", "--out-fmt", "bf17"], "argument --out-fmt: unknown format"),
    ("p-zero", ["calibrate", "--format", "e4m3", "--p", "0"], "argument --p: expected a probability"),
    ("confidence-one", ["calibrate", "--format", "e4m3", "--confidence", "1"], "argument --confidence: expected a"),
    ("samples-one", ["calibrate", "--format", "e4m3", "--samples", "1"], "argument --samples: expected an integer >= 2"),
    ("samples-too-few", ["calibrate", "--format", "e4m3", "--ops", "gelu", "--samples", "10"], "too few"),
    ("calibrate-dist-unknown", ["calibrate", "--format", "e4m3", "--dist", "normal,cauchy"],
     "unknown distribution 'cauchy'"),
    ("op-shape-no-equals", ["calibrate", "--format", "e4m3", "--shape", "softmax"], "bad --shape 'softmax'"),
    ("op-shape-unknown-op", ["calibrate", "--format", "e4m3", "--shape", "nosuchop=4"], "cannot calibrate nosuchop"),
    ("op-shape-bad", ["calibrate", "--format", "e4m3", "--shape", "softmax=4xx"], "bad shape '4xx'"),
    ("calibrate-out-no-dir", ["calibrate", "--format", "e4m3", "--out", "{t}/nodir/c.json"], "does not exist"),
    ("plots-a-file", ["calibrate", "--format", "e4m3", "--plots", "{t}/afile/plots"], "is not a directory"),
    ("calibrate-inputs-without-file", ["calibrate", "--format", "e4m3", "--inputs", "x"], "give --file"),
    # ttrace itself
    ("no-command", [], "the following arguments are required: command"),
    ("unknown-command", ["frobnicate"], "invalid choice: 'frobnicate'"),
]

REF, CAND = "{t}/ref", "{t}/cand"
COMPARE = [
    ("false-alarm-nan", ["compare", REF, CAND, "--false-alarm", "nan"], "argument --false-alarm: expected a probability"),
    ("false-alarm-zero", ["compare", REF, CAND, "--false-alarm", "0"], "strictly between 0 and 1, got '0'"),
    ("false-alarm-one", ["compare", REF, CAND, "--false-alarm", "1"], "strictly between 0 and 1, got '1'"),
    ("step-negative", ["compare", REF, CAND, "--step", "-1"], "argument --step: expected an integer >= 0"),
    ("step-word", ["compare", REF, CAND, "--step", "two"], "argument --step: expected an integer, got 'two'"),
    ("step-absent", ["compare", REF, CAND, "--step", "9"],
     "step(s) [9] requested but not traced by both: reference '{t}/ref' has steps [0, 1]"),
    ("top-negative", ["compare", REF, CAND, "--top", "-1"], "argument --top: expected an integer >= 0"),
    # a path without run.json: the TraceReader's error, naming the file
    ("reference-missing", ["compare", "{t}/nope", CAND], "no run.json: not a trace directory, or rank 0 never "
                                                        "started tracing [file {t}/nope/run.json]"),
    ("candidate-a-file", ["compare", REF, "{t}/afile"], "no run.json: not a trace directory"),
    ("candidate-not-a-trace", ["compare", REF, "{t}/empty"], "not a trace directory, or rank 0 never started "
                                                            "tracing [file {t}/empty/run.json]"),
    ("reference-corrupt", ["compare", "{t}/corrupt", CAND], "not valid JSON"),
    # the refusals of tracer.compare.check.compare (docs/tracing.md, "What a comparison refuses")
    ("same-directory", ["compare", REF, REF], "reference '{t}/ref' and candidate '{t}/ref' are the same directory"),
    ("same-directory-via-link", ["compare", REF, "{t}/ref_link"], "are the same directory: comparing a run with "
                                                                  "itself says nothing"),
    ("swapped-multi-rank", ["compare", "{t}/multi", REF], "was traced on 2 ranks and has no noise samples: a reference "
                                                          "is either the single-device run with noise samples, or a "
                                                          "distributed reference"),
    ("swapped-noise", ["compare", CAND, REF], "(the candidate has noise samples: reference and candidate swapped?)"),
    ("no-noise-samples", ["compare", "{t}/nonoise", CAND], "reference '{t}/nonoise' has no noise samples"),
    ("noise-is-reference", ["compare", REF, CAND, "--noise", REF],
     "noise sample '{t}/ref' is the reference ('{t}/ref'), not a noise sample"),
    ("noise-is-candidate", ["compare", REF, CAND, "--noise", CAND],
     "noise sample '{t}/cand' is the candidate ('{t}/cand'), not a noise sample"),
    ("noise-parent-dir", ["compare", REF, CAND, "--noise", "{t}/ref/noise"],
     "no run.json: not a trace directory, or rank 0 never started tracing [file {t}/ref/noise/run.json]"),
    ("noise-missing", ["compare", REF, CAND, "--noise", "{t}/nope"], "[file {t}/nope/run.json]"),
    # the one check of the command line's own: compare would use the sample twice
    ("noise-twice", ["compare", REF, CAND, "--noise", "{t}/ref/noise/sample_0", "--noise", "{t}/ref/noise/sample_0"],
     "is given twice"),
    ("noise-twice-spelled-differently", ["compare", REF, CAND, "--noise", "{t}/ref/noise/sample_0",
                                         "--noise", "{t}/ref/noise/../noise/sample_0"], "is given twice"),
    ("noise-multi-rank", ["compare", REF, CAND, "--noise", "{t}/multi"],
     "was traced on 2 ranks; a noise sample is a single-device run of the reference"),
    ("skip-everything", ["compare", REF, CAND, "--skip", "m.*"], "once skip=['m.*'] left out 4 records"),
    ("other-model", ["compare", REF, "{t}/other"], "model signature"),
    ("report-symlink", ["compare", REF, CAND, "--report", "{t}/link", "--no-plot"], "is a symbolic link"),
    ("report-foreign", ["compare", REF, CAND, "--report", "{t}/foreign", "--no-plot"], "did not write is in the way"),
    ("report-a-directory", ["compare", REF, CAND, "--report", "{t}/adir", "--no-plot"], "not a regular file"),
    ("report-under-a-file", ["compare", REF, CAND, "--report", "{t}/afile/r"], "afile is not a directory"),
]


@pytest.mark.parametrize("argv, fragment", [c[1:] for c in NUMERICS + COMPARE], ids=[c[0] for c in NUMERICS + COMPARE])
def test_bad_input_exits_2_with_a_message(t, capsys, argv, fragment):
    code, out, err = _run([a.format(t=t) for a in argv], capsys)
    _assert_clean_failure(code, err, out, 2, fragment.format(t=t))


def test_refused_reports_leave_files_untouched(t, capsys):
    for report in ("link", "foreign"):
        assert main(["compare", str(t / "ref"), str(t / "cand"), "--report", str(t / report), "--no-plot"]) == 2
    assert (t / "victim.txt").read_text() == "precious" and (t / "link.json").is_symlink()
    assert (t / "foreign.json").read_text() == '{"mine": true}'


def test_report_goes_beside_the_candidate_and_is_rewritten(t, capsys):
    inside = sorted(p.relative_to(t / "cand") for p in (t / "cand").rglob("*"))
    (t / "cand" / "ttrace_report.json").symlink_to(t / "victim.txt")  # the old default path, now never written
    assert main(["compare", str(t / "ref"), str(t / "cand")]) == 0
    assert f"report: {t / 'cand.ttrace_report.json'}" in capsys.readouterr().out
    report = json.loads((t / "cand.ttrace_report.json").read_text())
    assert report["generator"] == "ttrace compare" and report["verdict"] == "consistent"
    png = (t / "cand.ttrace_report.png").read_bytes()
    assert png.startswith(b"\x89PNG") and b"tEXtSoftware\x00ttrace compare" in png
    assert main(["compare", str(t / "ref"), str(t / "cand")]) == 0  # its own report: overwritten
    (t / "cand" / "ttrace_report.json").unlink()
    assert sorted(p.relative_to(t / "cand") for p in (t / "cand").rglob("*")) == inside
    assert (t / "victim.txt").read_text() == "precious"


def test_divergent_exits_1_and_report_prefix_may_carry_json_suffix(t, tmp_path, capsys):
    assert main(["compare", str(t / "ref"), str(t / "bug"), "--report", str(tmp_path / "sub" / "r.json"),
                 "--no-plot"]) == 1
    assert "verdict: DIVERGENT" in capsys.readouterr().out
    assert json.loads((tmp_path / "sub" / "r.json").read_text())["verdict"] == "DIVERGENT"
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["r.json"]  # no temporary file left


def test_an_unexpected_exception_exits_3_without_traceback(t, capsys, monkeypatch):
    import tracer.compare.check as check

    def boom(*a, **k):
        raise RuntimeError("boom")
    monkeypatch.setattr(check, "compare", boom)
    argv = ["compare", str(t / "ref"), str(t / "cand"), "--report", str(t / "x"), "--no-plot"]
    code, out, err = _run(argv, capsys)
    assert code == 3 and "internal error, please report" in err and "RuntimeError: boom" in err
    assert "Traceback" not in err and "TTRACE_DEBUG=1" in err
    monkeypatch.setenv("TTRACE_DEBUG", "1")
    code, out, err = _run(argv, capsys)
    assert code == 3 and "Traceback" in err


def test_real_exit_status_of_bad_input(t):
    p = subprocess.run([sys.executable, "-m", "tracer.cli", "compare", str(t / "ref"), str(t / "ref")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "are the same directory" in p.stderr
    assert "Traceback" not in p.stderr


# ---------------------------------------------------------------------- the demo's --out
@pytest.fixture(scope="module")
def demo():
    pytest.importorskip("megatron.core")
    from examples.megatron_cpu import demo
    return demo


def _demo_case(tmp_path: Path, kind: str) -> Path:
    out = tmp_path / "out"
    if kind == "foreign":
        out.mkdir()
        (out / "thesis.tex").write_text("precious")
    elif kind == "symlink":
        (tmp_path / "real").mkdir()
        out.symlink_to(tmp_path / "real")
    elif kind == "file":
        out.write_text("precious")
    return out


@pytest.mark.parametrize("kind, fragment", [
    ("foreign", "exists and was not created by the demo (no .ttrace-demo in it)"),
    ("symlink", "is a symbolic link"),
    ("file", "exists and is not a directory"),
])
def test_demo_refuses_an_out_it_did_not_create(demo, tmp_path, capsys, kind, fragment):
    out = _demo_case(tmp_path, kind)
    before = sorted(tmp_path.rglob("*"))
    code, err = demo.main(["--out", str(out)]), capsys.readouterr().err
    _assert_clean_failure(code, err, "", 2, fragment)
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize("argv, fragment", [
    (["--steps", "0"], "argument --steps: expected an integer >= 1"),
    (["--noise-samples", "x"], "argument --noise-samples: expected an integer"),
    (["--bug", "nosuchbug"], "argument --bug: invalid choice"),
])
def test_demo_bad_options(demo, capsys, argv, fragment):
    code, err = demo.main(argv), capsys.readouterr().err
    _assert_clean_failure(code, err, "", 2, fragment)


def test_demo_out_created_empty_or_its_own(demo, tmp_path):
    out = tmp_path / "a" / "out"
    demo.prepare_out(out)  # absent: created and marked
    assert sorted(p.name for p in out.iterdir()) == [demo.MARKER]
    (out / "ref").mkdir()
    (out / "ref" / "run.json").write_text("{}")
    demo.prepare_out(out)  # its own: emptied
    assert sorted(p.name for p in out.iterdir()) == [demo.MARKER]
    empty = tmp_path / "empty"
    empty.mkdir()
    demo.prepare_out(empty)  # empty: used
    assert (empty / demo.MARKER).is_file()
