"""Fit, then test the best checkpoint, in one Trainer; rank 0 writes results.json into the run's folder."""

import json
import math
from pathlib import Path

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="configs", config_name="train.yaml")
def main(cfg: DictConfig) -> None:
    L.seed_everything(cfg.seed, workers=True)
    datamodule = hydra.utils.instantiate(cfg.data)
    model = hydra.utils.instantiate(cfg.model)
    callbacks = [hydra.utils.instantiate(cb) for cb in cfg.callbacks.values()]
    trainer = hydra.utils.instantiate(cfg.trainer, callbacks=callbacks)

    trainer.fit(model=model, datamodule=datamodule)
    train_metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    ckpt_path = trainer.checkpoint_callback.best_model_path or None
    # the network is pickled into the hyperparameters: not loadable with torch.load's weights_only default
    trainer.test(model=model, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=False)
    test_metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("test/")}

    if trainer.is_global_zero:
        results = {
            "strategy": type(trainer.strategy).__name__,
            "world_size": trainer.world_size,
            "batch_size_per_device": datamodule.batch_size_per_device,
            "global_step": trainer.global_step,
            "best_model_path": ckpt_path,
            "train": {k: v for k, v in train_metrics.items() if not math.isnan(v)},
            "test": test_metrics,
        }
        Path(HydraConfig.get().runtime.output_dir, "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
