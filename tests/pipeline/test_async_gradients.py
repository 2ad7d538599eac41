"""AsyncGradients as pure bookkeeping: which batch's gradient a step applies, and when the reduction
over the stages of a finished gradient starts (when it finishes) and is waited for (when applied)."""

import torch
from torch import nn

from lightning_parallel.pipeline.async_gradients import AsyncGradients


class RecordingReduce:
    """A stand-in for the reduction over the stages: records when each one starts and is waited for,
    and 'reduces' by doubling (as if a second stage held the same gradient)."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def __call__(self, grads):
        batch = int(grads[0].item())
        self.events.append(f"start {batch}")

        def reduced():
            self.events.append(f"wait {batch}")
            return [None if g is None else 2 * g for g in grads]

        return reduced


def backward_of(param: nn.Parameter, batch: int) -> None:
    """A backward of micro-batch data of ``batch``: accumulates ``batch`` into the gradient."""
    param.grad = torch.tensor([float(batch)]) if param.grad is None else param.grad + batch


def test_first_stage_applies_the_previous_batch_reduced_and_starts_its_reduction_early() -> None:
    # stage 0 of 2: the first backward of each step belongs to the previous batch (carried over)
    param = nn.Parameter(torch.zeros(1))
    reduce = RecordingReduce()
    grads = AsyncGradients(reduce)

    grads.begin([param], carried=0)  # step 0: nothing in flight yet
    grads.before_backward([param], batch=0)
    backward_of(param, 1)
    assert grads.end([param], finished=False) is None  # batch 0 is not finished on this stage
    assert reduce.events == []

    grads.begin([param], carried=1)  # step 1: batch 0's last backward comes first
    grads.before_backward([param], batch=-1)
    backward_of(param, 1)  # batch 0's gradient is now 1 + 1 = 2
    grads.before_backward([param], batch=0)  # closes batch 0: its reduction starts here
    assert reduce.events == ["start 2"]
    backward_of(param, 5)
    applied = grads.end([param], finished=False)
    assert reduce.events == ["start 2", "wait 2"]
    assert applied[0].item() == 4.0  # batch 0's gradient, reduced
    assert param.grad is None  # the gradients live in AsyncGradients, not in .grad, between steps


def test_last_stage_starts_the_reduction_at_the_end_of_the_step_and_waits_a_step_later() -> None:
    param = nn.Parameter(torch.zeros(1))
    reduce = RecordingReduce()
    grads = AsyncGradients(reduce)
    for step, value in enumerate((3, 7)):
        grads.begin([param], carried=0)
        grads.before_backward([param], batch=0)
        backward_of(param, value)
        applied = grads.end([param], finished=True)
        if step == 0:
            assert applied is None and reduce.events == ["start 3"]
        else:
            assert applied[0].item() == 6.0
            assert reduce.events == ["start 3", "wait 3", "start 7"]  # the wait comes before the next start


def test_drain_finishes_the_in_flight_batch_and_its_reduction_starts_then() -> None:
    param = nn.Parameter(torch.zeros(1))
    reduce = RecordingReduce()
    grads = AsyncGradients(reduce)
    grads.begin([param], carried=0)
    backward_of(param, 4)
    grads.end([param], finished=False)
    grads.drain([param])
    backward_of(param, 1)
    grads.drained([param])
    assert reduce.events == ["start 5"]
    assert grads.take_pending()[0].item() == 10.0
    assert grads.take_pending() is None


def test_without_a_reduction_the_gradient_is_applied_as_computed() -> None:
    param = nn.Parameter(torch.zeros(1))
    grads = AsyncGradients()
    grads.begin([param], carried=0)
    backward_of(param, 3)
    grads.end([param], finished=True)
    assert grads.take_pending()[0].item() == 3.0
