import pytest
import torch

from lightning_parallel.distributed.buckets import MB, assign_buckets


def params(*numels, dtype=torch.float32):
    return [torch.empty(n, dtype=dtype) for n in numels]


def test_first_bucket_is_small_and_the_rest_fill_to_the_cap():
    quarter_mb = MB // 4 // 4  # float32 elements in 0.25 MB
    ps = params(*[quarter_mb] * 12)
    buckets = assign_buckets(ps, bucket_cap_mb=1.0, first_bucket_cap_mb=0.5)
    assert buckets[0] == [0, 1]  # 0.5 MB
    assert buckets[1] == [2, 3, 4, 5]  # 1 MB
    assert sorted(i for b in buckets for i in b) == list(range(12))


def test_order_is_kept_and_large_parameters_get_their_own_bucket():
    ps = params(10, MB, 10)
    buckets = assign_buckets(ps, bucket_cap_mb=1.0, first_bucket_cap_mb=1.0)
    assert buckets == [[0, 1], [2]]


def test_dtypes_never_share_a_buffer():
    ps = params(4, 4) + params(4, dtype=torch.float64)
    buckets = assign_buckets(ps, bucket_cap_mb=25, first_bucket_cap_mb=1)
    for b in buckets:
        assert len({ps[i].dtype for i in b}) == 1


def test_bad_cap_is_refused_with_the_value():
    with pytest.raises(ValueError, match="bucket_cap_mb must be > 0, got -1"):
        assign_buckets(params(4), bucket_cap_mb=-1, first_bucket_cap_mb=1)
