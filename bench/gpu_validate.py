"""Validate the error models against the GPU kernels torch runs: cuBLAS GEMMs, FP8 ``_scaled_mm``, SDPA.

    python bench/gpu_validate.py [--device cuda] [--small] [--trials N] [--only gemm,fp8,sdpa]
                                 [--json gpu_validate.json] [--write docs/bounds.md]

For every *kernel row* (a kernel, its setting, a dtype, a shape) it draws ``--trials`` random
instances on the CPU, runs the kernel on ``--device``, computes the exact reference on the CPU
(:mod:`ttrace_num.reference`: ``exact_matmul`` / ``exact_scaled_matmul``, correctly rounded
float64; attention: ``exact_attention`` (mpmath) up to ``EXACT_ATTENTION_MAX`` scores per
instance, else the float64 attention ``reference_attention_f64``, whose error, ~1e-16 relative,
is 10^9 below the bf16/fp16 bounds) and the bound ``tn.tolerance(op, ..., mode=...)`` of each
*model* stated for that kernel (below), in both modes, and reports per (row, model):
deterministic violations (elements whose error exceeds the deterministic bound: must be 0),
probabilistic violations (elements, and their rate against the claimed failure probability)
and tightness (per instance ``min bound / error`` over the elements with nonzero error, as in
:mod:`bench.harness`; median and max over the instances; 1 = attained).

Families and models:

``gemm``
    ``a @ b`` of bf16/fp16 ``(M, K) @ (K, N)`` by cuBLAS under the three settings of
    :data:`GEMM_SETTINGS` (``torch.backends.cuda.matmul.allow_{bf16,fp16}_reduced_precision_
    reduction = (allow_reduced_precision, allow_split_k)``; torch's default is ``(True, True)``);
    small ``M, N`` with ``K`` up to 65536 make cuBLAS split K. Split-K is *detected* on the first
    instance of each shape, both reported in the notes: the CUDA kernels each setting launches
    (torch.profiler: a split-K kernel, or a second, reduction kernel) and whether its output
    differs bitwise from that of ``fp32-reduce, no splitK`` (only a different reduction, i.e.
    split K, can make them differ). Models: ``default`` (fp32 accumulation in any order, output
    rounded once: split K with an fp32 reduction is one more order, so this is what the
    ``fp32-reduce`` settings need) and ``splitK<=32 in <dtype>`` (``Summation(split=s,
    reduce_fmt=dtype)``, the elementwise maximum over ``s`` in ``SPLITS`` (the bound is not
    monotone in ``s``): the partials rounded to the output dtype and reduced in it, what
    ``reduced`` may do; the split factor cuBLAS picks is not observable, hence the maximum).
``fp8``
    ``torch._scaled_mm`` of e4m3 x e4m3 and e4m3 x e5m2, per-tensor and row-wise scales
    (``ttrace_num.scaling.quantize``), bf16 and fp32 outputs, ``use_fast_accum`` False/True.
    Models (``scaled_matmul``, scales applied in the epilogue): ``fp32 accum`` (no
    promotion), ``promote 128`` (chains of 128 products in the 14-bit tensor-core accumulator
    ``TENSOR_CORE_ACCUM``, DeepSeek-V3 §3.3.2) and ``no promotion`` (the whole K in that
    accumulator: what fast accumulation may do).
``sdpa``
    ``F.scaled_dot_product_attention`` under ``torch.nn.attention.sdpa_kernel`` of each backend
    (flash, efficient, cuDNN, math), bf16/fp16, causal or not. Model: the default attention
    model (``algorithm=None``: the union of the kernels torch and the GPU libraries run,
    :mod:`ttrace_num.bounds.attention`).

Every family also has an ``emulated`` row (the model's own emulation, :mod:`ttrace_num.emulate`,
on the CPU) so that ``--device cpu --small`` exercises each family's data, reference and
bounds (the CUDA-only kernels are then skipped with the reason printed). A kernel that fails
(missing on this GPU, unsupported combination) is reported in its row; the table continues.
Writes the markdown table between the ``BEGIN``/``END`` markers of ``--write`` and the raw
figures (per instance) as JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ttrace_num as tn  # noqa: E402
from ttrace_num import scaling  # noqa: E402
from ttrace_num.bounds.fp8 import ScaledGemm  # noqa: E402
from ttrace_num.bounds.summation import Summation  # noqa: E402
from ttrace_num.emulate.attention import emulate_attention, exact_attention, reference_attention_f64  # noqa: E402
from ttrace_num.emulate.fp8 import emulate_scaled_matmul  # noqa: E402
from ttrace_num.emulate.summation import emulate_matmul  # noqa: E402
from ttrace_num.reference import exact_matmul, exact_scaled_matmul  # noqa: E402

BEGIN, END = "<!-- BEGIN GPU VALIDATION TABLE -->", "<!-- END GPU VALIDATION TABLE -->"
HEADERS = ["family", "kernel", "setting", "dtype", "shape", "model", "inst.", "det. viol.",
           "prob. viol. (rate / claim)", "tight med (det)", "tight max (det)", "tight med (prob)", "notes"]
MODES = ("deterministic", "probabilistic")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: split factors over which the reduced-precision split-K model takes its maximum (--small: SMALL_SPLITS)
SPLITS = (1, 2, 3, 4, 6, 8, 16, 32)
SMALL_SPLITS = (1, 2, 4)
#: largest number of scores (heads x Lq x Lk) per instance referenced with mpmath
EXACT_ATTENTION_MAX = 1 << 15
Model = dict[str, Any] | list[dict[str, Any]]  # tolerance keywords; a list: the elementwise max of its bounds


@dataclass
class Instance:
    args: tuple          # the op's tensor arguments (CPU)
    kwargs: dict         # the op's keywords (shared by the kernel, the reference and the bound)
    exact: torch.Tensor  # float64 reference (CPU)
    reference: str       # which reference


@dataclass
class Impl:
    """One way to compute a row's op: ``run(instance, device) -> result``; ``cuda`` kernels are
    skipped on other devices; ``setting`` names a global switch it runs under."""

    kernel: str
    setting: str
    run: Callable[[Instance, str], torch.Tensor]
    cuda: bool = True


@dataclass
class Spec:
    """One kernel row family member: an op on one dtype and shape, its implementations and models."""

    family: str
    op: str
    dtype: str
    shape: str
    make: Callable[[torch.Generator], Instance]
    impls: list[Impl]
    models: dict[str, Model]
    probe: Callable[[Instance, str], dict] | None = None  # per-spec extra figures (split-K detection)


@dataclass
class Tally:
    instances: int = 0
    elements: int = 0
    violations: dict[str, int] = field(default_factory=lambda: {m: 0 for m in MODES})
    claimed: float = 0.0
    tightness: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in MODES})

    def add(self, err: torch.Tensor, bounds: dict[str, torch.Tensor], claimed: float) -> None:
        self.instances += 1
        self.elements += err.numel()
        self.claimed = claimed
        nz = err > 0
        for mode, b in bounds.items():
            b = torch.broadcast_to(b, err.shape)
            self.violations[mode] += int((err > b).sum())
            self.tightness[mode].append(float((b[nz] / err[nz]).min()) if nz.any() else math.inf)


# ----------------------------------------------------------------------------- helpers
def _randn(shape: tuple[int, ...], g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _bound(op: str, inst: Instance, model: Model, mode: str) -> tuple[torch.Tensor, float]:
    """The bound of ``model`` (elementwise max over a list of keyword sets) and its claimed failure probability."""
    out, p = None, 0.0
    for kw in (model if isinstance(model, list) else [model]):
        b = tn.tolerance(op, *inst.args, mode=mode, **inst.kwargs, **kw)
        out = b.abs if out is None else torch.maximum(out, b.abs)
        p = max(p, b.failure_probability)
    return out, p


#: cuBLAS reduction settings of the gemm rows: ``(allow_reduced_precision, allow_split_k)`` of
#: ``torch.backends.cuda.matmul.allow_{bf16,fp16}_reduced_precision_reduction`` (a pair since torch
#: PR 164766; torch's default is ``(True, True)``)
GEMM_SETTINGS = {"reduced, splitK": (True, True), "fp32-reduce, splitK": (False, True),
                 "fp32-reduce, no splitK": (False, False)}


@contextlib.contextmanager
def _matmul_reduction(dtype: torch.dtype, setting: tuple[bool, bool]):
    """cuBLAS's reduction setting for ``dtype`` GEMMs (:data:`GEMM_SETTINGS`) inside, restored after.
    A torch without the split-K element takes the first element only."""
    m = torch.backends.cuda.matmul
    name = f"allow_{'bf16' if dtype == torch.bfloat16 else 'fp16'}_reduced_precision_reduction"
    before = (getattr(m, name), getattr(m, name + "_split_k", True))
    try:
        setattr(m, name, setting)
    except TypeError:  # torch before the (reduced, split_k) pair
        setattr(m, name, setting[0])
    try:
        yield
    finally:
        try:
            setattr(m, name, before)
        except TypeError:
            setattr(m, name, before[0])


def _kernel_names(fn: Callable[[], Any]) -> list[str]:
    """Names of the CUDA kernels ``fn`` launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower()
                   and "memset" not in e.name.lower()})


