"""Exact resume with real processes: a rank is SIGKILLed mid-run, the run resumes from ``last.ckpt``
with ``ckpt_path="last"``, and the following losses and the final parameters equal an uninterrupted
run's to 1e-10 (float64, 2 gloo processes, dropout + momentum + StepLR + shuffled data).

- lp_ddp: checkpoint every 2 steps, rank 1 killed after step 9: resumes mid-epoch (epoch 1, batch 2).
- lp_dp: checkpoint every 3 steps, rank 0 killed after step 7: resumes from an epoch-end checkpoint
  (step 6 = end of epoch 0), the case where Lightning's own loop gets the sampler epoch wrong.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.helpers.harness import free_port, max_param_diff, run_processes, worker_env

STEPS = 14  # 6 batches per epoch: crosses two epoch boundaries
CASES = {"lp_ddp": {"every": 2, "kill": [9, 1, "SIGKILL"], "ckpt_step": 8},
         "lp_dp": {"every": 3, "kill": [7, 0, "SIGKILL"], "ckpt_step": 6}}


def launch(cases: list[dict], tmp_path, name: str, expect_failure: bool = False) -> None:
    spec = tmp_path / f"{name}.json"
    spec.write_text(json.dumps({"cases": cases}))
    cwd = tmp_path / name
    cwd.mkdir()
    port = free_port()
    cmd = [sys.executable, "-m", "tests.reliability.resume_worker", str(spec)]
    try:
        run_processes([cmd] * 2, [worker_env(r, 2, port) for r in range(2)], timeout=150, cwd=cwd, grace=2.0)
    except RuntimeError:
        if not expect_failure:
            raise
        return
    assert not expect_failure, f"{name}: the run was supposed to be killed"


def load(path) -> list[dict]:
    return [torch.load(path / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    base = [{"strategy": s, "steps": STEPS, "every": c["every"], "dir": str(tmp / f"base_{s}")} for s, c in CASES.items()]
    launch(base, tmp, "uninterrupted")
    for s, c in CASES.items():
        launch([{"strategy": s, "steps": STEPS, "every": c["every"], "kill": c["kill"], "dir": str(tmp / f"kill_{s}")}],
               tmp, f"killed_{s}", expect_failure=True)
    killed_at = {s: torch.load(tmp / f"kill_{s}" / "ckpt" / "last.ckpt", weights_only=False)["global_step"] for s in CASES}
    resumed = [{"strategy": s, "steps": STEPS, "every": c["every"], "resume": True, "dir": str(tmp / f"kill_{s}")}
               for s, c in CASES.items()]
    launch(resumed, tmp, "resumed")
    return {s: (load(tmp / f"base_{s}"), load(tmp / f"kill_{s}"), killed_at[s], tmp / f"kill_{s}" / "ckpt") for s in CASES}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", list(CASES))
def test_sigkill_then_resume_is_exact(runs, strategy):
    base, resumed, last_step, ckpt_dir = runs[strategy]
    ckpt_step = CASES[strategy]["ckpt_step"]
    assert last_step == ckpt_step, "last.ckpt after the kill is the last periodic checkpoint"
    for rank in range(2):
        steps = sorted(resumed[rank]["losses"])
        assert steps == list(range(ckpt_step + 1, STEPS + 1)), f"rank {rank} resumed at the wrong step: {steps}"
        worst = max(abs(resumed[rank]["losses"][s] - base[rank]["losses"][s]) for s in steps)
        assert worst <= 1e-10, f"rank {rank}: losses after resume differ by {worst:.3e}"
        diff = max_param_diff(resumed[rank]["state_dict"], base[rank]["state_dict"])
        assert diff <= 1e-10, f"rank {rank}: final parameters differ by {diff:.3e}"
    ckpt = torch.load(ckpt_dir / f"epoch={(ckpt_step - 1) // 6}-step={ckpt_step}.ckpt", weights_only=False)
    moved = max_param_diff(ckpt["state_dict"], base[0]["state_dict"])
    assert moved > 1e-4, "parameters must move after the checkpoint, or the comparison proves nothing"
