"""The reference side of a comparison: noisy trajectories that give the thresholds.

A reference run traced with :class:`NoiseSampler` runs every training step ``S + 1`` times
from the same batch: once clean (traced by the caller's own writer), which advances the run,
then ``S`` times under :class:`ttrace_num.propagate.noise.NoiseInjector` (every modelled op
perturbed by its probabilistic local bound for the difference between the reference's and
the candidate's computation models), each traced into ``root/noise/sample_<i>``. Each sample is its own trajectory: it continues from its own model and
optimizer state of the previous step, so its deviations include those propagated from
earlier steps, as a candidate's do (or, with ``restart=True`` for a reference re-synchronised
to its candidate at every step, :mod:`tracer.capture.resync`, each sample starts every step from the
clean state before it). :mod:`tracer.compare.thresholds` turns the samples into
per-tensor thresholds; :func:`tracer.compare.check.compare` finds them under ``root/noise``.

The state of a step (model parameters and buffers, the optimizer's parameters -- the fp32 main
parameters of a mixed-precision optimizer -- and its state, e.g. Adam's moments) is
snapshotted and restored bit for bit around the samples. Cost: ``S`` extra steps per step,
plus ``S + 1`` copies of the model and optimizer state in memory. By default a sample's trace
stores, per tensor, the three moments of its deviation from the clean step and its block
coordinates that the thresholds need instead of the tensor (:mod:`tracer.compare.deviation`: at most
152 bytes per tensor, one float64 copy of
a step's traced tensors in memory while its samples run). The samples of a step share
their noise amplitudes (:mod:`ttrace_num.propagate.memo`): the first sample computes each op's
local bound, the others reuse it where their operands match (and recompute only the rows of a
GEMM's bound whose operand rows moved), which makes a sample after the first several times
cheaper.

Coverage: each sample's injector counts the torch calls it saw (:mod:`ttrace_num.propagate.census`:
perturbed, exact, unmodelled), and the sample's ``run.json`` meta holds the counts summed over
its steps as ``ops``: ``{"perturbed": {name: calls}, "exact": {...}, "unmodelled": {...}}``. A
traced record taken after an unmodelled call gets ``unmodelled_before`` (the number of
unmodelled calls of the sample so far: since its first step, or since the step's start when
the samples restart every step) in its meta, which :mod:`tracer.compare.coverage` reads. The
optimizer's ``step()`` is marked (``NoiseInjector.optimizer_step``): unmodelled ops inside it
are counted as ``optimizer``, not ``unmodelled`` (the census module states the assumption).
The tracer's own work in the sample's writer (copies, statistics, the flush) runs with torch
functions disabled: neither perturbed nor counted.

Distributed reference (docs/distributed-reference.md): on a reference traced by several ranks
(its writer's ``world_size > 1``), every rank constructs its sampler and calls :meth:`NoiseSampler.step`
at the same points, so the ``S`` perturbed re-runs of a step run in lockstep on every rank and
the collectives inside them still pair up; each rank writes its own shard of each sample
(``root/noise/sample_<i>/step_*/rank_<r>.*``, the sample's run id and meta as above, the same on
every rank). The injector's generator is seeded from ``seed``, the step and the sample only,
never from the rank: an op computed identically on several ranks (a layer norm on every TP rank
without sequence parallelism, the optimizer's update of a replicated parameter) draws the same
uniform numbers from the same generator state, hence the same perturbation, and replicated
records of a sample stay bitwise equal, as the checker requires of them
(``tests/test_distributed_reference.py`` checks it on a megatron-core TP=2 reference). That holds
while every rank makes the same sequence of draws of the same sizes up to that op: true of TP
and DP ranks (the same ops on shards of equal shape); where it is not (pipeline stages, or
ranks that draw for different shard shapes), no record is replicated across those ranks anyway,
or the checker finds the replicas unequal and refuses the sample. A consequence, stated: the
shards of a split tensor on different TP ranks are perturbed with the *same* uniform numbers
times their own amplitudes, i.e. correlated noise across shards, where independent noise was
modelled; the variance of each element is unchanged, and a later sum over the shards (a
row-parallel GEMM) mixes them with independent weights, so its variance is unchanged in
expectation.

Samples of a multi-rank reference are stored whole (``store="tensors"``): their moments
(:mod:`tracer.compare.deviation`) are sums over a *shard's* elements of a deviation from the
shard of the clean step, which cannot be assembled soundly into the full tensor's: a partial
placement (a gradient summed over ranks) has a deviation that is the sum of the shards'
deviations, whose moments are not the sum of theirs, and the block coordinates of the block-scale
statistic are of blocks of the full tensor, not of a shard.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from tracer.compare.coverage import ACCEPTED_META, OPS_META, UNMODELLED_META
from tracer.compare.deviation import MomentAccumulator, MomentWriter
from tracer.trace.store import TraceWriter, existing_run

__all__ = ["NoiseSampler", "StateSnapshot", "sample_seed"]


class _CensusWriter:
    """A sample's writer whose records carry :data:`UNMODELLED_META` when unmodelled calls
    preceded them (``count()``); everything else is the wrapped writer's."""

    def __init__(self, writer: TraceWriter, count: Callable[[], int]) -> None:
        self._writer, self._count = writer, count

    def add(self, name: str, tensor: torch.Tensor, **kw: Any) -> str:
        n = self._count()
        if n:
            kw["meta"] = {**(kw.get("meta") or {}), UNMODELLED_META: n}
        with torch._C.DisableTorchFunction():  # the tracer's own work: not the run's ops
            return self._writer.add(name, tensor, **kw)

    def flush_step(self, step: int) -> Path:
        with torch._C.DisableTorchFunction():
            return self._writer.flush_step(step)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._writer, attr)


