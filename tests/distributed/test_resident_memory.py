"""Resident memory the package hands back or never takes, on 2 real gloo processes:

- making the replicas equal at set-up (``replicas.broadcast_tensors``) broadcasts large tensors in place,
  with no flat copy of the whole model (it held the model twice per rank);
- ``zero_stage=3``'s units, gathered and freed again and again (as every step does twice per block) with
  small tensors allocated in between that pin glibc's heap, leave no freed unit in the resident memory, and
  a gathered unit holds its values again.

The per-rank program is this module itself (``python -m tests.distributed.test_resident_memory OUT``)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.helpers.harness import run_program

MIB = 2**20


def broadcast_peak() -> None:
    from lightning_parallel.distributed.replicas import broadcast_tensors
    from lightning_parallel.memory.accounting import peak_rss_bytes, reset_peak_rss, rss_bytes

    tensors = [torch.full((2 * MIB,), float(dist.get_rank())) for _ in range(8)]  # 8 x 8 MiB, resident
    total = sum(t.numel() * t.element_size() for t in tensors)
    assert reset_peak_rss()
    start = rss_bytes()
    broadcast_tensors(tensors, src=0)
    grown = peak_rss_bytes() - start
    assert all(bool((t == 0).all()) for t in tensors)
    assert grown < total / 4, (grown, total)  # no flat copy of them all (the copy alone: total)


def freed_units_leave() -> None:
    from lightning_parallel.distributed.zero3 import ShardedParameters
    from lightning_parallel.memory.accounting import rss_bytes
    from lightning_parallel.memory.report import parameter_bytes
    from lightning_parallel.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=512)  # blocks of 12 MiB in float32
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sharded = ShardedParameters(model, None, dist.new_group())
    unit_bytes = sum(u.full.numel() * u.full.element_size() for u in sharded.units())
    pins, start = [], rss_bytes()
    for _ in range(4):
        sharded.gather_all()
        pins.append(torch.ones(2**16))  # 256 KiB above the gathered units in the heap
        sharded.free_all()
    grown = rss_bytes() - start
    assert grown < 0.25 * unit_bytes, (grown, unit_bytes)
    shards = sum(u.shard.numel() * u.shard.element_size() for u in sharded.units())
    small = [u for u in sharded.units() if u.mapped is None]  # freed by resizing their storage to nothing
    assert len(small) < len(sharded.units())  # the blocks are mapped
    held = parameter_bytes(model.parameters(), sharded.held_tensors(), sharded.released_tensors())
    assert held == shards, (held, shards)  # what the memory report counts: the shards, not the freed units
    sharded.gather_all()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def resident_program(out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    broadcast_peak()
    freed_units_leave()
    (out / f"ok{dist.get_rank()}").write_text("ok")
    dist.destroy_process_group()


def test_set_up_and_zero3_units_hold_no_more_than_they_need(tmp_path):
    cmd = [sys.executable, "-m", "tests.distributed.test_resident_memory", str(tmp_path)]
    run_program(cmd, tmp_path, timeout=240)
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()


if __name__ == "__main__":
    resident_program(Path(sys.argv[1]))
