"""``lp-train --help``: the names users type, one line each on what they do; no schema entry, no ``lp/``
group (the plugin's copy of the same files for other apps), aliases beside the name they stand for."""

from __future__ import annotations

import itertools
import re

import pytest

from lightning_parallel.cli.choices import choices_text
from lightning_parallel.registry import STRATEGY_NAMES
from tests.cli.lp import REPO, explain, run


def _choices(text: str, group: str) -> dict[str, str]:
    """``name -> line`` of one group's section of the help text."""
    body = text.split(f"\n{group}=\n", 1)[1].splitlines()
    return {line.split()[0]: line for line in itertools.takewhile(lambda line: line.startswith("  "), body)}


def test_the_choices_are_the_names_users_type() -> None:
    text = "\n" + choices_text(REPO / "conf")
    strategies = _choices(text, "strategy")
    assert set(strategies) == {*STRATEGY_NAMES, "ddp", "auto"}, strategies
    assert "The layout planner chooses lp_parallel's layout" in strategies["auto"]
    assert "TensorParallelStrategy: layers split" in strategies["lp_tensor_parallel"]
    assert "(also: tensor_parallel)" in strategies["lp_tensor_parallel"]
    assert "A few steps with a tiny model" in _choices(text, "experiment")["quick"]
    assert set(_choices(text, "trainer")) == {"cpu", "gpu", "multinode"}
    assert "_schema" not in text and "lp/" not in text


@pytest.mark.timeout(120)
def test_help_lists_them(tmp_path) -> None:
    proc = run(["--help"], tmp_path)
    assert proc.returncode == 0, explain(proc)
    out = proc.stdout
    assert "\nstrategy=\n" in out and re.search(
        r"\n  lp_pipeline_1f1b +PipelineParallelStrategy, schedule 1F1B", out
    )
    assert "_schema" not in out and "lp/strategy" not in out, out[:3000]
    assert "== Config" in out and "bucket_cap_mb: 25.0" in out  # the composed config, as Hydra prints it
    assert not list(tmp_path.iterdir()), "--help wrote files"
