"""ZeRO-3 (``zero_stage=3``): the parameters sharded over the data-parallel group too, gathered per unit.

The model is cut into *units*: each block of the block stack (``module_names.find_block_stack``), and the
root unit, every other trainable parameter. A unit's parameters live in one flat buffer laid out as ZeRO-1/2
lay out a gradient bucket (``zero.py``): the parameters one after the other, padded to ``W`` equal ranges,
rank ``r`` keeping range ``r`` (its *shard*, a flat tensor of its own). While gathered, the parameters are
views of the flat buffer; while the unit is freed its storage is resized to zero and each parameter presents
a placeholder instead (its ``.data`` one NaN element expanded to its shape), so that their names, shapes and
objects stay the model's own, only the memory goes, and code that reads a weight between uses (a callback)
reads NaN, never released memory. ``gathered()`` gives the values.

One step, in the order the hooks run::

    forward      a block's forward pre-hook gathers it (its shard into its range, an all-gather of the
                 ranges; the next block's gather is started then, so it runs while this one computes:
                 at most one unit in flight); its forward hook frees it again (``reshard_after_forward``;
                 False keeps it until its backward; an evaluation forward always frees) and hooks its
                 outputs. The root unit is
                 gathered by the strategy before the step (and by the forward pre-hook of every module that
                 owns one of its parameters: a second forward after a backward) and kept through backward.
    backward     the first gradient of a block's outputs gathers it again (before any of its backward
                 runs, so a recomputed forward finds it too; the gather of the block before it is started
                 then); its gradients accumulate in a bucket of the
                 unit's layout, which is reduce-scattered as ZeRO-2 does (``ShardedGradientReducer``,
                 stage 2's buffers) once the unit's last gradient arrives, and the unit is freed then
    step         the optimizer updates this rank's pieces, which are views of the shards: nothing is
                 gathered after the step (the next forward gathers)

A pipeline stage (``kept=True``, over the blocks the stage holds) runs several forwards and backwards of
each unit per step, one per micro-batch, interleaved with other micro-batches' by its schedule. Its units
are gathered once, when the step's schedule starts (``step()``: every gather started, then waited for), and
stay gathered across its micro-batches, split backwards' weight gradients included; they are freed once
the schedule's backwards are done, while the gradients' reduce-scatters may still run. No block hook is
installed: one all-gather per unit and step instead of two per unit and micro-batch, at the cost of the
stage's parameters held whole during the schedule (torchtitan's choice under pipelines).

The gathers run over a process group of their own, so that their order against the gradients'
reduce-scatters (started from autograd hooks) cannot differ between ranks. Frozen parameters are not
sharded (every rank holds them whole, as at stage 0), nor are those a strategy leaves out (under expert
parallelism the experts placed on a rank differ across the data-parallel group: a second set of units over
their replicas shards them, leaving out the rest).

The module may be a rank's tensor-parallel share: its parameters are whatever this rank holds (sharded
layers' slices, replicated norms), and the units shard those over the data-parallel group.

A module built on meta is laid out in units there (``device``): each rank allocates only its shards, and
set-up writes its range of each parameter's full value into them (``place``). A sharded checkpoint writes
and reads each parameter's range in this rank's shard (``state_pieces``).
"""

from __future__ import annotations

import ctypes
import mmap
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Generator, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.compat import all_gather_single, tree_flatten
from lightning_parallel.distributed.optimizer_shards import StatePieces
from lightning_parallel.distributed.reducer import _Bucket
from lightning_parallel.distributed.zero import MAPPED_BYTES, ShardedGradientReducer, all_gather_by_ranges
from lightning_parallel.module_names import find_block_stack

__all__ = ["ParameterUnit", "ShardedParameters", "FullyShardedGradientReducer"]


