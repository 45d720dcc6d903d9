"""The detection benchmark's CI subset: ``python -m bench.detection all --quick`` (5 clean rows
x 1 seed x 3 steps in fp32 and bf16: three on real megatron-core, one of them with virtual
pipeline chunks, two on the plain-PyTorch CP/FP8 harness, all under gloo; plus 6 bugs, 4 on
megatron-core and 2 on the harness).

One call for the whole module; it must report no tensor over threshold on the clean rows and
every bug at the phase and tensor it declares (the command's exit status says so)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("megatron.core")

from bench.detection import QUICK_BUGS, QUICK_ROWS, main


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> tuple[int, dict]:
    out = tmp_path_factory.mktemp("detection")
    status = main(["all", "--quick", "--out", str(out)])
    return status, json.loads((out / "detection.json").read_text())


def test_quick_passes(quick):
    status, summary = quick
    assert status == 0, (summary["clean"], summary["bugs"])


def test_quick_clean_rows_have_no_false_positive(quick):
    _, summary = quick
    assert [(r["layout"], r["dtype"]) for r in summary["clean"]] == list(QUICK_ROWS)
    for r in summary["clean"]:
        assert r["tensors"] > 300 and r["over"] == 0 and r["unmatched"] == 0, r["false_positives"][:5]


def test_quick_bugs_placed(quick):
    _, summary = quick
    assert sorted(r["bug"] for r in summary["bugs"]) == sorted(QUICK_BUGS)
    for r in summary["bugs"]:
        assert r["detected"] and r["placed"], r
