"""An axis: one parallelism's part of each training step, as an object with the same few hooks.

A strategy holds its active axes in one list, built by its ``step_axes`` (``base.py`` for ``lp_ddp``,
``parallel.py`` for ``lp_parallel`` and its presets), and each of its step hooks calls that hook of every
axis in the list's order. No hook of one parallelism decides whether another's runs.

The hooks, in the order a step reaches them:

- ``training_step()``: a context around the strategy's training step (forward and, under pipeline
  stages, the schedule's backwards);
- ``pre_backward()`` / ``post_backward()``: before and after Lightning's backward of the step's loss;
- ``no_sync()``: a context around an accumulating micro-step (Lightning's ``block_backward_sync``);
- ``optimizer_step(optimizer)``: a context around Lightning's optimizer step (clipping included);
- ``teardown()``: when the strategy tears down.

The list's order is the order in which the step finishes the gradients, so each axis finds the
gradients the axes before it left: the data-parallel average (its collectives overlap the backward, so
it is waited for first), then the pipeline's sum over the stages of the modules every stage holds (a sum
of averages), then ZeRO's pieces taking their finished gradients (the stage sums included), then the
experts' own average over their replicas, then tensor parallelism's and plan verification's bookkeeping.
Contexts are entered in that order and left in the reverse one. Set-up applies the parallelisms to the
module in its own order (tp, ep, pp, then dp: ``ParallelStrategy.configure_parallelism``).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, ClassVar, ContextManager, Iterator, Sequence

__all__ = ["Axis", "each", "around"]


class Axis:
    """One parallelism's step hooks; each does nothing unless the axis overrides it."""

    #: the axis's name, as ``step_axes`` lists it
    name: ClassVar[str] = ""

    @contextmanager
    def training_step(self) -> Iterator[None]:
        yield

    def pre_backward(self) -> None:
        """Before Lightning's backward of the step's loss."""

    def post_backward(self) -> None:
        """After it: this axis's part of the gradients finished."""

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Around an accumulating micro-step: keep the gradients local."""
        yield

    @contextmanager
    def optimizer_step(self, optimizer: Any) -> Iterator[None]:
        yield

    def teardown(self) -> None:
        """When the strategy tears down."""


def each(axes: Sequence[Axis], hook: str, *args: Any) -> None:
    """Call ``hook`` of every axis, in the list's order."""
    for axis in axes:
        getattr(axis, hook)(*args)


@contextmanager
def around(axes: Sequence[Axis], hook: str, *args: Any) -> Iterator[None]:
    """Enter the context ``hook`` of every axis in the list's order (left in the reverse one)."""
    with ExitStack() as stack:
        for axis in axes:
            context: ContextManager[None] = getattr(axis, hook)(*args)
            stack.enter_context(context)
        yield
