"""plan="auto" traces and dry-runs the user's step on fake tensors (lightning_parallel/tensor/fake.py):
for every family of the zoo it finds the plan that a trace of the real step finds, also for a module
built on the meta device, leaves the module's own tensors as they were, allocates no memory of the
model's order, and leaves a step that reads values computed from weights to the structural rules."""

from __future__ import annotations

import copy
import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake
from torch.nn import functional as F
from torchmetrics import MeanMetric, Metric
from torchmetrics.classification import MulticlassAccuracy

from lightning_parallel.tensor.auto import auto_plan, resolve_auto
from lightning_parallel.tensor.sample import forward_on
from tests.helpers.harness import REPO
from tests.helpers.zoo import ARCHITECTURES, ZooLM
from tests.helpers.zoo_more import MORE

# every family, Mixtral included: its eager experts loop over the experts its router chose (values fakes do
# not have), so the fake step runs its batched form (tensor.fake._experts_batched) and finds the same plan
FAMILIES = (*ARCHITECTURES, *MORE)
NOT_TRACED = "the sample step could not be traced ({}); structural rules decided"


def batch(seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32, (8, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def tensors(module: nn.Module) -> dict[str, Tensor]:
    return dict([*module.named_parameters(remove_duplicate=False), *module.named_buffers()])


def attributes(module: nn.Module) -> list[dict]:
    return [dict(vars(m)) for m in module.modules()]


def seeded(step: Callable[[], Tensor]) -> Tensor:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return step()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("arch", FAMILIES)
def test_the_fake_trace_finds_the_plan_of_the_real_trace(arch, tp):
    module = ZooLM(arch=arch)
    before = {n: (t, t.detach().clone()) for n, t in tensors(module).items()}
    held = attributes(module)
    step = forward_on(module, batch())
    fake = auto_plan(module, tp, step)
    assert all(
        a.keys() == b.keys() and all(a[k] is b[k] for k in a) for a, b in zip(attributes(module), held)
    )
    after = tensors(module)
    assert after.keys() == before.keys()
    for name, (t, value) in before.items():
        assert after[name] is t and torch.equal(t, value), name
    loss = seeded(step)
    assert fake == auto_plan(module, tp, step, fake=False)
    assert not is_fake(loss) and torch.equal(loss, seeded(step))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", FAMILIES)
def test_a_module_on_the_meta_device_gets_the_same_plan_and_stays_meta(arch):
    real = ZooLM(arch=arch)
    with torch.device("meta"):
        meta = ZooLM(arch=arch)
    held = tensors(meta)
    assert auto_plan(meta, 2, forward_on(meta, batch())) == auto_plan(real, 2, forward_on(real, batch()))
    assert tensors(meta) == held and all(t.is_meta for t in held.values())


def gradients(module: ZooLM) -> dict[str, Tensor]:
    module.zero_grad()
    seeded(lambda: module.loss(batch())).backward()
    return {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.timeout(120)
def test_hooks_a_step_installs_are_put_back():
    """Hugging Face's output capture installs its hooks on the first forward and marks the model; the
    mark is an attribute put back after the fake step, so the hooks go too (else the router logits of
    the load-balancing loss were captured once more per traced forward)."""
    module = ZooLM(arch="mixtral", router_aux=0.5)
    untraced = copy.deepcopy(module)
    auto_plan(module, 2, forward_on(module, batch()))
    expected = gradients(untraced)
    assert all(torch.equal(g, expected[n]) for n, g in gradients(module).items())


class ScaledByItsPeak(LightningModule):
    """An MLP pair whose output is divided by its largest value, read as a Python number."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.example_input_array = torch.randn(4, 8)

    def forward(self, x: Tensor) -> Tensor:
        h = self.mlp(x)
        return h / max(h.abs().max().item(), 1.0)


class TrimsPadding(LightningModule):
    """An MLP pair on the tokens up to the longest unpadded row: the length is read from the input."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.example_input_array = torch.tensor([[3, 4, 5, 0], [6, 7, 0, 0]])

    def forward(self, idx: Tensor) -> Tensor:
        longest = int((idx != 0).sum(1).max())
        kept = idx[:, (idx != 0).any(0).nonzero().flatten()][:, :longest]
        return self.down(torch.relu(self.up(self.embed(kept))))


@pytest.mark.timeout(60)
def test_a_value_computed_from_weights_cannot_be_read_and_the_structure_decides():
    module = ScaledByItsPeak()
    plan, report = auto_plan(module, 2, forward_on(module))
    why = NOT_TRACED.format("DataDependentOutputException: aten._local_scalar_dense.default")
    assert report[0] == ("(whole model)", why)
    assert plan == auto_plan(module, 2)[0]
    assert {r.pattern: r.style for r in plan.layers} == {"mlp.0": "colwise", "mlp.2": "rowwise"}
    assert all(name != "(whole model)" for name, _ in auto_plan(module, 2, forward_on(module), fake=False)[1])


@pytest.mark.timeout(60)
def test_values_computed_from_the_inputs_alone_can_be_read():
    module = TrimsPadding()
    step = forward_on(module)
    plan, report = auto_plan(module, 2, step)
    assert (plan, report) == auto_plan(module, 2, step, fake=False)
    assert {r.pattern: r.style for r in plan.layers} == {"embed": "vocab", "up": "colwise", "down": "rowwise"}


class Measured(LightningModule):
    """An MLP pair whose step feeds a torchmetrics metric: the loss, the predictions, or the hidden
    features (which a split region would hand it sharded)."""

    def __init__(self, metric: Metric, reads: str) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 4)
        self.metric, self.reads = metric, reads

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        hidden = torch.relu(self.up(x))
        logits = self.down(hidden)
        loss = F.cross_entropy(logits, y)
        given = {"loss": (loss,), "predictions": (logits.argmax(-1), y), "hidden": (hidden,)}[self.reads]
        self.log("metric", self.metric(*given))
        return loss


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "metric, reads",
    [(MeanMetric(), "loss"), (MulticlassAccuracy(4), "predictions"), (MeanMetric(), "hidden")],
    ids=["mean-of-loss", "accuracy", "mean-of-hidden"],
)
def test_a_metric_reads_what_it_is_given_whole_and_keeps_its_state(metric, reads):
    module = Measured(metric, reads)
    state = {k: v.clone() for k, v in metric.metric_state.items()}
    methods = {k: vars(metric).get(k) for k in ("forward", "update")}
    step = forward_on(module, (torch.randn(6, 8), torch.randint(0, 4, (6,))))
    plan, report = auto_plan(module, 2, step)
    real_plan, real_report = auto_plan(module, 2, step, fake=False)
    assert plan == real_plan and [n for n, _ in report] == [n for n, _ in real_report]
    if reads == "hidden":  # the checks of a real metric read it first, the stand-in's sum here
        assert dict(report)["up"] == "sum over the sharded dimension (in metric)"
    else:
        assert {r.pattern: r.style for r in plan.layers} == {"up": "colwise", "down": "rowwise"}
        assert report == real_report
    assert all(torch.equal(v, state[k]) and not is_fake(v) for k, v in metric.metric_state.items())
    assert {k: vars(metric).get(k) for k in methods} == methods


def resolve_on_meta_rss() -> dict[str, int]:
    """Resolve plan="auto" for a ~380 MB float32 Llama built on the meta device (after a tiny one, so
    that lazy imports are not counted): the parameters' bytes and the growth of the peak RSS."""
    with torch.device("meta"):
        resolve_auto(ZooLM(arch="hf_llama"), 2, forward_on(ZooLM(arch="hf_llama"), batch()))
        module = ZooLM(arch="hf_llama", width=1024, layers=10, heads=8)
    step = forward_on(module, batch())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    resolved = resolve_auto(module, 2, step)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert all(t.is_meta for t in tensors(module).values())
    assert not any(why.startswith("the sample step could not") for _, why in resolved.report)
    sharded = sum(a.style not in ("replicate", "per_feature") for a in resolved.assignments)
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    return {"parameter_bytes": params, "rss_growth_bytes": grown, "sharded_layers": sharded}


@pytest.mark.timeout(240)
def test_resolving_a_meta_model_allocates_nothing_of_its_size():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "tests.tensor.test_fake_trace"]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    print(measured)
    assert measured["parameter_bytes"] > 350e6 and measured["sharded_layers"] >= 70
    assert measured["rss_growth_bytes"] < 0.1 * measured["parameter_bytes"], measured


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(resolve_on_meta_rss()))
