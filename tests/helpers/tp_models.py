"""Models and data for the tensor-parallel tests: plain user code that knows nothing about
lightning_parallel (strategies must cope with unmodified modules)."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.models.gpt import Block, CharGPT

__all__ = [
    "TokenData",
    "SmallGPT",
    "ManualAccumulationGPT",
    "TwoBackwardsGPT",
    "ConfiguredGPT",
    "SequenceData",
    "EncoderRegressor",
    "TransformerRegressor",
    "MomentumGPT",
    "DropoutGPT",
    "ManualClipGPT",
]


class TokenData(LightningDataModule):
    """Random token windows for next-token prediction (the same on every process)."""

    def __init__(
        self, batch_size: int = 8, n: int = 128, block_size: int = 8, vocab_size: int = 32, seed: int = 3
    ):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, vocab_size, (n, block_size + 1), generator=g)
        self.dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True, drop_last=True)


class SmallGPT(CharGPT):
    """The package's GPT (own attention with an ``n_head`` attribute), tiny and in float64-friendly sizes."""

    def __init__(
        self,
        vocab_size: int = 32,
        block_size: int = 8,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 16,
        lr: float = 1e-2,
        optimizer: str = "adamw",
        weight_decay: float = 0.0,
        momentum: float = 0.0,
    ) -> None:
        super().__init__(
            vocab_size=vocab_size,
            block_size=block_size,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            lr=lr,
            optimizer=optimizer,
            weight_decay=weight_decay,
            momentum=momentum,
        )


class ManualAccumulationGPT(SmallGPT):
    """``SmallGPT`` under manual optimization, accumulating ``accumulate`` batches per optimizer step as
    Lightning documents it: each batch's loss divided by ``accumulate`` goes through its own
    ``manual_backward``, and every ``accumulate`` batches come ``step()`` and ``zero_grad()``.

    The attention keys have no bias: softmax is unchanged by a shift of a row's scores, so a key bias's
    gradient is zero but for rounding, and Adam turns that rounding into steps of ``lr`` (two summation
    orders of the same gradient then differ by up to ``lr`` in those elements)."""

    def __init__(self, accumulate: int = 2, **kwargs) -> None:
        super().__init__(**kwargs)
        self.accumulate = accumulate
        self.automatic_optimization = False
        for block in self.model.blocks:
            block.attn.k.bias = None

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = self._loss(batch)
        self.manual_backward(loss / self.accumulate)
        if (batch_idx + 1) % self.accumulate == 0:
            optimizer.step()
            optimizer.zero_grad()
        return loss.detach()


class TwoBackwardsGPT(ManualAccumulationGPT):
    """``ManualAccumulationGPT`` with both backwards of a step in one ``training_step``: each half of the batch
    goes through its own forward and ``manual_backward`` (loss halved), then one ``step()``: the second
    forward runs after the first backward."""

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        losses = []
        for half in zip(*(t.chunk(2) for t in batch)):
            loss = self._loss(half)
            self.manual_backward(loss / 2)
            losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        return sum(losses) / 2


class SequenceData(LightningDataModule):
    """Random sequences with a regression target that depends on the whole sequence."""

    def __init__(self, batch_size: int = 8, n: int = 128, seq_len: int = 6, d_model: int = 16, seed: int = 5):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, seq_len, d_model, generator=g, dtype=torch.float64)
        y = torch.tanh(x.sum(1)[:, :2])
        self.dataset = TensorDataset(x, y)
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True, drop_last=True)


class EncoderRegressor(LightningModule):
    """``nn.TransformerEncoderLayer`` (so ``nn.MultiheadAttention``) with a causal mask, then a linear head."""

    def __init__(
        self,
        d_model: int = 16,
        nhead: int = 4,
        dim_feedforward: int = 32,
        out_dim: int = 2,
        lr: float = 0.05,
        batch_first: bool = True,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.TransformerEncoderLayer(
            d_model, nhead, dim_feedforward, dropout=0.0, batch_first=batch_first
        )
        self.head = nn.Linear(d_model, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
        if not self.hparams.batch_first:
            return self.head(self.encoder(x.transpose(0, 1), src_mask=mask).mean(0))
        return self.head(self.encoder(x, src_mask=mask).mean(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class TransformerRegressor(EncoderRegressor):
    """A whole ``nn.Transformer`` (encoder and decoder stacks, so cross-attention too)."""

    def __init__(
        self, d_model: int = 16, nhead: int = 4, dim_feedforward: int = 32, out_dim: int = 2, lr: float = 0.05
    ):
        super().__init__(d_model, nhead, dim_feedforward, out_dim, lr)
        del self.encoder
        self.transformer = nn.Transformer(
            d_model,
            nhead,
            num_encoder_layers=1,
            num_decoder_layers=1,
            dim_feedforward=dim_feedforward,
            dropout=0.0,
            batch_first=True,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tgt = x[:, -2:]
        return self.head(self.transformer(x, tgt).mean(1))


class ConfiguredGPT(SmallGPT):
    """``SmallGPT`` whose network is built in ``configure_model``, as Lightning documents for large models."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        del self.model

    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            from lightning_parallel.models.gpt import GPT

            h = self.hparams
            self.model = GPT(h.vocab_size, h.block_size, h.n_layer, h.n_head, h.n_embd, h.dropout)


class MomentumGPT(SmallGPT):
    """``SmallGPT`` trained by SGD with momentum."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class ResidualDropoutBlock(Block):
    """A GPT block with dropout on both residual branches (after each pair's row-parallel layer)."""

    def __init__(self, n_embd: int, n_head: int, p: float) -> None:
        super().__init__(n_embd, n_head)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x), mask))
        return x + self.drop(self.mlp(self.ln2(x)))


class DropoutGPT(MomentumGPT):
    """``MomentumGPT`` whose blocks drop out on their residual branches (none inside attention)."""

    def __init__(self, residual_dropout: float = 0.1, **kwargs) -> None:
        super().__init__(**kwargs)
        h = self.hparams
        blocks = [ResidualDropoutBlock(h.n_embd, h.n_head, residual_dropout) for _ in range(h.n_layer)]
        self.model.blocks = nn.ModuleList(blocks)
        self.model.blocks.apply(self.model._init_weights)


class ManualClipGPT(SmallGPT):
    """``SmallGPT`` under manual optimization, clipping by the user's own call before each step:
    ``clip="lightning"`` is ``self.clip_gradients(opt, clip_val, "norm")``, ``clip="torch"`` is
    ``torch.nn.utils.clip_grad_norm_(self.parameters(), clip_val)``."""

    def __init__(self, clip: str = "lightning", clip_val: float = 0.05, **kwargs) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.clip, self.clip_val = clip, clip_val
        self.example_input_array = torch.zeros(2, self.hparams.block_size, dtype=torch.long)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = self._loss(batch)
        self.manual_backward(loss)
        if self.clip == "lightning":
            self.clip_gradients(opt, gradient_clip_val=self.clip_val, gradient_clip_algorithm="norm")
        else:
            torch.nn.utils.clip_grad_norm_(self.parameters(), self.clip_val)
        opt.step()
        return loss.detach()
