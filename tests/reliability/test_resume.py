"""Exact resume with real processes: a rank is SIGKILLed mid-run, the run resumes from ``last.ckpt``
with ``ckpt_path="last"``, and the following losses and the final parameters equal an uninterrupted
run's to 1e-10 (float64, 2 gloo processes, dropout + momentum + StepLR + shuffled data).

6 batches per epoch in every case (48 samples; 4 per rank under data parallelism, 8 per replica where
the 2 ranks form one replica).

- lp_ddp: checkpoint every 2 steps, rank 1 killed after step 9: resumes mid-epoch (epoch 1, batch 2).
- lp_dp: checkpoint every 3 steps, rank 0 killed after step 7: resumes from an epoch-end checkpoint
  (step 6 = end of epoch 0), the case where Lightning's own loop gets the sampler epoch wrong.
- lp_ddp under Lightning's own launcher, the launcher (rank 0) SIGKILLed after step 11: resumes from
  step 8 with a fresh launch.
- lp_ddp + SIGTERM to rank 1 after step 5: the ranks' vote at step 5 says so, they read it a step later
  (``checkpointing/preemption.py``), so both save ``last.ckpt`` at step 6 and stop cleanly; the resumed run continues
  exactly.
- lp_tensor_parallel (tp=2, one replica: both ranks see the same batch): resumes mid-epoch.
- lp_ddp with ``zero_stage=2`` and ``zero_stage=3`` mid-epoch, and with ``zero_stage=1`` and
  ``zero_stage=3`` (each rank's shards of the parameters too) from a sharded checkpoint.
- lp_pipeline_1f1b (2 stages, loss on the last stage only) mid-epoch; lp_pipeline_gpipe from an
  epoch-end checkpoint; lp_pipeline_async (no flush: the unapplied gradient travels) mid-epoch;
  lp_pipeline_interleaved (two chunks per rank) and lp_pipeline_zb (split backwards) mid-epoch.
- lp_ddp with ``accumulate_grad_batches=4`` (does not divide the 6 batches: Lightning also steps at the
  epoch's last batch, after 2 micro-batches) from epoch-end checkpoints saved in the last batch's
  ``on_train_batch_end`` (``every_n_train_steps``; killed again after resuming) and in
  ``on_train_epoch_end`` (``every_n_epochs=1``); ``checkpointing/loop_state.py`` repairs both.
- lp_ddp with ``accumulate_grad_batches=2`` (3 steps per epoch) and validation at each epoch end, from
  epoch-end checkpoints saved in ``on_train_epoch_end`` under ``max_epochs``, and before (last batch's
  ``on_train_batch_end``) and after (``on_validation_end``) the validation, whose loader's iterator
  draws from the global RNG (the save before it failed before the RNG was restored at ``on_train_start``).

The checkpoint matrix: {full, sharded (``save_distributed``)} x {mid-epoch, epoch end (``every_n_epochs=1``:
saved in ``on_train_epoch_end``)} x {lp_ddp, lp_tensor_parallel, lp_pipeline_1f1b, lp_pipeline_async} (the full
lp_ddp epoch end is the accumulating case above); a sharded epoch-end checkpoint of lp_tensor_parallel
resumed under lp_pipeline_1f1b (no dropout: the two layouts draw different masks), compared on the gathered
single-device parameters; and a save between the micro-batches of an accumulated step, which warns on both
storage paths.

Every killed rank leaves a marker file before it kills itself and must have died by that signal; the
checkpoint it left is checked to be at the expected step, and the resumed batch trace (global step after
each batch, loss) must equal the uninterrupted run's from the batch after that step's save.
"""

from __future__ import annotations

import json
import math
import signal
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

from lightning_parallel.processes import start_processes
from tests.helpers.harness import forked_commands, max_param_diff, run_processes, worker_env

