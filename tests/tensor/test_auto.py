"""plan="auto": what it shards on each kind of model, and what it leaves replicated (and says why)."""

from __future__ import annotations

from torch import nn

from lightning_parallel.tensor import resolve
from lightning_parallel.tensor.auto import auto_plan
from tests.helpers.models import MLP
from tests.helpers.tp_models import EncoderRegressor, SmallGPT


def test_gpt_attention_mlp_and_embeddings():
    resolved = resolve(SmallGPT(), "auto", 2)
    styles = resolved.styles()
    for b in range(2):
        assert [styles[f"model.blocks.{b}.attn.{n}"] for n in ("q", "k", "v", "proj")] == ["colwise"] * 3 + [
            "rowwise"
        ]
        assert (styles[f"model.blocks.{b}.mlp.fc"], styles[f"model.blocks.{b}.mlp.proj"]) == (
            "colwise",
            "rowwise",
        )
    assert styles["model.tok_emb"] == styles["model.pos_emb"] == "vocab"
    assert [(o, a) for o, a, _ in resolved.attributes] == [
        ("model.blocks.0.attn", "n_head"),
        ("model.blocks.1.attn", "n_head"),
    ]
    assert dict(resolved.report) == {"model.head": "no row-parallel partner found (replicated)"}


def test_sequential_pairs_and_leftovers():
    resolved = resolve(MLP(), "auto", 2)
    assert resolved.styles() == {"net.0": "colwise", "net.2": "rowwise"}
    assert [n for n, _ in resolved.report] == ["net.4"]


def test_transformer_encoder_layer():
    styles = resolve(EncoderRegressor(), "auto", 2).styles()
    assert styles == {
        "encoder.self_attn": "attention",
        "encoder.linear1": "colwise",
        "encoder.linear2": "rowwise",
    }


def test_what_cannot_be_split_stays_replicated_and_is_reported():
    resolved = resolve(SmallGPT(vocab_size=33, n_head=2, n_embd=8), "auto", 4)
    report = dict(resolved.report)
    assert "model.tok_emb" not in resolved.styles()
    assert report["model.tok_emb"] == "num_embeddings=33 not divisible by tp=4"
    assert "n_head=2 and q/k/v widths [8] do not split over tp=4" in report["model.blocks.0.attn"]
    assert resolved.styles()["model.blocks.0.mlp.fc"] == "colwise"  # 32 hidden units do split over 4


class Residual(nn.Module):
    """Two Linears whose data flow is not a pair: the second reads the input too."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x) + x)


class Traced(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)

    def forward(self, x):
        return self.down(nn.functional.dropout(self.act(self.up(x)), 0.0))


def test_fx_trace_proves_pairs_and_refuses_non_pairs():
    assert auto_plan(Residual(), 2)[0].layers == []
    plan, _ = auto_plan(Traced(), 2)
    assert {r.pattern: r.style for r in plan.layers} == {"up": "colwise", "down": "rowwise"}
