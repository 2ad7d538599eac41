"""``lp_pipeline_gpipe`` / ``_1f1b`` / ``_async``: pipeline parallelism with micro-batches for unmodified
LightningModules, optionally combined with data parallelism (``data_parallel_size`` x stages).

It is ``ParallelStrategy`` without tensor parallelism; how a pipelined step runs is in
``pipeline_stages.py``, the async schedule's rule in ``pipeline_async.py``. Checkpoints hold the full
model under the original names (gathered from the stages), so they load into the plain module, and a
network held in the hyperparameters whole; a full checkpoint loads into any number of stages, as strictly
as on one device. With ``save_distributed=True`` each stage writes only its own tensors
(``checkpointing.sharded``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from lightning_parallel.strategies.parallel import ParallelStrategy

__all__ = ["PipelineParallelStrategy"]


class PipelineParallelStrategy(ParallelStrategy):
    """Pipeline parallelism (and 2-D with data parallelism): ``ParallelStrategy`` with one tensor-parallel rank.

    Args:
        schedule: ``"gpipe"`` (fill-drain), ``"1f1b"`` (one-forward-one-backward, flush each step),
            ``"interleaved_1f1b"`` (Megatron's interleaved 1F1B over ``virtual_stages`` chunks per rank),
            ``"zb_h1"`` (zero bubble: 1F1B with the weight gradients deferred into its bubble), ``"zbv"``
            (zero bubble over two chunks per rank in a V; rank 0 runs the loss), or
            ``"async"`` (PipeDream-2BW's update rule).
        virtual_stages: chunks per rank for ``"interleaved_1f1b"`` (None: 2) and ``"async"`` (None: 1).
        pipeline_parallel_size: number of stages; None = all processes / data_parallel_size.
        data_parallel_size: replicas of the whole pipeline, each with its own batches.
        num_microbatches, split_points, balance, block_stack, timeline_step: as for ``ParallelStrategy``.
        **kwargs: process plumbing, as for Lightning's ``DDPStrategy``.
    """

    strategy_name = "lp_pipeline"
    popen_only = "Lightning's spawn launcher hands back only rank 0's stage"
    size_options = {"data_parallel_size": "dp", "pipeline_parallel_size": "pp"}
    nullable_sizes = ("pipeline_parallel_size",)
    always_applied = ("pp",)
    hidden_options = ParallelStrategy.tensor_options + ParallelStrategy.expert_options

    def __init__(
        self,
        schedule: str = "gpipe",
        virtual_stages: Optional[int] = None,
        num_microbatches: int = 4,
        pipeline_parallel_size: Optional[int] = None,
        data_parallel_size: int = 1,
        split_points: Optional[Sequence[Union[str, int]]] = None,
        balance: str = "parameters",
        block_stack: Optional[str] = None,
        timeline_step: Optional[int] = 2,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=1,
            pipeline_parallel_size=pipeline_parallel_size,
            plan=None,
            schedule=schedule,
            virtual_stages=virtual_stages,
            num_microbatches=num_microbatches,
            split_points=split_points,
            balance=balance,
            block_stack=block_stack,
            timeline_step=timeline_step,
            **kwargs,
        )
