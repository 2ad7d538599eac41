"""The version smoke set (``pytest -m smoke``; CI runs it at the oldest and the newest torch, Lightning and
transformers that ``setup.cfg`` allows): one short run of each way to train on 2 gloo processes, each equal
to one process in float64 (1e-10), every model built on meta (deferred initialization): ``lp_ddp`` plain,
with full and selective recompute, with ZeRO-1 and ZeRO-2; tensor parallel with and without sequence
parallelism; 1F1B; ``lp_parallel``; a Hugging Face Llama under tp=2, 1F1B and ZeRO-2; a sharded checkpoint
saved under tp=2 and resumed under 1F1B."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.harness import assert_params_close, run_distributed, saved_checkpoint
from tests.strategies.test_deferred_init import case
from tests.strategies.test_parallel_3d import layout

pytestmark = pytest.mark.smoke

DDP = "lightning_parallel:DDPStrategy"
TP = "lightning_parallel:TensorParallelStrategy"
PP = "lightning_parallel:PipelineParallelStrategy"
PARALLEL = "lightning_parallel:ParallelStrategy"
STEPS = 3
ONE_F_ONE_B = {"schedule": "1f1b", "num_microbatches": 2}
ZB_H1 = {"schedule": "zb_h1", "num_microbatches": 2}  # split backwards (autograd's edges API since 2.7)
#: name: (model, strategy, its arguments, data-parallel size), each on 2 processes
RUNS = {
    "gpt-ddp": ("gpt", DDP, {}, 2),
    "gpt-ddp-recompute": ("gpt", DDP, {"activation_checkpointing": True}, 2),
    "gpt-ddp-selective": ("gpt", DDP, {"activation_checkpointing": "selective"}, 2),
    "gpt-zero1": ("gpt", DDP, {"zero_stage": 1}, 2),
    "gpt-zero2": ("gpt", DDP, {"zero_stage": 2}, 2),
    "gpt-tp2": ("gpt", TP, {"plan": "auto"}, 1),
    "gpt-tp2-sp": ("gpt", TP, {"plan": "auto", "sequence_parallel": True}, 1),
    "gpt-1f1b": ("gpt", PP, ONE_F_ONE_B, 1),
    "gpt-lp-parallel": ("gpt", PARALLEL, layout(1, 1, 2, "gpipe"), 1),
    "llama-tp2": ("llama", TP, {"plan": "auto"}, 1),
    "llama-1f1b": ("llama", PP, ONE_F_ONE_B, 1),
    "gpt-zb-h1": ("gpt", PP, ZB_H1, 1),
    "llama-zb-h1": ("llama", PP, ZB_H1, 1),
    "llama-zero2": ("llama", DDP, {"zero_stage": 2}, 2),
}
SHARDED = case("gpt", "tp2-sharded", TP, {"plan": "auto", "save_distributed": True}, 1, STEPS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process (the references), then every ``RUNS`` case in one launch of 2, then a resume."""
    tmp = tmp_path_factory.mktemp("smoke")
    references = [case(model, "ref", DDP, {}, 1, STEPS) for model in ("gpt", "llama")]
    references += [case("llama", "initial", DDP, {}, 1, 0), case("gpt", "ref-6", DDP, {}, 1, 2 * STEPS)]
    run_distributed(references, world_size=1, tmp_path=tmp, timeout=300)
    runs = [
        {**case(model, "", s, kwargs, dp, STEPS), "name": name}
        for name, (model, s, kwargs, dp) in RUNS.items()
    ]
    results = run_distributed([*runs, SHARDED], world_size=2, tmp_path=tmp, timeout=600)
    folder = tmp / "dist2" / SHARDED["name"] / "last.ckpt"
    resume = {**case("gpt", "resume-1f1b", PP, ONE_F_ONE_B, 1, 2 * STEPS), "ckpt_path": str(folder)}
    results.update(run_distributed([resume], world_size=2, tmp_path=tmp / "resume", timeout=300))
    return tmp, results


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", list(RUNS))
def test_each_way_to_train_equals_one_process(runs, name):
    tmp, results = runs
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in results[name])
    reference = saved_checkpoint(tmp, 1, f"{RUNS[name][0]}-ref")["state_dict"]
    assert_params_close(saved_checkpoint(tmp, 2, name)["state_dict"], reference, atol=1e-10)


@pytest.mark.timeout(1200)
def test_a_sharded_checkpoint_resumes_in_another_layout(runs):
    tmp, _ = runs
    assert (tmp / "dist2" / SHARDED["name"] / "last.ckpt").is_dir()
    reference = saved_checkpoint(tmp, 1, "gpt-ref-6")["state_dict"]
    assert_params_close(
        saved_checkpoint(tmp / "resume", 2, "gpt-resume-1f1b")["state_dict"], reference, atol=1e-10
    )


@pytest.mark.timeout(1200)
def test_a_llama_built_on_meta_starts_finite_with_the_constructors_norms(runs):
    tmp, _ = runs
    initial = saved_checkpoint(tmp, 1, "llama-initial")["state_dict"]
    norms = [name for name in initial if name.endswith("norm.weight")]
    assert norms and all(torch.isfinite(t).all() for t in initial.values())
    for name in norms:
        assert torch.equal(initial[name], torch.ones_like(initial[name])), name
