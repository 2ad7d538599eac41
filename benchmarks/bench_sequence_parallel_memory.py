"""Peak resident memory per rank with and without sequence parallelism, phase by phase.

    MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/bench_sequence_parallel_memory.py true   # and false
        [--steps 3] [--width 384] [--layers 8] [--heads 6] [--seq 256] [--batch 8] [--recompute true]

Two CPU processes (Lightning's launcher, one thread each), tp = 2, the package's GPT with the written
``char_gpt`` plan, AdamW, float32 (``--recompute``: the strategy's ``activation_checkpointing``, true,
selective or false). Each rank prints, per training step, the peak resident memory (``VmHWM``, lowered to
the resident memory at each phase's start) of the forward, backward, clipping and optimizer step, in MiB,
then the memory report's table (whose peak RSS is therefore the last phase's). With glibc,
``MALLOC_MMAP_THRESHOLD_`` fixed makes freed tensors leave the resident set, so the figures follow what is
allocated rather than what the heap retained.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
from common import QUIET_TRAINER  # noqa: E402
from lightning.pytorch import Callback, Trainer  # noqa: E402

from lightning_parallel import TensorParallelStrategy  # noqa: E402
from lightning_parallel.memory.accounting import peak_rss_bytes, reset_peak_rss  # noqa: E402
from lightning_parallel.models.gpt import CharGPT  # noqa: E402
from tests.helpers.tp_models import TokenData  # noqa: E402


class Phases(Callback):
    """The peak resident memory of each phase of a training step, printed per rank."""

    def __init__(self, label: str) -> None:
        self.label, self.peaks = label, {}

    def _mark(self, phase: str) -> None:
        self.peaks[phase] = peak_rss_bytes() / 2**20
        reset_peak_rss()

    def on_train_batch_start(self, *args) -> None:
        self.peaks = {}
        reset_peak_rss()

    def on_before_backward(self, *args) -> None:
        self._mark("forward")

    def on_after_backward(self, *args) -> None:
        self._mark("backward")

    def on_before_optimizer_step(self, *args) -> None:
        self._mark("clip")

    def on_train_batch_end(self, trainer, *args) -> None:
        self._mark("step")
        peaks = " ".join(f"{k} {v:.0f}" for k, v in self.peaks.items())
        print(f"rank {trainer.global_rank} {self.label}: {peaks} MiB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("sequence_parallel", choices=["true", "false"])
    for name, default in (
        ("steps", 3),
        ("width", 384),
        ("layers", 8),
        ("heads", 6),
        ("seq", 256),
        ("batch", 8),
    ):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--recompute", choices=["true", "selective", "false"], default="false")
    args = parser.parse_args()
    os.chdir(REPO)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = CharGPT(
        vocab_size=128, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.width
    )
    strategy = TensorParallelStrategy(
        plan=str(REPO / "conf/plan/char_gpt.yaml"),
        sequence_parallel=args.sequence_parallel == "true",
        activation_checkpointing={"true": True, "false": False}.get(args.recompute, args.recompute),
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        **QUIET_TRAINER,
        callbacks=[Phases(f"sequence_parallel={args.sequence_parallel} recompute={args.recompute}")],
    )
    data = TokenData(batch_size=args.batch, n=8 * args.batch, block_size=args.seq, vocab_size=128)
    trainer.fit(model, datamodule=data)


if __name__ == "__main__":
    main()
