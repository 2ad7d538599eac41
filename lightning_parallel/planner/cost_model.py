"""The cost model: a layout's step time and peak memory per rank, from per-block measurements and a cluster.

Pure: no process, no tensor. What it models, in the order a step runs (docs/planner.md):

- compute: each block's forward and backward on one tp rank (as timed on its shard, else ``1/tp``), its
  batch-independent share kept and the rest scaled linearly from the measured batch to the micro-batch;
  under ZB-H1 and ZBV the backward as its measured split into two passes costs (``split_backward``);
  the blocks cut into ``pp x v`` chunks as the pipeline cuts them (``partition.balance`` over parameter
  counts, ``balance="parameters"``, the default); the rest of the model (embedding, head, loss)
  on the last stage. Full recompute runs each block's forward again in its backward; selective recompute
  its attention core;
- tensor parallelism: two all-reduces per block forward and two backward (Megatron's f and g), or as
  many all-gathers and reduce-scatters under sequence parallelism (on gloo all-reduces) and a backward
  all-gather of each region's saved input, and the rest's collectives as counted on a shard
  (``ModelCost.other_tp_calls``), on the critical path; every collective at its calibrated figures where
  the link has them;
- expert parallelism: an all-to-all to dispatch and one to combine per expert block, forward and backward;
- the pipeline: one message per chunk boundary each way, then the schedule's own clock
  (``schedules.expected_bubbles``): each rank's busy time over its busy share. The async schedule has no
  flush, so its step is the busiest rank's work;
- data parallelism: the gradients' ring all-reduce (ZeRO 1/2: reduce-scatter, then the parameters'
  all-gather after the step; ZeRO 3 also gathers each unit's parameters in forward and backward). The
  reduce overlaps the last backward (the whole backward without pipeline stages) where the reducer's hooks
  start it during that backward (``schedules.OVERLAPPED``) and a core is spare; the post-step all-gather
  never overlaps;
- processes outnumbering a CPU box's cores: the step at least their work over the cores, and each blocking
  collective waiting for its peer's turn (``call_wait_s``); with a core per process, each blocking
  collective waking its rank's idle core (``Cluster.wake_s``); processes computing on several of its cores
  at once: each computes slower, as the box's ``shared_compute`` measured (``compute_scale``);
- the optimizer step on the rank's share of the state, and Lightning's own work around a step
  (``ModelCost.step_overhead_s``), on every rank.

Memory: ``memory.expected``'s model states of the busiest rank's share, and its chunks' activations times
the micro-batches its schedule keeps in flight (``schedules.activation_bound``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence, Union

from lightning_parallel.distributed.zero3 import KEPT_FOR_BACKWARD
from lightning_parallel.memory.expected import (
    ModelStates,
    block_activation_bytes,
    model_state_bytes,
    stage_activation_bytes,
    state_bytes_for,
)
from lightning_parallel.pipeline.partition import balance
from lightning_parallel.pipeline.placement import global_stage
from lightning_parallel.pipeline.schedules import (
    OVERLAPPED,
    SPLIT_BACKWARD,
    activation_bound,
    expected_bubbles,
    schedule,
)
from lightning_parallel.planner.cluster import Cluster
from lightning_parallel.planner.collective_time import (
    all_gather_s,
    all_reduce_s,
    all_to_all_s,
    p2p_s,
    reduce_scatter_s,
)
from lightning_parallel.planner.layout import Layout

__all__ = ["BlockCost", "ModelCost", "Prediction", "predict", "compute_scale", "zero3_gathers", "BUCKET_BYTES"]

#: the tensor-parallel regions of a transformer block where they were not counted: attention and the MLP
TRANSFORMER_REGIONS = 2

#: lp_ddp's gradient bucket size (``bucket_cap_mb=25``): a reduce's latency is paid per bucket
BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class BlockCost:
    """One block of the block stack at ``ModelCost.batch_size`` samples on one device, unsplit.

    ``output_bytes``: its output (the next block's input): what a stage boundary sends and what tensor
    parallelism all-reduces. ``attention_bytes`` / ``attention_s``: the parts of ``activation_bytes`` /
    ``forward_s`` that are the attention core (what selective recompute drops and reruns); 0 if unknown.
    ``expert_parameter_bytes``: the part of ``parameter_bytes`` in experts (shared out over ep).
    ``tp_calls``: its tensor-parallel collectives in a forward and backward on one rank's shard at each tp,
    as counted (``regions``)."""

    forward_s: float
    backward_s: float
    activation_bytes: float
    parameter_bytes: float
    output_bytes: float = 0.0
    attention_bytes: float = 0.0
    attention_s: float = 0.0
    expert_parameter_bytes: float = 0.0
    fixed_s: float = 0.0
    tp_s: tuple[tuple[int, float], ...] = ()
    tp_calls: tuple[tuple[int, int], ...] = ()

    def regions(self, tp: int) -> float:
        """The block's tensor-parallel regions at ``tp``: each a pair of Megatron's f and g, one collective in
        the forward and one in the backward, so half the collectives counted in its forward and backward on
        one rank's shard (``tp_calls``, ``(tp, calls)``), else two (attention and MLP, as Megatron splits a
        transformer block)."""
        return dict(self.tp_calls).get(tp, 2 * TRANSFORMER_REGIONS) / 2

    def seconds(self, scale: float, tp: int) -> tuple[float, float]:
        """Forward and backward seconds at ``scale`` times the measured batch on one of ``tp`` ranks:
        ``fixed_s`` (the part of forward + backward that does not shrink with the batch, each operator's
        dispatch: every tp rank runs every operator) shared between them as their times are, the rest
        scaled, and divided by ``tp``, or where ``tp_s`` has it, the forward + backward measured on one
        rank's shard of the block at ``tp`` (``(tp, seconds)``: the unsplit operators and the sharded
        layers' own work included, their collectives not)."""
        measured = dict(self.tp_s).get(tp)
        if measured is None or tp == 1:
            return block_seconds(self.forward_s, self.backward_s, self.fixed_s, scale, tp)
        share = measured / (self.forward_s + self.backward_s)
        return block_seconds(self.forward_s * share, self.backward_s * share, self.fixed_s, scale, 1)


