"""Published training runs the planner is checked against (docs/planner_published.md): each model built from
its shape alone (parameter, FLOP and activation counts; nothing downloaded, nothing allocated), its layout,
its cluster, and the throughput its authors reported.

- Megatron-LM's weak-scaling table (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", SC'21, arXiv:2104.04473, table 1): GPT models of 1.7B to 1T parameters on
  DGX A100 nodes (``clusters/a100_selene.yaml``), reported in teraFLOP/s per GPU by the paper's own count
  (its equation 3: ``96 B s l h^2 (1 + s/6h + V/16lh)`` per step, the recompute's forward included).
- torchtitan's Llama 3.1 405B on 512 H100 (``benchmarks/llama3_h100_202412_torchtitan.md``, table 5):
  FSDP 8 x TP 8 x PP 8, full activation checkpointing, local batch 32, sequence 8192; 1F1B at 100 tokens/s
  per GPU, interleaved 1F1B at 128.

Block costs from shapes (``transformer_cost``): a block's forward is its matrix products' FLOPs at a
matrix-product rate (Megatron's count: ``24 b s h^2 + 4 b s^2 h`` for a GPT block; the projections' own
widths for a gated, grouped-query Llama block) plus, with ``DeviceRates``' memory terms, its memory-bound
work (norms, dropout, softmax, GeLU, biases, residual adds) at the device's memory bandwidth, its backward
twice that; its activations Korthikanti et al.'s ``s b h (34 + 5 a s / h)`` bytes in 16-bit; the logit
layer (``2 b s h V`` forward) outside the stack. The memory-bound share falls as blocks widen (its bytes
grow as ``h``, the FLOPs as ``h^2``), which is why wider models reach a higher share of the peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from lightning_parallel.memory.expected import block_activation_bytes
from lightning_parallel.planner.cluster import Cluster
from lightning_parallel.planner.cost_model import BlockCost, ModelCost, Prediction, predict
from lightning_parallel.planner.layout import Layout

__all__ = [
    "DeviceRates",
    "A100_MEMORY_BANDWIDTH",
    "fit_device_rates",
    "TransformerShape",
    "PublishedRun",
    "transformer_cost",
    "MEGATRON_TABLE_1",
    "TORCHTITAN_405B",
    "megatron_flops_per_step",
    "predicted_tflops_per_gpu",
    "achieved_rate",
    "predict_run",
]


#: the A100 80GB SXM's memory bandwidth, bytes/s (NVIDIA A100 datasheet: 2,039 GB/s)
A100_MEMORY_BANDWIDTH = 2.039e12


@dataclass(frozen=True)
class DeviceRates:
    """How fast a device runs a block: its matrix products at ``matmul_flops`` per second, and its
    memory-bound work as ``traffic`` bytes moved through memory per byte the block saves for backward (the
    saved tensors are those element-wise operations' outputs) at ``bandwidth`` bytes per second. Without
    ``traffic`` a block is its FLOPs at one rate."""

    matmul_flops: float
    bandwidth: float = 1.0
    traffic: float = 0.0

    def seconds(self, flops: float, saved_bytes: float) -> float:
        """The time of work of ``flops`` matrix-product FLOPs that saves ``saved_bytes`` for backward."""
        return flops / self.matmul_flops + self.traffic * saved_bytes / self.bandwidth


@dataclass(frozen=True)
class TransformerShape:
    """A decoder-only transformer: ``ffn`` the MLP's inner width (default 4h), ``kv_heads`` the key/value
    heads (default all), ``gated``: a SwiGLU MLP (three matrices), ``tied``: the head is the embedding."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    ffn: Optional[int] = None
    kv_heads: Optional[int] = None
    gated: bool = False
    tied: bool = True
    position_embeddings: bool = True

    @property
    def _ffn(self) -> int:
        return self.ffn or 4 * self.hidden

    def block_matmul_elements(self) -> int:
        """The weight elements of a block's matrix products (attention's q, k, v, output; the MLP's)."""
        h, kv = self.hidden, self.hidden * (self.kv_heads or self.heads) // self.heads
        return h * (h + 2 * kv) + h * h + (3 if self.gated else 2) * h * self._ffn

    def block_parameters(self) -> int:
        """Its parameters: the matrices, and for a GPT block their biases and two layer norms (13h, as
        Megatron's ``12h^2 + 13h``); for a Llama block two RMS norms."""
        extra = 2 * self.hidden if self.gated else 9 * self.hidden + self._ffn
        return self.block_matmul_elements() + extra

    def block_forward_flops(self, samples: float) -> float:
        """The forward's FLOPs of one block: 2 per weight element per token, and the attention products
        ``Q K^T`` and ``softmax V`` (``4 b s^2 h``, unmasked as Megatron counts them)."""
        tokens = samples * self.seq
        return 2 * tokens * self.block_matmul_elements() + 4 * samples * self.seq**2 * self.hidden

    def other_parameters(self) -> int:
        """The embedding (and position embeddings), and the head where it is not the embedding."""
        return self.hidden * (
            self.vocab * (1 if self.tied else 2) + (self.seq if self.position_embeddings else 0)
        )

    @property
    def parameters(self) -> int:
        return self.layers * self.block_parameters() + self.other_parameters()


def transformer_cost(
    shape: TransformerShape, rates: Union[float, DeviceRates], itemsize: int = 2, tensor_parallel: int = 1
) -> ModelCost:
    """The ``ModelCost`` of ``shape`` at one sample, its blocks timed by ``rates`` (a FLOP rate alone, or
    ``DeviceRates``), backward twice the forward, bytes in ``itemsize``-byte elements (16-bit: 2).

    The cost model divides a block's time by the tensor-parallel degree. The memory-bound work is the bytes
    a rank saves (``block_activation_bytes`` at ``tensor_parallel`` without sequence parallelism: the norms,
    dropouts and residual, 10 of 34 sbh, run whole on every rank as in Megatron-LM of 2021), so its time
    enters ``forward_s`` times ``tensor_parallel``: each rank then gets all of it."""
    rates = rates if isinstance(rates, DeviceRates) else DeviceRates(rates)
    s, h, a, t = shape.seq, shape.hidden, shape.heads, tensor_parallel
    activations, attention = s * h * (34 + 5 * a * s / h) * itemsize / 2, 5 * a * s * s * itemsize / 2
    per_rank = block_activation_bytes(activations, attention, s * h * itemsize, t, False, False)
    forward = rates.seconds(shape.block_forward_flops(1), 0.0) + t * rates.seconds(0.0, per_rank)
    block = BlockCost(
        forward_s=forward,
        backward_s=2 * forward,
        activation_bytes=activations,
        parameter_bytes=shape.block_parameters() * itemsize,
        output_bytes=s * h * itemsize,
        attention_bytes=attention,
        attention_s=rates.seconds(4 * s * s * h, 0.0),
    )
    logit_bytes = 2 * s * shape.vocab * itemsize
    logits = rates.seconds(2 * s * h * shape.vocab, logit_bytes)
    return ModelCost(
        blocks=[block] * shape.layers,
        other_parameter_bytes=shape.other_parameters() * itemsize,
        batch_size=1,
        other_forward_s=logits,
        other_backward_s=2 * logits,
        other_activation_bytes=logit_bytes,
        parameter_itemsize=itemsize,
        optimizer="adam",
        tokens_per_sample=s,
        name=f"{shape.parameters / 1e9:.1f}B ({shape.layers} x {h})",
    )


@dataclass(frozen=True)
class PublishedRun:
    """One published run: its model, layout and what was reported (``reported``: TFLOP/s per GPU for
    Megatron's rows, tokens/s per GPU for torchtitan's)."""

    name: str
    shape: TransformerShape
    layout: Layout
    reported: float


def _gpt(
    params_b: str,
    heads: int,
    hidden: int,
    layers: int,
    t: int,
    p: int,
    gpus: int,
    batch: int,
    tflops: float,
    microbatch: int,
    virtual: int = 1,
) -> PublishedRun:
    """A row of Megatron's table 1: vocabulary 51,200, sequence 2048, full recompute (the table's FLOP count
    includes it); the micro-batch and the interleaved schedule's chunks per rank (``virtual``) of
    Megatron-LM's script for the row (``examples/sc21/run_table_1.sh``: ``MBS``, and ``layers / (p x
    --num-layers-per-virtual-pipeline-stage)``). With t > 1 and pipeline stages each GPU sends 1/t of a
    stage's output (the paper's scatter/gather, on by default), which the cost model computes for sequence
    parallelism: the rows set it, which leaves the tensor-parallel time alike (a ring all-reduce is a
    reduce-scatter and an all-gather)."""
    dp = gpus // (t * p)
    m = batch // (dp * microbatch)
    schedule = "interleaved_1f1b" if virtual > 1 else "1f1b"
    layout = Layout(
        dp,
        t,
        p,
        batch,
        schedule=schedule,
        num_microbatches=m,
        virtual_stages=virtual,
        recompute=True,
        sequence_parallel=t > 1 and p > 1,
    )
    return PublishedRun(f"{params_b}B", TransformerShape(layers, hidden, heads, 2048, 51200), layout, tflops)


#: Narayanan et al., SC'21, table 1: parameters (billions), heads, hidden, layers, t, p, GPUs, batch,
#: achieved TFLOP/s per GPU; then the micro-batch and chunks per rank of ``examples/sc21/run_table_1.sh``
MEGATRON_TABLE_1 = [
    _gpt("1.7", 24, 2304, 24, 1, 1, 32, 512, 137, microbatch=16),
    _gpt("3.6", 32, 3072, 30, 2, 1, 64, 512, 138, microbatch=16),
    _gpt("7.5", 32, 4096, 36, 4, 1, 128, 512, 142, microbatch=16),
    _gpt("18.4", 48, 6144, 40, 8, 1, 256, 1024, 135, microbatch=8),
    _gpt("39.1", 64, 8192, 48, 8, 2, 512, 1536, 138, microbatch=4),
    _gpt("76.1", 80, 10240, 60, 8, 4, 1024, 1792, 140, microbatch=2, virtual=3),
    _gpt("145.6", 96, 12288, 80, 8, 8, 1536, 2304, 148, microbatch=2, virtual=2),
    _gpt("310.1", 128, 16384, 96, 8, 16, 1920, 2160, 155, microbatch=1, virtual=2),
    _gpt("529.6", 128, 20480, 105, 8, 35, 2520, 2520, 163, microbatch=1, virtual=3),
    _gpt("1008.0", 160, 25600, 128, 8, 64, 3072, 3072, 163, microbatch=1),
]

_LLAMA_405B = TransformerShape(
    layers=126,
    hidden=16384,
    heads=128,
    seq=8192,
    vocab=128256,
    ffn=53248,
    kv_heads=8,
    gated=True,
    tied=False,
    position_embeddings=False,
)


def _titan(schedule: str, v: int, tokens_per_s: float) -> PublishedRun:
    """torchtitan's table 5: FSDP (ZeRO 3) 8 x TP 8 x PP 8 with its sequence-parallel tensor plan, global
    batch 256 (32 per replica), its
    default micro-batch count (the pipeline degree, 8), two stages per rank for a looped schedule."""
    layout = Layout(
        8,
        8,
        8,
        256,
        schedule=schedule,
        num_microbatches=8,
        virtual_stages=v,
        zero_stage=3,
        recompute=True,
        sequence_parallel=True,
    )
    return PublishedRun(schedule, _LLAMA_405B, layout, tokens_per_s)


#: torchtitan's Llama 3.1 405B runs (tokens/s per GPU)
TORCHTITAN_405B = [_titan("1f1b", 1, 100.0), _titan("interleaved_1f1b", 2, 128.0)]


def megatron_flops_per_step(shape: TransformerShape, batch: int) -> float:
    """Narayanan et al.'s equation 3: ``96 B s l h^2 (1 + s/6h + V/16lh)``, the FLOPs the paper counts per
    step (forward, the recompute's forward and the backward of every block; the logit layer)."""
    b, s, layers, h, v = batch, shape.seq, shape.layers, shape.hidden, shape.vocab
    return 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


def predict_run(
    run: PublishedRun, cluster: Cluster, rates: Union[float, DeviceRates, None] = None
) -> Prediction:
    """The run's prediction on ``cluster``, its blocks timed by ``rates`` (default the cluster's FLOP rate)."""
    cost = transformer_cost(run.shape, rates or cluster.flops, tensor_parallel=run.layout.tp)
    return predict(cost, run.layout, cluster, precision="paper")


def predicted_tflops_per_gpu(
    run: PublishedRun, cluster: Cluster, rates: Union[float, DeviceRates, None] = None
) -> float:
    """The throughput per GPU the paper would have reported for the predicted step (its own FLOP count)."""
    step = predict_run(run, cluster, rates).step_s
    return megatron_flops_per_step(run.shape, run.layout.global_batch) / step / run.layout.devices / 1e12


def fit_device_rates(
    runs: Sequence[PublishedRun], cluster: Cluster, bandwidth: float, iterations: int = 4
) -> DeviceRates:
    """The matrix-product rate and the memory traffic per saved byte (``DeviceRates``, at ``bandwidth``) at
    which ``runs`` (Megatron's rows: TFLOP/s per GPU by its equation 3) are predicted nearest their reported
    throughput: least squares of the steps' relative
    errors. The step is linear in (1 / rate, traffic) where no bubble or overlap changes with them (runs
    without pipeline stages); Gauss-Newton from 60% of the peak and 1 byte per saved byte."""
    inverse, traffic = 1 / (0.6 * cluster.flops), 1.0
    for _ in range(iterations):
        rows = []
        for run in runs:
            goal = megatron_flops_per_step(run.shape, run.layout.global_batch) / run.reported / 1e12
            goal /= run.layout.devices  # the reported step, seconds

            def step(u: float, k: float) -> float:
                return predict_run(run, cluster, DeviceRates(1 / u, bandwidth, k)).step_s / goal

            here = step(inverse, traffic)
            d_inverse = (step(inverse * 1.01, traffic) - here) / (0.01 * inverse)
            d_traffic = (step(inverse, traffic + 0.01) - here) / 0.01
            rows.append((d_inverse, d_traffic, 1 - here))
        inverse_step, traffic_step = _least_squares_2(rows)
        inverse, traffic = inverse + inverse_step, max(traffic + traffic_step, 0.0)
    return DeviceRates(1 / inverse, bandwidth, traffic)


def _least_squares_2(rows: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """(x, y) minimising the sum of (a x + b y - c)^2 over rows (a, b, c): the 2 x 2 normal equations."""
    aa = sum(a * a for a, _, _ in rows)
    ab = sum(a * b for a, b, _ in rows)
    bb = sum(b * b for _, b, _ in rows)
    ac = sum(a * c for a, _, c in rows)
    bc = sum(b * c for _, b, c in rows)
    det = aa * bb - ab * ab
    return (ac * bb - bc * ab) / det, (bc * aa - ac * ab) / det


def achieved_rate(run: PublishedRun, cluster: Cluster, target: Union[float, None] = None) -> float:
    """The block FLOP rate at which ``run`` is predicted at ``target`` (default its reported) TFLOP/s per
    GPU: the one figure the planner would measure on the real device (its blocks' time), found here from
    one published row. Fixed-point iteration: the prediction falls as the rate falls, nearly in proportion."""
    goal, rate = target or run.reported, cluster.flops
    for _ in range(20):
        predicted = predicted_tflops_per_gpu(run, cluster, rate)
        if abs(predicted / goal - 1) < 1e-4:
            break
        rate *= goal / predicted
    return rate
