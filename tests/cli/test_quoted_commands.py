"""Every ``lp-train`` command quoted in the README, docs/ and conf/ composes, and passes the checks made before
launch (placeholders such as ``my_pkg.MyModule`` and a GPU trainer without CUDA aside). A sweep's values are
tried one at a time."""

from __future__ import annotations

import re
import shlex

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser

from lightning_parallel.config import problems, register_configs
from tests.cli.lp import REPO

SOURCES = [
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    *sorted((REPO / "conf").rglob("*.yaml")),
]
# a command runs up to the end of its line, a comment, a code span's end or a table cell's end
COMMAND = re.compile(r"\blp-train((?:[ \t]+[^\s`#|]+)*)")
OVERRIDE = re.compile(r"[+~]{0,2}[\w./@-]+=")
FLAGS = {"-m", "--multirun", "--help", "--cfg", "job", "hydra", "--resolve"}
PLACEHOLDERS = ("my_pkg.", "no CUDA device is visible")


def quoted_commands() -> list[tuple[str, tuple[str, ...]]]:
    found = {}
    for path in SOURCES:
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            for match in COMMAND.finditer(line):
                text, following = match.group(1), number
                while text.endswith("\\") and following < len(lines):  # continued on the next line
                    text, following = text[:-1] + " " + lines[following].split("#")[0], following + 1
                if (
                    "<" in text or text.count("'") % 2
                ):  # a pattern (<overrides>) or prose (lp-train's), not a command
                    continue
                args = []
                for arg in shlex.split(text):  # overrides and flags, up to the first word of prose or "..."
                    if arg not in FLAGS and not OVERRIDE.match(arg):
                        break
                    args.append(arg)
                found.setdefault(tuple(a for a in args if a not in FLAGS), []).append(
                    f"{path.relative_to(REPO)}:{number}"
                )
    return [(" ".join(wheres), args) for args, wheres in found.items()]


def one_value_each(args: tuple[str, ...]) -> list[list[str]]:
    """The command with each sweep (``a=x,y``) at one of its values, the others at their first."""
    overrides = OverridesParser.create().parse_overrides(list(args))

    def line(override, value=None) -> str:
        if value is None and override.is_sweep_override():
            value = next(iter(override.sweep_string_iterator()))
        return override.input_line if value is None else f"{override.get_key_element()}={value}"

    variants = [[line(o) for o in overrides]]
    for i, override in enumerate(overrides):
        if override.is_sweep_override():
            for value in list(override.sweep_string_iterator())[1:]:
                variants.append([line(o, value if j == i else None) for j, o in enumerate(overrides)])
    return variants


COMMANDS = quoted_commands()


def test_the_quoted_commands_were_found() -> None:
    wheres = {where.split(":")[0] for found, _ in COMMANDS for where in found.split()}
    assert {"README.md", "docs/lp_train.md", "conf/experiment/quick.yaml", "conf/config.yaml"} <= wheres, (
        wheres
    )
    assert ("experiment=quick",) in {args for _, args in COMMANDS}, COMMANDS


@pytest.mark.parametrize("where, args", COMMANDS, ids=[f"{w.split()[0]} {' '.join(a)}" for w, a in COMMANDS])
def test_a_quoted_command_composes_and_passes_the_checks(where: str, args: tuple[str, ...]) -> None:
    register_configs()
    for overrides in one_value_each(args):
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
        found = [p for p in problems(cfg) if not any(word in p for word in PLACEHOLDERS)]
        assert not found, f"{where}: lp-train {' '.join(overrides)}: {found}"
