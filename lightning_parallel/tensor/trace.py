"""Record the data flow of one forward: every tensor operation (at the ATen level) and every call of a
projection layer, with which tensors went in and came out.

The trace is what ``plan="auto"`` reads to find Megatron's patterns wherever and however a model writes
them (an MLP inline in a block's ``forward``, fused q/k/v split in ``forward``, heads reshaped by hand).
It runs the user's own code on the batch's fake copy, with the module's tensors as fakes
(``tensor.fake``): nothing is guessed from module names or structure, and no memory is spent on
weights or activations.
Projection layers, ``SyncBatchNorm`` (``LEAF_TYPES``) and a mixture of experts' experts module
(``moe.experts``) are recorded as one node each; what they compute inside is not recorded. Tensors
are told apart by identity and version, so in-place operations start a new value. Every other
module's call is recorded as a ``Call``: its tensor arguments and outputs and the steps it ran.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_parallel.compat import TorchDispatchMode, tree_flatten, tree_map
from lightning_parallel.memory.accounting import storage_id
from lightning_parallel.moe.experts import is_experts
from lightning_parallel.tensor.fake import fake_step

__all__ = ["LEAF_TYPES", "Call", "Node", "Ref", "Trace", "is_projection", "trace_dataflow"]

# a SyncBatchNorm is one step too: inside, it all-reduces its statistics (over the data-parallel group),
# which the operator-level rules cannot follow; as a whole it is a per-feature layer
LEAF_TYPES: tuple[type, ...] = (nn.Linear, nn.Embedding, nn.MultiheadAttention, nn.SyncBatchNorm)
# questions a fake tensor answers through the dispatcher (a real one answers them without): no data flow
METADATA_OPS = frozenset({torch.ops.prim.device.default, torch.ops.prim.layout.default})


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
    return isinstance(module, LEAF_TYPES) or is_conv1d(module) or is_experts(module)


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


@dataclass(frozen=True)
class Call:
    """One call of a module that is no leaf: its tensor arguments and outputs, and the recorded steps
    ``nodes[start:end]`` it ran."""

    module: str
    inputs: tuple[Ref, ...]
    outputs: tuple[Ref, ...]
    start: int
    end: int


@dataclass
class Trace:
    nodes: list[Node] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    modules: dict[str, nn.Module] = field(default_factory=dict)
    # values that are a parameter, or computed from parameters alone (``1 + weight``): key -> its name
    parameters: dict[int, str] = field(default_factory=dict)
    # the same for buffers (``running_var + eps``; a value computed from both counts as a buffer's)
    buffers: dict[int, str] = field(default_factory=dict)
    # values that are a parameter or buffer itself (any version of it): key -> its name
    raw: dict[int, str] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)  # non-leaf module calls, in the order they ended

    def tensors(self) -> dict[int, str]:
        """Values that are a parameter or buffer, or computed from them alone: key -> the name."""
        return {**self.buffers, **self.parameters}


def _signature(t: Tensor) -> tuple | None:
    """Where a tensor's values live: same storage, offset, shape, strides and dtype mean the same values.
    The storage is told by its identity, which real, meta and fake tensors all have (meta and fake
    storages have no data pointer)."""
    try:
        if not t.numel():
            return None
        return (storage_id(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
    except (RuntimeError, NotImplementedError):
        return None


class _Recorder(TorchDispatchMode):
    def __init__(self, root: nn.Module) -> None:
        super().__init__()
        self.trace = Trace(modules=dict(root.named_modules()))
        self.names = {id(m): n for n, m in root.named_modules()}
        self.keys: dict[tuple[int, int], int] = {}
        self.alive: list[Tensor] = []  # keeps ids from being reused during the trace
        self.stack: list[str] = [""]
        self.entered: list[tuple[tuple[Ref, ...], int]] = []  # each running non-leaf call's inputs, start
        self.leaf_depth = 0
        self.param_names = {id(p): n for n, p in root.named_parameters()}
        self.buffer_names = {id(b): n for n, b in root.named_buffers()}
        self.aliases = {_signature(t): (n, False) for n, t in root.named_buffers()}
        self.aliases.update({_signature(t): (n, True) for n, t in root.named_parameters()})
        self.aliases.pop(None, None)

    def ref(self, t: Tensor) -> Ref:
        k = (id(t), t._version)
        if k not in self.keys:
            self.keys[k] = len(self.trace.shapes)
            self.trace.shapes.append(tuple(t.shape))
            self.alive.append(t)
            name, is_param = self._named(t)
            if name is not None:
                (self.trace.parameters if is_param else self.trace.buffers)[self.keys[k]] = name
                self.trace.raw[self.keys[k]] = name
        return Ref(self.keys[k])

    def _named(self, t: Tensor) -> tuple[str | None, bool]:
        """The parameter or buffer ``t`` is, or is an unrecorded alias of (``detach()`` may hand back a
        new tensor object over the same memory): its name, and whether it is a parameter."""
        if id(t) in self.param_names:
            return self.param_names[id(t)], True
        if id(t) in self.buffer_names:
            return self.buffer_names[id(t)], False
        return self.aliases.get(_signature(t), (None, False))

    def refs(self, tree: Any) -> Any:
        return tree_map(lambda a: self.ref(a) if isinstance(a, Tensor) else a, tree)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.leaf_depth or func in METADATA_OPS:
            return func(*args, **kwargs)
        inputs = self.refs((args, kwargs))
        out = func(*args, **kwargs)
        flat, _ = tree_flatten(out)
        outputs = [self.ref(t) if isinstance(t, Tensor) else None for t in flat]
        node = Node(func, inputs[0], inputs[1], outputs, self.stack[-1])
        sources = node.inputs()
        params, buffers = self.trace.parameters, self.trace.buffers
        if sources and all(r.key in params for r in sources):
            for o in outputs:
                if o is not None:
                    params.setdefault(o.key, params[sources[0].key])
        elif sources and all(r.key in params or r.key in buffers for r in sources):
            name = next(buffers[r.key] for r in sources if r.key in buffers)
            for o in outputs:
                if o is not None:
                    buffers.setdefault(o.key, name)
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
        elif not self.leaf_depth:
            flat, _ = tree_flatten(args)
            self.entered.append(
                (tuple(self.ref(t) for t in flat if isinstance(t, Tensor)), len(self.trace.nodes))
            )

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
        elif not self.leaf_depth and self.entered:
            inputs, start = self.entered.pop()
            flat, _ = tree_flatten(output)
            outs = tuple(self.ref(t) for t in flat if isinstance(t, Tensor))
            name = self.names.get(id(module), "?")
            self.trace.calls.append(Call(name, inputs, outs, start, len(self.trace.nodes)))


@contextmanager
def _module_hooks(recorder: _Recorder) -> Iterator[None]:
    pre = nn.modules.module.register_module_forward_pre_hook(recorder.pre)
    post = nn.modules.module.register_module_forward_hook(recorder.post)
    try:
        yield
    finally:
        pre.remove()
        post.remove()


def trace_dataflow(root: nn.Module, run: Callable[[], Any], fake: bool = True) -> Trace:
    """Run ``run()`` (which calls ``root``'s code, a ``sample.SampleStep`` or any callable) without
    gradients and record its data flow: on fake tensors, or with ``fake=False`` on the real ones (the
    tests compare the two). A ``SampleStep`` keeps random state, buffers, metrics and logs untouched."""
    with fake_step(root, run) if fake else nullcontext(run) as step:
        recorder = _Recorder(root)  # after the swap: it knows the module's tensors by identity
        with _module_hooks(recorder), torch.no_grad(), recorder:
            step()
    return recorder.trace
