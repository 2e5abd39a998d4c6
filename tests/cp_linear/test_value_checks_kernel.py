"""The value-checks kernel (``cp_linear.kernels.value_checks``): one launch for the GDP value checks.

On the CPU: its emulation against a plain torch reference written here (planted NaN / ±Inf and range
violations in every input, clean inputs, lengths with a tail after the last 16-byte vector, bf16 and
fp16); the kernel compiled for sm_90a (its PTX reads 16-byte vectors and ORs flags with ``red``); and
``torch_api.gdp.validation.gdp_value_flags`` with the launch carried out by the emulation. On a GPU
(marked ``gpu``): the kernel against the reference and the torch path, also at 8192 x 16 x 128.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cp_linear.kernels import configs as kcfg
from cp_linear.kernels import launch as kl
from cp_linear.kernels.emulation import run_emulated
from cp_linear.validation import BETA_MAX, gdp_value_flag_array
from torch_api.gdp import validation

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
NAMES = ("q", "k", "v", "g", "beta")
INF = float("inf")


def reference_flags(q, k, v, g, beta) -> list[bool]:
    """The checks in plain torch: non-finite is x != x or |x| = inf; g > 0; beta < 0 or beta > BETA_MAX."""
    def nonfinite(x):
        x = x.float()
        return bool(((x != x) | (x.abs() == INF)).any())

    g, beta = g.float(), beta.float()
    return [nonfinite(x) for x in (q, k, v, g, beta)] + [bool((g > 0).any()),
                                                          bool(((beta < 0) | (beta > BETA_MAX)).any())]


def clean_inputs(dtype, *, tokens=37, heads=3, key_dim=5, value_dim=7, n_h=2, seed=0, device="cpu"):
    """Finite inputs with g < 0 and beta in (0, 2). Element counts with a tail after the last 16-byte
    vector: q 555 = 69 x 8 + 3, k 1110, v 1554 (8 per vector), g 111 = 27 x 4 + 3, beta 222 (4 per vector)."""
    rng = torch.Generator().manual_seed(seed)
    q = torch.randn(1, tokens, heads, key_dim, generator=rng)
    k = torch.randn(1, tokens * n_h, heads, key_dim, generator=rng)
    v = torch.randn(1, tokens * n_h, heads, value_dim, generator=rng)
    g = -torch.rand(1, tokens, heads, generator=rng) - 0.01
    beta = 2 * torch.rand(1, tokens * n_h, heads, generator=rng).clamp(0.01, 0.99)
    return [x.to(device) for x in (q.to(dtype), k.to(dtype), v.to(dtype), g, beta)]


# (tensor, planted value, the flags it sets): NaN fails every comparison, so it sets only its tensor's flag
PLANTED = [
    pytest.param(None, 0.0, (), id="clean"),
    pytest.param("q", float("nan"), (0,), id="q-nan"),
    pytest.param("k", INF, (1,), id="k-posinf"),
    pytest.param("v", -INF, (2,), id="v-neginf"),
    pytest.param("g", float("nan"), (3,), id="g-nan"),
    pytest.param("g", INF, (3, 5), id="g-posinf"),
    pytest.param("g", -INF, (3,), id="g-neginf"),
    pytest.param("g", 0.25, (5,), id="g-positive"),
    pytest.param("g", 0.0, (), id="g-zero-allowed"),
    pytest.param("beta", float("nan"), (4,), id="beta-nan"),
    pytest.param("beta", -INF, (4, 6), id="beta-neginf"),
    pytest.param("beta", -0.5, (6,), id="beta-negative"),
    pytest.param("beta", 2.5, (6,), id="beta-above-max"),
    pytest.param("beta", BETA_MAX, (), id="beta-max-allowed"),
]
# flat positions: the first element, one inside the vectors, the last whole vector's last element, the tail's last
POSITIONS = {"first": lambda n, per: 0, "middle": lambda n, per: n // 2,
             "last-vector": lambda n, per: n // per * per - 1, "tail": lambda n, per: n - 1}


def plant(tensors, name, value, position):
    if name is None:
        return tensors
    x = tensors[NAMES.index(name)]
    per_vector = 16 // x.element_size()
    x.view(-1)[POSITIONS[position](x.numel(), per_vector)] = value
    return tensors


def emulated_flags(tensors, dtype_name) -> torch.Tensor:
    flags = torch.zeros(7, dtype=torch.int32)
    launch = kl.ValueChecksLaunch.of(kcfg.ValueChecksConfig(dtype_name), *(x.view(-1) for x in tensors), flags,
                                     sm_count=132)
    run_emulated(launch)
    return flags


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("name, value, expected", PLANTED)
def test_emulation_sets_exactly_the_failed_checks(dtype, position, name, value, expected):
    tensors = plant(clean_inputs(DTYPES[dtype]), name, value, position)
    flags = emulated_flags(tensors, str(DTYPES[dtype]).removeprefix("torch."))
    assert flags.dtype == torch.int32
    assert flags.tolist() == [int(i in expected) for i in range(7)]
    assert flags.bool().tolist() == reference_flags(*tensors)


def test_emulation_ors_into_the_flags_it_is_given():
    """The kernel ORs into a zero-filled buffer; set entries stay set (it never clears)."""
    tensors = plant(clean_inputs(torch.bfloat16), "k", INF, "middle")
    flags = torch.tensor([0, 0, 0, 1, 0, 0, 1], dtype=torch.int32)
    run_emulated(kl.ValueChecksLaunch(kcfg.ValueChecksConfig("bfloat16"), *(x.view(-1) for x in tensors), flags, 1))
    assert flags.tolist() == [0, 1, 0, 1, 0, 0, 1]


def test_launch_blocks_cover_the_largest_tensor_with_at_most_two_ctas_per_sm():
    flags = torch.zeros(7, dtype=torch.int32)
    config = kcfg.ValueChecksConfig("bfloat16")
    tiny = [torch.zeros(n) for n in (3, 3, 3, 1, 1)]
    assert kl.ValueChecksLaunch.of(config, *tiny, flags, sm_count=132).blocks == 1
    # q / k / v of 8192 x 16 x 128 bf16 (32 MiB each): capped at 2 CTAs per SM
    big = [torch.empty(8192 * 16 * 128, dtype=torch.bfloat16)] * 3 + [torch.empty(8192 * 16)] * 2
    assert kl.ValueChecksLaunch.of(config, *big, flags, sm_count=132).blocks == 2 * 132
    # 40 steps of 256 threads x 4 vectors x 16 bytes
    mid = [torch.empty(40 * 256 * 4 * 8, dtype=torch.float16)] * 3 + [torch.empty(5)] * 2
    assert kl.ValueChecksLaunch.of(config, *mid, flags, sm_count=132).blocks == 40
    assert kl.ValueChecksLaunch.argument_roles() == (("q", "k", "v", "g", "beta"), ("flags",), ("blocks",))


def test_config_is_in_the_library_and_ci_and_rejects_float32():
    assert {kcfg.ValueChecksConfig(d) for d in kcfg.TENSOR_CORE_DTYPES} <= set(kcfg.all_configs())
    assert kcfg.ValueChecksConfig("bfloat16") in kcfg.ci_configs()
    assert kcfg.describe(kcfg.ValueChecksConfig("float16")) == "ValueChecksConfig(float16)"
    with pytest.raises(ValueError, match="dtype must be one of"):
        kcfg.ValueChecksConfig("float32").validate()


# --------------------------------------------------------------------------- compiled for sm_90a (no GPU)


def test_kernel_compiles_for_sm90a_with_vector_loads_and_or_reductions(tmp_path):
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (the cuda extra)")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, "-m", "cp_linear.kernels", "--compile", "--arch", "sm_90a", "--ptxas", "--only",
         "ValueChecksConfig", "--jobs", "2", "--keep-ptx", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "2 of 2 compiled" in result.stdout
    for line in (line for line in result.stdout.splitlines() if line.startswith("ok ")):
        assert "spills 0/0 B" in line or "registers" not in line, line  # no spills where ptxas reported
    ptx_files = sorted(tmp_path.glob("ValueChecksConfig-*.ptx"))
    assert len(ptx_files) == 2
    for path in ptx_files:
        ptx = Path(path).read_text()
        assert ptx.count("ld.global.v4.b32") >= 5 * kl.VALUE_CHECKS_UNROLL, path.name  # 16-byte loads, every tensor
        assert ptx.count("red.relaxed.gpu.global.or.b32") == 2, path.name  # non-finite and range flags
        assert "atom." not in ptx, path.name


# --------------------------------------------------------------------------- the torch integration (emulated)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name, value, expected", PLANTED)
def test_gdp_value_flags_through_the_kernel_match_the_torch_path(emulated_launches, dtype, name, value, expected):
    tensors = plant(clean_inputs(DTYPES[dtype]), name, value, "tail")
    flags = validation.gdp_value_flags(*tensors)
    assert len(emulated_launches) == 1
    assert flags.dtype == torch.bool and flags.shape == (7,) and flags.device == tensors[0].device
    assert flags.tolist() == [i in expected for i in range(7)]
    assert flags.tolist() == gdp_value_flag_array(*tensors, extrema=torch.aminmax).tolist()


def test_gdp_value_flags_casts_a_low_precision_gate_and_detaches(emulated_launches):
    q, k, v, g, beta = plant(clean_inputs(torch.float16), "g", 0.5, "first")
    q.requires_grad_(True)
    flags = validation.gdp_value_flags(q, k, v, g.to(torch.bfloat16), beta)
    assert flags.tolist() == [False] * 5 + [True, False]
    launch = emulated_launches[0]
    assert launch.g.dtype == torch.float32 and not launch.q.requires_grad and launch.q.dim() == 1


def _misaligned(x):
    """A contiguous copy of ``x`` whose data starts 2 bytes past a 16-byte boundary."""
    storage = torch.empty(x.numel() + 8, dtype=x.dtype)
    view = storage[1:1 + x.numel()].view(x.shape)
    view.copy_(x)
    return view


@pytest.mark.parametrize("case", ["float32-qkv", "mixed-qkv", "non-contiguous-k", "misaligned-v", "empty-beta"])
def test_gdp_value_flags_take_the_torch_path_where_the_kernel_cannot_read_the_inputs(emulated_launches, case):
    q, k, v, g, beta = plant(clean_inputs(torch.bfloat16), "v", float("nan"), "middle")
    if case == "float32-qkv":
        q, k, v = q.float(), k.float(), v.float()
    elif case == "mixed-qkv":
        k = k.half()
    elif case == "non-contiguous-k":
        k = k.transpose(1, 2).contiguous().transpose(1, 2)
    elif case == "misaligned-v":
        v = _misaligned(v)
        assert v.is_contiguous() and v.data_ptr() % 16 != 0
    elif case == "empty-beta":
        beta = beta[:, :0]
    flags = validation.gdp_value_flags(q, k, v, g, beta)
    assert emulated_launches == []
    assert flags.tolist() == gdp_value_flag_array(q, k, v, g, beta, extrema=torch.aminmax).tolist()
    assert bool(flags[2])


def test_cpu_inputs_take_the_torch_path_without_the_patch():
    assert not validation._kernel_platform_ready(torch.device("cpu"))
    assert not validation._kernel_checks_available(*clean_inputs(torch.bfloat16))


# --------------------------------------------------------------------------- on a GPU


def _kernel_gpu():
    from torch_api.gdp import cutedsl

    reason = cutedsl.kernel_platform_reason(torch.device("cuda"))
    if reason:
        pytest.skip(reason)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("name, value, expected", PLANTED)
def test_kernel_flags_on_gpu_match_the_reference_and_the_torch_path(dtype, position, name, value, expected):
    _kernel_gpu()
    tensors = plant(clean_inputs(DTYPES[dtype], device="cuda"), name, value, position)
    assert validation._kernel_checks_available(*tensors)
    flags = validation.gdp_value_flags(*tensors)
    assert flags.dtype == torch.bool and flags.device == tensors[0].device
    assert flags.tolist() == [i in expected for i in range(7)]
    assert flags.tolist() == reference_flags(*tensors)
    assert flags.tolist() == gdp_value_flag_array(*tensors, extrema=torch.aminmax).tolist()


@pytest.fixture(scope="module")
def large_clean_inputs():
    return clean_inputs(torch.bfloat16, tokens=8192, heads=16, key_dim=128, value_dim=128, n_h=1, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("name, value, expected", PLANTED)
@pytest.mark.parametrize("position", ["first", "middle", "tail"])
def test_kernel_flags_on_gpu_at_8192_tokens_16_heads_128_dims(large_clean_inputs, name, value, expected, position):
    """bf16 q / k / v of 8192 x 16 x 128 elements (n_h = 1): the grid-stride loop reaches every vector."""
    _kernel_gpu()
    tensors = plant([x.clone() for x in large_clean_inputs], name, value, position)
    assert validation._kernel_checks_available(*tensors)
    assert tensors[0].numel() == 8192 * 16 * 128
    flags = validation.gdp_value_flags(*tensors)
    assert flags.tolist() == [i in expected for i in range(7)]
    assert flags.tolist() == gdp_value_flag_array(*tensors, extrema=torch.aminmax).tolist()
