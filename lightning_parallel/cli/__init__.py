"""Command-line entry points: ``lp-train`` (``cli/train.py``) and the sweep summary (``cli/sweep.py``)."""

__all__ = ["main"]


def main() -> None:
    """``lp-train`` (imported lazily so ``import lightning_parallel.cli`` stays cheap)."""
    from lightning_parallel.cli.train import main as _main

    _main()
