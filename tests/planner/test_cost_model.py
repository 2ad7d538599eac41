"""The cost model against figures computed by hand: ring collectives, the schedules' own bubbles, the ZeRO
paper's model states, and the directions in which a layout's figures must move."""

from __future__ import annotations

import dataclasses
import math

import pytest

from lightning_parallel.memory.expected import model_state_bytes, state_bytes_for
from lightning_parallel.pipeline.schedules import bubble_fraction
from lightning_parallel.planner.cluster import Cluster, Link
from lightning_parallel.planner.collective_time import (
    all_gather_s,
    all_reduce_s,
    all_to_all_s,
    p2p_s,
    reduce_scatter_s,
)
from lightning_parallel.planner.cost_model import BUCKET_BYTES, BlockCost, ModelCost, predict
from lightning_parallel.planner.layout import Layout

FREE = Link(bandwidth=math.inf, latency=0.0)
LINK = Link(bandwidth=1e10, latency=1e-5)


def cluster(link: Link = FREE, devices: int = 8) -> Cluster:
    return Cluster("test", 1, devices, 80e9, 1e15, link, link)


def model(blocks: int = 8, forward: float = 1.0, backward: float = 2.0, **block) -> ModelCost:
    cost = BlockCost(
        forward, backward, activation_bytes=1000.0, parameter_bytes=4000.0, output_bytes=100.0, **block
    )
    return ModelCost([cost] * blocks, other_parameter_bytes=0.0, batch_size=1)


def test_ring_collectives_by_hand() -> None:
    # 2(n-1) steps of 10 us, and 2(n-1)/n of 1 GB at 10 GB/s
    assert all_reduce_s(1e9, 8, LINK) == pytest.approx(14e-5 + 1.75 * 0.1)
    assert all_gather_s(1e9, 4, LINK) == pytest.approx(3e-5 + 0.75 * 0.1)
    assert reduce_scatter_s(1e9, 4, LINK) == all_gather_s(1e9, 4, LINK)
    assert p2p_s(1e9, LINK) == pytest.approx(1e-5 + 0.1)
    assert all_reduce_s(1e9, 1, LINK) == 0.0


@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)])
def test_bubble_is_the_schedules_own(schedule: str, v: int) -> None:
    """Equal stages, free communication: stage 0 idles (p-1)/(v m + p-1) of the step, and the step is the
    busy time over the busy share: (m + (p-1)/v) x (F + B) of a stage."""
    p, m = 4, 8
    layout = Layout(dp=1, tp=1, pp=p, global_batch=m, schedule=schedule, num_microbatches=m, virtual_stages=v)
    prediction = predict(model(), layout, cluster())
    assert prediction.bubble == pytest.approx(bubble_fraction(p, m, v))
    assert prediction.step_s == pytest.approx(m * 6 / (1 - bubble_fraction(p, m, v)))
    assert prediction.step_s == pytest.approx((m + (p - 1) / v) * 6)


def test_one_device_step_is_the_work() -> None:
    layout = Layout(dp=1, tp=1, pp=1, global_batch=2)
    prediction = predict(model(), layout, cluster())
    assert prediction.step_s == pytest.approx(2 * 8 * 3.0)  # 2 samples x 8 blocks x (F + B)


def test_data_parallel_reduce_without_overlap_is_the_ring_all_reduce() -> None:
    """No backward to hide behind: the whole all-reduce of the gradients is exposed (one bucket)."""
    layout = Layout(dp=4, tp=1, pp=1, global_batch=4)
    prediction = predict(model(backward=0.0), layout, cluster(LINK))
    assert prediction.data_parallel_s == pytest.approx(all_reduce_s(8 * 4000.0, 4, LINK))


