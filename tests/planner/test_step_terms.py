"""The step model's measured terms, each as a pure function against figures computed by hand: a block's
batch-independent share and its measured tensor-parallel shard, the calibrated collectives, gloo's
sequence-parallel collectives, the overlap a CPU box whose processes fill its cores does not have."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from lightning_parallel.planner.cluster import Cluster, Link
from lightning_parallel.planner.collective_time import (
    all_gather_s,
    all_reduce_s,
    p2p_s,
    reduce_scatter_s,
    ring_figures,
)
from lightning_parallel.planner.cost_model import (
    BlockCost,
    ModelCost,
    block_seconds,
    call_wait_s,
    compute_scale,
    predict,
    tensor_parallel_s,
)
from lightning_parallel.planner.layout import Layout
from lightning_parallel.planner.measure import fixed_seconds

LINK = Link(bandwidth=1e9, latency=1e-4)


def test_fixed_share_does_not_shrink_with_the_batch_or_split_over_tp() -> None:
    # 1 s of 3 is fixed, shared 1:2 between the passes; the other 2 s halve with the batch and with tp
    forward, backward = block_seconds(1.0, 2.0, 1.0, scale=0.5, tp=2)
    assert forward == pytest.approx(1 / 3 + 2 / 3 * 0.25)
    assert backward == pytest.approx(2 / 3 + 4 / 3 * 0.25)
    assert block_seconds(1.0, 2.0, 0.0, 0.5, 2) == pytest.approx((0.25, 0.5))  # no fixed share: linear
    assert block_seconds(1.0, 2.0, 5.0, 0.1, 1) == pytest.approx((1.0, 2.0))  # at most the whole time


def test_fixed_seconds_is_the_line_through_two_batches_at_no_samples() -> None:
    assert fixed_seconds(whole_s=10.0, part_s=4.0, batch=8, part=2) == pytest.approx(2.0)
    assert fixed_seconds(10.0, 1.0, 8, 2) == 0.0  # faster than linear: no fixed part, not a negative one
    assert fixed_seconds(10.0, 10.0, 8, 2) == 10.0
    assert fixed_seconds(10.0, 4.0, 8, 8) == 0.0


def test_a_measured_shard_replaces_the_one_over_tp_estimate() -> None:
    block = BlockCost(1.0, 2.0, 0.0, 0.0, fixed_s=0.0, tp_s=((2, 2.0),))
    assert block.seconds(1.0, 2) == pytest.approx((2 / 3, 4 / 3))  # the shard measured 2 of 3 s
    assert block.seconds(0.5, 2) == pytest.approx((1 / 3, 2 / 3))
    assert block.seconds(1.0, 4) == pytest.approx((0.25, 0.5))  # not measured at 4: divided
    model = ModelCost([block], 0.0, 1, other_forward_s=1.0, other_backward_s=2.0, other_tp_s=((2, 1.5),))
    assert model.other_seconds(1.0, 2) == pytest.approx((0.5, 1.0))
    assert model.other_seconds(2.0, 4) == pytest.approx((0.5, 1.0))


@pytest.mark.parametrize("name", ["all_reduce", "all_gather", "reduce_scatter", "send_recv"])
def test_calibrated_collectives_give_back_the_measured_call(name: str) -> None:
    """A fit over 2 ranks (latency + bytes per rank x seconds per byte), as ring figures on the link, gives
    the fitted time of that call; a collective not calibrated keeps the link's message figures."""
    latency, per_byte, per_rank = 3e-4, 2e-9, 2**19
    bandwidth, step = ring_figures(name, 2, latency, per_byte)
    link = dataclasses.replace(LINK, collectives=((name, bandwidth, step),))
    fitted = latency + per_rank * per_byte
    predicted = {
        "all_reduce": lambda: all_reduce_s(per_rank, 2, link),
        "all_gather": lambda: all_gather_s(2 * per_rank, 2, link),  # the gathered output: 2 pieces
        "reduce_scatter": lambda: reduce_scatter_s(per_rank, 2, link),
        "send_recv": lambda: p2p_s(per_rank, link),
    }[name]()
    assert predicted == pytest.approx(fitted)
    if name != "all_reduce":
        assert all_reduce_s(per_rank, 2, link) == all_reduce_s(per_rank, 2, LINK)


def test_a_cluster_yaml_carries_its_calibrated_collectives(tmp_path) -> None:
    link = dataclasses.replace(LINK, collectives=(("all_reduce", 5e8, 2e-4),))
    cluster = Cluster("c", 1, 2, 1e9, 1e10, link, LINK, cores=2, backend="gloo")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cluster.as_mapping()))
    assert Cluster.load(path) == cluster
    assert Cluster.load("cpu_2core").within_node.of("all_reduce") != Cluster.load("cpu_2core").within_node


