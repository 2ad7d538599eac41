"""Expert parallelism's traffic, for the plan table: the experts each rank holds, and the all-to-all volume
of a step.

With ``expert_parallel_size=ep`` every experts module (``moe.experts.find_hf_experts``) keeps
``num_experts / ep`` whole experts per rank (``ExpertParallelExperts``). Per call, it hands to
``torch.distributed.all_to_all_single``:

    forward     the tokens per expert (num_experts int64); the dispatch, every token's top-k copies
                (tokens x top_k rows of hidden elements); the combine, the rows its experts received
    backward    the gradients of the combine and of the dispatch, each sent back the other way

``all_to_all_rows`` hands over every row, those routed to this rank's own experts included, so the
dispatch forward and the combine's backward are exactly tokens x top_k rows on every rank; the combine
forward and the dispatch's backward are the rows this rank's experts received, which depend on the
routing: tokens x top_k on average over the ep group (each rank routes a batch of the same size). The
figures are per rank, handed over, averaged over the group (their sum over the group is exact). Of the
rows handed over, those routed to the rank's own experts stay on it: with evenly spread routing,
(ep - 1) / ep of them leave the rank (what ``benchmarks/bench_expert_parallel.py`` reports as sent).

Tokens per call, top-k, hidden size and dtype are read from the experts' calls in the traced step
(``recorded_calls``; the plan table runs it on fake tensors as ``plan="auto"`` traces): the batch is one
rank's (a data loader's batch size is per rank).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

from torch import nn

from lightning_parallel.moe.experts import experts_layout, find_hf_experts

__all__ = ["COUNT_BYTES", "ExpertCall", "ExpertPlacement", "recorded_calls"]

#: the bytes of one expert's token count (``torch.bincount`` gives int64)
COUNT_BYTES = 8


@dataclass(frozen=True)
class ExpertCall:
    """One call of an experts module in the traced step."""

    tokens: int  # token rows routed (batch x sequence of this rank)
    top_k: int
    hidden: int
    itemsize: int  # bytes per element of the hidden states

    def rows_bytes(self) -> int:
        """One exchange of every token's top-k copies: tokens x top_k x hidden elements."""
        return self.tokens * self.top_k * self.hidden * self.itemsize


@contextmanager
def recorded_calls(module: nn.Module) -> Iterator[dict[str, list[ExpertCall]]]:
    """The calls of every experts module of ``module`` made inside the ``with`` block, by name (the plan
    table runs the step on fake tensors inside it: ``tensor.table.expert_placement``)."""
    experts = find_hf_experts(module)
    calls: dict[str, list[ExpertCall]] = {name: [] for name in experts}

    def record(name: str, _: nn.Module, args: tuple, kwargs: dict) -> None:
        given = [*args, *kwargs.values()]  # (hidden states, top-k indices, weights), by position or name
        hidden, index = given[0], given[1]
        calls[name].append(
            ExpertCall(hidden.shape[0], index.shape[-1], hidden.shape[-1], hidden.element_size())
        )

    hooks = [
        m.register_forward_pre_hook(partial(record, name), with_kwargs=True) for name, m in experts.items()
    ]
    try:
        yield calls
    finally:
        for hook in hooks:
            hook.remove()


