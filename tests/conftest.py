import os

# JAX reads this once, at import: give the CPU enough host devices for multi-device tests, and have XLA
# compile the (tiny) test programs without LLVM's expensive optimisations. Compiling is most of a JAX
# test's time on CI's 2 cores; at optimisation level 0 the suite's programs compile in about 2/3 of the
# CPU time (tests/jax_api/test_gdp_cp.py: 173 -> 113 s) and run on arrays small enough that slower code
# costs nothing measurable. The flags change code generation only, never the HLO the library emits;
# subprocesses the tests start inherit them (tests.conftest.child_xla_flags for those that set their own).
# Set XLA_FLAGS yourself to run the tests under other flags.
FAST_COMPILE_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
os.environ.setdefault("XLA_FLAGS", " ".join(("--xla_force_host_platform_device_count=8", *FAST_COMPILE_XLA_FLAGS)))


def child_xla_flags(device_count: int) -> str:
    """XLA_FLAGS for a child process with ``device_count`` host devices and this session's other flags."""
    kept = [flag for flag in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in flag]
    return " ".join([f"--xla_force_host_platform_device_count={device_count}", *kept])

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
