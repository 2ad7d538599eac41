"""The machines a layout runs on: devices per node, memory per device, and the links between devices.

A cluster is read from a small YAML file (``Cluster.load``) or measured on the machine at hand by the
calibration. The cost model reads nothing else about the hardware."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Mapping, Union

import yaml

__all__ = ["Link", "Cluster", "SHIPPED"]

#: the cluster files shipped with the package: ``cpu_2core``, ``h100_8x``, ``h100_64x8``
SHIPPED = Path(__file__).parent / "clusters"


@dataclass(frozen=True)
class Link:
    """One kind of link between two devices: bytes per second each way per device, and the latency of one
    message in seconds. ``collectives``: ``(name, bandwidth, latency)`` of collectives measured on this link
    (the calibration's fits, as the ring model's figures: ``collective_time`` reproduces each measured call
    with them), in place of the message figures for that collective."""

    bandwidth: float
    latency: float
    collectives: tuple[tuple[str, float, float], ...] = ()

    def of(self, collective: str) -> "Link":
        """The figures of ``collective`` on this link: its measured ones, else the message's."""
        for name, bandwidth, latency in self.collectives:
            if name == collective:
                return replace(self, bandwidth=bandwidth, latency=latency, collectives=())
        return self

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "Link":
        measured = values.get("collectives") or {}
        collectives = tuple(
            (name, float(fit["bandwidth"]), float(fit["latency"])) for name, fit in sorted(measured.items())
        )
        return cls(float(values["bandwidth"]), float(values["latency"]), collectives)

    def as_mapping(self) -> dict:
        out: dict = {"bandwidth": self.bandwidth, "latency": self.latency}
        if self.collectives:
            out["collectives"] = {n: {"bandwidth": b, "latency": a} for n, b, a in self.collectives}
        return out


@dataclass(frozen=True)
class Cluster:
    """``nodes`` machines of ``devices_per_node`` devices, each with ``memory`` bytes and ``flops`` dense
    floating-point operations per second in the compute dtype (used only for blocks that were not timed).
    ``cores``: on a CPU box, the cores a node's devices (processes, one thread each) share, so that more
    processes than cores run no faster in all; 0 where every device computes on its own (GPUs).
    ``backend``: the process groups' backend; on ``gloo`` the package's sequence-parallel all-gather and
    reduce-scatter are each an all-reduce of the whole tensor (``distributed.collectives._on_host``).
    ``slice_s``: on such a box, the scheduler's time slice: how long a process runs before another
    runnable one on its core takes its turn (``calibrate.scheduler_slice``). ``shared_compute``: on such a
    box, how many times longer a rank's compute takes while every core runs a rank than alone (their caches
    and memory bandwidth are shared; ``calibrate.shared_compute``); 1.0 where each device computes alone.
    ``wake_s``: on such a box with a core per process, what each blocking collective or message between a
    step's computations costs beyond its own time: the waiting rank's core idles and is woken when the data
    arrives (``calibrate.wake_up``); 0 where it was not measured."""

    name: str
    nodes: int
    devices_per_node: int
    memory: float
    flops: float
    within_node: Link
    between_nodes: Link
    cores: int = 0
    backend: str = "nccl"
    slice_s: float = 0.0
    shared_compute: float = 1.0
    wake_s: float = 0.0

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    def link(self, group_size: int, stride: int = 1) -> Link:
        """The slowest link a process group of ``group_size`` ranks, ``stride`` ranks apart, crosses."""
        spans_nodes = self.nodes > 1 and group_size * stride > self.devices_per_node
        return self.between_nodes if spans_nodes else self.within_node

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "Cluster":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown cluster keys {unknown}; the keys are {sorted(known)}")
        values = dict(values)
        for key in ("within_node", "between_nodes"):  # numbers as floats: YAML reads 4.5e11 as text
            values[key] = Link.from_mapping(values[key])
        for key in ("memory", "flops", "slice_s", "shared_compute", "wake_s"):
            if key in values:
                values[key] = float(values[key])
        return cls(**values)

    def as_mapping(self) -> dict:
        """The keys ``from_mapping`` reads (a cluster YAML's)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update(within_node=self.within_node.as_mapping(), between_nodes=self.between_nodes.as_mapping())
        return out

    @classmethod
    def load(cls, path: Union[str, Path]) -> "Cluster":
        """A cluster YAML file, or the name of one shipped in ``planner/clusters`` (``SHIPPED``)."""
        shipped = SHIPPED / f"{path}.yaml"
        with open(shipped if shipped.is_file() else path) as f:
            return cls.from_mapping(yaml.safe_load(f))
