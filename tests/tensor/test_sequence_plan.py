"""Where sequence parallelism cuts the sequence: found for ``plan="auto"`` from a fake step (or refused, naming
why), and a written plan's ``sequence`` section checked before anything runs. One process, fake tensors."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from lightning_parallel.models.gpt import GPT
from lightning_parallel.tensor import PlanError, parse_plan, resolve
from lightning_parallel.tensor.sample import forward_on
from lightning_parallel.tensor.sequence_plan import auto_sequence_plan, resolve_sequence, sequence_plan
from tests.helpers.harness import REPO
from tests.helpers.tp_models import EncoderRegressor
from tests.helpers.zoo import build

IDS = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))


class Wrapped(LightningModule):
    """A network held as ``self.model``, as users hold one."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)


def _gpt(block_forward=None) -> nn.Module:
    model = GPT(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16)
    if block_forward is not None:
        for block in model.blocks:
            block.forward = block_forward.__get__(block)
    return Wrapped(model)


def _auto(model: nn.Module, inputs: Tensor = IDS):
    model.example_input_array = inputs  # the step traced: forward on it
    run = forward_on(model)
    return auto_sequence_plan(model, resolve(model, "auto", 2, run=run), run)


def test_auto_finds_the_sequence_of_the_gpt():
    found, why = _auto(_gpt())
    assert found is not None, why
    assert (found.dim, found.enter, found.exits) == (1, "model.blocks.0", ("model.head",))
    assert found.regions == tuple(f"model.blocks.{i}.{m}" for i in (0, 1) for m in ("attn", "mlp"))
    assert "sequence dimension 1 (length 8)" in why


def _mean_over_sequence(self, x, mask):
    x = x + self.attn(self.ln1(x), mask)
    x = x - x.mean(1, keepdim=True)  # mixes the positions
    return x + self.mlp(self.ln2(x))


def _batchnorm_over_features(self, x, mask):
    x = x + self.attn(self.ln1(x), mask)
    x = self.bn(x.transpose(1, 2)).transpose(1, 2)  # statistics over batch and sequence
    return x + self.mlp(self.ln2(x))


def _position_bias(self, x, mask):
    x = x + self.attn(self.ln1(x), mask) + self.bias  # [T, C]: one row per position
    return x + self.mlp(self.ln2(x))


def _functional_dropout(self, x, mask):
    x = x + nn.functional.dropout(self.attn(self.ln1(x), mask), 0.1, self.training)
    return x + self.mlp(self.ln2(x))


def test_auto_refuses_operations_that_mix_positions():
    found, why = _auto(_gpt(_mean_over_sequence))
    assert found is None and "mean in 'model.blocks.0'" in why and "reduces over the sequence" in why, why
    model = _gpt(_batchnorm_over_features)
    for block in model.model.blocks:
        block.bn = nn.BatchNorm1d(16)
    found, why = _auto(model)
    assert found is None and "BatchNorm" in why, why
    model = _gpt(_position_bias)
    for block in model.model.blocks:
        block.bias = nn.Parameter(torch.zeros(8, 16))
    found, why = _auto(model)
    assert found is None and "combines the sequence with a tensor of shape (8, 16)" in why, why
    found, why = _auto(_gpt(_functional_dropout))
    assert found is None and "bernoulli" in why and "a functional dropout" in why, why


def _norm_twice(self, idx):
    x = self.ln_f(self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1])))  # ln_f on whole sequences
    mask = torch.ones(idx.shape[1], idx.shape[1], dtype=torch.bool).tril()
    for block in self.blocks:
        x = block(x, mask)
    return self.head(self.ln_f(x))  # and on the parts


def test_auto_refuses_a_module_used_on_whole_sequences_and_on_parts():
    model = _gpt()
    model.model.forward = _norm_twice.__get__(model.model)
    found, why = _auto(model)
    assert found is None and "'model.ln_f' runs both on the sequence shards" in why, why


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.mlp(self.norm(x))


