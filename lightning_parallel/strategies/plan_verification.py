"""``verify_plan=True``: on the first training batch, the sharded module's top-level parts that the plan
touched are run again unsharded on the same inputs, and a difference fails the run (an axis of
``ParallelStrategy``: ``axes.py``)."""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_parallel.materialize import has_meta_tensors
from lightning_parallel.strategies.axes import Axis
from lightning_parallel.tensor import ResolvedPlan

__all__ = ["PlanVerification", "PlanVerificationError"]


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


class PlanVerification(Axis):
    """Keeps unsharded copies of what the plan touches until the first training step compares them."""

    name = "plan_verification"

    def __init__(self, strategy_name: str) -> None:
        self.strategy_name = strategy_name
        self._reference: Optional[dict[str, nn.Module]] = None
        self._module: Optional[nn.Module] = None

    def keep_reference(self, module: nn.Module, resolved: ResolvedPlan, pipelined: bool) -> None:
        """Unsharded copies of the top-level children that the plan touches (before it is applied)."""
        if pipelined:
            raise ValueError(
                "verify_plan=True runs the unsharded module beside the sharded one on the first batch, which a "
                "pipeline stage does not run whole; verify the plan with pipeline_parallel_size=1"
            )
        if has_meta_tensors(module):
            raise ValueError(
                "verify_plan=True compares the sharded module with the unsharded one, which a module built "
                "on the meta device (init_module / configure_model) does not have; build it with "
                "init_module(empty_init=False) to verify the plan"
            )
        touched = {a.name.split(".")[0] for a in resolved.assignments if a.style != "replicate"}
        touched |= {owner.split(".")[0] for owner, _, _ in resolved.attributes}
        self._reference = {n: copy.deepcopy(c) for n, c in module.named_children() if n in touched}
        self._module = module

    @contextmanager
    def training_step(self) -> Iterator[None]:
        """The first training step's inputs and outputs of the touched children recorded, then compared."""
        if self._reference is None:
            yield
            return
        calls: dict[str, tuple[tuple, dict, Any]] = {}

        def record(name: str):
            def hook(mod: nn.Module, a: tuple, kw: dict, out: Any) -> None:
                calls.setdefault(name, (a, kw, out))

            return hook

        module = self._module
        handles = [
            getattr(module, n).register_forward_hook(record(n), with_kwargs=True) for n in self._reference
        ]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
        self._verify(calls)

    def teardown(self) -> None:
        self._reference = self._module = None

    def _verify(self, calls: dict[str, tuple[tuple, dict, Any]]) -> None:
        reference, self._reference, self._module = self._reference, None, None
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
        rank_zero_info(f"{self.strategy_name}: verify_plan passed for {sorted(calls)}")