def block_seconds(forward_s: float, backward_s: float, fixed_s: float, scale: float, tp: int) -> tuple[float, float]:
    """``BlockCost.seconds``: each pass's batch-independent share of ``fixed_s`` plus the rest of it times
    ``scale / tp``."""
    total = forward_s + backward_s
    fixed = min(fixed_s, total) / total if total > 0 else 0.0

    def one(t: float) -> float:
        return t * fixed + t * (1 - fixed) * scale / tp

    return one(forward_s), one(backward_s)


@dataclass(frozen=True)
class ModelCost:
    """A model's blocks and the rest: ``other_*`` is outside the block stack (embeddings, final norm, head,
    loss), run on the last stage and held on every stage. ``optimizer_step_s``: one optimizer step over the
    whole model on one device. ``parameter_itemsize``: the bytes of one parameter element as measured.
    ``split_backward``: the blocks' backward run split in two (the input gradients, then the weights';
    ZB-H1, ZBV) over their time as one backward, as measured. ``step_overhead_s``: what a Lightning training
    step on one process spends beside the module's own work and the optimizer step (its loop, hooks,
    logging, the optimizer's closure), the same on a rank of any layout. ``other_tp_calls``: the rest's
    tensor-parallel collectives in a step (a vocabulary-parallel embedding's, the head's), as counted on one
    rank's shard (``(tp, calls)``)."""

    blocks: Sequence[BlockCost]
    other_parameter_bytes: float
    batch_size: int
    other_forward_s: float = 0.0
    other_backward_s: float = 0.0
    other_activation_bytes: float = 0.0
    optimizer_step_s: float = 0.0
    parameter_itemsize: int = 4
    optimizer: str = "adamw"
    tokens_per_sample: int = 1
    name: str = "model"
    other_tp_s: tuple[tuple[int, float], ...] = ()
    split_backward: float = 1.0
    step_overhead_s: float = 0.0
    other_tp_calls: tuple[tuple[int, int], ...] = ()

    def other_seconds(self, scale: float, tp: int) -> tuple[float, float]:
        """The rest's forward and backward seconds at ``scale`` times the batch on one of ``tp`` ranks: its
        measured ``1/tp`` share, or as ``other_tp_s`` measured it on one rank's shard (``(tp, seconds)``)."""
        whole = self.other_forward_s + self.other_backward_s
        measured = dict(self.other_tp_s).get(tp) if tp > 1 else None
        share = 1 / tp if measured is None or whole <= 0 else measured / whole
        return self.other_forward_s * share * scale, self.other_backward_s * share * scale

    @property
    def parameter_bytes(self) -> float:
        return sum(b.parameter_bytes for b in self.blocks) + self.other_parameter_bytes


