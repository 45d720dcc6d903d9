"""Localisation re-run for the megatron harness: the reference's module on the candidate's inputs.

    verdict = rerun_first_divergence(comparison, seed=..., dtype=..., global_batch=...)

When the first divergence of a comparison is a module's forward output, a single-process
reference is rebuilt, trained up to that step (it is deterministic, so its state is the
traced reference's; a re-synchronised one then loads the candidate's state of the step
before, as the traced one did), and the module is re-run on the candidate's assembled inputs of that
microbatch (:func:`tracer.compare.localise.rerun_module`): the module's own difference, free of
anything propagated, against a threshold from noise samples of the same re-run.
"""
from __future__ import annotations

from examples.gloo import run_gloo
from tracer.compare.check import Comparison, assembled_records
from tracer.compare.localise import LocalVerdict, split_inputs

__all__ = ["rerun_first_divergence"]


def _worker(rank: int, world: int, layout: dict, kw: dict, rerun: dict):
    import warnings
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    from examples.megatron_cpu.gpt import build_and_train
    return build_and_train(layout, steps=rerun["step"] + 1, rerun=rerun, **kw)["rerun"]


def rerun_first_divergence(c: Comparison, *, seed: int, dtype: str, global_batch: int = 4,
                           noise_tp: int = 2, resync: bool = False) -> LocalVerdict | None:
    """Re-run the module of ``c``'s first divergence (None if it is not a forward output).
    ``resync``: ``c``'s reference was re-synchronised to its candidate (:mod:`tracer.capture.resync`), so the
    re-run's reference starts the step from the candidate's state too (its weights)."""
    f = c.first
    if f is None or f.phase != "fwd" or ".output" not in f.name:
        return None
    module = f.name.split(".output")[0]
    inputs = assembled_records(c.candidate, f.step, "fwd", f.microbatch, module + ".input")
    args, kwargs = split_inputs(inputs, module)
    output = assembled_records(c.candidate, f.step, "fwd", f.microbatch, f.name)[f.name]
    rerun = {"step": f.step, "module": module, "args": args, "kwargs": kwargs, "output": output,
             "noise_tp": noise_tp, **({"resync_from": c.candidate} if resync else {})}
    kw = {"seed": seed, "dtype": dtype, "global_batch": global_batch}
    return run_gloo(_worker, 1, {"tp": 1, "pp": 1, "dp": 1}, kw, rerun)[0]
