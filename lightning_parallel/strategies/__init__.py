"""Lightning strategies: thin wiring of the pieces in ``distributed/``, ``tensor/`` and ``pipeline/``."""

from lightning_parallel.strategies.base import ParallelStrategyBase
from lightning_parallel.strategies.ddp import DDPStrategy
from lightning_parallel.strategies.dp import DataParallelStrategy
from lightning_parallel.strategies.parallel import ParallelStrategy
from lightning_parallel.strategies.pipeline import PipelineParallelStrategy
from lightning_parallel.strategies.reference import SingleDeviceReferenceStrategy
from lightning_parallel.strategies.tensor_parallel import TensorParallelStrategy

__all__ = [
    "ParallelStrategyBase",
    "DDPStrategy",
    "DataParallelStrategy",
    "SingleDeviceReferenceStrategy",
    "ParallelStrategy",
    "TensorParallelStrategy",
    "PipelineParallelStrategy",
]
