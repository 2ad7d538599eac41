"""The sweep-safe subprocess launcher: child command, clean-up, and a user's own Hydra app under -m."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig

from lightning_parallel.config import register_configs
from lightning_parallel.strategies import launcher as L
from tests.cli.lp import REPO, assert_no_survivors, explain, run, sweep_dir


def test_child_command_is_this_job_only(tmp_path, monkeypatch) -> None:
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(
            config_name="config", overrides=["strategy=lp_dp", "trainer.devices=2"], return_hydra_config=True
        )
    cfg.hydra.runtime.output_dir = str(tmp_path / "multirun" / "3")
    cfg.hydra.runtime.cwd = str(tmp_path)
    monkeypatch.setenv(
        L.ENTRY_ENV, json.dumps(["python", "-m", "lightning_parallel.cli.train", "--config-dir", "x"])
    )
    HydraConfig.instance().set_config(cfg)
    try:
        command, cwd = L.child_command(local_rank=1, global_rank=1)
    finally:
        HydraConfig.instance().cfg = None
    assert command[:5] == ["python", "-m", "lightning_parallel.cli.train", "--config-dir", "x"]
    assert "strategy=lp_dp" in command and "trainer.devices=2" in command
    assert f'hydra.run.dir="{tmp_path / "multirun" / "3"}"' in command
    assert "hydra.mode=RUN" in command and "hydra.job.name=train_rank1" in command
    assert "-m" not in command[3:] and "--multirun" not in command
    assert cwd == str(tmp_path)


def test_finish_job_restores_environment_and_reports_failed_children(monkeypatch) -> None:
    monkeypatch.setenv("MASTER_PORT", "1234")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv(L.AGENT_STORE_ENV, raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    state = L._JobState(
        job_key="job-0",
        env_before={"MASTER_PORT": "1234", "LOCAL_RANK": None, "MASTER_ADDR": None, L.AGENT_STORE_ENV: None},
        threads_before=1,
    )
    state.store = L.HostedStore(world_size=2)
    port = state.store.port
    state.procs = [
        subprocess.Popen(
            [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], stdout=subprocess.DEVNULL
        )
    ]
    state.ranks, state.logs = [1], [Path(os.devnull)]
    monkeypatch.setattr(L, "_ACTIVE", state)
    os.environ.update(state.store.env(), LOCAL_RANK="0")  # what a launch leaves behind
    with pytest.raises(L.RankFailedError, match=r"rank 1 \(pid \d+\) exited with code 3"):
        L.finish_job(wait_timeout=20)
    assert os.environ["MASTER_PORT"] == "1234"
    assert not {"LOCAL_RANK", "MASTER_ADDR", L.AGENT_STORE_ENV} & set(os.environ)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # the job's rendezvous store is closed
    assert L._ACTIVE is None
    L.finish_job()  # idempotent


@pytest.mark.timeout(200)
def test_users_own_hydra_app_sweeps_with_our_strategy(tmp_path) -> None:
    """Not lp-train: jobs end without our clean-up call; the next job's launch cleans up the previous one."""
    proc = run(
        ["-m", "devices=2,1,2"],
        tmp_path,
        command=[sys.executable, str(REPO / "tests/helpers/hydra_user_app.py")],
    )
    assert proc.returncode == 0, explain(proc)
    root = sweep_dir(tmp_path)
    worlds = [json.loads((root / str(i) / "world.json").read_text()) for i in range(3)]
    assert [w["world_size"] for w in worlds] == [2, 1, 2], worlds
    # each 2-process job met at its own store, held by the launching process from before its child started
    assert [w["hosted_store"] for w in worlds] == [True, False, True], worlds
    assert worlds[0]["port"] != worlds[2]["port"], worlds
    assert_no_survivors(tmp_path)
