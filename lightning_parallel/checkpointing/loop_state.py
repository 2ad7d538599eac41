"""Two places where Lightning's own loop bookkeeping (2.6) breaks exact resume, and their repairs.

Both are covered by ``tests/reliability/test_resume.py`` (a rank SIGKILLed, ``fit(ckpt_path="last")``):

1. **A checkpoint saved after the epoch's last batch** (in ``on_train_epoch_end``, e.g. ``ModelCheckpoint(
   every_n_epochs=1)``) holds the epoch loop's per-epoch counters at the end of the epoch (``ready ==
   completed == batches per epoch``). With ``max_steps`` set the fit loop always "restarts" that epoch; with
   no validation to finish, the epoch loop then fetches one more batch, counted as batch ``N + 1`` of the old
   epoch: the data fetcher (offset by those counters) calls it the epoch's last batch, so the optimizer steps
   on it alone, whatever ``accumulate_grad_batches`` says, and the new epoch's data is cut after one batch
   (the sampler had already started the next epoch). The same save made one hook earlier, in the last
   batch's ``on_train_batch_end``, resumes correctly, so such a checkpoint's loop state is rewritten to that
   form on load (``normalize_epoch_end``): one batch and the epoch not yet completed, one fewer stepped
   batch (the restart adds it back).
2. **The step it resumed from is saved again.** ``ModelCheckpoint`` does not keep the step it last saved,
   so with ``every_n_train_steps=k`` and accumulation, the first resumed batch (a micro-batch of step k + 1,
   while ``global_step`` is still k) writes step k again, mid-accumulation, over ``last.ckpt``. Its gradient
   is in no checkpoint: a second kill resumes one micro-batch short. ``mark_step_saved`` tells the
   checkpoint callbacks that step k is saved (it is: it was just loaded). The preemption checkpoint uses it
   too, naming the ``last.ckpt`` it wrote: otherwise ``ModelCheckpoint(save_last=True)`` saves "last" again
   in ``on_train_end``, as ``last-v1.ckpt`` (the newest, so ``ckpt_path="last"`` picks it), and at an
   epoch's last batch that copy, made after the epoch ended, does not resume exactly.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint

__all__ = ["mark_step_saved", "normalize_epoch_end"]


def _saved_after_last_batch(batches: dict[str, Any], epochs: dict[str, Any]) -> bool:
    """Lightning's signature of a save in ``on_train_epoch_end``: every batch of the epoch completed
    (the last one included) and the epoch processed but not completed."""
    done = all(
        len({t["ready"], t["started"], t["processed"], t["completed"]}) == 1
        for t in (batches["total"], batches["current"])
    )
    epoch_end = all(
        t["ready"] == t["started"] == t["processed"] == t["completed"] + 1
        for t in (epochs["total"], epochs["current"])
    )
    return bool(batches.get("is_last_batch")) and batches["current"]["ready"] > 0 and done and epoch_end


def normalize_epoch_end(checkpoint: dict[str, Any]) -> bool:
    """Rewrite (in place) a checkpoint saved in ``on_train_epoch_end`` as if it had been saved in the last
    batch's ``on_train_batch_end``. Returns whether it did; other checkpoints are left alone."""
    fit = checkpoint.get("loops", {}).get("fit_loop")
    if not fit or "epoch_loop.batch_progress" not in fit or "epoch_progress" not in fit:
        return False
    batches, epochs = fit["epoch_loop.batch_progress"], fit["epoch_progress"]
    if not _saved_after_last_batch(batches, epochs):
        return False
    for tracker in (batches["total"], batches["current"]):
        tracker["completed"] -= 1  # the last batch's on_train_batch_end is where the restart picks up
    for tracker in (epochs["total"], epochs["current"]):
        tracker["processed"] -= 1  # the epoch is finished by the restart (fit loop: last batch, mid-epoch)
    loop_state = fit.get("epoch_loop.state_dict", {})
    if "_batches_that_stepped" in loop_state:
        loop_state["_batches_that_stepped"] -= 1  # the restart counts the last batch's step again
    return True


def mark_step_saved(trainer: Any, global_step: int, last_path: str | None = None) -> None:
    """The checkpoint callbacks must not save ``global_step`` again: the run resumed from it, or a
    preemption checkpoint holds it (``last_path``: where that was written, as each callback's "last")."""
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            callback._last_global_step_saved = global_step  # Lightning's own "already saved" guard
            if last_path is not None and callback.save_last:
                callback.last_model_path = callback._last_checkpoint_saved = last_path