@contextlib.contextmanager
def _optimizer_marked(optimizer: Any, injector: Any) -> Iterator[None]:
    """``optimizer.step()`` runs inside ``injector.optimizer_step()`` (an instance attribute,
    removed afterwards; one set before, e.g. by an LR scheduler, is put back)."""
    had = "step" in vars(optimizer)
    orig = optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        with injector.optimizer_step():
            return orig(*args, **kwargs)
    optimizer.step = step
    try:
        yield
    finally:
        if had:
            optimizer.step = orig
        else:
            del optimizer.step


class StateSnapshot:
    """Copies of every tensor a training step changes; :meth:`restore` puts them back bitwise.

    The model's parameters and registered buffers (e.g. running statistics), the extra
    state of modules that define ``get_extra_state``/``set_extra_state`` (e.g. FP8 amax
    histories and scales; ``set_extra_state`` must copy what it is given), the optimizer's
    parameters and its state.

    ``optimizer`` is a ``torch.optim.Optimizer`` or a wrapper holding one as ``.optimizer``
    (megatron-core's optimizers). ``take_state``: keep the optimizer's state tensors themselves
    instead of copies, for a caller that restores a snapshot (which replaces them) before the
    optimizer steps again, so that nothing writes to them in between.
    """

    def __init__(self, model: torch.nn.Module, optimizer: Any, *, take_state: bool = False) -> None:
        self.inner = getattr(optimizer, "optimizer", optimizer)
        # Module.buffers, not model.buffers: megatron's DDP wrapper has a `buffers` attribute
        # (its gradient buffers) that shadows the method
        self.tensors = (list(model.parameters()) + list(torch.nn.Module.buffers(model))
                        + [p for g in self.inner.param_groups for p in g["params"]])
        self.saved = [t.detach().clone() for t in self.tensors]
        self.state = {p: dict(st) if take_state else _clone_state(st) for p, st in self.inner.state.items()}
        self.extra = {m: m.get_extra_state() for m in model.modules()
                      if type(m).get_extra_state is not torch.nn.Module.get_extra_state}

    def restore(self, last_use: bool = False) -> None:
        """Put the saved values back; ``last_use``: this snapshot is not restored again, so the
        optimizer takes its saved state tensors instead of copies (the parameters are copied
        into in any case: other objects, e.g. gradient buffers, hold views of them)."""
        with torch.no_grad():
            for t, s in zip(self.tensors, self.saved):
                t.copy_(s)
        self.inner.state.clear()
        for p, st in self.state.items():
            self.inner.state[p] = dict(st) if last_use else _clone_state(st)
        for m, st in self.extra.items():
            m.set_extra_state(st)


def _clone_state(st: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}


