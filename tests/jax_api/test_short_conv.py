"""The short conv's kernel path on the CPU: ``jax_api.layers.conv.kernel_short_conv`` and the layer using it.

The fused kernels' custom calls run their torch emulations (``tests/jax_api/kernel_emulation.py``), so
the traced program is the product's (reshapes, custom_vjp, the halo exchange inside shard_map) and only
what runs behind each target differs from the GPU. Checked:

* ``kernel_short_conv`` (jit, grad) against a float64 numpy reference on the same bf16 / fp16 values:
  packed documents incl. length-1 ones, B = 2, P = 1 and 2 pieces, with and without bias;
* ``conv_halos`` under shard_map: each piece's halo is exactly the tokens before it, and its gradient
  goes back to them (contiguous and zig-zag);
* ``GatedDeltaProduct`` with the kernel path forced against the jnp path, on one device and under CP
  (2 host devices, contiguous and zig-zag): output, input and parameter gradients;
* the kernel path lowers for CUDA to the three kernels' custom calls and nothing else.

tests/jax_api/test_cutedsl_gpu.py compares the kernels with torch's on a GPU, bit for bit.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("tvm_ffi", reason="needs apache-tvm-ffi and jax-tvm-ffi (the cuda extra)")
pytest.importorskip("jax_tvm_ffi", reason="needs jax-tvm-ffi (the cuda extra)")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

if jax.default_backend() != "cpu":  # these run the CPU path on purpose (tests/jax_api/test_cutedsl_gpu.py: the GPU)
    pytest.skip("CPU-only tests of the kernel bridge", allow_module_level=True)

from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_api.layers.conv as conv  # noqa: E402
from cp_linear.kernels import configs as kcfg  # noqa: E402
from cp_linear.zigzag import inverse_permutation, layout_permutation  # noqa: E402
from jax_api.gdp import kernel_calls  # noqa: E402
from jax_api.layers import GatedDeltaProduct, build_layout  # noqa: E402
from tests.jax_api.kernel_emulation import LAUNCH_COUNTS, register_emulated_kernels  # noqa: E402
from tests.jax_api.test_layers import doc_ids_from_runs, flat, mesh_of  # noqa: E402
from tests.tolerance import assert_close, cancellation, tolerance, unit_roundoff  # noqa: E402

DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}


@pytest.fixture
def kernel_path(monkeypatch):
    """The short conv takes the kernel path on this CPU; its custom calls run the emulations."""
    register_emulated_kernels()
    monkeypatch.setattr(conv, "FORCE_SHORT_CONV_KERNEL", True)


def _positions(lengths) -> np.ndarray:
    return np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)


# --------------------------------------------------------------------------- kernel_short_conv


def reference_short_conv(x, halo, weight, bias, positions, dy) -> dict:
    """float64 numpy: y = silu(masked causal conv) of each piece's window [halo_p; piece_p] and the
    gradients of sum(y * dy); also the cancellation of the weight and bias gradients (sums over tokens)."""
    x, halo, dy = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (x, halo, dy))
    batch, length, channels = x.shape
    pieces, width = halo.shape[1], weight.shape[-1]
    piece = length // pieces
    taps = np.asarray(weight, np.float64)[:, 0, :].T  # [W, C]: tap W - 1 multiplies the current token
    windows = np.concatenate([halo, x.reshape(batch, pieces, piece, channels)], axis=2)  # [B, P, W - 1 + Lp, C]
    piece_positions = np.asarray(positions).reshape(1, pieces, piece, 1)
    shifted = [windows[:, :, width - 1 - s:width - 1 - s + piece] for s in range(width)]  # token t - s
    reach = [piece_positions >= s for s in range(width)]
    pre = np.zeros((batch, pieces, piece, channels)) + (0.0 if bias is None else np.asarray(bias, np.float64))
    for s in range(width):
        pre = pre + np.where(reach[s], shifted[s], 0.0) * taps[width - 1 - s]
    sig = 1.0 / (1.0 + np.exp(-pre))
    dpre = dy.reshape(pre.shape) * sig * (1.0 + pre * (1.0 - sig))
    dwindows = np.zeros_like(windows)
    tap_terms = np.zeros((width, batch * length, channels))  # each token's term of each tap's gradient
    for s in range(width):
        masked = np.where(reach[s], dpre, 0.0)
        dwindows[:, :, width - 1 - s:width - 1 - s + piece] += masked * taps[width - 1 - s]
        tap_terms[width - 1 - s] = (masked * shifted[s]).reshape(-1, channels)
    return dict(y=(pre * sig).reshape(x.shape), dx=dwindows[:, :, width - 1:].reshape(x.shape),
                dhalo=dwindows[:, :, :width - 1], dweight=tap_terms.sum(1).T[:, None, :],
                dbias=dpre.sum((0, 1, 2)), kappa_weight=cancellation(tap_terms, axis=1),
                kappa_bias=cancellation(dpre.reshape(-1, channels)))


KERNEL_CASES = [
    # a piece boundary (150) inside a document: the second piece reads its halo
    pytest.param("bfloat16", 4, 1, True, (5, 140, 1, 154), id="bf16-W4-P1-bias"),
    pytest.param("bfloat16", 4, 2, False, (5, 140, 1, 154), id="bf16-W4-P2-halo-read"),
    # a document starting exactly at the piece boundary: its halo must not be read
    pytest.param("bfloat16", 3, 2, True, (1, 149, 1, 149), id="bf16-W3-P2-bias-boundary-at-start"),
    pytest.param("float16", 2, 1, False, (1, 299), id="fp16-W2-P1"),
]


@pytest.mark.parametrize("dtype, width, pieces, with_bias, lengths", KERNEL_CASES)
def test_kernel_short_conv_matches_float64_reference(kernel_path, dtype, width, pieces, with_bias, lengths):
    rng = np.random.default_rng(width + pieces)
    batch, length, channels = 2, sum(lengths), 48
    x = jnp.asarray(rng.normal(size=(batch, length, channels)), DTYPES[dtype])
    halo = jnp.asarray(rng.normal(size=(batch, pieces, width - 1, channels)), DTYPES[dtype])  # never zeros
    weight = jnp.asarray(rng.normal(size=(channels, 1, width)) / np.sqrt(width), jnp.float32)
    bias = jnp.asarray(rng.normal(size=(channels,)), jnp.float32) if with_bias else None
    dy = jnp.asarray(rng.normal(size=(batch, length, channels)), DTYPES[dtype])
    positions = jnp.asarray(_positions(lengths))

    def loss(x, halo, weight, bias):
        return jnp.sum(conv.kernel_short_conv(x, halo, weight, bias, positions).astype(jnp.float32) * dy)

    before = LAUNCH_COUNTS[kcfg.ShortConvConfig(dtype, width)]
    y = jax.jit(conv.kernel_short_conv)(x, halo, weight, bias, positions)
    dx, dhalo, dweight, dbias = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, halo, weight, bias)
    jax.block_until_ready((y, dx))  # the emulations count when they run, not when they are dispatched
    assert LAUNCH_COUNTS[kcfg.ShortConvConfig(dtype, width)] > before  # the kernel path ran

    want = reference_short_conv(x, halo, weight, bias, positions, dy)
    assert y.dtype == dx.dtype == dhalo.dtype == x.dtype and dweight.dtype == jnp.float32
    # y, dx, dhalo: float32 sums of W + 1 terms, then one rounding to the input dtype
    rounded = unit_roundoff(dtype) + tolerance(width + 1)
    assert_close("y", want["y"], y.astype(jnp.float32), rounded)
    assert_close("dx", want["dx"], dx.astype(jnp.float32), rounded)
    assert_close("dhalo", want["dhalo"], dhalo.astype(jnp.float32), rounded)
    # weight and bias gradients: float32 sums over every token
    tokens = batch * length
    assert_close("dweight", want["dweight"], dweight, tolerance(tokens, cancellation=want["kappa_weight"]))
    if with_bias:
        assert_close("dbias", want["dbias"], dbias, tolerance(tokens, cancellation=want["kappa_bias"]))
    else:
        assert dbias is None


def test_kernel_short_conv_rejects_bad_shapes(kernel_path):
    x = jnp.zeros((1, 12, 16), jnp.bfloat16)
    halo, weight, positions = jnp.zeros((1, 1, 3, 16), jnp.bfloat16), jnp.zeros((16, 1, 4)), jnp.zeros(12, jnp.int32)
    with pytest.raises(ValueError, match="x must be bfloat16 or float16"):
        conv.kernel_short_conv(x.astype(jnp.float32), halo, weight, None, positions)
    with pytest.raises(ValueError, match="C must be divisible by 8"):
        conv.kernel_short_conv(x[..., :12], halo[..., :12], weight[:12], None, positions)
    with pytest.raises(ValueError, match=r"halo must be bfloat16 \[B, P, W - 1, C\]"):
        conv.kernel_short_conv(x, jnp.zeros((1, 5, 3, 16), jnp.bfloat16), weight, None, positions)
    with pytest.raises(ValueError, match="positions must be integer"):
        conv.kernel_short_conv(x, halo, weight, None, positions[:5])


def test_kernel_path_selection(monkeypatch):
    """The kernels take bf16 / fp16, widths 2-4 and channels in whole vectors, on their platform only."""
    bf16, fp16, f32 = (jnp.zeros((1, 8, 8), dtype) for dtype in (jnp.bfloat16, jnp.float16, jnp.float32))
    assert "CUDA GPU" in conv.short_conv_kernel_reason(bf16, 4, (16, 32))  # this CPU
    monkeypatch.setattr(conv, "FORCE_SHORT_CONV_KERNEL", True)
    assert conv.short_conv_kernel_reason(bf16, 4, (16, 32)) is None
    assert conv.short_conv_kernel_reason(fp16, 2, (8,)) is None
    assert "bfloat16 or float16" in conv.short_conv_kernel_reason(f32, 4, (16,))
    assert "widths" in conv.short_conv_kernel_reason(bf16, 1, (16,))  # conv_size 1: no halo, the jnp path
    assert "divisible by 8" in conv.short_conv_kernel_reason(bf16, 4, (16, 12))


# --------------------------------------------------------------------------- halos under CP


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_conv_halos_hold_the_tokens_before_each_piece_and_send_their_gradient_back(layout):
    """Two parts of 5 and 3 channels, one exchange: piece p's halo is the 3 tokens before it in sequence
    order (zeros before token 0); the gradient of sum(halo * c) lands on exactly those tokens."""
    cp, total, halo_len = 2, 24, 3
    pieces = 2 if layout == "zigzag" else 1
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, total, 8)).astype(np.float32)
    weights = rng.normal(size=(2, cp * pieces, halo_len, 8)).astype(np.float32)
    order = layout_permutation(total, cp, layout)

    def per_shard(x, weights):
        halos = conv.conv_halos((x[..., :5], x[..., 5:]), halo_len, "cp", zigzag=layout == "zigzag")
        halo = jnp.concatenate(halos, axis=-1)  # [B, P, halo_len, 8]
        return halo, jnp.sum(halo * weights)[None]  # [1] per rank

    mesh = mesh_of(cp)
    sharded = jax.shard_map(per_shard, mesh=mesh, in_specs=(P(None, "cp"), P(None, "cp")),
                            out_specs=(P(None, "cp"), P("cp")))
    along_ranks = lambda a: jax.device_put(jnp.asarray(a), NamedSharding(mesh, P(None, "cp")))  # noqa: E731

    def loss(x, weights):
        halo, partial_loss = sharded(x, weights)
        return jnp.sum(partial_loss), halo

    (_, halo), dx_ranks = jax.jit(jax.value_and_grad(loss, has_aux=True))(along_ranks(x[:, order]),
                                                                          along_ranks(weights))
    want, want_dx = np.zeros(weights.shape, np.float32), np.zeros_like(x)
    piece_len = total // (cp * pieces)
    for index in range(cp * pieces):  # rank index // pieces, its piece index % pieces
        start = order[index * piece_len]  # where the piece starts in sequence order
        if start > 0:
            want[:, index] = x[:, start - halo_len:start]
            want_dx[:, start - halo_len:start] += weights[:, index]
    np.testing.assert_array_equal(np.asarray(halo), want)
    np.testing.assert_allclose(np.asarray(dx_ranks)[:, inverse_permutation(order)], want_dx, rtol=0, atol=1e-6)
    one_device = conv.conv_halos((jnp.asarray(x[..., :5]), jnp.asarray(x[..., 5:])), halo_len)
    assert [h.shape for h in one_device] == [(2, 1, halo_len, 5), (2, 1, halo_len, 3)]
    assert not any(np.any(np.asarray(h)) for h in one_device)


# --------------------------------------------------------------------------- the layer


# channels 16, 32, 32 (q, k, v): whole 8-channel vectors
LAYER = dict(hidden_size=16, head_dim=8, num_heads=2, expand_v=1.0, num_householder=2, conv_bias=True)
TOTAL = 24  # cp 2: 12 tokens a rank, zig-zag chunks of 6
# document 3 crosses the contiguous rank boundary (12) and zig-zag chunk boundaries (6, 12), document 4
# crosses 18; document 2 has one token
LAYER_DOC_IDS = doc_ids_from_runs((1, 4), (2, 1), (3, 10), (4, 9))


def layer_run(module, x, cotangent, cp=None, layout="contiguous"):
    """Output, input gradient (sequence order, float32) and flat parameter gradients of
    sum(out * cotangent) through the layer; ``cp`` None: one device, else shard_map over ``cp`` devices
    with x in the layout's rank order."""
    graphdef, state = nnx.split(module)
    total = x.shape[1]
    order = layout_permutation(total, cp or 1, layout)
    token_layout = build_layout(total_len=total, doc_ids=LAYER_DOC_IDS, cp_size=cp or 1, layout=layout)
    if cp is None:
        apply = lambda state, x: nnx.merge(graphdef, state)(x, layout=token_layout)  # noqa: E731
    else:
        def per_shard(state, x, token_layout):
            return nnx.merge(graphdef, state)(x, layout=token_layout, axis_name="cp")

        sharded = jax.shard_map(per_shard, mesh=mesh_of(cp), in_specs=(P(), P(None, "cp"), P()),
                                out_specs=P(None, "cp"))
        apply = lambda state, x: sharded(state, x, token_layout)  # noqa: E731
    cotangent = jnp.asarray(cotangent[:, order])

    def loss(state, x):
        out = apply(state, x)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    x = jnp.asarray(x)[:, order]
    if cp is not None:
        x = jax.device_put(x, NamedSharding(mesh_of(cp), P(None, "cp")))
    (_, out), (state_grad, x_grad) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(state, x)
    back = inverse_permutation(order)
    as_f32 = lambda a: np.asarray(a.astype(jnp.float32))[:, back]  # noqa: E731
    return {"output": as_f32(out), "input gradient": as_f32(x_grad), "parameter gradients": flat(state_grad)}


