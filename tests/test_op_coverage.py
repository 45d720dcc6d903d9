"""Op coverage (issue 33, in the spirit of PyTorch's OpInfo): every registered op is fully
supported, or exempt from a component with the reason.

For every op of ``ttrace_num.ops()`` (the registry of ``ttrace_num/bounds/common.py``) six
components, each discovered from the code's own registry:

``reference``
    an exact reference: ``ttrace_num.reference.REFERENCES[op]`` resolves to a function;
``emulation``
    an emulation of its computation model: ``ttrace_num.emulate.EMULATIONS[op]`` resolves;
``noise``
    a noise model in the tracer: the injector (``ttrace_num.propagate.noise.NoiseInjector``)
    evaluates the op's error model when it perturbs :func:`_program`, a small training step that
    calls every torch function ``ttrace_num.propagate.calls.classify`` recognises, forward and
    backward (every registered model is wrapped to record that it ran;
    ``bounds.attention.attention_backward`` computes the three registered attention gradients
    at once and records them);
``calibration``
    a calibration spec: ``ttrace_num.calibrate.ops.SPECS[op]``;
``cli``
    ``ttrace tolerance OP --file F --inputs ... --json`` runs in-process (``ttrace_num.cli.main``)
    with exit status 0 on the inputs of the op's first benchmark case, with the keywords the
    command line can express (literals; formats by name); tensor and object keywords are
    dropped (``--kw`` takes literals);
``bench``
    a benchmark case: a ``Case`` of ``bench/cases/*`` (``bench.bounds_table.load_cases``) whose
    op is the op or one of its aliases.

``EXEMPT`` lists what is legitimately missing, or a known gap, with the reason. A registered op
neither covered nor exempt fails with what to add and where; so does an exemption that is stale
(the op is covered now, or no longer registered).
"""
from __future__ import annotations

import contextlib
import functools
import io
import pkgutil

import pytest
import torch
import torch.nn.functional as F

import ttrace_num as tn
from bench.bounds_table import load_cases
from ttrace_num.bounds import common
from ttrace_num.calibrate.ops import SPECS
from ttrace_num.cli import main as cli_main
from ttrace_num.emulate import EMULATIONS
from ttrace_num.formats import FloatFormat
from ttrace_num.propagate.noise import NoiseInjector
from ttrace_num.reference import REFERENCES

COMPONENTS = ("reference", "emulation", "noise", "calibration", "cli", "bench")

#: what to add, and where, for each component
WHERE = {
    "reference": "add its exact reference (float64 from the op's inputs) to ttrace_num/reference/ and name it in "
                 "ttrace_num.reference.REFERENCES",
    "emulation": "add an emulation of its computation model to ttrace_num/emulate/ and name it in "
                 "ttrace_num.emulate.EMULATIONS",
    "noise": "make the tracer perturb the torch call by this model: a branch of ttrace_num/propagate/calls.py "
             "classify (forward op) or of NoiseInjector._grad_noise_fns in ttrace_num/propagate/noise.py (a "
             "gradient), and a call of that torch function in _program of tests/test_op_coverage.py",
    "calibration": "add an OpSpec to ttrace_num/calibrate/ops.py SPECS",
    "cli": "make `ttrace tolerance OP --file F --inputs ... --kw K=V` run on the op's first bench case "
           "(ttrace_num/cli.py cmd_tolerance)",
    "bench": "add a Case for it to the CASES of a module of bench/cases/",
}

_ONE_ROUNDING = ("the tracer perturbs this gradient by one rounding of the gradient (NoiseInjector._grad_rounding, "
                 "noise.py module doc: how CPU kernels compute it, in fp32 then stored once), not by this model: gap")
_GEMM = ("the tracer perturbs this gradient GEMM by the matmul bound of the same product (NoiseInjector._gemm_bound: "
         "this op's bound is that matmul bound, bounds/grads.py), recorded as matmul")
