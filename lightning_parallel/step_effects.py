"""Running the user's step without its side effects: its ``self.log`` calls recorded instead of made
(``capture_logs``), and the random, buffer, metric and gradient states put back afterwards (``untouched``).

The pipeline replays the recorded logs of the last stage on every stage; the tensor-parallel plan's sample
step and the pipeline's block timing run the user's step once before training and must change nothing.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_parallel.compat import is_fake

__all__ = [
    "METRICS",
    "capture_logs",
    "untouched",
    "metric_state",
    "load_metric_state",
    "to_cpu",
    "to_device",
]

METRICS = "__metrics__"  # the key under which capture_logs records metric objects


def _number(value: Any) -> float:
    """A logged value as a number; nan for a fake tensor (``tensor.fake``), which has no value."""
    if isinstance(value, Tensor):
        return float("nan") if is_fake(value) else float(value.detach())
    return float(value)


@contextmanager
def capture_logs(module: Any, log_objects: bool = True) -> Iterator[dict[str, list]]:
    """Record ``module.log`` calls of numbers and tensors instead of making them; metric objects are
    logged (unless ``log_objects`` is False), and recorded as ``(Metric, its module path, kwargs, the
    value of its forward at each call)`` under ``logged[METRICS][name]``."""
    logged: dict[str, Any] = {METRICS: {}}
    paths = {id(m): n for n, m in module.named_modules()}

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(value, Tensor) or isinstance(value, (int, float)):
            logged.setdefault(name, []).append((_number(value), kwargs))
            return
        if isinstance(value, Metric) and id(value) in paths:
            calls = logged[METRICS].get(name, (None, None, None, []))[3]
            logged[METRICS][name] = (value, paths[id(value)], kwargs, calls + [to_cpu(value._forward_cache)])
        if log_objects:
            original(name, value, *args, **kwargs)

    original = module.log
    module.log = log
    try:
        yield logged
    finally:
        del module.log


def to_cpu(v: Any) -> Any:
    """``v`` with its tensors detached and on the CPU."""
    return apply_to_collection(v, Tensor, lambda t: t.detach().cpu())


def metric_state(metric: Metric) -> dict[str, Any]:
    """What a copy of ``metric`` needs to log and compute the same values (tensors on the CPU)."""
    return {
        "states": {k: to_cpu(getattr(metric, k)) for k in metric._defaults},
        "update_count": metric._update_count,
        "forward_cache": to_cpu(metric._forward_cache),
    }


def load_metric_state(metric: Metric, state: dict[str, Any], device: torch.device) -> None:
    """Make ``metric`` a copy of the one ``state`` was taken from."""
    for name, value in state["states"].items():
        setattr(metric, name, to_device(value, device))
    metric._update_count = state["update_count"]
    metric._forward_cache = to_device(state["forward_cache"], device)
    metric._computed = None


def to_device(v: Any, device: torch.device) -> Any:
    """``v`` with its tensors on ``device``."""
    return apply_to_collection(v, Tensor, lambda t: t.to(device))


@contextmanager
def untouched(module: nn.Module) -> Iterator[None]:
    """Python, NumPy and torch (CPU and CUDA) random states, the module's buffers (BatchNorm statistics),
    torchmetrics states and gradients are the same after the block as before: measuring changes nothing."""
    states = random.getstate(), np.random.get_state()
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    metrics = [(m, _cloned(metric_state(m)), m.device) for m in module.modules() if isinstance(m, Metric)]
    grads = [(p, p.grad) for p in module.parameters()]
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
            for m, saved, device in metrics:
                load_metric_state(m, saved, device)
            for p, g in grads:
                p.grad = g


def _cloned(state: Any) -> Any:
    """Copies of the tensors in ``state`` (metrics update their states in place)."""
    return apply_to_collection(state, Tensor, lambda t: t.detach().clone())
