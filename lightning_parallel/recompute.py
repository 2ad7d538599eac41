"""Activation checkpointing: chosen blocks keep only their inputs and recompute the rest in backward.

``apply_activation_checkpointing(module, spec)`` wraps the ``forward`` of each chosen submodule in
place (the same object, names and ``state_dict`` keys, so the tensor-parallel plan, the pipeline
partition and checkpoints see the same module) with torch's non-reentrant ``checkpoint``:

- ``True``: every block of the block stack (``module_names.find_block_stack``); blocks held by
  another pipeline stage are left alone;
- a list of module-name patterns (``*`` is one dotted segment, as in tensor-parallel plans);
- ``"selective"``: only the attention core of each block, as Megatron recomputes it. The checkpointed
  module is the innermost submodule whose ``forward`` computes softmax attention (the softmax of a
  product of activations, ``scaled_dot_product_attention``, a Hugging Face ``attention_interface``; a
  softmax that feeds a ``topk`` is a mixture-of-experts router, not attention) or an
  ``nn.MultiheadAttention``; inside it, torch's selective checkpoint policy keeps the outputs of
  ``_KEPT_OPS`` (the query/key/value and output projections, a fused attention kernel), so backward reruns
  only an unfused core between them (QK^T, mask, softmax, dropout, the product with V), the cheap shape
  operations and the collectives of a tensor-parallel layer. What it drops: the s x s attention scores and
  probabilities and the dropout mask, which only an unfused core keeps.

The recomputed forward equals the original one: the random state is replayed (dropout), BatchNorm
layers update scratch copies of their running statistics (kept once, from the forward), a pipeline's
``DeferredBatchNorm`` records nothing (``recompute_state.is_recomputing``, which the recompute sets), and
under an async pipeline's weights snapshot (``recompute_state.snapshot_in_use``) the parameters hold the
snapshot's values (the weights the forward used). While a counter counts, what the recompute saves is
reported to it (a ``memory.saved.SavedHooks`` over torch's recompute hook), so the peak counts it.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any, Callable, Iterator, Optional, Union

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from lightning_parallel.compat import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
    selective_op_outputs,
)
from lightning_parallel.kv_cache import caching_configs
from lightning_parallel.memory.saved import SavedHooks, can_stack, counting, record_saved
from lightning_parallel.module_names import find_block_stack, match_pattern
from lightning_parallel.pipeline.partition import held_elsewhere
from lightning_parallel.recompute_state import SnapshotView, recomputing, snapshot_in_use

log = logging.getLogger(__name__)

__all__ = [
    "CheckpointedForward",
    "Spec",
    "apply_activation_checkpointing",
    "checkpoint_targets",
    "remove_activation_checkpointing",
    "spec_problem",
]

Spec = Union[bool, str, Sequence[str]]

#: calls in a ``forward``'s source that compute softmax(QK^T)V in one kernel or function
_FUSED_ATTENTION = ("scaled_dot_product_attention", "attention_interface")
#: a product of two activations in a ``forward``'s source (the scores QK^T); ``@`` as an operator only,
#: not a decorator
_PRODUCT = re.compile(r"\b(?:matmul|bmm|baddbmm|einsum)\(|[\w)\]]\s*@\s*[\w(]")
#: what a selective recompute keeps from the forward: the products of a linear layer with its weight (2-D
#: operands; the attention core's products of activations are batched, ``bmm``), and the fused attention
#: kernels, which keep no s x s scores for backward (recomputing one would cost time and free nothing, as
#: torchtitan's selective policy also judges). What is left to rerun is an unfused core: the scores, mask,
#: softmax, dropout and the product with V.
_KEPT_OPS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in (
        "mm",
        "addmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(torch.ops.aten, name)
)


def spec_problem(value: Any, name: str = "activation_checkpointing") -> Optional[str]:
    """Why ``value`` is not a valid ``activation_checkpointing`` (None when it is)."""
    if isinstance(value, bool) or value == "selective":
        return None
    if _is_patterns(value) and value and all(isinstance(p, str) and p for p in value):
        return None
    return (
        f"{name}={value!r} is not valid: use False (off), True (every block of the block stack), "
        '"selective" (only the attention of each block) or a non-empty list of module-name patterns '
        '(e.g. ["model.blocks.*"])'
    )


def _is_patterns(value: Any) -> bool:
    """A list of patterns (a Hydra list config included), not a string."""
    return isinstance(value, Sequence) and not isinstance(value, str)


def checkpoint_targets(module: nn.Module, spec: Spec, stack_name: Optional[str] = None) -> list[str]:
    """The names of the submodules of ``module`` that ``spec`` checkpoints (raises when it finds none)."""
    problem = spec_problem(spec)
    if problem is not None:
        raise ValueError(problem)
    if spec is False:
        return []
    if _is_patterns(spec):
        names = [n for n, _ in module.named_modules() if n and any(match_pattern(p, n) for p in spec)]
        if not names:
            raise ValueError(f"activation_checkpointing patterns {list(spec)} match no module of the model")
        return names
    stack, blocks = find_block_stack(module, stack_name)
    mine = [(f"{stack}.{i}" if stack else str(i), b) for i, b in enumerate(blocks) if not held_elsewhere(b)]
    if spec is True:
        return [name for name, _ in mine]
    return [name for block_name, block in mine for name in _attention_cores(block, block_name)]


def _attention_cores(block: nn.Module, block_name: str) -> list[str]:
    """The innermost submodules of ``block`` that compute softmax attention (raises when none does)."""
    found = [n for n, m in block.named_modules() if n and _computes_attention(m)]
    innermost = [n for n in found if not any(o.startswith(f"{n}.") for o in found)]
    if not innermost:
        raise ValueError(
            f'activation_checkpointing="selective" found no attention core in {block_name} '
            f"({type(block).__name__}): no submodule is an nn.MultiheadAttention or has a forward that calls "
            f"{' or '.join(_FUSED_ATTENTION)}, or a softmax of a product of activations (matmul, bmm, einsum, "
            "@) without a top-k. Use True (whole blocks) or module-name patterns."
        )
    return [f"{block_name}.{n}" for n in innermost]


def _computes_attention(module: nn.Module) -> bool:
    """An ``nn.MultiheadAttention``, or a ``forward`` that calls a fused attention or takes the softmax of a
    product of activations (the scores), and selects no top-k: a mixture-of-experts router's softmax
    over its gate's logits, followed by ``topk``, is not attention."""
    if isinstance(module, nn.MultiheadAttention):
        return True
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    if "topk" in source:
        return False
    return any(call in source for call in _FUSED_ATTENTION) or (
        "softmax" in source and _PRODUCT.search(source) is not None
    )


