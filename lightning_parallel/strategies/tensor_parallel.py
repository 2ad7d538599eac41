"""``lp_tensor_parallel``: Megatron-style tensor parallelism for unmodified LightningModules, optionally
combined with data parallelism (2-D: ``data_parallel_size`` x ``tensor_parallel_size`` processes).

At set-up the module's layers are rewritten in place following a sharding plan (``plan="auto"``, a dict
or a YAML file; see ``lightning_parallel.tensor.plan``), validated first on the unsharded module. The
ranks of a tensor-parallel group see the same batches (the sampler runs over the data-parallel group);
with ``data_parallel_size > 1`` the gradient reducer averages over the data-parallel group. Gradient
clipping by norm uses the global norm over the shards, and checkpoints hold full, unsharded tensors
under the original names, so they load into the plain module and into any tensor-parallel size; with
``save_distributed=True`` each rank writes only its shards (``checkpointing.sharded``).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_parallel.checkpointing import ShardLayout
from lightning_parallel.distributed.reducer import GradientReducer
from lightning_parallel.materialize import Cut, has_meta_tensors
from lightning_parallel.strategies.base import ParallelStrategyBase
from lightning_parallel.strategies.checks import positive_int, require
from lightning_parallel.strategies.options import level_problems
from lightning_parallel.tensor import Plan, ResolvedPlan, apply_plan, parse_plan, resolve
from lightning_parallel.tensor.coverage import check_coverage, sample_forward
from lightning_parallel.tensor.full_state import (
    full_optimizer_state,
    full_state_dict,
    load_full_state_dict,
    shard_optimizer_state,
    sharded_parameters,
    unsharded_copy,
)
from lightning_parallel.tensor.layers import SharedEntry, _TPLayer, shard_slice
from lightning_parallel.tensor.plan import install_gradient_sums

__all__ = ["TensorParallelStrategy", "PlanVerificationError"]


class PlanVerificationError(RuntimeError):
    """``verify_plan=True`` found the sharded module computing something else than the unsharded one."""


def _max_diff(a: Any, b: Any) -> float:
    if isinstance(a, torch.Tensor):
        return (a.detach().double() - b.detach().double()).abs().max().item() if a.numel() else 0.0
    if isinstance(a, (tuple, list)):
        return max((_max_diff(x, y) for x, y in zip(a, b)), default=0.0)
    if isinstance(a, Mapping):
        return max((_max_diff(a[k], b[k]) for k in a), default=0.0)
    return 0.0


class TensorParallelStrategy(ParallelStrategyBase):
    """Tensor parallelism (and 2-D with data parallelism) on ``torch.distributed`` collectives.

    Args:
        tensor_parallel_size: processes that split each sharded layer; None = all processes / dp.
        data_parallel_size: replicas of the tensor-parallel group, each with its own batches.
        plan: ``"auto"``, a dict of module-name patterns to styles, a YAML file path, or a ``Plan``.
        verify_plan: on the first batch, also run the unsharded module and fail with the largest
            difference if the outputs disagree.
        require_sharded: the least share of the model's parameters the plan must split; a plan that
            splits less fails before training, naming what stayed whole and why. 0 accepts any plan.
        **kwargs: process plumbing, as for Lightning's ``DDPStrategy``.
    """

    strategy_name = "lp_tensor_parallel"
    defers_init_by_default = True
    popen_only = "Lightning's spawn launcher hands rank 0's (sharded) weights back"
    model_parallel_option, model_parallel_axis = "tensor_parallel_size", "tp"

    def __init__(
        self,
        tensor_parallel_size: Optional[int] = None,
        data_parallel_size: int = 1,
        plan: Union[str, Path, Mapping[str, Any], Plan] = "auto",
        verify_plan: bool = False,
        require_sharded: float = 0.2,
        **kwargs: Any,
    ) -> None:
        require(level_problems(TensorParallelStrategy, type(self), locals()))
        # malformed plans and missing files fail here, before any process starts (and are read once)
        parsed = plan if isinstance(plan, str) and plan == "auto" else parse_plan(plan)
        super().__init__(**kwargs)
        self.tensor_parallel_size = tensor_parallel_size
        self.data_parallel_size = data_parallel_size
        self.plan = plan
        self._plan = parsed
        self.verify_plan = verify_plan
        self.require_sharded = float(require_sharded)
        self.resolved: Optional[ResolvedPlan] = None
        self._entries: list[SharedEntry] = []
        self._reference: Optional[dict[str, nn.Module]] = None

    @classmethod
    def own_option_problems(cls, values: Mapping[str, Any], prefix: str = "") -> list[Optional[str]]:
        """The checks of the arguments declared here (``strategies.options.option_problems`` reads them)."""
        share = values["require_sharded"]
        return [
            positive_int(f"{prefix}tensor_parallel_size", values["tensor_parallel_size"], allow_none=True),
            positive_int(f"{prefix}data_parallel_size", values["data_parallel_size"]),
            None
            if isinstance(share, (int, float)) and not isinstance(share, bool) and 0 <= share <= 1
            else f"{prefix}require_sharded must be a share between 0 and 1, got {share!r}",
        ]

    # ----------------------------------------------------------------- layout
    @property
    def tp_group(self) -> Optional[torch.distributed.ProcessGroup]:
        return self.mesh.group("tp") if self.mesh is not None else None

    # ----------------------------------------------------------------- set-up
    def model_is_split(self) -> bool:
        return self._is_sharded()

    def _is_sharded(self) -> bool:
        return self.lightning_module is not None and bool(sharded_parameters(self.lightning_module))

    def configure_parallelism(self) -> None:
        module = self.lightning_module
        dp, tp = self.parallel_sizes()
        if self._is_sharded():  # sharded by an earlier fit: keep its layers
            layers = [m for m in module.modules() if isinstance(m, _TPLayer)]
            if any(layer.tp_size != tp for layer in layers):
                raise ValueError(
                    f"the module is already sharded for tensor_parallel_size={layers[0].tp_size}, "
                    f"but this run has tensor_parallel_size={tp}; start from an unsharded module or a "
                    "full checkpoint"
                )
            self._entries = list(
                {id(e): e for layer in layers if (e := getattr(layer, "entry", None))}.values()
            )
        else:
            self._split(module, tp)
        if dp > 1:
            self.reducer = GradientReducer(list(module.named_parameters()), group=self.dp_group)
        self.install_global_norm_clipping(
            {id(t) for t, _, _ in sharded_parameters(module).values()}, self.tp_group
        )
        self.share_found_inf()

    def _split(self, module: nn.Module, tp: int) -> None:
        """Resolve the plan on the whole module, then cut it with ``set_up_share``: the rank allocates only
        its shards (and the replicated tensors) on its device, each filled from the full value."""
        self.resolved = resolve(module, self._plan, tp, run=sample_forward(module, self.batch_to_device))
        check_coverage(module, self.resolved, self.require_sharded)
        if self.verify_plan:
            if has_meta_tensors(module):
                raise ValueError(
                    "verify_plan=True compares the sharded module with the unsharded one, which a module built "
                    "on the meta device (init_module / configure_model) does not have; build it with "
                    "init_module(empty_init=False) to verify the plan"
                )
            self._keep_reference(module)

        def parallelize() -> Cut:
            self._entries = apply_plan(
                module, self.resolved, self.tp_group, self.mesh.tp_rank, gradient_hooks=False
            )
            cuts = {key: (spec, layer) for key, (_, spec, layer) in sharded_parameters(module).items()}

            def cut(name: str, full: torch.Tensor) -> torch.Tensor:
                if name not in cuts:
                    return full
                spec, layer = cuts[name]
                return shard_slice(full, spec, layer.tp_size, layer.tp_rank)

            return cut

        self.set_up_share(parallelize)
        install_gradient_sums(module, self.resolved, self.tp_group)

    # ----------------------------------------------------------------- verify_plan
    def _keep_reference(self, module: nn.Module) -> None:
        """Unsharded copies of the top-level children that the plan touches."""
        touched = {a.name.split(".")[0] for a in self.resolved.assignments if a.style != "replicate"}
        touched |= {owner.split(".")[0] for owner, _, _ in self.resolved.attributes}
        self._reference = {n: copy.deepcopy(c) for n, c in module.named_children() if n in touched}

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._reference is None:
            return super().training_step(*args, **kwargs)
        calls: dict[str, tuple[tuple, dict, Any]] = {}
        module = self.lightning_module

        def record(name: str):
            def hook(mod: nn.Module, a: tuple, kw: dict, out: Any) -> None:
                calls.setdefault(name, (a, kw, out))

            return hook

        handles = [
            getattr(module, n).register_forward_hook(record(n), with_kwargs=True) for n in self._reference
        ]
        try:
            output = super().training_step(*args, **kwargs)
        finally:
            for h in handles:
                h.remove()
        self._verify(calls)
        return output

    def _verify(self, calls: dict[str, tuple[tuple, dict, Any]]) -> None:
        reference, self._reference = self._reference, None
        for name, (a, kw, out) in calls.items():
            with torch.no_grad():
                expected = reference[name](*a, **kw)
            diff = _max_diff(out, expected)
            dtype = next((t.dtype for t in reference[name].parameters()), torch.float32)
            tol = {torch.float64: 1e-9, torch.float32: 1e-4}.get(dtype, 1e-2)
            if not diff <= tol:
                raise PlanVerificationError(
                    f"verify_plan: the sharded {name!r} differs from the unsharded one by {diff:.3e} on the first "
                    f"batch (tolerance {tol:.0e}). Check the plan's attribute adjustments (e.g. "
                    "'blocks.*.attn.n_head: divide') and that every colwise layer feeds a rowwise one."
                )
        rank_zero_info(f"lp_tensor_parallel: verify_plan passed for {sorted(calls)}")

    # ----------------------------------------------------------------- per step
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        for entry in self._entries:
            entry.clear()  # do not keep the step's activations alive

    # ----------------------------------------------------------------- checkpoints: full tensors
    def full_model_state(self) -> dict[str, Any]:
        if not self._is_sharded():
            return super().full_model_state()
        return full_state_dict(self.lightning_module, self.tp_group)

    def one_device_copy(self, tree: nn.Module, state: Mapping[str, Any]) -> nn.Module:
        """``tree`` as on one device: whole layers, per-feature tensors whole, no process group."""
        return unsharded_copy(tree, self.lightning_module, state)

    def shard_layouts(self) -> dict[str, ShardLayout]:
        """For ``save_distributed``: which slice of each full tensor this rank holds."""
        return {
            key: ShardLayout(spec.dim, spec.chunks, layer.tp_rank, layer.tp_size, self.tp_group)
            for key, (_, spec, layer) in sharded_parameters(self.lightning_module).items()
        }

    def load_full_model_state(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        if not self._is_sharded():
            return super().load_full_model_state(state_dict, strict=strict)
        load_full_state_dict(self.lightning_module, state_dict, strict=strict)

    def full_optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if not self._is_sharded():
            return super().full_optimizer_state(optimizer)
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return full_optimizer_state(optimizer, self.lightning_module, self.tp_group)

    def load_full_optimizer_state(self, checkpoint: Mapping[str, Any]) -> None:
        if not self._is_sharded():
            return super().load_full_optimizer_state(checkpoint)
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(shard_optimizer_state(state, optimizer, self.lightning_module))

    def teardown(self) -> None:
        self._entries = []
        self._reference = None
        super().teardown()