_NO_TORCH_CALL_COLLECTIVE = ("no torch function to perturb: torch.distributed collectives are not seen by a "
                             "TorchFunctionMode, and the tracer compares ranks' recorded tensors instead")
_CALIB_BACKWARD = ("calibration fits kappa for forward ops; gradient bounds stay analytic (NoiseInjector docstring: "
                   "a calibration covers the ops it calibrates, the backward GEMMs through matmul/linear)")

#: (op, component) -> why it is missing
EXEMPT: dict[tuple[str, str], str] = {
    # ---- exact references
    ("all_gather", "reference"): "a copy: the exact result is the shards themselves (bound 0 unless a narrower fmt)",
    ("quantize", "reference"): "the exact result of dequantize(quantize(x)) is x itself, the op's input",
    # ---- emulations
    ("all_gather", "emulation"): "a copy: there is no arithmetic to emulate",
    ("mse_loss", "emulation"): "gap: no emulation of torch's mse_kernel + reduction yet",
    ("mse_loss_backward", "emulation"): "gap: no emulation of torch's mse_backward_cpu_kernel yet",
    # ---- the tracer's noise
    ("all_reduce", "noise"): _NO_TORCH_CALL_COLLECTIVE,
    ("reduce_scatter", "noise"): _NO_TORCH_CALL_COLLECTIVE,
    ("all_gather", "noise"): _NO_TORCH_CALL_COLLECTIVE,
    ("swiglu", "noise"): "no torch op: swiglu is silu(a) * b in torch, perturbed as silu and an elementwise product",
    ("vocab_parallel_cross_entropy", "noise"): "no torch op: Megatron's VocabParallelCrossEntropy is a composite of "
                                               "torch calls (max, exp, sum, all-reduce), each perturbed on its own",
    ("quantize", "noise"): "no torch op: fake quantization is a scaling and a cast, perturbed as those calls",
    ("quantized_matmul", "noise"): "no torch op: quantize + torch._scaled_mm, see scaled_matmul",
    ("scaled_matmul", "noise"): "gap: calls.classify does not recognise torch._scaled_mm (counted unmodelled)",
    ("linear_backward_input", "noise"): _GEMM,
    ("linear_backward_weight", "noise"): _GEMM,
    ("matmul_backward_a", "noise"): _GEMM,
    ("matmul_backward_b", "noise"): _GEMM,
    ("linear_backward_bias", "noise"): ("the tracer perturbs the bias gradient by the sum bound of the output "
                                        "gradient over the tokens (NoiseInjector._sum_noise), this op's bound"),
    ("layer_norm_backward_weight", "noise"): ("the tracer perturbs the weight gradient by the sum (or fp32-chain "
                                              "variance) model of its token sum (NoiseInjector._sum_noise)"),
    ("layer_norm_backward_bias", "noise"): "perturbed like layer_norm_backward_weight (NoiseInjector._sum_noise)",
    ("rms_norm_backward_weight", "noise"): "perturbed like layer_norm_backward_weight (NoiseInjector._sum_noise)",
    ("layer_norm_backward_input", "noise"): _ONE_ROUNDING,
    ("rms_norm_backward_input", "noise"): _ONE_ROUNDING,
    ("softmax_backward", "noise"): _ONE_ROUNDING,
    ("log_softmax_backward", "noise"): _ONE_ROUNDING,
    ("gelu_backward", "noise"): _ONE_ROUNDING,
    ("silu_backward", "noise"): _ONE_ROUNDING,
    # ---- calibration
    **{(op, "calibration"): _CALIB_BACKWARD for op in (
        "attention_dq", "attention_dk", "attention_dv", "cross_entropy_backward", "gelu_backward", "silu_backward",
        "layer_norm_backward_input", "layer_norm_backward_weight", "layer_norm_backward_bias",
        "rms_norm_backward_input", "rms_norm_backward_weight", "linear_backward_input", "linear_backward_weight",
        "linear_backward_bias", "matmul_backward_a", "matmul_backward_b", "softmax_backward",
        "log_softmax_backward", "mse_loss_backward")},
    ("all_gather", "calibration"): "a copy: bound 0, nothing to calibrate",
    ("all_reduce", "calibration"): "its bound is the sum bound over k partials: calibrate op sum",
    ("reduce_scatter", "calibration"): "its bound is the sum bound over k partials: calibrate op sum",
    ("scaled_matmul", "calibration"): ("quantized_matmul's spec calibrates the same scaled GEMM model from fp32 data; "
                                       "scaled_matmul takes operands already quantized and their scales"),
    ("cross_entropy", "calibration"): "gap: OpSpec draws float inputs only; cross_entropy needs int64 targets",
    ("vocab_parallel_cross_entropy", "calibration"): "gap: as cross_entropy (int64 targets)",
    ("mse_loss", "calibration"): "gap: no emulation (see its emulation exemption) to calibrate against",
    # ---- the command line
    ("scaled_matmul", "cli"): "gap: its scales are tensor keywords (scale_a, scale_b), which --kw cannot pass",
    ("mse_loss", "cli"): "no bench case to draw its inputs from (see its bench exemption)",
    ("mse_loss_backward", "cli"): "no bench case to draw its inputs from (see its bench exemption)",
    # ---- the benchmark
    ("mse_loss", "bench"): "gap: no bench case yet (tests/test_noise_coverage.py checks it against float64 sums)",
    ("mse_loss_backward", "bench"): "gap: no bench case yet",
}


