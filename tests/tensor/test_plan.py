"""Sharding plans: parsing, pattern matching, and every validation error with its message."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_parallel.module_names import match_pattern
from lightning_parallel.tensor.plan import PlanError, apply_plan, parse_plan, resolve_plan
from tests.helpers.harness import REPO
from tests.helpers.models import MLP
from tests.helpers.tp_models import EncoderRegressor, SmallGPT
from tests.helpers.zoo import LITGPT

GPT_PLAN = REPO / "conf/plan/char_gpt.yaml"


def test_star_matches_exactly_one_segment():
    assert match_pattern("blocks.*.attn.q", "blocks.3.attn.q")
    assert not match_pattern("blocks.*.q", "blocks.0.attn.q")
    assert not match_pattern("blocks.*", "blocks.0.attn")
    assert match_pattern("net.0", "net.0") and not match_pattern("net.0", "net.01")


def test_flat_and_sectioned_plans_parse_alike(tmp_path):
    flat = parse_plan({"a.*.q": "colwise", "a.*.p": {"style": "rowwise"}, "a.*.n_head": "divide"})
    path = tmp_path / "plan.yaml"
    path.write_text(
        "layers:\n  a.*.q: colwise\n  a.*.p: {style: rowwise}\nattributes:\n  a.*.n_head: divide\n"
    )
    sectioned = parse_plan(str(path))
    assert flat == sectioned
    assert [r.style for r in flat.layers] == ["colwise", "rowwise"] and flat.attributes[
        0
    ].pattern == "a.*.n_head"


def test_conf_plans_resolve_on_their_models():
    gpt = resolve_plan(SmallGPT(), GPT_PLAN, 2)
    assert gpt.styles()["model.head"] == "colwise" and len(gpt.attributes) == 2
    mlp = resolve_plan(MLP(), REPO / "conf/plan/mlp.yaml", 2)
    assert mlp.styles() == {"net.0": "colwise", "net.2": "rowwise", "net.4": "rowwise"}


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"net.0": "sideways"}, r"plan entry 'net.0': unknown style 'sideways'; use one of colwise, rowwise"),
        (
            {"net.0": {"style": "colwise", "gather": True}},
            r"option\(s\) \['gather'\] not valid for style 'colwise'; "
            r"allowed: gather_output",
        ),
        ({"net.0": 3}, r"plan entry 'net.0': 3 is not a style"),
        ("/no/such/plan.yaml", r"plan file '/no/such/plan.yaml' does not exist"),
        (["net.0"], r"a plan must be a mapping of module-name patterns to styles, got list"),
    ],
)
def test_malformed_plans_are_rejected(spec, message):
    with pytest.raises(PlanError, match=message):
        parse_plan(spec)


def test_pattern_matching_nothing_lists_the_closest_names():
    with pytest.raises(
        PlanError,
        match=r"plan pattern 'model.blocks.\*.atn.q' matches no module of the model; "
        r"closest module names: .*model.blocks.0.attn.q",
    ):
        resolve_plan(SmallGPT(), {"model.blocks.*.atn.q": "colwise"}, 2)


@pytest.mark.parametrize(
    "module, spec, message",
    [
        (
            SmallGPT(),
            {"model.tok_emb": "colwise"},
            r"style 'colwise' applies to Linear or Conv1D, but 'model.tok_emb' is a Embedding; use 'vocab' for it",
        ),
        (
            SmallGPT(),
            {"model.head": "vocab"},
            r"style 'vocab' applies to Embedding, but 'model.head' is a Linear; use 'colwise or rowwise'",
        ),
        (
            SmallGPT(),
            {"model.blocks.*.ln1": {"style": "colwise", "gather_output": True}},
            r"'model.blocks.0.ln1' is a LayerNorm; use 'replicate'",
        ),
        (
            EncoderRegressor(),
            {"encoder.self_attn": "colwise"},
            r"'encoder.self_attn' is a MultiheadAttention; use 'attention'",
        ),
        (
            EncoderRegressor(),
            {"encoder.linear1": "attention"},
            r"style 'attention' applies to MultiheadAttention",
        ),
    ],
)
def test_style_on_the_wrong_layer_type(module, spec, message):
    with pytest.raises(PlanError, match=message):
        resolve_plan(module, spec, 2)


@pytest.mark.parametrize(
    "module, spec, tp, message",
    [
        (
            MLP(out_dim=5),
            {"net.4": {"style": "colwise", "gather_output": True}},
            2,
            r"'net.4' \(colwise\): out_features=5 is not divisible by the tensor-parallel size 2",
        ),
        (
            MLP(hidden=30),
            {"net.0": "colwise", "net.2": "rowwise"},
            4,
            r"'net.0' \(colwise\): out_features=30 is not divisible by the tensor-parallel size 4",
        ),
        (
            MLP(in_dim=15),
            {"net.0": {"style": "rowwise", "input_is_parallel": False}},
            2,
            r"'net.0' \(rowwise\): in_features=15 is not divisible",
        ),
        (
            SmallGPT(vocab_size=33),
            {"model.tok_emb": "vocab"},
            2,
            r"'model.tok_emb' \(vocab\): num_embeddings=33 is not divisible by the tensor-parallel size 2",
        ),
        (
            EncoderRegressor(nhead=2),
            {"encoder.self_attn": "attention"},
            4,
            r"'encoder.self_attn' \(attention\): num_heads=2 is not divisible by the tensor-parallel size 4",
        ),
    ],
)
def test_sizes_not_divisible(module, spec, tp, message):
    with pytest.raises(PlanError, match=message):
        resolve_plan(module, spec, tp)


def test_head_count_not_divisible():
    plan = {
        "model.blocks.*.attn.q": "colwise",
        "model.blocks.*.attn.k": "colwise",
        "model.blocks.*.attn.v": "colwise",
        "model.blocks.*.attn.proj": "rowwise",
        "model.blocks.*.attn.n_head": "divide",
    }
    with pytest.raises(
        PlanError,
        match=r"head count model.blocks.0.attn.n_head=3 is not divisible by the "
        r"tensor-parallel size 2; use a tensor-parallel size that divides 3",
    ):
        resolve_plan(SmallGPT(n_head=3, n_embd=12), plan, 2)
    with pytest.raises(
        PlanError, match=r"attribute 'n_heads' of 'model.blocks.0.attn' is None; 'divide' needs an integer"
    ):
        resolve_plan(SmallGPT(), {"model.blocks.*.attn.n_heads": "divide"}, 2)


def test_rowwise_fed_by_a_replicated_input():
    with pytest.raises(
        PlanError,
        match=r"rowwise layer 'net.2' would be fed a replicated input: no colwise layer "
        r"\(without gather_output\) feeds it in 'net'.*input_is_parallel: false",
    ):
        resolve_plan(MLP(), {"net.2": "rowwise"}, 2)
    with pytest.raises(
        PlanError, match=r"rowwise layer 'model.blocks.0.attn.proj' would be fed a replicated input"
    ):
        resolve_plan(SmallGPT(), {"model.blocks.*.attn.proj": "rowwise"}, 2)
    # gathering the producer's output makes the consumer's input replicated too
    with pytest.raises(PlanError, match=r"rowwise layer 'net.2' would be fed a replicated input"):
        resolve_plan(MLP(), {"net.0": {"style": "colwise", "gather_output": True}, "net.2": "rowwise"}, 2)
    # splitting the input on purpose is allowed
    resolve_plan(MLP(), {"net.2": {"style": "rowwise", "input_is_parallel": False}}, 2)


def test_sharded_output_without_a_rowwise_consumer():
    with pytest.raises(
        PlanError,
        match=r"colwise layer 'net.4' leaves its output sharded, but no rowwise layer "
        r"consumes it in 'net'.*gather_output: true",
    ):
        resolve_plan(MLP(), {"net.4": "colwise"}, 2)


def test_overlapping_patterns_are_rejected():
    with pytest.raises(
        PlanError, match=r"module 'net.0' is matched by two plan patterns, 'net.0' and 'net.\*'"
    ):
        resolve_plan(MLP(), {"net.0": "replicate", "net.*": "replicate"}, 2)
    with pytest.raises(PlanError, match=r"'encoder.self_attn.out_proj' is inside 'encoder.self_attn'"):
        resolve_plan(
            EncoderRegressor(),
            {
                "encoder.self_attn": "attention",
                "encoder.self_attn.out_proj": {"style": "rowwise", "input_is_parallel": False},
            },
            2,
        )


def test_validation_leaves_the_module_untouched_and_apply_replaces_layers():
    module = SmallGPT()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    resolved = resolve_plan(module, GPT_PLAN, 2)
    assert all(isinstance(m, (nn.Linear, nn.Embedding)) for m in (module.model.head, module.model.tok_emb))
    apply_plan(module, resolved, group=None, tp_rank=1)
    assert module.model.blocks[0].attn.n_head == 2
    assert module.model.blocks[0].attn.q.weight.shape == (8, 16)
    assert set(module.state_dict()) == set(before)  # the same names
    assert (module.model.tok_emb.weight == before["model.tok_emb.weight"][16:]).all()


def test_named_plans_come_from_conf_plan():
    assert {"char_gpt", "mlp"} <= set(
        __import__("lightning_parallel.tensor.plan", fromlist=["x"]).named_plans()
    )
    assert resolve_plan(MLP(), "mlp", 2).styles()["net.4"] == "rowwise"
    with pytest.raises(PlanError, match=r"plan 'mpl' is neither a file nor a named plan; named plans: .*mlp"):
        parse_plan("mpl")


def test_tied_weights_are_sharded_alike_or_not_at_all():
    gpt = SmallGPT()
    gpt.model.head.weight = gpt.model.tok_emb.weight
    with pytest.raises(
        PlanError,
        match=r"'model.tok_emb.weight' is the same tensor as 'model.head.weight' \(tied "
        r"weights\), and the plan does not shard both alike",
    ):
        resolve_plan(gpt, {"model.tok_emb": "vocab"}, 2)
    both = {"model.tok_emb": "vocab", "model.head": {"style": "colwise", "gather_output": True}}
    assert resolve_plan(gpt, both, 2).styles() == {"model.tok_emb": "vocab", "model.head": "colwise"}


def test_hydra_node_parses_like_the_file():
    from omegaconf import OmegaConf

    node = OmegaConf.create({"plan": OmegaConf.load(GPT_PLAN)}).plan
    assert parse_plan(node) == parse_plan(GPT_PLAN)


@pytest.mark.skipif(not LITGPT, reason="litgpt is not installed (the README's test command installs it)")
def test_a_written_plan_divides_sizes_held_in_a_config_object():
    """litgpt's attention reads its head counts from ``self.config``, shared by every layer: a written plan
    names them through it, and applying the plan gives each attention its own copy."""
    from tests.helpers.zoo import ZooLM

    module = ZooLM(arch="litgpt")
    attn = "model.transformer.h.*.attn"
    plan = {
        f"{attn}.qkv": {"style": "colwise", "chunks": 3},
        f"{attn}.proj": "rowwise",
        f"{attn}.config.n_head": "divide",
        f"{attn}.config.n_query_groups": "divide",
    }
    resolved = resolve_plan(module, plan, 2)
    assert ("model.transformer.h.1.attn", "config.n_query_groups", 4) in resolved.attributes
    config = module.model.config
    apply_plan(module, resolved, group=None, tp_rank=1)
    assert config.n_head == 4 and all(b.attn.config.n_head == 2 for b in module.model.transformer.h)
    with pytest.raises(PlanError, match="config.n_heads.* is None; .divide. needs an integer attribute"):
        resolve_plan(ZooLM(arch="litgpt"), {f"{attn}.config.n_heads": "divide"}, 2)


def test_a_written_plan_runs_a_norm_on_all_the_features():
    """OLMo-2's q_norm/k_norm written as ``full_width`` beside their colwise projections; one fed no split
    features is refused, naming it."""
    from tests.helpers.zoo import ZooLM

    attn = "model.model.layers.*.self_attn"
    plan = {f"{attn}.{p}_proj": "colwise" for p in "qkv"}
    plan.update({f"{attn}.o_proj": "rowwise", f"{attn}.q_norm": "full_width", f"{attn}.k_norm": "full_width"})
    resolved = resolve_plan(ZooLM(arch="olmo2"), plan, 2)
    assert sorted(resolved.full_width) == [
        f"model.model.layers.{i}.self_attn.{n}_norm" for i in (0, 1) for n in "kq"
    ]
    lone = {"model.model.layers.0.post_attention_layernorm": "full_width"}
    with pytest.raises(
        PlanError, match="full_width module 'model.model.layers.0.post_attention_layernorm' is fed"
    ):
        resolve_plan(ZooLM(arch="olmo2"), lone, 2)
