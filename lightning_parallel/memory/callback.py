"""``MemoryReport``: the memory table of every rank after set-up and at the end of ``fit``.

A Lightning callback, so that it works under any strategy, Lightning's own included. Every
lightning_parallel strategy holds one too (``memory_report=True``) and calls the same hooks from its own;
that one stays silent when the Trainer has a ``MemoryReport`` among its callbacks, so a run prints one
table. Saved activations are counted in a sample, the optimizer steps ``COUNTED_STEPS`` (the first two:
a pipeline that keeps a batch's activations into the next step is counted at its steady state), not on
every step: the count costs a lookup and a finalizer per saved tensor. The tables' titles name the sample.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_parallel.memory.accounting import (
    ModelSize,
    cuda_allocated,
    model_size,
    peak_rss_bytes,
    rss_bytes,
)
from lightning_parallel.memory.expected import StateBytes, model_state_bytes, optimizer_kind
from lightning_parallel.memory.report import RankMemory, SetupFigures, as_dicts, format_table, measure_rank
from lightning_parallel.memory.saved import SavedTensorCounter

__all__ = ["MemoryReport", "report_of", "expected_states", "COUNTED_STEPS"]

#: the optimizer steps (``trainer.global_step``) whose saved activations are counted, first and last
COUNTED_STEPS = (0, 1)

#: the moments a table is made, as named in the printed title and in ``summary.json``
AFTER_SETUP, END_OF_FIT = "after_setup", "end_of_fit"
_TITLES = {
    AFTER_SETUP: "after set-up (at the first training batch after the first optimizer step)",
    END_OF_FIT: "at the end of fit",
}


def _resident(device: torch.device) -> int:
    """What set-up growth is measured in: allocated bytes on a GPU, resident memory on the CPU."""
    cuda = cuda_allocated(device)
    return cuda["allocated"] if cuda else (rss_bytes() or 0)


def _created_baselines() -> dict[str, int]:
    """Resident memory now, and CUDA's allocated bytes where CUDA is already in use (else 0)."""
    in_use = torch.cuda.is_available() and torch.cuda.is_initialized()
    return {"cpu": rss_bytes() or 0, "cuda": torch.cuda.memory_allocated() if in_use else 0}


def _peak(device: torch.device) -> int:
    cuda = cuda_allocated(device)
    return cuda["max_allocated"] if cuda else peak_rss_bytes()


def _all_ranks(row: RankMemory) -> list[RankMemory]:
    """Every rank's row, in rank order (an object all-gather over the default group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [row]
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    return rows


class MemoryReport(Callback):
    """Prints, on rank 0, a table of every rank's memory after set-up and at the end of ``fit``.

    Columns (bytes, shown in B/KiB/MiB/GiB; docs/memory.md): the whole model's parameters, this rank's parameters,
    gradients and optimizer state (unique storages), the peak of the activations autograd saved in a step,
    the set-up's peak and growth, the process's peak and current resident memory, and the CUDA allocator's
    peaks on a GPU. ``tables`` holds the rows of each table made (``"after_setup"``, ``"end_of_fit"``).

    Args:
        defer_to_callback: stay silent when the Trainer has another ``MemoryReport`` among its callbacks
            (how a strategy's own report gives way to the user's).
    """

    def __init__(self, defer_to_callback: bool = False) -> None:
        self.defer_to_callback = defer_to_callback
        self.counter = SavedTensorCounter()
        self.tables: dict[str, list[RankMemory]] = {}
        self._created = _created_baselines()
        self._at_setup: Optional[int] = None
        self._model = ModelSize()
        self._setup: Optional[SetupFigures] = None
        #: the first and last optimizer step whose saved activations were counted
        self.counted: Optional[tuple[int, int]] = None

    def active(self, trainer: Trainer) -> bool:
        """Whether this report measures and prints in ``trainer`` (False where it defers to a callback)."""
        return not self.defer_to_callback or not any(
            isinstance(c, MemoryReport) and c is not self for c in trainer.callbacks
        )

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Before the strategy sets the model up: the baseline and the whole model's size."""
        if trainer.state.fn != TrainerFn.FITTING or not self.active(trainer):
            return
        self._at_setup = _resident(trainer.strategy.root_device)
        self._model = model_size(pl_module.parameters())
        self._setup, self.tables, self.counter, self.counted = None, {}, SavedTensorCounter(), None

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """The first batch reads the set-up's figures and starts counting; the first batch after the first
        optimizer step (when the optimizer state exists) prints the set-up table; the first batch after
        ``COUNTED_STEPS`` stops counting."""
        if not self.active(trainer):
            return
        if self._setup is None:
            self._read_setup(trainer.strategy.root_device)
            self.counter.ignore(
                [*pl_module.parameters(), *pl_module.buffers(), *gathered_parameters(trainer.strategy)]
            )
            self.counter.start()
            self.counted = (trainer.global_step, trainer.global_step)
        if trainer.global_step >= 1 and AFTER_SETUP not in self.tables:
            self.report(trainer, pl_module, AFTER_SETUP)
        if self.counter.counting:
            if trainer.global_step > self.counted[0] + COUNTED_STEPS[1] - COUNTED_STEPS[0]:
                self.counter.stop()
            else:
                self.counted = (self.counted[0], trainer.global_step)

    def _read_setup(self, device: torch.device) -> None:
        peak, created = _peak(device), self._created["cuda" if device.type == "cuda" else "cpu"]
        at_setup = self._at_setup if self._at_setup is not None else created
        self._setup = SetupFigures(peak, max(peak - at_setup, 0), max(peak - created, 0))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Stop counting; print the set-up table if no step reached it, then the end-of-fit table."""
        self.counter.stop()
        if not self.active(trainer) or self._setup is None:
            return
        if AFTER_SETUP not in self.tables:
            self.report(trainer, pl_module, AFTER_SETUP)
        self.report(trainer, pl_module, END_OF_FIT)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """A failed fit leaves no counting hook behind."""
        self.counter.stop()

    def report(self, trainer: Trainer, pl_module: LightningModule, when: str) -> list[RankMemory]:
        """Measure this rank, gather every rank's row (a collective: every rank calls it), print on rank 0."""
        assert self._setup is not None
        row = measure_rank(
            trainer.global_rank,
            pl_module,
            trainer.optimizers,
            self._model,
            self.counter.peak,
            self._setup,
            trainer.strategy.root_device,
            held_gradients(trainer.strategy),
            held_parameters(trainer.strategy),
            expected_states(trainer, pl_module),
            released_parameters(trainer.strategy),
        )
        self.tables[when] = _all_ranks(row)
        rank_zero_info(format_table(self.tables[when], f"{_TITLES[when]}; {self.counted_text()}"))
        return self.tables[when]

    def counted_text(self) -> str:
        """Which steps the activations column counted, as the tables' titles say it."""
        first, last = self.counted or (0, 0)
        steps = f"step {first}" if first == last else f"steps {first}-{last}"
        return f"activations: peak saved in {steps}"

    def summary(self) -> dict[str, list[dict[str, Any]]]:
        """The tables made so far as plain dictionaries (bytes), keyed by when they were made."""
        return {when: as_dicts(rows) for when, rows in self.tables.items()}


