"""Hugging Face models' key/value cache (``config.use_cache``), found and turned off.

Training reads no cache, but a Hugging Face model whose config says ``use_cache=True`` (the default of
most) builds one in every forward and hands it to each decoder layer, which appends its keys and values.
Code that runs a layer again on the arguments of an earlier call meets that cache already filled: a
recompute attends over the keys twice (``recompute``: the cache stays off, as Hugging Face's own gradient
checkpointing does), and a block timed repeatedly on its captured arguments grows it and reaches into the
graph of the call before (``pipeline.profile``: off while the arguments are captured).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from torch import nn

__all__ = ["caching_configs", "kv_cache_off"]


def caching_configs(module: nn.Module) -> list[tuple[str, Any]]:
    """``(name, config)`` of each submodule of ``module`` whose config has ``use_cache=True``, each config
    once (a model's layers share its config)."""
    found: dict[int, tuple[str, Any]] = {}
    for name, sub in module.named_modules():
        config = getattr(sub, "config", None)
        if getattr(config, "use_cache", False) is True:
            found.setdefault(id(config), (name, config))
    return list(found.values())


@contextmanager
def kv_cache_off(module: nn.Module) -> Iterator[None]:
    """``module``'s key/value caches off inside, as they were after."""
    configs = [config for _, config in caching_configs(module)]
    for config in configs:
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs:
            config.use_cache = True
