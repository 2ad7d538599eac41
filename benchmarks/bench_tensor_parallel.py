"""lightning_parallel's tensor parallelism vs torch DTensor ``parallelize_module`` on the same GPT.

    python benchmarks/bench_tensor_parallel.py [--steps 20] [--rounds 5] [--n-embd 128] [--n-layer 2] [--trainer]

Two CPU processes over gloo (one thread each). Both sides get the same model (the package's GPT, float32,
same seed) and the same plan: q/k/v and mlp.fc column-parallel, attention and MLP projections
row-parallel, head count divided; embeddings and head replicated. Each round times ``--steps`` training
steps (forward, cross-entropy, backward, SGD step) of ours, then of DTensor, so drifts in machine load
hit both alike. Prints each side's median step time on rank 0, their ratio (DTensor / ours; > 1 means
ours is faster), and the collectives of one step counted at the dispatcher next to the
Megatron count (2 all-reduces forward and 2 backward per transformer block). It also checks that both
sides compute the same first-step loss.

With ``--trainer`` the comparison runs one level up, as a user would: ``Trainer.fit`` of ``CharGPT``
with ``TensorParallelStrategy`` against Lightning's ``ModelParallelStrategy`` applying the same
``parallelize_module`` plan in ``configure_model`` (step time from batch start to batch end, each side
fitted ``--rounds`` times, alternating).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_parallel.distributed.rendezvous import HostedStore  # noqa: E402
from lightning_parallel.models.gpt import GPT  # noqa: E402
from lightning_parallel.tensor import apply_plan, resolve_plan  # noqa: E402

PLAN = {
    "blocks.*.attn.q": "colwise",
    "blocks.*.attn.k": "colwise",
    "blocks.*.attn.v": "colwise",
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.mlp.fc": "colwise",
    "blocks.*.mlp.proj": "rowwise",
    "blocks.*.attn.n_head": "divide",
}


def build(args: argparse.Namespace) -> GPT:
    torch.manual_seed(0)
    return GPT(
        vocab_size=128, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd
    )


def ours(args: argparse.Namespace, rank: int) -> GPT:
    model = build(args)
    apply_plan(model, resolve_plan(model, PLAN, 2), group=None, tp_rank=rank)
    return model


def dtensor(args: argparse.Namespace) -> GPT:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = build(args)
    mesh = init_device_mesh("cpu", (2,))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {k: styles[v]() for k, v in PLAN.items() if v in styles}
    parallelize_module(model, mesh, plan)
    for block in model.blocks:  # what the DTensor tutorial does by hand
        block.attn.n_head //= 2
    return model


def step(model: GPT, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


COLLECTIVES = (
    "all_reduce",
    "allreduce",
    "all_gather",
    "allgather",
    "reduce_scatter",
    "broadcast",
    "all_to_all",
    "alltoall",
)


def count_collectives(model: GPT, x: torch.Tensor, y: torch.Tensor) -> dict[str, int]:
    """Collectives issued by one forward+backward, seen at the dispatcher (c10d and functional ops alike).

    A plain dispatch mode rather than ``CommDebugMode``: the latter tracks modules with full backward
    hooks, which re-wrap every module's input and so hide that q, k and v read the same tensor."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    counts: Counter = Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            name = func._overloadpacket.__name__.strip("_")
            if any(name.startswith(c) for c in COLLECTIVES):
                counts[name] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        logits = model(x)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
    model.zero_grad(set_to_none=True)
    return dict(counts)


