"""What planning one run takes, shared by the command (``python -m lightning_parallel.planner``) and by
``lp-train strategy=auto``: the cluster planned on, the module measured on this machine, and the threads it
is timed with.

The cluster is a shipped one or a YAML file (a calibration's output, ``planner.calibration_run``, is one),
or this machine: calibrated now over the run's processes, or ``cpu_2core``'s figures with one process per
device. On the machine at hand the blocks are timed here; on a cluster that is not, from FLOPs at its rate.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from hydra.utils import get_object
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed

from lightning_parallel.memory.expected import optimizer_kind
from lightning_parallel.planner.calibration_run import CALIBRATED, calibrate_here
from lightning_parallel.planner.cluster import Cluster
from lightning_parallel.planner.cost_model import ModelCost
from lightning_parallel.planner.measure import lightning_step_seconds, measure_model, step_overhead

__all__ = ["cluster_for", "is_this_machine", "model_cost", "module_cost", "tensor_parallel_sizes", "threads_of"]


def _first_optimizer(configured: Any) -> torch.optim.Optimizer:
    """The optimizer of ``configure_optimizers()``'s return (an optimizer, a list, or a dict)."""
    if isinstance(configured, (list, tuple)):
        configured = configured[0]
        configured = configured[0] if isinstance(configured, (list, tuple)) else configured
    return configured["optimizer"] if isinstance(configured, dict) else configured


def _sample_step(
    module: Any, datamodule: Any, batch_size: int
) -> tuple[Callable[[], torch.Tensor], int, int, Any]:
    """A step returning a loss to time, its batch's samples, tokens per sample, and the training batch:
    ``training_step`` on the first training batch of ``datamodule`` (or of random tokens for the embedded
    GPT), else ``forward`` on the module's ``example_input_array`` (its outputs summed; no training batch)."""
    if datamodule is not None:
        datamodule.setup("fit")
        batch = next(iter(datamodule.train_dataloader()))
    elif hasattr(module, "model") and hasattr(module.model, "block_size") and hasattr(module, "hparams"):
        shape = (batch_size, module.model.block_size)
        batch = (
            torch.randint(module.hparams.vocab_size, shape),
            torch.randint(module.hparams.vocab_size, shape),
        )
    elif getattr(module, "example_input_array", None) is not None:
        example = module.example_input_array
        return lambda: module(example).float().sum(), len(example), 1, None
    else:
        raise ValueError(
            f"{type(module).__name__}: give --data package.module:DataModule (its first training batch is "
            "timed), or set the module's example_input_array"
        )
    first = batch[0] if isinstance(batch, (tuple, list)) else batch
    tokens = first.shape[1] if first.dim() > 1 and not first.is_floating_point() else 1

    def step() -> torch.Tensor:
        loss = module.training_step(batch, 0)
        return loss["loss"] if isinstance(loss, dict) else loss

    return step, len(first), tokens, batch


def module_cost(
    module: Any, datamodule: Any = None, batch_size: int = 8, repeats: int = 2, tensor_parallel: Sequence[int] = ()
) -> ModelCost:
    """``module`` measured on this machine (median of ``repeats``) on the first training batch of
    ``datamodule`` (else ``batch_size`` samples of its own making); its weights take optimizer steps. Its
    blocks are timed again on one rank's shard for each size of ``tensor_parallel``, and a few steps of it
    under a one-device ``Trainer.fit`` give Lightning's own work around a step (``step_overhead``)."""
    optimizer = _first_optimizer(module.configure_optimizers())
    step, samples, tokens, batch = _sample_step(module, datamodule, batch_size)
    with warnings.catch_warnings():  # self.log outside a Trainer; the Trainer's own on a short fit
        warnings.simplefilter("ignore")
        cost = measure_model(
            module, step, samples, optimizer, optimizer_kind(optimizer), tokens, repeats, tensor_parallel
        )
        whole_step = lightning_step_seconds(module, batch) if batch is not None else None
    return step_overhead(cost, whole_step)


def model_cost(
    target: str,
    kwargs: dict,
    data: Optional[str],
    batch_size: int,
    repeats: int = 2,
    tensor_parallel: Sequence[int] = (),
) -> ModelCost:
    """The module built from ``target`` with ``kwargs`` (and the data module ``data``, built without
    arguments), measured on this machine (median of ``repeats``; ``tensor_parallel``: ``module_cost``'s)."""
    module = get_object(target.replace(":", "."))(**kwargs)
    datamodule = get_object(data.replace(":", "."))() if data is not None else None
    return module_cost(module, datamodule, batch_size, repeats, tensor_parallel)


def tensor_parallel_sizes(devices: int) -> tuple[int, ...]:
    """The tensor-parallel sizes whose shards the planner times for ``devices``: every divisor above 1."""
    return tuple(n for n in range(2, devices + 1) if devices % n == 0)


@contextmanager
def threads_of(processes: Optional[int]) -> Iterator[None]:
    """The threads Lightning gives each of ``processes`` processes on this machine (None: as now), put back
    with ``OMP_NUM_THREADS`` after: blocks are timed as one rank of the run runs them."""
    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    try:
        if processes is not None:
            _set_num_threads_if_needed(num_processes=processes)
        yield
    finally:
        torch.set_num_threads(threads)
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = omp


def is_this_machine(cluster: Cluster) -> bool:
    """Whether ``cluster`` describes the machine at hand (``cpu_2core``'s figures, or a calibration): its
    blocks are timed here; on another cluster they come from FLOPs at its rate."""
    return cluster.name.startswith(("cpu", CALIBRATED))


def cluster_for(name: Optional[str], devices: int, calibrate: bool = False) -> Cluster:
    """The cluster planned on: ``name`` (a shipped cluster or a YAML file, a calibration's included), else
    this machine calibrated now over ``devices`` processes (``calibrate``), else ``cpu_2core``'s figures
    with one process per device."""
    if calibrate:
        if name is not None:
            raise ValueError(f"give a cluster ({name}) or calibrate this machine, not both")
        return calibrate_here(devices)
    if name is None:
        return dataclasses.replace(Cluster.load("cpu_2core"), devices_per_node=devices)
    cluster = Cluster.load(name)
    if cluster.name.startswith(CALIBRATED) and cluster.devices != devices:
        raise ValueError(
            f"{name} was calibrated over {cluster.devices} processes, not {devices}: calibrate again over "
            f"{devices} (python -m lightning_parallel.planner.calibration_run --devices {devices} --output FILE)"
        )
    return cluster
