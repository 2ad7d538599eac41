"""The refusals of Lightning callbacks a layout cannot run, decided from the options before any process group
(``strategies/callback_support.py``), and the marker ZeRO-3 reads before a block's hook gathers
(``every_rank.every_rank_runs``); the fits that meet them are in ``test_lightning_callbacks.py``."""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import StochasticWeightAveraging

from lightning_parallel.distributed.mesh import MeshShape
from lightning_parallel.every_rank import (
    every_rank_forward,
    every_rank_runs,
    every_rank_scope,
    training_step_scope,
)
from lightning_parallel.strategies.callback_support import split_model_refusal

SWA = [StochasticWeightAveraging(swa_lrs=1e-2)]


def test_swa_is_refused_where_the_parameters_are_sharded_by_zero_stage_3():
    """Under zero_stage=3 the parameters SWA averages between steps are NaN placeholders (unrefused, it
    averaged them and failed copying back at the end of fit)."""
    refusal = split_model_refusal(SWA, "DDPStrategy", MeshShape(dp=2), zero_stage=3)
    assert refusal is not None and "zero_stage=3" in refusal and "zero_stage 0, 1 or 2" in refusal
    for stage in (0, 1, 2):
        assert split_model_refusal(SWA, "DDPStrategy", MeshShape(dp=2), zero_stage=stage) is None
    assert split_model_refusal(SWA, "DDPStrategy", MeshShape(dp=1), zero_stage=3) is None  # nothing sharded
    assert "tensor_parallel_size=2" in split_model_refusal(SWA, "ParallelStrategy", MeshShape(dp=2, tp=2))


def test_every_rank_runs_inside_the_strategy_calls_every_rank_makes_in_any_grad_mode():
    assert not every_rank_runs()
    with every_rank_scope(), torch.no_grad():  # the evaluation step
        assert every_rank_runs() and not every_rank_forward()
    with training_step_scope():
        assert every_rank_runs() and every_rank_forward()
    assert not every_rank_runs()