def apply_activation_checkpointing(
    module: nn.Module, spec: Spec, stack_name: Optional[str] = None
) -> list[str]:
    """Checkpoint the submodules ``spec`` chooses (see the module docstring); returns their names.
    Submodules already checkpointed stay as they are."""
    names = checkpoint_targets(module, spec, stack_name)
    if names:
        _no_kv_cache(module)
    for name in names:
        sub = module.get_submodule(name)
        if not isinstance(sub.__dict__.get("forward"), CheckpointedForward):
            sub.forward = CheckpointedForward(sub, sub.__dict__.get("forward"), spec == "selective")
    return names


def _no_kv_cache(module: nn.Module) -> None:
    """Turn off the key/value cache of each Hugging Face model in ``module`` (``config.use_cache``), as
    Hugging Face's own gradient checkpointing does: a cache filled in the forward is filled again by the
    recompute, which then attends over the keys twice. Training reads no cache; ``generate`` asks for one."""
    for name, config in caching_configs(module):
        config.use_cache = False
        log.info("activation checkpointing: %s.config.use_cache set to False", name or type(module).__name__)


def remove_activation_checkpointing(module: nn.Module, names: Optional[Sequence[str]] = None) -> None:
    """Give the checkpointed submodules ``names`` of ``module`` (None: all) back the forward they had."""
    for sub in module.modules() if names is None else map(module.get_submodule, names):
        wrapper = sub.__dict__.get("forward")
        if isinstance(wrapper, CheckpointedForward):
            del sub.forward
            if wrapper.inner is not None:
                sub.forward = wrapper.inner


