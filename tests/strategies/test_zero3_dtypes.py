"""ZeRO-3's ``param_dtype`` / ``reduce_dtype`` (FSDP2's ``MixedPrecisionPolicy``) on 2 real gloo processes,
through ``Trainer.fit``: under ``bf16-mixed`` the units are gathered in bfloat16 by default (the blocks compute
on bfloat16 weights, a gathered unit takes half the resident memory and half the bytes of a float32 one), the
shards and the optimizer stay float32, and the run equals FSDP2 with ``MixedPrecisionPolicy(bfloat16,
float32)`` under Lightning's ``ModelParallelStrategy`` and stays within bfloat16's rounding of float32
training; reduced in bfloat16, the first step's gradients are the float32-reduced ones rounded to bfloat16;
under 16-mixed with a GradScaler, the steps skipped are those plain lp_ddp skips. Combinations that mean
nothing are refused before any process starts."""

from __future__ import annotations

import pytest
import torch

import lightning_parallel as lp
from tests.helpers.harness import max_param_diff, run_distributed

DDP = "lightning_parallel:DDPStrategy"
#: wide enough that a block's unit (about 0.8M parameters) is a memory mapping of its own in either dtype
MODEL = {"n_embd": 256, "n_layer": 2, "optimizer": "adamw", "lr": 1e-3}
PROBE = {"probe": "tests.helpers.unit_dtypes:unit_dtypes"}
CALLBACKS = [{"class": "tests.helpers.unit_dtypes:UnitDtypes"}]


def case(name: str, strategy, precision: str = "bf16-mixed", **more) -> dict:
    return {
        "name": name,
        "model": "tests.helpers.tp_models:SmallGPT",
        "model_kwargs": MODEL,
        "data": "tests.helpers.tp_models:TokenData",
        "data_kwargs": {"global_batch_size": 16},
        "trainer": {"precision": precision, "max_steps": 5},
        "strategy": strategy,
        "callbacks": CALLBACKS,
        **more,
    }


def z3(**kwargs) -> dict:
    return {"class": DDP, "kwargs": {"zero_stage": 3, **kwargs}}


