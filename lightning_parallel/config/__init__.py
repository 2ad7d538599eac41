"""Hydra structured-config schemas of ``lp-train`` and the checks run before any process starts."""

from lightning_parallel.config.schema import (
    CheckpointConf,
    DataParallelStrategyConf,
    DDPStrategyConf,
    LightningDDPStrategyConf,
    LPTrainConf,
    ParallelStrategyConf,
    PipelineParallelStrategyConf,
    StrategyConf,
    TensorParallelStrategyConf,
    TrainerConf,
)
from lightning_parallel.config.store import register_configs
from lightning_parallel.config.validate import ConfigError, problems, validate, world_size_of

__all__ = [
    "CheckpointConf",
    "ConfigError",
    "DDPStrategyConf",
    "DataParallelStrategyConf",
    "LPTrainConf",
    "LightningDDPStrategyConf",
    "PipelineParallelStrategyConf",
    "StrategyConf",
    "ParallelStrategyConf",
    "TensorParallelStrategyConf",
    "TrainerConf",
    "problems",
    "register_configs",
    "validate",
    "world_size_of",
]
