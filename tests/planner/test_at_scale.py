"""The set-up at scale (``planner/at_scale.py``): the strategies' own set-up on torch's fake process group
with the module on meta, each rank's parameter, gradient and optimizer bytes read from what it placed,
equal to a hand count at 8 ranks; a Llama-70B-shaped model at 64 and 512 ranks."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn

from lightning_parallel.distributed.mesh import MeshShape
from lightning_parallel.planner.at_scale import parameter_cost, representative_ranks, set_up_at_scale
from lightning_parallel.planner.cluster import Cluster
from lightning_parallel.planner.cost_model import predict
from lightning_parallel.planner.layout import Layout
from lightning_parallel.strategies.ddp import DDPStrategy
from lightning_parallel.strategies.parallel import ParallelStrategy
from tests.helpers.zoo import ZooLM

LLAMA_PLAN = Path(__file__).parents[2] / "lightning_parallel" / "conf" / "plan" / "hf_llama.yaml"
F32 = 4


class TwoLayers(LightningModule):
    """Linear(10, 10) then Linear(10, 3): 143 float32 parameters; AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 3))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters())


# The reducer's one bucket holds the gradients in reverse registration order: bias 2 (3), weight 2 (30),
# bias 1 (10), weight 1 (100). ZeRO pads it to 144 = 8 ranges of 18; rank 0's range is bias 2 and 15
# elements of weight 2 (two pieces), rank 7's the last 17 elements of weight 1 and one element of padding
# (one piece). AdamW keeps two moments per element and a float32 step per tensor it updates.
HAND_COUNT = {  # (zero_stage, rank): (parameters, gradients, optimizer state) in bytes
    (0, 0): (143 * F32, 143 * F32, (2 * 143 + 4) * F32),
    (0, 7): (143 * F32, 143 * F32, (2 * 143 + 4) * F32),
    (1, 0): (143 * F32, 144 * F32, (2 * 18 + 2) * F32),
    (1, 7): (143 * F32, 144 * F32, (2 * 17 + 1) * F32),
    (2, 0): (143 * F32, 18 * F32, (2 * 18 + 2) * F32),
    (2, 7): (143 * F32, 18 * F32, (2 * 17 + 1) * F32),
}


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_ddp_bytes_per_rank_equal_a_hand_count(zero_stage):
    states = set_up_at_scale(TwoLayers, lambda: DDPStrategy(zero_stage=zero_stage), 8, ranks=[0, 7])
    for s in states:
        assert (s.parameter_bytes, s.gradient_bytes, s.optimizer_bytes) == HAND_COUNT[zero_stage, s.rank]


def _llama_hand_count(stage: int, tp: int, stages: int) -> int:
    """Parameters of a tiny Llama on pipeline stage ``stage`` of ``stages`` under tensor parallelism ``tp``:
    the stage's blocks and every module outside the stack; the plan's linear layers, the embedding and the
    head split over tp, the norms whole."""
    with torch.device("meta"):
        whole = ZooLM("hf_llama", width=16, layers=4, heads=4)
    per_stage = 4 // stages
    total = 0
    for name, p in whole.named_parameters():
        if ".layers." in name and int(name.split(".layers.")[1].split(".")[0]) // per_stage != stage:
            continue
        split = "proj" in name or "embed_tokens" in name or "lm_head" in name
        total += p.numel() // tp if split else p.numel()
    return total * F32


def test_three_axes_bytes_per_rank_equal_a_hand_count():
    """dp 2 x pp 2 x tp 2 of a tiny Llama, ZeRO-1 with SGD (no state): each rank holds its stage's blocks
    and the modules outside the stack, the plan's layers halved; the gradient buckets hold as many
    elements as the parameters, padded to the two data-parallel ranges."""
    make = functools.partial(
        ParallelStrategy,
        data_parallel_size=2,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        plan=str(LLAMA_PLAN),
        require_sharded=0,
        zero_stage=1,
    )
    build = functools.partial(ZooLM, "hf_llama", width=16, layers=4, heads=4)
    states = set_up_at_scale(build, make, 8)
    assert [s.rank for s in states] == representative_ranks(MeshShape(dp=2, pp=2, tp=2)) == [0, 2, 7]
    for s in states:
        _, stage, _ = s.coordinates
        expected = _llama_hand_count(stage, tp=2, stages=2)
        assert s.parameter_bytes == expected
        assert expected <= s.gradient_bytes < expected + 2 * F32 * 16  # padding: under one element per bucket and rank
        assert s.optimizer_bytes == 0  # SGD without momentum keeps nothing


