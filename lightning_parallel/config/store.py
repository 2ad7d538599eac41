"""Registration of the schemas in Hydra's ConfigStore; ``conf/`` YAML files extend these entries."""

from __future__ import annotations

import warnings

from hydra.core.config_store import ConfigStore

from lightning_parallel.config.schema import (
    AutoStrategyConf,
    DataParallelStrategyConf,
    DDPStrategyConf,
    LightningDDPStrategyConf,
    LPTrainConf,
    ParallelStrategyConf,
    PipelineParallelStrategyConf,
    TensorParallelStrategyConf,
    TrainerConf,
)

__all__ = ["register_configs", "quiet_schema_matching_warning", "SCHEMAS"]

# (group, name) -> schema; a YAML file in conf/<group>/ names its schema first in its defaults list. lp-train
# stores them here; the Hydra plugin (hydra_plugins/lightning_parallel_configs) serves the same classes as
# lp/<group>/<name>, where the same YAML files are the groups lp/strategy and lp/plan of any Hydra app
SCHEMAS = {
    (None, "lp_train_schema"): LPTrainConf,
    ("strategy", "lp_ddp_schema"): DDPStrategyConf,
    ("strategy", "lp_dp_schema"): DataParallelStrategyConf,
    ("strategy", "ddp_schema"): LightningDDPStrategyConf,
    ("strategy", "tensor_parallel_schema"): TensorParallelStrategyConf,
    ("strategy", "pipeline_schema"): PipelineParallelStrategyConf,
    ("strategy", "parallel_schema"): ParallelStrategyConf,
    ("strategy", "auto_schema"): AutoStrategyConf,
    ("trainer", "trainer_schema"): TrainerConf,
}


def quiet_schema_matching_warning() -> None:
    """conf/hydra/launcher/{basic,joblib,submitit_slurm}.yaml share their names with the launchers' own
    schemas on purpose (Hydra then validates them against those); Hydra 1.3 warns about that pairing."""
    warnings.filterwarnings(
        "ignore", message=r"(?s).*is validated against ConfigStore schema with the same name"
    )


def register_configs() -> None:
    """Idempotent: Hydra's ConfigStore replaces an entry stored twice."""
    quiet_schema_matching_warning()
    cs = ConfigStore.instance()
    for (group, name), node in SCHEMAS.items():
        cs.store(group=group, name=name, node=node)
