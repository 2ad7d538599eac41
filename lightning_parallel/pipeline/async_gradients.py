"""The gradients of two batches on one stage of the no-flush (PipeDream-2BW) pipeline.

In a step of the async schedule a stage first finishes the backwards the previous batch left in
flight, then starts this batch's. So at any time it holds up to two gradients:

- ``partial``: the batch whose backwards are not all done yet (carried into the next step);
- ``pending``: a finished batch's gradient, applied by the next optimizer step.

The optimizer step at the end of step t applies batch t-1's gradient, which was computed with the
weights of step t-1. Writing W(k) for the weights after k updates, that is the documented rule
``W(t+1) = W(t) - lr * grad f_t(W(t-1))``, the same version on every stage for every micro-batch.
Lightning's closure wipes ``.grad`` (``zero_grad``) between the step's forward and backward, so the
gradients live here, and ``.grad`` only holds them while the executor runs backwards into them.

A finished gradient must still be summed over the stages for the modules replicated on every stage.
That reduction (``reduce``) starts the moment a batch's gradient is finished on this stage, and is
waited for only when the gradient is applied, a step later. A blocking all-reduce at the optimizer
step would make every stage wait for the slowest there, a flush in all but name: stage 0 could not
start the next batch's forwards while the last stage finishes this one.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from torch import Tensor, nn

__all__ = ["AsyncGradients", "Reduce", "merge_stage_gradients"]

Grads = list[Optional[Tensor]]
Reduce = Callable[[Grads], Callable[[], Grads]]  # start a reduction now; the result is waited for later


class AsyncGradients:
    def __init__(self, reduce: Optional[Reduce] = None) -> None:
        self.reduce = reduce
        self.partial: Optional[Grads] = None
        self.pending: Optional[Grads] = None  # as this stage computed it (what a checkpoint saves)
        self._reduced: Optional[Callable[[], Grads]] = None  # pending's reduction, started when it finished
        self.pending_by_name: Optional[dict[str, Tensor]] = None  # from a checkpoint, placed at first use
        self._previous_open = False

    def begin(self, params: Sequence[nn.Parameter], carried: int) -> None:
        """Before a step's backwards: ``.grad`` continues the in-flight batch's gradient."""
        for p, g in zip(params, self.partial or [None] * len(params)):
            p.grad = g
        self.partial = None
        self._previous_open = carried > 0

    def before_backward(self, params: Sequence[nn.Parameter], batch: int) -> None:
        """Called before each backward: the first one of this step's batch closes the previous batch."""
        if batch == 0 and self._previous_open:
            self._close_previous(params)

    def end(self, params: Sequence[nn.Parameter], finished: bool) -> Optional[Grads]:
        """After a step's backwards: returns the gradient to apply now (None: nothing finished yet) and
        keeps this batch's, as pending if ``finished`` (this stage has no backward of it left in flight)
        or else as partial."""
        if self._previous_open:  # every backward of this step belonged to the previous batch
            self._close_previous(params)
        apply_now = self.take_pending()
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        if finished:
            self._finished(grads)
        else:
            self.partial = grads
        return apply_now

    def take_pending(self) -> Optional[Grads]:
        """The finished gradient to apply now, reduced over the stages (waits for that); None if none."""
        grads, reduced = self.pending, self._reduced
        self.pending, self._reduced = None, None
        if grads is None:
            return None
        return reduced() if reduced is not None else grads

    def drain(self, params: Sequence[nn.Parameter]) -> None:
        """Before a drain's backwards (the in-flight batch's cool-down): continue its gradient."""
        self.begin(params, carried=0)

    def drained(self, params: Sequence[nn.Parameter]) -> None:
        """After a drain: the in-flight batch's gradient is finished and waits for the next step."""
        if self.pending is not None:
            raise RuntimeError("async pipeline: a finished gradient is already waiting to be applied")
        self._finished([p.grad for p in params])
        for p in params:
            p.grad = None

    def place_from_checkpoint(
        self, named: Sequence[tuple[str, nn.Parameter]], replicated: set[str], first_stage: bool
    ) -> None:
        """A checkpoint's full gradient (single-device names) becomes this stage's pending gradient.
        Parameters replicated on every stage get it on the first stage only (stages' parts are summed)."""
        if self.pending_by_name is None:
            return
        full, self.pending_by_name = self.pending_by_name, None
        self._finished(
            [
                None
                if (n in replicated and not first_stage) or n not in full
                else full[n].to(p.device, p.dtype)
                for n, p in named
            ]
        )

    def _close_previous(self, params: Sequence[nn.Parameter]) -> None:
        self._finished([p.grad for p in params])
        for p in params:
            p.grad = None
        self._previous_open = False

    def _finished(self, grads: Grads) -> None:
        """A batch's gradient is complete on this stage: it waits to be applied, and its reduction over
        the stages starts now. Every stage finishes the same batches in the same order, so the
        reductions pair up."""
        self.pending = grads
        self._reduced = self.reduce(grads) if self.reduce is not None else None


def merge_stage_gradients(parts: Sequence[dict[str, Tensor]], replicas: int) -> dict[str, Tensor]:
    """Per-rank pending gradients (whole tensors; a rank that holds no part of its own sends none) -> one
    full gradient: summed over the stages of a replica (replicated modules' parts), averaged over the
    ``replicas``."""
    full: dict[str, Tensor] = {}
    for part in parts:
        for name, g in part.items():
            g = g / replicas
            full[name] = g if name not in full else full[name] + g
    return full
