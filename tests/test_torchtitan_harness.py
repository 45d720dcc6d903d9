"""The torchtitan-style harness's bug registry (no process group): every registered bug is
well-formed (doc, catalogue entry, a layout the benchmark runs, a declared first divergence that
names a tensor the tracer records) and its patch replaces harness attributes and restores them.

The launches are the detection benchmark's: ``tests/test_detection_quick.py`` runs ``--quick``'s
FSDP2 x TP row and its bug (``sp_rope_rank_offset``) against a reference with noise samples, and
``bench.detection`` the full ``titan:`` matrix."""
from __future__ import annotations

import fnmatch
import re
from types import SimpleNamespace

import pytest

from examples.torchtitan_cpu import model as titan_model
from examples.torchtitan_cpu import parallelize, train
from examples.torchtitan_cpu.bugs import BUGS
from examples.torchtitan_cpu.model import ModelArgs, Transformer
from examples.torchtitan_cpu.parallelize import Layout
from tracer.trace.schema import Phase

STEPS = 3   # bench.detection's steps per run


def _recorded_names(tied: bool) -> dict[str, set[str]]:
    """Canonical names the DTensor tracer records for the harness's model, by phase."""
    m = Transformer(ModelArgs(tied_embeddings=tied))
    mods = [n for n, _ in m.named_modules()]
    acts = {f"{n}.{k}" if n else k for n in mods for k in ("input", "output")}
    acts |= {f"{a}.{i}" for a in acts for i in range(3)}
    grads = {f"{n}.output_grad" if n else "output_grad" for n in mods}
    params = {n for n, _ in m.named_parameters()}
    return {"fwd": acts, "bwd": grads, "grad_local": params, "grad": params, "param": params,
            "grad_norm": {"grad_norm"}, "loss": {"loss"}}


def test_at_least_eight_bugs_including_b24_and_b26():
    assert len(BUGS) >= 8
    cats = {c for b in BUGS.values() for c in b.catalogue.split("/")}
    assert {"B24", "B26"} <= cats


@pytest.mark.parametrize("name", sorted(BUGS))
def test_bug_is_well_formed(name):
    b = BUGS[name]
    assert b.name == name and re.fullmatch(r"[a-z0-9_]+", name)
    assert len(b.doc) >= 80 and b.doc == b.doc.strip(), "a doc says what goes wrong, and where"
    assert re.fullmatch(r"B\d\d(/B\d\d)*", b.catalogue), b.catalogue
    assert b.bug_class
    assert set(b.needs) == {"layout"}, "a torchtitan-style bug names its layout"
    lay = Layout.parse(b.needs["layout"])
    assert lay.name == b.needs["layout"] and 1 < lay.world <= 4
    assert b.expected_phase in {p.value for p in Phase}
    assert b.expected_step is None or 0 <= b.expected_step < STEPS
    names = _recorded_names(lay.tied)[b.expected_phase]
    assert any(fnmatch.fnmatchcase(n, b.expected_name) for n in names), \
        f"{b.expected_phase} {b.expected_name} names no tensor the tracer records"


@pytest.mark.parametrize("name", sorted(BUGS))
def test_patch_replaces_harness_attributes_and_undo_restores_them(name):
    b = BUGS[name]
    lay = Layout.parse(b.needs["layout"])
    fake = SimpleNamespace(layout=lay, dtype="bf16", tp_rank=1, dp_rank=0, args=ModelArgs(tied_embeddings=lay.tied))
    mods = (train, train.Run, parallelize, titan_model)
    before = [dict(vars(m)) for m in mods]
    undo = BUGS.inject(name, fake)
    try:
        changed = [k for m, d in zip(mods, before) for k in d if vars(m)[k] is not d[k]]
        assert len(changed) == 1, f"a bug replaces one harness function, {name} replaced {changed}"
    finally:
        undo()
    assert all(all(vars(m)[k] is d[k] for k in d) for m, d in zip(mods, before))


def test_benchmark_places_every_bug_on_its_clean_layout():
    pytest.importorskip("megatron.core")   # bench.detection imports the megatron-core harness
    from bench.detection import LAYOUTS, TITAN, pick_layout
    for b in BUGS.values():
        assert TITAN + b.needs["layout"] in LAYOUTS, "the bug's layout is one of the benchmark's clean layouts"
        assert pick_layout(b, list(LAYOUTS)) == TITAN + b.needs["layout"]


def test_quick_subset_has_a_titan_row_and_bug():
    pytest.importorskip("megatron.core")
    from bench.detection import QUICK_BUGS, QUICK_ROWS, TITAN
    assert ("titan:r1.s2.t2+sp", "bf16") in QUICK_ROWS
    quick = [n for n in QUICK_BUGS if n in BUGS]
    assert quick and all(TITAN + BUGS[n].needs["layout"] in {r for r, _ in QUICK_ROWS} for n in quick)
