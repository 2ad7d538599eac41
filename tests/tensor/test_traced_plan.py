"""plan="auto" from a trace of one forward on fake tensors (one process): what it finds on the zoo, and the
checks around it. The multi-process equality with one device is in tests/strategies/test_tensor_parallel_zoo.py."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from lightning_parallel.tensor import PlanError, resolve
from lightning_parallel.tensor.coverage import check_coverage, sharded_share
from lightning_parallel.tensor.shard_flow import Escape, _regroup, entry_layout
from lightning_parallel.tensor.table import format_table
from lightning_parallel.tensor.trace import Node
from tests.helpers.models import MLP
from tests.helpers.zoo import LITGPT, ZooLM


def traced(arch: str, tp: int = 2):
    module = ZooLM(arch=arch).double()
    x, y = torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))
    run = lambda: F.cross_entropy(module(x).flatten(0, 1), y.flatten())  # noqa: E731
    return module, resolve(module, "auto", tp, run=run)


def test_gpt2_fused_qkv_conv1d_and_tied_head():
    _, plan = traced("hf_gpt2")
    styles = plan.styles()
    h = "model.transformer.h.0"
    assert styles[f"{h}.attn.c_attn"] == "colwise" and styles[f"{h}.attn.c_proj"] == "rowwise"
    assert styles[f"{h}.mlp.c_fc"] == "colwise" and styles[f"{h}.mlp.c_proj"] == "rowwise"
    assert next(a for a in plan.assignments if a.name == f"{h}.attn.c_attn").options["chunks"] == 3
    assert (f"{h}.attn", "split_size", 16) in plan.attributes
    assert styles["model.transformer.wte"] == "vocab" and styles["model.lm_head"] == "colwise"


def test_llama_gqa_and_swiglu_need_no_attribute():
    module, plan = traced("hf_llama")
    styles = plan.styles()
    layer = "model.model.layers.1"
    assert [styles[f"{layer}.self_attn.{p}_proj"] for p in "qkvo"] == ["colwise"] * 3 + ["rowwise"]
    mlp = [styles[f"{layer}.mlp.{p}_proj"] for p in ("gate", "up", "down")]
    assert mlp == ["colwise", "colwise", "rowwise"]
    assert plan.attributes == [] and plan.report == []
    assert sharded_share(module, plan) > 0.9


def test_inline_mlp_found_inside_the_block_forward():
    _, plan = traced("inline_mlp")
    styles = plan.styles()
    assert [styles[f"model.blocks.0.{n}"] for n in ("gate", "up", "down", "qkv", "out")] == [
        "colwise",
        "colwise",
        "rowwise",
        "colwise",
        "rowwise",
    ]


def test_a_region_that_fails_on_a_rank_is_dropped_with_its_reason():
    """nanoGPT's attention views with C // n_head (C from the unsplit input): the trace cannot see where C
    came from, the one-rank dry run can; the MLPs, embeddings and tied head stay split."""
    _, plan = traced("nanogpt")
    styles, reasons = plan.styles(), dict(plan.report)
    assert "model.h.0.attn.c_attn" not in styles and "model.h.1.attn.c_proj" not in styles
    assert "the forward fails on a rank in 'model.h.0.attn'" in reasons["model.h.1.attn.c_attn"]
    assert "is invalid for input of size" in reasons["model.h.0.attn.c_attn"]
    assert styles["model.h.1.mlp.c_fc"] == "colwise" and styles["model.h.1.mlp.c_proj"] == "rowwise"
    assert styles["model.wte"] == "vocab" and styles["model.lm_head"] == "colwise"


def test_each_replicated_layer_has_a_reason():
    _, plan = traced("hf_bert")
    reasons = dict(plan.report)
    assert "native_layer_norm" in reasons["model.cls.predictions.transform.dense"]
    # the decoder's bias is tied to cls.predictions.bias, which BERT's own code never reads: split alike
    assert plan.styles()["model.cls.predictions.decoder"] == "colwise"


def test_a_plan_that_splits_too_little_fails_before_training():
    module = MLP()
    plan = resolve(module, {"net.4": {"style": "rowwise", "input_is_parallel": False}}, 2)
    with pytest.raises(PlanError, match=r"splits only \d+% .*require_sharded=0.9.*require_sharded=0"):
        check_coverage(module, plan, 0.9)
    check_coverage(module, plan, 0.0)


def test_views_regroup_the_sharded_factor():
    node = Node(None, (), {}, [], "attn", layer="view")
    heads = _regroup(entry_layout((2, 8, 16)), (2, 8, 4, 4), node)
    assert heads.sharded_dim == 2 and heads.dims[2] == ((4, True),)
    back = _regroup(heads, (2, 8, 16), node)
    assert back.features_split()
    with pytest.raises(Escape):
        _regroup(entry_layout((2, 8, 16), chunks=1), (2, 8, 3, 5), node)


def test_a_model_declared_plan_is_checked_not_trusted():
    module, plan = traced("hf_llama")
    from lightning_parallel.tensor.declared import declared_styles, disagreements

    declared = declared_styles(module)
    assert declared["model.model.layers.0.self_attn.q_proj"] == "colwise"
    assert declared["model.model.embed_tokens"] == "vocab"
    assert disagreements(module, plan.styles()) == {}  # the data flow finds Llama's own plan
    nano = ZooLM(arch="nanogpt").double()
    nano.model._tp_plan = {"h.*.attn.c_attn": "colwise", "h.*.attn.c_proj": "rowwise"}
    x = torch.randint(0, 32, (4, 8))
    reasons = dict(resolve(nano, "auto", 2, run=lambda: nano(x)).report)
    assert "the model's own plan says 'colwise'" in reasons["model.h.0.attn.c_attn"]
    assert "the forward fails on a rank" in reasons["model.h.0.attn.c_attn"]


def test_a_whole_parameter_used_only_on_split_heads_has_its_gradient_summed():
    """Qwen3 normalizes each head of q and k with one weight: split heads, each rank computes part of the
    weight's gradient; the plan sums it over the ranks (Hugging Face's own plan says the same)."""
    module, plan = traced("qwen3")
    assert plan.styles()["model.model.layers.0.self_attn.q_proj"] == "colwise"
    assert "model.model.layers.0.self_attn.q_norm.weight" in plan.gradient_sums
    assert "model.model.layers.1.self_attn.k_norm.weight" in plan.gradient_sums
    assert not any("q_norm" in name for name, _ in plan.report)  # agrees with the declared plan


def test_a_step_that_cannot_be_traced_falls_back_to_the_structural_rules():
    module = ZooLM(arch="hf_llama").double()

    def run():
        raise RuntimeError("self.optimizers() is not available before fit")

    plan = resolve(module, "auto", 2, run=run)
    assert dict(plan.report)["(whole model)"].startswith("the sample step could not be traced (RuntimeError")
    assert plan.styles()["model.model.embed_tokens"] == "vocab"  # the structural rules still ran


def test_manual_optimization_traces_the_training_step_with_its_optimization_made_inert():
    from lightning.pytorch import Trainer

    from lightning_parallel.tensor.sample import forward_on
    from tests.helpers.manual_zoo import ManualZooLM

    module = ManualZooLM(arch="hf_llama").double()
    module.trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    step = forward_on(module, batch=(ids, ids))
    assert step is not None and step.is_batch
    plan = resolve(module, "auto", 2, run=step)
    assert "(whole model)" not in dict(plan.report), plan.report  # traced, not the structural fallback
    assert plan.styles()["model.model.layers.0.self_attn.q_proj"] == "colwise"
    assert plan.styles()["model.model.layers.0.mlp.down_proj"] == "rowwise"
    step()  # run for real: manual_backward and the optimizer step do nothing while traced
    assert all(torch.equal(p, before[name]) for name, p in module.named_parameters())
    assert all(p.grad is None for p in module.parameters())
    assert "manual_backward" not in module.__dict__ and "optimizers" not in module.__dict__  # restored


@pytest.mark.parametrize("arch", ["hf_gpt2", "hf_bert", "mixtral"])
def test_manual_optimization_traces_the_same_model_as_automatic(arch):
    """The plan of a Hugging Face family's training step under manual optimization is the automatic one's:
    the same styles for every module and the same share split (the trace sees the same model)."""
    from lightning.pytorch import Trainer

    from lightning_parallel.tensor.sample import forward_on
    from tests.helpers.manual_zoo import ManualZooLM

    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    plans = []
    for cls in (ZooLM, ManualZooLM):
        module = cls(arch=arch).double()
        module.trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
        plan = resolve(module, "auto", 2, run=forward_on(module, batch=(ids, ids)))
        plans.append((plan.styles(), round(sharded_share(module, plan), 6)))
    assert plans[1] == plans[0]
    assert plans[0][1] > 0.5  # traced, not the structural fallback


def test_olmo2_norms_over_the_whole_projection_run_on_all_its_features():
    """OLMo-2's q_norm/k_norm take their statistics over the whole q/k projection: they run on all the
    features (tensor.full_width), and the attention splits around them."""
    module, plan = traced("olmo2")
    attn = "model.model.layers.1.self_attn"
    styles = plan.styles()
    assert [styles[f"{attn}.{p}_proj"] for p in "qkvo"] == ["colwise"] * 3 + ["rowwise"]
    assert f"{attn}.q_norm" in plan.full_width and f"{attn}.k_norm" in plan.full_width
    assert f"{attn}.q_norm.weight" not in plan.features and plan.report == []
    assert sharded_share(module, plan) > 0.9
    table = format_table(module, plan)  # whole weight, an all-gather of its width each way
    assert (
        f"{attn}.k_norm  full_width  (full)        8            all-gather 8/tok   all-gather 8/tok" in table
    )


@pytest.mark.skipif(not LITGPT, reason="litgpt is not installed (the README's test command installs it)")
def test_litgpt_sizes_read_from_the_shared_config_are_divided_on_a_copy():
    """litgpt's attention reads n_head and n_query_groups from a Config shared by the model and every
    layer: each sharded attention gets its own copy, the user's object keeps the full values."""
    from lightning_parallel.tensor import apply_plan

    module, plan = traced("litgpt")
    config = module.model.config
    attn = "model.transformer.h.0.attn"
    assert plan.styles()[f"{attn}.qkv"] == "colwise" and plan.styles()[f"{attn}.proj"] == "rowwise"
    assert (attn, "config.n_head", 4) in plan.attributes and (
        attn,
        "config.n_query_groups",
        4,
    ) in plan.attributes
    assert all(block.attn.config is config for block in module.model.transformer.h)  # the dry run undid it
    apply_plan(module, plan, group=None, tp_rank=0, gradient_hooks=False)
    copies = [block.attn.config for block in module.model.transformer.h]
    assert (config.n_head, config.n_query_groups) == (4, 4) and module.model.config is config
    assert all(c is not config and (c.n_head, c.n_query_groups, c.head_size) == (2, 2, 4) for c in copies)


