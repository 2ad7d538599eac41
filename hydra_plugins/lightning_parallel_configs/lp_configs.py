"""lightning_parallel's ``conf/strategy`` and ``conf/plan`` as the config groups ``lp/strategy`` and
``lp/plan`` of any Hydra app, once the package is installed.

    python train.py +lp/strategy@trainer.strategy=lp_pipeline_1f1b trainer.strategy.num_microbatches=8
    python train.py +lp/strategy@trainer.strategy=lp_tensor_parallel +lp/plan@trainer.strategy.plan=mlp

Hydra finds ``LightningParallelSearchPath`` by scanning the ``hydra_plugins`` namespace package; it adds
``LightningParallelConfigs``, a config source that serves the same YAML files ``lp-train`` composes as its
``strategy`` and ``plan`` groups, under ``lp/``, so they never collide with an app's own groups. A YAML
file names its schema relative to its group (``- pipeline_schema``); here that is
``lp/strategy/pipeline_schema``, served from the same schema classes ``lp-train`` registers as
``strategy/pipeline_schema`` (``lightning_parallel.config.store.SCHEMAS``): unknown keys and wrong types
fail while composing, and the strategy's constructor checks its values.

Hydra imports every plugin module whenever any Hydra app starts, so this one imports neither torch nor
lightning_parallel until a config of the ``lp/`` groups is composed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.config_store import ConfigStore
from hydra.core.object_type import ObjectType
from hydra.plugins.config_source import ConfigLoadError, ConfigResult, ConfigSource
from hydra.plugins.search_path_plugin import SearchPathPlugin
from omegaconf import OmegaConf

__all__ = ["LightningParallelConfigs", "LightningParallelSearchPath", "PREFIX", "GROUPS", "NOT_OFFERED"]

SCHEME = "lightning-parallel"
PREFIX = "lp"
# the groups of lightning_parallel's conf/ that an app may compose
GROUPS = ("strategy", "plan")
# Lightning's own ddp, which lp-train offers for comparison: not lightning_parallel's to ship; auto, the
# layout planner's choice, which lp-train makes before launching (cli/auto_strategy.py)
NOT_OFFERED = ("strategy/ddp", "strategy/auto")
_SCHEMA_SUFFIX = "_schema"


def _conf_dir() -> Optional[Path]:
    """lightning_parallel's conf/ folder, found without importing the package (no torch at Hydra start-up)."""
    spec = importlib.util.find_spec("lightning_parallel")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "conf"


def _schema(group: str, name: str) -> Optional[Any]:
    """The schema class ``lp-train`` registers as ``<group>/<name>``, or None (imports lightning_parallel)."""
    from lightning_parallel.config.store import SCHEMAS

    return SCHEMAS.get((group, name))


class LightningParallelConfigs(ConfigSource):
    """``lp/<group>/<name>`` -> lightning_parallel's ``conf/<group>/<name>.yaml`` (or the schema class
    for a ``*_schema`` name, see ``_schema_at``), for the groups in ``GROUPS``."""

    def __init__(self, provider: str, path: str) -> None:
        super().__init__(provider=provider, path=path)
        self.conf = _conf_dir()

    @staticmethod
    def scheme() -> str:
        return SCHEME

    def _inner(self, config_path: str) -> Optional[str]:
        """The path inside conf/ (``strategy/lp_ddp``; "" for ``lp`` itself), or None if not ours."""
        parts = [p for p in config_path.strip("/").split("/") if p]
        if not parts or parts[0] != PREFIX or (len(parts) > 1 and parts[1] not in GROUPS):
            return None
        inner = "/".join(parts[1:])
        return None if inner.removesuffix(".yaml") in NOT_OFFERED else inner

    def available(self) -> bool:
        return self.conf is not None and self.conf.is_dir()

    def is_group(self, config_path: str) -> bool:
        if config_path.strip("/") == "":
            return True
        inner = self._inner(config_path)
        return inner is not None and (inner == "" or inner in GROUPS) and self.available()

    def _schema_at(self, config_path: str) -> Optional[Any]:
        """The schema class that a strategy YAML names in its defaults list, relative to its group:
        ``lp/strategy/<x>_schema`` here, or ``strategy/<x>_schema`` where an app put conf/ itself on its
        search path (``hydra.searchpath=[pkg://lightning_parallel.conf]``) and its own ConfigStore has
        no such name."""
        parts = [p for p in config_path.removesuffix(".yaml").strip("/").split("/") if p]
        if parts[:1] == [PREFIX]:
            parts = parts[1:]
        elif ConfigStore.instance().get_type("/".join(parts)) is not ObjectType.NOT_FOUND:
            return None
        if len(parts) != 2 or parts[0] not in GROUPS or not parts[1].endswith(_SCHEMA_SUFFIX):
            return None
        return _schema(parts[0], parts[1])

    def _file(self, config_path: str) -> Optional[Path]:
        inner = self._inner(config_path)
        if inner is None or "/" not in inner or not self.available():
            return None
        file = self.conf / self._normalize_file_name(inner)
        return file if file.is_file() else None

    def is_config(self, config_path: str) -> bool:
        return self._file(config_path) is not None or (
            self.available() and self._schema_at(config_path) is not None
        )

    def load_config(self, config_path: str) -> ConfigResult:
        file = self._file(config_path)
        if file is not None:
            text = file.read_text(encoding="utf-8")
            config, header = OmegaConf.create(text), self._get_header_dict(text)
        else:
            schema = self._schema_at(config_path) if self.available() else None
            if schema is None:
                raise ConfigLoadError(f"Config not found: {config_path}")
            config, header = OmegaConf.structured(schema), {"package": None}
        return ConfigResult(
            config=config, path=f"{SCHEME}://{self.path}", provider=self.provider, header=header
        )

    def list(self, config_path: str, results_filter: Optional[ObjectType]) -> List[str]:
        """Groups and YAML configs; the schemas, which a YAML file names in its defaults, are not options."""
        if config_path.strip("/") == "":
            return [PREFIX] if results_filter in (None, ObjectType.GROUP) and self.available() else []
        inner = self._inner(config_path)
        if inner is None or not self.available():
            return []
        if inner == "":
            return sorted(GROUPS) if results_filter in (None, ObjectType.GROUP) else []
        if inner not in GROUPS or results_filter == ObjectType.GROUP:
            return []
        names = (f.stem for f in (self.conf / inner).glob("*.yaml"))
        return sorted(n for n in names if f"{inner}/{n}" not in NOT_OFFERED)


class LightningParallelSearchPath(SearchPathPlugin):
    """Adds lightning_parallel's configs (``LightningParallelConfigs``) to every Hydra app's search path."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="lightning-parallel", path=f"{SCHEME}://")
