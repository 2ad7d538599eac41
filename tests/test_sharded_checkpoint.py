"""``save_distributed=True``: each rank writes only its own shard (torch.distributed.checkpoint), and the
directory continues training under the same layout and under every other one exactly like single-device
training (Adam / SGD with momentum in float64: the optimizer state must survive too), and consolidates into
a plain ``.ckpt``. Real processes over gloo."""

import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from lightning_parallel.checkpointing import META_FILE, is_sharded_checkpoint
from lightning_parallel.strategies import SingleDeviceReferenceStrategy
from tests.helpers.harness import REPO, UNTRUSTED, assert_params_close, run_distributed, run_single
from tests.helpers.models import MLP

LAYOUTS = {
    "ddp": {"class": "lightning_parallel:DDPStrategy", "kwargs": {}},
    "tp": {"class": "lightning_parallel:TensorParallelStrategy", "kwargs": {"plan": "auto"}},
    "pp": {"class": "lightning_parallel:PipelineParallelStrategy", "kwargs": {"schedule": "1f1b"}},
}
DP_SIZE = {"ddp": 2, "tp": 1, "pp": 1, "single": 1}
MODELS = {  # MLP + Adam; a transformer layer (packed q/k/v weight) + SGD with momentum
    "mlp": {
        "model": "tests.helpers.models:MLP",
        "data": "tests.helpers.models:RegressionData",
        "model_kwargs": {"optimizer": "adam", "lr": 0.01},
    },
    "attn": {
        "model": "tests.helpers.tp_models:EncoderRegressor",
        "data": "tests.helpers.tp_models:SequenceData",
        "model_kwargs": {},
    },
}


def case(name, layout, steps, model="mlp", ckpt_path=None, sharded=True):
    strategy = "auto"
    if layout in LAYOUTS:
        strategy = {**LAYOUTS[layout], "kwargs": {**LAYOUTS[layout]["kwargs"], "save_distributed": sharded}}
    return {
        "name": name,
        **MODELS[model],
        "data_kwargs": {"global_batch_size": 16},
        "strategy": strategy,
        "dp_size": DP_SIZE[layout],
        "trainer": {"precision": "64-true", "max_steps": steps},
        "save_checkpoint": "split",  # at the end of fit, while each rank holds its shard
        "ckpt_path": ckpt_path,
        **(UNTRUSTED if ckpt_path else {}),
        "probe": "tests.helpers.probes:local_shards",
    }


def check_one_shard_per_rank(directory, probes):
    """Two rank files; every stored slice is in the file of a rank that holds exactly that slice."""
    assert is_sharded_checkpoint(directory)
    files = sorted(p.name for p in directory.iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", META_FILE], files
    assert not [p for p in directory.parent.iterdir() if ".tmp-" in p.name], "temporary directory left behind"
    metadata = FileSystemReader(str(directory)).read_metadata()
    written = {0: 0, 1: 0}
    for index, info in metadata.storage_data.items():
        rank = int(info.relative_path.split("_")[2])
        written[rank] += info.length
        if not index.fqn.startswith("state_dict/"):
            continue
        key = index.fqn[len("state_dict/") :]
        assert key in probes[rank]["keys"], f"rank {rank} wrote {key}, which it does not hold"
        if key in probes[rank]["layouts"]:
            dim, chunks, shard, size = probes[rank]["layouts"][key]
            chunk_dim = dim + (1 if chunks > 1 else 0)
            full = metadata.state_dict_metadata[index.fqn].size[chunk_dim]
            assert index.offset[chunk_dim] == shard * full // size, (
                f"rank {rank} wrote another rank's slice of {key}"
            )
    assert min(written.values()) > 0.2 * sum(written.values()), (
        f"one rank wrote (almost) everything: {written}"
    )


