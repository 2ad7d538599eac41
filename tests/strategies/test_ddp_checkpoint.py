"""A checkpoint written under lp_ddp (2 processes) is a plain Lightning checkpoint: it loads into a
single-device Trainer, which resumes training from it, and into ``load_from_checkpoint``."""

import pytest
import torch
from lightning.pytorch import Trainer

from tests.helpers.harness import assert_params_close, run_distributed
from tests.helpers.models import MLP, RegressionData


@pytest.mark.timeout(300)
def test_lp_ddp_checkpoint_resumes_on_one_device(tmp_path):
    case = {
        "name": "ckpt",
        "model": "tests.helpers.models:MLP",
        "data": "tests.helpers.models:RegressionData",
        "strategy": "lp_ddp",
        "data_kwargs": {"global_batch_size": 16},
        "model_kwargs": {"momentum": 0.9},
        "trainer": {"precision": "64-true", "max_steps": 5},
        "save_checkpoint": True,
    }
    results = run_distributed([case], world_size=2, tmp_path=tmp_path)
    ckpt_path = tmp_path / "dist2" / "ckpt" / "last.ckpt"
    ckpt = torch.load(ckpt_path, weights_only=False)
    assert ckpt["global_step"] == 5
    assert ckpt["optimizer_states"][0]["state"], "momentum buffers must be in the checkpoint"
    assert_params_close(ckpt["state_dict"], results["ckpt"][0]["state_dict"], atol=0)

    loaded = MLP.load_from_checkpoint(ckpt_path)  # a float32 module: the float64 values arrive rounded
    assert_params_close(loaded.state_dict(), results["ckpt"][0]["state_dict"], atol=1e-7)

    model = MLP(momentum=0.9)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=8,
        precision="64-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule=RegressionData(batch_size=16), ckpt_path=ckpt_path)
    assert trainer.global_step == 8
    moved = max(
        (model.state_dict()[k] - ckpt["state_dict"][k]).abs().max().item() for k in ckpt["state_dict"]
    )
    assert moved > 1e-4, "training continued from the checkpoint"
