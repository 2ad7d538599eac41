"""Every torch name that is private or newer than the package's floor, in one place, with the version it needs.

The package supports torch 2.5 to the newest release (``setup.cfg``; ``tests/smoke`` runs at both ends in
CI). No other module imports a private torch name (``torch._*``, ``torch.utils._*``,
``torch.distributed._*``) or one that arrived after the floor: they import it from here, and each shim
below says which versions have what and what happens on the others.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

# torch >= 2.0, private modules unchanged since: fake tensors, ShardedTensor from local shards (the form
# torch.distributed.checkpoint saves ZeRO's flat pieces in), dispatch modes and pytree
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    is_fake,
    unset_fake_temporarily,
)
from torch.autograd.graph import GradientEdge

# torch >= 2.1: functional collectives, the form of a collective that torch.compile traces into its graph
# (the tensor-parallel operators use them while compiling; private module, unchanged in use since)
from torch.distributed import _functional_collectives as functional_collectives
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as LocalShard
from torch.distributed._shard.sharded_tensor import ShardedTensorBase
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

# torch >= 2.4: the public selective checkpoint API (floor 2.5)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# torch >= 2.5: DTensor's public home; torch 2.4 had it at torch.distributed._tensor
try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # torch < 2.5
    from torch.distributed._tensor import DTensor, Shard  # type: ignore[no-redef]

__all__ = [
    "all_gather_single",
    "backward_from_edges",
    "drop_saved_tensors",
    "fake_store",
    "reduce_scatter_single",
    "CheckpointPolicy",
    "DTensor",
    "DataDependentOutputException",
    "DynamicOutputShapeException",
    "EnumerableShardingSpec",
    "FakeTensorMode",
    "LocalShard",
    "Shard",
    "ShardMetadata",
    "ShardedTensorBase",
    "ShardedTensorMetadata",
    "TensorProperties",
    "RESTART_COUNT_ENV",
    "TorchDispatchMode",
    "agent_store_env",
    "create_selective_checkpoint_contexts",
    "saved_tensors_hooks_readable",
    "in_backward",
    "graph_task_id",
    "accumulates_grad",
    "queue_end_of_backward",
    "foreach_copy_",
    "foreach_mul",
    "foreach_mul_",
    "foreach_norm",
    "compiled_by_lightning",
    "compiled_runs_eagerly",
    "functional_collectives",
    "is_fake",
    "selective_op_outputs",
    "top_saved_tensors_hooks",
    "tree_flatten",
    "tree_map",
    "torch_load_weights_only",
    "unset_fake_temporarily",
    "without_layer_caches",
]


#: torchrun's restart count, which torch <= 2.5's ``env://`` rendezvous reads with an agent store
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"


def agent_store_env(switch: str) -> dict[str, str]:
    """The environment that makes torch's ``env://`` rendezvous connect every rank as a client of a store
    hosted elsewhere (``switch``: ``TORCHELASTIC_USE_AGENT_STORE``). torch <= 2.5 also reads
    ``TORCHELASTIC_RESTART_COUNT`` there (its keys go under ``/worker/attempt_<count>``; torchrun sets it):
    kept if set, else 0. Newer torch ignores it."""
    return {switch: "True", RESTART_COUNT_ENV: os.environ.get(RESTART_COUNT_ENV, "0")}


def selective_op_outputs(ctx: Any) -> tuple:
    """The outputs of the operation a selective checkpoint policy is deciding on, as a tuple.

    torch >= 2.13 calls the policy after the operation and gives them as ``ctx.op_output``. Older torch
    calls it before the operation and has no ``op_output``: this gives ``()``, so what the policy keeps
    is not reported to the memory report's saved-tensor counter (its peak reads lower); the policy's
    decisions, and so the gradients, are the same."""
    out = getattr(ctx, "op_output", None)
    if out is None:
        return ()
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


#: torch >= 2.1: the multi-tensor kernels (one launch per device and dtype), public in all but name
foreach_norm = torch._foreach_norm
foreach_mul = torch._foreach_mul
foreach_mul_ = torch._foreach_mul_
foreach_copy_ = torch._foreach_copy_


_COMPILED_METHODS = ("forward", "training_step", "validation_step", "test_step", "predict_step")


def compiled_by_lightning(module: Any) -> bool:
    """Whether ``module`` is a LightningModule that Lightning compiled: ``trainer.fit(torch.compile(model))``
    unwraps the compiled module and marks it with the private ``_compiler_ctx`` (Lightning >= 2.0), which
    holds the uncompiled methods and torch.compile's settings."""
    return bool(getattr(module, "_compiler_ctx", None))


