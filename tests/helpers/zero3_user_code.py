"""What users run in their hooks, written as they write it, for ``zero_stage=3``: ``UserCode`` after every
``every``-th training batch

- on rank 0 alone (``if trainer.is_global_zero``), a forward (a sample) and ``state_dict()`` (what
  ``torch.save(pl_module.state_dict(), ...)`` under ``rank_zero_only`` reads): each either works (one device,
  ZeRO off) or raises; the error, its type and how long it took are recorded, and training goes on (left out
  with ``attempt=False``);
- then every rank enters ``trainer.strategy.parameters_gathered()`` (where the strategy has it), and inside it
  the forward runs (on rank 0 alone, ``forward="rank0"``; on every rank, ``"every"``: a tensor-parallel model's
  forward is itself a collective; ``"none"``: not at all) and rank 0 keeps the output and a copy of
  ``state_dict()``.

Everything runs without gradients and draws no random numbers: it changes nothing of what trains. At the
end of training each rank writes what it recorded to ``dirpath/user-code-rank{r}.pt``: ``{"attempts": [...],
"outputs": [...], "states": [...]}``.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback

__all__ = ["UserCode"]


def _attempt(call) -> dict:
    start = time.perf_counter()
    try:
        call()
        error = None
    except Exception as exc:  # the error is the result
        error = (type(exc).__name__, str(exc))
    return {"error": error, "seconds": time.perf_counter() - start}


class UserCode(Callback):
    def __init__(self, dirpath: str, every: int = 2, forward: str = "rank0", attempt: bool = True) -> None:
        self.dirpath, self.every, self.forward, self.attempt = Path(dirpath), every, forward, attempt
        self.attempts: list[dict] = []  # rank 0's calls outside parameters_gathered()
        self.outputs: list[torch.Tensor] = []  # rank 0's forward inside it
        self.states: list[dict[str, torch.Tensor]] = []  # rank 0's state_dict() inside it

    def _prompt(self, pl_module) -> torch.Tensor:
        return torch.arange(8, device=pl_module.device).remainder(pl_module.hparams.vocab_size).unsqueeze(0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (trainer.global_step % self.every) != 0:
            return
        prompt = self._prompt(pl_module)
        with torch.no_grad():
            if trainer.is_global_zero and self.attempt:
                self.attempts.append(
                    {
                        "forward": _attempt(lambda: pl_module(prompt)),
                        "state_dict": _attempt(pl_module.state_dict),
                    }
                )
            gathered = getattr(trainer.strategy, "parameters_gathered", contextlib.nullcontext)
            with gathered():
                runs = self.forward == "every" or (self.forward == "rank0" and trainer.is_global_zero)
                output = pl_module(prompt) if runs else None
                if trainer.is_global_zero:
                    if output is not None:
                        self.outputs.append(output.detach().clone())
                    self.states.append({k: v.detach().clone() for k, v in pl_module.state_dict().items()})

    def on_train_end(self, trainer, pl_module) -> None:
        self.dirpath.mkdir(parents=True, exist_ok=True)
        found = {"attempts": self.attempts, "outputs": self.outputs, "states": self.states}
        torch.save(found, self.dirpath / f"user-code-rank{trainer.global_rank}.pt")
