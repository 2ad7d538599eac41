"""Megatron-style tensor-parallel layers on ``torch.distributed`` collectives (no DTensor).

Each layer keeps only its rank's slice of the weights (parameters are split, not just compute) under
the same parameter names as the layer it replaces, so a module's ``state_dict`` keys do not change.
``SHARDS`` on each layer says how every local tensor was cut from the full one; ``full_tensor`` and
``shard_tensor`` turn one into the other (checkpoints store full tensors).

    ColumnParallelLinear      weight [out/tp, in]: output features split (per packed chunk for a fused
                              q|k|v, or per block of unequal widths: ``parts``, where a block of fewer
                              heads than ranks is held whole by the ranks that read it); output sharded or
                              gathered. Also for Conv1D (weight [in, out/tp])
    RowParallelLinear         weight [out, in/tp]: input features split, partial outputs all-reduced
    VocabParallelEmbedding    weight [V/tp, D]: rows split by token id, other ids masked, all-reduced
    ParallelMultiheadAttention  ``nn.MultiheadAttention`` with heads split: q/k/v column-, out row-parallel
    FeatureShards             per-feature tensors (a BatchNorm's weight, bias and running statistics)
                              between a column- and a row-parallel layer, sliced in place with the features

A column-parallel layer starts with the "f" operator (identity forward, all-reduce backward). Layers
fed the same tensor (q, k and v) share one ``SharedEntry``, so their input gradient is all-reduced
once, as in Megatron (2 all-reduces forward and 2 backward per transformer block). Under sequence
parallelism (``tensor.sequence``) the entry is an all-gather of the sequence (or nothing, where the pair's
module gathered it already) and a row-parallel layer reduce-scatters along the sequence.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_parallel.checkpointing.one_device import SKELETON
from lightning_parallel.distributed.collectives import (
    copy_to_group,
    gather_from_group,
    gather_sequence,
    reduce_from_group,
    reduce_scatter_sequence,
    split_to_group,
)

__all__ = [
    "ShardSpec",
    "SharedEntry",
    "check_parts",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "ParallelMultiheadAttention",
    "shard_tensor",
    "shard_slice",
    "full_tensor",
    "TP_LAYERS",
    "Conv1DType",
    "FeatureShards",
    "FEATURE_SHARDS",
    "shard_features",
]


@dataclass(frozen=True)
class ShardSpec:
    """A local tensor is slice ``rank`` of ``dim`` of the full one; with ``chunks`` > 1 the full tensor is
    ``chunks`` packed blocks along ``dim`` (q, k, v of ``in_proj_weight``) and each block is sliced.

    ``parts`` (full width, copies) describes packed blocks of unequal widths instead (a fused q|k|v with
    fewer key-value heads than query heads): each block is cut into ``tp // copies`` slices and rank r
    holds slice ``r // copies``, so a block with fewer heads than ranks (``copies`` > 1) is replicated
    over the ranks whose query heads read it, as Megatron does with key-value heads."""

    dim: int
    chunks: int = 1
    parts: tuple[tuple[int, int], ...] = ()

    def blocks(self, full: int, tp_size: int) -> list[tuple[int, int]]:
        """(full width, copies) of each packed block of a dimension ``full`` long."""
        return list(self.parts) if self.parts else [(full // self.chunks, 1)] * self.chunks

    def replicated(self) -> bool:
        """Some block is held whole by more than one rank (its gradient is summed over them)."""
        return any(copies > 1 for _, copies in self.parts)

    def full_size(self, local: int, tp_size: int) -> int:
        return sum(w for w, _ in self.parts) if self.parts else local * tp_size


def _local_widths(spec: ShardSpec, full: int, tp_size: int) -> list[int]:
    return [w * copies // tp_size for w, copies in spec.blocks(full, tp_size)]


def shard_slice(full: Tensor, spec: ShardSpec, tp_size: int, tp_rank: int) -> Tensor:
    """This rank's slice of ``full``: a view of it when the tensor is one block, else a new tensor."""
    blocks = full.split([w for w, _ in spec.blocks(full.shape[spec.dim], tp_size)], dim=spec.dim)
    copies = [c for _, c in spec.blocks(full.shape[spec.dim], tp_size)]
    parts = [b.chunk(tp_size // c, dim=spec.dim)[tp_rank // c] for b, c in zip(blocks, copies)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=spec.dim)


def shard_tensor(full: Tensor, spec: ShardSpec, tp_size: int, tp_rank: int) -> Tensor:
    """This rank's slice of ``full``, in memory of its own."""
    part = shard_slice(full, spec, tp_size, tp_rank)
    return part.clone() if spec.chunks == 1 and len(spec.parts) <= 1 else part


def full_tensor(parts: list[Tensor], spec: ShardSpec) -> Tensor:
    """Reassemble the full tensor from every rank's slice (in rank order); a block held by several ranks
    is taken from the first of them."""
    tp = len(parts)
    blocks = spec.blocks(spec.full_size(parts[0].shape[spec.dim], tp), tp)
    widths = _local_widths(spec, spec.full_size(parts[0].shape[spec.dim], tp), tp)
    per_rank = [p.split(widths, dim=spec.dim) for p in parts]
    return torch.cat(
        [per_rank[r][b] for b, (_, copies) in enumerate(blocks) for r in range(0, tp, copies)], dim=spec.dim
    )


class SharedEntry:
    """The "f" operator for a sharded region, shared by layers that read the same input tensor.

    Remembers the last input (by identity, with the grad mode) and returns the same output for it, so
    the gradients of all consumers are summed by autograd first and all-reduced once. Sequence parallel
    sets ``sequence_dim``: the entry then all-gathers that dimension (reduce-scatter backward), or passes
    the input through when ``gathered`` (the pair's module gathered it on entry; nothing is remembered
    then, since holding the gathered input would keep the whole sequence alive through backward, where
    only this rank's part is saved). Under ``torch.compile`` nothing is remembered (Python state set inside a
    graph, and inside a checkpointed region of one, is not allowed): each consumer enters on its own, and
    backward all-reduces (or reduce-scatters) each consumer's gradient, one collective per consumer."""

    def __init__(self, group: Optional[dist.ProcessGroup]) -> None:
        self.group = group
        self.sequence_dim: Optional[int] = None
        self.gathered = False
        self.clear()

    def __call__(self, x: Tensor) -> Tensor:
        if self.gathered:
            return x
        if torch.compiler.is_compiling():  # nothing remembered in a graph (docstring)
            return self._enter(x)
        grad_mode = torch.is_grad_enabled()
        if self._x is x and self._grad_mode == grad_mode:
            return self._y
        y = self._enter(x)
        self._x, self._y, self._grad_mode = x, y, grad_mode
        return y

    def _enter(self, x: Tensor) -> Tensor:
        if self.sequence_dim is None:
            return copy_to_group(x, self.group)
        return gather_sequence(x, self.group, self.sequence_dim)

    def clear(self) -> None:
        self._x: Optional[Tensor] = None
        self._y: Optional[Tensor] = None
        self._grad_mode = False

    def __reduce__(self) -> Any:
        """Pickled without its process group, as the layers are (``_TPLayer.__reduce_ex__``): the forward
        hook that releases it is pickled with the network it is registered on."""
        return (SharedEntry, (None,))

    def __deepcopy__(self, memo: dict) -> "SharedEntry":
        """A copy sharing the process group (as a deep-copied layer does), with nothing remembered."""
        new = SharedEntry(self.group)
        new.sequence_dim, new.gathered = self.sequence_dim, self.gathered
        memo[id(self)] = new
        return new

    def release(self, *hook_args: Any) -> None:
        """A forward hook on the module whose children share this entry (``apply_plan``): once its forward
        has returned, no consumer of this input is left, so the entry lets it go instead of keeping it
        alive through backward (under mixed precision the consumers save their low-precision casts, not
        this full-precision input: one input per shared region held for nothing)."""
        self.clear()


def check_parts(parts: tuple[tuple[int, int], ...], out_features: int, tp_size: int) -> None:
    """Blocks (full width, copies) that cover ``out_features`` and each cut into ``tp_size // copies``."""
    if sum(w for w, _ in parts) != out_features:
        raise ValueError(f"parts {list(parts)} cover {sum(w for w, _ in parts)} features, not {out_features}")
    for w, copies in parts:
        if copies < 1 or tp_size % copies or w % (tp_size // copies):
            raise ValueError(
                f"part of width {w} held by {copies} ranks each does not split over tensor-parallel size "
                f"{tp_size}: copies must divide {tp_size} and the width be divisible by {tp_size} // copies"
            )


def _check_divisible(what: str, size: int, tp_size: int) -> None:
    if size % tp_size:
        raise ValueError(f"{what}={size} is not divisible by the tensor-parallel size {tp_size}")


def _new_param(full: Tensor, spec: ShardSpec, tp_size: int, tp_rank: int) -> nn.Parameter:
    return nn.Parameter(shard_tensor(full.detach(), spec, tp_size, tp_rank), requires_grad=full.requires_grad)


def _unpickled(layer: nn.Module) -> nn.Module:
    return layer


class _TPLayer(nn.Module):
    SHARDS: dict[str, ShardSpec] = {}

    def _init_tp(self, group: Optional[dist.ProcessGroup], tp_size: int, tp_rank: int) -> None:
        self.group, self.tp_size, self.tp_rank = group, tp_size, tp_rank

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled as the layer it replaced, whole and empty (``unsharded``, set by ``apply_plan``): a
        network held in the hyperparameters stays picklable (Lightning drops what is not), with no
        process group; a checkpoint's copy is rebuilt with the full values (``full_state``)."""
        skeleton = self.__dict__.get(SKELETON)
        return super().__reduce_ex__(protocol) if skeleton is None else (_unpickled, (skeleton,))

    def __deepcopy__(self, memo: dict) -> "_TPLayer":
        """A true copy (not the pickled skeleton) that shares the process group."""
        memo.setdefault(id(self.group), self.group)
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new


def _linear_shape(layer: nn.Module) -> tuple[int, int, bool]:
    """(in_features, out_features, transposed) of an ``nn.Linear`` or a Hugging Face ``Conv1D`` (weight
    stored ``[in, out]``)."""
    if isinstance(layer, nn.Linear):
        return layer.in_features, layer.out_features, False
    in_features, out_features = layer.weight.shape
    return in_features, out_features, True


def out_width(weight: Tensor, transposed: bool) -> int:
    return weight.shape[1 if transposed else 0]


def _project(x: Tensor, weight: Tensor, bias: Optional[Tensor], transposed: bool) -> Tensor:
    return F.linear(x, weight.t() if transposed else weight, bias)


class ColumnParallelLinear(_TPLayer):
    """``nn.Linear`` (or ``Conv1D``) with its output features split over the group. With ``chunks`` > 1
    the output is that many packed blocks (a fused q|k|v) and each block is split, so every rank holds
    its share of q, of k and of v; ``parts`` gives blocks of unequal widths, each with the number of
    ranks that hold each of its slices (``ShardSpec``: key-value heads fewer than the ranks)."""

    def __init__(
        self,
        linear: nn.Module,
        group: Optional[dist.ProcessGroup],
        tp_size: int,
        tp_rank: int,
        gather_output: bool = False,
        chunks: int = 1,
        entry: Optional[SharedEntry] = None,
        parts: tuple[tuple[int, int], ...] = (),
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.transposed = _linear_shape(linear)
        parts = tuple((int(w), int(c)) for w, c in parts)
        if parts:
            check_parts(parts, self.out_features, tp_size)
        else:
            _check_divisible("out_features", self.out_features, tp_size * chunks)
        self._init_tp(group, tp_size, tp_rank)
        self.gather_output, self.chunks, self.parts = gather_output, chunks, parts
        if gather_output and (chunks > 1 or parts):
            raise ValueError(
                "gather_output=True needs chunks=1 and no parts (packed blocks would be gathered out of order)"
            )
        self.SHARDS = {
            "weight": ShardSpec(1 if self.transposed else 0, chunks, parts),
            "bias": ShardSpec(0, chunks, parts),
        }
        self.entry = entry or SharedEntry(group)
        self.weight = _new_param(linear.weight, self.SHARDS["weight"], tp_size, tp_rank)
        self.bias = (
            None if linear.bias is None else _new_param(linear.bias, self.SHARDS["bias"], tp_size, tp_rank)
        )

    def forward(self, x: Tensor) -> Tensor:
        y = _project(self.entry(x), self.weight, self.bias, self.transposed)
        return gather_from_group(y, self.group, -1) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(local {out_width(self.weight, self.transposed)}), gather_output={self.gather_output}, "
            f"chunks={self.chunks}" + (f", parts={list(self.parts)}" if self.parts else "")
        )


class RowParallelLinear(_TPLayer):
    """``nn.Linear`` (or ``Conv1D``) with its input features split; partial outputs are summed over the
    group."""

    def __init__(
        self,
        linear: nn.Module,
        group: Optional[dist.ProcessGroup],
        tp_size: int,
        tp_rank: int,
        input_is_parallel: bool = True,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.transposed = _linear_shape(linear)
        _check_divisible("in_features", self.in_features, tp_size)
        self._init_tp(group, tp_size, tp_rank)
        self.input_is_parallel = input_is_parallel
        self.sequence_dim: Optional[int] = None  # sequence parallel: reduce-scatter along it, not all-reduce
        self.SHARDS = {"weight": ShardSpec(0 if self.transposed else 1)}
        self.weight = _new_param(linear.weight, self.SHARDS["weight"], tp_size, tp_rank)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            x = split_to_group(x, self.group, -1)
        y = _project(x, self.weight, None, self.transposed)
        if self.sequence_dim is None:
            y = reduce_from_group(y, self.group)
        else:
            y = reduce_scatter_sequence(y, self.group, self.sequence_dim)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local {self.in_features // self.tp_size}), "
            f"out_features={self.out_features}, input_is_parallel={self.input_is_parallel}"
        )


class VocabParallelEmbedding(_TPLayer):
    """``nn.Embedding`` with rows split by token id; ids outside this rank's range give zeros, and the
    all-reduce of the partial lookups gives every rank the full embedding."""

    SHARDS = {"weight": ShardSpec(0)}

    def __init__(
        self, embedding: nn.Embedding, group: Optional[dist.ProcessGroup], tp_size: int, tp_rank: int
    ) -> None:
        super().__init__()
        _check_divisible("num_embeddings", embedding.num_embeddings, tp_size)
        self._init_tp(group, tp_size, tp_rank)
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        per_rank = embedding.num_embeddings // tp_size
        self.start, self.end = tp_rank * per_rank, (tp_rank + 1) * per_rank
        pad = embedding.padding_idx
        self.local_padding_idx = (
            pad - self.start if pad is not None and self.start <= pad < self.end else None
        )
        self.weight = _new_param(embedding.weight, self.SHARDS["weight"], tp_size, tp_rank)

    def forward(self, ids: Tensor) -> Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self.local_padding_idx).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_group(out, self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, local rows [{self.start}, {self.end})"


class ParallelMultiheadAttention(_TPLayer):
    """``nn.MultiheadAttention`` with its heads split over the group (q/k/v column-, out row-parallel).

    Keeps the call signature, ``batch_first`` and the parameter names of the original, so that
    ``nn.TransformerEncoderLayer`` and ``nn.Transformer`` work unchanged. ``_qkv_same_embed_dim`` is
    False on purpose: it keeps their fused inference fast path (which would read the local weights as
    if they were full) switched off. Attention weights are not returned (``None``)."""

    SHARDS = {"in_proj_weight": ShardSpec(0, chunks=3), "in_proj_bias": ShardSpec(0, chunks=3)}

    def __init__(
        self,
        mha: nn.MultiheadAttention,
        group: Optional[dist.ProcessGroup],
        tp_size: int,
        tp_rank: int,
        entry: Optional[SharedEntry] = None,
    ) -> None:
        super().__init__()
        _check_divisible("num_heads", mha.num_heads, tp_size)
        if not mha._qkv_same_embed_dim or mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError(
                "ParallelMultiheadAttention supports kdim == vdim == embed_dim, no add_bias_kv and no "
                "add_zero_attn"
            )
        self._init_tp(group, tp_size, tp_rank)
        self.embed_dim, self.batch_first, self.dropout = mha.embed_dim, mha.batch_first, mha.dropout
        self.full_num_heads = mha.num_heads
        self.num_heads = mha.num_heads // tp_size
        self.head_dim = mha.head_dim
        self._qkv_same_embed_dim = False  # see the class docstring
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False
        self.entry = entry or SharedEntry(group)
        self.in_proj_weight = _new_param(mha.in_proj_weight, self.SHARDS["in_proj_weight"], tp_size, tp_rank)
        self.in_proj_bias = (
            None
            if mha.in_proj_bias is None
            else _new_param(mha.in_proj_bias, self.SHARDS["in_proj_bias"], tp_size, tp_rank)
        )
        self.out_proj = RowParallelLinear(mha.out_proj, group, tp_size, tp_rank)

    def _mask(
        self, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], batch: int, dtype: torch.dtype
    ) -> Optional[Tensor]:
        """One additive mask broadcastable to (batch, local heads, target, source)."""

        def additive(m: Tensor) -> Tensor:
            if m.dtype == torch.bool:
                return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m, float("-inf"))
            return m.to(dtype)

        mask = None
        if attn_mask is not None:
            mask = additive(attn_mask)
            if mask.dim() == 3:  # (batch * heads, T, S): keep this rank's heads
                h0 = self.tp_rank * self.num_heads
                mask = mask.view(batch, self.full_num_heads, *mask.shape[1:])[:, h0 : h0 + self.num_heads]
        if key_padding_mask is not None:
            kpm = additive(key_padding_mask).view(batch, 1, 1, -1)
            mask = kpm if mask is None else mask + kpm
        return mask

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, None]:
        key_is_query, value_is_key = key is query, value is key
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        B, T, _ = query.shape
        q_in = self.entry(query)
        if key_is_query and value_is_key:  # self-attention: one matmul for q, k and v
            q, k, v = F.linear(q_in, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        else:
            w = self.in_proj_weight.chunk(3)
            b = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None,) * 3
            k_in = q_in if key_is_query else copy_to_group(key, self.group)
            v_in = k_in if value_is_key else copy_to_group(value, self.group)
            q, k, v = (F.linear(t, wi, bi) for t, wi, bi in zip((q_in, k_in, v_in), w, b))
        q, k, v = (t.view(B, -1, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if unbatched and key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
        mask = self._mask(attn_mask, key_padding_mask, B, q.dtype)
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal and mask is None,
        )
        y = self.out_proj(y.transpose(1, 2).reshape(B, T, -1))
        if unbatched:
            y = y.squeeze(0)
        elif not self.batch_first:
            y = y.transpose(0, 1)
        return y, None

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.full_num_heads} (local {self.num_heads})"


class _Conv1DMeta(type):
    """``isinstance(m, Conv1DType)`` is True for Hugging Face's ``Conv1D`` (without importing it)."""

    def __instancecheck__(cls, instance: object) -> bool:
        return type(instance).__name__ == "Conv1D" and hasattr(instance, "nf")


# Stands for ``transformers.pytorch_utils.Conv1D`` in type checks (and is named so in messages).
Conv1DType = _Conv1DMeta("Conv1D", (), {})


# plan style -> (layer class, the module types it replaces)
TP_LAYERS: dict[str, tuple[type, tuple[type, ...]]] = {
    "colwise": (ColumnParallelLinear, (nn.Linear, Conv1DType)),
    "rowwise": (RowParallelLinear, (nn.Linear, Conv1DType)),
    "vocab": (VocabParallelEmbedding, (nn.Embedding,)),
    "attention": (ParallelMultiheadAttention, (nn.MultiheadAttention,)),
}


@dataclass
class FeatureShards:
    """The per-feature tensors of a module tree that were sliced in place along the features of a
    column-parallel output (tensor name -> how it was cut), kept on the root module as ``FEATURE_SHARDS``.

    A per-feature layer (BatchNorm, a per-feature scale) inside a column -> row pair computes each feature
    from that feature alone, so each rank runs the unchanged module on its own features' slice of the
    weight, bias and running statistics: exact, with no communication. The modules stay the user's own
    objects (a ``SyncBatchNorm`` conversion keeps the tensors), which is why the record lives on the root
    and names the tensors."""

    tp_size: int
    tp_rank: int
    specs: dict[str, ShardSpec]


FEATURE_SHARDS = "_tp_feature_shards"


def shard_features(module: nn.Module, specs: dict[str, ShardSpec], tp_size: int, tp_rank: int) -> None:
    """Replace each named parameter or buffer of ``module`` by this rank's slice, and record it."""
    for name, spec in specs.items():
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        full = getattr(owner, attr)
        local = shard_tensor(full.detach(), spec, tp_size, tp_rank)
        if attr in owner._parameters:
            setattr(owner, attr, nn.Parameter(local, requires_grad=full.requires_grad))
        else:
            owner._buffers[attr] = local
    if specs:
        setattr(module, FEATURE_SHARDS, FeatureShards(tp_size, tp_rank, dict(specs)))
