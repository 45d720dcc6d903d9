"""Trace collection for plain PyTorch modules: hooks that copy tensors into a TraceWriter.

:class:`Tracer` attaches hooks to the selected submodules of a model and hands
copies of what flows through them to a :class:`tracer.trace.store.TraceWriter`:

==========  =======  ==========================================================
capture     phase    record name (``M`` = canonical module name)
==========  =======  ==========================================================
fwd_in      fwd      ``M.input`` / ``M.input.<i>`` / ``M.input.<kw>`` (pre-hook)
fwd_out     fwd      ``M.output`` / ``M.output.<i>`` (forward hook)
bwd_out     bwd      ``M.output_grad[...]``: d loss / d output (tensor hook)
bwd_in      bwd      ``M.input_grad[...]``: d loss / d input (tensor hook)
grad        grad     ``M.<param>``: ``param.grad`` after it is accumulated
param       param    ``M.<param>``: parameter values, at :meth:`Tracer.record_params`
==========  =======  ==========================================================

Nested outputs (tuples, lists, dicts) get one suffix per level (``.0``, ``.key``);
a single tensor gets none. The root module's name is ``""``, so its records are
``input``/``output``. Gradients of activations are taken with
``tensor.register_hook`` on the module's output/input tensors, never with
``register_full_backward_hook`` (whose identity wrappers forbid in-place ops on
module outputs, e.g. ``ReLU(inplace=True)`` after a ``Linear``). Hence a tensor's
gradient is autograd's total gradient of that tensor (summed over all its uses):
``bwd_in`` of a module equals its own input gradient when it is the input's only
consumer (a chain), and includes e.g. the residual branch otherwise. Hooks
registered before an in-place modification of the tensor receive the gradient
with respect to the value before the modification, which is the one traced.

Numerics: the hooks only read. Each hook returns ``None`` (so neither inputs,
outputs nor gradients are replaced), never writes to a tensor, and takes a single
copy: CPU tensors go straight to ``TraceWriter.add`` (which copies); tensors on an
accelerator are ``detach().clone()``-d on their device (asynchronous, no host
sync, no ``.item()``) and handed to the writer at :meth:`Tracer.end_step`.

Activation recomputation (``torch.utils.checkpoint``) runs forward hooks again inside
the backward pass; there (autograd's current graph task is set) the forward tensors
are not traced again, only gradient hooks are registered (the reentrant variant
differentiates the recomputed graph), so a checkpointed model traces the same
records as a plain one.

Execution index: every record of a step gets the next integer, in the order the
tensors were produced (forward pre/post hooks in call order, then backward hooks
in the order autograd computes the gradients), continuing over microbatches.
"""
from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Self

import torch
from torch import nn

from tracer.errors import TraceError
from tracer.trace.dtensor import local_shard
from tracer.trace.schema import Phase
from tracer.trace.store import TraceWriter

CAPTURES = ("fwd_in", "fwd_out", "bwd_out", "bwd_in", "grad", "param")


def _in_backward() -> bool:
    """True while autograd runs a backward pass on this thread: forward hooks firing then
    come from activation recomputation (``torch.utils.checkpoint``), already traced."""
    return torch._C._current_graph_task_id() != -1


def _needs_grad_hook(t: torch.Tensor, recompute: bool) -> bool:
    """Watch ``t``'s gradient? In a recomputation, leaves (the checkpoint's inputs, or
    their detached copies) were already watched by the original forward."""
    return t.requires_grad and not (recompute and t.grad_fn is None)


def _join(prefix: str, leaf: str) -> str:
    return ".".join(part for part in (prefix, leaf) if part)


