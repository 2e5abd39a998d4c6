"""JAX chunkwise-CP GDP on CPU host devices (meshes of 1-4): outputs against the float64 numpy
recurrence, all five gradients against float64 ``jax.grad`` of the naive recurrence, one compiled
program for every packing, the per-shard variant inside a caller's shard_map, and bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cp_linear import reference as ref
from jax_api.gdp.chunk import JaxGDPBackend
from jax_api.gdp.cp import gdp_chunkwise_context_parallel, gdp_chunkwise_context_parallel_shard
from tests.cp_linear.gdp_cases import random_gdp_inputs, rel_err, seq_idx_from_lengths
from tests.tolerance import assert_close, gdp_length, tolerance
from tests.jax_api.test_gdp_chunk import float64_reference_grads

TOKENS, HEADS, KEY_DIM, VALUE_DIM = 24, 2, 7, 5  # T = 24 splits over 1, 2, 3 and 4 ranks


def gdp_tolerance(num_householder, tokens=TOKENS):
    """float32 bound of GDP over ``tokens`` tokens (tests/tolerance.py), outputs and gradients alike."""
    return tolerance(gdp_length(tokens, num_householder, KEY_DIM))

# Each packing of T = 24 tokens; rank boundaries sit at multiples of 24 / cp.
PACKINGS = {
    "document-spans-every-rank": [1, 22, 1],
    "documents-end-on-rank-boundaries": [8, 4, 4, 8],  # ends at 8, 12, 16: boundaries for cp = 2, 3, 4
    "one-token-documents": [1, 1, 5, 1, 15, 1],
    "rank-holds-many-documents": [3, 1, 1, 2, 1, 1, 1, 14],
    "one-document": [24],
}


def mesh_of(cp_size, axis_name="cp"):
    return jax.make_mesh((cp_size,), (axis_name,))


def is_split_along_tokens(array, axis_name="cp"):
    """``array`` is laid out as ``P(None, axis_name)`` over its mesh. Compared as shardings, not specs:
    on a 1-device mesh XLA reports the equivalent ``P()`` for an output of an Auto-axes mesh."""
    sharding = array.sharding
    if not isinstance(sharding, NamedSharding):
        return False
    return sharding.is_equivalent_to(NamedSharding(sharding.mesh, P(None, axis_name)), array.ndim)


@functools.lru_cache(maxsize=None)
def cp_value_and_grad(cp_size, num_householder, use_qk_l2norm, packed, chunk_size):
    """jit(value_and_grad) of sum(o * do) through the global CP function; compiled once per config."""
    mesh = mesh_of(cp_size)
    backend = JaxGDPBackend(chunk_size=chunk_size)

    def loss(q, k, v, g, beta, seq_idx, output_grad):
        o = gdp_chunkwise_context_parallel(q, k, v, g, beta, mesh=mesh, global_seq_idx=seq_idx if packed else None,
                                           num_householder=num_householder, use_qk_l2norm_in_kernel=use_qk_l2norm,
                                           backend=backend)
        return jnp.sum(o * output_grad), o

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))


def check_case(rng, cp_size, *, num_householder, use_qk_l2norm_in_kernel=False, lengths=None, batch=1, chunk_size=8):
    """Run one case through the CP function and compare with the float64 references."""
    inputs = random_gdp_inputs(rng, batch=batch, tokens=TOKENS, heads=HEADS, key_dim=KEY_DIM, value_dim=VALUE_DIM,
                               num_householder=num_householder)
    output_grad = rng.normal(size=(batch, TOKENS, HEADS, VALUE_DIM))
    packed = lengths is not None
    seq_idx = jnp.asarray(seq_idx_from_lengths(lengths) if packed else np.zeros((1, TOKENS)), jnp.int32)
    fn = cp_value_and_grad(cp_size, num_householder, use_qk_l2norm_in_kernel, packed, chunk_size)
    (_, output), grads = fn(*(jnp.asarray(x, jnp.float32) for x in inputs), seq_idx,
                            jnp.asarray(output_grad, jnp.float32))
    cu = np.r_[0, np.cumsum(lengths)] if packed else None
    o_ref, _ = ref.naive_gated_delta_product(*inputs, num_householder=num_householder, cu_seqlens=cu,
                                             use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    assert output.dtype == jnp.float32 and is_split_along_tokens(output)
    tol = gdp_tolerance(num_householder)
    assert_close("output", o_ref, output, tol)
    want = float64_reference_grads(inputs, output_grad, num_householder=num_householder,
                                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, lengths=lengths)
    for name, got, expected in zip(("dq", "dk", "dv", "dg", "dbeta"), grads, want):
        assert got.shape == expected.shape, name
        assert_close(name, expected, got, tol)


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_every_packing_matches_float64_references(cp_size):
    rng = np.random.default_rng(cp_size)
    for name, lengths in PACKINGS.items():
        try:
            check_case(rng, cp_size, num_householder=2, lengths=lengths)
        except AssertionError as err:
            raise AssertionError(f"packing {name} {lengths}, cp = {cp_size}: {err}") from err


@pytest.mark.parametrize(
    "cp_size, num_householder, use_qk_l2norm, chunk_size",
    [
        pytest.param(3, 1, True, 64, id="cp3-nh1-l2norm-chunk64"),
        pytest.param(4, 3, True, 8, id="cp4-nh3-l2norm"),
    ],
)
def test_householder_counts_and_qk_l2norm(cp_size, num_householder, use_qk_l2norm, chunk_size):
    rng = np.random.default_rng(num_householder * 10 + cp_size)
    for name in ("document-spans-every-rank", "one-token-documents"):
        check_case(rng, cp_size, num_householder=num_householder, use_qk_l2norm_in_kernel=use_qk_l2norm,
                   lengths=PACKINGS[name], chunk_size=chunk_size)


def test_batch_rows_are_each_one_sequence_across_all_ranks():
    check_case(np.random.default_rng(40), 3, num_householder=2, batch=3)


@pytest.mark.timeout(180)
def test_long_shards_on_four_host_devices_run_to_completion():
    """Regression: with LAPACK's triangular solve the UT transform deadlocked four host devices
    once the chunk batch grew (T = 256); the blocked inverse has no hidden thread-pool waits."""
    rng = np.random.default_rng(8)
    tokens, lengths = 256, [100, 1, 155]
    inputs = random_gdp_inputs(rng, tokens=tokens, heads=HEADS, key_dim=KEY_DIM, value_dim=VALUE_DIM,
                               num_householder=2)
    output_grad = rng.normal(size=(1, tokens, HEADS, VALUE_DIM))
    mesh = mesh_of(4)

    @jax.jit
    def loss(q, k, v, g, beta, seq_idx, do):
        o = gdp_chunkwise_context_parallel(q, k, v, g, beta, mesh=mesh, global_seq_idx=seq_idx, num_householder=2)
        return jnp.sum(o * do), o

    (_, output), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(
        *(jnp.asarray(x, jnp.float32) for x in inputs), jnp.asarray(seq_idx_from_lengths(lengths), jnp.int32),
        jnp.asarray(output_grad, jnp.float32))
    o_ref, _ = ref.naive_gated_delta_product(*inputs, num_householder=2, cu_seqlens=np.r_[0, np.cumsum(lengths)])
    tol = gdp_tolerance(2, tokens)
    assert_close("output", o_ref, output, tol)
    want = float64_reference_grads(inputs, output_grad, num_householder=2, lengths=lengths)
    for name, got, expected in zip(("dq", "dk", "dv", "dg", "dbeta"), grads, want):
        assert_close(name, expected, got, tol)


def test_a_new_packing_reuses_the_compiled_program():
    rng = np.random.default_rng(0)
    inputs = [jnp.asarray(x, jnp.float32) for x in random_gdp_inputs(
        rng, tokens=TOKENS, heads=HEADS, key_dim=KEY_DIM, value_dim=VALUE_DIM)]
    mesh = mesh_of(2)
    forward = jax.jit(lambda seq_idx: gdp_chunkwise_context_parallel(*inputs, mesh=mesh, global_seq_idx=seq_idx))
    outputs = []
    for lengths in ([5, 19], [12, 1, 11]):
        outputs.append(forward(jnp.asarray(seq_idx_from_lengths(lengths), jnp.int32)))
        o_ref, _ = ref.naive_gated_delta_product(*inputs, cu_seqlens=np.r_[0, np.cumsum(lengths)])
        assert_close(f"output {lengths}", o_ref, outputs[-1], gdp_tolerance(1))
    assert forward._cache_size() == 1
    assert rel_err(outputs[0], outputs[1]) > 100 * gdp_tolerance(1)  # the packing changed the result


def test_no_gate_equals_a_zero_gate_under_cp():
    rng = np.random.default_rng(9)
    q, k, v, g, beta = (jnp.asarray(x, jnp.float32) for x in random_gdp_inputs(
        rng, tokens=TOKENS, heads=HEADS, key_dim=KEY_DIM, value_dim=VALUE_DIM))
    seq_idx = jnp.asarray(seq_idx_from_lengths([7, 17]), jnp.int32)
    mesh = mesh_of(2)
    without = gdp_chunkwise_context_parallel(q, k, v, None, beta, mesh=mesh, global_seq_idx=seq_idx)
    zero = gdp_chunkwise_context_parallel(q, k, v, jnp.zeros_like(g), beta, mesh=mesh, global_seq_idx=seq_idx)
    np.testing.assert_array_equal(np.asarray(without), np.asarray(zero))


def test_shard_variant_runs_inside_a_callers_two_axis_shard_map():
    """Batch rows over 'data', tokens over 'cp' in the caller's own shard_map."""
    rng = np.random.default_rng(5)
    inputs = random_gdp_inputs(rng, batch=2, tokens=TOKENS, heads=HEADS, key_dim=KEY_DIM, value_dim=VALUE_DIM,
                               num_householder=2)
    output_grad = rng.normal(size=(2, TOKENS, HEADS, VALUE_DIM))
    mesh = jax.make_mesh((2, 2), ("data", "cp"))
    spec = P("data", "cp")

    def per_shard(q, k, v, g, beta):
        return gdp_chunkwise_context_parallel_shard(q, k, v, g, beta, axis_name="cp", num_householder=2,
                                                    backend=JaxGDPBackend(chunk_size=8))

    layer = jax.shard_map(per_shard, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec)

    @jax.jit
    def loss(q, k, v, g, beta, do):
        o = layer(q, k, v, g, beta)
        return jnp.sum(o * do), o

    arrays = [jax.device_put(jnp.asarray(x, jnp.float32), NamedSharding(mesh, spec)) for x in (*inputs, output_grad)]
    (_, output), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(*arrays)
    o_ref, _ = ref.naive_gated_delta_product(*inputs, num_householder=2)
    tol = gdp_tolerance(2)
    assert_close("output", o_ref, output, tol)
    want = float64_reference_grads(inputs, output_grad, num_householder=2)
    for name, got, expected in zip(("dq", "dk", "dv", "dg", "dbeta"), grads, want):
        assert_close(name, expected, got, tol)


