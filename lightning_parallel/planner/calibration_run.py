"""``python -m lightning_parallel.planner.calibration_run --devices 4 --output FILE.yaml``: the calibration
(``planner.calibrate``) run here over ``--devices`` local processes, written as a cluster YAML that the
planner reads like a shipped one (``--cluster FILE.yaml``, ``lp-train strategy=auto
planner.cluster=FILE.yaml``); ``--calibrate`` / ``planner.calibrate=true`` run it first.

Each process joins one gloo group (nccl with ``--backend nccl``, one GPU each) and calls ``calibrate``; rank
0 writes the cluster, named ``calibrated-<backend>-<N>`` (``CALIBRATED``: the planner times blocks here for
such a cluster), with each collective's fit in a comment.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import yaml

from lightning_parallel.planner.cluster import Cluster
from lightning_parallel.processes import local_rank_envs, run_processes

__all__ = ["CALIBRATED", "calibrate_here", "cluster_yaml", "main"]

#: the name every calibrated cluster starts with
CALIBRATED = "calibrated"
MODULE = "lightning_parallel.planner.calibration_run"


def cluster_yaml(cluster: Cluster, fits: dict) -> str:
    """``cluster`` as the YAML ``Cluster.load`` reads, its collectives' fits in the opening comment."""
    lines = [f"# Calibrated here over {cluster.devices} processes (planner/calibration_run.py). Fits,"]
    lines += ["# seconds = latency + bytes per rank x seconds per byte:"]
    lines += [
        f"#   {name}: latency {fit.latency:.3g} s, {1 / fit.seconds_per_byte:.3g} bytes/s"
        for name, fit in fits.items()
    ]
    return "\n".join(lines) + "\n" + yaml.safe_dump(cluster.as_mapping(), sort_keys=False)


def _worker(output: str, backend: str) -> None:
    """One rank: join the group, calibrate the collectives and the device, rank 0 writes the cluster."""
    import torch
    import torch.distributed as dist

    from lightning_parallel.planner.calibrate import calibrate

    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    result = calibrate()
    if dist.get_rank() == 0:
        name = f"{CALIBRATED}-{backend}-{dist.get_world_size()}"
        Path(output).write_text(
            cluster_yaml(dataclasses.replace(result.cluster, name=name), result.collectives)
        )
    dist.destroy_process_group()


def calibrate_here(
    devices: int, output: Optional[str] = None, backend: str = "gloo", timeout: float = 180.0
) -> Cluster:
    """This machine's cluster, calibrated over ``devices`` local processes (and written to ``output``)."""
    if devices < 1:
        raise ValueError(f"calibrate over a positive number of processes, not {devices}")
    with tempfile.TemporaryDirectory(prefix="lp-calibrate-") as tmp:
        path = output or str(Path(tmp) / "calibrated.yml")
        path = str(Path(path).resolve())
        envs = local_rank_envs(devices)
        command = [sys.executable, "-m", MODULE, "--worker", path, "--backend", backend]
        run_processes([command] * devices, envs, timeout, Path(tmp), grace=2.0, rendezvous=True)
        return Cluster.load(path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, help="processes to calibrate over")
    parser.add_argument("--output", help="the cluster YAML written")
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.backend)
        return 0
    if args.devices is None or args.output is None:
        parser.error("give --devices N and --output FILE")
    cluster = calibrate_here(args.devices, args.output, args.backend)
    link = cluster.within_node
    print(
        f"{cluster.name}: {link.bandwidth:.3g} bytes/s and {link.latency:.3g} s a message, "
        f"{cluster.memory / 2**30:.3g} GiB and {cluster.flops:.3g} flop/s per device; written to {args.output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