def worker(rank: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 128, (args.batch, args.seq), generator=g)
    y = torch.randint(0, 128, (args.batch, args.seq), generator=g)
    models = {"lightning_parallel": ours(args, rank), "torch DTensor": dtensor(args)}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    counts = {k: count_collectives(m, x, y) for k, m in models.items()}
    first = {k: step(m, opts[k], x, y) for k, m in models.items()}
    for _ in range(2):  # warm-up
        for k, m in models.items():
            step(m, opts[k], x, y)
    times: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(args.rounds):
        for k, m in models.items():
            for _ in range(args.steps):
                start = time.perf_counter()
                step(m, opts[k], x, y)
                times[k].append(time.perf_counter() - start)
    if rank == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(
            f"GPT n_layer={args.n_layer} n_embd={args.n_embd} n_head={args.n_head} batch={args.batch} seq={args.seq}, "
            f"tp=2 on 2 CPU processes (gloo, 1 thread each), {args.rounds} rounds x {args.steps} steps per side"
        )
        print(
            f"first-step loss: ours {first['lightning_parallel']:.6f}, DTensor {first['torch DTensor']:.6f}"
        )
        for k in models:
            total = sum(counts[k].values())
            print(
                f"  {k:<20} median step {med[k]:8.2f} ms   collectives per step: {counts[k]} (total {total})"
            )
        print(f"Megatron count: {4 * args.n_layer} all-reduces per step (2 forward + 2 backward per block)")
        print(
            f"ratio DTensor / ours = {med['torch DTensor'] / med['lightning_parallel']:.2f} (> 1: ours faster)"
        )
    dist.barrier()
    dist.destroy_process_group()


def trainer_worker(rank: int, args: argparse.Namespace) -> None:
    """The same comparison one level up, as a user would run it: ``Trainer.fit`` of ``CharGPT`` with
    ``TensorParallelStrategy`` vs Lightning's ``ModelParallelStrategy`` with ``parallelize_module`` in
    ``configure_model``. Step time = ``on_train_batch_start`` to ``on_train_batch_end``."""
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_parallel import TensorParallelStrategy
    from lightning_parallel.models.gpt import CharGPT

    torch.set_num_threads(1)
    os.environ.update(
        WORLD_SIZE="2",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
    )
    hp = dict(
        vocab_size=128,
        block_size=args.seq,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        optimizer="sgd",
        lr=1e-3,
    )

    class DTensorCharGPT(CharGPT):
        def configure_model(self) -> None:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
            parallelize_module(
                self.model,
                self.device_mesh["tensor_parallel"],
                {k: styles[v]() for k, v in PLAN.items() if v in styles},
            )
            for block in self.model.blocks:
                block.attn.n_head //= 2

    class Timer(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, *a: object) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, *a: object) -> None:
            self.times.append(time.perf_counter() - self.start)

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (args.batch * (args.steps + 3), args.seq + 1), generator=g)
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch)
    sides = {
        "lightning_parallel": (
            CharGPT,
            lambda: TensorParallelStrategy(plan={f"model.{k}": v for k, v in PLAN.items()}),
        ),
        "Lightning ModelParallel (DTensor)": (
            DTensorCharGPT,
            lambda: ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2),
        ),
    }
    times: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(args.rounds):
        for name, (cls, strategy) in sides.items():
            torch.manual_seed(0)
            timer = Timer()
            trainer = Trainer(
                accelerator="cpu",
                devices=2,
                strategy=strategy(),
                max_steps=args.steps + 2,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                callbacks=[timer],
            )
            trainer.fit(cls(**hp), train_dataloaders=loader)
            times[name] += timer.times[2:]  # the first steps warm up
    if rank == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(
            f"Trainer.fit of CharGPT n_layer={args.n_layer} n_embd={args.n_embd} batch={args.batch} seq={args.seq}, "
            f"tp=2 on 2 CPU processes, {args.rounds} fits x {args.steps} timed steps per side"
        )
        for k, v in med.items():
            print(f"  {k:<34} median step {v:8.2f} ms")
        ours_ms, theirs = med["lightning_parallel"], med["Lightning ModelParallel (DTensor)"]
        print(f"ratio DTensor / ours = {theirs / ours_ms:.2f} (> 1: ours faster)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument(
        "--trainer",
        action="store_true",
        help="compare inside Trainer.fit: lp_tensor_parallel vs Lightning's ModelParallelStrategy",
    )
    args = parser.parse_args()
    with HostedStore(world_size=2) as store:  # the workers inherit where it is (MASTER_ADDR/PORT)
        os.environ.update(store.env())
        mp.spawn(trainer_worker if args.trainer else worker, args=(args,), nprocs=2, join=True)


if __name__ == "__main__":
    main()
