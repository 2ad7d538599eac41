"""Model and optimizer state of a split model, in the layout-independent form of a single-device run.

Each rank's optimizer only knows its own parameters (a pipeline stage's) and numbers them 0..k-1. A checkpoint must not
depend on that: we write the state a single-device optimizer would have (parameters numbered in the
module's ``named_parameters`` order), so it loads into any other layout and any layout's loads here.
Assumes what ``configure_optimizers`` usually does: one parameter group per optimizer built from
``self.parameters()``, or several whose concatenation keeps that order.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch.distributed as dist
from torch import nn

__all__ = [
    "names_in_optimizer",
    "state_by_name",
    "merge_states",
    "state_from_full",
    "gather_parts",
    "gather_optimizer_parts",
]


def names_in_optimizer(optimizer: Any, module: nn.Module) -> list[str]:
    """The names of the optimizer's parameters, in its param_groups order."""
    names = {id(p): n for n, p in module.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def state_by_name(
    optimizer: Any, module: nn.Module, state: Optional[Mapping[str, Any]] = None
) -> dict[str, Any]:
    """This rank's optimizer state (``state``, else ``optimizer.state_dict()``) keyed by parameter name
    (what the ranks exchange)."""
    state = optimizer.state_dict() if state is None else state
    names = names_in_optimizer(optimizer, module)
    order = [i for group in state["param_groups"] for i in group["params"]]
    by_index = dict(zip(order, names))
    groups = [
        {k: v for k, v in g.items() if k != "params"} | {"names": [by_index[i] for i in g["params"]]}
        for g in state["param_groups"]
    ]
    return {"state": {by_index[i]: s for i, s in state["state"].items()}, "groups": groups}


def merge_states(stages: Sequence[Mapping[str, Any]], full_names: Sequence[str]) -> dict[str, Any]:
    """The single-device ``optimizer.state_dict()`` made from every part's named state.

    A part may hold fewer parameter groups than another: a group added during fit with only some stages'
    parameters (``BackboneFinetuning`` unfreezing blocks that one stage holds) is added on those stages
    only, after the groups every stage has. Groups are matched by their place, and a part lacks the last
    ones; a group's hyperparameters are those of the first part that has it."""
    position = {n: i for i, n in enumerate(full_names)}
    groups = []
    for g in range(max(len(s["groups"]) for s in stages)):
        having = [s["groups"][g] for s in stages if g < len(s["groups"])]
        names = sorted({n for group in having for n in group["names"]}, key=position.__getitem__)
        groups.append((having[0], names))
    index, param_groups, state = 0, [], {}
    for hyper, names in groups:
        ids = list(range(index, index + len(names)))
        param_groups.append({k: v for k, v in hyper.items() if k != "names"} | {"params": ids})
        for i, name in zip(ids, names):
            for stage in stages:
                if name in stage["state"]:
                    state[i] = stage["state"][name]
        index += len(names)
    return {"state": state, "param_groups": param_groups}


def state_from_full(
    full: Mapping[str, Any], optimizer: Any, module: nn.Module, full_names: Sequence[str]
) -> dict[str, Any]:
    """This rank's ``optimizer.state_dict()`` cut out of a single-device one (any layout saved it)."""
    ordered = [i for g in full["param_groups"] for i in g["params"]]
    if len(ordered) != len(full_names):
        raise ValueError(
            f"the checkpoint's optimizer has {len(ordered)} parameters, the model {len(full_names)}; "
            "it was saved for another model or optimizer"
        )
    name_of = dict(zip(ordered, full_names))
    local_names = names_in_optimizer(optimizer, module)
    local_index = {n: i for i, n in enumerate(local_names)}
    param_groups, state, start = [], {}, 0
    for g, group in zip(full["param_groups"], optimizer.param_groups):
        count = len(group["params"])
        param_groups.append(
            {k: v for k, v in g.items() if k != "params"} | {"params": list(range(start, start + count))}
        )
        start += count
    for i, s in full["state"].items():
        name = name_of[int(i)]
        if name in local_index:
            state[local_index[name]] = s
    return {"state": state, "param_groups": param_groups}


def gather_parts(
    local: Mapping[str, Any], group: Optional[dist.ProcessGroup], keys: Sequence[str]
) -> dict[str, Any]:
    """The state dict made of every rank's part over ``group`` (each rank holds some of ``keys``; a key
    several hold is the same on each), in the order of ``keys`` (a collective)."""
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(
        parts, {k: v.detach().cpu() if hasattr(v, "detach") else v for k, v in local.items()}, group=group
    )
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)
    return {k: merged[k] for k in keys if k in merged}


def gather_optimizer_parts(
    named: Mapping[str, Any], group: Optional[dist.ProcessGroup], full_names: Sequence[str]
) -> dict[str, Any]:
    """The single-device ``optimizer.state_dict()`` made of every rank's named state over ``group``."""
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, named, group=group)
    return merge_states(parts, full_names)
