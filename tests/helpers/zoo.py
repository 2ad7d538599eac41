"""The model zoo: tiny configs of the model families users bring, as they would wrap them.

Each is an ordinary LightningModule around a model built with the family's own code (``from_config``
for Hugging Face, never a download): next-token prediction on ``tests.helpers.tp_models:TokenData``
(vocabulary 32, 8 tokens). Nothing here knows about lightning_parallel.

    hf_gpt2         transformers GPT2LMHeadModel: Conv1D layers, fused c_attn, tied wte / lm_head
    hf_llama        transformers LlamaForCausalLM: grouped-query attention (4 / 2 heads), SwiGLU, RoPE
    hf_bert         transformers BertForMaskedLM: an encoder; q/k/v named query/key/value, the MLP split
                    over two submodules (intermediate.dense, output.dense), tied decoder
    torch_encoder   nn.TransformerEncoder (its forward reads layers[0].self_attn) with a causal mask
    lightning_demo  lightning.pytorch.demos.Transformer: a whole nn.Transformer (two stacks)
    inline_mlp      a GPT whose block computes its MLP inline: down(silu(gate(x)) * up(x)), no submodule
    nanogpt         nanoGPT's GPT: head sizes computed from the input's width (C // n_head, view(B, T, C)),
                    so its attention cannot be split without changing the code; lm_head tied to wte
    litgpt          litgpt's GPT (the Lightning ecosystem's model library): fused q|k|v split by sizes
                    computed in forward from ``config.n_head``/``config.n_query_groups``, a config object
                    shared by every layer
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.util import find_spec

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.nn import functional as F

from tests.helpers.pp_models import AsyncRule
from tests.helpers.zoo_more import MORE, SEQ2SEQ, VISION, build_more

__all__ = ["ARCHITECTURES", "AsyncZooLM", "InlineMLPGPT", "ZooLM", "build", "parameter_count"]

VOCAB, BLOCK = 32, 8


def _hf_gpt2(width: int, layers: int, heads: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=BLOCK,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def _hf_llama(width: int, layers: int, heads: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=BLOCK,
    )
    return LlamaForCausalLM(config)


def _hf_bert(width: int, layers: int, heads: int) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=2 * width,
        max_position_embeddings=BLOCK,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForMaskedLM(config)


def _litgpt(width: int, layers: int, heads: int) -> nn.Module:
    from litgpt.config import Config
    from litgpt.model import GPT

    config = Config(
        n_layer=layers,
        n_embd=width,
        n_head=heads,
        block_size=BLOCK,
        vocab_size=VOCAB,
        padded_vocab_size=VOCAB,
        rotary_percentage=1.0,
    )
    return GPT(config)


class TorchEncoderLM(nn.Module):
    """Embedding, ``nn.TransformerEncoder`` with a causal mask, linear head."""

    def __init__(self, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, width)
        self.pos = nn.Parameter(torch.randn(BLOCK, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.embedding(idx) + self.pos[: idx.shape[1]]
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1], dtype=x.dtype)
        return self.head(self.encoder(x, mask=mask, is_causal=True))


class LightningDemo(nn.Module):
    """``lightning.pytorch.demos.Transformer`` (encoder and decoder stacks), fed the input as the source
    and the target as the decoder's input, as its own ``LightningTransformer`` does."""

    def __init__(self, width: int, layers: int, heads: int) -> None:
        super().__init__()
        from lightning.pytorch.demos import Transformer

        self.model = Transformer(
            vocab_size=VOCAB, ninp=width, nhead=heads, nhid=2 * width, nlayers=layers, dropout=0.0
        )

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx, idx).view(idx.shape[0], idx.shape[1], VOCAB)


class InlineBlock(nn.Module):
    """Pre-norm block with hand-written attention and an MLP computed inline in ``forward``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.n_head, self.n_embd = heads, width
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.out = nn.Linear(width, width, bias=False)
        self.gate = nn.Linear(width, 2 * width, bias=False)
        self.up = nn.Linear(width, 2 * width, bias=False)
        self.down = nn.Linear(2 * width, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(self.n_embd, dim=-1)  # as nanoGPT writes it
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(B, T, -1))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class InlineMLPGPT(nn.Module):
    """A GPT of ``InlineBlock``s with a fused q/k/v projection and a head tied to the embedding."""

    def __init__(self, width: int, layers: int, heads: int, vocab: int = VOCAB, block: int = BLOCK) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(block, width)
        self.blocks = nn.ModuleList(InlineBlock(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: Tensor) -> Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class NanoAttention(nn.Module):
    """nanoGPT's CausalSelfAttention, shape handling verbatim."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.n_head, self.n_embd = heads, width

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class NanoBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = NanoAttention(width, heads)
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(width, 4 * width), "c_proj": nn.Linear(4 * width, width)})

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp["c_proj"](F.gelu(self.mlp["c_fc"](self.ln_2(x))))


