"""``lp-train strategy=auto``: the planner's layout trained as its overrides, the prediction beside the
measured figures in ``summary.json``; contradicting fixed options refused before launch; ``planner.top_k``'s
sweep composes to k different planned layouts."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from lightning_parallel.cli.auto_strategy import (
    _record,
    auto_problems,
    chosen_overrides,
    register_planner_ranks,
)
from lightning_parallel.config import problems, register_configs
from lightning_parallel.planner.layouts import plan_layouts
from lightning_parallel.planner.planning import cluster_for, model_cost
from tests.cli.lp import assert_no_survivors, explain, run, summary
from tests.cli.test_config import CONF, _compose

# a two-block CharGPT (the planner times a block stack), a few short steps, no validation, no checkpoint
SHORT = [
    "experiment=quick",
    "model.n_layer=2",
    "data.batch_size=8",
    "trainer.max_steps=6",
    "trainer.limit_val_batches=0",
    "checkpoint.enabled=false",
]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_strategy_auto_trains_the_planned_layout_and_records_its_error(tmp_path) -> None:
    run_dir = tmp_path / "run"
    proc = run(["strategy=auto", "trainer.devices=4", *SHORT, f"hydra.run.dir={run_dir}"], tmp_path, 540)
    assert proc.returncode == 0, explain(proc)
    s = summary(run_dir)
    planned = s["planner"]
    assert s["status"] == "completed" and s["global_step"] == 6 and s["world_size"] == 4
    # the planner's first: trained as its overrides (the strategy and its data-parallel size as run)
    assert planned["rank"] == 1 and planned["layout"] == planned["ranked"][0]["layout"]
    assert s["strategy"] == "lp_parallel" and s["strategy_target"] == "lightning_parallel.ParallelStrategy"
    dp = next(
        int(o.split("=")[1]) for o in planned["overrides"] if o.startswith("strategy.data_parallel_size=")
    )
    assert s["data_parallel_size"] == dp
    assert planned["global_batch"] == 8 * 4  # data.batch_size x the world
    assert (run_dir / "planner.json").is_file()  # what the started ranks read
    # the prediction beside the measured figures, and the error
    assert planned["predicted"]["step_seconds"] > 0 and planned["predicted"]["peak_bytes_per_rank"] > 0
    assert planned["measured"]["step_seconds"] == s["median_step_seconds"] > 0
    assert len(planned["measured"]["peak_bytes_per_rank"]) == 4
    assert planned["measured"]["peak_bytes"] == max(planned["measured"]["peak_bytes_per_rank"])
    measured, predicted = planned["measured"], planned["predicted"]
    step_error = 100 * (predicted["step_seconds"] - measured["step_seconds"]) / measured["step_seconds"]
    assert planned["error_percent"]["step_time"] == pytest.approx(step_error, abs=0.01)
    assert planned["error_percent"]["peak_memory"] is not None
    out = proc.stdout + proc.stderr
    assert "strategy=auto: planned" in out and f"chose #1 {planned['layout']}" in out
    assert f"planned (strategy=auto)  {planned['layout']}: step" in out and "error" in out
    assert_no_survivors(tmp_path)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["strategy.tensor_parallel_size=3"], ["strategy.tensor_parallel_size=3", "in [1, 2, 4]"]),
        (
            ["strategy.tensor_parallel_size=1", "strategy.sequence_parallel=true"],
            ["no layout of 4 devices has all of these together"],
        ),
        (["strategy.schedule=async"], ["strategy.schedule='async'", "'1f1b'"]),
        (["trainer.devices=auto"], ["give trainer.devices=N"]),
        (["planner.rank=0"], ["planner.rank=0 must be at least 1"]),
    ],
)
def test_contradicting_choices_are_refused_before_launch(overrides, words) -> None:
    found = "\n".join(auto_problems(_compose("strategy=auto", "trainer.devices=4", *overrides)))
    assert all(w in found for w in words), found


def test_planner_settings_need_strategy_auto() -> None:
    found = auto_problems(_compose("planner.top_k=3"))
    assert found == [
        "planner.top_k=3 is read only under strategy=auto (the planner chooses the layout); add strategy=auto "
        "or leave it out"
    ]
    cfg = _compose("strategy=auto", "trainer.devices=4", "strategy.zero_stage=1")
    assert auto_problems(cfg) == [] and problems(cfg) == []


def test_top_k_sweeps_k_planned_layouts_that_compose(tmp_path) -> None:
    """``-m strategy=auto planner.top_k=3``: the sweeper's jobs are planner.rank=1,2,3; each job's config is
    the k-th planned layout's overrides in place of strategy=auto, and passes the checks made before launch."""
    register_configs()
    register_planner_ranks()
    task = ["strategy=auto", "trainer.devices=4", "model.n_layer=2", "planner.top_k=3"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=task, return_hydra_config=True)
        params = OmegaConf.to_container(cfg.hydra.sweeper.params, resolve=True)
        parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()] + task)
        jobs = [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
        ranks = [next(o for o in job if o.startswith("planner.rank=")) for job in jobs]
        assert ranks == ["planner.rank=1", "planner.rank=2", "planner.rank=3"]
        cost = model_cost("lightning_parallel.models.gpt:CharGPT", {"n_layer": 2, "n_embd": 32}, None, 8, 1)
        plan = plan_layouts(cost, cluster_for(None, 4), 4, 32)
        layouts = []
        for job, rank_override in zip(jobs, ranks):
            rank = int(rank_override.split("=")[1])
            chosen = _record(plan.ranked[rank - 1], 1)
            job_cfg = compose(config_name="config", overrides=chosen_overrides(job, chosen["overrides"]))
            assert (
                problems(job_cfg) == auto_problems(job_cfg) == [] and job_cfg.planner.rank == 1
            )  # planner.* read by then
            assert job_cfg.strategy._target_ == "lightning_parallel.ParallelStrategy"
            assert job_cfg.strategy.data_parallel_size == chosen["options"]["dp"]
            assert job_cfg.strategy.zero_stage == chosen["options"]["zero_stage"]
            layouts.append(chosen["layout"])
    assert len(set(layouts)) == 3


def test_a_job_with_a_plan_reads_it_and_only_the_planning_process_refuses_top_k_without_m(tmp_path) -> None:
    """A rank the launcher starts for a ``planner.top_k=2`` job runs in RUN mode with the job's overrides:
    it reads the job's plan; without a plan (the planning process), top_k > 1 without -m is refused."""
    from lightning_parallel.cli.auto_strategy import PLAN_FILE, _job_plan
    from lightning_parallel.config import ConfigError

    cfg = _compose("strategy=auto", "trainer.devices=4", "planner.top_k=2")
    (tmp_path / "job").mkdir()
    plan = {"ranked": [{"layout": "dp4 tp1 pp1"}]}
    (tmp_path / "job" / PLAN_FILE).write_text(json.dumps(plan))

    def never(node, section):
        raise AssertionError("a job with a plan measures nothing")

    assert _job_plan(cfg, 4, tmp_path / "job", None, never) == plan
    with pytest.raises(
        ConfigError, match="planner.top_k=2 trains the planner's 2 fastest layouts as a sweep: add -m"
    ):
        _job_plan(cfg, 4, tmp_path, None, never)
