"""Sharded layers, checked without processes: with no process group the collectives are the identity,
so building both ranks' layers in one process and combining their outputs by hand (concatenate what a
gather would, add what an all-reduce would) must give the unsharded layer's output. The real collectives
are exercised by the multi-process tests in tests/strategies/test_tensor_parallel.py."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from lightning_parallel.tensor.layers import (
    ColumnParallelLinear,
    ParallelMultiheadAttention,
    RowParallelLinear,
    ShardSpec,
    SharedEntry,
    VocabParallelEmbedding,
    full_tensor,
    shard_tensor,
)


@pytest.fixture(autouse=True)
def float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def ranks(make, tp=2):
    return [make(r) for r in range(tp)]


@pytest.mark.parametrize("chunks", [1, 3])
def test_shard_and_full_tensor_round_trip(chunks):
    full = torch.randn(12, 5)
    spec = ShardSpec(0, chunks)
    parts = [shard_tensor(full, spec, 2, r) for r in range(2)]
    assert parts[0].shape == (6, 5)
    assert torch.equal(full_tensor(parts, spec), full)
    if chunks == 3:  # each rank holds its slice of q, of k and of v
        assert torch.equal(parts[1][:2], full[2:4]) and torch.equal(parts[1][2:4], full[6:8])


def test_column_parallel_linear_splits_output_features():
    lin, x = nn.Linear(6, 8), torch.randn(3, 6)
    layers = ranks(lambda r: ColumnParallelLinear(lin, None, 2, r))
    assert layers[0].weight.shape == (4, 6) and layers[0].bias.shape == (4,)
    torch.testing.assert_close(torch.cat([layer(x) for layer in layers], -1), lin(x))


def test_row_parallel_linear_sums_partial_outputs():
    lin, x = nn.Linear(8, 5), torch.randn(3, 8)
    layers = ranks(lambda r: RowParallelLinear(lin, None, 2, r))
    assert layers[0].weight.shape == (5, 4) and layers[0].bias.shape == (5,)
    partial = [layer(xi) - lin.bias for layer, xi in zip(layers, x.chunk(2, -1))]
    torch.testing.assert_close(sum(partial) + lin.bias, lin(x))


def test_vocab_parallel_embedding_masks_foreign_ids():
    emb = nn.Embedding(10, 4, padding_idx=7)
    ids = torch.tensor([[0, 4, 5, 9, 7]])
    layers = ranks(lambda r: VocabParallelEmbedding(emb, None, 2, r))
    assert layers[1].local_padding_idx == 2 and layers[0].local_padding_idx is None
    outs = [layer(ids) for layer in layers]
    assert (outs[0][0, 2:4] == 0).all() and (outs[1][0, :2] == 0).all()
    torch.testing.assert_close(outs[0] + outs[1], emb(ids))


def test_column_then_row_gradients_match():
    fc, proj, x = nn.Linear(4, 8), nn.Linear(8, 4), torch.randn(5, 4)
    cols = ranks(lambda r: ColumnParallelLinear(fc, None, 2, r))
    rows = ranks(lambda r: RowParallelLinear(proj, None, 2, r))
    out = sum(row(torch.tanh(col(x))) for col, row in zip(cols, rows)) - proj.bias
    out.pow(2).sum().backward()
    proj(torch.tanh(fc(x))).pow(2).sum().backward()
    torch.testing.assert_close(torch.cat([c.weight.grad for c in cols]), fc.weight.grad)
    torch.testing.assert_close(torch.cat([r.weight.grad for r in rows], 1), proj.weight.grad)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("mask", ["none", "bool", "float", "padding", "per-head"])
def test_parallel_multihead_attention_matches(batch_first, mask):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 4, batch_first=batch_first)
    B, T = 2, 5
    x = torch.randn(B, T, 8) if batch_first else torch.randn(T, B, 8)
    kw = {}
    if mask == "bool":
        kw["attn_mask"] = torch.ones(T, T, dtype=torch.bool).triu(1)
    elif mask == "float":
        kw["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(T)
    elif mask == "padding":
        kw["key_padding_mask"] = torch.tensor([[False] * T, [False] * (T - 2) + [True] * 2])
    elif mask == "per-head":
        kw["attn_mask"] = torch.randn(B * 4, T, T)
    layers = ranks(lambda r: ParallelMultiheadAttention(mha, None, 2, r))
    assert layers[0].num_heads == 2 and layers[0].in_proj_weight.shape == (12, 8)
    out = sum(layer(x, x, x, need_weights=False, **kw)[0] for layer in layers) - mha.out_proj.bias
    torch.testing.assert_close(out, mha(x, x, x, need_weights=False, **kw)[0])


def test_parallel_multihead_attention_cross_attention_and_unbatched():
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    q, kv = torch.randn(2, 3, 8), torch.randn(2, 6, 8)
    layers = ranks(lambda r: ParallelMultiheadAttention(mha, None, 2, r))
    out = sum(layer(q, kv, kv)[0] for layer in layers) - mha.out_proj.bias
    torch.testing.assert_close(out, mha(q, kv, kv)[0])
    single = q[0]
    out = sum(layer(single, single, single)[0] for layer in layers) - mha.out_proj.bias
    torch.testing.assert_close(out, mha(single, single, single)[0])


def test_transformer_encoder_layer_keeps_off_the_fused_path_in_eval(monkeypatch):
    """The fused inference kernel would read the local weights as full ones: it must not be taken."""
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 4, 8)
    fused = []
    original = torch._transformer_encoder_layer_fwd
    monkeypatch.setattr(
        torch, "_transformer_encoder_layer_fwd", lambda *a, **k: fused.append(1) or original(*a, **k)
    )
    with torch.no_grad():
        expected = layer(x)
        assert fused, "the plain layer should take the fused path here (else this test proves nothing)"
        fused.clear()
        layer.self_attn = ParallelMultiheadAttention(layer.self_attn, None, 1, 0)
        torch.testing.assert_close(layer(x), expected)
    assert not fused


def test_shared_entry_reuses_the_operator_for_the_same_input():
    entry, x = SharedEntry(None), torch.randn(3, requires_grad=True)
    assert entry(x) is entry(x)
    with torch.no_grad():
        assert entry(x) is not None
    entry.clear()
    assert entry._x is None


def test_an_entry_inside_a_sequence_parallel_region_keeps_no_input_alive() -> None:
    """The region gathered the whole sequence; the entry passes it through and does not hold it (only the
    part is saved for backward)."""
    entry = SharedEntry(None)
    entry.sequence_dim, entry.gathered = 1, True
    gathered = torch.randn(2, 8, 4, requires_grad=True)
    assert entry(gathered) is gathered
    seen = weakref.ref(gathered)
    del gathered
    gc.collect()
    assert seen() is None


def test_blocks_of_unequal_widths_are_cut_per_block_and_held_by_their_copies():
    """A fused q|k|v of 4 query heads and one key-value head (head size 2) at tp=4: each rank holds one
    query head and the whole k and v, which the full tensor takes from the first of their holders."""
    full = torch.randn(12, 3)
    spec = ShardSpec(0, parts=((8, 1), (2, 4), (2, 4)))
    parts = [shard_tensor(full, spec, 4, r) for r in range(4)]
    for r, part in enumerate(parts):
        assert torch.equal(part, torch.cat([full[2 * r : 2 * r + 2], full[8:12]]))
    assert torch.equal(full_tensor(parts, spec), full)
    two_kv = ShardSpec(0, parts=((8, 2),))  # 2 key-value heads of 4 at tp=4: ranks 0, 1 hold the first
    assert [
        torch.equal(shard_tensor(full[:8], two_kv, 4, r), full[4 * (r // 2) : 4 * (r // 2) + 4])
        for r in range(4)
    ] == [True] * 4
    with pytest.raises(ValueError, match="copies must divide 4"):
        ColumnParallelLinear(nn.Linear(3, 12), None, 4, 0, parts=((8, 1), (2, 3), (2, 4)))
