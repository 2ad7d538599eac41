"""An interleaved A/B of lightning_parallel's tensor-parallel step between two commits, each against DTensor.

    python benchmarks/ab_tensor_parallel.py OLD_REF [--new NEW_REF] [--rounds 4]
        [any option of bench_tensor_parallel.py --trainer: --trainer-model rotary --steps 25 ...]

The package of ``OLD_REF`` (and of ``NEW_REF``; by default this working tree's) is exported with
``git archive`` to a temporary directory. Each round runs ``bench_tensor_parallel.py --trainer --rounds 1``
(this checkout's benchmark, so both commits fit the same models and are timed alike) once with each
package, the order of the commits and of the two sides inside each run alternated round by round, so a
drift in the machine's load hits both alike. Each run fits ours (``TensorParallelStrategy``) and Lightning's
``ModelParallelStrategy`` with DTensor's ``parallelize_module``, tp=2 on 2 CPU processes.

Printed: each round's median ms per step of both sides and their ratio (DTensor / ours, > 1: ours faster)
for each commit, then the medians over rounds, the process CPU ms per step (less moved by other
processes' load than the wall clock), and new / old of our step time and of the ratio. DTensor's side runs
the same torch code in both, so its times say how much the machine moved between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent / "bench_tensor_parallel.py"
OURS, THEIRS = "lightning_parallel", "Lightning ModelParallel (DTensor)"


def export(ref: str, into: Path) -> Path:
    """The package of commit ``ref`` under ``into`` (``git archive``); returns the directory to import from."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", ref, "lightning_parallel"],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def run_once(root: Path, bench_args: list[str], reverse: int, out: Path) -> dict:
    """One ``--trainer`` run of the benchmark with the package under ``root``; its medians."""
    env = dict(os.environ, LP_PACKAGE_ROOT=str(root), PYTHONPATH=str(root))
    cmd = [sys.executable, str(BENCH), "--trainer", "--rounds", "1", "--reverse", str(reverse), "--json", str(out)]
    done = subprocess.run(cmd + bench_args, env=env, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd + bench_args)} failed with the package of {root}:\n{done.stderr}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", help="the commit to compare against (any git revision)")
    parser.add_argument("--new", default="", help="the other commit (default: this working tree)")
    parser.add_argument("--rounds", type=int, default=4, help="runs of each commit, interleaved")
    args, bench_args = parser.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="lp-ab-") as tmp:
        roots = {args.old: export(args.old, Path(tmp) / "old")}
        new = args.new or "working tree"
        roots[new] = export(args.new, Path(tmp) / "new") if args.new else REPO
        runs: dict[str, list[dict]] = {name: [] for name in roots}
        for r in range(args.rounds):
            order = list(roots) if r % 2 == 0 else list(roots)[::-1]
            for name in order:
                got = run_once(roots[name], bench_args, r % 2, Path(tmp) / "out.json")
                runs[name].append(got)
                ms = got["ms"]
                print(
                    f"round {r + 1} {name:>14}: ours {ms[OURS]:7.2f} ms, DTensor {ms[THEIRS]:7.2f} ms, "
                    f"DTensor / ours {ms[THEIRS] / ms[OURS]:.3f}",
                    flush=True,
                )
    summary = {}
    for name, got in runs.items():
        summary[name] = {
            key: statistics.median(g[kind][side] for g in got)
            for key, kind, side in (
                ("ours", "ms", OURS),
                ("theirs", "ms", THEIRS),
                ("ours_cpu", "cpu_ms", OURS),
                ("theirs_cpu", "cpu_ms", THEIRS),
            )
        }
        summary[name]["ratio"] = statistics.median(g["ms"][THEIRS] / g["ms"][OURS] for g in got)
    print(f"\nbench_tensor_parallel.py --trainer {' '.join(bench_args)}; {args.rounds} rounds, medians")
    print("| commit | ours ms/step | DTensor ms/step | DTensor / ours | CPU ms/step ours / DTensor |")
    print("|---|---|---|---|---|")
    for name, s in summary.items():
        print(
            f"| {name} | {s['ours']:.2f} | {s['theirs']:.2f} | **{s['ratio']:.3f}x** "
            f"| {s['ours_cpu']:.2f} / {s['theirs_cpu']:.2f} |"
        )
    old, now = summary[args.old], summary[new]
    print(
        f"\n{new} / {args.old}: our step time {now['ours'] / old['ours']:.3f}, DTensor's "
        f"{now['theirs'] / old['theirs']:.3f}, our CPU time {now['ours_cpu'] / old['ours_cpu']:.3f}; "
        f"ratio vs DTensor {old['ratio']:.3f} -> {now['ratio']:.3f}"
    )


if __name__ == "__main__":
    main()