STEPS = 14
# the 2 ranks form one replica: 8 samples per batch on both, and the same losses on both
TP = {
    "strategy": "lp_tensor_parallel",
    "strategy_kwargs": {"plan": {"net.0": "colwise", "net.3": "rowwise"}},
    "batch_size": 8,
    "one_replica": True,
}
# dropout on stage 0, the loss on stage 1
PP = {"strategy_kwargs": {"split_points": [3, 1]}, "batch_size": 8, "one_replica": True}
CASES = {
    "lp_ddp": {"strategy": "lp_ddp", "every": 2, "kill": [9, 1, "SIGKILL"], "ckpt_step": 8},
    "lp_dp": {"strategy": "lp_dp", "every": 3, "kill": [7, 0, "SIGKILL"], "ckpt_step": 6},
    # SIGTERM to one rank after step 5, no periodic checkpoint: the preemption checkpoint is the only one;
    # step 5's vote carries it and is read at step 6 (a vote read at once would sync the ranks every step)
    "lp_ddp_sigterm": {"strategy": "lp_ddp", "every": 100, "kill": [5, 1, "SIGTERM"], "ckpt_step": 6},
    # the same with 2 micro-batches per step: SIGTERM lands after batch 9, the first micro-batch of step 5,
    # so the vote waits for the optimizer step (the accumulated gradient is not in a checkpoint)
    "lp_ddp_sigterm_accumulate": {
        "strategy": "lp_ddp",
        "every": 100,
        "kill": [9, 1, "SIGTERM", "batch"],
        "ckpt_step": 6,
        "accumulate": 2,
    },
    # Lightning's own launcher (one command; rank 1 is its child) SIGKILLed with its rank 0 after step 11
    "lp_ddp_launcher": {
        "strategy": "lp_ddp",
        "every": 4,
        "kill": [11, 0, "SIGKILL"],
        "ckpt_step": 8,
        "lightning_launcher": True,
    },
    "lp_tensor_parallel": {**TP, "every": 2, "kill": [9, 0, "SIGKILL"], "ckpt_step": 8},
    # ZeRO: the checkpoint holds the optimizer state gathered over dp (stage 2), or each rank's shard
    # (stage 1, sharded); StepLR keeps its meaning on the sharded optimizer
    "lp_ddp_zero2": {
        "strategy": "lp_ddp",
        "strategy_kwargs": {"zero_stage": 2},
        "every": 2,
        "kill": [9, 1, "SIGKILL"],
        "ckpt_step": 8,
    },
    # stage 3: the parameters sharded too, gathered block by block into the full checkpoint
    "lp_ddp_zero3": {
        "strategy": "lp_ddp",
        "strategy_kwargs": {"zero_stage": 3},
        "every": 2,
        "kill": [9, 0, "SIGKILL"],
        "ckpt_step": 8,
    },
    "lp_ddp_zero3_sharded": {
        "strategy": "lp_ddp",
        "strategy_kwargs": {"zero_stage": 3},
        "every": 4,
        "kill": [10, 1, "SIGKILL"],
        "ckpt_step": 8,
        "sharded": True,
    },
    "lp_ddp_zero1_sharded": {
        "strategy": "lp_ddp",
        "strategy_kwargs": {"zero_stage": 1},
        "every": 4,
        "kill": [10, 0, "SIGKILL"],
        "ckpt_step": 8,
        "sharded": True,
    },
    "lp_pipeline_1f1b": {
        **PP,
        "strategy": "lp_pipeline_1f1b",
        "every": 4,
        "kill": [10, 1, "SIGKILL"],
        "ckpt_step": 8,
    },
    "lp_pipeline_gpipe": {
        **PP,
        "strategy": "lp_pipeline_gpipe",
        "every": 3,
        "kill": [7, 0, "SIGKILL"],
        "ckpt_step": 6,
    },
    # interleaved: one block per virtual stage (2 ranks x 2 chunks); zero bubble: split backwards
    "lp_pipeline_interleaved": {
        **PP,
        "strategy": "lp_pipeline_interleaved",
        "strategy_kwargs": {"split_points": [1, 1, 1, 1]},
        "every": 4,
        "kill": [10, 1, "SIGKILL"],
        "ckpt_step": 8,
    },
    "lp_pipeline_zb": {
        **PP,
        "strategy": "lp_pipeline_zb",
        "every": 4,
        "kill": [10, 0, "SIGKILL"],
        "ckpt_step": 8,
    },
    # no flush: the checkpoint at step 8 drains the pipeline and holds batch 7's gradient (applied by the
    # resumed step 8) and batch 7's loss (shown by it); SGD with momentum, dropout on stage 0
    "lp_pipeline_async": {
        **PP,
        "strategy": "lp_pipeline_async",
        "every": 4,
        "kill": [10, 0, "SIGKILL"],
        "ckpt_step": 8,
    },
    # accumulate_grad_batches=4 does not divide 6 batches: steps after batches 4 and 6 of each epoch (the
    # epoch's last batch steps after 2 micro-batches); step 4 ends epoch 1, step 6 ends epoch 2.
    # Saved in the last batch's on_train_batch_end, then killed again after resuming (after step 7, before
    # the next save): the last checkpoint must still be step 6's, not step 6 saved again after the first
    # micro-batch of step 7
    "lp_ddp_accumulate_uneven_epoch_end": {
        "strategy": "lp_ddp",
        "every": 3,
        "kill": [7, 0, "SIGKILL"],
        "kill_again": [7, 1, "SIGKILL"],
        "ckpt_step": 6,
        "accumulate": 4,
    },
    # the epoch end of step 4, saved by ModelCheckpoint(every_n_epochs=1) in on_train_epoch_end
    "lp_ddp_accumulate_uneven_on_epoch_end": {
        "strategy": "lp_ddp",
        "every": "epoch",
        "kill": [5, 1, "SIGKILL"],
        "ckpt_step": 4,
        "accumulate": 4,
    },
    # accumulate_grad_batches=2: 3 steps per epoch, step 3 ends epoch 0. Saved in on_train_epoch_end under
    # epoch-based training (max_epochs; Lightning's own restart is right there, and the rewritten loop
    # state must be too), with validation at each epoch end, which runs before the save
    "lp_ddp_accumulate_on_epoch_end_max_epochs_validated": {
        "strategy": "lp_ddp",
        "every": "epoch",
        "kill": [5, 1, "SIGKILL"],
        "ckpt_step": 3,
        "accumulate": 2,
        "epochs": 4,
        "val_batches": 2,
    },
    # the same epoch end with validation: saved before it (every_n_train_steps, in the last batch's
    # on_train_batch_end), which the restart skips, and after it (in on_validation_end); the random state
    # must account for the validation loader's iterator (it draws from the global RNG) in both
    "lp_ddp_validated_batch_end": {
        "strategy": "lp_ddp",
        "every": 3,
        "kill": [5, 1, "SIGKILL"],
        "ckpt_step": 3,
        "accumulate": 2,
        "val_batches": 2,
    },
    "lp_ddp_validated_validation_end": {
        "strategy": "lp_ddp",
        "every": "validation",
        "kill": [5, 1, "SIGKILL"],
        "ckpt_step": 3,
        "accumulate": 2,
        "val_batches": 2,
    },
}
# every_n_epochs=1 saves in on_train_epoch_end: step 6 ends epoch 0, the run dies after step 7
EPOCH_END = {"every": "epoch", "ckpt_step": 6}
MATRIX = {
    "lp_ddp": {"strategy": "lp_ddp"},
    "lp_tensor_parallel": TP,
    "lp_pipeline_1f1b": {**PP, "strategy": "lp_pipeline_1f1b"},
    "lp_pipeline_async": {**PP, "strategy": "lp_pipeline_async"},
}
for _name, _training in MATRIX.items():
    if _name != "lp_ddp":  # lp_ddp's full epoch end: lp_ddp_accumulate_uneven_on_epoch_end
        CASES[f"{_name}_on_epoch_end"] = {**_training, **EPOCH_END, "kill": [7, 1, "SIGKILL"]}
    CASES[f"{_name}_sharded"] = {
        **_training,
        "every": 4,
        "kill": [10, 1, "SIGKILL"],
        "ckpt_step": 8,
        "sharded": True,
    }
    CASES[f"{_name}_sharded_on_epoch_end"] = {
        **_training,
        **EPOCH_END,
        "kill": [7, 0, "SIGKILL"],
        "sharded": True,
    }
