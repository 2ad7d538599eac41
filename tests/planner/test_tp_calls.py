"""The tensor-parallel collectives the cost model charges a step, each block's and the rest's, which the
planner counts on one rank's shard in a dry run (``BlockCost.tp_calls``, ``ModelCost.other_tp_calls``),
against the collectives 2 real gloo ranks issue in a step of the same model with the same automatic plan
(``collectives.COUNTS``): the embedded CharGPT and a Hugging Face Llama.

The per-rank program is this module itself (``python -m tests.planner.test_tp_calls OUT NAME``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers.harness import REPO, run_program

BATCH, BLOCKS = 4, 2


def _char_gpt():
    from lightning_parallel.models.gpt import CharGPT

    return CharGPT(n_layer=BLOCKS, n_embd=32, n_head=4, block_size=16), None


def _hf_llama():  # as users hold one: its key/value cache on, as its config has it
    from tests.helpers.tp_models import TokenData
    from tests.helpers.zoo import ZooLM

    return ZooLM(arch="hf_llama", width=16, layers=BLOCKS), TokenData()


#: each model and its data module (None: the planner's own random tokens)
MODELS = {"char_gpt": _char_gpt, "hf_llama": _hf_llama}


def _model_and_step(name: str):
    from lightning_parallel.planner.planning import _sample_step

    torch.manual_seed(0)
    model, datamodule = MODELS[name]()
    step, *_ = _sample_step(model, datamodule, BATCH)
    return model, step


def rank_program(out: Path, name: str) -> None:
    from lightning_parallel.distributed.collectives import COUNTS
    from lightning_parallel.tensor import resolve
    from lightning_parallel.tensor.plan import apply_plan

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, step = _model_and_step(name)
    resolved = resolve(model, "auto", 2, run=step)
    apply_plan(model, resolved, None, dist.get_rank())
    step().backward()  # a first step: anything lazy happens here
    COUNTS.clear()
    step().backward()
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(sum(COUNTS.values())))
    dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:You are trying to `self.log")
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_step_issues_the_collectives_the_planner_counts(tmp_path, name):
    from lightning_parallel.planner.measure import measure_model

    model, step = _model_and_step(name)
    optimizer = torch.optim.AdamW(model.parameters())
    cost = measure_model(model, step, BATCH, optimizer, "adamw", repeats=1, tensor_parallel=[2])
    blocks, other = [dict(b.tp_calls)[2] for b in cost.blocks], dict(cost.other_tp_calls)[2]
    assert len(blocks) == BLOCKS and all(n > 0 for n in blocks)
    assert other > 0  # the vocabulary-parallel embedding's all-reduce, at least
    command = [sys.executable, "-m", "tests.planner.test_tp_calls", str(tmp_path), name]
    run_program(command, tmp_path, timeout=90)
    issued = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert issued[0] == issued[1] == sum(blocks) + other


if __name__ == "__main__":
    os.chdir(REPO)
    rank_program(Path(sys.argv[1]), sys.argv[2])