class FlatNet(nn.Module):
    """Residual MLP blocks on [batch, features]: no sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Residual() for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_auto_refuses_a_model_without_a_sequence_and_multihead_attention():
    found, why = _auto(Wrapped(FlatNet()), torch.randn(4, 16))
    assert found is None and "no sequence dimension" in why and "(4, 16)" in why, why
    model = EncoderRegressor().double()
    found, why = _auto(model, torch.randn(4, 6, 16, dtype=torch.float64))
    assert found is None and "nn.MultiheadAttention" in why, why


def test_a_written_plan_states_the_sequence_and_is_checked():
    plan = parse_plan(REPO / "conf/plan/char_gpt.yaml")
    model = _gpt()
    resolved = resolve(model, plan, 2)
    found = sequence_plan(model, resolved, {"dim": 1, "exit": "model.head"})
    assert (found.enter, found.exits) == ("model.blocks.0", ("model.head",))
    with pytest.raises(PlanError, match=r"dim=-1 must be the sequence dimension.*1 for \[batch, sequence"):
        parse_plan({"layers": {"model.head": "colwise"}, "sequence": {"dim": -1}})
    with pytest.raises(PlanError, match=r"unknown key\(s\) \['dims'\]; allowed: dim, enter, exit"):
        parse_plan({"sequence": {"dims": 1}})
    with pytest.raises(PlanError, match="closest module names"):
        sequence_plan(model, resolved, {"exit": "model.heads"})
    no_head = resolve(model, {k: v for k, v in plan_dict().items() if k != "model.head"}, 2)
    assert sequence_plan(model, no_head, {}).exits == ("model.head",)  # the last Linear: gathered whole
    del model.model.head
    with pytest.raises(PlanError, match=r"sequence: \{exit: model.head\}"):
        sequence_plan(model, no_head, {})


def test_a_written_plan_is_tried_on_the_sample_step_before_training():
    model = _gpt()
    plan = parse_plan(REPO / "conf/plan/char_gpt.yaml")
    odd = torch.randint(0, 32, (4, 7))
    model.example_input_array = odd
    with pytest.raises(
        PlanError, match=r"sequence length 7 \(dimension 1 .*not divisible by tensor_parallel_size=2"
    ):
        resolve_sequence(model, resolve(model, plan, 2), plan, forward_on(model))
    model.example_input_array = IDS
    plan.sequence = {"dim": 3}
    with pytest.raises(
        PlanError, match=r"has shape \(4, 8, 16\): no sequence dimension.*sequence: \{dim: ...\}"
    ):
        resolve_sequence(model, resolve(model, plan, 2), plan, forward_on(model))


def test_the_written_llama_plan_has_its_pairs_as_regions():
    from tests.helpers.zoo import ZooLM

    model = ZooLM("hf_llama")
    found = sequence_plan(model, resolve(model, REPO / "conf/plan/hf_llama.yaml", 2))
    assert (found.enter, found.exits) == ("model.model.layers.0", ("model.lm_head",))
    assert found.regions[:2] == ("model.model.layers.0.mlp", "model.model.layers.0.self_attn")


def plan_dict() -> dict:
    import yaml

    spec = yaml.safe_load((REPO / "conf/plan/char_gpt.yaml").read_text())
    return {**spec["layers"], **spec["attributes"]}


def test_whole_block_recompute_is_refused_where_torch_cannot_stack_saved_tensor_hooks(tmp_path, monkeypatch):
    from lightning.pytorch import Trainer

    from lightning_parallel import TensorParallelStrategy
    from lightning_parallel.strategies import parallel
    from tests.helpers.tp_models import SmallGPT, TokenData

    monkeypatch.setattr(parallel, "can_stack", lambda: False)  # torch 2.5 lacks the function it reads
    strategy = TensorParallelStrategy(sequence_parallel=True, activation_checkpointing=True)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    with pytest.raises(
        ValueError, match="activation_checkpointing=True needs a torch whose saved-tensor hooks"
    ):
        trainer.fit(SmallGPT(), datamodule=TokenData())


def test_the_plan_table_shows_the_collectives_with_and_without_sequence_parallel(capsys):
    from lightning_parallel.cli.plan_table import main

    args = ["tests.helpers.tp_models:SmallGPT", "--tp", "2", "--plan", "char_gpt", "--sequence-parallel"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "model.blocks.0.attn       sequence gather  -             0            all-gather 16/tok" in out
    assert "reduce-scatter 16/tok                 all-gather 16/tok" in out  # a row-parallel layer
    # per block: 2 all-gathers + 2 reduce-scatters each way (+ 2 all-gathers of the saved parts) instead of
    # 2 all-reduces
    assert "collectives per step 11 forward + 14 backward, without it 6 + 5" in out


def test_a_plan_with_split_experts_is_refused():
    model = build("mixtral")
    resolved = resolve(model, "auto", 2)
    with pytest.raises(PlanError, match=r"does not cover the experts .*model\.layers\.0\.mlp\.experts"):
        sequence_plan(model, resolved)
