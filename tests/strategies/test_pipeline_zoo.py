"""The model zoo (``tests/helpers/zoo.py``) under the pipeline strategies, on real processes: every family
under gpipe, 1f1b and zb_h1 (split backwards; Mixtral's experts too) on 2 stages, and three under
interleaved_1f1b and zbv (two chunks per rank), and Llama and Mixtral with their stages balanced by
measured time, equals single-device training (float64, 5 SGD steps, 1e-10); async
follows its rule (a one-process emulation); ``nn.TransformerEncoder`` validates on every stage; and
dp=2 x pp=2 on Llama. The blocks a stage does not hold stay the model's own objects, so code that
reads them (``nn.TransformerEncoder.forward`` reads ``layers[0].self_attn``) runs on every stage."""

import pytest
import torch

from lightning_parallel.module_names import find_block_stack, other_stacks
from lightning_parallel.pipeline.placement import global_stage
from lightning_parallel.pipeline.schedules import chunks_per_rank
from tests.helpers.harness import assert_params_close, max_param_diff, run_distributed, run_single
from tests.helpers.zoo import ARCHITECTURES, ZooLM, build
from tests.strategies.test_pipeline import PP, check, reference

ZOO, EMULATION = "tests.helpers.zoo:ZooLM", "tests.helpers.zoo:AsyncZooLM"
TOKENS, TOKENS_VAL = "tests.helpers.tp_models:TokenData", "tests.helpers.pp_models:TokenDataWithValidation"
ASYNC_ARCHS = tuple(ARCHITECTURES)  # every family: the rule holds whatever the model


def case(name, arch, schedule, dp=1, trainer=None, data=TOKENS, **kwargs):
    return {
        "name": name,
        "model": ZOO,
        "data": data,
        "dp_size": dp,
        "model_kwargs": {"arch": arch},
        "data_kwargs": {"global_batch_size": 16},
        "trainer": {"precision": "64-true", "max_steps": 5, **(trainer or {})},
        "strategy": {
            "class": PP,
            "kwargs": {"schedule": schedule, "num_microbatches": 4, "data_parallel_size": dp, **kwargs},
        },
        "save_checkpoint": True,
        "forward_after_fit": True,
        "probe": "tests.helpers.probes:pipeline_stages",
    }


SYNC_2 = [
    case(f"{arch}-{schedule}", arch, schedule)
    for arch in ARCHITECTURES
    for schedule in ("gpipe", "1f1b", "zb_h1")
] + [case("mixtral-zb_h1", "mixtral", "zb_h1")]
# balance="time" times each block on the arguments it was called with in a sample step: a Hugging Face
# model's key/value cache among them (use_cache=True, the configs' default) must not carry over between calls
SYNC_2 += [case(f"{arch}-1f1b-time", arch, "1f1b", balance="time") for arch in ("hf_llama", "mixtral")]
for _arch in ("torch_encoder", "hf_gpt2", "hf_bert"):  # two chunks per rank: 4 blocks for 2 ranks
    for _schedule in ("interleaved_1f1b", "zbv"):
        _c = case(f"{_arch}-{_schedule}", _arch, _schedule)
        _c["model_kwargs"]["layers"] = 4
        SYNC_2.append(_c)
ASYNC_2 = [case(f"{arch}-async", arch, "async") for arch in ASYNC_ARCHS]
VALIDATE = {
    **case(
        "torch_encoder-validate",
        "torch_encoder",
        "1f1b",
        data=TOKENS_VAL,
        trainer={"limit_val_batches": 2, "val_check_interval": 2},
    ),
    "validate_after_fit": True,
}
CASES_4 = [case("hf_llama-dp2-1f1b", "hf_llama", "1f1b", dp=2)]
# decoder blocks that return a tuple: Falcon's (hidden, None), with multi-query and grouped-query
# attention; Bloom's, MPT's and GPT-Neo's (hidden, attention weights)
TUPLE_BLOCKS = [case(f"{a}-1f1b", a, "1f1b") for a in ("falcon", "falcon_new", "bloom", "mpt", "gpt_neo")]


@pytest.fixture(scope="module")
def zoo2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zoo2")
    return tmp, run_distributed(SYNC_2 + ASYNC_2 + [VALIDATE], world_size=2, tmp_path=tmp, timeout=280)


