"""Functions the worker calls after fit (case option ``probe``) to report what a strategy did inside; those
marked ``before_teardown`` look at the split module, so they run when fit ends, before it is made whole."""

from dataclasses import asdict

from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelSummary


def full_state_round_trip(trainer) -> dict:
    """While the module is split (fit ends): the strategy's full state read, a state of zeros loaded and
    read back, the first state loaded again and read back; the largest differences."""
    strategy = trainer.strategy
    first = {k: v.clone() for k, v in strategy.full_model_state().items()}
    strategy.load_full_model_state({k: v.new_zeros(v.shape) for k, v in first.items()})
    zeros = strategy.full_model_state()
    strategy.load_full_model_state(first)
    again = strategy.full_model_state()
    return {
        "zeros_max": max(float(v.abs().max()) for v in zeros.values()),
        "again_diff": max(float((again[k] - v).abs().max()) for k, v in first.items()),
        "keys": sorted(first) == sorted(again),
    }


full_state_round_trip.before_teardown = True


def reducer_stats(trainer) -> dict:
    reducer = trainer.strategy.reducer
    views = all(
        p.grad is not None and p.grad.untyped_storage().data_ptr() == b.buffer.untyped_storage().data_ptr()
        for b in reducer.buckets
        for p in b.params
    )
    return {**asdict(reducer.stats), "bucket_names": reducer.bucket_names(), "grads_are_bucket_views": views}


def samples_seen(trainer) -> float:
    """The synced value of CountingMLP's metric (a collective: every rank calls it)."""
    return float(trainer.lightning_module.seen.compute())


def pipeline_stages(trainer) -> list:
    """What each pipeline stage holds, as the strategy reported it."""
    return trainer.strategy.stage_report


def pipeline_peak_held(trainer) -> list:
    """Per training step, the most micro-batches whose activations this stage held at once."""
    return trainer.strategy.peak_held


def sequence_lengths(trainer) -> list:
    """The sequence lengths ``VariableLengthTokens`` cut its batches to, in order."""
    return trainer.datamodule.lengths


def local_shards(trainer) -> dict:
    """This rank's state_dict keys and, for tensor-parallel shards, (dim, chunks, rank, size)."""
    strategy = trainer.strategy
    layouts = {k: (v.dim, v.chunks, v.rank, v.size) for k, v in strategy.shard_layouts().items()}
    return {"keys": sorted(strategy.lightning_module.state_dict().keys()), "layouts": layouts}


local_shards.before_teardown = True


def split_state_shapes(trainer) -> dict:
    """This rank's state dict keys and shapes while the module is split."""
    return {k: tuple(v.shape) for k, v in trainer.lightning_module.state_dict().items()}


split_state_shapes.before_teardown = True


def held_state_numel(trainer) -> int:
    """The elements of this rank's state dict while the module is split."""
    return sum(t.numel() for t in trainer.lightning_module.state_dict().values())


held_state_numel.before_teardown = True


def tensor_parallel_plan(trainer) -> dict:
    """The resolved plan's styles, what stayed whole and why, and the parameters this rank holds."""
    resolved = trainer.strategy.resolved
    return {
        "styles": resolved.styles(),
        "attributes": resolved.attributes,
        "report": resolved.report,
        "local_parameters": sum(p.numel() for p in trainer.lightning_module.parameters()),
    }


tensor_parallel_plan.before_teardown = True


def batchnorm_history(trainer) -> list:
    """``BatchNormStack``'s BatchNorm buffers (this stage's) after every training batch."""
    return trainer.lightning_module.bn_history


def memory_report(trainer) -> dict:
    """The memory report's tables, and this rank's own count of what it holds, measured from outside the
    report: distinct storages (by data pointer) of the parameters, their gradients and the optimizer state."""
    from lightning_parallel.memory import report_of

    def storages(tensors) -> int:
        found = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(found.values())

    params = [p for p in trainer.lightning_module.parameters() if p.device.type != "meta"]
    state = [
        v
        for opt in trainer.optimizers
        for s in opt.state.values()
        for v in s.values()
        if hasattr(v, "untyped_storage")
    ]
    report = report_of(trainer)
    sharded = getattr(trainer.strategy, "sharded_parameters", None)  # zero_stage=3's units
    own = trainer.strategy.own_parameters() if hasattr(trainer.strategy, "own_parameters") else frozenset()
    shards = getattr(trainer.strategy, "parameter_shards", [])
    in_units = {id(p) for s in shards for unit in s.units() for p in unit.params}
    return {
        "tables": report.summary() if report is not None else {},
        "gathers": None if sharded is None else (sharded.gathers, sharded.prefetches),
        # the bytes of the parameters this rank holds when they are whole (their shapes; ZeRO-3 keeps them)
        "shapes": sum(p.numel() * p.element_size() for p in params),
        "outside": {
            "parameters": storages(params),
            "gradients": storages(p.grad for p in params if p.grad is not None),
            "optimizer_state": storages(state),
        },
        # by the parameters' shapes (ZeRO-3 keeps them): this rank's share of the model (its tensor-parallel
        # slices and its experts), and of that its experts, held whole or sharded (over their replicas)
        "share": sum(p.numel() * p.element_size() for p in params),
        "kept_whole": sum(
            p.numel() * p.element_size() for p in params if id(p) in own and id(p) not in in_units
        ),
        "experts_sharded": sum(
            p.numel() * p.element_size() for p in params if id(p) in own and id(p) in in_units
        ),
    }


