"""Bitwise where the arithmetic is the same: the output of a module whose inputs matched bitwise.

A distributed layout changes the arithmetic of some computations (a row-parallel GEMM sums
partial products over the TP ranks; a data-parallel gradient is reduced across ranks) and leaves
the rest as it was: a layer norm over a row, a column-parallel GEMM (each output element reduces
over the full input dimension on one rank), the attention of one head, an embedding lookup. Run
by the same kernels on bitwise-equal inputs and parameters, those produce bitwise-equal outputs,
so there the legitimate difference is exactly zero and any difference is a divergence, however
small: a few ulps lost by a bf16 softmax that skips the row maximum, one flipped bit.

**The rule.** A forward record ``M.output*`` of module ``M`` is *exact* when

1. the candidate's adapter marked ``M``'s forward as unchanged by its layout (record meta
   :data:`tracer.trace.schema.SAME_ARITHMETIC_META`: ``M`` and every module inside it compute each output element
   as the reference does; :class:`tracer.adapters.megatron.MegatronTracer` marks the classes it
   knows, nothing else);
2. the step is one that the candidate and the reference began from the same parameters
   (:func:`tracer.compare.check.shared_start_steps`: the first step of the traces, or every step of
   a re-synchronised reference);
3. every forward record ``M.input*`` of the same step, microbatch and call was compared and found
   bitwise equal (error 0, full tensors: a statistics-only record proves nothing).

An exact record whose output differs is ``over`` (ratio infinite) with a note naming the rule,
whatever its noise threshold; its threshold is reported as 0.

**What it assumes** (stated in every note): the reference and the candidate run the same
kernels (same machine type and library versions; a GPU candidate against a CPU reference is not
bitwise), and those kernels are deterministic and compute an output element independently of
the tensor's other dimensions (checked on this machine's CPU kernels: the clean TP=2 + SP
candidate of the demo is bitwise equal to its reference up to the first row-parallel GEMM, in
bf16 and fp32, ``docs/detection-statistics.md``). On a GPU: ``torch.use_deterministic_algorithms
(True)`` and ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` in both runs. Checked where the traces say it
(:func:`kernels_differ`, from ``run.json``'s ``kernels``: torch version, CPU dispatch, CUDA,
determinism): the rule is not applied when they differ, and the comparison says why
(``Comparison.exactness``). ``compare(exact_unchanged=False)`` turns the rule off.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

from tracer.trace.schema import Phase, Status

__all__ = ["EXACT_NOTE", "apply_exactness", "io_role", "kernels_differ"]

EXACT_NOTE = ("its inputs matched the reference bitwise and its layout does not change its arithmetic "
              "(tracer.compare.exactness): it must match bitwise")


def io_role(name: str) -> tuple[str, str] | None:
    """``(module, "input" | "output")`` of a forward record named ``module.input*`` / ``module.output*``
    (the canonical names, so every layout agrees), else None."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if parts[i] in ("input", "output"):
            return ".".join(parts[:i]), parts[i]
    return None


def kernels_differ(reference_run: dict, candidate_run: dict) -> str | None:
    """Why the two runs may not compute an unchanged op bitwise alike (their ``run.json``: torch
    version and :func:`tracer.trace.store.kernel_settings`), or None when nothing says so: a GPU run
    needs deterministic algorithms and ``CUBLAS_WORKSPACE_CONFIG`` on both sides. A trace from before
    the kernel record says nothing: the rule is not applied to it."""
    a, b = reference_run.get("kernels"), candidate_run.get("kernels")
    if a is None or b is None:
        return "a trace does not record its kernel settings (traced by an older version)"
    if reference_run.get("torch_version") != candidate_run.get("torch_version"):
        return (f"torch {reference_run.get('torch_version')} in the reference, "
                f"{candidate_run.get('torch_version')} in the candidate")
    if a.get("cpu_capability") != b.get("cpu_capability"):
        return f"CPU dispatch {a.get('cpu_capability')} in the reference, {b.get('cpu_capability')} in the candidate"
    if a.get("cuda") != b.get("cuda"):
        return f"CUDA {a.get('cuda')} in the reference, {b.get('cuda')} in the candidate"
    if a.get("cuda") and not all(k.get("deterministic") and k.get("cublas_workspace_config") for k in (a, b)):
        return ("a GPU run without torch.use_deterministic_algorithms(True) and CUBLAS_WORKSPACE_CONFIG set on "
                "both sides")
    return None


def apply_exactness(rows: list, same_arithmetic: set[tuple[int, str, int, int]], shared_steps: Iterable[int]) -> int:
    """Apply the rule (module doc) to ``rows`` (:class:`~tracer.compare.judge.TensorCheck`, in execution
    order) in place; ``same_arithmetic``: ``(step, record name, microbatch, call)`` of the forward records
    the candidate marked; returns how many rows the rule judged."""
    shared = set(shared_steps)
    inputs_equal: dict[tuple[int, int, str, int], bool] = {}
    judged = 0
    for row in rows:
        if row.phase != Phase.FWD or row.step not in shared:
            continue
        io = io_role(row.name)
        if io is None:
            continue
        module, role = io
        where = (row.step, row.microbatch, module, row.call)
        if role == "input":
            equal = row.error == 0 and not math.isnan(row.max_abs) and row.status in (Status.OK, Status.UNMODELLED)
            inputs_equal[where] = inputs_equal.get(where, True) and equal
        elif role == "output" and inputs_equal.get(where) and \
                (row.step, row.name, row.microbatch, row.call) in same_arithmetic and not math.isnan(row.max_abs):
            judged += 1
            if row.error != 0 and row.status in (Status.OK, Status.UNMODELLED, Status.UNCHECKED):
                row.status = Status.OVER
                row.ratio = math.inf
                row.threshold = 0.0
                row.note = "; ".join(x for x in (row.note, f"differs by {row.max_abs:.3g} at most: {EXACT_NOTE}") if x)
            elif row.error == 0:
                row.note = "; ".join(x for x in (row.note, "bitwise equal, as required: " + EXACT_NOTE) if x)
    return judged