# ----------------------------------------------------------------------------- gemm
def _gemm_spec(dtype: str, m: int, k: int, n: int, splits: tuple[int, ...] = SPLITS) -> Spec:
    dt = DTYPES[dtype]

    def make(g: torch.Generator) -> Instance:
        a, b = _randn((m, k), g, dt), _randn((k, n), g, dt)
        return Instance((a, b), {}, exact_matmul(a, b), "exact_matmul")

    def cublas(setting: tuple[bool, bool]) -> Callable[[Instance, str], torch.Tensor]:
        def run(inst: Instance, device: str) -> torch.Tensor:
            a, b = (t.to(device) for t in inst.args)
            with _matmul_reduction(dt, setting):
                return (a @ b).cpu()
        return run

    def probe(inst: Instance, device: str) -> dict:
        """Split-K evidence, per setting: the CUDA kernels of the call, and whether its output
        differs bitwise from that of ``fp32-reduce, no splitK`` (a different reduction)."""
        a, b = (t.to(device) for t in inst.args)
        out: dict[str, Any] = {}
        results = {}
        for name, setting in GEMM_SETTINGS.items():
            with _matmul_reduction(dt, setting):
                out[f"kernels {name}"] = _kernel_names(lambda: a @ b)
                results[name] = a @ b
        base = results["fp32-reduce, no splitK"]
        for name, r in results.items():
            out[f"differs {name}"] = bool((r != base).any())
        return out

    models: dict[str, Model] = {
        "default": {},
        f"splitK<={splits[-1]} in {dtype}": [{"summation": Summation(split=s, reduce_fmt=dtype)} for s in splits],
    }
    impls = [Impl("cuBLAS", name, cublas(setting)) for name, setting in GEMM_SETTINGS.items()]
    impls.append(Impl("emulated", "fp32 chain", lambda inst, dev: emulate_matmul(*inst.args, Summation(), dtype),
                      False))
    return Spec("gemm", "matmul", dtype, f"{m}x{k}x{n}", make, impls, models, probe)


