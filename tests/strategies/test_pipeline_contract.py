"""Lightning's contract for a user's steps under the pipelines, on real processes (gloo, 2 stages; and 2
replicas x 2 stages): collectives inside validation_step / test_step / training_step span the replicas
and give what ``ddp`` gives over those replicas, prediction writers and ``trainer.predict`` get the
predictions on every stage, and manual optimization is refused before training (also at dp2 x pp2 with
zero_stage=3). The runs have time limits well below the suite's, so a hang fails fast."""

import json
import sys

import pytest
import torch
from torch import nn

from tests.helpers.harness import REPO, start_processes, worker_env

SCRIPT = str(REPO / "tests" / "helpers" / "scripts" / "pipeline_contract.py")
SCHEDULES = ["gpipe", "1f1b", "async"]
GLOBAL_BATCH, MICROBATCHES = 8, 2  # as in the script


def launch(tmp_path, world, dp, schedules, manual=False, timeout=150, zero_stage=0):
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps(
            {"out": str(tmp_path), "dp": dp, "schedules": schedules, "manual": manual, "zero_stage": zero_stage}
        )
    )
    envs = [worker_env(r, world) for r in range(world)]
    return start_processes(
        [[sys.executable, SCRIPT, str(spec)]] * world, envs, timeout, tmp_path, grace=5, rendezvous=True
    )


def results_of(tmp_path, world, dp, timeout=150):
    run = launch(tmp_path, world, dp, SCHEDULES, timeout=timeout)
    assert run.codes == [0] * world, "\n".join(
        f"--- rank {r}\n{o[-3000:]}" for r, o in enumerate(run.outputs)
    )
    return {
        s: [torch.load(tmp_path / s / f"rank{r}.pt", weights_only=False) for r in range(world)]
        for s in SCHEDULES
    }


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    return results_of(tmp_path_factory.mktemp("pp2"), world=2, dp=1)


@pytest.fixture(scope="module")
def dp2pp2(tmp_path_factory):
    return results_of(tmp_path_factory.mktemp("dp2pp2"), world=4, dp=2, timeout=220)


