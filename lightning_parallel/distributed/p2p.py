"""Point-to-point transfer of activations and their gradients between pipeline stages.

An activation is one tensor or a tuple of them. A receiver cannot allocate a buffer without knowing
shape and dtype, and both can change from batch to batch (variable sequence length; bf16 under
autocast). So every transfer starts with one fixed-size int64 header describing all its tensors,
``[count, is_tuple, (ndim, dtype code, *shape) per tensor]``, followed by the tensors themselves: a
single tensor costs two messages, and on a loaded CPU every message counts. Sends are non-blocking,
receives block: with every stage sending before it waits, no schedule can deadlock on a send. A send's
handle and buffer are kept until it completes, which can be a step later: without a flush (``async``)
the receiver of the last gradients of a batch posts its receive in the next step. Tensors go through
host memory when the backend is gloo (gloo cannot send CUDA tensors).

Small Python objects (what the last stage logged) go on their own ``tag``, so they never mix with the
activation and gradient traffic between the same two ranks; a stage can read them a step later.
"""

from __future__ import annotations

import pickle
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["PeerLink", "MAX_DIMS", "MAX_TENSORS", "OBJECT_TAG"]

MAX_DIMS = 8
MAX_TENSORS = 8  # elements of a tuple crossing a stage boundary
OBJECT_TAG = 7  # the channel for pickled objects; activations and gradients use tag 0
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool, torch.uint8]
_SLOT = MAX_DIMS + 2  # header words per tensor
_HEADER = 2 + MAX_TENSORS * _SLOT


def encode_header(tensors: list[Tensor], is_tuple: bool) -> Tensor:
    """The int64 header that lets the receiver allocate every buffer of the transfer."""
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"can send at most {MAX_TENSORS} tensors across a stage boundary, got a tuple of {len(tensors)}")
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = len(tensors), int(is_tuple)
    for i, t in enumerate(tensors):
        if t.dim() > MAX_DIMS:
            raise ValueError(f"can send tensors of at most {MAX_DIMS} dimensions, got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise ValueError(f"cannot send dtype {t.dtype} across a stage boundary; supported: {_DTYPES}")
        slot = 2 + i * _SLOT
        header[slot], header[slot + 1] = t.dim(), _DTYPES.index(t.dtype)
        header[slot + 2 : slot + 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return header


def decode_header(header: Tensor) -> tuple[list[tuple[tuple[int, ...], torch.dtype]], bool]:
    """(shape, dtype) of each tensor of the transfer, and whether it is a tuple."""
    values = header.tolist()
    specs = []
    for i in range(values[0]):
        slot = 2 + i * _SLOT
        ndim = values[slot]
        specs.append((tuple(values[slot + 2 : slot + 2 + ndim]), _DTYPES[values[slot + 1]]))
    return specs, bool(values[1])


class PeerLink:
    """Sends to / receives from fixed global ranks; keeps send handles alive until they complete."""

    def __init__(self, device: torch.device, group: Optional[dist.ProcessGroup] = None) -> None:
        self.device = device
        self.group = group
        self.via_host = device.type != "cpu" and dist.get_backend(group) == "gloo"
        self._wire = torch.device("cpu") if self.via_host else device
        self._pending: list[tuple[dist.Work, Tensor]] = []
        self._posted: dict[tuple[int, int], tuple[dist.Work, Tensor]] = {}  # early header receives

    def send(self, activation: Union[Tensor, tuple[Tensor, ...]], dst: int, tag: int = 0) -> None:
        """Send a tensor or a tuple of tensors: one header, then each tensor."""
        is_tuple = isinstance(activation, (tuple, list))
        tensors = list(activation) if is_tuple else [activation]
        header = encode_header(tensors, is_tuple)
        for t in [header] + [t.detach().contiguous() for t in tensors]:
            t = t.to(self._wire)
            self._pending.append((dist.isend(t, dst, group=self.group, tag=tag), t))

    def post_header_recv(self, src: int, tag: int = 0) -> None:
        """Post the receive of the next transfer's header from ``src`` now, so the sender's data can flow
        as soon as it is sent (gloo writes only into a posted receive). Only where a transfer from ``src``
        is sure to come: the receive cannot be taken back."""
        if (src, tag) not in self._posted:
            header = torch.empty(_HEADER, dtype=torch.int64, device=self._wire)
            self._posted[(src, tag)] = (dist.irecv(header, src, group=self.group, tag=tag), header)

    def recv(self, src: int, tag: int = 0) -> Union[Tensor, tuple[Tensor, ...]]:
        if (src, tag) in self._posted:
            work, header = self._posted.pop((src, tag))
            work.wait()
        else:
            header = torch.empty(_HEADER, dtype=torch.int64, device=self._wire)
            dist.recv(header, src, group=self.group, tag=tag)
        specs, is_tuple = decode_header(header.cpu())
        tensors = []
        for shape, dtype in specs:
            buffer = torch.empty(shape, dtype=dtype, device=self._wire)
            dist.recv(buffer, src, group=self.group, tag=tag)
            tensors.append(buffer.to(self.device))
        return tuple(tensors) if is_tuple else tensors[0]

    def send_object(self, obj: Any, dst: int) -> None:
        """Send a picklable object on the object channel (non-blocking, like every send)."""
        self.send(torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8), dst, OBJECT_TAG)

    def recv_object(self, src: int) -> Any:
        return pickle.loads(self.recv(src, OBJECT_TAG).cpu().numpy().tobytes())

    def wait_sends(self) -> None:
        """Block until every send has left. Only safe where every receiver is known to post its receive
        before waiting on this rank (a flushed pipeline): a send's receiver may be a step behind."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    def forget_finished_sends(self) -> None:
        """Drop the handles (and buffers) of the sends that have completed; keep the others pending."""
        self._pending = [(work, t) for work, t in self._pending if not work.is_completed()]