# ----------------------------------------------------------------------------- discovery
def _canonical(name: str) -> str | None:
    return common._CANONICAL.get(name)


def _resolves(path: str) -> bool:
    return callable(pkgutil.resolve_name(path))


@functools.cache
def _bench_cases() -> tuple:
    return tuple(load_cases(None))


def _program() -> None:
    """One small bf16 training step calling every torch function ``calls.classify`` models."""
    g = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=g).bfloat16().requires_grad_()
    x, w, b, w2 = leaf(4, 8), leaf(6, 8), leaf(6), leaf(8, 6)
    q, k, v = leaf(1, 2, 8, 4), leaf(1, 2, 8, 4), leaf(1, 2, 8, 4)
    ln_w, ln_b, emb = leaf(8), leaf(8), leaf(10, 8)
    h = F.linear(x, w, b) + x @ w2
    outs = [h, F.softmax(h, -1), F.log_softmax(h, -1), F.layer_norm(x, (8,), ln_w, ln_b), F.rms_norm(x, (8,), ln_w),
            F.gelu(x), F.silu(x), torch.sum(x, -1), torch.mean(x, -1),
            F.scaled_dot_product_attention(q, k, v, is_causal=True), F.embedding(torch.tensor([1, 3, 1]), emb)]
    loss = F.cross_entropy(h.float(), torch.tensor([0, 2, 5, 1])) + F.mse_loss(x, x.detach() * 0.5).float()
    for o in outs:
        loss = loss + o.float().sum(dim=tuple(range(o.dim())))
    loss.backward()


@functools.cache
def _noise_models() -> frozenset[str]:
    """The registered ops whose models the injector evaluates while perturbing :func:`_program`."""
    seen: set[str] = set()

    def recording(name: str, fn):
        def wrapper(*args, **kwargs):
            seen.add(common._CANONICAL[name])
            return fn(*args, **kwargs)
        return wrapper
    import ttrace_num.bounds.attention as attention
    backward = attention.attention_backward

    def attention_backward(*args, **kwargs):
        seen.update(("attention_dq", "attention_dk", "attention_dv"))
        return backward(*args, **kwargs)
    with pytest.MonkeyPatch.context() as mp:
        for name, fn in list(common.OPS.items()):
            mp.setitem(common.OPS, name, recording(name, fn))
        mp.setattr(attention, "attention_backward", attention_backward)
        with NoiseInjector(torch.Generator().manual_seed(1), backward=True):
            _program()
    return frozenset(seen)


