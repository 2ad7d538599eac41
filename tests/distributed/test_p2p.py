"""The transfers between pipeline stages: the header and the one-message packing keep every shape and
dtype a stage may send (what cannot travel is named), and on 2 real gloo processes a stream of
transfers whose shapes change, with receives posted early at the predicted size, arrives intact.
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
from tests.helpers.harness import REPO, run_processes, worker_env

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
    from lightning_parallel.distributed.p2p import PeerLink

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, link = dist.get_rank(), PeerLink(torch.device("cpu"))
    expected = transfers()
    if rank == 0:
        for x in expected:
            link.send(x, 1)
        link.send_object({"loss": 1.5}, 1)
        link.send_object({"loss": 2.5, "acc": [1, 2, 3]}, 1)
        assert torch.equal(link.recv(1), torch.tensor([42.0]))
        link.wait_sends()
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
        assert link.recv_object(0) == {"loss": 1.5}
        assert link.recv_object(0) == {"loss": 2.5, "acc": [1, 2, 3]}
        link.send(torch.tensor([42.0]), 0)
        link.wait_sends()
    (out / f"ok{rank}").write_text("ok")
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_changing_shapes_arrive_intact_on_two_processes(tmp_path):
    cmd = [sys.executable, "-m", "tests.distributed.test_p2p", str(tmp_path)]
    run_processes([cmd, cmd], [worker_env(r, 2) for r in range(2)], timeout=90, cwd=tmp_path, rendezvous=True)
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()


if __name__ == "__main__":
    os.chdir(REPO)
    rank_program(Path(sys.argv[1]))