memory_report.before_teardown = True


def _refit_with_an_extra_key(trainer, strict: bool) -> dict:
    """After fit: a full checkpoint of the run with one key the module lacks (``extra.weight``), then
    ``fit(ckpt_path=...)`` again from it, with ``strict_loading=strict``: the second fit splits the module
    again and each stage loads its part. Returns this rank's tensors after that fit."""
    import tempfile
    from pathlib import Path

    import torch

    strategy, module = trainer.strategy, trainer.lightning_module
    path = Path(strategy.broadcast(tempfile.mkdtemp() if strategy.is_global_zero else None)) / "extra.ckpt"
    trainer.save_checkpoint(path)
    if strategy.is_global_zero:
        checkpoint = torch.load(path, weights_only=False)
        checkpoint["state_dict"]["extra.weight"] = torch.zeros(3)
        torch.save(checkpoint, path)
    strategy.barrier()
    module.strict_loading = strict
    trainer.fit(module, datamodule=trainer.datamodule, ckpt_path=path)
    return {"checkpoint": str(path), "state_dict": {k: v.clone() for k, v in module.state_dict().items()}}


def refit_with_an_extra_key(trainer) -> dict:
    return _refit_with_an_extra_key(trainer, strict=True)


def refit_with_an_extra_key_not_strict(trainer) -> dict:
    return _refit_with_an_extra_key(trainer, strict=False)


def sequence_parallel(trainer) -> dict:
    """The sequence plan in use (or None), the modules whose gradients are summed for it, and this rank's
    peak saved activations from the memory report's end-of-fit table."""
    from dataclasses import asdict as fields

    from lightning_parallel.memory import report_of

    strategy = trainer.strategy
    resolved = strategy.resolved
    rank = trainer.global_rank
    return {
        "plan": None if resolved.sequence is None else fields(resolved.sequence),
        "summed": strategy.sequence.summed() if strategy.sequence is not None else [],
        "activations": report_of(trainer).tables["end_of_fit"][rank].activations,
    }


sequence_parallel.before_teardown = True


class CollectiveCounter:
    """A callback that counts the calls of torch.distributed's collectives made inside training batches
    (from the start of a batch to its end), by wrapping them for that time: the collectives still run."""

    NAMES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor")
    NAMES += (
        "reduce",
        "all_gather_object",
        "broadcast_object_list",
        "barrier",
        "send",
        "recv",
        "isend",
        "irecv",
    )

    def __new__(cls, *args, **kwargs):
        from lightning.pytorch import Callback

        class Counter(Callback):
            def __init__(self) -> None:
                self.calls: dict[str, int] = {}
                self._originals: dict = {}

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
                import torch.distributed as dist

                for name in CollectiveCounter.NAMES:
                    original = self._originals[name] = getattr(dist, name)

                    def counted(*a, _name=name, _original=original, **k):
                        self.calls[_name] = self.calls.get(_name, 0) + 1
                        return _original(*a, **k)

                    setattr(dist, name, counted)

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                import torch.distributed as dist

                for name, original in self._originals.items():
                    setattr(dist, name, original)
                self._originals = {}

        return Counter()


def collectives_in_steps(trainer) -> dict:
    """What ``CollectiveCounter`` counted, whether the strategy holds a gradient reducer, and which steps
    the memory report counted saved activations in."""
    from lightning_parallel.memory import report_of

    counter = next(c for c in trainer.callbacks if hasattr(c, "calls"))
    report = report_of(trainer)
    return {
        "calls": counter.calls,
        "reducer": getattr(trainer.strategy, "reducer", None) is not None,
        "counted": report.counted,
        "counting": report.counter.counting,
    }


class GradientPeak(Callback):
    """The most gradient bytes a rank held at once during training, by the memory report's accounting
    (unique storages of the parameters' ``.grad`` and of the gradient memory the strategy holds besides),
    read at every gradient's arrival and before every optimizer step."""

    def __init__(self) -> None:
        self.peak = 0

    def on_train_start(self, trainer, pl_module) -> None:
        params = [p for p in pl_module.parameters() if p.requires_grad]
        for p in params:
            p.register_post_accumulate_grad_hook(lambda _, params=params: self.sample(trainer, params))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.sample(trainer, list(pl_module.parameters()))

    def sample(self, trainer, params) -> None:
        from lightning_parallel.memory.accounting import unique_storage_bytes
        from lightning_parallel.memory.callback import held_gradients

        held = [*held_gradients(trainer.strategy), *(p.grad for p in params)]
        self.peak = max(self.peak, unique_storage_bytes(held))


