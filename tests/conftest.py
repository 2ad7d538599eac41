import pytest
import torch


def pytest_configure(config):
    torch.set_num_threads(1)


@pytest.fixture
def cuda_required():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
