"""Cut an unmodified module into pipeline stages without rewriting its ``forward``.

The block stack (an ``nn.ModuleList`` looped over in ``forward``, or an ``nn.Sequential``) is the one
with the most parameters, unless named. Each stage keeps a contiguous range of blocks. The blocks held
by other stages stay in place, the same objects of the same classes with the same attributes and
submodules (the model's own code may read them: ``nn.TransformerEncoder`` reads ``layers[0].self_attn``),
but their parameters and buffers become meta tensors held as plain attributes, outside the module's
registry: ``parameters()``, ``state_dict()`` and the optimizer see only this stage's tensors, under the
single-device names, and a held-elsewhere block stores nothing. Calling such a block returns its first
input (on a later stage, what the previous stage sent: below). Two hooks turn the user's own ``forward``
into a stage:

- on the blocks of earlier stages (on all but the first stage), a hook makes each return the output
  received from the previous stage's last block, in its structure (a tensor, or a tuple of tensors and
  None such as Falcon's ``(hidden, None)``); the user's code between blocks and the extra per-block
  arguments (e.g. a mask computed in ``forward``) run as on one device: every stage runs ``forward`` itself;
- on the last block of a stage (but the last stage), a hook raises ``StageOutput`` with the block's
  output: the rest of ``forward`` and of ``training_step`` belongs to later stages.

A rank may hold several chunks of the stack (``chunks``: the virtual stages it holds, in the order of
its local chunk index; the interleaved and V-shaped schedules). ``StageInput.chunk`` says which one runs:
the blocks before its range return what was received for it, its last block ends the stage, and the
blocks of the rank's earlier chunks pass their input through while it runs (``StagePartition.running``).
With one chunk per rank (``chunks=[stage]``) a rank's stage is one contiguous range, as above.

Every block keeps a skeleton of itself from before the cut (``keep_block_skeletons``), so a network held
in a checkpoint's hyperparameters is saved as one device holds it.

Modules outside the stack (embeddings, final norm, head, and any other block stack, e.g. the encoder
of an ``nn.Transformer`` whose decoder is pipelined) stay on every stage, replicated: each stage runs
them, and their gradients are summed over the pipeline group so every copy takes the same step.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence, Union

from torch import Tensor, nn

from lightning_parallel.checkpointing.one_device import keep_skeleton
from lightning_parallel.compat import without_layer_caches
from lightning_parallel.module_names import find_block_stack, other_stacks

__all__ = [
    "StageInput",
    "StageOutput",
    "StagePartition",
    "balance",
    "block_parameters",
    "held_elsewhere",
    "hold_elsewhere",
    "keep_block_skeletons",
    "partition",
    "refuse_tensors_shared_across_stages",
    "stage_bounds",
]


class StageOutput(BaseException):
    """Raised through the user's code at the end of a stage (BaseException: ``except Exception`` in
    user code must not swallow it), with the stage's output as its one argument: ``StageOutput(output)``.
    No ``__init__`` of its own, so that dynamo can build it inside a compiled forward."""

    @property
    def tensor(self) -> Any:
        """The stage's output (a tensor, or a tuple of tensors and None)."""
        return self.args[0]


@dataclass
class StageInput:
    """Where the executor puts the received activation, and where the hook records what it used."""

    pending: Optional[Any] = None  # a tensor, or a tuple of tensors and None
    used: Optional[Any] = None
    chunk: int = 0  # the local chunk whose forward runs (several chunks per rank: interleaved, V)
    repeating: bool = False  # the forward runs again what this rank's first chunk ran (``running``)


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