def test_gdp_layer_kernel_path_matches_the_jnp_path_on_one_device_and_under_cp(monkeypatch):
    """bf16 activations. On one device the kernel path agrees with the jnp path up to bf16 rounding (the
    jnp path rounds the weights and every tap's product and sum to bf16, the kernels sum in float32 and
    round once; the layer after the conv carries the difference on): two differently rounded bf16
    results. Under CP (contiguous, zig-zag) the kernel path computes the same conv values as on one
    device; only the GDP's float32 CP arithmetic and the bf16 roundings after it differ. A wrong halo
    (zeros under CP) moves everything by 0.25-0.5."""
    module = GatedDeltaProduct(**LAYER, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(4)
    x = rng.normal(size=(1, TOTAL, LAYER["hidden_size"])).astype(jnp.bfloat16)
    cotangent = rng.normal(size=(1, TOTAL, LAYER["hidden_size"])).astype(np.float32)
    launches = lambda: LAUNCH_COUNTS[kcfg.ShortConvConfig("bfloat16", 4)]  # noqa: E731

    before = launches()
    jnp_path = layer_run(module, x, cotangent)
    assert launches() == before  # the jnp path on this CPU by default

    register_emulated_kernels()
    monkeypatch.setattr(conv, "FORCE_SHORT_CONV_KERNEL", True)
    kernels = layer_run(module, x, cotangent)
    cp_runs = {"contiguous": layer_run(module, x, cotangent, cp=2),
               "zigzag": layer_run(module, x, cotangent, cp=2, layout="zigzag")}
    assert launches() == before + 3 * (1 + 2 + 2)  # q, k and v on each device of each run
    for key, want in jnp_path.items():
        assert_close(f"one device, kernels vs jnp path: {key}", want, kernels[key],
                     tolerance(1, dtype="bfloat16", compared_with="rounded"))
    for layout, run in cp_runs.items():
        for key, want in kernels.items():
            assert_close(f"cp 2 {layout} vs one device, kernels: {key}", want, run[key], tolerance(1, dtype="bfloat16"))


# --------------------------------------------------------------------------- lowering for CUDA


def test_kernel_short_conv_lowers_to_the_three_kernels_for_cuda(kernel_path):
    """Forward and backward under jit: one short_conv, one short_conv backward, one column sum; no
    callback; a new packing (positions are data) lowers to the same program."""
    assert not kernel_calls._registers_here()
    x, halo = jnp.zeros((2, 256, 64), jnp.bfloat16), jnp.zeros((2, 2, 3, 64), jnp.bfloat16)
    weight, bias = jnp.zeros((64, 1, 4)), jnp.zeros((64,))

    def loss(x, halo, weight, bias, positions):
        return jnp.sum(conv.kernel_short_conv(x, halo, weight, bias, positions).astype(jnp.float32))

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    texts = [grad.trace(x, halo, weight, bias, jnp.asarray(_positions(lengths))).lower(
        lowering_platforms=("cuda",)).as_text() for lengths in ((100, 156), (1, 255))]
    calls = re.findall(r"stablehlo\.custom_call @([\w.]+)", texts[0])
    expected = {kernel_calls.target_name(config) for config in (
        kcfg.ShortConvConfig("bfloat16", 4), kcfg.ShortConvBackwardConfig("bfloat16", 4), kcfg.ColumnSumConfig())}
    assert len(calls) == 3 and set(calls) == expected, calls
    assert "callback" not in texts[0]
    assert texts[0] == texts[1]
