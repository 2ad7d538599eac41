"""What a strategy states so that checkpoints work under its layout: the contract, with single-device defaults.

The checkpoint hooks (``checkpointer.py``) read and write a strategy only through these methods:

- its **full state**: the model (``full_model_state``) and each optimizer (``full_optimizer_state``) as a
  single device would hold them, under single-device names and order (``full_state_keys``,
  ``full_parameter_names``);
- how it **loads a full state** (``load_full_model_state``, ``load_full_optimizer_state``): each rank takes
  its part;
- which **shards it owns** (``shard_layouts``: a state-dict key or parameter name -> the slice of the full
  tensor this rank holds; keys absent are held whole; ``model_state_pieces``: the parameters it holds as a
  range of the flattened tensor, ZeRO-3's) and the optimizer state it owns
  (``local_optimizer_state`` by parameter name, cut as ``optimizer_state_layouts`` says: by default like its
  parameter, so a strategy that shards optimizer state alone states only those two);
- a **network held in the hyperparameters** as one device holds it (``one_device_copy``);
- the **extra resume state** it needs (``extra_resume_state`` / ``load_extra_resume_state``) and what must
  happen before any state is read (``prepare_checkpoint``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from torch import nn

from lightning_parallel.checkpointing.by_name import state_by_name
from lightning_parallel.checkpointing.one_device import one_device_copy
from lightning_parallel.distributed.optimizer_shards import StatePieces

__all__ = ["CheckpointContract", "ShardLayout", "check_keys"]


@dataclass(frozen=True)
class ShardLayout:
    """This rank's tensor is slice ``rank`` of ``size`` along ``dim`` of the full one (``chunks`` packed blocks
    are each sliced; see ``tensor.layers.ShardSpec``)."""

    dim: int
    chunks: int
    rank: int
    size: int
    group: dist.ProcessGroup | None


def check_keys(expected: set[str], given: set[str], accepted: set[str], where: str = "the module") -> None:
    """Raise as a strict single-device load does when a checkpoint's keys (``given``) lack some of
    ``expected`` or hold some outside ``accepted`` (the whole module's keys, where a rank holds a part)."""
    missing, unexpected = expected - given, given - accepted
    if missing or unexpected:
        raise KeyError(
            f"the checkpoint does not match {where}: missing {sorted(missing)[:5]} (of {len(missing)}), "
            f"unexpected {sorted(unexpected)[:5]} (of {len(unexpected)}); strict_loading=False on the "
            "LightningModule ignores them"
        )


def unwrapped(optimizer: Any) -> Any:
    """The torch optimizer inside a ``LightningOptimizer``."""
    return getattr(optimizer, "_optimizer", optimizer)


class CheckpointContract:
    """A strategy's part in checkpoints; the defaults are those of a single device (every rank whole)."""

    def model_is_split(self) -> bool:
        """True when ranks hold different parts of the model (shards, stages)."""
        return False

    def prepare_checkpoint(self) -> None:
        """Called before any state is read for a checkpoint (a pipeline drains here)."""

    # ------------------------------------------------------------------ full state
    def full_model_state(self) -> dict[str, Any]:
        """The single-device ``state_dict``, on every rank that calls it (a collective where it gathers)."""
        return self.lightning_module.state_dict()

    def load_full_model_state(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Load a single-device ``state_dict``; each rank takes its part."""
        self.lightning_module.load_state_dict(state_dict, strict=strict)

    def one_device_copy(self, tree: nn.Module, state: Mapping[str, Any]) -> nn.Module:
        """``tree``, a part of the split module (a network held in the hyperparameters), as one device holds
        it: every module changed by the split rebuilt from its skeleton with the values of the full ``state``."""
        return one_device_copy(tree, self.lightning_module, state)

    def full_optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The single-device ``optimizer.state_dict()`` (torch's ZeroRedundancyOptimizer: on rank 0 only)."""
        optimizer = unwrapped(optimizer)
        if hasattr(optimizer, "consolidate_state_dict"):
            optimizer.consolidate_state_dict()
            return optimizer.state_dict() if self.is_global_zero else {}
        return optimizer.state_dict()

    def load_full_optimizer_state(self, checkpoint: Mapping[str, Any]) -> None:
        """Load ``checkpoint["optimizer_states"]`` (single-device states) into this rank's optimizers."""
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(state)
            _optimizer_to_device(optimizer, self.root_device)

    def full_state_keys(self) -> list[str]:
        """``state_dict`` keys in single-device order."""
        return list(self.lightning_module.state_dict().keys())

    def full_parameter_names(self) -> list[str]:
        """Parameter names in single-device ``named_parameters`` order (the optimizer's index order)."""
        return [n for n, _ in self.lightning_module.named_parameters()]

    # ------------------------------------------------------------------ owned shards
    def shard_layouts(self) -> dict[str, ShardLayout]:
        """state_dict key / parameter name -> the slice of the full tensor this rank holds."""
        return {}

    def model_state_pieces(self) -> dict[str, Optional[StatePieces]]:
        """state_dict keys this rank holds as a range of the flattened tensor (ZeRO-3's parameters), each as
        ``StatePieces`` over the rank's own memory (None: the rank holds none of it); keys absent are held as
        the module holds them."""
        return {}

    def local_model_state(self) -> dict[str, Any]:
        """This rank's own model tensors (a sharded checkpoint's): the module's ``state_dict``, with the keys
        of ``model_state_pieces`` as those pieces (left out where the rank holds none)."""
        pieces = self.model_state_pieces()
        state = {k: pieces.get(k, v) for k, v in self.lightning_module.state_dict().items()}
        return {k: v for k, v in state.items() if v is not None}

    def local_optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """This rank's optimizer state by parameter name: ``{"state": {name: {...}}, "groups": [...]}``."""
        return state_by_name(unwrapped(optimizer), self.lightning_module)

    def optimizer_state_layouts(self) -> dict[str, ShardLayout]:
        """Parameter name -> the slice its optimizer-state tensors (of the parameter's shape) are."""
        return self.shard_layouts()

    # ------------------------------------------------------------------ resume
    def extra_resume_state(self) -> dict[str, Any]:
        """More state for exact resume (every rank calls it; rank 0's is written)."""
        return {}

    def load_extra_resume_state(self, state: Mapping[str, Any]) -> None:
        """Take back what ``extra_resume_state`` saved (called on load, before ``setup``)."""
