"""Checks that need more than one field, run on the composed config before any process starts.

Hydra and the schemas already reject unknown keys and wrong types while composing; what is left is
whether the pieces fit together: is the world (``devices x num_nodes``) divisible by the tensor- or
pipeline-parallel size, are there more pipeline stages than processes, do the classes named by
``_target_`` exist. A lightning_parallel strategy's options are checked by the same functions its
constructor calls (``strategies.options.option_problems``, ``strategies.checks.layout``). Every problem
is reported at once, each naming the offending values and what would work.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import math
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from lightning_parallel.pipeline.executor import loader_problem
from lightning_parallel.pipeline.schedules import chunks_per_rank
from lightning_parallel.strategies.base import ParallelStrategyBase
from lightning_parallel.strategies.checks import layout, layout_sizes, shard_size
from lightning_parallel.strategies.options import defaults, option_problems

__all__ = ["ConfigError", "validate", "world_size_of", "problems"]


class ConfigError(ValueError):
    """An impossible configuration; the message lists every problem found."""

    @classmethod
    def of(cls, found: list[str]) -> "ConfigError":
        lines = "\n".join(f"  - {p}" for p in found)
        return cls(f"invalid lp-train configuration ({len(found)} problem(s)):\n{lines}")


def _devices_count(devices: Any) -> Optional[int]:
    if isinstance(devices, int) and not isinstance(devices, bool):
        return devices
    if isinstance(devices, str):
        if devices == "auto":
            return None
        if devices.isdigit():
            return int(devices)
        if "," in devices:
            return len([d for d in devices.split(",") if d.strip()])
        return -1
    if isinstance(devices, (list, tuple)) or (hasattr(devices, "__len__") and not isinstance(devices, dict)):
        return len(devices)
    return -1


def world_size_of(trainer: Any) -> Optional[int]:
    """``devices x num_nodes`` as the Trainer will count it (None for ``devices=auto``)."""
    n = _devices_count(trainer.devices)
    return None if n is None or n < 0 else n * int(trainer.num_nodes)


def _target_problem(section: str, target: Any) -> Optional[str]:
    if not isinstance(target, str) or not target:
        return f"{section}._target_ must name a class, e.g. {section}._target_=my_package.module.MyClass"
    module_name, _, attr = target.replace(":", ".").rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        return f"{section}._target_={target}: module {module_name!r} cannot be imported ({err})"
    if not hasattr(module, attr):
        hint = ""
        if module_name == "lightning_parallel":
            from lightning_parallel import __all__ as public

            hint = f"; this installation provides {sorted(n for n in public if n.endswith('Strategy'))}"
        return f"{section}._target_={target}: {module_name!r} has no attribute {attr!r}{hint}"
    return None


def _unknown_keys(section: str, node: Any) -> list[str]:
    """Keys that Hydra let in with ``+key=...`` although the node's schema has no such field."""
    schema = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
    if schema is None or not dataclasses.is_dataclass(schema):
        return []
    fields = [f.name for f in dataclasses.fields(schema)]
    out = []
    for key in node.keys():
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean {section}.{close[0]}?" if close else ""
            out.append(
                f"{section}.{key} is not an option of {schema.__name__} (options: "
                f"{', '.join(f for f in fields if not f.startswith('_'))}){hint}"
            )
    return out


def problems(cfg: DictConfig) -> list[str]:
    """Every problem with the composed ``lp-train`` config, as human-readable sentences."""
    out: list[str] = _not_a_number(cfg)
    out += _unknown_keys("strategy", cfg.strategy) + _unknown_keys("trainer", cfg.trainer)
    trainer, strategy = cfg.trainer, cfg.strategy
    devices = _devices_count(trainer.devices)
    if devices is not None and devices < 1:
        out.append(
            f"trainer.devices={trainer.devices!r} is not a device count; use a positive integer, a list of "
            "device indices, or 'auto'"
        )
    if trainer.num_nodes < 1:
        out.append(f"trainer.num_nodes={trainer.num_nodes} must be at least 1")
    if trainer.accelerator in ("gpu", "cuda"):
        import torch

        if not torch.cuda.is_available():
            out.append(
                f"trainer.accelerator={trainer.accelerator} but no CUDA device is visible; "
                "use trainer=cpu (accelerator=cpu)"
            )
    for section in ("model", "data"):
        node = cfg.get(section)
        if node is None or "_target_" not in node:
            out.append(
                f"{section} needs a _target_ naming a class, e.g. {section}._target_=my_package.MyClass"
            )
            continue
        problem = _target_problem(section, node._target_)
        if problem:
            out.append(problem)
    if "_target_" in strategy:
        problem = _target_problem("strategy", strategy._target_)
        if problem:
            out.append(problem)
    out.extend(_strategy_problems(strategy, trainer, cfg))
    return out


