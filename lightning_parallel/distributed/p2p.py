"""Point-to-point transfer of activations and their gradients between pipeline stages.

An activation is one tensor or a tuple of them. A receiver cannot allocate a buffer without knowing shape and dtype, and both can change from batch to
batch (variable sequence length; bf16 under autocast). So every tensor travels after a fixed-size
header: ``[ndim, dtype code, *shape]`` as int64. Sends are non-blocking, receives block: with every
stage sending before it waits, no schedule can deadlock on a send. A send's handle and buffer are kept
until it completes, which can be a step later: without a flush (``async``) the receiver of the last
gradients of a batch posts its receive in the next step. Tensors go through host memory when the backend is gloo (gloo cannot send CUDA tensors).

Small Python objects (what the last stage logged) go on their own ``tag``, so they never mix with the
activation and gradient traffic between the same two ranks; a stage can read them a step later.
"""

from __future__ import annotations

import pickle
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["PeerLink", "MAX_DIMS", "OBJECT_TAG"]

MAX_DIMS = 8
OBJECT_TAG = 7  # the channel for pickled objects; activations and gradients use tag 0
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool, torch.uint8]


class PeerLink:
    """Sends to / receives from fixed global ranks; keeps send handles alive until ``wait_sends``."""

    def __init__(self, device: torch.device, group: Optional[dist.ProcessGroup] = None) -> None:
        self.device = device
        self.group = group
        self.via_host = device.type != "cpu" and dist.get_backend(group) == "gloo"
        self._pending: list[tuple[dist.Work, Tensor]] = []

    def send(self, activation: Union[Tensor, tuple[Tensor, ...]], dst: int, tag: int = 0) -> None:
        """Send a tensor or a tuple of tensors (a count header says which)."""
        is_tuple = isinstance(activation, (tuple, list))
        tensors = list(activation) if is_tuple else [activation]
        self._send_raw(torch.tensor([len(tensors), int(is_tuple)], dtype=torch.int64), dst, tag)
        for t in tensors:
            self._send_tensor(t, dst, tag)

    def recv(self, src: int, tag: int = 0) -> Union[Tensor, tuple[Tensor, ...]]:
        count = torch.empty(2, dtype=torch.int64, device="cpu" if self.via_host else self.device)
        dist.recv(count, src, group=self.group, tag=tag)
        n, is_tuple = (int(v) for v in count.cpu())
        tensors = tuple(self._recv_tensor(src, tag) for _ in range(n))
        return tensors if is_tuple else tensors[0]

    def send_object(self, obj: Any, dst: int) -> None:
        """Send a picklable object on the object channel (non-blocking, like every send)."""
        self.send(torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8), dst, OBJECT_TAG)

    def recv_object(self, src: int) -> Any:
        return pickle.loads(self.recv(src, OBJECT_TAG).cpu().numpy().tobytes())

    def _send_raw(self, header: Tensor, dst: int, tag: int) -> None:
        header = header if self.via_host else header.to(self.device)
        self._pending.append((dist.isend(header, dst, group=self.group, tag=tag), header))

    def _send_tensor(self, tensor: Tensor, dst: int, tag: int) -> None:
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
            self._pending.append((dist.isend(t, dst, group=self.group, tag=tag), t))

    def _recv_tensor(self, src: int, tag: int) -> Tensor:
        header = torch.empty(MAX_DIMS + 2, dtype=torch.int64, device="cpu" if self.via_host else self.device)
        dist.recv(header, src, group=self.group, tag=tag)
        header = header.cpu()
        shape = tuple(int(s) for s in header[2 : 2 + int(header[0])])
        buffer = torch.empty(shape, dtype=_DTYPES[int(header[1])], device="cpu" if self.via_host else self.device)
        dist.recv(buffer, src, group=self.group, tag=tag)
        return buffer.to(self.device)

    def wait_sends(self) -> None:
        """Block until every send has left. Only safe where every receiver is known to post its receive
        before waiting on this rank (a flushed pipeline): a send's receiver may be a step behind."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    def forget_finished_sends(self) -> None:
        """Drop the handles (and buffers) of the sends that have completed; keep the others pending."""
        self._pending = [(work, t) for work, t in self._pending if not work.is_completed()]
