"""``lp-train strategy=auto``: the layout planner chooses the run's layout before anything is launched.

The launching process measures the run's model on its first training batch here (``planner.planning``),
predicts every layout of ``trainer.devices x trainer.num_nodes`` on the cluster (``planner.cluster``, a
calibration, or this machine), keeps those with the options the user fixed (``strategy.zero_stage=1``:
``planner.constraints``), logs the ranked table and why the chosen one, and composes the run's config again
with the chosen layout's overrides in place of ``strategy=auto`` (``Layout.overrides``): the run is the one
``lp-train <those overrides>`` would be. ``planner.rank`` chooses which of the ranking (1: the fastest);
``planner.top_k=k`` under ``-m`` sweeps ``planner.rank`` over 1..k (``conf/strategy/auto.yaml``).

The plan is written to ``planner.json`` in the job's folder: the ranks the launcher starts and a resumed run
(same folder) read it instead of planning again, so every rank trains the same layout. The jobs of one
sweep share one plan per planning input (``<sweep dir>/planner/<key>.json``), so ``planner.rank=1..k`` are k
different layouts of one ranking. At the end, ``compare`` puts the prediction beside the run's median step
time and its busiest rank's parameters + gradients + optimizer state + activations (the memory report's
measured columns, the cost model's memory side).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf

from lightning_parallel.config.schema import AutoStrategyConf

__all__ = [
    "PLAN_FILE",
    "RESOLVER",
    "chosen_overrides",
    "auto_problems",
    "compare",
    "fixed_options",
    "global_batch",
    "is_auto",
    "plan_and_compose",
    "register_planner_ranks",
]

log = logging.getLogger("lp-train")

#: how the run builds a user's class from its config node and section ("model", "data")
Build = Callable[[DictConfig, str], Any]

#: the plan of a job, in its folder
PLAN_FILE = "planner.json"
#: ``${lp_planner_ranks:k}``: "1,2,...,k", the sweep of ``planner.rank`` that ``planner.top_k`` asks for
RESOLVER = "lp_planner_ranks"
#: predictions kept in a plan (the ranks a job may ask for)
KEPT = 50
MIB = 2**20


def register_planner_ranks() -> None:
    OmegaConf.register_new_resolver(
        RESOLVER, lambda k: ",".join(str(r) for r in range(1, int(k) + 1)), replace=True
    )


def is_auto(cfg: DictConfig) -> bool:
    """Whether the config's strategy is ``strategy=auto`` (the planner's choice)."""
    return OmegaConf.get_type(cfg.get("strategy")) is AutoStrategyConf


def _layout_options() -> tuple[str, ...]:
    from lightning_parallel.strategies.parallel import ParallelStrategy

    return ParallelStrategy.layout_options


def fixed_options(strategy: DictConfig) -> dict[str, Any]:
    """The layout options the user fixed under ``strategy=auto`` (those not null)."""
    return {name: strategy[name] for name in _layout_options() if strategy.get(name) is not None}


def auto_problems(cfg: DictConfig) -> list[str]:
    """What ``config.validate`` cannot judge of ``strategy=auto`` (the planner sits above it), checked before
    anything is measured: its settings: a device count to plan for, a global batch, fixed layout options some
    layout of the devices has; ``planner.*`` set without ``strategy=auto``."""
    from lightning_parallel.config import world_size_of
    from lightning_parallel.config.schema import PlannerConf
    from lightning_parallel.planner.constraints import constraint_problems

    planner = cfg.get("planner")
    if planner is None:
        return []
    if not is_auto(cfg):
        set_here = [f.name for f in dataclasses.fields(PlannerConf) if planner[f.name] != f.default]
        return [
            f"planner.{name}={planner[name]} is read only under strategy=auto (the planner chooses the layout); "
            "add strategy=auto or leave it out"
            for name in set_here
        ]
    out = [
        f"planner.{name}={planner[name]} must be at least 1"
        for name in ("rank", "top_k", "show", "repeats")
        if planner[name] < 1
    ]
    world = world_size_of(cfg.trainer)
    if world is None:
        out.append("strategy=auto plans for a number of devices: give trainer.devices=N, not 'auto'")
        return out
    batch = global_batch(cfg, world)
    if batch is None:
        out.append("strategy=auto: the data config has no batch_size; give planner.global_batch=B")
        return out
    return out + constraint_problems(fixed_options(cfg.strategy), world, batch)


def _record(prediction: Any, num_nodes: int) -> dict[str, Any]:
    """One prediction as JSON: the layout, its lp-train overrides, step time and the busiest rank's peak."""
    layout = prediction.layout
    return {
        "layout": layout.name(),
        "options": dataclasses.asdict(layout),
        "overrides": layout.overrides(num_nodes),
        "step_seconds": prediction.step_s,
        "samples_per_second": prediction.samples_per_s,
        "bubble": prediction.bubble,
        "data_parallel_seconds": prediction.data_parallel_s,
        "peak_bytes": prediction.peak_bytes,
        "states_bytes": prediction.states.total,
        "activation_bytes": prediction.activation_bytes,
    }