def gradient_peak(trainer) -> dict:
    """``GradientPeak``'s figure, and the gradient bytes held between steps (the end-of-fit report's)."""
    from lightning_parallel.memory import report_of

    (found,) = [c for c in trainer.callbacks if isinstance(c, GradientPeak)]
    buckets = trainer.strategy.reducer.buckets
    return {
        "peak": found.peak,
        "between_steps": report_of(trainer).tables["end_of_fit"][trainer.global_rank].gradients,
        "largest_bucket": max(b.params[0].element_size() * sum(p.numel() for p in b.params) for b in buckets),
    }


AXIS_HOOKS = ("training_step", "pre_backward", "post_backward", "no_sync", "optimizer_step", "teardown")


class AxisTrace(Callback):
    """Records every call of a hook of the strategy's axes (``strategies/axes.py``), in order, as
    (axis name, hook name): each hook of each axis in ``strategy.axes`` is wrapped from the start of
    training (the hook still runs; a context is recorded when it is entered)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        for axis in getattr(trainer.strategy, "axes", []):  # the single-device reference has none
            for hook in AXIS_HOOKS:
                original = getattr(axis, hook)

                def recorded(*args, _axis=axis.name, _hook=hook, _original=original):
                    self.calls.append((_axis, _hook))
                    return _original(*args)

                setattr(axis, hook, recorded)


def axis_trace(trainer) -> dict:
    """The axes' names in the strategy's order, and what ``AxisTrace`` recorded (None without it): its live
    list, which the worker reads after fit, the strategy's teardown included."""
    traces = [c.calls for c in trainer.callbacks if isinstance(c, AxisTrace)]
    return {"axes": [a.name for a in trainer.strategy.axes], "calls": traces[0] if traces else None}


def expert_parallel(trainer) -> dict:
    """This rank's experts modules (of its pipeline stage: another stage's are left on meta): which experts
    each holds, the gradient groups' sizes, and ``axis_trace``'s report ("axes")."""
    from lightning_parallel.moe.expert_parallel import ExpertParallelExperts

    strategy = trainer.strategy
    held = {
        name: (m.ep_rank * m.num_local, m.num_local, tuple(m.gate_up_proj.shape))
        for name, m in trainer.lightning_module.named_modules()
        if isinstance(m, ExpertParallelExperts) and not m.gate_up_proj.is_meta
    }
    reducer = strategy.expert_reducer
    held_by_reducer = None if reducer is None else sum(len(b.params) for b in reducer.buckets)
    return {"held": held, "expert_reducer": held_by_reducer, "axes": axis_trace(trainer)}


expert_parallel.before_teardown = True


def step_traffic(trainer) -> list[dict]:
    """Per step, the bytes this rank handed to each kind of collective (``StepTraffic``'s count), split
    into ``sent`` to other ranks and ``kept`` (an all-to-all's own rows)."""
    from lightning_parallel.step_traffic import StepTraffic

    (found,) = [c for c in trainer.callbacks if isinstance(c, StepTraffic)]
    return [{"sent": dict(step.sent), "kept": dict(step.kept)} for step in found.steps]


class SummaryTotals(ModelSummary):
    """Lightning's model summary callback, keeping what it prints: the total and trainable parameters and
    each layer's count (rank 0 prints)."""

    def __init__(self) -> None:
        super().__init__(max_depth=1)
        self.totals: dict = {}

    def summarize(self, summary_data, total_parameters, trainable_parameters, *args, **kwargs) -> None:
        self.totals = {
            "total": total_parameters,
            "trainable": trainable_parameters,
            "layers": dict(summary_data),
        }
        ModelSummary.summarize(summary_data, total_parameters, trainable_parameters, *args, **kwargs)


def summary_totals(trainer) -> dict:
    (found,) = [c for c in trainer.callbacks if isinstance(c, SummaryTotals)]
    return found.totals


class NoRoomForTheWhole(Callback):
    """Makes the host report no memory for the whole module at the end of fit, as for a model too large to
    gather: the strategy must leave it split and refuse its ``state_dict()`` and forward."""

    def setup(self, trainer, pl_module, stage) -> None:
        trainer.strategy.room_for_whole = lambda: 0


def forwards_set_on_modules(trainer) -> list[str]:
    """After fit: the modules whose ``forward`` is still set on the instance (a compile or a recompute that
    set-up applied and did not take off)."""
    return [n for n, m in trainer.lightning_module.named_modules() if "forward" in m.__dict__]


def host_blocks_mapped(_trainer) -> bool:
    """Whether glibc serves a block of 2 MiB from a mapping of its own now, after an 8 MiB block was freed:
    with its own adjusting threshold (raised by that free) it comes from the heap; with the threshold that
    ``zero_stage=3``'s ``release_host_memory`` fixes at 1 MiB, from a mapping (``mallinfo2().hblks``)."""
    import ctypes

    import torch

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd")] + [
            (name, ctypes.c_size_t) for name in ("usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
        ]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    freed = torch.empty(2 * 2**20)  # 8 MiB
    del freed
    before = libc.mallinfo2().hblks
    held = torch.empty(2**19)  # 2 MiB
    mapped = libc.mallinfo2().hblks > before
    del held
    return mapped
