"""Data, tensor and pipeline parallel strategies for PyTorch Lightning.

``import lightning_parallel`` registers the strategy names (``lp_ddp``, ``lp_dp``, ...) so that
``Trainer(strategy="lp_ddp")`` works; the classes can be used directly too.
"""

from lightning_parallel.memory import MemoryReport
from lightning_parallel.registry import STRATEGY_NAMES, register_strategies
from lightning_parallel.strategies import (
    DataParallelStrategy,
    DDPStrategy,
    ParallelStrategy,
    ParallelStrategyBase,
    PipelineParallelStrategy,
    TensorParallelStrategy,
)
from lightning_parallel.strategies.global_batch import data_parallel_size

__version__ = "0.1.0"
__all__ = [
    "DDPStrategy",
    "DataParallelStrategy",
    "MemoryReport",
    "ParallelStrategy",
    "ParallelStrategyBase",
    "PipelineParallelStrategy",
    "STRATEGY_NAMES",
    "TensorParallelStrategy",
    "__version__",
    "data_parallel_size",
]

register_strategies()
