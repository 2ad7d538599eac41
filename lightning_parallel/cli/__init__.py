"""Command-line entry points: ``lp-train`` (``train.py``) with its run and sweep summaries, and
``python -m lightning_parallel.cli.<name>`` for ``checkpoint`` (consolidate), ``plan_table`` and
``verify``."""

__all__ = ["main"]


def main() -> None:
    """``lp-train`` (imported lazily so ``import lightning_parallel.cli`` stays cheap)."""
    from lightning_parallel.cli.train import main as _main

    _main()
