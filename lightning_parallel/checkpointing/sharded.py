"""Sharded storage (``save_distributed=True``): a directory where each rank writes only its own part.

The checkpoint path becomes a directory written by ``torch.distributed.checkpoint`` (DCP): every rank
hands DCP its local tensors under the **single-device names**, and a tensor-parallel shard is handed over
as a ``DTensor`` that says which slice of the full tensor it is. DCP writes one file per rank
(``__<rank>_0.distcp``) and records, per name, which file holds which slice. Tensors that several ranks
hold (data-parallel replicas, pipeline stages' replicated modules, tensor-parallel biases) are written
once, by one of them.

DCP does the resharding: loading asks for exactly the slices this rank's layout needs (a DTensor for a
tensor-parallel shard of any size, a full tensor for data parallel, one stage's tensors for a pipeline)
and reads only those bytes, so one directory loads into tp=2, 2 pipeline stages, lp_ddp or one device.
Packed tensors (q, k, v in one weight: ``ShardSpec.chunks > 1``) are stored viewed as ``(chunks, rows)``
along the split dimension, where each rank's part is one slice; the layouts that hold them whole view
their tensor the same way when loading.

Optimizer state is stored by parameter name; a state tensor of its parameter's shape is sliced as
``optimizer_state_layouts`` says. Under ZeRO (``zero_stage``) a rank holds a moment only for its range of the
flattened parameter (``StatePieces``); it hands DCP that range as the few boxes it makes in the tensor's
shape (a ``ShardedTensor``: a flat range of an n-dimensional tensor is at most 2n - 1 boxes), so each rank
writes only its own pieces and every layout reads them back as it reads a slice.

The rest of the checkpoint (loops, callbacks, schedulers, resume state, optimizer hyperparameters) goes into
``meta.pt``, which rank 0 writes last into a hidden temporary directory before renaming it into place
(``interrupted_saves.py``: the hidden names, the two renames, and what a kill leaves): a directory without
``meta.pt`` and DCP's ``.metadata`` is never taken for a checkpoint. A strict load refuses model keys that
differ from the module's, with ``load_state_dict``'s message, before any tensor is read. Tensors are read at the
end of the strategy's set-up, once the module has its layout and the optimizers exist. ``consolidate`` turns a
directory into one single-device ``.ckpt``.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.types import _PATH
from torch import Tensor, nn

from lightning_parallel.checkpointing.atomic import atomic_torch_save
from lightning_parallel.checkpointing.by_name import names_in_optimizer
from lightning_parallel.checkpointing.contract import ShardLayout
from lightning_parallel.checkpointing.interrupted_saves import (
    hidden_path,
    move_into_place,
    new_token,
    recover,
)
from lightning_parallel.checkpointing.resume_state import all_gather_objects
from lightning_parallel.checkpointing.trust import MetadataReader, load_dcp, load_file
from lightning_parallel.distributed.optimizer_shards import StatePieces

__all__ = [
    "META_FILE",
    "SHARDED_KEY",
    "consolidate",
    "is_sharded_checkpoint",
    "load_sharded",
    "read_sharded_meta",
    "write_sharded",
]

META_FILE = "meta.pt"
SHARDED_KEY = "lightning_parallel_sharded"
_MODEL = "state_dict/"
_OPTIM = "optimizer_states/"


def is_sharded_checkpoint(path: _PATH) -> bool:
    """A complete sharded checkpoint: a directory with DCP's ``.metadata`` and our ``meta.pt`` (written last)."""
    path = Path(path)
    return path.is_dir() and (path / META_FILE).is_file() and (path / ".metadata").is_file()


