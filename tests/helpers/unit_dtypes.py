"""What the tests of ZeRO-3's ``param_dtype`` / ``reduce_dtype`` read inside a run: the dtypes the blocks
compute in, the first step's reduced gradients, the GradScaler's scale after each step, the memory and the
bytes that gathering one unit takes; and FSDP2 with a ``MixedPrecisionPolicy`` under Lightning's
``ModelParallelStrategy``, to compare with."""

from __future__ import annotations

import torch
from lightning.pytorch import Callback

from lightning_parallel.distributed.traffic import count_collective_bytes
from lightning_parallel.memory.accounting import rss_bytes
from tests.helpers.tp_models import SmallGPT


class UnitDtypes(Callback):
    """Records the dtype of the first block's weights as its forward sees them, this rank's reduced
    gradients (the shards' ranges) before the first optimizer step, and the GradScaler's scale (16-mixed)
    after every step."""

    def __init__(self) -> None:
        self.forward_dtypes: set[str] = set()
        self.first_gradients = None
        self.scales: list[float] = []

    def on_train_start(self, trainer, pl_module) -> None:
        block = pl_module.model.blocks[0]
        block.register_forward_pre_hook(
            lambda m, args: self.forward_dtypes.add(str(next(m.parameters()).dtype))
        )

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        shards = getattr(trainer.strategy.reducer, "shards", None)
        if self.first_gradients is None and shards is not None:
            self.first_gradients = torch.cat([s.grad.detach().clone() for s in shards if s.grad is not None])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            self.scales.append(float(scaler.get_scale()))


def unit_dtypes(trainer) -> dict:
    """``UnitDtypes``'s records, the dtypes of the shards, the optimizer's pieces and its state, and what gathering the
    first block's unit once takes: the growth of this process's resident memory and the bytes it hands to
    the collectives (a collective: every rank calls it)."""
    (found,) = [c for c in trainer.callbacks if isinstance(c, UnitDtypes)]
    records = {"forward_dtypes": sorted(found.forward_dtypes), "scales": found.scales}
    shards = trainer.strategy.sharded_parameters
    if shards is None:  # zero_stage 0: the callback's records only
        return records
    unit = shards.blocks[0]
    before = rss_bytes()
    with count_collective_bytes() as traffic:
        shards.gather(unit)
    grown = rss_bytes() - before
    unit.free()
    pieces = [piece.shard for piece in trainer.strategy.reducer.pieces()]
    state = [v for st in trainer.optimizers[0].state.values() for v in st.values() if torch.is_tensor(v)]
    return {
        **records,
        "first_gradients": found.first_gradients,
        "shard_dtypes": sorted({str(u.shard.dtype) for u in shards.units()}),
        "piece_dtypes": sorted({str(p.dtype) for p in pieces}),
        "state_dtypes": sorted({str(v.dtype) for v in state if v.dim()}),
        "gathered_rss": grown,
        "gathered_bytes": sum(traffic.handed().values()),
        "unit_numel": unit.full.numel(),
    }


unit_dtypes.before_teardown = True


class FSDP2GPT(SmallGPT):
    """``SmallGPT`` under FSDP2 as Lightning's docs write it in ``configure_model``: ``fully_shard`` per block,
    then the root, with a ``MixedPrecisionPolicy`` (``param_dtype`` and ``reduce_dtype`` by name)."""

    def __init__(self, param_dtype: str = "bfloat16", reduce_dtype: str = "float32", **kwargs) -> None:
        super().__init__(**kwargs)
        self.policy = (getattr(torch, param_dtype), getattr(torch, reduce_dtype))

    def configure_model(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=self.policy[0], reduce_dtype=self.policy[1])
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(self.model, mesh=mesh, mp_policy=policy)


def fsdp2_full_state(trainer) -> dict:
    """The FSDP2 module's full parameters (a collective), by single-device names."""
    return {k: v.full_tensor().detach().clone() for k, v in trainer.lightning_module.state_dict().items()}
