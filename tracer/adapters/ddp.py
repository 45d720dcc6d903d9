"""Tracing a plain PyTorch data-parallel run (``DistributedDataParallel``).

:class:`DDPTracer` wraps a :class:`tracer.capture.hooks.Tracer` around the module under DDP and adds
what a data-parallel comparison needs (see docs/tracing-pytorch.md):

* **microbatch numbers**: rank ``r``'s local microbatch ``i`` is the global microbatch
  ``r * num_microbatches + i`` (:meth:`DDPTracer.microbatch`, through
  :meth:`Tracer.set_microbatch`). A global batch split the same way on a single device
  then gives every activation record the same ``(name, microbatch)`` key in both runs, and
  activations, activation gradients and losses need no placement at all: each is a whole
  tensor held by exactly one rank.
* **activation-gradient scale**: DDP *averages* gradients over the ``dp`` ranks. With each
  rank's loss the mean over its own samples, the global loss is ``1/dp`` times the sum of
  the per-rank losses, so every activation gradient of a DDP rank is ``dp`` times its
  single-device counterpart: they are stored multiplied by ``grad_scale = 1/dp`` (exact for
  ``dp`` a power of two; otherwise one rounding of the stored copy, never of the run).
* **parameters** (phases ``grad`` and ``param``) are replicated over the DP group: each
  rank's copy is stored with a ``replicated`` placement over ``dp``, and the checker
  requires the copies to agree bitwise (a skipped or extra all-reduce shows as disagreeing
  replicas). ``grad`` is ``p.grad`` after the backward of the last microbatch (DDP has
  all-reduced it by the time ``backward()`` returns), ``param`` the values after
  ``optimizer.step()``.
* **loss** (phase ``loss``): the per-microbatch loss the caller passes to
  :meth:`DDPTracer.record_loss`, before any ``1/num_microbatches`` scaling.

The single-device reference uses the same class with ``dp=1`` (the default outside a
process group), so one training-loop function serves both runs.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from tracer.trace.canonical import Placement, ShardDim
from tracer.capture.hooks import Tracer
from tracer.capture.optim_state import main_param_and_state, optimizer_options
from tracer.trace.schema import Phase
from tracer.trace.store import TraceWriter
from tracer.adapters.base import phases_of

__all__ = ["DDPTracer", "ddp_placement"]

_MODULE_CAPTURES = ("fwd_in", "fwd_out", "bwd_out", "bwd_in")


def ddp_placement(dp_rank: int, dp: int) -> dict[str, Any]:
    """Placement dict of a parameter or its reduced gradient on DP rank ``dp_rank`` of ``dp``:
    replicated over the ``dp`` group (no dims when ``dp == 1``)."""
    dims = (ShardDim(None, "dp", dp_rank, dp, "replicated"),) if dp > 1 else ()
    return Placement(dims).to_dict()


class DDPTracer:
    """Trace one rank of a plain PyTorch (DDP) training loop (see the module docstring).

    Args:
        model: the model, wrapped in ``DistributedDataParallel`` or not (the wrapper's
            ``.module`` is traced, so names are those of the single-device model).
        writer: this rank's :class:`~tracer.trace.store.TraceWriter`.
        num_microbatches: microbatches per step on this rank.
        dp_rank, dp: this rank and the data-parallel size; default: the default process
            group's rank and size when one is initialised, else ``0`` and ``1``.
        include, exclude: ``fnmatch`` patterns on local module names (as ``Tracer``); they
            select the traced parameters too.
        capture: subset of ``fwd_in fwd_out bwd_out bwd_in grad options param optim``;
            ``options``: after the optimizer step, the numeric options of its param groups
            (:func:`tracer.capture.optim_state.optimizer_options`; needs ``optimizer``), replicated over
            every rank of the default process group and compared exactly; ``optim``: after
            the optimizer step, each param's main copy and Adam moments (phases ``main_param``,
            ``exp_avg``, ``exp_avg_sq``; needs ``optimizer``), for a reference re-synchronised to
            this run (:mod:`tracer.capture.resync`).
        placement_fn, param_placement, loss_placement, grad_scale: for models sharded beyond
            data parallelism (e.g. the tensor/context-parallel harness of
            ``examples/torch_parallel``): the placement of module records (as
            :class:`~tracer.capture.hooks.Tracer`), of a parameter and its gradient by local name
            (default: replicated over DP), of the per-microbatch loss (default: none, one
            rank holds it), and the activation-gradient scale (default ``1/dp``).
        module_meta: extra meta for the records of matching modules (as
            :class:`~tracer.capture.hooks.Tracer`; e.g. an MoE router's top-k, :mod:`tracer.compare.decisions`).
        optimizer: the run's optimizer (captures ``optim`` and ``options``).
        name_fn, outputs_first, grad_placement_from_forward: as :class:`~tracer.capture.hooks.Tracer`
            (an adapter built on this one, :class:`tracer.adapters.dtensor.DTensorTracer`, strips wrapper
            names, records outputs before other forward hooks and places a gradient as its tensor).
    """

    def __init__(self, model: nn.Module, writer: TraceWriter, *, num_microbatches: int = 1,
                 dp_rank: int | None = None, dp: int | None = None, include: Sequence[str] = ("*",),
                 exclude: Sequence[str] = (),
                 capture: Sequence[str] = ("fwd_in", "fwd_out", "bwd_out", "grad", "param"),
                 placement_fn: Callable[[str, str, torch.Tensor], dict[str, Any]] | None = None,
                 param_placement: Callable[[str], dict[str, Any]] | None = None,
                 loss_placement: dict[str, Any] | None = None, grad_scale: float | None = None,
                 module_meta: dict[str, dict[str, Any]] | None = None, optimizer: Any = None,
                 role: str | None = None, layout: dict[str, Any] | None = None,
                 name_fn: Callable[[str], str] | None = None, outputs_first: bool = False,
                 grad_placement_from_forward: bool = False) -> None:
        import torch.distributed as dist
        dist_on = dist.is_available() and dist.is_initialized()
        self.dp = int(dp if dp is not None else (dist.get_world_size() if dist_on else 1))
        self.dp_rank = int(dp_rank if dp_rank is not None else (dist.get_rank() if dist_on else 0))
        self.module = getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model
        self.writer = writer
        self.num_microbatches = int(num_microbatches)
        self.capture = set(capture)
        self.tracer = Tracer(self.module, writer, include=include, exclude=exclude,
                             capture=[c for c in capture if c in _MODULE_CAPTURES], placement_fn=placement_fn,
                             grad_scale=1.0 / self.dp if grad_scale is None else grad_scale,
                             module_meta=module_meta, name_fn=name_fn, outputs_first=outputs_first,
                             grad_placement_from_forward=grad_placement_from_forward)
        self.params = {local: p for local, (_canon, p) in self.tracer.params.items()}
        placement = ddp_placement(self.dp_rank, self.dp)
        self.param_placement = param_placement or (lambda local: placement)
        self.loss_placement = loss_placement
        self.optimizer = optimizer
        for needs_optimizer in ("optim", "options"):
            if needs_optimizer in self.capture and optimizer is None:
                raise ValueError(f"capture {needs_optimizer!r} records the optimizer's state or options: pass "
                                 "DDPTracer(..., optimizer=...)")
        world, rank = (dist.get_world_size(), dist.get_rank()) if dist_on else (1, 0)
        #: every rank holds the same optimizer options (capture ``options``)
        self.options_placement = Placement((ShardDim(None, "world", rank, world, "replicated"),)
                                           if world > 1 else ()).to_dict()
        #: ``"reference"`` or ``"candidate"`` (:class:`tracer.adapters.base.Adapter`); default: a
        #: single-rank run is the reference
        self.role = role or ("reference" if world == 1 else "candidate")
        self._layout = dict(layout) if layout is not None else {"dp": self.dp}

    @contextlib.contextmanager
    def step(self, step: int, writer: TraceWriter | None = None) -> Iterator[DDPTracer]:
        """Trace one optimizer step into ``writer`` (e.g. a noise sample's, see
        :class:`tracer.capture.noise_sampler.NoiseSampler`) or the tracer's own; flushes at the end."""
        self.tracer.writer = writer or self.writer
        try:
            with self.tracer.step(step):
                self.microbatch(0)
                yield self
        finally:
            self.tracer.writer = self.writer

    def microbatch(self, i: int) -> None:
        """Start local microbatch ``i`` (records get the global number ``dp_rank * n + i``)."""
        self.tracer.set_microbatch(self.dp_rank * self.num_microbatches + int(i))

    def record_loss(self, loss: torch.Tensor) -> None:
        """Record this microbatch's loss (phase ``loss``; call before scaling it)."""
        self.tracer.record("loss", loss.detach(), Phase.LOSS, placement=self.loss_placement)

    def _record_params(self, tensors_of: Callable[[torch.Tensor], dict[str, torch.Tensor | None]]) -> None:
        """Record ``tensors_of(p)`` (phase -> tensor, None: not recorded) of every parameter, in
        the parameter's placement."""
        self.tracer.set_microbatch(0)  # per-step tensors, not of a microbatch
        for local, (canon, p) in self.tracer.params.items():
            for phase, t in tensors_of(p).items():
                if t is not None:
                    self.tracer.record(canon, t.detach(), phase, placement=self.param_placement(local),
                                       meta={"param": local})

    def after_backward(self) -> None:
        """Record the reduced gradients (phase ``grad``); call after the last microbatch's
        backward (DDP's all-reduce has completed when ``backward()`` returns)."""
        if "grad" in self.capture:
            self._record_params(lambda p: {Phase.GRAD: p.grad})

    def after_optimizer_step(self) -> None:
        """Record the optimizer's options (capture ``options``), the updated parameters (phase
        ``param``), and with capture ``optim`` each param's main copy and Adam moments; call
        after ``optimizer.step()``."""
        if "options" in self.capture:
            with torch._C.DisableTorchFunction():  # the tracer's own arithmetic: no noise injector sees it
                options = optimizer_options(self.optimizer)
            for name, t in options.items():
                self.tracer.record(f"optimizer.{name}", t, Phase.OPTIONS, placement=self.options_placement)
        if "param" in self.capture:
            self._record_params(lambda p: {Phase.PARAM: p})
        if "optim" in self.capture:
            self._record_params(lambda p: main_param_and_state(self.optimizer, p)[0])

    def remove(self) -> None:
        """Remove every hook."""
        self.tracer.remove()

    # the adapter protocol (tracer.adapters.base.Adapter) ---------------------------------------
    @property
    def layout(self) -> dict[str, Any]:
        """The run's layout, the same on every rank: ``{"dp": dp}``, or the ``layout`` given
        (a harness sharded beyond DP names its other sizes there)."""
        return dict(self._layout)

    @property
    def phases(self) -> tuple[Phase, ...]:
        """The phases this tracer records (the loss when :meth:`record_loss` is called)."""
        return phases_of(self.capture)

    def canonical_name(self, local: str) -> str:
        """The single-device name of ``local``: the name itself (DDP's ``.module`` is traced)."""
        return self.tracer.name_fn(local)

    def record_placement(self, local: str, name: str, t: torch.Tensor) -> Placement:
        """Placement of a module record: ``placement_fn``'s, else the whole tensor on one rank."""
        return Placement.of(self.tracer.placement_fn(local, name, t) if self.tracer.placement_fn else None)

    def parameter_placement(self, local: str, phase: str) -> Placement:
        """Placement of parameter ``local``'s record (the same in every phase)."""
        return Placement.of(self.param_placement(local))

    def close(self) -> None:
        """End tracing (:meth:`remove`)."""
        self.remove()

