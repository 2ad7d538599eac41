import torch
import torchmetrics
from torch import nn

from lightning_parallel.pipeline.executor import split_microbatches
from lightning_parallel.pipeline.logs import WholeBatchMetrics, summarize


class Scored(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.worst = (
            torchmetrics.MaxMetric()
        )  # not an average: no mix of micro-batch values gives the batch's
        self.mse = torchmetrics.MeanSquaredError()


def test_whole_batch_value_of_a_metric_fed_micro_batch_by_micro_batch():
    torch.manual_seed(0)
    module, plain = Scored(), Scored()
    tracker = WholeBatchMetrics()
    for step in range(3):
        errors, preds = torch.rand(16) * (step + 1), torch.rand(16)
        with tracker.track(module):
            for e, p in zip(split_microbatches(errors, 4), split_microbatches(preds, 4)):
                module.worst(e)
                module.mse(p, torch.zeros_like(p))
        assert tracker.value(module.worst) == errors.max()  # the step's batch alone, not the running max
        torch.testing.assert_close(tracker.value(module.mse), (preds**2).mean())
        plain.worst(errors)
        plain.mse(preds, torch.zeros_like(preds))
        # the tracked metrics accumulate as if untracked, and lose their instance-level forward again
        assert module.worst.compute() == plain.worst.compute()
        torch.testing.assert_close(module.mse.compute(), plain.mse.compute())
        assert "forward" not in vars(module.worst)


def test_summary_carries_the_whole_batch_value_not_the_mean_of_micro_batch_values():
    module, tracker = Scored(), WholeBatchMetrics()
    logged = {"__metrics__": {}}
    with tracker.track(module):
        values = [module.worst(torch.tensor([v])) for v in (1.0, 5.0)]
    logged["__metrics__"]["worst"] = (module.worst, "worst", {}, values)
    assert float(summarize("train", [], [0.5, 0.5], logged)["metrics"]["worst"][1]["forward_cache"]) == 3.0
    summary = summarize("train", [], [0.5, 0.5], logged, whole_batch=tracker)
    assert float(summary["metrics"]["worst"][1]["forward_cache"]) == 5.0