# ----------------------------------------------------------------------------- fp8
def _fp8_spec(fmt_b: str, recipe: str, out: str, m: int, k: int, n: int) -> Spec:
    def make(g: torch.Generator) -> Instance:
        a, b = torch.randn((m, k), generator=g, dtype=torch.float64), torch.randn((k, n), generator=g,
                                                                                   dtype=torch.float64)
        qa, qbt = scaling.quantize(a, "e4m3", recipe), scaling.quantize(b.T, fmt_b, recipe)
        sa = qa.scale_inv.float()
        sb = (qbt.scale_inv if qbt.scale_inv.dim() == 0 else qbt.scale_inv.T).float().contiguous()
        a8 = qa.as_torch()
        b8 = qbt.as_torch().T  # column-major, as cuBLASLt wants it
        kw = {"scale_a": sa, "scale_b": sb, "out_fmt": out}
        return Instance((a8, b8), kw, exact_scaled_matmul(a8, b8, sa, sb), "exact_scaled_matmul")

    def scaled_mm(fast: bool) -> Callable[[Instance, str], torch.Tensor]:
        def run(inst: Instance, device: str) -> torch.Tensor:
            a, b = (t.to(device) for t in inst.args)
            sa, sb = inst.kwargs["scale_a"].to(device), inst.kwargs["scale_b"].to(device)
            return torch._scaled_mm(a, b, sa, sb, out_dtype=DTYPES[out], use_fast_accum=fast).cpu()
        return run

    def emulated(inst: Instance, device: str) -> torch.Tensor:
        kw = inst.kwargs
        return emulate_scaled_matmul(*inst.args, kw["scale_a"], kw["scale_b"], ScaledGemm(out=out))

    models: dict[str, Model] = {
        "fp32 accum": {"scale_application": "epilogue"},
        "promote 128": {"scale_application": "epilogue", "promotion_interval": 128},
        "no promotion": {"scale_application": "epilogue", "promotion_interval": k},
    }
    impls = [Impl("_scaled_mm", "fast_accum=False", scaled_mm(False)),
             Impl("_scaled_mm", "fast_accum=True", scaled_mm(True)),
             Impl("emulated", "fp32 accum", emulated, False)]
    return Spec("fp8", "scaled_matmul", f"e4m3 x {fmt_b} {recipe} -> {out}", f"{m}x{k}x{n}", make, impls, models)


