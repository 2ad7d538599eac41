"""What a training batch is under a layout: the data-parallel size, and the global batch it makes.

Tensor-parallel peers and the stages of one pipeline replica read the same batch, so the global batch is
a replica's batch times the data-parallel size, not times ``trainer.world_size``. A datamodule that sizes
its batches from a global batch size divides by ``data_parallel_size(trainer)``; dividing by the world
size silently shrinks the global batch under tensor or pipeline parallelism. The strategies say it once,
at the first training batch of a fit (``describe_global_batch``).
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_parallel.distributed.mesh import MeshShape

__all__ = ["data_parallel_size", "describe_global_batch"]

_AXIS_NAMES = {"tp": "tensor-parallel ranks", "pp": "pipeline stages"}


def data_parallel_size(trainer: Any) -> int:
    """The number of data-parallel replicas under any strategy (Lightning's own included): what a global
    batch size is divided by. It is ``trainer.strategy.distributed_sampler_kwargs["num_replicas"]``, which
    a datamodule can read without importing this package; 1 for single-device strategies."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("num_replicas", 1))


def describe_global_batch(
    strategy_name: str, shape: MeshShape, batch_size: Optional[int], accumulate_grad_batches: int
) -> str:
    """One paragraph for the start-up log: the layout, a replica's batch and the global batch of a step."""
    parts = [f"{shape.dp} data-parallel replica{'s' if shape.dp != 1 else ''}"]
    parts += [
        f"{getattr(shape, axis)} {name}" for axis, name in _AXIS_NAMES.items() if getattr(shape, axis) > 1
    ]
    layout = f"{strategy_name}: {shape.world_size} process(es) = " + " x ".join(parts) + "."
    if batch_size is None:
        batch = "The size of a training batch could not be read from the batch."
    else:
        accumulated = f" x {accumulate_grad_batches} accumulated" if accumulate_grad_batches > 1 else ""
        total = batch_size * shape.dp * accumulate_grad_batches
        batch = (
            f"Each replica's training batch has {batch_size} samples, so an optimizer step sees a global batch "
            f"of {total} ({batch_size} x {shape.dp} replica{'s' if shape.dp != 1 else ''}{accumulated})."
        )
    advice = ""
    if shape.dp != shape.world_size:
        advice = (
            f" A datamodule that splits a global batch size divides it by the data-parallel size "
            f"(trainer.strategy.distributed_sampler_kwargs['num_replicas'] = {shape.dp}), "
            f"not by trainer.world_size = {shape.world_size}."
        )
    return f"{layout} {batch}{advice}"