@dataclass
class ParameterUnit:
    """The trainable parameters of one unit (``module`` a block, or None for the root unit), views of the
    flat buffer ``full`` (``W`` ranges of ``size`` elements), of which this rank keeps range ``rank`` in
    ``shard``."""

    name: str
    module: Optional[nn.Module]
    params: list[nn.Parameter]
    full: Tensor
    shard: Tensor
    rank: int
    gathered: bool = True
    work: Any = None  # the gather in flight (prefetched), waited for before the unit is used or freed
    mapped: Optional[mmap.mmap] = None  # on the CPU: the memory mapping ``full`` lies in (``_flat_buffer``)
    views: list[Tensor] = field(init=False, repr=False)
    placeholders: list[Tensor] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # what each parameter presents: its view of ``full`` while gathered, a placeholder while freed
        self.views = [p.data for p in self.params]
        released = torch.full((), float("nan"), dtype=self.full.dtype, device=self.full.device)
        self.placeholders = [released.expand(p.shape) for p in self.params]

    @property
    def size(self) -> int:
        return self.shard.numel()

    def own(self) -> Tensor:
        """This rank's range of the flat buffer (readable while gathered)."""
        return self.full[self.rank * self.size : (self.rank + 1) * self.size]

    def wait(self) -> None:
        """The gather in flight, if any, finished: the unit is gathered, its parameters its views again."""
        if self.work is not None:
            self.work.wait()
            self.work, self.gathered = None, True
            self.present(self.views)

    def free(self) -> None:
        """The gathered parameters' memory handed back (a mapped buffer's pages released, else the storage
        resized to nothing); the parameters present their placeholders meanwhile."""
        self.wait()
        if self.gathered:
            self.present(self.placeholders)
            if self.mapped is not None:
                self.mapped.madvise(mmap.MADV_DONTNEED)
            else:
                self.full.untyped_storage().resize_(0)
            self.gathered = False

    def allocate(self) -> None:
        """The flat buffer's memory back before a gather (a mapped buffer's pages come back as written)."""
        if self.mapped is None:
            self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())

    def present(self, tensors: list[Tensor]) -> None:
        """Each parameter's ``.data`` set to its tensor in ``tensors`` (same shape, dtype and device)."""
        for p, t in zip(self.params, tensors):
            p.data = t

    @contextmanager
    def as_views(self) -> Generator[None, None, None]:
        """The parameters present their views inside, gathered or not: for code that reads only their
        metadata (shape, strides), never their values."""
        self.present(self.views)
        try:
            yield
        finally:
            if not self.gathered:
                self.present(self.placeholders)

    def keep_own(self) -> None:
        """The gathered values of this rank's range into its shard (after the parameters were loaded)."""
        with torch.no_grad():
            self.shard.copy_(self.own())


def _refuse_mixed(name: str, params: list[nn.Parameter]) -> None:
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1 or len({p.device for p in params}) != 1:
        raise ValueError(
            f"zero_stage=3 flattens each unit's parameters into one buffer; unit {name or '(root)'!r} mixes "
            f"dtypes or devices ({sorted(map(str, dtypes))}); give its parameters one dtype and device"
        )


def _unit(name: str, module: Optional[nn.Module], params: list[nn.Parameter], group: Any) -> ParameterUnit:
    """A unit over ``params``, which become views of its flat buffer (gathered: it holds their values)."""
    _refuse_mixed(name, params)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    numel = sum(p.numel() for p in params)
    size = -(-numel // world)
    full, mapped = _flat_buffer(size * world, params[0].dtype, params[0].device)
    offset = 0
    with torch.no_grad():
        for p in params:
            view = full[offset : offset + p.numel()]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view_as(p)
            offset += p.numel()
    shard = full[rank * size : (rank + 1) * size].clone()
    return ParameterUnit(name, module, params, full, shard, rank, mapped=mapped)


def _flat_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Optional[mmap.mmap]]:
    """A unit's zeroed flat buffer and, on the CPU from ``MAPPED_BYTES`` on, the memory mapping it lies in.
    A unit is freed and gathered again twice a step; through the allocator, glibc serves such sizes from its
    heap once a large block has been freed (its mmap threshold rises to the freed size), and the freed
    units' pages stayed resident there: ZeRO-3's peak resident memory was above ZeRO-1's at dp=4. A mapping
    of its own releases its pages when freed (``madvise``) and keeps its address, so the views stay valid."""
    nbytes = numel * dtype.itemsize
    if device.type != "cpu" or nbytes < MAPPED_BYTES:
        return torch.zeros(numel, dtype=dtype, device=device), None
    mapped = mmap.mmap(-1, nbytes)
    return torch.frombuffer(mapped, dtype=dtype, count=numel), mapped


#: glibc's ``mallopt`` parameter for its mmap threshold
M_MMAP_THRESHOLD = -3


