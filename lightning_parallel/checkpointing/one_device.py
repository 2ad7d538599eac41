"""A part of a split module, such as a network held in the hyperparameters, as one device holds it.

Strategies change modules in place: a tensor-parallel layer replaces a ``Linear``; a pipeline stage
empties the blocks of other stages, replaces their ``forward`` and hooks the ends of its own. Before
changing a module they keep a skeleton of it (``keep_skeleton``: a copy with meta tensors, outside the
module's registry). ``one_device_copy`` rebuilds a copy from the skeletons, filled from the full state
dict, without process groups: what ``save_hyperparameters()`` would have pickled on one device.
``put_back_whole`` does the same for a whole module in place: its children become the skeleton of
them kept before the split (``meta_skeleton``), filled with the trained values.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = [
    "SKELETON",
    "filled_copy",
    "keep_skeleton",
    "meta_skeleton",
    "one_device_copy",
    "put_back_whole",
    "unsaved_buffers",
]

SKELETON = "unsharded"  # the key of a changed module's skeleton in its __dict__


def meta_skeleton(module: nn.Module, memo: Optional[dict[int, Any]] = None) -> nn.Module:
    """A copy of ``module`` with its parameters and persistent buffers on the meta device (no memory); its
    non-persistent buffers (a causal mask), which no state dict holds, keep their values. ``memo``: further
    replacements (``copy.deepcopy``'s); a process group held by a module is left out (None)."""
    memo = dict(memo or {})
    for m in module.modules():
        for value in vars(m).values():
            if isinstance(value, dist.ProcessGroup):
                memo[id(value)] = None
    kept = {id(b) for b in unsaved_buffers(module).values()}
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) in kept:
            continue
        empty = t.detach().to("meta")
        memo[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return copy.deepcopy(module, memo)


def unsaved_buffers(module: nn.Module) -> dict[str, Tensor]:
    """The non-persistent buffers of ``module`` by name (a causal mask): what no state dict holds."""
    return {
        f"{prefix}.{n}" if prefix else n: b
        for prefix, m in module.named_modules()
        for n, b in m._buffers.items()
        if n in m._non_persistent_buffers_set and b is not None
    }


def keep_skeleton(module: nn.Module, skeleton: Optional[nn.Module] = None) -> None:
    """Remember what ``module`` is now (or ``skeleton``, the module it replaces), to be rebuilt whole
    for a checkpoint's hyperparameters; held as a plain attribute: no state, no parameters."""
    module.__dict__[SKELETON] = meta_skeleton(module if skeleton is None else skeleton)


def one_device_copy(
    tree: nn.Module, root: nn.Module, state: Mapping[str, Tensor], memo: Optional[dict[int, Any]] = None
) -> nn.Module:
    """A copy of ``tree`` (a part of ``root``) in which every module with a skeleton is its skeleton
    filled from the full ``state`` (``root``'s names), and no process group is kept. ``memo``: further
    replacements (``copy.deepcopy``'s)."""
    names = {id(m): n for n, m in root.named_modules()}
    memo = dict(memo or {})
    for m in tree.modules():
        for value in vars(m).values():  # a SyncBatchNorm's group; a sharded layer's (replaced below)
            if isinstance(value, dist.ProcessGroup):
                memo[id(value)] = None
        if SKELETON in m.__dict__ and id(m) in names:
            memo[id(m)] = _filled(m.__dict__[SKELETON], names[id(m)], state)
    return copy.deepcopy(tree, memo)


def _filled(skeleton: nn.Module, name: str, state: Mapping[str, Tensor]) -> nn.Module:
    """A copy of ``skeleton`` holding the values that ``state`` has under ``name``."""
    prefix = f"{name}." if name else ""
    return filled_copy(skeleton, {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})


def filled_copy(
    skeleton: nn.Module, state: Mapping[str, Tensor], device: Optional[torch.device] = None
) -> nn.Module:
    """A copy of ``skeleton`` whose parameters and persistent buffers are ``state``'s tensors (their dtype,
    on ``device`` or where they are; tied ones stay tied), its non-persistent buffers its own (or, where
    they are meta, ``state``'s)."""
    memo: dict[int, Any] = {}
    named = [
        *skeleton.named_parameters(remove_duplicate=False),
        *skeleton.named_buffers(remove_duplicate=False),
    ]
    for key, t in named:
        if id(t) in memo or not t.is_meta:  # a tie's other name; a non-persistent buffer's value
            continue
        if key not in state:
            raise KeyError(f"{key!r} is not in the full state dict, which holds {len(state)} keys")
        value = state[key].detach()
        value = value if device is None else value.to(device)
        memo[id(t)] = nn.Parameter(value, t.requires_grad) if isinstance(t, nn.Parameter) else value
    return copy.deepcopy(skeleton, memo)


def put_back_whole(
    module: nn.Module, skeleton: nn.Module, state: Mapping[str, Tensor], device: torch.device
) -> None:
    """Make ``module`` whole again, in place: each child named in ``skeleton`` (a container of the children's
    skeletons, taken before the split) becomes its skeleton filled from the full ``state``. A module of the
    same type as before keeps its identity (what the user holds stays valid) and takes the filled one's
    attributes, hooks and children; one the split replaced (a sharded layer) is replaced back."""
    filled = filled_copy(skeleton, state, device)
    seen: set[int] = set()
    for name, whole in filled._modules.items():
        current = module._modules.get(name)
        if _keeps_its_state(current):
            continue
        if whole is not None and current is not None and type(current) is type(whole):
            _take_over(current, whole, seen)
        else:
            module._modules[name] = whole


def _keeps_its_state(module: Optional[nn.Module]) -> bool:
    """A torchmetrics ``Metric`` is left as it is: no split touches it, and what it accumulated during the
    stage lives in plain attributes that no state dict (and so no skeleton) holds."""
    from torchmetrics import Metric

    return isinstance(module, Metric)


def _take_over(current: nn.Module, whole: nn.Module, seen: set[int]) -> None:
    """``current`` becomes ``whole`` (its ``__dict__``), keeping the identity of ``current`` and of those of
    its descendants whose type is unchanged."""
    if id(current) in seen:  # a module held under two names
        return
    seen.add(id(current))
    for name, child in whole._modules.items():
        old = current._modules.get(name)
        if _keeps_its_state(old):
            whole._modules[name] = old
        elif child is not None and old is not None and type(old) is type(child):
            _take_over(old, child, seen)
            whole._modules[name] = old
    current.__dict__ = whole.__dict__
