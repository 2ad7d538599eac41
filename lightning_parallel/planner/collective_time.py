"""The time of one collective by the alpha-beta model: ``alpha`` seconds per message step, ``1 / beta``
seconds per byte each device sends, for the ring algorithms NCCL and gloo use at large sizes.

``size`` is always the whole tensor's bytes: an all-reduce's input, an all-gather's output, a
reduce-scatter's input, an all-to-all's input on one rank. Over ``n`` ranks:

- ring all-reduce: ``2(n - 1)`` steps, each rank sends ``2(n - 1)/n`` of the size;
- all-gather, reduce-scatter, all-to-all: ``n - 1`` steps, ``(n - 1)/n`` of the size;
- point-to-point: one message of the size.

Each uses the link's figures for that collective where the calibration measured them (``Link.of``), else
the link's message figures.
"""

from __future__ import annotations

from lightning_parallel.planner.cluster import Link

__all__ = ["all_reduce_s", "all_gather_s", "reduce_scatter_s", "all_to_all_s", "p2p_s", "ring_figures"]


def _ring(steps_per_rank: float, share: float, size: float, link: Link) -> float:
    return steps_per_rank * link.latency + share * size / link.bandwidth


def all_reduce_s(size: float, n: int, link: Link) -> float:
    """Seconds of a ring all-reduce of ``size`` bytes over ``n`` ranks."""
    return 0.0 if n <= 1 else _ring(2 * (n - 1), 2 * (n - 1) / n, size, link.of("all_reduce"))


def _exchange(name: str, size: float, n: int, link: Link) -> float:
    return 0.0 if n <= 1 else _ring(n - 1, (n - 1) / n, size, link.of(name))


def all_gather_s(size: float, n: int, link: Link) -> float:
    """Seconds of an all-gather whose gathered output is ``size`` bytes."""
    return _exchange("all_gather", size, n, link)


def reduce_scatter_s(size: float, n: int, link: Link) -> float:
    """Seconds of a reduce-scatter of a ``size``-byte input."""
    return _exchange("reduce_scatter", size, n, link)


def all_to_all_s(size: float, n: int, link: Link) -> float:
    """Seconds of an all-to-all of ``size`` bytes per rank, ``1/n`` of it kept."""
    return _exchange("all_to_all", size, n, link)


def p2p_s(size: float, link: Link) -> float:
    """Seconds of one point-to-point message of ``size`` bytes."""
    link = link.of("send_recv")
    return link.latency + size / link.bandwidth


def ring_figures(name: str, n: int, latency: float, seconds_per_byte: float) -> tuple[float, float]:
    """The link's ``(bandwidth, latency)`` for collective ``name`` with which the functions above give a
    calibration's fit over ``n`` ranks, ``latency + bytes per rank x seconds_per_byte`` (bytes per rank: an
    all-reduce's, reduce-scatter's or all-to-all's input; an all-gather's piece, ``1/n`` of its output)."""
    if name == "send_recv" or n <= 1:
        return 1.0 / seconds_per_byte, latency
    steps, share = (2 * (n - 1), 2 * (n - 1) / n) if name == "all_reduce" else (n - 1, (n - 1) / n)
    whole_per_rank = n if name == "all_gather" else 1  # the size the functions take, per byte per rank
    return share * whole_per_rank / seconds_per_byte, latency / steps
