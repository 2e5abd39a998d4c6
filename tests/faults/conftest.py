import pytest


@pytest.fixture(scope="session")
def fault_pools():
    """``fault_pools(world_size)`` -> a GlooPool whose collectives time out after 20 s (a hang fails fast)."""
    from tests.gloo_pool import GlooPool

    pools: dict[int, GlooPool] = {}

    def get(world_size: int) -> GlooPool:
        if world_size not in pools:
            pools[world_size] = GlooPool(world_size, collective_timeout_s=20)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()