@dataclass(frozen=True)
class Prediction:
    """A layout's predicted step (seconds) and its parts, and the peak bytes of its busiest rank."""

    layout: Layout
    step_s: float
    pipeline_s: float  # compute, tensor/expert collectives, stage messages and the bubble
    bubble: float  # the busiest rank's idle share of pipeline_s
    data_parallel_s: float  # the gradient (and ZeRO's parameter) collectives not hidden by the backward
    optimizer_s: float
    states: ModelStates
    activation_bytes: float
    gathered_bytes: float = 0.0  # ZeRO 3: a unit gathered and the one prefetched (pipelines: the stage)

    @property
    def peak_bytes(self) -> float:
        return self.states.total + self.activation_bytes + self.gathered_bytes

    @property
    def samples_per_s(self) -> float:
        return self.layout.global_batch / self.step_s


@dataclass(frozen=True)
class _Chunk:
    forward: float
    backward: float
    blocks: tuple[BlockCost, ...]
    last: bool
    calls: float = 0.0  # blocking collectives and messages of one micro-batch's forward and backward


def _chunks(model: ModelCost, layout: Layout, cluster: Cluster) -> list[_Chunk]:
    """Each virtual stage's forward and backward seconds per micro-batch, in model order."""
    n = layout.pp * layout.virtual_stages
    counts = _balance(tuple(b.parameter_bytes for b in model.blocks), n)
    scale = layout.microbatch / model.batch_size
    slower = compute_scale(layout, cluster)
    split = model.split_backward if layout.schedule in SPLIT_BACKWARD and layout.pp > 1 else 1.0
    tp, ep = layout.tp, layout.ep
    tp_link, ep_link = cluster.link(tp), cluster.link(ep, tp * layout.pp)
    pp_link = cluster.link(layout.pp, tp)
    chunks, start = [], 0
    sp = layout.sequence_parallel
    passes = 3 if layout.recompute is True else 2  # full recompute runs each region's forward collective again
    for g, count in enumerate(counts):
        blocks = tuple(model.blocks[start : start + count])
        start += count
        forward = backward = calls = 0.0
        for b in blocks:
            # blocking calls a region has in a pass: f or g, or under sequence parallelism an all-gather and a
            # reduce-scatter; and in the backward under sequence parallelism its saved input gathered again
            regions = b.regions(tp) if tp > 1 else 0
            calls += regions * ((2 if sp else 1) * passes + (1 if sp else 0))
            if b.expert_parameter_bytes and ep > 1:
                calls += 4
            output = b.output_bytes * scale
            comm = tensor_parallel_s(output, tp, tp_link, sp, cluster.backend, regions)
            regather = sequence_collective_s("all_gather", output, tp, tp_link, cluster.backend) if sp else 0.0
            if b.expert_parameter_bytes:
                size = output / (tp if sp else 1)
                comm += 2 * all_to_all_s(size, ep, ep_link)
            block_forward, block_backward = (t * slower for t in b.seconds(scale, tp))
            block_backward *= split
            selective = b.attention_s * scale / tp * slower
            rerun = {True: block_forward, "selective": selective, False: 0.0}[layout.recompute]
            forward += block_forward + comm
            backward += block_backward + rerun + comm * (passes - 1) + regions * regather
        last = g == n - 1
        if last:
            other_forward, other_backward = model.other_seconds(scale, tp)
            other_calls = dict(model.other_tp_calls).get(tp, 0) if tp > 1 else 0
            forward += other_forward * slower + other_calls * all_reduce_s(blocks[-1].output_bytes * scale, tp, tp_link)
            backward += other_backward * slower
            calls += other_calls
        if layout.pp > 1:
            message = p2p_s(
                blocks[-1].output_bytes * scale / (tp if layout.sequence_parallel else 1), pp_link
            )
            forward += 0.0 if last else message
            backward += 0.0 if g == 0 else message
            calls += (0 if last else 1) + (0 if g == 0 else 1)
        chunks.append(_Chunk(forward, backward, blocks, last, calls))
    return chunks


