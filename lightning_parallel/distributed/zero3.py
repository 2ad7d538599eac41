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
                 False keeps it until its backward, and so do the last two blocks, which the backward's
                 start holds anyway: ``KEPT_FOR_BACKWARD``; an evaluation forward always frees) and hooks
                 its outputs. The root unit is gathered by the strategy before the step (and by the forward
                 pre-hook of every module that owns one of its parameters: a second forward after a
                 backward) and kept through backward.
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

User code in a hook or callback (which may run on some ranks only: a sample under ``rank_zero_only``) never
starts a gather: a block's hook gathers only inside the calls every rank makes (``every_rank.every_rank_runs``:
the training step, its backward, the evaluation step), and elsewhere raises ``OffStepGatherError``, naming
``gathered()`` (the strategy's ``parameters_gathered()``), inside which the hooks neither gather nor free, so
one rank may run the module alone. A ``state_dict()`` called from outside the package while a unit is freed
raises likewise rather than return its NaN placeholders, and so does a pipeline stage's forward outside its
schedule.

The gathers run over a process group of their own, so that their order against the gradients'
reduce-scatters (started from autograd hooks) cannot differ between ranks. Frozen parameters are not
sharded (every rank holds them whole, as at stage 0), nor are those a strategy leaves out (under expert
parallelism the experts placed on a rank differ across the data-parallel group: a second set of units over
their replicas shards them, leaving out the rest).

The module may be a rank's tensor-parallel share: its parameters are whatever this rank holds (sharded
layers' slices, replicated norms), and the units shard those over the data-parallel group.

With a ``param_dtype`` (``zero3_dtypes``: by default autocast's dtype under ``bf16-mixed`` / ``16-mixed``) the
flat buffer is in that dtype and the shards stay in the parameters' own: a gather casts this rank's shard into
its range, the gradients (in that dtype) are cast to the reduce dtype for the reduce-scatter and what a rank
receives to the shards' dtype. A full state read or load and the module given back at teardown gather in the
shards' dtype (``retype``), so checkpoints hold the master weights.

A module built on meta is laid out in units there (``device``): each rank allocates only its shards, and
set-up writes its range of each parameter's full value into them (``place``). A sharded checkpoint writes
and reads each parameter's range in this rank's shard (``state_pieces``).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Generator, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.compat import all_gather_single, reduce_scatter_single, tree_flatten
from lightning_parallel.distributed.optimizer_shards import StatePieces
from lightning_parallel.distributed.page_pool import PagePool, host_mapping
from lightning_parallel.distributed.reducer import _Bucket
from lightning_parallel.distributed.zero import (
    MAPPED_BYTES,
    BucketShard,
    ShardedGradientReducer,
    _Works,
    all_gather_by_ranges,
    reduce_scatter_by_ranges,
)
from lightning_parallel.distributed.zero3_dtypes import UnitDtypes
from lightning_parallel.every_rank import every_rank_runs
from lightning_parallel.module_names import find_block_stack

__all__ = [
    "FullyShardedGradientReducer",
    "KEPT_FOR_BACKWARD",
    "OffStepGatherError",
    "ParameterUnit",
    "ShardedParameters",
]


class OffStepGatherError(RuntimeError):
    """A unit's parameters were needed by a forward or backward that not every rank may run (a hook or a
    callback), outside ``gathered()``."""


def _unit_label(unit: "ParameterUnit") -> str:
    return f"block {unit.name}" if unit.module is not None else "the modules outside the block stack"


def _off_step_message(unit: "ParameterUnit", use: str, where: str) -> str:
    return (
        f"zero_stage=3: a {use} of {_unit_label(unit)} ran {where} (in a hook or callback), while its "
        "parameters are sharded over the data-parallel ranks. Gathering them is a collective every "
        "data-parallel rank must join, and such code may run on some ranks only (rank_zero_only, "
        "`if trainer.is_global_zero`), where the gather would wait for ranks that never come. Enter "
        "`with trainer.strategy.parameters_gathered():` on every rank around it (a collective; inside it the "
        "parameters are whole, and a forward that involves only this rank may run on one rank alone), or use "
        "zero_stage 1 or 2"
    )


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
    pool: Optional[PagePool] = None  # where a mapped buffer's pages go when freed and come from when gathered
    taken: bool = field(default=False, repr=False)  # whether the mapped buffer's pages were taken from ``pool``
    views: list[Tensor] = field(init=False, repr=False)
    placeholders: list[Tensor] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._lay_out()

    def _lay_out(self) -> None:
        """What each parameter presents (its view of ``full`` while gathered, a placeholder while freed),
        presented now."""
        self.views, offset = [], 0
        for p in self.params:
            self.views.append(self.full[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        released = torch.full((), float("nan"), dtype=self.full.dtype, device=self.full.device)
        self.placeholders = [released.expand(p.shape) for p in self.params]
        self.present(self.views if self.gathered else self.placeholders)

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

    def free(self, keep_pages: bool = False) -> None:
        """The gathered parameters' memory handed back (a mapped buffer's pages released, or with
        ``keep_pages`` kept by the pool for the next unit gathered; else the storage resized to nothing); the
        parameters present their placeholders meanwhile."""
        self.wait()
        if self.gathered:
            self.present(self.placeholders)
            self._release(keep_pages)
            self.gathered = False

    def _release(self, keep_pages: bool = False) -> None:
        if self.mapped is not None:
            kept = keep_pages and self.taken and self.pool is not None
            kept = kept and self.pool.give(self.full.data_ptr(), len(self.mapped))
            if not kept:
                self.mapped.madvise(mmap.MADV_DONTNEED)
            self.taken = False
        else:
            self.full.untyped_storage().resize_(0)

    def retype(self, dtype: torch.dtype) -> None:
        """The unit freed and its flat buffer made anew in ``dtype`` (``param_dtype``: gathered in the shards'
        dtype for a full state read or load and when the module is given back, in the compute dtype for
        training): the parameters present views and placeholders of that dtype."""
        if self.full.dtype == dtype:
            return
        self.free()
        self.full, self.mapped = _flat_buffer(self.full.numel(), dtype, self.full.device)
        self._lay_out()  # views of the memory, before it is released
        self._release()

    def allocate(self) -> None:
        """The flat buffer's memory back before a gather (a mapped buffer's pages: a freed unit's moved onto it
        by the pool, else they come back as written)."""
        if self.mapped is None:
            self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        elif self.pool is not None and not self.taken:
            self.pool.take(self.full.data_ptr(), len(self.mapped))
            self.taken = True

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


_PACKAGE = os.path.dirname(os.path.dirname(__file__)) + os.sep  # as the code objects name their files
_TORCH_MODULE = nn.Module.__init__.__code__.co_filename


def _called_by_package() -> bool:
    """Whether the ``state_dict()`` running now was called by this package's code: the first frame out of
    torch's ``Module`` methods (its recursion into the children included) lies in the package."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename in (_TORCH_MODULE, __file__):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(_PACKAGE)


def _refuse_mixed(name: str, params: list[nn.Parameter]) -> None:
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1 or len({p.device for p in params}) != 1:
        raise ValueError(
            f"zero_stage=3 flattens each unit's parameters into one buffer; unit {name or '(root)'!r} mixes "
            f"dtypes or devices ({sorted(map(str, dtypes))}); give its parameters one dtype and device"
        )


def _unit(
    name: str, module: Optional[nn.Module], params: list[nn.Parameter], group: Any, dtype: Optional[torch.dtype]
) -> ParameterUnit:
    """A unit over ``params``, which become views of its flat buffer in ``dtype`` (None: theirs; gathered:
    it holds their values, cast); the shard keeps this rank's range in their own dtype."""
    _refuse_mixed(name, params)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    numel = sum(p.numel() for p in params)
    size = -(-numel // world)
    full, mapped = _flat_buffer(size * world, dtype or params[0].dtype, params[0].device)
    shard = torch.zeros(size, dtype=params[0].dtype, device=params[0].device)
    offset = 0
    with torch.no_grad():
        for p in params:
            flat = p.detach().reshape(-1)
            full[offset : offset + p.numel()].copy_(flat)
            start, stop = _span(size, rank, offset, p.numel())
            if start < stop:
                shard[offset + start - rank * size : offset + stop - rank * size].copy_(flat[start:stop])
            offset += p.numel()
    return ParameterUnit(name, module, params, full, shard, rank, mapped=mapped)


def _flat_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Optional[mmap.mmap]]:
    """A unit's zeroed flat buffer and, on the CPU from ``MAPPED_BYTES`` on, the memory mapping it lies in.
    A unit is freed and gathered again twice a step; through the allocator, glibc serves such sizes from its
    heap once a large block has been freed (its mmap threshold rises to the freed size), and the freed
    units' pages stayed resident there: ZeRO-3's peak resident memory was above ZeRO-1's at dp=4. A mapping
    of its own releases its pages when freed (``madvise``, or hands them to the next unit gathered through a
    ``PagePool``) and keeps its address, so the views stay valid (``page_pool.host_mapping``: its pages
    faulted in 2 MiB at a time where the kernel gives transparent huge pages)."""
    nbytes = numel * dtype.itemsize
    if device.type != "cpu" or nbytes < MAPPED_BYTES:
        return torch.zeros(numel, dtype=dtype, device=device), None
    mapped = host_mapping(nbytes)
    return torch.frombuffer(mapped, dtype=dtype, count=numel), mapped


#: the last blocks that ``reshard_after_forward`` keeps gathered from their forward to their backward: the
#: backward's start holds them anyway (the last block, whose backward is the first, and the block before
#: it, whose gather that backward starts at once), so freeing them would lower no peak and gather them again
#: (torchtitan keeps the last block)
KEPT_FOR_BACKWARD = 2

#: glibc's ``mallopt`` parameter for its mmap threshold
M_MMAP_THRESHOLD = -3


def map_large_host_blocks() -> None:
    """From now on glibc serves every block of ``MAPPED_BYTES`` or more from a mapping of its own, which a
    free hands back to the system (a no-op without glibc). By default glibc raises that threshold to the
    size of the largest mapped block freed so far (up to 32 MiB), so once set-up has freed a module's host
    copy, or a step a large gradient, the activations and gradients of every later step come from its
    heap, whose freed holes stay resident below what lives above them. ZeRO-3 holds little between steps,
    so those holes were most of what it added: at dp=4, 32 blocks of width 384, 145 MiB of a 501 MiB peak
    above the runtime (docs/memory.md). The price: each such block is faulted in page by page whenever it is
    allocated again (on a 2-core VM, about 45 ms of a 600 ms step at dp=2, docs/benchmarks.md), which the
    strategies' ``release_host_memory=False`` avoids. Process-wide, as ``MALLOC_MMAP_THRESHOLD_`` would set
    it, and for the rest of the process (glibc's own adjusting threshold cannot be restored)."""
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


def _span(size: int, rank: int, offset: int, numel: int) -> tuple[int, int]:
    """The elements ``(start, stop)`` of the parameter at ``offset`` in a flat buffer of ranges of ``size``
    (of ``numel`` elements) that rank ``rank``'s range holds; ``start >= stop``: none."""
    first = rank * size
    return max(first, offset) - offset, min(first + size, offset + numel) - offset


def _overlap(unit: ParameterUnit, rank: int, offset: int, numel: int) -> tuple[int, int]:
    """``_span`` in ``unit``'s flat buffer."""
    return _span(unit.size, rank, offset, numel)


def _unit_on_meta(
    name: str,
    module: Optional[nn.Module],
    params: list[nn.Parameter],
    group: Any,
    dtype: Optional[torch.dtype],
    device: torch.device,
) -> ParameterUnit:
    """A freed unit over ``params`` (meta parameters of a module built on meta) laid out as ``_unit`` lays
    out real ones: new parameters on ``device``, views of a flat buffer that is never filled (freed at once),
    and this rank's shard, zeros until ``ShardedParameters.place`` writes the values into it. The caller puts
    the new parameters in the module in the meta ones' place. ``dtype``: as ``_unit``'s."""
    _refuse_mixed(name, params)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    numel = sum(p.numel() for p in params)
    size = -(-numel // world)
    full, mapped = _flat_buffer(size * world, dtype or params[0].dtype, device)  # as _unit's, freed below
    views, offset = [], 0
    for p in params:
        param = nn.Parameter(torch.empty(0, dtype=full.dtype, device=device))
        param.data = full[offset : offset + p.numel()].view(p.shape)  # as _unit: a version counter of its own
        views.append(param)
        offset += p.numel()
    shard = torch.zeros(size, dtype=params[0].dtype, device=device)
    unit = ParameterUnit(name, module, views, full, shard, rank, mapped=mapped)
    unit.free()  # laid out first: a view of a storage resized to nothing is refused
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
        dtypes: the gathered parameters' and the reduced gradients' dtypes (``zero3_dtypes``); the shards keep
            the parameters' own.
        release_host_memory: on the CPU, ``map_large_host_blocks`` (False: glibc's heap policy left as it is).
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
        dtypes: UnitDtypes = UnitDtypes(),
        release_host_memory: bool = True,
    ) -> None:
        self.group, self.gather_group, self.dtypes = group, gather_group, dtypes
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
            make(str(i), block, trainable(block.parameters()), group, dtypes.param)
            for i, block in enumerate(blocks)
            if trainable(block.parameters())
        ]
        self.root = make("", None, root, group, dtypes.param) if root else None
        # built on meta: each new parameter's unit and offset, until place() has written its values
        self._unplaced: dict[nn.Parameter, tuple[ParameterUnit, int]] = {}
        self._by_name: dict[str, nn.Parameter] = {}
        if device is not None:
            metas = [trainable(block.parameters()) for block in blocks if trainable(block.parameters())]
            in_root = set(self._replace_meta_parameters(module, [*metas, root]))
        self._index = {id(unit): i for i, unit in enumerate(self.blocks)}
        self._handles = [h for unit in self.blocks for h in self._hook(unit)]
        if self.root is not None:  # a forward after a backward in one step gathers the root
            owners = [m for m in module.modules() if any(p in in_root for p in m.parameters(recurse=False))]
            before = self._refuse_freed if kept else self._gather_before
            self._handles += [m.register_forward_pre_hook(partial(before, self.root)) for m in owners]
        self._handles += self._guard_state_dicts(module)
        if release_host_memory and any(unit.full.device.type == "cpu" for unit in self.units()):
            map_large_host_blocks()
        self.pages = PagePool()  # the freed units' pages, for the next gathers of the step
        for unit in self.units():
            unit.free()
            unit.pool = self.pages

    def _guard_state_dicts(self, module: nn.Module) -> list[Any]:
        """A ``state_dict()`` pre-hook on every module holding a unit's parameter (itself or below it):
        ``_refuse_placeholder_read``."""
        unit_of = {p: unit for unit in self.units() for p in unit.params}
        handles = []
        for m in module.modules():
            units = list({id(unit_of[p]): unit_of[p] for p in m.parameters() if p in unit_of}.values())
            if units:
                hook = partial(self._refuse_placeholder_read, units)
                handles.append(m.register_state_dict_pre_hook(hook))
        return handles

    def _refuse_placeholder_read(self, units: list[ParameterUnit], module: nn.Module, *args: Any) -> None:
        """Before ``module.state_dict()``: raises if one of ``units`` below it is freed (its parameters NaN
        placeholders) and the call comes from outside this package and ``gathered()`` (a user's callback,
        ``torch.save(pl_module.state_dict())`` under ``rank_zero_only``). The package's own reads of a
        freed module's state read its names and shapes only, or gather first."""
        if self._gathered_depth or all(unit.gathered or unit.work is not None for unit in units):
            return
        if _called_by_package():
            return
        freed = [_unit_label(u) for u in units if not u.gathered]
        raise OffStepGatherError(
            f"zero_stage=3: {type(module).__name__}.state_dict() read while the parameters of "
            f"{', '.join(freed[:4])}{' ...' if len(freed) > 4 else ''} are sharded over the data-parallel "
            "ranks: it would hold NaN placeholders of their shapes, not their values. Read it inside `with "
            "trainer.strategy.parameters_gathered():`, entered on every rank (a collective; inside it any rank "
            "may read or save alone), or save with trainer.save_checkpoint(path) on every rank (one device's "
            "state)"
        )

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

    def holds(self, name: str) -> bool:
        """Whether ``name`` is a parameter of a unit built on meta (``place`` writes its values)."""
        return name in self._by_name

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
        """Raises naming the parameters built on meta that ``place`` gave no values (those laid out on the meta
        device itself stay unfilled: a set-up for the placement alone, ``planner/at_scale.py``)."""
        waiting = {p for p in self._unplaced if not p.is_meta}
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

    def _retype(self, master: bool) -> None:
        """Every unit's flat buffer in the shards' dtype (``master``) or in ``dtypes.param``."""
        for unit in self.units():
            unit.retype(unit.shard.dtype if master else self.dtypes.param or unit.shard.dtype)

    def gather_all(self, master: bool = False) -> None:
        """Every unit gathered: all the gathers started, then waited for; ``master``: in the shards' dtype
        (a full state read or loaded, the module given back), not the compute dtype."""
        if master:
            self._retype(master=True)
        units = self.units()
        for unit in units:
            self.start_gather(unit)
        for unit in units:
            unit.wait()

    def free_all(self) -> None:
        """Every unit freed, and the pages the pool kept handed back (a step's end: nothing more is resident
        between steps than the shards)."""
        for unit in self.units():
            unit.free()
        self.pages.release()

    @contextmanager
    def gathered(self) -> Generator[None, None, None]:
        """Every unit gathered inside (a full state read or loaded, a forward in a hook); what a load wrote is
        kept. A collective: every rank enters it; inside, the hooks neither gather nor free, so any rank may
        run the module alone. Nested, only the outermost gathers, keeps and frees (an inner one would free
        what the outer still reads)."""
        if self._gathered_depth:
            self._gathered_depth += 1
            try:
                yield
            finally:
                self._gathered_depth -= 1
            return
        self.gather_all(master=True)
        self._gathered_depth = 1
        try:
            yield
        finally:
            self._gathered_depth = 0
            for unit in self.units():
                unit.keep_own()
            self.free_all()
            self._retype(master=False)

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
        if self.kept:  # gathered by step(): a forward outside it finds the unit freed
            return [module.register_forward_pre_hook(partial(self._refuse_freed, unit))]
        return [
            module.register_forward_pre_hook(partial(self._gather_before, unit)),
            module.register_forward_hook(partial(self._after_block, unit)),
        ]

    def _refuse_off_step(self, unit: ParameterUnit, use: str) -> None:
        """Raises if ``unit`` would be gathered from a module hook outside the calls every rank makes
        (``every_rank.every_rank_runs``: the training step, its backward, the evaluation step) and outside
        ``gathered()``: there its gather is a collective that code running on some ranks only (a callback under
        ``rank_zero_only``) leaves the other ranks out of, which would hang."""
        if unit.gathered or unit.work is not None or self._gathered_depth or every_rank_runs():
            return
        where = "outside the strategy's training and evaluation steps"
        raise OffStepGatherError(_off_step_message(unit, use, where))

    def _refuse_freed(self, unit: ParameterUnit, module: nn.Module, args: Any) -> None:
        """Before a forward of a pipeline stage's unit (``kept``): raises if it is freed, that is outside the
        schedule's run (``step()``) and ``gathered()``, where its parameters are NaN placeholders."""
        if not unit.gathered and unit.work is None and not self._gathered_depth:
            raise OffStepGatherError(_off_step_message(unit, "forward", "outside the pipeline's schedule"))

    def _gather_before(self, unit: ParameterUnit, module: nn.Module, args: Any) -> None:
        """Before a unit's forward: the unit gathered, and the next block's gather started (prefetch: at
        most one unit in flight while this one computes)."""
        self._refuse_off_step(unit, "forward")
        self.gather(unit)
        self._prefetch(unit, +1)

    def _prefetch(self, unit: ParameterUnit, step: int) -> None:
        """Start the gather of the block ``step`` places from ``unit`` in the stack (the root: none)."""
        index = self._index.get(id(unit))
        if index is not None and 0 <= index + step < len(self.blocks):
            self.prefetches += self.start_gather(self.blocks[index + step])

    def _gathered_next(self, unit: ParameterUnit, step: int) -> bool:
        """Whether a block's gather follows ``unit``'s free (``step`` +1 forward, -1 backward), with
        ``reshard_after_forward``: the prefetch of the block two places on, or after a training forward's last
        blocks the backward's first two gathers, which the freed pages are kept for (``PagePool``: what the
        backward's start holds anyway). Otherwise (the last blocks of an evaluation forward or of a backward,
        the blocks kept from forward to backward) they are handed back."""
        index = self._index.get(id(unit))
        if not self.reshard_after_forward or index is None:
            return False
        return (step > 0 and torch.is_grad_enabled()) or 0 <= index + 2 * step < len(self.blocks)

    def _after_block(self, unit: ParameterUnit, module: nn.Module, args: Any, output: Any) -> None:
        training = torch.is_grad_enabled()
        if training:
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
            for t in tensors:
                t.register_hook(partial(self._before_block_backward, unit))
        if self._frees_after_forward(unit, training) and not self._gathered_depth:
            unit.free(keep_pages=self._gathered_next(unit, +1))

    def _frees_after_forward(self, unit: ParameterUnit, training: bool) -> bool:
        """Whether a block is freed after its forward: always after an evaluation forward; after a training
        forward as ``reshard_after_forward`` says, except the last ``KEPT_FOR_BACKWARD`` blocks of the stack."""
        if not training:
            return True
        index = self._index.get(id(unit))
        return self.reshard_after_forward and (index is None or index < len(self.blocks) - KEPT_FOR_BACKWARD)

    def _before_block_backward(self, unit: ParameterUnit, grad: Tensor) -> None:
        """The block's backward comes next: gathered, and the block before it (whose backward follows)
        started."""
        self._refuse_off_step(unit, "backward")
        self.gather(unit)
        self._prefetch(unit, -1)

    def before_forward(self) -> None:
        """Before a step's forward: the root unit gathered (it is used before and after the blocks), the first
        block's gather started behind it."""
        if self.root is not None:
            self.start_gather(self.root)
        if self.blocks and not self.kept:
            self.prefetches += self.start_gather(self.blocks[0])
        if self.root is not None:
            self.root.wait()

    def after_forward(self) -> None:
        """After a step's forward: an evaluation step (no backward to come) frees what it gathered."""
        if not torch.is_grad_enabled():
            self.free_all()

    def backward_done(self, unit: ParameterUnit) -> None:
        """The unit's last gradient of this backward arrived: its parameters are not needed again (``kept``:
        until the schedule's other micro-batches are done, ``step()``)."""
        if not self.kept and not self._gathered_depth:
            unit.free(keep_pages=self._gathered_next(unit, -1))

    def after_backward(self) -> None:
        """What a backward left gathered (a unit with a parameter that got no gradient) is freed."""
        self.free_all()

    def teardown(self) -> None:
        """Every unit gathered for good (the module leaves fit whole), the hooks removed."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.gather_all(master=True)
        self.pages.release()


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
        self._aside: dict[int, Tensor] = {}  # id(bucket) -> accumulating micro-batches' sum (``_set_aside``)
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

    # ------------------------------------------------------------------ dtypes (``zero3_dtypes``)
    def _casts(self, bucket: _Bucket) -> bool:
        """Whether the bucket's gradients (in the gathered parameters' dtype) are reduced in another dtype,
        or received in another than the shards': then they are cast around the reduce-scatter."""
        unit = self._unit_of[bucket.params[0]]
        reduce = self._reduce_dtype(unit)
        return not self._shard_of[id(bucket)].whole and (unit.full.dtype != reduce or reduce != unit.shard.dtype)

    def _reduce_dtype(self, unit: ParameterUnit) -> torch.dtype:
        return self.sharded.dtypes.reduce or unit.shard.dtype

    def finish_sync(self) -> None:
        if not self.sync_enabled:
            self._set_aside()
        super().finish_sync()

    def _set_aside(self) -> None:
        """After an accumulating micro-batch's backward (no sync): each bucket whose gradients are in another
        dtype than the reduce dtype added into a sum of its own in the reduce dtype and zeroed, so that the
        micro-batches add up in the reduce dtype (FSDP2's accumulated gradient), not the gathered one."""
        for bucket in self.buckets:
            unit = self._unit_of[bucket.params[0]]
            if not bucket.buffer.numel() or bucket.buffer.dtype == self._reduce_dtype(unit):
                continue
            aside = self._aside.get(id(bucket))
            if aside is None:
                self._aside[id(bucket)] = bucket.buffer.to(self._reduce_dtype(unit))
            else:
                aside.add_(bucket.buffer)
            bucket.buffer.zero_()

    def gradient_tensors(self) -> list[Tensor]:
        return [*super().gradient_tensors(), *self._aside.values()]

    def _seeds(self, bucket: _Bucket, shard: BucketShard) -> bool:
        return super()._seeds(bucket, shard) and not self._casts(bucket)

    def _reduce_bucket(self, bucket: _Bucket) -> Any:
        """ZeRO-2's reduce-scatter; a bucket that ``_casts`` is cast to the reduce dtype first, received in
        it, then written (or, in a later synchronised backward before the step, added) into the shards'
        dtype, as FSDP2 does with a ``reduce_dtype``."""
        if not self._casts(bucket):
            return super()._reduce_bucket(bucket)
        shard, unit = self._shard_of[id(bucket)], self._unit_of[bucket.params[0]]
        if not bucket.buffer.numel():  # no gradient of this bucket on this rank
            self._open(bucket)
        aside = self._aside.pop(id(bucket), None)  # the accumulating micro-batches' sum
        send = bucket.buffer.to(self._reduce_dtype(unit)) if aside is None else aside.add_(bucket.buffer)
        send.div_(self.world_size * self.replicas)
        received = send.new_empty(shard.size)
        if self._by_ranges:
            work: Any = reduce_scatter_by_ranges(received, send, self.group)
        else:
            work = reduce_scatter_single()(received, send, group=self.group, async_op=True)
        accumulate = bool(self.syncs_since_step) and shard.grad is not None
        if shard.grad is None:
            shard.grad = unit.shard.new_empty(shard.size)
        into = shard.grad.add_ if accumulate else shard.grad.copy_
        self._in_flight.append(bucket)
        return _Works([self._across_replicas(work, received)], lambda: into(received))

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
