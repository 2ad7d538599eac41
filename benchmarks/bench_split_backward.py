"""The split backward's cost: one full backward against its input part (I) and weight part (W).

    python benchmarks/bench_split_backward.py                  # GPT block, width 512, CPU, one thread
    python benchmarks/bench_split_backward.py --width 256 --rounds 9 --checkpoint

One process, one thread, float32: a GPT block (``tests.helpers.zoo.NanoBlock``) on ``batch x tokens``
positions, its input a leaf that requires grad (a pipeline stage's received activation). Each round runs
a fresh forward before each of: a full ``torch.autograd.backward``, then ``backward_input`` (I) and
``WeightGradients.run`` (W) timed apart; the variants alternate order every other round. Reported: the
median over rounds of each time and the ratios. The zero-bubble goal: I + W about the full backward, I
clearly below it. ``--checkpoint``: the block checkpointed by the package's recompute (I and W each recompute it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved  # noqa: E402  (puts this checkout on sys.path)

from lightning_parallel.pipeline.split_backward import backward_input  # noqa: E402
from lightning_parallel.recompute import apply_activation_checkpointing  # noqa: E402
from tests.helpers.zoo import NanoBlock  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--checkpoint", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    block = NanoBlock(args.width, args.heads)
    stage = torch.nn.Sequential(block)
    if args.checkpoint:
        apply_activation_checkpointing(stage, ["0"])
    x = torch.randn(args.batch, args.tokens, args.width, requires_grad=True)
    grad = torch.randn_like(x)

    def forward() -> torch.Tensor:
        return stage(x)

    times: dict[str, list[float]] = {"full": [], "I": [], "W": []}
    for round_, variant in interleaved(args.rounds + 1, ["full", "split"]):  # round 0 warms up
        y = forward()
        start = time.perf_counter()
        if variant == "full":
            torch.autograd.backward(y, grad)
            lap = {"full": time.perf_counter() - start}
        else:
            weights = backward_input([y], [grad], [x])
            middle = time.perf_counter()
            weights.run()
            lap = {"I": middle - start, "W": time.perf_counter() - middle}
        del y
        block.zero_grad(set_to_none=True)
        x.grad = None
        for key, seconds in lap.items():
            if round_ > 0:
                times[key].append(seconds)
    full, i, w = (statistics.median(times[key]) * 1e3 for key in ("full", "I", "W"))
    print(
        f"width {args.width}, {args.batch}x{args.tokens} tokens, checkpoint {args.checkpoint}, "
        f"medians of {args.rounds}: full {full:.1f} ms, I {i:.1f} ms ({i / full:.2f}), "
        f"W {w:.1f} ms ({w / full:.2f}), I+W {(i + w) / full:.2f} of full"
    )


if __name__ == "__main__":
    main()