def _planning_input(cfg: DictConfig, world: int) -> dict[str, Any]:
    """What the plan depends on: the model, the data, the trainer's world and precision, the fixed options
    and the planner's settings (not which rank a job trains)."""
    planner = OmegaConf.to_container(cfg.planner, resolve=True)
    assert isinstance(planner, dict)
    return {
        "model": OmegaConf.to_container(cfg.model, resolve=True),
        "data": OmegaConf.to_container(cfg.data, resolve=True),
        "world": world,
        "num_nodes": cfg.trainer.num_nodes,
        "precision": str(cfg.trainer.precision),
        "fixed": fixed_options(cfg.strategy),
        "planner": {k: v for k, v in planner.items() if k not in ("rank", "top_k", "show")},
    }


def global_batch(cfg: DictConfig, world: int) -> Optional[int]:
    """``planner.global_batch``, else ``data.batch_size`` x the world (what data parallelism over every
    process would train), or None where the data config has no batch size."""
    if cfg.planner.global_batch is not None:
        return int(cfg.planner.global_batch)
    batch = cfg.data.get("batch_size") if cfg.get("data") is not None else None
    return batch * world if isinstance(batch, int) and not isinstance(batch, bool) else None


def _plan(cfg: DictConfig, world: int, build: Build) -> dict[str, Any]:
    """The ranking of the run's layouts, measured and predicted now (the model and the data built by
    ``build(node, section)``, as the run builds them)."""
    from lightning_parallel.config import ConfigError
    from lightning_parallel.planner.command import format_plan
    from lightning_parallel.planner.constraints import keeps
    from lightning_parallel.planner.layouts import Plan, plan_layouts
    from lightning_parallel.planner.measure import flop_times
    from lightning_parallel.planner.planning import (
        cluster_for,
        is_this_machine,
        module_cost,
        tensor_parallel_sizes,
        threads_of,
    )

    planner, fixed = cfg.planner, fixed_options(cfg.strategy)
    try:
        cluster = cluster_for(planner.cluster, world, planner.calibrate)
    except (ValueError, OSError) as err:
        raise ConfigError.of([f"planner.cluster={planner.cluster}: {err}"]) from err
    batch = global_batch(cfg, world)
    here = is_this_machine(cluster)
    module, data = build(cfg.model, "model"), build(cfg.data, "data")
    try:
        with threads_of(world if here else None):
            sizes = tensor_parallel_sizes(world) if here else ()
            cost = module_cost(module, data, repeats=planner.repeats, tensor_parallel=sizes)
    except ValueError as err:  # no block stack, no batch to time: the planner cannot measure this model
        raise ConfigError.of(
            [f"strategy=auto: the planner times the model's blocks, and cannot: {err}"]
        ) from err
    if not here:
        cost = flop_times(cost, cluster.flops)
    memory = planner.memory_gb * 2**30 if planner.memory_gb else None
    found = plan_layouts(cost, cluster, world, batch, memory, str(cfg.trainer.precision))
    plan = Plan(
        [p for p in found.ranked if keeps(p.layout, fixed)],
        [e for e in found.excluded if keeps(e.layout, fixed)],
    )
    table = format_plan(plan, planner.show, cost.tokens_per_sample)
    if not plan.ranked:
        given = " ".join(f"strategy.{k}={v}" for k, v in fixed.items()) or "no fixed option"
        raise ConfigError.of(
            [f"strategy=auto ({given}): no layout of {world} devices can run this model:\n{table}"]
        )
    return {
        "model": cost.name,
        "cluster": cluster.name,
        "devices": world,
        "global_batch": batch,
        "block_times": "measured" if here else "flops",
        "fixed": fixed,
        "table": table,
        "ranked": [_record(p, cfg.trainer.num_nodes) for p in plan.ranked[:KEPT]],
    }


