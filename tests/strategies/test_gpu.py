"""CUDA paths: skipped cleanly on machines without a GPU (CI has none)."""

import pytest
import torch

from tests.helpers.harness import max_param_diff

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.timeout(300)
def test_one_rank_nccl_bf16_matches_plain_single_gpu(tmp_path):
    """lp_ddp on 1 GPU (NCCL process group of one) trains like single-GPU Lightning in bf16, on the same
    samples: the reference strategy is single-device training with a distributed run's sampler (a plain
    run keeps the loader's own order, and its parameters were 0.03 away on an H100)."""
    from lightning.pytorch import Trainer, seed_everything

    import lightning_parallel
    from lightning_parallel.strategies import SingleDeviceReferenceStrategy
    from tests.helpers.models import MLP, RegressionData

    def fit(strategy):
        seed_everything(0)
        model = MLP()
        kwargs = dict(
            accelerator="gpu",
            devices=1,
            max_steps=5,
            precision="bf16-mixed",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            limit_val_batches=0,
        )
        Trainer(strategy=strategy, **kwargs).fit(
            model, datamodule=RegressionData(batch_size=16, dtype="float32")
        )
        return {k: v.float().cpu() for k, v in model.state_dict().items()}

    ours = fit(lightning_parallel.DDPStrategy(process_group_backend="nccl"))
    plain = fit(SingleDeviceReferenceStrategy(device="cuda:0"))
    assert max_param_diff(ours, plain) < 1e-3
