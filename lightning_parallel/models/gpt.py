"""A small GPT-style character language model: the default model of ``lp-train``.

Written as ordinary user code on purpose, so that every strategy has to cope with what real models do:
attention with its own q/k/v projections and a head-count attribute (``n_head``, read in ``forward``),
blocks in an ``nn.ModuleList`` looped over in ``forward`` with a mask computed there, and an
embedding and output head outside the block stack.
"""

from __future__ import annotations

import math

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.nn import functional as F

__all__ = ["CausalSelfAttention", "MLP", "Block", "GPT", "CharGPT", "argument_problems"]

OPTIMIZERS = ("adamw", "sgd")


def argument_problems(**arguments: object) -> list[str]:
    """What is wrong with CharGPT's arguments (sizes, dropout, learning rate, optimizer), each with what works."""
    out = []
    for name in ("vocab_size", "block_size", "n_head", "n_embd", "n_layer"):
        value, least = arguments.get(name), 0 if name == "n_layer" else 1
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            out.append(f"{name}={value!r}: use an integer >= {least}")
    dropout = arguments.get("dropout")
    if dropout is not None and not (isinstance(dropout, (int, float)) and 0 <= dropout < 1):
        out.append(f"dropout={dropout!r}: use a number in [0, 1)")
    for name in ("lr", "weight_decay", "momentum"):
        value, positive = arguments.get(name), name == "lr"
        if value is None:
            continue
        finite = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not finite or value < 0 or (positive and value == 0):
            out.append(f"{name}={value!r}: use a finite number {'> 0' if positive else '>= 0'}")
    optimizer = arguments.get("optimizer")
    if optimizer is not None and optimizer not in OPTIMIZERS:
        out.append(f"optimizer={optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
    return out


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}")
        self.n_head = n_head
        self.q = nn.Linear(n_embd, n_embd)
        self.k = nn.Linear(n_embd, n_embd)
        self.v = nn.Linear(n_embd, n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        B, T, _ = x.shape
        # -1 for the head size: the width comes from the projections, the head count from n_head
        q, k, v = (lin(x).view(B, T, self.n_head, -1).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + position embeddings, a stack of blocks, a final norm and a linear head."""

    def __init__(
        self,
        vocab_size: int = 128,
        block_size: int = 64,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 64,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        problems = argument_problems(
            vocab_size=vocab_size,
            block_size=block_size,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            dropout=dropout,
        )
        if problems:
            raise ValueError("GPT: " + "; ".join(problems))
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: Tensor) -> Tensor:
        T = idx.shape[1]
        if T > self.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.block_size}")
        mask = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


class CharGPT(LightningModule):
    """``GPT`` trained on next-character prediction; logs ``train_loss`` and ``val_loss``."""

    def __init__(
        self,
        vocab_size: int = 128,
        block_size: int = 64,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 64,
        dropout: float = 0.0,
        lr: float = 3e-3,
        optimizer: str = "adamw",
        weight_decay: float = 0.0,
        momentum: float = 0.0,
    ) -> None:
        super().__init__()
        problems = argument_problems(lr=lr, optimizer=optimizer, weight_decay=weight_decay, momentum=momentum)
        if problems:
            raise ValueError("CharGPT: " + "; ".join(problems))
        self.save_hyperparameters()
        self.model = GPT(vocab_size, block_size, n_layer, n_head, n_embd, dropout)

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        h = self.hparams
        if h.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=h.lr, momentum=h.get("momentum", 0.0))
        if h.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=h.lr, weight_decay=h.weight_decay)
        raise ValueError(f"optimizer={h.optimizer!r} is not supported; use one of {', '.join(OPTIMIZERS)}.")

    @staticmethod
    def initial_loss(vocab_size: int = 128) -> float:
        """Cross-entropy of a uniform guess: where an untrained model starts."""
        return math.log(vocab_size)