class NoiseSampler:
    """Noisy trajectories of a reference run (see the module docstring).

    Args:
        model, optimizer: the reference's (wrapped or not).
        root: the reference's trace directory (samples go to ``root/noise/sample_<i>``).
        layout, signature: as for the reference's :class:`~tracer.trace.store.TraceWriter`.
        samples: ``S`` (default 4; more samples estimate the spread better, see :mod:`tracer.compare.thresholds`).
        seed: noise seed (the thresholds are reproducible).
        injector_kwargs: passed to :class:`~ttrace_num.propagate.noise.NoiseInjector`, e.g.
            ``policy`` and ``grad_summation`` describing the candidate's split reductions, or
            ``accepted`` (``{torch name: reason}``: ops without a model the integration accepts
            unperturbed; written to the samples' ``run.json`` meta as ``accepted_ops``).
            The optimizer's ``step()`` runs inside the injector's ``optimizer_step()`` (module
            doc, "Coverage").
        custom_functions: ``torch.autograd.Function`` classes whose backward does arithmetic
            (autograd runs it outside the injector otherwise; see
            :func:`~ttrace_num.propagate.noise.perturb_custom_backward`).
        reuse_amplitudes: share the amplitudes of a step across its samples
            (:class:`~ttrace_num.propagate.memo.AmplitudeMemo`); False: each sample computes its own.
        store: ``"moments"`` (default on one rank): each sample's trace stores, per tensor, the three
            moments of its deviation from the clean step that the threshold needs
            (:mod:`tracer.compare.deviation`; needs the reference traced in full mode); ``"tensors"``:
            the sample's tensors whole (for analyses beyond the thresholds, e.g.
            ``bench.sensitivity``), S times the reference's trace on disk; the default, and the only
            choice, of a multi-rank reference (module doc, "Distributed reference").
        restart: every sample starts each step from the state before the clean step instead of
            continuing its own trajectory: for a reference re-synchronised to its candidate at
            every step (:mod:`tracer.capture.resync`), whose thresholds then cover one step's round-off.
        clean_writer: the reference's own writer, when it writes in the background
            (``TraceWriter(background=True)``): the samples wait for the clean step to be on
            disk (moments are taken against it) before they run.
        rank, world_size: this rank's place in a distributed reference (module doc); by default
            those of ``clean_writer``, else rank 0 of 1.
    """

    def __init__(self, model: torch.nn.Module, optimizer: Any, root: str | Path, *, layout: dict[str, Any],
                 signature: str, samples: int = 4, seed: int = 0, injector_kwargs: dict[str, Any] | None = None,
                 custom_functions: Sequence[type] = (), reuse_amplitudes: bool = True, store: str | None = None,
                 clean_writer: TraceWriter | None = None, restart: bool = False, rank: int | None = None,
                 world_size: int | None = None) -> None:
        if samples < 1:
            raise ValueError("need at least one noise sample")
        self.rank = int(rank if rank is not None else (clean_writer.rank if clean_writer is not None else 0))
        self.world_size = int(world_size if world_size is not None else
                              (clean_writer.world_size if clean_writer is not None else 1))
        store = store or ("moments" if self.world_size == 1 else "tensors")
        if store not in ("moments", "tensors"):
            raise ValueError(f"store must be 'moments' or 'tensors', got {store!r}")
        if store == "moments" and self.world_size > 1:
            raise ValueError("noise samples of a multi-rank reference are stored as tensors (store='tensors'): "
                             "moments of a shard's deviation cannot be assembled into the full tensor's "
                             "(tracer.capture.noise_sampler, 'Distributed reference')")
        self.model, self.optimizer = model, optimizer
        self.seed = int(seed)
        self.injector_kwargs = {"mode": "probabilistic", **(injector_kwargs or {})}
        self.custom_functions = tuple(custom_functions)
        self.clean_writer = clean_writer
        self.restart = bool(restart)
        self.reuse_amplitudes = reuse_amplitudes
        self.amplitude_hits = self.amplitude_patched = self.amplitude_misses = 0  # over all steps, for reports
        #: wall seconds of each sample (state restore, the traced step, the snapshot), per step:
        #: the first one computes the amplitudes the later ones reuse
        self.sample_seconds: list[list[float]] = []
        self.moments = MomentAccumulator() if store == "moments" else None
        #: read by the checker (tracer.compare.check): a re-synchronised comparison's samples
        # a sample names the reference run it perturbs (run id "<reference's>.noise<i>", meta
        # noise_sample_of), so that a comparison refuses samples of another reference run
        of = _reference_run_id(root, clean_writer)
        base_meta = {"restarts_each_step": True} if self.restart else {}
        metas = [{**base_meta, "noise_sample": i, "noise_sample_of": of} for i in range(samples)]
        ids = [f"{of}.noise{i}" if of else "" for i in range(samples)]
        self.writers = [TraceWriter(Path(root) / "noise" / f"sample_{i}", self.rank, self.world_size, layout,
                                    signature, run_id=ids[i], run_meta=metas[i])
                        if self.moments is None else
                        MomentWriter(Path(root) / "noise" / f"sample_{i}", root, i, self.moments, layout, signature,
                                     run_id=ids[i], run_meta=metas[i]) for i in range(samples)]
        self.states: list[StateSnapshot] = []
        #: per sample: the op census summed over its steps (written to its run.json meta as ``ops``)
        self.census: list[dict[str, dict[str, int]]] = [{} for _ in self.writers]
        self._unmodelled = [0] * len(self.writers)  # per sample: unmodelled calls of its trajectory

    def step(self, step: int, traced_step: Callable[[TraceWriter | None], Any]) -> Any:
        """Run training step ``step`` clean, then its noise samples; returns what the clean
        ``traced_step(None)`` returned. ``traced_step(writer)`` must run one whole training step
        (forward, backward, optimizer step), traced into ``writer`` (None: the run's own).

        The clean step runs first so that whatever the model caches on first use (megatron
        caches its rotary table with ``lru_cache``) is computed without noise; the samples
        then start from the state before the clean step and the run continues from the
        state after it."""
        from ttrace_num.propagate.memo import AmplitudeMemo
        from ttrace_num.propagate.noise import NoiseInjector, perturb_custom_backward
        if not self.states or self.restart:  # every sample starts from the state before the step
            self.states = [StateSnapshot(self.model, self.optimizer)] * len(self.writers)
        out = traced_step(None)
        if self.clean_writer is not None:
            self.clean_writer.wait()
        after = StateSnapshot(self.model, self.optimizer, take_state=True)  # the samples restore theirs next
        memo = AmplitudeMemo() if self.reuse_amplitudes else None
        if self.moments is not None:
            self.moments.reset()
        seconds = []
        for i, w in enumerate(self.writers):
            t0 = time.perf_counter()
            self.states[i].restore(last_use=self.states[i] not in self.states[i + 1:])
            gen = torch.Generator().manual_seed(sample_seed(self.seed, step, i))  # the same on every rank
            if memo is not None:
                memo.rewind()
            inj = NoiseInjector(gen, memo=memo, **self.injector_kwargs)
            base = 0 if self.restart else self._unmodelled[i]
            with inj, perturb_custom_backward(inj, *self.custom_functions), _optimizer_marked(self.optimizer, inj):
                traced_step(_CensusWriter(w, lambda: base + inj.unmodelled_calls))
            self._unmodelled[i] = base + inj.unmodelled_calls
            self._write_census(i, inj.census())
            if not self.restart:  # the sample's trajectory goes on from here next step
                self.states[i] = StateSnapshot(self.model, self.optimizer, take_state=True)  # a restore follows
            seconds.append(time.perf_counter() - t0)
        self.sample_seconds.append(seconds)
        if self.moments is not None:
            self.moments.reset()
        if memo is not None:
            self.amplitude_hits += memo.hits
            self.amplitude_patched += memo.patched
            self.amplitude_misses += memo.misses
        after.restore(last_use=True)
        return out

    def _write_census(self, i: int, step_census: dict[str, dict[str, int]]) -> None:
        """Add a step's census to sample ``i``'s and rewrite its ``run.json`` (meta ``ops``); on a
        multi-rank reference the ranks' censuses are gathered (a collective, in lockstep) and
        rank 0, which writes ``run.json``, keeps each op's largest count over the ranks."""
        from ttrace_num.propagate.census import Census
        if self.world_size > 1:
            import torch.distributed as dist
            every: list[Any] = [None] * self.world_size
            dist.all_gather_object(every, step_census)
            step_census = _most(every)
        self.census[i] = Census.merged([self.census[i], step_census])
        w = self.writers[i]
        if self.rank != 0:
            return
        w.run_meta[OPS_META] = self.census[i]
        accepted = self.injector_kwargs.get("accepted")
        if accepted:
            w.run_meta[ACCEPTED_META] = dict(accepted)
        w._write_run_file()  # the writer's own run.json writer (atomic), with the new meta

    def unmodelled(self) -> dict[str, int]:
        """Unmodelled ops (name -> calls of one sample over its steps, the most of any sample):
        what the thresholds do not cover (:mod:`ttrace_num.propagate.census`)."""
        out: dict[str, int] = {}
        for c in self.census:
            for name, n in c.get("unmodelled", {}).items():
                out[name] = max(out.get(name, 0), n)
        return dict(sorted(out.items()))


def sample_seed(seed: int, step: int, sample: int) -> int:
    """The injector's seed for ``sample`` of ``step``: a function of the sampler's ``seed``, the
    step and the sample, never of the rank (module doc, "Distributed reference")."""
    return (int(seed) * 1_000_003 + int(step)) * 101 + int(sample)


def _most(censuses: Sequence[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    """Per category and op, the largest count over ``censuses`` (one per rank)."""
    out: dict[str, dict[str, int]] = {}
    for c in censuses:
        for cat, ops in (c or {}).items():
            mine = out.setdefault(cat, {})
            for name, n in ops.items():
                mine[name] = max(mine.get(name, 0), int(n))
    return out


def _reference_run_id(root: str | Path, clean_writer: TraceWriter | None) -> str:
    """The run id of the clean reference the samples perturb: its writer's, else the one in its
    ``run.json`` (written by rank 0 of the clean run), else "" (unknown: the samples then get ids
    of their own and compare cannot tell their reference)."""
    if clean_writer is not None:
        return clean_writer.run_id
    return str((existing_run(root) or {}).get("run_id", ""))
