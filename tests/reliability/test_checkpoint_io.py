"""``AtomicCheckpointIO``: a crash in the middle of writing a checkpoint leaves the previous one intact
and loadable, and leaves no temporary file behind. Every lightning_parallel strategy uses it by default."""

from __future__ import annotations

import io

import pytest
import torch

import lightning_parallel
from lightning_parallel.checkpointing import AtomicCheckpointIO
from lightning_parallel.checkpointing import atomic as ckpt_module

_real_save = torch.save


def _half_written_save(obj, f) -> None:
    """Writes the first half of the real bytes to the file, then fails as a full disk or a kill would."""
    buf = io.BytesIO()
    _real_save(obj, buf)
    data = buf.getvalue()
    f.write(data[: len(data) // 2])
    f.flush()
    raise OSError(28, "No space left on device (injected)")


@pytest.mark.timeout(60)
def test_crash_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    io_plugin = AtomicCheckpointIO()
    path = tmp_path / "ckpts" / "last.ckpt"
    first = {"state_dict": {"w": torch.arange(1000, dtype=torch.float64)}, "global_step": 4}
    io_plugin.save_checkpoint(first, path)

    monkeypatch.setattr(ckpt_module.torch, "save", _half_written_save)
    second = {"state_dict": {"w": torch.zeros(1000, dtype=torch.float64)}, "global_step": 6}
    with pytest.raises(OSError, match="injected"):
        io_plugin.save_checkpoint(second, path)
    monkeypatch.undo()

    loaded = io_plugin.load_checkpoint(path)
    assert loaded["global_step"] == 4
    assert torch.equal(loaded["state_dict"]["w"], first["state_dict"]["w"])
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"], "temporary file left behind"

    io_plugin.save_checkpoint(second, path)  # and the next save works
    assert io_plugin.load_checkpoint(path)["global_step"] == 6


@pytest.mark.timeout(60)
def test_injected_failure_would_corrupt_a_direct_write(tmp_path, monkeypatch):
    """Control: the same injected failure while writing straight to the target destroys the old file,
    so the test above can fail."""
    path = tmp_path / "last.ckpt"
    torch.save({"global_step": 4}, path)
    with pytest.raises(OSError), open(path, "wb") as f:
        _half_written_save({"global_step": 6, "w": torch.zeros(1000)}, f)
    with pytest.raises(Exception):
        torch.load(path, weights_only=False)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["lp_ddp", "lp_dp"])
def test_strategies_write_atomically_by_default(name):
    from lightning.pytorch.strategies import StrategyRegistry

    assert name in lightning_parallel.STRATEGY_NAMES
    strategy = StrategyRegistry.get(name)
    assert isinstance(strategy.checkpoint_io, AtomicCheckpointIO)
