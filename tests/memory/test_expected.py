"""The expected memory per rank: the ZeRO paper's model states by optimizer, precision and stage, and the
activations a block keeps under tensor and sequence parallelism and recompute (Korthikanti et al.)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_parallel.distributed.mesh import MeshShape
from lightning_parallel.memory.callback import expected_states
from lightning_parallel.memory.expected import (
    block_activation_bytes,
    model_state_bytes,
    optimizer_kind,
    state_bytes_for,
)


def test_states_per_optimizer_and_stage() -> None:
    fp32 = state_bytes_for("32-true")
    assert model_state_bytes(100, 4, 0, "sgd", fp32).total == 800  # parameters and gradients
    assert model_state_bytes(100, 4, 0, "sgd_momentum", fp32).total == 1200
    adamw = [model_state_bytes(100, 4, z, "adamw", fp32) for z in range(4)]
    assert [s.optimizer for s in adamw] == [800, 200, 200, 200]
    assert [s.gradients for s in adamw] == [400, 400, 100, 100]
    assert [s.parameters for s in adamw] == [400, 400, 400, 100]
    assert state_bytes_for("64-true").parameter == 8 and state_bytes_for("bf16-mixed").parameter == 4
    with pytest.raises(ValueError, match="zero_stage=4"):
        model_state_bytes(100, 4, 4, "adamw", fp32)


def test_optimizer_kinds() -> None:
    p = [nn.Parameter(torch.zeros(2))]
    assert optimizer_kind(torch.optim.SGD(p, lr=0.1)) == "sgd"
    assert optimizer_kind(torch.optim.SGD(p, lr=0.1, momentum=0.9)) == "sgd_momentum"
    assert optimizer_kind(torch.optim.AdamW(p)) == "adamw"
    with pytest.raises(ValueError, match="LBFGS"):
        optimizer_kind(torch.optim.LBFGS(p))


def test_block_activations_after_korthikanti() -> None:
    """34 sbh per block: 10 stay whole on each of t ranks without sequence parallelism, 24 split."""
    assert block_activation_bytes(34, 0, 1, 1, False, False) == pytest.approx(34)
    assert block_activation_bytes(34, 0, 1, 2, False, False) == pytest.approx(10 + 12)
    assert block_activation_bytes(34, 0, 1, 2, True, False) == pytest.approx(17)
    assert block_activation_bytes(34, 0, 1, 2, True, True) == pytest.approx(0.5)  # the input, cut
    assert block_activation_bytes(44, 10, 1, 2, False, "selective") == pytest.approx(22)


def test_the_reports_expected_column_reads_the_strategys_layout() -> None:
    module = nn.Linear(10, 10)  # 110 elements
    strategy = SimpleNamespace(mesh=SimpleNamespace(shape=MeshShape(dp=2)), zero_stage=1)
    trainer = SimpleNamespace(
        strategy=strategy, optimizers=[torch.optim.AdamW(module.parameters())], world_size=2
    )
    assert expected_states(trainer, module) == 110 * (4 + 4) + 110 * 8 // 2
    trainer.optimizers = [torch.optim.LBFGS(module.parameters())]
    assert expected_states(trainer, module) is None


def test_no_expected_states_for_dtensor_parameters() -> None:
    """FSDP2's ``fully_shard`` (under Lightning's ``ModelParallelStrategy``) leaves DTensor parameters whose
    ``numel`` is the whole tensor's: the column would read the unsharded states, so it is left empty. A
    parameter with a local tensor (what the report reads of a DTensor) stands in for one."""
    module = nn.Linear(10, 10)
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(), optimizers=[torch.optim.AdamW(module.parameters())], world_size=1
    )
    assert expected_states(trainer, module) == 110 * 16
    module.weight._local_tensor = torch.zeros(50)
    assert expected_states(trainer, module) is None
