"""What every lightning_parallel strategy shares: processes, the rank mesh, and Lightning's contract.

We inherit Lightning's own ``DDPStrategy`` for the process plumbing only (launchers, cluster
environments, process-group creation, barrier/broadcast). Two reasons: the Trainer recognises it as a
distributed strategy by ``isinstance`` (distributed sampler, ``sync_dist`` logging), and torchrun/SLURM
detection is already right there. Everything it does with ``torch.nn.parallel.DistributedDataParallel``
is replaced: ``configure_ddp`` never wraps the module; subclasses install their own parallelism in
``configure_parallelism``.

What the base adds on top:
- a (dp, pp, tp) mesh built right after the default process group (``mesh_shape`` is the subclass's);
- samplers, ``self.log(sync_dist=True)`` and torchmetrics reduce over the data-parallel group, so
  model-parallel peers that hold the same batch are not counted twice;
- the step's axes (``axes.py``): each step hook calls that hook of every axis in ``self.axes``, the list
  ``step_axes`` builds at set-up in one order (here: the ``GradientReducer``'s average and ZeRO's pieces);
- with ``check_finite_loss=True``, a NaN/inf training loss raises, naming step, batch and rank, without a
  per-step device sync (``checkpointing.loss_check``); by default training goes on, as under Lightning's
  ``ddp``;
- a ``FailureWatchdog``: if one rank raises or dies, or waits in a collective that a peer never joins,
  every rank exits within ``failure_timeout`` seconds (default 60) naming the rank and the call, instead
  of waiting in a collective; a signal (SIGTERM) ends a rank stuck in one within seconds;
- the set-up that split models share: the (dp, model-parallel) sizes checked against the world before
  any process group exists (``mesh_shape``), clipping by the whole model's norm, decided once
  (``clipping_rule``, installed by ``install_clipping``), one overflow verdict for every rank under 16-mixed
  (``share_found_inf``), and the refusal of launchers that would hand back rank 0's part only
  (``popen_only``);
- deferred initialization and a set-up that holds only the rank's share (``set_up_share``, from
  ``materialize``): ``init_module()`` / ``configure_model`` build on meta (``tensor_init_context``), the
  parallelism is applied to the meta module, and the rank allocates and fills only what it keeps, from a
  checkpoint, ``initial_weights``, rank 0's real tensors or the modules' initializers;
- options checked by ``own_option_problems`` at each level, which ``lp-train`` runs before launching too
  (``strategies.options``);
- with ``memory_report=True`` (default), rank 0 prints every rank's memory after set-up and at the end of
  ``fit`` (``memory.MemoryReport``, held as ``self.memory``; a ``MemoryReport`` callback takes its place);
- checkpoints and exact resume (``checkpointing.Checkpointer``: data position and RNG in the checkpoint,
  files written atomically, ``save_distributed=True`` for one shard per rank through
  torch.distributed.checkpoint); a strategy states its part through ``checkpointing.CheckpointContract``.
"""

from __future__ import annotations

import sys
import types
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import (
    Any,
    Callable,
    Generator,
    Literal,
    Mapping,
    Optional,
    Sequence,
    Union,
    get_args,
)

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _init_dist_connection, _sync_ddp_if_available
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies import DDPStrategy as _LightningDDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_parallel.block_compile import (
    CompiledBlocks,
    CompileOption,
    apply_block_compile,
    compile_problem,
    uncompile_blocks,
)
from lightning_parallel.checkpointing import AtomicCheckpointIO, Checkpointer
from lightning_parallel.checkpointing.by_name import state_by_name
from lightning_parallel.checkpointing.contract import check_keys, unwrapped
from lightning_parallel.checkpointing.loss_check import FiniteLossCheck, training_loss
from lightning_parallel.compat import compiled_by_lightning
from lightning_parallel.distributed.collectives import clip_grad_norm_counted, group_size, share_found_inf
from lightning_parallel.distributed.group_exit import destroy_process_groups_at_exit
from lightning_parallel.distributed.mesh import Mesh, MeshShape, build_mesh, new_axis_group
from lightning_parallel.distributed.optimizer_shards import (
    ShardedOptimizer,
    StatePieces,
    refuse_raw_clipping,
    sharding_problem,
)
from lightning_parallel.distributed.reducer import GradientReducer
from lightning_parallel.distributed.replicas import broadcast_module_states
from lightning_parallel.distributed.sync_batchnorm import SyncBatchNormPlugin
from lightning_parallel.distributed.watchdog import FailureWatchdog
from lightning_parallel.distributed.zero import ZERO_STAGES, ShardedGradientReducer
from lightning_parallel.distributed.zero3 import FullyShardedGradientReducer, ShardedParameters
from lightning_parallel.distributed.zero3_dtypes import dtype_option_problem, unit_dtypes, unit_dtypes_problem
from lightning_parallel.every_rank import every_rank_scope, training_step_scope
from lightning_parallel.materialize import (
    Cut,
    Place,
    WeightSource,
    capture,
    describe_loaded,
    has_meta_tensors,
    materialize,
    open_weights,
    recording_constructors,
    shared_rng_state,
)
from lightning_parallel.memory import MemoryReport
from lightning_parallel.module_names import find_block_stack
from lightning_parallel.moe.load_balancing import install as install_global_load_balancing
from lightning_parallel.parameter_set import ParameterChange, ParameterSet
from lightning_parallel.recompute import (
    Spec,
    apply_activation_checkpointing,
    remove_activation_checkpointing,
    spec_problem,
)
from lightning_parallel.strategies.axes import Axis, around, each
from lightning_parallel.strategies.callback_support import (
    accumulation_refusal,
    finetuning_refusal,
    split_model_refusal,
)
from lightning_parallel.strategies.checks import (
    layout,
    layout_sizes,
    one_of,
    positive_number,
    require,
    shard_size,
)
from lightning_parallel.strategies.data_parallel_axes import DataParallel, Zero, ZeroParameters
from lightning_parallel.strategies.global_batch import describe_global_batch
from lightning_parallel.strategies.launcher import (
    HydraSafeSubprocessLauncher,
    failure_exit_fn,
    launching_store,
)
from lightning_parallel.strategies.options import level_problems, options

__all__ = ["ParallelStrategyBase"]


#: seconds a collective waits before it fails (torch's default, 30 minutes)
DEFAULT_TIMEOUT_S = default_pg_timeout.total_seconds()
StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
START_METHODS = get_args(StartMethod)


def _initial_weights_problem(value: Any, prefix: str) -> Optional[str]:
    if value is None or isinstance(value, Mapping):
        return None
    if not isinstance(value, (str, Path)) or not Path(value).exists():
        return (
            f"{prefix}initial_weights={value!r} is not a file or folder: give a .safetensors file, a folder of "
            "them, a torch file (a checkpoint or a state dict), or a mapping of names to tensors"
        )
    return None


