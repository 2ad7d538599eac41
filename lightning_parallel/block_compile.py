"""Per-block compile, as torchtitan does it: each block of the block stack compiled on its own, after the
parallelisms (tensor, expert, pipeline) and the recompute are applied to it.

A block's ``forward`` is replaced by its compiled form (the one it has then: a recompute wrapper is compiled
with it). Blocks of one class run the same code, and dynamo's guards do not pin a block's identity (torch
inlines ``nn.Module`` calls and takes their parameters as graph inputs), so one graph per distinct block
class is compiled and reused across the layers. Hooks on a block stay outside its graph: they run around
``forward`` (a pipeline stage ends in one). The code outside the blocks runs eagerly.

The compile's settings are the strategy's ``compile`` option (True: torch.compile's defaults; a mapping:
its keyword arguments), or those of a model the user compiled (``trainer.fit(torch.compile(model))``):
Lightning's whole-step compile is then undone and its settings are used for the blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional, Sequence, Union

import torch
from lightning.pytorch.utilities.compile import to_uncompiled
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_parallel.compat import compiled_by_lightning

__all__ = [
    "CompileOption",
    "CompiledBlocks",
    "apply_block_compile",
    "block_compiler",
    "compile_blocks",
    "compile_problem",
    "uncompile_blocks",
]

#: the strategies' ``compile`` option: False (off), True (torch.compile's defaults) or its keyword arguments
CompileOption = Union[bool, Mapping[str, Any]]

#: a compiled block: the block and the forward it held as an instance attribute before (None: its class's)
CompiledBlocks = list[tuple[nn.Module, Optional[Callable[..., Any]]]]


def compile_problem(value: Any, name: str) -> Optional[str]:
    """What is wrong with a ``compile`` option, or None."""
    if isinstance(value, bool) or (isinstance(value, Mapping) and all(isinstance(k, str) for k in value)):
        return None
    return (
        f"{name}={value!r} is not a compile setting: give False (off), True (torch.compile's defaults) or "
        "torch.compile's keyword arguments as a mapping, e.g. {'backend': 'inductor', 'mode': 'max-autotune'}"
    )


def block_compiler(module: nn.Module, option: CompileOption) -> Callable[[Callable[..., Any]], Any]:
    """The function that compiles one block's forward: with the settings of the model the user compiled
    (whose whole-step compile is undone here), else with ``option``'s."""
    if compiled_by_lightning(module):
        settings = module._compiler_ctx["dynamo_ctx"]  # torch.compile's, as the user gave them
        to_uncompiled(module)
        return settings
    kwargs = dict(option) if isinstance(option, Mapping) else {}
    return lambda forward: torch.compile(forward, **kwargs)


def compile_blocks(
    blocks: Sequence[nn.Module], compile_block: Callable[[Callable[..., Any]], Any]
) -> CompiledBlocks:
    """Replace each block's forward by ``compile_block(forward)``; returns what ``uncompile_blocks`` puts back."""
    compiled: CompiledBlocks = []
    for block in blocks:
        own = block.__dict__.get("forward")
        block.forward = compile_block(block.forward)
        compiled.append((block, own))
    return compiled


def uncompile_blocks(compiled: CompiledBlocks) -> None:
    """Give each block the forward it had before ``compile_blocks``."""
    for block, own in compiled:
        block.__dict__.pop("forward", None)
        if own is not None:
            block.forward = own


def apply_block_compile(
    module: nn.Module,
    option: CompileOption,
    blocks: Sequence[nn.Module],
    what: str,
    whole_cannot: Optional[str] = None,
) -> CompiledBlocks:
    """Compile each of ``blocks`` (``what`` names them for the message) when ``option`` asks it, or when the
    user compiled ``module`` and ``whole_cannot`` says why its whole-step compile cannot run here (pipeline
    stages, zero_stage=3's gathers). Where the user's own compile moves onto the blocks, a warning says once
    what runs eagerly."""
    user = compiled_by_lightning(module)
    if option is False and not (user and whole_cannot):
        return []
    compiled = compile_blocks(blocks, block_compiler(module, option))
    if not user:
        rank_zero_info(f"compile: {what} compiled; training_step and the rest of forward run eagerly")
        return compiled
    rank_zero_warn(
        f"{'a whole compiled step' if whole_cannot else 'compile=True'} under torch.compile: the model's compile, its "
        f"settings kept, moves onto {what}; training_step and the rest of forward run eagerly "
        f"({whole_cannot or 'compile=True compiles block by block'})"
    )
    return compiled