#: keywords of ``tn.tolerance`` that are options of ``ttrace tolerance``
_CLI_OPTIONS = {"fmt": "--fmt", "compute_fmt": "--compute-fmt", "mode": "--mode"}


def _cli_literal(v) -> str | None:
    """``v`` as a ``--kw`` value (a Python literal; a format by name), or None if it has none."""
    if isinstance(v, FloatFormat):
        return repr(v.name)
    if v is None or isinstance(v, (bool, int, float, str)):
        return repr(v)
    if isinstance(v, (list, tuple)) and all(_cli_literal(e) is not None for e in v):
        return repr(v)
    return None


def _cli_problem(op: str, tmp_path) -> str | None:
    """Why ``ttrace tolerance OP`` does not run on the op's first bench case, or None."""
    from safetensors.torch import save_file
    case = next((c for c in _bench_cases() if _canonical(c.op) == op), None)
    if case is None:
        return "no bench case to draw its inputs from"
    inputs, kwargs = case.make(torch.Generator().manual_seed(0))
    names = [f"t{i}" for i in range(len(inputs))]
    path = tmp_path / f"{op}.safetensors"
    save_file({n: t.detach().contiguous().clone() for n, t in zip(names, inputs)}, str(path))
    argv = ["tolerance", op, "--file", str(path), "--inputs", ",".join(names), "--json"]
    for key, value in {**kwargs, **case.bound_kwargs}.items():
        lit = _cli_literal(value)
        if key in _CLI_OPTIONS and value is not None:
            argv += [_CLI_OPTIONS[key], value.name if isinstance(value, FloatFormat) else str(value)]
        elif lit is not None:
            argv += ["--kw", f"{key}={lit}"]
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = cli_main(argv)
    return None if rc == 0 else f"`ttrace {' '.join(argv)}` exited {rc}: {err.getvalue().strip()}"


def discover(ops: list[str], tmp_path) -> dict[str, dict[str, str | None]]:
    """Per component, per op of ``ops``: None if the op has the component (module docstring),
    else what the probe found missing."""
    bench = {_canonical(c.op) for c in _bench_cases()}
    noise = _noise_models()

    def named(table: dict[str, str], op: str, what: str) -> str | None:
        if op not in table:
            return f"not in {what}"
        return None if _resolves(table[op]) else f"{what}[{op!r}] = {table[op]!r} is not a function"
    return {
        "reference": {op: named(REFERENCES, op, "REFERENCES") for op in ops},
        "emulation": {op: named(EMULATIONS, op, "EMULATIONS") for op in ops},
        "noise": {op: None if op in noise else "the injector never evaluated its model" for op in ops},
        "calibration": {op: None if op in SPECS else "not in SPECS" for op in ops},
        "cli": {op: _cli_problem(op, tmp_path) for op in ops},
        "bench": {op: None if op in bench else "no Case" for op in ops},
    }


def problems(ops: list[str], found: dict[str, dict[str, str | None]], exempt: dict[tuple[str, str], str]
             ) -> list[str]:
    """What ``ops`` miss without an exemption, their stale exemptions, and exemptions of ops
    no longer registered (module docstring)."""
    out = []
    for op in ops:
        for comp in COMPONENTS:
            missing, key = found[comp][op], (op, comp)
            if missing is None and key in exempt:
                out.append(f"stale exemption {key}: {op} has a {comp} now; remove it from EXEMPT in "
                           "tests/test_op_coverage.py")
            elif missing is not None and key not in exempt:
                out.append(f"{op}: no {comp} ({missing}): {WHERE[comp].replace('OP', op)}; or exempt "
                           f"({op!r}, {comp!r}) with the reason in EXEMPT of tests/test_op_coverage.py")
    registered = set(tn.ops())
    for op, comp in exempt:
        if op not in registered:
            out.append(f"stale exemption {(op, comp)}: {op!r} is no longer a registered op; remove it from EXEMPT")
        elif comp not in COMPONENTS:
            out.append(f"exemption {(op, comp)}: unknown component {comp!r}; one of {', '.join(COMPONENTS)}")
    return out


