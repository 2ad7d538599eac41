"""Sharded checkpoints (``save_distributed=True``): each rank writes only its own part, any layout loads them.

A full checkpoint gathers every tensor to rank 0; for a model that does not fit one process that is
the thing to avoid. With ``save_distributed=True`` the checkpoint path becomes a directory written by
``torch.distributed.checkpoint`` (DCP): every rank hands DCP its local tensors under the
**single-device names**, and a tensor-parallel shard is handed over as a ``DTensor`` that says which
slice of the full tensor it is. DCP writes one file per rank (``__<rank>_0.distcp``) and records, per
name, which file holds which slice. Tensors that several ranks hold (data-parallel replicas, pipeline
stages' replicated modules, tensor-parallel biases) are written once, by one of them.

Why DTensor slices rather than our own per-rank pieces: DCP then does the resharding. Loading asks for
exactly the slices this rank's layout needs (a DTensor for a tensor-parallel shard of any size, a full
tensor for data parallel, one stage's tensors for a pipeline) and reads only those bytes, so the same
directory loads into tp=2, 2 pipeline stages, lp_ddp or one device, with no gather and no conversion.
Packed tensors (q, k, v in one weight: ``ShardSpec.chunks > 1``) are not one contiguous slice per
rank; they are stored viewed as ``(chunks, rows)`` along the split dimension, where each rank's part
*is* one slice. The layouts that hold them whole view their tensor the same way when loading.

Optimizer state is stored by parameter name (``pipeline.state.stage_state_by_name``); the state of a
sharded parameter (Adam's moments) is sliced like the parameter. Lightning's non-tensor state (loops,
callbacks, schedulers, our exact-resume state, optimizer hyperparameters) goes into ``meta.pt``.

Atomic: all ranks write into a hidden temporary directory next to the target; rank 0 writes
``meta.pt`` last and then renames the directory into place. A directory without ``meta.pt`` and DCP's
``.metadata`` is never taken for a checkpoint.

Loading happens at the end of the strategy's ``setup``, once the module has its layout and the
optimizers exist (Lightning restores weights before ``setup``): that is what lets each rank read only
its part. ``python -m lightning_parallel.sharded_checkpoint consolidate DIR OUT.ckpt`` turns a
directory into one ordinary single-device ``.ckpt`` (for ``load_from_checkpoint``).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.types import _PATH
from torch import Tensor, nn

from lightning_parallel.checkpoint import atomic_torch_save
from lightning_parallel.pipeline.state import names_in_optimizer, stage_state_by_name
from lightning_parallel.resume import CHECKPOINT_KEY

__all__ = ["ShardLayout", "ShardedCheckpointMixin", "is_sharded_checkpoint", "consolidate", "META_FILE", "SHARDED_KEY"]

META_FILE = "meta.pt"
SHARDED_KEY = "lightning_parallel_sharded"
_MODEL = "state_dict/"
_OPTIM = "optimizer_states/"


@dataclass(frozen=True)
class ShardLayout:
    """This rank's tensor is slice ``rank`` of ``size`` along ``dim`` of the full one (``chunks`` packed blocks
    are each sliced; see ``tensor.layers.ShardSpec``)."""

    dim: int
    chunks: int
    rank: int
    size: int
    group: Optional[dist.ProcessGroup]


def is_sharded_checkpoint(path: _PATH) -> bool:
    """A complete sharded checkpoint: a directory with DCP's ``.metadata`` and our ``meta.pt`` (written last)."""
    path = Path(path)
    return path.is_dir() and (path / META_FILE).is_file() and (path / ".metadata").is_file()


