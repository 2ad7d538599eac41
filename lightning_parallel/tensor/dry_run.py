"""Run the model's forward once as one tensor-parallel rank would, in one process, before any change.

A trace shows where values flow, not where a size came from: ``view(B, T, C)`` with ``C`` read from the
unsplit input fails on a rank whose tensor holds ``C / tp`` features, although the trace looks the
same as ``view(B, T, -1)``. So the automatic plan is tried: the planned layers are swapped for rank 0's
shards with a ``SimulatedGroup`` (no communication, values meaningless, shapes exact; the sequence cut
where ``resolved.sequence`` says), the forward runs
on fake tensors (``tensor.fake``: the shards are fakes too, so nothing is allocated and a module on the
meta device works), and everything is put back. An exception names the module whose ``forward``
failed.
"""

from __future__ import annotations

import traceback
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Optional

from torch import nn

from lightning_parallel.distributed.collectives import SimulatedGroup
from lightning_parallel.tensor.attributes import held_objects, restore_attributes
from lightning_parallel.tensor.fake import fake_step
from lightning_parallel.tensor.full_width import remove_full_width
from lightning_parallel.tensor.layers import FEATURE_SHARDS
from lightning_parallel.tensor.plan import ResolvedPlan, apply_plan
from lightning_parallel.tensor.sequence import apply_sequence_parallel

__all__ = ["DryRunFailure", "dry_run", "as_rank_zero"]


class DryRunFailure(Exception):
    def __init__(self, module: str, error: BaseException) -> None:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        super().__init__(f"{type(error).__name__}: {first}")
        self.module = module


@contextmanager
def as_rank_zero(module: nn.Module, resolved: ResolvedPlan) -> Iterator[None]:
    """``module`` with its planned layers swapped for tensor-parallel rank 0's shards over a
    ``SimulatedGroup`` (no communication), put back as it was on leaving: the dry run's, and what the
    planner times one rank's share of the blocks on."""
    held = [
        (name.rpartition(".")[0], name.rpartition(".")[2], p)
        for name, p in module.named_parameters(remove_duplicate=False)
    ]
    buffers = [(name.rpartition(".")[0], name.rpartition(".")[2], b) for name, b in module.named_buffers()]
    held_configs = held_objects(module, resolved.attributes)
    apply_plan(module, resolved, SimulatedGroup(resolved.tp_size), 0, gradient_hooks=False)
    sequence = resolved.sequence and apply_sequence_parallel(
        module, resolved.sequence, SimulatedGroup(resolved.tp_size), gradient_hooks=False
    )
    try:
        yield
    finally:
        if sequence:
            sequence.remove()
        for a in resolved.assignments:
            if a.style != "replicate":
                parent, _, child = a.name.rpartition(".")
                setattr(module.get_submodule(parent), child, a.module)
        restore_attributes(module, resolved.attributes, held_configs)
        for name in resolved.full_width:
            remove_full_width(module.get_submodule(name))
        for owner, attr, p in held:  # tied aliases held outside the planned layers, per-feature tensors
            setattr(module.get_submodule(owner), attr, p)
        for owner, attr, b in buffers:
            module.get_submodule(owner)._buffers[attr] = b
        vars(module).pop(FEATURE_SHARDS, None)


def _failing_module(error: BaseException, names: dict[int, str]) -> str:
    """The innermost module (by name) whose ``forward`` was running when ``error`` was raised (a sharded
    layer has the name of the layer it replaced)."""
    found = ""
    for frame, _ in traceback.walk_tb(error.__traceback__):
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            found = names[id(owner)]
    return found


def dry_run(
    module: nn.Module, resolved: ResolvedPlan, run: Callable[[], Any], fake: bool = True
) -> Optional[DryRunFailure]:
    """None if ``run()`` works with ``module`` sharded as ``resolved`` says (seen from rank 0), else where
    and how it failed; on fake tensors (the shards are cut from fakes too), or with ``fake=False`` on
    the real ones. The module is left as it was."""
    with fake_step(module, run) if fake else nullcontext(run) as step, as_rank_zero(module, resolved):
        names = {id(m): n for n, m in module.named_modules()}
        try:
            step()
        except Exception as error:  # noqa: BLE001  (any failure of the user's code on a shard)
            return DryRunFailure(_failing_module(error, names), error)
    return None
