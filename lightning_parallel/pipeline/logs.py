"""``self.log`` calls from the last stage, mirrored to every stage.

The user's ``training_step`` (the loss) runs only on the last stage, once per micro-batch, but the
progress bar and loggers live on rank 0 (the first stage), and ``ModelCheckpoint``/``EarlyStopping``
must decide the same way on every rank or the ranks' collectives stop matching. So the last stage
records its ``self.log`` calls instead of making them, averages them over the micro-batches with the
loss weights, and sends one summary per step to the other stages on the object channel (no
collective: under the async schedule the stages are not in step, and a summary can be read a step
later). Every stage then replays the summary with ``self.log``. An evaluation step's summary also
carries what the step returned for the whole batch, which every stage then returns to Lightning
(validation outputs for ``on_validation_batch_end``, predictions for writers and ``trainer.predict``).

A torchmetrics ``Metric`` logged as an object is logged for real on the last stage, and its state (and
its value for the step's whole batch) travels in the summary instead of a number: the other stages load
it into their own copy of the metric (modules outside the block stack exist on every stage) and log that
copy with the same arguments. Lightning then treats the metric alike everywhere: per-step values, and
``compute()`` at the end of the epoch, synced over each stage's own data-parallel group.

A metric's ``forward`` gives its value on one micro-batch only. The step value Lightning shows must be
the whole batch's, and for metrics that are not averages (a maximum, F1, AUROC) no mix of micro-batch
values gives it: ``WholeBatchMetrics`` feeds every call of the step to a second, reset copy as well, and
that copy's ``compute()`` is the whole batch's value.
"""

from __future__ import annotations

import copy
from collections import deque
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric

from lightning_parallel.distributed.p2p import PeerLink
from lightning_parallel.step_effects import (
    METRICS,
    capture_logs,
    load_metric_state,
    metric_state,
    to_cpu,
    to_device,
)

__all__ = [
    "capture_logs",
    "summarize",
    "metric_state",
    "load_metric_state",
    "LogMirror",
    "METRICS",
    "WholeBatchMetrics",
]


class WholeBatchMetrics:
    """While a step's micro-batches run, each call of a ``Metric`` of the module also updates a reset copy
    of it (made once, never synced), so that copy's ``compute()`` is the metric's value on the whole batch."""

    def __init__(self) -> None:
        self._copies: dict[int, Metric] = {}  # id(metric) -> its copy

    @contextmanager
    def track(self, module: Any) -> Iterator[None]:
        metrics = [m for m in module.modules() if isinstance(m, Metric)]
        for metric in metrics:
            twin = self._copies.get(id(metric))
            if twin is None:
                shared = {
                    id(v): v for v in vars(metric).values() if isinstance(v, dist.ProcessGroup)
                }  # not copyable
                twin = self._copies[id(metric)] = copy.deepcopy(metric, memo=shared)
                twin.sync_on_compute = twin.dist_sync_on_step = twin._to_sync = (
                    False  # a collective here would
                )
                # be on the last stage alone: a deadlock
            twin.reset()
            metric.forward = _also_updating(metric.forward, twin)  # nn.Module.__call__ finds it first
        try:
            yield
        finally:
            for metric in metrics:
                del metric.forward

    def value(self, metric: Metric) -> Any:
        """The whole batch's value of ``metric`` in the last tracked step (None if it was not called)."""
        twin = self._copies.get(id(metric))
        return twin.compute() if twin is not None and twin._update_count else None


def _also_updating(forward: Any, twin: Metric) -> Any:
    def forward_and_update_twin(*args: Any, **kwargs: Any) -> Any:
        twin.update(*args, **kwargs)
        return forward(*args, **kwargs)

    return forward_and_update_twin


