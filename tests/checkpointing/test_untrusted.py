"""Untrusted checkpoints: ``fit(ckpt_path=..., weights_only=True)`` runs nothing that a checkpoint pickled, on
every load path, and fails before training with torch's weights-only error naming the file
(``checkpointing/trust.py``). A pickled ``__reduce__`` that would create a marker file is planted in a full
file, a sharded directory's ``meta.pt`` (at the top, and in the resume state), its DCP index (``.metadata``)
and among its DCP objects (the optimizer's state, read by ZeRO's pieces too); every marker must stay absent.
With ``weights_only=None`` the package decides as Lightning's own single-file load does. Real processes: one
saves the checkpoints, one runs every load (the refused fits and the clean ones, one after another), 2 ranks
refuse a stored object together; the consolidate command runs here."""

from __future__ import annotations

import os
import pickle
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch.distributed.checkpoint import FileSystemReader, load, save

from lightning_parallel import compat
from lightning_parallel.checkpointing import META_FILE, RESUME_KEY, AtomicCheckpointIO
from lightning_parallel.checkpointing.trust import (
    FIT_TAKES_WEIGHTS_ONLY,
    METADATA_FILE,
    lightning_weights_only,
    resolved,
)
from lightning_parallel.cli.checkpoint import main as checkpoint_cli
from tests.helpers.harness import run_distributed

DDP = {"class": "lightning_parallel:DDPStrategy", "kwargs": {}}
LAYOUTS = {
    "lp_ddp": DDP,
    "lp_ddp_zero1": {"class": "lightning_parallel:DDPStrategy", "kwargs": {"zero_stage": 1}},
    "reference": "auto",  # one device: lightning_parallel's SingleDeviceReferenceStrategy
    "lightning": {"class": "lightning.pytorch.strategies:SingleDeviceStrategy", "kwargs": {"device": "cpu"}},
}


class RunsCode:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def case(name, layout, steps=3, ckpt_path=None, weights_only="unset", sharded=False, expect_error=False):
    strategy = LAYOUTS[layout]
    if sharded:
        strategy = {**strategy, "kwargs": {**strategy["kwargs"], "save_distributed": True}}
    c = {
        "name": name,
        "model": "tests.helpers.models:MLP",
        "data": "tests.helpers.models:RegressionData",
        "model_kwargs": {"optimizer": "adam", "lr": 0.01},
        "data_kwargs": {"global_batch_size": 16},
        "strategy": strategy,
        "dp_size": 1,
        "trainer": {"precision": "64-true", "max_steps": steps},
        "save_checkpoint": not expect_error,
        "ckpt_path": None if ckpt_path is None else str(ckpt_path),
        "expect_error": expect_error,
    }
    return c if weights_only == "unset" else {**c, "weights_only": weights_only}


def planted(clean: Path, where: str, marker: Path, out: Path) -> Path:
    """A copy of the checkpoint ``clean`` with a ``RunsCode(marker)`` planted ``where``."""
    if clean.is_file():
        checkpoint = torch.load(clean, weights_only=True)
        checkpoint["callbacks"] = {"Planted": RunsCode(marker)}
        torch.save(checkpoint, out)
        return out
    if where == "object":  # re-written by DCP with one more object among the optimizer's state
        md = FileSystemReader(str(clean)).read_metadata().state_dict_metadata
        values = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.items()}
        load(values, checkpoint_id=str(clean), no_dist=True)
        name = next(k for k in values if k.startswith("optimizer_states/0/")).rsplit("/", 1)[0]
        values[f"{name}/planted"] = RunsCode(marker)
        save(values, checkpoint_id=str(out), no_dist=True)
        shutil.copy(clean / META_FILE, out / META_FILE)
        return out
    shutil.copytree(clean, out)
    if where in ("meta", "resume"):
        meta = torch.load(clean / META_FILE, weights_only=True)
        if where == "meta":
            meta["callbacks"] = {"Planted": RunsCode(marker)}
        else:
            meta[RESUME_KEY]["sampler"] = RunsCode(marker)
        torch.save(meta, out / META_FILE)
    elif where == "index":
        (out / METADATA_FILE).write_bytes(pickle.dumps(RunsCode(marker)))
    return out


class Harmless:
    """A class that no weights-only load allows: whether a load refuses it says what it trusts."""


@pytest.mark.smoke
@pytest.mark.parametrize(
    "forced", [None, "TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"]
)
def test_unset_weights_only_is_decided_as_lightning_decides_for_one_file(tmp_path, monkeypatch, forced):
    """``weights_only=None`` at the installed torch and Lightning: the package's decision (``resolved``, used
    for DCP's index and objects) is what Lightning's own single-file load does, and what torch does with the
    value Lightning hands it."""
    for name in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"):
        monkeypatch.delenv(name, raising=False)
    if forced:
        monkeypatch.setenv(forced, "1")
    path = tmp_path / "harmless.ckpt"
    torch.save({"state_dict": {}, "object": Harmless()}, path)

    def refuses(load) -> bool:
        try:
            load()
        except pickle.UnpicklingError:
            return True
        return False

    lightning = refuses(lambda: TorchCheckpointIO().load_checkpoint(path))
    assert resolved(None) == lightning
    assert refuses(lambda: torch.load(path, weights_only=lightning_weights_only(None))) == lightning
    assert compat.torch_load_weights_only(None) == refuses(lambda: torch.load(path))
    assert resolved(True) and refuses(lambda: AtomicCheckpointIO().load_checkpoint(path, weights_only=True))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not FIT_TAKES_WEIGHTS_ONLY, reason="Lightning < 2.6: fit takes no weights_only")
