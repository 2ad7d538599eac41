"""The layout planner: predict each layout's step time and memory per rank, rank them, check against runs."""

from lightning_parallel.planner.cluster import Cluster, Link

__all__ = ["Cluster", "Link"]
