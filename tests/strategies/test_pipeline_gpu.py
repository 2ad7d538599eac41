"""Pipeline stages on a CUDA device (skipped without one; CI has none).

- 2 stages on one GPU, over gloo: every activation and gradient crosses the stages as a CUDA tensor
  through host memory (gloo cannot send CUDA tensors). float64 gpipe, 1f1b, interleaved_1f1b, zb_h1
  and zbv (the split backward on CUDA tensors) against the
  single-device CPU reference, async against the CPU emulation of its rule, bf16-mixed close to the
  float32 reference.
- 1 stage over NCCL: the strategy with a pipeline of one, on the GPU's own backend, equals the
  reference to 1e-10.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.harness import (
    assert_params_close,
    distributed_command,
    max_param_diff,
    run_processes,
    run_single,
    worker_env,
)
from tests.strategies.test_pipeline import SGD, case, reference
from tests.strategies.test_pipeline_schedules import NEW, blocks

pytestmark = pytest.mark.gpu

ONE_GPU_TWO_STAGES = {
    "accelerator": "cuda",
    "devices": 1,
    "num_nodes": 2,
}  # each process is a "node" of one GPU


def _on_one_gpu(name, model, trainer=None, **kwargs):
    return case(
        name, model, trainer={**ONE_GPU_TWO_STAGES, **(trainer or {})}, process_group_backend="gloo", **kwargs
    )


def _run_two_stages_on_one_gpu(cases, tmp_path):
    commands, _, out = distributed_command(cases, 2, tmp_path)
    envs = [worker_env(r, 2, local_world_size=1) for r in range(2)]  # LOCAL_RANK 0 on both: cuda:0
    run_processes(commands, envs, 400, out, rendezvous=True)
    return out


def _checkpoint(out, name):
    return torch.load(out / name / "last.ckpt", weights_only=False, map_location="cpu")["state_dict"]


@pytest.mark.timeout(600)
def test_two_stages_on_one_gpu_over_gloo_match_the_cpu_reference(cuda_required, tmp_path):
    f64 = [_on_one_gpu(f"gpt-cuda-{s}", "gpt", schedule=s, num_microbatches=4) for s in ("gpipe", "1f1b")]
    f64 += [
        _on_one_gpu(f"gpt-cuda-{s}", "gpt", schedule=s, num_microbatches=4, model_kwargs=blocks(s, 2))
        for s in NEW
    ]
    bf16 = _on_one_gpu(
        "seq-cuda-bf16",
        "seq",
        schedule="1f1b",
        trainer={"precision": "bf16-mixed"},
        data_kwargs={"global_batch_size": 16, "dtype": "float32"},
        model_kwargs=SGD,
    )
    stale = _on_one_gpu("seq-cuda-async", "seq", schedule="async", model_kwargs=SGD)
    out = _run_two_stages_on_one_gpu(f64 + [bf16, stale], tmp_path)
    for c in f64:
        cpu = {**c, "trainer": {**c["trainer"], "accelerator": "cpu", "devices": 1, "num_nodes": 1}}
        assert_params_close(_checkpoint(out, c["name"]), reference(cpu, tmp_path)["state_dict"], atol=1e-10)
    cpu = {
        **bf16,
        "trainer": {
            **bf16["trainer"],
            "accelerator": "cpu",
            "devices": 1,
            "num_nodes": 1,
            "precision": "32-true",
        },
    }
    fp32 = reference(cpu, tmp_path)["state_dict"]
    moved = max_param_diff(reference(cpu, tmp_path, max_steps=0)["state_dict"], fp32)
    assert max_param_diff(_checkpoint(out, bf16["name"]), fp32) < 0.05 * moved
    emulation = run_single(
        {
            **stale,
            "name": "emulation",
            "model": "tests.helpers.pp_models:AsyncRuleEmulation",
            "strategy": "auto",
            "save_checkpoint": False,
            "trainer": {**stale["trainer"], "accelerator": "cpu", "devices": 1, "num_nodes": 1},
        },
        tmp_path,
    )
    assert_params_close(_checkpoint(out, stale["name"]), emulation["state_dict"], atol=1e-10)


@pytest.mark.timeout(300)
def test_one_stage_over_nccl_matches_the_cpu_reference(cuda_required, tmp_path):
    c = case(
        "gpt-cuda-nccl-pp1",
        "gpt",
        schedule="1f1b",
        num_microbatches=4,
        trainer={"accelerator": "cuda", "devices": 1},
        process_group_backend="nccl",
    )
    commands, envs, out = distributed_command([c], 1, tmp_path)
    run_processes(commands, envs, 240, out, rendezvous=True)
    cpu = {**c, "trainer": {**c["trainer"], "accelerator": "cpu"}}
    assert_params_close(_checkpoint(out, c["name"]), reference(cpu, tmp_path)["state_dict"], atol=1e-10)