def test_auto_axis_mesh_with_unsharded_numpy_inputs():
    rng = np.random.default_rng(6)
    inputs = random_gdp_inputs(rng, tokens=TOKENS, heads=HEADS, key_dim=KEY_DIM, value_dim=VALUE_DIM)
    mesh = Mesh(np.array(jax.devices()[:3]), ("sp",))  # Auto axis types, a different axis name
    lengths = [7, 17]
    layer = jax.jit(functools.partial(gdp_chunkwise_context_parallel, mesh=mesh, axis_name="sp"))
    output = layer(*(x.astype(np.float32) for x in inputs), global_seq_idx=seq_idx_from_lengths(lengths))
    o_ref, _ = ref.naive_gated_delta_product(*inputs, cu_seqlens=np.r_[0, np.cumsum(lengths)])
    assert is_split_along_tokens(output, "sp")
    assert_close("output", o_ref, output, gdp_tolerance(1))


# --------------------------------------------------------------------------- bad input


def bad_call(case):
    rng = np.random.default_rng(0)
    q, k, v, g, beta = (jnp.asarray(x, jnp.float32) for x in random_gdp_inputs(
        rng, tokens=TOKENS, heads=HEADS, key_dim=KEY_DIM, value_dim=VALUE_DIM, num_householder=2))
    kwargs = dict(mesh=mesh_of(4), num_householder=2, global_seq_idx=seq_idx_from_lengths([10, 14]))
    if case == "k-length":
        k = k[:, :-1]
    elif case == "g-heads":
        g = g[:, :, :1]
    elif case == "v-heads":
        v = v[:, :, :1]
    elif case == "q-rank":
        q = q[0]
    elif case == "k-dtype":
        k = k.astype(jnp.bfloat16)
    elif case == "integer-beta":
        beta = beta.astype(jnp.int32)
    elif case == "tokens-not-divisible":
        kwargs["mesh"] = mesh_of(5)
        kwargs["global_seq_idx"] = None
    elif case == "unknown-axis":
        kwargs["axis_name"] = "sp"
    elif case == "decreasing-ids":
        kwargs["global_seq_idx"] = np.array([[0] * 10 + [2] * 7 + [1] * 7])
    elif case == "ids-shape":
        kwargs["global_seq_idx"] = np.zeros((TOKENS,), np.int32)
    elif case == "ids-float":
        kwargs["global_seq_idx"] = np.zeros((1, TOKENS), np.float32)
    elif case == "ids-with-batch-rows":
        q, k, v, g, beta = (jnp.concatenate([x, x]) for x in (q, k, v, g, beta))
    return gdp_chunkwise_context_parallel(q, k, v, g, beta, **kwargs)


