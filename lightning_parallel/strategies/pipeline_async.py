"""The ``async`` pipeline schedule (PipeDream-2BW) in Lightning's terms: a mixin of
``PipelineParallelStrategy`` (it uses that class's executor, log mirror and ``_run``/``_show``).

The schedule never flushes between batches: batch t+1's first forwards run in batch t's cool-down, and
the optimizer step at the end of step t applies batch t-1's gradient. Its rule, one step stale, the
same weight version on every stage for every micro-batch: ``W(t+1) = W(t) - lr * grad f_t(W(t-1))``
(``W(-1) = W(0)``), with W(k) the weights after k updates. What that means for a Lightning user:

- the first step of a fit applies no update (nothing has finished yet; Lightning still counts it), and
  ``fit`` ends by applying the last batch's gradient, so N batches give N updates;
- values logged by ``training_step`` (and the loss passed to callbacks) at step t are batch t-1's, logged
  as ``pipeline_async_batch`` = t-1 beside them; the last step of an epoch flushes the pipeline and logs
  both its own batch and the previous one;
- the pipeline drains (finishes the in-flight backwards) before validation and before a checkpoint is
  written; the checkpoint holds the gradient not yet applied and the loss not yet shown, so a resumed
  run makes the same updates;
- gradient accumulation and a 16-mixed gradient scaler are refused (the strategy checks at set-up).

Nothing makes the stages wait for each other at a step's end: the gradients of the modules replicated on
every stage are summed over the stages by a reduction started when a batch's gradient is finished and
waited for when it is applied, a step later (``AsyncGradients``). A blocking all-reduce at the optimizer
step would hold stage 0 there until the last stage finished, and the last stage would then wait for
stage 0's first forward: a flush in all but name.

With ``virtual_stages`` v >= 2 chunks per rank (the looping placement) the stream is interleaved 1F1B's
with no flush: each step runs its batch's forwards in Megatron's round order and carries in the backwards
the batch before left (``schedules.async_step``). Two weight versions still suffice where every rank

1. runs all of batch t's forwards, on every chunk, before any of batch t+1's: its one optimizer step
   updates all its chunks at once, so a forward on the wrong side of it would run on the other version.
   The looping placement keeps a batch's rounds together, the last on the last chunk, so this holds;
2. ends batch t's backwards before batch t+2's first forward, which needs W(t+1) and so batch t's whole
   gradient; otherwise W(t-1) (batch t), W(t) (batch t+1) and W(t+1) would all be needed: a third version.
   Rank r runs ``(v-1) R + 2 (p-1-r)`` chunk forwards ahead of its backwards (``warmup_depth``, R the
   round), so this holds when rank 0's ``(v-1) R + 2 (p-1) <= m v``: every m >= 2p - 2 that the rounds
   allow. Others are refused at set-up (``schedules.schedule_problem``), with the reason.

The V placement (``zbv``'s) breaks 1 whatever m is: rank r's chunk-1 forward of a micro-batch comes
2(p-1-r)+1 stage forwards after its chunk-0 forward, and a busy rank runs batch t+1's chunk-0 forwards in
that gap; so async does not offer it (docs/pipeline.md, "Async with several chunks per rank").
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.distributed.mesh import new_axis_group
from lightning_parallel.distributed.replicas import start_sum_at
from lightning_parallel.pipeline.async_gradients import AsyncGradients, Reduce, merge_stage_gradients
from lightning_parallel.pipeline.executor import weights_snapshot
from lightning_parallel.pipeline.schedules import async_step, cooldown, warmup_depth

__all__ = ["AsyncPipelineMixin"]


class AsyncPipelineMixin:
    """The no-flush stream, its drains, the last update at the end of fit, and its resume state."""

    def _init_async_state(self) -> None:
        self.async_grads = AsyncGradients()
        self._summary_due = False  # the last step's summary is still to be logged
        self._held_summary: Optional[dict] = None  # that summary, taken early (for a checkpoint)

    def _async_step(self, params: list, batch: Any, step_fn: Any, batch_idx: int) -> Optional[Tensor]:
        """One piece of the no-flush stream; the gradient it hands the optimizer is the previous batch's."""
        here = (self.mesh.shape.pp, self.num_microbatches, self.mesh.pp_rank)
        v = self.virtual_stages
        self._place_checkpoint_gradient()
        depth = warmup_depth(*here, v)
        carried = depth if self.executor.has_in_flight else 0
        flush = self._last_step_before_a_pause()
        actions = async_step(*here, carried, v) + (cooldown(*here, 0, v) if flush else [])
        self.async_grads.begin(params, carried)
        keeps_graphs = not flush and depth > 0
        with (
            weights_snapshot(params) if keeps_graphs else nullcontext()
        ):  # graphs left in flight keep this step's weights
            self._run(
                actions,
                batch,
                step_fn,
                backward=True,
                flushed=flush,
                batch_idx=batch_idx,
                before_backward=lambda a: self.async_grads.before_backward(params, a.batch),
            )
        # a stage that keeps no micro-batch in flight (the last) has finished this batch even without a flush
        apply_now = self.async_grads.end(params, finished=not self.executor.has_in_flight)
        self._set_aside = apply_now or []
        shown = []
        if self._summary_due:
            shown.append(self._take_due_summary())
        if flush:
            shown.append(self.logs.take("train"))
        self._summary_due = not flush
        losses = [self._show(summary) for summary in shown]
        if apply_now is None or (not losses and self._last_loss is None):
            # nothing finished yet (the optimizer step finds no gradient), or no loss known (just resumed)
            return torch.tensor(float("nan"), dtype=torch.float64, device=self.root_device)
        return losses[0] if losses else self._last_loss

    def _take_due_summary(self) -> dict:
        """The previous step's summary: held since a checkpoint, or read from the last stage now."""
        summary = self._held_summary if self._held_summary is not None else self.logs.take("train")
        self._held_summary, self._summary_due = None, False
        return summary

    def _last_step_before_a_pause(self) -> bool:
        """Whether the pipeline must flush in this step: the epoch or the fit ends after it."""
        trainer = self.lightning_module.trainer
        loop = trainer.fit_loop.epoch_loop
        return bool(
            loop.batch_progress.is_last_batch
            or loop.batch_idx + 1 >= trainer.num_training_batches
            or 0 <= trainer.max_steps <= trainer.global_step + 1
        )

    def drain(self) -> None:
        """async: finish the backwards still in flight; their gradient waits for the next optimizer step."""
        if self.executor is None or not self.executor.has_in_flight:
            return
        params = list(self.lightning_module.parameters())
        earlier = [p.grad for p in params]
        self.async_grads.drain(params)
        here = (self.mesh.shape.pp, self.num_microbatches, self.mesh.pp_rank)
        actions = cooldown(*here, batch=-1, virtual_stages=self.virtual_stages)
        self.executor.run(actions, [], None, [0.0] * self.num_microbatches)
        self.async_grads.drained(params)
        for p, g in zip(params, earlier):
            p.grad = g

    def on_validation_start(self) -> None:
        """async: validation inside fit starts from a drained pipeline (nothing left in flight)."""
        self.drain()
        super().on_validation_start()

    def on_train_end(self) -> None:
        """async: the last batch's gradient is applied here, so N batches make N updates."""
        if self.schedule == "async" and self.partition is not None:
            self.drain()
            if self._summary_due:  # the last step's logs can no longer be shown; keep the channel clean
                self._take_due_summary()
            self._apply_pending_update()
        if self._bubbles_gathered is not None:  # the last step's bubbles: no step is left to log them
            self._bubbles_gathered()
            self._bubbles_gathered = None
        super().on_train_end()

    def _apply_pending_update(self) -> None:
        self._place_checkpoint_gradient()
        pending = self.async_grads.take_pending()
        if pending is None:
            return
        module = self.lightning_module
        for p, g in zip(module.parameters(), pending):
            p.grad = g
        self.post_backward(torch.zeros(()))
        for optimizer in self.optimizers:
            # through the precision plugin: unscaling (16-mixed), clipping and the optimizer hooks
            self.optimizer_step(optimizer, lambda: torch.zeros(()), module)
            optimizer.zero_grad()

    def _replicated_gradient_reduce(self, module: Any, replicated: list[int]) -> Reduce:
        """The sum over the stages of the gradients of the modules replicated on every stage, started when
        a batch's gradient is finished (``AsyncGradients``). It runs on a process group of its own: other
        collectives of the stages (clipping, checkpoints) come between its start and its end, and must
        not be paired with it."""
        group = new_axis_group(self.mesh.shape, "pp", self.global_rank)
        params = list(module.parameters())
        return lambda grads: start_sum_at(replicated, params, grads, group)

    def _place_checkpoint_gradient(self) -> None:
        """A resumed run's unapplied gradient (single-device names) becomes this stage's, once; every
        other step this is one check (the layout is built only when there is something to place)."""
        if self.async_grads.pending_by_name is None:
            return
        owned = set(self.partition.owned)
        named = list(self.lightning_module.named_parameters())
        self.async_grads.pending_by_name = self.cut_gradients(self.async_grads.pending_by_name)
        self.async_grads.place_from_checkpoint(
            named, {n for n, _ in named if n not in owned}, self.mesh.pp_rank == 0
        )

    def prepare_checkpoint(self) -> None:
        """Before a checkpoint's state is read: the async pipeline drains, so what is saved (full or sharded)
        holds no half-finished batch."""
        self.drain()

    def extra_resume_state(self) -> dict[str, Any]:
        """The async gradient not yet applied (single-device names), so a resumed run applies it, and the
        loss a resumed step shows: the summary still due, or (none due after an epoch's flush) the last one."""
        state: dict[str, Any] = {}
        if self.schedule != "async" or self.partition is None:
            return state
        self._place_checkpoint_gradient()
        pending = self.async_grads.pending
        names = [n for n, _ in self.lightning_module.named_parameters()]
        local = self.whole_gradients({n: g.detach() for n, g in zip(names, pending or []) if g is not None})
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, {n: g.cpu() for n, g in local.items()})
        if any(parts):
            state["async_pending_gradient"] = merge_stage_gradients(parts, self.mesh.shape.dp)
        if self._summary_due and self._held_summary is None:  # so the resumed step shows the right loss
            self._held_summary = self.logs.take("train")
        state["async_due_summary"] = self._held_summary
        state["async_last_loss"] = float(self._last_loss) if self._last_loss is not None else None
        return state

    def load_extra_resume_state(self, state: Mapping[str, Any]) -> None:
        if self.schedule == "async":
            self.async_grads.pending_by_name = state.get("async_pending_gradient")
            self._held_summary = state.get("async_due_summary")
            self._summary_due = self._held_summary is not None
            last = state.get("async_last_loss")
            self._last_loss = (
                torch.tensor(last, dtype=torch.float64, device=self.root_device) if last is not None else None
            )
