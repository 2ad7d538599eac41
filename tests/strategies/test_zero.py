"""ZeRO (``zero_stage`` 1, 2 and 3) on real gloo processes: equal to one device in float64 (1e-10) with AdamW and with
SGD with momentum, on the GPT-style model and the Hugging Face Llama-style zoo model, under lp_ddp (2 and 4
processes; stage 3 with and without ``reshard_after_forward``), tensor parallel dp2 x tp2 (also with sequence
parallelism), pipeline dp2 x pp2 (1F1B and GPipe; stage 3 under 1F1B, ZB-H1, interleaved 1F1B and ZBV, and at dp2 x
tp2 x pp2), and expert parallel Mixtral at stage 3 (dp2 x ep2, and dp4 x ep2: the experts sharded over their two
replicas; with pipeline stages at dp2 x ep2 x pp2 and dp4 x ep2 x pp2), and with activation checkpointing; the
async pipeline equals its emulation; clipping, gradient accumulation, bf16-mixed and 16-mixed (a GradScaler) keep
their meaning; the memory report shows 1/dp of the optimizer state (and of the gradients at stage 2, while stage 1
holds the gradient buckets and no more; at stage 3 of the parameters too: of each rank's tensor-parallel share, of
a pipeline stage's own, its experts over their replicas); a checkpoint saved at dp=2 with ZeRO resumes exactly at
dp=1, at dp=4, with ZeRO off and under stage 3 (lp_ddp and dp2 x pp2), and ones saved under stage 3 (lp_ddp, dp2 x
tp2, dp2 x pp2, HSDP) on one device; the full state is read and loaded while sharded (lp_ddp, dp2 x tp2). Stage 3
also on models we did not write (nn.TransformerEncoder, a whole nn.Transformer), under bf16-mixed and 16-mixed, and
with a callback reading the weights in Lightning's hooks while the units are freed (``weight_reader``), and with
one running the model and reading ``state_dict()`` there (``zero3_user_code``: refused at once on rank 0 alone, one
device's values inside ``parameters_gathered()``; lp_ddp, dp2 x tp2, dp2 x pp2). Stage 3 composed under each
axis (dp2 x tp2, dp2 x pp2 under 1F1B and interleaved 1F1B, Mixtral dp2 x ep2 and dp4 x ep2) with full and
selective recompute, ``accumulate_grad_batches=2`` with clipping by norm, manual optimization with two backwards
per step, and ``reshard_after_forward=False`` (where there are no pipeline stages). HSDP
(``data_parallel_shard_size=2`` at dp=4: sharded within pairs of ranks, replicated across the pairs) equals one
device at stages 2 and 3 and holds 1/2 (not 1/4) of the states."""

from __future__ import annotations

import pytest
import torch

from lightning_parallel.distributed.zero3 import KEPT_FOR_BACKWARD
from lightning_parallel.module_names import find_block_stack
from tests.helpers.harness import (
    UNTRUSTED,
    assert_given_back_whole,
    assert_params_close,
    gloo_threads_left,
    max_param_diff,
    run_distributed,
    saved_checkpoint,
)
from tests.helpers.weight_reader import HOOKS, all_nan
from tests.helpers.worker import load_object
from tests.strategies.test_deferred_init import MODELS as DEFERRED_INIT_MODELS
from tests.strategies.test_parallel_3d import layout as layout_3d

DDP = "lightning_parallel:DDPStrategy"
PARALLEL = "lightning_parallel:ParallelStrategy"
OPTIMIZERS = {
    "adamw": {"optimizer": "adamw", "lr": 1e-2},
    "sgdm": {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9},
}
SMALL_BUCKETS = {
    "bucket_cap_mb": 0.004,
    "first_bucket_cap_mb": 0.002,
}  # several buckets; pieces straddle them
MEMORY = "tests.helpers.probes:memory_report"
F64 = {"precision": "64-true"}
MODELS = {
    **DEFERRED_INIT_MODELS,
    "mixtral": ("tests.helpers.zoo:ZooLM", {"arch": "mixtral", "optimizer": "adamw", "lr": 1e-2}),
}


#: the deferred-init models, and models we did not write: nn.TransformerEncoder, and a whole nn.Transformer
#: (lightning.pytorch.demos.Transformer: its decoder's layers are the units, the encoder stays in the root)
ZOO = "tests.helpers.zoo:ZooLM"
MODELS = {**MODELS, "encoder": (ZOO, {"arch": "torch_encoder"}), "demo": (ZOO, {"arch": "lightning_demo"})}
#: the models, and the GPT with 4 blocks (2 stages x 2 chunks per rank under interleaved 1F1B)
ZERO_MODELS = {**MODELS, "gpt4": (MODELS["gpt"][0], {**MODELS["gpt"][1], "n_layer": 4})}
#: manual optimization, two forwards and backwards (each on half the batch) before one step: the GPT (its
#: attention keys without a bias: a reference of its own) and the zoo's, whose reference is the automatic run
TWO_BACKWARDS_ZOO = "tests.helpers.manual_zoo:TwoBackwardsZooLM"
ZERO_MODELS = {
    **ZERO_MODELS,
    "gpt2b": ("tests.helpers.tp_models:TwoBackwardsGPT", ZERO_MODELS["gpt4"][1]),  # blocks freed between uses
    "llama2b": (TWO_BACKWARDS_ZOO, MODELS["llama"][1]),
    "mixtral2b": (TWO_BACKWARDS_ZOO, MODELS["mixtral"][1]),
}
#: the one-device run a model's runs are compared with, where it is another model's (the same updates)
REFERENCE_MODEL = {"llama2b": "llama", "mixtral2b": "mixtral"}


