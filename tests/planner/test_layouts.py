"""The layouts of N devices and why some are excluded: in the strategy's own words, or for sizes that do not
divide, or for a peak above the device's memory."""

from __future__ import annotations

import dataclasses

from lightning_parallel.pipeline.schedules import schedule_problem
from lightning_parallel.planner.cluster import Cluster, Link
from lightning_parallel.planner.cost_model import BlockCost, ModelCost
from lightning_parallel.planner.layout import Layout
from lightning_parallel.planner.layouts import (
    NO_FIT,
    NOT_DIVISIBLE,
    REFUSED,
    candidate_layouts,
    layout_refusal,
    plan_layouts,
)
from lightning_parallel.strategies.parallel import SP_WITH_PP

CLUSTER = Cluster("test", 1, 8, 80e9, 1e15, Link(1e10, 1e-5), Link(1e9, 1e-5))
MODEL = ModelCost([BlockCost(1e-3, 2e-3, 1e6, 4e6, 1e5)] * 8, other_parameter_bytes=1e6, batch_size=1)


def test_every_candidate_uses_every_device() -> None:
    found = list(candidate_layouts(8, 32))
    assert {(x.dp, x.tp, x.pp) for x in found} == {
        (dp, tp, pp) for dp in (1, 2, 4, 8) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8) if dp * tp * pp == 8
    }
    assert all(x.num_microbatches >= x.pp for x in found if x.pp > 1)
    assert not any(x.zero_stage for x in found if x.dp == 1)


def test_refusals_are_the_strategys_own_words() -> None:
    sp_with_pp = Layout(dp=2, tp=2, pp=2, global_batch=8, num_microbatches=2, sequence_parallel=True)
    refusal = layout_refusal(sp_with_pp, 8)
    assert refusal is not None and refusal.kind == REFUSED
    assert any(SP_WITH_PP in p for p in refusal.problems)
    few = Layout(dp=1, tp=1, pp=4, global_batch=8, schedule="1f1b", num_microbatches=2)
    refusal = layout_refusal(few, 8)
    assert refusal is not None and refusal.problems == (schedule_problem("1f1b", 4, 2, 1),)


def test_sizes_that_do_not_divide() -> None:
    refusal = layout_refusal(Layout(dp=4, tp=1, pp=2, global_batch=6, num_microbatches=2), 8)
    assert refusal is not None and refusal.kind == NOT_DIVISIBLE and "dp=4" in refusal.reason
    refusal = layout_refusal(Layout(dp=1, tp=1, pp=8, global_batch=8, num_microbatches=8), 4)
    assert refusal is not None and refusal.kind == NOT_DIVISIBLE and "the model has 4" in refusal.reason
    assert layout_refusal(Layout(dp=2, tp=2, pp=2, global_batch=8, num_microbatches=2), 8) is None


def test_a_small_memory_excludes_what_does_not_fit_and_ranks_the_rest() -> None:
    roomy = plan_layouts(MODEL, CLUSTER, 8, 32)
    assert roomy.ranked and not any(e.kind == NO_FIT for e in roomy.excluded)
    steps = [p.step_s for p in roomy.ranked]
    assert steps == sorted(steps)
    peaks = sorted(p.peak_bytes for p in roomy.ranked)
    tight = plan_layouts(MODEL, CLUSTER, 8, 32, memory=peaks[len(peaks) // 2])
    assert any(e.kind == NO_FIT for e in tight.excluded)
    assert all(p.peak_bytes <= peaks[len(peaks) // 2] for p in tight.ranked)


def test_overrides_name_the_layout() -> None:
    layout = Layout(
        2, 2, 2, 16, schedule="interleaved_1f1b", num_microbatches=4, virtual_stages=2, zero_stage=1
    )
    lines = layout.overrides()
    assert "strategy=lp_parallel" in lines and "strategy.virtual_stages=2" in lines
    assert "data.batch_size=8" in lines and "strategy.zero_stage=1" in lines
    assert dataclasses.replace(layout, recompute=True).name().endswith("z1 rc")
