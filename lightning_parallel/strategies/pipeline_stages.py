"""Pipeline stages in Lightning's terms: the part of ``ParallelStrategy`` that runs a step as micro-batches
through this rank's stage (``PipelineStages``, a mixin, active once the module is partitioned; the
``async`` schedule's part is ``pipeline_async.AsyncPipelineMixin``). Its step hooks are the ``Pipeline``
axis (``axes.py``), which the strategy calls in its list after the data-parallel average.

How a step runs (Lightning's closure is training_step -> zero_grad -> backward):

- ``training_step``: split the batch into micro-batches and run this stage's schedule; the user's own
  ``training_step`` is the loss, run on the last stage once per micro-batch, weighted by its share of the
  batch, so a step equals the full-batch step. The gradients it produced are set aside (the closure's
  ``zero_grad`` would wipe them) and the full-batch loss is returned on every stage.
- data parallel (``data_parallel_size > 1``): the backwards accumulate into the ``GradientReducer``'s
  buckets, whose all-reduces over the stage's replicas start during the stage's last backward of the
  step (only on the last step of a gradient-accumulation window); the ``DataParallel`` axis waits for them.
  With ``zero_stage=3`` each replica keeps 1/dp of the stage's parameters (``ParallelStrategy.shard_over_dp``), all
  gathered when the schedule starts and kept across its micro-batches, freed when its backwards are done.
- ``backward``: Lightning's backward of the returned loss touches no parameter; ``pre_backward`` puts
  the set-aside gradients back (added, for gradient accumulation); the gradients of the modules
  replicated outside the block stack are summed over the stages: with one replica on every micro-step
  (a sum started as soon as the stage's backwards are done), with several in ``post_backward`` (skipped on
  accumulating micro-steps), after waiting for the data-parallel average.
- ``self.log`` calls made by the user's code on the last stage are captured per micro-batch, averaged
  with the same weights, and replayed on every stage, so the progress bar (rank 0 is the first stage),
  loggers, ``ModelCheckpoint`` and ``EarlyStopping`` see the same values everywhere.
- Collectives that the user's step makes (``self.all_gather``, the strategy's ``reduce``/``broadcast``/
  ``barrier``, a metric's ``compute()``) span the replicas of this stage while the step runs: the step's
  code after the model's forward runs on the last stage only, so a collective over every rank would
  wait for stages that never join it. Outside the step they span every rank, as under ``ddp``.
- ``validation_step``/``test_step``/``predict_step`` return, on every stage, what the last stage's step
  returned for the whole batch (micro-batch outputs merged), so prediction writers and
  ``trainer.predict`` get the predictions on every rank.
- Manual optimization is refused at set-up: the step is split across stages and micro-batches, so a
  ``manual_backward`` or ``optimizer.step()`` inside it has no place.

Checkpoints hold the full model under the original names (gathered from the stages), so they load into
the plain module, and a network held in the hyperparameters whole; a full checkpoint loads into any number
of stages, as strictly as on one device. With ``save_distributed=True`` each
stage writes only its own tensors (``checkpointing.sharded``).
"""

from __future__ import annotations

import statistics
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.strategy import Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_parallel.checkpointing.loss_check import check_finite_loss
from lightning_parallel.distributed.collectives import start_gather_numbers
from lightning_parallel.distributed.p2p import OBJECT_TAG, PeerLink
from lightning_parallel.distributed.replicas import broadcast_tensors, start_sum_at
from lightning_parallel.materialize import has_meta_tensors
from lightning_parallel.module_names import find_block_stack
from lightning_parallel.pipeline.channels import new_channel_groups
from lightning_parallel.pipeline.deferred_batchnorm import DeferredBatchNorm, batchnorm_warning
from lightning_parallel.pipeline.executor import (
    ChunkLinks,
    StageExecutor,
    batch_size,
    loader_problem,
    split_microbatches,
)
from lightning_parallel.pipeline.logs import LogMirror, WholeBatchMetrics, summarize
from lightning_parallel.pipeline.partition import StagePartition, keep_block_skeletons
from lightning_parallel.pipeline.placement import next_stage, previous_stage, stage_ranks
from lightning_parallel.pipeline.profile import (
    average_over_ranks,
    capture_block_inputs,
    time_blocks,
)
from lightning_parallel.pipeline.schedules import (
    OVERLAPPED,
    Action,
    chunks_per_rank,
    expected_bubbles,
    forward_only,
    schedule,
    schedule_problem,
)
from lightning_parallel.pipeline.timeline import (
    Timeline,
    bubble,
    from_dicts,
    to_dicts,
    write_chrome_trace,
    write_svg,
)
from lightning_parallel.step_effects import capture_logs, untouched
from lightning_parallel.strategies.axes import Axis
from lightning_parallel.strategies.checks import require