def tensor_parallel_s(
    size: float, tp: int, link, sequence_parallel: bool, backend: str, regions: float = TRANSFORMER_REGIONS
) -> float:
    """A block's tensor-parallel collectives in one pass on its ``size``-byte output: an all-reduce for each
    of its ``regions`` (Megatron's f or g), or under sequence parallelism an all-gather and a reduce-scatter."""
    if not sequence_parallel:
        return regions * all_reduce_s(size, tp, link)
    gather = sequence_collective_s("all_gather", size, tp, link, backend)
    return regions * (gather + sequence_collective_s("reduce_scatter", size, tp, link, backend))


def sequence_collective_s(kind: str, size: float, tp: int, link, backend: str) -> float:
    """One ``kind`` ("all_gather" or "reduce_scatter") of a ``size``-byte sequence-parallel activation, which
    on gloo the package runs as an all-reduce of the whole tensor (``collectives._on_host``)."""
    if backend == "gloo":
        return all_reduce_s(size, tp, link)
    return {"all_gather": all_gather_s, "reduce_scatter": reduce_scatter_s}[kind](size, tp, link)


def _pipeline(
    chunks: list[_Chunk], layout: Layout
) -> tuple[float, float, list[list[int]], list[float]]:
    """The pipeline's seconds per step, the busiest rank's idle share, each rank's chunks (model order), and
    each rank's busy seconds."""
    p, v, m = layout.pp, layout.virtual_stages, layout.num_microbatches
    held = [[global_stage(layout.schedule, p, r, c, v) for c in range(v)] for r in range(p)]
    busy = [m * sum(chunks[g].forward + chunks[g].backward for g in held[r]) for r in range(p)]
    if p == 1:
        return busy[0], 0.0, held, busy
    if layout.schedule == "async":
        return max(busy), 0.0, held, busy
    forward = tuple(c.forward for c in chunks)
    backward = tuple(c.backward for c in chunks)
    idle = _bubbles(layout.schedule, p, m, forward, backward, v)
    spans = [b / (1 - i) for b, i in zip(busy, idle)]
    slowest = max(range(p), key=spans.__getitem__)
    return spans[slowest], idle[slowest], held, busy


@lru_cache(maxsize=256)
def _balance(costs: tuple, chunks: int) -> list[int]:
    """``partition.balance``, once per model and number of chunks."""
    return balance(costs, chunks)


@lru_cache(maxsize=4096)
def _bubbles(name: str, p: int, m: int, forward: tuple, backward: tuple, v: int) -> list[float]:
    """``expected_bubbles``, once per schedule and costs (layouts that differ only in ZeRO share it)."""
    return expected_bubbles(name, p, m, forward, backward, virtual_stages=v)


