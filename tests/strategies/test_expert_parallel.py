"""Expert parallelism (``expert_parallel_size`` of ``lp_parallel``) on Hugging Face mixture-of-experts models,
real processes: equal to single-device training on the global batch (float64, 5 SGD steps, 1e-10), the
checkpoint holding every expert under its single-device name (momentum buffers included), each rank holding
num_experts / ep experts. Alone (ep = dp), with 2 replicas of each expert (ep=2, dp=4), with clipping by the
global norm, with whole blocks recomputed in backward, under tensor parallelism (dp2 x tp2, ep=2), under
pipeline stages (dp2 x pp2, ep=2, 1F1B and zero bubble's split backward; dp4 x pp2 with replicas of each
expert, accumulation and momentum), built on meta under ``init_module()``, and with a rank whose experts get
no token; an ep checkpoint resumes exactly under ep and on one device. With ZeRO (stages 1 and 2; dp2 and dp4
x ep2, dp2 x pp2 x ep2, dp2 x tp2 x ep2, with recompute, SGD momentum and AdamW, clipping) the same, the
checkpoint's optimizer state equal to one device's, and resumed. The plan table's all-to-all bytes per step
equal what a real ep=2 run hands to its all-to-alls."""

from __future__ import annotations

import pytest
import torch

from lightning_parallel.tensor.sample import forward_on
from lightning_parallel.tensor.table import expert_placement
from tests.helpers.harness import max_param_diff, run_distributed, run_single
from tests.helpers.tp_models import TokenData
from tests.helpers.zoo import ZooLM

PARALLEL = "lightning_parallel:ParallelStrategy"
F64 = {"precision": "64-true", "max_steps": 5}
ARCHS = ("mixtral", "qwen2_moe")
EXPERTS = 4  # both tiny configs (tests/helpers/zoo_more.py)


def case(arch: str, ep: int, dp: int, tp: int = 1, momentum: float = 0.0, clip: float = 0.0) -> dict:
    name = f"{arch}-ep{ep}-dp{dp}" + (f"-tp{tp}" if tp > 1 else "") + ("-momentum" if momentum else "")
    return {
        "name": name + ("-clip" if clip else ""),
        "model": "tests.helpers.zoo:ZooLM",
        "model_kwargs": {"arch": arch, "momentum": momentum},
        "data": "tests.helpers.tp_models:TokenData",
        "data_kwargs": {"global_batch_size": 16},
        "dp_size": dp,
        "trainer": {**F64, **({"gradient_clip_val": clip} if clip else {})},
        "save_checkpoint": True,
        "probe": "tests.helpers.probes:expert_parallel",
        "strategy": {
            "class": PARALLEL,
            "kwargs": {
                "data_parallel_size": dp,
                "expert_parallel_size": ep,
                "tensor_parallel_size": tp,  # with the default require_sharded: the experts ep places count
            },
        },
    }


def adamw(c: dict) -> dict:
    """``c`` trained by AdamW (its two moments and step in the checkpoint)."""
    return {**c, "name": f"{c['name']}-adamw", "model_kwargs": {**c["model_kwargs"], "optimizer": "adamw"}}


def with_options(c: dict, suffix: str, **options) -> dict:
    """``c`` with more strategy options, under a name of its own."""
    strategy = {**c["strategy"], "kwargs": {**c["strategy"]["kwargs"], **options}}
    return {**c, "name": f"{c['name']}-{suffix}", "strategy": strategy}


def traced(c: dict, axes: list[str]) -> dict:
    """``c`` with every call of its axes' hooks recorded (``AxisTrace``), which ``check`` compares with
    ``axes``, the strategy's order."""
    callbacks = [*c.get("callbacks", []), {"class": "tests.helpers.probes:AxisTrace"}]
    return {**c, "callbacks": callbacks, "axes": axes}


def pipelined(c: dict, schedule: str) -> dict:
    """``c`` over 2 pipeline stages (one layer each) with 2 micro-batches, the experts of each stage shared out
    over its ep ranks."""
    return with_options(c, f"pp2-{schedule}", pipeline_parallel_size=2, schedule=schedule, num_microbatches=2)


