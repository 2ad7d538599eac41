"""A checkpoint with keys the model lacks (a layer more) is refused by a strict load, sharded directory
(``save_distributed=True``) as file, with torch's message and before training; ``strict_loading = False``
on the LightningModule loads it, ignoring the extra keys. ``lp_ddp``, 2 gloo processes."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.harness import assert_params_close, run_distributed

MODELS = "tests.checkpointing.extra_layer_models"
UNEXPECTED = r'Unexpected key\(s\) in state_dict: "extra.weight", "extra.bias"'


def case(name: str, model: str, sharded: bool, steps: int, ckpt_path: str | None = None) -> dict:
    return {
        "name": name,
        "model": model,
        "data": "tests.helpers.models:RegressionData",
        "data_kwargs": {"global_batch_size": 16},
        "strategy": {"class": "lightning_parallel:DDPStrategy", "kwargs": {"save_distributed": sharded}},
        "trainer": {"precision": "64-true", "max_steps": steps},
        "save_checkpoint": True,
        "ckpt_path": ckpt_path,
    }


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_extra_keys_fail_a_strict_load_and_pass_a_lenient_one(tmp_path):
    saved = {"sharded": True, "file": False}
    run_distributed(
        [case(f"save-{s}", f"{MODELS}:MLPWithExtraLayer", sharded, 2) for s, sharded in saved.items()],
        world_size=2,
        tmp_path=tmp_path / "save",
    )
    paths = {s: str(tmp_path / "save" / "dist2" / f"save-{s}" / "last.ckpt") for s in saved}
    for s, path in paths.items():
        with pytest.raises(RuntimeError, match=UNEXPECTED) as caught:
            run_distributed(
                [case(f"strict-{s}", "tests.helpers.models:MLP", False, 3, path)],
                world_size=2,
                tmp_path=tmp_path / f"strict-{s}",
                timeout=120,
            )
        assert str(caught.value).count("Unexpected key(s)") >= 2, "every rank refuses"
    # lenient: the sharded directory's optimizer state is by name, so the extra layer's is dropped too (a
    # file's optimizer state is by position: Lightning's own restore refuses it, whatever strict_loading says)
    lenient = run_distributed(
        [case("lenient-sharded", f"{MODELS}:LenientMLP", False, 2, paths["sharded"])],
        world_size=2,
        tmp_path=tmp_path / "lenient",
    )["lenient-sharded"]
    saved_state = torch.load(paths["file"], weights_only=False)["state_dict"]
    for rank in lenient:
        assert rank["losses"] == [], "resumed at its last step: nothing more to train"
        assert_params_close(
            rank["state_dict"], {k: v for k, v in saved_state.items() if k.startswith("net.")}, 0
        )