#: a real GradScaler on the CPU, starting at a scale that overflows float16 (steps skipped, the scale halved)
FP16 = {"fp16_cpu": True, "fp16_init_scale": 2.0**22, "trainer": {"precision": None, "max_steps": 8}}
#: FSDP2 with MixedPrecisionPolicy(bfloat16, float32), fully_shard per block under ModelParallelStrategy
FSDP2 = {
    **case(
        "fsdp2-bf16",
        {
            "class": "lightning.pytorch.strategies:ModelParallelStrategy",
            "kwargs": {"data_parallel_size": 2, "tensor_parallel_size": 1},
        },
        callbacks=[],
    ),
    "model": "tests.helpers.unit_dtypes:FSDP2GPT",
    "no_state_dict": True,
    "probe": "tests.helpers.unit_dtypes:fsdp2_full_state",
}
ACCUMULATE = {"precision": "bf16-mixed", "max_steps": 5, "accumulate_grad_batches": 2}
CASES = [
    case("z0-bf16", {"class": DDP, "kwargs": {}}),
    case("z3-bf16", z3(), **PROBE),  # the defaults: gathered in bfloat16, reduced in float32
    case("z3-bf16-f32-gather", z3(param_dtype="float32"), **PROBE),
    case("z3-bf16-bf16-reduce", z3(reduce_dtype="bfloat16"), **PROBE),
    case("z3-f32", z3(), "32-true", **PROBE),
    FSDP2,
    case("z3-bf16-accumulate", z3(), trainer=ACCUMULATE),
    {**FSDP2, "name": "fsdp2-bf16-accumulate", "trainer": ACCUMULATE},
    case("z0-fp16", {"class": DDP, "kwargs": {}}, **FP16, **PROBE),
    case("z3-fp16", z3(), **FP16, **PROBE),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(CASES, world_size=2, tmp_path=tmp_path_factory.mktemp("z3dtypes"), timeout=600)


def params(results: dict, name: str) -> dict:
    state = results[name][0]["probe"] if name.startswith("fsdp2") else results[name][0]["state_dict"]
    return {k: v for k, v in state.items() if v.is_floating_point()}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bf16_mixed_gathers_in_bf16_and_keeps_float32_masters(runs):
    for rank in runs["z3-bf16"]:
        probe = rank["probe"]
        assert probe["forward_dtypes"] == ["torch.bfloat16"]
        assert probe["shard_dtypes"] == probe["piece_dtypes"] == probe["state_dtypes"] == ["torch.float32"]
    assert runs["z3-bf16-f32-gather"][0]["probe"]["forward_dtypes"] == ["torch.float32"]
    assert runs["z3-f32"][0]["probe"]["forward_dtypes"] == ["torch.float32"]  # 32-true: nothing cast
    # the module given back after fit holds the float32 masters
    assert {str(v.dtype) for v in params(runs, "z3-bf16").values()} == {"torch.float32"}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bf16_gathered_unit_takes_half_the_memory_and_bytes(runs):
    for bf16, f32 in zip(runs["z3-bf16"], runs["z3-bf16-f32-gather"]):
        half, full = bf16["probe"], f32["probe"]
        assert half["unit_numel"] == full["unit_numel"] > 2**19
        # resident memory measured around one gather (pages of the unit's mapping), within a page
        assert abs(full["gathered_rss"] - 4 * full["unit_numel"]) <= 4096 * 2
        assert abs(half["gathered_rss"] - 2 * half["unit_numel"]) <= 4096 * 2
        assert half["gathered_bytes"] * 2 == full["gathered_bytes"] > 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bf16_gather_equals_fsdp2_and_stays_within_bf16_of_float32(runs):
    ours, fsdp2 = params(runs, "z3-bf16"), params(runs, "fsdp2-bf16")
    plain, f32_gather = params(runs, "z0-bf16"), params(runs, "z3-bf16-f32-gather")
    to_fsdp2, to_plain = max_param_diff(ours, fsdp2), max_param_diff(ours, plain)
    losses = {n: torch.tensor(runs[n][0]["losses"]) for n in ("z3-bf16", "z0-bf16", "fsdp2-bf16")}
    mean = sum((ours[k] - plain[k]).abs().sum() for k in ours) / sum(v.numel() for v in ours.values())
    assert to_fsdp2 <= 1e-6, f"ZeRO-3 in bfloat16 differs from FSDP2's MixedPrecisionPolicy by {to_fsdp2:.2e}"
    assert torch.allclose(losses["z3-bf16"], losses["fsdp2-bf16"], rtol=0, atol=1e-6)
    # bfloat16 weights move the run off float32 weights' by bfloat16's rounding: the losses within one
    # bfloat16 ulp of a loss in [2, 4) (2**-6), the weights on average within a tenth of one AdamW step (lr
    # 1e-3); single weights may move further (AdamW turns a near-zero gradient's rounding into a step of lr)
    assert 0 < (losses["z3-bf16"] - losses["z0-bf16"]).abs().max() <= 2**-6
    assert 1e-5 < to_plain and mean <= 1e-4, f"bfloat16 gathers moved the weights by {mean:.2e} on average"
    # gathered in float32, autocast casts per op as plain lp_ddp does: float32 round-off only
    assert max_param_diff(f32_gather, plain) <= 1e-5


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bf16_gather_accumulates_in_the_reduce_dtype_as_fsdp2(runs):
    """Under ``accumulate_grad_batches=2`` the micro-batches' bfloat16 gradients add up in float32 (FSDP2's
    accumulated gradient), not in bfloat16: equal to FSDP2 but for the order of two float32 sums."""
    ours, fsdp2 = params(runs, "z3-bf16-accumulate"), params(runs, "fsdp2-bf16-accumulate")
    diff = max_param_diff(ours, fsdp2)
    assert diff <= 1e-6, f"accumulated ZeRO-3 in bfloat16 differs from FSDP2's by {diff:.2e}"
    assert max_param_diff(ours, params(runs, "z3-bf16")) > 1e-3  # accumulation changed the run


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bf16_reduce_rounds_the_float32_reduced_gradients(runs):
    for f32, bf16 in zip(runs["z3-bf16"], runs["z3-bf16-bf16-reduce"]):
        exact, rounded = f32["probe"]["first_gradients"], bf16["probe"]["first_gradients"]
        assert exact.dtype == rounded.dtype == torch.float32
        # a sum of two ranks' halves, each exact in bfloat16, rounded once: the float32 sum rounded
        assert torch.equal(rounded, exact.to(torch.bfloat16).float())
        assert not torch.equal(rounded, exact)
    assert max_param_diff(params(runs, "z3-bf16-bf16-reduce"), params(runs, "z3-bf16")) > 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_16_mixed_skips_the_steps_plain_ddp_skips(runs):
    scales = [rank["probe"]["scales"] for rank in runs["z3-fp16"]]
    # the scale after each step: every rank, and plain lp_ddp, skipped the same steps (each skip halves it)
    assert scales[0] == scales[1] == runs["z0-fp16"][0]["probe"]["scales"]
    skipped = sum(a > b for a, b in zip([2.0**22, *scales[0]], scales[0]))
    assert 0 < skipped < len(scales[0]), f"overflowed steps, of {len(scales[0])}: {skipped} ({scales[0]})"
    assert runs["z3-fp16"][0]["probe"]["forward_dtypes"] == ["torch.float16"]
    ours, plain = params(runs, "z3-fp16"), params(runs, "z0-fp16")
    assert all(v.isfinite().all() for v in ours.values())
    mean = sum((ours[k] - plain[k]).abs().sum() for k in ours) / sum(v.numel() for v in ours.values())
    assert mean <= 1e-4, f"float16 gathers moved the weights by {mean:.2e} on average"


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: lp.DDPStrategy(param_dtype="bfloat16"), ["param_dtype='bfloat16'", "zero_stage=3"]),
        (lambda: lp.DDPStrategy(zero_stage=2, reduce_dtype="float32"), ["reduce_dtype", "zero_stage=2"]),
        (lambda: lp.DDPStrategy(zero_stage=3, param_dtype="bf16"), ["param_dtype='bf16'", "'bfloat16'"]),
    ],
)
def test_dtype_options_refused_with_their_fix(make, words):
    with pytest.raises(ValueError) as error:
        make()
    assert all(w in str(error.value) for w in words), str(error.value)


@pytest.mark.parametrize(
    ("precision", "param_dtype", "words"),
    [
        (
            "32-true",
            "bfloat16",
            ["param_dtype='bfloat16'", "precision='32-true'", "no autocast", "'float32'"],
        ),
        ("64-true", "float32", ["precision='64-true'", "'float64'"]),
        ("bf16-mixed", "float16", ["autocast computes in bfloat16", "'bfloat16' or 'float32'"]),
    ],
)
def test_meaningless_param_dtype_refused_before_launch(precision, param_dtype, words):
    from lightning.pytorch import Trainer

    strategy = lp.DDPStrategy(zero_stage=3, param_dtype=param_dtype)
    with pytest.raises(ValueError) as error:
        Trainer(accelerator="cpu", devices=2, strategy=strategy, precision=precision, logger=False)
    assert all(w in str(error.value) for w in words), str(error.value)
