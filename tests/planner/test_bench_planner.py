"""``benchmarks/bench_planner.py --tiny``: two layouts of 2 gloo processes, each a real ``Trainer.fit``, their
measured step and peak memory per rank beside the cost model's prediction. Memory does not depend on the
machine's load, so its prediction is held to the measurement; the step times only to being measured."""

from __future__ import annotations

import importlib.util

import pytest

from tests.helpers.harness import REPO


def bench():
    spec = importlib.util.spec_from_file_location("bench_planner", REPO / "benchmarks" / "bench_planner.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_layout_of_the_benchmark_is_one_the_strategy_runs():
    """The 12+ layouts: 2 to 8 processes, none the planner's own checks would refuse."""
    from lightning_parallel.planner.layouts import layout_refusal

    b = bench()
    assert len(b.LAYOUTS) >= 12 and {layout.devices for layout in b.LAYOUTS} == {2, 4, 8}
    assert len({layout.name() for layout in b.LAYOUTS}) == len(b.LAYOUTS)
    for layout in b.LAYOUTS:
        if layout.zero_stage != 3:  # ZeRO 3 runs under lp_ddp, which lp_parallel's checks do not cover
            assert layout_refusal(layout, b.MODEL["n_layer"]) is None, layout.name()


@pytest.mark.slow
def test_tiny_mode_measures_and_predicts_memory_within_2_percent(capsys):
    result = bench().run(bench().parse(["--tiny"]))
    summary = result["summary"]
    assert summary["layouts"] == 2
    assert summary["median_memory_error"] < 0.02
    assert all(r["step_s"] > 0 for r in result["records"])
    assert "median absolute error of the step time" in capsys.readouterr().out
