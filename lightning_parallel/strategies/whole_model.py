"""The module the user passed in, given back whole at the end of ``fit``/``validate``/``test``/``predict``.

A split strategy changes the user's module in place (sharded layers, pipeline stages, placed experts).
Before the split, ``WholeModel.keep`` takes a skeleton of the module's children (meta tensors, no memory).
When the stage ends, ``give_back`` gathers the full state (the checkpoints' gathers: ``full_model_state``,
``full_optimizer_state``) and ``put_back`` makes the children their skeletons filled with the trained
values, on every rank, the optimizer the whole module's: ``state_dict()`` and ``forward`` are one device's
again. A module whose whole does not fit the host (a model built on meta because it is too large for one
device), or one whose stage failed, stays split; then ``state_dict()`` and ``forward`` raise
(``refuse_shard``), naming ``trainer.save_checkpoint``, instead of returning a shard. The skeleton also
gives Lightning's model summary the whole model's parameter counts (``summary_of_whole``).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Mapping, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.model_summary import ModelSummary as Summary
from lightning.pytorch.utilities.model_summary.model_summary import _tensor_has_shape
from torch import nn

from lightning_parallel.checkpointing.by_name import gather_parts, names_in_optimizer
from lightning_parallel.checkpointing.contract import unwrapped
from lightning_parallel.checkpointing.one_device import meta_skeleton, put_back_whole, unsaved_buffers
from lightning_parallel.materialize import has_meta_tensors
from lightning_parallel.memory.accounting import optimizer_state_tensors, unique_storage_bytes

__all__ = [
    "WholeModel",
    "give_back",
    "WholeModelSummary",
    "ShardedModuleError",
    "guard_lifted",
    "remove_guard",
    "summary_of_whole",
    "whole_optimizer",
]

#: the attributes a module left split answers with an error
GUARDED = ("state_dict", "forward")
_GUARD = "_lp_shard_guard"  # the guard's record in the module's __dict__


class ShardedModuleError(RuntimeError):
    """``state_dict()`` or ``forward`` of a module left split after a stage: it holds this rank's share."""


def _numel(params: Any) -> tuple[int, int]:
    unique = {id(p): p for p in params if not _tensor_has_shape(p)}.values()
    return sum(p.numel() for p in unique), sum(p.numel() for p in unique if p.requires_grad)


@dataclass
class WholeModel:
    """The skeleton of a module's children before the split, and whether the module was whole then."""

    skeleton: Optional[nn.Module]  # an nn.ModuleDict of the children's skeletons, under the children's names
    built_on_meta: bool  # init_module / configure_model on meta: never whole on one device
    uncopied: str = ""  # why there is no skeleton: the children could not be copied
    names: dict[int, str] = field(default_factory=dict)  # id of each parameter before the split -> its name

    @classmethod
    def keep(cls, module: nn.Module) -> "WholeModel":
        """Before the split: the children's skeleton (one copy, so ties between children stay tied; a child
        pointing back at the LightningModule keeps pointing at it)."""
        children = nn.ModuleDict()
        children._modules = dict(module._modules)
        names = {id(p): n for n, p in module.named_parameters()}
        try:
            return cls(meta_skeleton(children, {id(module): module}), has_meta_tensors(module), names=names)
        except Exception as error:  # a child holding what deepcopy refuses: training goes on, split after it
            return cls(None, has_meta_tensors(module), f"{type(error).__name__}: {error}", names)

    def names_of(self, optimizer: Any) -> dict[Any, str]:
        """The parameters of ``optimizer`` that the module held before the split, with their names."""
        held = [p for group in unwrapped(optimizer).param_groups for p in group["params"]]
        return {p: self.names[id(p)] for p in held if id(p) in self.names}

    def put_back(self, module: nn.Module, state: Mapping[str, torch.Tensor], device: torch.device) -> None:
        """``module`` whole again, from the full ``state`` (every key of its state dict)."""
        remove_guard(module)
        put_back_whole(module, self.skeleton, state, device)

    def nbytes(self, module: nn.Module) -> int:
        """The bytes of the whole ``module``'s parameters and buffers (read from the skeleton's shapes)."""
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        tensors = {id(t): t for t in [*own, *self.skeleton.parameters(), *self.skeleton.buffers()]}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def parameter_counts(self, module: nn.Module) -> tuple[int, int]:
        """(all, trainable) parameters of the whole ``module``: its own and its children's before the split."""
        own = list(module.parameters(recurse=False))
        return _numel([*own, *(self.skeleton.parameters() if self.skeleton is not None else [])])

    def refuse_shard(self, module: nn.Module, why: str) -> None:
        """``module.state_dict()`` and ``module(...)`` raise from now on (until the next stage starts):
        ``module`` holds only this rank's share."""
        remove_guard(module)
        held, _ = _numel(module.parameters())
        whole = f" of {self.parameter_counts(module)[0]:,}" if self.skeleton is not None else ""
        message = (
            f"{type(module).__name__} {why}, so this rank holds only its share of it ({held:,}{whole} "
            "parameters) and state_dict() or a forward would be a shard's. Save it whole with "
            "trainer.save_checkpoint('model.ckpt') (every rank calls it; the file holds the single-device "
            "state dict), then load it on one device with "
            f"{type(module).__name__}.load_from_checkpoint('model.ckpt') or "
            "model.load_state_dict(torch.load('model.ckpt')['state_dict']). A module whose whole fits the "
            "host's memory is given back whole when a stage ends well."
        )

        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise ShardedModuleError(message)

        module.__dict__[_GUARD] = {name: module.__dict__.get(name) for name in GUARDED}
        for name in GUARDED:
            module.__dict__[name] = refuse


