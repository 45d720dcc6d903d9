r"""FP8 training by fake-quant, following Transformer Engine's *delayed scaling*, for the
plain-PyTorch CPU/gloo bug-detection harness.

Every tensor that TE would cast to FP8 is cast here to the FP8 grid (values kept in float32)
with the same per-tensor scale, so a run on one device and a data/tensor/sequence-parallel
run compute on bitwise identical FP8 operands whenever their scales agree. The FP8 bugs of
``/work/shared/bug-catalogue.md`` (B09-B12) are injected by monkeypatching the small
module-level functions below (:data:`BUG_PATCHES`, :func:`patch_bug`); they are looked up at
call time.

Shapes: no batch dim. ``x``: ``[tokens, in]``, ``weight``: ``[out, in]`` (``nn.Linear``
layout), ``y = x W^T``: ``[tokens, out]``.

**Formats** (TE ``Format.HYBRID``): the forward tensors ``x`` and ``w`` in E4M3 (max 448,
OCP ``float8_e4m3fn``), the output gradient ``g`` in E5M2 (max 57344). Casts saturate at
``+-max`` (TE casts with ``satfinite``), NaN stays NaN.

**Cast and dequantization** (per tensor; ``s`` = scale, ``s_inv`` = scale_inv, both float32)::

    q  = RN_fmt( x * s ),  clamped to +-fmt.max       # fp8_cast: the FP8 "bytes", exact in fp32
    x' = RN_fp32( q * s_inv )                         # fp8_dequantize
    quantize(x, s, fmt) = x'

``x * s`` is formed exactly (float64; a <=24-bit input times a 24-bit scale fits in 53 bits)
and rounded once, by :func:`ttrace_num.rounding.round_to`. TE multiplies in float32 and then
casts (two roundings); the two can differ only at near-ties of the FP8 grid. Since reference
and candidate use the same function, this does not matter for bug detection.

The dequantized value is kept in **float32**, whatever the input dtype: ``q * s_inv`` has at
most ``4 + 24`` significant bits, so its float32 rounding is off by at most ``2**-24``
relative (far below the FP8 spacing ``2**-3`` / ``2**-2``; ``q`` is recoverable from ``x'``),
while a cast back to bf16 would round a second time and could merge neighbouring FP8 values
times ``s_inv``, hiding a wrong scale. TE's GEMM instead multiplies ``sum q_a q_b`` (fp32
accumulation) by ``s_inv_a s_inv_b``; the difference is again ``O(2**-24)`` relative.

**Delayed scaling** (TE ``DelayedScaling(amax_history_len=history, amax_compute_algo="max",
margin=margin)``), per tensor ``t`` in ``{x, w, g}`` of each linear layer (:class:`Fp8Meta`):

* in every forward (``x``, ``w``) / backward (``g``) of every microbatch:
  ``running[t] = max(running[t], max|t|)`` over the *unquantized* tensor;
* at the step boundary (:meth:`Fp8Meta.end_step`, once per optimizer step):
  ``a = allreduce_max(running, amax group)`` (:func:`_reduce_amax`; for ``g`` over the group
  chosen by :func:`_backward_amax_group`), ``history = [a, history[:-1]]``,
  ``m = max(history)``, ``s = RN_fp32(fmt.max / m) / 2**margin`` where ``m > 0`` and finite,
  else the old ``s``; ``s_inv = RN_fp32(1 / s)``; ``running = 0``.

Scales therefore change only at step boundaries (TE updates them after every
``fp8_autocast`` exit, i.e. possibly between microbatches; this harness does not, so that a
single-device reference running all microbatches of a step and a parallel candidate whose
amax is reduced over all ranks holding different data get bitwise identical scales).
Initial ``s = s_inv = 1``, history zeros.

**FP8 linear** (:class:`Fp8LinearFunction`, :func:`fp8_linear`), TE ``Linear`` with
``sequence_parallel`` (column-parallel)::

    forward:  q_x = cast(x_local, s_x),  q_w = cast(W, s_w)           (or the cached q_w)
              q_X = all_gather_dim0(q_x, sp_group)                      (FP8 all-gather)
              y   = (deq(q_X, s_inv_x) @ deq(q_w, s_inv_w)^T)  in fp32, then cast to x.dtype
    backward: g' = quantize(g, s_g, E5M2)
              dX = (g' @ W') in fp32 -> x.dtype;  dx_local = reduce_scatter_dim0(dX, sum)
              dW = (g'^T @ X') in fp32 -> W.dtype, X' = deq(_gather_for_wgrad(q_x), s_inv_x)

The local FP8 shard ``q_x`` (not the gathered one) is saved for backward and all-gathered
again there (TE's memory saving); the gathered bytes are decoded with *this* rank's
``s_inv_x``, as TE does, so inconsistent scales across ranks (B09) corrupt the gathered
input. Each rank holds a column shard ``W[r*out/p:(r+1)*out/p]``: ``y``, ``g`` and ``dW`` are
that rank's output columns / weight rows; ``dW`` is complete locally (no reduction over
``sp_group``). The GEMMs are plain ``torch.matmul`` calls so that a torch-function mode (the
noise injector) sees them in forward, and in backward under
:func:`ttrace_num.propagate.noise.perturb_custom_backward`; the casts, amax bookkeeping and
dequantization run under ``torch._C.DisableTorchFunction()`` (deterministic, identical in
reference and candidate: no mode may perturb them).

Measured on torch 2.13 (tests/test_fp8_harness.py): a ``TorchFunctionMode`` active around
``Function.apply`` sees the ops inside ``forward`` (but not ``apply`` itself) and does not see
the ops inside ``backward`` unless the class is patched by ``perturb_custom_backward``.

**Weight cache** (TE ``is_first_microbatch``): ``True`` casts the weight and stores
``{"q": q_w, "scale_inv": s_inv_w}`` in ``cache``; ``False`` reuses the stored FP8 weight
with the ``scale_inv`` stored with it (:func:`_cached_weight_scale_inv`) and does not touch
the weight amax (TE skips it: the weight has not changed); ``None`` casts every time and
caches nothing.

Collectives are the harness's (:mod:`examples.torch_parallel.comm`): all-gather along dim 0,
and the reduce-scatter as an all-reduce plus this rank's block.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from examples.torch_parallel.comm import all_gather_seq, reduce_scatter_seq_raw
from ttrace_num.formats import FloatFormat, get_format
from ttrace_num.rounding import round_to
from ttrace_num.scaling import ScalingRecipe, scales_from_amax

__all__ = [
    "E4M3",
    "E5M2",
    "FORMATS",
    "TENSORS",
    "Fp8Linear",
    "Fp8LinearFunction",
    "Fp8Meta",
    "Fp8State",
    "amax_of",
    "fp8_cast",
    "fp8_dequantize",
    "fp8_linear",
    "quantize",
]

E4M3: FloatFormat = get_format("e4m3")
E5M2: FloatFormat = get_format("e5m2")
#: the three FP8 tensors of a linear layer, their index in :class:`Fp8Meta`'s arrays
TENSORS: tuple[str, ...] = ("x", "w", "g")
#: TE Format.HYBRID: E4M3 forward, E5M2 backward
FORMATS: dict[str, FloatFormat] = {"x": E4M3, "w": E4M3, "g": E5M2}
_IDX = {n: i for i, n in enumerate(TENSORS)}


# ---------------------------------------------------------------------- cast / dequantize
def fp8_cast(t: torch.Tensor, scale: torch.Tensor | float, fmt: FloatFormat | str) -> torch.Tensor:
    """The FP8 values ``q = RN_fmt(t * scale)``, saturating at ``+-fmt.max``, as float32.

    ``t * scale`` is formed exactly in float64 and rounded once (``round_to``); every FP8 value
    is exact in float32. Runs with torch-function modes disabled.
    """
    fmt = get_format(fmt)
    with torch._C.DisableTorchFunction():
        s = torch.as_tensor(scale, dtype=torch.float32).to(torch.float64)
        q = round_to(t.detach().to(torch.float64) * s, fmt, overflow="saturate")
        return q.to(torch.float32)


def fp8_dequantize(q: torch.Tensor, scale_inv: torch.Tensor | float) -> torch.Tensor:
    """``RN_fp32(q * scale_inv)`` (float32), with torch-function modes disabled."""
    with torch._C.DisableTorchFunction():
        return q.to(torch.float32) * torch.as_tensor(scale_inv, dtype=torch.float32)


def quantize(t: torch.Tensor, scale: torch.Tensor | float, fmt: FloatFormat | str,
             scale_inv: torch.Tensor | float | None = None) -> torch.Tensor:
    """Fake-quant: ``RN_fp32(RN_fmt_sat(t * s) * s_inv)`` in float32 (see the module docstring).

    ``scale_inv`` defaults to ``RN_fp32(1 / scale)`` (what TE stores). Deterministic and
    invisible to torch-function modes (runs under ``torch._C.DisableTorchFunction()``).
    """
    with torch._C.DisableTorchFunction():
        s = torch.as_tensor(scale, dtype=torch.float32)
        s_inv = torch.reciprocal(s) if scale_inv is None else torch.as_tensor(scale_inv, dtype=torch.float32)
        return fp8_dequantize(fp8_cast(t, s, fmt), s_inv)


def amax_of(t: torch.Tensor) -> torch.Tensor:
    """``max |t|`` as a float32 scalar (exact; NaN if ``t`` has a NaN; 0 for an empty ``t``)."""
    with torch._C.DisableTorchFunction():
        a = t.detach().abs()
        if a.numel() == 0:
            return torch.zeros((), dtype=torch.float32)
        return a.amax().to(torch.float32)


# ---------------------------------------------------------------------- patchable hooks
def _reduce_amax(amaxes: torch.Tensor, group: Any) -> torch.Tensor:
    """All-reduce MAX of ``amaxes`` (float32 vector) over ``group`` (the amax reduction group).

    ``None`` means no reduction. Returns a new tensor. Bug B09 replaces it
    (:func:`_reduce_amax_b09`).
    """
    out = amaxes.detach().clone()
    if group is None or dist.get_world_size(group) == 1:
        return out
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


def _backward_amax_group(group: Any, recompute: bool) -> Any:
    """The group the backward (``g``) amax is reduced over at the step boundary: ``group``.

    Bug B12 (:func:`_backward_amax_group_b12`) returns None when activation recompute was on.
    """
    return group


def _gather_for_wgrad(x_local: torch.Tensor, group: Any) -> torch.Tensor:
    """All-gather this rank's saved FP8 input shard ``[t, in]`` along dim 0 -> ``[p*t, in]``
    (TE ``gather_along_first_dim``). Bug B10 replaces it (:func:`_gather_for_wgrad_b10`)."""
    return all_gather_seq(x_local, group)


def _cached_weight_scale_inv(entry: dict, meta: Fp8Meta) -> torch.Tensor:
    """The ``scale_inv`` to decode a cached FP8 weight with: the one stored with it at
    ``is_first_microbatch=True``. Bug B11 replaces it (:func:`_cached_weight_scale_inv_b11`)."""
    return entry["scale_inv"]


# ---------------------------------------------------------------------- delayed scaling state
class Fp8Meta:
    """Delayed-scaling state of one linear layer for ``x``, ``w`` (E4M3) and ``g`` (E5M2).

    Attributes (float32; index 0, 1, 2 = ``x``, ``w``, ``g``, see :data:`TENSORS`):
        amax_history: ``[history, 3]``, newest row first.
        amax: ``[3]``, the running amax of the current step (max over every microbatch's
            unquantized tensor, updated in each forward / backward).
        scale, scale_inv: ``[3]``; ``scale_inv = RN_fp32(1 / scale)``. Initially 1.
        recompute: whether a forward of this step ran with ``recompute=True``.
        fp8_max: ``[3]``, 448, 448, 57344.

    The update rule is in the module docstring; :meth:`end_step` applies it. The tensors are
    replaced, never modified in place, so references taken earlier (e.g. by autograd's
    saved context) keep their values.
    """

    def __init__(self, history: int = 4, margin: int = 0):
        if history < 1:
            raise ValueError(f"history must be >= 1, got {history}")
        self.history = int(history)
        self.margin = int(margin)
        self.fp8_max = torch.tensor([FORMATS[n].max for n in TENSORS], dtype=torch.float32)
        self.amax_history = torch.zeros(self.history, len(TENSORS), dtype=torch.float32)
        self.amax = torch.zeros(len(TENSORS), dtype=torch.float32)
        self.scale = torch.ones(len(TENSORS), dtype=torch.float32)
        self.scale_inv = torch.ones(len(TENSORS), dtype=torch.float32)
        self.recompute = False
        self.steps = 0

    # -------------------------------------------------------------- per microbatch
    def record(self, name: str, t: torch.Tensor) -> None:
        """``amax[name] = max(amax[name], max|t|)`` (NaN propagates)."""
        i = _IDX[name]
        with torch._C.DisableTorchFunction():
            a = self.amax.clone()
            a[i] = torch.maximum(a[i], amax_of(t))  # torch.maximum propagates NaN
            self.amax = a

    def scale_of(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, scale_inv)`` of ``name`` as fresh float32 scalars."""
        i = _IDX[name]
        return self.scale[i].clone(), self.scale_inv[i].clone()

    # -------------------------------------------------------------- step boundary
    def end_step(self, group: Any = None) -> None:
        """Reduce the running amaxes over ``group`` (None: no reduction; ``g`` over
        ``_backward_amax_group(group, self.recompute)``), push them into the history and
        recompute the scales: ``s = RN_fp32(fp8_max / max(history)) / 2**margin`` where the
        history max is positive and finite, else the old scale; ``s_inv = RN_fp32(1/s)``.
        Then reset the running amax and the recompute flag."""
        with torch._C.DisableTorchFunction():
            fwd = _reduce_amax(self.amax[:2], group)
            bwd = _reduce_amax(self.amax[2:], _backward_amax_group(group, self.recompute))
            a = torch.cat([fwd, bwd]).to(torch.float32)
            self.amax_history = torch.cat([a[None], self.amax_history[:-1]], dim=0)
            m = self.amax_history.amax(dim=0)  # NaN if any entry is NaN
            self.scale = self._scales(m, self.scale)
            self.scale_inv = torch.reciprocal(self.scale)
            self.amax = torch.zeros_like(self.amax)
            self.recompute = False
            self.steps += 1

    def _scales(self, m: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        """TE ``_default_sf_compute`` via ``ttrace_num.scaling.scales_from_amax`` (float64
        quotient rounded once to fp32: equal to the fp32 division, as 53 >= 2*24 + 2)."""
        recipe = ScalingRecipe.per_tensor(margin=self.margin)
        new = torch.stack([scales_from_amax(m[i], FORMATS[n], recipe)[0] for i, n in enumerate(TENSORS)])
        ok = (m > 0) & torch.isfinite(m)
        return torch.where(ok, new.to(torch.float32), old)

    def state(self) -> dict[str, torch.Tensor]:
        """Copies of the state, for traces and tests."""
        return {"amax_history": self.amax_history.clone(), "amax": self.amax.clone(),
                "scale": self.scale.clone(), "scale_inv": self.scale_inv.clone()}

    def __repr__(self) -> str:
        return (f"Fp8Meta(steps={self.steps}, scale={self.scale.tolist()}, amax={self.amax.tolist()}, "
                f"history_max={self.amax_history.amax(0).tolist()})")


# ---------------------------------------------------------------------- FP8 linear
def _weight_fp8(weight: torch.Tensor, meta: Fp8Meta, cache: dict | None,
                is_first_microbatch: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_w, s_inv_w)`` with TE's ``is_first_microbatch`` caching semantics."""
    if is_first_microbatch is not None and cache is None:
        raise ValueError("is_first_microbatch needs a cache dict")
    if is_first_microbatch is False:
        if "weight" not in cache:
            raise ValueError("is_first_microbatch=False but the cache holds no FP8 weight "
                             "(run a microbatch with is_first_microbatch=True first)")
        entry = cache["weight"]
        return entry["q"], _cached_weight_scale_inv(entry, meta)
    meta.record("w", weight)
    s, s_inv = meta.scale_of("w")
    q = fp8_cast(weight, s, FORMATS["w"])
    if is_first_microbatch:
        cache["weight"] = {"q": q, "scale_inv": s_inv.clone()}
    return q, s_inv


class Fp8LinearFunction(torch.autograd.Function):
    """``y = x' W'^T`` with FP8 fake-quant (see the module docstring for the math).

    ``apply(x, weight, meta, sp_group, cache, is_first_microbatch, recompute)``. The backward
    is a plain staticmethod that looks up module-level names only, so
    ``perturb_custom_backward`` can wrap it.
    """

    @staticmethod
    def forward(ctx, x, weight, meta, sp_group, cache, is_first_microbatch, recompute):
        with torch._C.DisableTorchFunction():
            meta.record("x", x)
            if recompute:
                meta.recompute = True
            s_x, s_inv_x = meta.scale_of("x")
            q_x = fp8_cast(x, s_x, FORMATS["x"])
            q_w, s_inv_w = _weight_fp8(weight, meta, cache, is_first_microbatch)
            q_full = all_gather_seq(q_x, sp_group)  # identity for sp_group=None
            xq = fp8_dequantize(q_full, s_inv_x)
            wq = fp8_dequantize(q_w, s_inv_w)
        y = torch.matmul(xq, wq.t()).to(x.dtype)  # the GEMM: visible to torch-function modes
        ctx.save_for_backward(q_x, q_w)
        ctx.s_inv_x, ctx.s_inv_w = s_inv_x, s_inv_w
        ctx.meta, ctx.sp_group = meta, sp_group
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        return y

    @staticmethod
    def backward(ctx, g):
        q_x, q_w = ctx.saved_tensors
        meta, sp_group = ctx.meta, ctx.sp_group
        with torch._C.DisableTorchFunction():
            meta.record("g", g)
            s_g, s_inv_g = meta.scale_of("g")
            gq = quantize(g, s_g, FORMATS["g"], s_inv_g)
            wq = fp8_dequantize(q_w, ctx.s_inv_w)
            q_full = _gather_for_wgrad(q_x, sp_group) if sp_group is not None else q_x
            xq = fp8_dequantize(q_full, ctx.s_inv_x)
        dx = torch.matmul(gq, wq).to(ctx.x_dtype)      # dgrad GEMM
        dw = torch.matmul(gq.t(), xq).to(ctx.w_dtype)  # wgrad GEMM
        if sp_group is not None:
            with torch._C.DisableTorchFunction():
                dx = reduce_scatter_seq_raw(dx, sp_group)
        return dx, dw, None, None, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, meta: Fp8Meta, *, sp_group: Any = None,
               cache: dict | None = None, is_first_microbatch: bool | None = None,
               recompute: bool = False) -> torch.Tensor:
    """FP8 ``x W^T`` (``x``: ``[tokens, in]``, or this rank's sequence shard with ``sp_group``;
    ``weight``: ``[out, in]`` or this rank's column shard). See :class:`Fp8LinearFunction`."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"fp8_linear needs x [tokens, in] and weight [out, in]; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    return Fp8LinearFunction.apply(x, weight, meta, sp_group, cache, is_first_microbatch, recompute)


class Fp8Linear(torch.nn.Module):
    """A bias-free linear layer computed in FP8 (``weight`` ``[out, in]``, an :class:`Fp8Meta`
    and a weight cache). ``weight`` is initialised from ``seed`` (``N(0, 1/in)`` in float32,
    then cast to ``dtype``), independently of the global RNG."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype = torch.float32,
                 seed: int = 0, history: int = 4, margin: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        w = torch.randn(out_features, in_features, generator=gen, dtype=torch.float32) * in_features ** -0.5
        self.weight = torch.nn.Parameter(w.to(dtype))
        self.meta = Fp8Meta(history=history, margin=margin)
        self.cache: dict = {}

    def forward(self, x: torch.Tensor, sp_group: Any = None, is_first_microbatch: bool | None = None,
                recompute: bool = False) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.meta, sp_group=sp_group, cache=self.cache,
                          is_first_microbatch=is_first_microbatch, recompute=recompute)

    def end_step(self, group: Any = None) -> None:
        """The step boundary (:meth:`Fp8Meta.end_step`)."""
        self.meta.end_step(group)

    def extra_repr(self) -> str:
        return f"in={self.weight.shape[1]}, out={self.weight.shape[0]}, dtype={self.weight.dtype}"