# ----------------------------------------------------------------------------- sdpa
_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")


def _sdpa_spec(dtype: str, causal: bool, b: int, h: int, L: int, d: int) -> Spec:
    dt = DTYPES[dtype]

    def make(g: torch.Generator) -> Instance:
        q, k, v = (_randn((b, h, L, d), g, dt) for _ in range(3))
        kw = {"is_causal": causal}
        if b * h * L * L <= EXACT_ATTENTION_MAX:
            return Instance((q, k, v), kw, exact_attention(q, k, v, **kw), "exact_attention")
        return Instance((q, k, v), kw, reference_attention_f64(q, k, v, **kw), "float64")

    def backend(name: str) -> Callable[[Instance, str], torch.Tensor]:
        def run(inst: Instance, device: str) -> torch.Tensor:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            q, k, v = (t.to(device) for t in inst.args)
            with sdpa_kernel(getattr(SDPBackend, name)):
                return F.scaled_dot_product_attention(q, k, v, **inst.kwargs).cpu()
        return run

    def emulated(inst: Instance, device: str) -> torch.Tensor:
        return emulate_attention(*inst.args, **inst.kwargs, algorithm="online", block_size=64, p_fmt=dtype)

    # the CPU has flash and math kernels of its own: run them on any device
    impls = [Impl(n.split("_")[0].lower(), "", backend(n), n in ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION"))
             for n in _BACKENDS]
    impls.append(Impl("emulated", "online b=64, P in " + dtype, emulated, False))
    return Spec("sdpa", "attention", dtype, f"{b}x{h}x{L}x{d}{' causal' if causal else ''}", make, impls,
                {"default": {}})


# ----------------------------------------------------------------------------- the rows
def specs(small: bool) -> list[Spec]:
    """The kernel rows: full (``small=False``, sized for about 8 minutes on one H100/H200 with
    the round-robin budget of :func:`main`) or the CPU smoke set."""
    fp8_kinds = [("e4m3", "tensor", "bf16"), ("e4m3", "tensor", "fp32"), ("e5m2", "tensor", "bf16"),
                 ("e4m3", "row", "bf16")]
    if small:
        return ([_gemm_spec("bf16", 4, 512, 4, SMALL_SPLITS)]
                + [_fp8_spec(fb, r, o, 16, 256, 16) for fb, r, o in fp8_kinds[2:]]
                + [_sdpa_spec("bf16", True, 1, 1, 16, 8), _sdpa_spec("fp16", False, 1, 1, 16, 8)])
    out = [_gemm_spec(dt, *s) for s in ((16, 4096, 16), (16, 16384, 16), (8, 65536, 8), (64, 4096, 64))
           for dt in ("bf16", "fp16")]
    out += [_fp8_spec(fb, r, o, *s) for s in ((64, 4096, 64), (16, 16384, 16)) for fb, r, o in fp8_kinds]
    out += [_sdpa_spec(dt, c, 1, 2, 256, 64) for dt in ("bf16", "fp16") for c in (False, True)]
    out += [_sdpa_spec("bf16", c, 1, 1, 512, 128) for c in (False, True)]
    return out


@dataclass
class Row:
    spec: Spec
    impl: Impl
    model: str
    tally: Tally = field(default_factory=Tally)
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    reference: str = ""

    def cells(self) -> list[str]:
        s, t = self.spec, self.tally
        head = [s.family, self.impl.kernel, self.impl.setting or "-", s.dtype, s.shape, self.model]
        if self.error is not None:
            return head + [str(t.instances), "-", "-", "-", "-", "-", self.error]
        det, prob = ([x for x in t.tightness[m] if math.isfinite(x)] for m in MODES)
        rate = t.violations["probabilistic"] / max(t.elements, 1)
        return head + [str(t.instances), str(t.violations["deterministic"]),
                       f"{t.violations['probabilistic']} ({rate:.2g} / {t.claimed:.2g})",
                       f"{statistics.median(det):.3g}" if det else "exact", f"{max(det):.3g}" if det else "exact",
                       f"{statistics.median(prob):.3g}" if prob else "exact",
                       "; ".join([f"ref {self.reference}"] + self.notes)]

    def raw(self) -> dict:
        return {"family": self.spec.family, "op": self.spec.op, "kernel": self.impl.kernel,
                "setting": self.impl.setting, "dtype": self.spec.dtype, "shape": self.spec.shape,
                "model": self.model, "reference": self.reference, "error": self.error, "notes": self.notes,
                "instances": self.tally.instances, "elements": self.tally.elements,
                "violations": self.tally.violations, "claimed_failure_probability": self.tally.claimed,
                "tightness": {m: [x if math.isfinite(x) else None for x in v]
                              for m, v in self.tally.tightness.items()}}


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]


