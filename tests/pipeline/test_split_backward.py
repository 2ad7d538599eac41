"""The split backward (``pipeline.split_backward``): the input part and then the weight part give every
input and parameter the gradient of one full backward (float64, to 1e-12), fire the parameters' hooks as
it does, leave the weights alone in the input part and the input path alone in the weight part."""

from __future__ import annotations

import gc
import weakref
from functools import partial
from typing import Callable, Optional

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_parallel.distributed.collectives import SimulatedGroup
from lightning_parallel.pipeline.split_backward import backward_input
from lightning_parallel.recompute import apply_activation_checkpointing
from lightning_parallel.recompute_state import recomputes_started
from lightning_parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from tests.helpers.zoo import NanoBlock

pytestmark = pytest.mark.timeout(120)

WIDTH, HEADS, TOKENS = 16, 4, 8


def _as_tuple(value: object) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _output_grads(outputs: tuple) -> list[Optional[Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        torch.randn(o.shape, dtype=o.dtype, generator=generator)
        if isinstance(o, Tensor) and o.requires_grad
        else None
        for o in outputs
    ]


def _gradients(module: nn.Module, inputs: list[Tensor]) -> dict[str, Optional[Tensor]]:
    grads = {f"input {i}": t.grad for i, t in enumerate(inputs)}
    grads.update({name: p.grad for name, p in module.named_parameters()})
    return grads


def _reset(module: nn.Module, inputs: list[Tensor]) -> None:
    module.zero_grad(set_to_none=True)
    for tensor in inputs:
        tensor.grad = None


def assert_split_is_full(
    module: nn.Module, inputs: list[Tensor], forward: Optional[Callable[[], object]] = None, seed: int = 0
) -> None:
    """The same forward (same random state) backpropagated whole, then split: the same gradients."""
    forward = forward or (lambda: module(*inputs))
    torch.manual_seed(seed)
    outputs = _as_tuple(forward())
    grads = _output_grads(outputs)
    torch.autograd.backward(*zip(*[(o, g) for o, g in zip(outputs, grads) if g is not None]))
    full = _gradients(module, inputs)
    _reset(module, inputs)

    torch.manual_seed(seed)
    outputs = _as_tuple(forward())
    weights = backward_input(outputs, grads, inputs)
    assert all(p.grad is None for p in module.parameters()), "the input part computed weight gradients"
    del outputs
    weights.run()
    split = _gradients(module, inputs)
    for name, expected in full.items():
        got = split[name]
        assert (got is None) == (expected is None), f"{name}: {got} vs {expected}"
        if expected is not None:
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-12, msg=f"{name} differs")


def _leaf(*shape: int, requires_grad: bool = True) -> Tensor:
    return torch.randn(*shape, dtype=torch.float64, requires_grad=requires_grad)


def test_gpt_block():
    torch.manual_seed(0)
    assert_split_is_full(NanoBlock(WIDTH, HEADS).double(), [_leaf(2, TOKENS, WIDTH)])


def test_llama_decoder_layer():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(
        vocab_size=32, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=1,
        num_attention_heads=HEADS, num_key_value_heads=HEADS // 2, max_position_embeddings=TOKENS,
    )  # fmt: skip
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(config, layer_idx=0).double()
    x = _leaf(2, TOKENS, WIDTH)
    positions = torch.arange(TOKENS).unsqueeze(0)
    cos_sin = LlamaRotaryEmbedding(config)(x, positions)
    assert_split_is_full(layer, [x], lambda: layer(x, position_ids=positions, position_embeddings=cos_sin))


class _LinearFunction(torch.autograd.Function):
    """A linear layer written as a custom Function: one backward computes dX and dW together."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
        x, weight = ctx.saved_tensors
        return grad @ weight, (grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1]))


class _CustomAndTensorParallel(nn.Module):
    """A custom Function with a parameter, then rank 0's half of a tensor-parallel MLP (a group of two
    simulated in one process: its "f" operator is a custom Function on the input path)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH))
        group = SimulatedGroup(2)
        self.up = ColumnParallelLinear(nn.Linear(WIDTH, 2 * WIDTH), group, 2, 0)
        self.down = RowParallelLinear(nn.Linear(2 * WIDTH, WIDTH), group, 2, 0)

    def forward(self, x: Tensor) -> Tensor:
        h = _LinearFunction.apply(x, self.weight)
        return self.down(torch.tanh(self.up(h)))


def test_custom_autograd_function_and_tensor_parallel_layers():
    torch.manual_seed(0)
    module = _CustomAndTensorParallel().double()
    assert any("_CopyToGroup" in n.name() for n in _nodes(module(_leaf(3, WIDTH)).grad_fn))
    assert_split_is_full(module, [_leaf(3, WIDTH)])


def _nodes(root) -> list:
    found, stack = [], [root]
    while stack:
        node = stack.pop()
        found.append(node)
        stack.extend(c for c, _ in node.next_functions if c is not None)
    return found


