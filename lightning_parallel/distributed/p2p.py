"""Point-to-point transfer of activations and their gradients between pipeline stages.

An activation is one tensor or a tuple of tensors and None (a block's ``(hidden, None)``). A receiver
cannot allocate a buffer without knowing shape and dtype, and both can change from batch to batch
(variable sequence length; bf16 under autocast). So every transfer carries a fixed-size int64 header
describing all its tensors, ``[count, is_tuple, follow, nones, (ndim, dtype code, *shape) per tensor]``
(``nones``: a bit per tuple position that holds None), packed with the tensors' bytes into one message:
on a loaded CPU every message and every round trip counts.

gloo writes data only into a posted receive of exactly the sent size; a receive posted after the send
costs a round trip (the receiver says it is ready, then the data flows). To post receives early, both
ends predict a message's size: the size of the previous message between the same two ranks on the
same stream, which both know. Shapes rarely change, so the prediction is nearly always right. When it is
wrong, the sender first sends a stand-in of the predicted size whose only content is ``follow`` = the
real message's size, then the real message::

    predicted size right:  [header | tensor bytes]                  one message
    predicted size wrong:  [follow=N | unused]         [header | tensor bytes (N bytes)]

Sends are non-blocking, receives block: with every stage sending before it waits, no schedule can
deadlock on a send. A send's handle and buffer are kept until it completes, which can be a step later:
without a flush (``async``) the receiver of the last gradients of a batch posts its receive in the next
step. Tensors go through host memory when the backend is gloo (gloo cannot send CUDA tensors).

A link's streams (a pipeline's: the activations or gradients crossing one boundary) are kept apart by
process group, not by tag: NCCL ignores tags and matches the messages between two ranks in the order
they were posted on one communicator. ``channels`` gives the group of each stream (others go on
``group``), and every message of a link travels with the link's one ``tag``; two streams between the same
two ranks, in the same direction, must not share a group (``pipeline/channels.py`` sees to that).

Small Python objects (what the last stage logged) go on a link of their own, with tag ``OBJECT_TAG``: on
gloo it shares the default group with a pipeline's channel 0 and is kept apart by that tag; on NCCL it is a
gloo group of its own (pickled bytes stay on the CPU). A stage can read them a step later.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "PeerLink",
    "MAX_DIMS",
    "MAX_TENSORS",
    "OBJECT_TAG",
    "encode_header",
    "decode_header",
    "pack",
    "unpack",
]

Activation = Union[Tensor, tuple[Optional[Tensor], ...]]  # what crosses a stage boundary
MAX_DIMS = 8
MAX_TENSORS = 8  # elements of a tuple crossing a stage boundary
#: the tag of the link that carries pickled objects (a pipeline's links use tag 0)
OBJECT_TAG = 1 << 20
_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
]
_COUNT, _IS_TUPLE, _FOLLOW, _NONES, _FIRST_SLOT = 0, 1, 2, 3, 4  # the header's words
MAX_ITEMS = 62  # positions of a tuple that the ``nones`` word can mark
_SLOT = MAX_DIMS + 2  # header words per tensor: ndim, dtype code, shape
_HEADER = _FIRST_SLOT + MAX_TENSORS * _SLOT
HEADER_BYTES = _HEADER * 8
_ALIGN = 8  # every tensor starts at a multiple of this many bytes, so it can be viewed in its own dtype


def encode_header(
    tensors: list[Tensor], is_tuple: bool, follow: int = 0, nones: Sequence[int] = ()
) -> Tensor:
    """The int64 header that lets the receiver allocate every buffer of the transfer (``nones``: the
    tuple positions that hold None). Built as a Python list and turned into a tensor once: a dozen small
    tensor writes took 63 us, this 17 us (on the CPU)."""
    if len(tensors) > MAX_TENSORS:
        raise ValueError(
            f"can send at most {MAX_TENSORS} tensors across a stage boundary, got a tuple of {len(tensors)}"
        )
    if any(i >= MAX_ITEMS for i in nones):
        raise ValueError(f"can send None only in the first {MAX_ITEMS} places of a tuple, got {max(nones)}")
    words = [0] * _HEADER
    words[_COUNT], words[_IS_TUPLE], words[_FOLLOW] = len(tensors), int(is_tuple), follow
    words[_NONES] = sum(1 << i for i in nones)
    for i, t in enumerate(tensors):
        if t.dim() > MAX_DIMS:
            raise ValueError(f"can send tensors of at most {MAX_DIMS} dimensions, got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise ValueError(f"cannot send dtype {t.dtype} across a stage boundary; supported: {_DTYPES}")
        slot = _FIRST_SLOT + i * _SLOT
        words[slot], words[slot + 1] = t.dim(), _DTYPES.index(t.dtype)
        words[slot + 2 : slot + 2 + t.dim()] = t.shape
    return torch.tensor(words, dtype=torch.int64)


def decode_header(header: Tensor) -> tuple[list[tuple[tuple[int, ...], torch.dtype]], bool, int, list[int]]:
    """(shape, dtype) of each tensor of the transfer, whether it is a tuple, ``follow`` (the size of
    the message that really holds the tensors, when this one could not), and the tuple positions of None."""
    values = header.tolist()
    specs = []
    for i in range(values[_COUNT]):
        slot = _FIRST_SLOT + i * _SLOT
        ndim = values[slot]
        specs.append((tuple(values[slot + 2 : slot + 2 + ndim]), _DTYPES[values[slot + 1]]))
    nones = [i for i in range(MAX_ITEMS) if values[_NONES] >> i & 1]
    return specs, bool(values[_IS_TUPLE]), values[_FOLLOW], nones


def _header_of(message: Tensor) -> Tensor:
    return message[:HEADER_BYTES].view(torch.int64)


def _layout(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> tuple[int, list[slice]]:
    """The message size, and where each tensor's bytes lie in it (after the header, each aligned)."""
    places, offset = [], HEADER_BYTES
    for shape, dtype in specs:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        places.append(slice(offset, offset + nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return offset, places


def _message(header: Tensor, size: int, device: torch.device) -> Tensor:
    """A uint8 message of ``size`` bytes that starts with ``header`` (the bytes after it are left as they
    are: the receiver reads only what the header describes)."""
    message = torch.empty(size, dtype=torch.uint8, device=device)
    _header_of(message).copy_(header)
    return message


def pack(items: list[Optional[Tensor]], is_tuple: bool, device: torch.device) -> Tensor:
    """One uint8 message on ``device``: the header, then each tensor's bytes (aligned); None items are
    marked in the header."""
    tensors = [t for t in items if t is not None]
    size, places = _layout([(tuple(t.shape), t.dtype) for t in tensors])
    nones = [i for i, t in enumerate(items) if t is None]
    message = _message(encode_header(tensors, is_tuple, nones=nones), size, device)
    for t, place in zip(tensors, places):
        message[place].view(t.dtype).copy_(t.detach().reshape(-1))
    return message


def unpack(message: Tensor, device: torch.device, header: Optional[tuple] = None) -> Activation:
    """The tensors of a ``pack``-ed message, each in memory of its own on ``device`` (``header``: the
    message's header already decoded)."""
    specs, is_tuple, _, nones = header or decode_header(_header_of(message))
    _, places = _layout(specs)
    tensors = [
        message[place].view(dtype).view(shape).to(device, copy=True)
        for (shape, dtype), place in zip(specs, places)
    ]
    if not is_tuple:
        return tensors[0]
    given = iter(tensors)
    return tuple(None if i in nones else next(given) for i in range(len(tensors) + len(nones)))


class PeerLink:
    """Sends to / receives from fixed global ranks on numbered streams; keeps send handles alive until
    they complete. ``channels``: the process group of each stream that does not go on ``group``; ``tag``:
    the tag of every message (streams are never told apart by it)."""

    def __init__(
        self,
        device: torch.device,
        group: Optional[dist.ProcessGroup] = None,
        channels: Optional[Mapping[int, dist.ProcessGroup]] = None,
        tag: int = 0,
    ) -> None:
        self.device, self.group, self.tag = device, group, tag
        self.channels = dict(channels or {})
        self.via_host = device.type != "cpu" and dist.get_backend(group) == "gloo"
        self._wire = torch.device("cpu") if self.via_host else device
        self._pending: list[tuple[dist.Work, Tensor]] = []
        self._posted: dict[tuple[int, int], tuple[dist.Work, Tensor]] = {}  # receives posted early
        self._predicted: dict[
            tuple[str, int, int], int
        ] = {}  # ("send"|"recv", peer, stream) -> next message size

    def _group(self, stream: int) -> Optional[dist.ProcessGroup]:
        return self.channels.get(stream, self.group)

    def send(self, activation: Activation, dst: int, stream: int = 0) -> None:
        """Send a tensor or a tuple of tensors and None, as one message when its size is the predicted one."""
        is_tuple = isinstance(activation, (tuple, list))
        message = pack(list(activation) if is_tuple else [activation], is_tuple, self._wire)
        key = ("send", dst, stream)
        predicted = self._predicted.get(key, HEADER_BYTES)
        if message.numel() != predicted:
            stand_in = _message(encode_header([], False, follow=message.numel()), predicted, self._wire)
            self._isend(stand_in, dst, stream)
            self._predicted[key] = message.numel()
        self._isend(message, dst, stream)

    def _isend(self, message: Tensor, dst: int, stream: int) -> None:
        work = dist.isend(message, dst, group=self._group(stream), tag=self.tag)
        self._pending.append((work, message))

    def post_recv(self, src: int, stream: int = 0) -> None:
        """Post the receive of the next message from ``src`` on ``stream`` now, at its predicted size, so
        the sender's data can flow as soon as it is sent. Only where a transfer from ``src`` is sure to
        come: the receive cannot be taken back."""
        if (src, stream) not in self._posted:
            size = self._predicted.get(("recv", src, stream), HEADER_BYTES)
            message = torch.empty(size, dtype=torch.uint8, device=self._wire)
            work = dist.irecv(message, src, group=self._group(stream), tag=self.tag)
            self._posted[(src, stream)] = (work, message)

    def recv(self, src: int, stream: int = 0) -> Activation:
        self.post_recv(src, stream)
        work, message = self._posted.pop((src, stream))
        work.wait()
        header = decode_header(_header_of(message))
        follow = header[2]
        if follow:
            self._predicted[("recv", src, stream)] = follow
            message = torch.empty(follow, dtype=torch.uint8, device=self._wire)
            dist.recv(message, src, group=self._group(stream), tag=self.tag)
            header = decode_header(_header_of(message))
        return unpack(message, self.device, header)

    def send_object(self, obj: Any, dst: int) -> None:
        """Send a picklable object (non-blocking, like every send) on stream ``OBJECT_TAG``."""
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