@pytest.fixture(scope="module")
def found(tmp_path_factory) -> dict[str, dict[str, str | None]]:
    return discover(tn.ops(), tmp_path_factory.mktemp("cli"))


# ----------------------------------------------------------------------------- tests
def test_every_registered_op_is_covered_or_exempt(found):
    bad = problems(tn.ops(), found, EXEMPT)
    assert not bad, "op coverage:\n  " + "\n  ".join(bad)


def test_every_exemption_gives_a_reason():
    assert all(isinstance(r, str) and len(r.split()) >= 4 for r in EXEMPT.values())


def test_a_new_op_without_its_components_fails_naming_what_to_add(monkeypatch, tmp_path):
    name = "coverage_dummy_op"

    def dummy(x, **kw):
        return tn.tolerance("add", x, x, **kw)
    monkeypatch.setitem(common.OPS, name, dummy)
    monkeypatch.setitem(common._CANONICAL, name, name)
    assert name in tn.ops()
    bad = problems([name], discover([name], tmp_path), EXEMPT)
    assert len(bad) == len(COMPONENTS), bad
    for comp, msg in zip(COMPONENTS, bad):
        assert msg.startswith(f"{name}: no {comp} (") and "EXEMPT" in msg
    assert "REFERENCES" in bad[0] and "EMULATIONS" in bad[1] and "calls.py" in bad[2]
    assert "SPECS" in bad[3] and "bench case" in bad[4] and "bench/cases/" in bad[5]
    # exempting every component makes it pass
    exempt = {**EXEMPT, **{(name, c): "a dummy op of this test" for c in COMPONENTS}}
    assert problems([name], discover([name], tmp_path), exempt) == []


def test_a_stale_exemption_fails(found):
    ops = tn.ops()
    covered = {**EXEMPT, ("matmul", "reference"): "matmul has no reference"}  # it has one
    assert problems(ops, found, covered) == [
        "stale exemption ('matmul', 'reference'): matmul has a reference now; remove it from EXEMPT in "
        "tests/test_op_coverage.py"]
    gone = {**EXEMPT, ("no_such_op", "bench"): "removed op"}
    assert problems(ops, found, gone) == [
        "stale exemption ('no_such_op', 'bench'): 'no_such_op' is no longer a registered op; remove it from EXEMPT"]


def test_a_lost_component_fails(found):
    """Dropping a registration (here: linear's reference) is caught."""
    lost = {**found, "reference": {**found["reference"], "linear": "not in REFERENCES"}}
    bad = problems(tn.ops(), lost, EXEMPT)
    assert len(bad) == 1 and bad[0].startswith("linear: no reference (not in REFERENCES): ")


def test_the_noise_probe_sees_the_tracers_models():
    """The probe records the forward models classify maps torch calls to and the backward models
    the injector evaluates (a probe that saw nothing would exempt nothing and fail nothing)."""
    assert {"linear", "matmul", "softmax", "log_softmax", "layer_norm", "rms_norm", "gelu", "silu", "add", "sum",
            "mean", "attention", "attention_dq", "cross_entropy", "cross_entropy_backward", "mse_loss",
            "mse_loss_backward"} <= _noise_models()


