"""A non-finite loss: by default training goes on as under Lightning's ddp; ``check_finite_loss=True``
raises, naming step, batch and rank, without making the host wait for a GPU."""

import pytest
import torch

from lightning_parallel.checkpointing.loss_check import FiniteLossCheck, NonFiniteLossError
from tests.helpers.harness import run_distributed


def nan_case(name, strategy):
    return {
        "name": name,
        "model": "tests.helpers.models:NaNLossMLP",
        "model_kwargs": {"nan_step": 2, "nan_rank": 1},
        "data": "tests.helpers.models:RegressionData",
        "strategy": strategy,
        "data_kwargs": {"global_batch_size": 16},
        "trainer": {"precision": "64-true", "max_steps": 4},
    }


@pytest.mark.timeout(300)
def test_by_default_training_goes_on_as_under_lightning_ddp(tmp_path):
    results = run_distributed(
        [nan_case("lp_ddp", "lp_ddp"), nan_case("ddp", "ddp")], world_size=2, tmp_path=tmp_path
    )
    for rank in (0, 1):
        ours, theirs = results["lp_ddp"][rank], results["ddp"][rank]
        assert len(ours["losses"]) == len(theirs["losses"]) == 4  # every step ran, after the NaN too
        for key, value in theirs["state_dict"].items():
            torch.testing.assert_close(ours["state_dict"][key], value, equal_nan=True, atol=1e-10, rtol=0)
        assert any(v.isnan().any() for v in ours["state_dict"].values())  # the NaN did reach the weights


def test_a_cpu_loss_is_checked_at_once_naming_where():
    check = FiniteLossCheck()
    check.observe(torch.tensor(1.0), global_step=2, batch_idx=2, rank=1)
    with pytest.raises(
        NonFiniteLossError, match=r"\(inf\) at global step 3, batch 5, on rank 1; stopped before"
    ):
        check.observe(torch.tensor(float("inf")), global_step=3, batch_idx=5, rank=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_gpu_loss_is_read_without_a_device_sync():
    check = FiniteLossCheck()
    try:
        with pytest.raises(NonFiniteLossError, match=r"\(nan\) at global step 1, batch 1, on rank 0; read"):
            torch.cuda.set_sync_debug_mode("error")  # a synchronising call in observe() raises
            for step in range(3):
                loss = torch.randn(64, device="cuda").pow(2).mean()
                if step == 1:
                    loss = loss * float("nan")
                check.observe(loss, global_step=step, batch_idx=step, rank=0)
            torch.cuda.set_sync_debug_mode(0)
            check.poll(wait=True)  # the end of training waits for what is left
    finally:
        torch.cuda.set_sync_debug_mode(0)
