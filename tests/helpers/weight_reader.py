"""A callback that reads the model's weights the way users do, in the hooks users put such code in.

``WeightReader`` takes ``p.norm()``, ``p.sum()``, ``p.clone()`` and ``print(p)`` of every parameter in
``on_train_batch_start``, ``on_before_backward``, ``on_after_backward``, ``on_before_optimizer_step``,
``on_train_batch_end``, ``on_validation_epoch_end`` and ``on_train_epoch_end`` (under ``zero_stage=3`` most of
these run while units are freed), and after each step, inside ``strategy.sharded_parameters.gathered()``
where the strategy has one, keeps every parameter's values. At fit's end it writes, per rank,
``reads-rank{r}.pt``: ``{"steps": [{name: tensor} per step], "between": [{name: norm} read outside
gathered() after each step], "hooks": {hook: times run}}``.
"""

from __future__ import annotations

import io
import math
from contextlib import nullcontext
from pathlib import Path

import torch
from lightning.pytorch import Callback

__all__ = ["HOOKS", "WeightReader", "all_nan"]

HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_validation_epoch_end",
    "on_train_batch_end",
    "on_train_epoch_end",
)


class WeightReader(Callback):
    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)
        self.steps: list[dict[str, torch.Tensor]] = []
        self.between: list[dict[str, float]] = []
        self.hooks: dict[str, int] = {}

    def _read(self, hook: str, pl_module) -> dict[str, float]:
        norms = {}
        for name, p in pl_module.named_parameters():
            norms[name] = float(p.detach().norm())
            float(p.detach().sum())
            p.detach().clone()
            print(p, file=io.StringIO())
        self.hooks[hook] = self.hooks.get(hook, 0) + 1
        return norms

    def on_train_batch_start(self, trainer, pl_module, *args) -> None:
        self._read("on_train_batch_start", pl_module)

    def on_before_backward(self, trainer, pl_module, *args) -> None:
        self._read("on_before_backward", pl_module)

    def on_after_backward(self, trainer, pl_module) -> None:
        self._read("on_after_backward", pl_module)

    def on_before_optimizer_step(self, trainer, pl_module, *args) -> None:
        self._read("on_before_optimizer_step", pl_module)

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        self._read("on_validation_epoch_end", pl_module)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._read("on_train_epoch_end", pl_module)

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.between.append(self._read("on_train_batch_end", pl_module))
        sharded = getattr(trainer.strategy, "sharded_parameters", None)
        with sharded.gathered() if sharded is not None else nullcontext():
            self.steps.append({n: p.detach().clone() for n, p in pl_module.named_parameters()})

    def on_train_end(self, trainer, pl_module) -> None:
        self.dirpath.mkdir(parents=True, exist_ok=True)
        found = {"steps": self.steps, "between": self.between, "hooks": self.hooks}
        torch.save(found, self.dirpath / f"reads-rank{trainer.global_rank}.pt")


def all_nan(norms: dict[str, float]) -> bool:
    """Every norm read is NaN (what a freed unit's parameter reads as)."""
    return all(math.isnan(v) for v in norms.values())