def stage_bounds(
    stack_name: str,
    stack: nn.Module,
    num_stages: int,
    split_points: Optional[Sequence[Union[str, int]]] = None,
    costs: Optional[Sequence[float]] = None,
) -> list[tuple[int, int]]:
    """[start, end) block indices per stage, from ``split_points`` (block names where a stage starts,
    or block counts per stage), else balanced by ``costs`` per block (default: parameter counts)."""
    n = len(stack)
    if num_stages > n:
        raise ValueError(
            f"{num_stages} pipeline stages need at least {num_stages} blocks, but {stack_name!r} has {n}; "
            f"use pipeline_parallel_size <= {n} (with several chunks per rank, pipeline_parallel_size x "
            f"virtual stages <= {n})."
        )
    if split_points is None:
        counts = balance(block_parameters(stack) if costs is None else costs, num_stages)
    elif all(isinstance(s, int) for s in split_points):
        counts = list(split_points)
        if len(counts) != num_stages or sum(counts) != n or min(counts) < 1:
            raise ValueError(
                f"split_points={counts} as block counts must be {num_stages} positive numbers summing to {n}."
            )
    else:
        names = [f"{stack_name}.{i}" if stack_name else str(i) for i in range(n)]
        starts = []
        for point in split_points:
            if point not in names:
                raise ValueError(
                    f"split point {point!r} names no block of the stack; candidates: {', '.join(names)}"
                )
            starts.append(names.index(point))
        if len(starts) != num_stages - 1 or starts != sorted(set(starts)) or starts[0] == 0:
            raise ValueError(
                f"split_points={list(split_points)} must name {num_stages - 1} distinct blocks after the "
                f"first, in order (one per stage boundary)."
            )
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
    bounds: list[tuple[int, int]]  # [start, end) blocks of each (virtual) stage, in model order
    stage: int  # this rank's place in the pipeline group
    chunks: list[int] = field(default_factory=list)  # the virtual stages this rank holds, by local chunk
    io: StageInput = field(default_factory=StageInput)
    owned: list[str] = field(default_factory=list)  # names of this stage's parameters that live nowhere else
    unpipelined: list[str] = field(default_factory=list)  # other candidate stacks, run whole on every stage
    stack: Optional[nn.Module] = None
    outside: list[nn.Module] = field(default_factory=list)  # modules outside the stack, run on every stage
    _aside: list[tuple[nn.Module, str, Tensor]] = field(default_factory=list)  # their buffers in a repeat

    @property
    def num_stages(self) -> int:
        return len(self.bounds)

    def chunk_bounds(self, chunk: int) -> tuple[int, int]:
        """[start, end) blocks of this rank's local ``chunk``."""
        return self.bounds[self.chunks[chunk]]

    def held_blocks(self) -> list[nn.Module]:
        """The blocks of every chunk this rank holds."""
        return [self.stack[i] for c in range(len(self.chunks)) for i in range(*self.chunk_bounds(c))]

    def ends_model(self, chunk: int) -> bool:
        """Whether ``chunk`` holds the stack's last blocks (its stage runs the rest of the forward)."""
        return self.chunks[chunk] == len(self.bounds) - 1

    @contextmanager
    def running(self, chunk: int) -> Iterator[None]:
        """Run ``chunk``'s forward: the hooks take its bounds, and the blocks of this rank's earlier chunks
        pass their input through (their output is replaced by what was received anyway).

        The user's ``forward`` runs from its start for every chunk, so the modules outside the stack that
        come before the chunk's first block (an input BatchNorm, an embedding) run once per chunk, each
        micro-batch. Their values there are replaced by the received input; only the rank's first chunk
        keeps their side effects: while a later chunk repeats them (``io.repeating``, until the block
        before its range), the buffers of the modules outside the stack are scratch copies, dropped
        after, so running statistics and call counters move once per micro-batch, as on one device."""
        start = self.chunk_bounds(chunk)[0]
        earlier = [
            self.stack[i]
            for c, (a, b) in enumerate(self.chunk_bounds(c) for c in range(len(self.chunks)))
            if c != chunk and b <= start
            for i in range(a, b)
        ]
        saved = [block.__dict__.get("forward") for block in earlier]
        self.io.chunk = chunk
        for block in earlier:
            block.forward = _passed_over
        try:
            if chunk > 0:
                self._begin_repeat()
            yield
        finally:
            self.end_repeat()
            for block, forward in zip(earlier, saved):
                if forward is None:
                    del block.forward
                else:
                    block.forward = forward

    def _begin_repeat(self) -> None:
        """The buffers of the modules outside the stack become scratch copies (``running``)."""
        self.io.repeating = True
        self._aside = [(m, n, b) for m in self.outside for n, b in m._buffers.items() if b is not None]
        for module, name, buffer in self._aside:
            module._buffers[name] = buffer.clone()

    def end_repeat(self) -> None:
        """The chunk's own part of the forward starts: the buffers set aside are the modules' again."""
        for module, name, buffer in self._aside:
            module._buffers[name] = buffer
        self._aside = []
        self.io.repeating = False

    def describe_stack(self) -> str:
        """Which stack is pipelined, and which other candidates run whole on every stage."""
        text = f"block stack {self.stack_name!r} ({sum(b - a for a, b in self.bounds)} blocks) is pipelined"
        if not self.unpipelined:
            return text
        others = ", ".join(repr(n) for n in self.unpipelined)
        return (
            f"{text}; other stacks run whole on every stage, replicated: {others} (block_stack=<name> "
            "pipelines another)"
        )


