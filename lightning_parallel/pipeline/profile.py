"""Measure each block's forward + backward time, for ``balance="time"``.

Parameter counts are a poor proxy for time when blocks differ in what they compute per parameter
(attention over long sequences, a block applied several times, convolutions). So before the model is
cut, every rank runs the user's ``training_step`` once on a sample micro-batch with the whole model, and
records each block's inputs (its activation and any extra arguments, e.g. a mask). Each block is then
timed alone: forward, then backward of the sum of its outputs, ``repeats`` times, keeping the median.

The random state is restored afterwards (dropout draws from it), so profiling does not change what
training computes, and the times are averaged over all ranks so that every rank cuts the model at the
same places.
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_parallel.kv_cache import kv_cache_off

__all__ = [
    "capture_block_inputs",
    "time_blocks",
    "time_block_passes",
    "average_over_ranks",
    "requiring_grad",
    "tensors_in",
]


class _StopForward(BaseException):
    """Ends the sample step once the last block has run (what follows is not timed)."""


def capture_block_inputs(
    blocks: Sequence[nn.Module], run_step: Callable[[], Any], model: Optional[nn.Module] = None
) -> list[tuple[tuple, dict]]:
    """Run ``run_step`` (which must call every block once, in order) and return each block's detached
    (args, kwargs). ``model``: the module ``run_step`` runs, whose Hugging Face key/value caches are off
    meanwhile (``kv_cache.kv_cache_off``): a cache captured in a block's arguments would grow with each timed
    call and keep the graph of the call before."""
    captured: list[tuple[tuple, dict]] = [((), {})] * len(blocks)
    seen = [False] * len(blocks)

    def pre_hook(index: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            captured[index] = (_detached(args), _detached(kwargs))
            seen[index] = True

        return hook

    def last_hook(module: nn.Module, args: tuple, output: Any) -> None:
        raise _StopForward

    handles = [b.register_forward_pre_hook(pre_hook(i), with_kwargs=True) for i, b in enumerate(blocks)]
    handles.append(blocks[-1].register_forward_hook(last_hook))
    try:
        with torch.no_grad(), kv_cache_off(model) if model is not None else nullcontext():
            run_step()
    except _StopForward:
        pass
    finally:
        for h in handles:
            h.remove()
    if not all(seen):
        missing = [i for i, s in enumerate(seen) if not s]
        raise RuntimeError(
            f"balance='time': blocks {missing} of the stack did not run in training_step's forward; "
            "use balance='parameters' or split_points."
        )
    return captured


def time_blocks(
    blocks: Sequence[nn.Module],
    inputs: Sequence[tuple[tuple, dict]],
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
    pick: Callable[[Any], float] = statistics.median,
) -> list[float]:
    """Seconds of forward + backward of each block alone on its captured inputs, read on ``clock`` (wall
    time; the planner reads a CPU process's own CPU time, ``time.thread_time``), the ``pick`` of the
    repeats (the median)."""
    return [pick([f + b for f, b in runs]) for runs in _passes(blocks, inputs, repeats, clock)]


def time_block_passes(
    blocks: Sequence[nn.Module], inputs: Sequence[tuple[tuple, dict]], repeats: int = 3
) -> list[tuple[float, float]]:
    """Median seconds of the forward and of the backward of each block alone (the planner's calibration)."""
    return [
        (statistics.median(f for f, _ in runs), statistics.median(b for _, b in runs))
        for runs in _passes(blocks, inputs, repeats)
    ]


def _passes(
    blocks: Sequence[nn.Module],
    inputs: Sequence[tuple[tuple, dict]],
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
) -> list[list[tuple[float, float]]]:
    """Each block's ``repeats`` (forward, backward of the sum of its outputs) seconds, after one run that
    warms up (allocations, lazy init) and is dropped."""
    times = []
    for block, (args, kwargs) in zip(blocks, inputs):
        samples = []
        for _ in range(repeats + 1):
            a, k = requiring_grad(args), requiring_grad(kwargs)
            start = clock()
            out = block(*a, **k)
            _synchronize(out)
            middle = clock()
            total = sum(t.float().sum() for t in tensors_in(out) if t.requires_grad)
            if isinstance(total, Tensor):
                total.backward()
            _synchronize(out)
            samples.append((middle - start, clock() - middle))
        times.append(samples[1:])
    return times


def average_over_ranks(times: Sequence[float], group: Any = None) -> list[float]:
    """The mean of each block's time over the ranks: every rank balances with the same numbers."""
    if not dist.is_available() or not dist.is_initialized():
        return list(times)
    t = torch.tensor(list(times), dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return (t / dist.get_world_size(group)).tolist()


def tensors_in(value: Any) -> list[Tensor]:
    """The tensors in ``value`` (nested tuples, lists and dicts), in order."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    return []


def _detached(value: Any) -> Any:
    return apply_to_collection(value, Tensor, lambda t: t.detach())


def requiring_grad(value: Any) -> Any:
    return apply_to_collection(
        value, Tensor, lambda t: t.detach().requires_grad_(True) if t.is_floating_point() else t
    )


def _synchronize(value: Any) -> None:
    if any(t.is_cuda for t in tensors_in(value)):
        torch.cuda.synchronize()
