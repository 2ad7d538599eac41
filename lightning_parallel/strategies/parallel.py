"""``lp_parallel``: data x tensor x pipeline parallelism on one (dp, pp, tp) mesh, for unmodified LightningModules.

Set-up applies the parallelisms to the module in one order, each a function of the module and the mesh
that knows no strategy class (``configure_parallelism`` reads as that order):

1. tensor parallel: the plan is resolved on the whole, unmodified module (``plan="auto"`` traces the
   user's ``training_step`` on fake tensors), then its layers are sharded over the tp group
   (``tensor.shard_module``);
2. expert parallel: each experts module keeps this rank's experts, the tokens reach them by all-to-all
   over the ep group, which divides the dp axis (``moe.expert_parallel.apply_expert_parallel``);
3. pipeline: the block stack of the sharded module is partitioned into stages over the pp group
   (``pipeline.partition``); the stage's ranks of one tp group run the same blocks and pass the same
   activations on to the next stage's tp group;
4. data parallel: the gradients of the parameters this rank holds are averaged over the dp group by the
   ``GradientReducer``, overlapped with backward (pipeline stages: with the stage's last backward of the
   step; the ``async`` schedule's finished gradient is averaged at once, after the step); the experts'
   over their replicas (the ``edp`` group), after a division by ep.

Steps 1 to 3 run on the module built on meta (``set_up_share``): a rank allocates only its share. Each
step then calls the axes of ``step_axes`` (``axes.py``) in the order the gradients are finished: the dp
average, the pipeline's sum over the stages, ZeRO's pieces, the experts' average, tensor parallelism.
Checkpoints stack the gathers in the same order: over tp (full tensors), then over ep (every expert), then
over pp (the stages' parts), so a checkpoint of any layout holds the single-device state under
single-device names and loads into any other layout; clipping uses the norm of the whole model over tp and
pp (and ep: each expert counted by its rank).

``lp_tensor_parallel`` and ``lp_pipeline_*`` are this class with an axis fixed (``tensor_parallel.py``,
``pipeline.py``): their options are the ones they declare, their defaults and behaviour as before.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelSummary
from torch import nn

from lightning_parallel.checkpointing import ShardLayout
from lightning_parallel.checkpointing.by_name import (
    gather_optimizer_parts,
    gather_parts,
    state_by_name,
    state_from_full,
)
from lightning_parallel.checkpointing.contract import check_keys, unwrapped
from lightning_parallel.distributed.mesh import MeshShape
from lightning_parallel.distributed.reducer import GradientReducer
from lightning_parallel.distributed.zero import ShardedGradientReducer
from lightning_parallel.every_rank import training_step_scope
from lightning_parallel.materialize import Cut
from lightning_parallel.memory.accounting import available_host_bytes
from lightning_parallel.memory.saved import can_stack
from lightning_parallel.moe.expert_parallel import experts_left_to_expert_parallel
from lightning_parallel.moe.expert_traffic import ExpertPlacement
from lightning_parallel.moe.load_balancing import refusal as load_balancing_refusal
from lightning_parallel.parameter_set import ParameterChange
from lightning_parallel.pipeline.partition import partition
from lightning_parallel.pipeline.placement import global_stage
from lightning_parallel.pipeline.schedules import SCHEDULES, SPLIT_BACKWARD, virtual_stages_problem
from lightning_parallel.strategies.axes import Axis
from lightning_parallel.strategies.base import ParallelStrategyBase
from lightning_parallel.strategies.checks import one_of, positive_int, require
from lightning_parallel.strategies.data_parallel_axes import DataParallel, Zero, ZeroParameters
from lightning_parallel.strategies.expert_stages import ExpertParallel, Experts
from lightning_parallel.strategies.options import given, level_problems
from lightning_parallel.strategies.pipeline_async import AsyncPipelineMixin
from lightning_parallel.strategies.pipeline_stages import (
    Pipeline,
    PipelineStages,
    hsdp_stages_problem,
    zero3_stages_problem,
)
from lightning_parallel.strategies.plan_verification import PlanVerification
from lightning_parallel.strategies.tensor_axis import TensorParallel
from lightning_parallel.strategies.whole_model import (
    WholeModel,
    give_back,
    guard_lifted,
    remove_guard,
    summary_of_whole,
)
from lightning_parallel.tensor import Plan, ResolvedPlan, parse_plan, resolve
from lightning_parallel.tensor.coverage import check_coverage
from lightning_parallel.tensor.full_state import (
    cut_shards,
    expert_pieces,
    full_optimizer_state,
    full_state_dict,
    gather_shards,
    load_full_state_dict,
    shard_optimizer_state,
    sharded_parameters,
    unsharded_copy,
)
from lightning_parallel.tensor.gradient_sums import installed_gradient_sums, remove_gradient_sums
from lightning_parallel.tensor.layers import FEATURE_SHARDS, SharedEntry, _TPLayer
from lightning_parallel.tensor.plan import install_gradient_sums, replicated_blocks
from lightning_parallel.tensor.replicated_blocks import norm_weight
from lightning_parallel.tensor.sample import sample_forward
from lightning_parallel.tensor.sequence import SequenceParallel, apply_sequence_parallel
from lightning_parallel.tensor.sequence_plan import resolve_sequence
from lightning_parallel.tensor.shard import shard_module

__all__ = ["ParallelStrategy", "BALANCES"]

BALANCES = ("parameters", "time")
#: why a model the user compiled is compiled block by block under pipeline stages
STAGE_ENDS_IN_FORWARD = "a stage ends inside forward, where a whole compiled step cannot stop"
SP_WITH_PP = (
    "sequence parallelism is not composed with pipeline stages (a stage's activations would be sent cut "
    "along the sequence); use pipeline_parallel_size=1 or sequence_parallel=False"
)


class ParallelStrategy(ExpertParallel, PipelineStages, AsyncPipelineMixin, ParallelStrategyBase):
    """Data x tensor x pipeline parallelism (3-D) on ``torch.distributed``; see docs/parallel_3d.md.

    Args:
        data_parallel_size: replicas of the model, each with its own batches; None = what the other two
            leave of the world.
        tensor_parallel_size: processes that split each sharded layer (neighbouring ranks); None = what
            the other two leave.
        pipeline_parallel_size: pipeline stages; None = what the other two leave. At most one of the
            three sizes may be None.
        plan: the tensor-parallel plan: ``"auto"``, a dict of module-name patterns to styles, a YAML file
            path, or a ``Plan`` (used when ``tensor_parallel_size > 1``).
        verify_plan: on the first batch, also run the unsharded module and fail with the largest
            difference if the outputs disagree (without pipeline stages).
        require_sharded: the least share of the model's parameters the plan must split; a plan that
            splits less fails before training, naming what stayed whole and why. 0 accepts any plan.
        sequence_parallel: Megatron's sequence parallelism under tensor parallelism: norms, dropout and
            residual adds hold 1/tp of the sequence (docs/tensor_parallel.md); not with pipeline stages.
        schedule: ``"gpipe"`` (fill-drain), ``"1f1b"`` (one-forward-one-backward, flush each step),
            ``"interleaved_1f1b"`` (Megatron's: ``virtual_stages`` chunks per rank, a smaller bubble),
            ``"zb_h1"`` (zero bubble: the weight gradients fill 1F1B's bubble), ``"zbv"`` (zero bubble,
            two chunks per rank in a V), or ``"async"``
            (PipeDream-2BW's update rule; see ``pipeline_async.py``).
        virtual_stages: chunks of the block stack per rank under ``schedule="interleaved_1f1b"`` (at
            least 2; None: 2) or ``schedule="async"`` (None: 1; 2 or more: interleaved 1F1B's stream
            with no flush, where two weight versions suffice: ``pipeline_async.py``), in Megatron's
            looping placement. Other schedules hold one chunk per rank (``zbv`` two, in a V).
        num_microbatches: micro-batches per batch; a batch that does not divide evenly is split into
            parts differing by one sample, each weighted by its size.
        split_points: where stages start: block names (``["model.blocks.2"]``) or block counts per
            stage (``[2, 2]``); None balances by parameter count.
        balance: how stages are chosen when ``split_points`` is None: ``"parameters"`` (equal parameter
            counts) or ``"time"`` (each block's forward + backward time measured on the first micro-batch
            before training, averaged over ranks; the random state is left as it was).
        block_stack: name of the ``nn.ModuleList``/``nn.Sequential`` to split; None takes the one with the
            most parameters (of an ``nn.Transformer``, the decoder's layers). Other stacks run whole on
            every stage, like an embedding; rank 0 names both at start-up.
        timeline_step: the step whose pipeline timeline is written (Chrome trace + SVG) to the run's folder.
        expert_parallel_size: ranks that share out each mixture-of-experts layer's experts (whole experts,
            ``num_experts / ep`` per rank; tokens sent to their expert's rank by all-to-all). It divides the
            data-parallel size: the ranks of an ep group see different batches, and the experts are
            replicated ``dp / ep`` times. Needs Hugging Face experts modules (Mixtral, Qwen2-MoE, OLMoE, ...).
        **kwargs: process plumbing, as for Lightning's ``DDPStrategy``.
    """

    strategy_name = "lp_parallel"
    zero_stages = (0, 1, 2, 3)  # 3: with and without pipeline stages (zero3_stages_problem)
    shards_within_data_parallel = True  # HSDP: without pipeline stages (hsdp_stages_problem)
    defers_init_by_default = True
    popen_only = "Lightning's spawn launcher hands back only rank 0's part of the model"
    size_options = {"data_parallel_size": "dp", "tensor_parallel_size": "tp", "pipeline_parallel_size": "pp"}
    #: what a layout sets (``planner.layout.Layout.strategy_options``): the options ``lp-train strategy=auto``
    #: leaves to the planner or lets the user fix
    layout_options = (
        "data_parallel_size",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "expert_parallel_size",
        "sequence_parallel",
        "activation_checkpointing",
        "zero_stage",
        "schedule",
        "num_microbatches",
        "virtual_stages",
    )
    #: axes applied even at size 1 (the presets: a tensor-parallel run of one process still shards, a
    #: pipeline of one stage still runs micro-batches)
    always_applied: tuple[str, ...] = ()
    #: the sizes that may be None (inferred from the world)
    nullable_sizes: tuple[str, ...] = tuple(size_options)
    evaluates_split = True
    #: the options of each axis; a preset that fixes an axis hides its options (``strategies.options``)
    expert_options = ("expert_parallel_size",)
    tensor_options = ("tensor_parallel_size", "plan", "verify_plan", "require_sharded", "sequence_parallel")
    pipeline_options = (
        "pipeline_parallel_size",
        "schedule",
        "virtual_stages",
        "num_microbatches",
        "split_points",
        "balance",
        "block_stack",
        "timeline_step",
    )

    def __init__(
        self,
        data_parallel_size: Optional[int] = None,
        tensor_parallel_size: Optional[int] = 1,
        pipeline_parallel_size: Optional[int] = 1,
        plan: Union[str, Path, Mapping[str, Any], Plan, None] = "auto",
        verify_plan: bool = False,
        require_sharded: float = 0.2,
        sequence_parallel: bool = False,
        schedule: str = "1f1b",
        virtual_stages: Optional[int] = None,
        num_microbatches: int = 4,
        split_points: Optional[Sequence[Union[str, int]]] = None,
        balance: str = "parameters",
        block_stack: Optional[str] = None,
        timeline_step: Optional[int] = 2,
        expert_parallel_size: int = 1,
        **kwargs: Any,
    ) -> None:
        # the base's options (activation_checkpointing) arrive in kwargs; some checks here read them too
        require(level_problems(ParallelStrategy, type(self), {**kwargs, **locals()}))
        # malformed plans and missing files fail here, before any process starts (and are read once)
        self._plan = plan if plan is None or (isinstance(plan, str) and plan == "auto") else parse_plan(plan)
        super().__init__(**kwargs)
        self.data_parallel_size = data_parallel_size
        self.tensor_parallel_size = tensor_parallel_size
        self.pipeline_parallel_size = pipeline_parallel_size
        self.plan, self.verify_plan, self.require_sharded = plan, verify_plan, float(require_sharded)
        self.sequence_parallel = sequence_parallel
        self.sequence: Optional[SequenceParallel] = None
        self.schedule, self.num_microbatches = schedule, num_microbatches
        self.chunks_option = virtual_stages
        self.split_points, self.block_stack, self.timeline_step = split_points, block_stack, timeline_step
        self.balance = balance
        self.expert_parallel_size = expert_parallel_size
        self.expert_reducer: Optional[GradientReducer] = None  # the experts' gradients over their replicas
        self.resolved: Optional[ResolvedPlan] = None
        self.whole: Optional[WholeModel] = None  # the module's children before the split (given back after)
        self._entries: list[SharedEntry] = []
        self._stage_costs: Optional[list[float]] = None  # balance='time': each block's measured seconds
        self._init_stage_state()
        self._init_async_state()
        self.plan_verification = PlanVerification(self.strategy_name)

    @classmethod
    def own_option_problems(cls, values: Mapping[str, Any], prefix: str = "") -> list[Optional[str]]:
        """The checks of the arguments declared here (``strategies.options.option_problems`` reads them)."""
        share, balance, split_points = values["require_sharded"], values["balance"], values["split_points"]
        sequence, pp = values["sequence_parallel"], values["pipeline_parallel_size"]
        pipelined = 2 if "pp" in cls.always_applied else pp
        return [
            None
            if given(values, "zero_stage", 0) != 3
            else zero3_stages_problem(
                cls.__name__,
                values["schedule"],
                pipelined,
                given(values, "reshard_after_forward", True),
                prefix,
            ),
            hsdp_stages_problem(values.get("data_parallel_shard_size"), pipelined, prefix),
            *cls.expert_problems(values, prefix),
            None
            if isinstance(sequence, bool)
            else f"{prefix}sequence_parallel must be True or False, got {sequence!r}",
            None
            if sequence is not True or pp in (1, None)
            else f"{prefix}sequence_parallel=True with {prefix}pipeline_parallel_size={pp}: {SP_WITH_PP}",
            *(
                positive_int(f"{prefix}{name}", values[name], allow_none=name in cls.nullable_sizes)
                for name in ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size")
            ),
            None
            if isinstance(share, (int, float)) and not isinstance(share, bool) and 0 <= share <= 1
            else f"{prefix}require_sharded must be a share between 0 and 1, got {share!r}",
            one_of(f"{prefix}schedule", values["schedule"], SCHEDULES),
            virtual_stages_problem(values["schedule"], values["virtual_stages"], prefix),
            None
            if values["schedule"] not in SPLIT_BACKWARD
            or values.get("activation_checkpointing") != "selective"
            else f"{prefix}schedule={values['schedule']!r} with {prefix}activation_checkpointing='selective': the "
            "schedule splits each backward into the input's gradient and, later, the weights', and torch's "
            "selective checkpoint recomputes a block once only. Use activation_checkpointing=True (whole blocks, "
            "exact with the split), or a schedule with whole backwards ('1f1b', 'interleaved_1f1b').",
            positive_int(f"{prefix}num_microbatches", values["num_microbatches"]),
            one_of(f"{prefix}balance", balance, BALANCES, hint=", or give split_points"),
            None
            if balance != "time" or split_points is None
            else f"{prefix}balance='time' and {prefix}split_points={list(split_points)!r} both choose the stages; give "
            "one of them (split_points fix the stages, balance='time' measures and chooses them).",
        ]

    # ----------------------------------------------------------------- layout
    @property
    def tp_group(self) -> Optional[dist.ProcessGroup]:
        return self.mesh.group("tp") if self.mesh is not None else None

    def check_before_launch(self) -> Any:
        """The layout, and what the schedule, sequence parallelism and ``zero_stage=3`` need of it, before any
        process starts."""
        shape = super().check_before_launch()
        pipelined = 2 if "pp" in self.always_applied else shape.pp
        require([hsdp_stages_problem(self.data_parallel_shard_size, pipelined)])
        if self.zero_stage == 3:
            require(
                [
                    zero3_stages_problem(
                        type(self).__name__, self.schedule, pipelined, self.reshard_after_forward
                    )
                ]
            )
        if shape.pp > 1 or "pp" in self.always_applied:
            require([self.stages_problem(shape.pp)])
            if self.sequence_parallel:
                raise ValueError(
                    f"sequence_parallel=True with pipeline_parallel_size={shape.pp}: {SP_WITH_PP}"
                )
        return shape

    def applies(self, axis: str, shape: Optional[MeshShape] = None) -> bool:
        """Whether set-up applies the parallelism of ``axis`` ("tp" or "pp") to this run's module (of
        ``shape``, by default this run's mesh)."""
        return (shape or self.mesh.shape).size(axis) > 1 or axis in self.always_applied

    def model_is_split(self) -> bool:
        return self.pipelined or self._is_sharded() or self._has_experts_split()

    def _is_sharded(self) -> bool:
        return self.lightning_module is not None and bool(sharded_parameters(self.lightning_module))

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """A partitioned module's step is its stage's schedule, with its backwards (``PipelineStages``), in
        the base's ``step_scope``."""
        if not self.pipelined:
            return super().training_step(*args, **kwargs)
        with self.step_scope():
            return self.pipelined_training_step(*args, **kwargs)

    def drain(self) -> None:
        """The async pipeline's backwards still in flight (a recompute among them) belong to the training
        step: every rank runs them (``every_rank.py``)."""
        with training_step_scope():
            super().drain()

    # ----------------------------------------------------------------- set-up: the composition
    def step_axes(self, shape: MeshShape) -> list[Axis]:
        """The axes whose hooks every step runs, in the order they run (``axes.py`` says why): the
        data-parallel average, the pipeline's sum over the stages, ZeRO's pieces, the experts' average over
        their replicas, tensor parallelism, plan verification."""
        pipelined, dp = self.applies("pp", shape), shape.dp > 1
        axes = [
            DataParallel(self, after_schedule=pipelined, overlapped=self.overlaps_reducer) if dp else None,
            Pipeline(self) if pipelined else None,
            Zero(self) if self.zero_stage and dp else None,
            ZeroParameters(self) if self.zero_stage == 3 and dp else None,
            Experts(self, after_schedule=pipelined) if shape.ep > 1 and shape.size("edp") > 1 else None,
            TensorParallel(self) if self.applies("tp", shape) else None,
            self.plan_verification if self.verify_plan and self.applies("tp", shape) else None,
        ]
        return [axis for axis in axes if axis is not None]

    def configure_parallelism(self) -> None:
        module = self.lightning_module
        shape = self.mesh.shape
        if self.applies("pp"):  # the layout's problems were refused when the Trainer was built
            self.check_schedule(shape.pp)
        why = load_balancing_refusal(module, shape.pp, self.sequence_parallel)
        if why is not None:
            raise ValueError(why)
        recompute = self.activation_checkpointing
        if self.sequence_parallel and recompute not in (False, "selective") and not can_stack():
            raise ValueError(
                f"sequence_parallel=True with activation_checkpointing={recompute!r} needs a torch whose "
                f"saved-tensor hooks can be stacked (2.13 can; this is {torch.__version__}): without it the "
                "sequence-parallel regions inside checkpointed modules would be saved for real. Use "
                "activation_checkpointing='selective', or a newer torch"
            )
        self.share_found_inf()
        self._bind_metrics_to_dp_group()  # also for validate/test/predict without a fit
        if not self.model_is_split():
            self._split(module)
        elif self._is_sharded():  # split by an earlier fit of this trainer (built on meta): keep its layers
            self._keep_earlier_shards(module, shape.tp)
        self._summarize_whole()
        self.apply_activation_checkpointing(self.block_stack)  # on the sharded stage, before the dp path
        if self.pipelined:
            self.apply_compile(self.partition.stack_name, self.partition.held_blocks(), STAGE_ENDS_IN_FORWARD)
        else:
            self.apply_compile(self.block_stack)
        if self.pipelined and self.executor is None:
            self.wire_stages(self._stage_costs)
        self.shard_over_dp()  # zero_stage=3, where set-up has not (an earlier fit's split): before the dp path
        # pipeline stages: a module replicated outside the block stack gets no gradient on some stages;
        # async averages a gradient finished a step earlier, and the schedules with several chunks or split
        # backwards average once after the schedule, not as gradients arrive in backward; the gradients
        # summed over tp at the end of each backward are held until then
        params = list(module.parameters())
        hooks = not self.pipelined or self.overlaps_reducer
        sums = installed_gradient_sums(module)
        self.reducer = self.make_reducer(
            self.split_expert_gradients(module),
            find_unused_parameters=self.pipelined,
            hooks=hooks,
            whole=[params[i] for i in self._replicated] if self.pipelined else (),
            held=sums.params if sums is not None and hooks else (),
        )
        if sums is not None:
            sums.report_to(self.reducer.grad_ready if self.reducer is not None and hooks else None)

    def follow_parameter_change(self, change: ParameterChange) -> None:
        """As the base's, for a split model: pipeline stages read again which parameters outside the
        block stack train (their gradients are summed over the stages; the split backward's weight part
        reads what trains from each graph)."""
        if self.pipelined and not change.structural:
            self._replicated = self.replicated_positions()
        super().follow_parameter_change(change)

    def trainable_set_fixed(self) -> Optional[str]:
        """As the base's; also tensor parallelism's gradient sums, the experts' reducer and the async
        schedule's batch in flight, each fixed at set-up."""
        shape = self.mesh_shape()
        if shape.tp > 1 or self.sequence_parallel:
            return (
                "tensor parallelism sums over its ranks the gradients of the parameters that trained at set-up "
                "(tensor_parallel_size > 1 or sequence_parallel=True)"
            )
        if shape.ep > 1 and shape.size("edp") > 1:
            return "the experts' gradients are averaged over their replicas by a reducer built at set-up"
        if shape.pp > 1 and self.schedule == "async":
            return (
                "schedule='async' applies each batch's gradient a step later, from a graph built before the "
                "change"
            )
        return super().trainable_set_fixed()

    def accumulation_refused(self) -> Optional[str]:
        """As the base's; the async schedule's update rule is per batch."""
        if self.mesh_shape().pp > 1 and self.schedule == "async":
            return (
                "schedule='async' applies one update per batch, its rule's (raise num_microbatches or the batch "
                "size instead, or use schedule='1f1b')"
            )
        return super().accumulation_refused()

    def _split(self, module: nn.Module) -> None:
        """Tensor parallel, then pipeline stages, applied to the meta module inside ``set_up_share``: the
        rank allocates only its stage's shards (and what it replicates), each filled from the full value.
        The module's structure before is kept (``self.whole``) to give it back whole when the stage ends."""
        self.whole = WholeModel.keep(module)
        shards = self.applies("tp") and self._plan is not None
        if shards:
            tp = self.mesh.shape.tp
            run = sample_forward(module, self.batch_to_device)
            self.resolved = resolve(module, self._plan, tp, run=run)
            if self.expert_parallel_size > 1:
                experts_left_to_expert_parallel(self.resolved, ExpertPlacement(self.expert_parallel_size))
            if self.sequence_parallel:
                self.resolved.sequence = resolve_sequence(module, self.resolved, self._plan, run)
            check_coverage(module, self.resolved, self.require_sharded)
            if self.verify_plan:
                self.plan_verification.keep_reference(module, self.resolved, pipelined=self.applies("pp"))
        self._stage_costs = self.prepare_stages(module) if self.applies("pp") else None
        self.check_experts(module)

        def parallelize() -> Any:
            cut = None
            if shards:
                self._entries, cut = shard_module(module, self.resolved, self.tp_group, self.mesh.tp_rank)
            cut = self.place_experts(module, cut)
            if self.applies("pp"):
                pp, stage, v = self.mesh.shape.pp, self.mesh.pp_rank, self.virtual_stages
                self.partition = partition(
                    module,
                    pp * v,
                    stage,
                    self.block_stack,
                    self.split_points,
                    self._stage_costs,
                    chunks=[global_stage(self.schedule, pp, stage, c, v) for c in range(v)],
                )
            self.shard_over_dp(self.root_device)  # zero_stage=3: each rank allocates only its shards
            made.append(cut)
            return cut

        made: list[Optional[Cut]] = []  # parallelize's cut, which place reads

        def place(name: str, full: torch.Tensor) -> bool:
            shards, cut = self.sharded_parameters, made[0]
            if shards is None or not shards.holds(name):
                return False
            return shards.place(name, full if cut is None else cut(name, full))

        self.set_up_share(parallelize, place)
        if self.sharded_parameters is not None:
            self.sharded_parameters.check_placed()
        if shards:
            install_gradient_sums(module, self.resolved, self.tp_group)
            if self.resolved.sequence is not None:
                self.sequence = apply_sequence_parallel(
                    module, self.resolved.sequence, self.tp_group, compiled=self.compiles(module)
                )

    def shard_over_dp(self, device: Optional[torch.device] = None) -> None:
        """``zero_stage=3``, once (set-up shards the meta module, ``device`` where each rank allocates only its
        shards): this rank's tensor-parallel share sharded over dp in units, a pipeline stage's held blocks
        kept gathered for its schedule; its experts left to their own replicas' set
        (``split_expert_gradients``)."""
        if self.sharded_parameters is not None:
            return
        own = self.own_parameters()
        experts = [p for p in self.lightning_module.parameters() if id(p) in own]
        stage = {"blocks": self.partition.held_blocks(), "kept": True} if self.pipelined else {}
        self.shard_parameters(self.block_stack, leave_out=experts, device=device, **stage)

    def per_block_refused(self) -> Optional[str]:
        """Under sequence parallelism: its hooks record by name where each module runs, so each block would
        compile a graph of its own (and dynamo runs the blocks past its recompile limit eagerly)."""
        if self.sequence is None:
            return None
        return (
            "sequence parallelism's hooks name each module, so each block would compile a graph of its own "
            "(past dynamo's recompile limit, eagerly)"
        )

    def _keep_earlier_shards(self, module: nn.Module, tp: int) -> None:
        layers = [m for m in module.modules() if isinstance(m, _TPLayer)]
        if any(layer.tp_size != tp for layer in layers):
            raise ValueError(
                f"the module is already sharded for tensor_parallel_size={layers[0].tp_size}, "
                f"but this run has tensor_parallel_size={tp}; start from an unsharded module or a "
                "full checkpoint"
            )
        self._entries = list({id(e): e for layer in layers if (e := getattr(layer, "entry", None))}.values())

    def norm_share(self) -> tuple[set[int], Optional[dist.ProcessGroup]]:
        """The parameters whose squares this rank adds to the model's norm, summed over the model group
        (pp x tp): a shard by its holder (a shard that ``copies`` ranks hold by the first of them; one
        with blocks of both kinds, split and held by several, by every holder, weighed: ``norm_weights``);
        a tensor whole on every tp rank by tp rank 0; a module outside the block stack (on every stage) by
        stage 0; with expert parallelism, an expert placed on this rank by its holder, anything else by ep
        rank 0, summed over ep x pp x tp (``ep_model``)."""
        experts = self.own_parameters()
        counted = self._counted(others=self.mesh.ep_rank == 0, experts=True)
        return counted, self.mesh.group("ep_model" if experts else "model")

    def clipping_rule(self) -> Optional[tuple[set[int], Optional[dist.ProcessGroup]]]:
        """As the base's; with ZeRO and expert parallelism, summed over the world: the other parameters'
        pieces by their holders (disjoint over dp, ep included) on ``norm_share``'s tp and pp terms, and the
        experts (held whole, out of ZeRO) by the first of their replicas (edp rank 0) on the same terms; where
        ``zero_stage=3`` shards the experts over their replicas, their pieces by their holders."""
        if not isinstance(self.reducer, ShardedGradientReducer) or not self.own_parameters():
            return super().clipping_rule()
        others = self._counted(others=True, experts=False)
        if isinstance(self.expert_reducer, ShardedGradientReducer):
            placed = self._counted(others=False, experts=True)
            experts = {id(x.shard) for x in self.expert_reducer.pieces() if id(x.param) in placed}
        else:
            experts = self._counted(others=False, experts=self.mesh.dp_rank // self.expert_parallel_size == 0)
        return {id(x.shard) for x in self.reducer.pieces() if id(x.param) in others} | experts, None

    def _counted(self, others: bool, experts: bool) -> set[int]:
        """The parameters (by id) this rank counts on ``norm_share``'s tp and pp terms: the experts placed
        on it if ``experts``, the others if ``others``."""
        module = self.lightning_module
        sharded = {  # a slice held by `copies` ranks (key-value heads fewer than the ranks) by the first
            id(t)
            for t, spec, _ in sharded_parameters(module).values()
            if self.mesh.tp_rank % min((c for _, c in spec.parts), default=1) == 0
        }
        placed = self.own_parameters()
        owned = set(self.partition.owned) if self.pipelined else None
        first_tp, first_stage = self.mesh.tp_rank == 0, self.mesh.pp_rank == 0
        return {
            id(p)
            for n, p in module.named_parameters()
            if (id(p) in sharded or first_tp)
            and (owned is None or n in owned or first_stage)
            and (experts if id(p) in placed else others)
        }

    def norm_weights(self) -> dict[int, torch.Tensor]:
        """A shard with blocks of both kinds (split, and held by several ranks: a fused q|k|v with fewer
        key-value heads than ranks), counted on every holder, weighs each row by 1 / sqrt(its copies)."""
        return {
            id(p): norm_weight(p, how)
            for p, how in replicated_blocks(self.lightning_module).items()
            if min(c for _, c in how.spec.parts) == 1
        }

    # ----------------------------------------------------------------- checkpoints: gathers over tp, ep, then pp
    def full_state_keys(self) -> list[str]:
        return list(self._full_keys) if self.pipelined else super().full_state_keys()

    def full_parameter_names(self) -> list[str]:
        return list(self._full_param_names) if self.pipelined else super().full_parameter_names()

    def full_model_state(self) -> dict[str, Any]:
        """The single-device state dict: the shards gathered over tp, the experts over ep, then the stages'
        parts over pp (``zero_stage=3``: every unit gathered over dp first)."""
        return self.read_gathered(self._split_model_state)

    def _split_model_state(self) -> dict[str, Any]:
        module = self.lightning_module
        state = full_state_dict(module, self.tp_group) if self._is_sharded() else module.state_dict()
        state = gather_shards(module, state, self.ep_group, expert_pieces)
        return gather_parts(state, self.pp_group, self._full_keys) if self.pipelined else state

    def load_full_model_state(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """A full checkpoint (any layout, or a plain single-device one): each rank takes its stage's part
        (``strict`` refuses, as one device does, keys of no stage and this stage's keys it lacks) and cuts
        its shards from it (``zero_stage=3``: into the gathered units, each rank keeping its range)."""
        with self.parameters_gathered():
            self._load_split_model_state(state_dict, strict)

    def _load_split_model_state(self, state_dict: Mapping[str, Any], strict: bool) -> None:
        if not self.model_is_split():
            return super().load_full_model_state(state_dict, strict=strict)
        module = self.lightning_module
        if self.pipelined:
            local_keys = set(module.state_dict().keys())
            if strict:
                check_keys(
                    local_keys, set(state_dict), set(self._full_keys), f"pipeline stage {self.mesh.pp_rank}"
                )
            state_dict, strict = {k: v for k, v in state_dict.items() if k in local_keys}, False
        state_dict = cut_shards(module, state_dict, expert_pieces)
        if self._is_sharded():
            load_full_state_dict(module, state_dict, strict=strict)
        else:
            module.load_state_dict(state_dict, strict=strict)

    def one_device_copy(self, tree: nn.Module, state: Mapping[str, Any]) -> nn.Module:
        """``tree`` as on one device: whole layers and blocks, per-feature tensors whole, no process group."""
        if self._is_sharded() or self._has_experts_split():
            return unsharded_copy(tree, self.lightning_module, state)
        return super().one_device_copy(tree, state)

    def shard_layouts(self) -> dict[str, ShardLayout]:
        """For ``save_distributed``: which slice of each full tensor this rank holds."""
        shards = sharded_parameters(self.lightning_module)
        parted = [key for key, (_, spec, _) in shards.items() if spec.parts]
        if parted:
            raise ValueError(
                f"{parted[0]!r} is cut in blocks of unequal widths (parts), which a distributed checkpoint "
                "cannot describe yet; save a full checkpoint (the default checkpoint format)"
            )
        return {
            key: ShardLayout(spec.dim, spec.chunks, layer.tp_rank, layer.tp_size, self.tp_group)
            for key, (_, spec, layer) in shards.items()
        }

    def full_optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The single-device optimizer state: its shards gathered over tp, then the stages' over pp."""
        if not self.model_is_split():
            return super().full_optimizer_state(optimizer)
        optimizer, module = unwrapped(optimizer), self.lightning_module
        state = full_optimizer_state(optimizer, module, self.tp_group) if self._is_sharded() else None
        state = full_optimizer_state(optimizer, module, self.ep_group, expert_pieces, state)
        if not self.pipelined:
            return state
        named = state_by_name(optimizer, module, state)
        return gather_optimizer_parts(named, self.pp_group, self._full_param_names)

    def load_full_optimizer_state(self, checkpoint: Mapping[str, Any]) -> None:
        if not self.model_is_split():
            return super().load_full_optimizer_state(checkpoint)
        module = self.lightning_module
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            if self.pipelined:
                state = state_from_full(state, optimizer, module, self._full_param_names)
            state = shard_optimizer_state(state, optimizer, module, expert_pieces)
            if self._is_sharded():
                state = shard_optimizer_state(state, optimizer, module)
            optimizer.load_state_dict(state)

    def whole_gradients(self, grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's gradients by name with its shards gathered over tp (a collective); a rank other than
        tp rank 0 returns none, so each part of the model is counted once (the async resume state)."""
        whole = gather_shards(self.lightning_module, grads, self.tp_group)
        return whole if self.mesh.tp_rank == 0 else {}

    def cut_gradients(self, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole gradients by name cut to this rank's shards (no communication)."""
        return cut_shards(self.lightning_module, full)

    # ----------------------------------------------------------------- the module given back
    def connect(self, model: Any) -> None:
        remove_guard(model)  # a module left split by an earlier stage is this stage's to set up
        super().connect(model)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        with guard_lifted(self.lightning_module):  # trainer.save_checkpoint of a module left split
            return super().lightning_module_state_dict()

    def _summary_callbacks(self) -> list[ModelSummary]:
        trainer = getattr(self.lightning_module, "_trainer", None)
        return [c for c in trainer.callbacks if isinstance(c, ModelSummary)] if trainer is not None else []

    def _summarize_whole(self) -> None:
        """Lightning's model summary (at ``on_fit_start``, after set-up) counts the whole module's
        parameters, not this rank's share."""
        if self.whole is None or self.whole.skeleton is None or not self.model_is_split():
            return
        for callback in self._summary_callbacks():
            callback.__dict__["_summary"] = types.MethodType(summary_of_whole(self.whole), callback)

    def give_back_whole(self) -> None:
        """At the end of a stage, the module (and its optimizer) whole again, or refusing to pass for whole."""
        for callback in self._summary_callbacks():
            callback.__dict__.pop("_summary", None)
        if self.lightning_module is not None and self.whole is not None and self.model_is_split():
            give_back(self, self.lightning_module, self.whole)

    def room_for_whole(self) -> int:
        """The bytes of host memory each process on this host may take for the whole module (where Lightning
        puts it at the end of a stage); unbounded where the host does not say."""
        available = available_host_bytes()
        return sys.maxsize if available is None else available // max(1, self.num_processes)

    def forget_split(self, module: nn.Module) -> None:
        """What the split left on the strategy and the root module: the next stage splits the whole module."""
        module.__dict__.pop(FEATURE_SHARDS, None)
        remove_gradient_sums(module)
        self.sequence = None
        self.partition, self.executor, self.logs, self._deferred_bn = None, None, None, None
        self._replicated = []
        self._checkpointed = []
        self._compiled_blocks = []

    def teardown(self) -> None:
        self.give_back_whole()  # then the axes' teardowns (the base's)
        super().teardown()