def test_untrusted_checkpoints_run_no_code_on_any_load_path(tmp_path):
    run_distributed(
        [case("save-file", "lp_ddp"), case("save-dir", "lp_ddp", sharded=True)],
        world_size=1,
        tmp_path=tmp_path,
    )
    clean = {
        "file": tmp_path / "dist1" / "save-file" / "last.ckpt",
        "dir": tmp_path / "dist1" / "save-dir" / "last.ckpt",
    }
    assert clean["file"].is_file() and (clean["dir"] / META_FILE).is_file()
    markers = tmp_path / "markers"
    markers.mkdir()
    bad = tmp_path / "bad"
    bad.mkdir()
    # (name, clean source, where, layout, weights_only): every load path, refused
    refused = [
        ("file", "file", "meta", "lp_ddp", True),
        ("file-reference", "file", "meta", "reference", True),
        ("meta", "dir", "meta", "lp_ddp", True),
        ("resume-state", "dir", "resume", "lp_ddp", True),
        ("index", "dir", "index", "lp_ddp", True),
        ("object", "dir", "object", "lp_ddp", True),
        ("object-zero1", "dir", "object", "lp_ddp_zero1", True),
        ("meta-reference", "dir", "meta", "reference", True),
        ("index-reference", "dir", "index", "reference", True),
    ]
    # weights_only=None: the package's formats decide as Lightning's own single file does
    unset = [
        ("lightning-file-unset", "file", "meta", "lightning", "unset"),
        ("meta-unset", "dir", "meta", "lp_ddp", "unset"),
        ("index-unset", "dir", "index", "lp_ddp", "unset"),
        ("object-unset", "dir", "object", "lp_ddp", "unset"),
    ]
    paths = {}
    cases = []
    for name, source, where, layout, weights_only in refused + unset:
        suffix = ".ckpt" if source == "file" else ""
        paths[name] = planted(clean[source], where, markers / name, bad / f"{name}{suffix}")
        cases.append(case(name, layout, 5, paths[name], weights_only, expect_error=True))
    # what the package wrote loads with weights_only=True, whole and sharded, and under ZeRO
    cases += [
        case("clean-file", "lp_ddp", 5, clean["file"], True),
        case("clean-dir", "lp_ddp", 5, clean["dir"], True),
        case("clean-dir-zero1", "lp_ddp_zero1", 5, clean["dir"], True),
    ]
    results = run_distributed(cases, world_size=1, tmp_path=tmp_path / "load", timeout=240)

    ran = [name for name, *_ in refused if (markers / name).exists()]
    assert not ran, f"these loads ran the checkpoint's code: {ran}"
    for name, *_ in refused:
        result = results[name][0]
        assert result["error"] and "Weights only load failed" in result["error"], f"{name}: {result['error']}"
        assert str(paths[name]) in result["error"], (
            f"{name}: the error does not name the file: {result['error']}"
        )
        assert result["losses"] == [], f"{name}: trained before failing"
    lightning_ran = (markers / "lightning-file-unset").exists()
    for name, *_ in unset:
        assert (markers / name).exists() == lightning_ran, f"{name}: decided otherwise than Lightning"
        if not lightning_ran:
            assert "Weights only load failed" in results[name][0]["error"], name
    for name in ("clean-file", "clean-dir", "clean-dir-zero1"):
        assert len(results[name][0]["losses"]) == 2, name  # steps 4 and 5: it resumed

    # 2 ranks: both refuse DCP's stored object (the failure DCP gathers is raised as the refusal) and stop
    two_ranks = planted(clean["dir"], "object", markers / "object-2-ranks", bad / "object-2-ranks")
    with pytest.raises(RuntimeError, match="Weights only load failed") as refusal:
        run_distributed(
            [{**case("object-2-ranks", "lp_ddp", 5, two_ranks, True), "dp_size": 2}],
            world_size=2,
            tmp_path=tmp_path / "two",
            timeout=120,
        )
    assert str(two_ranks) in str(refusal.value)
    assert not (markers / "object-2-ranks").exists(), "2 ranks: the checkpoint ran code"

    for name in ("meta", "index", "object"):  # the consolidate command
        with pytest.raises(pickle.UnpicklingError, match="Weights only load failed") as refusal:
            checkpoint_cli(
                ["consolidate", "--weights-only", str(paths[name]), str(tmp_path / f"{name}.ckpt")]
            )
        assert str(paths[name]) in str(refusal.value)
        assert not (markers / name).exists(), f"consolidate {name}: the checkpoint ran code"
        assert not (tmp_path / f"{name}.ckpt").exists()
    checkpoint_cli(["consolidate", "--weights-only", str(clean["dir"]), str(tmp_path / "clean.ckpt")])
    consolidated = torch.load(tmp_path / "clean.ckpt", weights_only=True)
    assert consolidated["global_step"] == 3
