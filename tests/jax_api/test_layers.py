"""JAX layers: parameter table, CP inside jax.shard_map == one device, conv halo, Linen bridge.

CP runs on host CPU devices (tests/conftest.py asks XLA for 8; a mesh takes the first 2 or 4).
Each check compares the module run per shard inside ``jax.shard_map`` with the same module on the
whole sequence: outputs, input gradients and parameter gradients. Their agreement with float64
references goes through tests/parity (JAX == torch) and tests/torch_api/test_layers.py.
"""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from flax.nnx import bridge  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_api.layers import (  # noqa: E402
    BlockDiagAttention,
    DecoderConfig,
    GatedDeltaProduct,
    HybridDecoder,
    build_layout,
    cp_apply,
    flatten_jax_state,
    load_torch_state_dict,
)
from jax_api.layers.conv import conv_window, masked_causal_conv  # noqa: E402
from tests.tolerance import (  # noqa: E402
    assert_close,
    decoder_length,
    layer_length,
    token_cancellation,
    tolerance,
)
from torch_api.layers import PackedLayout, parameter_shapes  # noqa: E402

GDP = dict(hidden_size=20, head_dim=6, num_heads=2, expand_v=1.5, num_householder=2)
GDP_GVA = dict(hidden_size=20, head_dim=6, num_heads=1, num_v_heads=2, expand_v=1.0, num_householder=3,
               conv_bias=True, conv_size=3)
ATTENTION = dict(hidden_size=20, num_heads=4, num_kv_heads=2, head_dim=6)


def doc_ids_from_runs(*runs):
    return np.concatenate([np.full(n, d, np.int64) for d, n in runs])


# cp 2, L = 12: document 2 starts exactly at rank 1's first token, padding before it
STARTS_AT_BOUNDARY = doc_ids_from_runs((1, 9), (0, 3), (2, 12))
# cp 4, L = 10: document 3 starts at a boundary, document 4 crosses two boundaries (attention: a2a)
CROSSES_BOUNDARIES = doc_ids_from_runs((1, 4), (0, 2), (2, 4), (3, 7), (4, 19), (0, 4))


def mesh_of(cp):
    return jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])


def sharded_loss(module, layout, mesh, cotangent):
    graphdef, _ = nnx.split(module)
    spec = P(None, "cp")

    def per_shard(state, x, layout):
        return nnx.merge(graphdef, state)(x, layout=layout, axis_name="cp")

    run = jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), spec, P()), out_specs=spec)

    def loss(state, x):
        out = run(state, x, layout)
        return jnp.sum(out * cotangent), out

    return loss


def single_loss(module, layout):
    """``loss(state, x, cotangent)`` = sum(out * cotangent) on one device (the cotangent an argument,
    so one compiled program also gives the per-token gradients of kappa)."""
    graphdef, _ = nnx.split(module)

    def loss(state, x, cotangent):
        out = nnx.merge(graphdef, state)(x, layout=layout)
        return jnp.sum(out * cotangent), out

    return loss


def flat(tree):
    return np.concatenate([np.ravel(a) for a in jax.tree.leaves(tree)])


def gradient_cancellation(one, state, x, cotangent):
    """kappa of the input and parameter gradients of sum(out * cotangent) as sums over tokens;
    ``one`` is the jitted value_and_grad of ``single_loss`` (tests/tolerance.py)."""

    def grads(cot):
        _, (state_grad, x_grad) = one(state, x, jnp.asarray(cot))
        return {"x": np.asarray(x_grad), "params": flat(state_grad)}

    return token_cancellation(grads, np.asarray(cotangent))


def assert_cp_matches(module, doc_ids, cp, batch=1, seed=0, attention_mode="auto"):
    """CP against one device: output, input gradient and parameter gradients (both float32)."""
    total = doc_ids.shape[0] if doc_ids is not None else 24
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(batch, total, 20)), jnp.float32)
    cotangent = jnp.asarray(rng.normal(size=(batch, total, 20)), jnp.float32)
    mesh = mesh_of(cp)
    state = nnx.state(module)
    one = jax.jit(jax.value_and_grad(single_loss(module, build_layout(total_len=total, doc_ids=doc_ids)),
                                     argnums=(0, 1), has_aux=True))
    layout = build_layout(total_len=total, doc_ids=doc_ids, cp_size=cp, attention_mode=attention_mode)
    many = jax.jit(jax.value_and_grad(sharded_loss(module, layout, mesh, cotangent), argnums=(0, 1), has_aux=True))
    (_, out_ref), (state_grad_ref, x_grad_ref) = one(state, x, cotangent)
    (_, out), (state_grad, x_grad) = many(state, jax.device_put(x, NamedSharding(mesh, P(None, "cp"))))
    length = layer_length(module.config, total, batch)
    kappa = gradient_cancellation(one, state, x, cotangent)
    assert_close("output", out_ref, out, tolerance(length, compared_with="rounded"))
    assert_close("input gradient", x_grad_ref, x_grad,
                 tolerance(length, cancellation=kappa["x"], compared_with="rounded"))
    assert_close("parameter gradients", flat(state_grad_ref), flat(state_grad),
                 tolerance(length, cancellation=kappa["params"], compared_with="rounded"))


