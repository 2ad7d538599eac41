"""Example data: the embedded default corpus of ``lp-train``."""

from lightning_parallel.data.chars import CharCorpusData, load_corpus

__all__ = ["CharCorpusData", "load_corpus"]
