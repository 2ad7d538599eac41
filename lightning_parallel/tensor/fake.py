"""The sample step on fake tensors: the shapes, dtypes and data flow of a real run, with no memory.

``plan="auto"`` reads what the user's code does with tensors, never their values. Under torch's
``FakeTensorMode`` a tensor is metadata only, so the trace and the dry run cost no memory for weights or
activations, and work on a module built on the meta device. The module's parameters and buffers (real
or meta) are swapped for fakes on the step's device, one per tensor so that tied weights stay tied, and
the module's own objects are put back after.

What the step computes from its inputs and constants alone (token ids, positions, masks: no parameter
or buffer involved) is small, and it is also computed for real beside its fake (``_InputValues``), so
code that reads such a value works as in a real run (``bool((mask == causal).all())`` in
``nn.TransformerDecoder``, ``nonzero`` of a padding mask). A torchmetrics ``Metric`` called in the step
reads what it is given whole and computes nothing (its checks read values; its state and value feed
only itself and the logs, never the loss). A step whose work depends on the value of
anything a parameter or buffer touched (``.item()`` of a loss in a computation) raises here; the caller
then decides without a trace. Hugging Face mixtures of experts run their batched experts instead of the
eager loop over the router's ``nonzero`` choices (``_experts_batched``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, Optional

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.utils.weak import WeakTensorKeyDictionary
from torchmetrics import Metric

from lightning_parallel.compat import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    TorchDispatchMode,
    tree_flatten,
    tree_map,
    unset_fake_temporarily,
)
from lightning_parallel.memory.accounting import storage_id
from lightning_parallel.tensor.sample import SampleStep

__all__ = ["VALUE_LIMIT", "fake_step", "step_device"]

# the most elements a value computed beside its fake may have: larger ones are not kept (no real memory
# of the activations' order is spent), and code that reads one raises as without a value
VALUE_LIMIT = 1 << 20


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
    """Every parameter and buffer of ``module`` a fake on ``device`` within; after, the originals, and
    every module's attributes and hooks as they were (a step may cache what it computed, such as a
    positional table made on first use: a fake kept there would reach the real steps; or install hooks
    once and mark it in an attribute, as Hugging Face's output capture does: the mark goes, so must the
    hooks, or the next step installs them twice)."""
    made: dict[int, Tensor] = {}
    held = [
        (table, name, t)
        for m in module.modules()
        for table in (m._parameters, m._buffers)
        for name, t in table.items()
        if t is not None
    ]
    attributes = [(vars(m), dict(vars(m))) for m in module.modules()]
    hooks = [
        (table, dict(table)) for state, _ in attributes for k, table in state.items() if _hook_table(k, table)
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
        for state, before in attributes:
            for key in state.keys() - before.keys():
                del state[key]
            state.update(before)
        for table, before in hooks:
            table.clear()
            table.update(before)


def _hook_table(name: str, value: Any) -> bool:
    """A module's table of hooks (``_forward_hooks``, ...): a dict that the step may add to in place."""
    return name.startswith("_") and name.endswith("hooks") and isinstance(value, dict)


def _reads_whole(*args: Any, **kwargs: Any) -> None:
    """A metric's call in the fake step: every tensor it is given is read whole (a sum), as a metric's
    reductions read it, so the plan keeps whole what a metric reads; nothing is computed or kept."""
    for t in tree_flatten((args, kwargs))[0]:
        if isinstance(t, Tensor) and t.numel():
            t.sum()


@contextmanager
def _metrics_read_whole(module: nn.Module) -> Iterator[None]:
    """Every ``Metric`` of ``module`` called (``forward``) or updated as ``_reads_whole`` within."""
    held = [(vars(m), dict(vars(m))) for m in module.modules() if isinstance(m, Metric)]
    for state, _ in held:
        state["forward"] = state["update"] = _reads_whole
    try:
        yield
    finally:
        for state, before in held:
            for key in ("forward", "update"):
                state.pop(key, None)
                if key in before:
                    state[key] = before[key]


class _InputValues(TorchDispatchMode):
    """Real values beside the fakes computed from the step's inputs and constants alone (under
    ``VALUE_LIMIT`` elements): an operation whose tensors all have one is also run on them, and one
    that fake tensors cannot answer (a value read, an output shape that depends on values) is answered
    from them. Writing into a tensor from a value not known forgets the values of its storage."""

    def __init__(self, mode: FakeTensorMode) -> None:
        super().__init__()
        self.mode = mode
        self.values = WeakTensorKeyDictionary()  # fake -> its real value

    def know(self, fake: Tensor, real: Tensor) -> None:
        if real.numel() <= VALUE_LIMIT:
            self.values[fake] = real

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None
    ) -> Any:
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, Tensor)]
        known = all(t in self.values for t in tensors)
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            if not known:
                raise
            real = self._real(func, args, kwargs)
            out = tree_map(lambda r: self.mode.from_tensor(r) if isinstance(r, Tensor) else r, real)
            self._pair(out, real)
            return out
        if known and all(o.numel() <= VALUE_LIMIT for o in tree_flatten(out)[0] if isinstance(o, Tensor)):
            self._pair(out, self._real(func, args, kwargs))
        elif func._schema.is_mutable:
            written = {storage_id(t) for t in tensors}
            for fake in [f for f in self.values if storage_id(f) in written]:
                del self.values[fake]
        return out

    def _real(self, func: Any, args: tuple, kwargs: dict) -> Any:
        swap = lambda a: self.values[a] if isinstance(a, Tensor) else a  # noqa: E731
        with unset_fake_temporarily():
            return func(*tree_map(swap, args), **tree_map(swap, kwargs))

    def _pair(self, fakes: Any, reals: Any) -> None:
        for fake, real in zip(tree_flatten(fakes)[0], tree_flatten(reals)[0]):
            if isinstance(fake, Tensor) and isinstance(real, Tensor):
                self.know(fake, real)


@contextmanager
def _experts_batched(module: nn.Module) -> Iterator[None]:
    """Hugging Face mixtures of experts run their batched form (``experts_implementation="batched_mm"``:
    every expert's weights gathered per token) instead of the eager loop over the experts the router
    chose, whose trip count depends on values fakes do not have; the same layers, the same data flow into
    and out of the experts."""
    configs = {
        id(c): c
        for m in module.modules()
        if getattr(c := getattr(m, "config", None), "_experts_implementation", None) == "eager"
    }
    for config in configs.values():
        config._experts_implementation = "batched_mm"
    try:
        yield
    finally:
        for config in configs.values():
            config._experts_implementation = "eager"


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
    values = _InputValues(mode)
    device = step_device(module, inputs)
    with kept, _fake_tensors(module, mode, device), _metrics_read_whole(module), _experts_batched(module):
        fake_inputs = apply_to_collection(inputs, Tensor, lambda t: _with_value(values, t))
        with mode, values:
            yield lambda: step(fake_inputs)


def _with_value(values: _InputValues, t: Tensor) -> Tensor:
    """The fake of an input tensor, with a copy of its value (the step may write into its input)."""
    fake = values.mode.from_tensor(t)
    values.know(fake, t.detach().clone())
    return fake