def give_back(strategy: Any, module: nn.Module, whole: WholeModel) -> None:
    """At the end of a stage that ended well, ``module`` (split by ``strategy``) is whole again on every rank,
    and so is its optimizer: the checkpoints' gathers, then the children rebuilt from their skeletons. If the
    stage failed, or the whole does not fit the host (``strategy.room_for_whole``: every rank decides
    together), it stays split and its ``state_dict()`` and ``forward`` raise."""
    trainer = getattr(module, "_trainer", None)
    stage = trainer.state.fn.value if trainer is not None and trainer.state.fn else "the stage"
    name = strategy.strategy_name
    if trainer is None or trainer.state.status != TrainerStatus.RUNNING:
        return whole.refuse_shard(module, f"stopped with an error while split by {name}")
    if whole.skeleton is None:
        return whole.refuse_shard(
            module,
            f"could not be copied before the split ({whole.uncopied}), so after trainer.{stage}() it "
            f"stays split by {name}",
        )
    need = whole.nbytes(module) * (1 + _optimizer_state_ratio(strategy, module))
    room = strategy.room_for_whole()
    if not strategy.reduce_boolean_decision(need <= room):  # every rank gathers, or none
        built = (
            "was built on the meta device (trainer.init_module() / configure_model) and "
            * whole.built_on_meta
        )
        return whole.refuse_shard(
            module,
            f"{built}is {need / 2**30:.2f} GiB whole with its optimizer state, more than each process on its "
            f"host can hold ({room / 2**30:.2f} GiB available to each), so after trainer.{stage}() it stays split "
            f"by {name}",
        )
    strategy.prepare_checkpoint()
    # fit: the split module's optimizers, gathered; another stage: the optimizers of the whole module it split
    fitting = trainer.state.fn == TrainerFn.FITTING
    optimizers = [
        (unwrapped(o), *_whole_optimizer_state(strategy, o)) for o in strategy.optimizers if fitting
    ]
    unsaved = _unsaved_buffers(strategy, module, whole.skeleton) if whole.built_on_meta else {}
    whole.put_back(module, {**unsaved, **strategy.full_model_state()}, torch.device("cpu"))
    for optimizer, full, names in optimizers:
        whole_optimizer(optimizer, full, names, module)
    if not fitting:
        named = dict(module.named_parameters())
        for optimizer in strategy.optimizers:
            _repoint(unwrapped(optimizer), {p: named[n] for p, n in whole.names_of(optimizer).items()})
    strategy.forget_split(module)


def _repoint(optimizer: Any, new: Mapping[Any, nn.Parameter]) -> None:
    """``optimizer`` holds (and keeps the state of) ``new[p]`` in place of each ``p``."""
    for group in optimizer.param_groups:
        group["params"] = [new.get(p, p) for p in group["params"]]
    for old, param in new.items():
        if old in optimizer.state:
            optimizer.state[param] = optimizer.state.pop(old)


def _whole_optimizer_state(strategy: Any, optimizer: Any) -> tuple[dict[str, Any], dict[int, str]]:
    """The single-device state of ``optimizer`` on every rank (with ZeRO, from the data-parallel rank 0 that
    gathered it), and the parameter name of each of its indices."""
    full = strategy.full_optimizer_state(optimizer)
    if (
        strategy._optimizer_shards.pop(id(unwrapped(optimizer)), None) is not None
        and strategy.mesh.shape.dp > 1
    ):
        box = [full]
        dist.broadcast_object_list(box, src=strategy.mesh.ranks("dp")[0], group=strategy.dp_group)
        full = box[0]
    if strategy.pipelined:  # numbered in single-device order (``merge_states``)
        return full, dict(enumerate(strategy.full_parameter_names()))
    order = [i for group in full["param_groups"] for i in group["params"]]
    return full, dict(zip(order, names_in_optimizer(unwrapped(optimizer), strategy.lightning_module)))


