"""Injected bugs for the megatron CPU harness: small named monkeypatches from the catalogue.

A bug is a function ``inject(model, config, optimizer) -> undo`` registered with
:func:`bug`, with the layout it needs and the first divergence it must produce
(``expected_phase``, ``expected_name`` as an ``fnmatch`` pattern on the canonical name).
It patches megatron-core or the harness for one run, never the installed files, and
``undo()`` restores everything. Adding one takes about 20 lines::

    @bug("my_bug", catalogue="B99", bug_class="wrong scale factor", needs={"tp": 2},
         expected_phase="grad", expected_name="*linear_fc2.weight",
         doc="what goes wrong, and where")
    def _my_bug(model, config, optimizer):
        ...patch...
        return lambda: ...unpatch...

``build_and_train(..., bug="my_bug")`` injects it on every rank after the model and the
optimizer are built.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Bug", "BUGS", "bug", "inject"]


@dataclass(frozen=True)
class Bug:
    name: str
    catalogue: str
    bug_class: str
    doc: str
    needs: dict[str, Any]
    expected_phase: str
    expected_name: str
    patch: Callable[..., Callable[[], None]] = field(repr=False)


BUGS: dict[str, Bug] = {}


def bug(name: str, *, catalogue: str, bug_class: str, doc: str, needs: dict[str, Any], expected_phase: str,
        expected_name: str) -> Callable:
    """Register the decorated ``inject(model, config, optimizer) -> undo`` as bug ``name``."""
    def deco(fn: Callable) -> Callable:
        BUGS[name] = Bug(name, catalogue, bug_class, doc, needs, expected_phase, expected_name, fn)
        return fn
    return deco


def inject(name: str, *, model: Any, config: Any, optimizer: Any) -> Callable[[], None]:
    """Apply bug ``name`` to this rank's run; returns the function that undoes it."""
    if name not in BUGS:
        raise ValueError(f"unknown bug {name!r}; known: {sorted(BUGS)}")
    return BUGS[name].patch(model, config, optimizer)


def _params(model: Any, pattern: str) -> list:
    found = [p for n, p in model.named_parameters() if pattern in n]
    if not found:
        raise ValueError(f"no parameter name contains {pattern!r}")
    return found


@bug("sp_norm_grad_not_reduced", catalogue="B23/B04", bug_class="missing reduction of a replicated param's grad",
     needs={"tp": 2, "sp": True}, expected_phase="grad_local", expected_name="decoder.layers.0.input_layernorm.weight",
     doc="norm params lose their `sequence_parallel` tag (NeMo looked for another attribute name), so "
         "finalize_model_grads never all-reduces their per-sequence-shard grads over TP")
def _sp_norm(model, config, optimizer):
    norms = _params(model, "layernorm")
    for p in norms:
        p.sequence_parallel = False

    def undo():
        for p in norms:
            p.sequence_parallel = True
    return undo


@bug("grad_norm_undercounts_tp_shards", catalogue="B19", bug_class="norm accounting", needs={"tp": 2},
     expected_phase="grad_norm", expected_name="grad_norm",
     doc="the grad-norm filter checks ownership with the wrong rule for the column-parallel and "
         "vocab-parallel weights (TP-sharded along dim 0): they are counted as TP duplicates, only TP "
         "rank 0's shard enters the norm, and the clip coefficient is wrong")
def _grad_norm(model, config, optimizer):
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    orig = tensor_parallel.param_is_not_tensor_parallel_duplicate

    def filtered(param, tp_group=None):  # param: the optimizer's fp32 main copy (attributes copied)
        if getattr(param, "tensor_model_parallel", False) and getattr(param, "partition_dim", None) == 0:
            return ps.get_tensor_model_parallel_rank() == 0
        return orig(param, tp_group)
    tensor_parallel.param_is_not_tensor_parallel_duplicate = filtered

    def undo():
        tensor_parallel.param_is_not_tensor_parallel_duplicate = orig
    return undo


@bug("vocab_ce_local_denominator", catalogue="B13", bug_class="partition-local statistic used as global",
     needs={"tp": 2}, expected_phase="loss", expected_name="loss_per_token",
     doc="the vocab-parallel cross entropy divides by this rank's partition of sum(exp(logits)) instead "
         "of the all-reduced sum over the whole vocabulary")
def _vocab_ce(model, config, optimizer):
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as V
    orig = V.__dict__["calculate_cross_entropy_loss"]

    def local(exp_logits, predicted_logits, sum_exp_logits):
        return orig.__func__(exp_logits, predicted_logits, exp_logits.sum(dim=-1))
    V.calculate_cross_entropy_loss = staticmethod(local)

    def undo():
        V.calculate_cross_entropy_loss = orig
    return undo


@bug("lost_grad_contribution", catalogue="B27", bug_class="lost gradient contribution",
     needs={"tp": 2}, expected_phase="grad_local", expected_name="decoder.layers.0.mlp.linear_fc1.weight",
     doc="global rank 0 loses its accumulated fc1 weight grad before the cross-rank reduction "
         "(a hook that fired twice reset the accumulator)")
def _lost_grad(model, config, optimizer):
    import torch.distributed as dist
    victims = _params(model, "linear_fc1.weight")
    orig = config.finalize_model_grads_func

    def finalize(*a, **k):
        if dist.get_rank() == 0:
            for p in victims:
                p.main_grad.zero_()
        return orig(*a, **k)
    config.finalize_model_grads_func = finalize

    def undo():
        config.finalize_model_grads_func = orig
    return undo
