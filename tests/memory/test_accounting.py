"""Counting by unique storage (views and tied weights once, meta nothing), the saved-activation counter
and its composition with the pipeline's own pack hook, and the callback under Lightning's single device."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from torch import nn

from lightning_parallel import MemoryReport
from lightning_parallel.memory import SavedTensorCounter, format_table, model_size, unique_storage_bytes
from lightning_parallel.pipeline.executor import weights_snapshot
from tests.helpers.models import MLP, RegressionData
from tests.helpers.probes import memory_report


def test_views_and_tied_weights_count_once_and_meta_counts_nothing() -> None:
    weight = torch.zeros(10, 4)  # 160 bytes
    assert unique_storage_bytes([weight, weight.t(), weight[2:5], weight.view(-1)]) == 160
    embedding, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight  # tied
    model = nn.Sequential(embedding, head)
    assert unique_storage_bytes(model.parameters()) == 160
    assert unique_storage_bytes([weight, torch.empty(1000, device="meta"), None]) == 160


def test_model_size_counts_a_meta_model_and_reads_it_in_another_dtype() -> None:
    with torch.device("meta"):
        model = nn.Linear(8, 4)  # 36 float32 elements
    size = model_size(model.parameters())
    assert size.bytes_as(None) == 36 * 4
    assert size.bytes_as(torch.float64) == 36 * 8


def test_optimizer_state_of_a_zero_redundancy_optimizer_is_read_from_its_local_optimizer(tmp_path) -> None:
    """torch's ZeroRedundancyOptimizer keeps this rank's state in ``optim`` and its own ``state`` empty."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from lightning_parallel.memory.accounting import optimizer_state_tensors

    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1
    )
    try:
        model = nn.Linear(8, 4)  # 36 float32 elements
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.1)
        model(torch.randn(2, 8)).sum().backward()
        optimizer.step()
        assert not optimizer.state
        # two moments of 36 elements, and a step count per parameter
        assert unique_storage_bytes(optimizer_state_tensors([optimizer])) == 2 * 36 * 4 + 2 * 4
    finally:
        torch.distributed.destroy_process_group()


def test_reset_peak_rss_lowers_the_peak_to_the_resident_memory_now() -> None:
    from lightning_parallel.memory.accounting import peak_rss_bytes, reset_peak_rss, rss_bytes

    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    del big
    if not reset_peak_rss():
        pytest.skip("no /proc/self/clear_refs here")
    assert peak_rss_bytes() < rss_bytes() + 32 * 2**20


def _forward_backward(model: nn.Module, batch: int) -> None:
    model(torch.randn(batch, 16)).square().sum().backward()


def _counted(batch: int, snapshot: bool) -> SavedTensorCounter:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    counter = SavedTensorCounter()
    counter.ignore(model.parameters())
    counter.start()
    try:
        if snapshot:  # the async pipeline's hook, installed inside the counting one
            with weights_snapshot(list(model.parameters())):
                _forward_backward(model, batch)
        else:
            _forward_backward(model, batch)
    finally:
        counter.stop()
    return counter


def test_saved_activations_are_counted_freed_and_scale_with_the_batch() -> None:
    small, large = _counted(8, snapshot=False), _counted(16, snapshot=False)
    assert small.peak > 0 and small.live == 0  # backward freed what the forward saved
    assert large.peak == 2 * small.peak
    # no parameter counts: 8 x (16 input + 32 + 32 + 32 + 32 + 4 values) float32, roughly
    assert small.peak < 8 * 200 * 4


def test_the_pipeline_snapshot_hook_does_not_hide_the_count() -> None:
    assert _counted(8, snapshot=True).peak == _counted(8, snapshot=False).peak > 0


def test_a_hook_that_does_not_report_hides_the_count() -> None:
    """Why the package's own pack hooks call ``record_saved``: only the innermost hook runs."""
    model = nn.Linear(16, 4)
    counter = SavedTensorCounter()
    counter.start()
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            _forward_backward(model, 8)
    finally:
        counter.stop()
    assert counter.peak == 0


def test_format_table_leaves_out_what_was_not_measured() -> None:
    report = MemoryReport()
    trainer = _fit(report, max_steps=1)
    text = format_table(report.tables["end_of_fit"], "now")
    assert "CUDA" not in text and "activations" in text and "\n   0 |" in text
    assert trainer.global_step == 1


def _trainer(report: MemoryReport, accelerator: str = "cpu", **kwargs) -> Trainer:
    """A quiet one-device Trainer with ``report``."""
    quiet = dict(
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )
    return Trainer(
        accelerator=accelerator, devices=1, callbacks=[report], limit_val_batches=0, **quiet, **kwargs
    )


def _fit(report: MemoryReport, max_steps: int = 3) -> Trainer:
    trainer = _trainer(report, max_steps=max_steps, precision="64-true")
    trainer.fit(MLP(optimizer="adam"), datamodule=RegressionData(batch_size=8))
    return trainer


@pytest.mark.timeout(120)
def test_callback_under_lightning_single_device(caplog) -> None:
    trainer = _fit(MemoryReport())
    probe = memory_report(trainer)
    (row,) = probe["tables"]["end_of_fit"]
    for column, outside in probe["outside"].items():
        assert outside > 0 and abs(row[column] - outside) <= 0.02 * outside, (column, row[column], outside)
    assert row["model_parameters"] == row["parameters"] and row["activations"] > 0
    assert row["setup_peak"] > 0 and row["peak_rss"] >= row["setup_peak"]
    text = caplog.text  # Lightning's rank_zero_info (shown on the console outside pytest)
    assert (
        text.count("Memory per rank, after set-up") == 1
        and text.count("Memory per rank, at the end of fit") == 1
    )


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_callback_reads_the_cuda_allocator_on_a_gpu(cuda_required) -> None:
    report = MemoryReport()
    trainer = _trainer(report, accelerator="gpu", max_steps=2)
    trainer.fit(MLP(optimizer="adam"), datamodule=RegressionData(batch_size=8, dtype="float32"))
    (row,) = report.tables["end_of_fit"]
    assert row.device.startswith("cuda") and row.activations > 0
    assert row.cuda_max_reserved >= row.cuda_max_allocated >= row.parameters + row.optimizer_state
    assert "CUDA max alloc" in format_table(report.tables["end_of_fit"], "now")
