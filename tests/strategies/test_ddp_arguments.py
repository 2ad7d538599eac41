"""lp_ddp takes every argument of Lightning's DDPStrategy and of the torch DDP it forwards to, with their
meaning, or refuses it saying why; the ones that change training are run on 2 real processes."""

import inspect

import pytest
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook
from torch.nn.parallel import DistributedDataParallel

import lightning_parallel as lp
from lightning_parallel.strategies.ddp import NOT_APPLICABLE
from lightning_parallel.strategies.options import options
from tests.helpers.harness import assert_params_close, max_param_diff, run_distributed, run_single_once
from tests.strategies.test_ddp import case

OURS = {o.name for o in options(lp.DDPStrategy, configurable=False)}


def _parameters(function) -> list[str]:
    skip = (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    return [p.name for p in inspect.signature(function).parameters.values() if p.kind not in skip]


def test_every_lightning_ddp_argument_is_ours():
    lightning = set(_parameters(LightningDDPStrategy.__init__)) - {"self"}
    assert lightning <= OURS, f"Lightning's DDPStrategy arguments lp_ddp lacks: {sorted(lightning - OURS)}"


@pytest.mark.parametrize(
    "name", sorted(set(_parameters(DistributedDataParallel.__init__)) - {"self", "module"})
)
def test_every_torch_ddp_argument_is_taken_or_refused_with_its_reason(name):
    """Lightning forwards its extra keyword arguments to torch's DistributedDataParallel."""
    if name in OURS:
        default = inspect.signature(lp.DDPStrategy.__init__).parameters[name].default
        lp.DDPStrategy(**{name: default})
        return
    assert name in NOT_APPLICABLE, f"torch DDP's {name} is neither an lp_ddp option nor refused"
    with pytest.raises(TypeError) as err:
        lp.DDPStrategy(**{name: None})
    assert name in str(err.value) and NOT_APPLICABLE[name] in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"model_averaging_period": 4}, "PostLocalSGDState"),
        (
            {"ddp_comm_state": post_localSGD_hook.PostLocalSGDState(None, None, 2)},
            "needs model_averaging_period",
        ),
        ({"ddp_comm_hook": "int8"}, "'int8' is not supported"),
        ({"ddp_comm_wrapper": "fp16"}, "ddp_comm_wrapper must be a function"),
        ({"model_averaging_period": 0}, "model_averaging_period must be a positive integer"),
    ],
)
def test_argument_combinations_without_meaning_fail_at_construction(kwargs, expected):
    with pytest.raises(ValueError, match=expected):
        lp.DDPStrategy(**kwargs)


def test_the_old_name_comm_hook_says_the_new_one():
    with pytest.raises(TypeError, match="ddp_comm_hook"):
        lp.DDPStrategy(comm_hook="bf16")


# ---------------------------------------------------------------------------------------------------
# on real processes
# ---------------------------------------------------------------------------------------------------
def allreduce_hook_strategy() -> lp.DDPStrategy:
    """torch's reference hook, run on our buckets through its Future."""
    return lp.DDPStrategy(
        ddp_comm_hook=default_hooks.allreduce_hook, bucket_cap_mb=0.002, first_bucket_cap_mb=0.001
    )


def fp16_wrapper_strategy() -> lp.DDPStrategy:
    """torch: ``fp16_compress_hook`` is ``fp16_compress_wrapper(allreduce_hook)``; both through ours."""
    return lp.DDPStrategy(
        ddp_comm_hook=default_hooks.allreduce_hook, ddp_comm_wrapper=default_hooks.fp16_compress_wrapper
    )


def _each_rank_alone(state, bucket):
    """post-local SGD whose local steps are each rank's own (a subgroup of one rank)."""
    if state.subgroup is None:
        state.subgroup, _ = dist.new_subgroups(group_size=1)
    return post_localSGD_hook.post_localSGD_hook(state, bucket)


def post_local_sgd_strategy() -> lp.DDPStrategy:
    """2 synchronous steps, then local steps with the parameters averaged every 2 steps."""
    state = post_localSGD_hook.PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=2)
    return lp.DDPStrategy(ddp_comm_hook=_each_rank_alone, ddp_comm_state=state, model_averaging_period=2)


UNUSED = {
    "model": "tests.helpers.models:MLPWithUnusedBranch",
    "model_kwargs": {"optimizer": "adam", "lr": 0.01},
}
ACCUMULATE = {"trainer": {"accumulate_grad_batches": 2}}
DDP = "lightning_parallel:DDPStrategy"
HERE = "tests.strategies.test_ddp_arguments"