def summarize(
    kind: str,
    losses: Sequence[Tensor],
    weights: Sequence[float],
    logged: dict[str, list],
    batch: Optional[int] = None,
    batch_idx: Optional[int] = None,
    whole_batch: Optional[WholeBatchMetrics] = None,
    outputs: Any = None,
) -> dict[str, Any]:
    """One step's loss and logs, each averaged over the micro-batches with the loss weights; a metric
    object's step value is its whole-batch value (``whole_batch``). ``batch``: the global step it was
    computed in (async, where it is shown a step later), ``batch_idx``: its index in the epoch;
    ``outputs``: what an evaluation step returned for the whole batch (sent on the CPU), so every stage
    hands Lightning the same as the last."""
    # the micro-batches' losses read in one transfer (one host sync), summed in float64
    values = torch.stack([torch.as_tensor(v).reshape(()) for v in losses]).double().tolist() if losses else []
    loss = sum(w * value for w, value in zip(weights, values)) if losses else None
    logs = {}
    metrics = {}
    for name, (metric, path, kwargs, values) in logged.get(METRICS, {}).items():
        value = whole_batch.value(metric) if whole_batch is not None else None
        step_value = to_cpu(value) if value is not None else _weighted(values, weights)
        metrics[name] = (path, {**metric_state(metric), "forward_cache": step_value}, kwargs)
    for name, calls in logged.items():
        if name == METRICS:
            continue
        values = [v for v, _ in calls]
        w = weights if len(values) == len(weights) else [1 / len(values)] * len(values)
        logs[name] = (sum(a * b for a, b in zip(w, values)), calls[-1][1])
    return {
        "kind": kind,
        "loss": loss,
        "logs": logs,
        "metrics": metrics,
        "batch": batch,
        "batch_idx": batch_idx,
        "outputs": to_cpu(outputs),
    }


def _weighted(values: Sequence[Any], weights: Sequence[float]) -> Any:
    """A metric's value for the whole batch from its per-micro-batch values, when it was not tracked:
    their weighted mean (exact for averaging metrics such as MSE or accuracy), or the last value where
    that is not defined."""
    if len(values) == len(weights) and all(isinstance(v, Tensor) and v.is_floating_point() for v in values):
        return sum(w * v for w, v in zip(weights, values))
    return values[-1] if values else None


class LogMirror:
    """The last stage publishes summaries; every stage takes them, in order, per kind."""

    def __init__(self, link: PeerLink, last_rank: int, other_ranks: Sequence[int], is_last: bool) -> None:
        self.link, self.last_rank, self.other_ranks, self.is_last = (
            link,
            last_rank,
            list(other_ranks),
            is_last,
        )
        self.received: deque[dict[str, Any]] = deque()

    def publish(self, summary: dict[str, Any]) -> None:
        """Last stage only: keep a copy and send one to every other stage (non-blocking)."""
        self.received.append(summary)
        for rank in self.other_ranks:
            self.link.send_object(summary, rank)

    def take(self, kind: str) -> dict[str, Any]:
        """The oldest summary of ``kind`` (a training summary read late may sit before an eval one)."""
        while not any(s["kind"] == kind for s in self.received):
            self.received.append(self.link.recv_object(self.last_rank))
        summary = next(s for s in self.received if s["kind"] == kind)
        self.received.remove(summary)
        return summary

    def finish(self, flushed: bool) -> None:
        """At the end of a step: wait until what this stage sent has left if every stage takes it in this
        step (``flushed``), else only drop what has left (an async summary is read a step later)."""
        if flushed:
            self.link.wait_sends()
        else:
            self.link.forget_finished_sends()

    def replay(self, module: Any, summary: dict[str, Any], device: torch.device) -> Optional[Tensor]:
        """``self.log`` each value on this stage; returns the loss as a tensor (None if there is none).
        Metric objects were logged on the last stage already; the other stages load their state first."""
        for name, (value, kwargs) in summary["logs"].items():
            module.log(
                name, torch.tensor(value, dtype=torch.float64, device=device), **kwargs
            )  # sync_dist: NCCL wants it there
        for name, (path, state, kwargs) in summary.get("metrics", {}).items():
            metric = module.get_submodule(path)
            if self.is_last:  # logged during the step already: only its step value becomes the whole batch's
                metric._forward_cache = to_device(state["forward_cache"], device)
            else:
                load_metric_state(metric, state, device)
            module.log(name, metric, **kwargs)  # Lightning takes the step value when log() is called
        if summary["loss"] is None:
            return None
        return torch.tensor(summary["loss"], dtype=torch.float64, device=device)
