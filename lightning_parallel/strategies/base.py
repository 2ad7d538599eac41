"""What every lightning_parallel strategy shares: processes, the rank mesh, and Lightning's contract.

We inherit Lightning's own ``DDPStrategy`` for the process plumbing only (launchers, cluster
environments, process-group creation, barrier/broadcast). Two reasons: the Trainer recognises it as a
distributed strategy by ``isinstance`` (distributed sampler, ``sync_dist`` logging), and torchrun/SLURM
detection is already right there. Everything it does with ``torch.nn.parallel.DistributedDataParallel``
is replaced: ``configure_ddp`` never wraps the module; subclasses install their own parallelism in
``configure_parallelism``.

What the base adds on top:
- a (dp, pp, tp) mesh built right after the default process group (``mesh_shape`` is the subclass's);
- samplers, ``self.log(sync_dist=True)`` and torchmetrics reduce over the data-parallel group, so
  model-parallel peers that hold the same batch are not counted twice;
- an optional ``GradientReducer`` driven by the backward hooks and by ``block_backward_sync``;
- exact resume (``resume.ExactResumeMixin``: data position and RNG in the checkpoint) and checkpoint
  files written atomically (``checkpoint.AtomicCheckpointIO``, the default CheckpointIO).
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Generator, Literal, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies import DDPStrategy as _LightningDDPStrategy
from torch import Tensor

import lightning.pytorch as pl
from lightning_parallel.checkpoint import AtomicCheckpointIO
from lightning_parallel.distributed.mesh import Mesh, MeshShape, build_mesh
from lightning_parallel.distributed.reducer import GradientReducer
from lightning_parallel.distributed.sync_batchnorm import SyncBatchNormPlugin
from lightning_parallel.resume import ExactResumeMixin

__all__ = ["ParallelStrategyBase"]


class ParallelStrategyBase(ExactResumeMixin, _LightningDDPStrategy):
    """Base of all lightning_parallel strategies; not registered itself."""

    def __init__(
        self,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(
                f"start_method={start_method!r} is not supported; use 'popen' (default), 'spawn', 'fork' or "
                "'forkserver'."
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io if checkpoint_io is not None else AtomicCheckpointIO(),
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.mesh: Optional[Mesh] = None
        self.reducer: Optional[GradientReducer] = None

    # ----------------------------------------------------------------- layout
    def mesh_shape(self) -> MeshShape:
        """The (dp, pp, tp) layout of this strategy; pure data data-parallel by default."""
        return MeshShape(dp=self.world_size)

    def setup_distributed(self) -> None:
        super().setup_distributed()
        self.mesh = build_mesh(self.mesh_shape())

    @property
    def dp_group(self) -> Optional[torch.distributed.ProcessGroup]:
        """The data-parallel group (None = the whole world)."""
        return self.mesh.group("dp") if self.mesh is not None else None

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        shape = self.mesh_shape()
        dp_rank = shape.coordinates(self.global_rank)[0]
        return {"num_replicas": shape.dp, "rank": dp_rank}

    # ----------------------------------------------------------------- Lightning hooks
    def setup(self, trainer: "pl.Trainer") -> None:
        if self._layer_sync is not None and not isinstance(self._layer_sync, SyncBatchNormPlugin):
            # Trainer(sync_batchnorm=True): torch's SyncBatchNorm refuses CPU and syncs over WORLD
            self._layer_sync = SyncBatchNormPlugin(self.dp_group)
        super().setup(trainer)

    def configure_ddp(self) -> None:
        """Called by Lightning's ``DDPStrategy.setup`` while fitting: install our parallelism instead."""
        self.configure_parallelism()
        self._bind_metrics_to_dp_group()

    def configure_parallelism(self) -> None:
        """Subclasses rewrite the module and create ``self.reducer`` here."""

    def _bind_metrics_to_dp_group(self) -> None:
        from torchmetrics import Metric

        if self.mesh is None or self.mesh.shape.dp == self.world_size:
            return
        for module in self.lightning_module.modules():
            if isinstance(module, Metric):
                module.process_group = self.dp_group

    def reduce(
        self, tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Tensor:
        """``self.log(sync_dist=True)`` lands here: reduce over the data-parallel group by default."""
        if not isinstance(tensor, Tensor):
            return tensor
        if group is None and self.mesh is not None and self.mesh.shape.dp != self.world_size:
            group = self.dp_group
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @contextmanager
    def block_backward_sync(self) -> Generator:
        """Lightning wraps accumulating micro-steps in this: keep gradients local until the last one."""
        if self.reducer is None:
            yield None
            return
        previous = self.reducer.sync_enabled
        self.reducer.sync_enabled = False
        try:
            yield None
        finally:
            self.reducer.sync_enabled = previous

    def pre_backward(self, closure_loss: Tensor) -> None:
        if self.reducer is not None:
            self.reducer.prepare_for_backward()

    def post_backward(self, closure_loss: Tensor) -> None:
        if self.reducer is not None:
            self.reducer.finish_sync()

    def teardown(self) -> None:
        if self.reducer is not None:  # kept (without hooks) so its stats can be read after fit
            self.reducer.remove_hooks()
        super().teardown()