def test_the_references_added_for_coverage_are_exact():
    """``exact_linear`` (bias as one more term) equals ``math.fsum`` of the exact products and
    ``exact_scaled_matmul`` the rational sum of ``a sa b sb``, rounded once, element by element
    (fp8 x fp32 scale products need 28 bits, the four-factor products 55: not exact in float64);
    bad scales are refused by name."""
    import math
    from fractions import Fraction

    from ttrace_num.reference import exact_linear, exact_scaled_matmul
    g = torch.Generator().manual_seed(3)
    x, w, b = (torch.randn(*s, generator=g) * 1e3 ** torch.randn(*s, generator=g) for s in ((3, 7), (5, 7), (5,)))
    got = exact_linear(x, w, b)
    want = [[math.fsum([*(float(x[i, j]) * float(w[o, j]) for j in range(7)), float(b[o])]) for o in range(5)]
            for i in range(3)]
    assert torch.equal(got, torch.tensor(want, dtype=torch.float64))
    a8 = torch.randn(4, 16, generator=g).to(torch.float8_e4m3fn)
    b8 = torch.randn(16, 3, generator=g).to(torch.float8_e5m2)
    sa, sb = torch.rand(4, 1, generator=g) + 0.1, torch.rand(1, 3, generator=g) + 0.1
    got = exact_scaled_matmul(a8, b8, sa, sb)
    exact = [[sum(Fraction(float(a8[i, j])) * Fraction(float(sa[i, 0])) * Fraction(float(b8[j, o]))
                  * Fraction(float(sb[0, o])) for j in range(16)) for o in range(3)] for i in range(4)]
    want = [[float(e) for e in row] for row in exact]  # Fraction -> float rounds correctly
    assert torch.equal(got, torch.tensor(want, dtype=torch.float64))
    with pytest.raises(ValueError, match="scale_a"):
        exact_scaled_matmul(a8, b8, torch.ones(3, 1), sb)
    with pytest.raises(ValueError, match="scale_b holds values that are not fp32"):
        exact_scaled_matmul(a8, b8, sa, torch.full((1, 3), 0.1, dtype=torch.float64))


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_the_mse_references_are_correctly_rounded(reduction):
    """``mse_loss`` / ``mse_loss_backward`` equal mpmath at 400 bits (exact here: fp32 data of
    exponents within +-30 give differences, squares and sums of < 200 bits) rounded once (a plain
    float64 evaluation differs on 8 of these 63 squares: ``x - y`` of numbers up to 2^60 apart
    is inexact); torch's bf16 result is within the op's deterministic bound of the reference."""
    import mpmath

    from ttrace_num.reference import mse_loss, mse_loss_backward
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(7, 9, generator=g) * 2.0 ** torch.randint(-30, 30, (7, 9), generator=g)).float()
    y = (torch.randn(7, 9, generator=g) * 2.0 ** torch.randint(-30, 30, (7, 9), generator=g)).float()
    go = torch.randn(7, 9, generator=g) if reduction == "none" else torch.tensor(0.3)
    with mpmath.workprec(400):
        d = [[mpmath.mpf(float(x[i, j])) - mpmath.mpf(float(y[i, j])) for j in range(9)] for i in range(7)]
        sq = [[e * e for e in row] for row in d]
        n, gs = 63, go.expand(7, 9)
        if reduction == "none":
            want = torch.tensor([[float(e) for e in row] for row in sq], dtype=torch.float64)
        else:
            total = mpmath.fsum(e for row in sq for e in row)
            want = torch.tensor(float(total / n if reduction == "mean" else total), dtype=torch.float64)
        norm = mpmath.mpf(2) / n if reduction == "mean" else mpmath.mpf(2)
        want_g = torch.tensor([[float(norm * d[i][j] * mpmath.mpf(float(gs[i, j]))) for j in range(9)]
                               for i in range(7)], dtype=torch.float64)
    assert torch.equal(mse_loss(x, y, reduction), want)
    assert torch.equal(mse_loss_backward(x, y, go, reduction), want_g)
    xb, yb = x.bfloat16(), (x + 0.01 * y.clamp(-1, 1)).bfloat16()
    err = (torch.nn.functional.mse_loss(xb, yb, reduction=reduction).double() - mse_loss(xb, yb, reduction)).abs()
    assert (err <= tn.tolerance("mse_loss", xb, yb, reduction=reduction).abs).all()
    with pytest.raises(ValueError, match="reduction must be one of"):
        mse_loss(x, y, "avg")
    with pytest.raises(ValueError, match="same shape"):
        mse_loss(x, y[:, :3], reduction)