def test_data_parallel_reduce_hides_behind_the_backward() -> None:
    """A long backward hides all but the last bucket's reduce; a pipeline schedule whose reducer waits until
    after the schedule (ZB-H1) hides nothing."""
    blocks = [BlockCost(1.0, 2.0, 1000.0, 2 * BUCKET_BYTES, 100.0)] * 4
    cost = ModelCost(blocks, 0.0, 1)
    slow = Link(bandwidth=1e9, latency=0.0)
    whole = all_reduce_s(8 * BUCKET_BYTES, 2, slow)
    hidden = predict(cost, Layout(dp=2, tp=1, pp=1, global_batch=2), cluster(slow)).data_parallel_s
    assert hidden == pytest.approx(whole / 8)
    exposed = predict(
        cost, Layout(dp=2, tp=1, pp=2, global_batch=4, schedule="zb_h1", num_microbatches=2), cluster(slow)
    ).data_parallel_s
    assert exposed == pytest.approx(all_reduce_s(4 * BUCKET_BYTES, 2, slow))


def test_zero_stages_follow_the_paper() -> None:
    """ZeRO's figure 1: Ψ = 7.5B, Nd = 64, mixed-precision Adam (K = 12): 120, 31.4, 16.6 and 1.9 GB."""
    psi, paper = 7.5e9, state_bytes_for("paper")
    totals = [model_state_bytes(psi, 64, stage, "adam", paper).total / 1e9 for stage in range(4)]
    assert totals == pytest.approx([120.0, 31.40625, 16.640625, 1.875])
    assert totals[3] == pytest.approx((2 + 2 + 12) * psi / 64 / 1e9)


def test_predicted_states_are_the_expected_formula_of_the_ranks_share() -> None:
    """tp=2 x pp=2: a rank holds 4 of the 8 blocks, half of each; its states are memory.expected's."""
    cost = model()
    layout = Layout(dp=2, tp=2, pp=2, global_batch=8, num_microbatches=2, zero_stage=1)
    prediction = predict(cost, layout, cluster())
    elements = 4 * 4000.0 / 2 / 4
    assert prediction.states == model_state_bytes(elements, 2, 1, "adamw", state_bytes_for("32-true"))


def test_memory_falls_with_each_zero_stage_and_with_recompute() -> None:
    cost = model()
    peaks = [predict(cost, Layout(4, 1, 1, 8, zero_stage=z), cluster()).peak_bytes for z in (0, 1, 2)]
    assert peaks[0] > peaks[1] > peaks[2]
    plain = predict(cost, Layout(1, 1, 1, 8), cluster()).activation_bytes
    recomputed = predict(cost, Layout(1, 1, 1, 8, recompute=True), cluster()).activation_bytes
    assert recomputed < plain
    slower = predict(cost, Layout(1, 1, 1, 8, recompute=True), cluster()).step_s
    assert slower > predict(cost, Layout(1, 1, 1, 8), cluster()).step_s


def test_gpipe_holds_every_microbatch_and_1f1b_the_stages() -> None:
    cost = model()
    base = Layout(1, 1, 4, 16, num_microbatches=16)
    gpipe = predict(cost, dataclasses.replace(base, schedule="gpipe"), cluster()).activation_bytes
    one_f_one_b = predict(cost, base, cluster()).activation_bytes
    assert gpipe == pytest.approx(16 * 2 * 1000.0)  # 16 micro-batches of one sample through 2 blocks
    assert one_f_one_b == pytest.approx(4 * 2 * 1000.0)  # stage 0 of 1F1B: p in flight


def test_tensor_parallel_collectives_sit_on_the_critical_path_and_slow_links_cost_more() -> None:
    cost = model()
    layout = Layout(dp=1, tp=2, pp=1, global_batch=1)
    free = predict(cost, layout, cluster()).step_s
    assert free == pytest.approx(8 * 3.0 / 2)
    slow = predict(cost, layout, cluster(LINK)).step_s
    assert slow == pytest.approx(free + 8 * 4 * all_reduce_s(100.0, 2, LINK))
    sp = predict(cost, dataclasses.replace(layout, sequence_parallel=True), cluster(LINK))
    assert sp.activation_bytes < predict(cost, layout, cluster(LINK)).activation_bytes