def map_large_host_blocks() -> None:
    """From now on glibc serves every block of ``MAPPED_BYTES`` or more from a mapping of its own, which a
    free hands back to the system (a no-op without glibc). By default glibc raises that threshold to the
    size of the largest mapped block freed so far (up to 32 MiB), so once set-up has freed a module's host
    copy, or a step a large gradient, the activations and gradients of every later step come from its
    heap, whose freed holes stay resident below what lives above them. ZeRO-3 holds little between steps,
    so those holes were most of what it added: at dp=4, 32 blocks of width 384, 145 MiB of a 501 MiB peak
    above the runtime (docs/memory.md). Process-wide, as ``MALLOC_MMAP_THRESHOLD_`` would set it."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MAPPED_BYTES)
    except (OSError, AttributeError):
        pass


def _blocks(module: nn.Module, stack_name: Optional[str]) -> list[nn.Module]:
    """The blocks of the block stack (``stack_name``, or found); none for a model without a stack of at
    least 2 blocks (one block, or no repeated layers): the whole model is then the root unit."""
    try:
        _, stack = find_block_stack(module, stack_name)
    except ValueError:
        if stack_name is not None:
            raise
        return []
    return list(stack)


def _overlap(unit: ParameterUnit, rank: int, offset: int, numel: int) -> tuple[int, int]:
    """The elements ``(start, stop)`` of the parameter at ``offset`` in ``unit``'s flat buffer (of ``numel``
    elements) that rank ``rank``'s range holds; ``start >= stop``: none."""
    first = rank * unit.size
    return max(first, offset) - offset, min(first + unit.size, offset + numel) - offset


