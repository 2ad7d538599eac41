"""The package's saved-tensor hooks (``memory.saved.SavedHooks``): a forward whose backward never runs
leaves nothing alive under any of them, they stack on the hooks below them, and they count once."""

from __future__ import annotations

import gc
import weakref
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_parallel  # noqa: F401  (registers lp_ddp)
from lightning_parallel.memory import SavedTensorCounter
from lightning_parallel.memory.saved import SavedHooks, can_stack
from lightning_parallel.pipeline.executor import weights_snapshot
from lightning_parallel.tensor.sequence_saved import SavedAsPart


@contextmanager
def _counting() -> Iterator[SavedTensorCounter]:
    counter = SavedTensorCounter()
    counter.start()
    try:
        yield counter
    finally:
        counter.stop()


@contextmanager
def _region(model: nn.Module) -> Iterator[None]:
    """A sequence-parallel region on one process, whose gathered input is the model's input."""
    saved = SavedAsPart(None, 0)
    handles = [
        model.register_forward_pre_hook(lambda m, args: saved.enter(args[0], args[0])),
        model.register_forward_hook(lambda m, args, out: saved.exit()),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


HOOKS: dict[str, Callable[[nn.Module], object]] = {
    "counter": lambda model: nullcontext(),
    "weights_snapshot": lambda model: weights_snapshot(list(model.parameters())),
    "sequence_parallel_region": _region,
}


@pytest.mark.parametrize("hooks", list(HOOKS))
def test_outputs_of_forwards_without_backward_are_freed(hooks) -> None:
    """``Sigmoid`` saves its own output: a pack hook that stores that tensor object itself makes a cycle
    (output -> grad_fn -> saved output) that ``gc`` cannot free."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Sigmoid())
    alive = []
    with _counting(), HOOKS[hooks](model):
        for _ in range(50):
            out = model(torch.randn(4, 8, requires_grad=True))
            alive.append(weakref.ref(out))
            del out
    gc.collect()
    assert sum(ref() is not None for ref in alive) == 0


STACKS = pytest.mark.skipif(not can_stack(), reason="this torch cannot read the saved-tensor hooks below")


@STACKS
def test_a_hook_inside_another_hands_what_it_stores_down() -> None:
    """Stacked hooks both apply, and what is stored is counted once."""
    seen = []

    def pack(t):
        seen.append(t)
        return t.detach()

    x = torch.randn(4, 8, requires_grad=True)
    with _counting() as counter:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # stores what it is given
            with SavedHooks(below_stores=True):
                y = torch.sigmoid(x)
    assert len(seen) == 1 and seen[0] is y
    assert counter.peak == y.numel() * y.element_size()
    y.sum().backward()
    torch.testing.assert_close(x.grad, (y * (1 - y)).detach())


@STACKS
def test_inside_a_checkpoint_a_package_hook_stores_and_counts_nothing() -> None:
    """Torch's checkpoint keeps only the inputs: a package hook inside it (a sequence-parallel region in a
    checkpointed block) must not store the region's tensors for real."""
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 8))

    def run(x):
        with SavedHooks():
            return model(x)

    x = torch.randn(16, 8, requires_grad=True)
    with _counting() as counter:
        y = torch.utils.checkpoint.checkpoint(run, x, use_reentrant=False)
        forward_peak = counter.peak
    assert forward_peak == x.numel() * x.element_size()  # the checkpoint's input alone
    y.sum().backward()
    expected = torch.autograd.grad(model(x).sum(), x)[0]
    torch.testing.assert_close(x.grad, expected)


class _DroppingSteps(LightningModule):
    """Manual optimization where every other step drops its graph (no backward), its outputs watched."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.layer = nn.Linear(16, 16)
        self.outputs: list[weakref.ref] = []

    def training_step(self, batch, batch_idx):
        out = torch.sigmoid(self.layer(batch[0]))
        self.outputs.append(weakref.ref(out))
        if batch_idx % 2 == 0:
            return None
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(out.sum())
        optimizer.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.timeout(120)
def test_a_manual_step_that_drops_its_graph_leaves_nothing_alive_under_the_memory_report(tmp_path) -> None:
    model = _DroppingSteps()
    data = DataLoader(TensorDataset(torch.randn(64, 16)), batch_size=4)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy="lp_ddp",  # memory_report=True: the counter's pack hook runs in the counted steps
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    try:
        trainer.fit(model, data)
    finally:  # the fit ran in this process: leave no process group to the tests after it
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    gc.collect()
    assert len(model.outputs) == 16 and sum(ref() is not None for ref in model.outputs) == 0
