"""``schedule="async"`` (PipeDream-2BW) with ``virtual_stages`` chunks per rank in the looping placement
follows its rule W(t+1) = W(t) - lr * grad f_t(W(t-1)) on 2 real gloo processes: float64, against the rule
written out on one process, to 1e-10; at m = 2, v = 2 each step carries every backward of the batch before
(the most two weight versions allow); with 3 chunks; across epochs with mid-epoch validation and
checkpoints (drains and flushes), and resumed from a mid-epoch checkpoint; and in dp2 x pp2 on 4
processes. A layout that would need a third weight version is refused at set-up."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer

import lightning_parallel as lp
from tests.helpers.harness import assert_params_close, max_param_diff, run_distributed
from tests.strategies.test_pipeline import EPOCHS, SGD, case, check_rule_on_global_batch, emulation, reference

DEEP = {**SGD, "depth": 4}  # 7 blocks: enough for 2 stages x 3 chunks
CASES = [
    case("seq-async-v2-m4", "seq", schedule="async", virtual_stages=2, model_kwargs=DEEP),
    case("seq-async-v2-m2", "seq", schedule="async", virtual_stages=2, num_microbatches=2, model_kwargs=DEEP),
    case("seq-async-v3-m4", "seq", schedule="async", virtual_stages=3, model_kwargs=DEEP),
    {
        **EPOCHS,
        "name": "seq-async-v2-epochs",
        "model_kwargs": {**EPOCHS["model_kwargs"], **DEEP},
        "strategy": {**EPOCHS["strategy"], "kwargs": {**EPOCHS["strategy"]["kwargs"], "virtual_stages": 2}},
    },
]


def resumed(tmp) -> dict:
    """The epochs case again, resumed from its step-6 checkpoint (mid-epoch, a drained gradient pending)."""
    ckpt = tmp / "dist2" / "seq-async-v2-epochs" / "ckpts" / "epoch=1-step=6.ckpt"
    return {**CASES[-1], "name": "seq-async-v2-resume", "callbacks": [], "ckpt_path": str(ckpt)}


REPLICAS = case("seq-dp2-async-v2", "seq", dp=2, schedule="async", virtual_stages=2, model_kwargs=DEEP)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async_chunks")
    return tmp, run_distributed(CASES + [resumed(tmp)], world_size=2, tmp_path=tmp, timeout=600)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_async_with_looping_chunks_resumes_mid_epoch_on_its_rule(runs):
    tmp, results = runs
    c = resumed(tmp)
    emulated = emulation(CASES[-1], tmp, callbacks=[])
    full = torch.load(tmp / "dist2" / c["name"] / "last.ckpt", weights_only=False)["state_dict"]
    assert_params_close(full, emulated["state_dict"], atol=1e-10)
    losses = results[c["name"]][1]["losses"]  # steps 6..9 show batches 5..8
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(emulated["losses"][5:9]), atol=1e-10, rtol=0
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_async_with_looping_chunks_and_two_replicas_follows_the_rule_on_the_global_batch(tmp_path):
    """dp=2 x pp=2 with 2 chunks per rank: each replica's pipeline has its own channel groups' pairs, and
    the replicas average the stale gradient, so the update is the emulated rule's on the global batch."""
    results = run_distributed([REPLICAS], world_size=4, tmp_path=tmp_path, timeout=600)
    check_rule_on_global_batch(tmp_path, results, REPLICAS)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("c", CASES, ids=[c["name"] for c in CASES])
def test_async_with_looping_chunks_equals_an_emulation_of_its_rule(runs, c):
    tmp, results = runs
    first_rank = sorted(
        {int(k.split(".")[1]) for k in results[c["name"]][0]["state_dict"] if k.startswith("net.")}
    )
    assert first_rank != list(range(first_rank[0], first_rank[-1] + 1))  # looping: chunks apart in the model
    emulated = emulation(c, tmp, callbacks=[])
    full = torch.load(tmp / "dist2" / c["name"] / "last.ckpt", weights_only=False)["state_dict"]
    assert_params_close(full, emulated["state_dict"], atol=1e-10)
    steps = c["trainer"]["max_steps"]
    assert len(emulated["losses"]) == steps
    if "epochs" not in c["name"]:  # no flush before the last step: step t shows batch t-1's loss
        for rank in results[c["name"]]:
            torch.testing.assert_close(
                torch.tensor(rank["losses"][1:]), torch.tensor(emulated["losses"][:-1]), atol=1e-10, rtol=0
            )
    synchronous = reference(c, tmp)  # the rule really differs from plain SGD
    assert max_param_diff(full, synchronous["state_dict"]) > 1e-4


class _Module(LightningModule):
    pass


def test_async_chunks_that_would_need_a_third_weight_version_are_refused_at_set_up():
    """2 stages, 2 chunks, m = 1: rank 0 runs 4 chunk forwards ahead of its backwards, more than a batch's
    2, so batch t's backwards would outlive batch t + 1's forwards; refused when the Trainer is built."""
    with pytest.raises(ValueError, match=r"third weight version.*num_microbatches >= 2"):
        Trainer(
            strategy=lp.PipelineParallelStrategy(
                schedule="async", virtual_stages=2, num_microbatches=1, pipeline_parallel_size=2
            ),
            accelerator="cpu",
            devices=2,
            logger=False,
        )
    strategy = lp.PipelineParallelStrategy(
        schedule="async", virtual_stages=2, num_microbatches=2, pipeline_parallel_size=2
    )
    module = _Module()
    module.trainer = Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
    strategy._lightning_module = module
    strategy.check_schedule(2)  # m x v = 4 = the warm-up: two versions suffice