def jittered(module):
    """Move the norm weights and biases off their defaults so that they matter."""
    rng = np.random.default_rng(1)
    state = nnx.state(module, nnx.Param)
    for path, variable in nnx.to_flat_state(state):
        name = ".".join(map(str, path))
        if name.endswith("norm.weight") or name.endswith("bias"):
            variable[...] = variable[...] + 0.3 * jnp.asarray(rng.normal(size=variable.shape), jnp.float32)
    nnx.update(module, state)
    return module


@pytest.mark.parametrize("kwargs, cp, doc_ids, batch", [
    pytest.param(GDP, 2, STARTS_AT_BOUNDARY, 1, id="cp2-starts-at-boundary"),
    pytest.param(GDP_GVA, 4, CROSSES_BOUNDARIES, 1, id="cp4-GVA-conv-bias-crosses-boundaries"),
    pytest.param(GDP, 2, None, 2, id="cp2-rows-B2"),
])
def test_gdp_layer_under_cp_equals_one_device(kwargs, cp, doc_ids, batch):
    module = jittered(GatedDeltaProduct(**kwargs, rngs=nnx.Rngs(0)))
    assert_cp_matches(module, doc_ids, cp, batch=batch)


@pytest.mark.parametrize("cp, doc_ids, mode", [
    pytest.param(2, STARTS_AT_BOUNDARY, "auto", id="cp2-auto"),
    pytest.param(4, CROSSES_BOUNDARIES, "auto", id="cp4-auto-a2a"),
    pytest.param(4, CROSSES_BOUNDARIES, "allgather", id="cp4-allgather"),
])
def test_attention_layer_under_cp_equals_one_device(cp, doc_ids, mode):
    module = BlockDiagAttention(**ATTENTION, mode=mode, rngs=nnx.Rngs(0))  # the layout's plan carries the mode
    assert_cp_matches(module, doc_ids, cp, attention_mode=mode)


def logits_count(config, tokens):
    """The loss is a mean over every logit: one more sum of that length."""
    return config.vocab_size * tokens


def test_decoder_under_cp_equals_one_device():
    config = DecoderConfig(vocab_size=13, hidden_size=20, num_layers=2, num_heads=2, head_dim=6, num_kv_heads=1)
    model = HybridDecoder(config, rngs=nnx.Rngs(0))
    doc_ids = CROSSES_BOUNDARIES
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 13, size=(1, doc_ids.shape[0])))
    mesh = mesh_of(4)
    layout = build_layout(total_len=doc_ids.shape[0], doc_ids=doc_ids, cp_size=4)

    # sum(logits * cot) with cot = d mean(logits^2) / d logits has the gradients of mean(logits^2) at these
    # weights, and the cotangent as an argument lets one compiled program give kappa's per-token gradients
    def cp_loss(model, cot):
        return jnp.sum(cp_apply(model, tokens, layout, mesh=mesh) * cot)

    def one_loss(model, cot):
        logits = model(tokens, doc_ids=doc_ids)
        return jnp.sum(logits * cot), logits

    pure = lambda g: flat(nnx.to_pure_dict(g))  # noqa: E731
    one = nnx.jit(nnx.value_and_grad(one_loss, has_aux=True))
    (_, logits), _ = one(model, jnp.zeros((1, doc_ids.shape[0], 13), jnp.float32))
    cotangent = np.asarray(2 * logits / logits.size)
    # kappa first, on one device, before CP runs on the (explicit-axis) mesh
    kappa = token_cancellation(lambda cot: {"params": pure(one(model, jnp.asarray(cot))[1])}, cotangent)["params"]
    (value_ref, _), grads_ref = one(model, cotangent)
    value, grads = nnx.jit(nnx.value_and_grad(cp_loss))(model, cotangent)
    length = decoder_length(config, doc_ids.shape[0]) + logits_count(config, doc_ids.shape[0])
    assert_close("loss", float(value_ref), float(value), tolerance(length, compared_with="rounded"))
    assert_close("parameter gradients", pure(grads_ref), pure(grads),
                 tolerance(length, cancellation=kappa, compared_with="rounded"))


