"""The suite's guard against XLA's memory mappings (tests/conftest.py): every kernel of a compiled CPU
program stays mapped while the program lives, and a process at vm.max_map_count crashes in XLA's next
compile. The guard's release must unmap them while the jitted functions themselves stay alive (the
suite keeps those in lru_caches)."""

import sys

import jax
import jax.numpy as jnp
import pytest

from tests.conftest import memory_map_count, memory_map_limit, release_compiled_programs_over

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or memory_map_limit() is None,
                                reason="counts /proc/self/maps")


def _many_kernels(x):
    for step in range(8):  # each cumsum / sort is a kernel of its own
        x = jnp.sort(jnp.cumsum(x * (step + 1), axis=0), axis=1)
    return x


def test_release_unmaps_the_kernels_of_live_jitted_functions():
    x = jnp.ones((8, 16))
    jax.jit(lambda a: a + 1)(x).block_until_ready()  # XLA's threads and runtime are mapped before counting
    before = memory_map_count()
    kept = jax.jit(_many_kernels)
    kept(x).block_until_ready()
    compiled = memory_map_count()
    assert compiled > before + 8, (before, compiled)
    assert not release_compiled_programs_over(compiled + 1000)  # under the threshold: nothing released
    assert release_compiled_programs_over(0)
    released = memory_map_count()
    assert released < compiled - 8, (before, compiled, released)
    assert kept(x).shape == x.shape  # the function still runs (recompiled)
