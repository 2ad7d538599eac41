"""Exact resume with real processes: a rank is SIGKILLed mid-run, the run resumes from ``last.ckpt``
with ``ckpt_path="last"``, and the following losses and the final parameters equal an uninterrupted
run's to 1e-10 (float64, 2 gloo processes, dropout + momentum + StepLR + shuffled data).

- lp_ddp: checkpoint every 2 steps, rank 1 killed after step 9: resumes mid-epoch (epoch 1, batch 2).
- lp_dp: checkpoint every 3 steps, rank 0 killed after step 7: resumes from an epoch-end checkpoint
  (step 6 = end of epoch 0), the case where Lightning's own loop gets the sampler epoch wrong.
- lp_ddp under Lightning's own launcher, the launcher (rank 0) SIGKILLed after step 11: resumes from
  step 8 with a fresh launch.
- lp_ddp + SIGTERM to rank 1 after step 5: both ranks save ``last.ckpt`` at step 5 and stop cleanly;
  the resumed run continues exactly.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.helpers.harness import free_port, max_param_diff, run_processes, worker_env

STEPS = 14  # 6 batches per epoch: crosses two epoch boundaries
CASES = {
    "lp_ddp": {"strategy": "lp_ddp", "every": 2, "kill": [9, 1, "SIGKILL"], "ckpt_step": 8},
    "lp_dp": {"strategy": "lp_dp", "every": 3, "kill": [7, 0, "SIGKILL"], "ckpt_step": 6},
    # SIGTERM to one rank after step 5, no periodic checkpoint: the preemption checkpoint is the only one
    "lp_ddp_sigterm": {"strategy": "lp_ddp", "every": 100, "kill": [5, 1, "SIGTERM"], "ckpt_step": 5},
    # the same with 2 micro-batches per step: SIGTERM lands after batch 9, the first micro-batch of step 5,
    # so the checkpoint waits for the optimizer step (the accumulated gradient is not in a checkpoint)
    "lp_ddp_sigterm_accumulate": {"strategy": "lp_ddp", "every": 100, "kill": [9, 1, "SIGTERM", "batch"], "ckpt_step": 5,
                                  "accumulate": 2},
    # Lightning's own launcher (one command; rank 1 is its child) SIGKILLed with its rank 0 after step 11
    "lp_ddp_launcher": {"strategy": "lp_ddp", "every": 4, "kill": [11, 0, "SIGKILL"], "ckpt_step": 8,
                        "lightning_launcher": True},
}


def base_name(case: dict) -> str:
    return f"{case['strategy']}-{case.get('accumulate', 1)}"


def launch(cases: list[dict], tmp_path, name: str, expect_failure: bool = False, lightning_launcher: bool = False) -> None:
    spec = tmp_path / f"{name}.json"
    spec.write_text(json.dumps({"cases": cases, "devices": 2}))
    cwd = tmp_path / name
    cwd.mkdir()
    port = free_port()
    cmd = [sys.executable, "-m", "tests.reliability.resume_worker", str(spec)]
    envs = [worker_env(r, 2, port) for r in range(2)]
    if lightning_launcher:  # one process group: killing it takes the orphaned child rank too
        env = {k: v for k, v in envs[0].items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK")}
        cmd, envs = [cmd], [env]
    else:
        cmd = [cmd] * 2
    try:
        run_processes(cmd, envs, timeout=150, cwd=cwd, grace=2.0)
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
    bases = sorted({base_name(c) for c in CASES.values()})
    launch([{"strategy": b.split("-")[0], "steps": STEPS, "every": 2, "accumulate": int(b.split("-")[1]),
             "dir": str(tmp / f"base_{b}")} for b in bases], tmp, "uninterrupted")
    for name, c in CASES.items():
        sigterm = c["kill"][2] == "SIGTERM"  # exits cleanly after saving; SIGKILL leaves a failed run
        launch([{"strategy": c["strategy"], "steps": STEPS, "every": c["every"], "kill": c["kill"],
                 "accumulate": c.get("accumulate", 1), "dir": str(tmp / f"kill_{name}")}], tmp, f"killed_{name}", expect_failure=not sigterm,
               lightning_launcher=c.get("lightning_launcher", False))
        if sigterm:
            stopped = load(tmp / f"kill_{name}")
            assert [r["global_step"] for r in stopped] == [c["ckpt_step"]] * 2, "SIGTERM must stop the run"
    # weights_only=True: what load_from_checkpoint uses; the resume state must not need pickled classes
    killed_at = {n: torch.load(tmp / f"kill_{n}" / "ckpt" / "last.ckpt", weights_only=True)["global_step"]
                 for n in CASES}
    resume = {n: {"strategy": c["strategy"], "steps": STEPS, "every": c["every"], "resume": True,
                  "accumulate": c.get("accumulate", 1), "dir": str(tmp / f"kill_{n}")} for n, c in CASES.items()}
    launch([r for n, r in resume.items() if not CASES[n].get("lightning_launcher")], tmp, "resumed")
    launch([r for n, r in resume.items() if CASES[n].get("lightning_launcher")], tmp, "resumed_launcher",
           lightning_launcher=True)
    return {n: (load(tmp / f"base_{base_name(c)}"), load(tmp / f"kill_{n}"), killed_at[n], tmp / f"kill_{n}" / "ckpt")
            for n, c in CASES.items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_kill_then_resume_is_exact(runs, case):
    base, resumed, last_step, ckpt_dir = runs[case]
    ckpt_step = CASES[case]["ckpt_step"]
    assert last_step == ckpt_step, "last.ckpt after the kill is the last periodic checkpoint"
    for rank in range(2):
        steps = sorted(resumed[rank]["losses"])
        # keys are global_step at each batch end: with accumulation the first micro-batch of step k+1 has k
        first = ckpt_step if CASES[case].get("accumulate", 1) > 1 else ckpt_step + 1
        assert steps == list(range(first, STEPS + 1)), f"rank {rank} resumed at the wrong step: {steps}"
        worst = max(abs(resumed[rank]["losses"][s] - base[rank]["losses"][s]) for s in steps)
        assert worst <= 1e-10, f"rank {rank}: losses after resume differ by {worst:.3e}"
        diff = max_param_diff(resumed[rank]["state_dict"], base[rank]["state_dict"])
        assert diff <= 1e-10, f"rank {rank}: final parameters differ by {diff:.3e}"
    moved = max(abs(resumed[0]["losses"][s] - resumed[0]["losses"][ckpt_step + 1]) for s in steps)
    assert moved > 1e-4, "the losses must change after the checkpoint, or the comparison proves nothing"