def _launched_externally() -> bool:
    """Every rank runs lp-train itself (torchrun, srun with several tasks): no process plans for the others."""
    return "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1


def _job_plan(
    cfg: DictConfig, world: int, out_dir: Path, sweep_dir: Optional[Path], build: Build
) -> dict[str, Any]:
    """The job's plan: the one in its folder (a started rank, a resumed run), else the sweep's for the same
    planning input, else planned now; written to the job's folder."""
    from lightning_parallel.cli.json_file import write_json
    from lightning_parallel.config import ConfigError
    from lightning_parallel.strategies.launcher import is_launched_rank

    path = out_dir / PLAN_FILE
    if path.is_file():
        return json.loads(path.read_text())
    if is_launched_rank() or _launched_externally():
        raise ConfigError.of(
            [
                f"strategy=auto: {path} holds no plan. The process that launches the ranks plans; where every "
                "rank runs lp-train (torchrun, srun) plan first: python -m lightning_parallel.planner "
                "--devices N --output best.txt, and give every rank lp-train $(cat best.txt)"
            ]
        )
    if cfg.planner.top_k > 1 and sweep_dir is None:  # (a started rank or a resume has its plan already)
        raise ConfigError.of(
            [
                f"planner.top_k={cfg.planner.top_k} trains the planner's {cfg.planner.top_k} fastest layouts as a "
                "sweep: add -m (or train one of them: planner.rank=N)"
            ]
        )
    if sweep_dir is None:
        plan = _plan(cfg, world, build)
    else:
        text = json.dumps(_planning_input(cfg, world), sort_keys=True, default=str)
        shared = sweep_dir / "planner" / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
        shared.parent.mkdir(parents=True, exist_ok=True)
        with open(shared.with_suffix(".lock"), "w") as lock:  # jobs of a sweep in parallel plan once
            fcntl.flock(lock, fcntl.LOCK_EX)
            if shared.is_file():
                plan = json.loads(shared.read_text())
            else:
                plan = _plan(cfg, world, build)
                write_json(shared, plan)
    write_json(path, plan)
    return plan


def _why(plan: dict[str, Any], rank: int) -> str:
    ranked, chosen = plan["ranked"], plan["ranked"][rank - 1]
    if rank > 1:
        return f"planner.rank={rank}: #{rank} of the ranking"
    if len(ranked) == 1:
        return "the only layout that runs"
    runner_up = ranked[1]
    ahead = runner_up["step_seconds"] / chosen["step_seconds"] - 1
    if ahead < 5e-4:  # ranked by step time, then by peak memory
        return f"the fastest predicted, tied with #2 ({runner_up['layout']}) and less memory"
    return f"the fastest predicted, {ahead:.1%} ahead of #2 ({runner_up['layout']})"


def chosen_overrides(task: list[str], chosen: list[str]) -> list[str]:
    """The job's overrides with the chosen layout's in place of ``strategy=auto`` and the ``planner.*``
    settings (read by then): the user's other ones first (fixed options agree with the layout), the
    layout's after them (they win where both set a key)."""
    keys = [(o, o.split("=", 1)[0].lstrip("+~")) for o in task]
    return [o for o, key in keys if key != "strategy" and not key.startswith("planner.")] + list(chosen)


