"""The Hydra plugin (``hydra_plugins/lightning_parallel_configs``): lightning_parallel's strategy and plan
configs as the groups ``lp/strategy`` and ``lp/plan`` of another app's config tree, here the test project's
(``tests/projects/bn_classifier/configs``), with the schemas' checks, read from the same files as lp-train."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException, InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf

import lightning_parallel
from lightning_parallel.config import register_configs
from lightning_parallel.config.schema import PipelineParallelStrategyConf
from tests.cli.lp import REPO, env
from tests.projects.test_bn_classifier import PROJECT

CONF = REPO / "conf"
APP_CONF = PROJECT / "configs"
# every name of Trainer(strategy=...), and the former names of some (aliases: the same configs)
ALIASES = [
    p.stem
    for p in (CONF / "strategy").glob("*.yaml")
    if p.stem not in lightning_parallel.STRATEGY_NAMES and p.stem not in ("ddp", "auto")
]
OFFERED = sorted([*lightning_parallel.STRATEGY_NAMES, *ALIASES])
CLASSES = {
    name: getattr(
        lightning_parallel,
        lightning_parallel.STRATEGY_NAMES[name if name.startswith("lp_") else f"lp_{name}"][0],
    )
    for name in OFFERED
}


def _app(*overrides: str):
    """The test project's config, composed with ``overrides``."""
    with initialize_config_dir(config_dir=str(APP_CONF), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def _lp_train(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_plugin_is_discovered_without_importing_torch_or_the_package() -> None:
    """Hydra imports every plugin module when any app starts: this one must stay light."""
    code = (
        "import json, sys\n"
        "from hydra.core.plugins import Plugins\n"
        "from hydra.plugins.search_path_plugin import SearchPathPlugin\n"
        "names = [c.__name__ for c in Plugins.instance().discover(SearchPathPlugin)]\n"
        "print(json.dumps([names, 'torch' in sys.modules, 'lightning_parallel' in sys.modules]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd="/", env=env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    names, torch_imported, package_imported = json.loads(proc.stdout.splitlines()[-1])
    assert "LightningParallelSearchPath" in names
    assert not torch_imported and not package_imported


@pytest.mark.timeout(120)
def test_the_readme_install_shows_the_plugin_to_hydra_without_the_checkout_on_the_path() -> None:
    """After the README's own install command (which CI runs), an app anywhere finds the ``lp/`` groups:
    setuptools' default editable install would hide the plugin's namespace package (Hydra #2359)."""
    code = (
        "from hydra.core.plugins import Plugins\n"
        "from hydra.plugins.search_path_plugin import SearchPathPlugin\n"
        "print([c.__name__ for c in Plugins.instance().discover(SearchPathPlugin)])\n"
    )
    clean = {k: v for k, v in env().items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd="/", env=clean, capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == 0, proc.stderr
    assert "LightningParallelSearchPath" in proc.stdout, (
        "Hydra does not see the plugin: install with the README's command (editable_mode=compat)"
    )


def test_groups_offer_the_package_files() -> None:
    with initialize_config_dir(config_dir=str(APP_CONF), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        strategies = loader.get_group_options("lp/strategy")
        plans = loader.get_group_options("lp/plan")
    # Lightning's own ddp.yaml is lp-train's, for comparison, and auto.yaml (the planner's choice, made by
    # lp-train before launching); the schemas are not options
    assert strategies == OFFERED
    assert sorted(p.stem for p in (CONF / "strategy").glob("*.yaml")) == sorted([*OFFERED, "ddp", "auto"])
    assert plans == sorted(p.stem for p in (CONF / "plan").glob("*.yaml"))


@pytest.mark.parametrize("name", OFFERED)
def test_each_strategy_composes_and_instantiates_like_in_lp_train(name: str) -> None:
    node = _app(f"+lp/strategy@trainer.strategy={name}").trainer.strategy
    # the same file and schema as lp-train's strategy group
    assert OmegaConf.to_container(node) == OmegaConf.to_container(_lp_train(f"strategy={name}").strategy)
    assert OmegaConf.get_type(node).__name__ == f"{CLASSES[name].__name__}Conf"
    assert type(instantiate(node)) is CLASSES[name]


def test_overrides_and_their_checks() -> None:
    node = _app(
        "+lp/strategy@trainer.strategy=pipeline_1f1b", "trainer.strategy.num_microbatches=8"
    ).trainer.strategy
    assert OmegaConf.get_type(node) is PipelineParallelStrategyConf
    strategy = instantiate(node)
    assert strategy.schedule == "1f1b" and strategy.num_microbatches == 8
    # the schema, while composing
    with pytest.raises(ConfigCompositionException, match="bucket_cap"):
        _app("+lp/strategy@trainer.strategy=lp_ddp", "trainer.strategy.bucket_cap=5")
    with pytest.raises(ConfigCompositionException, match="num_microbatches"):
        _app("+lp/strategy@trainer.strategy=pipeline_gpipe", "trainer.strategy.num_microbatches=abc")
    # the constructor's own checks, before the Trainer starts any process
    node = _app("+lp/strategy@trainer.strategy=pipeline_gpipe", "trainer.strategy.num_microbatches=0")
    with pytest.raises(InstantiationException, match="num_microbatches"):
        instantiate(node.trainer.strategy)
    # not offered: Lightning's ddp (lp-train's comparison config)
    with pytest.raises(ConfigCompositionException, match="lp/strategy"):
        _app("+lp/strategy@trainer.strategy=ddp")


def test_plan_from_the_plan_group() -> None:
    mlp = OmegaConf.load(CONF / "plan" / "mlp.yaml")
    cfg = _app("+lp/strategy@trainer.strategy=tensor_parallel")
    assert cfg.trainer.strategy.plan == "auto"  # none chosen
    cfg = _app("+lp/strategy@trainer.strategy=tensor_parallel", "+lp/plan@trainer.strategy.plan=mlp")
    assert OmegaConf.to_container(cfg.trainer.strategy.plan) == OmegaConf.to_container(mlp)
    assert instantiate(cfg.trainer.strategy, _convert_="all").plan == OmegaConf.to_container(mlp)
    # lp-train reads its plan group from the same files, through the same default
    assert _lp_train("strategy=tensor_parallel").strategy.plan == "auto"
    cfg = _lp_train("strategy=tensor_parallel", "plan=mlp")
    assert OmegaConf.to_container(cfg.strategy.plan, resolve=True) == OmegaConf.to_container(mlp)


def test_conf_on_the_search_path_finds_its_schemas(monkeypatch) -> None:
    """conf/ itself on an app's search path: the strategy group's YAML names ``strategy/<x>_schema``,
    which only lp-train stores; the plugin serves it where the app's ConfigStore has no such name."""
    monkeypatch.delitem(ConfigStore.instance().repo, "strategy", raising=False)  # not lp-train
    cfg = _app(
        "hydra.searchpath=[pkg://lightning_parallel.conf]",
        "+strategy@trainer.strategy=pipeline_1f1b",
        "trainer.strategy.num_microbatches=8",
    )
    assert OmegaConf.get_type(cfg.trainer.strategy) is PipelineParallelStrategyConf
    assert cfg.trainer.strategy.num_microbatches == 8
