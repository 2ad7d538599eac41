"""What ``lp-train --help`` lists: each config group's choices, one line each, read from ``conf/`` itself.

A choice's line is the first comment line of its YAML file, so that what a file does is written once, in
the file. The schemas (``*_schema``, Hydra ConfigStore entries that a YAML file extends) are not choices,
and neither are the plugin's ``lp/`` groups (the same files, for other Hydra apps). An alias (a file whose
only content is a defaults list naming one other choice of its group) is shown beside that choice.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import yaml

__all__ = ["GROUPS", "alias_of", "choices_text", "describe", "register_choices"]

# lp-train's groups, in the order a user needs them
GROUPS = ("strategy", "trainer", "model", "data", "plan", "experiment", "layout", "hydra/launcher")
_WIDTH = 100


def alias_of(path: Path) -> Optional[str]:
    """The choice that ``path`` only renames, or None."""
    body = yaml.safe_load(path.read_text()) or {}
    defaults = body.get("defaults") if isinstance(body, dict) else None
    if set(body) != {"defaults"} or not isinstance(defaults, list):
        return None
    named = [d for d in defaults if d != "_self_"]
    return named[0] if len(named) == 1 and isinstance(named[0], str) else None


def describe(path: Path) -> str:
    """The first sentence of the comment that opens ``path`` (a ``# @package`` line aside), on one line."""
    words = []
    for line in path.read_text().splitlines():
        text = line.strip()
        if not text.startswith("#"):
            break
        if not text.lstrip("# ").startswith("@package"):
            words.append(text.lstrip("# "))
    text = " ".join(words).removeprefix("lightning_parallel.")
    text = text.split(". ")[0].split(": lp-train")[0].rstrip(".:;")
    return text if len(text) <= _WIDTH else text[: _WIDTH - 1] + "\u2026"


def choices_text(conf_dir: Path) -> str:
    """Every group's choices, one line each: ``group=<name>   what it does  (also: <aliases>)``."""
    lines = []
    for group in GROUPS:
        files = sorted((conf_dir / group).glob("*.yaml"))
        aliases: dict[str, list[str]] = {}
        for path in files:
            target = alias_of(path)
            if target is not None:
                aliases.setdefault(target, []).append(path.stem)
        names = [p for p in files if alias_of(p) is None]
        width = max((len(p.stem) for p in names), default=0)
        lines.append(f"{group}=")
        for path in names:
            also = f"  (also: {', '.join(aliases[path.stem])})" if path.stem in aliases else ""
            lines.append(f"  {path.stem:<{width}}  {describe(path)}{also}")
    return "\n".join(lines)


def register_choices(conf_dir: Path) -> None:
    """Register ``${lp_choices:}`` (``conf/config.yaml``'s help template): ``choices_text(conf_dir)``."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("lp_choices", lambda: choices_text(conf_dir), replace=True)