class CheckpointedForward:
    """A module's ``forward`` run under non-reentrant ``torch.utils.checkpoint`` while gradients are on.

    An object holding its module, not a closure, so that a deep copy of the module calls the copy.
    ``selective``: the selective form, which keeps the outputs of ``_KEPT_OPS``."""

    def __init__(
        self, module: nn.Module, inner: Optional[Callable[..., Any]] = None, selective: bool = False
    ) -> None:
        self.module = module
        self.inner = inner  # an instance ``forward`` the module had, else its class's is used
        self.selective = selective

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        run = self.inner if self.inner is not None else partial(type(self.module).forward, self.module)
        if not torch.is_grad_enabled():
            return run(*args, **kwargs)
        contexts = partial(_contexts, self.module, self.selective)
        return checkpoint(
            run, *args, use_reentrant=False, preserve_rng_state=True, context_fn=contexts, **kwargs
        )


def _contexts(module: nn.Module, selective: bool) -> tuple[Any, Any]:
    """Called at the forward: the contexts around the forward and around each recompute (``_recompute``;
    with ``selective``, inside torch's selective checkpoint modes)."""
    snapshot = snapshot_in_use()
    if not selective:
        return nullcontext(), _EachRecompute(partial(_recompute, module, snapshot))
    forward, recompute = create_selective_checkpoint_contexts(_selective_policy)
    return forward, _EachRecompute(lambda: _within(recompute, _recompute(module, snapshot, selective=True)))


class _EachRecompute:
    """The context around a recompute, made anew each time torch enters it: torch enters it once per
    backward call that recomputes the block (twice under a split backward, ``pipeline.split_backward``),
    and a generator's context can be entered once only."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make
        self.entered: list[Any] = []

    def __enter__(self) -> Any:
        context = self.make()
        self.entered.append(context)
        return context.__enter__()

    def __exit__(self, *exc_info: Any) -> Any:
        return self.entered.pop().__exit__(*exc_info)


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The selective policy: keep what ``_KEPT_OPS`` compute (counted as saved), recompute the rest."""
    if op not in _KEPT_OPS:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if not ctx.is_recompute:
        for out in selective_op_outputs(ctx):
            if isinstance(out, Tensor):
                record_saved(out)
    return CheckpointPolicy.MUST_SAVE


@contextmanager
def _within(outer: Any, inner: Any) -> Iterator[None]:
    with outer, inner:
        yield


@contextmanager
def _recompute(
    module: nn.Module, snapshot: Optional[SnapshotView], selective: bool = False
) -> Iterator[None]:
    """Around a recompute: BatchNorm updates go to scratch copies, parameters hold the forward's snapshot
    (if one was in use), and what is saved is reported to the memory counters (if any counts)."""
    layers = [
        m for m in module.modules() if isinstance(m, _BatchNorm) and m.training and m.track_running_stats
    ]
    own = [dict(m._buffers) for m in layers]
    for layer, buffers in zip(layers, own):
        layer._buffers.update({k: v.clone() for k, v in buffers.items() if v is not None})
    swapped = []
    for p in module.parameters() if snapshot is not None else ():
        view = snapshot(p)
        if view is not None:
            swapped.append((p, p.data))
            p.data = view
    # torch's recompute hook below stores what it is given: counted there, through the package's hooks
    # (which could not see it, and would hide it, where torch gives no way to read it)
    reported = SavedHooks(below_stores=True) if counting() and can_stack() else nullcontext()
    try:
        with recomputing(selective), reported:
            yield
    finally:
        for p, data in swapped:
            p.data = data
        for layer, buffers in zip(layers, own):
            layer._buffers.update(buffers)
