"""``lp_pipeline_gpipe`` / ``lp_pipeline_1f1b``: pipeline parallelism with micro-batches for unmodified
LightningModules, optionally combined with data parallelism (``data_parallel_size`` x stages).

How a step runs (Lightning's closure is training_step -> zero_grad -> backward):

- ``training_step``: split the batch into micro-batches and run this stage's schedule; the user's own
  ``training_step`` is the loss, run on the last stage once per micro-batch, weighted by its share of the
  batch, so a step equals the full-batch step. The gradients it produced are set aside (the closure's
  ``zero_grad`` would wipe them) and the full-batch loss is returned on every stage.
- ``backward``: Lightning's backward of the returned loss touches no parameter; ``pre_backward`` puts
  the set-aside gradients back (added, for gradient accumulation), ``post_backward`` sums the gradients
  of the replicated modules outside the block stack over the stages, and averages everything over the
  data-parallel group (skipped on accumulating micro-steps).
- ``self.log`` calls made by the user's code on the last stage are captured per micro-batch, averaged
  with the same weights, and replayed on every stage, so the progress bar (rank 0 is the first stage),
  loggers, ``ModelCheckpoint`` and ``EarlyStopping`` see the same values everywhere.

Checkpoints hold the full model under the original names (gathered from the stages), so they load into
the plain module; a full checkpoint loads into any number of stages. With ``save_distributed=True`` each
stage writes only its own tensors (``sharded_checkpoint``).
"""

from __future__ import annotations

import types
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from lightning.pytorch.strategies.strategy import Strategy
from torch import Tensor

from lightning_parallel.distributed.collectives import clip_grad_norm_sharded
from lightning_parallel.distributed.mesh import MeshShape
from lightning_parallel.distributed.p2p import PeerLink
from lightning_parallel.distributed.state import all_reduce_gradients, broadcast_module_states
from lightning_parallel.pipeline.executor import StageExecutor, batch_size, split_microbatches
from lightning_parallel.pipeline.partition import StagePartition, partition
from lightning_parallel.pipeline.schedules import bubble_fraction, schedule
from lightning_parallel.pipeline.state import merge_stage_states, stage_state_by_name, stage_state_from_full
from lightning_parallel.pipeline.timeline import Timeline, bubble, from_dicts, to_dicts, write_chrome_trace, write_svg
from lightning_parallel.strategies.base import ParallelStrategyBase

__all__ = ["PipelineParallelStrategy"]

SUPPORTED = ("gpipe", "1f1b", "async")