@pytest.fixture(scope="module")
def zoo4(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zoo4")
    return tmp, run_distributed(CASES_4, world_size=4, tmp_path=tmp, timeout=200)


@pytest.fixture(scope="module")
def tuple_blocks2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tuple_blocks2")
    return tmp, run_distributed(TUPLE_BLOCKS, world_size=2, tmp_path=tmp, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("c", SYNC_2, ids=[c["name"] for c in SYNC_2])
def test_zoo_on_two_stages_matches_single_device(zoo2, c):
    tmp, results = zoo2
    check(tmp, results, 2, c)
    reports = [r["probe"] for r in results[c["name"]]]
    schedule = c["strategy"]["kwargs"]["schedule"]
    v = chunks_per_rank(schedule)
    held = [[global_stage(schedule, 2, rank, chunk, v) for chunk in range(v)] for rank in range(2)]
    expected = [" and ".join(f"{g}..{g}" for g in stages) for stages in held]  # one block per virtual stage
    assert reports[0] == reports[1] and [r["blocks"] for r in reports[0]] == expected
    stack, _ = find_block_stack(ZooLM(**c["model_kwargs"]))
    assert all(r["stack"] == stack for r in reports[0])  # for lightning_demo: its decoder's layers


@pytest.mark.timeout(300)
@pytest.mark.parametrize("c", ASYNC_2, ids=[c["name"] for c in ASYNC_2])
def test_zoo_async_follows_its_rule(zoo2, c):
    """W(t+1) = W(t) - lr * grad f_t(W(t-1)), written out on one process with the model's own loss."""
    tmp, results = zoo2
    emulation = run_single(
        {
            **c,
            "name": "emulation-" + c["name"],
            "model": EMULATION,
            "strategy": "auto",
            "save_checkpoint": False,
            "probe": None,
        },
        tmp,
    )
    full = torch.load(tmp / "dist2" / c["name"] / "last.ckpt", weights_only=False)["state_dict"]
    assert_params_close(full, emulation["state_dict"], atol=1e-10)
    for rank in results[c["name"]]:  # the loss shown at step t is batch t-1's
        torch.testing.assert_close(
            torch.tensor(rank["losses"][1:]), torch.tensor(emulation["losses"][:-1]), atol=1e-10, rtol=0
        )
    assert max_param_diff(full, reference(c, tmp)["state_dict"]) > 1e-4  # the rule is not plain SGD's


@pytest.mark.timeout(300)
def test_torch_encoder_validates_on_every_stage(zoo2):
    """Validation in fit and after it (eval mode: ``nn.TransformerEncoder``'s fast-path checks read the
    first layer's tensors, on the stage that does not hold it too): the single-device loss everywhere."""
    tmp, results = zoo2
    check(tmp, results, 2, VALIDATE)
    ref = reference(VALIDATE, tmp)
    for rank in results[VALIDATE["name"]]:
        assert abs(rank["metrics"]["val_loss"] - ref["metrics"]["val_loss"]) < 1e-9, (
            rank["metrics"],
            ref["metrics"],
        )


@pytest.mark.timeout(300)
def test_llama_with_two_replicas_of_two_stages_matches_single_device(zoo4):
    tmp, results = zoo4
    check(tmp, results, 4, CASES_4[0])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("c", TUPLE_BLOCKS, ids=[c["name"] for c in TUPLE_BLOCKS])
def test_blocks_that_return_a_tuple_match_single_device(tuple_blocks2, c):
    """``FalconForCausalLM``'s decoder blocks return ``(hidden states, None)``: the tensor crosses the
    stage boundary, None in its place, and the next stage's ``forward`` gets the tuple as the output of the
    previous stage's last block (the model takes ``outputs[0]`` from it); 5 SGD steps equal one device's."""
    tmp, results = tuple_blocks2
    check(tmp, results, 2, c)


def test_two_stack_model_pipelines_its_largest_stack_and_names_the_other():
    """``lightning.pytorch.demos.Transformer`` holds an ``nn.Transformer``: the decoder's layers (larger:
    cross-attention) are pipelined, the encoder's run whole on every stage."""
    demo = build("lightning_demo")
    assert find_block_stack(demo)[0] == "model.transformer.decoder.layers"  # what the strategy reported above
    assert other_stacks(demo, "model.transformer.decoder.layers") == ["model.transformer.encoder.layers"]
