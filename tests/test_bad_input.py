"""The catalogue of misconfigurations: each raises before training starts, naming the offending value
and saying what would work. Strategies of every kind add their rows here."""

import pytest
import torch
from lightning.pytorch import Trainer
from torch import nn

import lightning_parallel as lp
from lightning_parallel.distributed.optimizer_shards import sharding_problem
from lightning_parallel.models import CharGPT
from lightning_parallel.module_names import find_block_stack
from lightning_parallel.moe.expert_parallel import expert_parallel_problem
from lightning_parallel.pipeline.executor import loader_problem, split_microbatches
from lightning_parallel.pipeline.partition import stage_bounds
from lightning_parallel.pipeline.schedules import schedule_problem
from lightning_parallel.strategies.checks import require
from lightning_parallel.tensor import resolve
from tests.helpers.zoo import ZooLM


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 8))


def gpt() -> nn.Module:
    return CharGPT(n_head=3, n_embd=48)


CATALOGUE = [
    # (id, callable that must raise, exception type, fragments the message must contain)
    (
        "ddp-bucket-zero",
        lambda: lp.DDPStrategy(bucket_cap_mb=0),
        ValueError,
        ["bucket_cap_mb", "got 0", "default 25"],
    ),
    (
        "ddp-bucket-type",
        lambda: lp.DDPStrategy(bucket_cap_mb="big"),
        ValueError,
        ["'big'", "positive number"],
    ),
    (
        "ddp-first-bucket",
        lambda: lp.DDPStrategy(first_bucket_cap_mb=-1),
        ValueError,
        ["first_bucket_cap_mb", "got -1"],
    ),
    (
        "ddp-comm-hook",
        lambda: lp.DDPStrategy(ddp_comm_hook="int8"),
        ValueError,
        ["'int8'", "'fp16'", "'bf16'"],
    ),
    (
        "zero-stage-4",
        lambda: lp.DDPStrategy(zero_stage=4),
        ValueError,
        ["zero_stage=4", "0, 1, 2, 3"],
    ),
    (
        "reshard-after-forward-without-zero-3",
        lambda: lp.DDPStrategy(zero_stage=2, reshard_after_forward=False),
        ValueError,
        ["reshard_after_forward=False", "zero_stage=2", "zero_stage=3"],
    ),
    (
        "reshard-after-forward-under-pipeline-stages",
        lambda: lp.PipelineParallelStrategy(schedule="interleaved_1f1b", zero_stage=3, reshard_after_forward=False),
        ValueError,
        ["reshard_after_forward=False with pipeline stages", "keeps them across", "pipeline_parallel_size=1"],
    ),
    (
        "reshard-after-forward-under-parallel-stages",
        lambda: lp.ParallelStrategy(pipeline_parallel_size=2, zero_stage=3, reshard_after_forward=False),
        ValueError,
        ["reshard_after_forward=False with pipeline stages", "reshard_after_forward=True"],
    ),
    (
        "reshard-after-forward-not-a-bool",
        lambda: lp.TensorParallelStrategy(zero_stage=3, reshard_after_forward="no"),
        ValueError,
        ["reshard_after_forward must be True or False", "'no'"],
    ),
    (
        "zero-stage-3-async-pipeline",
        lambda: lp.PipelineParallelStrategy(schedule="async", zero_stage=3),
        ValueError,
        ["zero_stage=3", "schedule='async'", "two gathered versions", "zero_stage 1", "'1f1b'"],
    ),
    (
        "compile-not-a-setting",
        lambda: lp.TensorParallelStrategy(compile="max-autotune"),
        ValueError,
        ["compile='max-autotune'", "True", "keyword arguments"],
    ),
    (
        "hsdp-without-zero",
        lambda: lp.DDPStrategy(data_parallel_shard_size=2),
        ValueError,
        ["data_parallel_shard_size=2", "zero_stage=0", "set zero_stage 1, 2 or 3"],
    ),
    (
        "hsdp-shard-of-one",
        lambda: lp.DDPStrategy(zero_stage=3, data_parallel_shard_size=1),
        ValueError,
        ["data_parallel_shard_size", "at least 2", "got 1", "None (all of them)"],
    ),
    (
        "hsdp-with-pipeline-stages",
        lambda: lp.PipelineParallelStrategy(zero_stage=2, data_parallel_shard_size=2),
        ValueError,
        ["data_parallel_shard_size=2", "pipeline_parallel_size=2", "pipeline_parallel_size=1", "leave"],
    ),
    (
        "hsdp-with-experts",
        lambda: lp.ParallelStrategy(zero_stage=3, data_parallel_shard_size=2, expert_parallel_size=2),
        ValueError,
        ["expert_parallel_size=2", "data_parallel_shard_size=2", "HSDP", "expert_parallel_size=1"],
    ),
    (
        "hsdp-save-distributed",
        lambda: lp.DDPStrategy(zero_stage=2, data_parallel_shard_size=2, save_distributed=True),
        ValueError,
        ["data_parallel_shard_size=2 with save_distributed=True", "save_distributed=False"],
    ),
    (
        "zero-on-lp-dp",
        lambda: lp.DataParallelStrategy(zero_stage=1),
        ValueError,
        ["zero_stage=1", "DataParallelStrategy", "use lp_ddp"],
    ),
    (
        "zero-with-comm-hook",
        lambda: lp.DDPStrategy(zero_stage=2, ddp_comm_hook="fp16", gradient_as_bucket_view=False),
        ValueError,
        ["zero_stage=2", "ddp_comm_hook='fp16'", "gradient_as_bucket_view=False", "zero_stage=0"],
    ),
    (
        "zero-optimizer-not-elementwise",
        lambda: require([sharding_problem(torch.optim.LBFGS(nn.Linear(2, 2).parameters()), 1)]),
        ValueError,
        ["zero_stage=1", "LBFGS", "AdamW", "zero_stage=0"],
    ),
    (
        "start-method",
        lambda: lp.DDPStrategy(start_method="thread"),
        ValueError,
        ["'thread'", "'popen'", "'spawn'"],
    ),
    (
        "failure-timeout",
        lambda: lp.DDPStrategy(failure_timeout=0),
        ValueError,
        ["failure_timeout", "got 0", "default 60"],
    ),
    ("unknown-kwarg", lambda: lp.DDPStrategy(bucket_size=5), TypeError, ["bucket_size", "bucket_cap_mb"]),
    (
        "save-distributed-type",
        lambda: lp.TensorParallelStrategy(save_distributed="yes"),
        ValueError,
        ["save_distributed", "'yes'", "True or False"],
    ),
    (
        "save-distributed-lp-dp",
        lambda: lp.DataParallelStrategy(save_distributed=True),
        ValueError,
        ["save_distributed=True", "lp_dp", "lp_tensor_parallel"],
    ),
    (
        "save-distributed-checkpoint-io",
        lambda: lp.PipelineParallelStrategy(save_distributed=True, checkpoint_io=object()),
        ValueError,
        ["save_distributed=True", "checkpoint_io"],
    ),
    (
        "dp-unknown-kwarg",
        lambda: lp.DataParallelStrategy(bucket_cap_mb=5),
        TypeError,
        ["bucket_cap_mb", "failure_timeout"],
    ),
    (
        "strategy-name",
        lambda: Trainer(strategy="lp_ddpp", accelerator="cpu", devices=2),
        ValueError,
        ["lp_ddpp"],
    ),
    # tensor parallel: arguments, then plans checked on the unsharded module
    (
        "tp-size",
        lambda: lp.TensorParallelStrategy(tensor_parallel_size=0),
        ValueError,
        ["tensor_parallel_size", "got 0"],
    ),
    (
        "tp-dp-type",
        lambda: lp.TensorParallelStrategy(data_parallel_size="2"),
        ValueError,
        ["data_parallel_size", "'2'"],
    ),
    (
        "tp-spawn",
        lambda: lp.TensorParallelStrategy(start_method="spawn"),
        ValueError,
        ["start_method='spawn'"],
    ),
    ("tp-plan-file", lambda: lp.TensorParallelStrategy(plan="missing.yaml"), ValueError, ["missing.yaml"]),
    (
        "tp-plan-style",
        lambda: lp.TensorParallelStrategy(plan={"net.0": "diagonal"}),
        ValueError,
        ["'diagonal'"],
    ),
    ("tp-plan-no-match", lambda: resolve(mlp(), {"net.9": "colwise"}, 2), ValueError, ["net.9"]),
    ("tp-plan-wrong-type", lambda: resolve(mlp(), {"1": "colwise"}, 2), ValueError, ["'1'"]),
    ("tp-indivisible", lambda: resolve(mlp(), {"0": "colwise", "2": "rowwise"}, 4), ValueError, ["6", "4"]),
    (
        "tp-heads",
        lambda: resolve(
            gpt(),
            {
                "model.blocks.*.attn.q": "colwise",
                "model.blocks.*.attn.k": "colwise",
                "model.blocks.*.attn.v": "colwise",
                "model.blocks.*.attn.proj": "rowwise",
                "model.blocks.*.attn.n_head": "divide",
            },
            2,
        ),
        ValueError,
        ["n_head=3", "not divisible"],
    ),
    (
        "tp-rowwise-replicated-input",
        lambda: resolve(mlp(), {"2": "rowwise"}, 2),
        ValueError,
        ["rowwise layer '2'"],
    ),
    # pipeline parallel
    (
        "pp-schedule",
        lambda: lp.PipelineParallelStrategy(schedule="zero"),
        ValueError,
        ["'zero'", "gpipe", "1f1b"],
    ),
    (
        "pp-microbatches",
        lambda: lp.PipelineParallelStrategy(num_microbatches=0),
        ValueError,
        ["num_microbatches", "got 0"],
    ),
    (
        "pp-size",
        lambda: lp.PipelineParallelStrategy(pipeline_parallel_size=0),
        ValueError,
        ["pipeline_parallel_size", "got 0"],
    ),
    (
        "pp-balance",
        lambda: lp.PipelineParallelStrategy(balance="flops"),
        ValueError,
        ["'flops'", "'parameters'", "'time'"],
    ),
    (
        "pp-balance-and-split",
        lambda: lp.PipelineParallelStrategy(balance="time", split_points=[2, 2]),
        ValueError,
        ["balance='time'", "split_points=[2, 2]", "give one"],
    ),
    (
        "pp-spawn",
        lambda: lp.PipelineParallelStrategy(start_method="spawn"),
        ValueError,
        ["'spawn'", "'popen'"],
    ),
    (
        "sp-type",
        lambda: lp.TensorParallelStrategy(sequence_parallel="yes"),
        ValueError,
        ["sequence_parallel must be True or False", "'yes'"],
    ),
    (
        "sp-with-pipeline-stages",
        lambda: lp.ParallelStrategy(tensor_parallel_size=2, pipeline_parallel_size=2, sequence_parallel=True),
        ValueError,
        ["pipeline_parallel_size=2", "not composed with pipeline stages", "sequence_parallel=False"],
    ),
    (
        "sp-plan-dim",
        lambda: lp.TensorParallelStrategy(plan={"model.head": "colwise", "sequence": {"dim": "T"}}),
        ValueError,
        ["dim='T'", "1 for [batch, sequence, features]"],
    ),
    (
        "pp-too-many-stages",
        lambda: stage_bounds("model.blocks", gpt().model.blocks, 3),
        ValueError,
        ["3 pipeline stages need at least 3 blocks", "has 2"],
    ),
    (
        "pp-split-point",
        lambda: stage_bounds("model.blocks", gpt().model.blocks, 2, ["blocks.1"]),
        ValueError,
        ["'blocks.1'", "candidates: model.blocks.0, model.blocks.1"],
    ),
    (
        "pp-interleaved-one-chunk",
        lambda: lp.PipelineParallelStrategy(schedule="interleaved_1f1b", virtual_stages=1),
        ValueError,
        ["virtual_stages=1", "interleaved_1f1b", ">= 2", "schedule='1f1b'"],
    ),
    (
        "pp-zero-bubble-selective",
        lambda: lp.PipelineParallelStrategy(schedule="zbv", activation_checkpointing="selective"),
        ValueError,
        ["schedule='zbv'", "activation_checkpointing='selective'", "activation_checkpointing=True"],
    ),
    (
        "pp-interleaved-microbatches",
        lambda: require([schedule_problem("interleaved_1f1b", 4, 9, 2)]),
        ValueError,
        ["equal rounds", "got 9: use 8 or 10"],
    ),
    (
        "pp-async-chunks-third-version",
        lambda: require([schedule_problem("async", 4, 4, 2)]),
        ValueError,
        ["virtual_stages=2", "num_microbatches=4", "third weight version", "num_microbatches >= 6"],
    ),
    (
        "pp-async-zero-chunks",
        lambda: lp.PipelineParallelStrategy(schedule="async", virtual_stages=0),
        ValueError,
        ["virtual_stages=0", "schedule='async'", ">= 1"],
    ),
    (
        "pp-no-stack",
        lambda: find_block_stack(nn.Linear(2, 2)),
        ValueError,
        ["no block stack", "nn.ModuleList"],
    ),
    (
        "pp-batch-too-small",
        lambda: split_microbatches((torch.zeros(3, 2),), 4),
        ValueError,
        ["batch of 3 samples", "num_microbatches=4"],
    ),
    (
        "pp-last-batch-too-small",
        lambda: require([loader_problem(258, 16, False, 4)]),
        ValueError,
        ["last batch holds 2 samples", "258", "batches of 16", "drop_last=True", "num_microbatches <= 2"],
    ),
    (
        "pp-batches-too-small",
        lambda: require([loader_problem(64, 2, True, 4)]),
        ValueError,
        ["batches hold 2 samples", "num_microbatches=4", "num_microbatches <= 2"],
    ),
    (
        "ep-size",
        lambda: lp.ParallelStrategy(expert_parallel_size=0),
        ValueError,
        ["expert_parallel_size must be a positive integer", "got 0"],
    ),
    (
        "ep-not-dividing-dp",
        lambda: lp.ParallelStrategy(data_parallel_size=4, expert_parallel_size=3),
        ValueError,
        ["expert_parallel_size=3 does not divide data_parallel_size=4", "use a divisor of 4"],
    ),
    (
        "ep-with-async-pipeline",
        lambda: lp.ParallelStrategy(
            data_parallel_size=2, pipeline_parallel_size=2, expert_parallel_size=2, schedule="async"
        ),
        ValueError,
        ["expert_parallel_size=2 with schedule='async'", "'1f1b'", "expert_parallel_size=1"],
    ),
    (
        "ep-on-pipeline-preset",
        lambda: lp.PipelineParallelStrategy(data_parallel_size=2, expert_parallel_size=2),
        ValueError,
        ["expert_parallel_size=2", "pipeline presets", "lp_parallel"],
    ),
    (
        "ep-with-save-distributed",
        lambda: lp.ParallelStrategy(data_parallel_size=2, expert_parallel_size=2, save_distributed=True),
        ValueError,
        [
            "expert_parallel_size=2 with save_distributed=True",
            "sharded checkpoints",
            "save_distributed=False",
        ],
    ),
    (
        "ep-no-experts",
        lambda: require([expert_parallel_problem(gpt(), 2)]),
        ValueError,
        ["expert_parallel_size=2", "no experts module", "use expert_parallel_size=1"],
    ),
    (
        "ep-experts-not-divisible",
        lambda: require([expert_parallel_problem(ZooLM(arch="mixtral"), 3)]),
        ValueError,
        [
            "expert_parallel_size=3 does not divide the 4 experts",
            "model.model.layers.0.mlp.experts",
            "[1, 2, 4]",
        ],
    ),
    # what the Trainer's devices decide: checked when the Trainer is built, before any process starts
    (
        "tp-more-than-the-devices",
        lambda: Trainer(
            accelerator="cpu", devices=2, strategy=lp.TensorParallelStrategy(tensor_parallel_size=3)
        ),
        ValueError,
        [
            "tensor_parallel_size=3 is more than the 2 process(es)",
            "tensor_parallel_size=2 or less",
            "3 or more devices",
        ],
    ),
    (
        "hsdp-shard-size-not-dividing-dp",
        lambda: Trainer(
            accelerator="cpu",
            devices=4,
            strategy=lp.DDPStrategy(zero_stage=3, data_parallel_shard_size=3),
        ),
        ValueError,
        [
            "data_parallel_shard_size=3 must divide the data-parallel size 4",
            "use one of [2, 4] (the devices per node on a multi-node run)",
            "null to shard over all 4",
        ],
    ),
    (
        "1f1b-fewer-microbatches-than-stages",
        lambda: Trainer(
            accelerator="cpu",
            devices=2,
            strategy=lp.PipelineParallelStrategy(schedule="1f1b", num_microbatches=1),
        ),
        ValueError,
        ["schedule='1f1b' needs num_microbatches >= the number of stages (2), got 1"],
    ),
    (
        "sequence-parallel-with-stages",
        lambda: Trainer(
            accelerator="cpu",
            devices=2,
            strategy=lp.ParallelStrategy(
                data_parallel_size=1, pipeline_parallel_size=None, sequence_parallel=True
            ),
        ),
        ValueError,
        ["sequence_parallel=True with pipeline_parallel_size=2"],
    ),
]