CASES_2 = [
    *(case(a, 2, 2) for a in ARCHS),
    case("mixtral", 2, 2, momentum=0.9),
    case("qwen2_moe", 2, 2, clip=0.05),  # the gradients' norm is about 0.5 here
    with_options(case("mixtral", 2, 2), "recompute", activation_checkpointing=True),  # all-to-alls replayed
    # ZeRO shards the replicated parameters over dp; each rank's optimizer holds its experts whole
    with_options(case("mixtral", 2, 2, momentum=0.9), "zero1", zero_stage=1),
    traced(with_options(adamw(case("mixtral", 2, 2)), "zero2", zero_stage=2), ["data_parallel", "zero"]),
    with_options(
        case("mixtral", 2, 2, momentum=0.9), "zero1-recompute", zero_stage=1, activation_checkpointing=True
    ),
]
# built on meta: each rank initializes its share from rank 0's random state, as lp_ddp on one process does
META = {**case("qwen2_moe", 2, 2), "name": "qwen2_moe-ep2-dp2-meta", "empty_init": True}
# rank 1 holds experts 2 and 3, which no token reaches (tests/helpers/moe_models.py)
IDLE = {
    **case("mixtral", 2, 2),
    "name": "first-experts-ep2",
    "model": "tests.helpers.moe_models:FirstExpertsMoE",
    "model_kwargs": {},
    "probe": None,
}
# validation during fit and after it runs on the split model (the ranks' all-to-alls in step)
VALIDATED = {
    **case("mixtral", 2, 2),
    "name": "mixtral-ep2-validated",
    "data": "tests.helpers.pp_models:TokenDataWithValidation",
    "trainer": {**F64, "val_check_interval": 2, "limit_val_batches": 2},
    "validate_after_fit": True,
}
# float32, the experts by Hugging Face's batched and grouped kernels (no float64 kernel for grouped_mm)
KERNELS = [
    {
        **case("qwen2_moe", 2, 2),
        "name": f"qwen2_moe-ep2-{kernel}",
        "model": "tests.helpers.moe_models:ZooMoE",
        "model_kwargs": {"arch": "qwen2_moe", "experts_implementation": kernel, "momentum": 0.0},
        "trainer": {"precision": "32-true", "max_steps": 5},
        "probe": None,
    }
    for kernel in ("batched_mm", "grouped_mm")
]
META_REFERENCE = {
    **META,
    "name": "qwen2_moe-meta-one-process",
    "dp_size": 1,
    "probe": None,
    "strategy": {"class": "lightning_parallel:DDPStrategy", "kwargs": {}},
}
CASES_4 = [
    *(case(a, ep, 4) for a in ARCHS for ep in (2, 4)),
    case("mixtral", 2, 2, tp=2, clip=0.05),
    with_options(case("mixtral", 2, 2, tp=2, momentum=0.9, clip=0.05), "zero1", zero_stage=1),
    # ZeRO with 2 replicas of each expert: the experts' state whole per rank, clipping by the global norm
    with_options(case("mixtral", 2, 4, momentum=0.9, clip=0.05), "zero1", zero_stage=1),
    with_options(adamw(case("mixtral", 2, 4)), "zero1", zero_stage=1),
    # accumulation: both reducers hold their gradients until the last micro-step
    {
        **case("qwen2_moe", 2, 4),
        "name": "qwen2_moe-ep2-dp4-accumulate",
        "trainer": {**F64, "accumulate_grad_batches": 2},
    },
    # pipeline stages: each stage's ep ranks run the same schedule, their all-to-alls paired per micro-batch
    pipelined(case("mixtral", 2, 2), "1f1b"),
    pipelined(case("qwen2_moe", 2, 2), "zb_h1"),
    # and ZeRO: each stage's replicated parameters sharded over dp, clipping summed over the world
    traced(
        with_options(
            pipelined(case("mixtral", 2, 2, momentum=0.9, clip=0.05), "1f1b"), "zero1", zero_stage=1
        ),
        ["data_parallel", "pipeline", "zero"],
    ),
]
# 2 replicas of each expert under pipeline stages: their average over edp after the schedule, under accumulation
# (the experts' axis runs after the pipeline's, whose hooks once ended a chain before it)
CASE_8 = traced(
    {
        **pipelined(case("mixtral", 2, 4, momentum=0.9), "1f1b"),
        "trainer": {**F64, "accumulate_grad_batches": 2},
    },
    ["data_parallel", "pipeline", "experts"],
)


def resumed(c: dict, dp: int, ep: int, steps: int, ckpt: str) -> dict:
    """``c`` continued from the checkpoint ``ckpt`` to ``steps`` on ``dp`` processes at ``ep``."""
    kwargs = {**c["strategy"]["kwargs"], "data_parallel_size": dp, "expert_parallel_size": ep}
    return {
        **c,
        "name": f"resume-{c['name']}-dp{dp}",
        "dp_size": dp,
        "trainer": {**c["trainer"], "max_steps": steps},
        "ckpt_path": ckpt,
        "probe": None,
        "strategy": {**c["strategy"], "kwargs": kwargs} if ep > 1 else "auto",
    }


