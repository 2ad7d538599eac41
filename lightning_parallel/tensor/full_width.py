"""Modules that must see every feature of a column-parallel output (OLMo-2's q/k RMSNorm, over the
whole q or k projection) run on all of them: the input is all-gathered along its last dimension, the
unchanged module runs on it with its whole parameters, and each rank keeps its own slice of the output.

Backward is the conjugate: the slices of the output's gradient are all-gathered, so every rank runs the
module's backward on the whole gradient and keeps its slice of the input's. Each rank then computes
exactly what one device computes, in the same order, however the module reduces (a norm that takes
its statistics in float32 gives the single device's bits), and the module's parameters get their
whole gradient on every rank, with no sum. Per token it costs an all-gather of the module's width
forward and another backward.

Installed as forward hooks, so the module keeps its identity and parameter names. A pickled copy
carries inert hooks (a process group belongs to one run); a deep copy shares the group.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.distributed.collectives import gather_from_group, split_to_group

__all__ = ["FULL_WIDTH", "remove_full_width", "run_full_width"]

FULL_WIDTH = "_tp_full_width"  # the module attribute holding the hooks' handles


class _Hook:
    """Gathers the first argument (``gather``) or cuts the output (not ``gather``) over ``group``."""

    def __init__(self, group: Optional[dist.ProcessGroup], gather: bool, active: bool = True) -> None:
        self.group, self.gather, self.active = group, gather, active

    def __call__(self, module: nn.Module, args: tuple, *output: Any) -> Any:
        if not self.active:
            return None
        if self.gather:
            if not args or not isinstance(args[0], Tensor):
                raise TypeError(
                    f"{type(module).__name__} runs on all the features (full_width), which gathers its first "
                    "positional argument, but it was called without a tensor there; pass its input positionally"
                )
            return (gather_from_group(args[0], self.group, -1), *args[1:])
        out = output[0]
        return split_to_group(out, self.group, -1) if isinstance(out, Tensor) else out

    def __deepcopy__(self, memo: dict) -> "_Hook":
        return self

    def __reduce__(self) -> Any:
        return (type(self), (None, self.gather, False))


def run_full_width(module: nn.Module, group: Optional[dist.ProcessGroup]) -> None:
    """Run ``module`` on all the features of its split input (see the module docstring)."""
    remove_full_width(module)
    handles = (
        module.register_forward_pre_hook(_Hook(group, gather=True)),
        module.register_forward_hook(_Hook(group, gather=False)),
    )
    vars(module)[FULL_WIDTH] = handles


def remove_full_width(module: nn.Module) -> None:
    for handle in vars(module).pop(FULL_WIDTH, ()):
        handle.remove()