def _packed(shape: tuple[int, ...], dim: int, chunks: int) -> tuple[int, ...]:
    """``shape`` with ``dim`` split into (chunks, rows): each rank's part of a packed tensor is one slice of it."""
    if chunks == 1:
        return tuple(shape)
    return tuple(shape[:dim]) + (chunks, shape[dim] // chunks) + tuple(shape[dim + 1:])


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
    from torch.distributed.tensor import DTensor, Shard

    group = layout.group if layout.group is not None else dist.group.WORLD
    mesh = meshes.get(id(group))
    if mesh is None:
        mesh = meshes[id(group)] = DeviceMesh.from_group(group, local.device.type)
    if mesh.get_local_rank() != layout.rank:
        raise RuntimeError(f"tensor-parallel rank {layout.rank} is position {mesh.get_local_rank()} of its group")
    full = list(local.shape)
    full[layout.dim] *= layout.size
    global_shape = _packed(tuple(full), layout.dim, layout.chunks)
    local_shape = _packed(tuple(local.shape), layout.dim, layout.chunks)
    shard_dim = layout.dim + (1 if layout.chunks > 1 else 0)
    return DTensor.from_local(local.view(local_shape), mesh, [Shard(shard_dim)], run_check=False,
                              shape=torch.Size(global_shape), stride=_contiguous_stride(global_shape))


def _full_shape(local: Tensor, layout: ShardLayout) -> tuple[int, ...]:
    full = list(local.shape)
    full[layout.dim] *= layout.size
    return tuple(full)


def _gather_small(obj: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _move_into_place(tmp: Path, path: Path) -> None:
    """Rename the finished temporary directory over ``path`` (a previous checkpoint file or directory)."""
    old = None
    if path.exists() or path.is_symlink():
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() else old.unlink()


# ---------------------------------------------------------------------------------------------- load
def _destination(like: Tensor, md: Any, layout: Optional[ShardLayout], name: str, meshes: dict) -> tuple[Any, Tensor]:
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


def _read_metadata(path: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(path)).read_metadata().state_dict_metadata


class ShardedCheckpointMixin:
    """Strategy hooks for ``save_distributed``; mix in before ``resume.ExactResumeMixin``.

    Strategies provide full (gathered) state through ``full_model_state`` / ``full_optimizer_state_dict``
    and load it through ``load_full_model_state`` / ``load_full_optimizer_state``; this mixin chooses
    between that and the sharded path. A tensor-parallel strategy describes its shards in
    ``shard_layouts``; a pipeline names the single-device parameter order in ``full_parameter_names``.
    """

    save_distributed: bool = False

    # ------------------------------------------------------------- hooks a strategy may override
    def shard_layouts(self) -> dict[str, ShardLayout]:
        """state_dict key / parameter name -> how this rank's tensor is cut from the full one."""
        return {}

    def full_parameter_names(self) -> list[str]:
        """Parameter names in single-device ``named_parameters`` order (optimizer index order)."""
        return [n for n, _ in self.lightning_module.named_parameters()]

    def full_model_state(self) -> dict[str, Any]:
        return super().lightning_module_state_dict()  # type: ignore[misc]

    def full_optimizer_state_dict(self, optimizer: Any) -> dict[str, Any]:
        return super().optimizer_state(optimizer)  # type: ignore[misc]

    def load_full_optimizer_state(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)  # type: ignore[misc]

    # ------------------------------------------------------------- Lightning strategy hooks
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.save_distributed:  # this rank's tensors only; save_checkpoint hands them to DCP
            return self.lightning_module.state_dict()
        return self.full_model_state()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self.save_distributed:
            return stage_state_by_name(getattr(optimizer, "_optimizer", optimizer), self.lightning_module)
        return self.full_optimizer_state_dict(optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None) -> None:
        if not self.save_distributed:
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)  # type: ignore[misc]
        if storage_options is not None or "://" in str(filepath):
            raise ValueError(f"save_distributed=True writes to a local or shared file system path; got {filepath!r} "
                             f"with storage_options={storage_options!r}. Use a path, or save_distributed=False.")
        checkpoint[CHECKPOINT_KEY] = self.resume_state_dict()  # type: ignore[attr-defined]
        self._save_sharded(checkpoint, Path(self.broadcast(str(filepath))))  # type: ignore[attr-defined]

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path))) if "://" not in str(checkpoint_path) else None  # type: ignore[attr-defined]
        if path is None or not path.is_dir():
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # type: ignore[misc]
        if not is_sharded_checkpoint(path):
            raise FileNotFoundError(
                f"{path} is a directory but not a complete sharded checkpoint (no {META_FILE} or .metadata): "
                "its save was interrupted, or it is not a checkpoint. Point ckpt_path at a finished one."
            )
        meta = torch.load(path / META_FILE, map_location="cpu", weights_only=bool(weights_only))  # Lightning state: objects
        self.load_resume_state_dict(meta.get(CHECKPOINT_KEY, {}))  # type: ignore[attr-defined]
        self._sharded_pending = (path, meta)
        return meta

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if SHARDED_KEY in checkpoint:  # read at the end of setup, in this strategy's layout
            self._sharded_strict = strict
            return
        super().load_model_state_dict(checkpoint, strict=strict)  # type: ignore[misc]

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if SHARDED_KEY in checkpoint:
            return  # loaded together with the weights at the end of setup
        self.load_full_optimizer_state(checkpoint)

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)  # type: ignore[misc]
        self.load_pending_sharded_checkpoint()

    # ------------------------------------------------------------- the work
    def _save_sharded(self, checkpoint: dict[str, Any], path: Path) -> None:
        from torch.distributed.checkpoint import save

        module = self.lightning_module
        layouts, meshes = self.shard_layouts(), {}
        params = dict(module.named_parameters())
        state: dict[str, Any] = {}
        for key, tensor in checkpoint.pop("state_dict").items():
            state[_MODEL + key] = _as_dtensor(tensor, layouts[key], meshes) if key in layouts else tensor
        groups = []
        for i, by_name in enumerate(checkpoint.pop("optimizer_states", [])):
            for name, entry in by_name["state"].items():
                for k, v in entry.items():
                    sliced = name in layouts and isinstance(v, Tensor) and v.shape == params[name].shape
                    state[f"{_OPTIM}{i}/{name}/{k}"] = _as_dtensor(v, layouts[name], meshes) if sliced else v
            groups.append(by_name["groups"])
        packed = {n: _full_shape(params.get(n, t), layouts[n]) for n, t in module.state_dict().items()
                  if n in layouts and layouts[n].chunks > 1}
        everyone = _gather_small({"groups": [[g["names"] for g in gs] for gs in groups], "packed": packed,
                                  "keys": list(module.state_dict().keys())})
        token = self.broadcast(uuid.uuid4().hex[:12])  # type: ignore[attr-defined]
        tmp = path.parent / f".{path.name}.tmp-{token}"
        if self.global_rank == 0:  # type: ignore[attr-defined]
            tmp.mkdir(parents=True)
        self.barrier("sharded_checkpoint_mkdir")  # type: ignore[attr-defined]
        save(state, checkpoint_id=str(tmp))  # every rank writes its own file; .metadata once all are done
        if self.global_rank == 0:  # type: ignore[attr-defined]
            meta = dict(checkpoint)
            meta["optimizer_states"] = [self._merged_groups(gs, [e["groups"][i] for e in everyone])
                                        for i, gs in enumerate(groups)]
            order = {k: j for j, k in enumerate(self.full_state_keys())}
            keys = sorted({k for e in everyone for k in e["keys"]}, key=lambda k: order.get(k, len(order)))
            meta[SHARDED_KEY] = {"version": 1, "world_size": self.world_size, "state_keys": keys,  # type: ignore[attr-defined]
                                 "packed": {n: s for e in everyone for n, s in e["packed"].items()}}
            atomic_torch_save(meta, tmp / META_FILE)  # the completion marker: written last
            _move_into_place(tmp, path)

    def full_state_keys(self) -> list[str]:
        """state_dict keys in single-device order (pipelines hold only some on each rank)."""
        return list(self.lightning_module.state_dict().keys())

    def _merged_groups(self, local_groups: list[dict], names_per_rank: list[list[list[str]]]) -> dict[str, Any]:
        position = {n: j for j, n in enumerate(self.full_parameter_names())}
        out = []
        for g, hyper in enumerate(local_groups):
            names = sorted({n for ranks in names_per_rank for n in ranks[g]}, key=lambda n: position.get(n, len(position)))
            out.append({k: v for k, v in hyper.items() if k != "names"} | {"params": names})
        return {"param_groups": out}

    def load_pending_sharded_checkpoint(self) -> None:
        """Read the pending sharded checkpoint into the module (and optimizers, when fitting) as laid out now."""
        pending = getattr(self, "_sharded_pending", None)
        if pending is None:
            return
        self._sharded_pending = None
        from torch.distributed.checkpoint import load

        path, meta = pending
        md = _read_metadata(path)
        module = self.lightning_module
        layouts, meshes = self.shard_layouts(), {}
        dest: dict[str, Any] = {}
        local: dict[str, Tensor] = {}
        for key, tensor in module.state_dict().items():
            if _MODEL + key in md:
                dest[_MODEL + key], local[key] = _destination(tensor, md[_MODEL + key], layouts.get(key), key, meshes)
        optim_targets = []
        params = dict(module.named_parameters())
        for i, optimizer in enumerate(self.optimizers or []):  # type: ignore[attr-defined]
            if i >= len(meta.get("optimizer_states", [])):
                break
            targets: dict[str, dict[str, Any]] = {}
            for fqn, item in md.items():
                if not fqn.startswith(f"{_OPTIM}{i}/"):
                    continue
                name, k = fqn[len(f"{_OPTIM}{i}/"):].rsplit("/", 1)
                if name not in params:
                    continue
                if hasattr(item, "size") and len(item.size) >= 1 and math.prod(item.size) == params[name].numel() * (
                        layouts[name].size if name in layouts else 1):
                    dest[fqn], targets.setdefault(name, {})[k] = _destination(params[name].detach(), item, layouts.get(name), fqn, meshes)
                elif hasattr(item, "size"):
                    dest[fqn] = targets.setdefault(name, {})[k] = torch.empty(item.size, dtype=item.properties.dtype)
                else:
                    dest[fqn] = None
                    targets.setdefault(name, {})[k] = (fqn,)  # an object: filled in from dest after the load
            optim_targets.append((optimizer, meta["optimizer_states"][i], targets))
        load(dest, checkpoint_id=str(path))
        self.load_full_model_state(local, strict=getattr(self, "_sharded_strict", True))  # type: ignore[attr-defined]
        for optimizer, saved, targets in optim_targets:
            optimizer.load_state_dict(_local_optimizer_state(optimizer, module, saved, targets, dest))