@pytest.mark.parametrize("name,make,exc,fragments", CATALOGUE, ids=[c[0] for c in CATALOGUE])
def test_misconfiguration_is_named(name, make, exc, fragments):
    with pytest.raises(exc) as err:
        make()
    for fragment in fragments:
        assert fragment in str(err.value), f"{fragment!r} not in: {err.value}"


LAUNCHED = """
import os, sys
from pathlib import Path

if os.environ.get("LOCAL_RANK", "0") != "0":
    Path(sys.argv[1], "rank1-started").touch()
from lightning.pytorch import Trainer

import lightning_parallel as lp
from tests.helpers.models import MLP, RegressionData

strategy = lp.TensorParallelStrategy(tensor_parallel_size=3)
trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
trainer.fit(MLP(), datamodule=RegressionData())
"""


def test_a_layout_the_devices_cannot_hold_fails_once_before_a_second_process_starts(tmp_path):
    """A user's script with ``devices=2``: the error is printed once, by the user's process, and rank 1 never
    starts (Lightning's launcher would re-run the script for it)."""
    import subprocess
    import sys
    import time

    from tests.helpers.harness import REPO, worker_env

    script = tmp_path / "train.py"
    script.write_text(LAUNCHED)
    env = {
        k: v
        for k, v in worker_env(0, 1).items()
        if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")
    }
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    seconds = time.monotonic() - start
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert output.count("tensor_parallel_size=3 is more than the 2 process(es)") == 1, output
    assert "rank 1" not in output and not (tmp_path / "rank1-started").exists(), output
    assert "Traceback" in output and output.count("Traceback") == 1, output
    print(f"failed after {seconds:.1f} s (an interpreter importing torch and Lightning)")
