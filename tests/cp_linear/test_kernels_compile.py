"""Every CuTeDSL GDP kernel compiles for sm_90a on a machine without a GPU (runs in CI).

Compiles through the CLI (``python -m cp_linear.kernels --compile --arch sm_90a
--check-tensor-cores --ci``) in a fresh process, two compile processes at a time, and checks that
every CI config (``configs.ci_configs``: each bfloat16 kernel variant at K = V = 128 and each kernel
once at K = 64) is listed as compiled and that the tensor-core kernels' PTX holds ``mma``
instructions. The configs left out differ only in element types and extents; ``./dev compile``
compiles all of them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (the cuda extra)")

from cp_linear.kernels import describe  # noqa: E402
from cp_linear.kernels.__main__ import TENSOR_CORE_CONFIGS  # noqa: E402
from cp_linear.kernels.configs import ci_configs  # noqa: E402


def test_import_of_kernels_package_loads_no_cutlass():
    code = ("import sys, cp_linear, cp_linear.kernels; "
            "bad = [m for m in ('cutlass', 'torch', 'jax') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.timeout(1800)
def test_every_kernel_config_compiles_for_sm90a_without_a_gpu():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, "-m", "cp_linear.kernels", "--compile", "--arch", "sm_90a", "--check-tensor-cores",
         "--ci", "--jobs", "2"],
        capture_output=True, text=True, timeout=1700, env=env)
    configs = ci_configs()
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    compiled = [line for line in result.stdout.splitlines() if line.startswith("ok ")]
    for config in configs:
        line = next((line for line in compiled if describe(config) in line), None)
        assert line is not None, f"{describe(config)} not compiled"
        if type(config) in TENSOR_CORE_CONFIGS:  # the others are SIMT by design (folds, checks, elementwise)
            assert "mma.sync" in line or "wgmma" in line, line
    assert f"{len(configs)} of {len(configs)} compiled" in result.stdout


def test_configs_are_hashable_cache_keys_and_reject_unsupported_sizes():
    from cp_linear.kernels import ChunkPrepConfig, ChunkScanConfig

    assert ChunkScanConfig("bfloat16", 128, 64, "output", 32) == ChunkScanConfig("bfloat16", 128, 64, "output", 32)
    assert len({ChunkScanConfig("bfloat16", 128, 64, "output", 32),
                ChunkScanConfig("bfloat16", 128, 128, "output", 32)}) == 2
    with pytest.raises(ValueError, match="key_dim must be one of"):
        ChunkScanConfig("bfloat16", 96, 64, "output", 32).validate()
    with pytest.raises(ValueError, match="dtype must be one of"):
        ChunkPrepConfig("float32", 64, 32).validate()
    with pytest.raises(ValueError, match="query_tile must be 0"):
        ChunkScanConfig("bfloat16", 64, 64, "summary", 32).validate()
    with pytest.raises(ValueError, match="row_block"):
        ChunkScanConfig("bfloat16", 64, 128, "output", 32, 128).validate()


def test_backward_split_configs_validate_and_every_launch_orders_its_arguments():
    """The states scan reads no queries; the gradient pass takes 64- or 128-row blocks of V; every launch
    lists inputs, then outputs, then scalars (what a JAX custom call needs), and the library holds each."""
    from cp_linear.kernels import configs as kcfg
    from cp_linear.kernels import launch as kl

    kcfg.ChunkScanConfig("bfloat16", 128, 128, "states").validate()
    with pytest.raises(ValueError, match="mode 'states' reads no queries"):
        kcfg.ChunkScanConfig("bfloat16", 128, 128, "states", 32).validate()
    assert kcfg.ChunkReverseScanConfig("bfloat16", 128, 128, 32).rows_per_cta == 64
    assert kcfg.ChunkReverseScanConfig("bfloat16", 128, 128, 32, 128).rows_per_cta == 128
    with pytest.raises(ValueError, match="row_block"):
        kcfg.ChunkReverseScanConfig("bfloat16", 128, 64, 32, 128).validate()
    for launch in kl.LAUNCHES.values():
        inputs, outputs, scalars = launch.argument_roles()
        assert set(outputs) == set(launch.OUTPUTS) and not set(inputs) & set(outputs)
    assert kl.ChunkReverseScanLaunch.argument_roles()[1] == ("chunk_grads", "grad_in")
    # the chunk states travel as [C, H, V·K] rows (both state modes), the outputs as [T, H, V]
    config = kcfg.ChunkScanConfig("bfloat16", 128, 64, "output_states", 32)
    config.validate()
    assert [kl._extent(config, "chunk_state_size"), kl._extent(config, "value_dim")] == [128 * 64, 64]
    assert kl.ChunkScanLaunch.argument_roles()[1] == ("state_out", "o", "chunk_states")
    with pytest.raises(ValueError, match="query_tile"):
        kcfg.ChunkScanConfig("bfloat16", 128, 128, "output_states", 0).validate()
    library = kcfg.all_configs()
    for dtype in kcfg.TENSOR_CORE_DTYPES:
        assert kcfg.ChunkReverseScanConfig(dtype, 128, 128, 32) in library
        mma = "wgmma" if dtype == "bfloat16" else "sync"
        assert kcfg.ChunkScanConfig(dtype, 128, 128, "states", 0, 64, mma) in library
        # every output config has its twin that keeps the chunk states
        outputs = [c for c in library if isinstance(c, kcfg.ChunkScanConfig) and c.mode == "output"]
        assert outputs and all(replace(c, mode="output_states") in library for c in outputs)


def test_backward_warpgroup_variants_are_chosen_where_compiled_and_map_to_their_kernels():
    """ChunkReverseConfig.mma "wgmma" (two warpgroups, 64 value rows each) exists only for V = 128: the
    config refuses other V, ``reverse_mma`` picks it there unless "sync" is asked for, the library holds
    it for every dtype, K and query tile, and ``kernel_class`` maps it to the separate kernel class. The
    gradient passes (ChunkGamma, ChunkReverseScan) have both kinds for every config."""
    from cp_linear.kernels import configs as kcfg
    from cp_linear.kernels import launch as kl

    with pytest.raises(ValueError, match="value_dim 128"):
        kcfg.ChunkReverseConfig("bfloat16", 128, 64, 32, "wgmma").validate()
    with pytest.raises(ValueError, match="mma must be one of"):
        kcfg.ChunkReverseConfig("bfloat16", 128, 128, 32, "tensor").validate()
    assert [kl.reverse_mma(requested, 128) for requested in ("auto", "wgmma", "sync")] == ["wgmma", "wgmma", "sync"]
    assert [kl.reverse_mma(requested, 64) for requested in ("auto", "wgmma", "sync")] == ["sync"] * 3
    library = kcfg.all_configs()
    wgmma = [c for c in library if isinstance(c, kcfg.ChunkReverseConfig) and c.mma == "wgmma"]
    assert {(c.dtype, c.key_dim, c.query_tile) for c in wgmma} == {
        (dtype, key_dim, tile) for dtype in kcfg.TENSOR_CORE_DTYPES for key_dim in kcfg.HEAD_DIMS
        for tile in kcfg.QUERY_TILES}
    assert all(c.value_dim == 128 for c in wgmma)
    # the sequential gradient passes: warpgroup MMAs for every config unless "sync" is asked for
    assert [kl.gradient_rows_mma(requested) for requested in ("auto", "wgmma", "sync")] == ["wgmma", "wgmma", "sync"]
    with pytest.raises(ValueError, match="mma must be one of"):
        kcfg.ChunkGammaConfig("bfloat16", 128, 128, 32, "tensor").validate()
    with pytest.raises(ValueError, match="mma must be one of"):
        kcfg.ChunkReverseScanConfig("bfloat16", 128, 128, 32, 0, "tensor").validate()
    for config_class in (kcfg.ChunkGammaConfig, kcfg.ChunkReverseScanConfig):
        kinds = {(c.dtype, c.key_dim, c.value_dim, c.query_tile, c.mma) for c in library if isinstance(c, config_class)}
        assert kinds == {(d, k, v, t, m) for d in kcfg.TENSOR_CORE_DTYPES for k in kcfg.HEAD_DIMS for v in kcfg.HEAD_DIMS
                         for t in kcfg.QUERY_TILES for m in kcfg.MMA_KINDS}
    # the dispatch (imports the kernel modules, which import CuTeDSL)
    pytest.importorskip("cutlass")
    assert kl.kernel_class(kcfg.ChunkReverseConfig("bfloat16", 128, 128, 32, "wgmma")).__name__ == \
        "ChunkReverseWgmmaKernel"
    assert kl.kernel_class(kcfg.ChunkReverseConfig("bfloat16", 128, 128, 32)).__name__ == "ChunkReverseKernel"
    assert kl.kernel_class(kcfg.ChunkScanConfig("bfloat16", 128, 128, "states", 0, 0, "wgmma")).__name__ == \
        "ChunkScanKernel"
