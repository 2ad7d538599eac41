"""Record the real data flow of one forward: every tensor operation (at the ATen level) and every call of
a projection layer, with which tensors went in and came out.

The trace is what ``plan="auto"`` reads to find Megatron's patterns wherever and however a model writes
them (an MLP inline in a block's ``forward``, fused q/k/v split in ``forward``, heads reshaped by hand).
It runs the user's own code on a real batch, so nothing is guessed from module names or structure.
Projection layers (``LEAF_TYPES``) are recorded as one node each; what they compute inside is not
recorded. Tensors are told apart by identity and version, so in-place operations start a new value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["LEAF_TYPES", "Node", "Ref", "Trace", "is_projection", "trace_dataflow"]

LEAF_TYPES: tuple[type, ...] = (nn.Linear, nn.Embedding, nn.MultiheadAttention)


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D``: a Linear with a transposed weight ``[in, out]`` (matched by shape, so
    ``transformers`` need not be imported)."""
    return (
        type(module).__name__ == "Conv1D"
        and hasattr(module, "nf")
        and getattr(module, "weight", None) is not None
    )


def is_projection(module: nn.Module) -> bool:
    """A layer that ``colwise``/``rowwise`` can shard: ``nn.Linear`` or a ``Conv1D``."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def _is_leaf(module: nn.Module) -> bool:
    return isinstance(module, LEAF_TYPES) or is_conv1d(module)


@dataclass(frozen=True)
class Ref:
    """A tensor value in the trace (an index into ``Trace.shapes``)."""

    key: int


@dataclass
class Node:
    """One recorded step: an ATen operation (``layer`` is None) or a projection layer's call."""

    func: Any  # an OpOverload, or None for a layer call
    args: tuple  # tensors replaced by ``Ref``
    kwargs: dict
    outputs: list[Ref | None]  # one per output (None for non-tensor outputs)
    owner: str  # the innermost module whose forward was running
    layer: str | None = None

    @property
    def name(self) -> str:
        return self.layer if self.layer is not None else str(self.func.overloadpacket.__name__)

    def inputs(self) -> list[Ref]:
        flat, _ = tree_flatten((self.args, self.kwargs))
        return [a for a in flat if isinstance(a, Ref)]


@dataclass
class Trace:
    nodes: list[Node] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    modules: dict[str, nn.Module] = field(default_factory=dict)
    # values that are a parameter, or computed from parameters alone (``1 + weight``): key -> its name
    parameters: dict[int, str] = field(default_factory=dict)


class _Recorder(TorchDispatchMode):
    def __init__(self, root: nn.Module) -> None:
        super().__init__()
        self.trace = Trace(modules=dict(root.named_modules()))
        self.names = {id(m): n for n, m in root.named_modules()}
        self.keys: dict[tuple[int, int], int] = {}
        self.alive: list[Tensor] = []  # keeps ids from being reused during the trace
        self.stack: list[str] = [""]
        self.leaf_depth = 0
        self.param_names = {id(p): n for n, p in root.named_parameters()}

    def ref(self, t: Tensor) -> Ref:
        k = (id(t), t._version)
        if k not in self.keys:
            self.keys[k] = len(self.trace.shapes)
            self.trace.shapes.append(tuple(t.shape))
            self.alive.append(t)
            if id(t) in self.param_names:
                self.trace.parameters[self.keys[k]] = self.param_names[id(t)]
        return Ref(self.keys[k])

    def refs(self, tree: Any) -> Any:
        return tree_map(lambda a: self.ref(a) if isinstance(a, Tensor) else a, tree)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.leaf_depth:
            return func(*args, **kwargs)
        inputs = self.refs((args, kwargs))
        out = func(*args, **kwargs)
        flat, _ = tree_flatten(out)
        outputs = [self.ref(t) if isinstance(t, Tensor) else None for t in flat]
        node = Node(func, inputs[0], inputs[1], outputs, self.stack[-1])
        sources = node.inputs()
        if sources and all(r.key in self.trace.parameters for r in sources):
            for o in outputs:
                if o is not None:
                    self.trace.parameters.setdefault(o.key, self.trace.parameters[sources[0].key])
        self.trace.nodes.append(node)
        return out

    # global module hooks
    def pre(self, module: nn.Module, args: tuple, kwargs: dict | None = None) -> None:
        name = self.names.get(id(module), "?")
        self.stack.append(name)
        if _is_leaf(module):
            if not self.leaf_depth:
                self._leaf_inputs = self.refs((args, kwargs or {}))
            self.leaf_depth += 1

    def post(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.stack.pop()
        if _is_leaf(module):
            self.leaf_depth -= 1
            if not self.leaf_depth:
                flat, _ = tree_flatten(output)
                outputs = [self.ref(t) if isinstance(t, Tensor) else None for t in flat]
                largs, lkwargs = self._leaf_inputs
                self.trace.nodes.append(
                    Node(None, largs, lkwargs, outputs, self.stack[-1], layer=self.names.get(id(module), "?"))
                )


def trace_dataflow(root: nn.Module, run: Callable[[], Any]) -> Trace:
    """Run ``run()`` (which calls ``root``'s code) without gradients and record its data flow. The caller
    keeps random state, buffers and metrics untouched (``pipeline.profile.untouched``)."""
    recorder = _Recorder(root)
    pre = nn.modules.module.register_module_forward_pre_hook(recorder.pre)
    post = nn.modules.module.register_module_forward_hook(recorder.post)
    try:
        with torch.no_grad(), recorder:
            run()
    finally:
        pre.remove()
        post.remove()
    return recorder.trace