class PipelineParallelStrategy(ParallelStrategyBase):
    """Pipeline parallelism (and 2-D with data parallelism) on ``torch.distributed`` point-to-point.

    The ``async`` rule, one step stale with double-buffered weights: the gradient of batch t is computed
    with the weights from before the previous update, the same version on every stage for every
    micro-batch of the batch: ``W(t+1) = W(t) - lr * grad f_t(W(t-1))`` (``W(-1) = W(0)``). Each rank
    keeps the previous version beside the current one. This version runs each batch's micro-batches in
    1F1B order and still drains at the end of the step (the next batch does not yet start during this
    one's cool-down), so it has the update semantics of PipeDream-2BW but not yet its throughput gain.

    Args:
        schedule: ``"gpipe"`` (fill-drain), ``"1f1b"`` (one-forward-one-backward, flush each step), or
            ``"async"`` (PipeDream-2BW's update rule, see below).
        num_microbatches: micro-batches per batch; a batch that does not divide evenly is split into
            parts differing by one sample, each weighted by its size.
        pipeline_parallel_size: number of stages; None = all processes / data_parallel_size.
        data_parallel_size: replicas of the whole pipeline, each with its own batches.
        split_points: where stages start: block names (``["model.blocks.2"]``) or block counts per
            stage (``[2, 2]``); None balances by parameter count.
        balance: ``"parameters"`` (the only balancing implemented; see README).
        block_stack: name of the ``nn.ModuleList``/``nn.Sequential`` to split; None finds the largest.
        timeline_step: the step whose timeline is written (Chrome trace + SVG) to the run's folder.
        **kwargs: process plumbing, as for Lightning's ``DDPStrategy``.
    """

    strategy_name = "lp_pipeline"

    def __init__(
        self,
        schedule: str = "gpipe",
        num_microbatches: int = 4,
        pipeline_parallel_size: Optional[int] = None,
        data_parallel_size: int = 1,
        split_points: Optional[Sequence[Union[str, int]]] = None,
        balance: str = "parameters",
        block_stack: Optional[str] = None,
        timeline_step: Optional[int] = 2,
        **kwargs: Any,
    ) -> None:
        if schedule not in SUPPORTED:
            raise ValueError(f"schedule={schedule!r} is not supported; use one of {', '.join(SUPPORTED)}.")
        _positive("num_microbatches", num_microbatches)
        _positive("data_parallel_size", data_parallel_size)
        if pipeline_parallel_size is not None:
            _positive("pipeline_parallel_size", pipeline_parallel_size)
        if balance != "parameters":
            raise ValueError(f"balance={balance!r} is not supported; use 'parameters', or give split_points.")
        if kwargs.get("start_method", "popen") != "popen":
            raise ValueError(f"start_method={kwargs['start_method']!r} is not supported by PipelineParallelStrategy: "
                             "Lightning's spawn launcher hands back only rank 0's stage; use 'popen' (default).")
        super().__init__(**kwargs)
        self.schedule, self.num_microbatches = schedule, num_microbatches
        self.pipeline_parallel_size, self.data_parallel_size = pipeline_parallel_size, data_parallel_size
        self.split_points, self.block_stack, self.timeline_step = split_points, block_stack, timeline_step
        self.partition: Optional[StagePartition] = None
        self.executor: Optional[StageExecutor] = None
        self._set_aside: list[Optional[Tensor]] = []
        self._full_keys: list[str] = []
        self._full_param_names: list[str] = []
        self.bubbles: list[float] = []
        self._previous_weights: Optional[list[Tensor]] = None  # async: W(t-1)
        self._loss_is_real = False

    # ----------------------------------------------------------------- layout
    def _sizes(self) -> tuple[int, int]:
        world = self.num_nodes * self.num_processes
        dp = self.data_parallel_size
        pp = self.pipeline_parallel_size or max(world // dp, 1)
        if dp * pp != world:
            raise ValueError(
                f"PipelineParallelStrategy(data_parallel_size={dp}, pipeline_parallel_size="
                f"{self.pipeline_parallel_size}) needs data_parallel_size x pipeline_parallel_size processes, but the "
                f"run has {world} (devices x num_nodes); choose sizes whose product is {world}."
            )
        return dp, pp

    def mesh_shape(self) -> MeshShape:
        dp, pp = self._sizes()
        return MeshShape(dp=dp, pp=pp)

    def setup_environment(self) -> None:
        self._sizes()  # a layout that cannot fit fails before any process group exists
        super().setup_environment()

    @property
    def pp_group(self) -> Optional[dist.ProcessGroup]:
        return self.mesh.group("pp") if self.mesh is not None else None

    @property
    def is_last_stage(self) -> bool:
        return self.mesh is not None and self.mesh.pp_rank == self.mesh.shape.pp - 1

    # ----------------------------------------------------------------- set-up
    evaluates_split = True

    def model_is_split(self) -> bool:
        return self.partition is not None

    def configure_parallelism(self) -> None:
        module = self.lightning_module
        dp, pp = self._sizes()
        if self.schedule == "1f1b" and self.num_microbatches < pp:
            raise ValueError(f"schedule='1f1b' needs num_microbatches >= the number of stages ({pp}), got "
                             f"{self.num_microbatches}; raise num_microbatches or use schedule='gpipe'.")
        if self.partition is not None:
            return  # split by an earlier fit/validate of this trainer: keep the stages
        broadcast_module_states(module, src=0)  # every stage cuts its blocks from the same weights
        self._full_keys = list(module.state_dict().keys())
        self._full_param_names = [n for n, _ in module.named_parameters()]
        stage = self.mesh.pp_rank
        self.partition = partition(module, pp, stage, self.block_stack, self.split_points)
        ranks = self.mesh.ranks("pp")
        self.executor = StageExecutor(
            stage, pp, ranks[stage - 1] if stage > 0 else None, ranks[stage + 1] if stage < pp - 1 else None,
            PeerLink(self.root_device), self.partition.io, Timeline(self.global_rank),
        )
        owned = set(self.partition.owned)
        self._outside = [p for n, p in module.named_parameters() if n not in owned]
        self._install_global_norm_clipping({id(p) for n, p in module.named_parameters() if n in owned})

    def _install_global_norm_clipping(self, owned: set[int]) -> None:
        group = self.pp_group

        def clip_grad_by_norm(plugin: Any, optimizer: Any, clip_val: Union[int, float]) -> None:
            clip_grad_norm_sharded(list(plugin.main_params(optimizer)), float(clip_val), owned, group)

        self.precision_plugin.clip_grad_by_norm = types.MethodType(clip_grad_by_norm, self.precision_plugin)

    # ----------------------------------------------------------------- steps
    def training_step(self, batch: Any, batch_idx: int, *args: Any) -> Tensor:
        params = list(self.lightning_module.parameters())
        earlier = [p.grad for p in params]  # accumulated so far (or stale: the closure zeroes them next)
        for p in params:
            p.grad = None
        actions = schedule(self.schedule, self.mesh.shape.pp, self.num_microbatches, self.mesh.pp_rank)
        with self._stale_weights():
            loss = self._run(actions, batch, lambda mb: Strategy.training_step(self, mb, batch_idx, *args), backward=True)
        if self.check_finite_loss and self._loss_is_real:  # the last stage's loss, on every stage
            self.check_loss(loss, batch_idx, self.mesh.ranks("pp")[-1])
        self._set_aside = [p.grad for p in params]
        for p, g in zip(params, earlier):
            p.grad = g
        self._record_timeline()
        return loss.detach().requires_grad_()  # Lightning's backward of this touches no parameter

    @contextmanager
    def _stale_weights(self) -> Iterator[None]:
        """async: compute this batch's gradient with W(t-1), then put W(t) back for the optimizer."""
        if self.schedule != "async" or self._previous_weights is None:
            yield
            return
        params = list(self.lightning_module.parameters())
        current = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, old in zip(params, self._previous_weights):
                p.copy_(old)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, now in zip(params, current):
                    p.copy_(now)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self.schedule != "async":
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        before = [p.detach().clone() for p in self.lightning_module.parameters()]  # W(t)
        if self._previous_weights is None:
            self._previous_weights = before  # W(-1) = W(0)
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._previous_weights = before
        return output

    def validation_step(self, batch: Any, batch_idx: int, *args: Any) -> Any:
        return self._forward_only(batch, lambda mb: Strategy.validation_step(self, mb, batch_idx, *args))

    def test_step(self, batch: Any, batch_idx: int, *args: Any) -> Any:
        return self._forward_only(batch, lambda mb: Strategy.test_step(self, mb, batch_idx, *args))

    def predict_step(self, batch: Any, batch_idx: int, *args: Any) -> Any:
        outputs = self._forward_only(batch, lambda mb: Strategy.predict_step(self, mb, batch_idx, *args), outputs=True)
        if outputs and all(isinstance(o, Tensor) for o in outputs):
            return torch.cat(outputs)
        return outputs

    def _forward_only(self, batch: Any, step_fn: Any, outputs: bool = False) -> Any:
        actions = [a for a in schedule("gpipe", self.mesh.shape.pp, self.num_microbatches, self.mesh.pp_rank) if a.kind == "F"]
        with torch.no_grad():
            return self._run(actions, batch, step_fn, backward=False, outputs=outputs)

    def _run(self, actions: list, batch: Any, step_fn: Any, backward: bool, outputs: bool = False) -> Any:
        microbatches = split_microbatches(batch, self.num_microbatches)
        sizes = [batch_size(mb) or 1 for mb in microbatches]
        weights = [s / sum(sizes) for s in sizes]
        # Lightning divides each step's loss by accumulate_grad_batches before its backward; so do we
        scale = 1.0 / self.lightning_module.trainer.accumulate_grad_batches
        with _capture_logs(self.lightning_module) as logged:
            result = self.executor.run(actions, microbatches, step_fn, [w * scale for w in weights], backward=backward)
        if outputs:
            return result.outputs if self.is_last_stage else None
        loss = sum(w * l for w, l in zip(weights, result.losses)) if result.losses else None
        self._replay_logs(loss, logged, weights)
        return self._loss_everywhere

    def _replay_logs(self, loss: Optional[Tensor], logged: dict, weights: list[float]) -> None:
        """Average the last stage's captured ``self.log`` calls and replay them on every stage."""
        summary = None
        if self.is_last_stage:
            summary = {"loss": None if loss is None else float(loss), "logs": {}}
            for name, calls in logged.items():
                values = [float(v) for v, _ in calls]
                w = weights if len(values) == len(weights) else [1 / len(values)] * len(values)
                summary["logs"][name] = (sum(a * b for a, b in zip(w, values)), calls[-1][1])
        holder = [summary]
        dist.broadcast_object_list(holder, src=self.mesh.ranks("pp")[-1], group=self.pp_group)
        summary = holder[0]
        self._loss_is_real = summary["loss"] is not None  # else NaN below is a placeholder, not a failure
        value = summary["loss"] if summary["loss"] is not None else float("nan")
        self._loss_everywhere = torch.tensor(value, dtype=torch.float64, device=self.root_device)
        for name, (v, kwargs) in summary["logs"].items():
            self.lightning_module.log(name, torch.tensor(v, dtype=torch.float64), **kwargs)

    def _record_timeline(self) -> None:
        events = list(self.executor.timeline.events)
        self.executor.timeline.clear()
        self.bubbles.append(bubble(events))
        step = self.lightning_module.trainer.global_step
        if self.timeline_step is None or step != self.timeline_step:
            return
        gathered: list[Any] = [None] * self.mesh.shape.pp
        dist.all_gather_object(gathered, to_dicts(events), group=self.pp_group)
        if self.global_rank == 0:
            folder = Path(self.lightning_module.trainer.default_root_dir)
            folder.mkdir(parents=True, exist_ok=True)
            everyone = [e for rank_events in gathered for e in from_dicts(rank_events)]
            title = (f"{self.schedule}, {self.mesh.shape.pp} stages, {self.num_microbatches} micro-batches, step {step}; "
                     f"theory bubble {bubble_fraction(self.mesh.shape.pp, self.num_microbatches):.0%}")
            write_chrome_trace(everyone, folder / f"pipeline_timeline_step{step}.json")
            write_svg(everyone, folder / f"pipeline_timeline_step{step}.svg", title)

    # ----------------------------------------------------------------- gradients
    def pre_backward(self, closure_loss: Tensor) -> None:
        for p, fresh in zip(self.lightning_module.parameters(), self._set_aside):
            if fresh is None:
                continue
            if p.grad is None:
                p.grad = fresh
            else:
                p.grad += fresh
        self._set_aside = []

    def post_backward(self, closure_loss: Tensor) -> None:
        if not self._sync_grads:
            return
        if self.mesh.shape.pp > 1:  # replicated modules: each stage holds part of their gradient
            all_reduce_gradients(self._outside, self.pp_group, average=False)
        if self.mesh.shape.dp > 1:
            all_reduce_gradients(self.lightning_module.parameters(), self.dp_group, average=True)

    # ----------------------------------------------------------------- checkpoints
    def full_state_keys(self) -> list[str]:
        return list(self._full_keys) if self.partition is not None else super().full_state_keys()

    def full_parameter_names(self) -> list[str]:
        return list(self._full_param_names) if self.partition is not None else super().full_parameter_names()

    def full_model_state(self) -> dict[str, Any]:
        """The full model, gathered from the stages, under the original names and order."""
        local = {k: v.detach().cpu() for k, v in self.lightning_module.state_dict().items()}
        if self.mesh is None or self.mesh.shape.pp == 1:
            return local
        parts: list[Any] = [None] * self.mesh.shape.pp
        dist.all_gather_object(parts, local, group=self.pp_group)
        merged: dict[str, Any] = {}
        for part in parts:
            merged.update(part)
        return {k: merged[k] for k in self._full_keys if k in merged}

    def load_full_model_state(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """A full checkpoint (any layout, or a plain single-device one): each stage takes its tensors."""
        local_keys = set(self.lightning_module.state_dict().keys())
        state = {k: v for k, v in state_dict.items() if k in local_keys}
        missing = local_keys - set(state)
        if strict and missing:
            raise KeyError(f"checkpoint lacks {sorted(missing)[:5]} (of {len(missing)}) for this pipeline stage")
        self.lightning_module.load_state_dict(state, strict=False)

    def full_optimizer_state_dict(self, optimizer: Any) -> dict[str, Any]:
        """The single-device optimizer state, gathered from the stages (loads into any layout)."""
        if self.partition is None:
            return super().full_optimizer_state_dict(optimizer)
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        local = stage_state_by_name(optimizer, self.lightning_module)
        stages: list[Any] = [None] * self.mesh.shape.pp
        dist.all_gather_object(stages, local, group=self.pp_group)
        return merge_stage_states(stages, self._full_param_names)

    def load_full_optimizer_state(self, checkpoint: dict[str, Any]) -> None:
        if self.partition is None:
            return super().load_full_optimizer_state(checkpoint)
        for optimizer, full in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(stage_state_from_full(full, optimizer, self.lightning_module, self._full_param_names))


@contextmanager
def _capture_logs(module: Any) -> Iterator[dict[str, list]]:
    """Record ``module.log`` calls instead of making them (they are replayed averaged, on every stage)."""
    logged: dict[str, list] = {}

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(value, Tensor) or isinstance(value, (int, float)):
            logged.setdefault(name, []).append((float(value), kwargs))
        else:
            original(name, value, *args, **kwargs)

    original = module.log
    module.log = log
    try:
        yield logged
    finally:
        del module.log


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