def _ddp(**kwargs) -> dict:
    return {"class": DDP, "kwargs": kwargs}


EXACT = {
    "static-graph-unused": (_ddp(static_graph=True), UNUSED),
    "static-graph-accumulate": (_ddp(static_graph=True, gradient_as_bucket_view=True), ACCUMULATE),
    "separate-grads": (
        _ddp(gradient_as_bucket_view=False, bucket_cap_mb=0.002, first_bucket_cap_mb=0.001),
        {},
    ),
    "separate-grads-accumulate": (_ddp(gradient_as_bucket_view=False), ACCUMULATE),
    "separate-grads-unused": (_ddp(gradient_as_bucket_view=False, find_unused_parameters=True), UNUSED),
    "allreduce-hook": ({"class": f"{HERE}:allreduce_hook_strategy"}, ACCUMULATE),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp_arguments")
    cases = [
        case(name, strategy, probe="tests.helpers.probes:reducer_stats", **extra)
        for name, (strategy, extra) in EXACT.items()
    ]
    cases += [
        case("fp16-wrapper", {"class": f"{HERE}:fp16_wrapper_strategy"}),
        case("fp16-hook", _ddp(ddp_comm_hook="fp16")),
        case("post-local-sgd-5", {"class": f"{HERE}:post_local_sgd_strategy"}, trainer={"max_steps": 5}),
        case("post-local-sgd-4", {"class": f"{HERE}:post_local_sgd_strategy"}, trainer={"max_steps": 4}),
    ]
    return tmp, run_distributed(cases, world_size=2, tmp_path=tmp)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(EXACT))
def test_trains_like_one_device(results, name):
    tmp, found = results
    extra = EXACT[name][1]
    reference = run_single_once(case(f"single-{name}", "auto", **extra), tmp)
    for rank_result in found[name]:
        assert_params_close(rank_result["state_dict"], reference["state_dict"], atol=1e-10)
        # the .grad tensors are the buckets, or separate from them, as asked (unused ones are None)
        if not name.endswith("unused"):
            assert rank_result["probe"]["grads_are_bucket_views"] == ("separate" not in name)


@pytest.mark.timeout(400)
def test_a_wrapped_hook_is_the_hook_it_equals(results):
    """fp16_compress_wrapper(allreduce_hook) and fp16_compress_hook send the same bits."""
    _, found = results
    assert max_param_diff(found["fp16-wrapper"][0]["state_dict"], found["fp16-hook"][0]["state_dict"]) == 0
    tmp, _ = results
    reference = run_single_once(case("single-plain", "auto"), tmp)
    assert 0 < max_param_diff(found["fp16-wrapper"][0]["state_dict"], reference["state_dict"]) < 1e-3


@pytest.mark.timeout(400)
def test_post_local_sgd_averages_every_period(results):
    """After 2 synchronous steps, ranks step alone; Lightning's model averager (period 2) makes them equal
    again on the 5th step, not after the 4th."""
    tmp, found = results
    after5, after4 = found["post-local-sgd-5"], found["post-local-sgd-4"]
    assert max_param_diff(after5[0]["state_dict"], after5[1]["state_dict"]) < 1e-12
    assert max_param_diff(after4[0]["state_dict"], after4[1]["state_dict"]) > 1e-6
    reference = run_single_once(case("single-plain", "auto"), tmp)
    assert max_param_diff(after5[0]["state_dict"], reference["state_dict"]) > 1e-6  # local steps happened


@pytest.mark.timeout(120)
def test_unused_parameters_error_begins_with_lightnings_words_under_spawn_too(tmp_path):
    """A spawned rank's error reaches the launching process as a traceback; it still says what Lightning's
    ddp says, and names the parameters."""
    from lightning.pytorch import Trainer

    from tests.helpers.models import MLPWithUnusedBranch, RegressionData

    trainer = Trainer(  # 2 processes: one process averages nothing, so it has no reducer to find unused ones
        accelerator="cpu",
        devices=2,
        strategy="lp_ddp_spawn",
        max_steps=2,
        precision="64-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with pytest.raises(
        Exception, match="It looks like your LightningModule has parameters that were not used"
    ) as err:
        trainer.fit(MLPWithUnusedBranch(), datamodule=RegressionData())
    assert "unused.weight" in str(err.value)
