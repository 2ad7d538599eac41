"""Example models: the embedded default of ``lp-train`` and small models for tests and benchmarks."""

from lightning_parallel.models.gpt import GPT, CharGPT

__all__ = ["GPT", "CharGPT"]