class SpecRun:
    """The rows of one :class:`Spec`, filled one instance per :meth:`step`."""

    def __init__(self, spec: Spec, device: str, seed: int):
        self.spec, self.device = spec, device
        self.g = torch.Generator().manual_seed(seed)
        self.rows = {(i.kernel, i.setting, m): Row(spec, i, m) for i in spec.impls for m in spec.models}
        self.done = 0
        for (_, _, _), row in self.rows.items():
            if row.impl.cuda and device != "cuda":
                row.error = "skipped: a CUDA kernel (run with --device cuda)"

    def _fail(self, rows, what: str, e: BaseException) -> None:
        for r in rows:
            r.error = r.error or f"{what} failed: {_one_line(e)}"

    def step(self) -> None:
        """Draw one instance; bound it under every model; run every implementation on it."""
        spec, rows = self.spec, list(self.rows.values())
        try:
            inst = spec.make(self.g)
        except Exception as e:  # noqa: BLE001 -- reported in the rows; the other specs go on
            self._fail(rows, "inputs/reference", e)
            return
        bounds: dict[str, dict[str, torch.Tensor]] = {}
        claimed = 0.0
        for name, model in spec.models.items():
            try:
                bounds[name] = {}
                for mode in MODES:
                    bounds[name][mode], p = _bound(spec.op, inst, model, mode)
                    claimed = p if mode == "probabilistic" else claimed
            except Exception as e:  # noqa: BLE001
                bounds.pop(name, None)
                self._fail([r for r in rows if r.model == name], "bound", e)
        for impl in spec.impls:
            mine = [r for r in rows if r.impl is impl and r.error is None]
            if not mine:
                continue
            try:
                out = impl.run(inst, self.device).to(torch.float64)
            except Exception as e:  # noqa: BLE001 -- a kernel missing on this GPU/build: reported, go on
                self._fail(mine, "kernel", e)
                continue
            err = (out - inst.exact).abs()
            err = torch.where(torch.isnan(out) & torch.isnan(inst.exact), torch.zeros_like(err), err)
            for r in mine:
                if r.model in bounds:
                    r.tally.add(err, bounds[r.model], claimed)
                    r.reference = inst.reference
        if self.done == 0 and spec.probe is not None and self.device == "cuda":
            self._probe(inst)
        self.done += 1

    def _probe(self, inst: Instance) -> None:
        cublas = [r for r in self.rows.values() if r.impl.kernel == "cuBLAS"]
        try:
            found = self.spec.probe(inst, self.device)
        except Exception as e:  # noqa: BLE001
            for r in cublas:
                r.notes.append(f"probe failed: {_one_line(e)}")
            return
        for r in cublas:
            if r.impl.setting != "fp32-reduce, no splitK":
                r.notes.append(("differs" if found[f"differs {r.impl.setting}"] else "same bits as")
                               + " fp32-reduce, no splitK")
            r.notes.append("kernels: " + ", ".join(found[f"kernels {r.impl.setting}"]))