def partition(
    module: nn.Module,
    num_stages: int,
    stage: int,
    stack_name: Optional[str] = None,
    split_points: Optional[Sequence[Union[str, int]]] = None,
    costs: Optional[Sequence[float]] = None,
    chunks: Optional[Sequence[int]] = None,
) -> StagePartition:
    """Keep this rank's blocks in ``module`` (in place), hold the others elsewhere (``hold_elsewhere``)
    and install the stage-boundary hooks. ``num_stages`` counts the (virtual) stages the stack is cut
    into; ``chunks`` are those this rank holds, by local chunk index (default: ``[stage]``)."""
    name, stack = find_block_stack(module, stack_name)
    bounds = stage_bounds(name, stack, num_stages, split_points, costs)
    refuse_tensors_shared_across_stages(name, stack, bounds)
    held = list(chunks) if chunks is not None else [stage]
    part = StagePartition(
        stack_name=name,
        bounds=bounds,
        stage=stage,
        chunks=held,
        unpipelined=other_stacks(module, name),
        stack=stack,
    )
    mine = [i for c in held for i in range(*bounds[c])]
    prefix = f"{name}." if name else ""
    part.owned = [f"{prefix}{i}.{n}" for i in mine for n, _ in stack[i].named_parameters()]
    in_stack = {id(m) for m in stack.modules()}
    part.outside = [m for m in module.modules() if id(m) not in in_stack]
    hold_elsewhere(module, stack, [i for i in range(len(stack)) if i not in mine])
    for i in range(max(bounds[c][1] for c in held)):  # later blocks are never reached on this rank
        stack[i].register_forward_hook(_at_boundary(part, i))
    return part


def refuse_tensors_shared_across_stages(
    stack_name: str, stack: nn.Module, bounds: Sequence[tuple[int, int]]
) -> None:
    """Refuse a parameter or buffer that blocks of two different (virtual) stages hold as one tensor
    (``blocks[3].fc.weight = blocks[0].fc.weight``). Each stage would keep its own copy of it, update
    it with only its own blocks' part of the gradient, and save it under its own name, so the copies
    drift apart. The same rule on every rank (it reads the bounds, not this rank's share)."""
    stage_of = {i: s for s, (a, b) in enumerate(bounds) for i in range(a, b)}
    prefix = f"{stack_name}." if stack_name else ""
    first: dict[int, tuple[int, str]] = {}
    for i, block in enumerate(stack):
        named = [
            *block.named_parameters(remove_duplicate=False),
            *block.named_buffers(remove_duplicate=False),
        ]
        for name, tensor in named:
            j, other = first.setdefault(id(tensor), (i, name))
            if stage_of[j] != stage_of[i]:
                raise ValueError(
                    f"{prefix}{i}.{name} is the same tensor as {prefix}{j}.{other}, and blocks {j} and {i} "
                    f"fall in different pipeline stages ({stage_of[j]} and {stage_of[i]} of {len(bounds)}): each "
                    "stage would hold its own copy and train it with only its own blocks' part of the gradient. "
                    "Give each block its own tensor, tie it outside the block stack (a module every stage "
                    "runs, as tied embeddings are), or keep both blocks in one stage with split_points."
                )


