"""What a plan covers, said at start-up, and refused when it splits (almost) nothing.

``sample_forward`` gives ``plan="auto"`` the step to trace (a ``SampleStep``): the user's
``training_step`` on the first training batch (or ``forward`` on ``example_input_array`` outside
``fit``), with random state, buffers, metrics and logs left as they were.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_parallel.step_effects import capture_logs, untouched
from lightning_parallel.tensor.plan import PlanError, ResolvedPlan
from lightning_parallel.tensor.table import collectives_per_step, plan_rows

__all__ = ["SampleStep", "check_coverage", "forward_on", "sample_forward", "sharded_share"]


def sample_forward(module: Any, to_device: Callable[[Any], Any]) -> SampleStep | None:
    """The module's computation on the first training batch, or None when there is nothing to run."""
    trainer = getattr(module, "_trainer", None)
    batch = None
    if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
        try:  # a loader's iterator draws its base seed from the global random state: left as it was
            with torch.random.fork_rng(devices=[]):
                batch = to_device(next(iter(trainer.fit_loop._data_source.dataloader())))
        except (StopIteration, TypeError, AttributeError):
            batch = None
    return forward_on(module, batch)


@dataclass
class SampleStep:
    """The user's computation on one input, as ``plan="auto"`` traces it: ``training_step(inputs, 0)``
    on a batch, else ``forward`` on ``example_input_array``. Calling it runs ``step`` on ``inputs``
    inside ``kept``; ``tensor.fake`` runs the same step on fake copies of the inputs instead."""

    module: Any
    inputs: Any
    is_batch: bool

    def step(self, inputs: Any) -> Any:
        if self.is_batch:
            return self.module.training_step(inputs, 0)
        return self.module(*inputs) if isinstance(inputs, tuple) else self.module(inputs)

    @contextmanager
    def kept(self) -> Iterator[None]:
        """Random state, buffers, metrics and logs are as they were after the block."""
        with untouched(self.module), capture_logs(self.module, log_objects=False):
            yield

    def __call__(self) -> Any:
        with self.kept():
            return self.step(self.inputs)


def forward_on(module: Any, batch: Any = None) -> SampleStep | None:
    """``training_step(batch, 0)``, else ``forward`` on ``example_input_array``; None when neither is
    available. A step that optimizes by itself (``automatic_optimization=False``) is not run: only its
    ``forward``."""
    example = getattr(module, "example_input_array", None)
    if not getattr(module, "automatic_optimization", True):
        batch = None
    if batch is None and example is None:
        return None
    return SampleStep(module, batch if batch is not None else example, batch is not None)


def sharded_share(module: nn.Module, resolved: ResolvedPlan) -> float:
    """The share of the model's parameters that the plan splits over the ranks."""
    total = sum(p.numel() for p in module.parameters())
    split = {
        id(p): p.numel()
        for a in resolved.assignments
        if a.style not in ("replicate", "per_feature")
        for p in a.module.parameters()
    }
    parameters = dict(module.named_parameters())
    split.update({id(parameters[n]): parameters[n].numel() for n in resolved.features if n in parameters})
    return sum(split.values()) / max(total, 1)


def check_coverage(module: nn.Module, resolved: ResolvedPlan, required: float) -> None:
    """Say what the plan covers (rank 0); fail before training if it splits less than ``required``."""
    rows = plan_rows(module, resolved)
    total = sum(p.numel() for p in module.parameters())
    per_rank = sum(r.params_per_rank for r in rows)
    forward, backward = collectives_per_step(rows)
    share = sharded_share(module, resolved)
    per_feature = [a.name or "(root)" for a in resolved.assignments if a.style == "per_feature"]
    rank_zero_info(
        f"lp_tensor_parallel: tp={resolved.tp_size} splits {share:.0%} of the parameters; each rank holds "
        f"{per_rank:,} of {total:,} ({per_rank / max(total, 1):.0%}); {forward} collectives forward and "
        f"{backward} backward per step"
        + (f"; per-feature layers split with their pair: {', '.join(per_feature)}" if per_feature else "")
    )
    for name, why in resolved.report:
        rank_zero_info(f"lp_tensor_parallel: {name} stays replicated: {why}")
    if share < required:
        whole = "; ".join(f"{n}: {why}" for n, why in resolved.report[:8]) or "no layer was planned"
        raise PlanError(
            f"the plan splits only {share:.0%} of the model's parameters (require_sharded={required}): "
            f"tensor parallelism would only add communication. Left whole: {whole}. Write a plan "
            "(see docs/tensor_parallel.md and conf/plan/), or pass require_sharded=0 to train anyway"
        )