def test_experts_are_shared_out_over_ep_and_their_tokens_cross_by_all_to_all() -> None:
    """3000 of each block's 4000 parameter bytes in experts: at ep=2 a rank keeps half of them; each expert
    block adds a dispatch and a combine all-to-all of its output, forward and backward."""
    cost = model(expert_parameter_bytes=3000.0)
    layout = Layout(dp=2, tp=1, pp=1, global_batch=2, ep=2)
    prediction = predict(cost, layout, cluster(LINK))
    dense, experts = 8 * 1000.0 / 4, 8 * 3000.0 / 2 / 4
    assert prediction.states.parameters == pytest.approx((dense + experts) * 4)
    no_experts = predict(model(), layout, cluster(LINK))
    assert prediction.pipeline_s - no_experts.pipeline_s == pytest.approx(
        8 * 4 * all_to_all_s(100.0, 2, LINK)
    )


def test_zero_3_shards_the_parameters_too() -> None:
    peaks = [predict(model(), Layout(4, 1, 1, 8, zero_stage=z), cluster()).peak_bytes for z in (2, 3)]
    assert peaks[1] < peaks[0]


def test_a_recomputed_block_and_its_heads_activations_are_never_held_together() -> None:
    """Full recompute: the stage keeps each block's input, plus the larger of the head's activations (held
    until the head's backward) and one block rebuilt beyond its input (rebuilt after that backward)."""
    cost = dataclasses.replace(model(), other_activation_bytes=300.0)
    prediction = predict(cost, Layout(1, 1, 1, 1, recompute=True), cluster())
    assert prediction.activation_bytes == pytest.approx(8 * 100.0 + max(300.0, 1000.0 - 100.0))
    big_head = dataclasses.replace(cost, other_activation_bytes=5000.0)
    assert predict(big_head, Layout(1, 1, 1, 1, recompute=True), cluster()).activation_bytes == pytest.approx(
        8 * 100.0 + 5000.0
    )


def test_gpipe_holds_the_head_of_every_microbatch_and_1f1b_one() -> None:
    cost = dataclasses.replace(model(), other_activation_bytes=300.0)
    base = Layout(1, 1, 2, 4, num_microbatches=4)
    last_gpipe = predict(cost, dataclasses.replace(base, schedule="gpipe"), cluster())
    # both stages hold 4 micro-batches x 4 blocks; the last also 4 heads
    assert last_gpipe.activation_bytes == pytest.approx(4 * 4 * 1000.0 + 4 * 300.0)
    one_f_one_b = predict(cost, base, cluster())  # stage 0: 2 in flight; stage 1: 1 and one head
    assert one_f_one_b.activation_bytes == pytest.approx(2 * 4 * 1000.0)


def test_processes_sharing_cores_take_turns() -> None:
    """4 data-parallel processes on a box of 2 cores: a step is their work over the cores, twice one
    process's; on 4 cores (or devices of their own) it is one process's."""
    layout = Layout(dp=4, tp=1, pp=1, global_batch=4)
    alone = predict(model(), layout, cluster(devices=4)).step_s
    assert alone == pytest.approx(8 * 3.0)
    shared = dataclasses.replace(cluster(devices=4), cores=2)
    assert predict(model(), layout, shared).step_s == pytest.approx(2 * alone)
    assert predict(model(), layout, dataclasses.replace(shared, cores=4)).step_s == pytest.approx(alone)
def test_zero_3_under_pipeline_stages_holds_the_stage_gathered_through_the_step() -> None:
    """Under pipeline stages a stage's units stay gathered across its micro-batches: between steps 1/dp of
    its parameters, within the step all of them besides the shard, so the peak is stage 2's plus the shard."""
    z2, z3 = (
        predict(model(), Layout(2, 1, 2, 8, num_microbatches=2, zero_stage=z), cluster()) for z in (2, 3)
    )
    assert z3.states.parameters == pytest.approx(z2.states.parameters / 2)
    assert z3.gathered_bytes == pytest.approx(z2.states.parameters)
    assert z3.peak_bytes == pytest.approx(z2.peak_bytes + z2.states.parameters / 2)
