"""The plan table: its per-rank parameter count is what each rank holds after the plan is applied
(the multi-process check of the same is in tests/strategies/test_tensor_parallel.py)."""

from __future__ import annotations

import pytest
import torch

from lightning_parallel.cli.plan_table import STRUCTURAL, main
from lightning_parallel.tensor import apply_plan, resolve
from lightning_parallel.tensor.table import collectives_per_step, format_table, params_per_rank, plan_rows
from tests.helpers.harness import REPO
from tests.helpers.models import MLP
from tests.helpers.tp_models import EncoderRegressor, SmallGPT, TokenData
from tests.helpers.zoo import ZooLM


@pytest.mark.parametrize(
    "make, plan",
    [
        (SmallGPT, "auto"),
        (SmallGPT, REPO / "conf/plan/char_gpt.yaml"),
        (EncoderRegressor, "auto"),
        (MLP, REPO / "conf/plan/mlp.yaml"),
    ],
)
@pytest.mark.parametrize("tp", [2, 4])
def test_params_per_rank_equal_what_each_rank_holds(make, plan, tp):
    module = make()
    expected = params_per_rank(module, resolve(module, plan, tp))
    for rank in range(tp):
        sharded = make()
        apply_plan(sharded, resolve(sharded, plan, tp), group=None, tp_rank=rank)
        assert sum(p.numel() for p in sharded.parameters()) == expected


def test_megatron_collective_count_for_the_gpt():
    module = SmallGPT(n_layer=3)
    rows = plan_rows(module, resolve(module, REPO / "conf/plan/char_gpt.yaml", 2))
    fwd, bwd = collectives_per_step(rows)
    # 2 all-reduces forward and 2 backward per block, + token embedding (fwd) + gathered head (fwd and bwd)
    assert (fwd, bwd) == (2 * 3 + 2, 2 * 3 + 1)


def test_cli_prints_the_table(capsys):
    assert main(["lightning_parallel.models.gpt:CharGPT", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "model.blocks.1.attn.proj  rowwise" in out and "TOTAL" in out and "per rank" in out
    assert main(["tests.helpers.models:MLP", "--tp", "3"]) == 0  # 32 hidden units: nothing splits over 3
    assert "replicated net.0" in capsys.readouterr().out


def test_cli_traces_the_first_batch_of_a_data_module(capsys):
    args = [
        "tests.helpers.zoo:ZooLM",
        "--kwargs",
        '{"arch": "hf_gpt2"}',
        "--data",
        "tests.helpers.tp_models:TokenData",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "model.transformer.h.1.attn.c_attn  colwise" in out and "split_size: 16 -> 8" in out
    assert out.startswith("traced: training_step on the first batch of tests.helpers.tp_models:TokenData")
    assert main(args[:3]) == 0  # no batch, no example_input_array: the structural rules leave GPT-2 whole
    out = capsys.readouterr().out
    assert "model.transformer.h.1.attn.c_attn  colwise" not in out and not out.startswith("traced:")
    assert out.rstrip().endswith(STRUCTURAL)  # said, with how to trace, below the numbers it qualifies
    assert "--data package.module:DataModule" in STRUCTURAL and "example_input_array" in STRUCTURAL


class ExampleLM(ZooLM):
    """GPT-2 with an ``example_input_array``."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.example_input_array = torch.randint(0, 32, (2, 8))


class OwnLoaderLM(ZooLM):
    """GPT-2 whose LightningModule has its own ``train_dataloader``."""

    def train_dataloader(self):
        return TokenData().train_dataloader()


@pytest.mark.parametrize(
    "target, traced",
    [
        ("ExampleLM", "traced: forward on the module's example_input_array"),
        ("OwnLoaderLM", "traced: training_step on the first batch of the module's train_dataloader"),
    ],
)
def test_cli_traces_without_data_when_the_module_has_a_sample(capsys, target, traced):
    assert main([f"tests.tensor.test_table:{target}", "--kwargs", '{"arch": "hf_gpt2"}']) == 0
    out = capsys.readouterr().out
    assert out.startswith(traced) and STRUCTURAL not in out
    assert "model.transformer.h.1.attn.c_attn  colwise" in out


def test_cli_reports_plan_errors(capsys):
    assert main(["tests.helpers.models:MLP", "--plan", str(REPO / "conf/plan/char_gpt.yaml")]) == 2
    assert "matches no module of the model" in capsys.readouterr().err


def test_format_table_lists_attributes_and_report():
    module = SmallGPT()
    text = format_table(module, resolve(module, "auto", 2))
    assert "attribute model.blocks.0.attn.n_head: 4 -> 2 per rank" in text
    assert "replicated model.head" in text
