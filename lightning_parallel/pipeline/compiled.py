"""A compiled model (``trainer.fit(torch.compile(model))``) under pipeline stages: compiled block by block.

Lightning compiles the module's ``forward`` and ``training_step`` whole. A pipeline stage runs only part of
them: the hook on its last block ends the stage by raising ``partition.StageOutput`` through the user's
code, and dynamo gives up on a frame that an exception leaves (the whole step would run eagerly, with no
graph break counted). So on a pipelined module the compile moves onto the blocks this rank holds: each
block's ``forward`` is compiled with the user's own settings, the stage hooks stay outside the graphs (they
run around ``forward``), and the code outside the blocks (``training_step``, embeddings, head) runs
eagerly, which set-up says once. Blocks of one class share their compiled code.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from lightning.pytorch.utilities.compile import to_uncompiled

from lightning_parallel.compat import compiled_by_lightning
from lightning_parallel.pipeline.partition import StagePartition

__all__ = ["compile_stage_blocks"]


def compile_stage_blocks(module: Any, part: StagePartition, warn: Callable[[str], None]) -> Optional[int]:
    """If Lightning compiled ``module``, undo that and compile each of this rank's blocks instead, telling
    ``warn`` what runs eagerly; returns how many blocks were compiled (None: the module was not compiled)."""
    if not compiled_by_lightning(module):
        return None
    compile_block = module._compiler_ctx["dynamo_ctx"]  # torch.compile's settings, as the user gave them
    to_uncompiled(module)
    mine = [i for c in range(len(part.chunks)) for i in range(*part.chunk_bounds(c))]
    for i in mine:
        block = part.stack[i]
        block.forward = compile_block(block.forward)
    warn(
        f"pipeline stages under torch.compile: the {len(mine)} blocks of {part.stack_name!r} this stage holds "
        "are compiled one by one; training_step and the rest of forward run eagerly (a stage ends inside "
        "forward, where a whole compiled step cannot stop)"
    )
    return len(mine)
