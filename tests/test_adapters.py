"""The adapter protocol (tracer.adapters.base) and the placements megatron's adapter reads from
the module's configuration, on small in-process instances (no process group, no megatron model).

* both adapters satisfy the runtime-checkable :class:`~tracer.adapters.base.Adapter` protocol,
  and each member answers as documented;
* a ``ColumnParallelLinear``'s output is split on its last dim over TP, unless the module
  gathers it (``gather_output=True``, what ``GPTModel(parallel_output=False)`` builds, or the
  call's ``runtime_gather_output``): then it is replicated over TP;
* ``parallel_layout()`` is the same on every rank (the reader refuses a rank whose manifest
  layout differs from ``run.json``'s).
"""
from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tracer.adapters.base import Adapter, phases_of
from tracer.adapters.ddp import DDPTracer
from tracer.adapters.megatron import MegatronTracer, parallel_coordinates, parallel_layout
from tracer.trace.canonical import Placement, ShardDim
from tracer.trace.schema import Phase
from tracer.trace.store import TraceWriter


class ColumnParallelLinear(nn.Module):
    """Stands in for megatron-core's class (the adapter reads the class name and ``gather_output``)."""

    def __init__(self, gather_output: bool) -> None:
        super().__init__()
        self.gather_output = gather_output
        self.weight = nn.Parameter(torch.randn(4, 8))
        self.weight.tensor_model_parallel, self.weight.partition_dim = True, 0

    def forward(self, x: torch.Tensor, runtime_gather_output: bool | None = None):
        return x @ self.weight.t(), None


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.split = ColumnParallelLinear(gather_output=False)
        self.gathered = ColumnParallelLinear(gather_output=True)


def _coords(tp_rank: int = 1) -> dict:
    return {"tp": 2, "pp": 1, "dp": 1, "vpp": 1, "tp_rank": tp_rank, "pp_rank": 0, "dp_rank": 0,
            "first_stage": True, "last_stage": True}


@pytest.fixture
def megatron(tmp_path):
    config = SimpleNamespace(sequence_parallel=False, num_layers=1, finalize_model_grads_func=None)
    mt = MegatronTracer(Model(), config, TraceWriter(tmp_path / "m", 0, 1, {"tp": 2}, "sig", run_id="r"),
                        coordinates=_coords())
    yield mt
    mt.close()


def test_both_adapters_satisfy_the_protocol(megatron, tmp_path):
    ddp = DDPTracer(nn.Linear(3, 2), TraceWriter(tmp_path / "d", 0, 1, {"dp": 1}, "sig", run_id="r"))
    for a in (megatron, ddp):
        assert isinstance(a, Adapter), type(a)
    assert ddp.role == "reference" and megatron.role == "candidate"
    assert ddp.layout == {"dp": 1}
    assert megatron.layout == {"tp": 2, "pp": 1, "dp": 1, "vpp": 1, "sp": False}
    assert ddp.phases == (Phase.FWD, Phase.BWD, Phase.LOSS, Phase.GRAD, Phase.PARAM)
    assert megatron.phases == (Phase.FWD, Phase.BWD, Phase.LOSS, Phase.GRAD_LOCAL, Phase.GRAD, Phase.GRAD_NORM,
                               Phase.PARAM)  # no optimizer: no options, no cast
    assert ddp.canonical_name("weight") == "weight" and megatron.canonical_name("split") == "split"
    assert ddp.parameter_placement("weight", "grad") == Placement(())
    assert ddp.record_placement("", "output", torch.zeros(2)) == Placement(())
    assert megatron.parameter_placement("split.weight", "param") == Placement((ShardDim(0, "tp", 1, 2),))
    with ddp.step(0):
        ddp.microbatch(0)
        ddp.after_optimizer_step()
    ddp.close()


def test_phases_of_orders_by_the_step():
    assert phases_of(["param", "fwd_out", "optim"], loss=False) == (
        Phase.FWD, Phase.PARAM, Phase.MAIN_PARAM, Phase.EXP_AVG, Phase.EXP_AVG_SQ)


def test_column_parallel_output_placement_follows_gather_output(megatron):
    y = torch.zeros(5, 2)  # this rank's output (split) or the full one (gathered)
    split = megatron.record_placement("split", "split.output.0", y)
    assert split == Placement((ShardDim(1, "tp", 1, 2),)), split  # last dim over TP
    assert megatron.record_placement("split", "split.output_grad.0", y) == split
    rep = Placement((ShardDim(None, "tp", 1, 2, "replicated"),))
    assert megatron.record_placement("gathered", "gathered.output.0", y) == rep
    assert megatron.record_placement("gathered", "gathered.output_grad.0", y) == rep
    # the weight stays a TP shard either way; the input is untouched by the flag
    assert megatron.parameter_placement("gathered.weight", "grad") == Placement((ShardDim(0, "tp", 1, 2),))
    assert megatron.record_placement("gathered", "gathered.input.0", torch.zeros(5, 8)) == rep


def test_runtime_gather_output_overrides_the_module_flag(megatron):
    y = torch.zeros(5, 2)
    megatron.model.split(torch.zeros(5, 8), runtime_gather_output=True)
    assert megatron.record_placement("split", "split.output.0", y) == Placement(
        (ShardDim(None, "tp", 1, 2, "replicated"),))
    megatron.model.split(torch.zeros(5, 8))
    assert megatron.record_placement("split", "split.output.0", y) == Placement((ShardDim(1, "tp", 1, 2),))


def test_megatron_sources_name_the_flags_the_adapter_reads():
    """The flags read above are megatron-core's own: ColumnParallelLinear keeps ``gather_output``,
    GPTModel builds its output layer with ``gather_output=not parallel_output``."""
    pytest.importorskip("megatron.core")
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear as Real
    assert "self.gather_output = gather_output" in inspect.getsource(Real.__init__)
    assert "runtime_gather_output" in inspect.signature(Real.forward).parameters
    assert "gather_output=not self.parallel_output" in inspect.getsource(GPTModel.__init__)


def _fake_ps(tp_rank: int, pp_rank: int, dp_rank: int, vpp: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        get_virtual_pipeline_model_parallel_world_size=lambda: vpp,
        get_tensor_model_parallel_world_size=lambda: 2, get_pipeline_model_parallel_world_size=lambda: 2,
        get_data_parallel_world_size=lambda: 2, get_tensor_model_parallel_rank=lambda: tp_rank,
        get_pipeline_model_parallel_rank=lambda: pp_rank, get_data_parallel_rank=lambda: dp_rank,
        is_pipeline_first_stage=lambda ignore_virtual: pp_rank == 0,
        is_pipeline_last_stage=lambda ignore_virtual: pp_rank == 1)


def test_parallel_layout_is_the_same_on_every_rank():
    config = SimpleNamespace(sequence_parallel=True)
    first, last = parallel_layout(config, ps=_fake_ps(0, 0, 0)), parallel_layout(config, ps=_fake_ps(1, 1, 1))
    assert first == last == {"tp": 2, "pp": 2, "dp": 2, "vpp": 1, "sp": True}
    assert parallel_layout(ps=_fake_ps(1, 0, 1)) == {"tp": 2, "pp": 2, "dp": 2, "vpp": 1}
    # the coordinates (what placements use) do differ
    assert parallel_coordinates(_fake_ps(0, 0, 0)) != parallel_coordinates(_fake_ps(1, 1, 1))
