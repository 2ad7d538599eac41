"""lightning_parallel's tensor parallelism vs torch DTensor ``parallelize_module``, model by model.

    python benchmarks/bench_tensor_parallel.py [--models gpt,llama,inline] [--rounds 5]
        [--steps 20] [--n-embd 128] [--n-layer 2] [--gpt-plan written|auto]
        [--zoo-steps 6] [--width 256] [--layers 4] [--heads 8] [--zoo-batch 4] [--zoo-seq 128]
    python benchmarks/bench_tensor_parallel.py --trainer [--trainer-model gpt|rotary] [--gpt-plan written|auto]
        [--steps 20] [--rounds 5]

Two CPU processes over gloo (one thread each), tp=2, float32, the same weights (same seed) and the same
batch on both sides; plain SGD. The models (``--models``, comma-separated):

- ``gpt``: the package's GPT (``--n-embd``/``--n-layer``/``--n-head``, ``--batch``/``--seq``). By default
  both sides get the same written plan (``PLAN``: q/k/v and mlp.fc column-parallel, attention and MLP
  projections row-parallel, head count divided; embeddings and head replicated); ``--gpt-plan auto``
  gives ours the traced automatic plan instead.
- ``llama``: a Hugging Face ``LlamaForCausalLM`` built from a ``LlamaConfig`` (no download): grouped-query
  attention (``--heads`` query heads, half as many key/value heads), SwiGLU MLP of 2 x width, RoPE,
  RMSNorm, untied head, vocabulary 128.
- ``inline``: ``InlineMLPGPT`` imported from ``tests/helpers/zoo.py`` (the tests' model zoo; run from the
  repository root): nanoGPT-style fused ``qkv`` whose forward does ``split(self.n_embd)``, and a SwiGLU
  MLP computed inline in the block's ``forward`` (``down(silu(gate(h)) * up(h))``, no MLP submodule);
  head tied to the token embedding.

``llama`` and ``inline`` use ``--width`` (default 256) x ``--layers`` (4), ``--zoo-batch`` x ``--zoo-seq``
(4 x 128) tokens per step. Ours is ``plan="auto"``: ``lightning_parallel.tensor.resolve(model, "auto",
2, run=...)``, where ``run`` computes the loss of one forward on the benchmark's batch (what the strategy
does with the first batch of ``fit``), then ``apply_plan``. The DTensor side is the Megatron plan written
by hand for that model, as torch's tutorial and torchtitan write it: q/k/v and gate/up
``ColwiseParallel``, o/down ``RowwiseParallel``, embeddings and head left whole. For ``llama`` there is no
head count to divide: transformers' ``LlamaAttention`` views its projections as ``(..., -1, head_dim)``
and repeats each key/value head ``num_key_value_groups`` (unchanged) times. For ``inline`` DTensor cannot
shard the fused ``qkv`` as the model is written (each rank's contiguous rows would hold all of q and part
of k, and ``split(256)`` would cut them wrongly), so there are two DTensor sides: ``DTensor (MLP only)``
shards gate/up/down and leaves attention replicated (the model untouched), and ``DTensor (qkv regrouped)``
permutes ``qkv.weight``'s rows before ``parallelize_module`` so that rank r's shard is [q_r; k_r; v_r],
halves ``n_embd`` and ``n_head``, and shards qkv/out too (computes the same; its parameter is no longer
laid out like the model's, so its checkpoint is not the model's).

Each round times ``--steps`` (``--zoo-steps``) training steps (forward, cross-entropy, backward, SGD step)
of every side, the order reversed every other round so drifts in machine load hit both alike. Rank 0
prints each side's median step time (wall clock) and the ratio (DTensor / ours; > 1 means ours is
faster), each round's paired ratio (how much the load moved it), the median process CPU time per step
(threads included; it leaves out the time a loaded machine keeps the process waiting), the
collectives of one forward+backward counted at the dispatcher next to the Megatron count (2 all-reduces
forward and 2 backward per block), the first-step loss of each side (they must agree) and the loss after
the warm-up steps (agreeing there shows the gradients agree too), then a markdown table of all models.

With ``--trainer`` the comparison runs one level up, as a user would: ``Trainer.fit`` of ``CharGPT``
with ``TensorParallelStrategy`` against Lightning's ``ModelParallelStrategy`` applying the same
``parallelize_module`` plan in ``configure_model`` (step time from batch start to batch end, each side
fitted ``--rounds`` times, alternating). ``--trainer-model rotary`` fits ``RotaryGPT`` instead (rotary
positions on q and k, RMSNorm, the same module names and ``PLAN``); ``--gpt-plan auto`` gives ours
``plan="auto"``. ``benchmarks/ab_tensor_parallel.py`` runs this mode on two commits, interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.nn import functional as F

REPO = Path(__file__).resolve().parents[1]
# the package from this checkout, or from another commit's (``LP_PACKAGE_ROOT``: ab_tensor_parallel.py)
sys.path[:0] = [os.environ.get("LP_PACKAGE_ROOT", str(REPO)), str(REPO)]

from lightning_parallel.distributed.rendezvous import HostedStore  # noqa: E402
from lightning_parallel.models.gpt import GPT  # noqa: E402
from lightning_parallel.tensor import apply_plan, resolve, resolve_plan  # noqa: E402
from lightning_parallel.tensor.coverage import sharded_share  # noqa: E402

VOCAB = 128
PLAN = {
    "blocks.*.attn.q": "colwise",
    "blocks.*.attn.k": "colwise",
    "blocks.*.attn.v": "colwise",
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.mlp.fc": "colwise",
    "blocks.*.mlp.proj": "rowwise",
    "blocks.*.attn.n_head": "divide",
}
LLAMA_MEGATRON = {
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}
INLINE_MLP = {"blocks.*.gate": "colwise", "blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
INLINE_MEGATRON = {"blocks.*.qkv": "colwise", "blocks.*.out": "rowwise", **INLINE_MLP}


def parallelize(model: nn.Module, plan: dict[str, str]) -> None:
    """torch's ``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel`` over both processes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(
        model, init_device_mesh("cpu", (2,)), {k: styles[v]() for k, v in plan.items() if v in styles}
    )


