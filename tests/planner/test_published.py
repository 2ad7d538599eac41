"""The cost model against published runs (docs/planner_published.md): Megatron-LM's table 1 (Narayanan et al.,
SC'21) on its DGX A100 cluster, and torchtitan's Llama 3.1 405B on 512 H100, each model built from its shape."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from lightning_parallel.memory.expected import block_activation_bytes
from lightning_parallel.planner.cluster import Cluster
from lightning_parallel.planner.published import (
    A100_MEMORY_BANDWIDTH,
    MEGATRON_TABLE_1,
    TORCHTITAN_405B,
    DeviceRates,
    _least_squares_2,
    achieved_rate,
    fit_device_rates,
    megatron_flops_per_step,
    predict_run,
    predicted_tflops_per_gpu,
    transformer_cost,
)

SELENE = Cluster.load("a100_selene")
#: the rows without pipeline stages: their step is the blocks' time and the tensor-parallel collectives,
#: linear in the device's two rates, which are fitted on them; the pipelined rows are then predictions
UNPIPELINED = [run for run in MEGATRON_TABLE_1 if run.layout.pp == 1]


def test_device_rates_add_matrix_products_and_memory_traffic():
    rates = DeviceRates(matmul_flops=100.0, bandwidth=10.0, traffic=2.0)
    assert rates.seconds(300.0, 0.0) == pytest.approx(3.0)
    assert rates.seconds(0.0, 5.0) == pytest.approx(1.0)  # 2 bytes moved per saved byte, 10 bytes/s
    assert rates.seconds(300.0, 5.0) == pytest.approx(4.0)
    assert DeviceRates(100.0).seconds(300.0, 5.0) == pytest.approx(3.0)  # one rate: FLOPs alone


def test_least_squares_of_two_unknowns_solves_an_exact_system_and_averages_a_noisy_one():
    assert _least_squares_2([(1, 0, 3), (0, 1, -2)]) == pytest.approx((3, -2))
    assert _least_squares_2([(1, 1, 5), (1, -1, 1), (2, 0, 6)]) == pytest.approx((3, 2))
    assert _least_squares_2([(1, 0, 1), (1, 0, 3), (0, 1, 0)]) == pytest.approx((2, 0))


def test_a_tensor_parallel_rank_runs_its_share_of_the_products_and_its_whole_norms():
    """After the cost model's division by t, a rank's block forward is 1/t of the matrix products plus the
    memory-bound work of the bytes it saves, whose norms and residual (10 of 34 sbh) are whole on each."""
    run = MEGATRON_TABLE_1[-1]
    rates, t, shape = DeviceRates(2e14, 2e12, 1.5), 8, MEGATRON_TABLE_1[-1].shape
    block = transformer_cost(run.shape, rates, tensor_parallel=t).blocks[0]
    s, h, a = shape.seq, shape.hidden, shape.heads
    saved = block_activation_bytes(block.activation_bytes, block.attention_bytes, 2 * s * h, t, False, False)
    assert saved == pytest.approx(s * h * (10 + 24 / t + 5 * a * s / (h * t)))  # Korthikanti's table 2
    expected = shape.block_forward_flops(1) / t / 2e14 + 1.5 * saved / 2e12
    assert block.forward_s / t == pytest.approx(expected)
    assert block.backward_s == pytest.approx(2 * block.forward_s)
    one_rate = transformer_cost(run.shape, 2e14, tensor_parallel=t).blocks[0]
    assert one_rate.forward_s == pytest.approx(shape.block_forward_flops(1) / 2e14)


def test_the_fit_finds_the_rates_that_made_the_throughputs():
    """Throughputs predicted at planted rates, reported as such, give those rates back."""
    planted = DeviceRates(1.7e14, A100_MEMORY_BANDWIDTH, 2.3)
    runs = [
        dataclasses.replace(r, reported=predicted_tflops_per_gpu(r, SELENE, planted)) for r in UNPIPELINED
    ]
    fitted = fit_device_rates(runs, SELENE, A100_MEMORY_BANDWIDTH)
    assert fitted.matmul_flops == pytest.approx(planted.matmul_flops, rel=1e-3)
    assert fitted.traffic == pytest.approx(planted.traffic, rel=1e-3)


def test_shapes_give_the_tables_parameter_counts():
    for run in MEGATRON_TABLE_1:
        assert round(run.shape.parameters / 1e9, 1) == float(run.name[:-1]), run.name  # the table's rounding


def test_block_flops_are_the_papers_count():
    """Forward, the recompute's forward and a backward of twice the FLOPs per block, and the logit layer's
    forward and backward: equation 3's 96 B s l h^2 (1 + s/6h + V/16lh), at the rate of 1 FLOP/s."""
    for run in MEGATRON_TABLE_1:
        cost = transformer_cost(run.shape, 1.0)
        per_sample = sum(2 * b.forward_s + b.backward_s for b in cost.blocks)
        per_sample += cost.other_forward_s + cost.other_backward_s
        assert per_sample == pytest.approx(megatron_flops_per_step(run.shape, 1), rel=1e-9)


@functools.lru_cache(maxsize=1)
def megatron_errors() -> tuple[DeviceRates, dict[str, float]]:
    rates = fit_device_rates(UNPIPELINED, SELENE, A100_MEMORY_BANDWIDTH)
    return rates, {
        run.name: predicted_tflops_per_gpu(run, SELENE, rates) / run.reported - 1 for run in MEGATRON_TABLE_1
    }


def test_megatron_table_1_within_20_percent_at_rates_fitted_without_pipelines():
    """The device's two rates fitted on the 4 rows without pipeline stages (1.7B-18.4B); the 6 pipelined
    rows (39.1B-1T) are predictions. The fitted rates are physical: the products below the A100's peak, a
    few bytes moved per byte saved."""
    rates, errors = megatron_errors()
    assert 0.4 * SELENE.flops < rates.matmul_flops < 0.9 * SELENE.flops, rates
    assert 1.0 < rates.traffic < 4.0, rates
    for name, error in errors.items():
        assert abs(error) <= 0.20, (name, error)


def test_one_rate_for_every_width_predicts_the_wide_models_low():
    """The model this replaces: one rate, the 1.7B row's, predicts the 145.6B row more than 20% low; the
    memory-bound share of a block falls as it widens, which the fitted rates see."""
    by_name = {run.name: run for run in MEGATRON_TABLE_1}
    one_rate = achieved_rate(by_name["1.7B"], SELENE)
    wide = by_name["145.6B"]
    assert predicted_tflops_per_gpu(wide, SELENE, one_rate) / wide.reported - 1 < -0.20
    assert abs(megatron_errors()[1]["145.6B"]) < 0.10


def test_torchtitan_405b_interleaved_over_1f1b_within_10_percent_of_1_28():
    cluster = Cluster.load("h100_64x8")
    one_f_one_b, interleaved = (predict_run(run, cluster) for run in TORCHTITAN_405B)
    assert interleaved.layout.devices == one_f_one_b.layout.devices == 512
    ratio = one_f_one_b.step_s / interleaved.step_s
    reported = TORCHTITAN_405B[1].reported / TORCHTITAN_405B[0].reported
    assert reported == pytest.approx(1.28)
    assert abs(ratio / reported - 1) <= 0.10, ratio
