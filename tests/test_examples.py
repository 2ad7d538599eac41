"""Every example in examples/ runs (the real SLURM submission excepted: its dry run runs)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.lp import REPO, assert_no_survivors, check_sweep, env, explain, run_bounded

EXAMPLES = REPO / "examples"
LP_TRAIN = f"{sys.executable} -m lightning_parallel.cli.train"


def _run(command: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    e = env(str(cwd))
    e.update(
        LP_TRAIN=LP_TRAIN,
        PYTHON=sys.executable,
        TORCHRUN=f"{sys.executable} -m torch.distributed.run",
        OUT=str(cwd / "out"),
    )
    proc = run_bounded(command, cwd, e, timeout)
    assert proc.returncode == 0, explain(proc)
    return proc


@pytest.mark.timeout(200)
def test_drop_in_script(tmp_path) -> None:
    proc = _run([sys.executable, str(EXAMPLES / "drop_in" / "train.py"), "--max-epochs", "2"], tmp_path)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("world size"))
    assert line.startswith("world size 2, val_acc ") and float(line.split()[-1]) > 0.9, line
    assert_no_survivors(tmp_path)


@pytest.mark.timeout(200)
def test_hydra_app_on_a_user_module(tmp_path) -> None:
    _run(["bash", str(EXAMPLES / "hydra_app" / "run.sh")], tmp_path)
    s = json.loads((tmp_path / "out" / "hydra_app" / "summary.json").read_text())
    assert s["status"] == "completed" and s["model"] == "my_project.model.SineRegressor"
    assert s["world_size"] == 2 and s["global_step"] == 60 and s["val_loss"] < 0.5
    assert_no_survivors(tmp_path)


@pytest.mark.timeout(420)
def test_sweep_example(tmp_path) -> None:
    """Also the test of a sweep defined in a config file (``experiment=sweep_strategies``: its first sweep)."""
    proc = _run(["bash", str(EXAMPLES / "sweep" / "run.sh")], tmp_path, timeout=380)
    from_config = {f"strategy={s} trainer.devices={d}": d for s in ("lp_ddp", "lp_dp") for d in (1, 2)}
    check_sweep(tmp_path, from_config, proc, root=tmp_path / "out" / "from_config")
    for name, n_jobs in (("from_config", 4), ("command_line", 2), ("schedules", 4)):
        root = tmp_path / "out" / name
        summaries = [json.loads((root / str(i) / "summary.json").read_text()) for i in range(n_jobs)]
        assert all(s["status"] == "completed" and s["world_size"] == s["devices"] for s in summaries)
        assert (root / "sweep_summary.svg").is_file()
    assert proc.stdout.count("| completed |") >= 10
    assert_no_survivors(tmp_path)


@pytest.mark.timeout(200)
def test_torchrun_example(tmp_path) -> None:
    _run(["bash", str(EXAMPLES / "torchrun" / "run.sh")], tmp_path)
    run_dir = tmp_path / "out" / "torchrun"
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "completed" and s["world_size"] == 2 and s["global_step"] == 20
    assert (run_dir / "train_rank1.log").exists()  # rank 1 logs apart from rank 0
    assert_no_survivors(tmp_path)


@pytest.mark.timeout(120)
def test_slurm_dry_run(tmp_path) -> None:
    proc = _run(
        [
            sys.executable,
            str(EXAMPLES / "slurm" / "dry_run.py"),
            "strategy=lp_ddp",
            "hydra.launcher.partition=gpu",
        ],
        tmp_path,
    )
    out = proc.stdout
    assert (
        "#SBATCH --nodes=2" in out
        and "#SBATCH --ntasks-per-node=4" in out
        and "#SBATCH --gpus-per-node=4" in out
    )
    assert "#SBATCH --partition=gpu" in out and "world size 8" in out
    assert not (tmp_path / "multirun").exists()  # nothing submitted, nothing run


@pytest.mark.timeout(200)
def test_lightning_cli_example(tmp_path) -> None:
    if importlib.util.find_spec("jsonargparse") is None:
        pytest.skip("LightningCLI needs jsonargparse (pip install 'jsonargparse[signatures]')")
    proc = _run(["bash", str(EXAMPLES / "lightning_cli" / "run.sh")], tmp_path)
    saved = (tmp_path / "out" / "lightning_cli" / "lightning_logs" / "version_0" / "config.yaml").read_text()
    assert "class_path: lightning_parallel.DDPStrategy" in saved and "bucket_cap_mb: 5" in saved, saved
    assert "zero_stage: 3" in saved, saved  # ZeRO-3 on a model we did not write, from the command line
    saved = (tmp_path / "out" / "lightning_cli" / "lightning_logs" / "version_1" / "config.yaml").read_text()
    assert "class_path: lightning_parallel.TensorParallelStrategy" in saved
    assert "tensor_parallel_size: 2" in saved, saved
    # the YAML config's class_path, from a script that never imports lightning_parallel
    script = (EXAMPLES / "lightning_cli" / "own_module.py").read_text().splitlines()
    assert not [
        line for line in script if line.startswith(("import lightning_parallel", "from lightning_parallel"))
    ]
    saved = sorted((tmp_path / "out" / "lightning_cli" / "lightning_logs").glob("version_*/config.yaml"))[-1]
    assert (
        "class_path: lightning_parallel.DDPStrategy" in saved.read_text()
        and "hidden: 16" in saved.read_text()
    )
    assert "world size 2, DDPStrategy, loss " in proc.stdout, proc.stdout[-2000:]
    assert_no_survivors(tmp_path)