def _flatten(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(suffix, tensor) for each tensor in nested tuples/lists/dicts; suffix '' for a bare tensor.
    Parameters passed or returned by a module (a tied weight, a bias returned for a later
    fused add) are skipped: they are traced as parameters (phases grad/param), and a hook on
    a parameter would outlive the microbatch that registered it."""
    if isinstance(obj, nn.Parameter):
        return
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from _flatten(v, _join(path, str(i)))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flatten(v, _join(path, str(k)))


def _inputs(args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    """Tensors among a call's arguments; a lone positional tensor gets no suffix."""
    items = list(_flatten(args[0] if len(args) == 1 and not kwargs else args))
    items += list(_flatten(kwargs))
    return items


def _outputs(output: Any) -> list[tuple[str, torch.Tensor]]:
    return list(_flatten(output))


class Tracer:
    """Collects a model's activations, gradients and parameters into a TraceWriter.

    ``include``/``exclude`` are ``fnmatch`` patterns on local module names (``""`` is
    the root); a parameter is selected when its module name or its full name
    matches an include pattern and neither matches an exclude pattern.
    ``capture`` is a subset of :data:`CAPTURES`. ``name_fn`` maps a local module name
    to its canonical name (default: identity); parameter names are
    ``name_fn(module) + "." + leaf``. ``placement_fn(local, name, tensor)`` maps the local
    module name (module records) or local parameter name (grad/param records), the record's
    canonical name and the tensor to the writer's ``placement`` dict. ``grad_scale``:
    activation gradients (``bwd``) are stored multiplied by it (a copy; e.g. ``1/dp`` for
    Megatron, whose per-rank loss is ``dp`` times its share of the global mean). Every
    record goes to ``writer.add`` in the hook, which waits for no device: a tensor on an
    accelerator is staged (``TraceWriter``'s ``stage``) and read at the flush.
    ``module_meta``: ``fnmatch`` pattern on local module names -> extra meta for every record
    of a matching module, read back by the checker (e.g. ``{"*.router.linear":
    tracer.compare.decisions.topk_meta(2)}``: that module's output scores a top-2 choice).
    ``outputs_first``: the forward hooks run before any the module already has (``prepend``),
    so outputs are recorded as the module computed them, before e.g. a tensor-parallel style
    turns a ``DTensor`` into its local tensor or redistributes a pending sum.
    ``grad_placement_from_forward``: an activation gradient's placement is ``placement_fn``'s for
    the forward tensor it is the gradient of (taken when the tensor is produced), for adapters
    that know a tensor's layout by its identity.

    DTensors (FSDP2, tensor parallelism) are recorded as their local shard with the placement
    their spec gives (:mod:`tracer.trace.dtensor`) unless the caller passes a placement (an adapter
    that knows the run's whole mesh: a parameter on a sub-mesh is replicated over the rest);
    ``placement_fn`` is asked about other tensors only.

    Usage::

        tracer = Tracer(model, writer)
        for step in range(n):
            with tracer.step(step):
                for mb, batch in enumerate(batches):
                    if mb:
                        tracer.next_microbatch()
                    loss = loss_fn(model(batch))
                    tracer.record("loss", loss, phase="loss")
                    loss.backward()
                opt.step()
                tracer.record_params()
        tracer.remove()

    Hooks are silent outside a step (e.g. evaluation passes).
    """

    def __init__(self, model: nn.Module, writer: TraceWriter, *, include: Sequence[str] = ("*",),
                 exclude: Sequence[str] = (), capture: Sequence[str] = CAPTURES,
                 name_fn: Callable[[str], str] | None = None,
                 placement_fn: Callable[[str, str, torch.Tensor], dict[str, Any]] | None = None,
                 grad_scale: float = 1.0,
                 module_meta: dict[str, dict[str, Any]] | None = None, outputs_first: bool = False,
                 grad_placement_from_forward: bool = False) -> None:
        unknown = set(capture) - set(CAPTURES)
        if unknown:
            raise ValueError(f"unknown capture kinds {sorted(unknown)}; choose from {CAPTURES}")
        self.model, self.writer = model, writer
        self.include, self.exclude = list(include), list(exclude)
        self.capture = frozenset(capture)
        self.name_fn = name_fn or (lambda name: name)
        self.placement_fn = placement_fn
        self.module_meta = dict(module_meta or {})
        self._wildcards = {p: any(c in p for c in "*?[") for p in self.module_meta}  # exact names: no fnmatch
        self.grad_scale = float(grad_scale)
        self.outputs_first = bool(outputs_first)
        self.grad_placement_from_forward = bool(grad_placement_from_forward)
        self._step: int | None = None
        self._microbatch = 0
        self._index = 0
        self._calls: dict[tuple[str, str, int], int] = {}
        self._handles: list[Any] = []
        self._tensor_handles: list[Any] = []
        self.modules = {n: m for n, m in model.named_modules() if self._selected(n)}
        self.params = self._selected_params()
        self._attach()

    # selection ---------------------------------------------------------------
    def _selected(self, *names: str) -> bool:
        hit = lambda pats: any(fnmatch.fnmatchcase(n, p) for n in names for p in pats)
        return hit(self.include) and not hit(self.exclude)

    def _selected_params(self) -> dict[str, tuple[str, nn.Parameter]]:
        """local param name -> (canonical name, parameter), in ``named_parameters`` order."""
        out = {}
        for full, p in self.model.named_parameters():
            owner, _, leaf = full.rpartition(".")
            if self._selected(owner, full):
                out[full] = (_join(self.name_fn(owner), leaf), p)
        return out

    # hook registration -----------------------------------------------------------
    def _attach(self) -> None:
        for local, module in self.modules.items():
            canon = self.name_fn(local)
            if {"fwd_in", "bwd_in"} & self.capture:
                self._handles.append(module.register_forward_pre_hook(
                    self._pre_hook(local, canon), with_kwargs=True))
            if {"fwd_out", "bwd_out"} & self.capture:
                self._handles.append(module.register_forward_hook(self._post_hook(local, canon),
                                                                  prepend=self.outputs_first))
        if "grad" in self.capture:
            for local, (canon, p) in self.params.items():
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(
                        self._grad_hook(local, canon)))

    def _pre_hook(self, local: str, canon: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self._step is None:
                return
            recompute = _in_backward()
            for suffix, t in _inputs(args, kwargs):
                name = _join(canon, _join("input", suffix))
                if "fwd_in" in self.capture and not recompute:
                    self._emit(name, t, Phase.FWD, local)
                if "bwd_in" in self.capture and _needs_grad_hook(t, recompute):
                    self._watch_grad(t, _join(canon, _join("input_grad", suffix)), local)
        return hook

    def _post_hook(self, local: str, canon: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if self._step is None:
                return
            recompute = _in_backward()
            for suffix, t in _outputs(output):
                if "fwd_out" in self.capture and not recompute:
                    self._emit(_join(canon, _join("output", suffix)), t, Phase.FWD, local)
                if "bwd_out" in self.capture and _needs_grad_hook(t, recompute):
                    self._watch_grad(t, _join(canon, _join("output_grad", suffix)), local)
        return hook

    def _watch_grad(self, t: torch.Tensor, name: str, local: str) -> None:
        microbatch = self._microbatch  # the microbatch whose forward produced the tensor
        placement = (self.placement_fn(local, name, t) if self.grad_placement_from_forward and
                     self.placement_fn is not None else None)

        def hook(grad: torch.Tensor) -> None:
            if self._step is not None:
                g = grad if self.grad_scale == 1.0 else grad * self.grad_scale  # a scaled copy
                self._emit(name, g, Phase.BWD, local, microbatch=microbatch, placement=placement,
                           meta={"scaled_by": self.grad_scale} if self.grad_scale != 1.0 else None)
        self._tensor_handles.append(t.register_hook(hook))

    def _grad_hook(self, local: str, canon: str) -> Callable:
        def hook(p: torch.Tensor) -> None:
            if self._step is not None and p.grad is not None:
                self._emit(canon, p.grad, Phase.GRAD, local)
        return hook

    # recording -----------------------------------------------------------------
    def _emit(self, name: str, tensor: torch.Tensor, phase: str, local: str | None, *,
              microbatch: int | None = None, meta: dict[str, Any] | None = None,
              placement: dict[str, Any] | None = None) -> None:
        """Assign the next execution index and hand one copy of ``tensor`` to the writer."""
        if self._step is None:
            raise TraceError("no step is active: call begin_step(step) or use `with tracer.step(step)`",
                             tensor=name)
        mb = self._microbatch if microbatch is None else microbatch
        call = self._calls.get((phase, name, mb), 0)
        self._calls[(phase, name, mb)] = call + 1
        meta = dict(meta or {})
        if local is not None:
            meta.setdefault("module", local)
            for pattern, extra in self.module_meta.items():
                if pattern == local or (self._wildcards.get(pattern) and fnmatch.fnmatchcase(local, pattern)):
                    meta.update(extra)
        meta.setdefault("call", call)
        tensor, spec = local_shard(tensor)
        if placement is None:  # a DTensor's own spec, unless the caller knows more (its whole mesh)
            placement = spec
        if placement is None and self.placement_fn is not None and local is not None:
            placement = self.placement_fn(local, name, tensor)
        index, self._index = self._index, self._index + 1
        self.writer.add(name, tensor, phase=phase, step=self._step, microbatch=mb, index=index,
                        placement=placement, meta=meta)

    def record(self, name: str, tensor: torch.Tensor, phase: str, *,
               placement: dict[str, Any] | None = None, meta: dict[str, Any] | None = None) -> None:
        """Record an arbitrary tensor (e.g. ``record("loss", loss, phase="loss")``) under
        ``name`` as given (``name_fn`` is not applied), at the next execution index."""
        self._emit(name, tensor, phase, None, placement=placement, meta=meta)

    def record_params(self) -> None:
        """Record the selected parameters' values (call after ``optimizer.step()``)."""
        if "param" not in self.capture:
            return
        for local, (canon, p) in self.params.items():
            self._emit(canon, p, Phase.PARAM, local)

    # step bookkeeping -------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Start tracing ``step`` (microbatch 0, execution index 0)."""
        if self._step is not None:
            raise TraceError(f"step {self._step} is still active: call end_step() first", step=step)
        self._step, self._microbatch, self._index = int(step), 0, 0
        self._calls.clear()

    def next_microbatch(self) -> int:
        """Advance to the next microbatch of the current step; returns its number."""
        if self._step is None:
            raise TraceError("no step is active")
        self._microbatch += 1
        return self._microbatch

    @property
    def active(self) -> bool:
        """True between ``begin_step`` and ``end_step``."""
        return self._step is not None

    def set_microbatch(self, microbatch: int) -> None:
        """Number the records that follow as ``microbatch`` (e.g. a global microbatch number
        under data parallelism, or the microbatch a pipeline schedule runs next)."""
        if self._step is None:
            raise TraceError("no step is active")
        self._microbatch = int(microbatch)

    def end_step(self) -> None:
        """Flush the step (``writer.flush_step``)."""
        if self._step is None:
            raise TraceError("no step is active")
        step = self._step
        self._close_step()
        self.writer.flush_step(step)

    def _close_step(self) -> None:
        self._step = None
        for h in self._tensor_handles:
            h.remove()
        self._tensor_handles.clear()

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[Tracer]:
        """``with tracer.step(s): ...`` = ``begin_step(s)`` ... ``end_step()``. On an
        exception the step is abandoned (nothing flushed by the tracer)."""
        self.begin_step(step)
        try:
            yield self
        except BaseException:
            self._close_step()
            raise
        self.end_step()

    def remove(self) -> None:
        """Remove every module, parameter and tensor hook this tracer registered."""
        self._close_step()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.remove()