class NanoGPT(nn.Module):
    def __init__(self, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, width), nn.Embedding(BLOCK, width)
        self.h = nn.ModuleList(NanoBlock(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # as nanoGPT ties them

    def forward(self, idx: Tensor) -> Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


ARCHITECTURES: dict[str, Callable[[int, int, int], nn.Module]] = {
    "hf_gpt2": _hf_gpt2,
    "hf_llama": _hf_llama,
    "hf_bert": _hf_bert,
    "torch_encoder": TorchEncoderLM,
    "lightning_demo": LightningDemo,
    "inline_mlp": InlineMLPGPT,
    "nanogpt": NanoGPT,
}
# litgpt pins huggingface-hub below what transformers 5 needs: it is installed apart, with --no-deps (the
# README's test command, .ci/run), and its zoo entry (and every test of it) is there only where it is
LITGPT = find_spec("litgpt") is not None
if LITGPT:
    ARCHITECTURES["litgpt"] = _litgpt
# called as ``model(idx)`` though they hold a ``config``: not Hugging Face models
PLAIN = frozenset({"litgpt"})


def build(arch: str, width: int = 16, layers: int = 2, heads: int = 4) -> nn.Module:
    """A zoo model, or one of the further Hugging Face families of ``tests.helpers.zoo_more``."""
    if arch in MORE:
        return build_more(arch, width, layers, heads)
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"unknown zoo architecture {arch!r}; choose from {sorted(ARCHITECTURES) + sorted(MORE)}"
        )
    return ARCHITECTURES[arch](width, layers, heads)


class ZooLM(LightningModule):
    """Next-token prediction with a zoo model; plain SGD by default (an update proportional to the
    gradient shows every difference), or AdamW."""

    def __init__(
        self,
        arch: str = "hf_llama",
        width: int = 16,
        layers: int = 2,
        heads: int = 4,
        lr: float = 0.5,
        optimizer: str = "sgd",
        momentum: float = 0.0,
        router_aux: float = 0.0,
        experts_implementation: str = "",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = build(arch, width, layers, heads)  # as users hold a Hugging Face model: self.model
        if router_aux:  # a mixture of experts' load-balancing loss, weighted by router_aux, in the loss
            self.model.config.output_router_logits = True
        if experts_implementation:  # how a mixture of experts runs its experts (batched_mm, grouped_mm)
            self.model.set_experts_implementation(experts_implementation)

    def forward(self, idx: Tensor) -> Tensor:
        arch = self.hparams.arch
        if arch in SEQ2SEQ:  # the tokens as encoder and decoder input
            return self.model(input_ids=idx, decoder_input_ids=idx).logits
        if arch in VISION:  # the 8 tokens as a 1-channel 4x4 image, the first target token as the class
            pixels = (idx.to(self.dtype) / VOCAB).view(idx.shape[0], 1, 2, 4).repeat_interleave(2, dim=2)
            return self.model(pixel_values=pixels).logits
        if (
            hasattr(self.model, "config") and arch not in PLAIN
        ):  # a Hugging Face model, called the way users call it
            return self.model(input_ids=idx).logits
        return self.model(idx)

    def loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        if self.hparams.get("router_aux"):
            out = self.model(input_ids=x)
            lm = F.cross_entropy(out.logits.flatten(0, 1), y.flatten())
            return lm + self.hparams.router_aux * out.aux_loss
        logits = self(x)
        if self.hparams.arch in VISION:
            return F.cross_entropy(logits, y[:, 0])
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return torch.optim.SGD(
            self.parameters(), lr=self.hparams.lr, momentum=self.hparams.get("momentum", 0.0)
        )


class AsyncZooLM(AsyncRule, ZooLM):
    """A zoo model trained by the async pipeline's rule on one process (``pp_models.AsyncRule``); SGD."""


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
