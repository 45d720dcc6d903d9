r"""What one calibration instance of each op is: its inputs, emulation, exact reference and bound.

**Computation model per op** (inputs rounded to the calibrated format ``fmt`` with
:func:`~ttrace_num.rounding.round_to`, compute format ``c``, default fp32; every op is
emulated by :mod:`ttrace_num.emulate`, referenced by :mod:`ttrace_num.reference` (or the
``exact_*`` of its emulation module) and bounded by ``ttrace_num.tolerance(op, ...)``; the
*op shape* is the default of ``--shape OP=...``; ``o`` is ``--out-fmt``, default ``c``):

=================  ===============  ==========================================================
op                 op shape         model (output format)
=================  ===============  ==========================================================
matmul             m x K x n        ``(m, K) @ (K, n)``, recursive chain in ``c`` (``o``)
linear             m x K x n        ``F.linear(x (m, K), w (n, K))``, same GEMM (``o``)
sum, mean          row              row sum (``mean``: then ``/ n`` rounded in ``c``) (``o``)
softmax            row              ``emulate_softmax`` (``fmt``)
log_softmax        row              ``emulate_log_softmax``, statistics in ``fmt`` (``fmt``)
layer_norm         row              torch CPU Welford moments (vector width of ``fmt``),
                                    no affine, eps 1e-5 (``fmt``)
rms_norm           row              torch CPU cascade sum of squares, eps 1e-6 (``fmt``)
gelu, silu         row              elementwise in ``c`` (``fmt``)
swiglu             row (even)       Megatron ``silu(a) * b``, unfused (``fmt``)
add                row              ``x + y`` in ``c`` (``fmt``)
attention          H x L x d        ``softmax(q k^T / sqrt d) v``, standard algorithm (``fmt``)
quantize           rows x cols      ``dequantize(quantize(x))`` of fp32 data with the recipe (``c``)
quantized_matmul   m x K x n        both fp32 operands quantized with the recipe, scaled
                                    GEMM in ``c`` (``o``)
=================  ===============  ==========================================================

**Sources of instances.** From a distribution, every input of every instance is a fresh
draw of the op shape's inputs. From *supplied tensors* (a safetensors file), the tensors
are the op's tensor arguments in order (an op with ``k`` tensor arguments uses the first
``k``; with fewer supplied it is skipped) and keep their structure: an argument with
``unit`` trailing dims (1: rows, 2: ``(L, d)`` slices of attention heads) views its tensor
as a stack of units, and each instance is a block of consecutive units (as many as the
op shape's leading dims ask for) starting at a uniformly drawn unit; the unit's own size
comes from the tensor, not from the op shape. The arguments of one instance use the same
unit indices (so ``x`` and ``y`` of ``add`` or ``q``, ``k``, ``v`` of ``attention`` stay
aligned). A *weight* argument (``b`` of ``matmul`` and ``quantized_matmul``, ``w`` of
``linear``) is the supplied tensor itself, the same in every instance.
Instances are then i.i.d. draws from the file's blocks, so the held-out check validates
the constant on fresh blocks of the same file, not on other data.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from .. import scaling
from ..bounds.common import lookup
from ..bounds.fp8 import ScaledGemm
from ..bounds.norms import default_layout
from ..bounds.summation import Summation, conversion_exact
from ..formats import FloatFormat, get_format
from ..rounding import round_to
from .distributions import Draw

__all__ = ["CalibrationError", "Setup", "OpSpec", "SPECS", "ALL_OPS", "QUANT_OPS", "Supplied", "op_shapes",
           "shape_error", "storage_dtype", "unsupported"]


class CalibrationError(ValueError):
    """A calibration that cannot be trusted or cannot be built (the message says why)."""


Shape = tuple[int, ...]


@dataclass(frozen=True)
class Setup:
    """The calibrated format, the compute format, the quantize ops' recipe and ``acc_out``,
    the output format of the GEMMs and reductions (matmul, linear, sum, mean,
    quantized_matmul; default the compute format)."""

    fmt: FloatFormat
    compute: FloatFormat
    recipe: scaling.ScalingRecipe
    acc_out: FloatFormat


@dataclass(frozen=True)
class OpSpec:
    """How to draw, emulate, reference and bound one op.

    ``shape``: the default op shape; ``ndim``: the number of dims an op shape must have (0:
    any); ``inputs``: op shape -> instance shapes of the tensor arguments ``args``;
    ``units``: per argument, the trailing dims forming one unit of a supplied tensor, 0 for
    a weight (module docstring); ``batched``: one call handles a stack of instances
    (leading dim), otherwise instances are processed one at a time."""

    args: tuple[str, ...]
    shape: Callable[[Setup], Shape]
    ndim: int
    inputs: Callable[[Shape], list[Shape]]
    units: tuple[int, ...]
    batched: bool
    out: Callable[[Setup], FloatFormat]
    prepare: Callable[[list[torch.Tensor], Setup], list[torch.Tensor]]
    emulate: Callable[[list[torch.Tensor], Setup], torch.Tensor]
    exact: Callable[[list[torch.Tensor], Setup], torch.Tensor]
    kwargs: Callable[[Setup], dict[str, Any]]


def _on_grid(t: torch.Tensor, fmt: FloatFormat, what: str) -> torch.Tensor:
    r = round_to(t, fmt)
    if not torch.isfinite(r).all():
        raise CalibrationError(f"{what}: the data overflow {fmt} (max {fmt.max:g}); use a narrower distribution, "
                               "scaled tensors, or a --recipe for the quantize ops")
    return r


def _round_all(xs: list[torch.Tensor], s: Setup) -> list[torch.Tensor]:
    return [_on_grid(x, s.fmt, "inputs") for x in xs]


def _fp32_all(xs: list[torch.Tensor], s: Setup) -> list[torch.Tensor]:
    return [x.float() for x in xs]


def storage_dtype(fmt: FloatFormat) -> torch.dtype | None:
    """A torch dtype holding every ``fmt`` value with the same CPU vector width as ``fmt``.

    The layer-norm emulation reads its storage format from the tensor's dtype, and ATen's
    moments schedule depends on the storage's vector width (``TorchCPULayout.vec_elems``),
    which the bound takes from ``fmt``; None if no such dtype exists."""
    layout = default_layout()
    for dt in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        f = get_format(dt)
        if conversion_exact(fmt, f) and layout.vec_elems(f) == layout.vec_elems(fmt):
            return dt
    return None


def _centering(s: Setup) -> str:
    """The bound's default layer-norm centering for storage ``fmt`` (torch CPU's rule)."""
    return "subtract" if s.fmt.precision >= s.compute.precision else "fold"


# ----------------------------------------------------------------------------- emulations
def _mm(xs, s):
    from ..emulate.summation import emulate_matmul
    return emulate_matmul(xs[0], xs[1], Summation(accum=s.compute), s.acc_out)


def _exact_mm(xs, s):
    from ..reference.dot import exact_matmul
    return exact_matmul(xs[0], xs[1])


def _linear(xs, s):
    return _mm([xs[0], xs[1].transpose(-1, -2)], s)


def _exact_linear(xs, s):
    return _exact_mm([xs[0], xs[1].transpose(-1, -2)], s)


def _sum(xs, s):
    from ..emulate.summation import emulate_sum
    return emulate_sum(xs[0], -1, Summation(accum=s.compute), s.acc_out)


def _exact_sum(xs, s):
    from ..reference.dot import exact_sum
    return exact_sum(xs[0], -1)


def _mean(xs, s):
    from ..emulate.summation import emulate_mean
    return emulate_mean(xs[0], -1, Summation(accum=s.compute), s.acc_out)


def _exact_mean(xs, s):
    from ..reference.ops import mean_ref
    return mean_ref(xs[0], -1)


def _softmax(xs, s):
    from ..emulate.softmax import emulate_softmax
    return emulate_softmax(xs[0], -1, fmt=s.fmt, compute_fmt=s.compute, out_fmt=s.fmt)


def _log_softmax(xs, s):
    from ..emulate.softmax import emulate_log_softmax
    return emulate_log_softmax(xs[0], -1, fmt=s.fmt, compute_fmt=s.compute, out_fmt=s.fmt)


def _layer_norm(xs, s):
    from ..emulate.norms import layer_norm
    x = xs[0].to(storage_dtype(s.fmt))
    return layer_norm(x, x.shape[-1], compute_fmt=s.compute, out_fmt=s.fmt, centering=_centering(s))


def _rms_norm(xs, s):
    from ..emulate.norms import rms_norm
    return rms_norm(xs[0], xs[0].shape[-1], compute_fmt=s.compute, out_fmt=s.fmt)


def _ref(name: str) -> Callable[[list[torch.Tensor], Setup], torch.Tensor]:
    """The exact reference ``ttrace_num.reference.ops.<name>`` of the first input along the last dim."""
    def exact(xs, s):
        from ..reference import ops
        fn = getattr(ops, name)
        return fn(xs[0], xs[0].shape[-1]) if name in ("layer_norm", "rms_norm") else fn(xs[0])
    return exact


def _act(name: str) -> Callable[[list[torch.Tensor], Setup], torch.Tensor]:
    def emulate(xs, s):
        from ..emulate import activations
        return getattr(activations, name)(*xs, compute_fmt=s.compute, out_fmt=s.fmt)
    return emulate


def _exact_add(xs, s):
    from ..reference.dot import exact_sum
    return exact_sum(torch.stack([xs[0], xs[1]], -1), -1)


def _attention(xs, s):
    from ..emulate.attention import emulate_attention
    return emulate_attention(*xs, fmt=s.fmt, compute_fmt=s.compute, out_fmt=s.fmt)


def _exact_attention(xs, s):
    from ..emulate.attention import exact_attention
    return exact_attention(*xs)


def _quant(xs, s):
    from ..emulate.fp8 import emulate_fake_quant
    return emulate_fake_quant(xs[0], s.fmt, s.recipe, compute_fmt=s.compute)


def _qmm(xs, s):
    from ..emulate.fp8 import emulate_quantized_matmul
    return emulate_quantized_matmul(xs[0], xs[1], fmt_a=s.fmt, fmt_b=s.fmt, recipe_a=s.recipe, recipe_b=s.recipe,
                                    model=ScaledGemm(accum=s.compute, out=s.acc_out))


def _tile(s: Setup) -> int:
    """Rows per instance of the quantize ops: 128 for 128x128 tiles, else 8."""
    return 128 if s.recipe.name == "128x128" else 8


# ----------------------------------------------------------------------------- the table
def _same(n: int) -> Callable[[Shape], list[Shape]]:
    return lambda sh: [sh] * n


def _mk(sh: Shape) -> list[Shape]:
    m, k, n = sh
    return [(m, k), (k, n)]


def _mk_linear(sh: Shape) -> list[Shape]:
    m, k, n = sh
    return [(m, k), (n, k)]


_C = lambda s: s.compute  # (output formats)
_A = lambda s: s.acc_out
_F = lambda s: s.fmt
_KW_A = lambda s: {"fmt": s.fmt, "compute_fmt": s.compute, "out_fmt": s.acc_out}
_KW_F = lambda s: {"fmt": s.fmt, "compute_fmt": s.compute, "out_fmt": s.fmt}
_KW_Q = lambda s: {"fmt": s.fmt, "recipe": s.recipe, "compute_fmt": s.compute}


def _row(args: tuple[str, ...], n: int, emulate, exact, out=_F, kwargs=_KW_F) -> OpSpec:
    """An op on rows of ``n`` (default), one unit-1 argument per name in ``args``."""
    return OpSpec(args, lambda s: (n,), 0, _same(len(args)), (1,) * len(args), True, out, _round_all, emulate,
                  exact, kwargs)


SPECS: dict[str, OpSpec] = {
    "matmul": OpSpec(("a", "b"), lambda s: (4, 1024, 4), 3, _mk, (1, 0), True, _A, _round_all, _mm, _exact_mm, _KW_A),
    "linear": OpSpec(("x", "w"), lambda s: (4, 1024, 4), 3, _mk_linear, (1, 0), True, _A, _round_all, _linear,
                     _exact_linear, _KW_A),
    "sum": _row(("x",), 4096, _sum, _exact_sum, _A, lambda s: {"dim": -1, **_KW_A(s)}),
    "mean": _row(("x",), 1000, _mean, _exact_mean, _A, lambda s: {"dim": -1, **_KW_A(s)}),
    "softmax": _row(("x",), 64, _softmax, _ref("softmax"), kwargs=lambda s: {"dim": -1, **_KW_F(s)}),
    "log_softmax": _row(("x",), 64, _log_softmax, _ref("log_softmax"), kwargs=lambda s: {"dim": -1, **_KW_F(s)}),
    "layer_norm": _row(("x",), 64, _layer_norm, _ref("layer_norm"),
                       kwargs=lambda s: {"centering": _centering(s), **_KW_F(s)}),
    "rms_norm": _row(("x",), 64, _rms_norm, _ref("rms_norm")),
    "gelu": _row(("x",), 64, _act("gelu"), _ref("gelu")),
    "silu": _row(("x",), 64, _act("silu"), _ref("silu")),
    "swiglu": _row(("x",), 64, _act("swiglu"), _ref("swiglu"), kwargs=lambda s: {"dim": -1, **_KW_F(s)}),
    "add": _row(("x", "y"), 64, _act("add"), _exact_add),
    "attention": OpSpec(("q", "k", "v"), lambda s: (1, 8, 16), 3, _same(3), (2, 2, 2), True, _F, _round_all,
                        _attention, _exact_attention, _KW_F),
    "quantize": OpSpec(("x",), lambda s: (_tile(s), 128), 2, _same(1), (1,), False, _C, _fp32_all, _quant,
                       lambda xs, s: xs[0].double(), _KW_Q),
    "quantized_matmul": OpSpec(("a", "b"), lambda s: (_tile(s), 128, _tile(s)), 3, _mk, (1, 0), False, _A,
                               _fp32_all, _qmm, _exact_mm, lambda s: {**_KW_Q(s), "out_fmt": s.acc_out}),
}
#: ops calibrated by ``ops="all"``: every op the emulators model in any format
ALL_OPS = tuple(SPECS)
QUANT_OPS = ("quantize", "quantized_matmul")


def unsupported(op: str, s: Setup) -> str | None:
    """Why ``op`` cannot be emulated in ``s.fmt`` (the op is then skipped), or None."""
    if op == "layer_norm" and storage_dtype(s.fmt) is None:
        return (f"the torch CPU moments schedule depends on the storage's vector width, and no torch dtype "
                f"of {s.fmt}'s width stores it exactly")
    return None


def op_shapes(op: str, s: Setup, override: Shape | None) -> list[Shape]:
    """Instance shapes of ``op``'s arguments for the op shape ``override`` (default: the op's)."""
    spec = SPECS[op]
    sh = spec.shape(s) if override is None else tuple(override)
    if (spec.ndim and len(sh) != spec.ndim) or not sh or min(sh) < 1:
        want = f"{spec.ndim} positive sizes" if spec.ndim else "positive sizes"
        raise CalibrationError(f"--shape {op}={'x'.join(map(str, sh))}: {op} takes {want} "
                               f"(default {'x'.join(map(str, spec.shape(s)))})")
    return spec.inputs(sh)


def shape_error(op: str, inst: Sequence[Sequence[int]], s: Setup) -> str | None:
    """Why ``op`` does not take arguments of shapes ``inst`` (K of a GEMM, even swiglu
    rows, ...), checked by the op's bound on a dummy instance of ones; or None."""
    try:
        spec = SPECS[op]
        lookup(op)(*spec.prepare([torch.ones(tuple(sh), dtype=torch.float64) for sh in inst], s), **spec.kwargs(s))
    except (RuntimeError, ValueError) as e:
        return f"{op}({', '.join(SPECS[op].args)}) does not take arguments of shapes {[list(sh) for sh in inst]}: {e}"
    return None