class Fp8State(torch.nn.Module):
    """One FP8 linear's state (an :class:`Fp8Meta` and a weight cache) for a module that owns
    its weight elsewhere (``examples/torch_parallel/model.py``): ``linear(x, weight,
    microbatch=k, ...)`` is :func:`fp8_linear` with ``is_first_microbatch = (k == 0)`` (TE's
    gradient-accumulation usage: the weight is cast on microbatch 0 of each step and reused).

    A module so that the delayed-scaling state travels with the model: ``get_extra_state`` /
    ``set_extra_state`` (PyTorch's protocol for non-tensor module state, used by
    ``state_dict`` and by :class:`tracer.capture.noise_sampler.StateSnapshot`) copy the amax history,
    running amax, scales and flags. The weight cache is not state: it is refilled on
    microbatch 0 of every step."""

    def __init__(self, history: int = 4, margin: int = 0):
        super().__init__()
        self.meta = Fp8Meta(history=history, margin=margin)
        self.cache: dict = {}

    def linear(self, x: torch.Tensor, weight: torch.Tensor, *, microbatch: int, sp_group: Any = None,
               recompute: bool = False) -> torch.Tensor:
        return fp8_linear(x, weight, self.meta, sp_group=sp_group, cache=self.cache,
                          is_first_microbatch=(microbatch == 0), recompute=recompute)

    def end_step(self, group: Any = None) -> None:
        """The step boundary (:meth:`Fp8Meta.end_step`)."""
        self.meta.end_step(group)

    def get_extra_state(self) -> dict[str, Any]:
        return {**self.meta.state(), "recompute": self.meta.recompute, "steps": self.meta.steps}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        m = self.meta
        m.amax_history, m.amax = state["amax_history"].clone(), state["amax"].clone()
        m.scale, m.scale_inv = state["scale"].clone(), state["scale_inv"].clone()
        m.recompute, m.steps = bool(state["recompute"]), int(state["steps"])