def case(name: str, model: str, optimizer: str, strategy: str, kwargs: dict, dp: int, steps: int = 5, **more):
    """``model`` (built normally from the seed) with ``optimizer``, float64, a checkpoint at the end."""
    target, model_kwargs = ZERO_MODELS[model]
    trainer = {**F64, "max_steps": steps, **more.pop("trainer", {})}
    return {
        "name": name,
        "model": target,
        "model_kwargs": {**model_kwargs, **OPTIMIZERS[optimizer]},
        "data": "tests.helpers.tp_models:TokenData",
        "data_kwargs": {"global_batch_size": 16},
        "dp_size": dp,
        "trainer": trainer,
        "strategy": {"class": strategy, "kwargs": kwargs},
        "save_checkpoint": True,
        **(UNTRUSTED if more.get("ckpt_path") else {}),
        "forward_after_fit": True,
        **more,
    }


def layout(dp: int, tp: int, pp: int, zero: int, schedule: str = "1f1b") -> dict:
    return {**layout_3d(dp, tp, pp, schedule), "zero_stage": zero}


CLIP_ACCUMULATE = {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2}
HSDP_2X2 = {"data_parallel_shard_size": 2}  # at dp=4: two shard groups of 2 ranks, each shard held twice
#: name: (world, model, optimizer, strategy, kwargs, dp, extra)
RUNS = {
    "ddp2-gpt-adamw-z1": (2, "gpt", "adamw", DDP, {"zero_stage": 1, **SMALL_BUCKETS}, 2, {}),
    "ddp2-gpt-sgdm-z2": (2, "gpt", "sgdm", DDP, {"zero_stage": 2, **SMALL_BUCKETS}, 2, {}),
    "ddp2-llama-adamw-z2": (2, "llama", "adamw", DDP, {"zero_stage": 2}, 2, {}),
    "ddp2-llama-sgdm-z1": (2, "llama", "sgdm", DDP, {"zero_stage": 1}, 2, {}),
    "ddp2-gpt-adamw-z2-clip-accumulate": (
        2,
        "gpt",
        "adamw",
        DDP,
        {"zero_stage": 2, **SMALL_BUCKETS},
        2,
        {"trainer": CLIP_ACCUMULATE},
    ),
    "ddp4-gpt-adamw-z2": (4, "gpt", "adamw", DDP, {"zero_stage": 2}, 4, {}),
    "dp2tp2-gpt-adamw-z1": (4, "gpt", "adamw", PARALLEL, layout(2, 2, 1, 1), 2, {}),
    "dp2tp2-llama-sgdm-z2": (4, "llama", "sgdm", PARALLEL, layout(2, 2, 1, 2), 2, {}),
    "dp2tp2-sp-gpt-adamw-z2": (
        4,
        "gpt",
        "adamw",
        PARALLEL,
        {**layout(2, 2, 1, 2), "sequence_parallel": True},
        2,
        {},
    ),
    "dp2pp2-gpt-sgdm-z2": (4, "gpt", "sgdm", PARALLEL, layout(2, 1, 2, 2), 2, {}),
    "dp2pp2-llama-adamw-z1": (4, "llama", "adamw", PARALLEL, layout(2, 1, 2, 1), 2, {}),
    "dp2pp2-gpipe-gpt-adamw-z1": (4, "gpt", "adamw", PARALLEL, layout(2, 1, 2, 1, "gpipe"), 2, {}),
    "ddp2-gpt-adamw-z2-recompute": (
        2,
        "gpt",
        "adamw",
        DDP,
        {"zero_stage": 2, "activation_checkpointing": True},
        2,
        {},
    ),
    "ddp2-gpt-adamw-z3": (2, "gpt", "adamw", DDP, {"zero_stage": 3}, 2, {"save_checkpoint": "split"}),
    "ddp2-gpt-sgdm-z3": (2, "gpt", "sgdm", DDP, {"zero_stage": 3}, 2, {}),
    "ddp2-gpt4-adamw-z3-kept": (
        2,
        "gpt4",
        "adamw",
        DDP,
        {"zero_stage": 3, "reshard_after_forward": False},
        2,
        {},
    ),
    "ddp2-llama-sgdm-z3": (2, "llama", "sgdm", DDP, {"zero_stage": 3}, 2, {}),
    "ddp2-gpt4-adamw-z3-clip-accumulate": (
        2,
        "gpt4",
        "adamw",
        DDP,
        {"zero_stage": 3},
        2,
        {"trainer": CLIP_ACCUMULATE},
    ),
    "ddp2-gpt4-adamw-z3-recompute": (
        2,
        "gpt4",
        "adamw",
        DDP,
        {"zero_stage": 3, "activation_checkpointing": True},
        2,
        {},
    ),
    "ddp4-gpt-adamw-z3": (4, "gpt", "adamw", DDP, {"zero_stage": 3}, 4, {}),
    "ddp2-encoder-sgdm-z3": (2, "encoder", "sgdm", DDP, {"zero_stage": 3}, 2, {}),
    "ddp2-demo-sgdm-z3": (2, "demo", "sgdm", DDP, {"zero_stage": 3}, 2, {}),
    "hsdp2x2-gpt-adamw-z3": (4, "gpt", "adamw", DDP, {"zero_stage": 3, **HSDP_2X2}, 4, {}),
    "hsdp2x2-llama-sgdm-z3": (4, "llama", "sgdm", DDP, {"zero_stage": 3, **HSDP_2X2}, 4, {}),
    "hsdp2x2-gpt-adamw-z2-clip-accumulate": (
        4,
        "gpt",
        "adamw",
        DDP,
        {"zero_stage": 2, **HSDP_2X2, **SMALL_BUCKETS},
        4,
        {"trainer": CLIP_ACCUMULATE},
    ),
    # stage 3 of each rank's tensor-parallel share; the checkpoint saved while sharded (before teardown)
    "dp2tp2-gpt-adamw-z3": (4, "gpt", "adamw", PARALLEL, layout(2, 2, 1, 3), 2, {"save_checkpoint": "split"}),
    "dp2tp2-gpt4-sgdm-z3": (4, "gpt4", "sgdm", PARALLEL, layout(2, 2, 1, 3), 2, {}),
    "dp2tp2-sp-gpt-adamw-z3": (
        4,
        "gpt",
        "adamw",
        PARALLEL,
        {**layout(2, 2, 1, 3), "sequence_parallel": True},
        2,
        {},
    ),
    # the experts placed on each rank held whole where they have one replica (dp2 x ep2), sharded over their
    # two replicas at dp4 x ep2
    "dp2ep2-mixtral-adamw-z3": (
        2,
        "mixtral",
        "adamw",
        PARALLEL,
        {**layout(2, 1, 1, 3), "expert_parallel_size": 2},
        2,
        {"save_checkpoint": "split"},
    ),
    "dp4ep2-mixtral-adamw-z3": (
        4,
        "mixtral",
        "adamw",
        PARALLEL,
        {**layout(4, 1, 1, 3), "expert_parallel_size": 2},
        4,
        {},
    ),
    # under pipeline stages: the experts held whole at dp2 x ep2 x pp2, sharded over their two replicas (a
    # second set of the stage's units) at dp4 x ep2 x pp2
    "dp2ep2pp2-mixtral-adamw-z3": (
        4,
        "mixtral",
        "adamw",
        PARALLEL,
        {**layout(2, 1, 2, 3), "expert_parallel_size": 2},
        2,
        {},
    ),
    "dp4ep2pp2-mixtral-adamw-z3": (
        8,
        "mixtral",
        "adamw",
        PARALLEL,
        {**layout(4, 1, 2, 3), "expert_parallel_size": 2},
        4,
        {},
    ),
    # a pipeline stage's units gathered once per step, kept across its micro-batches
    "dp2pp2-gpt-adamw-z3": (4, "gpt", "adamw", PARALLEL, layout(2, 1, 2, 3), 2, {}),
    "dp2pp2-zbh1-llama-sgdm-z3": (4, "llama", "sgdm", PARALLEL, layout(2, 1, 2, 3, "zb_h1"), 2, {}),
    "dp2pp2-interleaved-gpt4-sgdm-z3": (
        4,
        "gpt4",
        "sgdm",
        PARALLEL,
        layout(2, 1, 2, 3, "interleaved_1f1b"),
        2,
        {},
    ),
    "dp2pp2-zbv-gpt4-adamw-z3": (4, "gpt4", "adamw", PARALLEL, layout(2, 1, 2, 3, "zbv"), 2, {}),
    "dp2tp2pp2-gpt-adamw-z3": (8, "gpt", "adamw", PARALLEL, layout(2, 2, 2, 3), 2, {}),  # tp shards over dp
    # HSDP beside tensor parallelism: each rank's tp slices sharded within pairs of dp ranks, replicated across them
    "hsdp2x2tp2-gpt-adamw-z3": (8, "gpt", "adamw", PARALLEL, {**layout(4, 2, 1, 3), **HSDP_2X2}, 4, {}),
    # stage 3 composed with recompute (a recomputed forward gathers its unit again), accumulation with clipping
    # (each micro-step's gradient reduce-scattered once into the shards, the norm over every shard), manual
    # optimization (two backwards per step) and kept units (reshard_after_forward=False), under each axis
    "dp2tp2-gpt4-adamw-z3-recompute-clip-accumulate": (
        4,
        "gpt4",
        "adamw",
        PARALLEL,
        {**layout(2, 2, 1, 3), "activation_checkpointing": True},
        2,
        {"trainer": CLIP_ACCUMULATE},
    ),
    "dp2tp2-llama-sgdm-z3-selective": (
        4,
        "llama",
        "sgdm",
        PARALLEL,
        {**layout(2, 2, 1, 3), "activation_checkpointing": "selective"},
        2,
        {},
    ),
    "dp2tp2-gpt2b-adamw-z3-manual": (4, "gpt2b", "adamw", PARALLEL, layout(2, 2, 1, 3), 2, {}),
    "dp2tp2-gpt4-sgdm-z3-kept": (
        4,
        "gpt4",
        "sgdm",
        PARALLEL,
        {**layout(2, 2, 1, 3), "reshard_after_forward": False},
        2,
        {},
    ),
    "dp2pp2-gpt-adamw-z3-recompute-clip-accumulate": (
        4,
        "gpt",
        "adamw",
        PARALLEL,
        {**layout(2, 1, 2, 3), "activation_checkpointing": True},
        2,
        {"trainer": CLIP_ACCUMULATE},
    ),
    "dp2pp2-interleaved-gpt4-adamw-z3-selective-clip-accumulate": (
        4,
        "gpt4",
        "adamw",
        PARALLEL,
        {**layout(2, 1, 2, 3, "interleaved_1f1b"), "activation_checkpointing": "selective"},
        2,
        {"trainer": CLIP_ACCUMULATE},
    ),
    "dp2ep2-mixtral-adamw-z3-selective-clip-accumulate": (
        2,
        "mixtral",
        "adamw",
        PARALLEL,
        {**layout(2, 1, 1, 3), "expert_parallel_size": 2, "activation_checkpointing": "selective"},
        2,
        {"trainer": CLIP_ACCUMULATE},
    ),
    "dp2ep2-mixtral2b-adamw-z3-manual": (
        2,
        "mixtral2b",
        "adamw",
        PARALLEL,
        {**layout(2, 1, 1, 3), "expert_parallel_size": 2},
        2,
        {},
    ),
    # the experts sharded over their two replicas too: recomputed, kept, accumulated and clipped
    "dp4ep2-mixtral-adamw-z3-recompute-kept-clip-accumulate": (
        4,
        "mixtral",
        "adamw",
        PARALLEL,
        {
            **layout(4, 1, 1, 3),
            "expert_parallel_size": 2,
            "activation_checkpointing": True,
            "reshard_after_forward": False,
        },
        4,
        {"trainer": CLIP_ACCUMULATE},
    ),
}
#: ZeRO with ``save_distributed``: each rank writes only its own pieces of the optimizer state (and at stage 3
#: of the parameters): name: (world, strategy, kwargs)
SHARDED_SAVES = {
    "dp2tp2-gpt-adamw-z1-sharded": (4, PARALLEL, layout(2, 2, 1, 1)),
    "dp2pp2-gpt-adamw-z2-sharded": (4, PARALLEL, layout(2, 1, 2, 2)),
    "ddp2-gpt-adamw-z3-sharded": (2, DDP, {"zero_stage": 3}),
    # each rank's range of its tensor-parallel slice, of its stage's parameters
    "dp2tp2-gpt-adamw-z3-sharded": (4, PARALLEL, layout(2, 2, 1, 3)),
    "dp2pp2-gpt-adamw-z3-sharded": (4, PARALLEL, layout(2, 1, 2, 3)),
}
REFERENCES = {  # name: (model, optimizer, steps, trainer)
    "gpt-adamw": ("gpt", "adamw", 5, {}),
    "gpt-sgdm": ("gpt", "sgdm", 5, {}),
    "llama-adamw": ("llama", "adamw", 5, {}),
    "llama-sgdm": ("llama", "sgdm", 5, {}),
    "gpt-adamw-clip-accumulate": ("gpt", "adamw", 5, CLIP_ACCUMULATE),
    "gpt-adamw-10": ("gpt", "adamw", 10, {}),
    "encoder-sgdm": ("encoder", "sgdm", 5, {}),
    "demo-sgdm": ("demo", "sgdm", 5, {}),
    "mixtral-adamw": ("mixtral", "adamw", 5, {}),
    "gpt4-sgdm": ("gpt4", "sgdm", 5, {}),
    "gpt4-adamw": ("gpt4", "adamw", 5, {}),
    "gpt4-adamw-clip-accumulate": ("gpt4", "adamw", 5, CLIP_ACCUMULATE),
    "mixtral-adamw-clip-accumulate": ("mixtral", "adamw", 5, CLIP_ACCUMULATE),
    "gpt2b-adamw": ("gpt2b", "adamw", 5, {}),
}
ASYNC = "tests.helpers.pp_models:AsyncRuleGPT"
#: runs with a callback reading the weights in Lightning's hooks (``weight_reader``), validating every 2 steps
READ_WEIGHTS = {"ref-gpt-sgdm", "ddp2-gpt-sgdm-z3"}


