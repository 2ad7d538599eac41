"""Point-to-point transfer of activations and their gradients between pipeline stages.

An activation is one tensor or a tuple of them. A receiver cannot allocate a buffer without knowing shape and dtype, and both can change from batch to
batch (variable sequence length; bf16 under autocast). So every tensor travels after a fixed-size
header: ``[ndim, dtype code, *shape]`` as int64. Sends are non-blocking (their handles are kept until
the step ends), receives block: with every stage sending before it waits, no schedule can deadlock on
a send. Tensors go through host memory when the backend is gloo (gloo cannot send CUDA tensors).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["PeerLink", "MAX_DIMS"]

MAX_DIMS = 8
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool, torch.uint8]


class PeerLink:
    """Sends to / receives from fixed global ranks; keeps send handles alive until ``wait_sends``."""

    def __init__(self, device: torch.device, group: Optional[dist.ProcessGroup] = None) -> None:
        self.device = device
        self.group = group
        self.via_host = device.type != "cpu" and dist.get_backend(group) == "gloo"
        self._pending: list[tuple[dist.Work, Tensor]] = []

    def send(self, activation: Union[Tensor, tuple[Tensor, ...]], dst: int) -> None:
        """Send a tensor or a tuple of tensors (a count header says which)."""
        is_tuple = isinstance(activation, (tuple, list))
        tensors = list(activation) if is_tuple else [activation]
        self._send_raw(torch.tensor([len(tensors), int(is_tuple)], dtype=torch.int64), dst)
        for t in tensors:
            self._send_tensor(t, dst)

    def recv(self, src: int) -> Union[Tensor, tuple[Tensor, ...]]:
        count = torch.empty(2, dtype=torch.int64, device="cpu" if self.via_host else self.device)
        dist.recv(count, src, group=self.group)
        n, is_tuple = (int(v) for v in count.cpu())
        tensors = tuple(self._recv_tensor(src) for _ in range(n))
        return tensors if is_tuple else tensors[0]

    def _send_raw(self, header: Tensor, dst: int) -> None:
        header = header if self.via_host else header.to(self.device)
        self._pending.append((dist.isend(header, dst, group=self.group), header))

    def _send_tensor(self, tensor: Tensor, dst: int) -> None:
        if tensor.dim() > MAX_DIMS:
            raise ValueError(f"can send tensors of at most {MAX_DIMS} dimensions, got shape {tuple(tensor.shape)}")
        header = torch.zeros(MAX_DIMS + 2, dtype=torch.int64)
        header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        payload = tensor.detach().contiguous()
        if self.via_host:
            payload = payload.cpu()
        else:
            header = header.to(self.device)
        for t in (header, payload):
            self._pending.append((dist.isend(t, dst, group=self.group), t))

    def _recv_tensor(self, src: int) -> Tensor:
        header = torch.empty(MAX_DIMS + 2, dtype=torch.int64, device="cpu" if self.via_host else self.device)
        dist.recv(header, src, group=self.group)
        header = header.cpu()
        shape = tuple(int(s) for s in header[2 : 2 + int(header[0])])
        buffer = torch.empty(shape, dtype=_DTYPES[int(header[1])], device="cpu" if self.via_host else self.device)
        dist.recv(buffer, src, group=self.group)
        return buffer.to(self.device)

    def wait_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