def test_sequence_parallel_on_gloo_is_four_all_reduces() -> None:
    """The package's sequence-parallel all-gather and reduce-scatter each all-reduce the whole tensor on
    gloo (``collectives._on_host``): twice tensor parallelism's two all-reduces."""
    size = 2**19
    assert tensor_parallel_s(size, 2, LINK, False, "gloo") == pytest.approx(2 * all_reduce_s(size, 2, LINK))
    assert tensor_parallel_s(size, 2, LINK, True, "gloo") == pytest.approx(4 * all_reduce_s(size, 2, LINK))
    nccl = tensor_parallel_s(size, 2, LINK, True, "nccl")
    assert nccl == pytest.approx(2 * (all_gather_s(size, 2, LINK) + reduce_scatter_s(size, 2, LINK)))
    assert tensor_parallel_s(size, 1, LINK, True, "gloo") == 0.0


def test_no_overlap_where_the_processes_fill_the_cores() -> None:
    """With devices of their own the reduce of 4 buckets hides behind a long backward but for the last;
    on a CPU box whose 2 processes fill its 2 cores, gloo's work runs on those cores: all of it is added."""
    bucket = 25 * 2**20
    cost = ModelCost([BlockCost(1.0, 100.0, 0.0, bucket)] * 4, 0.0, 1)
    layout = Layout(dp=2, tp=1, pp=1, global_batch=2)
    gpus = Cluster("g", 1, 2, 1e12, 1e15, LINK, LINK)
    whole = 4 * all_reduce_s(bucket, 2, LINK)
    assert predict(cost, layout, gpus).data_parallel_s == pytest.approx(whole / 4)
    box = dataclasses.replace(gpus, cores=2)
    assert predict(cost, layout, box).data_parallel_s == pytest.approx(whole)
    assert predict(cost, layout, dataclasses.replace(box, cores=4)).data_parallel_s == pytest.approx(whole / 4)


def test_zero_3_gathers_every_unit_where_nothing_overlaps() -> None:
    """ZeRO-3 without pipeline stages: each unit's parameters gathered for its forward and its backward (the
    last two units kept between them) and its gradients reduce-scattered; with a core to spare only a unit's
    share of the gathers and the last reduce show."""
    unit = 2**20
    cost = ModelCost([BlockCost(1.0, 100.0, 0.0, unit)] * 4, 0.0, 1)
    layout = Layout(dp=2, tp=1, pp=1, global_batch=2, zero_stage=3)
    box = Cluster("b", 1, 2, 1e12, 1e15, LINK, LINK, cores=2)
    gathers, reduces = 6 * all_gather_s(unit, 2, LINK), 4 * reduce_scatter_s(unit, 2, LINK)
    assert predict(cost, layout, box).data_parallel_s == pytest.approx(gathers + reduces)
    spare = dataclasses.replace(box, cores=0)
    assert predict(cost, layout, spare).data_parallel_s == pytest.approx(gathers / 4 + reduces / 4)


def test_processes_outnumbering_cores_wait_a_turn_at_each_collective() -> None:
    """4 tp2 processes on 2 cores: each of the 8 blocks' 2 + 2 all-reduces, and the dp all-reduce, waits
    for the other process on its peer's core (4 / 2 - 1) to finish its slice, half of it on average; with a
    core each, nothing waits."""
    cost = ModelCost([BlockCost(1.0, 2.0, 0.0, 4.0)] * 8, 0.0, 2)
    layout = Layout(dp=2, tp=2, pp=1, global_batch=4)
    free = Link(float("inf"), 0.0)
    box = Cluster("b", 1, 4, 1e12, 1e15, free, free, cores=4, slice_s=1e-3)
    alone = predict(cost, layout, box).step_s
    shared = dataclasses.replace(box, cores=2)
    work = 4 * 8 * 1.5 / 2  # 4 processes' 8 blocks of 1.5 s (half the batch, half the block) on 2 cores
    assert predict(cost, layout, shared).step_s == pytest.approx(work + (8 * 4 + 1) * 1e-3 / 2)
    assert alone == pytest.approx(8 * 1.5)