# saved sharded by tensor parallel at an epoch end, resumed by 2 pipeline stages
NO_DROPOUT = {"model_kwargs": {"dropout": 0.0}, "full_state": True}
CASES["tp_to_pipeline_sharded_on_epoch_end"] = {
    **TP,
    **NO_DROPOUT,
    **EPOCH_END,
    "kill": [7, 1, "SIGKILL"],
    "sharded": True,
    "resume_as": {**PP, "strategy": "lp_pipeline_1f1b", **NO_DROPOUT},
}
# a save after the first of 2 micro-batches (run in the uninterrupted launch; it only has to warn)
MID_ACCUMULATION = {
    f"{name}_save_mid_accumulation": {
        "strategy": "lp_ddp",
        "accumulate": 2,
        "steps": 2,
        "every": 100,
        "save_at_batch": 1,
        "sharded": sharded,
    }
    for name, sharded in (("full", False), ("sharded", True))
}
# what makes two runs the same run (not when they checkpoint or die, nor how they store checkpoints)
TRAINING_KEYS = (
    "strategy",
    "strategy_kwargs",
    "accumulate",
    "batch_size",
    "epochs",
    "val_batches",
    "model_kwargs",
    "full_state",
)


def training(case: dict) -> dict:
    """The fields that decide the training itself (not when it checkpoints or dies)."""
    return {k: case[k] for k in TRAINING_KEYS if k in case}