def _optimizer_state_ratio(strategy: Any, module: nn.Module) -> float:
    """The optimizer state's bytes per parameter byte (Adam: 2), which the whole optimizer will hold too."""
    held = unique_storage_bytes(p for p in module.parameters() if not p.is_meta)
    state = unique_storage_bytes(optimizer_state_tensors(strategy.optimizers))
    return state / held * (strategy.mesh.shape.dp if strategy._optimizer_shards else 1) if held else 0.0


def _unsaved_buffers(strategy: Any, module: nn.Module, skeleton: nn.Module) -> dict[str, torch.Tensor]:
    """The non-persistent buffers (no state dict holds them) of a module built on meta: each stage has the real
    values of its own blocks' (a collective over the stages), and the whole module's names come from the
    skeleton of its children (a stage holds only its own blocks')."""
    local = {k: v for k, v in unsaved_buffers(module).items() if not v.is_meta}
    if not strategy.pipelined:
        return local
    return gather_parts(local, strategy.pp_group, list({**unsaved_buffers(skeleton), **local}))


def whole_optimizer(
    optimizer: Any, full: Mapping[str, Any], names: Mapping[int, str], module: nn.Module
) -> None:
    """``optimizer`` (the torch optimizer of a split module) made the optimizer of the whole ``module``: its
    groups hold the whole module's parameters and its state is ``full``, the single-device state dict
    (``full_optimizer_state``) whose parameter indices ``names`` maps to parameter names."""
    for name in ("state_dict", "load_state_dict"):  # ZeRO's unsharded view of its pieces
        optimizer.__dict__.pop(name, None)
    named = dict(module.named_parameters())
    for g, saved in enumerate(full["param_groups"]):
        params = [named[names[i]] for i in saved["params"]]
        if g < len(optimizer.param_groups):
            optimizer.param_groups[g]["params"] = params
        else:  # a group this stage lacked (BackboneFinetuning adds one where the backbone is)
            optimizer.add_param_group({**{k: v for k, v in saved.items() if k != "params"}, "params": params})
    optimizer.state.clear()
    optimizer.load_state_dict(full)


def remove_guard(module: Optional[nn.Module]) -> None:
    """Take ``refuse_shard``'s guard off (at the start of the next stage, or when made whole)."""
    saved = module.__dict__.pop(_GUARD, None) if module is not None else None
    for name, value in (saved or {}).items():
        if value is None:
            module.__dict__.pop(name, None)
        else:
            module.__dict__[name] = value


@contextmanager
def guard_lifted(module: Optional[nn.Module]) -> Generator[None, None, None]:
    """The strategy's own reads of a module left split (``trainer.save_checkpoint`` after the stage)."""
    saved = module.__dict__.get(_GUARD) if module is not None else None
    if saved is None:
        yield
        return
    guards = {name: module.__dict__[name] for name in GUARDED}
    remove_guard(module)
    try:
        yield
    finally:
        module.__dict__[_GUARD] = saved
        module.__dict__.update(guards)


class WholeModelSummary(Summary):
    """Lightning's model summary of a split module, with the parameter counts of the whole module (the
    layers' too): in/out sizes and FLOPs are measured on the module as this rank holds it."""

    def __init__(self, model: Any, max_depth: int, whole: WholeModel) -> None:
        self._whole = whole
        super().__init__(model, max_depth)

    @property
    def param_nums(self) -> list[int]:
        skeleton, counts = self._whole.skeleton, []
        for name, layer in self._layer_summary.items():
            try:
                counts.append(_numel(skeleton.get_submodule(name).parameters())[0])
            except AttributeError:  # a module the split added: counted as held
                counts.append(layer.num_parameters)
        return counts

    @property
    def total_parameters(self) -> int:
        return self._whole.parameter_counts(self._model)[0]

    @property
    def trainable_parameters(self) -> int:
        return self._whole.parameter_counts(self._model)[1]


def summary_of_whole(whole: WholeModel) -> Callable[..., Summary]:
    """A replacement of Lightning's ``ModelSummary._summary`` that counts the whole module."""

    def summary(callback: Any, trainer: Any, pl_module: Any) -> Summary:
        return WholeModelSummary(pl_module, max_depth=callback._max_depth, whole=whole)

    return summary
