"""Structured-config schemas of ``lp-train``: what each config group may contain, and of which type.

They are registered in Hydra's ConfigStore (``register_configs``) and extended by the YAML files in
``conf/``, so Hydra itself rejects, while composing and before any process starts, an unknown key
(``strategy.bucket_cap=5``: not in ``DDPStrategyConf``) or a wrong type (``trainer.max_steps=abc``).
Combinations that no single field can judge (devices versus parallel sizes) are checked by
``lightning_parallel.config.validate``, also before any process starts.

Model and data configs are deliberately open (``_target_`` plus any keyword): they belong to the
user's classes, which are instantiated unmodified.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

__all__ = [
    "StrategyConf",
    "LPStrategyConf",
    "DDPStrategyConf",
    "DataParallelStrategyConf",
    "LightningDDPStrategyConf",
    "TensorParallelStrategyConf",
    "PipelineParallelStrategyConf",
    "TrainerConf",
    "CheckpointConf",
    "LPTrainConf",
]


@dataclass
class StrategyConf:
    """Process plumbing shared by every multi-process strategy (Lightning's ``DDPStrategy`` arguments)."""

    _target_: str = MISSING
    start_method: str = "popen"
    process_group_backend: Optional[str] = None


@dataclass
class LPStrategyConf(StrategyConf):
    """What every lightning_parallel strategy adds (``ParallelStrategyBase``)."""

    # a failing or hung rank stops its peers within this many seconds
    failure_timeout: float = 60.0


@dataclass
class DDPStrategyConf(LPStrategyConf):
    _target_: str = "lightning_parallel.DDPStrategy"
    bucket_cap_mb: float = 25.0
    first_bucket_cap_mb: float = 1.0
    find_unused_parameters: bool = False
    comm_hook: Optional[str] = None
    broadcast_buffers: bool = True


@dataclass
class DataParallelStrategyConf(LPStrategyConf):
    _target_: str = "lightning_parallel.DataParallelStrategy"


@dataclass
class LightningDDPStrategyConf(StrategyConf):
    """Lightning's built-in ``ddp`` (torch DDP), for comparison."""

    _target_: str = "lightning.pytorch.strategies.DDPStrategy"
    find_unused_parameters: bool = False
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    bucket_cap_mb: Optional[float] = None


@dataclass
class TensorParallelStrategyConf(LPStrategyConf):
    _target_: str = "lightning_parallel.TensorParallelStrategy"
    tensor_parallel_size: Optional[int] = None
    data_parallel_size: int = 1
    # "auto", a path to a plan YAML, or a mapping; by default the ``plan`` group's choice
    plan: Any = "${plan}"
    verify_plan: bool = False
    require_sharded: float = 0.2


@dataclass
class PipelineParallelStrategyConf(LPStrategyConf):
    _target_: str = "lightning_parallel.PipelineParallelStrategy"
    schedule: str = "1f1b"
    num_microbatches: int = 4
    pipeline_parallel_size: Optional[int] = None
    data_parallel_size: int = 1
    split_points: Optional[List[Any]] = None  # block names where stages start, or block counts per stage
    balance: str = "parameters"
    block_stack: Optional[str] = None
    timeline_step: Optional[int] = 2  # the step whose timeline (Chrome trace + SVG) is written


@dataclass
class TrainerConf:
    """The ``Trainer`` arguments ``lp-train`` exposes; anything else goes in ``trainer.extra``."""

    accelerator: str = "cpu"
    devices: Any = 2  # an int, "auto", or a list of device indices
    num_nodes: int = 1
    max_steps: int = -1
    max_epochs: Optional[int] = None
    precision: Any = "32-true"
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = None
    log_every_n_steps: int = 10
    val_check_interval: Optional[Any] = None
    check_val_every_n_epoch: Optional[int] = 1
    limit_train_batches: Optional[Any] = None
    limit_val_batches: Optional[Any] = None
    num_sanity_val_steps: int = 0
    enable_progress_bar: bool = False
    enable_model_summary: bool = True
    deterministic: Optional[bool] = None
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class CheckpointConf:
    enabled: bool = True
    save_last: bool = True
    every_n_train_steps: Optional[int] = None


@dataclass
class LPTrainConf:
    """The root of ``conf/config.yaml``."""

    strategy: Any = MISSING
    trainer: TrainerConf = field(default_factory=TrainerConf)
    model: Any = MISSING
    data: Any = MISSING
    # the ``plan`` group (tensor-parallel sharding plans); "auto" when none is chosen
    plan: Any = "auto"
    seed: int = 1234
    checkpoint: CheckpointConf = field(default_factory=CheckpointConf)
    ckpt_path: Optional[str] = None  # resume from this checkpoint
    progress_every_n_steps: int = 25
    summary_file: str = "summary.json"
