"""After fit, test and a second fit in one script, the launching process holds no more than under
Lightning's ddp: the same environment variables added (the launch's MASTER_PORT, LOCAL_RANK, ..., which send
a later Trainer to the same children; none of the TORCHELASTIC_* ones the hosted store sets while a run is in
progress) and none changed, and only a watcher thread that ends with the children (or at once on
``stop()``)."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.harness import REPO

SCRIPT = r"""
import json, os, sys, threading
import torch
torch.set_num_threads(1)
import lightning.pytorch as pl
import lightning_parallel  # noqa: F401  (registers lp_ddp)
from lightning.pytorch.demos.boring_classes import BoringModel

launching = "LOCAL_RANK" not in os.environ
before = dict(os.environ)
report = []

def look(tag):
    threads = [t for t in threading.enumerate() if t is not threading.main_thread()]
    report.append({"tag": tag, "added": sorted(os.environ.keys() - before.keys()),
                   "changed": sorted(k for k in before if os.environ.get(k) != before[k]),
                   "threads": [t.name for t in threads]})
    return threads

def trainer():
    return pl.Trainer(accelerator="cpu", devices=2, strategy=sys.argv[1], max_steps=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=1, limit_test_batches=1, num_sanity_val_steps=0)

t = trainer()
t.fit(BoringModel())
look("fit")
t.test(BoringModel(), verbose=False)
look("test")
trainer().fit(BoringModel())
threads = look("second fit")
if launching:
    for thread in threads:  # what a test suite's thread check does with a daemon thread that has stop()
        if callable(getattr(thread, "stop", None)):
            thread.stop()
    report.append({"tag": "stopped", "alive": [t.name for t in threads if t.is_alive()]})
    print("REPORT " + json.dumps(report), flush=True)
"""


def _run(strategy: str, tmp_path) -> list[dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for key in ("LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR", "NODE_RANK", "WORLD_SIZE", "RANK"):
        env.pop(key, None)
    done = subprocess.run(
        [sys.executable, str(script), strategy],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("REPORT "))
    return json.loads(line[len("REPORT ") :])


@pytest.mark.timeout(300)
def test_the_launching_process_holds_no_more_than_under_ddp(tmp_path):
    ours, theirs = _run("lp_ddp", tmp_path / "lp"), _run("ddp", tmp_path / "ddp")
    for mine, lightning in zip(ours[:3], theirs[:3]):
        assert mine["tag"] == lightning["tag"]
        assert mine["added"] == lightning["added"], (mine, lightning)  # TORCHELASTIC_* included
        assert mine["changed"] == lightning["changed"] == []
        assert len(mine["threads"]) <= len(lightning["threads"]), (mine, lightning)
    assert ours[3] == {"tag": "stopped", "alive": []}
