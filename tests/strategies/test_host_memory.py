"""``release_host_memory``, zero_stage=3's choice on the CPU between the lowest peak and fewer page faults, on 2
real gloo processes per run, each run in processes of its own (glibc's setting is process-wide): True (the
default) fixes glibc's mmap threshold, so that a freed block of 1 MiB or more leaves the resident memory;
False leaves glibc's own policy. Either way training is the same."""

from __future__ import annotations

import pytest

from tests.helpers.harness import assert_params_close, run_distributed

DDP = "lightning_parallel:DDPStrategy"


def case(release: bool) -> dict:
    return {
        "name": f"release-{release}",
        "model": "tests.helpers.tp_models:SmallGPT",
        "model_kwargs": {"n_embd": 64, "n_layer": 2, "vocab_size": 32, "optimizer": "adamw"},
        "data": "tests.helpers.tp_models:TokenData",
        "data_kwargs": {"global_batch_size": 4, "n": 8},
        "dp_size": 2,
        "trainer": {"max_steps": 2},
        "strategy": {"class": DDP, "kwargs": {"zero_stage": 3, "release_host_memory": release}},
        "probe": "tests.helpers.probes:host_blocks_mapped",
    }


@pytest.mark.timeout(300)
def test_release_host_memory_sets_glibc_and_trains_alike(tmp_path):
    results = {}
    for release in (True, False):
        results.update(run_distributed([case(release)], 2, tmp_path / str(release), timeout=240))
    for rank in range(2):
        assert results["release-True"][rank]["probe"] is True
        assert results["release-False"][rank]["probe"] is False
        assert_params_close(
            results["release-True"][rank]["state_dict"], results["release-False"][rank]["state_dict"], atol=0
        )
