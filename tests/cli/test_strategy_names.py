"""Every way to name a strategy, and to misspell one, in a fresh process: a registered name
(``strategy="lp_ddp"``) exists only after ``import lightning_parallel``; ``_target_`` (Hydra) and
``class_path`` (LightningCLI, run by tests/test_examples.py) import the class themselves, and so does the
Hydra plugin's ``lp/strategy`` group (tests/cli/test_hydra_plugin.py, tests/projects/)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.cli.lp import env

SCRIPT = """
import json, sys
from lightning.pytorch import Trainer
from hydra.utils import instantiate

def trainer(strategy):
    try:
        t = Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False)
        return type(t.strategy).__module__ + "." + type(t.strategy).__name__
    except Exception as err:
        return f"{type(err).__name__}: {err}"

out = {"name before import": trainer("lp_ddp")}
target = instantiate({"_target_": "lightning_parallel.PipelineParallelStrategy", "num_microbatches": 8})
out["_target_"] = [type(target).__name__, target.num_microbatches]
out["registered by _target_"] = trainer("lp_pipeline_1f1b")  # instantiating imported the package
import lightning_parallel
out["name after import"] = trainer("lp_ddp")
out["misspelt"] = trainer("lp_tensorparallel")
out["unknown"] = trainer("dpp")
print(json.dumps(out))
"""


def test_every_way_to_name_a_strategy() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd="/", env=env(), capture_output=True, text=True, timeout=200
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["name before import"].startswith("ValueError") and "lp_ddp" in out["name before import"], out
    assert out["_target_"] == ["PipelineParallelStrategy", 8], out
    assert out["registered by _target_"].endswith("PipelineParallelStrategy"), out
    assert out["name after import"] == "lightning_parallel.strategies.ddp.DDPStrategy", out
    # a misspelt name: Lightning's error, then which of ours was meant and all of them
    assert out["misspelt"].startswith("ValueError: You selected an invalid strategy name"), out
    assert (
        "Did you mean 'lp_tensor_parallel'? lightning_parallel's strategies: lp_ddp, " in out["misspelt"]
    ), out
    assert "Did you mean" not in out["unknown"] and "lp_pipeline_1f1b" in out["unknown"], out
