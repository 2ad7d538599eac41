"""A character-level corpus that needs no download: the English text of Python's own documentation.

CPython ships its help topics (``pydoc_data.topics``, ~460 KB of prose and code examples) with every
installation, so the default run works offline on any machine. Characters are mapped to their ASCII
code (anything else becomes '?'), giving a fixed vocabulary of 128 that needs no fitting.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

__all__ = ["load_corpus", "encode", "CharWindows", "CharCorpusData", "VOCAB_SIZE"]

VOCAB_SIZE = 128


def load_corpus(max_chars: Optional[int] = None) -> str:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    return text[:max_chars] if max_chars else text


def encode(text: str) -> torch.Tensor:
    data = torch.frombuffer(bytearray(text.encode("ascii", errors="replace")), dtype=torch.uint8)
    return data.to(torch.long).clamp_(max=VOCAB_SIZE - 1)


class CharWindows(Dataset):
    """Non-overlapping windows: item i is (chars[i*T : i*T+T], chars[i*T+1 : i*T+T+1])."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data, self.block_size = data, block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.block_size : (i + 1) * self.block_size + 1]
        return chunk[:-1], chunk[1:]


class CharCorpusData(LightningDataModule):
    """Train/validation split (90/10) of the corpus into fixed-length windows."""

    def __init__(
        self,
        batch_size: int = 32,
        block_size: int = 64,
        max_chars: Optional[int] = None,
        val_fraction: float = 0.1,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction!r}")
        for name, value in (("batch_size", batch_size), ("block_size", block_size), ("max_chars", max_chars)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                whole = " (or None: the whole corpus)" if name == "max_chars" else ""
                raise ValueError(f"CharCorpusData: {name}={value!r}; use an integer >= 1{whole}")
        self.batch_size, self.block_size, self.num_workers = batch_size, block_size, num_workers
        data = encode(load_corpus(max_chars))
        split = int(len(data) * (1 - val_fraction))
        self.train_set = CharWindows(data[:split], block_size)
        self.val_set = CharWindows(data[split:], block_size)
        if len(self.train_set) < batch_size:  # drop_last: not one training batch
            needed = math.ceil((batch_size * block_size + 1) / (1 - val_fraction)) + 1
            raise ValueError(
                f"CharCorpusData: max_chars={max_chars} gives {len(self.train_set)} training windows of "
                f"{block_size} characters, fewer than one batch of batch_size={batch_size}; use max_chars >= "
                f"{needed}, or a smaller batch_size or block_size"
            )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)
