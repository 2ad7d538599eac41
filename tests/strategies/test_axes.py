"""The step's axes (``strategies/axes.py``): which axes each layout runs, in the one order of ``step_axes``,
and no step hook left on a mixin of ``ParallelStrategy`` (where a class order could end the chain before
another parallelism's hook). That every hook of every axis runs in that order on real processes is checked
in the expert-parallel runs (``tests/strategies/test_expert_parallel.py``: ``traced``)."""

from __future__ import annotations

import pytest

from lightning_parallel import DDPStrategy, ParallelStrategy
from lightning_parallel.distributed.mesh import MeshShape
from lightning_parallel.strategies.base import ParallelStrategyBase
from lightning_parallel.strategies.pipeline import PipelineParallelStrategy
from lightning_parallel.strategies.tensor_parallel import TensorParallelStrategy


@pytest.mark.parametrize(
    "options, shape, names",
    [
        (
            {"zero_stage": 1, "verify_plan": True, "expert_parallel_size": 2, "pipeline_parallel_size": 2},
            MeshShape(dp=4, pp=2, tp=2, ep=2),
            ["data_parallel", "pipeline", "zero", "experts", "tensor", "plan_verification"],
        ),
        (
            {"expert_parallel_size": 2},
            MeshShape(dp=4, pp=2, tp=2, ep=2),
            ["data_parallel", "pipeline", "experts", "tensor"],
        ),
        (  # zero_stage=3 under pipeline stages: the stage's units freed once the pieces hold the gradients
            {"zero_stage": 3, "pipeline_parallel_size": 2},
            MeshShape(dp=2, pp=2),
            ["data_parallel", "pipeline", "zero", "zero_parameters"],
        ),
        (  # and the experts sharded over their replicas, a second set of the stage's units
            {"zero_stage": 3, "pipeline_parallel_size": 2, "expert_parallel_size": 2},
            MeshShape(dp=4, pp=2, ep=2),
            ["data_parallel", "pipeline", "zero", "zero_parameters", "experts"],
        ),
        ({"expert_parallel_size": 2}, MeshShape(dp=2, ep=2), ["data_parallel"]),  # one replica of each expert
        ({"zero_stage": 3}, MeshShape(dp=2, tp=2), ["data_parallel", "zero", "zero_parameters", "tensor"]),
        (
            {"zero_stage": 3, "expert_parallel_size": 2},
            MeshShape(dp=4, ep=2),
            ["data_parallel", "zero", "zero_parameters", "experts"],
        ),
        ({}, MeshShape(pp=2, tp=2), ["pipeline", "tensor"]),
        ({}, MeshShape(), []),
    ],
)
def test_parallel_strategy_axes_in_order(options, shape, names):
    assert [a.name for a in ParallelStrategy(**options).step_axes(shape)] == names


def test_presets_and_ddp_axes():
    """The presets apply their fixed axis at size 1 too; lp_ddp has the data-parallel path only (ZeRO-3's
    sharded parameters last: they are freed once the pieces hold the step's gradients)."""
    assert [a.name for a in TensorParallelStrategy().step_axes(MeshShape(dp=2))] == [
        "data_parallel",
        "tensor",
    ]
    assert [a.name for a in PipelineParallelStrategy().step_axes(MeshShape())] == ["pipeline"]
    assert [a.name for a in DDPStrategy(zero_stage=2).step_axes(MeshShape(dp=2))] == ["data_parallel", "zero"]
    assert [a.name for a in DDPStrategy(zero_stage=3).step_axes(MeshShape(dp=2))] == [
        "data_parallel",
        "zero",
        "zero_parameters",
    ]
    assert DDPStrategy().step_axes(MeshShape()) == []


STEP_HOOKS = ("pre_backward", "post_backward", "block_backward_sync", "optimizer_step", "teardown")


@pytest.mark.parametrize("hook", STEP_HOOKS)
def test_no_mixin_defines_a_step_hook(hook):
    """Only the base loops over the axes; ``ParallelStrategy`` itself may add around it (``teardown``: the
    module given back whole first), its mixins not."""
    mixins = ParallelStrategy.__mro__[1 : ParallelStrategy.__mro__.index(ParallelStrategyBase)]
    assert [m.__name__ for m in mixins if hook in vars(m)] == []
    assert hook in vars(ParallelStrategyBase)
