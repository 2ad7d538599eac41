"""The hosted rendezvous store: its port is taken before any rank starts, the ranks meet there (rank 0
as a client too), and closing it frees the port."""

from __future__ import annotations

import os
import socket
import sys

import pytest

from lightning_parallel.compat import RESTART_COUNT_ENV
from lightning_parallel.distributed.rendezvous import AGENT_STORE_ENV, HostedStore
from tests.helpers.harness import run_processes, worker_env

ALL_REDUCE = (
    "import torch, torch.distributed as d; d.init_process_group('gloo'); "
    "t = torch.tensor([d.get_rank() + 1.0]); d.all_reduce(t); print('sum', int(t)); d.destroy_process_group()"
)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.smoke
@pytest.mark.timeout(120)
def test_port_is_held_before_the_ranks_start_and_they_meet_there(tmp_path) -> None:
    with HostedStore(world_size=2) as store:
        assert not _bindable(store.port)  # nothing else can take it while the ranks import torch
        assert store.env() == {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port),
            AGENT_STORE_ENV: "True",
            RESTART_COUNT_ENV: os.environ.get(RESTART_COUNT_ENV, "0"),  # read by torch <= 2.5
        }
        envs = [{**worker_env(r, 2), **store.env()} for r in range(2)]
        outputs = run_processes([[sys.executable, "-c", ALL_REDUCE]] * 2, envs, timeout=90, cwd=tmp_path)
    assert all("sum 3" in out for out in outputs), outputs


@pytest.mark.timeout(60)
def test_close_frees_the_port() -> None:
    store = HostedStore(world_size=2)
    port = store.port
    store.close()
    assert _bindable(port)