# --- the models ---------------------------------------------------------------------------------------


class RotaryAttention(nn.Module):
    """Causal self-attention with rotary position embeddings on q and k (``n_head`` read in forward)."""

    def __init__(self, n_embd: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.q, self.k, self.v, self.proj = (nn.Linear(n_embd, n_embd, bias=False) for _ in range(4))
        half = n_embd // n_head // 2
        angles = torch.outer(torch.arange(block_size).float(), 10000.0 ** (-torch.arange(half).float() / half))
        self.register_buffer("cos", torch.cat([angles, angles], -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat([angles, angles], -1).sin(), persistent=False)

    def rotate(self, t: Tensor) -> Tensor:
        first, second = t.chunk(2, dim=-1)
        length = t.shape[-2]
        return t * self.cos[:length] + torch.cat([-second, first], dim=-1) * self.sin[:length]

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, self.n_head, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(self.rotate(q), self.rotate(k), v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class RotaryMLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(n_embd, 4 * n_embd), nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class RotaryBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(n_embd), nn.RMSNorm(n_embd)
        self.attn, self.mlp = RotaryAttention(n_embd, n_head, block_size), RotaryMLP(n_embd)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class RotaryGPT(nn.Module):
    """A GPT with rotary positions and RMSNorm, named like the package's ``GPT`` (``PLAN`` fits both)."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.blocks = nn.ModuleList(RotaryBlock(n_embd, n_head, block_size) for _ in range(n_layer))
        self.norm = nn.RMSNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx: Tensor) -> Tensor:
        h = self.wte(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def build_gpt(args: argparse.Namespace) -> GPT:
    return GPT(
        vocab_size=VOCAB, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd
    )


def build_llama(args: argparse.Namespace) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=args.width,
        intermediate_size=2 * args.width,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads // 2,
        max_position_embeddings=args.zoo_seq,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def build_inline(args: argparse.Namespace) -> nn.Module:
    from tests.helpers.zoo import InlineMLPGPT

    return InlineMLPGPT(args.width, args.layers, args.heads, vocab=VOCAB, block=args.zoo_seq)


def logits_of(model: nn.Module, x: Tensor) -> Tensor:
    if hasattr(model, "config"):  # Hugging Face, called as users call it
        return model(input_ids=x, use_cache=False).logits
    return model(x)


def loss_of(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    logits = logits_of(model, x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# --- the sides ----------------------------------------------------------------------------------------


def dtensor_gpt(model: nn.Module) -> None:
    parallelize(model, PLAN)
    for block in model.blocks:  # what the DTensor tutorial does by hand
        block.attn.n_head //= 2


def dtensor_llama(model: nn.Module) -> None:
    parallelize(model, LLAMA_MEGATRON)
    # transformers 5 reads no head count in forward; older versions (and torchtitan's Llama) do
    for layer in model.model.layers:
        for attr in ("num_heads", "num_key_value_heads"):
            if hasattr(layer.self_attn, attr):
                setattr(layer.self_attn, attr, getattr(layer.self_attn, attr) // 2)


def dtensor_inline_mlp(model: nn.Module) -> None:
    parallelize(model, INLINE_MLP)


def dtensor_inline_regrouped(model: nn.Module) -> None:
    with torch.no_grad():
        for block in model.blocks:
            w = block.qkv.weight  # rows [q; k; v], each n_embd
            q, k, v = (t.chunk(2) for t in w.split(block.n_embd))
            # rank r's contiguous rows become q_r, k_r, v_r
            w.copy_(torch.cat([q[0], k[0], v[0], q[1], k[1], v[1]]))
            block.n_embd //= 2
            block.n_head //= 2
    parallelize(model, INLINE_MEGATRON)


@dataclass
class Case:
    name: str
    title: str
    build: Callable[[], nn.Module]
    ours_plan: object  # "auto" or a written plan
    theirs: dict[str, Callable[[nn.Module], None]]
    batch: int
    seq: int
    steps: int
    blocks: int


def cases(args: argparse.Namespace) -> list[Case]:
    zoo = {"batch": args.zoo_batch, "seq": args.zoo_seq, "steps": args.zoo_steps, "blocks": args.layers}
    size = f"{args.layers} layers x {args.width}, {args.heads} heads"
    known = {
        "gpt": Case(
            "gpt",
            f"package GPT {args.n_layer} layers x {args.n_embd}, {args.n_head} heads",
            lambda: build_gpt(args),
            "auto" if args.gpt_plan == "auto" else PLAN,
            {"DTensor": dtensor_gpt},
            args.batch,
            args.seq,
            args.steps,
            args.n_layer,
        ),
        "llama": Case(
            "llama",
            f"HF Llama {size} ({args.heads // 2} kv), SwiGLU {2 * args.width}",
            lambda: build_llama(args),
            "auto",
            {"DTensor": dtensor_llama},
            **zoo,
        ),
        "inline": Case(
            "inline",
            f"inline-MLP GPT {size}, fused qkv, SwiGLU {2 * args.width}",
            lambda: build_inline(args),
            "auto",
            {"DTensor (MLP only)": dtensor_inline_mlp, "DTensor (qkv regrouped)": dtensor_inline_regrouped},
            **zoo,
        ),
    }
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown --models {unknown}; choose from {sorted(known)}")
    return [known[n] for n in names]


def build_ours(case: Case, rank: int, x: Tensor, y: Tensor) -> tuple[nn.Module, list, str]:
    torch.manual_seed(0)
    model = case.build()
    if case.ours_plan == "auto":
        resolved = resolve(model, "auto", 2, run=lambda: loss_of(model, x, y))
        label = 'plan="auto"'
    else:
        resolved = resolve_plan(model, case.ours_plan, 2)
        label = "written plan"
    styles: dict[str, int] = {}
    for a in resolved.assignments:
        styles[a.style] = styles.get(a.style, 0) + 1
    share = sharded_share(model, resolved)
    whole = ", ".join(name for name, _ in resolved.report) or "-"
    summary = (
        f"{label}: splits {share:.0%} of the parameters; layers by style {styles}; "
        f"{len(resolved.attributes)} attributes divided; left whole: {whole}"
    )
    entries = apply_plan(model, resolved, group=None, tp_rank=rank)
    return model, entries, summary


def build_theirs(case: Case, apply: Callable[[nn.Module], None]) -> nn.Module:
    torch.manual_seed(0)
    model = case.build()
    apply(model)
    return model


def step(model: nn.Module, opt: torch.optim.Optimizer, x: Tensor, y: Tensor, entries: list) -> float:
    loss = loss_of(model, x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    for entry in entries:  # what TensorParallelStrategy does after each step
        entry.clear()
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


def count_collectives(model: nn.Module, x: Tensor, y: Tensor, entries: list) -> dict[str, int]:
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
        loss_of(model, x, y).backward()
    model.zero_grad(set_to_none=True)
    for entry in entries:
        entry.clear()
    return dict(counts)


def fmt_counts(counts: dict[str, int]) -> str:
    return " + ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "none"


def run_case(case: Case, rank: int, args: argparse.Namespace) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (case.batch, case.seq), generator=g)
    y = torch.randint(0, VOCAB, (case.batch, case.seq), generator=g)
    ours, entries, summary = build_ours(case, rank, x, y)
    sides: dict[str, tuple[nn.Module, list]] = {"ours": (ours, entries)}
    for name, apply in case.theirs.items():
        sides[name] = (build_theirs(case, apply), [])
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-2) for k, (m, _) in sides.items()}
    counts = {k: count_collectives(m, x, y, e) for k, (m, e) in sides.items()}
    first = {k: step(m, opts[k], x, y, e) for k, (m, e) in sides.items()}
    for _ in range(2):  # warm-up
        after = {k: step(m, opts[k], x, y, e) for k, (m, e) in sides.items()}
    times: dict[str, list[float]] = {k: [] for k in sides}
    cpu: dict[str, list[float]] = {k: [] for k in sides}
    per_round: dict[str, list[float]] = {k: [] for k in sides}  # each round's median, for paired ratios
    order = list(sides)
    for r in range(args.rounds):
        for k in order if r % 2 == 0 else order[::-1]:
            m, e = sides[k]
            this_round = []
            for _ in range(case.steps):
                start, start_cpu = time.perf_counter(), time.process_time()
                step(m, opts[k], x, y, e)
                this_round.append(time.perf_counter() - start)
                cpu[k].append(time.process_time() - start_cpu)
            times[k] += this_round
            per_round[k].append(statistics.median(this_round))
    rows = []
    if rank == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        med_cpu = {k: statistics.median(v) * 1e3 for k, v in cpu.items()}
        params = sum(p.numel() for p in case.build().parameters())
        print(
            f"\n== {case.name}: {case.title} ({params / 1e6:.2f} M parameters), batch {case.batch} x seq "
            f"{case.seq}, tp=2, {args.rounds} rounds x {case.steps} steps per side"
        )
        print(f"  ours: {summary}")
        for k in sides:
            print(
                f"  {k:<24} median step {med[k]:8.2f} ms (CPU {med_cpu[k]:7.2f} ms)   first-step loss "
                f"{first[k]:.6f}   loss after 3 steps {after[k]:.6f}   collectives per step: {fmt_counts(counts[k])}"
            )
        print(f"  Megatron count: {4 * case.blocks} all-reduces per step (2 forward + 2 backward per block)")
        for k in sides:
            if k != "ours":
                paired = [t / o for t, o in zip(per_round[k], per_round["ours"])]
                print(
                    f"  ratio {k} / ours = {med[k] / med['ours']:.2f} (> 1: ours faster); per round "
                    f"{' '.join(f'{p:.2f}' for p in paired)}; CPU time {med_cpu[k] / med_cpu['ours']:.2f}"
                )
                rows.append(
                    {
                        "model": case.name,
                        "title": case.title,
                        "ours": med["ours"],
                        "theirs_name": k,
                        "theirs": med[k],
                        "ratio": med[k] / med["ours"],
                        "cpu_ratio": med_cpu[k] / med_cpu["ours"],
                        "rounds": f"{min(paired):.2f}-{max(paired):.2f}",
                        "ours_counts": sum(counts["ours"].values()),
                        "theirs_counts": sum(counts[k].values()),
                        "loss": f"{first['ours']:.4f} / {first[k]:.4f}",
                    }
                )
        sys.stdout.flush()
    return rows


def worker(rank: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if rank == 0:
        print(f"command: {args.command}")
        print("tp=2 on 2 CPU processes (gloo, 1 thread each), float32, SGD")
    rows = []
    for case in cases(args):
        rows += run_case(case, rank, args)
        dist.barrier()
    if rank == 0:
        print(
            "\n| model | ours | ms/step | collectives | DTensor side | ms/step | collectives | DTensor / ours "
            "| per round | CPU time DTensor / ours | first-step loss ours / DTensor |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        ours_label = {"gpt": "auto" if args.gpt_plan == "auto" else "written plan"}
        for r in rows:
            print(
                f"| {r['title']} | {ours_label.get(r['model'], 'auto')} | {r['ours']:.1f} | {r['ours_counts']} "
                f"| {r['theirs_name']} | {r['theirs']:.1f} | {r['theirs_counts']} | **{r['ratio']:.2f}x** "
                f"| {r['rounds']} | {r['cpu_ratio']:.2f} | {r['loss']} |"
            )
    dist.barrier()
    dist.destroy_process_group()


def trainer_worker(rank: int, args: argparse.Namespace) -> None:
    """The same comparison one level up, as a user would run it: ``Trainer.fit`` of ``CharGPT`` (or, with
    ``--trainer-model rotary``, of ``RotaryGPT`` in its place) with ``TensorParallelStrategy`` vs Lightning's
    ``ModelParallelStrategy`` with ``parallelize_module`` in ``configure_model``. Step time =
    ``on_train_batch_start`` to ``on_train_batch_end``; with ``--json`` rank 0 writes each side's medians
    (wall and process CPU ms per step) there (``ab_tensor_parallel.py`` reads them)."""
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

    class RotaryCharGPT(CharGPT):
        def __init__(self, **kwargs: object) -> None:
            super().__init__(**kwargs)
            h = self.hparams
            self.model = RotaryGPT(h.vocab_size, h.block_size, h.n_layer, h.n_head, h.n_embd)

    model_class = RotaryCharGPT if args.trainer_model == "rotary" else CharGPT

    class DTensorCharGPT(model_class):  # type: ignore[valid-type,misc]
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
            self.cpu: list[float] = []

        def on_train_batch_start(self, *a: object) -> None:
            self.start, self.start_cpu = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, *a: object) -> None:
            self.times.append(time.perf_counter() - self.start)
            self.cpu.append(time.process_time() - self.start_cpu)

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (args.batch * (args.steps + 3), args.seq + 1), generator=g)
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch)
    plan = "auto" if args.gpt_plan == "auto" else {f"model.{k}": v for k, v in PLAN.items()}
    sides = {
        "lightning_parallel": (model_class, lambda: TensorParallelStrategy(plan=plan)),
        "Lightning ModelParallel (DTensor)": (
            DTensorCharGPT,
            lambda: ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2),
        ),
    }
    times: dict[str, list[float]] = {k: [] for k in sides}
    cpu: dict[str, list[float]] = {k: [] for k in sides}
    for r in range(args.rounds):
        order = list(sides) if (r + args.reverse) % 2 == 0 else list(sides)[::-1]
        for name in order:
            cls, strategy = sides[name]
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
            cpu[name] += timer.cpu[2:]
    if rank == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        if args.json:
            med_cpu = {k: statistics.median(v) * 1e3 for k, v in cpu.items()}
            Path(args.json).write_text(json.dumps({"ms": med, "cpu_ms": med_cpu}))
        print(
            f"Trainer.fit of {model_class.__name__} ({args.gpt_plan} plan) n_layer={args.n_layer} "
            f"n_embd={args.n_embd} batch={args.batch} seq={args.seq}, "
            f"tp=2 on 2 CPU processes, {args.rounds} fits x {args.steps} timed steps per side"
        )
        for k, v in med.items():
            print(f"  {k:<34} median step {v:8.2f} ms")
        ours_ms, theirs = med["lightning_parallel"], med["Lightning ModelParallel (DTensor)"]
        print(f"ratio DTensor / ours = {theirs / ours_ms:.2f} (> 1: ours faster)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,llama,inline", help="comma-separated: gpt, llama, inline")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="steps per side per round (gpt, --trainer)")
    parser.add_argument("--n-layer", type=int, default=2, help="gpt")
    parser.add_argument("--n-embd", type=int, default=128, help="gpt")
    parser.add_argument("--n-head", type=int, default=4, help="gpt")
    parser.add_argument("--batch", type=int, default=8, help="gpt")
    parser.add_argument("--seq", type=int, default=64, help="gpt")
    parser.add_argument("--gpt-plan", choices=("written", "auto"), default="written", help="ours on gpt")
    parser.add_argument("--zoo-steps", type=int, default=6, help="steps per side per round (llama, inline)")
    parser.add_argument("--width", type=int, default=256, help="llama, inline")
    parser.add_argument("--layers", type=int, default=4, help="llama, inline")
    parser.add_argument("--heads", type=int, default=8, help="llama (kv heads: half), inline")
    parser.add_argument("--zoo-batch", type=int, default=4, help="llama, inline")
    parser.add_argument("--zoo-seq", type=int, default=128, help="llama, inline")
    parser.add_argument(
        "--trainer",
        action="store_true",
        help="compare inside Trainer.fit: lp_tensor_parallel vs Lightning's ModelParallelStrategy (gpt)",
    )
    parser.add_argument(
        "--trainer-model", choices=("gpt", "rotary"), default="gpt", help="--trainer: CharGPT or RotaryGPT"
    )
    parser.add_argument("--reverse", type=int, default=0, help=argparse.SUPPRESS)  # start with the other side
    parser.add_argument("--json", default="", help=argparse.SUPPRESS)  # --trainer: medians written here
    args = parser.parse_args()
    args.command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])
    with HostedStore(world_size=2) as store:  # the workers inherit where it is (MASTER_ADDR/PORT)
        os.environ.update(store.env())
        mp.spawn(trainer_worker if args.trainer else worker, args=(args,), nprocs=2, join=True)


if __name__ == "__main__":
    main()