def _rank_elements(
    model: ModelCost, layout: Layout, chunks: list[_Chunk], held: list[int]
) -> tuple[float, float]:
    """(dense, expert) parameter elements a rank holding chunks ``held`` keeps: its tp share of its blocks
    and of the rest of the model (held on every stage), its 1/ep of the experts."""
    blocks = [b for g in held for b in chunks[g].blocks]
    expert = sum(b.expert_parameter_bytes for b in blocks)
    dense = sum(b.parameter_bytes for b in blocks) - expert + model.other_parameter_bytes
    item = model.parameter_itemsize
    return dense / layout.tp / item, expert / (layout.tp * layout.ep) / item


def _activations(model: ModelCost, layout: Layout, chunks: list[_Chunk], rank: int, held: list[int]) -> float:
    """The bytes of activations ``rank`` holds at its peak (``memory.expected.stage_activation_bytes``): a
    chunk's worth per micro-batch in flight, the head's on the loss stage, a block rebuilt by full recompute."""
    scale = layout.microbatch / model.batch_size
    tp, sp = layout.tp, layout.sequence_parallel

    def kept(b: BlockCost, recompute: Union[bool, str]) -> float:
        return block_activation_bytes(b.activation_bytes, b.attention_bytes, b.output_bytes, tp, sp, recompute)

    per_chunk = [sum(kept(b, layout.recompute) for b in chunks[g].blocks) * scale for g in held]
    in_flight = 1
    if layout.pp > 1:
        in_flight = activation_bound(
            layout.schedule, layout.pp, layout.num_microbatches, rank, layout.virtual_stages
        )
    recomputed = 0.0
    if layout.recompute is True:  # a block rebuilt whole in its backward, beyond the input it kept
        recomputed = max(kept(b, False) - kept(b, True) for g in held for b in chunks[g].blocks) * scale
    head, heads = 0.0, 1
    if chunks[-1].last and len(chunks) - 1 in held:
        head = model.other_activation_bytes * scale / tp
        if layout.pp > 1:
            heads = _heads_in_flight(
                layout.schedule, layout.pp, layout.num_microbatches, rank, layout.virtual_stages,
                held.index(len(chunks) - 1),
            )
    return stage_activation_bytes(in_flight * max(per_chunk), head, recomputed, heads)


@lru_cache(maxsize=256)
def _heads_in_flight(name: str, p: int, m: int, rank: int, v: int, chunk: int) -> int:
    """The most micro-batches whose loss-stage head the rank holds at once in the schedule's own order:
    forwards of its last chunk whose backward (or input gradient) has not run (GPipe: all m; 1F1B: one)."""
    live = peak = 0
    for action in schedule(name, p, m, rank, v):
        if action.chunk == chunk:
            live += {"F": 1, "B": -1, "I": -1}.get(action.kind, 0)
            peak = max(peak, live)
    return max(peak, 1)


