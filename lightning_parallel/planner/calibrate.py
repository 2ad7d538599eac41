"""Calibration on the machine at hand: the collectives timed over the real process group and fitted as
latency + bytes / bandwidth (the alpha-beta model, by least squares), the blocks of a model timed forward
and backward on the real device (the pipeline's ``balance="time"`` profiling), and the ``Cluster`` they
describe (one node; its link is the point-to-point fit).

Every rank of the group must call ``calibrate_collectives`` alike: each size of each collective is run
``repeats`` times after a warm-up, each run started together (a barrier); a run's time is the slowest
rank's, so every rank fits the same numbers, and a size's time the median run's (as a run's step is the
median of its steps, and the blocks are timed by their median). On gloo the all-gather
and the reduce-scatter are timed in the forms the ZeRO stages run there (one broadcast, one reduce per
rank's range: ``distributed.zero``), which gloo runs 2.4x and 1.05x as fast as its own
``all_gather_into_tensor`` and ``reduce_scatter_tensor`` at 28 MB over 2 processes.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel.compat import all_gather_single, reduce_scatter_single
from lightning_parallel.distributed.zero import all_gather_by_ranges, reduce_scatter_by_ranges
from lightning_parallel.memory.accounting import available_host_bytes
from lightning_parallel.memory.saved import SavedTensorCounter
from lightning_parallel.module_names import find_block_stack
from lightning_parallel.pipeline.profile import capture_block_inputs, requiring_grad, time_block_passes
from lightning_parallel.planner.cluster import Cluster, Link
from lightning_parallel.planner.collective_time import ring_figures

__all__ = [
    "COLLECTIVES",
    "FLOOR",
    "Calibration",
    "calibrate",
    "SIZES",
    "BlockTiming",
    "CollectiveFit",
    "calibrate_collectives",
    "scheduler_slice",
    "shared_compute",
    "wake_up",
    "cluster_from_fits",
    "device_flops",
    "fit_alpha_beta",
    "time_model_blocks",
]

#: what is timed: each takes a tensor of the size's bytes per rank
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
#: bytes per rank of each timed call: from latency-bound to bandwidth-bound, a few milliseconds on gloo;
#: 128 KiB to 1 MiB are the sizes of small models' tensor-parallel activations (a block's output)
SIZES = (2**10, 2**14, 2**17, 2**18, 2**19, 2**20, 2**22)

#: bytes per rank of the all-reduce ``wake_up`` times between computations: a small model's block output
WAKE_BYTES = 2**19

#: the least latency (seconds) and seconds per byte a fit gives
FLOOR = (1e-9, 1e-15)


@dataclass(frozen=True)
class CollectiveFit:
    """``seconds = latency + nbytes * seconds_per_byte`` for one collective over the group, and the
    (bytes per rank, seconds) it was fitted to."""

    name: str
    latency: float
    seconds_per_byte: float
    samples: tuple[tuple[int, float], ...]

    def predict(self, nbytes: float) -> float:
        return self.latency + nbytes * self.seconds_per_byte


@dataclass(frozen=True)
class BlockTiming:
    """One block of the stack on the real device: median forward and backward seconds on a sample
    micro-batch, the bytes autograd saved in its forward, and its parameters' bytes."""

    name: str
    forward_s: float
    backward_s: float
    activation_bytes: int
    parameter_bytes: int