# ----------------------------------------------------------------------------- supplied data
class Supplied:
    """Tensors supplied by the user, the op's tensor arguments in order (module docstring);
    refuses NaN/Inf, naming the tensor, the file and the first bad index."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], origin: str = "the supplied tensors"):
        self.tensors: list[tuple[str, torch.Tensor]] = []
        for name, t in tensors.items():
            if not t.is_floating_point():
                raise CalibrationError(f"tensor {name!r} of {origin} has dtype {t.dtype}; calibration needs float data")
            t64 = t.detach().to(torch.float64)
            bad = ~torch.isfinite(t64)
            if bad.any():
                idx = tuple(int(i) for i in torch.nonzero(bad)[0])
                raise CalibrationError(f"tensor {name!r} of {origin} holds {float(t64[idx])} at index {idx}; "
                                       "calibration needs finite data")
            self.tensors.append((name, t64))
        if not self.tensors:
            raise CalibrationError(f"no tensor in {origin}")

    @property
    def label(self) -> str:
        return "tensors:" + ",".join(n for n, _ in self.tensors)

    def unfit(self, op: str, shapes: Sequence[Shape], s: Setup) -> str | None:
        """Why the supplied tensors cannot give ``op``'s instances of ``shapes``, or None."""
        spec = SPECS[op]
        if len(self.tensors) < len(spec.args):
            return (f"{op} takes {len(spec.args)} tensor arguments ({', '.join(spec.args)}), "
                    f"{len(self.tensors)} supplied ({self.label[8:]})")
        counts = set()
        for (name, t), sh, u, arg in zip(self.tensors, shapes, spec.units, spec.args):
            if u == 0:
                continue
            if t.dim() < u:
                return f"{op}: argument {arg} takes units of {u} dims, tensor {name!r} has shape {list(t.shape)}"
            n_units, need = t.numel() // max(1, math.prod(t.shape[t.dim() - u:])), math.prod(sh[:-u])
            if n_units < need:
                return f"{op}: an instance takes {need} units of tensor {name!r}, which holds {n_units}"
            counts.add(n_units)
        if len(counts) > 1:
            return f"{op}: the supplied tensors hold different numbers of units ({sorted(counts)}); they cannot stay aligned"
        return shape_error(op, self.shapes(op, shapes), s)

    def shapes(self, op: str, shapes: Sequence[Shape]) -> list[list[int]]:
        """The argument shapes of one instance: the op shape's leading dims and the tensor's
        unit, or a weight's own shape."""
        return [list(t.shape) if u == 0 else [*sh[:-u], *t.shape[t.dim() - u:]]
                for (_, t), sh, u in zip(self.tensors, shapes, SPECS[op].units)]

    def draw(self, op: str, shapes: Sequence[Shape], k: int | None, g: torch.Generator) -> list[torch.Tensor]:
        """Inputs of ``k`` instances stacked on a leading dim (weights unstacked), or of one
        instance without the leading dim if ``k`` is None."""
        spec = SPECS[op]
        out: list[torch.Tensor] = []
        idx = None
        for (_, t), sh, u in zip(self.tensors, shapes, spec.units):
            if u == 0:
                out.append(t)
                continue
            units = t.reshape(-1, *t.shape[t.dim() - u:])
            count = math.prod(sh[:-u])
            if idx is None:
                starts = torch.randint(0, units.shape[0] - count + 1, (k or 1, 1), generator=g)
                idx = starts + torch.arange(count)
            x = units[idx].reshape(k or 1, *sh[:-u], *units.shape[1:])
            out.append(x if k else x[0])
        return out