class _Tied(nn.Module):
    """One linear layer applied twice (the second use below the first on the input path), and one shared
    by two parallel branches."""

    def __init__(self) -> None:
        super().__init__()
        self.twice = nn.Linear(WIDTH, WIDTH)
        self.shared = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        h = self.twice(torch.tanh(self.twice(x)))
        return self.shared(h) * self.shared(torch.sin(h))


def test_parameters_used_twice():
    torch.manual_seed(0)
    module = _Tied().double()
    assert_split_is_full(module, [_leaf(3, WIDTH)])
    # each parameter's gradient arrives whole, once (a reducer's hook sees it once)
    calls = []
    for p in module.parameters():
        p.register_post_accumulate_grad_hook(calls.append)
    x = _leaf(3, WIDTH)
    y = module(x)
    backward_input([y], [torch.ones_like(y)], [x]).run()
    assert sorted(map(id, calls)) == sorted(map(id, module.parameters()))


class _ParameterOffTheInputPath(nn.Module):
    """``scale`` joins the input path only at a sum; ``aux`` reaches only a second output."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.scale = nn.Parameter(torch.randn(WIDTH))
        self.aux = nn.Parameter(torch.randn(WIDTH))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.linear(x) + torch.exp(self.scale), torch.tanh(self.aux) * 2


def test_parameters_whose_gradient_does_not_reach_the_inputs():
    torch.manual_seed(0)
    assert_split_is_full(_ParameterOffTheInputPath().double(), [_leaf(3, WIDTH)])


class _MaskedTuple(nn.Module):
    """Two inputs (an activation and a mask that needs no gradient); outputs with None and a scalar."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.unused = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor, mask: Tensor) -> tuple:
        y = self.linear(x) * mask
        return y, None, y.detach(), (y**2).sum()


def test_input_without_gradient_and_tuple_outputs_with_none():
    torch.manual_seed(0)
    module = _MaskedTuple().double()
    x, mask = _leaf(3, WIDTH), _leaf(3, WIDTH, requires_grad=False)
    assert_split_is_full(module, [x, mask])
    # a scalar output's None gradient means ones, as in torch.autograd.backward
    outputs = module(x, mask)
    _reset(module, [x])
    backward_input([outputs[3]], [None], [x, mask]).run()
    expected = torch.autograd.grad(module(x, mask)[3], [x, module.linear.weight])
    torch.testing.assert_close([x.grad, module.linear.weight.grad], list(expected), rtol=0, atol=1e-12)


def test_no_input_requires_gradient_everything_is_weight_part():
    torch.manual_seed(0)
    embedding, block = nn.Embedding(32, WIDTH).double(), NanoBlock(WIDTH, HEADS).double()
    module = nn.Sequential(embedding, block)
    ids = torch.randint(0, 32, (2, TOKENS))
    assert_split_is_full(module, [ids])