def held_gradients(strategy: Any) -> list[torch.Tensor]:
    """The gradient memory a strategy's data-parallel paths hold (a lightning_parallel reducer's buckets or
    ranges: the dp reducer's, and the experts' over their replicas)."""
    reducers = (getattr(strategy, "reducer", None), getattr(strategy, "expert_reducer", None))
    return [t for r in reducers if hasattr(r, "gradient_tensors") for t in r.gradient_tensors()]


def expected_states(trainer: Trainer, module: LightningModule) -> Optional[int]:
    """The parameters, gradients and optimizer state this rank should hold by ``memory.expected``'s formulas:
    its share is the floating-point parameters it holds (as the strategy placed them), over the strategy's
    data-parallel size (HSDP: its shard size) and ``zero_stage``. None where that is not known: several
    optimizers, an optimizer without a formula, expert parallelism with ZeRO (the experts shard over fewer
    replicas), or a strategy that shards what this report cannot read (Lightning's FSDP; parameters that are
    DTensors, as FSDP2's ``fully_shard`` under Lightning's ``ModelParallelStrategy`` leaves them, whose
    ``numel`` is the whole tensor's)."""
    strategy, optimizers = trainer.strategy, trainer.optimizers
    params = [p for p in module.parameters() if p.is_floating_point() and p.device.type != "meta"]
    mesh, stage = getattr(strategy, "mesh", None), getattr(strategy, "zero_stage", 0)
    if len(optimizers) != 1 or not params or "fsdp" in type(strategy).__name__.lower():
        return None
    if any(isinstance(getattr(p, "_local_tensor", None), torch.Tensor) for p in params):
        return None
    if stage and getattr(strategy, "expert_parallel_size", 1) > 1:
        return None
    try:
        kind = optimizer_kind(optimizers[0])
    except ValueError:
        return None
    dp = mesh.shape.size("dp_shard") if mesh is not None else trainer.world_size  # what ZeRO shards over
    size = params[0].dtype.itemsize
    elements = sum(p.numel() for p in params)  # ZeRO-3 keeps each parameter's whole shape (a view)
    return int(model_state_bytes(elements, dp, stage, kind, StateBytes(size, size, 0, size)).total)


def held_parameters(strategy: Any) -> list[torch.Tensor]:
    """The parameter memory a strategy holds beside the module's parameters (ZeRO-3's shards)."""
    held = getattr(strategy, "held_parameters", None)
    return held() if callable(held) else []


def gathered_parameters(strategy: Any) -> list[torch.Tensor]:
    """The storages ZeRO-3's parameters lie in while gathered (its units' flat buffers): saved by autograd,
    they are parameters, not activations."""
    return [t for shards in getattr(strategy, "parameter_shards", ()) for t in shards.flat_buffers()]


def released_parameters(strategy: Any) -> list[torch.Tensor]:
    """Parameter storages whose pages the strategy handed back (ZeRO-3's freed units on the CPU)."""
    sharded = getattr(strategy, "sharded_parameters", None)
    released = getattr(sharded, "released_tensors", None)
    return released() if callable(released) else []


def report_of(trainer: Trainer) -> Optional[MemoryReport]:
    """The report that measures in ``trainer``: a ``MemoryReport`` callback, else the strategy's own."""
    found = [c for c in trainer.callbacks if isinstance(c, MemoryReport)]
    own = getattr(trainer.strategy, "memory", None)
    return found[0] if found else own if isinstance(own, MemoryReport) else None
