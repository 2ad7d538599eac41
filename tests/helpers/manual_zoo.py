"""A zoo model trained by manual optimization (``automatic_optimization=False``), as a user who steps the
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
