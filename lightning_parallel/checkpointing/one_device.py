"""A part of a split module, such as a network held in the hyperparameters, as one device holds it.

Strategies change modules in place: a tensor-parallel layer replaces a ``Linear``; a pipeline stage
empties the blocks of other stages, replaces their ``forward`` and hooks the ends of its own. Before
changing a module they keep a skeleton of it (``keep_skeleton``: a copy with meta tensors, outside the
module's registry). ``one_device_copy`` rebuilds a copy from the skeletons, filled from the full state
dict, without process groups: what ``save_hyperparameters()`` would have pickled on one device.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Optional

import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["SKELETON", "keep_skeleton", "meta_skeleton", "one_device_copy"]

SKELETON = "unsharded"  # the key of a changed module's skeleton in its __dict__


def meta_skeleton(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with its parameters and persistent buffers on the meta device (no memory); its
    non-persistent buffers (a causal mask), which no state dict holds, keep their values."""
    memo: dict[int, Any] = {}
    kept = {
        id(b) for m in module.modules() for n, b in m._buffers.items() if n in m._non_persistent_buffers_set
    }
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) in kept:
            continue
        empty = t.detach().to("meta")
        memo[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return copy.deepcopy(module, memo)


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
    plain = copy.deepcopy(skeleton)
    values = {k: state[prefix + k] for k in plain.state_dict()}
    kept = {n: b for n, b in plain.named_buffers() if n not in values and not b.is_meta}
    device = next(iter(values.values())).device if values else "cpu"
    plain.to_empty(device=device)
    plain.load_state_dict(values)
    for name, buffer in kept.items():
        owner, _, attr = name.rpartition(".")
        plain.get_submodule(owner)._buffers[attr] = buffer.to(device)
    return plain