def markdown(rows: list[Row], header: str) -> str:
    """The table of the rows that ran (or failed), then one line naming the skipped kernels."""
    shown = [r for r in rows if not (r.error or "").startswith("skipped")]
    lines = [header, "", "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in r.cells()) + " |" for r in shown]
    skipped = sorted({f"{r.spec.family} {r.impl.kernel}" for r in rows if r not in shown})
    if skipped:
        lines += ["", f"Skipped (CUDA kernels, not run on this device): {', '.join(skipped)}."]
    return "\n".join(lines)


def write_section(path: Path, body: str) -> None:
    """Replace the text between :data:`BEGIN` and :data:`END` of ``path`` (appended if absent)."""
    text = path.read_text() if path.exists() else ""
    if BEGIN not in text or END not in text:
        text += f"\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(head + BEGIN + "\n" + body + "\n" + END + tail)


def environment(device: str) -> dict:
    env = {"torch": torch.__version__, "device": device}
    if device == "cuda":
        env.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda,
                   capability=".".join(map(str, torch.cuda.get_device_capability())),
                   allow_fp16_bf16_reduction_math_sdp=getattr(torch.backends.cuda,
                                                              "fp16_bf16_reduction_math_sdp_allowed", lambda: None)())
    else:
        env["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--small", action="store_true", help="tiny shapes (the CPU smoke run)")
    ap.add_argument("--trials", type=int, default=None, help="instances per row (default 6; --small: 1)")
    ap.add_argument("--budget-s", dest="budget_s", type=float, default=400.0,
                    help="after the first instance of every spec, start no instance that would end past this "
                         "many seconds, judged by the spec's previous one (default 400)")
    ap.add_argument("--only", help="families to run, comma-separated: gemm, fp8, sdpa")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="gpu_validate.json", help="raw figures (default gpu_validate.json)")
    ap.add_argument("--write", help="markdown file whose GPU validation table to replace")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_validate: no CUDA device here; run `python bench/gpu_validate.py --device cpu --small` for the "
              "CPU smoke run", file=sys.stderr)
        return 2
    families = {"gemm", "fp8", "sdpa"}
    only = set(args.only.split(",")) if args.only else families
    if not only <= families:
        print(f"gpu_validate: --only takes {', '.join(sorted(families))}, got {args.only!r}", file=sys.stderr)
        return 2
    if args.trials is not None and args.trials < 1:
        print("gpu_validate: --trials must be >= 1", file=sys.stderr)
        return 2
    trials = args.trials or (1 if args.small else 6)
    env = environment(args.device)
    print("gpu_validate:", ", ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    runs = [SpecRun(s, args.device, args.seed + i) for i, s in enumerate(specs(args.small)) if s.family in only]
    t0 = time.time()
    last: dict[int, float] = {}  # seconds of each spec's previous instance
    for r in range(trials):  # round robin: every row gets an instance before any gets its next one
        for i, run in enumerate(runs, 1):
            if r and time.time() - t0 + last[i] > args.budget_s:
                continue  # after the first round, no instance that would end past the budget
            t = time.time()
            run.step()
            last[i] = time.time() - t
            print(f"[instance {r + 1}/{trials}, spec {i}/{len(runs)}, {time.time() - t0:5.0f}s] {run.spec.family} "
                  f"{run.spec.dtype} {run.spec.shape}", flush=True)
    if any(run.done < trials for run in runs):
        print(f"budget of {args.budget_s:.0f} s: {sum(run.done < trials for run in runs)} of {len(runs)} specs got "
              f"fewer than {trials} instances (the inst. column)", flush=True)
    rows = [row for run in runs for row in run.rows.values()]
    for reason in sorted({f"{r.spec.family} {r.impl.kernel}: {r.error}" for r in rows
                          if (r.error or "").startswith("skipped")}):
        print(reason, flush=True)
    det = sum(r.tally.violations["deterministic"] for r in rows)
    header = (f"Run: {env.get('gpu', env['device'])}, torch {env['torch']}"
              + (f", CUDA {env['cuda']}" if "cuda" in env else "")
              + f"; up to {trials} instances per row; {time.time() - t0:.0f} s. Deterministic violations: {det}. "
              f"Regenerate: `python bench/gpu_validate.py --write docs/bounds.md`.")
    table = markdown(rows, header)
    print("\n" + table)
    Path(args.json).write_text(json.dumps({"environment": env, "trials": trials, "rows": [r.raw() for r in rows]},
                                          indent=1))
    print(f"wrote {args.json}")
    if args.write:
        write_section(Path(args.write), table)
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
