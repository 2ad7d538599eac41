"""The autograd-aware collectives on 2 real gloo processes: each operator's forward and backward, the
collective counts, and global-norm clipping of sharded gradients.

The per-rank program is this module itself (``python -m tests.distributed.test_collectives OUT``); it
asserts on every rank and writes a marker, and the test checks both ranks finished."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers.harness import REPO, run_processes, run_program, worker_env


def rank_program(out: Path) -> None:
    from lightning_parallel.distributed.collectives import (
        COUNTS,
        clip_grad_norm_counted,
        copy_to_group,
        gather_from_group,
        reduce_from_group,
        share_found_inf,
        split_to_group,
    )

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, check = dist.get_rank(), torch.testing.assert_close
    weights = [torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])]

    x = torch.tensor([3.0, 4.0], requires_grad=True)  # identity forward, all-reduce backward
    y = copy_to_group(x, None)
    check(y, x)
    (y * weights[rank]).sum().backward()
    check(x.grad, weights[0] + weights[1])

    x = torch.tensor([1.0, 2.0]) * (rank + 1)  # all-reduce forward, identity backward
    x.requires_grad_()
    y = reduce_from_group(x, None)
    check(y, torch.tensor([3.0, 6.0]))
    (y * weights[rank]).sum().backward()
    check(x.grad, weights[rank])

    x = torch.full((2, 2), float(rank), requires_grad=True)  # all-gather forward, split backward
    y = gather_from_group(x, None, -1)
    check(y, torch.tensor([[0.0, 0.0, 1.0, 1.0]] * 2))
    g = torch.arange(8.0).view(2, 4)
    y.backward(g)
    check(x.grad, g.chunk(2, -1)[rank])

    x = torch.arange(8.0).view(2, 4).requires_grad_()  # split forward, all-gather backward
    y = split_to_group(x, None, -1)
    check(y, x.detach().chunk(2, -1)[rank])
    y.backward(torch.full_like(y, float(rank + 1)))
    check(x.grad, torch.tensor([[1.0, 1.0, 2.0, 2.0]] * 2))
    assert COUNTS["all_reduce"] == 2 and COUNTS["all_gather"] == 2, dict(COUNTS)

    # global-norm clipping: a weight split in two plus a replicated bias, against the unsharded norm
    full_w, bias = torch.arange(1.0, 7.0), torch.tensor([2.0, -1.0])
    shard = torch.nn.Parameter(full_w.chunk(2)[rank].clone())
    shard.grad = full_w.chunk(2)[rank].clone()
    b = torch.nn.Parameter(bias.clone())
    b.grad = bias.clone()
    # the shard counted by each holder, the replicated bias by rank 0
    total = clip_grad_norm_counted([shard, b], 1.0, {id(shard)} | ({id(b)} if rank == 0 else set()), None)
    expected = torch.cat([full_w, bias]).norm()
    check(total, expected)
    check(shard.grad, full_w.chunk(2)[rank] / (expected + 1e-6))
    check(b.grad, bias / (expected + 1e-6))
    # fp16 loss scaling: an overflow in one rank's shard makes every rank skip the step
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    share_found_inf(scaler, None)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scale = torch.tensor([1.0, float("inf") if rank == 1 else 2.0])
    scaler.scale((p * scale).sum()).backward()
    scaler.step(opt)
    scaler.update()
    check(p.detach(), torch.ones(2))  # skipped on rank 0 too, though its gradient was finite
    assert scaler.get_scale() == 8.0
    check_gradient_reductions(rank)
    (out / f"ok{rank}").write_text("ok")
    dist.destroy_process_group()


def clip_without_gradients_program(out: Path) -> None:
    """Rank 1's parameters have no ``.grad``, rank 0's have: both return from clipping (no rank waits in
    a collective the other skipped) with the norm over both ranks, and rank 0 is clipped by it."""
    import time
    from datetime import timedelta

    from lightning_parallel.distributed.collectives import clip_grad_norm_counted

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=5))
    rank = dist.get_rank()
    shard = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    bias = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    grad = torch.tensor([3.0, 4.0, 12.0], dtype=torch.float64)
    if rank == 0:
        shard.grad = grad.clone()
    start = time.monotonic()
    total = clip_grad_norm_counted(
        [shard, bias], 1.0, {id(shard)} | ({id(bias)} if rank == 0 else set()), None
    )
    dist.barrier()  # a rank that skipped the norm's all-reduce meets the other one here: both time out
    assert time.monotonic() - start < 5.0
    torch.testing.assert_close(total, torch.tensor(13.0, dtype=torch.float64))
    if rank == 0:
        torch.testing.assert_close(shard.grad, grad / (13.0 + 1e-6))
    else:
        assert shard.grad is None and bias.grad is None
    (out / f"ok{rank}").write_text("ok")
    dist.destroy_process_group()


def host_buffers_program(out: Path) -> None:
    """Sequence parallelism's all-gather and reduce-scatter along the sequence on gloo: equal to gloo's own
    collectives, and the only whole-size buffer a gather allocates is its result (gloo's all-gather staged
    the parts in buffers of its own, and the concatenation was one more), a reduce-scatter one copy of its
    input besides its part (gloo's reduce-scatter clones the input; moving the sequence to the front was
    one more). Counted by the profiler: the bytes each operation keeps allocated when it returns."""
    from lightning_parallel.distributed.collectives import all_gather_dim, reduce_scatter_dim

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    part = torch.randn(4, 64, 32, generator=torch.Generator().manual_seed(rank))
    whole = torch.randn(4, 128, 32, generator=torch.Generator().manual_seed(10 + rank))
    parts = [torch.empty_like(part) for _ in range(2)]
    dist.all_gather(parts, part)
    summed = whole.clone()
    dist.all_reduce(summed)

    def allocated(collective):
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        ) as p:
            result = collective()
        return result, sum(max(e.self_cpu_memory_usage, 0) for e in p.events())

    gathered, gather_bytes = allocated(lambda: all_gather_dim(part, None, 1))
    assert torch.equal(gathered, torch.cat(parts, 1))
    scattered, scatter_bytes = allocated(lambda: reduce_scatter_dim(whole, None, 1))
    assert torch.equal(scattered, summed.chunk(2, 1)[rank])
    assert gather_bytes == whole.nbytes, (gather_bytes, whole.nbytes)
    assert scatter_bytes == whole.nbytes + part.nbytes, (scatter_bytes, whole.nbytes + part.nbytes)
    (out / f"ok{rank}").write_text("ok")
    dist.destroy_process_group()


def check_gradient_reductions(rank: int) -> None:
    """``replicas.start_gradient_sum``: a parameter only one rank has a gradient for gets it on both,
    one no rank has stays None; two reductions in flight at once finish in either order."""
    from lightning_parallel.distributed.replicas import start_gradient_sum

    check = torch.testing.assert_close
    params = [
        torch.nn.Parameter(torch.zeros(2)),
        torch.nn.Parameter(torch.zeros(3, dtype=torch.float64)),
        torch.nn.Parameter(torch.zeros(1)),
    ]
    first = [torch.full((2,), rank + 1.0), torch.ones(3, dtype=torch.float64) if rank == 0 else None, None]
    second = [torch.full((2,), 10.0 * (rank + 1)), None, None]
    finish_first = start_gradient_sum(params, first, None)
    finish_second = start_gradient_sum(params, second, None)
    got_second, got_first = finish_second(), finish_first()
    check(got_first[0], torch.full((2,), 3.0))
    check(got_first[1], torch.ones(3, dtype=torch.float64))  # rank 1 had none: it gets rank 0's
    assert got_first[2] is None
    check(got_second[0], torch.full((2,), 30.0))
    check(first[0], torch.full((2,), rank + 1.0))  # the inputs are left as they were


@pytest.mark.timeout(120)
def test_conjugate_collectives_on_two_processes(tmp_path):
    cmd = [sys.executable, "-m", "tests.distributed.test_collectives", str(tmp_path)]
    run_program(cmd, tmp_path, timeout=90)
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()


@pytest.mark.timeout(60)
def test_clipping_returns_on_every_rank_when_one_has_no_gradients(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "tests.distributed.test_collectives",
        str(tmp_path),
        "clip_without_gradients",
    ]
    run_program(cmd, tmp_path, timeout=30)
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()


@pytest.mark.timeout(60)
def test_sequence_collectives_on_gloo_allocate_no_whole_size_temporaries(tmp_path):
    cmd = [sys.executable, "-m", "tests.distributed.test_collectives", str(tmp_path), "host_buffers"]
    run_processes([cmd, cmd], [worker_env(r, 2) for r in range(2)], timeout=30, cwd=tmp_path, rendezvous=True)
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()


def reducer_program(out: Path) -> None:
    """``GradientReducer``: with ``hooks=False``, ``average_now`` averages what ``.grad`` holds (a parameter
    no rank has a gradient for keeps none); with hooks, a parameter unused in the first synchronised step
    gets a bucket of its own, so the others' buckets are sent from the hooks of the next backwards."""
    from lightning_parallel.distributed.reducer import GradientReducer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, check = dist.get_rank(), torch.testing.assert_close
    a, b, c = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    later = GradientReducer([("a", a), ("b", b), ("c", c)], hooks=False, find_unused_parameters=True)
    a.grad, b.grad = torch.full((2,), float(rank)), (torch.ones(2) if rank == 0 else None)
    later.average_now()
    check(a.grad, torch.full((2,), 0.5))
    check(b.grad, torch.full((2,), 0.5))  # rank 1 had none: it takes part with zeros
    assert c.grad is None and later.stats.launched_in_backward == 0

    hooked = GradientReducer([("a", a), ("b", b), ("c", c)], find_unused_parameters=True)
    for step in range(2):
        a.grad = b.grad = None  # the optimizer's zero_grad
        hooked.prepare_for_backward()
        (a.sum() * (rank + 1) + b.sum()).backward()  # c never gets a gradient
        hooked.finish_sync()
    assert hooked.bucket_names()[-1] == ["c"], hooked.bucket_names()
    assert hooked.stats.launched_in_backward >= 1  # the second step: a and b's bucket, from b's hook
    check(a.grad, torch.full((2,), 1.5))
    assert c.grad is None
    (out / f"ok{rank}").write_text("ok")
    dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_reducer_averages_now_and_buckets_unused_parameters_apart(tmp_path):
    cmd = [sys.executable, "-m", "tests.distributed.test_collectives", str(tmp_path), "reducer"]
    run_program(cmd, tmp_path, timeout=30)
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()


PROGRAMS = {
    "all": rank_program,
    "clip_without_gradients": clip_without_gradients_program,
    "reducer": reducer_program,
    "host_buffers": host_buffers_program,
}

if __name__ == "__main__":
    os.chdir(REPO)
    PROGRAMS[sys.argv[2] if len(sys.argv) > 2 else "all"](Path(sys.argv[1]))