__all__ = ["PipelineStages", "Pipeline", "hsdp_stages_problem", "zero3_stages_problem"]


def zero3_stages_problem(
    name: str, schedule: str, pp: Optional[int], reshard_after_forward: Any = True, prefix: str = ""
) -> Optional[str]:
    """What ``zero_stage=3`` does not run on under ``ParallelStrategy`` with pipeline stages (``pp`` None
    where the layout may or may not be pipelined): it shards a pipeline stage's parameters (its
    tensor-parallel shards, under tp; its experts over their own replicas, under ep) over the stage's
    data-parallel replicas, under every flushing schedule, its units kept gathered across the step's
    micro-batches (``reshard_after_forward=False`` asks for what a stage does anyway)."""
    if pp == 1:  # pp None: not known yet, refused once it is (ParallelStrategy.check_before_launch)
        return None
    if schedule == "async" and pp is not None:
        return (
            f"{prefix}zero_stage=3 with {prefix}schedule='async': the async schedule applies each batch's gradient "
            "a step later, while the next batch's backwards run on a snapshot of the weights, so a stage would "
            "hold two gathered versions of its parameters through every step and save nothing; use zero_stage 1 "
            "or 2 (the async schedule runs with those), or a flushing schedule ('1f1b', 'gpipe', "
            "'interleaved_1f1b', 'zb_h1', 'zbv') with zero_stage=3"
        )
    if reshard_after_forward is False and pp is not None:
        return (
            f"{prefix}reshard_after_forward=False with pipeline stages: a stage gathers its units once when its "
            "schedule starts and keeps them across all its micro-batches' forwards and backwards, freeing them "
            "only when the step's backwards are done, so there is no freeing after a forward to turn off; leave "
            f"{prefix}reshard_after_forward=True (it has no effect on a stage's units), or keep blocks to their "
            f"backward without pipeline stages (lp_parallel with {prefix}pipeline_parallel_size=1, or lp_ddp)"
        )
    return None


def hsdp_stages_problem(shard: Optional[int], pp: Optional[int], prefix: str = "") -> Optional[str]:
    """``data_parallel_shard_size`` (HSDP) with pipeline stages (``pp`` None: not known yet, checked once it
    is): HSDP is wired for the data-parallel path without stages (lp_ddp, lp_parallel beside tp) only."""
    if shard is None or pp is None or pp == 1:
        return None
    return (
        f"{prefix}data_parallel_shard_size={shard} (HSDP) with pipeline stages ({prefix}pipeline_parallel_size="
        f"{pp}) is not supported yet: the stages' data-parallel path shards over all of a stage's replicas; use "
        "pipeline_parallel_size=1 (HSDP beside tensor parallelism), or leave data_parallel_shard_size None (ZeRO "
        "over every replica of the stage)"
    )


