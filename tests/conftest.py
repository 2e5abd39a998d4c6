import os

# JAX reads this once, at import: give the CPU enough host devices for multi-device tests.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def gloo_pools():
    """``gloo_pools(world_size)`` -> a live GlooPool, one per world size for the whole session."""
    from tests.gloo_pool import GlooPool

    pools: dict[int, GlooPool] = {}

    def get(world_size: int) -> GlooPool:
        if world_size not in pools:
            pools[world_size] = GlooPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` where no CUDA device is present."""
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
