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