#: runs with a callback running the model and reading state_dict() in a hook (``zero3_user_code.UserCode``):
#: name -> where its forward inside parameters_gathered() runs (rank 0 alone; every rank: a tensor-parallel
#: forward is a collective itself; none: a pipeline stage's forward outside the schedule is not the model's)
USER_CODE = {
    "ref-gpt-sgdm": "rank0",
    "ref-gpt-adamw": "rank0",
    "ddp2-gpt-sgdm-z3": "rank0",
    "dp2tp2-gpt-adamw-z3": "every",
    "dp2pp2-gpt-adamw-z3": "none",
}


def running_user_code(c: dict) -> dict:
    """``c`` with ``UserCode`` where ``USER_CODE`` names it (it changes nothing of what trains)."""
    forward = USER_CODE.get(c["name"])
    if forward is None:
        return c
    code = {
        "class": "tests.helpers.zero3_user_code:UserCode",
        "kwargs": {"dirpath": "user_code", "forward": forward},
    }
    return {**c, "callbacks": [*c.get("callbacks", []), code]}


def reading_weights(c: dict) -> dict:
    """``c`` with ``WeightReader`` and a validation loop (validation does not change what trains)."""
    if c["name"] not in READ_WEIGHTS:
        return c
    return {
        **c,
        "data": "tests.helpers.callback_models:ValidatedTokens",
        "callbacks": [{"class": "tests.helpers.weight_reader:WeightReader", "kwargs": {"dirpath": "reads"}}],
        "trainer": {**c["trainer"], "val_check_interval": 2, "limit_val_batches": 1},
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero")
    by_world: dict[int, list[dict]] = {1: [], 2: [], 4: [], 8: []}
    for name, (model, optimizer, steps, trainer) in REFERENCES.items():
        by_world[1].append(case(f"ref-{name}", model, optimizer, DDP, {}, 1, steps, trainer=trainer))
    emulation = case("async-emulation", "gpt", "sgdm", DDP, {}, 1, save_checkpoint=False)
    sgd = {"optimizer": "sgd", "lr": 0.05}  # the async rule's optimizer
    by_world[1].append({**emulation, "model": ASYNC, "strategy": "auto", "model_kwargs": sgd})
    for name, (world, model, optimizer, strategy, kwargs, dp, extra) in RUNS.items():
        by_world[world].append(case(name, model, optimizer, strategy, kwargs, dp, probe=MEMORY, **extra))
    f32 = {"precision": "32-true", "max_steps": 5}
    for precision, extra in {"bf16-mixed": {}, "fp16": {"fp16_cpu": True}}.items():  # fp16: a real GradScaler
        trainer = {**f32, "precision": None if precision == "fp16" else precision}  # fp16: the plugin's
        for zero in (0, 2, 3):
            name = f"ddp2-gpt-adamw-{precision}-z{zero}"
            kwargs = {"zero_stage": zero, **({"param_dtype": "float32"} if zero == 3 else {})}
            by_world[2].append(case(name, "gpt", "adamw", DDP, kwargs, 2, trainer=trainer, **extra))
    round_trip = case(
        "ddp2-z3-round-trip", "gpt", "sgdm", DDP, {"zero_stage": 3}, 2, 1, save_checkpoint=False
    )
    by_world[2].append({**round_trip, "probe": "tests.helpers.probes:full_state_round_trip"})
    tp_round_trip = case(
        "dp2tp2-z3-round-trip", "gpt", "sgdm", PARALLEL, layout(2, 2, 1, 3), 2, 1, save_checkpoint=False
    )
    by_world[4].append({**tp_round_trip, "probe": "tests.helpers.probes:full_state_round_trip"})
    for name, (world, strategy, kwargs) in SHARDED_SAVES.items():  # saved while each rank holds its pieces
        c = case(
            name, "gpt", "adamw", strategy, {**kwargs, "save_distributed": True}, 2, save_checkpoint="split"
        )
        by_world[world].append(c)
    async_run = case("async-dp2pp2-z1", "gpt", "sgdm", PARALLEL, layout(2, 1, 2, 1, "async"), 2)
    by_world[4].append({**async_run, "model_kwargs": sgd})
    results = {}
    for world, cases in by_world.items():
        cases = [running_user_code(reading_weights(c)) for c in cases]
        results.update(
            run_distributed(
                cases, world_size=world, tmp_path=tmp, timeout=600, threads_after_destroy=world > 1
            )
        )
    saved = str(tmp / "dist2" / "ddp2-gpt-adamw-z1" / "last.ckpt")  # ZeRO-1 at dp=2, several buckets
    later = {
        1: [case("resume-dp1-z1", "gpt", "adamw", DDP, {"zero_stage": 1}, 1, 10, ckpt_path=saved)],
        2: [case("resume-dp2-off", "gpt", "adamw", DDP, {}, 2, 10, ckpt_path=saved)],
        4: [case("resume-dp4-z1", "gpt", "adamw", DDP, {"zero_stage": 1}, 4, 10, ckpt_path=saved)],
    }
    saved_z3 = str(tmp / "dist2" / "ddp2-gpt-adamw-z3" / "last.ckpt")  # saved while sharded, at dp=2
    later[1].append(case("resume-dp1-from-z3", "gpt", "adamw", DDP, {}, 1, 10, ckpt_path=saved_z3))
    later[2].append(case("resume-dp2-z3", "gpt", "adamw", DDP, {"zero_stage": 3}, 2, 10, ckpt_path=saved))
    saved_hsdp = str(tmp / "dist4" / "hsdp2x2-gpt-adamw-z3" / "last.ckpt")  # saved while sharded in pairs
    later[1].append(case("resume-dp1-from-hsdp", "gpt", "adamw", DDP, {}, 1, 10, ckpt_path=saved_hsdp))
    saved_tp_z3 = str(tmp / "dist4" / "dp2tp2-gpt-adamw-z3" / "last.ckpt")  # saved sharded over tp and dp
    later[1].append(case("resume-dp1-from-dp2tp2-z3", "gpt", "adamw", DDP, {}, 1, 10, ckpt_path=saved_tp_z3))
    saved_pp_z3 = str(tmp / "dist4" / "dp2pp2-gpt-adamw-z3" / "last.ckpt")  # each stage's units sharded
    later[1].append(case("resume-dp1-from-dp2pp2-z3", "gpt", "adamw", DDP, {}, 1, 10, ckpt_path=saved_pp_z3))
    later[4].append(
        case("resume-dp2pp2-z3", "gpt", "adamw", PARALLEL, layout(2, 1, 2, 3), 2, 10, ckpt_path=saved)
    )
    for name, (world, *_) in SHARDED_SAVES.items():  # read into one device, lp_ddp with ZeRO-2 and ZeRO-3
        directory = str(tmp / f"dist{world}" / name / "last.ckpt")
        later[1].append(case(f"resume-{name}-dp1", "gpt", "adamw", DDP, {}, 1, 10, ckpt_path=directory))
        for stage in (2, 3):
            resumed = case(
                f"resume-{name}-dp2-z{stage}",
                "gpt",
                "adamw",
                DDP,
                {"zero_stage": stage},
                2,
                10,
                ckpt_path=directory,
            )
            later[2].append(resumed)
    z3_directory = str(tmp / "dist2" / "ddp2-gpt-adamw-z3-sharded" / "last.ckpt")  # read as ranges at dp=4
    later[4].append(
        case(
            "resume-z3-sharded-dp4-z3", "gpt", "adamw", DDP, {"zero_stage": 3}, 4, 10, ckpt_path=z3_directory
        )
    )
    for world, cases in later.items():
        results.update(run_distributed(cases, world_size=world, tmp_path=tmp / "later", timeout=400))
    return tmp, results


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("world", [2, 4, 8])
def test_no_process_group_outlives_destroy_process_group(runs, world):
    """After each world's runs (every ZeRO stage, tp, pp and ep layouts, HSDP, sharded saves), each rank
    destroys the process group and collects garbage: no gloo thread may be left (a group something still
    holds would be torn down at interpreter exit, where it can abort a rank that finished)."""
    tmp, _ = runs
    assert gloo_threads_left(tmp, world) == [[]] * world


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", list(RUNS))
def test_zero_equals_one_device(runs, name):
    tmp, results = runs
    world, model, optimizer, *_ = RUNS[name]
    reference = f"ref-{REFERENCE_MODEL.get(model, model)}-{optimizer}" + (
        "-clip-accumulate" if "clip" in name else ""
    )
    expected = results[reference][0]["state_dict"]
    full = saved_checkpoint(tmp, world, name)["state_dict"]
    assert_params_close(full, expected, atol=1e-10)
    # every rank holds the whole updated model after fit: ZeRO's pieces all-gathered after each step, and
    # tensor-parallel shards and pipeline stages joined when fit ends
    assert_given_back_whole(results[name], full, results[reference][0])


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("model", ["gpt", "gpt4", "mixtral"])
def test_clipping_and_accumulation_changed_the_run(runs, model):
    _, results = runs
    clipped = results[f"ref-{model}-adamw-clip-accumulate"][0]["state_dict"]
    assert max_param_diff(clipped, results[f"ref-{model}-adamw"][0]["state_dict"]) > 1e-4


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16"])
def test_mixed_precision_keeps_its_meaning(runs, precision, stage):
    """Under 16-mixed (a GradScaler: every rank skips a step when any rank's pieces overflowed) and
    bf16-mixed, ZeRO-2 and ZeRO-3 train as plain lp_ddp does, to float32 round-off (1e-5 after 5 AdamW
    steps of lr 1e-2: the float32 master weights and gradients are the same; only the order of the
    float32 sums in the reduce-scatter differs from the all-reduce's). Under ZeRO-3 the parameters are
    gathered in float32 here (``param_dtype="float32"``) and autocast casts them per op, as for plain lp_ddp;
    the default, gathered in the compute dtype, is tested in ``test_zero3_dtypes.py``."""
    tmp, results = runs
    sharded = saved_checkpoint(tmp, 2, f"ddp2-gpt-adamw-{precision}-z{stage}")["state_dict"]
    plain = saved_checkpoint(tmp, 2, f"ddp2-gpt-adamw-{precision}-z0")["state_dict"]
    assert_params_close(sharded, plain, atol=1e-5)


@pytest.mark.timeout(1500)
def test_async_pipeline_with_zero_equals_its_emulation(runs):
    tmp, results = runs
    full = saved_checkpoint(tmp, 4, "async-dp2pp2-z1")["state_dict"]
    assert_params_close(full, results["async-emulation"][0]["state_dict"], atol=1e-10)


def _end_of_fit(rank_result: dict) -> dict:
    tables = rank_result["probe"]["tables"]
    return {row["rank"]: row for row in list(tables.values())[-1]}


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", list(RUNS))
def test_memory_report_shows_the_shards(runs, name):
    """Optimizer state per rank is 1/dp (HSDP: 1/shard size) of what an unsharded optimizer of the rank's
    parameters holds (within 5%); at stage 2 so are the gradients held between steps; at stage 1 the gradients
    take the full-size buckets and no more (each rank receives its range into its own slice of the bucket); a
    pipeline's modules replicated over the stages keep whole gradients."""
    _, results = runs
    world, _, optimizer, _, kwargs, dp, _ = RUNS[name]
    rows = _end_of_fit(results[name][0])
    assert len(rows) == world
    moments = 2 if optimizer == "adamw" else 1  # AdamW: exp_avg and exp_avg_sq; SGD: the momentum buffer
    stage = kwargs["zero_stage"]
    dp = kwargs.get("data_parallel_shard_size", dp)  # HSDP: 1/shard size, each shard held by its replicas
    replicas = dp // kwargs.get("expert_parallel_size", 1)  # of each expert (none to shard over at dp2 x ep2)
    if stage == 3 and "pp" in name:  # a stage's units: 1/dp of what the stage holds whole (its shapes)
        for rank, row in rows.items():
            found = results[name][rank]["probe"]
            whole, kept, experts = found["shapes"], found["kept_whole"], found["experts_sharded"]
            assert (experts > 0) == ("ep2" in name and replicas > 1), found
            held = kept + experts / replicas + (whole - kept - experts) / dp
            assert row["parameters"] == pytest.approx(held, rel=0.05)
            assert row["optimizer_state"] == pytest.approx(moments * held, rel=0.05)
            # the blocks' gradients reduce-scattered; the modules every stage holds keep whole ones (all-reduced,
            # then summed over the stages)
            assert held < row["gradients"] < whole
        return
    if stage == 3:  # the parameters too: between steps every unit is freed, each rank keeps its shards
        for rank, row in rows.items():
            # the rank's share by the parameters' shapes: the whole model under lp_ddp, its tensor-parallel
            # slices and its experts otherwise; the experts placed on it sharded over their replicas (dp / ep
            # of them: none to shard over at dp2 x ep2, where they stay whole)
            found = results[name][rank]["probe"]
            share, kept, experts = found["share"], found["kept_whole"], found["experts_sharded"]
            assert (experts > 0) == ("ep2" in name and replicas > 1), found
            held = kept + experts / replicas + (share - kept - experts) / dp
            assert row["parameters"] == pytest.approx(held, rel=0.05)
            # manual optimization: the user's zero_grad after the step drops the .grad of what is held whole (as
            # on one device); the reducer's received ranges of the shards stay allocated
            grads = held - kept if "manual" in name else held
            assert row["gradients"] == pytest.approx(grads, rel=0.05)
            assert row["optimizer_state"] == pytest.approx(moments * held, rel=0.05)
            if "data_parallel_shard_size" in kwargs:  # the expected column knows the shard size too
                states = row["parameters"] + row["gradients"] + row["optimizer_state"]
                assert row["expected_states"] == pytest.approx(states, rel=0.05)
            if "tp2" in name or "ep2" in name:
                assert share < 0.6 * row["model_parameters"], (share, row["model_parameters"])
            else:
                assert share == pytest.approx(row["model_parameters"], rel=0.01)
        return
    for row in rows.values():
        held = row["parameters"]  # the rank's own share (tensor-parallel shards, a pipeline stage)
        assert row["optimizer_state"] == pytest.approx(moments * held / dp, rel=0.05)
        if "pp2" in name and stage == 2:
            assert held / dp < row["gradients"] < held
        else:
            assert row["gradients"] == pytest.approx(held / dp if stage == 2 else held, rel=0.05)
    if "tp" not in name and "pp" not in name:
        assert rows[0]["parameters"] == pytest.approx(
            rows[0]["model_parameters"], rel=0.01
        )  # whole on every rank


@pytest.mark.timeout(1500)
@pytest.mark.parametrize(
    "resumed, world",
    [
        ("resume-dp1-z1", 1),
        ("resume-dp2-off", 2),
        ("resume-dp4-z1", 4),
        ("resume-dp1-from-z3", 1),  # saved under zero_stage=3, loaded on one device
        ("resume-dp2-z3", 2),  # saved under zero_stage=1, loaded into zero_stage=3's shards
        ("resume-dp1-from-hsdp", 1),  # saved under zero_stage=3 sharded in pairs at dp=4, on one device
        ("resume-dp1-from-dp2tp2-z3", 1),  # saved under dp2 x tp2 at zero_stage=3, loaded on one device
        ("resume-dp1-from-dp2pp2-z3", 1),  # saved at dp2 x pp2 under zero_stage=3, loaded on one device
        ("resume-dp2pp2-z3", 4),  # saved under zero_stage=1, loaded into the stages' zero_stage=3 shards
    ],
)
def test_zero_checkpoint_resumes_exactly_under_other_dp_sizes(runs, resumed, world):
    tmp, results = runs
    full = torch.load(tmp / "later" / f"dist{world}" / resumed / "last.ckpt", weights_only=False)
    assert full["global_step"] == 10
    assert_params_close(full["state_dict"], results["ref-gpt-adamw-10"][0]["state_dict"], atol=1e-10)


@pytest.mark.timeout(1500)
def test_zero_checkpoint_holds_the_single_device_optimizer_state(runs):
    tmp, results = runs
    saved = saved_checkpoint(tmp, 2, "ddp2-gpt-adamw-z1")
    reference = saved_checkpoint(tmp, 1, "ref-gpt-adamw")
    ours, theirs = saved["optimizer_states"][0], reference["optimizer_states"][0]
    assert ours["param_groups"] == theirs["param_groups"]
    assert set(ours["state"]) == set(theirs["state"])
    for index, state in theirs["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(ours["state"][index][key], value, atol=1e-10, rtol=0)


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", list(SHARDED_SAVES))
def test_sharded_zero_checkpoint_is_written_in_pieces_and_resumes_exactly(runs, name):
    """``save_distributed`` with ZeRO: a moment of a parameter (and at stage 3 the parameter itself) is
    written as pieces by both data-parallel ranks (not gathered and written by one), the directory
    consolidates into the single-device optimizer state and parameters, and it resumes exactly on one device
    and under lp_ddp with ZeRO-2 and ZeRO-3 (the stage-3 directory also at dp=4)."""
    from torch.distributed.checkpoint import FileSystemReader

    from lightning_parallel.checkpointing.sharded import consolidate

    tmp, _ = runs
    world = SHARDED_SAVES[name][0]
    directory = tmp / f"dist{world}" / name / "last.ckpt"
    metadata = FileSystemReader(str(directory)).read_metadata()
    writers: dict[str, set] = {}
    for index, info in metadata.storage_data.items():
        moment = index.fqn.startswith("optimizer_states/") and index.fqn.endswith("/exp_avg")
        if moment or ("z3" in name and index.fqn.startswith("state_dict/")):
            writers.setdefault(index.fqn, set()).add(info.relative_path)
    assert writers and max(len(files) for files in writers.values()) >= 2, writers
    if "z3" in name:  # a parameter as pieces too, each written by the rank that holds it
        model = {fqn: files for fqn, files in writers.items() if fqn.startswith("state_dict/")}
        assert model and max(len(files) for files in model.values()) >= 2, model
    consolidate(directory, tmp / f"{name}.ckpt")
    ours = torch.load(tmp / f"{name}.ckpt", weights_only=False)["optimizer_states"][0]
    theirs = saved_checkpoint(tmp, 1, "ref-gpt-adamw")["optimizer_states"][0]
    assert set(ours["state"]) == set(theirs["state"])
    for index, state in theirs["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(ours["state"][index][key], value, atol=1e-10, rtol=0)
    parameters = torch.load(tmp / f"{name}.ckpt", weights_only=False)["state_dict"]
    assert_params_close(parameters, saved_checkpoint(tmp, 1, "ref-gpt-adamw")["state_dict"], atol=1e-10)
    expected = runs[1]["ref-gpt-adamw-10"][0]["state_dict"]
    for resumed, world in (
        (f"resume-{name}-dp1", 1),
        (f"resume-{name}-dp2-z2", 2),
        (f"resume-{name}-dp2-z3", 2),
        *([("resume-z3-sharded-dp4-z3", 4)] if "z3" in name else []),
    ):
        full = torch.load(tmp / "later" / f"dist{world}" / resumed / "last.ckpt", weights_only=False)
        assert full["global_step"] == 10, resumed
        assert_params_close(full["state_dict"], expected, atol=1e-10)


@pytest.mark.timeout(1500)
def test_reshard_after_forward_gathers_each_block_again_for_its_backward(runs):
    """zero_stage=3 gathers a block for its forward and, freed after it (the default), again for its
    backward (all but the last two blocks, which the backward's start holds anyway: the last, whose backward
    comes first, and the one before it, whose gather that backward starts); ``reshard_after_forward=False``
    keeps each from the forward to its backward: per training step the default gathers every block but the
    last two once more. The next block's gather starts while one computes: in forward every block (the first
    behind the root unit's gather), and in backward every block but the last two."""
    _, results = runs
    target, kwargs = ZERO_MODELS["gpt4"]
    blocks, steps = len(find_block_stack(load_object(target)(**kwargs))[1]), 5
    for default_run, kept_run in (
        # recompute reruns a block's forward inside its backward without the block's hooks: no gather more
        ("ddp2-gpt4-adamw-z3-recompute", "ddp2-gpt4-adamw-z3-kept"),
        ("dp2tp2-gpt4-sgdm-z3", "dp2tp2-gpt4-sgdm-z3-kept"),  # lp_parallel: each rank's tp share
    ):
        default, default_prefetched = results[default_run][0]["probe"]["gathers"]
        kept, kept_prefetched = results[kept_run][0]["probe"]["gathers"]
        assert blocks > KEPT_FOR_BACKWARD
        assert default - kept == steps * (blocks - KEPT_FOR_BACKWARD), (default_run, default, kept)
        assert kept_prefetched == steps * blocks, kept_run
        assert default_prefetched == steps * (2 * blocks - KEPT_FOR_BACKWARD), default_run


@pytest.mark.timeout(1500)
def test_zero_3_full_state_is_read_and_loaded_while_sharded(runs):
    """While the parameters are sharded, the strategy's full state gathers every unit and a full state
    loaded is kept by each rank's shards: zeros read back as zeros, the first state loaded again reads back
    unchanged."""
    _, results = runs
    for rank in [*results["ddp2-z3-round-trip"], *results["dp2tp2-z3-round-trip"]]:
        found = rank["probe"]
        assert found["keys"] and found["zeros_max"] == 0.0 and found["again_diff"] == 0.0, found


@pytest.mark.timeout(1500)
def test_zero_3_weights_read_in_hooks(runs):
    """A callback reading every weight (norm, sum, clone, print) in Lightning's hooks while zero_stage=3's units
    are freed does not crash the fit (freed storage is never read): outside ``gathered()`` a freed unit's
    parameters read as NaN of their own shape, never as a plausible value; inside it they equal one device's
    parameters at that step."""
    tmp, _ = runs
    reference = torch.load(tmp / "dist1" / "ref-gpt-sgdm" / "reads" / "reads-rank0.pt", weights_only=False)
    assert not any(all_nan(norms) for norms in reference["between"])  # one device reads true values
    for rank in range(2):
        found = torch.load(
            tmp / "dist2" / "ddp2-gpt-sgdm-z3" / "reads" / f"reads-rank{rank}.pt", weights_only=False
        )
        assert set(found["hooks"]) == set(HOOKS) == set(reference["hooks"]), found["hooks"]
        assert len(found["between"]) == 5 and all(all_nan(norms) for norms in found["between"])
        assert len(found["steps"]) == len(reference["steps"]) == 5
        for step, expected in zip(found["steps"], reference["steps"]):
            assert_params_close(step, expected, atol=1e-10)


def user_code_found(tmp, world: int, name: str) -> dict:
    return torch.load(tmp / f"dist{world}" / name / "user_code" / "user-code-rank0.pt", weights_only=False)


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", [n for n in USER_CODE if not n.startswith("ref-")])
def test_zero_3_user_code_in_hooks_gets_the_values_or_a_prompt_error(runs, name):
    """What users run in a hook under zero_stage=3 (``UserCode``, after steps 2 and 4): on rank 0 alone, a
    forward and ``state_dict()`` raise at once, naming ``parameters_gathered()`` (before, the forward waited in
    a gather the other ranks never joined until failure_timeout, and ``state_dict()`` returned NaN
    placeholders), and training goes on as on one device; inside ``parameters_gathered()``, entered on every
    rank, the forward gives one device's output (on rank 0 alone under lp_ddp, on every rank at dp2 x tp2) and
    ``state_dict()`` one device's weights (lp_ddp; this rank's share, with no NaN, where the model is split)."""
    tmp, _ = runs
    world, model, optimizer, *_ = RUNS[name]
    reference = user_code_found(tmp, 1, f"ref-{model}-{optimizer}")
    found = user_code_found(tmp, world, name)
    assert len(found["attempts"]) == len(reference["attempts"]) == 2
    for attempt, expected in zip(found["attempts"], reference["attempts"]):
        for call in ("forward", "state_dict"):
            assert expected[call]["error"] is None
            kind, message = attempt[call]["error"]
            assert kind == "OffStepGatherError" and "zero_stage=3" in message, message
            assert "trainer.strategy.parameters_gathered()" in message, message
            assert attempt[call]["seconds"] < 1.0, attempt
    if USER_CODE[name] == "none":
        assert found["outputs"] == []
    else:
        assert len(found["outputs"]) == len(reference["outputs"]) == 2
        for output, expected in zip(found["outputs"], reference["outputs"]):
            assert (output - expected).abs().max().item() <= 1e-10
    assert len(found["states"]) == 2
    for state, expected in zip(found["states"], reference["states"]):
        assert not any(v.isnan().any() for v in state.values() if v.is_floating_point())
        if world == 2:  # lp_ddp: the whole model
            assert_params_close(state, expected, atol=1e-10)
