"""The transfers between pipeline stages: the header and the one-message packing keep every shape and
dtype a stage may send (what cannot travel is named), and on 2 real gloo processes a stream of
transfers whose shapes change, with receives posted early at the predicted size, arrives intact, and
streams on channels (groups) of their own are matched apart with every tag equal, as NCCL needs.
(The pipeline's own use of them runs in tests/strategies/test_pipeline.py.)"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_parallel.distributed.p2p import (
    HEADER_BYTES,
    MAX_TENSORS,
    decode_header,
    encode_header,
    pack,
    unpack,
)
from tests.helpers.harness import REPO, run_program

SHAPES = [
    ([torch.zeros(4, 64, 128)], False),
    ([torch.zeros((), dtype=torch.float64)], False),
    (
        [
            torch.zeros(2, 3, dtype=torch.bfloat16),
            torch.zeros(5, dtype=torch.int64),
            torch.zeros(1, 1, 1, dtype=torch.bool),
        ],
        True,
    ),
    ([torch.zeros(0, 7, dtype=torch.float16)], True),
]


@pytest.mark.parametrize("tensors,is_tuple", SHAPES)
def test_header_round_trip(tensors, is_tuple):
    specs, tuple_flag, follow, nones = decode_header(encode_header(tensors, is_tuple, follow=123))
    assert tuple_flag == is_tuple and follow == 123 and nones == []
    assert specs == [(tuple(t.shape), t.dtype) for t in tensors]


@pytest.mark.parametrize("tensors,is_tuple", SHAPES)
def test_pack_round_trip_keeps_values_and_gives_each_tensor_its_own_memory(tensors, is_tuple):
    tensors = [
        torch.randn(t.shape).to(t.dtype) if t.is_floating_point() else torch.ones(t.shape, dtype=t.dtype)
        for t in tensors
    ]
    message = pack(tensors, is_tuple, torch.device("cpu"))
    assert message.dtype == torch.uint8 and message.numel() % 8 == 0 and message.numel() >= HEADER_BYTES
    back = unpack(message, torch.device("cpu"))
    back = list(back) if is_tuple else [back]
    assert isinstance(unpack(message, torch.device("cpu")), tuple) == is_tuple
    for sent, got in zip(tensors, back):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got, sent)
        assert got.untyped_storage().data_ptr() != message.untyped_storage().data_ptr()


def test_a_tuple_with_none_arrives_with_none_in_its_places():
    """A Hugging Face block returns ``(hidden, None)``: the None crosses in the header, in its place."""
    hidden, mask = torch.randn(2, 3), torch.ones(2, dtype=torch.bool)
    back = unpack(pack([None, hidden, None, mask, None], True, torch.device("cpu")), torch.device("cpu"))
    assert len(back) == 5 and back[0] is None and back[2] is None and back[4] is None
    assert torch.equal(back[1], hidden) and torch.equal(back[3], mask)


def test_what_cannot_travel_is_named():
    with pytest.raises(ValueError, match=f"at most {MAX_TENSORS} tensors"):
        encode_header([torch.zeros(1)] * (MAX_TENSORS + 1), True)
    with pytest.raises(ValueError, match="at most 8 dimensions"):
        encode_header([torch.zeros([1] * 9)], False)
    with pytest.raises(ValueError, match="complex64"):
        encode_header([torch.zeros(2, dtype=torch.complex64)], False)


def transfers() -> list:
    """What rank 0 sends: same shapes in a row (the predicted size is right), then changes of shape,
    dtype and tuple-ness (it is wrong)."""
    out = [torch.full((4, 8), float(i)) for i in range(3)]
    out += [torch.full((4, 9), 3.0), torch.full((4, 9), 4.0), torch.full((2, 9), 5.0, dtype=torch.float64)]
    out += [
        (torch.full((3,), 6.0), torch.arange(5)),
        (torch.full((3,), 7.0), torch.arange(5)),
        torch.zeros(0),
    ]
    return out


def rank_program(out: Path) -> None:
    from lightning_parallel.distributed.p2p import OBJECT_TAG, PeerLink

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, link = dist.get_rank(), PeerLink(torch.device("cpu"))
    objects = PeerLink(torch.device("cpu"), tag=OBJECT_TAG)  # as the pipeline's log mirror
    channels_program(out, rank)
    expected = transfers()
    if rank == 0:
        objects.send_object({"loss": 1.5}, 1)  # sent first, read last: kept apart by its tag
        objects.send_object({"loss": 2.5, "acc": [1, 2, 3]}, 1)
        for x in expected:
            link.send(x, 1)
        assert torch.equal(link.recv(1), torch.tensor([42.0]))
        link.wait_sends()
        objects.wait_sends()
    else:
        link.post_recv(0)  # posted before rank 0 sends anything, at the first prediction
        for i, want in enumerate(expected):
            got = link.recv(0)
            if i + 1 < len(expected):
                link.post_recv(0)  # the next one, as the executor does
            for w, g in zip(
                want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)
            ):
                assert g.dtype == w.dtype and torch.equal(g, w), (i, g, w)
            assert isinstance(got, tuple) == isinstance(want, tuple)
        assert objects.recv_object(0) == {"loss": 1.5}
        assert objects.recv_object(0) == {"loss": 2.5, "acc": [1, 2, 3]}
        link.send(torch.tensor([42.0]), 0)
        link.wait_sends()
    (out / f"ok{rank}").write_text("ok")
    dist.destroy_process_group()


def channels_program(out: Path, rank: int) -> None:
    """Rank 0 sends on streams 1 then 2, rank 1 reads stream 2 first, every message with tag 0 and of one
    size. On channels of their own (``channels``: a new group each) each read gets its own stream's
    message; on one group (``one_group``, the control) the first read takes the first message sent, so the
    values come swapped: tags do not keep them apart, as on NCCL."""
    from lightning_parallel.distributed.p2p import PeerLink

    groups = {1: dist.new_group([0, 1]), 2: dist.new_group([0, 1])}  # every rank, in one order
    for name, channels in (("channels", groups), ("one_group", {})):
        link = PeerLink(torch.device("cpu"), channels=channels)
        if rank == 0:
            link.send(torch.full((3,), 1.0), 1, stream=1)
            link.send(torch.full((3,), 2.0), 1, stream=2)
            link.wait_sends()
        else:
            second, first = link.recv(0, stream=2), link.recv(0, stream=1)
            (out / f"{name}.txt").write_text(f"{second[0].item()} {first[0].item()}")
        dist.barrier()


@pytest.mark.timeout(120)
def test_changing_shapes_arrive_intact_on_two_processes(p2p_run):
    assert (p2p_run / "ok0").exists() and (p2p_run / "ok1").exists()


@pytest.mark.timeout(120)
def test_streams_on_channels_of_their_own_are_matched_without_tags(p2p_run):
    """Stream 2 read before stream 1 gets stream 2's message on channels of their own (2.0, then 1.0);
    on one group, with one tag, it would get stream 1's (the control: 1.0, then 2.0)."""
    assert (p2p_run / "channels.txt").read_text() == "2.0 1.0"
    assert (p2p_run / "one_group.txt").read_text() == "1.0 2.0"


@pytest.fixture(scope="module")
def p2p_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("p2p")
    cmd = [sys.executable, "-m", "tests.distributed.test_p2p", str(tmp)]
    run_program(cmd, tmp, timeout=90)
    return tmp


if __name__ == "__main__":
    os.chdir(REPO)
    rank_program(Path(sys.argv[1]))