#: why a model the user compiled whole is compiled block by block under zero_stage=3
ZERO3_GATHERS_IN_FORWARD = (
    "zero_stage=3 gathers each block's parameters in hooks around its forward and backward, collectives a "
    "whole compiled step would break its graph at, once per block"
)


def _raw_clipping_refused(zero_stage: int) -> str:
    return (
        f"zero_stage={zero_stage}: the model's parameters hold no gradient (each data-parallel rank holds the "
        "gradients of its pieces of them), so torch's clip_grad_norm_ / clip_grad_value_ on them would clip "
        "nothing. Call self.clip_gradients(optimizer, gradient_clip_val=..., gradient_clip_algorithm='norm') "
        "in training_step (it clips by the whole model's norm), or set Trainer(gradient_clip_val=...)."
    )


def _zero_stage_problem(cls: type, stage: Any, prefix: str) -> Optional[str]:
    """A ``zero_stage`` of ``ZERO_STAGES`` that ``cls`` does not run (``zero_stages``)."""
    if stage not in ZERO_STAGES or stage in cls.zero_stages or cls.zero_refused is not None:
        return None
    return (
        f"{prefix}zero_stage={stage} (parameters sharded over the data-parallel group) is not supported by "
        f"{cls.__name__} yet: it runs under lp_ddp and lp_parallel; here use zero_stage "
        f"{', '.join(map(str, cls.zero_stages[:-1]))} or {cls.zero_stages[-1]} (optimizer state and gradients "
        "sharded)"
    )


def _shard_size_problem(cls: type, values: Mapping[str, Any], prefix: str) -> Optional[str]:
    """``data_parallel_shard_size`` (HSDP) without the world: its type, that ZeRO is on, where it runs; that
    it divides the data-parallel size is ``checks.shard_size``'s, once the world is known."""
    name = f"{prefix}data_parallel_shard_size"
    shard, stage = values["data_parallel_shard_size"], values["zero_stage"]
    if shard is None:
        return None
    if not isinstance(shard, int) or isinstance(shard, bool) or shard < 2:
        return (
            f"{name} must be an integer of at least 2 (the data-parallel ranks ZeRO shards over, e.g. the devices "
            f"per node) or None (all of them), got {shard!r}"
        )
    if not cls.shards_within_data_parallel:
        return (
            f"{name}={shard} (HSDP) is not supported by {cls.__name__} yet: it runs under lp_ddp and lp_parallel "
            "(without pipeline stages); leave it None"
        )
    if stage not in (1, 2, 3):
        return (
            f"{name}={shard} shards ZeRO's state within groups of {shard} ranks, and zero_stage={stage!r} shards "
            "nothing: set zero_stage 1, 2 or 3, or leave it None"
        )
    if values["save_distributed"]:
        return (
            f"{name}={shard} with save_distributed=True is not supported yet: use save_distributed=False (a full "
            "checkpoint, loadable in any layout) or leave data_parallel_shard_size None"
        )
    return None


#: the switches of zero_stage=3 (default True) -> what False does, and why it means nothing below stage 3
ZERO3_SWITCHES = {
    "reshard_after_forward": (
        "keeps zero_stage=3's gathered blocks until their backward",
        "the parameters are whole anyway",
    ),
    "release_host_memory": (
        "leaves glibc's heap policy as it is for zero_stage=3's host memory",
        "nothing is sharded that would release memory",
    ),
}


def _zero3_switch_problem(name: str, stage: Any, value: Any, prefix: str) -> Optional[str]:
    """A switch of ``ZERO3_SWITCHES`` against ``zero_stage`` (the pipelines' refusal of
    ``reshard_after_forward``: ``zero3_stages_problem``)."""
    if not isinstance(value, bool):
        return f"{prefix}{name} must be True or False, got {value!r} (default True)"
    if not value and stage != 3:
        does, moot = ZERO3_SWITCHES[name]
        return f"{prefix}{name}=False {does}; with zero_stage={stage} {moot}: leave it True, or use zero_stage=3"
    return None


def _nothing() -> None:
    """The release of a refusal never installed (a function, not a lambda: the strategy pickles for spawn)."""


