"""Cut an unmodified module into pipeline stages without rewriting its ``forward``.

The block stack (an ``nn.ModuleList`` looped over in ``forward``, or an ``nn.Sequential``) is found by
size. Each stage keeps a contiguous range of blocks; the others are replaced by ``_Skip`` (no
parameters, passes its first argument through), so indices and parameter names stay as they were. Two
hooks turn the user's own ``forward`` into a stage:

- on the first block of a stage (but the first stage), a pre-hook swaps the input for the activation
  received from the previous stage (extra per-block arguments, e.g. a mask computed in ``forward``,
  are untouched: every stage runs ``forward`` itself);
- on the last block of a stage (but the last stage), a hook raises ``StageOutput`` with the block's
  output: the rest of ``forward`` and of ``training_step`` belongs to later stages.

Modules outside the stack (embeddings, final norm, head) stay on every stage, replicated: the first
stage's embedding and the last stage's head do the work, and their gradients are summed over the
pipeline group so every copy takes the same step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

from torch import Tensor, nn

__all__ = ["StageOutput", "StageInput", "find_block_stack", "balance", "block_parameters", "stage_bounds", "StagePartition", "partition"]


class StageOutput(BaseException):
    """Raised through the user's code at the end of a stage (BaseException: ``except Exception`` in
    user code must not swallow it)."""

    def __init__(self, tensor: Tensor) -> None:
        super().__init__("end of pipeline stage")
        self.tensor = tensor


@dataclass
class StageInput:
    """Where the executor puts the received activation, and where the pre-hook records what it used."""

    pending: Optional[Any] = None  # a tensor, or a tuple of tensors
    used: Optional[Any] = None


class _Skip(nn.Module):
    """Stands in for a block that lives on another stage."""

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return x


def find_block_stack(module: nn.Module, name: Optional[str] = None) -> tuple[str, nn.Module]:
    """The block stack: ``name`` if given, else the ModuleList/Sequential (>= 2 children) with the most
    parameters (the shallowest on a tie)."""
    stacks = {n: m for n, m in module.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= 2}
    if name is not None:
        if name not in stacks:
            raise ValueError(f"block stack {name!r} is not an nn.ModuleList/nn.Sequential of the module; candidates: "
                             f"{sorted(stacks) or 'none'}")
        return name, stacks[name]
    if not stacks:
        raise ValueError(
            f"{type(module).__name__} has no block stack to pipeline: looked for an nn.ModuleList looped over in "
            "forward, or an nn.Sequential, with at least 2 blocks. Put the repeated layers in one of those."
        )
    best = max(stacks, key=lambda n: (sum(p.numel() for p in stacks[n].parameters()), -n.count(".")))
    return best, stacks[best]


def block_parameters(stack: nn.Module) -> list[int]:
    """Each block's parameter count: the default cost to balance."""
    return [sum(p.numel() for p in b.parameters()) for b in stack]


def balance(costs: Sequence[float], num_stages: int) -> list[int]:
    """Block counts per stage (contiguous) minimising the largest stage's total cost (parameter counts,
    or measured seconds for ``balance="time"``)."""
    n = len(costs)
    prefix = [0.0]
    for s in costs:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    # best[k][i]: smallest max-stage size splitting the first i blocks into k non-empty stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    counts, i = [], n
    for k in range(num_stages, 0, -1):
        counts.append(i - cut[k][i])
        i = cut[k][i]
    return counts[::-1]


def stage_bounds(stack_name: str, stack: nn.Module, num_stages: int,
                 split_points: Optional[Sequence[Union[str, int]]] = None,
                 costs: Optional[Sequence[float]] = None) -> list[tuple[int, int]]:
    """[start, end) block indices per stage, from ``split_points`` (block names where a stage starts,
    or block counts per stage), else balanced by ``costs`` per block (default: parameter counts)."""
    n = len(stack)
    if num_stages > n:
        raise ValueError(f"{num_stages} pipeline stages need at least {num_stages} blocks, but {stack_name!r} has {n}; "
                         f"use pipeline_parallel_size <= {n}.")
    if split_points is None:
        counts = balance(block_parameters(stack) if costs is None else costs, num_stages)
    elif all(isinstance(s, int) for s in split_points):
        counts = list(split_points)
        if len(counts) != num_stages or sum(counts) != n or min(counts) < 1:
            raise ValueError(f"split_points={counts} as block counts must be {num_stages} positive numbers summing to {n}.")
    else:
        names = [f"{stack_name}.{i}" if stack_name else str(i) for i in range(n)]
        starts = []
        for point in split_points:
            if point not in names:
                raise ValueError(f"split point {point!r} names no block of the stack; candidates: {', '.join(names)}")
            starts.append(names.index(point))
        if len(starts) != num_stages - 1 or starts != sorted(set(starts)) or starts[0] == 0:
            raise ValueError(f"split_points={list(split_points)} must name {num_stages - 1} distinct blocks after the "
                             f"first, in order (one per stage boundary).")
        edges = [0] + starts + [n]
        counts = [b - a for a, b in zip(edges, edges[1:])]
    edges = [0]
    for c in counts:
        edges.append(edges[-1] + c)
    return list(zip(edges, edges[1:]))


@dataclass
class StagePartition:
    """What ``partition`` did to the module on this rank."""

    stack_name: str
    bounds: list[tuple[int, int]]
    stage: int
    io: StageInput = field(default_factory=StageInput)
    owned: list[str] = field(default_factory=list)  # names of this stage's parameters that live nowhere else

    @property
    def num_stages(self) -> int:
        return len(self.bounds)


def partition(module: nn.Module, num_stages: int, stage: int, stack_name: Optional[str] = None,
              split_points: Optional[Sequence[Union[str, int]]] = None,
              costs: Optional[Sequence[float]] = None) -> StagePartition:
    """Keep this stage's blocks in ``module`` (in place) and install the stage-boundary hooks."""
    name, stack = find_block_stack(module, stack_name)
    bounds = stage_bounds(name, stack, num_stages, split_points, costs)
    part = StagePartition(stack_name=name, bounds=bounds, stage=stage)
    start, end = bounds[stage]
    for i in range(len(stack)):
        if not start <= i < end:
            stack[i] = _Skip()
    prefix = f"{name}." if name else ""
    part.owned = [f"{prefix}{i}.{n}" for i in range(start, end) for n, _ in stack[i].named_parameters()]
    if stage > 0:
        stack[start].register_forward_pre_hook(_take_received_input(part.io), with_kwargs=True)
    if stage < num_stages - 1:
        stack[end - 1].register_forward_hook(_end_of_stage)
    return part


def _take_received_input(io: StageInput):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if io.pending is None:
            raise RuntimeError("pipeline stage ran without an input from the previous stage")
        received, io.pending = io.pending, None
        for t in received if isinstance(received, tuple) else (received,):
            if t.is_floating_point():
                t.requires_grad_(True)
        io.used = received
        if args:
            return (received,) + tuple(args[1:]), kwargs
        first = next(iter(kwargs))
        return args, {**kwargs, first: received}

    return hook


def _end_of_stage(module: nn.Module, args: tuple, output: Any) -> None:
    raise StageOutput(output)
