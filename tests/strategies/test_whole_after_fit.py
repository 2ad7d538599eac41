"""The module a user passes to ``fit`` comes back whole, in place, on one process: the objects the user holds
stay theirs, the split layers become the user's layers again, ``validate`` splits it again and gives it back,
and a module that cannot be copied before the split stays split and says so. (The comparisons with one
device on several processes, for every strategy, are in each strategy's equivalence tests:
``tests.helpers.harness.assert_given_back_whole``.)"""

from __future__ import annotations

import threading

import pytest
import torch
from lightning.pytorch import Trainer
from torch import nn

import lightning_parallel as lp
from lightning_parallel.strategies.whole_model import ShardedModuleError
from tests.helpers.models import MLP, RegressionData


def _trainer(strategy, tmp_path) -> Trainer:
    return Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=2,
        precision="64-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1,
        default_root_dir=tmp_path,
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "strategy",
    [lambda: lp.TensorParallelStrategy(plan="auto"), lambda: lp.PipelineParallelStrategy(num_microbatches=2)],
    ids=["tensor_parallel", "pipeline"],
)
def test_the_module_passed_in_is_given_back_in_place(strategy, tmp_path):
    model, data = MLP(), RegressionData()
    net, first = model.net, model.net[0]
    trainer = _trainer(strategy(), tmp_path)
    trainer.fit(model, datamodule=data)
    assert model.net is net  # what the user holds is the module trained
    assert type(model.net[0]) is nn.Linear and model.net[0].weight.shape == first.weight.shape
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in MLP().named_parameters()]
    optimizer = trainer.optimizers[0]
    assert [p for g in optimizer.param_groups for p in g["params"]] == list(model.parameters())
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.validate(model, datamodule=data, verbose=False)  # split again while it runs, whole after
    assert model.net is net and type(model.net[0]) is nn.Linear
    assert [p for g in optimizer.param_groups for p in g["params"]] == list(model.parameters())
    assert all(torch.equal(trained[k], v) for k, v in model.state_dict().items())
    plain = MLP().double()
    plain.load_state_dict(trained)
    with torch.no_grad():
        x = data.dataset.tensors[0][:2]
        assert torch.equal(model(x), plain(x))  # a forward of one device, no collective


class UncopyableMLP(MLP):
    """An MLP whose network holds something ``copy.deepcopy`` refuses (a lock)."""

    def __init__(self) -> None:
        super().__init__()
        self.net.lock = threading.Lock()


@pytest.mark.timeout(300)
def test_a_module_that_cannot_be_copied_stays_split_and_says_so(tmp_path):
    model = UncopyableMLP()
    trainer = _trainer(lp.TensorParallelStrategy(plan="auto"), tmp_path)
    trainer.fit(model, datamodule=RegressionData())
    for call in (model.state_dict, lambda: model(torch.zeros(2, 16, dtype=torch.float64))):
        with pytest.raises(ShardedModuleError, match="could not be copied before the split") as error:
            call()
        assert "trainer.save_checkpoint" in str(error.value) and "load_from_checkpoint" in str(error.value)
    trainer.save_checkpoint(tmp_path / "model.ckpt")  # whole, as the message says
    MLP().load_state_dict(torch.load(tmp_path / "model.ckpt", weights_only=False)["state_dict"])


@pytest.mark.timeout(300)
def test_tied_weights_stay_tied(tmp_path):
    """Hugging Face GPT-2's lm_head is its wte: one parameter after fit, as before it, in the optimizer too."""
    pytest.importorskip("transformers")
    from tests.helpers.tp_models import TokenData
    from tests.helpers.zoo import ZooLM

    model = ZooLM(arch="hf_gpt2")
    trainer = _trainer(lp.TensorParallelStrategy(plan="auto"), tmp_path)
    trainer.fit(model, datamodule=TokenData(batch_size=8))
    assert model.model.lm_head.weight is model.model.transformer.wte.weight
    assert [p for g in trainer.optimizers[0].param_groups for p in g["params"]] == list(model.parameters())
