"""Zoo models trained by manual optimization (``automatic_optimization=False``), as a user who steps the
optimizer themselves writes it: ``plan="auto"`` must trace its ``training_step`` as it does an automatic one."""

from __future__ import annotations

from torch import Tensor

from tests.helpers.zoo import ZooLM


class ManualZooLM(ZooLM):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = self.loss(batch)
        self.manual_backward(loss)
        optimizer.step()
        self.log("train_loss", loss)
        return loss.detach()


class TwoBackwardsZooLM(ZooLM):
    """A zoo model under manual optimization with two backwards per step: each half of the batch goes through
    its own forward and ``manual_backward`` (loss halved), then one ``step()``, so a step's gradient is the
    whole batch's as for ``ZooLM`` trained automatically (the second forward runs after the first backward)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        optimizer = self.optimizers()
        losses = []
        for half in zip(*(t.chunk(2) for t in batch)):
            loss = self.loss(half)
            self.manual_backward(loss / 2)
            losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        return sum(losses) / 2