def test_module_parameters_match_the_shared_table():
    config = DecoderConfig(vocab_size=11, hidden_size=20, num_layers=3, head_dim=6)
    model = HybridDecoder(config, rngs=nnx.Rngs(0))
    assert {name: a.shape for name, a in flatten_jax_state(model).items()} == parameter_shapes(config)
    gva = GatedDeltaProduct(**GDP_GVA, rngs=nnx.Rngs(0))
    assert {name: a.shape for name, a in flatten_jax_state(gva).items()} == parameter_shapes(gva.config)


# --------------------------------------------------------------------------- conv halo


def reference_document_conv(x, weight, doc_ids):
    """numpy float64: causal depthwise conv restarted at every run of equal ids. x [1, T, C]."""
    width = weight.shape[-1]
    out = np.zeros_like(x)
    position = PackedLayout.from_doc_ids(doc_ids).position
    for t in range(x.shape[1]):
        for s in range(min(width, position[t] + 1)):
            out[:, t] += x[:, t - s] * weight[:, 0, width - 1 - s]
    return out


@pytest.mark.parametrize("doc_ids, reach", [
    pytest.param(doc_ids_from_runs((1, 12), (2, 12)), [False] * 12, id="document-starts-at-rank-boundary"),
    pytest.param(doc_ids_from_runs((1, 5), (2, 10), (3, 9)), [True] * 3 + [False] * 9, id="document-continues"),
])
def test_conv_halo_reaches_back_only_within_the_document(doc_ids, reach):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(1, 24, 5))
    weight = rng.normal(size=(5, 1, 4))
    layout = build_layout(total_len=24, doc_ids=doc_ids, cp_size=2)
    mesh = mesh_of(2)

    def per_shard(x, position):
        local = layout.local(position, "cp")
        return masked_causal_conv(conv_window(x, 3, "cp"), weight.astype(np.float32), None, local)

    sharded = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(P(None, "cp"), P()), out_specs=P(None, "cp")))

    def run(x, position):
        return sharded(jax.device_put(jnp.asarray(x, jnp.float32), NamedSharding(mesh, P(None, "cp"))), position)

    out = np.asarray(run(x, layout.position))
    assert_close("conv", reference_document_conv(x, weight, doc_ids), out, tolerance(weight.shape[-1]))
    changed = x.copy()
    changed[:, :12] += 1.0  # rank 0's tokens
    moved = np.abs(np.asarray(run(changed, layout.position)) - out)[0, 12:].max(-1) > 0
    assert moved.tolist() == reach


# --------------------------------------------------------------------------- Linen, bad input


def test_modules_run_from_linen_through_the_nnx_bridge():
    linen_attention = bridge.ToLinen(BlockDiagAttention, kwargs=ATTENTION)
    linen_gdp = bridge.ToLinen(GatedDeltaProduct, kwargs=GDP)
    x = jnp.asarray(np.random.default_rng(7).normal(size=(1, 17, 20)), jnp.float32)
    doc_ids = doc_ids_from_runs((1, 6), (0, 2), (2, 9))
    cases = ((linen_attention, BlockDiagAttention, ATTENTION, {"doc_ids": doc_ids}),
             (linen_gdp, GatedDeltaProduct, GDP, {"cu_seqlens": np.array([0, 6, 17])}))
    for linen_module, nnx_cls, kwargs, ids in cases:
        variables = jax.jit(lambda key, x: linen_module.init(key, x, **ids))(jax.random.key(0), x)  # noqa: B023
        out = jax.jit(lambda variables, x: linen_module.apply(variables, x, **ids))(variables, x)  # noqa: B023
        twin = load_torch_state_dict(nnx_cls(**kwargs, rngs=nnx.Rngs(9)), flatten_jax_state(variables))
        # the same weights and the same program: equal up to how XLA fuses the two compilations
        assert_close(nnx_cls.__name__, out, nnx.jit(lambda module, x: module(x, **ids))(twin, x),  # noqa: B023
                     tolerance(layer_length(twin.config, x.shape[1]), compared_with="rounded"))


@pytest.mark.parametrize("call, match", [
    pytest.param(lambda m, x: m(x, layout=build_layout(total_len=24, cp_size=2)), "cp_size = 2", id="layout-for-cp2"),
    pytest.param(lambda m, x: m(x, axis_name="cp"), "not bound", id="axis-outside-shard_map"),
    pytest.param(lambda m, x: m(x[:, :, :5]), "D = 20", id="wrong-width"),
    pytest.param(lambda m, x: m(x, layout=build_layout(total_len=12)), "L = 12", id="layout-for-another-T"),
    pytest.param(lambda m, x: m(x, cu_seqlens=np.array([0, 30])), "T = 30", id="ids-for-another-T"),
])
def test_gdp_layer_rejects_bad_input(call, match):
    module = GatedDeltaProduct(**GDP, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=match):
        call(module, jnp.zeros((1, 24, 20)))
