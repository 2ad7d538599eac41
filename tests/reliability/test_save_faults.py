"""The crash-safety contract of checkpoints (docs/checkpoints.md), point by point of a save, on real
processes: a rank dies inside the save of ``last.ckpt`` at step 8 (checkpoints every 4 steps, 2 gloo
processes, ``lp_ddp``), at a point chosen by ``tests/reliability/save_faults.py`` (deterministic: no
sleeps), and ``fit(ckpt_path="last")`` then resumes exactly (losses and parameters to 1e-10, as
``test_resume.py`` checks) from the checkpoint the contract promises: the previous one (step 4) where
the new one was not finished, the new one (step 8) where it was, also when the kill struck between the two
renames of a sharded save and ``last.ckpt`` was missing.

Also: a full disk during a file or sharded save fails every rank cleanly and leaves no temporary file or
directory; every checkpoint file has the permissions ``open()`` gives under the umask;
SIGTERM with sharded saves and ``ModelCheckpoint(save_last="link")`` (``last.ckpt`` a link to a
step's checkpoint) saves, stops and resumes exactly; and whatever a killed save hid is gone after the
resumed run (its owner is dead).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.reliability.test_resume import check_resumed, run_resume_cases, saved_step


def fault(point: str, rank: int, ckpt_step: int, sharded: bool = True) -> dict:
    return {
        "strategy": "lp_ddp",
        "every": 4,
        "kill": [8, rank, "SIGKILL"],
        "die_in_save": point,
        "ckpt_step": ckpt_step,
        "sharded": sharded,
    }


CASES = {
    # a file: the half-written temporary file is never last.ckpt
    "file_killed_mid_write": fault("file_write", 0, 4, sharded=False),
    # not a kill: the file write fails (ENOSPC) on rank 0, the only writer; every rank fails
    "file_disk_full": fault("file_disk_full", 0, 4, sharded=False),
    # sharded: rank 1 killed once its shard is written (no .metadata, no meta.pt)
    "sharded_killed_after_a_shard": fault("shard_written", 1, 4),
    # sharded: meta.pt half written (every shard and .metadata are there)
    "sharded_killed_mid_meta": fault("file_write", 0, 4),
    # between the two renames: no last.ckpt; the new one is put back at the next start
    "sharded_killed_between_renames": fault("renamed_aside", 0, 8),
    # after the second rename, the previous checkpoint not yet removed
    "sharded_killed_before_old_removed": fault("renamed", 0, 8),
    # not a kill: rank 1's shard write fails (ENOSPC); every rank fails, no temporary directory is left
    "sharded_disk_full": fault("disk_full", 1, 4),
    # SIGTERM, sharded, last.ckpt a link to the step's checkpoint: saved over the link, stops, resumes
    "sharded_sigterm_last_link": {
        "strategy": "lp_ddp",
        "every": 4,
        "kill": [5, 1, "SIGTERM"],
        "ckpt_step": 6,
        "sharded": True,
        "save_last": "link",
    },
}
HIDDEN = re.compile(r"^\.last\.ckpt\.(tmp|old)-")
# what each fault leaves: (the step of last.ckpt or None, the kinds of hidden entries of last.ckpt)
LEFT = {
    "file_killed_mid_write": (4, {"tmp"}),
    "file_disk_full": (4, set()),
    "sharded_killed_mid_meta": (4, {"tmp"}),
    "sharded_killed_between_renames": (None, {"tmp", "old"}),
    "sharded_killed_before_old_removed": (8, {"old"}),
    "sharded_disk_full": (4, set()),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    left = {}

    def after_kill(name: str, folder: Path) -> None:
        last = folder / "last.ckpt"
        hidden = {m[1] for p in folder.iterdir() if (m := HIDDEN.match(p.name))}
        left[name] = (saved_step(last) if last.exists() else None, hidden)

    tmp = tmp_path_factory.mktemp("faults")
    results = run_resume_cases(CASES, tmp, after_kill=after_kill)
    remaining = {n: sorted(p.name for p in (tmp / f"kill_{n}" / "ckpt").iterdir()) for n in CASES}
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {
        str(p.relative_to(tmp)): p.stat().st_mode & 0o777
        for n in CASES
        for p in (tmp / f"kill_{n}" / "ckpt").rglob("*")
        if p.is_file() and not p.is_symlink()
    }
    return results, left, remaining, (umask, modes)


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first case also runs the module fixture: every launch
@pytest.mark.parametrize("case", list(CASES))
def test_a_fault_at_each_point_of_a_save_resumes_exactly(runs, case):
    results, left, remaining, _ = runs
    if case in LEFT:
        assert left[case] == LEFT[case], f"{case}: after the fault (step of last.ckpt, hidden): {left[case]}"
    base, resumed, _ = results[case]
    # the resumed batches start after ckpt_step: it resumed from that checkpoint
    check_resumed(CASES[case], base, resumed, CASES[case]["ckpt_step"])
    hidden = [name for name in remaining[case] if name.startswith(".last.ckpt.")]
    assert not hidden, f"{case}: left after the resumed run: {hidden}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_checkpoint_files_honour_the_umask(runs):
    """Every file of the file and sharded checkpoints (``meta.pt`` included) has the permissions a plain
    ``open()`` gives under the processes' umask, as Lightning's own checkpoints, not tempfile's 0600."""
    umask, modes = runs[3]
    assert any(name.endswith("meta.pt") for name in modes) and any(name.endswith(".distcp") for name in modes)
    wrong = {name: oct(mode) for name, mode in modes.items() if mode != 0o666 & ~umask}
    assert not wrong, f"not {oct(0o666 & ~umask)} under umask {oct(umask)}: {wrong}"