def fit_alpha_beta(samples: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (latency, seconds per byte) of ``(bytes, seconds)`` samples, each weighted by
    1 / seconds (relative errors: the small sizes count as much as the large), constrained to neither below
    zero and then raised to ``FLOOR`` (so a bandwidth, 1 / seconds per byte, stays finite)."""
    x = torch.tensor([s[0] for s in samples], dtype=torch.float64)
    y = torch.tensor([s[1] for s in samples], dtype=torch.float64)
    w2 = 1.0 / y**2
    a = torch.stack([torch.ones_like(x), x], dim=1) * w2.sqrt()[:, None]
    alpha, beta = torch.linalg.lstsq(a, y * w2.sqrt()).solution.tolist()
    if beta <= 0:  # no bandwidth term visible: the latency alone
        alpha, beta = float((y * w2).sum() / w2.sum()), 0.0
    elif alpha <= 0:  # no latency visible: the line through the origin
        alpha, beta = 0.0, float((x * y * w2).sum() / (x * x * w2).sum())
    return max(alpha, FLOOR[0]), max(beta, FLOOR[1])


def _call(name: str, nbytes: int, group: Any) -> Callable[[], None]:
    """One run of collective ``name`` with ``nbytes`` per rank (float32) over ``group``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = max(world, nbytes // 4 // world * world)
    x = torch.ones(n, device=_device(group))
    if name == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    by_ranges = dist.get_backend(group) == "gloo"  # the forms the ZeRO stages run on gloo (distributed.zero)
    if name == "all_gather":
        out = x.new_empty(n * world)
        if by_ranges:
            return lambda: all_gather_by_ranges(out, group).wait()
        return lambda: all_gather_single()(out, x, group=group)
    if name == "reduce_scatter":
        out = x.new_empty(n // world)
        if by_ranges:
            return lambda: reduce_scatter_by_ranges(out, x, group).wait()
        return lambda: reduce_scatter_single()(out, x, group=group)
    if name == "all_to_all":
        out = torch.empty_like(x)
        return lambda: dist.all_to_all_single(out, x, group=group)
    if name == "send_recv":  # neighbouring pairs (0-1, 2-3, ...) exchange one message each way at once
        if (rank ^ 1) >= world:
            return lambda: None
        peer = dist.get_global_rank(group, rank ^ 1) if group is not None else rank ^ 1
        out = torch.empty_like(x)

        def exchange() -> None:
            for work in (dist.isend(x, peer, group=group), dist.irecv(out, peer, group=group)):
                work.wait()

        return exchange
    raise ValueError(f"unknown collective {name!r}; the collectives are {COLLECTIVES}")


def _device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _timed(run: Callable[[], None], group: Any, repeats: int) -> float:
    """The median over ``repeats`` of the slowest rank's seconds for one ``run`` (after a warm-up run): what
    the collective typically takes, as the planner's other times are medians."""
    device = _device(group)
    run()
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return statistics.median(slowest.tolist())


def calibrate_collectives(
    group: Any = None,
    sizes: Sequence[int] = SIZES,
    repeats: int = 5,
    collectives: Sequence[str] = COLLECTIVES,
) -> dict[str, CollectiveFit]:
    """Each collective timed at each of ``sizes`` (bytes per rank) over ``group`` and fitted."""
    fits = {}
    for name in collectives:
        samples = tuple((nbytes, _timed(_call(name, nbytes, group), group, repeats)) for nbytes in sizes)
        alpha, beta = fit_alpha_beta(samples)
        fits[name] = CollectiveFit(name, alpha, beta, samples)
    return fits


def cluster_from_fits(
    fits: dict[str, CollectiveFit],
    devices: int,
    memory: float,
    flops: float,
    name: str = "calibrated",
    backend: str = "nccl",
) -> Cluster:
    """One node of ``devices``, its link the point-to-point fit (a message each way at once, so its bytes
    per second are the link's each way per device, and its latency a message's) and each collective's own
    fit as the ring model's figures (``collective_time.ring_figures``): the cost model then gives each
    collective as it was measured over these ``devices`` ranks."""
    p2p = fits["send_recv"]
    measured = tuple(
        (n, *ring_figures(n, devices, fit.latency, fit.seconds_per_byte)) for n, fit in sorted(fits.items())
    )
    link = Link(bandwidth=1.0 / p2p.seconds_per_byte, latency=p2p.latency, collectives=measured)
    return Cluster(name, 1, devices, memory, flops, within_node=link, between_nodes=link, backend=backend)


def time_model_blocks(
    module: nn.Module, run_step: Callable[[], Any], block_stack: Optional[str] = None, repeats: int = 3
) -> list[BlockTiming]:
    """Each block of ``module``'s stack on its inputs from ``run_step`` (the user's step on a sample
    micro-batch): forward and backward seconds as ``balance="time"`` measures them, and the bytes autograd
    saves in one more forward (not timed)."""
    name, stack = find_block_stack(module, block_stack)
    blocks = list(stack)
    inputs = capture_block_inputs(blocks, run_step, module)
    passes = time_block_passes(blocks, inputs, repeats)
    timings = []
    for i, (block, (args, kwargs), (forward_s, backward_s)) in enumerate(zip(blocks, inputs, passes)):
        counter = SavedTensorCounter()
        counter.ignore([*block.parameters(), *block.buffers()])
        counter.start()
        try:
            out = block(*requiring_grad(args), **requiring_grad(kwargs))
            saved = counter.live
        finally:
            counter.stop()
        del out
        params = sum(p.numel() * p.element_size() for p in block.parameters())
        timings.append(BlockTiming(f"{name}.{i}", forward_s, backward_s, saved, params))
    return timings


def _spin(stop: Any) -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    while not stop.is_set():
        pass


def scheduler_slice(seconds: float = 1.0, gap_s: float = 50e-6) -> float:
    """The scheduler's time slice on this host, in seconds: this process and a spinning one are pinned to
    one core, and the median length of this process's runs between the gaps (another process's turn) is
    how long the scheduler lets a process run while another waits. Linux only (``sched_setaffinity``)."""
    import multiprocessing
    import statistics

    core = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    context = multiprocessing.get_context("fork")  # the spinner imports nothing
    stop = context.Event()
    spinner = context.Process(target=_spin, args=(stop,), daemon=True)
    spinner.start()
    os.sched_setaffinity(0, {core})
    runs: list[float] = []
    try:
        time.sleep(0.05)  # the spinner started and pinned
        start = last = time.perf_counter()
        end = start + seconds
        while last < end:
            now = time.perf_counter()
            if now - last > gap_s:
                runs.append(last - start)
                start = now
            last = now
    finally:
        os.sched_setaffinity(0, before)
        stop.set()
        spinner.join()
    return statistics.median(runs[1:]) if len(runs) > 2 else 0.0


def _compute_sample(size: int = 256, repeats: int = 9) -> float:
    """The median CPU seconds of this thread for one pass of a small two-layer MLP, forward and backward
    (a block's work at the sizes the CPU box trains), after a warm-up pass."""
    torch.manual_seed(0)
    x = torch.randn(4 * size, size)
    w1 = torch.randn(size, 4 * size, requires_grad=True)
    w2 = torch.randn(4 * size, size, requires_grad=True)
    samples = []
    for _ in range(repeats + 1):
        start = time.thread_time()
        (torch.nn.functional.gelu(x @ w1) @ w2).sum().backward()
        samples.append(time.thread_time() - start)
    return statistics.median(samples[1:])


def shared_compute(group: Any = None, rounds: int = 5) -> float:
    """How many times longer a rank's compute takes on a CPU box while every rank of ``group`` computes at
    once than alone (``Cluster.shared_compute``): rank 0 times a small MLP pass alone while the others wait,
    then every rank times it at once; the median of ``rounds`` such ratios on rank 0 (one ratio varied from
    1.0 to 1.1 on the 2-core box), given to every rank. One thread per rank."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ratios = []
    try:
        for _ in range(rounds):
            alone = _compute_sample() if dist.get_rank(group) == 0 else 0.0
            dist.barrier(group=group)
            together = _compute_sample()
            dist.barrier(group=group)
            ratios.append(together / alone if alone > 0 else 1.0)
    finally:
        torch.set_num_threads(threads)
    ratio = torch.tensor([sorted(ratios)[rounds // 2]], dtype=torch.float64)
    dist.broadcast(ratio, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return max(1.0, float(ratio))


def _interleaved_seconds(compute: Callable[[], None], collective: Callable[[], None], group: Any, calls: int) -> float:
    """Seconds per iteration of ``calls`` iterations of ``compute`` then ``collective``, started together."""
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(calls):
        compute()
        collective()
    return (time.perf_counter() - start) / calls


def wake_up(
    group: Any = None,
    nbytes: int = WAKE_BYTES,
    calls: int = 200,
    rounds: int = 5,
    own_s: Optional[float] = None,
) -> float:
    """What a blocking collective costs a CPU rank between two computations beyond its fitted time
    (``Cluster.wake_s``): every rank runs ``calls`` times about 2.5 ms of matrix products (a block's pass at
    the sizes the CPU box trains) then an all-reduce of ``nbytes``, and the products alone as often; the
    mean excess per call over ``own_s``, the all-reduce's time as the collectives' fit gives it (default:
    its median run, as the fits take their samples).

    This is every cost of such a call that its back-to-back timing misses: the waiting rank's idle core
    woken when the data arrives; on a virtual machine whose idle cores halt, the calls (one in five on the
    2-core VM) whose wake-up waits for a timer tick (about 4 ms: a median misses them, a step pays their
    mean); and the peers' jitter, each call waiting for the slower rank's computation. The median of
    ``rounds``, the slowest rank's, given to every rank; one thread per rank."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    x = torch.ones(nbytes // 4)

    def compute() -> None:
        for _ in range(10):  # about 2.5 ms on one core of the 2-core box
            a @ a

    def collective() -> None:
        dist.all_reduce(x, group=group)

    def nothing() -> None:
        pass

    excess = []
    try:
        own = _timed(collective, group, repeats=9) if own_s is None else own_s
        for _ in range(rounds):
            both = _interleaved_seconds(compute, collective, group, calls)
            excess.append(both - _interleaved_seconds(compute, nothing, group, calls) - own)
    finally:
        torch.set_num_threads(threads)
    found = torch.tensor([statistics.median(excess)], dtype=torch.float64)
    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return max(0.0, float(found))


@dataclass(frozen=True)
class Calibration:
    """What the machine at hand measured: its cluster, each collective's fit, and the blocks' timings."""

    cluster: Cluster
    collectives: dict[str, CollectiveFit]
    blocks: list[BlockTiming]


def device_flops(device: torch.device, size: int = 512, repeats: int = 5) -> float:
    """Dense float32 operations per second of a ``size``-square matrix product on ``device``."""
    a = torch.randn(size, size, device=device)
    run = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)
    a @ a
    run()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ a
    run()
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def calibrate(
    group: Any = None,
    module: Optional[nn.Module] = None,
    run_step: Optional[Callable[[], Any]] = None,
    block_stack: Optional[str] = None,
    sizes: Sequence[int] = SIZES,
    repeats: int = 5,
) -> Calibration:
    """The collectives over ``group`` (every rank calls this), the device's memory and speed, and, given a
    ``module`` and its ``run_step``, its blocks; the cluster is one node of the group's ranks."""
    fits = calibrate_collectives(group, sizes, repeats)
    device = _device(group)
    if device.type == "cuda":
        memory = float(torch.cuda.get_device_properties(device).total_memory)
    else:  # the host's memory, shared by the ranks on it
        memory = float(available_host_bytes() or 0) / dist.get_world_size(group)
    cluster = cluster_from_fits(
        fits, dist.get_world_size(group), memory, device_flops(device), backend=dist.get_backend(group)
    )
    if device.type == "cpu":  # the processes share the host's cores, taking turns when they outnumber them
        slice_s = scheduler_slice() if dist.get_rank(group) == 0 else 0.0
        cluster = dataclasses.replace(
            cluster,
            cores=len(os.sched_getaffinity(0)),
            slice_s=slice_s,
            shared_compute=shared_compute(group),
            wake_s=wake_up(group, own_s=fits["all_reduce"].predict(WAKE_BYTES)),
        )
    blocks = time_model_blocks(module, run_step, block_stack) if module is not None else []
    return Calibration(cluster, fits, blocks)