def _local_optimizer_state(optimizer: Any, module: nn.Module, saved: Mapping[str, Any],
                           targets: Mapping[str, Mapping[str, Any]], dest: Mapping[str, Any]) -> dict[str, Any]:
    """This rank's ``optimizer.state_dict()`` from the by-name values just read."""
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint's optimizer has {len(saved['param_groups'])} parameter groups, this one "
                         f"{len(optimizer.param_groups)}; it was saved for another optimizer configuration")
    names = names_in_optimizer(optimizer, module)
    state, param_groups, start = {}, [], 0
    for hyper, group in zip(saved["param_groups"], optimizer.param_groups):
        count = len(group["params"])
        param_groups.append({k: v for k, v in hyper.items() if k != "params"} | {"params": list(range(start, start + count))})
        start += count
    for index, name in enumerate(names):
        if name in targets:
            state[index] = {k: dest[v[0]] if isinstance(v, tuple) else v for k, v in targets[name].items()}
    return {"state": state, "param_groups": param_groups}


# ---------------------------------------------------------------------------------------------- consolidate
def consolidate(directory: _PATH, output: _PATH) -> None:
    """Write a sharded checkpoint directory as one single-device ``.ckpt`` (one process, no process group)."""
    from torch.distributed.checkpoint import load

    directory = Path(directory)
    if not is_sharded_checkpoint(directory):
        raise FileNotFoundError(f"{directory} is not a complete sharded checkpoint (needs {META_FILE} and .metadata)")
    md = _read_metadata(directory)
    values: dict[str, Any] = {k: torch.empty(m.size, dtype=m.properties.dtype) if hasattr(m, "size") else None
                              for k, m in md.items()}
    load(values, checkpoint_id=str(directory), no_dist=True)
    meta = torch.load(directory / META_FILE, map_location="cpu", weights_only=False)
    info = meta.pop(SHARDED_KEY)
    packed = {n: torch.Size(s) for n, s in info["packed"].items()}

    def unpack(name: str, t: Any) -> Any:
        return t.reshape(packed[name]) if name in packed and isinstance(t, Tensor) and t.numel() == packed[name].numel() else t

    meta["state_dict"] = {k: unpack(k, values[_MODEL + k]) for k in info["state_keys"] if _MODEL + k in values}
    optimizers = []
    for i, saved in enumerate(meta.get("optimizer_states", [])):
        state, groups, index = {}, [], 0
        for group in saved["param_groups"]:
            ids = list(range(index, index + len(group["params"])))
            groups.append({k: v for k, v in group.items() if k != "params"} | {"params": ids})
            for j, name in zip(ids, group["params"]):
                prefix = f"{_OPTIM}{i}/{name}/"
                entry = {k[len(prefix):]: unpack(name, v) for k, v in values.items() if k.startswith(prefix)}
                if entry:
                    state[j] = entry
            index += len(ids)
        optimizers.append({"state": state, "param_groups": groups})
    if "optimizer_states" in meta:
        meta["optimizer_states"] = optimizers
    atomic_torch_save(meta, output)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_parallel.sharded_checkpoint",
                                     description="Turn a save_distributed checkpoint directory into one .ckpt file.")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="DIR OUT.ckpt: a single-device checkpoint for load_from_checkpoint")
    c.add_argument("directory")
    c.add_argument("output")
    args = parser.parse_args(argv)
    consolidate(args.directory, args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