def _strategy_class(strategy: Any) -> Optional[type]:
    """The lightning_parallel strategy class named by ``strategy._target_``, or None."""
    module_name, _, attr = str(strategy.get("_target_", "")).replace(":", ".").rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError):
        return None
    return cls if isinstance(cls, type) and issubclass(cls, ParallelStrategyBase) else None


def _strategy_problems(strategy: Any, trainer: Any, cfg: DictConfig) -> list[str]:
    """The strategy's own checks of its options, then whether its layout fits the world."""
    cls = _strategy_class(strategy)
    if cls is None:
        return []
    values = {**defaults(cls), **OmegaConf.to_container(strategy, resolve=True)}
    out = option_problems(cls, values, prefix="strategy.")
    world = world_size_of(trainer)
    if out or world is None or world < 1:
        return out
    where = f"trainer.devices={trainer.devices} x trainer.num_nodes={trainer.num_nodes} = {world} process(es)"
    sizes = {name: values[name] for name in cls.size_options}
    problem = layout(world, where, sizes, prefix="strategy.") if sizes else None
    if problem:
        return [problem]
    resolved = layout_sizes(world, sizes)
    dp = next((resolved[name] for name, axis in cls.size_options.items() if axis == "dp"), world)
    problem = shard_size("strategy.data_parallel_shard_size", values["data_parallel_shard_size"], dp, where)
    if problem or not sizes:
        return [problem] if problem else []
    stages = resolved.get("pipeline_parallel_size", 1)
    return _stage_problems(values, stages, cfg) if stages > 1 or "pp" in cls.always_applied else []


def _stage_problems(values: dict[str, Any], ranks: int, cfg: DictConfig) -> list[str]:
    """Split points and blocks enough for the run's pipeline stages (``virtual_stages`` of them per rank
    where the schedule holds several chunks)."""
    out = []
    chunks = chunks_per_rank(values.get("schedule", "1f1b"), values.get("virtual_stages"))
    stages = ranks * chunks
    what = f"{stages} pipeline stages" if chunks == 1 else f"{stages} virtual stages ({ranks} x {chunks})"
    split_points = values["split_points"]
    if split_points is not None and len(split_points) + 1 != stages:
        out.append(
            f"strategy.split_points has {len(split_points)} entries, giving {len(split_points) + 1} "
            f"stages, but the run has {what}; give {stages - 1} split points"
        )
    microbatches, batch_size = values.get("num_microbatches"), _data_batch_size(cfg)
    if isinstance(microbatches, int) and batch_size is not None:
        problem = loader_problem(batch_size, batch_size, True, microbatches)  # one full batch's split
        if problem:
            out.append(
                f"strategy.num_microbatches={microbatches} with data.batch_size={batch_size}: {problem}"
            )
    n_layer = cfg.model.get("n_layer") if cfg.get("model") is not None else None
    if isinstance(n_layer, int) and stages > n_layer:
        out.append(
            f"{what} but model.n_layer={n_layer} blocks; every stage needs at least "
            f"one block: use model.n_layer>={stages} or fewer stages"
        )
    return out


def _data_batch_size(cfg: DictConfig) -> Optional[int]:
    """``data.batch_size`` where the data config has one (a data-parallel rank's batch), else None."""
    value = cfg.data.get("batch_size") if cfg.get("data") is not None else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _not_a_number(cfg: DictConfig) -> list[str]:
    """Every value of the config that is NaN (``model.lr=nan``): never a setting, always a slip."""
    out = []

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{where}.{key}" if where else str(key))
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{where}[{i}]")
        elif isinstance(node, float) and math.isnan(node):
            out.append(f"{where}=nan is not a number; give a finite value")

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return out


def validate(cfg: DictConfig) -> None:
    """Raise ``ConfigError`` listing every problem of the composed config (nothing if it is fine)."""
    found = problems(cfg)
    if found:
        raise ConfigError.of(found)
