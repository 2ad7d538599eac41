"""Functions the worker calls after fit (case option ``probe``) to report what a strategy did inside."""

from dataclasses import asdict


def reducer_stats(trainer) -> dict:
    reducer = trainer.strategy.reducer
    return {**asdict(reducer.stats), "bucket_names": reducer.bucket_names()}