def predict(model: ModelCost, layout: Layout, cluster: Cluster, precision: str = "32-true") -> Prediction:
    """The step time and the busiest rank's peak memory of ``layout`` on ``cluster``."""
    chunks = _chunks(model, layout, cluster)
    pipeline_s, idle, held, busy = _pipeline(chunks, layout)
    state = state_bytes_for(precision)
    dp_link = cluster.link(layout.dp, layout.tp * layout.pp)
    edp = layout.dp // layout.ep
    worst_states, worst_activations, worst_comm, worst_elements = None, 0.0, 0.0, 0.0
    worst_dense = 0.0
    for rank in range(layout.pp):
        dense, expert = _rank_elements(model, layout, chunks, held[rank])
        states = _add(
            model_state_bytes(dense, layout.dp, layout.zero_stage, model.optimizer, state),
            model_state_bytes(expert, edp, layout.zero_stage, model.optimizer, state),
        )
        activations = _activations(model, layout, chunks, rank, held[rank])
        if worst_states is None or states.total + activations > worst_states.total + worst_activations:
            worst_states, worst_activations, worst_dense = states, activations, dense
        window = _overlap_window(layout, chunks, held[rank]) if _spare_cores(layout, cluster) else 0.0
        comm = _data_parallel_s(
            dense * state.gradient, layout, dp_link, window, len(chunks[held[rank][0]].blocks)
        )
        comm += _data_parallel_s(expert * state.gradient, _with_dp(layout, edp), dp_link, window, 1)
        worst_comm, worst_elements = max(worst_comm, comm), max(worst_elements, dense + expert)
    whole = model.parameter_bytes / model.parameter_itemsize
    optimizer_s = model.optimizer_step_s * worst_elements / whole / (layout.dp if layout.zero_stage else 1)
    optimizer_s *= compute_scale(layout, cluster)
    per_process_s = optimizer_s + worst_comm + model.step_overhead_s * compute_scale(layout, cluster)
    assert worst_states is not None
    largest_unit = max(b.parameter_bytes for b in model.blocks) / layout.tp / model.parameter_itemsize
    # zero_stage=3: two units in flight, or under pipeline stages the whole stage, gathered for its schedule
    kept = worst_dense if layout.pp > 1 else 2 * largest_unit
    gathered = kept * state.parameter if layout.zero_stage == 3 else 0.0
    shared_s = _shared_cores_s(layout, cluster, busy, per_process_s)
    calls = max(layout.num_microbatches * sum(chunks[g].calls for g in h) for h in held)
    calls += _data_parallel_calls(layout, model)
    step_s = max(pipeline_s + per_process_s, shared_s) + calls * call_wait_s(layout, cluster)
    return Prediction(
        layout=layout,
        step_s=step_s,
        pipeline_s=pipeline_s,
        bubble=idle,
        data_parallel_s=worst_comm,
        optimizer_s=optimizer_s,
        states=worst_states,
        activation_bytes=worst_activations,
        gathered_bytes=gathered,
    )


def _shared_cores_s(layout: Layout, cluster: Cluster, busy: list[float], per_process_s: float) -> float:
    """The least time a node's CPU cores need for its processes' work when they share ``cluster.cores``
    (0: devices of their own, no bound): every rank's busy seconds, and each process's ``per_process_s``
    (its optimizer step, data-parallel collectives and Lightning's work around the step), over the cores.
    The step is at least this and at least the schedule's own span (a rank idle in the bubble leaves its
    core to the others)."""
    processes = min(layout.devices, cluster.devices_per_node)
    if not cluster.cores or processes <= cluster.cores:
        return 0.0
    replicas = processes / layout.pp  # each pipeline rank's dp x tp copies on the node
    return (replicas * sum(busy) + processes * per_process_s) / cluster.cores


def compute_scale(layout: Layout, cluster: Cluster) -> float:
    """How many times longer a rank computes than it did alone when timed: on a CPU box whose ``cores`` its
    processes share, ``cluster.shared_compute`` with every core running one, in proportion to the other
    cores they occupy below that; 1.0 with one process or devices of their own."""
    processes = min(layout.devices, cluster.devices_per_node)
    if cluster.cores < 2 or processes < 2:
        return 1.0
    others = min(processes, cluster.cores) - 1
    return 1.0 + (cluster.shared_compute - 1.0) * others / (cluster.cores - 1)


def call_wait_s(layout: Layout, cluster: Cluster) -> float:
    """The wait of one blocking collective or message beyond its own time. Where a node's processes
    outnumber its cores, the peer it waits for is one of ``processes / cores`` processes taking turns on a
    core, and runs after the others' turns, ``cluster.slice_s`` each (the scheduler's time slice, measured
    by the calibration), the turn under way half done on average: ``(processes / cores - 1) x slice_s / 2``.
    With a core per process the waiting rank's core idles: what that costs a call beyond its fitted time,
    the wake-up and the peers' jitter, is ``cluster.wake_s`` (measured by the calibration; 0 for devices of
    their own, whose waits the collectives' own times hold)."""
    processes = min(layout.devices, cluster.devices_per_node)
    if not cluster.cores:
        return 0.0
    if processes <= cluster.cores:
        return cluster.wake_s if processes > 1 else 0.0
    return (processes / cluster.cores - 1) * cluster.slice_s / 2