@pytest.mark.parametrize(
    "arch, layer, parts",
    [
        ("phi3", "model.model.layers.0.self_attn.qkv_proj", ((16, 1), (8, 1), (8, 1))),
        ("falcon", "model.transformer.h.0.self_attention.query_key_value", ((16, 1), (4, 2), (4, 2))),
        ("gpt_bigcode", "model.transformer.h.0.attn.c_attn", ((16, 1), (4, 2), (4, 2))),
    ],
)
def test_a_fused_qkv_of_unequal_widths_is_cut_per_block(arch, layer, parts):
    """Phi-3 slices q|k|v (GQA), Falcon views it as heads and indexes its one k and v head, GPT-BigCode
    splits it with sizes: each block's heads split over the ranks, a single key-value head held by both."""
    module, plan = traced(arch)
    found = next(a for a in plan.assignments if a.name == layer)
    assert found.style == "colwise" and found.options["parts"] == parts
    assert not any(".0." in name for name, _ in plan.report)


def test_phi3_head_count_read_from_the_config_is_divided_on_a_copy_of_its_own():
    module, plan = traced("phi3")
    attn = "model.model.layers.0.self_attn"
    assert (attn, "config.num_attention_heads", 4) in plan.attributes
    assert module.get_submodule(attn).config is module.model.config  # the plan changed nothing yet


def test_kv_heads_fewer_than_the_ranks_are_held_by_the_ranks_that_read_them():
    _, plan = traced("hf_llama", tp=4)
    options = {a.name: a.options for a in plan.assignments}
    attn = "model.model.layers.0.self_attn"
    assert options[f"{attn}.k_proj"]["parts"] == ((8, 2),) and options[f"{attn}.v_proj"]["parts"] == ((8, 2),)
    assert not options[f"{attn}.q_proj"].get("parts") and plan.report == []