@dataclass
class ExpertPlacement:
    """The experts of ``module`` placed on ``ep`` ranks, with their calls in a traced step
    (``recorded_calls``; none where nothing was traced)."""

    ep: int
    calls: dict[str, list[ExpertCall]] = field(default_factory=dict)

    def local_experts(self, m: nn.Module) -> int:
        return experts_layout(m).num_experts // self.ep

    def params_per_rank(self, m: nn.Module) -> int:
        return sum(p.numel() // self.ep for p in m.parameters())

    def local_shape(self, m: nn.Module) -> str:
        up, down = experts_layout(m).weights()
        shapes = [[self.local_experts(m), *getattr(m, w).shape[1:]] for w in (up, down)]
        return "+".join(str(s) for s in shapes)

    def comm(self, m: nn.Module, name: str) -> tuple[str, str]:
        """The row's forward and backward communication: per token, the elements of its top-k copies."""
        lay = experts_layout(m)
        calls = self.calls.get(name) or []
        top_k = calls[0].top_k if calls else getattr(getattr(m, "config", None), "num_experts_per_tok", "k")
        rows = f"all-to-all {top_k}x{lay.hidden}/tok"
        return f"all-to-all {lay.num_experts} counts, {rows}, {rows}", f"{rows}, {rows}"

    def bytes_per_call(self, m: nn.Module, call: ExpertCall) -> tuple[int, int]:
        """(forward, backward) bytes handed to all-to-alls per rank by one call (see the module doc)."""
        counts = experts_layout(m).num_experts * COUNT_BYTES
        return counts + 2 * call.rows_bytes(), 2 * call.rows_bytes()

    def step_bytes(self, experts: dict[str, nn.Module]) -> dict[str, tuple[int, int]]:
        """Per experts module: (forward, backward) bytes handed over per rank in the traced step."""
        out = {}
        for name, m in experts.items():
            per_call = [self.bytes_per_call(m, c) for c in self.calls.get(name, [])]
            out[name] = (sum(f for f, _ in per_call), sum(b for _, b in per_call))
        return out

    def summary(self, module: nn.Module) -> list[str]:
        """The lines below the table: experts per rank, then the all-to-all volume per step."""
        experts = find_hf_experts(module)
        if not experts:
            return []
        first = next(iter(experts.values()))
        local, total = self.local_experts(first), experts_layout(first).num_experts
        held = sum(self.params_per_rank(m) for m in experts.values())
        whole = sum(p.numel() for m in experts.values() for p in m.parameters())
        ranks = "; ".join(f"ep rank {r}: {r * local}..{(r + 1) * local - 1}" for r in range(min(self.ep, 4)))
        lines = [
            f"expert parallel ep={self.ep}: {local} of {total} experts per rank in each of {len(experts)} "
            f"experts module(s) ({ranks}{'; ...' if self.ep > 4 else ''}), {held:,} of the experts' "
            f"{whole:,} parameters per rank"
        ]
        traced = {n: c for n, c in self.calls.items() if c}
        if not traced:
            return lines + [
                "all-to-all per step: not traced (no sample batch, or a step that does not run on fake "
                f"tensors): per call, forward {total} counts and 2 x tokens x top-k x hidden elements, "
                "backward 2 x the same"
            ]
        volume = self.step_bytes(experts)
        call = next(iter(traced.values()))[0]
        lines.append(
            f"all-to-all per step and rank (bytes handed over, rows kept on the rank included; averaged over "
            f"the ep group, as the routing decides what each rank's experts receive): {call.tokens} tokens x "
            f"top-{call.top_k} x {call.hidden} hidden x {call.itemsize} bytes per exchange"
        )
        for name, (fwd, bwd) in volume.items():
            calls = len(self.calls.get(name, []))
            lines.append(
                f"  {name}: {calls} call(s), forward {fwd:,} B (counts + dispatch + combine), "
                f"backward {bwd:,} B (combine + dispatch)"
            )
        fwd = sum(f for f, _ in volume.values())
        bwd = sum(b for _, b in volume.values())
        leaving = (fwd + bwd) * (self.ep - 1) // self.ep
        lines.append(
            f"  total: {fwd + bwd:,} B per step ({fwd:,} forward + {bwd:,} backward); with evenly spread routing "
            f"about {leaving:,} B leave the rank ((ep-1)/ep), the rest stays with its own experts"
        )
        return lines

    def total_bytes(self, module: nn.Module) -> int:
        """Bytes handed to all-to-alls per rank in one step, all experts modules together."""
        return sum(f + b for f, b in self.step_bytes(find_hf_experts(module)).values())