def keep_block_skeletons(module: nn.Module, stack_name: Optional[str] = None) -> None:
    """Keep a skeleton of every block of the stack (``checkpointing.one_device``), before the tensors are
    taken out: a network held in a checkpoint's hyperparameters is saved from them as one device holds
    it, non-persistent buffers (which no state dict holds) included."""
    for block in find_block_stack(module, stack_name)[1]:
        keep_skeleton(block)


def hold_elsewhere(root: nn.Module, stack: nn.Module, indices: Sequence[int]) -> None:
    """Make the blocks ``stack[i]`` for ``i`` in ``indices`` (held by other stages) return their first
    input when called, and free their parameters and buffers: each becomes a meta tensor of the same
    shape, dtype and class held as a plain attribute, so reading it works but no registry
    (``parameters``, ``state_dict``, ``to``) sees it. Submodules that ``root`` also reaches other than
    through those blocks (shared with this stage's part) keep their tensors."""
    kept = _reachable(root, stack, {str(i) for i in indices})
    for i in indices:
        block = stack[i]
        if id(block) in kept:
            raise ValueError(
                f"block {i} of the stack, a {type(block).__name__}, is also used by another block or "
                "module of the model; pipelined blocks must be distinct modules."
            )
        block.forward = _first_input
        for sub in block.modules():
            if id(sub) not in kept:
                _free_tensors(sub)


def _reachable(root: nn.Module, stack: nn.Module, skipped: set[str]) -> set[int]:
    """ids of the modules reached from ``root`` without entering ``stack``'s children named in ``skipped``."""
    seen: set[int] = set()
    todo = [root]
    while todo:
        module = todo.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        todo.extend(
            child
            for name, child in module._modules.items()
            if child is not None and not (module is stack and name in skipped)
        )
    return seen


def _free_tensors(module: nn.Module) -> None:
    """Move ``module``'s own parameters and buffers out of its registry, as meta tensors."""
    for name, param in list(module._parameters.items()):
        del module._parameters[name]
        meta = None if param is None else nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        object.__setattr__(module, name, meta)
    for name, buffer in list(module._buffers.items()):
        del module._buffers[name]
        module._non_persistent_buffers_set.discard(name)
        object.__setattr__(module, name, None if buffer is None else buffer.to("meta"))


def held_elsewhere(block: nn.Module) -> bool:
    """Whether ``block`` is held by another stage (``hold_elsewhere``): it passes its input through."""
    return block.__dict__.get("forward") is _first_input


def _first_input(*args: Any, **kwargs: Any) -> Any:
    """The forward of a block held by another stage: its first argument, unchanged."""
    return args[0] if args else next(iter(kwargs.values()))


def _at_boundary(part: StagePartition, index: int):
    """The forward hook of block ``index``, for the chunk that runs (``part.io.chunk``):

    - a block before the chunk's range returns what the previous stage's last block returned (the
      received tensors in its structure, e.g. ``(hidden, None)``), so the user's code between the blocks
      (``hidden = outputs[0]``) runs as on one device. Only the last such block takes it for this stage
      (``io.used``): the earlier ones return it as a stand-in of the right structure;
    - the chunk's last block ends the stage (``StageOutput``), unless the chunk ends the model."""

    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        io = part.io
        start, end = part.chunk_bounds(io.chunk)
        if index < start:
            if io.pending is None:
                raise RuntimeError("pipeline stage ran without an input from the previous stage")
            received = io.pending
            for t in received if isinstance(received, tuple) else (received,):
                if t is not None and t.is_floating_point():
                    t.requires_grad_(True)
            if index == start - 1:
                io.pending, io.used = None, received
                part.end_repeat()
            return received
        if index == end - 1 and not part.ends_model(io.chunk):
            raise StageOutput(without_layer_caches(output))
        return None

    return hook


def _passed_over(*args: Any, **kwargs: Any) -> Any:
    """The forward of a block of this rank's earlier chunk while a later one runs: its first argument."""
    return _first_input(*args, **kwargs)
