"""The sample step on fake tensors: the shapes, dtypes and data flow of a real run, with no memory.

``plan="auto"`` reads what the user's code does with tensors, never their values. Under torch's
``FakeTensorMode`` a tensor is metadata only, so the trace and the dry run cost no memory for weights or
activations, and work on a module built on the meta device. The module's parameters and buffers (real
or meta) are swapped for fakes on the step's device, one per tensor so that tied weights stay tied, and
the module's own objects are put back after. A step whose work depends on values (``.item()`` in a
computation, ``nonzero``, ``if x.sum() > 0``) raises here; the caller then decides without a trace.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, Optional

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_parallel.tensor.coverage import SampleStep

__all__ = ["fake_step", "step_device"]


def _first_device(tensors: Any) -> Optional[torch.device]:
    found: list[torch.device] = []
    apply_to_collection(tensors, Tensor, lambda t: found.append(t.device))
    return next((d for d in found if d.type != "meta"), None)


def step_device(module: nn.Module, inputs: Any) -> torch.device:
    """Where the step runs: the device of its inputs, else of the module's tensors that are not on the
    meta device, else the CPU."""
    held = [*module.parameters(), *module.buffers()]
    return _first_device(inputs) or _first_device(held) or torch.device("cpu")


def _fake_like(t: Tensor, mode: FakeTensorMode, device: torch.device) -> Tensor:
    """A fake with ``t``'s shape, strides and dtype on ``device``; a ``Parameter`` for a parameter."""
    with mode:
        fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
        return nn.Parameter(fake, t.requires_grad) if isinstance(t, nn.Parameter) else fake


@contextmanager
def _fake_tensors(module: nn.Module, mode: FakeTensorMode, device: torch.device) -> Iterator[None]:
    """Every parameter and buffer of ``module`` a fake on ``device`` within, the originals after."""
    made: dict[int, Tensor] = {}
    held = [
        (table, name, t)
        for m in module.modules()
        for table in (m._parameters, m._buffers)
        for name, t in table.items()
        if t is not None
    ]
    for table, name, t in held:
        if id(t) not in made:
            made[id(t)] = _fake_like(t, mode, device)
        table[name] = made[id(t)]
    try:
        yield
    finally:
        for table, name, t in held:
            table[name] = t


@contextmanager
def fake_step(module: nn.Module, run: Callable[[], Any]) -> Iterator[Callable[[], Any]]:
    """Within: ``module``'s parameters and buffers are fakes and fake mode is on; yields ``run`` on fake
    inputs. A ``SampleStep`` keeps random state, buffers, metrics and logs as they were around it all;
    real tensors that another callable holds become fakes as they are used."""
    if isinstance(run, SampleStep):
        kept, inputs, step = run.kept(), run.inputs, run.step
    else:
        kept, inputs, step = nullcontext(), None, lambda _: run()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with kept, _fake_tensors(module, mode, step_device(module, inputs)):
        fake_inputs = apply_to_collection(inputs, Tensor, mode.from_tensor)
        with mode:
            yield lambda: step(fake_inputs)
