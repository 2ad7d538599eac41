"""A user's own Hydra app (not lp-train) that uses ``Trainer(strategy="lp_ddp")``.

Under ``-m devices=2,1,2`` each job must get its own world size: the fix lives in the strategy's
launcher, so it holds outside lp-train too. Each job writes ``world.json`` into its folder.
"""

import json
import os
from dataclasses import dataclass

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch import Callback, Trainer

import lightning_parallel  # noqa: F401
from tests.helpers.user_project import RandomRegressionData, Regressor


@dataclass
class AppConf:
    devices: int = 2
    max_steps: int = 4


ConfigStore.instance().store(name="app", node=AppConf)


class WorldSize(Callback):
    def on_train_start(self, trainer, pl_module):
        import torch.distributed as dist

        self.world = dist.get_world_size() if dist.is_initialized() else 1
        # set by the launch when this process hosts the job's rendezvous store
        self.hosted_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        self.port = os.environ.get("MASTER_PORT")


@hydra.main(version_base="1.3", config_name="app")
def app(cfg: AppConf) -> None:
    world = WorldSize()
    trainer = Trainer(
        accelerator="cpu",
        devices=cfg.devices,
        strategy="lp_ddp",
        max_steps=cfg.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[world],
        enable_model_summary=False,
    )
    trainer.fit(Regressor(), datamodule=RandomRegressionData())
    if trainer.is_global_zero:
        out = HydraConfig.get().runtime.output_dir
        with open(f"{out}/world.json", "w") as f:
            json.dump(
                {
                    "devices": cfg.devices,
                    "world_size": world.world,
                    "hosted_store": world.hosted_store,
                    "port": world.port,
                },
                f,
            )


if __name__ == "__main__":
    app()