class ParallelStrategyBase(Checkpointer, _LightningDDPStrategy):
    """Base of all lightning_parallel strategies; not registered itself.

    Args:
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; None picks the accelerator's.
        timeout: seconds (or a ``timedelta``) that a collective may wait before it fails.
        start_method: how processes start: ``"popen"`` (default), ``"spawn"``, ``"fork"``, ``"forkserver"``.
        failure_timeout: seconds after which the other ranks stop when one fails or dies, and after which
            every rank stops when a collective is never joined by some rank of its group.
        save_distributed: write checkpoints as a directory with one shard per rank
            (torch.distributed.checkpoint) instead of one gathered file; see ``checkpointing.sharded``.
        check_finite_loss: raise ``NonFiniteLossError`` at a NaN/inf training loss, naming step, batch and
            rank (``checkpointing.loss_check``: read without a per-step device sync). False (default): as
            under Lightning's ``ddp``, training goes on; ``EarlyStopping(check_finite=True)`` or
            ``SpikeDetection`` decide. (A strategy whose returned loss is a placeholder, e.g. a pipeline
            stage, checks its real loss itself.)
        memory_report: print every rank's memory (parameters, gradients, optimizer state, saved
            activations, set-up peak) on rank 0 after set-up and at the end of ``fit``; see docs/memory.md.
        initial_weights: pretrained weights that set-up reads straight into the rank's share, tensor by
            tensor: a ``.safetensors`` file or a folder of them, a torch file (a Lightning checkpoint or a
            state dict), or a mapping; tensors it lacks keep the module's initializers. A ``fit(ckpt_path=)``
            takes precedence. See docs/large_models.md.
        initial_weights_prefix: put before every name of ``initial_weights`` (``"model."`` for a Hugging
            Face model held as ``self.model``).
        activation_checkpointing: recompute activations in backward instead of keeping them: False (off),
            True (every block of the block stack), ``"selective"`` (only each block's attention) or a list
            of module-name patterns; applied at set-up after the model is split (``recompute``).
        zero_stage: optimizer sharding over the data-parallel group (ZeRO; ``distributed.zero``): 0 (off),
            1 (each rank keeps and updates 1/dp of the optimizer state; gradients reduce-scattered, updated
            parameters all-gathered), 2 (also only 1/dp of the gradients kept between steps) or 3 (also only
            1/dp of the parameters, each block gathered for its forward and backward,
            ``distributed.zero3``: lp_ddp, and lp_parallel, where each rank's tensor-parallel and pipeline
            share is sharded over dp). Needs an elementwise ``torch.optim`` optimizer (SGD, Adam, AdamW, ...).
        reshard_after_forward: with ``zero_stage=3``, free each block's gathered parameters after its
            forward and gather them again for its backward (True; the last two blocks, which the
            backward's start holds anyway, are kept: ``zero3.KEPT_FOR_BACKWARD``); False keeps them from the
            forward to the end of its backward (one gather per step, more memory held during the step).
            Refused where it means nothing: below zero_stage=3, and under pipeline stages, whose units are kept
            gathered across the micro-batches of a step already.
        release_host_memory: with ``zero_stage=3`` on the CPU, glibc serves every block of 1 MiB or more from
            a mapping of its own, handed back to the system when freed, process-wide from set-up on (True):
            the freed gathers and gradients never stay resident in its heap, for the lowest peak resident
            memory, at a page fault per 4 KiB each time such memory is used again. False leaves glibc's
            policy as it is: fewer faults and a faster step, a higher peak (docs/benchmarks.md, ZeRO-3).
            No effect on GPUs.
        data_parallel_shard_size: HSDP (lp_ddp, and lp_parallel without pipeline stages or experts; with
            ``zero_stage``): ZeRO shards over groups of this
            many neighbouring data-parallel ranks (the "shard" dimension of FSDP2's 2-D mesh; on several
            machines, the devices per node) and replicates across the groups: gradients reduce-scattered
            within a group, each shard then all-reduced across the groups, parameters gathered within a group
            only; each rank keeps 1/data_parallel_shard_size of the sharded state. None (default): shard over
            all data-parallel ranks. Must divide the data-parallel size.
        param_dtype: with ``zero_stage=3``, the dtype each unit's parameters are gathered and computed in
            ("bfloat16", "float16", "float32", "float64"; FSDP2's ``MixedPrecisionPolicy.param_dtype``); the
            shards, the optimizer and its state keep the parameters' own dtype. None (default): autocast's
            dtype under ``bf16-mixed`` / ``16-mixed`` (half the bytes gathered and held), the parameters'
            own under the true precisions, where another is refused (``distributed.zero3_dtypes``).
        reduce_dtype: with ``zero_stage=3``, the dtype the gradients are reduce-scattered in (cast to it
            before, to the shards' dtype after). None (default): the parameters' own (float32 under the mixed
            precisions).
        compile: per-block ``torch.compile`` (``block_compile``): False (off), True (torch.compile's
            defaults) or its keyword arguments as a mapping (``{"backend": "inductor", "mode": ...}``). Each
            block of the block stack this rank holds is compiled on its own after the parallelisms and the
            recompute are applied, so one graph per block class is reused across the layers; the code
            outside the blocks runs eagerly. A model the user compiled (``trainer.fit(torch.compile(model))``)
            gives the settings instead, its whole-step compile undone.
    """

    #: False where sharded checkpoints would be wrong or pointless (lp_dp: the optimizer lives on rank 0)
    supports_save_distributed = True
    #: why ``zero_stage`` cannot be used (lp_dp: the optimizer lives on rank 0), or None
    zero_refused: Optional[str] = None
    #: the ``zero_stage`` values this strategy runs (3, the parameters sharded too, only where it is wired)
    zero_stages: tuple[int, ...] = (0, 1, 2)
    #: ``data_parallel_shard_size`` (HSDP) is wired (ZeRO's groups are ``zero_group`` / ``zero_replica_group``)
    shards_within_data_parallel = False
    #: the data-parallel gradient path without optimizer sharding (a benchmark swaps the bucket collective)
    reducer_class: type[GradientReducer] = GradientReducer
    #: why only ``start_method="popen"`` works, where the others would hand back rank 0's part only
    popen_only: Optional[str] = None
    #: the options that size the mesh's axes (option name -> "dp", "tp" or "pp"), in the order messages name
    #: them; an axis without one has size 1, and without any the run is data parallel over every process
    size_options: dict[str, str] = {}
    #: ``init_module()`` and ``configure_model`` build on the meta device unless ``empty_init=False``
    #: (split models: each rank materializes its share); otherwise only with ``empty_init=True``
    defers_init_by_default = False

    def __init__(
        self,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta, None] = DEFAULT_TIMEOUT_S,
        start_method: StartMethod = "popen",
        failure_timeout: float = 60.0,
        save_distributed: bool = False,
        check_finite_loss: bool = False,
        memory_report: bool = True,
        initial_weights: Optional[WeightSource] = None,
        initial_weights_prefix: str = "",
        activation_checkpointing: Spec = False,
        zero_stage: int = 0,
        reshard_after_forward: bool = True,
        release_host_memory: bool = True,
        data_parallel_shard_size: Optional[int] = None,
        param_dtype: Optional[str] = None,
        reduce_dtype: Optional[str] = None,
        compile: CompileOption = False,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise TypeError(
                f"{type(self).__name__} got unknown argument(s) {sorted(unknown)}; it accepts "
                f"{sorted(o.name for o in options(type(self), configurable=False))}."
            )
        require(level_problems(ParallelStrategyBase, type(self), locals()))
        if isinstance(timeout, (int, float)):
            timeout = timedelta(seconds=timeout)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io if checkpoint_io is not None else AtomicCheckpointIO(),
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.mesh: Optional[Mesh] = None
        self.reducer: Optional[GradientReducer] = None
        self.axes: list[Axis] = []  # the step's axes, in the order their hooks run (step_axes)
        self._reducer_arguments: Optional[tuple[list, dict]] = None  # make_reducer's, to rebuild it
        self._parameter_set: Optional[ParameterSet] = None  # the parameters as set-up left them
        self._sync_grads = True  # False on accumulating micro-steps (block_backward_sync)
        self.failure_timeout = float(failure_timeout)
        self.save_distributed = save_distributed
        self.check_finite_loss = check_finite_loss
        self._loss_check = FiniteLossCheck()
        self._watchdog: Optional[FailureWatchdog] = None
        self._pending_full_state: Optional[Mapping[str, Any]] = None  # a checkpoint for a meta module
        self._setup_rng_state: Optional[Tensor] = None  # CPU random state at set-up: deferred initial values
        self.initial_weights = initial_weights
        self.initial_weights_prefix = initial_weights_prefix
        self.memory_report = memory_report
        self.activation_checkpointing = activation_checkpointing
        self.zero_stage = zero_stage
        self.reshard_after_forward = reshard_after_forward
        self.release_host_memory = release_host_memory
        self.data_parallel_shard_size = data_parallel_shard_size
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.compile = compile
        self._compiled_blocks: CompiledBlocks = []  # the blocks set-up compiled, and the forward each had
        self._optimizer_shards: dict[int, ShardedOptimizer] = {}  # id(optimizer) -> its sharding
        #: zero_stage=3's sharded parameters, once set up: over dp first, then (expert parallelism) the
        #: experts' over their replicas
        self.parameter_shards: list[ShardedParameters] = []
        self._release_raw_clipping: Callable[[], None] = _nothing  # refuse_raw_clipping's, under ZeRO
        self._release_load_balancing: Callable[[], None] = _nothing  # load_balancing.install's undo
        self._checkpointed: list[str] = []  # the submodules whose forward set-up checkpointed
        self.memory = MemoryReport(defer_to_callback=True) if memory_report else None  # baseline: now

    @classmethod
    def own_option_problems(cls, values: Mapping[str, Any], prefix: str = "") -> list[Optional[str]]:
        """The checks of the arguments declared here (``strategies.options.option_problems`` reads them)."""
        start_method, timeout = values["start_method"], values["timeout"]
        return [
            positive_number(f"{prefix}failure_timeout", values["failure_timeout"], "seconds", 60),
            None
            if timeout is None or isinstance(timeout, timedelta)
            else positive_number(f"{prefix}timeout", timeout, "seconds", 1800),
            one_of(f"{prefix}start_method", start_method, START_METHODS),
            None
            if cls.popen_only is None or start_method == "popen"
            else (
                f"{prefix}start_method={start_method!r} is not supported by {cls.__name__}: {cls.popen_only}; "
                "use 'popen'"
            ),
            cls._save_distributed_problem(values["save_distributed"], values.get("checkpoint_io"), prefix),
            _initial_weights_problem(values["initial_weights"], prefix),
            spec_problem(values["activation_checkpointing"], f"{prefix}activation_checkpointing"),
            one_of(f"{prefix}zero_stage", values["zero_stage"], ZERO_STAGES),
            compile_problem(values["compile"], f"{prefix}compile"),
            None
            if not values["zero_stage"] or cls.zero_refused is None
            else f"{prefix}zero_stage={values['zero_stage']!r} is not supported by {cls.__name__}: {cls.zero_refused}",
            _zero_stage_problem(cls, values["zero_stage"], prefix),
            _shard_size_problem(cls, values, prefix),
            dtype_option_problem(f"{prefix}param_dtype", values["param_dtype"], values["zero_stage"]),
            dtype_option_problem(f"{prefix}reduce_dtype", values["reduce_dtype"], values["zero_stage"]),
            *(_zero3_switch_problem(name, values["zero_stage"], values[name], prefix) for name in ZERO3_SWITCHES),
        ]

    @classmethod
    def _save_distributed_problem(cls, value: Any, checkpoint_io: Any, prefix: str) -> Optional[str]:
        name = f"{prefix}save_distributed"
        if not isinstance(value, bool):
            return f"{name} must be True or False, got {value!r} (default False)."
        if value and not cls.supports_save_distributed:
            return (
                f"{name}=True is not supported by {cls.__name__} ({cls.strategy_name}): it holds no sharded "
                "state; use save_distributed=False, or lp_ddp, lp_tensor_parallel or lp_pipeline_* for one "
                "shard per rank."
            )
        if value and checkpoint_io is not None:
            return (
                f"{name}=True writes through torch.distributed.checkpoint, so checkpoint_io="
                f"{type(checkpoint_io).__name__}(...) would be ignored; pass one or the other."
            )
        return None

    def _configure_launcher(self) -> None:
        """Our popen launcher: per-job children and clean-up, so Hydra sweeps (``-m``) work. The Trainer calls
        this in its constructor, once it has told the strategy its devices and nodes: the layout is checked
        here (``check_before_launch``), so a bad one fails once, in the user's process, before any other
        process starts."""
        self.check_before_launch()
        if self._start_method == "popen":
            assert self.cluster_environment is not None
            self._launcher = HydraSafeSubprocessLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        else:
            super()._configure_launcher()

    # ----------------------------------------------------------------- layout
    def check_before_launch(self) -> MeshShape:
        """What can be checked once the number of processes is known, before any starts: the layout, and
        ``param_dtype`` / ``reduce_dtype`` against the precision plugin the Trainer gave."""
        require([unit_dtypes_problem(self.param_dtype, self.reduce_dtype, self._precision())])
        return self.mesh_shape()

    def _precision(self) -> Any:
        """Lightning's precision of the plugin (e.g. "bf16-mixed"; "32-true" before the Trainer gives one)."""
        return getattr(self.precision_plugin, "precision", None)

    def mesh_shape(self) -> MeshShape:
        """The (dp, pp, tp) layout of this run from ``size_options`` (and HSDP's shard size); raises, naming
        sizes that fit, when their product is not the world, before any process group exists."""
        world, name = self.world_size, f"{type(self).__name__}: "
        where = f"{world} process(es) of this run (num_nodes={self.num_nodes} x devices={self.num_processes})"
        shape = MeshShape(dp=world)
        if self.size_options:
            sizes = {option: getattr(self, option) for option in self.size_options}
            require([layout(world, where, sizes)], prefix=name)
            resolved = layout_sizes(world, sizes)
            shape = MeshShape(**{axis: resolved[option] for option, axis in self.size_options.items()})
        shard = self.data_parallel_shard_size
        require([shard_size("data_parallel_shard_size", shard, shape.dp, where)], prefix=name)
        return replace(shape, dp_shard=shard)

    def setup_distributed(self) -> None:
        """Lightning's, except that a GPU is bound to the process group only for NCCL: Lightning binds it
        for any backend, and with gloo on CUDA that makes ``new_group`` try to split the gloo group, which
        gloo cannot do (torch 2.11: ``AttributeError: ... perform_nocolor_split``; seen on an H100)."""
        reset_seed()
        self.set_world_ranks()
        shape = self.mesh_shape()  # a layout that cannot fit fails before any process group exists
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:  # so does a callback it cannot run
            name = type(self).__name__
            callbacks = trainer.callbacks
            fixed, per_batch = self.trainable_set_fixed(), self.accumulation_refused()
            require(
                [
                    split_model_refusal(callbacks, name, shape, self.zero_stage),
                    finetuning_refusal(callbacks, name, fixed),
                    accumulation_refusal(callbacks, name, per_batch),
                ]
            )
        self._process_group_backend = self._get_process_group_backend()
        assert self.cluster_environment is not None
        bind = self.root_device.type != "cpu" and self._process_group_backend != "gloo"
        _init_dist_connection(
            self.cluster_environment,
            self._process_group_backend,
            timeout=self._timeout,
            device_id=self.root_device if bind else None,
            **self._launching_store(),
        )
        self.mesh = build_mesh(shape)
        destroy_process_groups_at_exit()
        if self.world_size > 1 and self._watchdog is None:
            self._watchdog = FailureWatchdog(
                self.global_rank, self.world_size, timeout=self.failure_timeout, exit_fn=failure_exit_fn()
            ).start()

    def _launching_store(self) -> dict[str, Any]:
        """``init_process_group``'s ``store`` where this process launched the run's ranks and hosts its store:
        its own connection, made before the children started (``launcher.launching_store``), so that a
        child lost before the rendezvous fails this rank at once whenever it happens; else nothing (the
        ``env://`` rendezvous)."""
        store = launching_store()
        if store is None:
            return {}
        store.set_timeout(self._timeout)
        return {"store": store}

    @property
    def dp_group(self) -> Optional[torch.distributed.ProcessGroup]:
        """The data-parallel group (None = the whole world)."""
        return self.mesh.group("dp") if self.mesh is not None else None

    @property
    def zero_group(self) -> Optional[torch.distributed.ProcessGroup]:
        """The group ZeRO shards over: the data-parallel group, or with ``data_parallel_shard_size`` (HSDP)
        this rank's shard group."""
        hsdp = self.mesh is not None and self.mesh.shape.replicates_shards
        return self.mesh.group("dp_shard") if hsdp else self.dp_group

    @property
    def zero_replica_group(self) -> Optional[torch.distributed.ProcessGroup]:
        """With ``data_parallel_shard_size`` (HSDP): the ranks holding the same shard as this one, across which
        ZeRO's gradient ranges are all-reduced; None without."""
        hsdp = self.mesh is not None and self.mesh.shape.replicates_shards
        return self.mesh.group("dp_replicate") if hsdp else None

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        shape = self.mesh_shape()
        dp_rank = shape.coordinates(self.global_rank)[0]
        return {"num_replicas": shape.dp, "rank": dp_rank}

    # ----------------------------------------------------------------- Lightning hooks
    #: evaluation without a previous fit also splits the model (pipelines must: they run stage by stage)
    evaluates_split = False

    def setup(self, trainer: "pl.Trainer") -> None:
        self._setup_rng_state = torch.get_rng_state()  # the same in every layout
        self.axes = self.step_axes(self.mesh.shape)
        if self._layer_sync is not None:
            # Trainer(sync_batchnorm=True): torch's SyncBatchNorm refuses CPU, syncs over WORLD and replaces
            # the layers; ours syncs over this run's data-parallel group and converts them in place
            self._layer_sync = SyncBatchNormPlugin(self.dp_group)
        if trainer.state.fn == TrainerFn.FITTING:
            self._memory_hook("setup", "fit")
            self._batch_described = False
            super().setup(trainer)
            self.restore_after_setup(trainer)
            return
        # validate/test/predict: Lightning's DDPStrategy would broadcast rank 0's tensors to every rank,
        # which would overwrite the other ranks' shards or stages. Keep each rank's part.
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if not self.model_is_split():
            if self.evaluates_split:
                self.configure_parallelism()
            elif has_meta_tensors(self.lightning_module):  # built on meta, evaluated whole
                self.set_up_share()
            else:
                broadcast_module_states(self.lightning_module)
        self.setup_precision_plugin()
        self.restore_after_setup(trainer)

    # ----------------------------------------------------------------- deferred initialization
    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=...)`` and ``configure_model``: on the meta device when the
        initialization is deferred (``empty_init=True``, or unset under a split-model strategy); each rank
        then materializes only what it keeps, from the modules' own initializers or a checkpoint."""
        if not (empty_init or (empty_init is None and self.defers_init_by_default)):
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context(), recording_constructors():
            yield

    def model_to_device(self) -> None:
        """A module on meta, or one this strategy is about to split, is placed by ``set_up_share``."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        splits_now = fitting or self.evaluates_split
        about_to_split = self.defers_init_by_default and splits_now and not self.model_is_split()
        if has_meta_tensors(self.model) or about_to_split:
            return
        super().model_to_device()

    def set_up_share(
        self, parallelize: Callable[[], Optional[Cut]] = lambda: None, place: Optional[Place] = None
    ) -> None:
        """Set up this rank's share of the module without holding the whole on the device: its tensors are
        taken out (meta left in place), ``parallelize()`` splits the meta module and returns how a rank cuts
        a full tensor (None: keeps it whole), then what the rank still holds is allocated on its device and
        filled one module at a time: from a checkpoint given before set-up, the module's real tensors (rank
        0's, one at a time), or its initializers, run on the host from rank 0's random state. Tensors that
        ``parallelize()`` placed itself get their values through ``place`` (``materialize``)."""
        module = self.lightning_module
        rng_state = shared_rng_state(self._setup_rng_state)
        captured = capture(module)
        cut = parallelize()
        checkpoint, self._pending_full_state = self._pending_full_state, None
        if checkpoint is None and self.initial_weights is not None:
            checkpoint = open_weights(self.initial_weights, self.initial_weights_prefix)
            rank_zero_info(describe_loaded(captured, checkpoint, self.initial_weights))
        materialize(module, captured, self.root_device, rng_state, cut, checkpoint, place)

    def load_full_model_state(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """A checkpoint read before set-up into a module built on meta is kept, and set-up reads each
        tensor of the rank's share straight from it."""
        module = self.lightning_module
        if has_meta_tensors(module) and not self.model_is_split():
            expected = set(module.state_dict().keys())
            if strict:
                check_keys(expected, set(state_dict), expected)
            self._pending_full_state = state_dict
            return
        super().load_full_model_state(state_dict, strict=strict)

    def configure_ddp(self) -> None:
        """Called by Lightning's ``DDPStrategy.setup`` while fitting: install our parallelism instead."""
        self.configure_parallelism()
        self._bind_metrics_to_dp_group()
        self.install_clipping()
        self._forget_parameter_set()
        self._parameter_set = ParameterSet(self.lightning_module)
        self._release_load_balancing()  # a mixture of experts' load-balancing loss on the global batch
        self._release_load_balancing = install_global_load_balancing(
            self.lightning_module, self.dp_group, rank_zero_warn
        )
        if self.zero_stage and self.mesh is not None and self.mesh.shape.dp == 1:
            rank_zero_info(
                f"zero_stage={self.zero_stage}: the data-parallel group has one process, so nothing is sharded "
                "(the optimizer state and gradients are whole, as with zero_stage=0)"
            )

    def make_reducer(self, named_params: list, **kwargs: Any) -> Optional[GradientReducer]:
        """The data-parallel gradient path over ``dp_group``: ``reducer_class``, or with ``zero_stage`` the
        sharded one (``kwargs["whole"]``: parameters all-reduced, as ``ShardedGradientReducer`` says; at
        stage 3 one bucket per unit of ``sharded_parameters``). None where the group has one process:
        nothing is averaged, so no bucket, hook or collective runs."""
        self._reducer_arguments = (list(named_params), dict(kwargs))
        if group_size(self.dp_group) == 1:
            return None
        whole = kwargs.pop("whole", ())
        if self.sharded_parameters is not None:
            return FullyShardedGradientReducer(
                named_params,
                self.zero_group,
                self.sharded_parameters,
                whole=whole,
                replicate_group=self.zero_replica_group,
                **kwargs,
            )
        if self.zero_stage:
            return ShardedGradientReducer(
                named_params, self.zero_group, self.zero_stage, whole, self.zero_replica_group, **kwargs
            )
        return self.reducer_class(named_params, group=self.dp_group, **kwargs)

    # ----------------------------------------------------------------- zero_stage=3: the sharded parameters
    @property
    def sharded_parameters(self) -> Optional[ShardedParameters]:
        """The parameters sharded over dp (``zero_stage=3``; None before set-up, after it, or at dp=1)."""
        return next((s for s in self.parameter_shards if s.group is self.zero_group), None)

    def shard_parameters(
        self,
        stack_name: Optional[str] = None,
        leave_out: Sequence[torch.nn.Parameter] = (),
        axis: str = "dp",
        blocks: Optional[Sequence[torch.nn.Module]] = None,
        kept: bool = False,
        device: Optional[torch.device] = None,
    ) -> Optional[ShardedParameters]:
        """With ``zero_stage=3`` and more than one rank along ``axis`` ("dp", or "edp": one expert's
        replicas): the module's trainable parameters (as this rank holds them, but ``leave_out``) sharded
        over it in units (``distributed.zero3``), gathered over a group of their own, each block freed after
        its forward or kept until its backward as ``reshard_after_forward`` says. Called once the
        parameters are final, before the reducers are built; None where nothing is sharded. ``blocks`` and
        ``kept``: ``ShardedParameters``'s (a pipeline stage's held blocks, gathered for the whole step);
        ``device``: of a module built on meta, each rank allocating only its shards there."""
        hsdp = axis == "dp" and self.zero_replica_group is not None  # within this rank's shard group
        group = self.zero_group if axis == "dp" else self.mesh.group(axis)
        if self.zero_stage != 3 or group_size(group) == 1:
            return None
        gather_group = new_axis_group(self.mesh.shape, "dp_shard" if hsdp else axis, self.global_rank)
        shards = ShardedParameters(
            self.lightning_module,
            group,
            gather_group,
            self.reshard_after_forward,
            stack_name,
            leave_out,
            blocks,
            kept,
            device,
            unit_dtypes(self.param_dtype, self.reduce_dtype, self._precision()),
            self.release_host_memory,
        )
        self.parameter_shards.append(shards)
        return shards

    @contextmanager
    def sharded_forward(self) -> Generator[None, None, None]:
        """Around a step's forward under ``zero_stage=3``: the root units gathered before it (the blocks gather
        themselves); an evaluation forward frees what it gathered after it."""
        for shards in self.parameter_shards:
            shards.before_forward()
        yield
        for shards in self.parameter_shards:
            shards.after_forward()

    @contextmanager
    def parameters_gathered(self) -> Generator[None, None, None]:
        """Every unit gathered inside under ``zero_stage=3``, and nothing otherwise: a full state read or
        loaded, each rank keeping its range of what a load wrote, or the model run in a hook or callback (a
        sample on rank 0 alone inside it). A collective: every rank enters it at the same point."""
        with ExitStack() as stack:
            for shards in self.parameter_shards:
                stack.enter_context(shards.gathered())
            yield

    def read_gathered(self, read: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``read()`` (a full state) with every unit gathered; its tensors copied out before the units are
        freed again (under ``zero_stage=3``; otherwise as it is)."""
        if not self.parameter_shards:
            return read()
        with self.parameters_gathered():
            return {k: v.clone() if isinstance(v, Tensor) else v for k, v in read().items()}

    def model_state_pieces(self) -> dict[str, Optional[StatePieces]]:
        """``zero_stage=3``: each parameter of a unit (of every set: the experts' too) as this rank's range of
        it, what a sharded checkpoint writes and reads."""
        module = self.lightning_module
        return {k: v for shards in self.parameter_shards for k, v in shards.state_pieces(module).items()}

    def held_parameters(self) -> list[torch.Tensor]:
        """Parameter memory held beside the module's own (``zero_stage=3``: this rank's shards)."""
        return [t for shards in self.parameter_shards for t in shards.held_tensors()]

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's, on every rank: ``zero_stage=3``'s blocks may gather their parameters inside."""
        with every_rank_scope(), self.sharded_forward():
            return super().validation_step(*args, **kwargs)

    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        """Lightning's; with ``zero_stage``, each optimizer then updates only this rank's pieces."""
        super().setup_optimizers(trainer)
        self.shard_optimizers()

    def shard_optimizers(self) -> None:
        """With ``zero_stage``, each of ``self.optimizers`` made to update only this rank's pieces (also
        called by the set-up at scale, ``planner/at_scale.py``, which builds the optimizers itself)."""
        reducers = self.sharded_reducers()
        if not reducers:
            return
        refused = [p for p in (sharding_problem(o, self.zero_stage) for o in self.optimizers) if p]
        require(refused)
        bucketed = {p for reducer in reducers for b in reducer.buckets for p in b.params}
        pieces = [piece for reducer in reducers for piece in reducer.pieces()]
        own_group = reducers[1].group if len(reducers) > 1 else None  # the experts' replicas, sharded too
        self._optimizer_shards = {
            id(o): ShardedOptimizer(o, pieces, bucketed, self.zero_group, self.own_parameters(), own_group)
            for o in self.optimizers
        }

    def sharded_reducers(self) -> list[ShardedGradientReducer]:
        """The reducers whose pieces the optimizers step (``zero_stage``): the data-parallel one."""
        return [self.reducer] if isinstance(self.reducer, ShardedGradientReducer) else []

    def own_parameters(self) -> frozenset:
        """Ids of the parameters held whole that differ across the data-parallel ranks (kept out of ZeRO,
        their optimizer state this rank's own); none here (expert parallelism has some)."""
        return frozenset()

    def local_optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """This rank's optimizer state by name (a sharded checkpoint's); with ``zero_stage``, only its pieces."""
        shards = self._optimizer_shards.get(id(unwrapped(optimizer)))
        if shards is None:
            return super().local_optimizer_state(optimizer)
        return state_by_name(unwrapped(optimizer), self.lightning_module, shards.local_state_dict())

    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        """Lightning's step inside every axis's ``optimizer_step`` (ZeRO: the pieces step, then are gathered)."""
        with around(self.axes, "optimizer_step", optimizer):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

    def configure_parallelism(self) -> None:
        """Subclasses rewrite the module and create ``self.reducer`` here."""

    def step_axes(self, shape: MeshShape) -> list[Axis]:
        """The axes whose hooks every step runs, in that order (``axes.py``): the data-parallel average and,
        with ``zero_stage``, its pieces, and at stage 3 the sharded parameters; none where the data-parallel
        group has one process."""
        if shape.dp == 1:
            return []
        zero = [Zero(self)] if self.zero_stage else []
        return [DataParallel(self), *zero, *([ZeroParameters(self)] if self.zero_stage == 3 else [])]

    def apply_activation_checkpointing(self, stack_name: Optional[str] = None) -> None:
        """``activation_checkpointing`` on the module as this rank holds it (after tensor-parallel sharding
        and the pipeline partition, before the data-parallel gradient path)."""
        if self.activation_checkpointing is not False:
            self._checkpointed = apply_activation_checkpointing(
                self.lightning_module, self.activation_checkpointing, stack_name
            )

    def compiles(self, module: Any) -> bool:
        """Whether set-up compiles (part of) ``module``: the ``compile`` option, or the user compiled it."""
        return self.compile is not False or compiled_by_lightning(module)

    def apply_compile(
        self,
        stack_name: Optional[str] = None,
        blocks: Optional[Sequence[torch.nn.Module]] = None,
        whole_cannot: Optional[str] = None,
    ) -> None:
        """``compile`` on each block this rank holds (``blocks``: a pipeline stage's; None: every block of the
        stack), after the recompute (``block_compile``); the module's forward whole where it has no stack or
        ``per_block_refused`` says why not; ``whole_cannot``: why a model the user compiled is compiled
        block by block even without the option."""
        module = self.lightning_module
        if self._compiled_blocks or not self.compiles(module):
            return  # compiled by an earlier set-up of the split module it still holds
        if whole_cannot is None and self.zero_stage == 3 and self.mesh_shape().dp > 1:
            whole_cannot = ZERO3_GATHERS_IN_FORWARD
        why_whole = self.per_block_refused()
        if blocks is None and why_whole is None:
            try:
                stack_name, stack = find_block_stack(module, stack_name)
                blocks = list(stack)
            except ValueError:
                why_whole = "it has no block stack (an nn.ModuleList or nn.Sequential of >= 2 blocks)"
        if blocks is None:
            what = f"the module's forward, whole, as {why_whole}"
            if self.compile is not False:
                rank_zero_warn(f"compile={self.compile!r}: not block by block: {what}")
            blocks = [module]
        else:
            what = f"the {len(blocks)} blocks of {stack_name!r} this rank holds, one by one"
        self._compiled_blocks = apply_block_compile(module, self.compile, blocks, what, whole_cannot)

    def per_block_refused(self) -> Optional[str]:
        """Why the blocks cannot be compiled one by one here (then the module's forward is compiled whole)."""
        return None

    # ----------------------------------------------------------------- set-up shared by split models
    def scaler(self) -> Optional[Any]:
        """The precision plugin's enabled GradScaler (16-mixed), or None."""
        scaler = getattr(self.precision_plugin, "scaler", None)
        return scaler if scaler is not None and scaler.is_enabled() else None

    def share_found_inf(self) -> None:
        """16-mixed: every rank skips a step together when any rank's gradients overflowed."""
        if self.scaler() is not None:
            share_found_inf(self.scaler(), group=None)

    def norm_share(self) -> Optional[tuple[set[int], Optional[torch.distributed.ProcessGroup]]]:
        """The model's parameters (by id) whose squared gradients this rank adds to the model's norm, and
        the group that sum runs over, each part of the model counted on one rank of it; None where every
        rank holds the whole model (split models say, ``strategies/parallel.py``)."""
        return None

    def norm_weights(self) -> dict[int, torch.Tensor]:
        """Counted parameters (by id) only part of which this rank alone holds, with the weights of their
        squares in the norm (``clip_grad_norm_counted``); none where no part is held by several ranks."""
        return {}

    def clipping_rule(self) -> Optional[tuple[set[int], Optional[torch.distributed.ProcessGroup]]]:
        """Which tensors' gradients count in the model's norm on this rank (by id), and over which group
        their squares are summed; None where Lightning's local norm is the whole model's. With
        ``zero_stage`` the tensors are this rank's pieces (the model's parameters hold no gradient), and
        the group is the whole world: the data-parallel ranks hold disjoint pieces of what the model
        group counts (under HSDP, the ranks of the first shard group count theirs, the replicas none)."""
        share = self.norm_share()
        if not isinstance(self.reducer, ShardedGradientReducer):
            return share
        if self.zero_replica_group is not None and torch.distributed.get_rank(self.zero_replica_group) > 0:
            return set(), None
        counted = None if share is None else share[0]
        return {id(x.shard) for x in self.reducer.pieces() if counted is None or id(x.param) in counted}, None

    def install_clipping(self) -> None:
        """Clipping by norm uses the whole model's norm (``clipping_rule``, decided here once per set-up),
        in the strategy's step and in the user's ``self.clip_gradients`` alike: it replaces Lightning's
        local norm on this precision plugin instance. With ``zero_stage``, the plugin's ``main_params`` of
        an optimizer are its pieces in and out of a step (clipping by value scales them too), and torch's
        ``clip_grad_norm_`` / ``clip_grad_value_`` on the model's parameters raise, naming
        ``self.clip_gradients`` (``refuse_raw_clipping``)."""
        plugin, rule = self.precision_plugin, self.clipping_rule()
        for name in ("main_params", "clip_grad_by_norm"):
            plugin.__dict__.pop(name, None)  # an earlier fit's
        self._release_raw_clipping()
        if rule is None:
            return
        counted, group = rule
        weights = self.norm_weights()
        zero = isinstance(self.reducer, ShardedGradientReducer)
        main_params = type(plugin).main_params

        def held_params(plugin: Any, optimizer: Any) -> Any:
            shards = self._optimizer_shards.get(id(unwrapped(optimizer)))
            return shards.held_parameters if shards is not None else main_params(plugin, optimizer)

        def clip_grad_by_norm(plugin: Any, optimizer: Any, clip_val: Union[int, float]) -> None:
            if zero and weights:
                raise ValueError(
                    f"clipping by norm with zero_stage={self.zero_stage} cannot weigh the key-value blocks "
                    "that several tensor-parallel ranks hold (a fused q|k|v with fewer key-value heads than "
                    "ranks); clip by value, use zero_stage=0, or a tensor-parallel size that splits the "
                    "key-value heads"
                )
            clip_grad_norm_counted(
                list(plugin.main_params(optimizer)), float(clip_val), counted, group, weights
            )

        plugin.main_params = types.MethodType(held_params, plugin)
        plugin.clip_grad_by_norm = types.MethodType(clip_grad_by_norm, plugin)
        if isinstance(self.reducer, ShardedGradientReducer):
            bucketed = [
                p for reducer in self.sharded_reducers() for bucket in reducer.buckets for p in bucket.params
            ]
            self._release_raw_clipping = refuse_raw_clipping(bucketed, _raw_clipping_refused(self.zero_stage))

    def _bind_metrics_to_dp_group(self) -> None:
        from torchmetrics import Metric

        if self.mesh is None or self.mesh.shape.dp == self.world_size:
            return
        for module in self.lightning_module.modules():
            if isinstance(module, Metric):
                module.process_group = self.dp_group

    @contextmanager
    def step_scope(self) -> Generator[None, None, None]:
        """Around a training step: one every rank runs, so the package's in-forward collectives may run
        (``every_rank.py``), inside every axis's ``training_step``."""
        with training_step_scope(), around(self.axes, "training_step"):
            yield

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.step_scope():
            output = super().training_step(*args, **kwargs)
        if self.check_finite_loss:
            batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx")
            step = self.lightning_module.trainer.global_step
            self._loss_check.observe(training_loss(output), step, batch_idx, self.global_rank)
        return output

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if not getattr(self, "_batch_described", True):
            self._batch_described = True
            try:
                size: Optional[int] = extract_batch_size(batch)
            except Exception:  # a batch without tensors: say so instead of failing the run
                size = None
            shape = self.mesh.shape if self.mesh is not None else self.mesh_shape()
            name = getattr(self, "strategy_name", type(self).__name__)
            trainer = self.lightning_module.trainer
            rank_zero_info(describe_global_batch(name, shape, size, trainer.accumulate_grad_batches))
        change = self._parameter_set.change() if self._parameter_set is not None else None
        if change is not None:
            self.follow_parameter_change(change)
        self._memory_hook("on_train_batch_start", batch, batch_idx)
        super().on_train_batch_start(batch, batch_idx)

    def _forget_parameter_set(self) -> None:
        if self._parameter_set is not None:
            self._parameter_set.close()
            self._parameter_set = None

    def trainable_set_fixed(self) -> Optional[str]:
        """Why this run cannot follow a change of which parameters train after set-up (None: it can); read
        from the options alone, so that it is known before any process group exists."""
        if self.zero_stage and self.mesh_shape().dp > 1:
            return (
                f"zero_stage={self.zero_stage} cut the trainable parameters into this rank's pieces and the "
                "optimizer's state once, at set-up (zero_stage=0 follows such a change)"
            )
        return None

    def accumulation_refused(self) -> Optional[str]:
        """Why this run cannot accumulate several batches into one optimizer step (None: it can); read from
        the options alone, so that it is known before any process group exists."""
        return None

    def follow_parameter_change(self, change: ParameterChange) -> None:
        """Make what set-up decided from the parameters follow a change the user's code made since (seen
        at the start of a training batch, after the callbacks' and the module's own hooks): the
        data-parallel buckets are rebuilt for the parameters that train now. What cannot follow is refused,
        naming the parameters: parameters added, removed or replaced after set-up, and a change of which
        train where ``trainable_set_fixed`` says why not. Split models add their own parts."""
        if change.structural:
            raise ValueError(
                f"{type(self).__name__}: the model's parameters changed after the strategy set it up "
                f"({change.describe()}). The strategy placed, split and bucketed the parameters it found at "
                "set-up. Add or replace modules in __init__, configure_model or a callback's setup hook (all "
                "run before set-up), frozen if they should train later: freezing and unfreezing during fit "
                "is supported."
            )
        fixed = self.trainable_set_fixed()
        if fixed is not None:
            raise ValueError(
                f"{type(self).__name__}: parameters were frozen or unfrozen after set-up ({change.describe()}), "
                f"and {fixed}. Set requires_grad before fit (a callback's setup hook runs before set-up)."
            )
        if self.reducer is not None and self._reducer_arguments is not None:
            self.reducer.remove_hooks()
            named, kwargs = self._reducer_arguments
            self.reducer = self.make_reducer(named, **kwargs)

    def on_train_end(self) -> None:
        """The losses of the last steps whose copies have not been read yet (on a GPU) are read now."""
        super().on_train_end()
        self._loss_check.poll(wait=True)
        self._memory_hook("on_train_end")

    def _memory_hook(self, name: str, *args: Any) -> None:
        """The memory report's Lightning callback hook ``name``, called with the trainer and module first."""
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None)  # None in a spawned rank that failed before attaching
        if self.memory is not None and trainer is not None:
            getattr(self.memory, name)(trainer, module, *args)

    def reduce(
        self, tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Tensor:
        """``self.log(sync_dist=True)`` lands here: reduce over the data-parallel group by default (a group
        of one process leaves the value as it is, with no collective)."""
        if not isinstance(tensor, Tensor):
            return tensor
        if group is None and self.mesh is not None and self.mesh.shape.dp != self.world_size:
            group = self.dp_group
        if group_size(group) == 1:
            return tensor
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Every process votes (``ModelCheckpoint``, ``EarlyStopping``): summed over the whole world, which
        Lightning compares with ``world_size``, not over the data-parallel group that ``reduce`` uses."""
        if self.world_size == 1:
            return decision
        votes = _sync_ddp_if_available(
            torch.tensor(int(decision), device=self.root_device), None, reduce_op=ReduceOp.SUM
        )
        return bool(votes == self.world_size) if all else bool(votes)

    @contextmanager
    def block_backward_sync(self) -> Generator:
        """Lightning wraps accumulating micro-steps in this: keep gradients local until the last one.

        Turns off ``self._sync_grads`` (which the axes and strategies without a reducer read) and every
        axis's sync (``no_sync``)."""
        previous, self._sync_grads = self._sync_grads, False
        try:
            with around(self.axes, "no_sync"):
                yield None
        finally:
            self._sync_grads = previous

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's, marked as a step every rank runs: a recompute inside it reruns the forward's
        collectives (``every_rank.py``)."""
        with training_step_scope():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def pre_backward(self, closure_loss: Tensor) -> None:
        each(self.axes, "pre_backward")

    def post_backward(self, closure_loss: Tensor) -> None:
        each(self.axes, "post_backward")

    def shard_gradients(self) -> None:
        """With ``zero_stage``, once the step's gradients are averaged: each piece takes its gradient."""
        if isinstance(self.reducer, ShardedGradientReducer) and self.reducer.sync_enabled:
            self.reducer.shard_gradients()

    def on_exception(self, exception: BaseException) -> None:
        """A failing rank tells the others (they stop within ``failure_timeout``, naming it)."""
        self._memory_hook("on_exception", exception)
        if self._watchdog is not None:
            root_cause = self._watchdog.report_failure(exception)
            if root_cause:
                print(
                    f"[lightning_parallel] {root_cause}; rank {self.global_rank} stops too.",
                    file=sys.stderr,
                    flush=True,
                )
                exception.args = (f"{root_cause} (this rank then saw: {exception})",) + exception.args[1:]
        super().on_exception(exception)

    def teardown(self) -> None:
        self._release_raw_clipping()
        self._release_raw_clipping = _nothing
        self._release_load_balancing()
        self._release_load_balancing = _nothing
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        each(self.axes, "teardown")
        self._forget_parameter_set()
        module = self.lightning_module
        if module is not None and self._compiled_blocks and not self.model_is_split():
            uncompile_blocks(self._compiled_blocks)
            self._compiled_blocks = []
        if module is not None and self._checkpointed and not self.model_is_split():
            # a whole model leaves fit as the user's; a split one keeps its set-up until the next fit
            remove_activation_checkpointing(module, self._checkpointed)
            self._checkpointed = []
        if module is None or not has_meta_tensors(module):
            return super().teardown()
        # a set-up that failed before materializing: Lightning's module.cpu() cannot copy meta tensors
        module._apply(lambda t: t if t.is_meta else t.cpu())
        module.__dict__["cpu"] = lambda: module
        try:
            super().teardown()
        finally:
            module.__dict__.pop("cpu", None)
