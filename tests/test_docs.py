"""The docs and docstrings name only files that exist: a path in README.md, ARCHITECTURE.md, docs/,
examples/ or a module of the package resolves in the repository (or is a placeholder the text defines)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PATH = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.(?:py|md|yaml))\b")
# names that stand for a user's file, one Hydra writes, or a file of another project
NOT_OURS = {
    "FILE.yaml",
    "overrides.yaml",
    ".hydra/overrides.yaml",
    "torch/distributed/rendezvous.py",
    "benchmarks/llama3_h100_202412_torchtitan.md",  # torchtitan's, for the published-table comparison
    "pipeline_llama.py",
    "pipelining_utils.py",
}


def texts() -> list[Path]:
    return [
        *REPO.glob("*.md"),
        *REPO.glob("docs/*.md"),
        *REPO.glob("examples/**/*.md"),
        *REPO.glob("lightning_parallel/**/*.py"),
    ]


def test_every_named_file_exists():
    missing = []
    for f in texts():
        for ref in PATH.findall(f.read_text()):
            places = (REPO, f.parent, REPO / "lightning_parallel", REPO / "conf")
            found = any((p / ref).exists() for p in places) or any(REPO.glob(f"[!.]*/**/{ref}"))
            if ref not in NOT_OURS and not found:
                missing.append(f"{f.relative_to(REPO)}: {ref}")
    assert not missing, "files named but not in the repository:\n" + "\n".join(missing)
