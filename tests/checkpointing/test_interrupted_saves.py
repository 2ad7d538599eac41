"""What a start does with what an interrupted save left (``checkpointing/interrupted_saves.py``), as
file-system states, one per point of a kill; the same points are killed for real in
``tests/reliability/test_save_faults.py``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from lightning_parallel.checkpointing.atomic import atomic_torch_save
from lightning_parallel.checkpointing.interrupted_saves import hidden_path, move_into_place, recover
from lightning_parallel.checkpointing.sharded import META_FILE, is_sharded_checkpoint


def dead_token() -> str:
    """The token of a save by a process of this host that has exited."""
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return f"abcdef012345-{int(proc.stdout)}@{socket.gethostname()}"


def checkpoint_dir(path: Path, step: int, finished: bool = True) -> Path:
    path.mkdir()
    (path / "__0_0.distcp").write_bytes(b"shard")
    if finished:
        (path / ".metadata").write_bytes(b"dcp")
        torch.save({"global_step": step}, path / META_FILE)
    return path


def step_of(path: Path) -> int:
    return torch.load(path / META_FILE, weights_only=True)["global_step"]


def test_killed_between_the_renames_the_new_checkpoint_is_put_back(tmp_path):
    last, token = tmp_path / "last.ckpt", dead_token()
    checkpoint_dir(hidden_path(last, "old", token), 4)
    checkpoint_dir(hidden_path(last, "tmp", token), 8)
    done = recover(tmp_path, is_sharded_checkpoint)
    assert step_of(last) == 8 and len(done) == 1 and "put back" in done[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_without_a_finished_new_one_the_previous_is_put_back(tmp_path):
    last, token = tmp_path / "last.ckpt", dead_token()
    checkpoint_dir(hidden_path(last, "old", token), 4)
    checkpoint_dir(hidden_path(last, "tmp", token), 8, finished=False)
    recover(tmp_path, is_sharded_checkpoint)
    assert step_of(last) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_with_last_present_stale_leftovers_go_and_it_stays(tmp_path):
    last, token = tmp_path / "last.ckpt", dead_token()
    checkpoint_dir(last, 8)
    checkpoint_dir(hidden_path(last, "old", token), 4)  # killed before the old one was removed
    checkpoint_dir(hidden_path(last, "tmp", dead_token()), 12, finished=False)  # killed mid-save
    hidden_path(last, "tmp", dead_token()).write_bytes(b"half a file")  # a file save killed mid-write
    assert recover(tmp_path, is_sharded_checkpoint) == []
    assert step_of(last) == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_live_or_unknown_owners_entries_are_left_alone(tmp_path):
    last = tmp_path / "last.ckpt"
    checkpoint_dir(last, 4)
    live = checkpoint_dir(
        hidden_path(last, "tmp", f"0123456789ab-{os.getppid()}@{socket.gethostname()}"), 8, False
    )
    elsewhere = checkpoint_dir(hidden_path(last, "tmp", "0123456789ab-1@another-host"), 8, finished=False)
    legacy = checkpoint_dir(tmp_path / ".last.ckpt.tmp-0123456789ab", 8, finished=False)
    recover(tmp_path, is_sharded_checkpoint)
    assert live.is_dir() and elsewhere.is_dir() and legacy.is_dir() and step_of(last) == 4


def test_the_next_save_of_a_name_removes_its_stale_leftovers(tmp_path):
    last = tmp_path / "last.ckpt"
    checkpoint_dir(last, 4)
    stale = checkpoint_dir(hidden_path(last, "tmp", dead_token()), 8, finished=False)
    other = checkpoint_dir(tmp_path / ".epoch=0.ckpt.tmp-abcdef012345-1@x", 8, finished=False)
    recover(tmp_path, is_sharded_checkpoint, only="last.ckpt")
    assert not stale.exists() and other.exists()


def test_moving_over_a_link_replaces_the_link_not_its_target(tmp_path):
    """save_last="link": last.ckpt links to a step's checkpoint, which must survive a save to last.ckpt."""
    target = checkpoint_dir(tmp_path / "step=4.ckpt", 4)
    last = tmp_path / "last.ckpt"
    last.symlink_to(target.name)
    new = checkpoint_dir(hidden_path(last, "tmp", "abc-1@h"), 8)
    move_into_place(new, last, "abc-1@h")
    assert not last.is_symlink() and step_of(last) == 8 and step_of(target) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step=4.ckpt"]


def test_atomic_files_honour_the_umask(tmp_path):
    before = os.umask(0o027)
    try:
        atomic_torch_save({"a": 1}, tmp_path / "x.ckpt")
    finally:
        os.umask(before)
    assert (tmp_path / "x.ckpt").stat().st_mode & 0o777 == 0o640


def test_files_that_only_look_hidden_are_not_touched(tmp_path):
    """A folder may be the working directory (Lightning's default_root_dir): only our exact names count."""
    mine = [tmp_path / ".notes.old-1", tmp_path / ".notes.tmp-abc", tmp_path / ".x.tmp-0123456789ab-12"]
    for path in mine:
        path.write_text("a user's file")
    assert recover(tmp_path, is_sharded_checkpoint) == []
    assert sorted(tmp_path.iterdir()) == sorted(mine)
