"""A rendezvous store that the launching process holds before any rank starts.

Why not the usual recipe (find a free port, close it, give its number to the ranks, and let rank 0
bind it when it reaches ``init_process_group``)? Between the close and the bind the port is free for
as long as the ranks take to import torch, seconds on a busy machine. Any other process can bind it
meanwhile, and rank 0 then fails with ``EADDRINUSE`` (seen in CI); worse, if that process is another
run's store, this run's other ranks join it and wait on ranks that are not theirs.

A store that is bound (to a port the OS picks) before the first rank starts closes the gap. torch's
``env://`` rendezvous connects every rank, rank 0 too, as a client of such a store when
``TORCHELASTIC_USE_AGENT_STORE=True``. That is how torchrun's agent hosts its store.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from lightning_parallel.compat import agent_store_env

__all__ = ["HostedStore", "AGENT_STORE_ENV"]

#: torch's switch (``torch/distributed/rendezvous.py``): every rank is a client of a store someone else hosts
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"


class HostedStore:
    """A ``TCPStore`` server held by this process for one run's ranks; ``env()`` tells them where it is.

    Keep the object alive until the run's process group is destroyed; ``close()`` stops the server.
    """

    def __init__(
        self, world_size: int, host: str = "127.0.0.1", timeout: timedelta = timedelta(minutes=30)
    ) -> None:
        self.host = host
        self.world_size = world_size
        self._store: Optional[dist.TCPStore] = dist.TCPStore(
            host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        self.port: int = self._store.port

    def env(self) -> dict[str, str]:
        """The environment variables that send each rank's ``env://`` rendezvous to this store."""
        return {"MASTER_ADDR": self.host, "MASTER_PORT": str(self.port), **agent_store_env(AGENT_STORE_ENV)}

    def close(self) -> None:
        self._store = None  # the server stops when its last reference goes

    def __enter__(self) -> "HostedStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
