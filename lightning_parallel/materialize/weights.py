"""Pretrained weights read tensor by tensor: a ``.safetensors`` file (or a folder of them), a torch file
(mapped, not copied into memory) or a mapping, seen as one read-only mapping of full names to tensors.
Set-up takes from it only the tensors of the rank's share, one at a time."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Union

import torch
from torch import Tensor

__all__ = ["WeightSource", "open_weights"]

WeightSource = Union[str, Path, Mapping[str, Tensor]]


class _Prefixed(Mapping):
    """``source``'s tensors under ``prefix + name`` (a Hugging Face model held as ``self.model``: "model.")."""

    def __init__(self, source: Mapping[str, Any], prefix: str) -> None:
        self.source, self.prefix = source, prefix

    def __getitem__(self, key: str) -> Tensor:
        if not key.startswith(self.prefix):
            raise KeyError(key)
        return self.source[key[len(self.prefix) :]]

    def __iter__(self) -> Iterator[str]:
        return (self.prefix + k for k in self.source)

    def __len__(self) -> int:
        return len(self.source)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key.startswith(self.prefix) and key[len(self.prefix) :] in self.source


class _Safetensors(Mapping):
    """The tensors of ``.safetensors`` files, each read from disk when asked for."""

    def __init__(self, files: list[Path]) -> None:
        from safetensors import safe_open  # a dependency of transformers; needed only for these files

        self.handles = [safe_open(str(f), framework="pt") for f in files]
        self.where = {k: h for h in self.handles for k in h.keys()}

    def __getitem__(self, key: str) -> Tensor:
        return self.where[key].get_tensor(key)

    def __contains__(self, key: object) -> bool:
        return key in self.where

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


def open_weights(source: WeightSource, prefix: str = "") -> Mapping[str, Tensor]:
    """``source`` as a mapping of full parameter names to tensors, read lazily where the format allows: a
    ``.safetensors`` file or a folder holding them (Hugging Face's ``save_pretrained``), a torch file (a
    Lightning checkpoint's ``state_dict``, or a plain state dict; memory-mapped), or a mapping. ``prefix``
    is put before every name (``"model."`` for a Hugging Face model held as ``self.model``)."""
    if isinstance(source, Mapping):
        weights: Mapping[str, Any] = source
    else:
        path = Path(source)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        if not files or not all(f.is_file() for f in files):
            raise FileNotFoundError(
                f"no weights at {str(path)!r}: give a .safetensors file, a folder of them, or a torch file"
            )
        if files[0].suffix == ".safetensors":
            weights = _Safetensors(files)
        else:
            loaded = torch.load(files[0], map_location="cpu", weights_only=True, mmap=True)
            weights = loaded.get("state_dict", loaded) if isinstance(loaded, dict) else loaded
    return _Prefixed(weights, prefix) if prefix else weights
