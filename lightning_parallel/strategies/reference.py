"""The single-process reference that distributed runs are compared with.

Under any distributed strategy Lightning gives the training loader a shuffling ``DistributedSampler``
seeded with ``PL_GLOBAL_SEED``; its step-``b`` batches, taken together over the data-parallel ranks, are
one contiguous slice of a single permutation. A plain single-device run would instead keep the user's
sampler and see other samples. This strategy is single-device training that asks Lightning for the
same sampler with one replica, so step ``b`` sees exactly the union of the ranks' step-``b`` batches:
the "same global batch" that equivalence is defined on. Its random state at set-up is that of the
distributed ranks too: Lightning's ``DDPStrategy`` re-seeds from ``PL_GLOBAL_SEED`` as it sets up the
process group (``reset_seed``), and so does this strategy as it sets up its environment.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ParallelStrategy

from lightning_parallel.checkpointing import Checkpointer

__all__ = ["SingleDeviceReferenceStrategy"]


class SingleDeviceReferenceStrategy(Checkpointer, ParallelStrategy):
    """One process, one device, with the sample order of a distributed run (a 1-replica
    ``DistributedSampler``), and the same exact resume as the distributed strategies, so that a
    resumed reference continues where the original left off, also from a sharded (``save_distributed``)
    checkpoint directory. A ``ParallelStrategy`` only so that
    Lightning asks it for sampler arguments; it creates no process group."""

    strategy_name = "lp_reference"

    def __init__(self, device: Any = "cpu", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._device = torch.device(device)
        self.num_nodes = 1

    @property
    def root_device(self) -> torch.device:
        return self._device

    @property
    def is_distributed(self) -> bool:
        return True  # makes Lightning insert its DistributedSampler

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}

    @property
    def world_size(self) -> int:
        return 1

    @property
    def global_rank(self) -> int:
        return 0

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()  # as Lightning's DDPStrategy.setup_distributed does on every rank

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        self.restore_after_setup(trainer)

    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor

    def all_gather(self, tensor: Any, group: Any = None, sync_grads: bool = False) -> Any:
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj
