"""The cost model against published runs (docs/planner_published.md): Megatron-LM's table 1 (Narayanan et al.,
SC'21) on its DGX A100 cluster, and torchtitan's Llama 3.1 405B on 512 H100, each model built from its shape."""

from __future__ import annotations

import functools

import pytest

from lightning_parallel.planner.cluster import Cluster
from lightning_parallel.planner.published import (
    MEGATRON_TABLE_1,
    TORCHTITAN_405B,
    achieved_rate,
    megatron_flops_per_step,
    predict_run,
    predicted_tflops_per_gpu,
    transformer_cost,
)

SELENE = Cluster.load("a100_selene")
#: the rows the one-rate model predicts within 20%; the larger ones it predicts low (docs: GEMM efficiency)
WITHIN_20 = ("1.7B", "3.6B", "7.5B", "18.4B", "39.1B", "76.1B")


def test_shapes_give_the_tables_parameter_counts():
    for run in MEGATRON_TABLE_1:
        assert round(run.shape.parameters / 1e9, 1) == float(run.name[:-1]), run.name  # the table's rounding


def test_block_flops_are_the_papers_count():
    """Forward, the recompute's forward and a backward of twice the FLOPs per block, and the logit layer's
    forward and backward: equation 3's 96 B s l h^2 (1 + s/6h + V/16lh), at the rate of 1 FLOP/s."""
    for run in MEGATRON_TABLE_1:
        cost = transformer_cost(run.shape, flops=1.0)
        per_sample = sum(2 * b.forward_s + b.backward_s for b in cost.blocks)
        per_sample += cost.other_forward_s + cost.other_backward_s
        assert per_sample == pytest.approx(megatron_flops_per_step(run.shape, 1), rel=1e-9)


@functools.lru_cache(maxsize=1)
def megatron_predictions() -> dict[str, float]:
    rate = achieved_rate(MEGATRON_TABLE_1[0], SELENE)  # the 1.7B row: data parallelism alone
    return {
        run.name: predicted_tflops_per_gpu(run, SELENE, rate) / run.reported - 1 for run in MEGATRON_TABLE_1
    }


@pytest.mark.slow
def test_megatron_table_1_within_20_percent_up_to_76b():
    errors = megatron_predictions()
    assert errors["1.7B"] == pytest.approx(0.0, abs=1e-6)  # the row the device's rate is taken from
    for name in WITHIN_20:
        assert abs(errors[name]) <= 0.20, (name, errors[name])


@pytest.mark.slow
def test_megatron_larger_models_are_predicted_low_because_their_blocks_run_faster():
    """From 145.6B on the prediction is more than 20% low: a block's achieved rate grows with its width
    (the paper's "superlinear" scaling), and one rate measured on the 2304-wide blocks misses it: the rate
    that would match a row is higher for the wide blocks (h >= 12288) than for any of the narrow ones
    (h <= 6144)."""
    errors = megatron_predictions()
    for name in ("145.6B", "310.1B", "529.6B", "1008.0B"):
        assert -0.35 < errors[name] < -0.20, (name, errors[name])
    by_name = {run.name: run for run in MEGATRON_TABLE_1}
    narrow = [achieved_rate(by_name[n], SELENE) for n in ("1.7B", "3.6B", "7.5B", "18.4B")]
    wide = [achieved_rate(by_name[n], SELENE) for n in ("145.6B", "1008.0B")]
    assert min(wide) > max(narrow)


def test_torchtitan_405b_interleaved_over_1f1b_within_10_percent_of_1_28():
    cluster = Cluster.load("h100_64x8")
    one_f_one_b, interleaved = (predict_run(run, cluster) for run in TORCHTITAN_405B)
    assert interleaved.layout.devices == one_f_one_b.layout.devices == 512
    ratio = one_f_one_b.step_s / interleaved.step_s
    reported = TORCHTITAN_405B[1].reported / TORCHTITAN_405B[0].reported
    assert reported == pytest.approx(1.28)
    assert abs(ratio / reported - 1) <= 0.10, ratio
