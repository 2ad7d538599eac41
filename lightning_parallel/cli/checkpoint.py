"""``python -m lightning_parallel.cli.checkpoint consolidate [--weights-only | --no-weights-only] DIR OUT.ckpt``:
a sharded checkpoint directory (``save_distributed=True``) as one single-device ``.ckpt`` for
``load_from_checkpoint``. ``--weights-only`` as ``fit(weights_only=True)``: a directory that would run code
is refused; neither flag: what Lightning does with a single file (``checkpointing/trust.py``)."""

from __future__ import annotations

import argparse

from lightning_parallel.checkpointing.sharded import consolidate

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_parallel.cli.checkpoint",
        description="Turn a save_distributed checkpoint directory into one .ckpt file.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser(
        "consolidate", help="DIR OUT.ckpt: a single-device checkpoint for load_from_checkpoint"
    )
    c.add_argument(
        "--weights-only",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="refuse anything but tensors and plain types (for a directory you did not write); "
        "--no-weights-only trusts it; default: as Lightning loads a single file",
    )
    c.add_argument("directory")
    c.add_argument("output")
    args = parser.parse_args(argv)
    consolidate(args.directory, args.output, weights_only=args.weights_only)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
