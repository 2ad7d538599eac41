"""Runs one rank's list of actions (from ``schedules.py``) with point-to-point communication.

``F i``: take micro-batch i's activation from the previous stage (unless first), run the user's step
function on micro-batch i (``StageOutput`` ends it on all but the last stage), send the result on.
``B i``: on the last stage, backward of the weighted micro-batch loss; elsewhere, backward of the
stage's output with the gradient received from the next stage; then send the input's gradient back.
``I i`` does the same for the input's gradient only, and ``W i`` later adds the weight gradients it left
(``split_backward.py``): the zero-bubble schedules send the input's gradient upstream sooner.

A rank may hold several chunks (virtual stages) of the model: each action names its chunk, each chunk
has its own previous and next rank (``ChunkLinks``; the previous may be this rank itself, a hand-off with
no communication), and the activations and the gradients crossing each boundary between two virtual
stages are a stream of their own (on a process group of their own where they share a pair of ranks with
another stream: ``channels.py``), so that one peer can send activations and gradients of different chunks
at once, over gloo and NCCL alike.

Without a flush (``async``) a micro-batch's forward and backward can fall in different steps, with an
optimizer step between them that updates the parameters in place. Its autograd graph must still see
the weights it ran with: forwards that may outlive the step save a snapshot of the parameters (one
per step: PipeDream-2BW's second weight buffer) instead of the parameters themselves.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor

from lightning_parallel.distributed.p2p import PeerLink
from lightning_parallel.memory.accounting import storage_key, storage_of
from lightning_parallel.memory.saved import SavedHooks, Stored
from lightning_parallel.pipeline.channels import stream_id
from lightning_parallel.pipeline.partition import StageOutput, StagePartition
from lightning_parallel.pipeline.schedules import Action
from lightning_parallel.pipeline.split_backward import WeightGradients, backward_input
from lightning_parallel.pipeline.timeline import Timeline
from lightning_parallel.recompute_state import using_snapshot

__all__ = [
    "split_microbatches",
    "loader_problem",
    "merge_microbatches",
    "batch_size",
    "ChunkLinks",
    "StageExecutor",
    "StepResult",
    "weights_snapshot",
]


def split_microbatches(batch: Any, num_microbatches: int) -> list[Any]:
    """Split every tensor of ``batch`` (nested tuples/lists/dicts) along dim 0 into ``num_microbatches``
    parts (sizes differ by at most one when the batch does not divide evenly)."""
    size = batch_size(batch)
    if size is None:
        raise ValueError("the batch holds no tensor to split into micro-batches")
    if size < num_microbatches:
        raise ValueError(
            f"a batch of {size} samples cannot be split into num_microbatches={num_microbatches}; "
            f"use num_microbatches <= {size} or a larger batch."
        )

    def part(x: Any, i: int) -> Any:
        if isinstance(x, Tensor) and x.dim() > 0:
            return torch.tensor_split(x, num_microbatches)[i]
        if isinstance(x, (list, tuple)):
            parts = [part(v, i) for v in x]
            return type(x)(*parts) if hasattr(x, "_fields") else type(x)(parts)
        if isinstance(x, dict):
            return {k: part(v, i) for k, v in x.items()}
        return x

    return [part(batch, i) for i in range(num_microbatches)]


def loader_problem(samples: int, batch_size: int, drop_last: bool, num_microbatches: int) -> Optional[str]:
    """Why a loader of ``samples`` (this rank's) in batches of ``batch_size`` has a batch that
    ``split_microbatches`` refuses (None: every batch splits), and what would work."""
    if batch_size < num_microbatches:
        return (
            f"the training batches hold {batch_size} samples per data-parallel rank, fewer than "
            f"num_microbatches={num_microbatches}; use num_microbatches <= {batch_size} or a larger batch."
        )
    last = 0 if drop_last else samples % batch_size
    if 0 < last < num_microbatches:
        return (
            f"the training dataloader's last batch holds {last} samples ({samples} per data-parallel rank in "
            f"batches of {batch_size}), fewer than num_microbatches={num_microbatches}, so it cannot be split "
            f"into micro-batches at the end of the epoch; use DataLoader(drop_last=True), a batch size that "
            f"divides {samples} or leaves at least {num_microbatches} samples in the last batch, or "
            f"num_microbatches <= {last}."
        )
    return None


def merge_microbatches(parts: Sequence[Any]) -> Any:
    """What a step returned per micro-batch, as one batch's return (the inverse of ``split_microbatches``):
    tensors with a batch dimension concatenated along dim 0, tuples/lists/dicts merged entry by entry,
    other values (numbers, 0-dim tensors, None) kept once where every micro-batch gave the same, else
    listed per micro-batch."""
    if len(parts) <= 1:
        return parts[0] if parts else None
    first = parts[0]
    if all(isinstance(p, Tensor) and p.dim() > 0 for p in parts):
        if all(p.shape[1:] == first.shape[1:] for p in parts):
            return torch.cat(list(parts))
        return list(parts)
    if isinstance(first, dict) and all(isinstance(p, dict) and p.keys() == first.keys() for p in parts):
        return type(first)({k: merge_microbatches([p[k] for p in parts]) for k in first})
    if isinstance(first, (list, tuple)) and all(
        type(p) is type(first) and len(p) == len(first) for p in parts
    ):
        merged = [merge_microbatches([p[i] for p in parts]) for i in range(len(first))]
        return type(first)(*merged) if hasattr(first, "_fields") else type(first)(merged)
    if all(_same(p, first) for p in parts[1:]):
        return first
    return list(parts)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:  # an object whose == is not a truth value
        return a is b


def batch_size(batch: Any) -> Optional[int]:
    """Length along dim 0 of the first tensor found in ``batch`` (None if it holds none)."""
    if isinstance(batch, Tensor) and batch.dim() > 0:
        return batch.shape[0]
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else []
    for v in values:
        size = batch_size(v)
        if size is not None:
            return size
    return None


def _as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _grad_or_placeholder(t: Optional[Tensor]) -> Optional[Tensor]:
    """The gradient to send back for one received item: zeros if it got none (unused by this stage),
    an empty placeholder for tensors that cannot have one (integers, masks), None for None."""
    if t is None:
        return None
    if not t.is_floating_point():
        return torch.empty(0)
    return t.grad if t.grad is not None else torch.zeros_like(t)


def _check_sendable(produced: Any) -> None:
    """What a stage's last block returned must cross to the next stage: a tensor, or a tuple of tensors
    and None (a Hugging Face block's ``(hidden, None)``), rebuilt as such on the next stage."""
    items = _as_tuple(produced)
    others = [
        f"{type(t).__name__} at {i}" for i, t in enumerate(items) if not (t is None or isinstance(t, Tensor))
    ]
    if others or not any(isinstance(t, Tensor) for t in items):
        raise RuntimeError(
            "a pipeline stage must pass a tensor, or a tuple of tensors and None, to the next block; got "
            f"{type(produced).__name__}" + (f" holding {', '.join(others)}" if others else "")
        )


def loss_of(output: Any) -> Tensor:
    """The loss in what ``training_step`` returned (a tensor, or a dict with ``"loss"``)."""
    loss = output["loss"] if isinstance(output, dict) else output
    if not isinstance(loss, Tensor):
        raise RuntimeError(
            f"training_step must return a loss tensor (or a dict with 'loss') under pipeline "
            f"parallelism, got {type(output).__name__}"
        )
    return loss


@contextmanager
def weights_snapshot(parameters: Sequence[Tensor]) -> Iterator[None]:
    """Within this block, autograd saves, for any tensor that is (a view of) a parameter's storage, the
    same view of a copy of that storage taken on entry, so in-place updates made later (the optimizer's)
    do not change what the backward computes with. Each storage is copied once, whole: parameters that
    are views into one flat buffer share the copy, at their own offsets and strides. The snapshot is the
    one in use (``recompute_state.snapshot_in_use``) within the block, for the recomputes of forwards
    that ran in it; its pack hook is one of the package's ``SavedHooks``, so the memory counters still see
    what is saved (the copy counted as the parameter: a weight buffer, not an activation)."""
    snapshot = {storage_key(p): storage_of(p).clone() for p in parameters if _has_values(p)}

    def view(t: Tensor) -> Optional[Tensor]:
        copy = snapshot.get(storage_key(t))
        return None if copy is None else t.new_empty(0).set_(copy, t.storage_offset(), t.size(), t.stride())

    def keep(t: Tensor) -> Stored:
        copy = view(t)
        return Stored(t) if copy is None else Stored(copy, counted=t)

    with using_snapshot(view), SavedHooks(keep):
        yield


def _has_values(p: Tensor) -> bool:
    """Whether ``p`` has a storage with values to copy (not meta, not empty)."""
    storage = storage_of(p)
    return storage is not None and storage.nbytes() > 0


@dataclass
class StepResult:
    losses: list[Tensor] = field(default_factory=list)  # last stage: each micro-batch's (unweighted) loss
    outputs: list[Any] = field(default_factory=list)  # last stage, forward only: what each step returned
    output: Any = None  # last stage, forward only: ``outputs`` merged as the whole batch's
    peak_held: int = 0  # most (micro-batch, chunk) activations this rank held at once (forward done,
    # backward, or its weight part, not yet)


@dataclass(frozen=True)
class ChunkLinks:
    """Where one local chunk's input comes from and its output goes (global ranks; None at the model's
    ends; this rank's own for a hand-off between two of its chunks), and its place in the model."""

    virtual_stage: int
    previous: Optional[int]
    next: Optional[int]

    def activation_stream(self, outgoing: bool) -> int:
        """The stream of the activations crossing the boundary after (``outgoing``) or before this stage."""
        return stream_id(self.virtual_stage if outgoing else self.virtual_stage - 1, gradient=False)

    def gradient_stream(self, outgoing: bool) -> int:
        """The stream of the gradients crossing the boundary before (``outgoing``) or after this stage."""
        return stream_id(self.virtual_stage - 1 if outgoing else self.virtual_stage, gradient=True)


MicroChunk = tuple[int, int]  # (micro-batch, chunk): one micro-batch through one local chunk


class StageExecutor:
    """The communication and autograd bookkeeping of one rank's chunks; knows nothing of Lightning."""

    def __init__(
        self,
        rank: int,
        part: StagePartition,
        links: Sequence[ChunkLinks],
        link: PeerLink,
        timeline: Timeline,
    ) -> None:
        self.rank, self.part, self.links = rank, part, list(links)
        self.link, self.io, self.timeline = link, part.io, timeline
        self.in_flight: dict[MicroChunk, tuple[Any, Any]] = {}  # previous batch: (output, input)
        self._weights_due: dict[MicroChunk, WeightGradients] = {}  # split backwards whose W is still to run
        self._expected: Counter = Counter()  # transfers still to come in this run, per (peer, stream)
        self._local: dict[int, list[Any]] = {}  # stream -> hand-offs between this rank's own chunks

    @property
    def has_in_flight(self) -> bool:
        return bool(self.in_flight)

    def ends_model(self, chunk: int) -> bool:
        return self.links[chunk].next is None

    def _send(self, value: Any, peer: int, stream: int) -> None:
        if peer == self.rank:
            self._local.setdefault(stream, []).append(_handed_off(value))
        else:
            self.link.send(value, peer, stream)

    def _receive(self, peer: int, stream: int) -> Any:
        """The next transfer from ``peer`` on ``stream``; then post the receive of the one after it, if
        this run has one (it is known from the actions), so that transfer does not wait for a round trip."""
        if peer == self.rank:
            return self._local[stream].pop(0)
        value = self.link.recv(peer, stream)
        self._expected[(peer, stream)] -= 1
        if self._expected[(peer, stream)] > 0:
            self.link.post_recv(peer, stream)
        return value

    def _expect(self, actions: Sequence[Action], backward: bool) -> None:
        """Count this run's transfers per peer and stream (activations from the previous stage, gradients
        from the next) and post the first receive of each."""
        self._expected = Counter()
        for action in actions:
            links = self.links[action.chunk]
            if action.kind == "F" and links.previous not in (None, self.rank):
                self._expected[(links.previous, links.activation_stream(outgoing=False))] += 1
            elif action.kind in ("B", "I") and backward and links.next not in (None, self.rank):
                self._expected[(links.next, links.gradient_stream(outgoing=False))] += 1
        for peer, stream in self._expected:
            self.link.post_recv(peer, stream)

    def forward(
        self, step_fn: Callable[[Any], Any], microbatch: Any, index: int, chunk: int = 0
    ) -> tuple[Any, Any]:
        """Run one forward of ``chunk``; returns (what it produced, the input leaf it used)."""
        links = self.links[chunk]
        if links.previous is not None:
            with self.timeline.record("wait", index, chunk=chunk):
                self.io.pending = self._receive(links.previous, links.activation_stream(outgoing=False))
        with self.part.running(chunk), self.timeline.record("F", index, chunk=chunk):
            try:
                produced = step_fn(microbatch)
            except StageOutput as end:
                produced = end.tensor
        used, self.io.used = self.io.used, None
        if links.next is not None:
            _check_sendable(produced)
            self._send(produced, links.next, links.activation_stream(outgoing=True))
        return produced, used

    def run(
        self,
        actions: Sequence[Action],
        microbatches: Sequence[Any],
        step_fn: Callable[[Any], Any],
        weights: Sequence[float],
        backward: bool = True,
        before_backward: Optional[Callable[[Action], None]] = None,
        flushed: bool = True,
    ) -> StepResult:
        """Run ``actions`` in order. Backwards marked ``batch=-1`` take the graphs the previous call left
        in flight; forwards whose backward is not in ``actions`` stay in flight for the next call.
        ``flushed``: every stage ends this call with nothing in flight, so it is safe to wait for the
        sends; otherwise a peer may receive them only in its next call, after collectives of its own."""
        result = StepResult()
        self._expect(actions, backward)
        produced: dict[MicroChunk, Any] = {}
        inputs: dict[MicroChunk, Any] = {}
        for action in actions:
            key = (action.microbatch, action.chunk)
            if action.kind == "F":
                produced[key], inputs[key] = self.forward(step_fn, microbatches[key[0]], *key)
                ends = self.ends_model(action.chunk)
                if backward:
                    held = len(produced) + len(self.in_flight) + len(self._weights_due)
                    result.peak_held = max(result.peak_held, held)
                if ends and backward:  # the loss alone is kept: what else the step returned goes
                    produced[key] = loss_of(produced[key])  # with its graph (a split one's at its W)
                    result.losses.append(produced[key].detach())
                elif ends:
                    result.outputs.append(produced[key])
                if not backward:
                    produced.pop(key), inputs.pop(key)
            elif action.kind == "W" and backward:
                with self.timeline.record("W", key[0], chunk=key[1]):
                    self._weights_due.pop(key).run()
            elif backward:
                if before_backward is not None:
                    before_backward(action)
                if action.batch == -1:
                    output, used = self.in_flight.pop(key)
                else:
                    output, used = produced.pop(key), inputs.pop(key)
                self._backward(action, output, used, weights[key[0]])
                del output, used  # a split backward's graph (its saved tensors) goes at its W, not later
        if result.outputs and not backward:
            result.output = merge_microbatches(result.outputs)
        if backward:  # forward-only runs (validation) leave training's in-flight graphs alone
            if self.in_flight or self._weights_due:
                raise RuntimeError(
                    f"stage {self.part.stage}: micro-batches {sorted(self.in_flight or self._weights_due)} "
                    "(micro-batch, chunk) were left without a backward"
                )
            self.in_flight = {key: (produced[key], inputs[key]) for key in produced}
        if flushed:
            self.link.wait_sends()
        else:
            self.link.forget_finished_sends()
        return result

    def _backward(self, action: Action, output: Any, used_input: Any, weight: float) -> None:
        """``B``/``I`` of one (micro-batch, chunk): the backward of its output (of the weighted loss where
        the chunk ends the model), then the input's gradient sent back. ``I`` leaves its weight part to a
        later ``W``."""
        index, chunk, previous = action.microbatch, action.chunk, action.batch == -1
        links = self.links[chunk]
        if links.next is None:
            roots, grads = [output * weight], [None]
        else:
            with self.timeline.record("wait", index, previous, chunk):
                grad = self._receive(links.next, links.gradient_stream(outgoing=False))
            pairs = [
                (o, g)
                for o, g in zip(_as_tuple(output), _as_tuple(grad))
                if o is not None and o.requires_grad and g.numel()
            ]
            roots, grads = [o for o, _ in pairs], [g for _, g in pairs]
        with self.timeline.record(action.kind, index, previous, chunk):
            if action.kind == "I":
                leaves = [t for t in _as_tuple(used_input) if isinstance(t, Tensor) and t.requires_grad]
                self._weights_due[(index, chunk)] = backward_input(roots, grads, leaves)
            else:
                torch.autograd.backward(roots, grads)
        if links.previous is None:
            return
        if used_input is None:
            raise RuntimeError(
                f"stage {self.part.stage}: no activation was received for micro-batch {index} (chunk {chunk})"
            )
        grads_back = tuple(_grad_or_placeholder(t) for t in _as_tuple(used_input))
        if all(g is None or g.numel() == 0 for g in grads_back):
            raise RuntimeError(
                f"stage {self.part.stage}: the activation received for micro-batch {index} (chunk {chunk}) "
                "got no gradient"
            )
        message = grads_back if isinstance(used_input, tuple) else grads_back[0]
        self._send(message, links.previous, links.gradient_stream(outgoing=True))


def _handed_off(value: Any) -> Any:
    """What the next chunk on the same rank receives: the tensors detached (its own leaves, as a received
    message would be), in the same structure."""
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return tuple(None if t is None else t.detach() for t in value)
    return value
