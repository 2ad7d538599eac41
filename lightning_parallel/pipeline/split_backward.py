"""A stage's backward in two parts: the input gradient now (I), the weight gradients later (W).

Zero-bubble schedules (ZB-H1, ZBV) send a stage's input gradient upstream as soon as it is known and
compute the weight gradients in the pipeline's bubbles. Both parts run torch's own autograd on the
unmodified module: nothing of the user's layers is written again.

How the graph is split. From the outputs, each autograd node either leads to a stage input (it is on
the *input path*) or leads only to parameters (the *weight side*). A *boundary node* is an input-path
node with an edge into the weight side: a linear layer's ``AddmmBackward`` (edges to the input and to
the weight), a LayerNorm's ``NativeLayerNormBackward``.

- I (``backward_input``): ``torch.autograd.backward(outputs, inputs=stage inputs)``. The engine runs
  only the input path, and torch's kernels compute only the outputs a pass needs, so a linear layer's
  node computes dX here, not dW. A pre-hook on each boundary node keeps the gradient flowing into it.
- W (``WeightGradients.run``): autograd again, started at the boundary nodes with the kept gradients
  (and at the outputs whose graph reaches no input), ``inputs=`` the parameters. Each boundary node now
  computes only its weight-side outputs; every parameter gets its gradient through its own
  ``AccumulateGrad`` node, so ``.grad`` accumulation, tensor hooks and post-accumulate hooks (the DDP
  reducer's) run as in a full backward, once per parameter with its whole gradient.
- W is one autograd call per *group*: boundary nodes whose weight sides share a node (a parameter used
  twice) form one group. One call for two stacked layers would re-run the input path between them
  (the engine runs every node on a path to a requested input), so groups run apart.

The sum is exact: I and W compute the same kernels on the same values as one backward does.

What is held between I and W: the gradients kept at the boundary nodes (a linear layer's dY: a GPT
block keeps 11 x width values per token) and what the boundary nodes saved (a linear layer's input).
What only input-path nodes saved (an activation function's input, attention's q, k, v) is dropped after
I (``compat.drop_saved_tensors``), unless a W call re-runs the input path (below). Measured with two GPT
blocks of width 256 on 8192 tokens (RSS, float32): the forward saves 257 MiB; between I and W 304 MiB
are held (417 without the drop), 176 MiB of them kept gradients; nothing after W. The graph above the
highest boundary nodes goes when the caller drops the outputs. ``run()`` drops every reference to the
graph and the kept gradients; the rest of the graph goes with the outputs' last reference.

Activation checkpointing (non-reentrant, the package's ``recompute``): exact. torch recomputes a
checkpointed block once per backward call, so I recomputes it and W again; between them a block holds
its inputs, the kept gradients and what I recomputed for nodes that only W runs (none in a GPT block:
the two blocks above hold 176 MiB between I and W, the kept gradients). One W call per group would
recompute each block once per group in it, so when the package's recompute ran during I
(``recompute_state.recomputes_started``), W is a single call over all groups: one recompute, at the
price of re-running the input path (a pre-hook on each boundary node replaces what reaches it with its
kept gradient, so the result stays exact). torch's ``checkpoint`` called directly is not seen: W then
recomputes once per group.

Measured (``benchmarks/bench_split_backward.py``: a GPT block of width 512, 4 x 128 tokens, CPU, one
thread, float32, medians on a shared machine): I 0.52 to 0.57 and W 0.50 to 0.52 of a full backward (I + W
1.03 to 1.09); checkpointed by the package's recompute, I 0.59 to 0.69 and W 1.03 to 1.18 of a
checkpointed full backward (torch's checkpoint called directly, one W call per group: W 2.26). The graph
walk and the extra calls cost about 0.6 ms per block (a width-16 block: full 0.3 ms, I + W 0.9 ms).

Costs and limits:
- A boundary node whose backward computes all its gradients at once computes them twice, once
  discarded: a custom ``torch.autograd.Function`` that takes a parameter (its ``needs_input_grad`` is
  fixed at forward, so its backward cannot tell the passes apart), with any collective inside it. A
  stack of linear layers written as such Functions: I 1.00 and W 0.97 of a full backward.
- A parameter reached at two boundary nodes, one below the other on the input path (a layer applied
  twice in one stage), makes its group's W call re-run the input path between them (exact, as above);
  then, as under the recompute, nothing is dropped after I.
- Refused, naming the cause: a reentrant checkpoint (``use_reentrant=True``) on the input path (its
  node runs its block's whole backward, weights included, in I), raised by ``backward_input`` before
  anything runs; a selective checkpoint (torch recomputes it once only), raised by ``backward_input``
  after I; a node whose backward cannot run twice (a custom Function that frees its own state), raised
  by ``run()``.
- W fills every leaf that the stage's graph reaches and that is not a stage input: the parameters that
  required grad when the forward ran, read from the graph itself (its ``AccumulateGrad`` nodes), so a
  parameter unfrozen or frozen after set-up trains as under a full backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from lightning_parallel.compat import backward_from_edges, drop_saved_tensors
from lightning_parallel.recompute_state import recomputes_started

__all__ = ["WeightGradients", "backward_input"]

#: autograd nodes whose backward computes its block's weight gradients inside the input pass
_UNSPLITTABLE = {
    "CheckpointFunctionBackward": "a reentrant activation checkpoint (use_reentrant=True) runs its block's "
    "whole backward, weights included, when the input gradient passes; checkpoint with use_reentrant=False",
}


@dataclass
class _WeightGroup:
    """One W call: boundary nodes and outputs whose weight sides share nodes, and their parameters."""

    boundary: list[int] = field(default_factory=list)  # indices into WeightGradients.boundary
    roots: list[tuple[GradientEdge, Tensor]] = field(default_factory=list)
    parameters: list[Tensor] = field(default_factory=list)


class WeightGradients:
    """The weight part of a split backward (see the module docstring); made by ``backward_input``."""

    def __init__(self, boundary: list[Node], groups: list[_WeightGroup]) -> None:
        self.boundary = boundary
        #: the gradients flowing into each boundary node during I (its outputs' gradients), by index
        self.kept: list[Optional[tuple[Optional[Tensor], ...]]] = [None] * len(boundary)
        self.groups = groups
        #: whether the input part recomputed checkpointed blocks: then W is one call (one recompute)
        self.recomputed = False

    def run(self) -> None:
        """Accumulates into each parameter's ``.grad`` what a full backward would have added (through
        its ``AccumulateGrad`` node: hooks run), then drops the graph and the kept gradients."""
        if self.groups is None:
            raise RuntimeError("WeightGradients.run() was called twice: the weight part runs once")
        groups = [_merged(self.groups)] if self.recomputed and len(self.groups) > 1 else self.groups
        try:
            for group in groups:
                self._run_group(group)
        finally:
            self.boundary, self.kept, self.groups = [], [], None

    def _run_group(self, group: _WeightGroup) -> None:
        edges = [edge for edge, _ in group.roots]
        grads = [grad for _, grad in group.roots]
        for index in group.boundary:
            for output_nr, grad in enumerate(self.kept[index] or ()):
                if grad is not None:
                    edges.append(GradientEdge(self.boundary[index], output_nr))
                    grads.append(grad)
        if not edges:
            return
        # a boundary node below another of the group also gets gradient from the one above: replace it
        # with the gradient it had in I, which already holds that contribution
        clamps = (
            [self.boundary[i].register_prehook(_replace_with(self.kept[i])) for i in group.boundary]
            if len(group.boundary) > 1
            else []
        )
        try:
            backward_from_edges(edges, grads, group.parameters, retain_graph=True)
        except Exception as error:
            names = ", ".join(sorted({self.boundary[i].name() for i in group.boundary}))
            raise RuntimeError(
                f"the weight part of a split backward failed re-running the backward of {names}: a node "
                "whose backward cannot run twice (a custom autograd.Function that frees its own state, a "
                "block under torch's selective activation checkpoint) cannot be split; run a full backward"
            ) from error
        finally:
            for handle in clamps:
                handle.remove()


def _merged(groups: list[_WeightGroup]) -> _WeightGroup:
    return _WeightGroup(
        [i for g in groups for i in g.boundary],
        [r for g in groups for r in g.roots],
        [p for g in groups for p in g.parameters],
    )


def backward_input(
    outputs: Sequence[Optional[Tensor]],
    grad_outputs: Sequence[Optional[Tensor]],
    inputs: Sequence[Optional[Tensor]],
) -> WeightGradients:
    """Runs the input-gradient part of ``torch.autograd.backward(outputs, grad_outputs)`` now: afterwards
    each input that requires grad (a leaf) has its ``.grad``, as a full backward gives it. Returns the
    weight part, to ``run()`` later: the gradients of every other leaf the graph reaches (the parameters
    that required grad in the forward), whatever required grad when the stage was set up.

    Outputs that are None or do not require grad are skipped; a None gradient means ones for a scalar
    output, as in ``torch.autograd.backward``."""
    pairs = _differentiable_pairs(outputs, grad_outputs)
    leaves = _input_leaves(inputs)
    children = _graph([get_gradient_edge(output).node for output, _ in pairs])
    input_nodes = {get_gradient_edge(t).node for t in leaves}
    parameter_of = _weight_leaves(children, input_nodes)
    input_path = _leading_to(children, input_nodes)
    weight_side = _leading_to(children, set(parameter_of)) - input_path
    _check_splittable(input_path)
    boundary = [
        node for node in children if node in input_path and _weight_edges(node, children, weight_side)
    ]
    roots = [
        (edge, grad)
        for edge, grad in ((get_gradient_edge(o), g) for o, g in pairs)
        if edge.node in weight_side
    ]
    weights = WeightGradients(boundary, _weight_groups(boundary, roots, parameter_of, children, weight_side))
    _run_input_part(pairs, leaves, input_path, weights)
    if not weights.recomputed and all(len(group.boundary) == 1 for group in weights.groups if group.boundary):
        for node in input_path.difference(boundary):  # no W call runs them
            drop_saved_tensors(node)
    return weights


def _weight_groups(
    boundary: list[Node],
    roots: list[tuple[GradientEdge, Tensor]],
    parameter_of: dict[Node, Tensor],
    children: dict[Node, list[Node]],
    weight_side: set[Node],
) -> list[_WeightGroup]:
    """The W calls: boundary nodes and weight-side roots whose weight sides share a node go in one."""
    starts = [_weight_edges(node, children, weight_side) for node in boundary] + [[e.node] for e, _ in roots]
    group_of, owner = _join_shared(starts, children, weight_side)
    groups = {number: _WeightGroup() for number in group_of}
    for index in range(len(boundary)):
        groups[group_of[index]].boundary.append(index)
    for index, root in enumerate(roots, start=len(boundary)):
        groups[group_of[index]].roots.append(root)
    for node, parameter in parameter_of.items():
        if node in owner:
            groups[group_of[owner[node]]].parameters.append(parameter)
    return list(groups.values())


def _differentiable_pairs(
    outputs: Sequence[Optional[Tensor]], grad_outputs: Sequence[Optional[Tensor]]
) -> list[tuple[Tensor, Tensor]]:
    if len(outputs) != len(grad_outputs):
        raise ValueError(
            f"{len(outputs)} outputs but {len(grad_outputs)} gradients: give one gradient per output"
        )
    pairs = []
    for output, grad in zip(outputs, grad_outputs):
        if output is None or not output.requires_grad:
            continue
        if grad is None:
            if output.numel() != 1:
                raise RuntimeError("grad can be implicitly created only for scalar outputs")
            grad = torch.ones_like(output, memory_format=torch.preserve_format)
        pairs.append((output, grad))
    return pairs


def _input_leaves(inputs: Sequence[Optional[Tensor]]) -> list[Tensor]:
    leaves = [t for t in inputs if t is not None and t.requires_grad]
    for index, tensor in enumerate(leaves):
        if tensor.grad_fn is not None:
            raise ValueError(
                f"input {index} of the split backward is not a leaf (grad_fn {tensor.grad_fn.name()}): give "
                "the stage's received activations, detached with requires_grad_()"
            )
    return leaves


def _graph(roots: list[Node]) -> dict[Node, list[Node]]:
    """Every node reachable from ``roots`` with its children, children before parents (post-order)."""
    children: dict[Node, list[Node]] = {}
    seen: set[Node] = set()
    for root in roots:
        if root in seen:
            continue
        seen.add(root)
        stack = [(root, _children(root))]
        while stack:
            node, kids = stack[-1]
            todo = next((kid for kid in kids if kid not in seen), None)
            if todo is None:
                stack.pop()
                children[node] = kids
            else:
                seen.add(todo)
                stack.append((todo, _children(todo)))
    return children


def _weight_leaves(children: dict[Node, list[Node]], input_nodes: set[Node]) -> dict[Node, Tensor]:
    """The leaves the graph accumulates into, other than the stage inputs: each ``AccumulateGrad`` node
    with its tensor (``variable``)."""
    return {
        node: node.variable
        for node in children
        if node not in input_nodes and not children[node] and hasattr(node, "variable")
    }


def _children(node: Node) -> list[Node]:
    return [child for child, _ in node.next_functions if child is not None]


def _leading_to(children: dict[Node, list[Node]], targets: set[Node]) -> set[Node]:
    """The nodes from which one of ``targets`` is reachable (``children`` is in post-order)."""
    found: set[Node] = set()
    for node, kids in children.items():
        if node in targets or any(kid in found for kid in kids):
            found.add(node)
    return found


def _weight_edges(node: Node, children: dict[Node, list[Node]], weight_side: set[Node]) -> list[Node]:
    return [kid for kid in children[node] if kid in weight_side]


def _check_splittable(input_path: set[Node]) -> None:
    for node in input_path:
        why = _UNSPLITTABLE.get(node.name())
        if why is not None:
            raise ValueError(f"cannot split the backward at {node.name()}: {why}")


def _join_shared(
    starts: list[list[Node]], children: dict[Node, list[Node]], weight_side: set[Node]
) -> tuple[list[int], dict[Node, int]]:
    """Entries (each a list of weight-side nodes it feeds) whose weight sides share a node are joined.
    Returns each entry's group number and, for each weight-side node reached, the entry that reached it
    first."""
    leader = list(range(len(starts)))

    def find(entry: int) -> int:
        while leader[entry] != entry:
            leader[entry] = leader[leader[entry]]
            entry = leader[entry]
        return entry

    owner: dict[Node, int] = {}
    for entry, start in enumerate(starts):
        stack = list(start)
        while stack:
            node = stack.pop()
            if node in owner:
                leader[find(owner[node])] = find(entry)
                continue
            owner[node] = entry
            stack.extend(kid for kid in children[node] if kid in weight_side)
    return [find(entry) for entry in range(len(starts))], owner


def _run_input_part(
    pairs: list[tuple[Tensor, Tensor]], leaves: list[Tensor], input_path: set[Node], weights: WeightGradients
) -> None:
    on_path = [(o, g) for o, g in pairs if get_gradient_edge(o).node in input_path]
    if not on_path:
        return
    handles = [node.register_prehook(_keep_into(weights.kept, i)) for i, node in enumerate(weights.boundary)]
    before = recomputes_started(), recomputes_started(selective=True)
    try:
        torch.autograd.backward(
            [o for o, _ in on_path], [g for _, g in on_path], retain_graph=True, inputs=leaves
        )
    finally:
        for handle in handles:
            handle.remove()
    weights.recomputed = recomputes_started() != before[0]
    if recomputes_started(selective=True) != before[1]:
        raise ValueError(
            "cannot split the backward of a block under selective activation checkpointing (recompute="
            "'selective'): torch recomputes such a block once only, and the weight part would recompute it "
            "again; checkpoint whole blocks (recompute=True or module patterns) or run a full backward"
        )


def _keep_into(kept: list, index: int):
    def keep(grad_outputs: tuple[Optional[Tensor], ...]) -> None:
        kept[index] = grad_outputs

    return keep


def _replace_with(grads: Optional[tuple[Optional[Tensor], ...]]):
    def replace(grad_outputs: tuple[Optional[Tensor], ...]) -> Optional[tuple[Optional[Tensor], ...]]:
        return grads

    return replace
