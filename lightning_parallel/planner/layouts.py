"""Every layout of N devices the strategies could run, each predicted or excluded with its reason.

A layout is excluded when its sizes do not divide (the devices, the global batch, the blocks among the
stages), when the strategy refuses it (``ParallelStrategy``'s own option checks, ``strategies.checks.layout``
and the schedule's ``schedule_problem``: the same functions its constructor, ``check_before_launch`` and
``lp-train``'s validation call, with their words), or when its predicted peak does not fit a device's
memory. The async schedule is not enumerated: it changes the update rule (PipeDream-2BW), which a planner
should not choose for the user.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

from lightning_parallel.pipeline.executor import loader_problem
from lightning_parallel.pipeline.schedules import SCHEDULES, chunks_per_rank, schedule_problem
from lightning_parallel.planner.cluster import Cluster
from lightning_parallel.planner.cost_model import ModelCost, Prediction, predict
from lightning_parallel.planner.layout import Layout
from lightning_parallel.strategies.checks import layout as layout_problem
from lightning_parallel.strategies.options import option_problems
from lightning_parallel.strategies.parallel import ParallelStrategy

__all__ = [
    "Excluded",
    "Plan",
    "candidate_layouts",
    "layout_refusal",
    "plan_layouts",
    "NOT_DIVISIBLE",
    "REFUSED",
    "NO_FIT",
]

NOT_DIVISIBLE, REFUSED, NO_FIT = "not divisible", "refused by the strategy", "does not fit"
RECOMPUTE: tuple[Union[bool, str], ...] = (False, True, "selective")
ZERO = (0, 1, 2, 3)


@dataclass(frozen=True)
class Excluded:
    """A layout left out: ``kind`` is NOT_DIVISIBLE, REFUSED or NO_FIT; ``problems`` in the strategy's words
    (or ours for the other kinds), each a sentence."""

    layout: Layout
    kind: str
    problems: tuple[str, ...]

    @property
    def reason(self) -> str:
        return "; ".join(self.problems)


@dataclass(frozen=True)
class Plan:
    """The predicted layouts, fastest first, and the excluded ones."""

    ranked: list[Prediction]
    excluded: list[Excluded]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(
    devices: int,
    global_batch: int,
    experts: bool = False,
    selective: bool = True,
    microbatch_factors: Sequence[int] = (1, 2, 4),
    max_tp: Optional[int] = None,
) -> Iterator[Layout]:
    """Every combination of the axes on ``devices``: dp x tp x pp = devices with tp at most ``max_tp`` (a
    node's devices: tensor parallelism's collectives on every block stay within a node, as Megatron keeps
    them), ep dividing dp when the model has experts, each synchronous schedule with ``pp x factor``
    micro-batches, ZeRO 0-3 where dp > 1, recompute off, full and (``selective``: when the attention core's
    share is known) selective, sequence parallelism where tp > 1."""
    recomputes = RECOMPUTE if selective else RECOMPUTE[:2]
    for tp, pp in itertools.product(_divisors(devices), repeat=2):
        if devices % (tp * pp) or tp > (max_tp or devices):
            continue
        dp = devices // (tp * pp)
        pipelines = (
            [("1f1b", 1, 1)]
            if pp == 1
            else [
                (name, chunks_per_rank(name), pp * f)
                for name in SCHEDULES
                if name != "async"
                for f in microbatch_factors
            ]
        )
        for ep in _divisors(dp) if experts else [1]:
            for (schedule, v, m), zero, recompute, sp in itertools.product(
                pipelines, ZERO if dp > 1 else (0,), recomputes, (False, True) if tp > 1 else (False,)
            ):
                yield Layout(dp, tp, pp, global_batch, ep, schedule, m, v, zero, recompute, sp)


def layout_refusal(layout: Layout, blocks: int) -> Optional[Excluded]:
    """Why ``layout`` cannot run a model of ``blocks`` blocks, in the strategy's own words, or None."""
    world = layout.devices
    if layout.global_batch % layout.dp:
        reason = f"global batch {layout.global_batch} does not divide over dp={layout.dp} replicas"
        return Excluded(layout, NOT_DIVISIBLE, (reason,))
    if layout.pp * layout.virtual_stages > blocks:
        chunks = layout.pp * layout.virtual_stages
        reason = f"{layout.pp} x {layout.virtual_stages} pipeline chunks need {chunks} blocks; the model has {blocks}"
        return Excluded(layout, NOT_DIVISIBLE, (reason,))
    options = layout.strategy_options()
    found = option_problems(ParallelStrategy, options)
    sizes = {name: options[name] for name in ParallelStrategy.size_options}
    found.append(layout_problem(world, f"{world} devices", sizes))
    if layout.pp > 1:
        found.append(
            schedule_problem(layout.schedule, layout.pp, layout.num_microbatches, layout.virtual_stages)
        )
        replica_batch = layout.global_batch // layout.dp
        found.append(loader_problem(replica_batch, replica_batch, True, layout.num_microbatches))
    found = [p for p in found if p]
    return Excluded(layout, REFUSED, tuple(found)) if found else None


def plan_layouts(
    model: ModelCost,
    cluster: Cluster,
    devices: int,
    global_batch: int,
    memory: Optional[float] = None,
    precision: str = "32-true",
) -> Plan:
    """Every candidate layout of ``devices`` predicted on ``cluster`` (``memory`` bytes per device, default
    the cluster's), fastest first, and the excluded ones with their reasons."""
    if devices > cluster.devices:
        raise ValueError(f"--devices {devices} is more than the cluster's {cluster.devices} ({cluster.name})")
    limit = cluster.memory if memory is None else memory
    experts = any(b.expert_parameter_bytes for b in model.blocks)
    selective = any(b.attention_bytes for b in model.blocks)
    ranked, excluded = [], []
    for layout in candidate_layouts(
        devices, global_batch, experts, selective, max_tp=cluster.devices_per_node
    ):
        refusal = layout_refusal(layout, len(model.blocks))
        if refusal is not None:
            excluded.append(refusal)
            continue
        prediction = predict(model, layout, cluster, precision)
        if prediction.peak_bytes > limit:
            reason = f"peak {prediction.peak_bytes / 2**30:.3g} GiB per rank > {limit / 2**30:.3g} GiB"
            excluded.append(Excluded(layout, NO_FIT, (reason,)))
            continue
        ranked.append(prediction)
    ranked.sort(key=lambda p: (p.step_s, p.peak_bytes))
    return Plan(ranked, excluded)
