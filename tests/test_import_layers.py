"""The package's import structure: no import circle between modules, and every import between parts of the
package runs from a higher layer to a lower one, in the order ARCHITECTURE.md ("Import layers") names.

The imports are read from the source with ``ast``, those inside functions included: an import moved into a
function to dodge a circle still counts. ``from package import name`` is an import of the submodule
``package.name`` when there is one, else of the package's ``__init__``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Iterator

PACKAGE = "lightning_parallel"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# Lowest first. A part is a subpackage or a module (``__init__``: the package's own public API file). A
# part may import the parts of lower layers, never those of its own layer or of a higher one.
LAYERS: list[tuple[str, ...]] = [
    ("compat", "recompute_state", "every_rank"),
    (
        "step_effects",
        "module_names",
        "kv_cache",
        "parameter_set",
        "memory",
        "materialize",
        "models",
        "data",
        "block_compile",
        "quiet_trainer",
    ),
    ("distributed",),
    ("checkpointing", "processes", "step_traffic"),
    ("moe",),
    ("tensor", "pipeline"),
    ("recompute",),
    ("strategies",),
    ("registry",),
    ("__init__",),
    ("config",),
    ("planner",),
    ("cli",),
]

# Imports that break the layers today, each owned by a change still to land. Delete an entry when its
# change lands: the test then holds the layers for it too.
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(node: ast.AST, module: str, is_package: bool, known: dict[str, Path]) -> Iterator[str]:
    """The package modules one import statement imports."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            here = module.split(".") if is_package else module.split(".")[:-1]
            base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
        subs = [f"{base}.{alias.name}" for alias in node.names]
        names = [s for s in subs if s in known] or [base]
        if len(names) < len(subs):  # some names are attributes of the package itself
            names.append(base)
    else:
        return
    for name in names:
        while name and name not in known:  # ``import a.b.c`` of a name inside a module
            name = name.rpartition(".")[0]
        if name.startswith(PACKAGE) and name != module:
            yield name


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (at module level or inside a function)."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        graph[module] = {t for node in ast.walk(tree) for t in _imported(node, module, is_package, known)}
    return graph


def part_of(module: str) -> str:
    """The part of ``LAYERS`` that holds ``module``."""
    if module == PACKAGE:
        return "__init__"
    return module.split(".")[1]


def layer_of(part: str) -> int:
    for level, parts in enumerate(LAYERS):
        if part in parts:
            return level
    raise KeyError(part)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a part to a part of the same layer or a higher one."""
    wrong = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            a, b = part_of(module), part_of(target)
            if a != b and layer_of(a) <= layer_of(b) and (module, target) not in KNOWN_EXCEPTIONS:
                wrong.append(
                    f"{module} (layer {layer_of(a)}: {a}) imports {target} (layer {layer_of(b)}: {b})"
                )
    return wrong


def test_every_part_of_the_package_has_a_layer():
    parts = {part_of(m) for m in modules()}
    listed = [p for layer in LAYERS for p in layer]
    assert len(listed) == len(set(listed)), "a part is named in two layers"
    assert parts == set(listed), (
        f"not in LAYERS: {sorted(parts - set(listed))}; gone: {sorted(set(listed) - parts)}"
    )


def test_no_import_circle():
    assert circles(import_graph()) == []


def test_imports_run_down_the_layers():
    assert upward_imports(import_graph()) == []


def test_known_exceptions_are_still_there():
    """An exception whose import is gone is deleted from the list, so it cannot hide a new one."""
    graph = import_graph()
    gone = [pair for pair in KNOWN_EXCEPTIONS if pair[1] not in graph.get(pair[0], set())]
    assert gone == [], f"delete from KNOWN_EXCEPTIONS: {gone}"


def test_layers_are_the_ones_architecture_md_names():
    text = (ROOT.parent / "ARCHITECTURE.md").read_text()
    section = text.split("\n## Import layers\n", 1)[1].split("\n## ", 1)[0]
    numbered = [line.split(". ", 1)[1] for line in section.splitlines() if re.match(r"\d+\. `", line)]
    listed = [tuple(re.findall(r"`([^`]+)`", line.split(":", 1)[0])) for line in numbered]
    assert listed == LAYERS, "ARCHITECTURE.md's import layers differ from this test's LAYERS"


def test_the_check_finds_a_circle_and_an_upward_import():
    """The checks themselves: a lazy import closing a loop, and a lower part importing a higher one."""
    graph = {"lightning_parallel.tensor.plan": {"lightning_parallel.tensor.table"}}
    graph["lightning_parallel.tensor.table"] = {"lightning_parallel.tensor.plan"}
    assert circles(graph) == [["lightning_parallel.tensor.plan", "lightning_parallel.tensor.table"]]
    upward = upward_imports({"lightning_parallel.distributed.mesh": {"lightning_parallel.strategies.base"}})
    assert len(upward) == 1 and "layer 2: distributed" in upward[0]
