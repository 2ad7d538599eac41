"""Module names: a plan or recompute pattern matched against them, and the block stack found among them.

A leaf that ``tensor/``, ``pipeline/`` and ``recompute`` all read; it imports nothing of the package.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

__all__ = ["find_block_stack", "match_pattern", "other_stacks"]


def match_pattern(pattern: str, name: str) -> bool:
    """``*`` stands for exactly one dotted segment; everything else must be equal."""
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(a == "*" or a == b for a, b in zip(p, n))


def _candidate_stacks(module: nn.Module) -> dict[str, nn.Module]:
    return {
        n: m
        for n, m in module.named_modules()
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= 2
    }


def _parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_block_stack(module: nn.Module, name: Optional[str] = None) -> tuple[str, nn.Module]:
    """The block stack: ``name`` if given, else the ModuleList/Sequential (>= 2 children) with the most
    parameters (the shallowest on a tie)."""
    stacks = _candidate_stacks(module)
    if name is not None:
        if name not in stacks:
            raise ValueError(
                f"block stack {name!r} is not an nn.ModuleList/nn.Sequential of the module; candidates: "
                f"{sorted(stacks) or 'none'}"
            )
        return name, stacks[name]
    if not stacks:
        raise ValueError(
            f"{type(module).__name__} has no block stack to pipeline: looked for an nn.ModuleList looped over in "
            "forward, or an nn.Sequential, with at least 2 blocks. Put the repeated layers in one of those."
        )
    best = max(stacks, key=lambda n: (_parameter_count(stacks[n]), -n.count(".")))
    return best, stacks[best]


def other_stacks(module: nn.Module, chosen: str) -> list[str]:
    """The candidate stacks that are not pipelined: neither inside ``chosen`` nor holding it (e.g. the
    encoder when the decoder of an ``nn.Transformer`` is chosen). They run whole on every stage."""
    return [n for n in _candidate_stacks(module) if not (_within(n, chosen) or _within(chosen, n))]


def _within(inner: str, outer: str) -> bool:
    """Whether the module named ``inner`` is ``outer`` or inside it (names from ``named_modules``)."""
    return outer == "" or inner == outer or inner.startswith(f"{outer}.")