def _packed(shape: tuple[int, ...], dim: int, chunks: int) -> tuple[int, ...]:
    """``shape`` with ``dim`` split into (chunks, rows): each rank's part of a packed tensor is one slice of it."""
    if chunks == 1:
        return tuple(shape)
    return tuple(shape[:dim]) + (chunks, shape[dim] // chunks) + tuple(shape[dim + 1 :])


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for n in reversed(shape):
        stride.append(step)
        step *= n
    return tuple(reversed(stride))


# ---------------------------------------------------------------------------------------------- save
def _as_dtensor(local: Tensor, layout: ShardLayout, meshes: dict) -> Any:
    """``local`` as the DTensor slice of the full (packed-viewed) tensor; shares ``local``'s memory."""
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_parallel.compat import DTensor, Shard

    group = layout.group if layout.group is not None else dist.group.WORLD
    mesh = meshes.get(id(group))
    if mesh is None:
        mesh = meshes[id(group)] = DeviceMesh.from_group(group, local.device.type)
    if mesh.get_local_rank() != layout.rank:
        raise RuntimeError(
            f"tensor-parallel rank {layout.rank} is position {mesh.get_local_rank()} of its group"
        )
    global_shape = _packed(_full_shape(local, layout), layout.dim, layout.chunks)
    local_shape = _packed(tuple(local.shape), layout.dim, layout.chunks)
    shard_dim = layout.dim + (1 if layout.chunks > 1 else 0)
    return DTensor.from_local(
        local.view(local_shape),
        mesh,
        [Shard(shard_dim)],
        run_check=False,
        shape=torch.Size(global_shape),
        stride=_contiguous_stride(global_shape),
    )


def _full_shape(local: Tensor, layout: ShardLayout) -> tuple[int, ...]:
    return _full_size(tuple(local.shape), layout)


def _full_size(shape: tuple[int, ...], layout: ShardLayout) -> tuple[int, ...]:
    full = list(shape)
    full[layout.dim] *= layout.size
    return tuple(full)


def _boxes(start: int, stop: int, shape: tuple[int, ...]) -> list[tuple[list[int], list[int], int]]:
    """Elements ``start:stop`` of a tensor of ``shape`` flattened, as boxes ``(offsets, sizes, first)``:
    each box is a run of consecutive elements from flat index ``first``."""
    if start >= stop:
        return []
    if len(shape) == 1:
        return [([start], [stop - start], start)]
    inner = math.prod(shape[1:])

    def in_row(row: int, begin: int, end: int) -> list[tuple[list[int], list[int], int]]:
        """Elements ``begin:end`` of one row, as boxes of the whole tensor."""
        return [([row, *o], [1, *s], row * inner + f) for o, s, f in _boxes(begin, end, shape[1:])]

    row, row_stop = start // inner, stop // inner
    if row == row_stop:
        return in_row(row, start % inner, stop % inner)
    out = []
    if start % inner:  # the end of a first, partial row
        out, row = in_row(row, start % inner, inner), row + 1
    if row_stop > row:  # whole rows
        out.append(([row] + [0] * (len(shape) - 1), [row_stop - row, *shape[1:]], row * inner))
    return out + in_row(row_stop, 0, stop % inner)  # the start of a last, partial row


def _as_pieces(pieces: StatePieces, layout: ShardLayout | None) -> Any:
    """ZeRO's pieces of one state tensor as a ``ShardedTensor`` of the full (packed-viewed) tensor: this rank's
    elements as their boxes (sharing their memory), every rank's boxes as its metadata."""
    from lightning_parallel.compat import (
        EnumerableShardingSpec,
        ShardedTensorBase,
        ShardedTensorMetadata,
        ShardMetadata,
        TensorProperties,
    )
    from lightning_parallel.compat import LocalShard as Shard

    shape, tp_ranks, tp_rank, shard_dim = tuple(pieces.shape), 1, 0, 0
    full = shape
    if layout is not None:
        full = _packed(_full_size(shape, layout), layout.dim, layout.chunks)
        shape = _packed(shape, layout.dim, layout.chunks)
        tp_ranks, tp_rank, shard_dim = layout.size, layout.rank, layout.dim + (1 if layout.chunks > 1 else 0)

    def boxes(start: int, stop: int, rank: int) -> list[tuple[list[int], list[int], int]]:
        found = _boxes(start, stop, shape)
        for offsets, _, _ in found:
            offsets[shard_dim] += rank * shape[shard_dim]
        return found

    everyone = [
        ShardMetadata(o, s) for r in range(tp_ranks) for a, b in pieces.spans for o, s, _ in boxes(a, b, r)
    ]
    flat, start = pieces.value.reshape(-1), pieces.start
    local = [
        Shard(
            flat[first - start : first - start + math.prod(sizes)].view(sizes), ShardMetadata(offsets, sizes)
        )
        for offsets, sizes, first in boxes(start, start + flat.numel(), tp_rank)
    ]
    properties = TensorProperties(dtype=flat.dtype, requires_grad=False)
    metadata = ShardedTensorMetadata(everyone, torch.Size(full), properties)
    spec = EnumerableShardingSpec(everyone)  # the boxes as they are (torch would infer a placed chunking)
    sharded = ShardedTensorBase._init_from_local_shards_and_global_metadata(local, metadata, spec)
    # a load destination too (ZeRO-3's parameters): DCP's load planner asks its size(), which torch's
    # sharded ops dispatch with the tensor's process group, unused by such queries
    sharded._process_group = None
    return sharded


# ---------------------------------------------------------------------------------------------- load
def _destination(
    like: Tensor, md: Any, layout: ShardLayout | None, name: str, meshes: dict
) -> tuple[Any, Tensor]:
    """(what DCP loads into, the plain local tensor that ends up holding the values)."""
    buffer = torch.empty_like(like)
    saved = tuple(md.size)
    if layout is not None:
        full = _full_shape(like, layout)
        if saved not in (full, _packed(full, layout.dim, layout.chunks)):
            raise ValueError(f"checkpoint tensor {name!r} has shape {saved}; this model's is {full}")
        return _as_dtensor(buffer, layout, meshes), buffer
    if saved == tuple(like.shape):
        return buffer, buffer
    if math.prod(saved) == like.numel() and len(saved) == like.dim() + 1:  # stored packed, loaded whole
        return buffer.view(saved), buffer
    raise ValueError(f"checkpoint tensor {name!r} has shape {saved}; this model's is {tuple(like.shape)}")


def _read_metadata(path: Path, weights_only: Optional[bool]) -> dict[str, Any]:
    return MetadataReader(path, weights_only).read_metadata().state_dict_metadata


def read_sharded_meta(path: Path, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """The checkpoint without its tensors (``meta.pt``), and DCP's index checked to load under
    ``weights_only``; the tensors are read later by ``load_sharded``."""
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(
            f"{path} is a directory but not a complete sharded checkpoint (no {META_FILE} or .metadata): "
            "its save was interrupted, or it is not a checkpoint. Point ckpt_path at a finished one."
        )
    _read_metadata(path, weights_only)  # refused here, before set-up, if it would run code
    return load_file(path / META_FILE, weights_only)


def write_sharded(strategy: Any, checkpoint: dict[str, Any], path: Path) -> None:
    """Write ``checkpoint`` (this rank's tensors, as the strategy's local state) to the directory ``path``;
    every rank calls it."""
    from torch.distributed.checkpoint import save

    state, groups = _dcp_state(strategy, checkpoint)
    everyone = all_gather_objects(_local_summary(strategy, groups))
    token = strategy.broadcast(new_token())  # rank 0's: it makes and renames the directory
    tmp = hidden_path(path, "tmp", token)
    if strategy.global_rank == 0:
        recover(path.parent, is_sharded_checkpoint, only=path.name)  # what earlier saves of this name left
        tmp.mkdir(parents=True)
    strategy.barrier("sharded_checkpoint_mkdir")
    try:
        save(state, checkpoint_id=str(tmp))  # every rank writes its own file; .metadata once all are done
        if strategy.global_rank == 0:
            atomic_torch_save(_meta(strategy, checkpoint, groups, everyone), tmp / META_FILE)  # written last
            move_into_place(tmp, path, token)
    except BaseException:
        if strategy.global_rank == 0 and not is_sharded_checkpoint(tmp):  # a finished one is kept to recover
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _dcp_state(strategy: Any, checkpoint: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """What DCP writes (model and optimizer tensors, shards as DTensors) and the optimizers' groups."""
    layouts, optim_layouts, meshes = strategy.shard_layouts(), strategy.optimizer_state_layouts(), {}
    params = dict(strategy.lightning_module.named_parameters())
    state: dict[str, Any] = {}
    for key, tensor in checkpoint.pop("state_dict").items():
        if isinstance(tensor, StatePieces):  # ZeRO-3: this rank's range of the parameter
            state[_MODEL + key] = _as_pieces(tensor, layouts.get(key))
        else:
            state[_MODEL + key] = _as_dtensor(tensor, layouts[key], meshes) if key in layouts else tensor
    groups = []
    for i, by_name in enumerate(checkpoint.pop("optimizer_states", [])):
        for name, entry in by_name["state"].items():
            for k, v in entry.items():
                sliced = name in optim_layouts and isinstance(v, Tensor) and v.shape == params[name].shape
                if isinstance(v, StatePieces):  # ZeRO: this rank's elements only
                    v = _as_pieces(v, optim_layouts.get(name))
                elif sliced:
                    v = _as_dtensor(v, optim_layouts[name], meshes)
                state[f"{_OPTIM}{i}/{name}/{k}"] = v
        groups.append(by_name["groups"])
    return state, groups


def _local_summary(strategy: Any, groups: list[Any]) -> dict[str, Any]:
    """What rank 0 needs from every rank to write ``meta.pt``: parameter names per group, packed shapes, keys."""
    module, layouts = strategy.lightning_module, strategy.shard_layouts()
    params, keys = dict(module.named_parameters()), list(module.state_dict().keys())
    packed = {
        n: _full_shape(params.get(n, t), layouts[n])
        for n, t in module.state_dict().items()
        if n in layouts and layouts[n].chunks > 1
    }
    return {"groups": [[g["names"] for g in gs] for gs in groups], "packed": packed, "keys": keys}


def _meta(
    strategy: Any, checkpoint: dict[str, Any], groups: list[Any], everyone: list[dict]
) -> dict[str, Any]:
    meta = dict(checkpoint)
    names = strategy.full_parameter_names()
    meta["optimizer_states"] = [
        _merged_groups(gs, [e["groups"][i] for e in everyone], names) for i, gs in enumerate(groups)
    ]
    order = {k: j for j, k in enumerate(strategy.full_state_keys())}
    keys = sorted({k for e in everyone for k in e["keys"]}, key=lambda k: order.get(k, len(order)))
    meta[SHARDED_KEY] = {
        "version": 1,
        "world_size": strategy.world_size,
        "state_keys": keys,
        "packed": {n: s for e in everyone for n, s in e["packed"].items()},
    }
    return meta


def _merged_groups(
    local_groups: list[dict], names_per_rank: list[list[list[str]]], full_names: list[str]
) -> dict[str, Any]:
    position = {n: j for j, n in enumerate(full_names)}
    out = []
    for g, hyper in enumerate(local_groups):
        names = sorted(
            {n for ranks in names_per_rank for n in ranks[g]}, key=lambda n: position.get(n, len(position))
        )
        out.append({k: v for k, v in hyper.items() if k != "names"} | {"params": names})
    return {"param_groups": out}


def load_sharded(
    strategy: Any, path: Path, meta: Mapping[str, Any], strict: bool, weights_only: Optional[bool] = None
) -> None:
    """Read the directory into the strategy's module (and optimizers, when there are) as laid out now."""
    md = _read_metadata(path, weights_only)
    module = strategy.lightning_module
    layouts, meshes = strategy.shard_layouts(), {}
    dest: dict[str, Any] = {}
    local: dict[str, Tensor] = {}
    pieces = strategy.model_state_pieces()  # read straight into the rank's own range (ZeRO-3)
    for key, tensor in module.state_dict().items():
        if _MODEL + key not in md:
            continue
        if key in pieces:
            if pieces[key] is not None:
                dest[_MODEL + key] = _as_pieces(pieces[key], layouts.get(key))
        else:
            dest[_MODEL + key], local[key] = _destination(
                tensor, md[_MODEL + key], layouts.get(key), key, meshes
            )
    if strict:
        _refuse_other_keys(module, md, strategy.full_state_keys())
    saved_states = meta.get("optimizer_states", [])
    optim_targets = [
        (optimizer, saved_states[i], _optimizer_targets(strategy, md, i, dest, meshes))
        for i, optimizer in enumerate((strategy.optimizers or [])[: len(saved_states)])
    ]
    load_dcp(dest, path, weights_only)
    strategy.load_full_model_state(local, strict=strict and not pieces)  # strict: checked above
    for optimizer, saved, targets in optim_targets:
        optimizer.load_state_dict(_local_optimizer_state(optimizer, module, saved, targets, dest))


def _refuse_other_keys(module: nn.Module, md: Mapping[str, Any], expected: list[str]) -> None:
    """A strict load of model keys that differ from the whole module's fails as ``load_state_dict`` does
    for a file (the same message), before any tensor is read."""
    saved = [k[len(_MODEL) :] for k in md if k.startswith(_MODEL)]
    saved_set, expected_set = set(saved), set(expected)
    found = (
        ("Missing", [k for k in expected if k not in saved_set]),
        ("Unexpected", [k for k in saved if k not in expected_set]),
    )
    errors = [f"{what} key(s) in state_dict: {_quoted(keys)}. " for what, keys in found if keys]
    if errors:
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(module).__name__}:\n\t" + "\n\t".join(errors)
        )


def _quoted(keys: list[str]) -> str:
    return ", ".join(f'"{k}"' for k in keys)


def _optimizer_targets(
    strategy: Any, md: Mapping[str, Any], i: int, dest: dict[str, Any], meshes: dict
) -> dict[str, dict[str, Any]]:
    """Where optimizer ``i``'s stored entries of this rank's parameters are read to (``dest`` filled in)."""
    params = dict(strategy.lightning_module.named_parameters())
    layouts = strategy.optimizer_state_layouts()
    targets: dict[str, dict[str, Any]] = {}
    prefix = f"{_OPTIM}{i}/"
    for fqn, item in md.items():
        if not fqn.startswith(prefix):
            continue
        name, k = fqn[len(prefix) :].rsplit("/", 1)
        if name not in params:
            continue
        full = params[name].numel() * (layouts[name].size if name in layouts else 1)
        if hasattr(item, "size") and len(item.size) >= 1 and math.prod(item.size) == full:
            dest[fqn], targets.setdefault(name, {})[k] = _destination(
                params[name].detach(), item, layouts.get(name), fqn, meshes
            )
        elif hasattr(item, "size"):
            dest[fqn] = targets.setdefault(name, {})[k] = torch.empty(item.size, dtype=item.properties.dtype)
        else:
            dest[fqn] = None
            targets.setdefault(name, {})[k] = (fqn,)  # an object: filled in from dest after the load
    return targets


def _local_optimizer_state(
    optimizer: Any,
    module: nn.Module,
    saved: Mapping[str, Any],
    targets: Mapping[str, Mapping[str, Any]],
    dest: Mapping[str, Any],
) -> dict[str, Any]:
    """This rank's ``optimizer.state_dict()`` from the by-name values just read."""
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(
            f"the checkpoint's optimizer has {len(saved['param_groups'])} parameter groups, this one "
            f"{len(optimizer.param_groups)}; it was saved for another optimizer configuration"
        )
    names = names_in_optimizer(optimizer, module)
    state, param_groups, start = {}, [], 0
    for hyper, group in zip(saved["param_groups"], optimizer.param_groups):
        count = len(group["params"])
        param_groups.append(
            {k: v for k, v in hyper.items() if k != "params"} | {"params": list(range(start, start + count))}
        )
        start += count
    for index, name in enumerate(names):
        if name in targets:
            state[index] = {k: dest[v[0]] if isinstance(v, tuple) else v for k, v in targets[name].items()}
    return {"state": state, "param_groups": param_groups}


# ---------------------------------------------------------------------------------------------- consolidate
def consolidate(directory: _PATH, output: _PATH, weights_only: Optional[bool] = None) -> None:
    """Write a sharded checkpoint directory as one single-device ``.ckpt`` (one process, no process group);
    ``weights_only`` as in ``fit``."""
    directory = Path(directory)
    if not is_sharded_checkpoint(directory):
        raise FileNotFoundError(
            f"{directory} is not a complete sharded checkpoint (needs {META_FILE} and .metadata)"
        )
    md = _read_metadata(directory, weights_only)
    values: dict[str, Any] = {
        k: torch.empty(m.size, dtype=m.properties.dtype) if hasattr(m, "size") else None
        for k, m in md.items()
    }
    load_dcp(values, directory, weights_only, no_dist=True)
    meta = load_file(directory / META_FILE, weights_only)
    info = meta.pop(SHARDED_KEY)
    packed = {n: torch.Size(s) for n, s in info["packed"].items()}

    def unpack(name: str, t: Any) -> Any:
        return (
            t.reshape(packed[name])
            if name in packed and isinstance(t, Tensor) and t.numel() == packed[name].numel()
            else t
        )

    meta["state_dict"] = {
        k: unpack(k, values[_MODEL + k]) for k in info["state_keys"] if _MODEL + k in values
    }
    optimizers = []
    for i, saved in enumerate(meta.get("optimizer_states", [])):
        state, groups, index = {}, [], 0
        for group in saved["param_groups"]:
            ids = list(range(index, index + len(group["params"])))
            groups.append({k: v for k, v in group.items() if k != "params"} | {"params": ids})
            for j, name in zip(ids, group["params"]):
                prefix = f"{_OPTIM}{i}/{name}/"
                entry = {k[len(prefix) :]: unpack(name, v) for k, v in values.items() if k.startswith(prefix)}
                if entry:
                    state[j] = entry
            index += len(ids)
        optimizers.append({"state": state, "param_groups": groups})
    if "optimizer_states" in meta:
        meta["optimizer_states"] = optimizers
    atomic_torch_save(meta, output)
