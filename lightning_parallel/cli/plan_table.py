"""``python -m lightning_parallel.cli.plan_table <module target> --tp 2 [--plan auto|NAME|FILE.yaml] [--kwargs JSON]
[--data package.module:DataModule [--data-kwargs JSON]] [--sequence-parallel] [--ep N [--dp M]]``

Prints the sharding plan of a module as a table (style, local weight shape, parameters per rank and
communication per layer, with totals) without starting any process. The target is ``package.module:Class``
(built with ``--kwargs``); a named plan of ``conf/plan`` or a YAML file can be given as ``--plan``. For
``auto``, the plan is traced from ``training_step`` on the first batch of ``--data`` (as the strategy does),
or of the module's own ``train_dataloader``, else from ``forward`` on the module's ``example_input_array``;
the output's first line says which. With none of them the plan is found from the module's structure
alone, which leaves attention and MLPs written in ``forward`` replicated: the output then says so, and
how to trace.
``--sequence-parallel`` adds where sequence parallelism cuts and gathers the sequence, and the collectives
per step with and without it.
``--ep`` (``expert_parallel_size``) places each mixture-of-experts layer's experts whole on that many ranks:
the table then gives the experts and parameters each rank holds and the all-to-all bytes per step, per
layer and in total, from the traced batch (``moe.expert_traffic``, ``tensor.table.expert_placement``).
``--dp`` (``data_parallel_size``) is checked against it as the strategy checks it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any, Optional

from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_parallel.moe.expert_parallel import expert_parallel_problem, experts_left_to_expert_parallel
from lightning_parallel.strategies.options import option_problems
from lightning_parallel.strategies.parallel import ParallelStrategy
from lightning_parallel.tensor import PlanError, parse_plan, resolve
from lightning_parallel.tensor.sample import forward_on
from lightning_parallel.tensor.sequence_plan import resolve_sequence
from lightning_parallel.tensor.table import expert_placement, format_table

__all__ = ["STRUCTURAL", "main"]


def _load(target: str) -> object:
    module, _, attr = target.partition(":")
    if not attr:
        raise SystemExit(f"target {target!r} must look like 'package.module:ClassName'")
    return getattr(importlib.import_module(module), attr)


STRUCTURAL = (
    "note: no sample input, so the plan was not traced: these numbers are structural (found from the module's "
    "types and names; attention and MLPs written in forward stay replicated, unlike under the strategy, which "
    "traces the first batch). To trace, pass --data package.module:DataModule (--data-kwargs JSON), or set "
    "example_input_array on the module"
)


def _first_batch(loader_owner: Any) -> Any:
    return next(iter(loader_owner.train_dataloader()))


def _sample(module: Any, data: Optional[str], data_kwargs: str) -> tuple[Any, str]:
    """The batch to trace and a line saying what is traced: ``--data``'s first batch, else that of the
    module's own ``train_dataloader``, else None (``example_input_array``, or nothing)."""
    if data:
        datamodule = _load(data)(**json.loads(data_kwargs))
        datamodule.setup("fit")
        return _first_batch(datamodule), f"traced: training_step on the first batch of {data}"
    if isinstance(module, LightningModule) and is_overridden("train_dataloader", module, LightningModule):
        batch = _first_batch(module)
        return batch, "traced: training_step on the first batch of the module's train_dataloader"
    if getattr(module, "example_input_array", None) is not None:
        return None, "traced: forward on the module's example_input_array"
    return None, STRUCTURAL


def parse_plan_unless_auto(plan: str) -> object:
    return plan if plan == "auto" else parse_plan(plan)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_parallel.cli.plan_table", description=__doc__.splitlines()[0]
    )
    parser.add_argument("target", help="package.module:Class of the (Lightning)Module")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    parser.add_argument("--plan", default="auto", help="'auto' (default) or a plan YAML file")
    parser.add_argument("--kwargs", default="{}", help="JSON keyword arguments for the target")
    parser.add_argument("--data", default=None, help="package.module:DataModule whose first batch is traced")
    parser.add_argument("--data-kwargs", default="{}", help="JSON keyword arguments for the data module")
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="as with sequence_parallel=True (docs/tensor_parallel.md)",
    )
    parser.add_argument(
        "--ep",
        "--expert-parallel-size",
        dest="ep",
        type=int,
        default=1,
        help="expert_parallel_size: ranks that share out each mixture-of-experts layer's experts",
    )
    parser.add_argument(
        "--dp",
        "--data-parallel-size",
        dest="dp",
        type=int,
        default=None,
        help="data_parallel_size, checked against --ep (default: left to the world size)",
    )
    args = parser.parse_args(argv)
    if args.tp < 1:
        parser.error(f"--tp must be a positive integer, got {args.tp}")
    layout = {
        "tensor_parallel_size": args.tp,
        "data_parallel_size": args.dp,
        "expert_parallel_size": args.ep,
        "sequence_parallel": args.sequence_parallel,
    }
    problems = option_problems(ParallelStrategy, layout)
    if problems:
        parser.error("; ".join(problems))
    module = _load(args.target)(**json.loads(args.kwargs))
    if args.ep > 1 and (problem := expert_parallel_problem(module, args.ep)):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    batch, traced = _sample(module, args.data, args.data_kwargs)
    run = forward_on(module, batch)
    try:
        resolved = resolve(module, args.plan, args.tp, run=run)
        if args.ep > 1:
            experts_left_to_expert_parallel(resolved, expert_placement(module, args.ep, run))
        if args.sequence_parallel:
            resolved.sequence = resolve_sequence(module, resolved, parse_plan_unless_auto(args.plan), run)
    except PlanError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    structural = args.plan == "auto" and traced == STRUCTURAL
    if args.plan == "auto" and not structural:
        print(traced)
    print(format_table(module, resolved))
    if structural:
        print(traced)
    return 0


if __name__ == "__main__":
    sys.exit(main())
