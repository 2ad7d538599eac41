"""Structured-config schemas of ``lp-train``: what each config group may contain, and of which type.

They are registered in Hydra's ConfigStore (``register_configs``) and extended by the YAML files in
``conf/``, so Hydra itself rejects, while composing and before any process starts, an unknown key
(``strategy.bucket_cap=5``: not in ``DDPStrategyConf``) or a wrong type (``trainer.max_steps=abc``).
Combinations that no single field can judge (devices versus parallel sizes) are checked by
``lightning_parallel.config.validate``, also before any process starts.

The schemas of lightning_parallel's strategies are generated from their constructors
(``strategy_schema``), which declare each option once: name, type, default. A config-side default (the
tensor-parallel ``plan`` follows the ``plan`` group) is the only thing written here.

Model and data configs are deliberately open (``_target_`` plus any keyword): they belong to the
user's classes, which are instantiated unmodified.
"""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from typing import Any, Dict, Literal, Optional, Union, get_args, get_origin

from omegaconf import MISSING

from lightning_parallel.strategies import (
    DataParallelStrategy,
    DDPStrategy,
    ParallelStrategy,
    PipelineParallelStrategy,
    TensorParallelStrategy,
)
from lightning_parallel.strategies.options import options

__all__ = [
    "StrategyConf",
    "hydra_type",
    "strategy_schema",
    "DDPStrategyConf",
    "DataParallelStrategyConf",
    "LightningDDPStrategyConf",
    "TensorParallelStrategyConf",
    "PipelineParallelStrategyConf",
    "ParallelStrategyConf",
    "TrainerConf",
    "CheckpointConf",
    "PlannerConf",
    "AutoStrategyConf",
    "LPTrainConf",
]


@dataclass
class StrategyConf:
    """Process plumbing shared by every multi-process strategy (Lightning's ``DDPStrategy`` arguments)."""

    _target_: str = MISSING
    start_method: str = "popen"
    process_group_backend: Optional[str] = None


_SIMPLE = (bool, int, float, str)


def hydra_type(hint: Any) -> Any:
    """The closest type that OmegaConf holds and checks: bool/int/float/str, Optional of one of them, str
    for a Literal of strings; Any for the rest (unions, paths, mappings, sequences, objects)."""
    if hint in _SIMPLE:
        return hint
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal and all(isinstance(a, str) for a in args):
        return str
    rest = [a for a in args if a is not type(None)]
    if origin is Union and len(rest) == 1 and len(args) == 2 and rest[0] in _SIMPLE:
        return Optional[rest[0]]
    return Any


def strategy_schema(cls: type, **config_defaults: Any) -> type:
    """The structured config of strategy ``cls``: ``_target_`` and every option of its constructor, at the
    constructor's default unless ``config_defaults`` gives a config-side value (an interpolation)."""
    fields = [("_target_", str, field(default=f"lightning_parallel.{cls.__name__}"))]
    fields += [
        (o.name, hydra_type(o.hint), field(default=config_defaults.get(o.name, o.default)))
        for o in options(cls)
    ]
    schema = make_dataclass(f"{cls.__name__}Conf", fields)
    schema.__module__ = __name__
    schema.__doc__ = f"The options of ``lightning_parallel.{cls.__name__}``, generated from its constructor."
    return schema


DDPStrategyConf = strategy_schema(DDPStrategy)
DataParallelStrategyConf = strategy_schema(DataParallelStrategy)
# "auto", a path to a plan YAML, or a mapping. By default the ``plan`` beside the strategy's node: lp-train's
# ``plan`` group at the root ("auto" when none is chosen); "auto" in an app that composes ``lp/strategy``
# into ``trainer.strategy`` (its plan comes as ``+lp/plan@trainer.strategy.plan=<name>``)
TensorParallelStrategyConf = strategy_schema(TensorParallelStrategy, plan="${oc.select:..plan,auto}")
PipelineParallelStrategyConf = strategy_schema(PipelineParallelStrategy)
ParallelStrategyConf = strategy_schema(ParallelStrategy, plan="${oc.select:..plan,auto}")




def _auto_strategy_schema() -> type:
    """``strategy=auto``: the layout options the planner chooses (``ParallelStrategy.layout_options``), each
    None (the planner chooses) or a value the user fixes (only layouts with it are planned); typed as
    ``ParallelStrategy``'s constructor types them."""
    hints = {o.name: hydra_type(o.hint) for o in options(ParallelStrategy)}
    fields = [(name, Optional[hints[name]], field(default=None)) for name in ParallelStrategy.layout_options]
    schema = make_dataclass("AutoStrategyConf", fields)
    schema.__module__ = __name__
    schema.__doc__ = _auto_strategy_schema.__doc__
    return schema


AutoStrategyConf = _auto_strategy_schema()


@dataclass
class PlannerConf:
    """How ``strategy=auto`` plans (docs/planner.md); read only under ``strategy=auto``."""

    rank: int = 1  # the planned layout trained: 1 = the predicted fastest
    top_k: int = 1  # under -m: one job for each of the k fastest (planner.rank=1..k)
    cluster: Optional[str] = None  # a shipped cluster or a YAML (a calibration's); None: this machine
    calibrate: bool = False  # time the collectives over trainer.devices processes here before planning
    memory_gb: Optional[float] = None  # memory per device; None: the cluster's
    global_batch: Optional[int] = None  # samples per step over all replicas; None: data.batch_size x world
    repeats: int = 2  # timings per block (the median is kept)
    show: int = 5  # rows of the ranked table printed


@dataclass
class LightningDDPStrategyConf(StrategyConf):
    """Lightning's built-in ``ddp`` (torch DDP), for comparison."""

    _target_: str = "lightning.pytorch.strategies.DDPStrategy"
    find_unused_parameters: bool = False
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    bucket_cap_mb: Optional[float] = None


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
    enable_progress_bar: Optional[bool] = (
        None  # None: a progress bar on a terminal, a line every N steps elsewhere
    )
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
    planner: PlannerConf = field(default_factory=PlannerConf)
    ckpt_path: Optional[str] = None  # resume from this checkpoint
    # fit(weights_only=...) for ckpt_path (Lightning >= 2.6): true for a checkpoint you did not write
    weights_only: Optional[bool] = None
    progress_every_n_steps: int = 25
    summary_file: str = "summary.json"
