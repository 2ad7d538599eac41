"""Full (unsharded) state of a tensor-parallel module, and loading a full state into one.

Checkpoints keep full tensors (per-feature buffers such as a BatchNorm's running statistics included)
under the original names, so they load into the plain module on one
device and into any tensor-parallel size. Saving gathers each sharded tensor over the tensor-parallel
group (every rank must call, in the same order); loading slices locally and needs no communication.
Optimizer state (e.g. Adam's moments) of a sharded parameter is treated the same way. A model held in
the hyperparameters is saved as it would be on one device (``unsharded_copy``). The gathers and cuts take
``found``, what lists the cut tensors: the tensor-parallel shards by default, or another axis's
(``expert_pieces``: the experts that ``moe.expert_parallel`` placed over ep), so each axis's gather is the
same code.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Union

import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.checkpointing.one_device import SKELETON, one_device_copy
from lightning_parallel.distributed.collectives import all_gather_list
from lightning_parallel.moe.expert_parallel import ExpertParallelExperts, ExpertSlice
from lightning_parallel.tensor.layers import (
    FEATURE_SHARDS,
    FeatureShards,
    ShardSpec,
    _TPLayer,
    full_tensor,
    shard_tensor,
)

__all__ = [
    "cut_experts",
    "cut_of",
    "expert_pieces",
    "sharded_parameters",
    "gather_shards",
    "cut_shards",
    "full_state_dict",
    "load_full_state_dict",
    "full_optimizer_state",
    "shard_optimizer_state",
    "unsharded_copy",
]


Owner = Union[_TPLayer, FeatureShards, ExpertSlice]  # how a tensor is cut: cut_of reads it


def cut_of(owner: Owner) -> tuple[int, int]:
    """(the parts a tensor is cut into, this rank's part): an expert slice's ep size and rank, a
    tensor-parallel layer's or per-feature record's tp size and rank."""
    if isinstance(owner, ExpertSlice):
        return owner.ep_size, owner.ep_rank
    return owner.tp_size, owner.tp_rank


def sharded_parameters(module: nn.Module) -> dict[str, tuple[Tensor, ShardSpec, Owner]]:
    """state_dict key -> (local tensor, how it was cut, its layer or per-feature record), in a fixed order;
    a shard tied to a parameter of another module (BERT's decoder bias) appears under each of its names.
    Per-feature tensors (a BatchNorm's running statistics included) are listed by the record that
    ``shard_features`` left on ``module``."""
    out: dict[str, tuple[Tensor, ShardSpec, Owner]] = {}
    for prefix, layer in module.named_modules():
        if isinstance(layer, _TPLayer):
            for name, spec in layer.SHARDS.items():
                tensor = getattr(layer, name, None)
                # a tensor held as a plain attribute is another pipeline stage's (``hold_elsewhere``)
                if tensor is not None and (name in layer._parameters or name in layer._buffers):
                    out[f"{prefix}.{name}" if prefix else name] = (tensor, spec, layer)
    record = getattr(module, FEATURE_SHARDS, None)
    for name, spec in (record.specs if record is not None else {}).items():
        owner, _, attr = name.rpartition(".")
        holder = module.get_submodule(owner)
        if attr in holder._parameters or attr in holder._buffers:
            out[name] = (getattr(holder, attr), spec, record)
    by_id = {id(t): entry for t, *_ in out.values() for entry in [(t, *_)]}
    for name, p in module.named_parameters(remove_duplicate=False):  # other names of a tied shard
        if id(p) in by_id and name not in out:
            out[name] = by_id[id(p)]
    return out


#: what lists a module's cut tensors: key -> (local tensor, how it was cut, its owner)
Found = Callable[[nn.Module], Mapping[str, tuple[Tensor, ShardSpec, Owner]]]

EXPERT_DIM = ShardSpec(dim=0)  # expert parallelism cuts the experts' stacked weights along the experts


def expert_pieces(module: nn.Module) -> dict[str, tuple[Tensor, ShardSpec, ExpertSlice]]:
    """state_dict key -> (this rank's experts' tensor, the cut along dim 0, its slice): the experts that
    expert parallelism placed, listed as the gathers and cuts here read sharded tensors (their ``found``)."""
    out = {}
    for prefix, m in module.named_modules():
        if isinstance(m, ExpertParallelExperts):
            for name, p in m._parameters.items():
                out[f"{prefix}.{name}" if prefix else name] = (
                    p,
                    EXPERT_DIM,
                    ExpertSlice(m.ep_size, m.ep_rank),
                )
    return out


def cut_experts(name: str, full: Tensor, pieces: dict[str, tuple[Tensor, ShardSpec, ExpertSlice]]) -> Tensor:
    """This rank's experts of the full tensor ``name`` (others whole)."""
    if name not in pieces:
        return full
    _, spec, part = pieces[name]
    return shard_tensor(full, spec, part.ep_size, part.ep_rank)


def _full_shape(local: Tensor, spec: ShardSpec, tp_size: int) -> tuple[int, ...]:
    shape = list(local.shape)
    shape[spec.dim] = spec.full_size(shape[spec.dim], tp_size)
    return tuple(shape)


def gather_shards(
    module: nn.Module,
    tensors: Mapping[str, Tensor],
    group: Optional[dist.ProcessGroup],
    found: Found = sharded_parameters,
) -> dict[str, Tensor]:
    """``tensors`` (by state-dict key, each shaped as ``module``'s own) with those of sharded tensors
    gathered to their full size over ``group`` (a collective: every rank holds the same keys)."""
    out = dict(tensors)
    for key, (_, spec, _) in found(module).items():
        if key in out:
            out[key] = full_tensor(all_gather_list(out[key].detach().contiguous(), group), spec)
    return out


def cut_shards(
    module: nn.Module, tensors: Mapping[str, Tensor], found: Found = sharded_parameters
) -> dict[str, Tensor]:
    """Full-size ``tensors`` (by state-dict key) with those of sharded tensors cut to this rank's slice
    (a tensor already of the local shape is kept)."""
    out = dict(tensors)
    for key, (local, spec, layer) in found(module).items():
        parts, part = cut_of(layer)
        if key in out and tuple(out[key].shape) == _full_shape(local, spec, parts):
            out[key] = shard_tensor(out[key], spec, parts, part)
    return out


def full_state_dict(module: nn.Module, group: Optional[dist.ProcessGroup]) -> dict[str, Any]:
    """``module.state_dict()`` with every sharded tensor gathered to its full size (a collective)."""
    return gather_shards(module, module.state_dict(), group)


def load_full_state_dict(module: nn.Module, state: Mapping[str, Any], strict: bool = True) -> Any:
    """Load a full state dict into a sharded module: each rank takes its own slice."""
    local = dict(state)
    for key, (tensor, spec, layer) in sharded_parameters(module).items():
        if key in local and tuple(local[key].shape) == _full_shape(tensor, spec, layer.tp_size):
            local[key] = shard_tensor(local[key], spec, layer.tp_size, layer.tp_rank)
        elif key in local and local[key].shape != tensor.shape:
            raise ValueError(
                f"checkpoint tensor {key!r} has shape {tuple(local[key].shape)}; expected the full "
                f"shape {_full_shape(tensor, spec, layer.tp_size)}"
            )
    return module.load_state_dict(local, strict=strict)


def _param_index(optimizer_state: Mapping[str, Any], optimizer: Any) -> dict[int, Tensor]:
    """optimizer.state_dict() index -> parameter (indices follow param_groups order)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = [i for group in optimizer_state["param_groups"] for i in group["params"]]
    return dict(zip(ids, params))


def full_optimizer_state(
    optimizer: Any,
    module: nn.Module,
    group: Optional[dist.ProcessGroup],
    found: Found = sharded_parameters,
    state: Optional[Mapping[str, Any]] = None,
) -> dict[str, Any]:
    """``state`` (default ``optimizer.state_dict()``) with the per-parameter tensors of sharded parameters
    gathered."""
    state = optimizer.state_dict() if state is None else {**state, "state": dict(state["state"])}
    specs = {id(t): (spec, layer) for t, spec, layer in found(module).values()}
    for index, param in _param_index(state, optimizer).items():
        if id(param) not in specs or index not in state["state"]:
            continue
        spec, _ = specs[id(param)]
        entry = dict(state["state"][index])
        for k, v in entry.items():
            if isinstance(v, Tensor) and v.shape == param.shape and v.dim() > 0:
                entry[k] = full_tensor(all_gather_list(v, group), spec)
        state["state"][index] = entry
    return state


def shard_optimizer_state(
    state: Mapping[str, Any], optimizer: Any, module: nn.Module, found: Found = sharded_parameters
) -> dict[str, Any]:
    """The inverse of ``full_optimizer_state`` for this rank (no communication)."""
    state = {**state, "state": dict(state["state"])}
    specs = {id(t): (spec, layer) for t, spec, layer in found(module).values()}
    for index, param in _param_index(state, optimizer).items():
        if id(param) not in specs or index not in state["state"]:
            continue
        spec, layer = specs[id(param)]
        parts, part = cut_of(layer)
        full = _full_shape(param, spec, parts)
        state["state"][index] = {
            k: shard_tensor(v, spec, parts, part) if isinstance(v, Tensor) and tuple(v.shape) == full else v
            for k, v in state["state"][index].items()
        }
    return state


def unsharded_copy(tree: nn.Module, root: nn.Module, state: Mapping[str, Tensor]) -> nn.Module:
    """A copy of ``tree`` (a part of the sharded ``root``, such as a network held in the hyperparameters)
    as it is on one device: the sharded layers back to the layers they replaced, per-feature tensors
    whole, values from the full ``state`` (``root``'s names), no process group."""
    names = {id(m): n for n, m in root.named_modules()}
    for m in tree.modules():
        if isinstance(m, _TPLayer) and id(m) in names and SKELETON not in m.__dict__:
            raise ValueError(f"{names[id(m)]!r} was sharded without a skeleton of its layer (by apply_plan)")
    memo: dict[int, Any] = {}
    record = getattr(root, FEATURE_SHARDS, None)
    for name in record.specs if record is not None else ():
        owner, _, attr = name.rpartition(".")
        local = getattr(root.get_submodule(owner), attr)
        full = state[name].detach().clone()
        memo[id(local)] = nn.Parameter(full, local.requires_grad) if isinstance(local, nn.Parameter) else full
    return one_device_copy(tree, root, state, memo)