def _unit_on_meta(
    name: str, module: Optional[nn.Module], params: list[nn.Parameter], group: Any, device: torch.device
) -> ParameterUnit:
    """A freed unit over ``params`` (meta parameters of a module built on meta) laid out as ``_unit`` lays
    out real ones: new parameters on ``device``, views of a flat buffer that is never filled (freed at once),
    and this rank's shard, zeros until ``ShardedParameters.place`` writes the values into it. The caller puts
    the new parameters in the module in the meta ones' place."""
    _refuse_mixed(name, params)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    numel = sum(p.numel() for p in params)
    size = -(-numel // world)
    full = torch.empty(size * world, dtype=params[0].dtype, device=device)  # never written: no pages touched
    views, offset = [], 0
    for p in params:
        param = nn.Parameter(torch.empty(0, dtype=full.dtype, device=device))
        param.data = full[offset : offset + p.numel()].view(p.shape)  # as _unit: a version counter of its own
        views.append(param)
        offset += p.numel()
    full.untyped_storage().resize_(0)
    shard = torch.zeros(size, dtype=full.dtype, device=device)
    unit = ParameterUnit(name, module, views, full, shard, rank, gathered=False)
    unit.present(unit.placeholders)  # freed: a read finds the placeholders, never the released buffer
    return unit


def _put_in_place(module: nn.Module, new: dict[nn.Parameter, nn.Parameter]) -> None:
    """Every registry entry of ``module`` holding a key of ``new`` made to hold its value (ties kept)."""
    for m in module.modules():
        for attr, p in m._parameters.items():
            if p is not None and p in new:
                m._parameters[attr] = new[p]


def _refuse_shared(module: nn.Module, blocks: list[nn.Module]) -> None:
    """A parameter is in one unit: one tied across two blocks, or between a block and a module outside
    the blocks, would be gathered and freed by either, so it is refused with its names."""
    inside = {m for block in blocks for m in block.modules()}
    owners: dict[nn.Parameter, set[int]] = {}
    for i, block in enumerate(blocks):
        for p in block.parameters():
            owners.setdefault(p, set()).add(i)
    outside = {p for m in module.modules() if m not in inside for p in m.parameters(recurse=False)}
    shared = [
        n
        for n, p in module.named_parameters(remove_duplicate=False)
        if len(owners.get(p, ())) > 1 or (p in owners and p in outside)
    ]
    if shared:
        raise ValueError(
            f"zero_stage=3 gathers each block's parameters as one unit, and these are shared between blocks or "
            f"between a block and the rest of the model: {shared[:6]}; untie them or use zero_stage 2"
        )


class ShardedParameters:
    """The parameters of ``module`` sharded over ``group`` in units (see the module docstring), gathered over
    ``gather_group``. The hooks a strategy calls: ``before_forward`` / ``after_forward`` around its step
    (``kept``: ``step()`` around a pipeline stage's schedule), ``after_backward``, ``gathered()`` around a
    full state read or load, ``teardown``.

    Args:
        leave_out: trainable parameters in no unit here (held whole, or sharded by another set).
        blocks: the blocks that are units (None: the module's block stack; a pipeline stage: those it holds).
        kept: gathered for a whole step by ``step()``, with no hooks on the blocks (a pipeline stage).
        device: of a module built on meta: the units laid out there, each rank allocating only its shards on
            ``device`` (filled by ``place``).
    """

    def __init__(
        self,
        module: nn.Module,
        group: Any,
        gather_group: Any,
        reshard_after_forward: bool = True,
        stack_name: Optional[str] = None,
        leave_out: Iterable[nn.Parameter] = (),
        blocks: Optional[Sequence[nn.Module]] = None,
        kept: bool = False,
        device: Optional[torch.device] = None,
    ) -> None:
        self.group, self.gather_group = group, gather_group
        self.reshard_after_forward, self.kept = reshard_after_forward, kept
        self._by_ranges = dist.get_backend(gather_group) == "gloo"
        self.gathers = 0  # units gathered so far (tests read how often reshard_after_forward gathers)
        self.prefetches = 0  # of those, started ahead of the unit's use (while another unit computes)
        self._gathered_depth = 0  # how many gathered() contexts are open
        blocks = _blocks(module, stack_name) if blocks is None else list(blocks)
        in_blocks = {p for block in blocks for p in block.parameters()}
        left_out = set(leave_out)
        trainable = lambda ps: [p for p in ps if p.requires_grad and p not in left_out]  # noqa: E731
        root = [p for p in trainable(dict.fromkeys(module.parameters())) if p not in in_blocks]
        in_root = set(root)
        _refuse_shared(module, blocks)
        make = _unit if device is None else partial(_unit_on_meta, device=device)
        self.blocks = [
            make(str(i), block, trainable(block.parameters()), group)
            for i, block in enumerate(blocks)
            if trainable(block.parameters())
        ]
        self.root = make("", None, root, group) if root else None
        # built on meta: each new parameter's unit and offset, until place() has written its values
        self._unplaced: dict[nn.Parameter, tuple[ParameterUnit, int]] = {}
        self._by_name: dict[str, nn.Parameter] = {}
        if device is not None:
            metas = [trainable(block.parameters()) for block in blocks if trainable(block.parameters())]
            in_root = set(self._replace_meta_parameters(module, [*metas, root]))
        self._index = {id(unit): i for i, unit in enumerate(self.blocks)}
        self._handles = [] if kept else [h for unit in self.blocks for h in self._hook(unit)]
        if self.root is not None and not kept:  # a forward after a backward in one step gathers the root
            owners = [m for m in module.modules() if any(p in in_root for p in m.parameters(recurse=False))]
            gather_root = partial(self._gather_before, self.root)
            self._handles += [m.register_forward_pre_hook(gather_root) for m in owners]
        if any(unit.full.device.type == "cpu" for unit in self.units()):
            map_large_host_blocks()
        for unit in self.units():
            unit.free()

    # ------------------------------------------------------------------ set-up of a model built on meta
    def _replace_meta_parameters(
        self, module: nn.Module, metas: list[list[nn.Parameter]]
    ) -> list[nn.Parameter]:
        """The units' new parameters put in ``module`` in place of the meta ones (``metas``: each unit's, in
        ``self.blocks`` then root order), each noted by every name with its unit and offset for ``place``.
        Returns the root unit's new parameters."""
        new: dict[nn.Parameter, nn.Parameter] = {}
        for unit, old in zip([*self.blocks, *([self.root] if self.root is not None else [])], metas):
            offset = 0
            for meta, p in zip(old, unit.params):
                new[meta], self._unplaced[p] = p, (unit, offset)
                offset += p.numel()
        _put_in_place(module, new)
        self._by_name = {
            n: p for n, p in module.named_parameters(remove_duplicate=False) if p in self._unplaced
        }
        return [] if self.root is None else self.root.params

    def place(self, name: str, value: Tensor) -> bool:
        """Write this rank's range of the full ``value`` of parameter ``name`` into its unit's shard (set-up
        of a model built on meta); False when ``name`` is not a parameter of a unit."""
        p = self._by_name.get(name)
        if p is None:
            return False
        where = self._unplaced.pop(p, None)
        if where is not None:  # else written already, under another of its names
            unit, offset = where
            start, stop = _overlap(unit, unit.rank, offset, p.numel())
            if start < stop:
                into = offset + start - unit.rank * unit.size
                with torch.no_grad():
                    unit.shard[into : into + stop - start].copy_(
                        value.reshape(-1)[start:stop].to(unit.shard.dtype)
                    )
        return True

    def check_placed(self) -> None:
        """Raises naming the parameters built on meta that ``place`` gave no values."""
        waiting = set(self._unplaced)
        missing = [n for n, p in self._by_name.items() if p in waiting]
        if missing:
            raise RuntimeError(
                f"zero_stage=3 set-up gave no values to {missing[:5]} (of {len(missing)}): a bug, please report it"
            )

    # ------------------------------------------------------------------ sharded checkpoints
    def state_pieces(self, module: nn.Module) -> dict[str, Optional[StatePieces]]:
        """Each parameter of a unit by every name in ``module``, as this rank holds it: its elements in this
        rank's shard (views, so a sharded checkpoint writes from and reads into the shards directly) and
        every rank's span of it; None for a parameter this rank holds no element of."""
        pieces: dict[nn.Parameter, Optional[StatePieces]] = {}
        world = dist.get_world_size(self.group)
        for unit in self.units():
            offset = 0
            for p in unit.params:
                spans = [_overlap(unit, r, offset, p.numel()) for r in range(world)]
                start, stop = spans[unit.rank]
                held = unit.shard[
                    offset + start - unit.rank * unit.size : offset + stop - unit.rank * unit.size
                ]
                spans = [(a, b) for a, b in spans if a < b]
                pieces[p] = StatePieces(held, start, spans, p.shape) if start < stop else None
                offset += p.numel()
        named = module.named_parameters(remove_duplicate=False)
        return {n: pieces[p] for n, p in named if p in pieces}

    def units(self) -> list[ParameterUnit]:
        """Every unit, in the order backward completes them: the blocks last to first, then the root."""
        return [*reversed(self.blocks), *([self.root] if self.root is not None else [])]

    def held_tensors(self) -> list[Tensor]:
        """What this rank holds of the parameters between steps (the memory report's)."""
        return [unit.shard for unit in self.units()]

    def released_tensors(self) -> list[Tensor]:
        """What the memory report leaves out of the parameters: the flat buffers of the units freed now whose
        memory is mapped (their storage keeps its size but holds no pages), and the placeholders the freed
        units' parameters present (one element each, not the model's memory)."""
        freed = [unit for unit in self.units() if not unit.gathered]
        mapped = [unit.full for unit in freed if unit.mapped is not None]
        return [*mapped, *(unit.placeholders[0] for unit in freed if unit.placeholders)]

    def flat_buffers(self) -> list[Tensor]:
        """Every unit's flat buffer: the storage of the parameters while gathered (autograd saves views of it,
        which are parameters, not activations)."""
        return [unit.full for unit in self.units()]

    # ------------------------------------------------------------------ gather and free
    def start_gather(self, unit: ParameterUnit) -> bool:
        """The unit's flat buffer allocated again and the gather of every rank's range into it started;
        False (nothing done) if it is gathered or on its way."""
        if unit.gathered or unit.work is not None:
            return False
        full = unit.full
        unit.allocate()
        own = unit.own()
        own.copy_(unit.shard)
        if self._by_ranges:
            unit.work = all_gather_by_ranges(full, self.gather_group)
        else:
            unit.work = all_gather_single()(full, own, group=self.gather_group, async_op=True)
        self.gathers += 1
        return True

    def gather(self, unit: ParameterUnit) -> None:
        """The unit gathered (its gather started now, or waited for if it was prefetched)."""
        self.start_gather(unit)
        unit.wait()

    def gather_all(self) -> None:
        """Every unit gathered: all the gathers started, then waited for."""
        units = self.units()
        for unit in units:
            self.start_gather(unit)
        for unit in units:
            unit.wait()

    def free_all(self) -> None:
        for unit in self.units():
            unit.free()

    @contextmanager
    def gathered(self) -> Generator[None, None, None]:
        """Every unit gathered inside (a full state read or loaded); what a load wrote is kept. Nested, only
        the outermost gathers, keeps and frees (an inner one would free what the outer still reads)."""
        if self._gathered_depth:
            self._gathered_depth += 1
            try:
                yield
            finally:
                self._gathered_depth -= 1
            return
        self.gather_all()
        self._gathered_depth = 1
        try:
            yield
        finally:
            self._gathered_depth = 0
            for unit in self.units():
                unit.keep_own()
            self.free_all()

    @contextmanager
    def as_views(self) -> Generator[None, None, None]:
        """Every parameter presents its view inside (``ParameterUnit.as_views``: metadata reads only)."""
        with ExitStack() as stack:
            for unit in self.units():
                stack.enter_context(unit.as_views())
            yield

    @contextmanager
    def step(self) -> Generator[None, None, None]:
        """Every unit gathered for a pipeline stage's schedule (its forwards and backwards), freed after."""
        self.gather_all()
        try:
            yield
        finally:
            self.free_all()

    # ------------------------------------------------------------------ hooks
    def _hook(self, unit: ParameterUnit) -> list[Any]:
        module = unit.module
        assert module is not None
        return [
            module.register_forward_pre_hook(partial(self._gather_before, unit)),
            module.register_forward_hook(partial(self._after_block, unit)),
        ]

    def _gather_before(self, unit: ParameterUnit, module: nn.Module, args: Any) -> None:
        """Before a unit's forward: the unit gathered, and the next block's gather started (prefetch: at
        most one unit in flight while this one computes)."""
        self.gather(unit)
        self._prefetch(unit, +1)

    def _prefetch(self, unit: ParameterUnit, step: int) -> None:
        """Start the gather of the block ``step`` places from ``unit`` in the stack (the root: none)."""
        index = self._index.get(id(unit))
        if index is not None and 0 <= index + step < len(self.blocks):
            self.prefetches += self.start_gather(self.blocks[index + step])

    def _after_block(self, unit: ParameterUnit, module: nn.Module, args: Any, output: Any) -> None:
        training = torch.is_grad_enabled()
        if training:
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
            for t in tensors:
                t.register_hook(partial(self._before_block_backward, unit))
        if self.reshard_after_forward or not training:
            unit.free()

    def _before_block_backward(self, unit: ParameterUnit, grad: Tensor) -> None:
        """The block's backward comes next: gathered, and the block before it (whose backward follows)
        started."""
        self.gather(unit)
        self._prefetch(unit, -1)

    def before_forward(self) -> None:
        """Before a step's forward: the root unit gathered (it is used before and after the blocks)."""
        if self.root is not None:
            self.gather(self.root)

    def after_forward(self) -> None:
        """After a step's forward: an evaluation step (no backward to come) frees what it gathered."""
        if not torch.is_grad_enabled():
            self.free_all()

    def backward_done(self, unit: ParameterUnit) -> None:
        """The unit's last gradient of this backward arrived: its parameters are not needed again (``kept``:
        until the schedule's other micro-batches are done, ``step()``)."""
        if not self.kept:
            unit.free()

    def after_backward(self) -> None:
        """What a backward left gathered (a unit with a parameter that got no gradient) is freed."""
        self.free_all()

    def teardown(self) -> None:
        """Every unit gathered for good (the module leaves fit whole), the hooks removed."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.gather_all()


class FullyShardedGradientReducer(ShardedGradientReducer):
    """ZeRO-2's gradient path (``ShardedGradientReducer``, stage 2's buffers) with one bucket per unit of
    ``sharded``, in the unit's layout, so that this rank's range of a bucket is its shard's: the pieces are
    views of the shards, a unit is freed once its bucket's gradients are all in, and nothing is gathered
    after the step."""

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        group: Any,
        sharded: ShardedParameters,
        **kwargs: Any,
    ) -> None:
        self.sharded = sharded
        units = sharded.units()
        self._unit_of = {p: unit for unit in units for p in unit.params}
        trainable = {p for _, p in named_params if p.requires_grad}
        missing = [n for n, p in named_params if p in trainable and p not in self._unit_of]
        if missing:
            raise ValueError(f"zero_stage=3: trainable parameters outside every unit: {missing[:5]}")
        with sharded.as_views():  # ZeRO-2's set-up reads the parameters' layout (contiguous), not values
            super().__init__(named_params, group, 2, **kwargs)
        self._bucket_units = [self._unit_of[b.params[0]] for b in self.buckets]

    def _bucket_groups(self, order: list[nn.Parameter], used: int) -> list[list[int]]:
        index = {p: i for i, p in enumerate(order)}
        return [[index[p] for p in unit.params] for unit in self.sharded.units()]

    def _piece_view(self, bucket: _Bucket, p: nn.Parameter, start: int, stop: int, offset: int) -> Tensor:
        return self._unit_of[p].shard[offset : offset + stop - start]

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        super()._on_grad_ready(p)
        b, _ = self._where[p]
        if self.buckets[b].pending == 0:
            self.sharded.backward_done(self._bucket_units[b])

    def gather_parameters(self) -> None:
        """After the optimizer step, which updated the shards in place: the pieces' gradients dropped (the
        next forward gathers the units)."""
        self.syncs_since_step, self._unused_since_step = 0, None
        for piece in self.pieces():
            piece.shard.grad = None
