import pytest
import torch.distributed as dist

from torch_api._dist import agree_or_raise, resolve_group


def agree_with_rank_specific_input(rank, world_size, bad_rank, signature_rank):
    error = "bad shape" if rank == bad_rank else None
    signature = [3, 4 + (rank == signature_rank)]
    try:
        agree_or_raise(dist.group.WORLD, error, signature, what="test inputs")
    except ValueError as err:
        return str(err)
    return "ok"


@pytest.mark.parametrize("world_size", [2, 3])
def test_agreement_raises_the_same_message_on_every_rank(gloo_pools, world_size):
    pool = gloo_pools(world_size)
    assert pool.run(agree_with_rank_specific_input, -1, -1) == ["ok"] * world_size
    failed = pool.run(agree_with_rank_specific_input, 1, -1)
    assert len(set(failed)) == 1 and "rank 1: bad shape" in failed[0]
    disagree = pool.run(agree_with_rank_specific_input, -1, 0)
    assert len(set(disagree)) == 1 and "disagree across ranks" in disagree[0]


def resolve_mesh(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    return dist.get_world_size(resolve_group(mesh))


def test_resolve_group_accepts_a_1d_device_mesh(gloo_pools):
    assert gloo_pools(2).run(resolve_mesh) == [2, 2]


def test_resolve_group_rejects_other_objects():
    with pytest.raises(ValueError, match="ProcessGroup or a 1-D DeviceMesh"):
        resolve_group("world")