def replica_microbatches(result, dp):
    """Per replica, its (outputs, targets) micro-batches in order: what ``ddp`` with ``dp`` ranks would see
    (Lightning's DistributedSampler without shuffling gives replica i the samples i, i + dp, ...)."""
    expected, y = result["expected"], result["y"]
    per_replica = []
    for i in range(dp):
        out, target = expected[i::dp], y[i::dp]
        parts = []
        for start in range(0, len(out), GLOBAL_BATCH // dp):
            batch = slice(start, start + GLOBAL_BATCH // dp)
            parts += list(
                zip(
                    torch.tensor_split(out[batch], MICROBATCHES),
                    torch.tensor_split(target[batch], MICROBATCHES),
                )
            )
        per_replica.append(parts)
    return per_replica


def check_evaluation_collectives(results, kind, dp):
    """The last stage of every replica ran the step on each micro-batch; its collectives spanned the
    replicas and gave what ``ddp`` over the replicas gives; the logged value reached every rank."""
    first = results[0]
    per_replica = replica_microbatches(first, dp)
    whole = nn.functional.mse_loss(first["expected"], first["y"]).item()
    for r in results:
        if r["pp_rank"] != max(x["pp_rank"] for x in results):
            assert r[kind]["records"] == [], "code after the forward runs on the last stage only"
        else:
            records = r[kind]["records"]
            assert len(records) == len(per_replica[0])
            for j, record in enumerate(records):
                assert record["gathered"].shape == (dp, *per_replica[0][j][0].shape)
                for i in range(dp):
                    assert torch.allclose(record["gathered"][i], per_replica[i][j][0], atol=1e-12, rtol=0)
                assert torch.equal(record["gathered"][r["dp_rank"]], record["own"])
                losses = [nn.functional.mse_loss(*per_replica[i][j]).item() for i in range(dp)]
                assert record["summed"].item() == pytest.approx(sum(losses), abs=1e-12)
                assert record["broadcast"] == pytest.approx(losses[0], abs=1e-12)
            assert records[-1]["running_mse"] == pytest.approx(whole, abs=1e-12)  # torchmetrics synced
        assert r[kind]["metrics"][f"{kind}_loss"] == pytest.approx(whole, abs=1e-12)


def check_predictions(results, dp):
    """Every rank's writers and ``trainer.predict`` get its replica's predictions, never None."""
    for r in results:
        expected, y = r["expected"], r["y"]
        batch_writer, epoch_writer = r["predict"]["writers"]
        assert len(batch_writer) == len(expected) // GLOBAL_BATCH
        for call in batch_writer:
            indices = call["indices"]
            assert (
                indices
                == list(range(r["dp_rank"], len(expected), dp))[call["idx"] * len(indices) :][: len(indices)]
            )
            assert torch.allclose(call["prediction"]["out"], expected[indices], atol=1e-12, rtol=0)
            assert torch.equal(call["prediction"]["y"], y[indices])
        (epoch,) = epoch_writer
        returned = r["predict"]["returned"]
        assert len(epoch["predictions"]) == len(returned) == len(batch_writer)  # one dataloader: not nested
        for call, from_epoch, from_return in zip(batch_writer, epoch["predictions"], returned):
            assert torch.equal(from_epoch["out"], call["prediction"]["out"])
            assert torch.equal(from_return["out"], call["prediction"]["out"])
        assert epoch["indices"][0] == [call["indices"] for call in batch_writer]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_collectives_in_validation_and_test_steps_span_the_replicas(pp2, schedule):
    check_evaluation_collectives(pp2[schedule], "val", dp=1)
    check_evaluation_collectives(pp2[schedule], "test", dp=1)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_prediction_writers_and_predict_get_the_predictions_on_every_stage(pp2, schedule):
    check_predictions(pp2[schedule], dp=1)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_validation_outputs_reach_every_stage(pp2, schedule):
    for r in pp2[schedule]:
        kept = r["val_outputs"]
        assert len(kept) == 4
        for batch in kept:
            x = batch["x"]
            assert torch.equal(batch["outputs"]["x"], x)  # the last stage's whole batch, merged
            losses = batch["outputs"]["loss"]  # a number per micro-batch: they differ, so listed
            assert len(losses) == MICROBATCHES and all(loss.shape == () for loss in losses)


def check_training_collectives(results, dp):
    """In fit (2 batches, then validation on 4), the last stages' steps gathered over the replicas, and
    what they logged with sync_dist reached every rank alike."""
    for r in results:
        if r["pp_rank"] == 1:
            assert len(r["fit"]["train"]) == 2 * MICROBATCHES
            assert len(r["fit"]["val"]) == 4 * MICROBATCHES
            for record in r["fit"]["train"] + r["fit"]["val"]:
                assert record["gathered"].shape == (dp, *record["own"].shape)
                assert torch.equal(record["gathered"][r["dp_rank"]], record["own"])
        assert r["fit"]["metrics"] == results[0]["fit"]["metrics"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_collectives_in_training_step_and_in_fit_validation(pp2, schedule):
    check_training_collectives(pp2[schedule], dp=1)


@pytest.mark.timeout(200)
def test_a_unanimous_vote_passes_on_every_stage(pp2):
    """``ModelCheckpoint`` keeps a better top-k checkpoint only if ``reduce_boolean_decision`` says so."""
    for schedule in SCHEDULES:
        assert [r["votes"] for r in pp2[schedule]] == [[True, True, False]] * 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_two_replicas_of_two_stages(dp2pp2, schedule):
    check_evaluation_collectives(dp2pp2[schedule], "val", dp=2)
    check_evaluation_collectives(dp2pp2[schedule], "test", dp=2)
    check_predictions(dp2pp2[schedule], dp=2)
    check_training_collectives(dp2pp2[schedule], dp=2)
    assert [r["votes"] for r in dp2pp2[schedule]] == [[True, True, False]] * 4


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world, dp, zero_stage", [(2, 1, 0), (4, 2, 3)])  # also with parameters sharded
def test_manual_optimization_is_refused_before_training(tmp_path, world, dp, zero_stage):
    run = launch(tmp_path, world, dp, ["1f1b"], manual=True, timeout=45 * world, zero_stage=zero_stage)
    assert all(code not in (0, -9) for code in run.codes), run.codes  # failed by itself, not killed
    for output in run.outputs:
        assert "automatic_optimization=False" in output and "lp_ddp / lp_tensor_parallel" in output
        assert "without an input from the previous stage" not in output
    assert run.seconds < 30 * world  # the processes' start (imports) and set-up, no training