def test_a_core_per_process_pays_its_wake_up_at_each_collective() -> None:
    """2 tp2 processes on 2 cores whose idle core takes 1 ms to wake: each of the 8 blocks' 2 + 2
    all-reduces costs 1 ms more; 4 processes on the 2 cores wait their turn instead (no core idles), and
    devices of their own, or one process, pay neither."""
    cost = ModelCost([BlockCost(1.0, 2.0, 0.0, 4.0)] * 8, 0.0, 2)
    free = Link(float("inf"), 0.0)
    box = Cluster("b", 1, 2, 1e12, 1e15, free, free, cores=2, wake_s=1e-3)
    tp2 = Layout(dp=1, tp=2, pp=1, global_batch=2)
    awake = dataclasses.replace(box, wake_s=0.0)
    assert predict(cost, tp2, box).step_s == pytest.approx(predict(cost, tp2, awake).step_s + 8 * 4 * 1e-3)
    four = dataclasses.replace(box, devices_per_node=4, slice_s=2e-3)
    assert call_wait_s(Layout(dp=2, tp=2, pp=1, global_batch=4), four) == pytest.approx(1e-3)
    assert call_wait_s(tp2, dataclasses.replace(box, cores=0)) == 0.0
    assert call_wait_s(Layout(dp=1, tp=1, pp=1, global_batch=2), box) == 0.0


def test_tensor_parallel_calls_are_the_blocks_and_the_rest_counted() -> None:
    """tp2 on 2 cores whose blocking calls cost 1 ms each beyond their time: 8 blocks' 2 + 2 all-reduces and
    the rest's 3 counted calls; under sequence parallelism 4 + 4 a block (an all-gather and a reduce-scatter
    for each, on gloo all-reduces, whichever the backend) and 2 more in its backward, its regions' saved
    inputs gathered again."""
    free = Link(float("inf"), 0.0)
    cost = ModelCost([BlockCost(1.0, 2.0, 0.0, 4.0)] * 8, 0.0, 2, other_tp_calls=((2, 3),))
    for backend in ("gloo", "nccl"):
        box = Cluster("b", 1, 2, 1e12, 1e15, free, free, cores=2, wake_s=1e-3, backend=backend)
        awake = dataclasses.replace(box, wake_s=0.0)
        for sp, calls in ((False, 8 * 4 + 3), (True, 8 * 10 + 3)):
            tp2 = Layout(dp=1, tp=2, pp=1, global_batch=2, sequence_parallel=sp)
            extra = predict(cost, tp2, box).step_s - predict(cost, tp2, awake).step_s
            assert extra == pytest.approx(calls * 1e-3), (backend, sp)


def test_a_block_counted_with_one_region_pays_half_a_transformer_blocks_collectives() -> None:
    """Blocks whose shard issued 2 collectives in a forward and backward (one region: an MLP split, its
    attention not) pay one all-reduce a pass and 2 calls, where uncounted blocks pay Megatron's two regions."""
    free = Link(float("inf"), 0.0)
    box = Cluster("b", 1, 2, 1e12, 1e15, LINK, LINK, cores=2, wake_s=1e-3, backend="gloo")
    awake = dataclasses.replace(box, wake_s=0.0)
    tp2 = Layout(dp=1, tp=2, pp=1, global_batch=2)
    whole = BlockCost(1.0, 2.0, 0.0, 4.0, output_bytes=2**19)
    counted = dataclasses.replace(whole, tp_calls=((2, 2),))
    no_links = dataclasses.replace(awake, within_node=free)
    assert counted.regions(2) == 1 and whole.regions(2) == 2 and counted.regions(4) == 2
    for block, calls in ((whole, 8 * 4), (counted, 8 * 2)):
        cost = ModelCost([block] * 8, 0.0, 2)
        extra = predict(cost, tp2, box).step_s - predict(cost, tp2, awake).step_s
        assert extra == pytest.approx(calls * 1e-3)
        comm = predict(cost, tp2, awake).pipeline_s - predict(cost, tp2, no_links).pipeline_s
        assert comm == pytest.approx(calls * all_reduce_s(2**19, 2, LINK))


def test_zero_3_blocks_on_its_first_gather_and_its_reductions_end() -> None:
    """ZeRO-3 on 2 processes that fill their 2 cores: of its 6 gathers and 4 reduce-scatters (4 units) only
    the first unit's gather and the wait for the reductions block the rank, so it pays 2 wake-ups, as plain
    data parallelism pays 1 (its bucket's reduce) and ZeRO-1 2 (the reduce and the post-step gather)."""
    cost = ModelCost([BlockCost(1.0, 2.0, 0.0, 4.0)] * 4, 0.0, 2)
    free = Link(float("inf"), 0.0)
    box = Cluster("b", 1, 2, 1e12, 1e15, free, free, cores=2, wake_s=1e-3)
    awake = dataclasses.replace(box, wake_s=0.0)
    for zero_stage, calls in ((0, 1), (1, 2), (3, 2)):
        dp2 = Layout(dp=2, tp=1, pp=1, global_batch=2, zero_stage=zero_stage)
        extra = predict(cost, dp2, box).step_s - predict(cost, dp2, awake).step_s
        assert extra == pytest.approx(calls * 1e-3), zero_stage


