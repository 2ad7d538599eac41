"""The test ranks forked by ``tests/helpers/forkserver.py`` are the processes users run.

The same 4-rank program runs on fresh interpreters and on ranks started by ``forked_commands``, with an
environment that asks for what a fresh interpreter reads at start: ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, two
threads, a temporary directory, and on rank 3 a fixed hash seed. Every observable must agree: the values
that follow from the environment, and which ranks share a random draw (fresh interpreters share none).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.helpers.harness import forked_commands, run_processes, worker_env

WORLD = 4
SEEDED_RANK = 3  # asks for PYTHONHASHSEED, which no fork can honour: it starts as a fresh interpreter
DRAWS = ("numpy", "random", "torch_seed", "torch", "hash")  # compared by which ranks share a value


def ranks_observed(tmp_path: Path, forked: bool) -> list[dict]:
    out = tmp_path / ("forked" if forked else "fresh")
    out.mkdir()
    temp = tmp_path / "temp"
    temp.mkdir(exist_ok=True)
    envs = [
        {
            **worker_env(r, WORLD),
            "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
            "OMP_NUM_THREADS": "2",
            "TMPDIR": str(temp),
        }
        for r in range(WORLD)
    ]
    envs[SEEDED_RANK]["PYTHONHASHSEED"] = "7"
    command = [sys.executable, "-m", "tests.helpers.rank_state_probe", str(out)]
    commands = forked_commands(command, WORLD) if forked else [command] * WORLD
    run_processes(commands, envs, timeout=180, cwd=out, rendezvous=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def sharing(values: list) -> list[int]:
    """Which ranks drew the same value: each rank's first rank with its value."""
    return [values.index(v) for v in values]


def summary(ranks: list[dict]) -> dict:
    """What must agree between fresh and forked ranks: every value the environment determines, and the
    pattern of the random ones."""
    fixed = [{k: v for k, v in seen.items() if k not in (*DRAWS, "parent")} for seen in ranks]
    return {
        "per_rank": fixed,
        "shared_draws": {k: sharing([seen[k] for seen in ranks]) for k in DRAWS},
        "seeded_hash": ranks[SEEDED_RANK]["hash"],
    }


@pytest.mark.slow
def test_forked_ranks_observe_what_fresh_interpreters_do(tmp_path):
    fresh, forked = ranks_observed(tmp_path, forked=False), ranks_observed(tmp_path, forked=True)
    expected = summary(fresh)
    assert [seen["rank_zero_only"] for seen in fresh] == list(range(WORLD))
    assert {seen["debug_level"] for seen in fresh} == {"DebugLevel.DETAIL"}
    assert expected["shared_draws"]["numpy"] == list(range(WORLD))
    assert summary(forked) == expected
    parents = [seen["parent"] for seen in forked]
    assert [p == os.getpid() for p in parents] == [r == SEEDED_RANK for r in range(WORLD)], (
        f"ranks other than {SEEDED_RANK} should be forked by a server (parent pids {parents}, test {os.getpid()})"
    )
