import os

import pytest
import torch

# What a launch or Lightning's ``_init_dist_connection`` writes into ``os.environ`` and never takes back.
RENDEZVOUS_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "TORCHELASTIC_USE_AGENT_STORE",
)


def pytest_configure(config):
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def rendezvous_env_is_restored():
    """A test that trains in-process leaves ``MASTER_PORT`` etc. behind: every later subprocess would
    inherit them, all runs would rendezvous on that one port, and a run could meet a store left by an
    earlier one. Restore them after each test."""
    before = {key: os.environ.get(key) for key in RENDEZVOUS_ENV}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def cuda_required():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