class _Stage(nn.Module):
    """Two GPT blocks, each followed by dropout (replayed by the checkpoint's recompute)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(NanoBlock(WIDTH, HEADS), nn.Dropout(0.1)) for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("recompute", ["package", "torch"])
def test_non_reentrant_activation_checkpointing(recompute):
    """Whole-block checkpoints: the input part and the weight part each recompute (the package's recompute,
    seen by the split: its weight part is one call; torch's checkpoint called directly: one per group)."""
    torch.manual_seed(0)
    stage, x = _Stage().double(), _leaf(2, TOKENS, WIDTH)
    if recompute == "package":
        assert apply_activation_checkpointing(stage, ["blocks.*"]) == ["blocks.0", "blocks.1"]
        assert_split_is_full(stage, [x])
        y = stage(x)
        weights = backward_input([y], [torch.ones_like(y)], [x])
        assert weights.recomputed and len(weights.groups) > 1
        before = recomputes_started()
        weights.run()
        assert recomputes_started() - before == 2  # one call: each block recomputed once
    else:
        blocks = [partial(checkpoint, block, use_reentrant=False) for block in stage.blocks]
        assert_split_is_full(stage, [x], lambda: blocks[1](blocks[0](x)))


def test_selective_checkpoint_is_refused_in_the_input_part():
    torch.manual_seed(0)
    stage = _Stage().double()
    assert apply_activation_checkpointing(stage, "selective")
    x = _leaf(2, TOKENS, WIDTH)
    y = stage(x)
    with pytest.raises(ValueError, match="selective activation checkpointing"):
        backward_input([y], [torch.ones_like(y)], [x])


def test_reentrant_checkpoint_is_refused_by_name():
    torch.manual_seed(0)
    block, x = NanoBlock(WIDTH, HEADS).double(), _leaf(2, TOKENS, WIDTH)
    y = checkpoint(block, x, use_reentrant=True)
    with pytest.raises(ValueError, match="CheckpointFunctionBackward.*use_reentrant=False"):
        backward_input([y], [torch.ones_like(y)], [x])


class _CountingIdentity(torch.autograd.Function):
    """Identity on the input path, counting its backwards."""

    calls = 0

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        _CountingIdentity.calls += 1
        return grad


def test_weight_part_does_not_rerun_the_input_path():
    torch.manual_seed(0)
    first, second = nn.Linear(WIDTH, WIDTH).double(), nn.Linear(WIDTH, WIDTH).double()
    x = _leaf(3, WIDTH)
    y = second(_CountingIdentity.apply(torch.tanh(first(x))))
    _CountingIdentity.calls = 0
    weights = backward_input([y], [torch.ones_like(y)], [x])
    assert _CountingIdentity.calls == 1
    weights.run()
    assert _CountingIdentity.calls == 1
    assert all(p.grad is not None for p in [*first.parameters(), *second.parameters()])


def test_hooks_and_accumulation_as_in_a_full_backward():
    """Two micro-batches, the second's input part before the first's weight part (as in ZB-H1), into
    gradients that already hold something: the same sums, each hook once per parameter per backward."""
    torch.manual_seed(0)
    block = NanoBlock(WIDTH, HEADS).double()
    xs = [_leaf(2, TOKENS, WIDTH) for _ in range(2)]
    grads = [torch.randn(2, TOKENS, WIDTH, dtype=torch.float64) for _ in range(2)]
    seen: list[tuple[str, str, Tensor]] = []
    for name, p in block.named_parameters():
        p.register_hook(lambda g, name=name: seen.append(("tensor", name, g.clone())))
        p.register_post_accumulate_grad_hook(lambda p, name=name: seen.append(("post", name, p.grad.clone())))

    def start() -> None:
        for p in block.parameters():
            p.grad = torch.ones_like(p)
        seen.clear()

    start()
    for x, g in zip(xs, grads):
        torch.autograd.backward(block(x), g)
    full, full_seen = [p.grad.clone() for p in block.parameters()], list(seen)

    start()
    first = backward_input([block(xs[0])], [grads[0]], [xs[0]])
    second = backward_input([block(xs[1])], [grads[1]], [xs[1]])
    assert not seen, "the input part ran parameter hooks"
    first.run()
    second.run()
    for expected, p in zip(full, block.parameters()):
        torch.testing.assert_close(p.grad, expected, rtol=0, atol=1e-12)
    key = lambda event: (event[0], event[1])  # noqa: E731
    assert sorted(map(key, seen)) == sorted(map(key, full_seen))
    assert len(seen) == 4 * len(full)
    for (kind, name, got), (_, _, expected) in zip(sorted(seen, key=key), sorted(full_seen, key=key)):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12, msg=f"{kind} hook of {name}")


def test_what_is_held_and_freed():
    """Between the parts: the kept gradients and what the boundary nodes saved (not what the input path
    alone saved, an activation function's input). After ``run()``: nothing; the weight part runs once."""
    torch.manual_seed(0)
    first, second = nn.Linear(WIDTH, WIDTH).double(), nn.Linear(WIDTH, WIDTH).double()
    x = _leaf(3, WIDTH)
    hidden = first(x)  # saved by GELU, a node of the input path only
    activated = nn.functional.gelu(hidden)  # saved by the second linear layer, for its dW
    top = second(activated)
    y = torch.sin(top)  # saved by sin, above every boundary node: freed with the output
    saved = [weakref.ref(t) for t in (hidden, activated, top)]
    weights = backward_input([y], [torch.ones_like(y)], [x])
    del hidden, activated, top, y
    gc.collect()
    assert [ref() is not None for ref in saved] == [False, True, False]
    assert sum(k is not None for k in weights.kept) == 2  # the two linear layers' dY
    weights.run()
    gc.collect()
    assert [ref() is not None for ref in saved] == [False, False, False]
    assert weights.kept == [] and weights.boundary == []
    with pytest.raises(RuntimeError, match="called twice"):
        weights.run()


class _FreesItsState(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:
        ctx.inputs = (x, weight)
        return x * weight

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
        x, weight = ctx.inputs
        del ctx.inputs
        return grad * weight, grad * x


def test_a_backward_that_cannot_run_twice_is_named():
    weight, x = nn.Parameter(torch.randn(WIDTH)), torch.randn(WIDTH, requires_grad=True)
    y = _FreesItsState.apply(x, weight)
    weights = backward_input([y], [torch.ones_like(y)], [x])
    with pytest.raises(RuntimeError, match="_FreesItsStateBackward"):
        weights.run()


def test_the_weight_part_fills_what_required_grad_in_the_forward():
    """The weight part reads the parameters from the graph, not from a list made earlier: a layer frozen
    gets no gradient, and unfrozen again it gets its full backward's."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)).double()
    x = torch.randn(TOKENS, WIDTH, dtype=torch.float64, requires_grad=True)
    module[0].requires_grad_(False)
    assert_split_is_full(module, [x])
    assert module[0].weight.grad is None and module[2].weight.grad is not None
    _reset(module, [x])
    module[0].requires_grad_(True)
    assert_split_is_full(module, [x])
    assert module[0].weight.grad is not None
