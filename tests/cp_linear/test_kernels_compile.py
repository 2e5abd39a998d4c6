"""Every CuTeDSL GDP kernel compiles for sm_90a on a machine without a GPU (runs in CI).

Compiles through the CLI (``python -m cp_linear.kernels --compile --arch sm_90a``) in a fresh
process, two compile processes at a time, and checks that every config is listed as compiled.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (the cuda extra)")

from cp_linear.kernels import all_forward_configs, describe  # noqa: E402


def test_import_of_kernels_package_loads_no_cutlass():
    code = ("import sys, cp_linear, cp_linear.kernels; "
            "bad = [m for m in ('cutlass', 'torch', 'jax') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_every_kernel_config_compiles_for_sm90a_without_a_gpu():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, "-m", "cp_linear.kernels", "--compile", "--arch", "sm_90a", "--jobs", "2"],
        capture_output=True, text=True, timeout=170, env=env)
    configs = all_forward_configs()
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    compiled = [line for line in result.stdout.splitlines() if line.startswith("ok ")]
    for config in configs:
        assert any(describe(config) in line for line in compiled), f"{describe(config)} not compiled"
    assert f"{len(configs)} of {len(configs)} compiled" in result.stdout


def test_configs_are_hashable_cache_keys_and_reject_unsupported_sizes():
    from cp_linear.kernels import OutputConfig, WYPrepareConfig

    assert WYPrepareConfig("bfloat16", 128, 64) == WYPrepareConfig("bfloat16", 128, 64)
    assert len({WYPrepareConfig("bfloat16", 128, 64), WYPrepareConfig("bfloat16", 128, 128)}) == 2
    with pytest.raises(ValueError, match="key_dim must be one of"):
        OutputConfig("bfloat16", 96, 64).validate()
    with pytest.raises(ValueError, match="dtype must be one of"):
        OutputConfig("float64", 64, 64).validate()
