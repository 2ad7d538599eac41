"""A quick ``ModelCost`` of a module on this machine: each block of its block stack timed alone on its captured
inputs (``pipeline.profile``, as ``balance="time"`` does), its saved activations counted
(``memory.saved``), and the rest of the step (embedding, head, loss) and one optimizer step timed whole.

On a CPU the times are this thread's CPU seconds (``time.thread_time``; the ranks run one thread each):
what a rank computes, which other processes' load on the machine does not add to, where wall time would
measure the load. Each time is the median of its repeats, as a run's step time is the median of its steps
(the fastest repeat was 0.91x the median on the 2-core box). What ranks computing at once on shared cores
add is the cluster's ``shared_compute``.

Each block is also timed on a quarter of the batch: the part of its time that does not shrink with the
batch (``BlockCost.fixed_s``, each operator's dispatch) is what the two times' line gives at no samples.

A Lightning step does more than the parts timed alone: its loop, hooks, logging and the optimizer's
closure. ``lightning_step_seconds`` times a few steps of the module under a one-device ``Trainer.fit`` on
the same batch, and the planner charges what they take beyond the parts as ``ModelCost.step_overhead_s``
(for the embedded CharGPT 8 x 128 a few ms a step, about the same at batch 4, 8 and 16: a fixed cost).

For a cluster that is not this machine, ``flop_times`` replaces the times by a FLOP estimate at the
cluster's rate (2 flops per parameter per token forward, 4 backward); the bytes stay as measured. The
calibration (``planner.calibrate``) produces the same ``ModelCost`` on the real devices.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from functools import partial
from typing import Any, Callable, Optional, Sequence

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_parallel.distributed.collectives import SIMULATED
from lightning_parallel.memory.saved import SavedTensorCounter
from lightning_parallel.module_names import find_block_stack
from lightning_parallel.pipeline.profile import capture_block_inputs, requiring_grad, tensors_in, time_blocks
from lightning_parallel.pipeline.split_backward import backward_input
from lightning_parallel.planner.cost_model import BlockCost, ModelCost
from lightning_parallel.quiet_trainer import QUIET_TRAINER

__all__ = [
    "measure_model",
    "flop_times",
    "fixed_seconds",
    "split_backward_ratio",
    "lightning_step_seconds",
    "step_overhead",
    "BACKWARD_SHARE",
]

#: the share of a block's measured forward + backward time that is its backward (two matmuls for each of
#: the forward's one: the input's gradient and the weights')
BACKWARD_SHARE = 2 / 3


def _bytes(value: Any) -> int:
    if isinstance(value, Tensor):
        return value.nbytes
    if isinstance(value, (tuple, list)):
        return sum(_bytes(v) for v in value)
    return 0


def _saved_bytes(module: nn.Module, run: Callable[[], Any]) -> tuple[int, Any]:
    """The bytes autograd keeps saved after ``run`` (parameters and buffers not counted), and its result."""
    counter = SavedTensorCounter()
    counter.ignore([*module.parameters(), *module.buffers()])
    counter.start()
    try:
        out = run()
    finally:
        counter.stop()
    return counter.live, out


def _typical_seconds(run: Callable[[], None], repeats: int, clock: Callable[[], float]) -> float:
    """The median of ``repeats`` runs after a warm-up."""
    samples = []
    for _ in range(repeats + 1):
        start = clock()
        run()
        samples.append(clock() - start)
    return statistics.median(samples[1:])


def _clock(module: nn.Module) -> Callable[[], float]:
    """CPU seconds of this thread for a module on the CPU (its ops run on the calling thread), wall seconds
    on an accelerator."""
    on_cpu = all(p.device.type == "cpu" for p in module.parameters())
    return time.thread_time if on_cpu else time.perf_counter


def split_backward_ratio(
    blocks: Sequence[nn.Module], inputs: Sequence[tuple[tuple, dict]], repeats: int, clock: Callable[[], float]
) -> float:
    """The blocks' backward split in two as the zero-bubble schedules run it (``split_backward``: the input
    gradients, then the weights'), over the same backward run whole: the medians of ``repeats`` (after a
    warm-up), each over all the blocks on their captured inputs. 1.0 where a block cannot be split."""

    def backward_seconds(split: bool) -> float:
        total = 0.0
        for block, (args, kwargs) in zip(blocks, inputs):
            a = requiring_grad(args)
            outputs = [t for t in tensors_in(block(*a, **requiring_grad(kwargs))) if t.requires_grad]
            grads = [torch.ones_like(t) for t in outputs]
            start = clock()
            if split:
                backward_input(outputs, grads, [t for t in tensors_in(a) if t.requires_grad]).run()
            else:
                torch.autograd.backward(outputs, grads)
            total += clock() - start
        for block in blocks:
            block.zero_grad(set_to_none=True)
        return total

    try:
        whole, split = ([backward_seconds(s) for _ in range(repeats + 1)][1:] for s in (False, True))
    except (RuntimeError, ValueError):  # a block the split refuses (a reentrant checkpoint) or that cannot
        return 1.0  # run its backward twice: the zero-bubble schedules refuse it too
    return statistics.median(split) / statistics.median(whole)


def fixed_seconds(whole_s: float, part_s: float, batch: int, part: int) -> float:
    """The batch-independent seconds of a block timed ``whole_s`` on ``batch`` samples and ``part_s`` on
    ``part``: the line through the two times at no samples, kept within ``[0, whole_s]``."""
    if part >= batch:
        return 0.0
    per_sample = (whole_s - part_s) / (batch - part)
    return min(max(whole_s - per_sample * batch, 0.0), whole_s)


def _first_rows(value: Any, batch: int, rows: int) -> tuple[Any, bool]:
    """``value`` with every tensor whose first dimension is ``batch`` cut to its first ``rows``; whether any
    was."""
    cut = []

    def first(t: Tensor) -> Tensor:
        if t.dim() and t.shape[0] == batch:
            cut.append(True)
            return t[:rows]
        return t

    return apply_to_collection(value, Tensor, first), bool(cut)


def measure_model(
    module: nn.Module,
    step: Callable[[], Tensor],
    batch_size: int,
    optimizer: torch.optim.Optimizer,
    optimizer_kind: str,
    tokens_per_sample: int = 1,
    repeats: int = 3,
    tensor_parallel: Sequence[int] = (),
) -> ModelCost:
    """The ``ModelCost`` of ``module`` at ``batch_size`` samples: ``step()`` runs its forward and returns
    the loss (every block called once, in order); ``optimizer`` steps its parameters (timed once warm).
    For each size of ``tensor_parallel``, the blocks and the whole step are timed again on one rank's
    shard of the module (``_sharded_seconds``)."""
    stack_name, stack = find_block_stack(module)
    blocks = list(stack)
    clock = _clock(module)
    inputs = capture_block_inputs(blocks, step, module)
    times = time_blocks(blocks, inputs, repeats, clock)
    rows = max(1, batch_size // 4)
    quarter, cut = _first_rows(inputs, batch_size, rows)
    fixed = [0.0] * len(blocks)
    if cut and rows < batch_size:
        small = time_blocks(blocks, quarter, repeats, clock)
        fixed = [fixed_seconds(t, s, batch_size, rows) for t, s in zip(times, small)]
    costs = []
    for block, (args, kwargs), seconds, fixed_s in zip(blocks, inputs, times, fixed):
        args = tuple(
            a.detach().requires_grad_(True) if isinstance(a, Tensor) and a.is_floating_point() else a
            for a in args
        )
        saved, out = _saved_bytes(block, lambda: block(*args, **kwargs))
        costs.append(
            BlockCost(
                forward_s=seconds * (1 - BACKWARD_SHARE),
                backward_s=seconds * BACKWARD_SHARE,
                activation_bytes=saved,
                parameter_bytes=sum(p.nbytes for p in block.parameters()),
                output_bytes=_bytes(out),
                fixed_s=fixed_s,
            )
        )

    def whole_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        step().backward()

    whole_s = _typical_seconds(whole_step, repeats, clock)
    total_saved, loss = _saved_bytes(module, step)
    del loss
    optimizer_s = _typical_seconds(optimizer.step, repeats, clock)
    other_s = max(0.0, whole_s - sum(times))
    other_tp, other_calls = [], []
    for tp in tensor_parallel:
        sharded = _sharded_seconds(module, step, tp, repeats, clock)
        if sharded is not None:
            tp_times, tp_whole, block_calls, calls = sharded
            costs = [
                dataclasses.replace(c, tp_s=(*c.tp_s, (tp, t)), tp_calls=(*c.tp_calls, (tp, n)))
                for c, t, n in zip(costs, tp_times, block_calls)
            ]
            other_tp.append((tp, max(0.0, tp_whole - sum(tp_times))))
            other_calls.append((tp, max(0, calls)))
    block_bytes = sum(b.parameter_bytes for b in costs)
    split = split_backward_ratio(blocks, inputs, repeats, clock)
    return ModelCost(
        blocks=costs,
        other_parameter_bytes=sum(p.nbytes for p in module.parameters()) - block_bytes,
        batch_size=batch_size,
        other_forward_s=other_s * (1 - BACKWARD_SHARE),
        other_backward_s=other_s * BACKWARD_SHARE,
        other_activation_bytes=max(0, total_saved - sum(b.activation_bytes for b in costs)),
        optimizer_step_s=optimizer_s,
        parameter_itemsize=next(p for p in module.parameters() if p.is_floating_point()).dtype.itemsize,
        optimizer=optimizer_kind,
        tokens_per_sample=tokens_per_sample,
        name=f"{type(module).__name__} ({stack_name}: {len(blocks)} blocks)",
        other_tp_s=tuple(other_tp),
        other_tp_calls=tuple(other_calls),
        split_backward=split,
    )


def _sharded_seconds(
    module: nn.Module, step: Callable[[], Tensor], tp: int, repeats: int, clock: Callable[[], float]
) -> Optional[tuple[list[float], float, list[int], int]]:
    """Each block's forward + backward seconds and the whole step's on tensor-parallel rank 0's shard at
    ``tp`` (the automatic plan, ``tensor.dry_run.as_rank_zero``: no communication): what one rank computes,
    with the operators no plan splits (norms, residuals) and the sharded layers' own work; and the
    tensor-parallel collectives, counted as the dry run stands in for them, of each block's forward and
    backward and of the rest of the step (a vocabulary-parallel embedding's, the head's). None where the
    automatic plan cannot split the module ``tp`` ways."""
    from lightning_parallel.tensor import resolve
    from lightning_parallel.tensor.dry_run import as_rank_zero

    try:
        resolved = resolve(module, "auto", tp, run=step)
    except Exception:  # noqa: BLE001 - no plan at this size: the cost model divides by tp instead
        return None

    def whole_step() -> None:
        module.zero_grad(set_to_none=True)
        step().backward()

    with as_rank_zero(module, resolved):
        blocks = list(find_block_stack(module)[1])
        inputs = capture_block_inputs(blocks, step, module)
        times = time_blocks(blocks, inputs, repeats, clock)
        whole = _typical_seconds(whole_step, repeats, clock)
        step_calls = _simulated_calls(whole_step)
        block_calls = [_simulated_calls(partial(_forward_backward, b, a)) for b, a in zip(blocks, inputs)]
    module.zero_grad(set_to_none=True)
    return times, whole, block_calls, step_calls - sum(block_calls)


def _simulated_calls(run: Callable[[], None]) -> int:
    """The collectives a dry run of ``run`` stood in for (``collectives.SIMULATED``)."""
    SIMULATED.clear()
    run()
    return sum(SIMULATED.values())


def _forward_backward(block: nn.Module, inputs: tuple[tuple, dict]) -> None:
    """``block``'s forward on its captured ``(args, kwargs)``, and its backward of its outputs' sum."""
    args, kwargs = inputs
    outputs = [t for t in tensors_in(block(*requiring_grad(args), **requiring_grad(kwargs))) if t.requires_grad]
    torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])


def lightning_step_seconds(module: Any, batch: Any, steps: int = 10, warmup: int = 3) -> Optional[float]:
    """The median CPU seconds of a training step of the LightningModule ``module`` under a one-device
    ``Trainer.fit`` on ``batch`` (``steps`` steps after ``warmup``; the first steps run slower), from the
    start of each training batch to its end as a run's step is timed; None where the module is not on the
    CPU. The fit steps ``module``'s weights: the planner measures a module of its own."""
    if any(p.device.type != "cpu" for p in module.parameters()):
        return None
    from lightning.pytorch import Callback, Trainer

    class StepClock(Callback):
        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.start = time.thread_time()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.seconds.append(time.thread_time() - self.start)

    clock, quiet = StepClock(), logging.getLogger("lightning.pytorch")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # the Trainer's "GPU available" lines: the planner's output is its table
    try:
        Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=warmup + steps,
            callbacks=[clock],
            **QUIET_TRAINER,
        ).fit(module, train_dataloaders=DataLoader([batch] * (warmup + steps), batch_size=None))
    finally:
        quiet.setLevel(level)
    return statistics.median(clock.seconds[warmup:])


