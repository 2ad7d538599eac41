"""``ShardedOptimizer.state_dict()`` on 2 real gloo processes: the unsharded state is gathered to the group's
rank 0 only (the rank that writes a checkpoint), equal to one device's, and the other rank gets the
parameter groups with an empty state.

The per-rank program is this module itself (``python -m tests.distributed.test_optimizer_shards OUT``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers.harness import REPO, run_program


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).double()


def _one_device_state() -> dict:
    """AdamW's state after one step on one device: the gradient average of the two ranks' inputs (1 and 2)
    is the gradient at 1.5, the model being affine."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.full((2, 3), 1.5, dtype=torch.float64)).sum().backward()
    optimizer.step()
    return optimizer.state_dict()


def state_dict_program(out: Path) -> None:
    from lightning_parallel.distributed.optimizer_shards import ShardedOptimizer
    from lightning_parallel.distributed.zero import ShardedGradientReducer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = _model()
    reducer = ShardedGradientReducer(list(model.named_parameters()), None, stage=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    bucketed = {p for bucket in reducer.buckets for p in bucket.params}
    shards = ShardedOptimizer(optimizer, reducer.pieces(), bucketed, None)
    assert (
        all(len(bucket.params) for bucket in reducer.buckets) and len(reducer.pieces()) < 4
    )  # 2 ranks share
    reducer.prepare_for_backward()
    model(torch.full((2, 3), rank + 1.0, dtype=torch.float64)).sum().backward()
    reducer.finish_sync()
    reducer.shard_gradients()
    with shards.sharded():
        optimizer.step()
    reducer.gather_parameters()

    state = optimizer.state_dict()
    expected = _one_device_state()
    assert state["param_groups"] == expected["param_groups"], state["param_groups"]
    if rank == 0:
        assert set(state["state"]) == set(expected["state"])
        for index, entry in expected["state"].items():
            for key, value in entry.items():
                torch.testing.assert_close(state["state"][index][key], value, atol=1e-12, rtol=0)
    else:
        assert state["state"] == {}, f"rank 1 received the optimizer state of {sorted(state['state'])}"
    (out / f"ok{rank}").write_text("ok")
    dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_state_dict_gathers_to_the_groups_first_rank_only(tmp_path):
    cmd = [sys.executable, "-m", "tests.distributed.test_optimizer_shards", str(tmp_path)]
    run_program(cmd, tmp_path, timeout=40)
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()


if __name__ == "__main__":
    os.chdir(REPO)
    state_dict_program(Path(sys.argv[1]))
