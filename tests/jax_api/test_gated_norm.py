"""The GDP output's gated norm on its fused kernels, on the CPU: ``GatedRMSNorm`` over
``jax_api.layers.blocks.kernel_gated_rms_norm``.

The kernels' custom calls run their torch emulations (``tests/jax_api/kernel_emulation.py``), so the traced
program is the product's (reshapes, custom_vjp, the column sum of the weight gradient) and only what runs
behind each target differs from the GPU. Checked:

* the kernel path (forced) under jit and grad against float64 autograd of the definition and against the
  jnp path: out, dx, dgate, dweight, for D = 64 and 128, bf16 and fp16, row counts that leave a partial
  CTA of ``GATED_NORM_ROWS`` rows;
* inside shard_map (2 host devices, tokens split, weight replicated): the same values as on one device,
  the weight gradient summed over the ranks;
* ``GatedDeltaProduct`` with the norm's kernel path forced against the jnp path;
* the path choice: shapes, dtypes and sizes the kernels do not take keep the jnp path;
* the kernel path lowers for CUDA to the three kernels' custom calls and nothing else.

tests/jax_api/test_cutedsl_gpu.py compares the kernels with torch's on a GPU, bit for bit.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tvm_ffi", reason="needs apache-tvm-ffi and jax-tvm-ffi (the cuda extra)")
pytest.importorskip("jax_tvm_ffi", reason="needs jax-tvm-ffi (the cuda extra)")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

if jax.default_backend() != "cpu":  # these run the CPU path on purpose (tests/jax_api/test_cutedsl_gpu.py: the GPU)
    pytest.skip("CPU-only tests of the kernel bridge", allow_module_level=True)

from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_api.layers.blocks as blocks  # noqa: E402
from cp_linear.kernels import configs as kcfg  # noqa: E402
from jax_api.gdp import kernel_calls  # noqa: E402
from jax_api.layers import GatedDeltaProduct  # noqa: E402
from tests.jax_api.kernel_emulation import LAUNCH_COUNTS, register_emulated_kernels  # noqa: E402
from tests.jax_api.test_layers import mesh_of  # noqa: E402
from tests.tolerance import assert_close, cancellation, tolerance, unit_roundoff  # noqa: E402

DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}
EPS = 1e-5
HEADS = 2


@pytest.fixture
def kernel_path(monkeypatch):
    """The gated norm takes the kernel path on this CPU; its custom calls run the emulations."""
    register_emulated_kernels()
    monkeypatch.setattr(blocks, "FORCE_GATED_NORM_KERNEL", True)


def make_case(tokens: int, dim: int, dtype: str, seed: int = 0):
    """A norm of ``dim`` with a non-trivial weight, and x, gate, dout [2, tokens, HEADS, dim] in ``dtype``."""
    rng = np.random.default_rng(seed)
    module = blocks.GatedRMSNorm(dim, eps=EPS)
    module.weight[...] = jnp.asarray(1 + rng.normal(size=dim) / 4, jnp.float32)
    x, gate, dout = (jnp.asarray(rng.normal(size=(2, tokens, HEADS, dim)), DTYPES[dtype]) for _ in range(3))
    return module, x, gate, dout


def run(module, x, gate, dout) -> dict:
    """out, dx, dgate, dweight of sum(out * dout) through the module, under jit and grad."""
    graphdef, state = nnx.split(module)

    def loss(state, x, gate):
        out = nnx.merge(graphdef, state)(x, gate)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out

    (_, out), (dstate, dx, dgate) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(state, x, gate)
    # the custom calls run (and count their launches) when the program does: wait for it
    return jax.block_until_ready(dict(out=out, dx=dx, dgate=dgate, dweight=dstate["weight"][...]))


def float64_reference(module, x, gate, dout) -> dict:
    """torch float64 autograd of x · rsqrt(mean(x²) + eps) · weight · silu(gate) on the same values, and
    the cancellations of dx (its two terms) and of dweight (a sum over rows)."""
    as_double = lambda a: torch.from_numpy(np.asarray(jnp.asarray(a, jnp.float32), np.float64))  # noqa: E731
    xd, gd = as_double(x).requires_grad_(), as_double(gate).requires_grad_()
    weight = as_double(module.weight[...]).requires_grad_()
    rstd = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS)
    out = xd * rstd * weight * torch.nn.functional.silu(gd)
    out.backward(as_double(dout))
    with torch.no_grad():  # dx = rstd · (a - normed · mean(a · normed)), a = dout · weight · silu(gate)
        normed = xd * rstd
        weighted = as_double(dout) * weight * torch.nn.functional.silu(gd)
        dx_terms = torch.stack([rstd * weighted, -rstd * normed * (weighted * normed).mean(-1, keepdim=True)])
        dweight_terms = (as_double(dout) * normed * torch.nn.functional.silu(gd)).reshape(-1, x.shape[-1])
    return dict(out=out.detach(), dx=xd.grad, dgate=gd.grad, dweight=weight.grad,
                kappa_dx=cancellation(dx_terms.numpy()), kappa_dweight=cancellation(dweight_terms.numpy()))


KERNEL_CASES = [
    pytest.param(7, 64, "bfloat16", id="bf16-D64-rows28"),  # one partial CTA
    pytest.param(kcfg.GATED_NORM_ROWS // 4 + 3, 128, "bfloat16", id="bf16-D128-full-cta-and-12-rows"),
    pytest.param(9, 128, "float16", id="fp16-D128-rows36"),
    pytest.param(33, 64, "float16", id="fp16-D64-rows132"),
]


@pytest.mark.parametrize("tokens, dim, dtype", KERNEL_CASES)
def test_gated_norm_kernel_path_matches_float64_and_the_jnp_path(kernel_path, monkeypatch, tokens, dim, dtype):
    module, x, gate, dout = make_case(tokens, dim, dtype)
    forward, backward = kcfg.GatedRMSNormConfig(dtype, dim), kcfg.GatedRMSNormBackwardConfig(dtype, dim)
    before = LAUNCH_COUNTS[forward], LAUNCH_COUNTS[backward], LAUNCH_COUNTS[kcfg.ColumnSumConfig()]
    kernels = run(module, x, gate, dout)
    after = LAUNCH_COUNTS[forward], LAUNCH_COUNTS[backward], LAUNCH_COUNTS[kcfg.ColumnSumConfig()]
    assert [b - a for a, b in zip(before, after)] == [1, 1, 1]  # one launch of each kernel

    monkeypatch.setattr(blocks, "FORCE_GATED_NORM_KERNEL", False)
    jnp_path = run(module, x, gate, dout)
    assert LAUNCH_COUNTS[forward] == after[0]  # the jnp path on this CPU

    want = float64_reference(module, x, gate, dout)
    assert all(kernels[name].dtype == x.dtype for name in ("out", "dx", "dgate"))
    assert kernels["dweight"].dtype == jnp.float32
    rows = x.size // dim
    # out, dgate: float32 arithmetic over a D-term mean, one rounding to the input dtype; dx: the same, its two
    # terms cancelling; dweight: float32 sums over every row
    bounds = dict(out=unit_roundoff(dtype) + tolerance(dim), dgate=unit_roundoff(dtype) + tolerance(dim),
                  dx=unit_roundoff(dtype) + tolerance(dim, cancellation=want["kappa_dx"]),
                  dweight=tolerance(dim + rows, cancellation=want["kappa_dweight"]))
    for name, bound in bounds.items():
        exact = want[name].numpy()
        assert_close(f"{name}: kernels vs float64", exact, np.asarray(kernels[name].astype(jnp.float32)), bound)
        assert_close(f"{name}: jnp path vs float64", exact, np.asarray(jnp_path[name].astype(jnp.float32)), bound)
        # two float32 computations in different orders, each rounded once: a last-place difference at most
        assert_close(f"{name}: kernels vs jnp path", np.asarray(jnp_path[name].astype(jnp.float32)),
                     np.asarray(kernels[name].astype(jnp.float32)), 2 * bound)


def test_gated_norm_kernel_path_inside_shard_map_sums_the_weight_gradient(kernel_path):
    """Tokens split over 2 devices, weight replicated: out, dx, dgate as on one device, dweight the sum of
    the ranks' gradients (a missing sum halves it)."""
    module, x, gate, dout = make_case(kcfg.GATED_NORM_ROWS // 4 + 4, 64, "bfloat16", seed=1)  # a CTA and 8 rows a rank
    one_device = run(module, x, gate, dout)

    graphdef, state = nnx.split(module)
    mesh = mesh_of(2)
    tokens = P(None, "cp")

    def per_shard(state, x, gate):
        return nnx.merge(graphdef, state)(x, gate)

    sharded = jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), tokens, tokens), out_specs=tokens)
    along_tokens = lambda a: jax.device_put(a, NamedSharding(mesh, tokens))  # noqa: E731

    def loss(state, x, gate):
        out = sharded(state, x, gate)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    (_, out), (dstate, dx, dgate) = grad(state, along_tokens(x), along_tokens(gate))
    cp_run = dict(out=out, dx=dx, dgate=dgate, dweight=dstate["weight"][...])
    for name, want in one_device.items():
        # rows are normalised independently: out, dx, dgate are the same values; dweight adds rows in another order
        bound = tolerance(x.size // 64, dtype="float32", compared_with="rounded") if name == "dweight" else 0.0
        assert_close(f"cp 2 vs one device: {name}", np.asarray(want.astype(jnp.float32)),
                     np.asarray(cp_run[name].astype(jnp.float32)), bound)


def test_gated_norm_takes_the_kernel_path_only_for_kernel_shapes(monkeypatch):
    x = jnp.zeros((3, 2, 128), jnp.bfloat16)
    assert "CUDA GPU" in blocks.gated_norm_kernel_reason(x, x)  # this CPU
    monkeypatch.setattr(blocks, "FORCE_GATED_NORM_KERNEL", True)
    assert blocks.gated_norm_kernel_reason(x, x) is None
    assert blocks.gated_norm_kernel_reason(x[..., :64].astype(jnp.float16), x[..., :64].astype(jnp.float16)) is None
    assert "bf16 / fp16" in blocks.gated_norm_kernel_reason(x.astype(jnp.float32), x.astype(jnp.float32))
    assert "bf16 / fp16" in blocks.gated_norm_kernel_reason(x, x.astype(jnp.float16))  # gate of another dtype
    assert "bf16 / fp16" in blocks.gated_norm_kernel_reason(x, x[:1])  # gate of another shape
    assert "rows of" in blocks.gated_norm_kernel_reason(x[..., :96], x[..., :96])


def test_kernel_gated_rms_norm_rejects_bad_arguments(kernel_path):
    x, weight = jnp.zeros((3, 128), jnp.bfloat16), jnp.ones(128)
    with pytest.raises(ValueError, match="x and gate must be bfloat16 or float16"):
        blocks.kernel_gated_rms_norm(x, x.astype(jnp.float16), weight, EPS)
    with pytest.raises(ValueError, match=r"D must be one of \(64, 128\) and weight \[D\]"):
        blocks.kernel_gated_rms_norm(x, x, weight[:64], EPS)


def test_gated_norm_kernel_path_lowers_to_the_three_kernels_for_cuda(kernel_path):
    """Forward and backward under jit: one gated_rms_norm, one backward, one column sum; no callback."""
    assert not kernel_calls._registers_here()
    module, x, gate, dout = make_case(5, 128, "bfloat16")
    graphdef, state = nnx.split(module)

    def loss(state, x, gate):
        return jnp.sum(nnx.merge(graphdef, state)(x, gate).astype(jnp.float32))

    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(state, x, gate).lower(
        lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"stablehlo\.custom_call @([\w.]+)", text)
    expected = {kernel_calls.target_name(config) for config in (
        kcfg.GatedRMSNormConfig("bfloat16", 128), kcfg.GatedRMSNormBackwardConfig("bfloat16", 128),
        kcfg.ColumnSumConfig())}
    assert len(calls) == 3 and set(calls) == expected, calls
    assert "callback" not in text


def test_gdp_layer_takes_the_gated_norm_kernels(monkeypatch):
    """GatedDeltaProduct with head_v_dim 64 and bf16 activations: its output norm (o and gate both bf16) runs
    on the kernels when forced, one launch each way, and agrees with the jnp path up to bf16 rounding (both
    round a float32 norm once; the output projection carries the difference on). Under CP the norm sees
    the same types as in the shard_map test above."""
    from tests.jax_api.test_short_conv import TOTAL, layer_run

    module = GatedDeltaProduct(hidden_size=64, head_dim=32, num_heads=2, expand_v=2.0, num_householder=2,
                               rngs=nnx.Rngs(0))
    assert module.o_norm.weight.shape == (64,)
    rng = np.random.default_rng(5)
    x = rng.normal(size=(1, TOTAL, 64)).astype(jnp.bfloat16)
    cotangent = rng.normal(size=(1, TOTAL, 64)).astype(np.float32)
    launches = lambda: LAUNCH_COUNTS[kcfg.GatedRMSNormBackwardConfig("bfloat16", 64)]  # noqa: E731

    before = launches()
    jnp_path = layer_run(module, x, cotangent)
    assert launches() == before  # the jnp path on this CPU by default

    register_emulated_kernels()
    monkeypatch.setattr(blocks, "FORCE_GATED_NORM_KERNEL", True)
    kernels = layer_run(module, x, cotangent)
    assert launches() == before + 1
    for key, want in jnp_path.items():
        assert_close(f"kernels vs jnp path: {key}", want, kernels[key],
                     tolerance(1, dtype="bfloat16", compared_with="rounded"))