def test_a_layout_the_strategy_refuses_fails_with_its_reason():
    """The strategy's own check, before any set-up: the layout's product is not the world."""
    make = functools.partial(ParallelStrategy, data_parallel_size=1, tensor_parallel_size=2, plan=str(LLAMA_PLAN))
    with pytest.raises(ValueError, match=r"= 2 must equal the 8 process\(es\) of this run"):
        set_up_at_scale(functools.partial(ZooLM, "hf_llama"), make, 8)


class Llama70B(LightningModule):
    """Llama 3 70B's shape (80 blocks of width 8192, 64 heads, 8 key-value heads, vocabulary 128256),
    built from a config on meta; AdamW."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            vocab_size=128256,
        )
        self.model = LlamaForCausalLM(config)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters())


@pytest.mark.slow
def test_llama_70b_at_64_and_512_ranks():
    """tp 8 x pp 8 (x dp 8 with ZeRO-1 at 512): the first and last stage and the last rank; 70.55 billion
    parameters, 10 of 80 blocks and the embedding and head (each split over tp) on every stage. Each rank's
    parameter + gradient + optimizer bytes equal the cost model's memory side (``predict(...).states``,
    memory.expected's formulas over the model's own parameter counts) within 1%, the whole run under 2
    minutes of CPU."""
    start, cpu_start = time.perf_counter(), time.process_time()
    cost = parameter_cost(Llama70B)
    cluster = Cluster.load("h100_64x8")
    per_stage = None
    # the tensors of a stage: 10 blocks of 9 (7 linear, 2 norms), the embedding, the final norm, the head
    tensors = 10 * 9 + 3
    for world in (64, 512):
        world_start = time.perf_counter()
        make = functools.partial(
            ParallelStrategy,
            data_parallel_size=world // 64,
            tensor_parallel_size=8,
            pipeline_parallel_size=8,
            plan=str(LLAMA_PLAN),
            require_sharded=0,
            num_microbatches=8,
            zero_stage=1,
        )
        states = set_up_at_scale(Llama70B, make, world, ranks=[0, 56, world - 1])
        layout = Layout(world // 64, 8, 8, 8 * world // 64, num_microbatches=8, zero_stage=1)
        expected = predict(cost, layout, cluster).states
        for s in states:
            # the cost model splits the norms over tp too (they are whole on each rank): 0.002% of a stage
            assert s.state_bytes == pytest.approx(expected.total, rel=0.01)
            assert s.parameter_bytes == pytest.approx(expected.parameters, rel=0.01)
            assert s.gradient_bytes == pytest.approx(expected.gradients, rel=0.01)
            assert s.optimizer_bytes == pytest.approx(expected.optimizer, rel=0.01)
            per_stage = per_stage or s.parameter_bytes
            assert s.parameter_bytes == per_stage  # 80 blocks divide into 8 stages: all alike
            params = s.parameter_bytes // F32
            if world == 64:  # no data-parallel group: autograd's .grad, AdamW's two moments
                assert s.gradient_bytes == s.parameter_bytes
                assert s.optimizer_bytes == 2 * s.parameter_bytes + F32 * tensors
            else:  # ZeRO-1 over 8: the buckets whole, the moments of one eighth
                assert s.parameter_bytes <= s.gradient_bytes < s.parameter_bytes + 8 * F32 * 1000
                assert abs(s.optimizer_bytes - 2 * params * F32 / 8) < 1e-4 * s.optimizer_bytes
        print(f"Llama-70B at {world} ranks, 3 of them set up: {time.perf_counter() - world_start:.1f} s")
    # 10 blocks of 8192 x (4 x 8192 / 8 ... ) over 8: about 1.07e9 + 2 x 131e6 + norms per rank
    assert 1.33e9 < per_stage / F32 < 1.34e9
    # the bound is on this process's CPU time: on the shared 2-core machine the wall time measures the load
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    print(f"Llama-70B at 64 and 512 ranks: {elapsed:.1f} s ({cpu:.1f} s of CPU)")
    assert cpu < 120, f"the set-up at 64 and 512 ranks took {cpu:.0f} s of CPU, more than 2 minutes"


def test_zero_3_under_tensor_parallelism_is_set_up_at_scale():
    """dp 4 x tp 2 at zero_stage=3: set-up lays the units out on the meta module and leaves them unfilled
    (a placement alone); each rank's gradients are 1/4 of its tensor-parallel share."""
    make = functools.partial(
        ParallelStrategy,
        data_parallel_size=4,
        tensor_parallel_size=2,
        plan=str(LLAMA_PLAN),
        require_sharded=0,
        zero_stage=3,
    )
    build = functools.partial(ZooLM, "hf_llama", width=16, layers=4, heads=4)
    for s in set_up_at_scale(build, make, 8):
        assert s.gradient_bytes * 4 == s.parameter_bytes, s
