"""``lp_tensor_parallel``: Megatron-style tensor parallelism for unmodified LightningModules, optionally
combined with data parallelism (2-D: ``data_parallel_size`` x ``tensor_parallel_size`` processes).

It is ``ParallelStrategy`` without pipeline stages: at set-up the module's layers are rewritten in place
following a sharding plan (``plan="auto"``, a dict or a YAML file; see ``lightning_parallel.tensor.plan``),
validated first on the unsharded module. The ranks of a tensor-parallel group see the same batches (the
sampler runs over the data-parallel group); with ``data_parallel_size > 1`` the gradient reducer averages
over the data-parallel group. Gradient clipping by norm uses the global norm over the shards, and
checkpoints hold full, unsharded tensors under the original names, so they load into the plain module and
into any tensor-parallel size; with ``save_distributed=True`` each rank writes only its shards
(``checkpointing.sharded``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional, Union

from lightning_parallel.strategies.parallel import ParallelStrategy
from lightning_parallel.strategies.plan_verification import PlanVerificationError
from lightning_parallel.tensor import Plan

__all__ = ["TensorParallelStrategy", "PlanVerificationError"]


class TensorParallelStrategy(ParallelStrategy):
    """Tensor parallelism (and 2-D with data parallelism): ``ParallelStrategy`` with one pipeline stage.

    Args:
        tensor_parallel_size: processes that split each sharded layer; None = all processes / dp.
        data_parallel_size: replicas of the tensor-parallel group, each with its own batches.
        plan, verify_plan, require_sharded: as for ``ParallelStrategy``.
        **kwargs: ``sequence_parallel`` (as for ``ParallelStrategy``), and process plumbing, as for
            Lightning's ``DDPStrategy``.
    """

    strategy_name = "lp_tensor_parallel"
    popen_only = "Lightning's spawn launcher hands rank 0's (sharded) weights back"
    size_options = {"data_parallel_size": "dp", "tensor_parallel_size": "tp"}
    nullable_sizes = ("tensor_parallel_size",)
    always_applied = ("tp",)
    evaluates_split = False  # validate/test/predict without a fit run the module whole
    hidden_options = ParallelStrategy.pipeline_options

    def __init__(
        self,
        tensor_parallel_size: Optional[int] = None,
        data_parallel_size: int = 1,
        plan: Union[str, Path, Mapping[str, Any], Plan] = "auto",
        verify_plan: bool = False,
        require_sharded: float = 0.2,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=1,
            plan=plan,
            verify_plan=verify_plan,
            require_sharded=require_sharded,
            **kwargs,
        )