@contextlib.contextmanager
def compiled_runs_eagerly(module: Any) -> Iterator[None]:
    """Inside the block, code that ``torch.compile`` compiled runs eagerly, and dynamo compiles nothing.

    torch >= 2.6: ``torch.compiler.set_stance("force_eager")``. torch 2.5 has no stance: the methods that
    Lightning compiled on ``module`` (``trainer.fit(torch.compile(model))`` keeps the originals in
    ``module._compiler_ctx``) are swapped for the originals for the block."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is not None:
        with set_stance("force_eager"):
            yield
        return
    if not compiled_by_lightning(module):
        yield
        return
    ctx = module._compiler_ctx
    compiled = {name: module.__dict__[name] for name in _COMPILED_METHODS if name in module.__dict__}
    for name in compiled:
        setattr(module, name, ctx[f"original_{name}"])
    try:
        yield
    finally:
        for name, method in compiled.items():
            setattr(module, name, method)


def in_backward() -> bool:
    """True while autograd's engine runs a backward on this thread (torch >= 2.0:
    ``torch._C._current_graph_task_id``, -1 outside a backward)."""
    return torch._C._current_graph_task_id() != -1


def graph_task_id() -> int:
    """The id of the backward (autograd graph task) running on this thread, -1 outside one (torch >= 2.0:
    ``torch._C._current_graph_task_id``; a nested backward has an id of its own)."""
    return torch._C._current_graph_task_id()


def accumulates_grad(accumulator: Any) -> bool:
    """Whether the backward running now accumulates into the ``.grad`` of the leaf whose gradient
    accumulator is ``accumulator`` (``torch.autograd.graph.get_gradient_edge(leaf).node``): True in
    ``backward()``, False in ``torch.autograd.grad``, which only returns gradients. Every torch of the range:
    ``torch._C._will_engine_execute_node``, which refuses a leaf inside ``autograd.grad``."""
    try:
        return torch._C._will_engine_execute_node(accumulator)
    except RuntimeError:
        return False


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the backward running now has computed and accumulated every gradient, before
    ``backward()`` returns; call it only inside a backward. Every torch of the range:
    ``torch.autograd.Variable._execution_engine.queue_callback`` (what torch's DDP uses)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def saved_tensors_hooks_readable() -> bool:
    """Whether ``top_saved_tensors_hooks`` can read the innermost pair (torch from about 2.8; 2.5 cannot)."""
    return hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks")


def top_saved_tensors_hooks() -> Optional[tuple[Callable[[Any], Any], Callable[[Any], Any]]]:
    """The innermost (pack, unpack) pair of saved-tensor hooks installed now, or None (none installed).

    torch from about 2.8 (2.13 has it, 2.5 does not) reads it with
    ``torch._C._autograd._top_saved_tensors_default_hooks``. Older torch has no
    way to read it: None, so a caller that wraps the pair (to count what it saves) leaves it as it is."""
    read_top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return read_top(False) if read_top is not None else None


def without_layer_caches(output: Any) -> Any:
    """A block's output with any Hugging Face key/value cache in it (an object whose class derives from
    transformers' ``Cache``) replaced by None.

    transformers 4.45 decoder layers return ``(hidden, cache)`` when ``use_cache`` (the config's default,
    in training too); 4.49 and later update the cache in place and return the hidden states alone. A
    pipeline stage sends its last block's output on, and a cache is neither needed by the next stage (its
    layers fill the cache of their own forward; the model's loop keeps the last layer's) nor sendable."""
    items = output if isinstance(output, tuple) else (output,)
    if not any(_is_cache(item) for item in items):
        return output
    kept = tuple(None if _is_cache(item) else item for item in items)
    return kept if isinstance(output, tuple) else kept[0]


def _is_cache(item: Any) -> bool:
    return not isinstance(item, torch.Tensor) and any(c.__name__ == "Cache" for c in type(item).__mro__)


def reduce_scatter_single() -> Callable[..., object]:
    """``(output, input, op=SUM, group=None, async_op=False)``: the sum of ``input`` over the group, this
    rank's equal part of it in ``output``. torch 2.13 added ``dist.reduce_scatter_single``; before it the
    same call is ``dist.reduce_scatter_tensor`` (torch >= 1.13)."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_single() -> Callable[..., object]:
    """``(output, input, group=None, async_op=False)``: every rank's ``input`` concatenated in ``output``
    (``input`` may be this rank's part of ``output``: in place). torch 2.13 added ``dist.all_gather_single``;
    before it the same call is ``dist.all_gather_into_tensor`` (torch >= 1.13)."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def torch_load_weights_only(weights_only: Optional[bool]) -> bool:
    """What ``torch.load(..., weights_only=weights_only)`` decides, for a reader that unpickles without it
    (``torch.distributed.checkpoint``'s ``.metadata``). ``None``: torch's default, True from torch 2.6
    (``torch.serialization._default_to_weights_only``), False before. ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``
    makes it True on every version; torch >= 2.6 also reads ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``, which turns
    an unset value into False."""
    true_values = ("1", "y", "yes", "true")
    if os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in true_values:
        return True
    if weights_only is not None:
        return weights_only
    default = getattr(torch.serialization, "_default_to_weights_only", None)
    if default is None:  # torch < 2.6
        return False
    return default(None) and os.getenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() not in true_values


_BACKWARD_TAKES_EDGES = torch.__version__ >= "2.7"


def backward_from_edges(
    edges: Sequence[GradientEdge],
    grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    retain_graph: bool,
) -> None:
    """``torch.autograd.backward(edges, grads, inputs=inputs)`` started at gradient edges (a node's input
    slots) instead of tensors: each of ``inputs`` gets its gradient through its own ``AccumulateGrad``
    node, so ``.grad`` accumulation and the tensor and post-accumulate hooks run as in any backward.

    torch >= 2.7 takes edges in ``torch.autograd.backward``; 2.5 and 2.6 take them only in the engine
    call that ``backward`` makes (``torch.autograd.graph._engine_run_backward``, the same arguments)."""
    if _BACKWARD_TAKES_EDGES:
        torch.autograd.backward(list(edges), list(grads), retain_graph=retain_graph, inputs=list(inputs))
        return
    torch.autograd.graph._engine_run_backward(
        tuple(edges),
        tuple(grads),
        retain_graph,
        False,
        tuple(inputs),
        allow_unreachable=True,
        accumulate_grad=True,
    )


def drop_saved_tensors(node: Any) -> None:
    """Let go of the tensors an autograd node saved for its backward, where torch allows it; running the
    node afterwards raises. A saved tensor that already has hooks (a checkpoint's) or is empty is left.

    torch has no public way to free one node's saved tensors. Every torch of the range (from 1.10) shows
    them as ``node._raw_saved_<name>`` (``SavedTensor``, or a tuple of them for a custom Function), whose
    ``register_hooks(pack, unpack)`` stores what ``pack`` returns instead of the tensor."""
    names = _SAVED_NAMES.get(type(node))
    if names is None:
        names = _SAVED_NAMES[type(node)] = tuple(n for n in dir(node) if n.startswith("_raw_saved_"))
    for name in names:
        saved = getattr(node, name)
        for one in saved if isinstance(saved, (tuple, list)) else (saved,):
            try:
                one.register_hooks(_forget, _refuse_unpack)
            except (RuntimeError, AttributeError):
                pass


#: each autograd node class's ``_raw_saved_*`` attribute names (``dir`` is slow)
_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def _forget(tensor: torch.Tensor) -> None:
    return None


def _refuse_unpack(packed: None) -> torch.Tensor:
    raise RuntimeError("this saved tensor was dropped after the input part of a split backward")


def fake_store() -> Any:
    """A store for torch's fake process group, whose backend ``"fake"`` returns from every collective at
    once, sending nothing (``torch.testing._internal.distributed.fake_pg``, private, in every supported
    torch; importing it registers the backend). The set-up at scale runs the strategies on it."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()
