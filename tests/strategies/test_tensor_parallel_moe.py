"""plan="auto" on Hugging Face mixtures of experts (Mixtral, Qwen2-MoE with its shared expert, OLMoE), 2 real
processes: each expert's MLP split as a column/row pair, the router's load-balancing loss in the loss.
Equal to single-device training in float64 (5 SGD steps, 1e-10) with the eager loop over the experts;
close in float32 with the batched_mm and grouped_mm kernels (grouped_mm has no float64 kernel)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.harness import max_param_diff, run_distributed, run_single
from tests.helpers.zoo import ZooLM

TP = "lightning_parallel:TensorParallelStrategy"
AUX = 0.5  # the load-balancing loss weighs enough to move the routers
# parameters each rank keeps at tp=2, as a share of the model
MAX_SHARE = {
    "mixtral": 0.51,
    "qwen2_moe": 0.51,
    "olmoe": 0.55,  # q/k RMSNorm over the whole projection: its attention stays whole
}
KERNELS = ("batched_mm", "grouped_mm")


def case(name: str, arch: str, precision: str = "64-true", experts: str = "", verify: bool = False) -> dict:
    return {
        "name": name,
        "model": "tests.helpers.zoo:ZooLM",
        "model_kwargs": {"arch": arch, "router_aux": AUX, "experts_implementation": experts},
        "data": "tests.helpers.tp_models:TokenData",
        "data_kwargs": {"global_batch_size": 16},
        "dp_size": 1,
        "trainer": {"precision": precision, "max_steps": 5},
        "save_checkpoint": True,
        "probe": "tests.helpers.probes:tensor_parallel_plan",
        "strategy": {"class": TP, "kwargs": {"plan": "auto", "verify_plan": verify}},
    }


# verify_plan: the first batch also runs the unsharded model beside the split one and compares
CASES = [case(a, a, verify=a == "mixtral") for a in MAX_SHARE] + [
    case(f"mixtral-{k}", "mixtral", "32-true", k) for k in KERNELS
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe")
    single = {
        c["name"]: run_single({**c, "name": f"single-{c['name']}", "strategy": "auto", "probe": None}, tmp)
        for c in CASES
    }
    results = run_distributed(CASES, world_size=2, tmp_path=tmp, timeout=500)
    return tmp, single, results


def _full_state(tmp, name: str) -> dict:
    return torch.load(tmp / "dist2" / name / "last.ckpt", weights_only=False)["state_dict"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("arch", tuple(MAX_SHARE))
def test_moe_experts_split_equals_single_device(arch, runs):
    tmp, single, results = runs
    full, reference = _full_state(tmp, arch), single[arch]["state_dict"]
    assert {k: v.shape for k, v in full.items()} == {k: v.shape for k, v in reference.items()}
    diff = max_param_diff(full, reference)
    assert diff < 1e-10, f"{arch}: parameters differ from single-device training by {diff:.3e}"
    plan = results[arch][0]["probe"]
    experts = [n for n, style in plan["styles"].items() if style == "experts"]
    assert len(experts) == 2, plan["styles"]  # every layer's experts
    total = sum(p.numel() for p in ZooLM(arch=arch).parameters())
    share = plan["local_parameters"] / total
    assert share <= MAX_SHARE[arch], (share, plan["report"])


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kernel", KERNELS)
def test_moe_experts_split_with_batched_kernels_float32(kernel, runs):
    tmp, single, results = runs
    name = f"mixtral-{kernel}"
    full, reference = _full_state(tmp, name), single[name]["state_dict"]
    diff = max_param_diff(full, reference)
    assert diff < 1e-5, f"{kernel}: parameters differ from single-device training by {diff:.3e}"
    assert "experts" in results[name][0]["probe"]["styles"].values()


PARALLEL = "lightning_parallel:ParallelStrategy"
DDP = "lightning_parallel:DDPStrategy"
# (world size, strategy, its arguments): the model built on meta, each rank materializing its share
COMPOSED = {
    "tp2": (2, TP, {"plan": "auto"}),
    "tp2xpp2": (
        4,
        PARALLEL,
        {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "num_microbatches": 2, "plan": "auto"},
    ),
}


def composed_case(arch: str, layout: str, aux: float) -> dict:
    world, strategy, kwargs = COMPOSED[layout] if layout in COMPOSED else (1, DDP, {})
    c = case(f"{arch}-{layout}-aux{aux}", arch)
    c["model_kwargs"] = {"arch": arch, "router_aux": aux}
    return {**c, "empty_init": True, "probe": None, "strategy": {"class": strategy, "kwargs": kwargs}}


@pytest.fixture(scope="module")
def composed(tmp_path_factory):
    """Mixtral and Qwen2-MoE built on meta: one process (the reference), tp=2, and tp2 x pp2 under
    lp_parallel (without the load-balancing loss: a pipeline stage captures only its own routers' logits)."""
    tmp = tmp_path_factory.mktemp("moe-composed")
    runs = [("mixtral", "tp2", AUX), ("mixtral", "tp2xpp2", 0.0), ("qwen2_moe", "tp2xpp2", 0.0)]
    cases: dict[int, list[dict]] = {1: [], 2: [], 4: []}
    for arch, layout, aux in runs:
        cases[1].append(composed_case(arch, "ddp1", aux))
        cases[COMPOSED[layout][0]].append(composed_case(arch, layout, aux))
    for world, group in cases.items():
        run_distributed(group, world_size=world, tmp_path=tmp, timeout=600)
    return tmp, runs


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_moe_on_meta_under_tp_and_tp_x_pp_equals_one_device(composed):
    tmp, runs = composed
    for arch, layout, aux in runs:
        world = COMPOSED[layout][0]
        full = torch.load(
            tmp / f"dist{world}" / f"{arch}-{layout}-aux{aux}" / "last.ckpt", weights_only=False
        )
        reference = torch.load(tmp / "dist1" / f"{arch}-ddp1-aux{aux}" / "last.ckpt", weights_only=False)
        diff = max_param_diff(full["state_dict"], reference["state_dict"])
        assert diff < 1e-10, f"{arch} {layout}: parameters differ from one process by {diff:.3e}"
