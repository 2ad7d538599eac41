"""``lp_ddp``: data parallelism with our own gradient buckets and all-reduce overlapped with backward.

Every rank holds the whole model and a slice of the global batch. Replicas start identical (rank 0's
parameters and buffers are broadcast at set-up) and stay identical because every rank applies the
same averaged gradient. The gradient work is done by ``distributed.reducer.GradientReducer``; this
file only wires it into Lightning's hooks.

Buffers (BatchNorm statistics) are copied from rank 0 before the forwards where torch DDP, as
Lightning's ``ddp`` drives it, copies them: a forward syncs if the previous forward ran with gradients
and gradient sync on (torch's ``require_forward_param_sync``), the first one always. While fitting,
validation forwards take part (Lightning routes them through the DDP wrapper); ``validate``, ``test``
and ``predict`` outside ``fit`` do not (no wrapper: the module is broadcast once at set-up).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Union

import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState

from lightning_parallel.distributed.collectives import group_size
from lightning_parallel.distributed.reducer import (
    COMM_HOOKS,
    CommHook,
    UnusedParametersError,
    resolve_comm_hook,
)
from lightning_parallel.distributed.replicas import broadcast_module_states
from lightning_parallel.materialize import has_meta_tensors
from lightning_parallel.strategies.base import ParallelStrategyBase
from lightning_parallel.strategies.checks import positive_int, positive_number, require
from lightning_parallel.strategies.options import given, level_problems

__all__ = ["DDPStrategy", "NOT_APPLICABLE"]

#: torch ``DistributedDataParallel`` arguments (which Lightning's ``DDPStrategy`` forwards) that have no
#: meaning here, each with the reason and what to use instead
NOT_APPLICABLE = {
    "device_ids": "each rank's device comes from Trainer(accelerator=..., devices=...)",
    "output_device": "each rank's device comes from Trainer(accelerator=..., devices=...)",
    "dim": "it splits inputs over several devices of one process; lp_ddp runs one device per process",
    "process_group": "lp_ddp averages over all ranks; to reduce over part of them, use lp_tensor_parallel or "
    "lp_pipeline_* (data_parallel_size)",
    "check_reduction": "it is deprecated in torch and has no effect there; remove it",
    "delay_all_reduce_named_params": "lp_ddp sends each bucket as soon as it is full; use bucket_cap_mb and "
    "first_bucket_cap_mb to shape the buckets",
    "param_to_hook_all_reduce": "lp_ddp sends each bucket as soon as it is full; use bucket_cap_mb and "
    "first_bucket_cap_mb to shape the buckets",
    "bucket_cap_mb_list": "use bucket_cap_mb and first_bucket_cap_mb",
    "mixed_precision": "use Trainer(precision='bf16-mixed'/'16-mixed'), or ddp_comm_hook='bf16'/'fp16' to "
    "compress gradients on the wire",
    "device_mesh": "lp_ddp builds its own (data-parallel) mesh; combine parallelisms with lp_tensor_parallel "
    "or lp_pipeline_*",
    "skip_all_reduce_unused_params": "unused parameters' zero slots travel with their bucket; use "
    "find_unused_parameters=True",
    "batched_grad_copy": "use gradient_as_bucket_view=True (the default): gradients are the buckets, "
    "there is nothing to copy",
    "forward_sync_buffers": "use broadcast_buffers, which means the same",
    "comm_hook": "it is called ddp_comm_hook (Lightning's name) and takes the same 'fp16'/'bf16', or any torch "
    "communication hook",
}


#: how Lightning's ``ddp`` begins its error for parameters without a gradient
UNUSED_PREFIX = (
    "It looks like your LightningModule has parameters that were not used in producing the loss returned by "
    "training_step."
)


def _zero_problem(values: Mapping[str, Any], prefix: str) -> Optional[str]:
    """``zero_stage`` (a base option: in ``kwargs`` while constructing) with what only all-reduce supports."""
    stage = given(values, "zero_stage", 0)
    if not stage:
        return None
    clashes = [
        f"{name}={values[name]!r}"
        for name, fine in (
            ("ddp_comm_hook", values["ddp_comm_hook"] is None),
            ("gradient_as_bucket_view", values["gradient_as_bucket_view"]),
            ("model_averaging_period", values["model_averaging_period"] is None),
        )
        if not fine
    ]
    if not clashes:
        return None
    return (
        f"{prefix}zero_stage={stage} reduce-scatters each bucket into this rank's shard, which does not go with "
        f"{', '.join(clashes)} (all-reduce hooks, separate gradient copies, parameter averaging); leave those at "
        "their defaults or use zero_stage=0"
    )


class DDPStrategy(ParallelStrategyBase):
    """Distributed data parallel, implemented on ``torch.distributed`` collectives.

    Takes every argument of Lightning's ``DDPStrategy`` and of torch's ``DistributedDataParallel`` that has
    a meaning here, with that meaning; the others (``NOT_APPLICABLE``) are refused, saying why.

    Args:
        bucket_cap_mb: size of a gradient bucket (torch DDP's default, 25 MB).
        first_bucket_cap_mb: the first bucket is small so communication starts early in backward.
        find_unused_parameters: allow parameters that get no gradient in a step.
        static_graph: the same parameters take part in every step: unused ones are allowed and found on
            the first step only (no per-step search).
        gradient_as_bucket_view: ``.grad`` tensors are views of the flat buckets (True, the default here:
            no second copy of the gradients); False keeps them separate, as torch DDP's default does.
        broadcast_buffers: copy rank 0's buffers (e.g. BatchNorm statistics) before the forwards where
            torch DDP does (see the module's docstring), validation forwards during ``fit`` included.
        init_sync: broadcast rank 0's parameters and buffers at set-up (False: the replicas are trusted to
            start identical).
        ddp_comm_hook: what sends a bucket: None (all-reduce of the average), ``"fp16"``/``"bf16"`` (torch's
            compression hooks), or any torch DDP hook ``hook(state, bucket) -> Future`` (PowerSGD, post-local
            SGD, ...), run on our buckets.
        ddp_comm_state: the hook's ``state`` (None: the data-parallel process group, as torch's default
            hooks expect).
        ddp_comm_wrapper: wraps the hook, as torch's ``fp16_compress_wrapper(hook)``.
        model_averaging_period: with ``ddp_comm_state=PostLocalSGDState(...)`` and torch's
            ``post_localSGD_hook``: average the parameters every this many steps (Lightning's post-local SGD).
        **kwargs: process plumbing, as for Lightning's ``DDPStrategy`` (``start_method``, ``timeout``,
            ``process_group_backend``, ...).
    """

    strategy_name = "lp_ddp"
    zero_stages = (0, 1, 2, 3)
    shards_within_data_parallel = True

    def __init__(
        self,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = True,
        broadcast_buffers: bool = True,
        init_sync: bool = True,
        ddp_comm_hook: Union[str, CommHook, None] = None,
        ddp_comm_state: Any = None,
        ddp_comm_wrapper: Optional[Callable[[CommHook], CommHook]] = None,
        model_averaging_period: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        refused = [f"{k} ({NOT_APPLICABLE[k]})" for k in kwargs if k in NOT_APPLICABLE]
        if refused:
            raise TypeError(f"{type(self).__name__} does not take {'; '.join(refused)}.")
        require(level_problems(DDPStrategy, type(self), locals()))
        super().__init__(**kwargs)
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.first_bucket_cap_mb = float(first_bucket_cap_mb)
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.broadcast_buffers = broadcast_buffers
        self.init_sync = init_sync
        self.comm_hook = resolve_comm_hook(ddp_comm_hook, ddp_comm_wrapper)
        # Lightning's names: its ``setup`` starts the model averager and its ``optimizer_step`` runs it
        self._ddp_comm_hook, self._ddp_comm_wrapper = ddp_comm_hook, ddp_comm_wrapper
        self._ddp_comm_state, self._model_averaging_period = ddp_comm_state, model_averaging_period
        self._has_buffers = False
        self._sync_buffers_next = True  # torch DDP's require_forward_param_sync

    @classmethod
    def own_option_problems(cls, values: Mapping[str, Any], prefix: str = "") -> list[Optional[str]]:
        """The checks of the arguments declared here (``strategies.options.option_problems`` reads them)."""
        hook, state, period = (
            values["ddp_comm_hook"],
            values["ddp_comm_state"],
            values["model_averaging_period"],
        )
        post_local_sgd = isinstance(state, PostLocalSGDState)
        return [
            positive_number(f"{prefix}bucket_cap_mb", values["bucket_cap_mb"], "megabytes", 25),
            positive_number(f"{prefix}first_bucket_cap_mb", values["first_bucket_cap_mb"], "megabytes", 1),
            None
            if callable(hook) or hook in COMM_HOOKS
            else (
                f"{prefix}ddp_comm_hook={hook!r} is not supported; use None, 'fp16', 'bf16', or a torch DDP "
                "communication hook hook(state, bucket) -> Future (torch.distributed.algorithms.ddp_comm_hooks)"
            ),
            None
            if values["ddp_comm_wrapper"] is None or callable(values["ddp_comm_wrapper"])
            else f"{prefix}ddp_comm_wrapper must be a function hook -> hook, got {values['ddp_comm_wrapper']!r}",
            None if period is None else positive_int(f"{prefix}model_averaging_period", period),
            None
            if period is None or post_local_sgd
            else (
                f"{prefix}model_averaging_period={period} averages parameters after post-local SGD only: pass "
                "ddp_comm_state=PostLocalSGDState(...) and ddp_comm_hook=post_localSGD_hook "
                "(torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook), or leave it None"
            ),
            _zero_problem(values, prefix),
            None
            if period is not None or not post_local_sgd
            else (
                f"{prefix}ddp_comm_state=PostLocalSGDState(...) needs model_averaging_period (how many steps "
                "between parameter averages)"
            ),
        ]

    def on_exception(self, exception: BaseException) -> None:
        """Unused parameters: Lightning's ``ddp`` words first (what users search for), then their names; also
        when the error comes as a spawned rank's traceback."""
        text = str(exception)
        unused = isinstance(exception, UnusedParametersError) or UnusedParametersError.__name__ in text
        if unused and UNUSED_PREFIX not in text:
            exception.args = (f"{UNUSED_PREFIX} {text}",) + exception.args[1:]
        super().on_exception(exception)

    def configure_parallelism(self) -> None:
        module = self.lightning_module
        shards_parameters = self.zero_stage == 3 and group_size(self.zero_group) > 1
        self.parameter_shards = []
        if has_meta_tensors(module) or self.initial_weights is not None:  # every rank makes the same values
            if shards_parameters:  # each rank allocates and fills only its shard of each unit
                self.set_up_share(self._shard_parameters_on_meta, self._place_in_shards)
                self.sharded_parameters.check_placed()
            else:
                self.set_up_share()
        elif self.init_sync:
            broadcast_module_states(module, src=0, group=self.dp_group)
        self.apply_activation_checkpointing()
        self.apply_compile()
        if self.zero_stage:  # each rank unscales its own pieces: one overflow verdict for all
            self.share_found_inf()
        # buffers broadcast from rank 0 before a forward, as torch DDP does: only where there are replicas
        self._has_buffers = group_size(self.dp_group) > 1 and any(True for _ in module.buffers())
        self._sync_buffers_next = True
        if shards_parameters and self.sharded_parameters is None:
            self.shard_parameters()
        self.reducer = self.make_reducer(
            list(module.named_parameters()),
            bucket_cap_mb=self.bucket_cap_mb,
            first_bucket_cap_mb=self.first_bucket_cap_mb,
            find_unused_parameters=self.find_unused_parameters,
            comm_hook=self.comm_hook,
            comm_state=self._ddp_comm_state,
            static_graph=self.static_graph,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
        )

    def _shard_parameters_on_meta(self) -> None:
        """``set_up_share``'s parallelize: the units laid out on the meta module, each rank's shards
        allocated on its device (filled by ``_place_in_shards``); the other tensors stay whole."""
        self.shard_parameters(device=self.root_device)

    def _place_in_shards(self, name: str, value: torch.Tensor) -> bool:
        assert self.sharded_parameters is not None
        return self.sharded_parameters.place(name, value)

    def full_model_state(self) -> dict[str, Any]:
        """With ``zero_stage=3``: every unit gathered (a collective), the state copied out, freed again."""
        return self.read_gathered(super().full_model_state)

    def load_full_model_state(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """With ``zero_stage=3`` and parameters of the units in ``state_dict``: every unit gathered, loaded,
        and each rank's range kept (a sharded checkpoint reads them into the shards itself)."""
        if self.sharded_parameters is None or not self.model_state_pieces().keys() & state_dict.keys():
            return super().load_full_model_state(state_dict, strict=strict)
        with self.parameters_gathered():  # every rank then keeps its range of what was loaded
            super().load_full_model_state(state_dict, strict=strict)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(super().training_step, *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(super().validation_step, *args, **kwargs)

    def _forward(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``step`` as torch DDP's forward would: buffers from rank 0 first when they are due (only
        while fitting: Lightning wraps the module in DDP for ``fit`` only, so test and predict, which
        never run inside ``fit``, are plain calls)."""
        module = self.lightning_module
        if module.trainer.state.fn != TrainerFn.FITTING:
            return step(*args, **kwargs)
        if self._sync_buffers_next and self.broadcast_buffers and self._has_buffers:
            broadcast_module_states(module, src=0, group=self.dp_group, buffers_only=True)
        output = step(*args, **kwargs)  # zero_stage=3's units: the base's sharded_forward, inside
        # torch DDP's _post_forward; under manual optimization Lightning turns the wrapper's gradient
        # sync off around the forward, so there only the first forward of a fit syncs
        self._sync_buffers_next = (
            torch.is_grad_enabled() and self._sync_grads and module.automatic_optimization
        )
        return output