def plan_and_compose(cfg: DictConfig, build: Build) -> tuple[DictConfig, dict[str, Any]]:
    """The run's config with the planned layout in place of ``strategy=auto``, and the plan's record for
    ``summary.json``; a ``ConfigError`` (nothing launched) where no layout can run. ``build(node, section)``
    builds the model and the data to measure (``lp-train``'s ``instantiate_user``)."""
    from hydra import compose
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from lightning_parallel.config import ConfigError, world_size_of

    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    planner = cfg.planner
    world = world_size_of(cfg.trainer)
    assert world is not None  # validate() refused devices=auto under strategy=auto
    out_dir = Path(hydra_cfg.runtime.output_dir)
    sweep_dir = Path(hydra_cfg.sweep.dir) if multirun else None
    plan = _job_plan(cfg, world, out_dir, sweep_dir, build)
    rank = planner.rank
    if rank > len(plan["ranked"]):
        raise ConfigError.of(
            [
                f"planner.rank={rank}: the planner ranked {len(plan['ranked'])} layouts; use 1 to {len(plan['ranked'])}"
            ]
        )
    chosen = plan["ranked"][rank - 1]
    overrides = chosen_overrides([str(o) for o in hydra_cfg.overrides.task], chosen["overrides"])
    composed = compose(config_name=hydra_cfg.job.config_name, overrides=overrides)
    fixed = ", ".join(f"strategy.{k}={v}" for k, v in plan["fixed"].items())
    log.info(
        "strategy=auto: planned %s on %d devices of %s, global batch %s, block times %s%s\n%s\n"
        "chose #%d %s: %s; predicted %.4g ms per step, peak %.4g MiB per rank\n  lp-train %s",
        plan["model"],
        plan["devices"],
        plan["cluster"],
        plan["global_batch"],
        plan["block_times"],
        f" (only layouts with {fixed})" if fixed else "",
        plan["table"],
        rank,
        chosen["layout"],
        _why(plan, rank),
        chosen["step_seconds"] * 1e3,
        chosen["peak_bytes"] / MIB,
        " ".join(chosen["overrides"]),
    )
    record = {
        "rank": rank,
        "layout": chosen["layout"],
        "overrides": chosen["overrides"],
        "why": _why(plan, rank),
        "cluster": plan["cluster"],
        "block_times": plan["block_times"],
        "global_batch": plan["global_batch"],
        "ranked": [
            {k: r[k] for k in ("layout", "step_seconds", "peak_bytes")}
            for r in plan["ranked"][: planner.show]
        ],
        "predicted": {
            "step_seconds": chosen["step_seconds"],
            "peak_bytes_per_rank": chosen["peak_bytes"],
            "states_bytes": chosen["states_bytes"],
            "activation_bytes": chosen["activation_bytes"],
        },
    }
    return composed, record


def _error(predicted: Optional[float], measured: Optional[float]) -> Optional[float]:
    if predicted is None or not measured:
        return None
    return round(100 * (predicted - measured) / measured, 2)


def compare(record: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any]:
    """``record`` with the run's measured figures and the prediction's error (predicted - measured, % of
    measured): the median step time, and each rank's parameters + gradients + optimizer state + activations
    at the end of fit (the memory report), the busiest rank's against the prediction."""
    memory = summary.get("memory") or {}
    rows = memory.get("end_of_fit") or memory.get("after_setup") or []
    per_rank = [
        sum(row[k] or 0 for k in ("parameters", "gradients", "optimizer_state", "activations"))
        for row in rows
    ]
    step = summary.get("median_step_seconds")
    peak = max(per_rank) if per_rank else None
    predicted = record["predicted"]
    return {
        **record,
        "measured": {"step_seconds": step, "peak_bytes_per_rank": per_rank, "peak_bytes": peak},
        "error_percent": {
            "step_time": _error(predicted["step_seconds"], step),
            "peak_memory": _error(predicted["peak_bytes_per_rank"], peak),
        },
    }