def test_ranks_computing_at_once_on_shared_cores_compute_slower() -> None:
    """A box whose ranks slow each other by 1.2 when both of its 2 cores compute: 2 processes' blocks and
    optimizer step take 1.2 times as long; one process, or devices of their own, are not slowed; 3
    processes on 4 cores occupy 2 of the 3 other cores."""
    cost = ModelCost([BlockCost(1.0, 2.0, 0.0, 4.0)] * 4, 0.0, 2, optimizer_step_s=0.5)
    free = Link(float("inf"), 0.0)
    box = Cluster("b", 1, 2, 1e12, 1e15, free, free, cores=2, shared_compute=1.2)
    dp2 = Layout(dp=2, tp=1, pp=1, global_batch=4)
    alone = predict(cost, dp2, dataclasses.replace(box, shared_compute=1.0))
    shared = predict(cost, dp2, box)
    assert shared.pipeline_s == pytest.approx(1.2 * alone.pipeline_s)
    assert shared.optimizer_s == pytest.approx(1.2 * alone.optimizer_s)
    assert compute_scale(Layout(dp=1, tp=1, pp=1, global_batch=2), box) == 1.0
    assert compute_scale(dp2, dataclasses.replace(box, cores=0)) == 1.0
    four = dataclasses.replace(box, devices_per_node=4, cores=4)
    assert compute_scale(Layout(dp=3, tp=1, pp=1, global_batch=3), four) == pytest.approx(1 + 0.2 * 2 / 3)


def test_the_zero_bubble_schedules_pay_their_measured_split_backward() -> None:
    """A model whose blocks' backward takes 1.5x as long split in two: ZB-H1 and ZBV on 2 stages predict
    their schedules on blocks whose backward is 1.5x as long; 1F1B, and ZB-H1 on one stage, are unchanged."""
    free = Link(float("inf"), 0.0)
    gpus = Cluster("g", 1, 2, 1e12, 1e15, free, free)
    whole = ModelCost([BlockCost(1.0, 2.0, 0.0, 4.0)] * 4, 0.0, 4)
    split = dataclasses.replace(whole, split_backward=1.5)
    slower = ModelCost([BlockCost(1.0, 3.0, 0.0, 4.0)] * 4, 0.0, 4)
    for schedule, v in (("zb_h1", 1), ("zbv", 2)):
        layout = Layout(1, 1, 2, 4, schedule=schedule, num_microbatches=4, virtual_stages=v)
        assert predict(split, layout, gpus).step_s == pytest.approx(predict(slower, layout, gpus).step_s)
        assert predict(split, layout, gpus).step_s > predict(whole, layout, gpus).step_s
    one_f_one_b = Layout(1, 1, 2, 4, schedule="1f1b", num_microbatches=4)
    assert predict(split, one_f_one_b, gpus).step_s == predict(whole, one_f_one_b, gpus).step_s


def test_lightning_s_work_around_a_step_is_charged_once_on_every_rank() -> None:
    """0.5 s of Lightning's work a step: with devices of their own each rank pays it once, whatever the
    layout; on 2 cores shared by 2 ranks computing at 1.2x, it is paid at 1.2x; on 2 cores shared by 4
    processes it is in the cores' work, once per process."""
    free = Link(float("inf"), 0.0)
    gpus = Cluster("g", 1, 4, 1e12, 1e15, free, free)
    bare = ModelCost([BlockCost(1.0, 2.0, 0.0, 4.0)] * 4, 0.0, 4, optimizer_step_s=0.25)
    loop = dataclasses.replace(bare, step_overhead_s=0.5)
    layouts = [
        Layout(2, 1, 1, 4),
        Layout(1, 2, 1, 4),
        Layout(1, 1, 2, 4, schedule="1f1b", num_microbatches=4),
        Layout(2, 1, 1, 4, zero_stage=3),
    ]
    for layout in layouts:
        assert predict(loop, layout, gpus).step_s == pytest.approx(predict(bare, layout, gpus).step_s + 0.5)
    box = dataclasses.replace(gpus, devices_per_node=2, cores=2, shared_compute=1.2)
    dp2 = Layout(2, 1, 1, 4)
    assert predict(loop, dp2, box).step_s == pytest.approx(predict(bare, dp2, box).step_s + 0.6)
    four = dataclasses.replace(gpus, cores=2)
    dp4 = Layout(4, 1, 1, 4)
    work = 4 * (4 * 3.0 / 4 + 0.25 * 1.0 + 0.5) / 2  # 4 processes' quarter-batch blocks, optimizer, loop
    assert predict(loop, dp4, four).step_s == pytest.approx(work + call_wait_s(dp4, four))