def single(c: dict, tmp) -> dict:
    """The same run on one device (a model and trainer options shared by several cases run once)."""
    name = single_name(c)
    out = tmp / "single" / name / "result.pt"
    if not out.exists():
        result = run_single({**c, "name": name, "dp_size": 1, "strategy": "auto", "probe": None}, tmp)
        torch.save(result, out)
    return torch.load(out, weights_only=False)


def check(tmp, world: int, c: dict, results: dict) -> None:
    kwargs = c["strategy"]["kwargs"]
    ep, dp = kwargs["expert_parallel_size"], c["dp_size"]
    reference = single(c, tmp)
    saved = torch.load(tmp / f"dist{world}" / c["name"] / "last.ckpt", weights_only=False)
    diff = max_param_diff(saved["state_dict"], reference["state_dict"])
    assert diff < 1e-10, f"{c['name']}: parameters differ from single-device training by {diff:.3e}"
    if c["model_kwargs"]["momentum"] or "optimizer" in c["model_kwargs"]:  # the state, by one device's names
        one = torch.load(tmp / "single" / single_name(c) / "last.ckpt", weights_only=False)
        mine, theirs = saved["optimizer_states"][0]["state"], one["optimizer_states"][0]["state"]
        assert mine.keys() == theirs.keys() and len(mine) > 0
        for index, entry in mine.items():
            assert entry.keys() == theirs[index].keys(), index
            for key, value in entry.items():
                value, their = torch.as_tensor(value), torch.as_tensor(theirs[index][key])
                assert value.shape == their.shape, (index, key)
                assert (value - their).abs().max() < 1e-10, (index, key)
    pp = kwargs.get("pipeline_parallel_size", 1)
    for rank, result in enumerate(results[c["name"]]):
        held = result["probe"]["held"]
        assert len(held) == 2 // pp, held  # one experts module per layer (of this stage)
        first = (rank // (kwargs["tensor_parallel_size"] * pp) % ep) * (EXPERTS // ep)
        assert {v[:2] for v in held.values()} == {(first, EXPERTS // ep)}, (rank, held)
        assert (result["probe"]["expert_reducer"] is None) == (dp == ep), result["probe"]
        if "axes" in c:
            check_axis_trace(c, result["probe"]["axes"])


def check_axis_trace(c: dict, report: dict) -> None:
    """Every hook of every axis ran, each call of a hook going through the axes in the strategy's order:
    once per batch (the training step, the backward's two hooks), per optimizer step, per accumulating
    micro-step (``no_sync``), and once at the end of fit (``teardown``)."""
    axes, calls = c["axes"], report["calls"]
    assert report["axes"] == axes, report["axes"]
    steps, accumulate = c["trainer"]["max_steps"], c["trainer"].get("accumulate_grad_batches", 1)
    runs: list[tuple[str, list[str]]] = []  # consecutive calls of one hook: (hook, the axes it reached)
    for axis, hook in calls:
        if runs and runs[-1][0] == hook and len(runs[-1][1]) < len(axes):
            runs[-1][1].append(axis)
        else:
            runs.append((hook, [axis]))
    assert all(reached == axes for _, reached in runs), runs
    times = {hook: sum(h == hook for h, _ in runs) for hook in {h for h, _ in runs}}
    batches = steps * accumulate
    expected = {"training_step": batches, "pre_backward": batches, "post_backward": batches}
    expected |= {"optimizer_step": steps, **({"no_sync": steps * (accumulate - 1)} if accumulate > 1 else {})}
    expected["teardown"] = 1  # the probe's list is the live one, read after the strategy's teardown
    assert times == expected, times


def single_name(c: dict) -> str:
    training = "-".join(f"{k}{v}" for k, v in sorted(c["trainer"].items()) if k != "precision")
    optimizer = c["model_kwargs"].get("optimizer", "sgd")
    return (
        f"single-{c['model_kwargs']['arch']}-{optimizer}-momentum{c['model_kwargs']['momentum']}-{training}"
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_expert_parallel_2_processes(tmp_path):
    every = CASES_2 + [META, IDLE, VALIDATED, *KERNELS]
    results = run_distributed(every, world_size=2, tmp_path=tmp_path, timeout=600)
    for c in CASES_2 + [VALIDATED]:
        check(tmp_path, 2, c, results)
    assert all("val_loss" in r["metrics"] for r in results[VALIDATED["name"]])
    for c in KERNELS:
        saved = torch.load(tmp_path / "dist2" / c["name"] / "last.ckpt", weights_only=False)["state_dict"]
        one = run_single({**c, "name": f"single-{c['name']}", "dp_size": 1, "strategy": "auto"}, tmp_path)
        diff = max_param_diff(saved, one["state_dict"])
        assert diff < 1e-5, f"{c['name']}: {diff:.3e} from one device"
    idle = torch.load(tmp_path / "dist2" / IDLE["name"] / "last.ckpt", weights_only=False)["state_dict"]
    one = run_single({**IDLE, "name": "single-first-experts", "dp_size": 1, "strategy": "auto"}, tmp_path)
    assert max_param_diff(idle, one["state_dict"]) < 1e-10
    reference = run_distributed([META_REFERENCE], world_size=1, tmp_path=tmp_path, timeout=300)
    meta = torch.load(tmp_path / "dist2" / META["name"] / "last.ckpt", weights_only=False)["state_dict"]
    diff = max_param_diff(meta, reference[META_REFERENCE["name"]][0]["state_dict"])
    assert diff < 1e-10, f"built on meta: {diff:.3e} from lp_ddp on one process"
    momentum, zero = CASES_2[2], CASES_2[5]  # the second under ZeRO: its pieces take their state back
    assert zero["strategy"]["kwargs"].get("zero_stage") == 1 and zero["model_kwargs"]["momentum"]
    later = tmp_path / "later"
    saved = {c["name"]: str(tmp_path / "dist2" / c["name"] / "last.ckpt") for c in (momentum, zero)}
    run_distributed(
        [resumed(c, 2, 2, 8, saved[c["name"]]) for c in (momentum, zero)],
        world_size=2,
        tmp_path=later,
        timeout=400,
    )
    reference = single({**momentum, "trainer": {**momentum["trainer"], "max_steps": 8}}, tmp_path)
    for c in (momentum, zero):
        on_one = run_single(resumed(c, 1, 1, 8, saved[c["name"]]), later)
        full = torch.load(later / "dist2" / f"resume-{c['name']}-dp2" / "last.ckpt", weights_only=False)
        assert full["global_step"] == 8
        for name, state in (("ep2", full["state_dict"]), ("one device", on_one["state_dict"])):
            diff = max_param_diff(state, reference["state_dict"])
            assert diff < 1e-10, f"{c['name']} resumed {name}: {diff:.3e} from 8 steps on one device"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_expert_parallel_4_processes(tmp_path):
    results = run_distributed(CASES_4, world_size=4, tmp_path=tmp_path, timeout=800)
    for c in CASES_4:
        check(tmp_path, 4, c, results)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_expert_replicas_under_pipeline_stages_8_processes(tmp_path):
    results = run_distributed([CASE_8], world_size=8, tmp_path=tmp_path, timeout=500)
    check(tmp_path, 8, CASE_8, results)


# the plan table's all-to-all figure against the bytes a real run hands over (float32, as the table traces)
COUNTED = {
    **case("mixtral", 2, 2),
    "name": "mixtral-ep2-traffic",
    "trainer": {"precision": "32-true", "max_steps": 2},
    "callbacks": [{"class": "lightning_parallel.step_traffic:StepTraffic"}],
    "probe": "tests.helpers.probes:step_traffic",
    "save_checkpoint": False,
}


@pytest.mark.timeout(300)
def test_plan_table_all_to_all_bytes_equal_a_real_run(tmp_path):
    results = run_distributed([COUNTED], world_size=2, tmp_path=tmp_path, timeout=240)
    module = ZooLM(arch="mixtral")
    batch = next(iter(TokenData(batch_size=8).train_dataloader()))  # each rank's batch: 16 / dp
    predicted = expert_placement(module, 2, forward_on(module, batch)).total_bytes(module)
    steps = [r["probe"] for r in results[COUNTED["name"]]]
    assert [len(s) for s in steps] == [2, 2]
    for step in range(2):
        sent = [s[step]["sent"]["all_to_all_single"] for s in steps]
        kept = [s[step]["kept"]["all_to_all_single"] for s in steps]
        # per rank, the combine and the dispatch's backward carry what the routing sent it: the group's sum
        assert sum(sent) + sum(kept) == 2 * predicted, (step, sent, kept, predicted)
        assert all(k > 0 for k in kept) and all(s > 0 for s in sent)  # rows stay, and rows leave
