"""Each strategy's options are declared once, by its constructor: Hydra reaches every one at the same default,
the README names them, and ``strategy.save_distributed=true`` (no ``+``) writes a sharded checkpoint."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lightning_parallel import strategies
from lightning_parallel.registry import STRATEGY_NAMES
from lightning_parallel.strategies.base import ParallelStrategyBase
from lightning_parallel.strategies.options import defaults, options
from tests.cli.lp import QUICK, REPO, assert_no_survivors, explain, run, summary
from tests.cli.test_config import CONF, _compose, _problems

LP_CONFS = sorted(p.stem for p in (CONF / "strategy").glob("*.yaml") if "lightning_parallel" in p.read_text())


def _registry_name(conf: str) -> str:
    return conf if conf.startswith("lp_") else f"lp_{conf}"


def _strategy_class(conf: str) -> type:
    return getattr(strategies, STRATEGY_NAMES[_registry_name(conf)][0])


def test_every_lp_strategy_has_a_config() -> None:
    classes = {STRATEGY_NAMES[name][0] for name in STRATEGY_NAMES}
    assert {_strategy_class(conf).__name__ for conf in LP_CONFS} == classes
    assert {_registry_name(conf) for conf in LP_CONFS} <= set(STRATEGY_NAMES)


@pytest.mark.parametrize("conf", LP_CONFS)
def test_every_option_reaches_hydra_at_the_constructors_default(conf: str) -> None:
    """The composed config (schema + YAML) holds every constructor option, at the constructor's default or
    at the registered name's preset (``schedule`` of lp_pipeline_1f1b)."""
    cls = _strategy_class(conf)
    composed = OmegaConf.to_container(_compose(f"strategy={conf}").strategy, resolve=True)
    expected = {**defaults(cls), **STRATEGY_NAMES[_registry_name(conf)][1]}
    assert set(expected) <= set(composed), (
        f"not reachable from Hydra: {sorted(set(expected) - set(composed))}"
    )
    differ = {k: (composed[k], v) for k, v in expected.items() if composed[k] != v}
    assert not differ, f"strategy={conf}: (config, constructor) defaults differ: {differ}"
    assert composed["_target_"] == f"lightning_parallel.{cls.__name__}"


@pytest.mark.parametrize("conf", LP_CONFS)
def test_save_distributed_is_set_without_plus(conf: str) -> None:
    blocks = (
        ["model.n_layer=4"] if conf in ("pipeline_interleaved", "pipeline_zbv") else []
    )  # 2 ranks x 2 chunks
    found = _problems(f"strategy={conf}", "strategy.save_distributed=true", *blocks)
    if _strategy_class(conf).supports_save_distributed:
        assert found == []
    else:
        assert any("strategy.save_distributed=True is not supported" in p for p in found), found


def _readme_row(class_name: str) -> str:
    rows = [line for line in (REPO / "README.md").read_text().splitlines() if f"| `{class_name}` |" in line]
    assert rows, f"README's strategy table has no row for {class_name}"
    return " ".join(rows)


@pytest.mark.parametrize(
    "cls", sorted({_strategy_class(c) for c in LP_CONFS}, key=lambda c: c.__name__), ids=lambda c: c.__name__
)
def test_readme_table_names_each_option_at_its_default(cls: type) -> None:
    """A strategy's own options are in its row of the table; the shared ones in the sentence below it."""
    readme = (REPO / "README.md").read_text()
    shared = readme[readme.index("Every strategy also takes") :].split("\n\n")[0]
    for option in options(cls):
        text = shared if option.owner is ParallelStrategyBase else _readme_row(cls.__name__)
        assert f"`{option.name}`" in text, f"README does not name {cls.__name__}'s option {option.name}"
        written = re.search(rf"`{option.name}` \((-?[\d.]+)", text)
        if written:
            assert float(written.group(1)) == option.default, f"README: {option.name} ({written.group(1)})"


@pytest.mark.timeout(200)
def test_lp_train_save_distributed_writes_a_sharded_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run(
        [
            "strategy=lp_ddp",
            "strategy.save_distributed=true",
            *QUICK,
            "trainer.max_steps=2",
            "trainer.val_check_interval=2",
            "data.max_chars=20000",
            f"hydra.run.dir={run_dir}",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, explain(proc)
    checkpoint = Path(summary(run_dir)["checkpoint"])
    assert checkpoint.is_dir() and list(checkpoint.iterdir()), checkpoint
    assert_no_survivors(tmp_path)
