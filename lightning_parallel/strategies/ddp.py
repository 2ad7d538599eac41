"""``lp_ddp``: data parallelism with our own gradient buckets and all-reduce overlapped with backward.

Every rank holds the whole model and a slice of the global batch. Replicas start identical (rank 0's
parameters and buffers are broadcast at set-up) and stay identical because every rank applies the
same averaged gradient. The gradient work is done by ``distributed.reducer.GradientReducer``; this
file only wires it into Lightning's hooks.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_parallel.distributed.reducer import COMM_HOOKS, GradientReducer
from lightning_parallel.distributed.state import broadcast_module_states
from lightning_parallel.strategies.base import ParallelStrategyBase

__all__ = ["DDPStrategy"]


class DDPStrategy(ParallelStrategyBase):
    """Distributed data parallel, implemented on ``torch.distributed`` collectives.

    Args:
        bucket_cap_mb: size of a gradient bucket (torch DDP's default, 25 MB).
        first_bucket_cap_mb: the first bucket is small so communication starts early in backward.
        find_unused_parameters: allow parameters that get no gradient in a step.
        comm_hook: ``None``, ``"fp16"`` or ``"bf16"``: compress gradients on the wire.
        broadcast_buffers: copy rank 0's buffers (e.g. BatchNorm statistics) before every forward.
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
        if not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be a positive number of megabytes, got {bucket_cap_mb!r} (default 25).")
        if not isinstance(first_bucket_cap_mb, (int, float)) or first_bucket_cap_mb <= 0:
            raise ValueError(f"first_bucket_cap_mb must be a positive number of megabytes, got {first_bucket_cap_mb!r} (default 1).")
        if comm_hook not in COMM_HOOKS:
            raise ValueError(f"comm_hook={comm_hook!r} is not supported; use None, 'fp16' or 'bf16'.")
        super().__init__(**kwargs)
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.first_bucket_cap_mb = float(first_bucket_cap_mb)
        self.find_unused_parameters = find_unused_parameters
        self.comm_hook = comm_hook
        self.broadcast_buffers = broadcast_buffers
        self._has_buffers = False

    def configure_parallelism(self) -> None:
        module = self.lightning_module
        broadcast_module_states(module, src=0, group=self.dp_group)
        self._has_buffers = any(True for _ in module.buffers())
        self.reducer = GradientReducer(
            list(module.named_parameters()),
            group=self.dp_group,
            bucket_cap_mb=self.bucket_cap_mb,
            first_bucket_cap_mb=self.first_bucket_cap_mb,
            find_unused_parameters=self.find_unused_parameters,
            comm_hook=self.comm_hook,
        )

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers and self.reducer is not None and self._has_buffers:
            broadcast_module_states(self.lightning_module, src=0, group=self.dp_group, buffers_only=True)
        return super().training_step(*args, **kwargs)
