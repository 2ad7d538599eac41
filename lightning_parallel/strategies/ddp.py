"""``lp_ddp``: data parallelism with our own gradient buckets and all-reduce overlapped with backward.

Every rank holds the whole model and a slice of the global batch. Replicas start identical (rank 0's
parameters and buffers are broadcast at set-up) and stay identical because every rank applies the
same averaged gradient. The gradient work is done by ``distributed.reducer.GradientReducer``; this
file only wires it into Lightning's hooks.

Buffers (BatchNorm statistics) are copied from rank 0 before the forwards where torch DDP, as
Lightning's ``ddp`` drives it, copies them: a forward syncs if the previous forward ran with gradients
and gradient sync on (torch's ``require_forward_param_sync``), the first one always. While fitting,
validation forwards take part (Lightning routes them through the DDP wrapper); ``validate``, ``test``
and ``predict`` outside ``fit`` do not (no wrapper: the module is broadcast once at set-up).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
from lightning.pytorch.trainer.states import TrainerFn

from lightning_parallel.distributed.reducer import COMM_HOOKS, GradientReducer
from lightning_parallel.distributed.replicas import broadcast_module_states
from lightning_parallel.strategies.base import ParallelStrategyBase
from lightning_parallel.strategies.checks import one_of, positive_number, require
from lightning_parallel.strategies.options import level_problems

__all__ = ["DDPStrategy"]


class DDPStrategy(ParallelStrategyBase):
    """Distributed data parallel, implemented on ``torch.distributed`` collectives.

    Args:
        bucket_cap_mb: size of a gradient bucket (torch DDP's default, 25 MB).
        first_bucket_cap_mb: the first bucket is small so communication starts early in backward.
        find_unused_parameters: allow parameters that get no gradient in a step.
        comm_hook: ``None``, ``"fp16"`` or ``"bf16"``: compress gradients on the wire.
        broadcast_buffers: copy rank 0's buffers (e.g. BatchNorm statistics) before the forwards where
            torch DDP does (see the module's docstring), validation forwards during ``fit`` included.
        **kwargs: process plumbing, as for Lightning's ``DDPStrategy`` (``start_method``, ``timeout``,
            ``process_group_backend``, ...).
    """

    strategy_name = "lp_ddp"

    def __init__(
        self,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        find_unused_parameters: bool = False,
        comm_hook: Optional[str] = None,
        broadcast_buffers: bool = True,
        **kwargs: Any,
    ) -> None:
        require(level_problems(DDPStrategy, type(self), locals()))
        super().__init__(**kwargs)
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.first_bucket_cap_mb = float(first_bucket_cap_mb)
        self.find_unused_parameters = find_unused_parameters
        self.comm_hook = comm_hook
        self.broadcast_buffers = broadcast_buffers
        self._has_buffers = False
        self._sync_buffers_next = True  # torch DDP's require_forward_param_sync

    @classmethod
    def own_option_problems(cls, values: Mapping[str, Any], prefix: str = "") -> list[Optional[str]]:
        """The checks of the arguments declared here (``strategies.options.option_problems`` reads them)."""
        return [
            positive_number(f"{prefix}bucket_cap_mb", values["bucket_cap_mb"], "megabytes", 25),
            positive_number(f"{prefix}first_bucket_cap_mb", values["first_bucket_cap_mb"], "megabytes", 1),
            one_of(f"{prefix}comm_hook", values["comm_hook"], COMM_HOOKS),
        ]

    def configure_parallelism(self) -> None:
        module = self.lightning_module
        broadcast_module_states(module, src=0, group=self.dp_group)
        self._has_buffers = any(True for _ in module.buffers())
        self._sync_buffers_next = True
        self.reducer = GradientReducer(
            list(module.named_parameters()),
            group=self.dp_group,
            bucket_cap_mb=self.bucket_cap_mb,
            first_bucket_cap_mb=self.first_bucket_cap_mb,
            find_unused_parameters=self.find_unused_parameters,
            comm_hook=self.comm_hook,
        )

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(super().training_step, *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(super().validation_step, *args, **kwargs)

    def _forward(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``step`` as torch DDP's forward would: buffers from rank 0 first when they are due (only
        while fitting: Lightning wraps the module in DDP for ``fit`` only, so test and predict, which
        never run inside ``fit``, are plain calls)."""
        module = self.lightning_module
        if module.trainer.state.fn != TrainerFn.FITTING:
            return step(*args, **kwargs)
        if self._sync_buffers_next and self.broadcast_buffers and self._has_buffers:
            broadcast_module_states(module, src=0, group=self.dp_group, buffers_only=True)
        output = step(*args, **kwargs)
        # torch DDP's _post_forward; under manual optimization Lightning turns the wrapper's gradient
        # sync off around the forward, so there only the first forward of a fit syncs
        self._sync_buffers_next = (
            torch.is_grad_enabled() and self._sync_grads and module.automatic_optimization
        )
        return output
