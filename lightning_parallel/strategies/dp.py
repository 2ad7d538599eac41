"""``lp_dp``: master-based data parallelism, the design DDP replaced, kept so its bottleneck can be measured.

Each step, every rank computes gradients on its slice of the batch and sends them to rank 0 (the
"parameter server"). Rank 0 averages them, runs the optimizer, and broadcasts the new parameters.
Rank 0's link carries (world_size - 1) full gradients in and a full model out every step, and nothing
is overlapped with backward: that is the bottleneck ``benchmarks/bench_ddp.py`` shows as the world grows.
Results equal ``lp_ddp`` and single-device training.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import lightning.pytorch as pl
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_parallel.distributed.master import gather_mean_to_master
from lightning_parallel.distributed.mesh import MeshShape
from lightning_parallel.distributed.replicas import broadcast_module_states, broadcast_tensors
from lightning_parallel.materialize import has_meta_tensors
from lightning_parallel.strategies.axes import Axis
from lightning_parallel.strategies.base import ParallelStrategyBase

__all__ = ["DataParallelStrategy"]


class DataParallelStrategy(ParallelStrategyBase):
    """Gradients to rank 0, optimizer step on rank 0 only, parameters broadcast back."""

    strategy_name = "lp_dp"
    supports_save_distributed = False
    zero_refused = (
        "the master-based design keeps the one optimizer on rank 0; use lp_ddp for optimizer sharding"
    )

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    def configure_parallelism(self) -> None:
        if (
            has_meta_tensors(self.lightning_module) or self.initial_weights is not None
        ):  # same values everywhere
            self.set_up_share()
        else:
            broadcast_module_states(self.lightning_module, src=0)
        self.apply_activation_checkpointing()
        self.apply_compile()

    def step_axes(self, shape: MeshShape) -> list[Axis]:
        """None: the gradients go to rank 0 in ``post_backward``, and only rank 0 steps (below)."""
        return []

    def post_backward(self, closure_loss: Tensor) -> None:
        if self._sync_grads:
            params = [p for p in self.lightning_module.parameters() if p.requires_grad]
            gather_mean_to_master(params, master=0)

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        model = model or self.lightning_module
        if self.is_global_zero:
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        else:
            # Workers run forward/backward (and the hooks around it) but never step.
            output = self.precision_plugin._wrap_closure(model, optimizer, closure)
        broadcast_tensors([p.data for p in self.lightning_module.parameters()], src=0)
        return output
