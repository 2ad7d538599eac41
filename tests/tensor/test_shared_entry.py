"""The shared entry of a sharded region (q, k and v read one input through one ``SharedEntry``) lets its
input go when the region's module returns: under mixed precision the consumers save their bf16 casts, so
the full-precision input the entry held was kept alive through backward for nothing (per layer and region:
tokens x width x 4 bytes; 768 MiB of a 12-layer Llama's step on a GPU). Measured here by the live bytes of
every tensor a forward makes (a dispatch mode), at tp=1 against the unsharded model."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_parallel.tensor import resolve
from lightning_parallel.tensor.layers import SharedEntry
from lightning_parallel.tensor.plan import apply_plan
from tests.helpers.zoo import build


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages the operators made that are still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t._is_view():
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self._seen:
                    self._seen.add(key)
                    self.live += storage.nbytes()
                    weakref.finalize(t, self._free, key, storage.nbytes())
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._seen.discard(key)


def _live_after_forward(model: torch.nn.Module, ids: torch.Tensor) -> int:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mode = _LiveBytes()
        with mode:
            loss = model(input_ids=ids, labels=ids).loss
        live = mode.live
        loss.backward()
    return live


def test_shared_entries_hold_nothing_after_their_region_returns():
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (4, 256))
    plain = build("hf_llama", 64, 2, 4)
    sharded = build("hf_llama", 64, 2, 4)
    plan = resolve(sharded, "auto", 1, run=lambda: sharded(input_ids=ids))
    entries = apply_plan(sharded, plan, None, 0)
    assert len(entries) >= 4  # attention and MLP of each layer
    one_input = ids.numel() * 64 * 4  # what an entry held: tokens x width, float32
    extra = _live_after_forward(sharded, ids) - _live_after_forward(plain, ids)
    assert extra < one_input / 4, (
        f"the sharded forward keeps {extra} bytes more (one entry's input: {one_input})"
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sharded(input_ids=ids)
    assert all(e._x is None and e._y is None for e in entries if isinstance(e, SharedEntry))
