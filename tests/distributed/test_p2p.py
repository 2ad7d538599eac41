"""The transfer header: every shape and dtype a stage may send survives it; what cannot is named.
(The transfers themselves run on real processes in tests/strategies/test_pipeline.py.)"""

import pytest
import torch

from lightning_parallel.distributed.p2p import MAX_TENSORS, decode_header, encode_header


@pytest.mark.parametrize("tensors,is_tuple", [
    ([torch.zeros(4, 64, 128)], False),
    ([torch.zeros((), dtype=torch.float64)], False),
    ([torch.zeros(2, 3, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.int64), torch.zeros(1, 1, 1, dtype=torch.bool)], True),
    ([torch.zeros(0, 7, dtype=torch.float16)], True),
])
def test_header_round_trip(tensors, is_tuple):
    specs, tuple_flag = decode_header(encode_header(tensors, is_tuple))
    assert tuple_flag == is_tuple
    assert specs == [(tuple(t.shape), t.dtype) for t in tensors]


def test_what_cannot_travel_is_named():
    with pytest.raises(ValueError, match=f"at most {MAX_TENSORS} tensors"):
        encode_header([torch.zeros(1)] * (MAX_TENSORS + 1), True)
    with pytest.raises(ValueError, match="at most 8 dimensions"):
        encode_header([torch.zeros([1] * 9)], False)
    with pytest.raises(ValueError, match="complex64"):
        encode_header([torch.zeros(2, dtype=torch.complex64)], False)
