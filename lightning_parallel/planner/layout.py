"""One layout of a run: the sizes of its axes and the options that change its step time or memory, and the
``lp-train`` overrides that run it (under ``strategy=lp_parallel``, which composes every axis)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

__all__ = ["Layout"]


@dataclass(frozen=True)
class Layout:
    """dp x tp x pp processes; ``ep`` divides dp. ``virtual_stages``: chunks per rank (2 under interleaved
    1F1B and ZBV, else 1). ``recompute``: ``activation_checkpointing`` (False, True or ``"selective"``).
    ``global_batch``: samples per optimizer step over all replicas."""

    dp: int
    tp: int
    pp: int
    global_batch: int
    ep: int = 1
    schedule: str = "1f1b"
    num_microbatches: int = 1
    virtual_stages: int = 1
    zero_stage: int = 0
    recompute: Union[bool, str] = False
    sequence_parallel: bool = False

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def microbatch(self) -> float:
        """Samples per micro-batch on one replica."""
        return self.global_batch / (self.dp * self.num_microbatches)

    def name(self) -> str:
        """A short label: ``dp2 tp2 pp2 1f1b m4 z1 rc sp`` (only what is not off)."""
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"] + ([f"ep{self.ep}"] if self.ep > 1 else [])
        if self.pp > 1:
            parts += [self.schedule + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else "")]
            parts += [f"m{self.num_microbatches}"]
        parts += [f"z{self.zero_stage}"] if self.zero_stage else []
        parts += {False: [], True: ["rc"], "selective": ["rc-sel"]}[self.recompute]
        parts += ["sp"] if self.sequence_parallel else []
        return " ".join(parts)

    def strategy_options(self) -> dict[str, Any]:
        """The ``ParallelStrategy`` keyword arguments of this layout (the rest at their defaults)."""
        options: dict[str, Any] = {
            "data_parallel_size": self.dp,
            "tensor_parallel_size": self.tp,
            "pipeline_parallel_size": self.pp,
            "expert_parallel_size": self.ep,
            "sequence_parallel": self.sequence_parallel,
            "activation_checkpointing": self.recompute,
            "zero_stage": self.zero_stage,
        }
        if self.pp > 1:
            options.update(schedule=self.schedule, num_microbatches=self.num_microbatches)
            if self.schedule == "interleaved_1f1b":
                options["virtual_stages"] = self.virtual_stages
        return options

    def overrides(self, num_nodes: int = 1) -> list[str]:
        """The ``lp-train`` command-line overrides of this layout (``data.batch_size``: one replica's batch)."""
        per_node = self.devices // num_nodes
        lines = ["strategy=lp_parallel", f"trainer.devices={per_node}", f"trainer.num_nodes={num_nodes}"]
        for key, value in self.strategy_options().items():
            text = str(value).lower() if isinstance(value, bool) else value
            lines.append(f"strategy.{key}={text}")
        return lines + [f"data.batch_size={self.global_batch // self.dp}"]
