"""``benchmarks/bench_zero3.py`` in its tiny mode: ZeRO-1, ZeRO-3 (built on meta) and FSDP2 under
Lightning's ``ModelParallelStrategy`` each train on 2 gloo processes (the sides built alike to the same
loss), with the memory report's figures in the records; the ``--gpu`` variant parses to its sizes (it runs
on a lent device only)."""

from __future__ import annotations

import importlib.util
import math

import pytest

from tests.helpers.harness import REPO


def bench():
    spec = importlib.util.spec_from_file_location("bench_zero3", REPO / "benchmarks" / "bench_zero3.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_variant_parses_to_its_sizes():
    b = bench()
    args = b.parse(["--gpu", "--world-sizes", "8"])
    assert (args.accelerator, args.precision, args.width, args.block_size) == (
        "cuda",
        "bf16-mixed",
        2048,
        1024,
    )
    assert args.world_sizes == [8] and b.parse(["--tiny", "--steps", "5"]).steps == 5


@pytest.mark.slow
def test_tiny_run_of_zero1_zero3_and_fsdp2(capsys):
    b = bench()
    args = b.parse(["--tiny", "--world-sizes", "2", "--configs", "zero1", "zero3", "fsdp2"])
    records = {r["config"]: r for r in b.run(args)}
    assert sorted(records) == ["fsdp2", "zero1", "zero3"]
    # the same model, data and steps; stage 3 is built on meta (from the modules' own initializers), as its
    # users would for the memory saving, the others as Lightning builds by default
    assert b.builds_on_meta("zero3") and not b.builds_on_meta("zero1") and not b.builds_on_meta("fsdp2")
    assert abs(records["zero1"]["final_loss"] - records["fsdp2"]["final_loss"]) < 1e-4
    assert math.isfinite(records["zero3"]["final_loss"])
    for name in ("parameters", "gradients"):  # stage 3 and FSDP2 hold half of ZeRO-1's (padding aside)
        for config in ("zero3", "fsdp2"):
            ratio = max(records[config][name]) / max(records["zero1"][name])
            assert 0.5 <= ratio < 0.52, (config, name, ratio)
    assert records["zero3"]["largest_unit"] > 0 and records["fsdp2"]["expected_states"] == [None, None]
    b.report(list(records.values()), args)
    table = capsys.readouterr().out
    assert "| 2 | zero3 |" in table and "| 2 | fsdp2 |" in table