def launch(
    cases: list[dict], tmp_path: Path, name: str, kill: list | None = None, lightning_launcher: bool = False
) -> None:
    """Run ``cases`` on 2 processes; with ``kill``, the run must die by that signal on that rank."""
    spec = tmp_path / f"{name}.json"
    spec.write_text(json.dumps({"cases": cases, "devices": 2}))
    cwd = tmp_path / name
    cwd.mkdir()
    cmd = [sys.executable, "-m", "tests.reliability.resume_worker", str(spec)]
    envs = [worker_env(r, 2) for r in range(2)]
    if lightning_launcher:  # one process group: killing it takes the orphaned child rank too
        env = {k: v for k, v in envs[0].items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK")}
        cmd, envs = [cmd], [env]
    else:
        cmd = forked_commands(cmd, 2)
    if kill is None or kill[2] == "SIGTERM":  # SIGTERM: saves, stops and exits cleanly
        run_processes(cmd, envs, timeout=240, cwd=cwd, grace=2.0, rendezvous=True)
        return
    # a rank that kills itself after a step leaves its peer blocked in the next step's collective, where
    # nothing it could still do is looked at: the peer is killed at once, as torchrun kills the ranks left
    # when one dies (a grace period here only waited, 2 s a launch). A rank that dies inside a save may
    # leave its peer mid-save or failing on its own: that peer gets the grace period
    grace = 2.0 if "die_in_save" in cases[-1] else 0.0
    result = start_processes(cmd, envs, timeout=240, cwd=cwd, grace=grace, rendezvous=True)
    rank = kill[1]
    if cases[-1].get("die_in_save") in (
        "disk_full",
        "file_disk_full",
    ):  # an error, not a kill: every rank fails
        assert result.codes == [1, 1], f"{name}: every rank must fail cleanly: {result.codes}"
        assert "No space left on device (injected)" in result.outputs[rank], result.outputs[rank][-2000:]
        return
    assert result.codes[rank] == -signal.SIGKILL, f"{name}: rank {rank} was to be SIGKILLed: {result.codes}"
    marker = Path(cases[-1]["dir"]) / f"killed_rank{rank}.json"  # the killed run ends its launch
    tail = result.outputs[rank][-2000:]
    assert marker.exists(), f"{name}: rank {rank} died, not by the test's kill:\n{tail}"


def load(path: Path) -> list[dict]:
    return [torch.load(path / f"rank{r}.pt", weights_only=False) for r in range(2)]


def saved_step(path: Path) -> int:
    """The global step of a checkpoint file or sharded directory. ``weights_only=True``: what
    ``load_from_checkpoint`` uses; the resume state must not need pickled classes."""
    return torch.load(path / "meta.pt" if path.is_dir() else path, weights_only=True)["global_step"]


def run_resume_cases(
    cases: dict[str, dict],
    tmp: Path,
    once: dict[str, dict] | None = None,
    after_kill: Callable[[str, Path], None] | None = None,
) -> dict[str, tuple]:
    """Launches (start-up dominates): the uninterrupted runs together with the SIGTERM runs, which stop
    cleanly, and the ``once`` cases (run as given, results under their name); one launch per SIGKILL, which
    ends its launch (``after_kill(name, its checkpoint folder)`` looks at what it left); then the resumed
    runs together (a case's ``resume_as`` changes their training). The step of a case's ``last.ckpt`` after
    the kill is None where none is there (a save killed between its renames hides it)."""
    once = once or {}

    def run(name: str, resume: bool = False, **extra) -> dict:
        c = cases[name]
        trained = training(c.get("resume_as", c)) if resume else training(c)
        return {
            **trained,
            "steps": STEPS,
            "every": c["every"],
            "dir": str(tmp / f"kill_{name}"),
            "sharded": c.get("sharded", False),
            "save_last": c.get("save_last", True),
            "resume": resume,
            **extra,
        }

    def key(case: dict) -> str:
        return json.dumps(training(case), sort_keys=True)

    bases = sorted({key(c) for c in cases.values()})
    base_dir = {b: tmp / f"base{i}" for i, b in enumerate(bases)}
    sigterm = [n for n, c in cases.items() if c["kill"][2] == "SIGTERM" and not c.get("lightning_launcher")]
    launch(
        [{**json.loads(b), "steps": STEPS, "every": 2, "dir": str(base_dir[b])} for b in bases]
        + [run(n, kill=cases[n]["kill"]) for n in sigterm]
        + [{**c, "dir": str(tmp / n)} for n, c in once.items()],
        tmp,
        "uninterrupted",
    )
    for name in sigterm:
        stopped = load(tmp / f"kill_{name}")
        steps = [r["global_step"] for r in stopped]
        assert steps == [cases[name]["ckpt_step"]] * 2, f"SIGTERM must stop the run: {steps}"
        signalled = tmp / f"kill_{name}" / f"killed_rank{cases[name]['kill'][1]}.json"
        assert signalled.exists(), "no SIGTERM was sent"
        # the preemption checkpoint is the run's "last": ModelCheckpoint must not save another one after it
        extra = sorted(p.name for p in (tmp / f"kill_{name}" / "ckpt").glob("last-v*.ckpt"))
        assert not extra, f"{name}: checkpoints saved after the preemption one: {extra}"
    for name, c in cases.items():
        if name in sigterm:
            continue
        fault = {"die_in_save": c["die_in_save"]} if "die_in_save" in c else {}
        launch(
            [run(name, kill=c["kill"], **fault)],
            tmp,
            f"killed_{name}",
            kill=c["kill"],
            lightning_launcher=c.get("lightning_launcher", False),
        )
        if after_kill is not None:
            after_kill(name, tmp / f"kill_{name}" / "ckpt")
        if "kill_again" in c:  # killed again after resuming
            launch(
                [run(name, kill=c["kill_again"], resume=True)],
                tmp,
                f"killed_again_{name}",
                kill=c["kill_again"],
            )
    last = {n: tmp / f"kill_{n}" / "ckpt" / "last.ckpt" for n in cases}
    killed_at = {n: saved_step(p) if p.exists() else None for n, p in last.items()}
    for own_launcher in (False, True):
        group = [
            run(n, resume=True) for n, c in cases.items() if bool(c.get("lightning_launcher")) == own_launcher
        ]
        if group:
            launch(group, tmp, f"resumed_launcher{own_launcher}", lightning_launcher=own_launcher)
    results = {n: (load(base_dir[key(c)]), load(tmp / f"kill_{n}"), killed_at[n]) for n, c in cases.items()}
    return results | {n: (load(tmp / n),) for n in once}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_resume_cases(CASES, tmp_path_factory.mktemp("resume"), once=MID_ACCUMULATION)


def check_resumed(case: dict, base: list[dict], resumed: list[dict], last_step: int) -> None:
    ckpt_step = case["ckpt_step"]
    assert last_step == ckpt_step, f"last.ckpt after the kill is at step {last_step}, expected {ckpt_step}"
    for rank in range(2):
        # the batch trace [(global step after the batch, loss)] after the checkpointed optimizer step; the
        # steps also fix how the resumed run groups micro-batches into optimizer steps
        trace = base[rank]["trace"]
        start = next(i for i, (step, _) in enumerate(trace) if step == ckpt_step) + 1  # after the save
        expected, got = trace[start:], resumed[rank]["trace"]
        assert [s for s, _ in got] == [s for s, _ in expected], f"rank {rank} resumed at a wrong batch: {got}"
        assert [math.isnan(a) for _, a in got] == [math.isnan(b) for _, b in expected], f"rank {rank}: {got}"
        worst = max(abs(a - b) for (_, a), (_, b) in zip(got, expected) if not math.isnan(a))
        assert worst <= 1e-10, f"rank {rank}: losses after resume differ by {worst:.3e}"
        # the same layout: this rank's parameters; another: the gathered single-device ones
        compared = "full_state" if "resume_as" in case else "state_dict"
        diff = max_param_diff(resumed[rank][compared], base[rank][compared])
        assert diff <= 1e-10, f"rank {rank}: final parameters differ by {diff:.3e}"
    if case.get("one_replica"):  # tensor-parallel peers saw the same batches; the last stage's loss mirrored
        worst = max(abs(a - b) for (_, a), (_, b) in zip(resumed[0]["trace"], resumed[1]["trace"]))
        assert worst <= 1e-12, f"the ranks of one replica disagree on the loss by {worst:.3e}"
    losses = [loss for _, loss in resumed[0]["trace"]]
    assert max(losses) - min(losses) > 1e-4, "the losses must change after the save, or this proves nothing"


@pytest.mark.timeout(600)  # the first case also runs the module fixture: every launch
@pytest.mark.parametrize("case", list(CASES))
def test_kill_then_resume_is_exact(runs, case):
    check_resumed(CASES[case], *runs[case])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(MID_ACCUMULATION))
def test_a_save_between_micro_batches_warns(runs, case):
    (ranks,) = runs[case]
    warned = [m for m in ranks[0]["warned"] if "saved between the micro-batches of an accumulated step" in m]
    assert len(warned) == 1, ranks[0]["warned"]
    assert "global step 0" in warned[0]
    assert ranks[1]["warned"] == [] or not any("micro-batches" in m for m in ranks[1]["warned"])
