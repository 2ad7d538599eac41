"""Equivalence checker for users: is my model trained the same under a strategy as on one device?

    python -m lightning_parallel.cli.verify --model pkg.mod:MyModule --data pkg.mod:MyDataModule \\
        --strategy lp_ddp --devices 2 --steps 3

runs ``steps`` optimizer steps of the user's own module on ``devices`` local processes under the
strategy, and on one process with the same global batches (``SingleDeviceReferenceStrategy``: the
distributed sampler's order with one replica), both in float64 by default from the same seed. It prints,
per step, the largest parameter difference and the difference of the (data-parallel mean) loss.

Contract with the user's code: the DataModule has a ``batch_size`` attribute, the per-process batch
size, read by its ``train_dataloader``; the reference run sets it to ``batch_size * dp_size``. Strategies
report full parameters through ``full_model_state()`` and the loss mean through ``reduce``,
so model-parallel strategies take part without changes here.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_parallel.processes import local_rank_envs, run_processes

__all__ = ["verify", "main"]


def _load(path: str) -> Any:
    module, _, attr = path.partition(":")
    if not attr:
        raise ValueError(
            f"{path!r} is not 'package.module:Name'; give the module and the class, e.g. 'mypkg.models:Net'."
        )
    return getattr(importlib.import_module(module), attr)


def _worker(spec_path: str) -> None:
    """One process of either run; writes per-step parameters (rank 0) and losses."""
    from lightning.pytorch import Callback, Trainer, seed_everything

    import lightning_parallel  # noqa: F401  (registers strategy names)
    from lightning_parallel.quiet_trainer import QUIET_TRAINER
    from lightning_parallel.strategies.reference import SingleDeviceReferenceStrategy

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))

    class Record(Callback):
        def __init__(self) -> None:
            self.steps: list[dict] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            loss = trainer.strategy.reduce(loss.detach(), reduce_op="mean") if world > 1 else loss.detach()
            strategy = trainer.strategy  # full tensors even when the strategy saves sharded checkpoints
            params = (
                strategy.full_model_state()
                if hasattr(strategy, "full_model_state")
                else strategy.lightning_module_state_dict()
            )
            if rank == 0:
                self.steps.append(
                    {"loss": float(loss), "params": {k: v.detach().cpu().clone() for k, v in params.items()}}
                )

    seed_everything(spec["seed"], workers=True)
    model = _load(spec["model"])(**spec["model_kwargs"])
    data = _load(spec["data"])(**spec["data_kwargs"])
    if not hasattr(data, "batch_size"):
        raise ValueError(
            f"{spec['data']} has no 'batch_size' attribute; verify needs it to give the one-device "
            "run the same global batch (set self.batch_size in __init__ and use it in train_dataloader)."
        )
    if world == 1:
        data.batch_size = data.batch_size * spec["dp_size"]
        strategy: Any = SingleDeviceReferenceStrategy()
    else:
        strategy = spec["strategy"]
    record = Record()
    trainer = Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        precision=spec["precision"],
        max_steps=spec["steps"],
        callbacks=[record],
        **QUIET_TRAINER,
    )
    trainer.fit(model, datamodule=data)
    if rank == 0:
        mesh = getattr(trainer.strategy, "mesh", None)
        dp = mesh.shape.dp if mesh is not None else world
        torch.save({"steps": record.steps, "dp_size": dp}, Path(spec["out"]) / f"result{world}.pt")


def _launch(spec: dict, nprocs: int, workdir: Path, timeout: float) -> dict:
    path = workdir / f"spec{nprocs}.json"
    path.write_text(json.dumps(spec))
    envs = local_rank_envs(nprocs, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "lightning_parallel.cli.verify", "--worker", str(path)]
    run_processes(
        [command] * nprocs,
        envs,
        timeout,
        workdir,
        grace=2.0,
        log_names=[f"run{nprocs}_rank{r}.log" for r in range(nprocs)],
        rendezvous=True,
    )
    return torch.load(workdir / f"result{nprocs}.pt", weights_only=False)


def verify(
    model: str,
    data: str,
    strategy: str = "lp_ddp",
    devices: int = 2,
    steps: int = 3,
    model_kwargs: Optional[dict] = None,
    data_kwargs: Optional[dict] = None,
    precision: str = "64-true",
    seed: int = 0,
    timeout: float = 600.0,
    workdir: Optional[str] = None,
) -> list[dict[str, float]]:
    """Run both and return, per step, ``{"step", "max_param_diff", "loss_diff", "loss"}``."""
    if not isinstance(devices, int) or devices < 2:
        raise ValueError(
            f"devices={devices!r}: verify compares a run on >= 2 processes with one process; use 2 or more."
        )
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r}: give a positive number of optimizer steps, e.g. 3.")
    _load(model), _load(data)  # fail here, clearly, on a wrong path
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        spec = {
            "model": model,
            "data": data,
            "strategy": strategy,
            "steps": steps,
            "precision": precision,
            "model_kwargs": model_kwargs or {},
            "data_kwargs": data_kwargs or {},
            "seed": seed,
            "out": tmp,
        }
        dist = _launch(spec, devices, Path(tmp), timeout)
        ref = _launch({**spec, "dp_size": dist["dp_size"]}, 1, Path(tmp), timeout)
    rows = []
    for i, (a, b) in enumerate(zip(dist["steps"], ref["steps"]), start=1):
        diff = max(
            (
                (a["params"][k].double() - b["params"][k].double()).abs().max().item()
                for k in b["params"]
                if b["params"][k].numel()
            ),
            default=0.0,
        )
        rows.append(
            {"step": i, "max_param_diff": diff, "loss_diff": abs(a["loss"] - b["loss"]), "loss": b["loss"]}
        )
    if len(rows) != steps:
        raise RuntimeError(
            f"expected {steps} steps, got {len(dist['steps'])} (distributed) and {len(ref['steps'])} "
            "(one device): is the training set long enough?"
        )
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_parallel.cli.verify", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", help="'package.module:LightningModuleClass'")
    parser.add_argument(
        "--data", help="'package.module:LightningDataModuleClass' (with a batch_size attribute)"
    )
    parser.add_argument("--strategy", default="lp_ddp")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model-kwargs", type=json.loads, default={}, help="JSON object")
    parser.add_argument("--data-kwargs", type=json.loads, default={}, help="JSON object")
    parser.add_argument("--precision", default="64-true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return 0
    if not args.model or not args.data:
        parser.error("--model and --data are required")
    rows = verify(
        args.model,
        args.data,
        args.strategy,
        args.devices,
        args.steps,
        args.model_kwargs,
        args.data_kwargs,
        args.precision,
        args.seed,
    )
    print(f"{args.strategy} on {args.devices} processes vs one device, {args.precision}:")
    print(f"{'step':>4}  {'max |param diff|':>16}  {'|loss diff|':>12}  {'loss':>12}")
    for r in rows:
        print(f"{r['step']:>4}  {r['max_param_diff']:>16.3e}  {r['loss_diff']:>12.3e}  {r['loss']:>12.6f}")
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv:
        try:
            main()
            sys.stdout.flush()
            os._exit(0)  # do not wait for peers in atexit handlers
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
    sys.exit(main())