@pytest.mark.timeout(900)
def test_sharded_checkpoint_saves_per_rank_and_continues_under_every_layout(tmp_path):
    sources = {"tp": ("tp", "mlp"), "pp": ("pp", "mlp"), "tp-attn": ("tp", "attn")}
    saved = run_distributed(
        [case(f"save-{s}", layout, 3, model) for s, (layout, model) in sources.items()],
        world_size=2,
        tmp_path=tmp_path / "save",
        timeout=400,
    )
    dirs = {s: tmp_path / "save" / "dist2" / f"save-{s}" / "last.ckpt" for s in sources}
    for s, d in dirs.items():
        check_one_shard_per_rank(d, [r["probe"] for r in saved[f"save-{s}"]])
    assert saved["save-tp"][0]["probe"]["layouts"] and saved["save-tp-attn"][0]["probe"]["layouts"]
    assert any(v[1] > 1 for v in saved["save-tp-attn"][0]["probe"]["layouts"].values()), (
        "no packed q/k/v weight"
    )

    reference = {m: run_single(case(f"ref-{m}", "single", 5, m), tmp_path)["state_dict"] for m in MODELS}
    three = {m: run_single(case(f"three-{m}", "single", 3, m), tmp_path)["state_dict"] for m in MODELS}
    plan = [(s, dst) for s in ("tp", "pp") for dst in LAYOUTS] + [("tp-attn", "tp")]
    cases = [
        case(f"from-{s}-to-{dst}", dst, 5, sources[s][1], ckpt_path=str(dirs[s]), sharded=False)
        for s, dst in plan
    ]
    continued = run_distributed(cases, world_size=2, tmp_path=tmp_path / "load", timeout=500)
    for c in cases:
        model = "attn" if "attn" in c["name"] else "mlp"
        for rank_result in continued[c["name"]][:1]:
            assert len(rank_result["losses"]) == 2, c["name"]  # steps 4 and 5 only: it resumed
        full = torch.load(tmp_path / "load" / "dist2" / c["name"] / "last.ckpt", weights_only=False)
        assert full["global_step"] == 5, c["name"]
        assert_params_close(full["state_dict"], reference[model], atol=1e-10)

    for s, (_, model) in sources.items():  # one device, straight from the directory
        single = run_single(case(f"from-{s}-to-single", "single", 5, model, ckpt_path=str(dirs[s])), tmp_path)
        assert_params_close(single["state_dict"], reference[model], atol=1e-10)

        out = tmp_path / f"{s}.ckpt"  # consolidated: a plain single-device checkpoint
        subprocess.run(
            [
                sys.executable,
                "-m",
                "lightning_parallel.cli.checkpoint",
                "consolidate",
                str(dirs[s]),
                str(out),
            ],
            check=True,
            cwd=REPO,
            timeout=120,
        )
        state = torch.load(out, weights_only=False)["state_dict"]
        assert_params_close(state, three[model], atol=1e-10)
        if model == "mlp":
            plain = MLP.load_from_checkpoint(out).double()
            assert_params_close(plain.state_dict(), state, atol=1e-7)  # load_from_checkpoint builds float32
        resumed = run_single(case(f"from-{s}-consolidated", "single", 5, model, ckpt_path=str(out)), tmp_path)
        assert_params_close(resumed["state_dict"], reference[model], atol=1e-10)


@pytest.mark.timeout(60)
def test_an_unfinished_directory_is_not_loaded(tmp_path):
    broken = tmp_path / "last.ckpt"
    broken.mkdir()
    (broken / "__0_0.distcp").write_bytes(b"partial")
    (broken / ".metadata").write_bytes(b"")
    assert not is_sharded_checkpoint(broken)
    with pytest.raises(FileNotFoundError, match="not a complete sharded checkpoint"):
        SingleDeviceReferenceStrategy().load_checkpoint(broken)


def written_bytes(directory) -> int:
    """What the shards hold of the model and optimizer (every stored slice once)."""
    return sum(info.length for info in FileSystemReader(str(directory)).read_metadata().storage_data.values())


@pytest.mark.timeout(900)
def test_two_dimensional_layouts_write_each_replicated_tensor_once(tmp_path):
    """dp=2 x tp=2 and dp=2 x pp=2 on 4 processes: 4 shard files, as many bytes as the same model saved by
    tp=2 or pp=2 alone (the two replicas do not both write), and one device continues from the directory
    exactly like single-device training."""
    two_d = {
        "dp2-tp2": {
            "class": "lightning_parallel:TensorParallelStrategy",
            "kwargs": {"plan": "auto", "data_parallel_size": 2, "save_distributed": True},
        },
        "dp2-pp2": {
            "class": "lightning_parallel:PipelineParallelStrategy",
            "kwargs": {"schedule": "1f1b", "data_parallel_size": 2, "save_distributed": True},
        },
    }
    cases = [
        {**case(f"save-{name}", "tp", 3), "strategy": strategy, "dp_size": 2, "probe": None}
        for name, strategy in two_d.items()
    ]
    run_distributed(cases, world_size=4, tmp_path=tmp_path / "save", timeout=400)
    run_distributed(
        [case("save-tp", "tp", 3), case("save-pp", "pp", 3)],
        world_size=2,
        tmp_path=tmp_path / "1d",
        timeout=200,
    )
    one_layout = {
        name: written_bytes(tmp_path / "1d" / "dist2" / f"save-{name[-3:-1]}" / "last.ckpt") for name in two_d
    }
    reference = run_single(case("ref", "single", 5), tmp_path)["state_dict"]
    for name in two_d:
        directory = tmp_path / "save" / "dist4" / f"save-{name}" / "last.ckpt"
        assert is_sharded_checkpoint(directory)
        assert sorted(p.name for p in directory.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
        assert written_bytes(directory) == pytest.approx(one_layout[name], rel=0.02), name
        single = run_single(
            {**case(f"from-{name}", "single", 5, ckpt_path=str(directory)), "probe": None}, tmp_path
        )
        assert_params_close(single["state_dict"], reference, atol=1e-10)