def step_overhead(model: ModelCost, lightning_step_s: Optional[float]) -> ModelCost:
    """``model`` with ``step_overhead_s`` from a Lightning step's measured seconds: what it took beyond the
    blocks, the rest and the optimizer step timed alone (0 where it took less, or was not measured)."""
    if lightning_step_s is None:
        return model
    parts = sum(b.forward_s + b.backward_s for b in model.blocks)
    parts += model.other_forward_s + model.other_backward_s + model.optimizer_step_s
    return dataclasses.replace(model, step_overhead_s=max(0.0, lightning_step_s - parts))


def flop_times(model: ModelCost, flops: float) -> ModelCost:
    """``model`` with each block's and the rest's times from a FLOP count at ``flops`` per second: a
    forward is 2 flops per parameter element per token, a backward 4 (Kaplan et al.'s 6N per token); the
    optimizer step is left as measured. Attention's own flops (the s x s products) are not counted. Lightning's
    work around a step is left out: it was measured on this host's CPU, not the cluster's."""
    tokens = model.batch_size * model.tokens_per_sample

    def seconds(parameter_bytes: float, per_element: int) -> float:
        return per_element * parameter_bytes / model.parameter_itemsize * tokens / flops

    blocks: Sequence[BlockCost] = [
        dataclasses.replace(
            b, forward_s=seconds(b.parameter_bytes, 2), backward_s=seconds(b.parameter_bytes, 4), fixed_s=0.0
        )
        for b in model.blocks
    ]
    return dataclasses.replace(
        model,
        blocks=blocks,
        other_forward_s=seconds(model.other_parameter_bytes, 2),
        other_backward_s=seconds(model.other_parameter_bytes, 4),
        step_overhead_s=0.0,
    )
