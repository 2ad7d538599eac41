import pytest

from lightning_parallel.distributed.mesh import MeshShape


@pytest.mark.parametrize("dp,pp,tp", [(2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 2, 2), (2, 1, 2), (2, 2, 2)])
def test_coordinates_round_trip_and_groups_partition_the_world(dp, pp, tp):
    shape = MeshShape(dp=dp, pp=pp, tp=tp)
    for rank in range(shape.world_size):
        assert shape.rank(*shape.coordinates(rank)) == rank
    for axis in ("dp", "pp", "tp"):
        groups = shape.all_axis_groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(shape.world_size))
        assert all(len(g) == getattr(shape, axis) for g in groups)


def test_tensor_parallel_peers_are_neighbours():
    shape = MeshShape(dp=2, pp=1, tp=2)
    assert shape.all_axis_groups("tp") == [[0, 1], [2, 3]]
    assert shape.all_axis_groups("dp") == [[0, 2], [1, 3]]


def test_expert_axes_divide_the_data_parallel_axis():
    """ep neighbouring dp indices exchange tokens; the dp indices holding the same experts average them;
    an ep group with its pp x tp ranks holds one model once."""
    shape = MeshShape(dp=4, pp=1, tp=2, ep=2)  # ranks: dp index = rank // 2, tp index = rank % 2
    assert shape.all_axis_groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.all_axis_groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert shape.all_axis_groups("ep_model") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [shape.size(a) for a in ("ep", "edp", "ep_model")] == [2, 2, 4]
    for axis in ("ep", "edp", "ep_model"):
        groups = shape.all_axis_groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(shape.world_size))


def test_hsdp_axes_divide_the_data_parallel_axis():
    """HSDP: neighbouring dp indices form a shard group (one node's ranks when the shard size is the devices
    per node), the same place of every shard group a replica group; without a shard size, the shard group is
    the whole dp axis."""
    shape = MeshShape(dp=4, tp=2, dp_shard=2)  # dp index = rank // 2
    assert shape.replicates_shards
    assert shape.all_axis_groups("dp_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.all_axis_groups("dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert MeshShape(dp=8, dp_shard=4).all_axis_groups("dp_shard") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert MeshShape(dp=8, dp_shard=4).all_axis_groups("dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    whole = MeshShape(dp=4)
    assert not whole.replicates_shards and whole.all_axis_groups("dp_shard") == whole.all_axis_groups("dp")
