"""BatchNorm under the strategies, on 2 real gloo processes in float64, in a template-style project
(``tests/helpers/bn_project.py``: the network is passed into the LightningModule and saved in its
hyperparameters).

- ``lp_ddp`` copies rank 0's buffers before the forwards where torch DDP under Lightning's ``ddp``
  does, validation during ``fit`` included: every rank's validation losses, the logged metrics and the
  final parameters and buffers equal Lightning's ``ddp``.
- ``sync_batchnorm=True`` runs fit -> ModelCheckpoint -> test / validate / predict in one Trainer under
  every strategy; the checkpoint holds the user's BatchNorm layers (no process group); data parallel
  equals one device on the global batch, and every strategy's test equals the checkpoint's model
  evaluated on one process.
- On 4 processes (dp=2 x tp=2, dp=2 x 2 stages) the statistics are reduced over the data-parallel
  replicas only: equal to one device on the global batch.
"""

import pickle

import pytest
import torch

from tests.helpers.harness import assert_params_close, max_param_diff, run_distributed, run_single

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
#: the parameters sharded too (each Linear and BatchNorm of the network a unit), the buffers whole
ZERO3 = {"class": "lightning_parallel:DDPStrategy", "kwargs": {"zero_stage": 3}}


@pytest.fixture(scope="module")
def versus_ddp(tmp_path_factory):
    # validate after fit too: outside fit neither copies buffers (the module is broadcast at set-up)
    after = {"probe": RECORD, "validate_after_fit": True}
    cases = [
        case("lp_ddp", "lp_ddp", **after),
        case("ddp", "ddp", **after),
        # no validate after fit here: its set-up broadcast would hide the ranks' differing statistics
        case("lp_ddp-manual", "lp_ddp", model_kwargs={"manual": True}, probe=RECORD),
        case("ddp-manual", "ddp", model_kwargs={"manual": True}, probe=RECORD),
        case("lp_ddp-no-broadcast", NO_BROADCAST, **after),
        case("lp_ddp-zero3", ZERO3, **after),
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
def test_zero_3_validation_during_fit_equals_lightning_ddp(versus_ddp):
    """zero_stage=3 on a network we did not write (BatchNorm between Linears, built outside the
    LightningModule): the same validation losses, metrics, parameters and buffers as Lightning's ddp."""
    _assert_same_run(versus_ddp["lp_ddp-zero3"], versus_ddp["ddp"])


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


# ---------------------------------------------------------------------------------------------------
# sync_batchnorm=True: fit -> checkpoint -> test / validate / predict, under every strategy
# ---------------------------------------------------------------------------------------------------
AFTER_FIT = "tests.helpers.bn_project:evaluate_after_fit"
TP = {
    "class": "lightning_parallel:TensorParallelStrategy",
    "kwargs": {
        "tensor_parallel_size": 2,
        # BatchNorm sits between the Linears: the written plan splits the two Linears after which the
        # features are whole again (their input rows), so BatchNorm stays replicated
        "plan": {
            "layers": {
                "net.model.3": {"style": "rowwise", "input_is_parallel": False},
                "net.model.6": {"style": "rowwise", "input_is_parallel": False},
            }
        },
    },
}
PIPELINES = {
    "1f1b": {
        "class": "lightning_parallel:PipelineParallelStrategy",
        "kwargs": {"schedule": "1f1b", "num_microbatches": 2},
    },
    "async": {
        "class": "lightning_parallel:PipelineParallelStrategy",
        "kwargs": {"schedule": "async", "num_microbatches": 2},
    },
}
SYNC = {"sync_batchnorm": True}
SYNC_CASES = {
    "lp_ddp": case("sync-lp_ddp", "lp_ddp", trainer=SYNC),
    "lp_dp": case("sync-lp_dp", "lp_dp", trainer=SYNC),
    "tp": case("sync-tp", TP, trainer=SYNC, dp_size=1),
    **{f"pp-{s}": case(f"sync-pp-{s}", spec, trainer=SYNC, dp_size=1) for s, spec in PIPELINES.items()},
}
EXACT = ("lp_ddp", "lp_dp", "tp")  # equal one device on the global batch; a pipeline's micro-batches are not


@pytest.fixture(scope="module")
def sync_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sync_bn")
    cases = [{**c, "callbacks": [CHECKPOINT], "probe": AFTER_FIT} for c in SYNC_CASES.values()]
    return tmp, run_distributed(cases, world_size=2, tmp_path=tmp, timeout=360)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    single = case("single", "auto", callbacks=[CHECKPOINT], probe=AFTER_FIT)
    return run_single(single, tmp_path_factory.mktemp("sync_bn1"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(SYNC_CASES))
def test_sync_batchnorm_fit_checkpoint_then_test(sync_runs, one_device, name):
    _, results = sync_runs
    for rank, result in enumerate(results[SYNC_CASES[name]["name"]]):
        probe = result["probe"]
        # converted in place for fit, the user's own classes again after it
        assert probe["layers_after_fit"] == ["BatchNorm1d", "BatchNorm1d"], probe["layers_after_fit"]
        # the checkpoint's hyperparameters hold the user's BatchNorm layers, which load without the package
        assert probe["layers_in_checkpoint"] == ["torch.nn.modules.batchnorm.BatchNorm1d"] * 2
        # test, right after fit (= last.ckpt) and of the best checkpoint, equals that checkpoint's model
        # evaluated on one process (async applies its last update at the end of fit, after last.ckpt)
        for run, expected in probe["one_process"].items():
            if run == "test" and name == "pp-async":
                continue
            (metrics,) = probe[run]
            for key in ("test/loss", "test/acc"):
                assert abs(metrics[key] - expected[key]) <= 1e-10, (rank, run, key, metrics, expected)
        (validated,) = probe["validate"]
        assert set(validated) == {"val/loss", "val/acc"}
        predictions = [p for p in probe["predict"] or [] if isinstance(p, torch.Tensor)]
        if rank == 1 or predictions:  # data parallel: this rank's half; model parallel: the whole set
            rows = 32 if name in ("lp_ddp", "lp_dp") else 64
            assert [p.shape[1] for p in predictions] == [4] * len(predictions)
            assert sum(p.shape[0] for p in predictions) == rows, [p.shape for p in predictions]
        if name in EXACT:
            assert_params_close(probe["last_state_dict"], one_device["state_dict"], atol=1e-10)
            # every process votes on the best checkpoint, as on one device
            assert _best(result) == _best(one_device) == "epoch=1-step=16.ckpt"
            for key in ("test/loss", "test/acc"):
                assert abs(probe["test"][0][key] - one_device["probe"]["test"][0][key]) <= 1e-10


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sync_batchnorm_forward_on_rank_zero_alone_between_steps(tmp_path):
    """A forward in training mode on rank 0 alone after each step (``tests/helpers/rank_zero.py``) gathers no
    statistics (no collective that rank 1 never joins): it normalizes with its input's own, updating rank 0's
    running statistics as one device does, and lp_ddp's buffers from rank 0 carry them on; parameters and
    buffers equal one device's with the same callback."""
    probe = {"class": "tests.helpers.rank_zero:RankZeroForward", "kwargs": {"shape": [4, 16]}}
    c = case(
        "sync-lp_ddp-rank0-forward",
        "lp_ddp",
        trainer={**SYNC, "max_epochs": 1, "limit_val_batches": 0, "num_sanity_val_steps": 0},
        callbacks=[probe],
    )
    results = run_distributed([c], world_size=2, tmp_path=tmp_path, timeout=300)
    single = run_single({**c, "strategy": "auto", "name": "single-rank0-forward"}, tmp_path)
    assert_params_close(results[c["name"]][0]["state_dict"], single["state_dict"], atol=1e-10)


def _best(result):
    return result["callback_state"]["ModelCheckpoint"]["best_model_path"].rsplit("/", 1)[-1]


@pytest.mark.timeout(600)
def test_one_device_reference_is_not_trivial(one_device):
    """Training moved the BatchNorm statistics, and the test set is not classified by chance alone."""
    state = one_device["state_dict"]
    assert (state["net.model.1.running_mean"].abs().max()) > 1e-2
    assert state["net.model.1.num_batches_tracked"] == 16
    assert one_device["probe"]["test"][0]["test/acc"] > 0.4


def test_a_converted_network_pickles_as_the_users_and_deep_copies_keep_syncing():
    """No process group in picklable state; in-place conversion keeps the objects that others hold."""
    import copy

    import torch.distributed as dist

    from lightning_parallel.distributed.sync_batchnorm import (
        SyncBatchNorm,
        convert_sync_batchnorm,
        revert_sync_batchnorm,
    )
    from tests.helpers.bn_project import DenseNet

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        net = DenseNet()
        layers = [net.model[1], net.model[4]]
        convert_sync_batchnorm(net, group)
        assert [type(m) for m in net.model[1:5:3]] == [SyncBatchNorm] * 2
        assert [net.model[1], net.model[4]] == layers  # the same objects
        net.train()(torch.randn(6, 16))
        restored = pickle.loads(pickle.dumps(net))
        assert [type(m) for m in restored.model[1:5:3]] == [torch.nn.BatchNorm1d] * 2
        assert "process_group" not in vars(restored.model[1])
        assert b"lightning_parallel" not in pickle.dumps(net)
        torch.testing.assert_close(restored.model[1].running_mean, net.model[1].running_mean)
        twin = copy.deepcopy(net)
        assert type(twin.model[1]) is SyncBatchNorm and twin.model[1].process_group is group
        assert twin.model[1].weight is not net.model[1].weight
        revert_sync_batchnorm(net)
        assert [type(m) for m in net.model[1:5:3]] == [torch.nn.BatchNorm1d] * 2
        assert [net.model[1], net.model[4]] == layers and "process_group" not in vars(net.model[1])
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------
# 4 processes: data parallel x model parallel; the statistics are reduced over the 2 replicas only
# ---------------------------------------------------------------------------------------------------
DP2 = {
    # no checkpoint: a row-parallel layer holds its tensor-parallel group, which a network pickled into
    # the hyperparameters cannot hold (tp=2 of 4 processes is a real group, not the default one)
    "tp": case(
        "dp2-tp",
        {"class": TP["class"], "kwargs": {**TP["kwargs"], "data_parallel_size": 2}},
        trainer=SYNC,
        dp_size=2,
    ),
    # one micro-batch: each stage's BatchNorm sees its replica's whole batch, so the result is exact
    "pp-gpipe": {
        **case(
            "dp2-pp-gpipe",
            {
                "class": "lightning_parallel:PipelineParallelStrategy",
                "kwargs": {"schedule": "gpipe", "num_microbatches": 1, "data_parallel_size": 2},
            },
            trainer=SYNC,
            dp_size=2,
        ),
        "callbacks": [CHECKPOINT],
        "probe": AFTER_FIT,
    },
}


@pytest.fixture(scope="module")
def dp2_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sync_bn4")
    return run_distributed(DP2.values(), world_size=4, tmp_path=tmp, timeout=500)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(DP2))
def test_sync_batchnorm_reduces_over_the_data_parallel_replicas_only(dp2_runs, one_device, name):
    """Counting a replica's model-parallel peers too would double the count (running_var's n/(n-1));
    not syncing would normalise each replica's half of the batch: either differs from one device."""
    expected = one_device["state_dict"]
    for rank, result in enumerate(dp2_runs[DP2[name]["name"]]):
        # what this rank holds whole (BatchNorm is replicated under tensor parallel; a stage holds its
        # own blocks) equals one device's
        local = {
            k: v for k, v in result["state_dict"].items() if k in expected and v.shape == expected[k].shape
        }
        assert {k for k in local if ".model.1." in k or ".model.4." in k}, sorted(local)
        assert_params_close(local, {k: expected[k] for k in local}, atol=1e-10)
        if "probe" in result:
            assert_params_close(result["probe"]["last_state_dict"], expected, atol=1e-10)
            for run, evaluated in result["probe"]["one_process"].items():
                (metrics,) = result["probe"][run]
                assert abs(metrics["test/loss"] - evaluated["test/loss"]) <= 1e-10, (rank, run, metrics)