@pytest.mark.parametrize(
    "case, message",
    [
        pytest.param("k-length", r"k must have shape \(1, 48, 2, 7\).*received \(1, 47, 2, 7\)", id="k-length"),
        pytest.param("g-heads", r"g must have shape \(1, 24, 2\).*received \(1, 24, 1\)", id="g-heads"),
        pytest.param("v-heads", r"v must have shape \(1, 48, 2, V\); received \(1, 48, 1, 5\)", id="v-heads"),
        pytest.param("q-rank", r"q must be \[B, T, H, K\]; received shape \(24, 2, 7\)", id="q-rank"),
        pytest.param("k-dtype", "q, k and v must share one dtype; received q float32, k bfloat16", id="k-dtype"),
        pytest.param("integer-beta", "beta must have a floating dtype; received int32", id="integer-beta"),
        pytest.param("tokens-not-divisible", "T = 24 must be divisible by the size of mesh axis 'cp' \\(5\\)",
                     id="tokens-not-divisible-by-axis"),
        pytest.param("unknown-axis", r"mesh has no axis 'sp'; its axes are \('cp',\)", id="unknown-axis"),
        pytest.param("decreasing-ids", "nondecreasing; it drops from 2 to 1 at index 17", id="decreasing-ids"),
        pytest.param("ids-shape", r"global_seq_idx must have shape \[1, T\] = \(1, 24\); received \(24,\)",
                     id="ids-shape"),
        pytest.param("ids-float", "global_seq_idx must hold integers; received dtype float32", id="ids-float"),
        pytest.param("ids-with-batch-rows", "B must be 1; received B = 2", id="ids-with-batch-rows"),
    ],
)
def test_bad_input_raises_a_clear_value_error_at_trace_time(case, message):
    with pytest.raises(ValueError, match=message):
        bad_call(case)
    with pytest.raises(ValueError, match=message):  # and the same under jit, before anything runs
        jax.jit(lambda: bad_call(case))()


def test_shard_variant_names_an_unbound_axis():
    inputs = [jnp.zeros((1, 4, 1, 3)), jnp.zeros((1, 4, 1, 3)), jnp.zeros((1, 4, 1, 2)), jnp.zeros((1, 4, 1)),
              jnp.zeros((1, 4, 1))]
    with pytest.raises(ValueError, match="axis_name 'cp' is not bound here"):
        gdp_chunkwise_context_parallel_shard(*inputs)  # outside any shard_map
    mesh = mesh_of(2, "sp")
    layer = jax.shard_map(lambda *x: gdp_chunkwise_context_parallel_shard(*x, axis_name="cp"), mesh=mesh,
                          in_specs=(P(None, "sp"),) * 5, out_specs=P(None, "sp"))
    sharded = [jax.device_put(x, NamedSharding(mesh, P(None, "sp"))) for x in inputs]
    with pytest.raises(ValueError, match="axis_name 'cp' is not bound here"):
        jax.jit(layer)(*sharded)
