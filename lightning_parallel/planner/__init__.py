"""The layout planner: predict each layout's step time and memory per rank, rank them, check against runs
(docs/planner.md). ``planner.layouts`` (every layout of N devices, with the strategies' refusals) and the
command (``python -m lightning_parallel.planner``) import the strategies; these names do not."""

from lightning_parallel.planner.cluster import Cluster, Link
from lightning_parallel.planner.cost_model import BlockCost, ModelCost, Prediction, predict
from lightning_parallel.planner.layout import Layout

__all__ = ["Cluster", "Link", "BlockCost", "ModelCost", "Prediction", "predict", "Layout"]