def _data_parallel_calls(layout: Layout, model: ModelCost) -> int:
    """The data-parallel collectives a rank blocks on in a step: each bucket's reduce, waited for after the
    backward (ZeRO 1/2 and the post-step all-gather: two). ZeRO-3 blocks on its first unit's gather and on
    its reductions' end: each later unit's gather is started a unit ahead and each unit's reduce-scatter
    while the backward goes on (under pipeline stages, the stage's one gather and its buckets' reduces)."""
    if layout.dp <= 1:
        return 0
    buckets = max(1, math.ceil(model.parameter_bytes / layout.tp / layout.pp / BUCKET_BYTES))
    if layout.zero_stage == 3:
        return buckets + 1 if layout.pp > 1 else 2
    return buckets * (2 if layout.zero_stage else 1)


def zero3_gathers(units: int) -> int:
    """ZeRO-3's unit gathers in a step without pipeline stages: each block for its forward and again for its
    backward, but the last ``KEPT_FOR_BACKWARD``, kept gathered between them."""
    units = max(1, units)
    return 2 * units - min(units, KEPT_FOR_BACKWARD)


def _spare_cores(layout: Layout, cluster: Cluster) -> bool:
    """Whether a node has cores its processes do not compute on. On a CPU box whose processes fill its
    cores, a collective started during the backward does not run beside it: gloo's copies, sums and the
    loopback transfers run on the same cores, so the data-parallel collectives add their time whole."""
    return not cluster.cores or min(layout.devices, cluster.devices_per_node) < cluster.cores


def _add(a: ModelStates, b: ModelStates) -> ModelStates:
    return ModelStates(a.parameters + b.parameters, a.gradients + b.gradients, a.optimizer + b.optimizer)


def _with_dp(layout: Layout, dp: int) -> Layout:
    return Layout(**{**layout.__dict__, "dp": dp})


def _overlap_window(layout: Layout, chunks: list[_Chunk], held: list[int]) -> float:
    """The backward time a data-parallel reduce can hide behind: the rank's backward without pipeline
    stages, its last micro-batch's backward under the schedules whose reducer starts during it, else none."""
    if layout.pp == 1 or layout.schedule in OVERLAPPED:
        return sum(chunks[g].backward for g in held)
    return 0.0


def _data_parallel_s(gradient_bytes: float, layout: Layout, link, window: float, units: int) -> float:
    """The data-parallel collectives of a step not hidden by the backward (``window`` seconds)."""
    n = layout.dp
    if n <= 1 or gradient_bytes <= 0:
        return 0.0
    buckets = max(1, math.ceil(gradient_bytes / BUCKET_BYTES))
    if layout.zero_stage == 3 and layout.pp == 1:  # a reduce-scatter of each unit's gradients
        buckets = max(1, units)
    if layout.zero_stage == 0:
        reduce = buckets * all_reduce_s(gradient_bytes / buckets, n, link)
    else:
        reduce = buckets * reduce_scatter_s(gradient_bytes / buckets, n, link)
    exposed = max(reduce - window, reduce / buckets)
    if layout.zero_stage in (1, 2):  # the updated ranges all-gathered after the step
        exposed += buckets * all_gather_s(gradient_bytes / buckets, n, link)
    if layout.zero_stage == 3 and layout.pp > 1:  # a stage's units gathered once, when its schedule starts
        exposed += all_gather_s(gradient_bytes, n, link)
    elif layout.zero_stage == 3:  # each unit gathered for its forward and again for its backward, prefetched
        gathers = zero3_gathers(units) * all_gather_s(gradient_bytes / max(1, units), n, link)
        exposed += gathers / max(1, units) if window > 0 else gathers  # no window: no core to overlap on
    return exposed
