import gc
import os
import sys

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

# XLA's CPU client maps each kernel of a compiled program as three memory mappings of its own (code,
# constants, data: a jit(value_and_grad) of CP GDP holds about 600) for as long as the program lives, and
# this process keeps its programs alive (jitted module functions, lru_cache'd compiled functions shared
# between files). The suite's programs outgrow the kernel's limit on mappings per process
# (vm.max_map_count, 65530 by default): the fresh-clone suite reached it at tests/parity, where XLA's next
# compile failed ("LLVM compilation error: Cannot allocate memory") and the C++ exception carrying that
# error faulted in libgcc's unwinder (an abort, or a deadlock in tvm_ffi's SIGSEGV handler). So after a
# test, once the process holds more than this share of the limit, JAX's compiled programs are released
# (jax.clear_caches(); later tests recompile what they use again).
MAP_SHARE_BEFORE_RELEASE = 0.5


def memory_map_limit() -> int | None:
    """vm.max_map_count (None off Linux)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def memory_map_count() -> int:
    """The number of memory mappings of this process (/proc/self/maps: one line each)."""
    with open("/proc/self/maps", "rb") as f:
        return f.read().count(b"\n")


def release_compiled_programs_over(threshold: int) -> bool:
    """Release JAX's compiled programs (jax.clear_caches) if this process holds more than ``threshold``
    memory mappings; True if it did."""
    jax = sys.modules.get("jax")
    if jax is None or memory_map_count() <= threshold:
        return False
    jax.clear_caches()
    gc.collect()
    return True


_MAP_LIMIT = memory_map_limit()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if _MAP_LIMIT is not None:
        release_compiled_programs_over(int(_MAP_LIMIT * MAP_SHARE_BEFORE_RELEASE))


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