class PipelineStages:
    """Micro-batched steps, logs, metrics and evaluation outputs of a partitioned module (``self.partition``
    set by ``ParallelStrategy``); without a partition every hook is the plain strategy's."""

    partition: Optional[StagePartition]

    def _init_stage_state(self) -> None:
        self.stage_report: list[dict[str, Any]] = []  # per stage: blocks, parameters, measured seconds
        self.partition = None
        self.executor: Optional[StageExecutor] = None
        self._set_aside: list[Optional[Tensor]] = []
        self._replicated: list[int] = []  # set by wire_stages
        self._accumulating = False  # the last backward kept its gradients local (accumulate_grad_batches)
        self._replicated_sum: Optional[Callable[[], list]] = None  # one replica: the stages' sum, in flight
        self._full_keys: list[str] = []
        self._full_param_names: list[str] = []
        self.bubbles: list[float] = []  # this rank's measured bubble, per training step
        self.peak_held: list[int] = []  # per training step: most micro-batches this stage held at once
        self.whole_batch = WholeBatchMetrics()  # the step values of metric objects logged on the last stage
        self._bubbles_gathered: Optional[Callable[[], list[float]]] = None  # every rank's, of the last step
        self.last_timeline: list[Any] = []  # this rank's timeline events of the last training step
        self.logs: Optional[LogMirror] = None
        self._last_loss: Optional[Tensor] = None
        self._deferred_bn: Optional[DeferredBatchNorm] = None  # BatchNorm statistics once per batch
        self._in_user_step = False  # the user's step is running: its collectives span this stage's replicas

    @property
    def pipelined(self) -> bool:
        """The module is partitioned into stages: steps run through the schedule."""
        return self.partition is not None

    # ----------------------------------------------------------------- layout
    @property
    def pp_group(self) -> Optional[dist.ProcessGroup]:
        return self.mesh.group("pp") if self.mesh is not None else None

    @property
    def virtual_stages(self) -> int:
        """Chunks of the block stack per rank: the schedule's own, or ``virtual_stages`` where it takes one."""
        return chunks_per_rank(self.schedule, self.chunks_option)

    @property
    def stage_of(self) -> list[int]:
        """The pp index holding each virtual stage of the model, in model order."""
        return stage_ranks(self.schedule, self.mesh.shape.pp, self.virtual_stages)

    @property
    def loss_stage(self) -> int:
        """The pp index of the rank that holds the model's last blocks and runs the loss (the last rank,
        but rank 0 in the V placement)."""
        return self.stage_of[-1]

    @property
    def runs_loss(self) -> bool:
        """Whether this rank runs the end of the model: the head, the loss and the user's step (the loss
        stage, the last rank but rank 0 in the V placement)."""
        return self.mesh is not None and self.mesh.pp_rank == self.loss_stage

    @property
    def overlaps_reducer(self) -> bool:
        """Whether the data-parallel average starts during the step's last backward (one chunk per rank and
        whole backwards); otherwise it runs once after the schedule."""
        return self.schedule in OVERLAPPED

    # ----------------------------------------------------------------- set-up
    def stages_problem(self, pp: int) -> Optional[str]:
        """What keeps the schedule from running on ``pp`` stages (known before any process starts)."""
        problem = schedule_problem(self.schedule, pp, self.num_microbatches, self.virtual_stages)
        return None if problem is None else f"{type(self).__name__}: {problem}"

    def check_schedule(self, pp: int) -> None:
        """Refuse, before the split, what the schedule cannot run; forget collectives of an earlier fit."""
        module = self.lightning_module
        # a fit that ended in an exception may have left collectives in flight, on groups now gone
        self._bubbles_gathered = self._replicated_sum = None
        self._accumulating = False
        if not module.automatic_optimization and module.trainer.state.fn == TrainerFn.FITTING:
            raise ValueError(
                f"{type(self).__name__} (schedule={self.schedule!r}) does not support manual optimization "
                f"(automatic_optimization=False in {type(module).__name__}): the strategy runs training_step once "
                "per micro-batch, split across the stages, and makes the backward itself, so manual_backward "
                "and optimizer.step() inside training_step have no place. Use automatic optimization, or "
                "lp_ddp / lp_tensor_parallel, which support manual optimization."
            )
        require([self.stages_problem(pp)])
        trainer = module._trainer  # None in the planner's set-up at scale, which has no Trainer
        accumulated = trainer.accumulate_grad_batches if trainer is not None else 1
        if accumulated > 1 and (per_batch := self.accumulation_refused()):
            raise ValueError(
                f"{type(self).__name__} does not support accumulate_grad_batches={accumulated}: {per_batch}."
            )
        if self.schedule == "async" and self.scaler() is not None:
            raise ValueError(
                "schedule='async' does not support precision='16-mixed' with a gradient scaler: a batch's gradient "
                "is finished a step later, under a loss scale that may have changed. Use precision='bf16-mixed' "
                "(no scaler), or schedule='1f1b'."
            )

    def on_train_start(self) -> None:
        """Refuse, before the first step, a training loader with a batch too small to split into
        ``num_microbatches`` (its last one, unless ``drop_last``): the loaders as Lightning built them,
        with this rank's sampler."""
        combined = self.lightning_module.trainer.fit_loop._combined_loader
        for loader in combined.flattened if self.pipelined and combined is not None else []:
            size, sampler = getattr(loader, "batch_size", None), getattr(loader, "sampler", None)
            if size is None or not hasattr(sampler, "__len__"):  # a batch sampler of its own, or no length
                continue
            problem = loader_problem(len(sampler), size, loader.drop_last, self.num_microbatches)
            if problem is not None:
                raise ValueError(
                    f"{type(self).__name__}(num_microbatches={self.num_microbatches}): {problem}"
                )
        super().on_train_start()

    def prepare_stages(self, module: Any) -> Optional[list[float]]:
        """What the partition needs of the whole module, read before anything changes it: its names, a
        skeleton of every block, the BatchNorm deferral, and (balance='time') each block's cost."""
        batchnorm = batchnorm_warning(module, self.num_microbatches)
        if batchnorm is not None:
            if module.trainer.state.fn == TrainerFn.FITTING:  # not again as validate/test split it again
                rank_zero_warn(batchnorm)
            self._deferred_bn = DeferredBatchNorm(module)
        self._full_keys = list(module.state_dict().keys())
        self._full_param_names = [n for n, _ in module.named_parameters()]
        keep_block_skeletons(module, self.block_stack)
        return self._measure_block_times(module) if self.balance == "time" else None

    def wire_stages(self, costs: Optional[list[float]]) -> None:
        """After the partition: the stage report, the executor and its links, the log mirror, and the
        gradients of the modules replicated outside the stack."""
        module = self.lightning_module
        pp = self.mesh.shape.pp
        self._report_stages(costs)
        ranks, v = self.mesh.ranks("pp"), self.virtual_stages

        def rank_of(neighbour: Optional[tuple[int, int]]) -> Optional[int]:
            return None if neighbour is None else ranks[neighbour[0]]

        here = (self.schedule, pp, self.mesh.pp_rank)
        links = [
            ChunkLinks(g, rank_of(previous_stage(*here, c, v)), rank_of(next_stage(*here, c, v)))
            for c, g in enumerate(self.partition.chunks)
        ]
        self.executor = StageExecutor(
            self.global_rank,
            self.partition,
            links,
            PeerLink(
                self.root_device,
                channels=new_channel_groups(self.schedule, self.mesh.shape, self.global_rank, v),
            ),
            Timeline(self.global_rank),
        )
        # summaries go over gloo on CPU, on their own tag (on NCCL, on a gloo group of their own; the fake
        # backend of the set-up at scale, planner/at_scale.py, carries CPU tensors as it carries any)
        carries_cpu = dist.get_backend() in ("gloo", "fake")
        objects = None if carries_cpu else dist.new_group(backend="gloo")
        last = ranks[self.loss_stage]
        others = [r for r in ranks if r != last]
        link = PeerLink(torch.device("cpu"), objects, tag=OBJECT_TAG)
        self.logs = LogMirror(link, last, others, self.runs_loss)
        self._replicated = self.replicated_positions()
        if self.schedule == "async" and pp > 1:
            self.async_grads.reduce = self._replicated_gradient_reduce(module, self._replicated)

    def replicated_positions(self) -> list[int]:
        """Positions in ``module.parameters()`` of the trainable parameters outside the stack (every stage
        holds them, and their gradients are summed over the stages): read at set-up, and again when the
        user's code freezes or unfreezes parameters (``follow_parameter_change``)."""
        owned = set(self.partition.owned)
        named = self.lightning_module.named_parameters()
        return [i for i, (n, p) in enumerate(named) if n not in owned and p.requires_grad]

    def prepare_checkpoint(self) -> None:
        """Before a checkpoint's state is read (after the async pipeline's drain): every stage's buffers of
        the modules outside the block stack become the loss stage's. Those after the stack (a final
        BatchNorm) run only there, and a checkpoint, full or sharded, takes a tensor that several ranks
        hold from any one of them."""
        super().prepare_checkpoint()
        if not self.pipelined or self.mesh.shape.pp == 1:
            return
        buffers = [b for m in self.partition.outside for b in m._buffers.values() if b is not None]
        if buffers:
            broadcast_tensors(buffers, src=self.loss_stage, group=self.pp_group)

    def _measure_block_times(self, module: Any) -> Optional[list[float]]:
        """balance='time': each block's forward + backward seconds on the first training micro-batch."""
        trainer = module.trainer
        if trainer.state.fn != TrainerFn.FITTING:
            rank_zero_warn(
                "balance='time' measures on a training batch; outside fit the stages are balanced by "
                "parameters instead."
            )
            return None
        if has_meta_tensors(module):
            raise ValueError(
                "balance='time' times each block on a real batch, and this module was built on the meta device "
                "(init_module / configure_model): use balance='parameters' or split_points, or build it with "
                "init_module(empty_init=False)"
            )
        _, stack = find_block_stack(module, self.block_stack)
        with untouched(module):
            try:
                batch = next(iter(trainer.fit_loop._data_source.dataloader()))
            except (StopIteration, TypeError, AttributeError) as error:
                raise ValueError(
                    "balance='time' needs a training dataloader with at least one batch to measure "
                    f"the blocks on ({error}); use balance='parameters' or split_points."
                ) from error
            sample = split_microbatches(self.batch_to_device(batch), self.num_microbatches)[0]
            with capture_logs(module, log_objects=False):
                inputs = capture_block_inputs(list(stack), lambda: module.training_step(sample, 0), module)
            times = time_blocks(list(stack), inputs)
        return average_over_ranks(times)

    def _report_stages(self, costs: Optional[list[float]]) -> None:
        """Gather what each stage holds; rank 0 prints it (parameters per rank, as the user will ask)."""
        ranges = [self.partition.chunk_bounds(c) for c in range(len(self.partition.chunks))]
        owned = set(self.partition.owned)
        named = list(self.lightning_module.named_parameters())
        mine = {
            "rank": self.global_rank,
            "stage": self.partition.stage,
            "stack": self.partition.stack_name,
            "blocks": " and ".join(f"{start}..{end - 1}" for start, end in ranges),
            "parameters": sum(p.numel() for n, p in named if n in owned),
            "replicated": sum(p.numel() for n, p in named if n not in owned),
            "seconds": None if costs is None else sum(sum(costs[a:b]) for a, b in ranges),
        }
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, mine)
        self.stage_report = parts
        lines = [
            f"  rank {r['rank']}: stage {r['stage']}, blocks {r['blocks']} of {self.partition.stack_name!r}, "
            f"{r['parameters']:,} parameters in its blocks + {r['replicated']:,} replicated outside the stack"
            + ("" if r["seconds"] is None else f", {1e3 * r['seconds']:.2f} ms forward+backward measured")
            for r in parts
        ]
        rank_zero_info(
            f"Pipeline stages (balance={self.balance!r}); {self.partition.describe_stack()}:\n"
            + "\n".join(lines)
        )

    # ----------------------------------------------------------------- steps
    def pipelined_training_step(self, batch: Any, batch_idx: int, *args: Any) -> Tensor:
        """The training step of a partitioned module: this stage's schedule on the batch's micro-batches."""
        params = list(self.lightning_module.parameters())
        earlier = [p.grad for p in params]  # accumulated so far (or stale: the closure zeroes them next)
        step_fn = lambda mb: Strategy.training_step(self, mb, batch_idx, *args)  # noqa: E731
        if self.schedule == "async":
            loss = self._async_step(params, batch, step_fn, batch_idx)
        else:
            actions = schedule(
                self.schedule,
                self.mesh.shape.pp,
                self.num_microbatches,
                self.mesh.pp_rank,
                self.virtual_stages,
            )
            last_backward = self._begin_gradients(params, earlier, actions)
            self._run(
                actions, batch, step_fn, backward=True, batch_idx=batch_idx, before_backward=last_backward
            )
            self._set_aside = [p.grad for p in params]
            if self.reducer is None:
                self._replicated_sum = self._start_replicated_sum(params, self._set_aside)
            elif self.overlaps_reducer:  # in the buckets (being averaged): out of zero_grad's reach
                earlier = [None] * len(params)
            loss = self._show(self.logs.take("train"))
        for p, g in zip(params, earlier):
            p.grad = g
        self._record_timeline()
        self._log_bubbles()
        return loss.detach().requires_grad_()  # Lightning's backward of this touches no parameter

    def _show(self, summary: dict) -> Optional[Tensor]:
        """Replay a summary's logs on this stage; the loss it carries (None for evaluation). A non-finite
        training loss stops every stage alike, naming the last stage's rank, before the optimizer step."""
        loss = self.logs.replay(self.lightning_module, summary, self.root_device)
        if self.check_finite_loss and loss is not None and summary["kind"] == "train":
            late = summary["batch"] is not None  # async: the loss of the step numbered in the summary
            step = summary["batch"] if late else self.lightning_module.trainer.global_step
            check_finite_loss(loss, step, summary["batch_idx"], self.mesh.ranks("pp")[self.loss_stage])
        if summary["batch"] is not None:
            self.lightning_module.log(
                "pipeline_async_batch", float(summary["batch"]), on_step=True, on_epoch=False
            )
        if loss is not None:
            self._last_loss = loss
        return loss

    def validation_step(self, batch: Any, batch_idx: int, *args: Any) -> Any:
        if not self.pipelined:
            return super().validation_step(batch, batch_idx, *args)
        return self._forward_only(batch, lambda mb: Strategy.validation_step(self, mb, batch_idx, *args))

    def test_step(self, batch: Any, batch_idx: int, *args: Any) -> Any:
        if not self.pipelined:
            return super().test_step(batch, batch_idx, *args)
        return self._forward_only(batch, lambda mb: Strategy.test_step(self, mb, batch_idx, *args))

    def predict_step(self, batch: Any, batch_idx: int, *args: Any) -> Any:
        if not self.pipelined:
            return super().predict_step(batch, batch_idx, *args)
        return self._forward_only(batch, lambda mb: Strategy.predict_step(self, mb, batch_idx, *args))

    def _forward_only(self, batch: Any, step_fn: Any) -> Any:
        """Evaluate a batch pipelined; every stage returns what the last stage's step returned for the whole
        batch (the merged micro-batch outputs), and replays its logs."""
        actions = forward_only(
            self.schedule, self.mesh.shape.pp, self.num_microbatches, self.mesh.pp_rank, self.virtual_stages
        )
        with torch.no_grad():
            # no wait for sends: under async, a receiver may still owe a receive from the last train step
            result = self._run(actions, batch, step_fn, backward=False, flushed=False)
        summary = self.logs.take("eval")
        self._show(summary)
        if self.runs_loss:
            return result.output
        return move_data_to_device(summary["outputs"], self.root_device)

    def _run(
        self,
        actions: list,
        batch: Any,
        step_fn: Any,
        backward: bool,
        before_backward: Any = None,
        flushed: bool = True,
        batch_idx: Optional[int] = None,
    ) -> Any:
        """Run this stage's actions on the batch's micro-batches; the last stage publishes its summary.
        ``flushed``: the call leaves no stage with work in flight, so it may wait for its sends."""
        microbatches = split_microbatches(batch, self.num_microbatches)
        sizes = [batch_size(mb) or 1 for mb in microbatches]
        weights = [s / sum(sizes) for s in sizes]
        # Lightning divides each step's loss by accumulate_grad_batches before its backward, and a 16-mixed
        # gradient scaler multiplies it by the loss scale (unscale_ divides it out later); so do we
        scale = 1.0 / self.lightning_module.trainer.accumulate_grad_batches
        if backward and self.scaler() is not None:
            scale *= self.scaler().get_scale()
        # only the last stage runs the user's step, so only it calls metrics
        tracked = self.whole_batch.track(self.lightning_module) if self.runs_loss else nullcontext()
        deferred = (
            self._deferred_bn.mini_batch(self.num_microbatches, lambda: self.partition.io.repeating)
            if backward and self._deferred_bn is not None
            else nullcontext()
        )
        # zero_stage=3: every set of units (the experts' too) gathered for the schedule
        gathered = ExitStack()
        for shards in self.parameter_shards:
            gathered.enter_context(shards.step())
        with capture_logs(self.lightning_module) as logged, tracked, deferred, gathered:
            result = self.executor.run(
                actions,
                microbatches,
                self._as_user_step(step_fn),
                [w * scale for w in weights],
                backward=backward,
                before_backward=before_backward,
                flushed=flushed,
            )
        if backward:
            self.peak_held.append(result.peak_held)
        if self.runs_loss:
            kind = "train" if backward else "eval"
            number = (
                self.lightning_module.trainer.global_step if self.schedule == "async" and backward else None
            )
            self.logs.publish(
                summarize(
                    kind, result.losses, weights, logged, number, batch_idx, self.whole_batch, result.output
                )
            )
        self.logs.finish(flushed)
        return result

    # ----------------------------------------------------------------- the user's collectives
    def _as_user_step(self, step_fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``step_fn`` run as the user's step: the collectives it makes span this stage's replicas."""

        def user_step(microbatch: Any) -> Any:
            with self._user_step():
                return step_fn(microbatch)

        return user_step

    @contextmanager
    def _user_step(self) -> Iterator[None]:
        outer, self._in_user_step = self._in_user_step, True
        try:
            yield
        finally:
            self._in_user_step = outer

    def _step_group(self, group: Optional[Any]) -> Optional[Any]:
        """The group a collective asked for with ``group`` spans: inside the user's step the default (None or
        WORLD, which ``LightningModule.all_gather`` passes) is the data-parallel group of this stage, the
        ranks that run the same code at the same time (the last stage of every replica, for the code after
        the model's forward; one rank when there is one replica)."""
        if not self._in_user_step or (group is not None and group is not dist.group.WORLD):
            return group
        return self.dp_group if self.dp_group is not None else dist.group.WORLD

    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        """Inside the user's step, a tensor of shape (data_parallel_size, ...): one entry per replica."""
        return super().all_gather(tensor, group=self._step_group(group), sync_grads=sync_grads)

    def reduce(
        self, tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Tensor:
        return super().reduce(tensor, group=self._step_group(group), reduce_op=reduce_op)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Inside the user's step, ``src`` counts the replicas (0: the first replica's copy of this stage)."""
        if not self._in_user_step or not dist.is_initialized():
            return super().broadcast(obj, src)
        box = [obj]
        dist.broadcast_object_list(box, src=self.mesh.ranks("dp")[src], group=self._step_group(None))
        return box[0]

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not self._in_user_step or not dist.is_initialized():
            return super().barrier(*args, **kwargs)
        nccl = dist.get_backend() == "nccl"
        ids = {"device_ids": self.determine_ddp_device_ids()} if nccl else {}
        dist.barrier(group=self._step_group(None), **ids)

    def _record_timeline(self) -> None:
        events = list(self.executor.timeline.events)
        self.executor.timeline.clear()
        self.last_timeline = events
        self.bubbles.append(bubble(events))
        step = self.lightning_module.trainer.global_step
        if self.timeline_step is None or step != self.timeline_step:
            return
        gathered: list[Any] = [to_dicts(events)] * self.mesh.shape.pp
        if self.mesh.shape.pp > 1:
            dist.all_gather_object(gathered, gathered[0], group=self.pp_group)
        if self.global_rank == 0:
            folder = Path(self.lightning_module.trainer.default_root_dir)
            folder.mkdir(parents=True, exist_ok=True)
            everyone = [e for rank_events in gathered for e in from_dicts(rank_events)]
            pp, v, m = self.mesh.shape.pp, self.virtual_stages, self.num_microbatches
            equal = [1.0] * (pp * v)  # equal stages, a backward twice a forward (I and W alike)
            theory = expected_bubbles(self.schedule, pp, m, equal, [2.0] * (pp * v), virtual_stages=v)[0]
            chunks = f" x {v} chunks" if v > 1 else ""
            title = (
                f"{self.schedule}, {pp} stages{chunks}, {m} micro-batches, step {step}; "
                f"theory bubble of stage 0 {theory:.0%}"
                + (
                    " with a flush, 0% without (B3' = the previous batch's)"
                    if self.schedule == "async"
                    else ""
                )
            )
            write_chrome_trace(everyone, folder / f"pipeline_timeline_step{step}.json")
            write_svg(everyone, folder / f"pipeline_timeline_step{step}.svg", title)

    def _log_bubbles(self) -> None:
        """Log the previous step's bubble of every stage (``pipeline_bubble_stage<s>``, averaged over the
        replicas) and their mean (``pipeline_bubble``), the same values on every rank. The gather is
        started at one step and read at the next, so no stage waits for another here. Logged on the steps
        whose logs Lightning writes (``log_every_n_steps``), the only ones loggers see: a ``self.log`` costs
        about a millisecond on a CPU, on the critical path of every step."""
        gathered, self._bubbles_gathered = self._bubbles_gathered, start_gather_numbers(self.bubbles[-1])
        if gathered is None:
            return
        everyone = gathered()
        trainer = self.lightning_module.trainer
        if not (trainer._logger_connector.should_update_logs or trainer.fast_dev_run):
            return
        shape = self.mesh.shape
        stages = [
            statistics.mean(v for r, v in enumerate(everyone) if shape.coordinates(r)[1] == s)
            for s in range(shape.pp)
        ]
        for s, value in enumerate(stages):
            self.lightning_module.log(f"pipeline_bubble_stage{s}", value, on_step=True, on_epoch=False)
        self.lightning_module.log("pipeline_bubble", statistics.mean(stages), on_step=True, on_epoch=False)

    # ----------------------------------------------------------------- gradients
    def _begin_gradients(
        self, params: list, earlier: list, actions: list[Action]
    ) -> Optional[Callable[[Action], None]]:
        """Where this step's backwards accumulate; returns the executor's ``before_backward`` (or None).

        Without a reducer (one replica): into fresh ``.grad``, set aside after the schedule and added to the
        accumulated ones in ``pre_backward``. With one: into the reducer's buckets, continuing the gradients
        of an accumulation window (dropped at a window's first step: they are the applied ones, which the
        loop's ``zero_grad`` would wipe). Its hooks only count until this stage's last backward of the step;
        before that one, sync is turned on (unless the step accumulates) and the counts restart, so each
        bucket's all-reduce starts as soon as that backward has filled it, and overlaps the rest of it."""
        reducer = self.reducer
        if reducer is None or not self.overlaps_reducer:  # averaged after the schedule, if at all
            for p in params:
                p.grad = None
            return None
        for p, g in zip(params, earlier):
            p.grad = g if self._accumulating else None
        sync, reducer.sync_enabled = self._sync_grads, False
        reducer.prepare_for_backward()
        last = [a for a in actions if a.kind == "B"][-1]

        def before_backward(action: Action) -> None:
            if action is last:
                reducer.sync_enabled = sync
                reducer.prepare_for_backward()

        return before_backward

    def _start_replicated_sum(self, params: list, grads: list) -> Optional[Callable[[], list]]:
        """Start summing over the stages the gradients of the modules replicated outside the block stack
        (each stage holds part of them: the first its embedding's, the last its head's); the returned
        function waits and gives ``grads`` with those replaced by their sums (None: nothing to sum).

        One replica: started on each micro-step's gradients as soon as the stage's backwards are done, so
        it overlaps the rest of the step; ``pre_backward`` waits and adds the sums. With data parallelism:
        once per optimizer step, after the average (the two commute: ``_sum_averaged_replicated``)."""
        if self.mesh.shape.pp == 1 or not self._replicated:
            return None
        return start_sum_at(self._replicated, params, grads, self.pp_group)

    def _sum_averaged_replicated(self) -> None:
        """The stages' sum of the averaged gradients of the replicated modules, into ``.grad`` (a bucket
        view keeps aliasing its bucket); every stage then holds the same whole gradient."""
        params = list(self.lightning_module.parameters())
        finish = self._start_replicated_sum(params, [p.grad for p in params])
        if finish is None:
            return
        summed = finish()
        for i in self._replicated:
            p, value = params[i], summed[i]
            if value is None:
                continue
            if p.grad is None:
                p.grad = value
            else:
                p.grad.copy_(value)  # keeps a reducer's bucket view

    def restore_set_aside(self) -> None:
        """Before Lightning's backward: the gradients the schedule set aside put back (added to those
        accumulated), with one replica the stages' sum of the replicated modules' waited for."""
        if self._replicated_sum is not None:
            self._set_aside, self._replicated_sum = self._replicated_sum(), None
        for p, fresh in zip(self.lightning_module.parameters(), self._set_aside):
            if fresh is None:
                continue
            if p.grad is None:
                p.grad = fresh
            else:
                p.grad += fresh
        self._set_aside = []

    def finish_stage_gradients(self) -> None:
        """After Lightning's backward and the data-parallel average (``DataParallel``, in the axes' order):
        the averaged gradients of the replicated modules summed over the stages, once per optimizer step
        (the async schedule sums a batch's when it is finished: ``AsyncGradients``)."""
        self._accumulating = not self._sync_grads
        if not self._accumulating and self.reducer is not None and self.schedule != "async":
            self._sum_averaged_replicated()


class Pipeline(Axis):
    """Pipeline stages: the schedule ran the step's backwards inside the training step; Lightning's
    backward of the returned loss finds their gradients put back, and after the data-parallel average the
    modules every stage holds are summed over the stages (``PipelineStages``)."""

    name = "pipeline"

    def __init__(self, strategy: PipelineStages) -> None:
        self.strategy = strategy

    def pre_backward(self) -> None:
        self.strategy.restore_set_aside()

    def post_backward(self) -> None:
        self.strategy.finish_stage_gradients()
