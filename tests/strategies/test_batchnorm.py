"""BatchNorm under the strategies, on 2 real gloo processes in float64, in a template-style project
(``tests/helpers/bn_project.py``: the network is passed into the LightningModule and saved in its
hyperparameters).

- ``lp_ddp`` copies rank 0's buffers before the forwards where torch DDP under Lightning's ``ddp``
  does, validation during ``fit`` included: every rank's validation losses, the logged metrics and the
  final parameters and buffers equal Lightning's ``ddp``.
"""

import pytest

from tests.helpers.harness import assert_params_close, max_param_diff, run_distributed

MODEL = "tests.helpers.bn_project:bn_classifier"
DATA = "tests.helpers.bn_project:ClassificationData"
WITH_VALIDATION = {
    "precision": "64-true",
    "max_epochs": 2,
    "limit_val_batches": 1.0,
    "num_sanity_val_steps": 2,
}
CHECKPOINT = {
    "class": "lightning.pytorch.callbacks:ModelCheckpoint",
    "kwargs": {"dirpath": "ckpt", "monitor": "val/loss", "save_top_k": 1, "save_last": True},
}


def case(name, strategy, trainer=None, dp_size=None, **extra):
    c = {
        "name": name,
        "model": MODEL,
        "data": DATA,
        "strategy": strategy,
        "data_kwargs": {"global_batch_size": 16},
        "trainer": {**WITH_VALIDATION, **(trainer or {})},
        **extra,
    }
    if dp_size is not None:
        c["dp_size"] = dp_size
    return c


# ---------------------------------------------------------------------------------------------------
# lp_ddp's buffers during validation equal Lightning ddp's
# ---------------------------------------------------------------------------------------------------
RECORD = "tests.helpers.bn_project:validation_record"
NO_BROADCAST = {"class": "lightning_parallel:DDPStrategy", "kwargs": {"broadcast_buffers": False}}


@pytest.fixture(scope="module")
def versus_ddp(tmp_path_factory):
    cases = [
        case("lp_ddp", "lp_ddp", probe=RECORD),
        case("ddp", "ddp", probe=RECORD),
        case("lp_ddp-manual", "lp_ddp", model_kwargs={"manual": True}, probe=RECORD),
        case("ddp-manual", "ddp", model_kwargs={"manual": True}, probe=RECORD),
        case("lp_ddp-no-broadcast", NO_BROADCAST, probe=RECORD),
    ]
    return run_distributed(cases, world_size=2, tmp_path=tmp_path_factory.mktemp("bn_ddp"))


def _assert_same_run(ours, theirs):
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        va, vb = a["probe"]["val_losses"], b["probe"]["val_losses"]
        assert len(va) == len(vb) > 8, (len(va), len(vb))  # sanity check + 2 epochs of validation
        diff = max(abs(x - y) for x, y in zip(va, vb))
        assert diff <= 1e-9, f"rank {rank}: validation losses differ from ddp's by {diff:.3e}"
        for key in ("val/loss", "val/acc"):
            assert abs(a["metrics"][key] - b["metrics"][key]) <= 1e-9, (rank, key, a["metrics"], b["metrics"])
        assert_params_close(a["state_dict"], b["state_dict"], atol=1e-10)  # buffers are in the state dict


@pytest.mark.timeout(400)
def test_validation_during_fit_equals_lightning_ddp(versus_ddp):
    _assert_same_run(versus_ddp["lp_ddp"], versus_ddp["ddp"])
    # ddp copies rank 0's statistics before validation: every rank ends with rank 0's buffers
    ranks = versus_ddp["ddp"]
    assert max_param_diff(ranks[0]["probe"]["buffers"], ranks[1]["probe"]["buffers"]) == 0


@pytest.mark.timeout(400)
def test_manual_optimization_syncs_buffers_where_ddp_does(versus_ddp):
    """Lightning turns torch DDP's gradient sync off around a manual-optimization forward, so torch syncs
    buffers before the first forward only; lp_ddp does the same (the ranks' statistics then differ)."""
    _assert_same_run(versus_ddp["lp_ddp-manual"], versus_ddp["ddp-manual"])
    ranks = versus_ddp["ddp-manual"]
    assert max_param_diff(ranks[0]["probe"]["buffers"], ranks[1]["probe"]["buffers"]) > 1e-3


@pytest.mark.timeout(400)
def test_without_the_broadcast_rank_1_validates_with_its_own_statistics(versus_ddp):
    """What the comparison above tells apart: rank 1's BatchNorm statistics are its own half-batch's."""
    ours, theirs = versus_ddp["lp_ddp-no-broadcast"], versus_ddp["ddp"]
    rank0 = [abs(x - y) for x, y in zip(ours[0]["probe"]["val_losses"], theirs[0]["probe"]["val_losses"])]
    rank1 = [abs(x - y) for x, y in zip(ours[1]["probe"]["val_losses"], theirs[1]["probe"]["val_losses"])]
    assert max(rank0) <= 1e-9 and max(rank1) > 1e-4, (max(rank0), max(rank1))
