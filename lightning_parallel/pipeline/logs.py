"""``self.log`` calls from the last stage, mirrored to every stage.

The user's ``training_step`` (the loss) runs only on the last stage, once per micro-batch, but the
progress bar and loggers live on rank 0 (the first stage), and ``ModelCheckpoint``/``EarlyStopping``
must decide the same way on every rank or the ranks' collectives stop matching. So the last stage
records its ``self.log`` calls instead of making them, averages them over the micro-batches with the
loss weights, and sends one summary per step to the other stages on the object channel (no
collective: under the async schedule the stages are not in step, and a summary can be read a step
later). Every stage then replays the summary with ``self.log``.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import Tensor

from lightning_parallel.distributed.p2p import PeerLink

__all__ = ["capture_logs", "summarize", "LogMirror"]


@contextmanager
def capture_logs(module: Any) -> Iterator[dict[str, list]]:
    """Record ``module.log`` calls of numbers and tensors instead of making them."""
    logged: dict[str, list] = {}

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(value, Tensor) or isinstance(value, (int, float)):
            logged.setdefault(name, []).append((float(value), kwargs))
        else:
            original(name, value, *args, **kwargs)

    original = module.log
    module.log = log
    try:
        yield logged
    finally:
        del module.log


def summarize(kind: str, losses: Sequence[Tensor], weights: Sequence[float], logged: dict[str, list],
              batch: Optional[int] = None, batch_idx: Optional[int] = None) -> dict[str, Any]:
    """One step's loss and logs, each averaged over the micro-batches with the loss weights. ``batch``:
    the global step it was computed in (async, where it is shown a step later), ``batch_idx``: its index
    in the epoch."""
    loss = sum(w * float(l) for w, l in zip(weights, losses)) if losses else None
    logs = {}
    for name, calls in logged.items():
        values = [v for v, _ in calls]
        w = weights if len(values) == len(weights) else [1 / len(values)] * len(values)
        logs[name] = (sum(a * b for a, b in zip(w, values)), calls[-1][1])
    return {"kind": kind, "loss": loss, "logs": logs, "batch": batch, "batch_idx": batch_idx}


class LogMirror:
    """The last stage publishes summaries; every stage takes them, in order, per kind."""

    def __init__(self, link: PeerLink, last_rank: int, other_ranks: Sequence[int], is_last: bool) -> None:
        self.link, self.last_rank, self.other_ranks, self.is_last = link, last_rank, list(other_ranks), is_last
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

    @staticmethod
    def replay(module: Any, summary: dict[str, Any], device: torch.device) -> Optional[Tensor]:
        """``self.log`` each value on this stage; returns the loss as a tensor (None if there is none)."""
        for name, (value, kwargs) in summary["logs"].items():
            module.log(name, torch.tensor(value, dtype=torch.float64), **kwargs)
        if summary["loss"] is None:
            return None
        return torch.tensor(summary["loss"], dtype=torch.float64, device=device)
