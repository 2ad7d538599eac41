"""The memory a rank is expected to hold for a layout: model states by the ZeRO paper's formulas, activations
by the schedule's activation bound. The memory report prints these beside what it measures, and the
layout planner's cost model reads the same functions, so the two never disagree about a formula.

Model states (Rajbhandari et al., "ZeRO", SC'20, section 5): a rank that holds ``Ψ`` parameter elements
(its tensor/pipeline/expert share) keeps parameters, gradients and optimizer state. Over ``Nd``
data-parallel ranks, stage 1 keeps ``1/Nd`` of the optimizer state (with the float32 master copy of
mixed precision), stage 2 also of the gradients, stage 3 also of the parameters. The paper's
mixed-precision Adam has 2 + 2 + K bytes per element with K = 12 (master weights, momentum, variance):
(2 + 2 + 12)Ψ at stage 0 and (2 + 2 + 12)Ψ / Nd at stage 3.

Activations (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022,
table 2): of a transformer block's ``34 sbh`` bytes (without the attention scores' ``5as²b``), ``10 sbh``
(the norms' and dropouts' inputs, the residual) stay whole on every tensor-parallel rank unless sequence
parallelism cuts them too; the rest is split ``1/t``. Full recompute keeps each block's input only
(``1/t`` of it under sequence parallelism) plus one block's activations while it is recomputed; selective
recompute drops the attention core's. A pipeline stage holds that for as many micro-batches (chunks) as
its schedule keeps in flight (``pipeline.schedules.activation_bound``, passed in by the caller), and on top
of it the larger of two moments that never meet (``stage_activation_bytes``): the loss stage's head
activations, held from its forward until its backward, and a block rebuilt by full recompute in its
backward, which comes after that micro-batch's head backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

__all__ = [
    "StateBytes",
    "ModelStates",
    "OPTIMIZER_STATES",
    "state_bytes_for",
    "optimizer_kind",
    "model_state_bytes",
    "block_activation_bytes",
    "stage_activation_bytes",
    "WHOLE_ON_EVERY_TP_RANK",
]

#: optimizer state tensors kept per parameter element: plain SGD none, SGD with momentum one buffer, Adam and
#: AdamW two (first and second moments), Adagrad one (the sum of squares)
OPTIMIZER_STATES = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2, "adagrad": 1}

#: Korthikanti et al.'s share of a block's activations (without attention scores) that tensor
#: parallelism leaves whole on every rank: 10 of 34 sbh bytes
WHOLE_ON_EVERY_TP_RANK = 10 / 34


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter element: the parameter as held, its gradient, a float32 master copy (only where
    the held parameters are in a lower precision than the optimizer's), and each optimizer state tensor."""

    parameter: int
    gradient: int
    master: int
    optimizer_state: int


@dataclass(frozen=True)
class ModelStates:
    """A rank's expected model-state bytes."""

    parameters: float
    gradients: float
    optimizer: float  # optimizer state and master weights

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer


def state_bytes_for(precision: Union[str, int, None]) -> StateBytes:
    """The bytes per element under a Lightning ``precision``. ``*-mixed`` keeps float32 parameters and
    autocasts the compute, so its states are float32's; ``*-true`` holds everything in that dtype;
    ``"paper"`` is the ZeRO paper's fp16 parameters and gradients with float32 master and Adam state."""
    text = str(precision if precision is not None else "32-true")
    if text == "paper":
        return StateBytes(parameter=2, gradient=2, master=4, optimizer_state=4)
    if text in ("bf16-true", "16-true", "bf16", "16"):
        return StateBytes(2, 2, 0, 2)
    if text in ("64-true", "64", "double"):
        return StateBytes(8, 8, 0, 8)
    return StateBytes(4, 4, 0, 4)


def optimizer_kind(optimizer: Any) -> str:
    """The ``OPTIMIZER_STATES`` key of a torch optimizer (by class name; SGD with momentum apart)."""
    name = type(optimizer).__name__.lower()
    if name == "sgd":
        groups = getattr(optimizer, "param_groups", [{}])
        return "sgd_momentum" if any(g.get("momentum", 0) for g in groups) else "sgd"
    if name not in OPTIMIZER_STATES:
        raise ValueError(
            f"no expected state size for optimizer {type(optimizer).__name__}; known: {sorted(OPTIMIZER_STATES)}"
        )
    return name


def model_state_bytes(
    elements: float, data_parallel: int, zero_stage: int, optimizer: str, state: StateBytes
) -> ModelStates:
    """The model states of a rank holding ``elements`` parameter elements (its tp/pp/ep share) over
    ``data_parallel`` replicas at ``zero_stage`` (0-3)."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r} is not known; use one of {sorted(OPTIMIZER_STATES)}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r} must be 0, 1, 2 or 3")
    k = state.master + OPTIMIZER_STATES[optimizer] * state.optimizer_state

    def share(stage: int) -> float:
        return 1 / data_parallel if zero_stage >= stage else 1.0

    return ModelStates(
        parameters=elements * state.parameter * share(3),
        gradients=elements * state.gradient * share(2),
        optimizer=elements * k * share(1),
    )


def block_activation_bytes(
    activations: float,
    attention: float,
    block_input: float,
    tensor_parallel: int,
    sequence_parallel: bool,
    recompute: Union[bool, str],
) -> float:
    """The bytes one block keeps for its backward per micro-batch on one tensor-parallel rank, given its
    unsplit ``activations`` (all of them), the part of them that is the attention core's (scores,
    probabilities, dropout mask: what selective recompute drops) and its ``block_input``. Full
    recompute (``True``) keeps the input only; add one block's ``activations`` to a stage's peak for the
    block being recomputed."""
    t = tensor_parallel
    if recompute is True:
        return block_input / t if sequence_parallel else block_input
    kept_attention = 0.0 if recompute == "selective" else attention / t
    rest = activations - attention
    whole = 0.0 if sequence_parallel else rest * WHOLE_ON_EVERY_TP_RANK
    return kept_attention + whole + (rest - whole) / t


def stage_activation_bytes(kept: float, head: float, recomputed: float, heads_in_flight: int = 1) -> float:
    """A stage's peak of saved activations: what its blocks keep for the micro-batches in flight (``kept``),
    the head activations of the loss stage (``head`` per micro-batch, ``heads_in_flight`` of them held
    between their forward and backward: one under 1F1B, every micro-batch under GPipe; ``head`` 0 on other
    stages), and under full recompute one block's activations rebuilt in its backward beyond the input it
    kept (``recomputed``). A micro-batch's head backward is done before its blocks are recomputed, so the
    rebuilt block and that micro-batch's head are never held together (measured: 2 gloo processes of
    CharGPT, ``benchmarks/bench_planner.py``, the report's peak equals the kept inputs plus one rebuilt
    block less its input, not plus the head)."""
    others = max(heads_in_flight - 1, 0) * head
    return kept + others + max(head, recomputed)
